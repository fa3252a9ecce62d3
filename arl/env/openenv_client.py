"""The client side of ``env.name: openenv`` (arl/env/openenv_env.py): OpenEnv's reply format and
its server processes, one per arl process and app: uvicorn from OpenEnv's own venv on a free local
port, waited for on ``/health``, replaced when it dies, stopped when arl exits (and exiting by itself
when arl dies without a word: arl holds its stdin).  Their stderr is kept for the one-line errors."""
from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any, Dict, Optional

from .server_proc import ServerProcess, venv_python

INSTALL_HINT = "bash install.sh --openenv"
_SERVERS: Dict[tuple, "_Server"] = {}
_LOCK = threading.Lock()
# uvicorn's own command line, plus a watchdog: the server exits when arl (holding its stdin) is gone
_BOOT = ("import os, sys, threading, uvicorn; "
         "threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start(); uvicorn.main()")


class _Server(ServerProcess):
    """One OpenEnv server process on a free local port; its stderr kept for the one-line errors."""

    def __init__(self, python: str, app: str, cwd: Optional[str], start_timeout_s: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.err = f"http://127.0.0.1:{port}", tempfile.TemporaryFile()
        self.proc = subprocess.Popen([python, "-c", _BOOT, app, "--host", "127.0.0.1", "--port", str(port),
                                      "--log-level", "warning"], cwd=cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=self.err,
                                     env=dict(os.environ, ENABLE_WEB_INTERFACE="false"))  # no Gradio UI
        httpx, deadline = client_libs()[0], time.monotonic() + start_timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
               else f"no /health within {start_timeout_s:g}s")
        self.stop()
        raise ValueError(f"env.kwargs.server: OpenEnv server {app!r} failed to start ({why}; stderr: {self.tail()})")


atexit.register(lambda: [s.stop() for s in list(_SERVERS.values())])


def shared_server(key: tuple) -> _Server:
    """The running server of ``key`` (python, app, cwd, start_timeout_s), started (again) if need be."""
    with _LOCK:  # the first env that finds it missing or dead starts it; the others wait and share it
        srv = _SERVERS.get(key)
        if srv is None or srv.dead:
            srv = _SERVERS[key] = _Server(*key)
        return srv


def running(key: Optional[tuple]) -> Optional[_Server]:
    """The server last started for ``key`` (dead or alive), None for a ``base_url`` env."""
    return _SERVERS.get(key) if key is not None else None


def client_libs():
    """arl's side of the wire (the ``openenv`` extra): httpx and websockets' asyncio client."""
    try:
        import httpx
        from websockets.asyncio.client import connect
    except ImportError as e:
        raise ValueError(f"env.name: openenv needs httpx and websockets>=13 in arl's environment ({e}): "
                         f"pip install 'arl[openenv]' or {INSTALL_HINT}") from None
    return httpx, connect


def openenv_python(python: Optional[str] = None) -> str:
    """The OpenEnv venv's interpreter: ``python``, else ARL_OPENENV_VENV's, else the checkout's .venv-openenv."""
    return venv_python(python, "ARL_OPENENV_VENV", ".venv-openenv",
                       "env.name: openenv runs OpenEnv servers from their own venv, which is missing ({py}): "
                       + INSTALL_HINT)


def reply_data(raw: Any) -> dict:
    """The ``data`` of an ``observation`` reply (``{"observation": {...}, "reward", "done"}``); an error
    reply or anything else raises, in one line."""
    reply = json.loads(raw)
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, dict) or reply.get("type") == "error":
        raise RuntimeError(f"{(data or {}).get('code', 'bad reply')}: {(data or {}).get('message', str(reply)[:200])}")
    if not isinstance(data.get("observation"), dict):
        raise ValueError(f"reply without an observation object: {str(reply)[:200]}")
    return data


def text_field(schema: dict, given: Optional[str], where: str) -> Optional[str]:
    """The field of a model's JSON ``schema`` that carries text: ``given`` (checked), else its only string field."""
    props = {k: v for k, v in schema.get("properties", {}).items() if k not in ("metadata", "done", "reward")}
    texts = [k for k, v in props.items() if v.get("type") == "string"]
    if given is not None and given not in props:
        raise ValueError(f"env.kwargs.{where}: {schema.get('title')!r} has no field {given!r} "
                         f"(fields: {sorted(props)})")
    return given if given is not None else (texts[0] if len(texts) == 1 else None)


def observation_text(obs: dict, field: Optional[str]) -> str:
    """What the model reads of an observation: its text field, else its fields as JSON."""
    if field is not None:
        return str(obs.get(field, ""))
    return json.dumps({k: v for k, v in obs.items() if k != "metadata"})

"""The client side of ``env.name: verifiers`` (arl/env/verifiers_env.py): the verifiers server process
(arl/env/verifiers_server.py run by the verifiers venv's python), one per arl process and taskset,
speaking JSON lines over its stdin/stdout; many episodes share it (each has its own key).  A reader
thread hands each reply to the request that waits for it (a ``concurrent.futures.Future``, so any event
loop can await it).  It is replaced when it dies and exits by itself when arl does (its stdin closes);
its stderr is kept for the one-line errors."""
from __future__ import annotations

import atexit
import itertools
import json
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Dict, Optional

from .server_proc import ServerProcess, venv_python

INSTALL_HINT = "bash install.sh --verifiers"
SERVER = str(Path(__file__).with_name("verifiers_server.py"))
_SERVERS: Dict[tuple, "Server"] = {}
_LOCK = threading.Lock()


class Server(ServerProcess):
    """One verifiers server process; ``request`` sends a line and returns the Future of its reply."""

    def __init__(self, python: str, spec: str, start_timeout_s: float):
        self.err, self._ids, self._wait, self._lock = tempfile.TemporaryFile(), itertools.count(1), {}, threading.Lock()
        self.proc = subprocess.Popen([python, SERVER, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, bufsize=1)
        first: Future = Future()
        threading.Thread(target=lambda: first.set_result(self.proc.stdout.readline()), daemon=True).start()
        what = json.loads(spec)["taskset"]
        try:
            line = first.result(timeout=start_timeout_s)
        except TimeoutError:
            line = None
        try:
            ready = json.loads(line) if line else {}
        except ValueError:
            ready = {"error": f"not a verifiers server reply: {line.strip()[:200]!r}"}
        if "ready" not in ready:
            why = (ready.get("error") if ready.get("error") else
                   f"no reply within {start_timeout_s:g}s" if line is None else
                   f"exited with code {self.proc.wait(5)}; stderr: {self.tail()}")
            self.stop()
            raise ValueError(f"env.kwargs.taskset: verifiers taskset {what!r} failed to load ({why})")
        self.info = ready["ready"]
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            fut = self._wait.pop(msg.pop("id", None), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        self.proc.wait()
        for fut in list(self._wait.values()):  # the server is gone: every pending request fails
            if not fut.done():
                fut.set_exception(ConnectionError(f"verifiers server died (stderr: {self.tail()})"))

    def request(self, **msg) -> Future:
        fut: Future = Future()
        with self._lock:
            if msg.get("op") != "drop":
                msg["id"] = next(self._ids)
                self._wait[msg["id"]] = fut
            try:
                self.proc.stdin.write(json.dumps(msg) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._wait.pop(msg.get("id"), None)
                fut.set_exception(ConnectionError(f"verifiers server died (stderr: {self.tail()})"))
        if msg.get("op") == "drop" and not fut.done():
            fut.set_result({})
        return fut


atexit.register(lambda: [s.stop() for s in list(_SERVERS.values())])


def shared_server(key: tuple) -> Server:
    """The running server of ``key`` (python, spec JSON, start_timeout_s), started (again) if need be."""
    with _LOCK:
        srv = _SERVERS.get(key)
        if srv is None or srv.dead:
            srv = _SERVERS[key] = Server(*key)
        return srv


def verifiers_python(python: Optional[str] = None) -> str:
    """The verifiers venv's interpreter: ``python``, else ARL_VERIFIERS_VENV's, else the checkout's .venv-verifiers."""
    return venv_python(python, "ARL_VERIFIERS_VENV", ".venv-verifiers",
                       "env.name: verifiers runs verifiers environments from their own venv, which is missing ({py}): "
                       + INSTALL_HINT)

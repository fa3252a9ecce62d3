"""``openenv``: an OpenEnv environment (a FastAPI server) behind arl's door, over its wire protocol.

    env:
      name: openenv
      kwargs:
        server: "guess_env.server.app:app"      # its ASGI app, started by arl (or base_url: of a running one)
        system_prompt: "You play a guessing game."

OpenEnv does not install beside arl's pins (docs/envs.md): its server runs from a venv of its own
(``bash install.sh --openenv``; arl/env/openenv_client.py starts it, one per process and app) and arl
speaks its wire protocol with its own httpx/websockets: ``GET /schema`` (action/observation JSON
schemas), then a WebSocket session (``/ws``) per env instance, kept across episodes: ``{"type":
"reset", "data": {"seed": s}}`` / ``{"type": "step", "data": ACTION}`` answered ``{"type":
"observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or ``{"type": "error"}``
(its HTTP ``/reset``/``/step`` make a fresh env per request: no episode).  The app's
``max_concurrent_envs`` must cover ``env.pool_size`` (one session per live env).

Mapping: a model turn (to the end of sequence) is the text of the action's string field
(``action_field``: the only one unless named; other required fields from ``action_defaults``); the
observation's string field (``observation_field``, likewise; else its fields as JSON) is the
``user``'s next message, the first one the task (after ``system_prompt``).  Rewards come per step;
arl trains on the episode's return (the sum) at ``done`` (past ``env.max_turns``: reward 0).  Numeric
observation metadata are ``env/<name>`` counts.

Faults, one line each: no OpenEnv venv (naming the install flag), a server that fails to start (its
stderr's last line) or an action without a text field fail the constructor (so ``--dry-run``); a
server that dies, times out or answers bad JSON, an error or a non-finite reward mid-episode makes
the episode a recoverable fault (retried, then filtered; the next ``reset`` restarts a dead server);
a failed ``reset`` (e.g. a full server) is an unrecoverable fault of that episode.  Not carried:
structured actions (several model-written fields; MCP ``call_tool`` actions: serve those tools as
``env.name: mcp``), non-text observations (shown as JSON), ``env.dataset`` rows (the env draws its
task from the seed; fixed ``reset_kwargs`` go to every reset), OpenEnv's Gradio UI, ``/mcp`` and
production-mode routes, Docker/Space images (start one yourself and give ``base_url``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any, Dict, Optional

from .base import Environment, Fault, StepResult
from .openenv_client import (client_libs, observation_text, openenv_python, reply_data, running, shared_server,
                             text_field)
from .registry import register_env


@register_env("openenv")
class OpenEnvEnv(Environment):
    observation_role = "user"  # a game or simulator answers as the user
    stop = ()  # a turn (the action) ends at the end of sequence

    def __init__(self, server: Optional[str] = None, base_url: Optional[str] = None, python: Optional[str] = None,
                 cwd: Optional[str] = None, system_prompt: str = "", action_field: Optional[str] = None,
                 action_defaults: Optional[Dict[str, Any]] = None, observation_field: Optional[str] = None,
                 reset_kwargs: Optional[Dict[str, Any]] = None, timeout_s: float = 30.0,
                 start_timeout_s: float = 60.0, max_turns: int = 8):
        if (server is None) == (base_url is None):
            raise ValueError("env.kwargs: give server (an OpenEnv ASGI app, 'pkg.server.app:app', which arl starts) "
                             "or base_url (a running OpenEnv server), one of them")
        httpx, self._connect = client_libs()
        self.what, self._key = str(server or base_url), None
        if server is not None:
            self._key = (openenv_python(python), str(server), cwd, float(start_timeout_s))
        url = shared_server(self._key).url if self._key else str(base_url).rstrip("/")
        try:
            schema = httpx.get(url + "/schema", timeout=timeout_s, trust_env=False).raise_for_status().json()
        except Exception as e:
            raise ValueError(f"env.kwargs: no OpenEnv /schema at {url} ({type(e).__name__}: {e})") from None
        act, self.defaults = schema.get("action", {}), dict(action_defaults or {})
        self.action_field = text_field(act, action_field, "action_field")
        missing = [k for k in act.get("required", []) if k not in (self.action_field, *self.defaults)]
        if self.action_field is None or missing:
            raise ValueError(f"env.kwargs.action_field: OpenEnv action {act.get('title')!r} needs "
                             f"{missing or 'one text field'}; arl fills one text field (action_field) with the turn, "
                             "the rest from action_defaults")
        self.observation_field = text_field(schema.get("observation", {}), observation_field, "observation_field")
        self.system_prompt, self.max_turns, self.timeout_s = system_prompt or "", int(max_turns), float(timeout_s)
        self.reset_kwargs, self._url = dict(reset_kwargs or {}), url
        self._ws, self._loop, self._active = None, None, False

    async def _send(self, msg: dict) -> dict:
        loop = asyncio.get_running_loop()
        if self._ws is None or self._loop is not loop:  # a session per instance (and per event loop)
            self._ws, self._loop = await self._connect("ws" + self._url[4:] + "/ws", open_timeout=self.timeout_s,
                                                 max_size=None, proxy=None), loop
        try:
            await self._ws.send(json.dumps(msg))
            return reply_data(await asyncio.wait_for(self._ws.recv(), self.timeout_s))
        except BaseException:  # broken, or cancelled (a step timeout) with a reply still due: a new session next time
            self._drop()
            raise

    def _drop(self) -> None:  # the session is closed in the background
        ws, self._ws = self._ws, None
        if ws is not None and self._loop is asyncio.get_running_loop():
            self._closing = asyncio.ensure_future(ws.close())

    async def reset(self, seed: int) -> str:
        if self._key is not None:
            url = shared_server(self._key).url  # restarted if it died
            if url != self._url:
                self._url, self._ws = url, None
        try:
            data = await self._send({"type": "reset", "data": {**self.reset_kwargs, "seed": int(seed)}})
        except Exception as e:
            raise ValueError(f"OpenEnv server {self.what!r} reset failed ({type(e).__name__}: {e})") from None
        self._return, self._turns, self._active = 0.0, 0, True
        return observation_text(data["observation"], self.observation_field)

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self._turns += 1
        try:
            data = await self._send({"type": "step", "data": {**self.defaults, self.action_field: action_text.strip()}})
            reward = 0.0 if data.get("reward") is None else data["reward"]
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"reward {reward!r} is not a finite number")
        except Exception as e:
            await asyncio.sleep(0.05)  # a server killed under a call: let its exit be seen
            srv = running(self._key)
            detail = str(e) or f"no reply within {self.timeout_s:g}s"
            dead = srv is not None and srv.dead
            why = (f"OpenEnv server {self.what!r} died mid-episode (stderr: {srv.tail()})" if dead
                   else f"OpenEnv server {self.what!r}: {type(e).__name__}: {detail}")
            self._active = False
            return StepResult(why, 0.0, True, {"fault": Fault.RECOVERABLE, "fault_reason": why})
        self._return += float(reward)
        obs = data["observation"]
        out = {"fault": Fault.NONE, "turn": self._turns, "tool": None, "tool_error": False}
        counts = {k: v for k, v in (obs.get("metadata") or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if counts:  # the env's own numeric metadata: summed per episode, logged as env/<name>
            out["counts"] = counts
        if data.get("done"):
            self._active = False
            return StepResult("", self._return, True, out)
        return StepResult(observation_text(obs, self.observation_field), 0.0, False, out)

    async def close(self) -> None:
        ws, self._ws, self._active = self._ws, None, False
        if ws is not None and self._loop is asyncio.get_running_loop():
            with contextlib.suppress(Exception):  # the server ends the session when its socket closes
                await asyncio.wait_for(ws.close(), 2)

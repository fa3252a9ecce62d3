"""``mcp``: the tools of an MCP server (started over stdio) with the ``tools`` env's tasks and reward.

    env:
      name: mcp
      kwargs: {command: python, args: ["examples/mcp/server.py"]}  # "python": arl's own interpreter
      dataset: examples/mcp/data/train.jsonl                       # rows and reward: as the tools env
      reward_fn: "examples.mcp.reward:score"

The server's ``tools/list`` (name, description, JSON input schema) are the tool schemas the chat
template renders; each parsed call is a ``tools/call`` whose text content is the tool message (role
``tool``; an ``isError`` result answers ``error: ...``).  Tasks, parsing, argument checks,
``tool_timeout_s``, the final answer and the reward are the ``tools`` env's, which this extends.

One server per env instance, kept across its episodes: the pool holds ``env.pool_size`` instances,
so no episode waits on another's calls, and no episode pays a process start (~1-2 s);
``restart_each_episode: true`` for a server whose tools keep state.  The MCP client (anyio) must
live in one task: the servers of a process are held by one daemon thread running its own event
loop, awaited from the rollout's loop (``run_coroutine_threadsafe``), so neither blocks the other.

Faults, one line each: a server that fails to start or list its tools fails the constructor (so
``--dry-run``); one that dies mid-episode makes that episode a recoverable fault (retried, then
filtered; the run goes on) and the next ``reset`` starts a new server; no ``mcp`` package names the
install extra.  What the adapter cannot carry: resources, prompts, sampling and elicitation (a
tool that asks the client for input fails as a tool error), non-text content (shown as
``[image]``), tools that change after start, HTTP transports.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

from .registry import register_env
from .tool_env import ToolEnv
from .tools import tool_from_schema
from .base import Fault, StepResult

INSTALL_HINT = "pip install 'arl[mcp]' (mcp==2.3.0) or bash install.sh --mcp"
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()
_CONNECTION_CLOSED = -32000  # JSON-RPC code of a closed connection (mcp_types.CONNECTION_CLOSED)


def _mcp():
    try:
        import mcp
    except ImportError:
        raise ValueError(f"env.name: mcp needs the mcp package, which is not installed: {INSTALL_HINT}") from None
    return mcp


def _loop() -> asyncio.AbstractEventLoop:
    """The process's MCP event loop (a daemon thread), started on first use."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="arl-mcp", daemon=True).start()
        return _LOOP


os.register_at_fork(after_in_child=lambda: globals().update(_LOOP=None))  # a child lacks the thread


class ToolError(Exception):  # the server answered a call with isError: an error message for the model
    pass


class ServerDied(Exception):  # the server's connection closed under a call
    pass


class _Server:
    """One stdio MCP server and its client session, held open by a task on the MCP loop."""

    def __init__(self, params: Any, timeout_s: float):
        self.params, self.timeout_s, self.dead = params, timeout_s, False
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = asyncio.Event()  # (bound to the MCP loop on first use)
        self.task = asyncio.run_coroutine_threadsafe(self._hold(), _loop())

    async def _hold(self) -> None:
        try:
            async with _mcp().Client(self.params, read_timeout_seconds=self.timeout_s) as client:
                self.client = client
                self.ready.set_result((await client.list_tools()).tools)
                await self._stop.wait()
        except BaseException as e:  # noqa: B036 -- also anyio's group errors; reported, not raised
            if not self.ready.done():
                self.ready.set_exception(e)
        finally:
            self.dead = True

    async def call(self, name: str, arguments: Dict[str, Any]) -> Any:
        fut = asyncio.run_coroutine_threadsafe(self.client.call_tool(name, arguments), _loop())
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # the connection closed (the process exited): MCPError CONNECTION_CLOSED, or the holder ended
            if self.dead or self.task.done() or getattr(e, "code", None) == _CONNECTION_CLOSED:
                self.dead = True
                raise ServerDied(f"{type(e).__name__}: {e}") from None
            raise

    def close(self) -> None:
        if not self.task.done():
            _loop().call_soon_threadsafe(self._stop.set)
            try:
                self.task.result(timeout=10)
            except Exception:
                pass


def _result_text(res: Any) -> str:
    parts = [getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]" for c in res.content]
    text = "\n".join(parts)
    if getattr(res, "is_error", False):
        raise ToolError(text)  # the tools env answers "error: <tool> raised ToolError: ...": the episode goes on
    return text


@register_env("mcp")
class MCPEnv(ToolEnv):
    def __init__(self, command: str, args: Sequence[str] = (), server_env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, reward_fn: Union[str, Any, None] = None, parser: str = "hermes",
                 tool_timeout_s: float = 10.0, start_timeout_s: float = 60.0, system_prompt: Optional[str] = None,
                 max_calls_per_turn: int = 8, restart_each_episode: bool = False, tokenizer: Any = None):
        mcp = _mcp()
        if not isinstance(command, str) or not command:
            raise ValueError(f"env.kwargs.command: the MCP server's executable, e.g. 'python', got {command!r}")
        self._params = mcp.StdioServerParameters(command=sys.executable if command == "python" else command,
                                                 args=[str(a) for a in args], env=server_env, cwd=cwd)
        self._what = " ".join([command, *self._params.args])
        self.start_timeout_s, self.restart_each_episode = float(start_timeout_s), bool(restart_each_episode)
        self._server = self._start_blocking(tool_timeout_s)
        tools = [tool_from_schema({"name": t.name, "description": t.description or "",
                                   "parameters": t.input_schema}, self._caller(t.name)) for t in self._listed]
        super().__init__(tools, reward_fn, parser, tool_timeout_s, system_prompt, max_calls_per_turn, tokenizer)

    def _start_blocking(self, timeout_s: float) -> _Server:
        server = _Server(self._params, timeout_s)
        try:
            self._listed = server.ready.result(timeout=self.start_timeout_s)
        except Exception as e:
            server.close()
            while isinstance(e, BaseExceptionGroup) and e.exceptions:  # anyio's task groups: the cause
                e = e.exceptions[0]
            if isinstance(e, concurrent.futures.TimeoutError):
                e = TimeoutError(f"no tools/list answer within {self.start_timeout_s:g}s")
            first = (str(e).splitlines() or [""])[0]
            raise ValueError(f"env.kwargs.command: MCP server {self._what!r} failed to start "
                             f"({type(e).__name__}: {first})") from None
        return server

    def _caller(self, name: str):
        async def call(**arguments):
            return _result_text(await self._server.call(name, arguments))
        return call

    async def reset(self, seed: int, task=None) -> List[Dict[str, str]]:
        if self._server.dead or self.restart_each_episode:  # a new server for the next episode
            self._server.close()
            self._server = await asyncio.get_running_loop().run_in_executor(
                None, self._start_blocking, self.tool_timeout_s)
        return await super().reset(seed, task)

    async def step(self, action_text: str) -> StepResult:
        res = await super().step(action_text)
        if self._server.dead:  # the server died under a call: this episode is a recoverable fault
            self._active = False
            why = f"MCP server {self._what!r} died mid-episode"
            return StepResult(why, 0.0, True, dict(res.info, fault=Fault.RECOVERABLE, fault_reason=why))
        return res

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._server.close)

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
``restart_each_episode: true`` for a server whose tools keep state.  The client side (one event
loop per process in a daemon thread) is ``arl.env.mcp_client``.

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
import sys
from typing import Any, Dict, List, Optional, Sequence, Union

from .registry import register_env
from .tool_env import ToolEnv
from .tools import tool_from_schema
from .base import Fault, StepResult
from .mcp_client import McpServer, mcp_module, result_text


@register_env("mcp")
class MCPEnv(ToolEnv):
    def __init__(self, command: str, args: Sequence[str] = (), server_env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None, reward_fn: Union[str, Any, None] = None, parser: str = "hermes",
                 tool_timeout_s: float = 10.0, start_timeout_s: float = 60.0, system_prompt: Optional[str] = None,
                 max_calls_per_turn: int = 8, restart_each_episode: bool = False, tokenizer: Any = None):
        mcp = mcp_module()
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

    def _start_blocking(self, timeout_s: float) -> McpServer:
        server = McpServer(self._params, timeout_s, self.start_timeout_s)
        try:
            self._listed = server.ready.result(timeout=self.start_timeout_s)
        except Exception as e:
            server.close()
            while isinstance(e, BaseExceptionGroup) and e.exceptions:  # anyio's task groups: the cause
                e = e.exceptions[0]
            if isinstance(e, concurrent.futures.TimeoutError):
                e = TimeoutError(f"no tools/list answer within {self.start_timeout_s:g}s")
            first = (str(e).splitlines() or [""])[0]
            said = server.tail()
            raise ValueError(f"env.kwargs.command: MCP server {self._what!r} failed to start "
                             f"({type(e).__name__}: {first}" + (f"; stderr: {said})" if said else ")")) from None
        return server

    def _caller(self, name: str):
        async def call(**arguments):
            return result_text(await self._server.call(name, arguments))
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

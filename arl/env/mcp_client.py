"""The MCP client side of ``env.name: mcp``: one stdio server per ``McpServer``, its session held
open by a task on a per-process event loop in a daemon thread.  The MCP client (anyio) must live in
one task, so calls are made from the rollout's loop with ``run_coroutine_threadsafe`` and neither
loop blocks the other."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import tempfile
import threading
from typing import Any, Dict, Optional

INSTALL_HINT = "pip install 'arl[mcp]' (mcp==2.3.0) or bash install.sh --mcp"
_LOOP: Optional[asyncio.AbstractEventLoop] = None
_LOOP_LOCK = threading.Lock()
_CONNECTION_CLOSED = -32000  # JSON-RPC code of a closed connection (mcp_types.CONNECTION_CLOSED)


def mcp_module():
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


class McpServer:
    """One stdio MCP server and its client session, held open by a task on the MCP loop.  Its start
    (initialize, tools/list) may take ``start_timeout_s`` (a server that imports its SDK on a loaded
    machine takes more than a tool call's budget), each tool call ``timeout_s``."""

    def __init__(self, params: Any, timeout_s: float, start_timeout_s: float):
        self.params, self.timeout_s, self.dead = params, timeout_s, False
        self.start_timeout_s = start_timeout_s
        # the server's stderr, kept for the error of a server that dies at start (its own last word,
        # e.g. the import that failed, where the MCP client sees only "Connection closed")
        self.err = tempfile.TemporaryFile()
        self.ready: concurrent.futures.Future = concurrent.futures.Future()
        self._stop = asyncio.Event()  # (bound to the MCP loop on first use)
        self.task = asyncio.run_coroutine_threadsafe(self._hold(), _loop())

    async def _hold(self) -> None:
        try:
            from mcp.client.stdio import stdio_client

            transport = stdio_client(self.params, errlog=self.err)
            async with mcp_module().Client(transport, read_timeout_seconds=self.start_timeout_s) as client:
                self.client = client
                self.ready.set_result((await client.list_tools()).tools)
                await self._stop.wait()
        except BaseException as e:  # noqa: B036 -- also anyio's group errors; reported, not raised
            if not self.ready.done():
                self.ready.set_exception(e)
        finally:
            self.dead = True

    async def call(self, name: str, arguments: Dict[str, Any]) -> Any:
        fut = asyncio.run_coroutine_threadsafe(
            self.client.call_tool(name, arguments, read_timeout_seconds=self.timeout_s), _loop())
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

    def tail(self) -> str:
        """The last non-empty line the server wrote to stderr ("" when none)."""
        try:
            self.err.seek(0)
            lines = [x.strip() for x in self.err.read().decode(errors="replace").splitlines() if x.strip()]
        except (OSError, ValueError):  # closed
            return ""
        return lines[-1][:300] if lines else ""

    def close(self) -> None:
        if not self.task.done():
            _loop().call_soon_threadsafe(self._stop.set)
            try:
                self.task.result(timeout=10)
            except Exception:
                pass


def result_text(res: Any) -> str:
    parts = [getattr(c, "text", None) or f"[{getattr(c, 'type', 'content')}]" for c in res.content]
    text = "\n".join(parts)
    if getattr(res, "is_error", False):
        raise ToolError(text)  # the tools env answers "error: <tool> raised ToolError: ...": the episode goes on
    return text

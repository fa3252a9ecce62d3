"""A verifiers taskset's ``vf.Toolset``s inside arl's verifiers server (arl/env/verifiers_server.py; run by
the verifiers venv's python, never imported by arl).  verifiers serves each toolset as an MCP server that a
harness program calls; here each one is registered on an in-process ``mcp`` ``MCPServer`` (the toolset's
own ``register``, so its tools, names, docstrings and argument schemas are exactly what verifiers would
serve) and called directly: no transport, no harness.  Tool names carry the server's prefix as verifiers'
chat harness shows them (``<server_name>_<tool>``).  Not carried: a typed toolset ``State`` synced with the
rollout (each call sees a fresh one), toolset runtimes (a container, a remote ``url``): they run here."""
import json

from mcp.server.mcpserver import MCPServer


class Tools:
    """The tools of an episode: the taskset's shared toolsets (set up once) and the task's own (per episode)."""

    def __init__(self):
        self.by_name, self.schemas = {}, []

    async def add(self, toolset, task=None):
        if task is not None:
            await toolset.setup()
            await toolset.setup_task(task)
        server = MCPServer(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        prefix = toolset.server_name
        for t in await server.list_tools():
            name = f"{prefix}_{t.name}" if prefix else t.name
            self.by_name[name] = (server, t.name)
            self.schemas.append({"type": "function", "function": {
                "name": name, "description": t.description or "", "parameters": t.input_schema}})

    async def call(self, name: str, arguments) -> str:
        """One call's tool message text; a failure is the text the model reads, never an exception."""
        if name not in self.by_name:
            return f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.by_name)) or 'none'}"
        server, raw = self.by_name[name]
        try:
            res = await server.call_tool(raw, dict(arguments or {}))
        except Exception as e:
            return f"error: {name} raised {type(e).__name__}: {e}"
        text = "\n".join(c.text for c in getattr(res, "content", []) if getattr(c, "text", None) is not None)
        if not text and getattr(res, "structured_content", None) is not None:
            text = json.dumps(res.structured_content)
        return f"error: {text}" if getattr(res, "is_error", False) and not text.startswith("error") else text


async def shared_tools(env):
    """The taskset's own toolsets (one instance for every episode), set up once."""
    sets = list(env.taskset.toolsets(env.taskset.config))
    for ts in sets:
        await ts.setup()
    return sets

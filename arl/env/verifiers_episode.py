"""One episode of a verifiers env inside arl's verifiers server (arl/env/verifiers_server.py; run by the
verifiers venv's python, never imported by arl): ``Episode.drive`` plays ``env.run(task, agents)`` with arl
as the env's one agent seat (``_Agent``), each model turn handed to arl through ``Episode.events`` and
answered through ``Episode.reply``; the task's rewards score the trace when ``run`` returns."""
import asyncio
import json

import verifiers.v1 as vf
from verifiers.v1.agent import Segment
from verifiers.v1.dialects import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers_tools import Tools  # next to this module


def line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:500]


def _wire(m) -> dict:
    content = m.content if isinstance(m.content, str) else vf.types.content_text(m.content)
    return {"role": m.role, "content": content or ""}


class Episode:
    """One rollout of ``env.run(task, agents)``, its model turns answered by arl."""

    def __init__(self, env, task, shared):
        self.env, self.task, self.events, self.shared = env, task, asyncio.Queue(), shared
        self.reply, self.pending, self.turns = None, [], 0
        self.trace, self.tools = None, Tools()

    async def drive(self):
        try:
            for ts in self.shared:
                await self.tools.add(ts)
            for ts in type(self.task).toolsets(self.task.config):  # the task's own: a fresh set per episode
                await self.tools.add(ts, self.task)
            agents = vf.Agents(self.env.config, lambda name, cfg: _Agent(self, name))
            await self.env.setup(agents)
            await self.env.run(self.task, agents)
            if self.trace is None:
                raise RuntimeError(f"{type(self.env).__name__}.run() ran no agent")
        except Exception as e:
            return await self.events.put({"error": line(e), "where": "run"})
        try:
            await self.task.score(self.trace)
            episode = vf.Episode(env=vf.EnvInfo(id=self.env.config.env_id), task=self.trace.task)
            episode.traces.append(self.trace)
            await self.env.finalize(self.task, episode)
        except Exception as e:  # a reward (or finalize) bug: the episode ends, the message reaches arl's log
            while e.__cause__ is not None:  # the user's exception, not verifiers' TaskError boundary around it
                e = e.__cause__
            return await self.events.put({"error": line(e), "where": "reward"})
        rewards = {k: r.value for k, r in self.trace.rewards.items() if r is not None}
        metrics = {k: v for k, v in self.trace.metrics.items() if v is not None}
        await self.events.put({"done": True, "reward": self.trace.reward, "rewards": rewards, "metrics": metrics})

    def add(self, message, sampled=False):
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(message=message, parent=parent, sampled=sampled))
        if not sampled:
            self.pending.append(message)

    async def model_turn(self) -> str:
        """The messages since the model's last reply go to arl; its reply comes back: text, and the tool
        calls arl parsed from it.  Calls run here and their results go back to the model (the harness's
        loop); a reply without calls ends the segment, its text is the env's."""
        while True:
            self.reply = asyncio.get_running_loop().create_future()
            obs, self.pending = [_wire(m) for m in self.pending], []
            await self.events.put({"messages": obs, **({"tools": self.tools.schemas} if not self.turns else {})})
            text, calls = await self.reply
            self.turns += 1
            if not calls:
                self.add(vf.AssistantMessage(content=text), sampled=True)
                return text
            ids = [f"call_{self.turns}_{k}" for k in range(len(calls))]
            self.add(vf.AssistantMessage(content=text, tool_calls=[
                vf.ToolCall(id=i, name=c.get("name") or "", arguments=json.dumps(c.get("arguments") or {}))
                for i, c in zip(ids, calls)]), sampled=True)
            for i, c in zip(ids, calls):
                out = c["error"] if c.get("error") else await self.tools.call(c["name"], c.get("arguments"))
                self.add(vf.ToolMessage(tool_call_id=i, content=out, name=c.get("name") or None))


class _Interaction:
    def __init__(self, ep: Episode):
        self.ep, self.trace = ep, ep.trace

    async def turn(self, message=None) -> Segment:
        if isinstance(message, str):
            self.ep.add(vf.UserMessage(content=message))
        elif message is not None:
            for m in message:
                self.ep.add(parse_message(m) if isinstance(m, dict) else m)
        text = await self.ep.model_turn()
        return Segment(messages=[vf.AssistantMessage(content=text)])

    async def close(self):
        return self.trace


class _Agent:
    """The env's one seat, played by arl's engine."""

    def __init__(self, ep: Episode, name: str):
        self.ep, self.name, self.trainable = ep, name, True

    def interaction(self, task):
        ep = self.ep
        if ep.trace is not None:
            raise RuntimeError("arl plays one agent run per episode; this env starts a second")
        ep.trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                         agent=AgentInfo(config=vf.AgentConfig(), name=self.name))
        if task.data.system_prompt:
            ep.add(vf.SystemMessage(content=task.data.system_prompt))
        prompt = task.data.prompt
        for m in ([vf.UserMessage(content=prompt)] if isinstance(prompt, str) else prompt or []):
            ep.add(m)
        return _Open(_Interaction(ep))

    async def run(self, task, **_):
        async with self.interaction(task) as i:
            await i.turn()
        return i.trace


class _Open:
    def __init__(self, i):
        self.i = i

    async def __aenter__(self):
        return self.i

    async def __aexit__(self, *exc):
        return False

"""The verifiers side of ``env.name: verifiers`` (arl/env/verifiers_env.py): run by the verifiers venv's
python (``bash install.sh --verifiers``), never imported by arl.  It loads a verifiers 0.4 taskset package
(``taskset.id``: a module exporting its ``Taskset`` -- and optionally its ``Env`` -- via ``__all__``) the
way verifiers does (``verifiers.v1.utils.loaders``), and plays its ``Env.run`` with arl as the one agent's
model: each ``interaction.turn(...)`` (or ``agent.run(task)``: one turn) hands the messages since the
model's last reply to arl and waits for arl's reply text; the task's ``@vf.reward``s score the trace when
``run`` returns, then ``Env.finalize``.  No harness program, interception server or model client runs.

Wire: JSON lines on stdin/stdout.  First line out: ``{"ready": {...}}`` or ``{"error": "one line"}``.
In: ``{"id", "op": "reset", "ep", "seed", "split"}`` / ``{"id", "op": "step", "ep", "text"}`` /
``{"op": "drop", "ep"}``; out ``{"id", "messages": [{"role", "content"}...]}`` (the model's turn is due),
``{"id", "done": true, "reward", "rewards", "metrics"}`` or ``{"id", "error": "one line", "where"}``.
The server exits when its stdin closes (arl is gone)."""
import asyncio
import json
import sys
import threading
import traceback

_OUT, sys.stdout = sys.stdout, sys.stderr  # the wire owns stdout: a print() in env code goes to stderr

import verifiers.v1 as vf  # noqa: E402 (after the stdout swap: an import-time print must not break the wire)
from verifiers.v1.agent import Segment
from verifiers.v1.dialects import parse_message
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import AgentInfo, Trace, TraceTask
from verifiers.v1.utils import loaders
from verifiers_tools import Tools, shared_tools  # next to this script

del sys.path[0]  # this script's directory: arl/env's modules must not shadow a taskset's name


def _line(e: BaseException) -> str:
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
            return await self.events.put({"error": _line(e), "where": "run"})
        try:
            await self.task.score(self.trace)
            episode = vf.Episode(env=vf.EnvInfo(id=self.env.config.env_id), task=self.trace.task)
            episode.traces.append(self.trace)
            await self.env.finalize(self.task, episode)
        except Exception as e:  # a reward (or finalize) bug: the episode ends, the message reaches arl's log
            while e.__cause__ is not None:  # the user's exception, not verifiers' TaskError boundary around it
                e = e.__cause__
            return await self.events.put({"error": _line(e), "where": "reward"})
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


def load(taskset_id: str, args: dict, eval_args):
    """The env and its train/held-out tasksets; one line for what arl cannot carry."""
    cfg = loaders.resolve_env_config({"taskset": {"id": taskset_id, **args}})
    env = loaders.load_environment(cfg)
    roles = list(vf.configs.agent.agent_config_fields(cfg))
    if len(roles) != 1:
        raise ValueError(f"{type(env).__name__} declares {len(roles)} agents {roles}; arl's engine plays exactly one")
    if loaders.default_harness_id(taskset_id) != "bash":
        raise ValueError(f"taskset {taskset_id!r} ships its own Harness, whose program owns the sampling loop "
                         "(arl's engine must be the model)")
    task_cls = type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise ValueError(f"{task_cls.__name__} needs a container runtime")
    held = env.taskset if eval_args is None else loaders.load_taskset(
        loaders.resolve_env_config({"taskset": {"id": taskset_id, **args, **eval_args}}).taskset)
    return env, {"train": _Tasks(env.taskset), "eval": _Tasks(held)}


class _Tasks:
    """A taskset's tasks by index (read lazily: a taskset may be infinite); the train seeds wrap."""

    def __init__(self, taskset):
        self.it, self.tasks, self.bounded = iter(taskset), [], taskset.bounded

    def get(self, i: int, wrap: bool):
        while len(self.tasks) <= i and self.it is not None:
            nxt = next(self.it, None)
            if nxt is None:
                self.it = None
            else:
                self.tasks.append(nxt)
        if len(self.tasks) <= i:
            if not self.tasks or not wrap:
                raise IndexError(f"task {i}: the taskset has {len(self.tasks)}")
            return self.tasks[i % len(self.tasks)]
        return self.tasks[i]


async def serve(env, tasks):
    loop, episodes = asyncio.get_running_loop(), {}
    shared = await shared_tools(env)
    lines = asyncio.Queue()

    def read():  # stdin in a thread; its end (arl gone) ends the server
        for raw in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, raw)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()

    def out(msg):
        _OUT.write(json.dumps(msg) + "\n")
        _OUT.flush()

    async def answer(rid, key, ep):
        ev = await ep.events.get()
        if "messages" not in ev:  # the episode is over: forget it
            episodes.pop(key, None)
        out({"id": rid, **ev})

    async def handle(req):
        rid, op, key = req.get("id"), req.get("op"), req.get("ep")
        try:
            if op == "drop":
                old = episodes.pop(key, None)
                if old is not None:
                    old.runner.cancel()
                return
            if op == "reset":
                split = req.get("split", "train")
                task = tasks[split].get(int(req["seed"]), wrap=split == "train")
                ep = episodes[key] = Episode(env, task, shared)
                ep.runner = asyncio.ensure_future(ep.drive())
            elif op == "step":
                ep = episodes[key]
                if ep.reply is None or ep.reply.done():
                    raise RuntimeError("no model turn is due")
                ep.reply.set_result((str(req["text"]), list(req.get("calls") or [])))
            else:
                raise ValueError(f"unknown op {op!r}")
            await answer(rid, key, ep)
        except Exception as e:
            out({"id": rid, "error": _line(e), "where": op})

    while (raw := await lines.get()) is not None:
        if raw.strip():
            asyncio.ensure_future(handle(json.loads(raw)))
    for ep in episodes.values():
        ep.runner.cancel()


def main():
    spec = json.loads(sys.argv[1])
    sys.path[:0] = spec.get("path", [])
    try:
        env, tasks = load(spec["taskset"], spec.get("args") or {}, spec.get("eval_args"))
    except Exception as e:
        print(json.dumps({"error": _line(e)}), file=_OUT, flush=True)
        if spec.get("debug"):
            traceback.print_exc()
        return 1
    print(json.dumps({"ready": {"env": type(env).__name__, "taskset": type(env.taskset).__name__}}), file=_OUT, flush=True)
    asyncio.run(serve(env, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

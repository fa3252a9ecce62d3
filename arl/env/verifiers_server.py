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
from verifiers.v1.utils import loaders  # noqa: E402
from verifiers_episode import Episode, line  # noqa: E402 (next to this script)
from verifiers_tools import shared_tools  # noqa: E402

del sys.path[0]  # this script's directory: arl/env's modules must not shadow a taskset's name


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
            out({"id": rid, "error": line(e), "where": op})

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
        print(json.dumps({"error": line(e)}), file=_OUT, flush=True)
        if spec.get("debug"):
            traceback.print_exc()
        return 1
    print(json.dumps({"ready": {"env": type(env).__name__, "taskset": type(env.taskset).__name__}}), file=_OUT, flush=True)
    asyncio.run(serve(env, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())

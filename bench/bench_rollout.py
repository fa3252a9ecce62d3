"""Rollout throughput: arl's async rollout vs sequential and batched lock-step rollouts.

Same vLLM engine (the tiny local model), same tasks, same seeded tool latencies and same seeded
sampling for all modes.  A run is ``--batches`` training batches of ``--trajectories`` each, with a
real weight reload into the engine after every batch (what the trainer's step costs the rollout
side on CPU; the trainer's own compute is left out of every mode alike):
  * async     -- ``RolloutManager`` as the trainer runs it (max staleness 1): every trajectory runs
                 on its own, the engine batches whatever turns are pending while other trajectories
                 wait on their tools, and the next batch's groups start while this one's slowest
                 trajectories finish -- the overlap that bounded policy lag buys;
  * async_staleness0 -- the same manager with staleness 0, one batch at a time (no overlap
                 between batches; reported for reference);
  * lockstep  -- per batch: generate the whole batch's turn, run all its tool calls concurrently,
                 wait for all, repeat;
  * sequential-- one trajectory, one call at a time.
Every mode runs the identical task set (same task seeds, samples and sampling seeds; checked: the
same number of tool calls), ``--repeats`` times, the modes interleaved in a rotating order; the
figures are medians, with the min-max of trajectories/s.
Tools: lognormal latency, median 200 ms, p99 2 s; 2-6 calls per trajectory (drawn per task).
Prints trajectories/s and engine idle fraction of each; the last stdout line is one JSON object.
Timings on a shared CPU are noisy.

    python bench/bench_rollout.py [--quick] [--trajectories 32] [--batches 3] [--repeats 3] [--max-tokens 16]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from arl.env.base import Environment, StepResult  # noqa: E402
from arl.env.faults import LatencyModel  # noqa: E402


class ToolLatencyEnv(Environment):
    """Each task needs ``2..6`` tool calls (from the task seed); every call takes a seeded lognormal
    time.  The (untrained) model's text is accepted as a call, so the schedule is what is measured."""

    system_prompt = "Call the lookup tool until you have the value, then answer."
    max_turns = 8

    def __init__(self, median_s=0.2, p99_s=2.0, min_calls=2, max_calls=6):
        self.latency = LatencyModel(median_s, p99_s)
        self.min_calls, self.max_calls = min_calls, max_calls

    async def reset(self, seed, *, sample=0):
        self.calls_needed = random.Random(f"calls/{seed}").randint(self.min_calls, self.max_calls)
        self.rng = random.Random(f"latency/{seed}/{sample}")
        self.calls = 0
        return f"Find the value for k{seed % 100:02d}."

    async def step(self, action_text):
        self.calls += 1
        await asyncio.sleep(self.latency.sample(self.rng))
        if self.calls >= self.calls_needed:
            return StepResult("v42", 1.0, True, {"tool": "lookup"})
        return StepResult(f"k{self.calls:02d}", 0.0, False, {"tool": "lookup"})


def _tasks(n, group):
    """(task seed, sample) for n trajectories in groups of ``group``."""
    return [(i // group, i % group) for i in range(n)]


SEED = 0


def _sample_seed(seed, sample):
    from arl.rollout.manager import derive_sample_seed

    return derive_sample_seed(SEED, seed, sample)


async def _manager_run(engine, fmt, ep_cfg, n, group, batches, weights_dir, staleness):
    from arl.config import RolloutConfig
    from arl.rollout import RolloutManager

    cfg = RolloutConfig(group_size=group, staleness=staleness, retries=0)
    mgr = RolloutManager(engine, ToolLatencyEnv, fmt, tasks=range(batches * n // group), config=cfg,
                         groups_per_step=n // group, pool_size=n * (staleness + 1), episode=ep_cfg,
                         seed=SEED)  # same sampling seeds as the baselines
    out = []
    async with mgr:
        for b in range(batches):
            out += (await mgr.get_batch()).trajectories
            await mgr.update_weights(weights_dir, engine.version + 1)  # the trainer's step
    return out


async def run_async(engine, fmt, ep_cfg, n, group, batches, weights_dir):
    return await _manager_run(engine, fmt, ep_cfg, n, group, batches, weights_dir, staleness=1)


async def run_async_staleness0(engine, fmt, ep_cfg, n, group, batches, weights_dir):
    return await _manager_run(engine, fmt, ep_cfg, n, group, batches, weights_dir, staleness=0)


async def run_lockstep(engine, fmt, ep_cfg, n, group, batches, weights_dir):
    from arl.rollout import Episode

    tasks = _tasks(batches * n, group)
    out = []
    for b in range(batches):
        eps = [Episode(ToolLatencyEnv(), fmt, ep_cfg, s, sample=j, sample_seed=_sample_seed(s, j))
               for s, j in tasks[b * n:(b + 1) * n]]
        await asyncio.gather(*(e.start() for e in eps))
        while True:
            live = [e for e in eps if not e.done]
            if not live:
                break
            outs = await asyncio.gather(*(engine.generate_one(e.tokens, e.sampling()) for e in live))
            await asyncio.gather(*(e.apply(s) for e, s in zip(live, outs)))  # wait for every tool call
        out += [e.trajectory() for e in eps]
        await engine.update_weights(weights_dir, engine.version + 1)  # the trainer's step
    return out


async def run_sequential(engine, fmt, ep_cfg, n, group, batches, weights_dir):
    from arl.rollout import run_episode

    tasks = _tasks(batches * n, group)
    out = []
    for b in range(batches):
        for s, j in tasks[b * n:(b + 1) * n]:
            out.append(await run_episode(engine, ToolLatencyEnv(), fmt, s, ep_cfg, sample=j,
                                         sample_seed=_sample_seed(s, j)))
        await engine.update_weights(weights_dir, engine.version + 1)  # the trainer's step
    return out


MODES = {"async": run_async, "async_staleness0": run_async_staleness0, "lockstep": run_lockstep,
         "sequential": run_sequential}


async def main_async(args):
    from transformers import AutoTokenizer

    from arl.config import TinyModelConfig
    from arl.model.tiny import build_tiny_model
    from arl.rollout import ChatFormat, EpisodeConfig, SamplingConfig, VLLMEngine

    model_dir = build_tiny_model(config=TinyModelConfig(vocab_size=512, intermediate=256), envs=("toy_lookup",))
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    # the model's own weights, reloaded after every batch as the trainer's sync would
    weights_dir = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                               f"arl-bench-rollout-{os.getpid()}")
    shutil.copytree(model_dir, weights_dir, dirs_exist_ok=True)
    engine = VLLMEngine(model_dir, seed=0, max_model_len=1024, max_num_seqs=max(64, 2 * args.trajectories))
    ep_cfg = EpisodeConfig(sampling=SamplingConfig(max_tokens=args.max_tokens, stop=()))
    await engine.generate([[1, 2, 3]] * 4, SamplingConfig(max_tokens=args.max_tokens, stop=()))  # warm-up
    B, n = args.batches, args.trajectories * args.batches
    runs = {m: [] for m in MODES}
    names = list(MODES)
    try:
        for rep in range(args.repeats):  # interleaved, the order rotating: no mode always runs first
            for mode in names[rep % len(names):] + names[:rep % len(names)]:
                engine.idle_stats(reset=True)
                t0 = time.perf_counter()
                trajs = await MODES[mode](engine, fmt, ep_cfg, args.trajectories, args.group, B, weights_dir)
                wall = time.perf_counter() - t0
                if len(trajs) != n:
                    raise RuntimeError(f"{mode}: produced {len(trajs)} trajectories, expected {n}")
                idle = engine.idle_stats()["idle_frac"]
                calls = sum(t.metadata["tool_calls"] for t in trajs)
                runs[mode].append({"wall_s": wall, "traj_per_s": n / wall, "engine_idle_frac": idle,
                                   "tool_calls": calls, "tokens": int(sum(len(t) for t in trajs))})
                print(f"repeat {rep} {mode:>18}: {n:3d} trajectories, {calls:3d} tool calls in {wall:7.2f} s -> "
                      f"{n / wall:6.2f} traj/s, engine idle {idle:5.1%}", flush=True)
    finally:
        await engine.close()
        shutil.rmtree(weights_dir, ignore_errors=True)
    calls = {m: {r["tool_calls"] for r in rs} for m, rs in runs.items()}
    if len(set().union(*calls.values())) != 1:  # the same tasks, so the same tool calls, in every mode
        raise RuntimeError(f"modes ran different work: tool calls per mode {calls}")
    res = {m: {k: float(np.median([r[k] for r in rs])) for k in ("traj_per_s", "engine_idle_frac", "wall_s")}
           for m, rs in runs.items()}
    spread = {m: [round(min(r["traj_per_s"] for r in rs), 4), round(max(r["traj_per_s"] for r in rs), 4)]
              for m, rs in runs.items()}
    return {
        "bench": "rollout", "quick": args.quick, "trajectories": args.trajectories, "batches": B,
        "repeats": args.repeats, "tool_calls": next(iter(calls["async"])),
        "traj_per_s_min_max": spread,
        "async_max_staleness": 1,
        "max_tokens_per_turn": args.max_tokens, "tool_latency_median_s": 0.2, "tool_latency_p99_s": 2.0,
        "traj_per_s": {m: round(r["traj_per_s"], 4) for m, r in res.items()},
        "engine_idle_frac": {m: round(r["engine_idle_frac"], 4) for m, r in res.items()},
        "wall_s": {m: round(r["wall_s"], 3) for m, r in res.items()},
        "speedup_vs_lockstep": round(res["async"]["traj_per_s"] / res["lockstep"]["traj_per_s"], 3),
        "speedup_vs_sequential": round(res["async"]["traj_per_s"] / res["sequential"]["traj_per_s"], 3),
        "engine_idle_frac_async": round(res["async"]["engine_idle_frac"], 4),
        "speedup_vs_lockstep_staleness0": round(
            res["async_staleness0"]["traj_per_s"] / res["lockstep"]["traj_per_s"], 3),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer trajectories (about a minute or two)")
    p.add_argument("--trajectories", type=int, default=None, help="trajectories per batch (default 64)")
    p.add_argument("--batches", type=int, default=None, help="training batches per mode (default 4; 2 with --quick)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every mode, interleaved (median reported)")
    p.add_argument("--group", type=int, default=4, help="samples per task")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per model turn")
    args = p.parse_args(argv)
    if args.trajectories is None:
        args.trajectories = 16 if args.quick else 32
    if args.batches is None:
        args.batches = 2 if args.quick else 3
    if args.batches < 1:
        raise ValueError(f"--batches: must be >= 1, got {args.batches}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.trajectories % args.group:
        raise ValueError(f"--trajectories: must be a multiple of --group ({args.group}), got {args.trajectories}")
    out = asyncio.run(main_async(args))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

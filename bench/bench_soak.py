"""The fault soak: the main job on the default launcher (Ray) through environment faults, a dead
trainer rank and a dead engine, checked step by step.

    python bench/bench_soak.py [--steps 100] [--kill-rank-at 40] [--kill-engine-after 20] [--out runs/soak]
    python bench/bench_soak.py --quick       # 12 steps, rank killed at 6, engine after its 3rd batch
    python bench/bench_soak.py --parts sandbox   # only the hostile programs inside a Ray actor

The run is ``python -m arl.train --config configs/tiny_cpu.yaml`` with
``env.kwargs.recoverable_rate=0.3`` (a tool call fails transiently: the episode goes on) and
``env.kwargs.unrecoverable_rate=0.1`` (the tool server dies: the episode ends as a fault, masked),
drawn per tool call; trainer rank 1 SIGKILLs itself when step ``--kill-rank-at`` starts
(``ARL_TEST_KILL_RANK``: Ray's trainer restart brings every rank back from the last checkpoint) and
engine 0 SIGKILLs itself after its ``--kill-engine-after``-th batch (``ARL_TEST_KILL_ENGINE``: Ray
restarts it with the current weights; the trainer restart starts new engines, whose hook counts
again, so the default run loses engine 0 twice: after batch 20 and after batch 50).  Checked, and printed as one JSON object (last stdout line):
rc 0; every planned step logged exactly once; every step's batch whole
(``rollout/num_trajectories`` = tasks_per_step x group_size); no NaN or missing loss, grad norm or
reward in any step; the restart named in the step record; the engine's restart line; the faults
seen (``status/faults`` summed) and the held-out success at the end.

``--parts sandbox``: the sandbox's hostile programs (fork and memory bombs, network, file escapes,
signals, ...: ``HOSTILE`` of tests/test_sandbox.py) run by the code sandbox inside a Ray actor of a
local cluster, where the default launcher runs the rollout process and its environments (Ray's
worker process tree and niceness): each must hit the limit the test suite expects outside Ray,
print nothing it should not, and leave the canary file outside the sandbox intact.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"
FAULTS = ["env.kwargs.recoverable_rate=0.3", "env.kwargs.unrecoverable_rate=0.1"]
NUMERIC = ("train/loss", "train/grad_norm", "rollout/reward_mean")


def check(lines: list, steps: int, batch: int, text: str, kill_rank_at: int) -> dict:
    """The soak's verdicts over the run's step records (metrics.jsonl, in file order) and output."""
    recs = {r["step"]: r for r in lines}
    logged = [r["step"] for r in lines if r["step"] >= 1]
    bad_numbers = [(r["step"], k, r.get(k)) for r in lines if r["step"] >= 1 for k in NUMERIC
                   if not isinstance(r.get(k), (int, float)) or not math.isfinite(r[k])]
    short = [(s, recs[s].get("rollout/num_trajectories")) for s in recs if s >= 1
             if recs[s].get("rollout/num_trajectories") != batch]
    restarted = [s for s in recs if s >= 1 and "restart/trainer_restarts" in recs[s]]
    return {
        "steps_logged_once": logged == list(range(1, steps + 1)),
        "batches_whole": not short, "short_batches": short[:5],
        "no_nan": not bad_numbers, "bad_numbers": bad_numbers[:5],
        "trainer_restart_recorded": bool(restarted) if kill_rank_at <= steps else None,
        "restart_steps": restarted,
        "engine_restarts": text.count("restarted: it makes batch"),
        "faults_total": sum(recs[s].get("status/faults", 0) for s in recs if s >= 1),
        "trajectories_total": sum(recs[s].get("rollout/num_trajectories", 0) for s in recs if s >= 1),
        "masked_total": sum(recs[s].get("status/masked", 0) for s in recs if s >= 1),
        "heldout_end": next((recs[s]["success/heldout"] for s in sorted(recs, reverse=True)
                             if "success/heldout" in recs[s]), None),
    }


def sandbox_on_ray() -> dict:
    """Every hostile program through ``arl.env.sandbox.Sandbox`` in one Ray actor; the verdicts."""
    import tempfile

    from arl.cluster.launcher import session_token_auth

    session_token_auth()  # before ray's import, as the launcher does: no token left in ~/.ray
    import ray

    sys.path.insert(0, str(ROOT / "tests"))
    from test_sandbox import CANARY, FAST, HOSTILE

    canary = Path(tempfile.mkdtemp(prefix="arl-soak-canary-")) / "canary.txt"
    canary.write_text("keep me")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        @ray.remote(num_cpus=1)
        def contain(programs: dict, fast: dict) -> dict:
            import asyncio
            import textwrap

            from arl.env.sandbox import Sandbox, SandboxLimits

            out = {}
            for name, (code, expect) in programs.items():
                limits = SandboxLimits(**fast)
                if expect in ("cpu_time", "crash"):  # CPU-bound: slow on a loaded machine (as the test)
                    limits = SandboxLimits(**{**fast, "wall_s": 10.0, "cpu_s": 1 if expect == "cpu_time" else 5})
                r = asyncio.run(Sandbox(limits).run(textwrap.dedent(code)))
                out[name] = {"limit": r.limit, "expect": expect, "leak": "escaped" in r.stdout or "pwned" in r.stdout,
                             "wall_s": round(r.wall_s, 2)}
            return out

        programs = {k: (code.replace(CANARY, str(canary)), expect) for k, (code, expect) in HOSTILE.items()}
        t0 = time.monotonic()
        res = ray.get(contain.remote(programs, dict(FAST.__dict__)))
        wall = round(time.monotonic() - t0, 1)
    finally:
        ray.shutdown()
    wrong = {k: v for k, v in res.items() if v["limit"] != v["expect"] or v["leak"]}
    escaped = [p for p in ("/tmp/arl_sandbox_escape.txt", "/tmp/arl_pwned") if os.path.exists(p)]
    intact = canary.is_file() and canary.read_text() == "keep me"
    return {"programs": len(res), "contained": len(res) - len(wrong), "wrong": wrong, "files_escaped": escaped,
            "canary_intact": intact, "wall_s": wall,
            "ok": not wrong and not escaped and intact}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kill-rank-at", type=int, default=40, help="trainer rank 1 dies as this step starts")
    ap.add_argument("--kill-engine-after", type=int, default=20,
                    help="engine 0 dies after this many batches (each trainer attempt starts new engines: again)")
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--quick", action="store_true", help="12 steps, rank killed at 6, engine after 3 batches")
    ap.add_argument("--parts", default="soak,sandbox", help="soak, sandbox or both (default)")
    ap.add_argument("overrides", nargs="*", help="more arl.train overrides")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= {"soak", "sandbox"}:
        print(f"bench_soak: --parts: unknown {sorted(parts - {'soak', 'sandbox'})} (soak, sandbox)", file=sys.stderr)
        return 2
    verdict = {}
    if "sandbox" in parts:
        verdict["sandbox"] = sandbox_on_ray()
    if "soak" in parts:
        verdict["soak"] = soak(args)
    ok = all(v["ok"] for v in verdict.values())
    if not ok:
        print("bench_soak: failed (see the verdicts)", file=sys.stderr)
    print(json.dumps({**verdict, "ok": ok}))
    return 0 if ok else 1


def soak(args) -> dict:
    if args.quick:
        args.steps, args.kill_rank_at, args.kill_engine_after = 12, 6, 3
    from arl.config import load_config

    out = Path(args.out).resolve()
    overrides = [f"output_dir={out}", f"trainer.steps={args.steps}", "trainer.max_wall_s=null",
                 "trainer.checkpoint_every=10" if not args.quick else "trainer.checkpoint_every=2",
                 "logging.progress=false", *FAULTS, *args.overrides]
    cfg = load_config(str(ROOT / CONFIG), overrides)
    batch = cfg.rollout.tasks_per_step * cfg.rollout.group_size
    env = dict(os.environ, ARL_TEST_KILL_RANK=f"1@{args.kill_rank_at}",
               ARL_TEST_KILL_ENGINE=f"0:{args.kill_engine_after}")
    cmd = [sys.executable, "-m", "arl.train", "--config", CONFIG, *overrides]
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = round(time.monotonic() - t0, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.log").write_text(res.stdout + res.stderr)
    lines = []
    if (out / "metrics.jsonl").is_file():
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    verdict = {"rc": res.returncode, "wall_s": wall, "steps": args.steps, "batch": batch,
               "kill_rank_at": args.kill_rank_at, "kill_engine_after": args.kill_engine_after,
               **check(lines, args.steps, batch, res.stdout + res.stderr, args.kill_rank_at)}
    ok = (verdict["rc"] == 0 and verdict["steps_logged_once"] and verdict["batches_whole"] and verdict["no_nan"]
          and verdict["trainer_restart_recorded"] is not False and verdict["engine_restarts"] > 0)
    verdict["ok"] = ok
    verdict["log"] = str(out / "soak.log")
    return verdict


if __name__ == "__main__":
    raise SystemExit(main())

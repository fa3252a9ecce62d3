"""Continued SFT, the baseline RL must beat: SFT on the demonstrations for RL's wall time, from the same start.

It runs a config's SFT warm start exactly as ``python -m arl.train`` does (same tiny model or
checkpoint, same expert demonstrations, ``trainer.world_size`` DeepSpeed ranks, the same draws and
learning rate), so step 0 here is the policy RL step 0 starts from; then it keeps stepping SFT on
the same demonstrations and evaluates greedy held-out success every ``--eval-every`` SFT steps with
the run's own engine and evaluation code (``arl.rollout.worker.evaluate``, the ``success/heldout``
of an RL run), until the wall budget (``--wall-s``, default ``trainer.max_wall_s``) or ``--steps``.
``metrics.jsonl`` in ``output_dir`` has the RL run's format (``step``: SFT steps after the warm
start, ``wall_s`` from the model load as in RL, SFT included; ``success/heldout``; ``sft/*``), so
``python -m arl.plot RL_RUN SFT_RUN --x wall`` draws both.  Every evaluated policy is kept in
``output_dir/snapshots/sft<N>`` (HF format with the tokenizer, N = SFT steps in all): an RL run can
start from any of them (``model.name_or_path=... sft.enabled=false``).

Wall time counts training only: the trainers wait while the engine evaluates, and that pause is not
counted (an RL run's evaluations share the CPU with its training), which favours this baseline.

    python bench/sft_continue.py --config configs/tiny_cpu.yaml --wall-s 600 --eval-every 4
    python bench/sft_continue.py --config configs/long_horizon_cpu.yaml --steps 1600 --eval-every 200
    python bench/sft_continue.py --quick

The last stdout line is one JSON object: the start and final held-out success, the best and the
SFT steps and wall it came at, time to 50% and 80%, and the curve.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))


def eval_server(cfg_dict: dict, model_dir: str, requests, results, parent_pid: int) -> None:
    """The evaluating process: one engine; ``(weights_dir, version)`` in, held-out success out."""
    from arl.config import TrainConfig
    from arl.procs import die_with_parent

    die_with_parent(parent_pid, take_children=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from arl.rollout.episode import ChatFormat
    from arl.rollout.worker import evaluate, run_engine, task_set

    cfg = TrainConfig.model_validate(cfg_dict)

    async def serve():
        engine = run_engine(cfg, model_dir)
        fmt, tasks = ChatFormat(AutoTokenizer.from_pretrained(model_dir)), task_set(cfg)
        try:
            results.put(("ready", None))
            while True:
                req = requests.get()
                if req is None:
                    return
                weights, version = req
                await engine.update_weights(weights, version)
                t = time.perf_counter()
                acc = await evaluate(engine, fmt, cfg, cfg.env.eval_tasks, tasks)
                results.put(("eval", (acc, time.perf_counter() - t)))
        finally:
            await engine.close()

    try:
        asyncio.run(serve())
    except BaseException as e:  # tell the trainers instead of leaving them waiting
        results.put(("error", f"{type(e).__name__}: {e}"))
        raise


def sft_rank(rank: int, world: int, port: int, cfg_dict: dict, model_dir: str, demos: list, plan: dict,
             requests, results, parent_pid: int) -> None:
    """One trainer rank: the warm start, then continued SFT with evaluations (rank 0 logs)."""
    import torch
    from transformers import AutoTokenizer

    from arl.config import TrainConfig
    from arl.metrics import MetricsLogger
    from arl.procs import die_with_parent, exit_process
    from arl.trainer.dist import barrier, broadcast_from_rank0, init_distributed, set_rank_env, shutdown
    from arl.trainer.models import load_policy
    from arl.trainer.sft import SFTSteps

    die_with_parent(parent_pid)
    cfg = TrainConfig.model_validate(cfg_dict)
    set_rank_env(rank, world, port)
    if cfg.trainer.cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.trainer.cpu_threads)
    init_distributed(cfg.layout.device)
    torch.manual_seed(cfg.seed)
    log = None
    if rank == 0:
        lg = cfg.logging
        log = MetricsLogger(cfg.output_dir, jsonl=True, tensorboard=lg.tensorboard, progress=False)
    model = load_policy(cfg, model_dir)
    t0, paused = time.perf_counter(), 0.0  # the RL run's clock: from the model load, SFT included
    run = SFTSteps(cfg, model, demos, rank, world)
    tok = AutoTokenizer.from_pretrained(model_dir) if rank == 0 else None
    snapshots = Path(cfg.output_dir) / "snapshots"
    last = {}
    while True:
        extra = run.done - cfg.sft.steps  # SFT steps after the warm start (the RL run's step axis)
        if extra >= 0:
            wall = time.perf_counter() - t0 - paused
            over = broadcast_from_rank0(extra >= plan["stop_extra"] or wall > plan["wall_s"], rank)
            if over or extra % plan["eval_every"] == 0:  # the policy the run ends with is evaluated too
                pause = time.perf_counter()
                weights = snapshots / f"sft{run.done}"  # each evaluated policy, loadable as model.name_or_path
                run.tr.export_hf(str(weights), tokenizer=tok)  # a collective under ZeRO-3; rank 0 writes
                acc = ev_s = None
                if rank == 0:
                    requests.put((str(weights), run.done))
                    kind, payload = results.get()
                    if kind != "eval":
                        raise RuntimeError(f"evaluation process failed: {payload}")
                    acc, ev_s = payload
                barrier()
                paused += time.perf_counter() - pause
                if rank == 0:
                    rec = {**{f"sft/{k}": v for k, v in last.items()}, "success/heldout": acc,
                           "sft/steps_total": run.done, "time/eval_s": ev_s}
                    log.log(extra, rec, wall_s=wall)
                    print(f"sft_continue: {run.done} SFT steps ({extra:+d}), {wall:.0f} s: held-out {acc:.3f}",
                          flush=True)
            elif rank == 0:  # the steps between evaluations, as an RL run logs every step
                log.log(extra, {**{f"sft/{k}": v for k, v in last.items()}, "sft/steps_total": run.done},
                        wall_s=wall)
            if over:
                break
        last = run.step()
    if rank == 0:
        requests.put(None)
        log.close()
    run.tr.export_hf(str(Path(cfg.output_dir) / "hf"), tokenizer=tok)
    shutdown()
    exit_process(0)


def run(config: Optional[str], overrides: list, wall_s: Optional[float], eval_every: int,
        steps: Optional[int]) -> Path:
    """Continued SFT with ``config``; returns the run directory."""
    import torch.multiprocessing as mp

    from arl.config import load_config
    from arl.prepare import model_dir_for, sft_demos
    from arl.procs import free_port

    cfg = load_config(config, overrides)
    if cfg.layout.device != "cpu":
        raise ValueError("layout.device: continued SFT runs the CPU layout (trainer ranks + one engine)")
    if eval_every < 1:
        raise ValueError(f"--eval-every: must be >= 1, got {eval_every}")
    if not cfg.env.eval_tasks:
        raise ValueError("env.eval_tasks: 0; continued SFT needs held-out tasks to evaluate on")
    wall_s = cfg.trainer.max_wall_s if wall_s is None else wall_s
    if wall_s is None and steps is None:
        raise ValueError("--wall-s: the config has no trainer.max_wall_s; give --wall-s or --steps")
    if steps is not None and steps < cfg.sft.steps:
        raise ValueError(f"--steps: {steps} is fewer than the warm start's sft.steps ({cfg.sft.steps})")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = model_dir_for(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    demos = sft_demos(cfg, model_dir)
    if not demos:
        raise ValueError("sft: no demonstrations (sft.enabled false, or sft.steps 0)")
    plan = {"eval_every": eval_every, "wall_s": float("inf") if wall_s is None else float(wall_s),
            "stop_extra": (steps - cfg.sft.steps) if steps is not None else 1 << 60}
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=eval_server, args=(cfg.model_dump(), model_dir, requests, results, os.getpid()),
                         name="arl-sft-eval")
    server.start()
    try:
        kind, payload = results.get()  # the engine is up before the clock starts
        if kind != "ready":
            raise RuntimeError(f"evaluation process failed: {payload}")
        world = cfg.trainer.world_size
        mp.start_processes(sft_rank, args=(world, free_port(), cfg.model_dump(), model_dir, demos, plan, requests,
                                           results, os.getpid()),
                           nprocs=world, join=True, start_method="spawn")
    finally:
        server.join(timeout=60)
        if server.is_alive():
            server.terminate()
    return out


def summary(run_dir: Path) -> dict:
    from arl.metrics.logger import read_metrics

    recs = read_metrics(run_dir / "metrics.jsonl")
    curve = [{"step": r["step"], "sft_steps": r["sft/steps_total"], "wall_s": round(r["wall_s"], 1),
              "success": r["success/heldout"]} for r in recs if r.get("success/heldout") is not None]
    if not curve:
        raise RuntimeError(f"{run_dir}: no held-out evaluation was logged")
    best = max(curve, key=lambda c: c["success"])

    def first(th):
        hit = next((c for c in curve if c["success"] >= th), None)
        return None if hit is None else {"step": hit["step"], "wall_s": hit["wall_s"]}

    return {"run_dir": str(run_dir), "success_start": curve[0]["success"], "success_end": curve[-1]["success"],
            "success_best": best["success"], "best_at": {"step": best["step"], "wall_s": best["wall_s"]},
            "to_50": first(0.5), "to_80": first(0.8), "sft_steps_start": curve[0]["sft_steps"],
            "sft_steps_end": curve[-1]["sft_steps"], "wall_s_end": curve[-1]["wall_s"], "curve": curve}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML config (default: the built-in tiny CPU run)")
    ap.add_argument("--wall-s", type=float, default=None, help="wall budget, SFT included (default: trainer.max_wall_s)")
    ap.add_argument("--eval-every", type=int, default=20, help="SFT steps between held-out evaluations")
    ap.add_argument("--steps", type=int, default=None, help="stop at this many SFT steps in all (warm start included)")
    ap.add_argument("--quick", action="store_true", help="8 SFT steps + 4 more, 8 held-out tasks: checks the runner")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. output_dir=runs/sft_baseline")
    args = ap.parse_args(argv)
    overrides, steps, every = list(args.overrides), args.steps, args.eval_every
    if args.quick:
        tmp = tempfile.mkdtemp(prefix="arl-sft-continue-")
        overrides = [f"output_dir={tmp}", "sft.steps=8", "sft.episodes=32", "env.eval_tasks=8", *overrides]
        steps, every = 12, 2
    try:
        run_dir = run(args.config, overrides, args.wall_s, every, steps)
    except ValueError as e:
        print(f"sft_continue: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary(run_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

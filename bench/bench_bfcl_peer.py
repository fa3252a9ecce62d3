"""arl and TRL side by side on the BFCL recipe (examples/bfcl), from one SFT start, one wall budget.

1. the SFT start: ``bench/sft_continue.py --config examples/bfcl/config.yaml --steps 8`` (the
   recipe's warm start: BFCL's ground truth on the train split) -> ``<root>/sft/snapshots/sft8``,
   with its held-out evaluation (``--start DIR`` skips this);
2. arl: ``python -m arl.train --config examples/bfcl/config.yaml model.name_or_path=START
   sft.enabled=false trainer.max_wall_s=BUDGET``; its held-out curve is the run's own evaluations
   (every ``trainer.eval_every`` steps, inside its wall clock);
3. TRL: ``bench/peer_trl_bfcl.py`` (GRPOTrainer, the differences are in its docstring) for the same
   budget, alone on the machine after arl's run; its snapshots are evaluated afterwards on one arl
   engine with the same code and rows as arl's in-run evaluations (greedy, BFCL's verdicts);
4. the comparison: each run's held-out AST mean (live_simple, live_multiple, parallel) and the
   irrelevance categories over wall time; ``arl_wall_to_trl_final_s``: arl's first evaluation at or
   above TRL's final held-out AST mean, and its ratio to TRL's wall.

    python bench/bench_bfcl_peer.py --seed 0 [--budget-s 1200] [--root runs/bfcl_peer] [--start DIR]
    python bench/bench_bfcl_peer.py --quick      # checks the runner: 2 rows per category, short budget

The last stdout line is one JSON object.  Run output stays under ``--root`` (git-ignored ``runs/``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.bfcl.recipe import CONFIG, from_heldout, run  # noqa: E402

PY = sys.executable


def sh(cmd: list, log: Path) -> float:
    return run(cmd, log, cwd=ROOT)  # the recipe's runner, from the repository root


def sft_start(root: Path, seed: int, common: list, steps: int) -> Path:
    snap = root / "sft" / "snapshots" / f"sft{steps}"
    if not (snap / "config.json").is_file():
        sh([PY, "bench/sft_continue.py", "--config", CONFIG, "--steps", str(steps), "--eval-every", str(steps),
            f"output_dir={root / 'sft'}", f"seed={seed}", *common], root / "sft.log")
    return snap


def arl_curve(run_dir: Path) -> list:
    """``[{step, wall_s, scores}]`` from the run's held-out transcripts and its metrics' wall clock."""
    from arl.metrics.logger import read_metrics

    wall = {r["step"]: r.get("wall_s") for r in read_metrics(run_dir / "metrics.jsonl")}
    steps = sorted(int(p.stem.removeprefix("heldout_step")) for p in (run_dir / "transcripts").glob("heldout_step*.jsonl"))
    return [{"step": s, "wall_s": wall.get(s), **from_heldout(run_dir / "transcripts" / f"heldout_step{s}.jsonl")}
            for s in steps]


async def _evaluate(cfg, start: str, snaps: list, n: int, out_dir: Path) -> list:
    from arl.eval import evaluate_model
    from arl.rollout.worker import run_engine

    engine = run_engine(cfg, start, serve_adapters=False)
    paths = []
    try:
        for s in snaps:
            await engine.update_weights(s["dir"])
            rows = await evaluate_model(cfg, start, n, engine=engine)
            p = out_dir / f"heldout_step{s['step']}.jsonl"
            p.write_text("".join(json.dumps(r) + "\n" for r in rows))
            paths.append(p)
    finally:
        await engine.close()
    return paths


def trl_curve(cfg, start: Path, result: dict, n: int, out_dir: Path) -> list:
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    snaps = result["snapshots"]
    paths = asyncio.run(_evaluate(cfg, str(start), snaps, n, out_dir))
    return [{"step": s["step"], "wall_s": s["wall_s"], **from_heldout(p)} for s, p in zip(snaps, paths)]


def compare(arl: list, trl: list, trl_wall: float) -> dict:
    key = "held_out_ast_mean"
    final = trl[-1].get(key) if trl else None
    hit = next((c for c in arl if final is not None and c.get(key) is not None and c[key] >= final), None)
    return {"trl_final_ast_mean": final, "arl_final_ast_mean": arl[-1].get(key) if arl else None,
            "arl_best_ast_mean": max((c.get(key, 0.0) for c in arl), default=None),
            "arl_wall_to_trl_final_s": hit["wall_s"] if hit else None, "trl_wall_s": trl_wall,
            "ratio_arl_over_trl": round(hit["wall_s"] / trl_wall, 3) if hit and hit["wall_s"] and trl_wall else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=1200.0, help="each run's RL wall budget (default 1200)")
    ap.add_argument("--limit", type=int, default=10, help="held-out rows per category (default 10)")
    ap.add_argument("--root", default=None, help="default runs/bfcl_peer/seed<S>")
    ap.add_argument("--start", default=None, help="an SFT snapshot to start both from (default: made here)")
    ap.add_argument("--parts", default="arl,trl", help="which runs (default arl,trl)")
    ap.add_argument("--quick", action="store_true", help="2 rows per category, 2 SFT steps, 150 s budgets")
    args = ap.parse_args(argv)
    from arl.config import load_config

    limit, budget, sft_steps = (2, 150.0, 2) if args.quick else (args.limit, args.budget_s, 8)
    root = Path(args.root or f"runs/bfcl_peer/seed{args.seed}" + ("_quick" if args.quick else ""))
    root.mkdir(parents=True, exist_ok=True)
    common = ["logging.progress=false", f"env.eval_tasks={5 * limit}"] + (["sft.steps=2", "sft.episodes=16"]
                                                                         if args.quick else [])
    start = Path(args.start) if args.start else sft_start(root, args.seed, common, sft_steps)
    rl = [f"model.name_or_path={start}", "sft.enabled=false", f"seed={args.seed}", f"trainer.max_wall_s={budget}",
          *common]
    parts = set(args.parts.split(","))
    res = {"seed": args.seed, "budget_s": budget, "start": str(start), "limit_per_category": limit}
    if "arl" in parts:
        res["arl_run_s"] = sh([PY, "-m", "arl.train", "--config", CONFIG, f"output_dir={root / 'arl'}", *rl],
                              root / "arl.log")
        res["arl"] = arl_curve(root / "arl")
    if "trl" in parts:
        cfg = load_config(CONFIG, rl)
        spec = {"config": CONFIG, "overrides": rl, "start": str(start), "out": str(root / "trl"),
                "budget_s": budget, "max_steps": 10_000, "snap_every_s": budget / 4}
        res["trl_run_s"] = sh([PY, "bench/peer_trl_bfcl.py", "--spec", json.dumps(spec)], root / "trl.log")
        result = json.loads((root / "trl" / "result.json").read_text())
        res["trl"] = trl_curve(cfg, start, result, 5 * limit, root / "trl" / "transcripts")
        res["trl_wall_s"], res["trl_rows_left_out"] = result["wall_s"], result["rows_left_out"]
        res["trl_steps"] = max((s["step"] for s in result["steps"]), default=0)
    if "arl" in parts and "trl" in parts:
        res.update(compare(res["arl"], res["trl"], res["trl_wall_s"]))
    (root / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

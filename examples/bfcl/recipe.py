"""The BFCL recipe on SmolLM2-135M-Instruct, one command per seed (docs/bfcl.md):

    python -m examples.bfcl.recipe --seed 0 [--limit 10] [--root runs/bfcl_recipe] [key=value ...]
    python -m examples.bfcl.recipe --summarize runs/bfcl_recipe     # the table over the seeds run

1. base: ``python -m arl.eval --bench bfcl --split examples/bfcl/split.json --limit N`` on the model
   (greedy; once per root, every seed shares it: it has no seed);
2. SFT + RL: ``python -m arl.train --config examples/bfcl/config.yaml seed=S`` -- SFT on BFCL's
   ground truth of the train split (``BfclEnv.expert_turns``), then RL on the same rows with BFCL's
   checker as the reward; its held-out evaluation (the same rows as 1: the first N of each held-out
   category, greedy, BFCL's verdicts) runs after SFT (step 0, the SFT start) and every
   ``trainer.eval_every`` steps up to the last;
3. the summary, ``<root>/seed<S>/summary.json``: per category and held-out AST mean (live_simple,
   live_multiple, parallel, unweighted) for base, SFT and every evaluated RL step, and the wall time
   of each stage.  Run output stays under ``--root`` (git-ignored ``runs/``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from arl.env.bfcl.split import held_out_rows

HERE = Path(__file__).resolve().parent
SPLIT = "examples/bfcl/split.json"
CONFIG = "examples/bfcl/config.yaml"
MODEL = "models/smollm2-135m-instruct"
AST_HELD = ("live_simple", "live_multiple", "parallel")
# the episode limits of config.yaml, so that the base model's evaluation is the trained ones'
LIMITS = ["env.max_turns=1", "rollout.max_turn_tokens=160", "rollout.max_total_tokens=3072",
          "trainer.micro_batch_tokens=3072"]


def per_category(successes: dict, categories: list) -> dict:
    """``{category: accuracy}`` and the held-out AST mean from ``{category: [bool, ...]}``."""
    out = {c: sum(v) / len(v) for c, v in successes.items() if v}
    ast = [out[c] for c in AST_HELD if c in out]
    if ast:
        out["held_out_ast_mean"] = sum(ast) / len(ast)
    return {k: round(100 * v, 1) for k, v in out.items()}


def from_eval_json(path: Path) -> dict:
    doc = json.loads(path.read_text())
    succ: dict = {}
    for r in doc["rows"]:
        succ.setdefault(r["category"], []).append(bool(r["valid"]))
    return per_category(succ, list(succ))


def from_heldout(path: Path) -> dict:
    """A training run's held-out evaluation file: task i is the split's interleaved held-out row i."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    order = held_out_rows(SPLIT, interleave=True)
    succ: dict = {}
    for r in rows:
        succ.setdefault(order[r["task"] % len(order)]["category"], []).append(bool(r["success"]))
    return per_category(succ, list(succ))


def run(cmd: list, log: Path, cwd=None) -> float:
    t0 = time.monotonic()
    print("+ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
    if rc != 0:
        raise SystemExit(f"recipe: {' '.join(cmd[:4])} ... failed (exit {rc}); see {log}")
    return round(time.monotonic() - t0, 1)


def curve(run_dir: Path) -> dict:
    steps = sorted((int(p.stem.removeprefix("heldout_step")), p) for p in (run_dir / "transcripts").glob("heldout_step*.jsonl"))
    return {s: from_heldout(p) for s, p in steps}


def recipe(args) -> dict:
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / f"seed{args.seed}"
    walls = {}
    base = root / f"base_limit{args.limit}.json"
    if not base.is_file():
        walls["base_eval_s"] = run([sys.executable, "-m", "arl.eval", "--bench", "bfcl", "--model", MODEL, "--split", SPLIT,
                                    "--limit", str(args.limit), "--out", str(base), *LIMITS], root / "base_eval.log")
    walls["sft_rl_s"] = run([sys.executable, "-m", "arl.train", "--config", CONFIG, f"seed={args.seed}",
                             f"output_dir={run_dir}", f"env.eval_tasks={5 * args.limit}", *args.overrides],
                            root / f"seed{args.seed}.log")
    return summarize_seed(root, run_dir, args.limit, walls)


def summarize_seed(root: Path, run_dir: Path, limit: int, walls: dict) -> dict:
    steps = curve(run_dir)
    base = root / f"base_limit{limit}.json"
    summary = {"limit_per_category": limit, "split": SPLIT, "config": CONFIG,
               "base": from_eval_json(base) if base.is_file() else None,
               "sft": steps.get(0), "rl": steps[max(steps)] if steps else None,
               "rl_step": max(steps) if steps else None, "curve": steps, "wall": walls}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def table(summaries: list) -> str:
    cols = ["live_simple", "live_multiple", "parallel", "held_out_ast_mean", "irrelevance", "live_irrelevance"]
    lines = ["| row | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in ("base", "sft", "rl"):
        vals = [s[name] for s in summaries if s.get(name)]
        if not vals:
            continue
        cells = []
        for c in cols:
            xs = [v[c] for v in vals if c in v]
            cells.append("" if not xs else f"{statistics.mean(xs):.1f}" + (f" ({', '.join(f'{x:.0f}' for x in xs)})"
                                                                            if len(xs) > 1 and name != "base" else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.bfcl.recipe", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=10, help="held-out rows per category (default 10)")
    ap.add_argument("--root", default="runs/bfcl_recipe")
    ap.add_argument("--summarize", metavar="ROOT", help="print the table over ROOT's seed*/ runs and exit")
    ap.add_argument("overrides", nargs="*", help="arl.train overrides, e.g. trainer.steps=20")
    args = ap.parse_args(argv)
    if args.limit < 1:
        print(f"recipe: --limit must be >= 1, got {args.limit}", file=sys.stderr)
        return 2
    if args.summarize:
        root = Path(args.summarize)
        runs = sorted(p for p in root.glob("seed*") if (p / "transcripts").is_dir())
        summaries = [summarize_seed(root, p, args.limit, json.loads((p / "summary.json").read_text())["wall"]
                                    if (p / "summary.json").is_file() else {}) for p in runs]
        print(f"{len(summaries)} seed(s): {', '.join(p.name for p in runs)}")
        print(table(summaries))
        return 0
    print(table([recipe(args)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

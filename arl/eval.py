"""Evaluation only: ``python -m arl.eval --model DIR [--config X.yaml] [--tasks N] [--show N] [--out FILE] [key=value ...]``.

``--bench bfcl``: the Berkeley Function Calling Leaderboard instead (arl/eval_bfcl.py, docs/bfcl.md).

Greedy held-out success of the HF model in DIR (a run's ``hf/`` or ``checkpoints/step<N>/hf``, or
any HF directory with its tokenizer) on the config's environment, and one row per task: seed,
reward, success, model turns, tool calls and errors, fault.  It runs the training run's own engine
(``arl.rollout.worker.run_engine``) and episode code (``evaluate_tasks``, the held-out evaluation
behind ``success/heldout``), so a run's number and this one agree for the same weights and config.
``--out`` writes the rows as JSONL (``.jsonl``) or the summary and the rows as JSON (``.json``), each
with its transcript; ``--show N`` prints the first N transcripts (arl/rollout/transcript.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from . import eval_bfcl
from .config import ConfigError, TrainConfig, load_config
from .rollout.episode import ChatFormat
from .rollout.engine_args import check_engine_kwargs
from .rollout.transcript import format_transcript
from .rollout.worker import evaluate_tasks, run_engine, task_set

OUT_SUFFIXES = (".jsonl", ".json")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m arl.eval", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights, config.json and tokenizer)")
    ap.add_argument("--config", default=None, help="YAML config of the run (default: the built-in tiny CPU run)")
    ap.add_argument("--tasks", type=int, default=None, help="held-out tasks to run (default: env.eval_tasks)")
    ap.add_argument("--out", default=None, help="write the per-task rows: FILE.jsonl (rows) or FILE.json (summary + rows)")
    ap.add_argument("--show", type=int, default=0, metavar="N",
                    help="print the transcripts of the first N tasks (each turn's text, tool calls, observations, reward)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. env.max_turns=4")
    return ap.parse_args(argv)


def check_model_dir(path: str) -> str:
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--model: no such directory {path}")
    if not (p / "config.json").is_file():
        raise ValueError(f"--model: {path} has no config.json (expected an HF model directory, e.g. a run's hf/)")
    try:
        AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # transformers' reports run over many lines
        raise ValueError(f"--model: cannot load the tokenizer of {path} ({type(e).__name__})") from None
    return str(p)


def resolve(args) -> tuple:
    """The config, model directory, task count and output path of the command line; a bad one is
    a one-line ValueError (ConfigError) naming the option or key."""
    cfg = load_config(args.config, args.overrides)
    check_engine_kwargs(cfg.rollout.engine_kwargs)
    model_dir = check_model_dir(args.model)
    n = cfg.env.eval_tasks if args.tasks is None else args.tasks
    if n < 1:
        raise ValueError(f"--tasks: must be >= 1, got {n}" if args.tasks is not None else
                         "--tasks: env.eval_tasks is 0 in the config; give --tasks N")
    if args.show < 0:
        raise ValueError(f"--show: must be >= 0, got {args.show}")
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix not in OUT_SUFFIXES:
        raise ValueError(f"--out: {args.out} must end in .jsonl or .json")
    return cfg, model_dir, n, out


async def evaluate_model(cfg: TrainConfig, model_dir: str, n: int, engine=None, transcripts: bool = False) -> list:
    """The ``n`` held-out rows of the model in ``model_dir`` (``transcripts``: each with its
    ``transcript``).  Without ``engine`` one is started
    and shut down here before returning (vLLM's own finalizer at interpreter exit would print a
    traceback)."""
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    own = engine is None
    if own:
        engine = run_engine(cfg, model_dir, serve_adapters=False)  # an exported model: the adapters merged
    try:
        return await evaluate_tasks(engine, fmt, cfg, n, task_set(cfg), transcripts=transcripts)
    finally:
        if own:
            await engine.close()


def summarize(rows: list) -> dict:
    n = len(rows)
    wins = sum(r["success"] for r in rows)
    return {"tasks": n, "successes": wins, "success": wins / n if n else float("nan"),
            "reward_mean": sum(r["reward"] for r in rows) / n if n else float("nan"),
            "faults": sum(r["fault"] != "none" for r in rows)}


def render(rows: list, summary: dict, model_dir: str, cfg: TrainConfig, console: Optional[Console] = None) -> None:
    # piped output gets a table as wide as a terminal's would be, not 80 columns
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"held-out tasks: {model_dir} on {cfg.env.name}")
    for col in ("task", "seed", "reward", "success", "turns", "tool calls", "tool errors", "fault", "truncated"):
        table.add_column(col, justify="left" if col in ("fault", "truncated") else "right", no_wrap=True)
    for r in rows:
        table.add_row(str(r["task"]), str(r["seed"]), f"{r['reward']:.3g}", "yes" if r["success"] else "no",
                      str(r["turns"]), str(r["tool_calls"]), str(r["tool_errors"]), r["fault"], r["truncated"] or "-")
    console.print(table)
    console.print(f"held-out success: {summary['successes']}/{summary['tasks']} = {100 * summary['success']:.1f}%  "
                  f"(mean reward {summary['reward_mean']:.3g}, faults {summary['faults']})")
    reasons = Counter(r.get("fault_reason") or r["fault"] for r in rows if r["fault"] != "none")
    for why, k in reasons.most_common(5):  # what went wrong, not only that it did
        console.print(f"fault x{k}: {why}", markup=False, highlight=False)


def show(rows: list, k: int, file=None) -> None:
    """The transcripts of the first ``k`` rows, as plain text."""
    for r in rows[:k]:
        print(format_transcript(r), file=file or sys.stdout)


def write_out(path: Path, rows: list, summary: dict, model_dir: str, config: Optional[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        text = "".join(json.dumps(r) + "\n" for r in rows)
    else:
        text = json.dumps({"model": model_dir, "config": config, **summary, "rows": rows}, indent=1) + "\n"
    path.write_text(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--bench" or a.startswith("--bench=") for a in argv):  # a benchmark of its own
        return eval_bfcl.main(argv)
    args = parse_args(argv)
    try:
        cfg, model_dir, n, out = resolve(args)
    except (ConfigError, ValueError) as e:
        print(f"arl.eval: error: {e}", file=sys.stderr)
        return 2
    # vLLM logs to stdout at INFO by default: keep stdout for the table (a user's setting wins)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        rows = asyncio.run(evaluate_model(cfg, model_dir, n, transcripts=bool(args.show or out)))
    except RuntimeError as e:  # e.g. the reward function raised on every episode
        print(f"arl.eval: error: {e}", file=sys.stderr)
        return 1
    summary = summarize(rows)
    show(rows, args.show)
    render(rows, summary, model_dir, cfg)
    if out is not None:
        write_out(out, rows, summary, model_dir, args.config)
        print(f"arl.eval: rows in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

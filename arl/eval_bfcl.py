"""``python -m arl.eval --bench bfcl --model DIR [--categories a,b] [--split F] [--limit N] [--out F.json] [--show N]``

The Berkeley Function Calling Leaderboard on the model in DIR: BFCL's rows of each category played
greedily as ``bfcl`` episodes (arl/env/bfcl/) on arl's own engine and episode code (the vLLM
engine ``python -m arl.eval`` runs), each scored by BFCL's own checker; then BFCL's per-category
accuracy and the leaderboard's aggregate columns, computed by BFCL's own ``calculate_*``
functions over the categories that were run (docs/bfcl.md):

  non-live AST   unweighted mean of simple_python, multiple, parallel, parallel_multiple
  live AST       mean weighted by rows of live_simple, live_multiple, live_parallel, live_parallel_multiple
  irrelevance    unweighted mean of irrelevance, live_irrelevance
  multi-turn     unweighted mean of the multi_turn_* categories

The tool-call format follows the model family (Llama 3 chat templates: ``llama3_json``; SmolLM2,
Qwen and the rest: ``hermes``); ``env.tool_parser=NAME`` overrides it.  A row whose checker
raised is marked (``checker_error``), counted and scored wrong; the run goes on.  ``--split FILE``
(examples/bfcl/split.json) plays the file's held-out rows instead of BFCL's first ones: its seeded
order of each held-out category, the first N with ``--limit``.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from .config import ConfigError, TrainConfig, load_config
from .env import env_kwargs, make_env
from .env.bfcl import AST, IRRELEVANCE, MULTI_TURN, bfcl, check_categories, load_entries
from .env.bfcl.split import held_out_rows, load_split
from .env.door import prompt_mismatch
from .env.vllm_parsers import make_parser
from .rollout.episode import ChatFormat, run_episode
from .rollout.transcript import format_transcript, transcript
from .rollout.worker import episode_config, run_engine

DEFAULT_CATEGORIES = "simple_python,live_simple,irrelevance"
# generous limits: BFCL's prompts carry every function doc (live_multiple's run to thousands of
# tokens) and a multi-turn task takes several model turns per user turn; a user's overrides win
DEFAULTS = ["env.name=bfcl", "env.kwargs={}", "env.max_turns=24", "env.pool_size=8",
            "rollout.max_turn_tokens=256", "rollout.max_total_tokens=8000",
            "trainer.micro_batch_tokens=8192"]  # (an eval trains nothing; the config asks that a trajectory could be packed)
PROBE_TOOL = {"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}
AGGREGATES = {  # column -> (its categories, BFCL's way of averaging them)
    "non-live AST": (("simple_python", "multiple", "parallel", "parallel_multiple"), "unweighted"),
    "live AST": (("live_simple", "live_multiple", "live_parallel", "live_parallel_multiple"), "weighted"),
    "irrelevance": (IRRELEVANCE, "unweighted"),
    "multi-turn": (MULTI_TURN, "unweighted"),
}
assert set(AST) <= {c for cats, _ in AGGREGATES.values() for c in cats}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m arl.eval --bench bfcl", description=__doc__.splitlines()[0])
    ap.add_argument("--bench", required=True, choices=["bfcl"])
    ap.add_argument("--model", required=True, help="HF model directory (weights, config.json and tokenizer)")
    ap.add_argument("--categories", default=None,
                    help=f"comma-separated (default {DEFAULT_CATEGORIES}; with --split, its held-out ones)")
    ap.add_argument("--split", default=None, help="a split file (examples/bfcl/split.json): its held-out rows")
    ap.add_argument("--limit", type=int, default=None, help="the first N rows of each category (default: all)")
    ap.add_argument("--config", default=None, help="YAML config for the engine and limits (default: the built-in CPU one)")
    ap.add_argument("--out", default=None, help="write the summary, the rows and their transcripts to FILE.json")
    ap.add_argument("--show", type=int, default=0, metavar="N", help="print the transcripts of the first N rows")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.max_turn_tokens=128")
    return ap.parse_args(argv)


def default_parser(tokenizer) -> str:
    """The tool-call format of the model family: Llama 3.x templates write ``llama3_json`` calls;
    SmolLM2 (whose template renders no tools: arl's Hermes fallback), Qwen and Hermes models ``hermes``."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    return "llama3_json" if "<|start_header_id|>" in template else "hermes"


def resolve(args) -> tuple:
    """Config, model directory, categories and output path; a bad one is a one-line ValueError."""
    bfcl()  # bfcl-eval missing: one line, before any engine starts
    if args.categories is None:
        args.categories = ",".join(load_split(args.split)["held_out"]) if args.split else DEFAULT_CATEGORIES
    categories = check_categories(args.categories)
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit: must be >= 1, got {args.limit}")
    if args.show < 0:
        raise ValueError(f"--show: must be >= 0, got {args.show}")
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix != ".json":
        raise ValueError(f"--out: {args.out} must end in .json")
    p = Path(args.model)
    if not (p / "config.json").is_file():
        raise ValueError(f"--model: {args.model} is not an HF model directory (no config.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # transformers' reports run over many lines
        raise ValueError(f"--model: cannot load the tokenizer of {args.model} ({type(e).__name__})") from None
    cfg = load_config(args.config, DEFAULTS + [f"env.kwargs.categories={json.dumps(categories)}"] + args.overrides)
    if cfg.env.tool_parser is None:
        cfg.env.tool_parser = default_parser(tok)
    wrong = prompt_mismatch(make_parser(cfg.env.tool_parser, tok), ChatFormat(tok).supports_tools, [PROBE_TOOL])
    if wrong:  # a template that renders no tools gets the Hermes block: a parser must read what it teaches
        raise ValueError(wrong)
    return cfg, str(p), categories, out


def row_of(entry: dict, env, t) -> dict:
    """One BFCL row's outcome: BFCL's verdict (``valid``, ``error_type``), how the episode ended."""
    m = t.metadata
    v = env.verdict
    checker_error = bool(v and v["error_type"] == "arl:checker_exception")
    if v is None:  # the episode ended before the env scored it (token or turn limit, a fault)
        why = m.get("truncated") or m.get("fault_reason") or m.get("fault")
        v = {"valid": False, "error_type": f"arl:ended:{why}", "error": m.get("fault_reason")}
    return {"id": entry["id"], "category": entry["category"], "valid": bool(v["valid"]) and not checker_error,
            "error_type": v["error_type"], "error": str(v["error"])[:300] if v.get("error") else None,
            "checker_error": checker_error, "reward": float(t.reward), "turns": len(t.turns),
            "tool_calls": int(m.get("tool_calls", 0)), "tool_errors": int(m.get("tool_errors", 0)),
            "fault": m.get("fault", "none"), "truncated": m.get("truncated")}


async def run_rows(engine, fmt: ChatFormat, cfg: TrainConfig, model_dir: str, entries: list,
                   transcripts: bool = False) -> list:
    """Every entry played greedily as a ``bfcl`` episode, rows in the entries' order."""
    kwargs, ep_cfg = env_kwargs(cfg.env, model_dir), episode_config(cfg, greedy=True)
    sem = asyncio.Semaphore(cfg.env.pool_size)

    async def one(i, entry):
        async with sem:
            env = make_env(cfg.env.name, **kwargs)
            try:
                t = await run_episode(engine, env, fmt, i, ep_cfg, task=entry)
                row = row_of(entry, env, t)
            finally:
                await env.close()
            if transcripts:
                row["transcript"] = transcript(fmt, t)
            return row

    return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(entries))))


def summarize(rows: list, categories: list) -> dict:
    """Per category and per aggregate column, BFCL's accuracy dicts (``accuracy``, ``total_count``)."""
    b = bfcl()
    per = {}
    for c in categories:
        mine = [r for r in rows if r["category"] == c]
        n = len(mine)
        acc = sum(r["valid"] for r in mine) / n if n else 0.0
        per[c] = {"accuracy": acc, "total_count": n, "display_accuracy": acc, "correct": sum(r["valid"] for r in mine),
                  "checker_errors": sum(r["checker_error"] for r in mine),
                  "ended_early": sum(r["error_type"].startswith("arl:ended:") for r in mine)}
    agg = {}
    for col, (cats, how) in AGGREGATES.items():
        have = [per[c] for c in cats if c in per]
        if have:
            fn = b.calculate_weighted_accuracy if how == "weighted" else b.calculate_unweighted_accuracy
            res = fn(have, display_na_if_category_missing=False)
            agg[col] = {"accuracy": res["accuracy"], "total_count": res["total_count"],
                        "categories": [c for c in cats if c in per], "of": list(cats)}
    return {"categories": per, "aggregates": agg, "rows": len(rows),
            "checker_errors": sum(r["checker_error"] for r in rows)}


def render(summary: dict, model_dir: str, console: Optional[Console] = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"BFCL: {model_dir}")
    for col in ("category", "rows", "correct", "accuracy", "checker errors", "ended early"):
        table.add_column(col, justify="left" if col == "category" else "right", no_wrap=True)
    for c, s in summary["categories"].items():
        table.add_row(c, str(s["total_count"]), str(s["correct"]), f"{100 * s['accuracy']:.1f}%",
                      str(s["checker_errors"]), str(s["ended_early"]))
    console.print(table)
    for col, a in summary["aggregates"].items():
        part = "" if a["categories"] == a["of"] else f" (over {', '.join(a['categories'])} of {', '.join(a['of'])})"
        console.print(f"{col}: {100 * a['accuracy']:.1f}%{part}", markup=False, highlight=False)
    if "wall_s" in summary:
        console.print(f"{summary['rows']} rows in {summary['wall_s']:.0f} s (engine start included)")
    if summary["checker_errors"]:
        console.print(f"checker errors: {summary['checker_errors']} rows (marked checker_error, scored wrong)")


def show(rows: list, k: int, file=None) -> None:
    for r in rows[:k]:
        verdict = "valid" if r["valid"] else f"invalid ({r['error_type']}: {r['error']})"
        print(f"=== {r['id']} ({r['category']}): BFCL {verdict}", file=file or sys.stdout)
        print(format_transcript(r["transcript"]), file=file or sys.stdout)


async def evaluate(cfg: TrainConfig, model_dir: str, entries: list, transcripts: bool) -> list:
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model_dir))
    engine = run_engine(cfg, model_dir, serve_adapters=False)
    try:
        return await run_rows(engine, fmt, cfg, model_dir, entries, transcripts)
    finally:
        await engine.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg, model_dir, categories, out = resolve(args)
        entries = (held_out_rows(args.split, categories, args.limit) if args.split
                   else load_entries(categories, args.limit))
    except (ConfigError, ValueError) as e:
        print(f"arl.eval: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep stdout for the table
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    t0 = time.monotonic()
    rows = asyncio.run(evaluate(cfg, model_dir, entries, transcripts=bool(args.show or out)))
    summary = dict(summarize(rows, categories), wall_s=round(time.monotonic() - t0, 1))
    show(rows, args.show)
    render(summary, model_dir)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"model": model_dir, "bench": "bfcl", "bfcl_eval": "2026.3.23", "limit": args.limit, "split": args.split,
               "tool_parser": cfg.env.tool_parser, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": f"{platform.machine()}, {os.cpu_count()} cores", **summary, "rows": rows}
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"arl.eval: rows in {out}")
    return 0

"""Writes examples/bfcl/split.json, the train/held-out split of BFCL the recipe uses
(arl/env/bfcl/split.py says how it is made; deterministic in --seed):

    python -m examples.bfcl.make_split            # rewrites split.json (seed 0)
    python -m examples.bfcl.make_split --check    # exits 1 if split.json differs from a fresh one
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arl.env.bfcl.split import make_split

HERE = Path(__file__).resolve().parent


def render(doc: dict) -> str:
    # one id per line: reviewable diffs, still a small file
    return json.dumps(doc, indent=1) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.bfcl.make_split", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "split.json"))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    text = render(make_split(args.seed))
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'differs from a fresh split'}")
        return 0 if same else 1
    out.write_text(text)
    doc = json.loads(text)
    print(f"{out}: {len(doc['train'])} train rows ({doc['irrelevance_rows']} irrelevance-style), held out: "
          + ", ".join(f"{c} {len(v)}" for c, v in doc["held_out"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

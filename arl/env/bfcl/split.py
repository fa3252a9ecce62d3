"""A train/held-out split of BFCL that tests generalisation (``examples/bfcl/split.json``).

* **held out**: whole categories never trained on.  ``HELD_OUT`` (live_simple, live_multiple,
  parallel, irrelevance, live_irrelevance) are the evaluated ones: the file lists, per category, a
  seeded order of its rows (the first ``EVAL_ROWS``), so ``--limit N`` evaluates the first N, a
  random sample.  Every other category (live_parallel, live_parallel_multiple, the multi-turn ones)
  is not trained on either (``not_trained``).
* **train**: the rows of ``TRAIN_CATEGORIES`` (simple_python, multiple, parallel_multiple) none of
  whose functions is named in any row of any other category, so no function the policy trains on
  appears in a held-out row (tests/test_bfcl_split.py checks the file).
* **irrelevance-style train rows**, ``"A|B"``: the question of train row A with the function docs
  of train row B (no function name in common): the right answer calls nothing, as in BFCL's
  irrelevance categories, which are held out.  Without them a policy that always calls a function
  would be rewarded everywhere in training and lose the irrelevance categories.
"""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any, Dict, List, Sequence

from .loader import CATEGORIES, kind, load_entries

TRAIN_CATEGORIES = ("simple_python", "multiple", "parallel_multiple")
HELD_OUT = ("live_simple", "live_multiple", "parallel", "irrelevance", "live_irrelevance")
EVAL_ROWS = 60  # held-out rows listed per category (the recipe evaluates fewer: docs/bfcl.md)
PAIR = "|"


def _names(row: Dict[str, Any]) -> set:
    return {d["name"] for d in row["function"]}


def category_of(row_id: str) -> str:
    """A BFCL row id's category (``live_simple_3-2-1`` -> ``live_simple``): what BFCL derives it from."""
    return row_id.rsplit("_", 1)[0]


def make_split(seed: int = 0, irrelevance_frac: float = 0.2) -> Dict[str, Any]:
    """The split, deterministic in ``seed`` (``examples/bfcl/make_split.py`` writes it)."""
    rng = random.Random(seed)
    others = [c for c in CATEGORIES if c not in TRAIN_CATEGORIES]
    seen = set().union(*(_names(r) for r in load_entries(others, copy_rows=False)))
    train = [r for r in load_entries(list(TRAIN_CATEGORIES), copy_rows=False) if not (_names(r) & seen)]
    ids = [r["id"] for r in train]
    by_id = {r["id"]: r for r in train}
    pairs: List[str] = []
    while len(pairs) < round(irrelevance_frac * len(ids)):
        a, b = rng.sample(ids, 2)
        if not (_names(by_id[a]) & _names(by_id[b])) and f"{a}{PAIR}{b}" not in pairs:
            pairs.append(f"{a}{PAIR}{b}")
    order = ids + pairs
    rng.shuffle(order)
    held = {}
    for c in HELD_OUT:
        rows = [r["id"] for r in load_entries([c], copy_rows=False)]
        rng.shuffle(rows)
        held[c] = rows[:EVAL_ROWS]
    return {"bfcl_eval": "2026.3.23", "seed": seed, "train_categories": list(TRAIN_CATEGORIES),
            "not_trained": [c for c in others if c not in HELD_OUT], "irrelevance_rows": len(pairs),
            "train": order, "held_out": held}


@functools.lru_cache(maxsize=8)
def _read(path: str) -> Dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"bfcl: split file {path} not found (python -m examples.bfcl.make_split writes one)")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"bfcl: split file {path}: not JSON ({e})") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("train"), list) and isinstance(doc.get("held_out"), dict)):
        raise ValueError(f"bfcl: split file {path}: needs a 'train' list and a 'held_out' mapping")
    for c in doc["held_out"]:
        if c not in CATEGORIES:
            raise ValueError(f"bfcl: split file {path}: unknown held-out category {c!r}")
    return doc


def load_split(path: str) -> Dict[str, Any]:
    return _read(str(path))


@functools.lru_cache(maxsize=None)
def _index(category: str) -> Dict[str, Dict[str, Any]]:
    return {r["id"]: r for r in load_entries([category], copy_rows=False)}


def row(row_id: str) -> Dict[str, Any]:
    """BFCL's row ``row_id`` (shared, read-only), or an irrelevance-style ``"A|B"`` row."""
    if PAIR in row_id:
        a, b = (row(x) for x in row_id.split(PAIR))
        return {"id": row_id, "category": "irrelevance", "question": a["question"], "function": b["function"]}
    c = category_of(row_id)
    try:
        return _index(c)[row_id]
    except (KeyError, ValueError):
        raise ValueError(f"bfcl: unknown row id {row_id!r}") from None


def train_rows(path: str) -> List[Dict[str, Any]]:
    return [row(i) for i in load_split(path)["train"]]


def held_out_rows(path: str, categories: Sequence[str] | None = None, limit: int | None = None,
                  interleave: bool = False) -> List[Dict[str, Any]]:
    """The split's held-out rows of ``categories`` (default: all of the file's), the first ``limit``
    of each; ``interleave``: round robin over the categories (so any prefix covers all of them)."""
    held = load_split(path)["held_out"]
    cats = list(held) if categories is None else list(categories)
    for c in cats:
        if c not in held:
            raise ValueError(f"bfcl: category {c!r} is not held out in {path}; held out: {', '.join(held)}")
    per = [[row(i) for i in held[c][:limit]] for c in cats]
    if not interleave:
        return [r for rows in per for r in rows]
    return [rows[k] for k in range(max(map(len, per), default=0)) for rows in per if k < len(rows)]


def train_kind_counts(path: str) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for r in train_rows(path):
        out[kind(r["category"])] = out.get(kind(r["category"]), 0) + 1
    return out

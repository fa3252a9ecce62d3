"""Tasks from data: the rows of a dataset file as the environment's tasks, split into train and
held-out rows, handed out in a seeded order that a resumed run continues exactly.

A row is a JSON object with ``prompt`` (a non-empty string) or ``messages`` (a non-empty list of
``{role, content}``); its other keys (ground truth, metadata) reach the env and the reward function
untouched.  Formats, by name: ``.jsonl``/``.ndjson`` (one object a line, blank lines ignored),
``.json`` (an array of objects, or JSON lines), ``.parquet``, a directory written by HF
``datasets``' ``save_to_disk``, or anything ``datasets.load_dataset`` reads, as ``hf:<id or
folder>[:config][@split]`` (arl/data/task_files.py).  A bad row is named by ``line <n>`` (1-based,
as an editor shows it) or, in an array/columnar file, ``row <n>`` (0-based, as ``ds[n]``).

Rows are identified by their position among the valid rows of their file (``train_index``,
``eval_ids``): the positions live beside the rows, not in them, so what the env sees is the row as
written.  Task seeds: train seed ``s`` is position ``s % n_train`` of epoch ``s // n_train``, whose
order is a permutation seeded by ``(seed, epoch)``: a pure function of the seed, so a run resumed at
any task seed continues exactly.  Seeds from ``EVAL_SEED_BASE`` on are the held-out rows.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..config import EVAL_SEED_BASE, DatasetConfig  # noqa: F401 (re-exported; below env and data, read by both)
from .task_files import Record, json_type as _json_type, records as _records

ROLES = ("system", "user", "assistant", "tool")
MAX_SKIP_REASONS = 5  # skipped rows keep the first few reasons for the log
_SPLIT, _EPOCH = 0, 1  # the two uses of the seed, so the split and the epoch orders are independent

# ----------------------------------------------------------------------------- checking rows

def _messages_problem(msgs: Any) -> Optional[str]:
    if not isinstance(msgs, list) or not msgs:
        got = f"an empty {_json_type(msgs)}" if msgs == [] else f"a JSON {_json_type(msgs)}"
        return f"'messages' must be a non-empty list of {{role, content}} (got {got})"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object (got a JSON {_json_type(m)})"
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            return f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}"
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue  # a message that only calls tools
        if not isinstance(content, str):
            return f"messages[{i}].content must be a string (got a JSON {_json_type(content)})"
    return None


def task_problem(row: Any) -> Optional[str]:
    """What is wrong with ``row`` as a task, or None.  A null ``prompt``/``messages`` counts as absent
    (columnar files store the one a row lacks as null)."""
    if not isinstance(row, dict):
        return f"not a JSON object (got a JSON {_json_type(row)})"
    prompt, msgs = row.get("prompt"), row.get("messages")
    if prompt is None and msgs is None:
        keys = sorted(map(str, row))
        shown = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "") if keys else "none"
        return f"needs 'prompt' (a string) or 'messages' (a list of {{role, content}}); its keys: {shown}"
    if prompt is not None and msgs is not None:
        return "has both 'prompt' and 'messages' (keep one)"
    if prompt is not None:
        if not isinstance(prompt, str):
            return f"'prompt' must be a string (got a JSON {_json_type(prompt)})"
        return None if prompt.strip() else "'prompt' is empty"
    return _messages_problem(msgs)


def _prompt_key(row: dict) -> str:
    """What the model is shown, canonically: a prompt and the same text as one user message match."""
    msgs = [{"role": "user", "content": row["prompt"]}] if row.get("prompt") is not None else row["messages"]
    return json.dumps([[m.get("role"), m.get("content")] for m in msgs], ensure_ascii=False)


@dataclass
class Rows:
    """The valid task rows of one source, each with where it came from (``where[i]``: "line 7")."""

    source: str  # the file, for messages
    rows: list[dict]
    where: list[str]
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)


def _collect(records: Iterable[Record], source: str, key: str, bad_rows: str) -> Rows:
    if bad_rows not in ("fail", "skip"):
        raise ValueError(f"{key}.bad_rows: {bad_rows!r} is not 'fail' or 'skip'")
    out = Rows(source, [], [])
    for where, obj, problem in records:
        problem = problem or task_problem(obj)
        if problem is None:
            out.rows.append(obj)
            out.where.append(where)
        elif bad_rows == "fail":
            raise ValueError(f"{key}: {source} {where}: {problem}")
        else:
            out.skipped += 1
            if len(out.skip_reasons) < MAX_SKIP_REASONS:
                out.skip_reasons.append(f"{source} {where}: {problem}")
    if not out.rows:
        if out.skipped:
            raise ValueError(f"{key}: {source}: no valid rows ({out.skipped} bad; first: {out.skip_reasons[0]})")
        raise ValueError(f"{key}: {source}: no rows")
    return out


def read_tasks(path: str, key: str = "env.dataset", bad_rows: str = "fail") -> Rows:
    """The task rows of the file (or saved-dataset directory) at ``path``.  A bad row fails with
    ``<key>: <path> line <n>: <what is wrong>``, or with ``bad_rows="skip"`` is counted in
    ``skipped`` (first reasons in ``skip_reasons``); no valid row at all always fails."""
    return _collect(_records(str(path), key), str(path), key, bad_rows)


# ----------------------------------------------------------------------------- the task set

def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([w % 2**64 for w in words]))


class TaskSet:
    """Train and held-out rows, and the seeded order the train rows are handed out in.

    ``train_ids`` / ``eval_ids`` index ``rows`` (the valid rows of the main file); with a separate
    eval file ``eval_ids`` is None and ``eval_row(i)`` is that file's i-th valid row.  Otherwise the
    held-out rows are a seeded draw of ``round(eval_fraction * n)`` rows (at least one when the
    fraction is > 0 and n >= 2), in the draw's order, so the first k are a random sample.  A train row
    whose prompt equals a held-out row's is dropped (counted in ``overlap``): eval rows are never
    trained on, not even as a duplicate line.
    """

    def __init__(self, data: Rows, seed: int = 0, *, eval_data: Optional[Rows] = None, eval_fraction: float = 0.1,
                 shuffle: bool = True, key: str = "env.dataset"):
        if not 0 <= eval_fraction < 1:
            raise ValueError(f"{key}.eval_fraction: {eval_fraction} must be in [0, 1)")
        self.seed, self.shuffle, self.eval_fraction = int(seed), bool(shuffle), float(eval_fraction)
        self.source = data.source
        self.eval_source = eval_data.source if eval_data is not None else None
        self.rows, self._where = data.rows, data.where
        self.skipped = data.skipped + (eval_data.skipped if eval_data else 0)
        self.skip_reasons = (data.skip_reasons + (eval_data.skip_reasons if eval_data else []))[:MAX_SKIP_REASONS]
        n = len(self.rows)
        if eval_data is not None:
            self.eval_ids: Optional[np.ndarray] = None
            self._eval, self._eval_where = eval_data.rows, [f"{eval_data.source} {w}" for w in eval_data.where]
            candidates = np.arange(n)
        else:
            n_eval = round(eval_fraction * n)
            if eval_fraction > 0 and n >= 2:
                n_eval = max(1, n_eval)
            perm = _rng(self.seed, _SPLIT).permutation(n)
            self.eval_ids = perm[:n_eval]
            self._eval = [self.rows[i] for i in self.eval_ids]
            self._eval_where = [f"{self.source} {self._where[i]}" for i in self.eval_ids]
            candidates = np.sort(perm[n_eval:])
        held_out = {_prompt_key(r) for r in self._eval}
        kept = [i for i in candidates if _prompt_key(self.rows[i]) not in held_out]
        self.train_ids = np.array(kept, dtype=np.int64)
        self.overlap = len(candidates) - len(self.train_ids)
        if not len(self.train_ids):
            why = f"{len(self._eval)} held out"
            if self.overlap:
                why += f", {self.overlap} more share a held-out prompt"
            raise ValueError(f"{key}: {self.source}: no training rows left of {n} ({why})")
        self._orders: dict[int, np.ndarray] = {}

    @classmethod
    def from_config(cls, cfg: DatasetConfig, seed: int) -> "TaskSet":
        """Read ``cfg.path`` (and ``cfg.eval_path``) and split; every error is one line."""
        data = read_tasks(cfg.path, "env.dataset", cfg.bad_rows)
        eval_data = read_tasks(cfg.eval_path, "env.dataset", cfg.bad_rows) if cfg.eval_path else None
        return cls(data, seed, eval_data=eval_data, eval_fraction=cfg.eval_fraction, shuffle=cfg.shuffle)

    @classmethod
    def from_rows(cls, rows: Sequence[dict], seed: int = 0, *, eval_rows: Optional[Sequence[dict]] = None,
                  eval_fraction: float = 0.1, shuffle: bool = True) -> "TaskSet":
        """Tasks made in memory (rows checked as a file's would be, ``bad_rows="fail"``)."""
        def rows_of(rs, name):
            return _collect(((f"row {i}", r, None) for i, r in enumerate(rs)), name, "tasks", "fail")
        return cls(rows_of(rows, "rows"), seed, eval_data=rows_of(eval_rows, "eval_rows") if eval_rows is not None
                   else None, eval_fraction=eval_fraction, shuffle=shuffle, key="tasks")

    @property
    def n_train(self) -> int:
        return len(self.train_ids)

    @property
    def n_eval(self) -> int:
        return len(self._eval)

    def _order(self, epoch: int) -> np.ndarray:
        order = self._orders.get(epoch)
        if order is None:
            order = _rng(self.seed, _EPOCH, epoch).permutation(self.n_train)
            if len(self._orders) >= 4:  # tasks in flight straddle at most an epoch boundary or two
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return order

    def train_index(self, task_seed: int) -> int:
        """Position in ``rows`` of the row train task seed ``task_seed`` gets."""
        if task_seed < 0:
            raise ValueError(f"task seed {task_seed} must be >= 0")
        epoch, pos = divmod(int(task_seed), self.n_train)
        return int(self.train_ids[self._order(epoch)[pos] if self.shuffle else pos])

    def train_row(self, task_seed: int) -> dict:
        """The train row of ``task_seed`` (a copy: an env may change it freely)."""
        return copy.deepcopy(self.rows[self.train_index(task_seed)])

    def eval_row(self, i: int) -> dict:
        """The i-th held-out row (a copy), ``0 <= i < n_eval``."""
        if not 0 <= i < self.n_eval:
            raise IndexError(f"eval row {i} out of range: {self.n_eval} held-out rows")
        return copy.deepcopy(self._eval[i])

    def row(self, task_seed: int) -> dict:
        """The row of any task seed: ``EVAL_SEED_BASE + i`` is eval row i, smaller seeds train."""
        return self.eval_row(task_seed - EVAL_SEED_BASE) if task_seed >= EVAL_SEED_BASE else self.train_row(task_seed)

    def origin(self, task_seed: int) -> str:
        """Where the row of ``task_seed`` comes from ("tasks.jsonl line 7"), for messages about it."""
        if task_seed >= EVAL_SEED_BASE:
            self.eval_row(task_seed - EVAL_SEED_BASE)  # the range check
            return self._eval_where[task_seed - EVAL_SEED_BASE]
        return f"{self.source} {self._where[self.train_index(task_seed)]}"

    def describe(self) -> str:
        """One line for the log: the counts, where the held-out rows come from, what was dropped."""
        held = (f"from {self.eval_source}" if self.eval_source is not None
                else f"{self.eval_fraction:g} of it, seed {self.seed}")
        s = f"tasks: {self.source}: {self.n_train} train, {self.n_eval} held out ({held})"
        if self.overlap:
            s += f"; {self.overlap} train rows dropped (same prompt as a held-out row)"
        if self.skipped:
            s += f"; {self.skipped} bad rows skipped (first: {self.skip_reasons[0]})"
        return s

    def __repr__(self) -> str:
        return (f"TaskSet(n_train={self.n_train}, n_eval={self.n_eval}, skipped={self.skipped}, "
                f"overlap={self.overlap})")


# ----------------------------------------------------------------------------- demonstrations

def _tool_call(tc: Any, at: str) -> tuple[Optional[dict], Optional[str]]:
    """``{"name", "arguments": dict}`` from the simple shape or OpenAI's ``{"type": "function",
    "function": {"name", "arguments": dict | JSON string}}``."""
    if not isinstance(tc, dict):
        return None, f"{at} must be an object (got a JSON {_json_type(tc)})"
    if "function" in tc:
        fn = tc["function"]
        if not isinstance(fn, dict):
            return None, f"{at}.function must be an object (got a JSON {_json_type(fn)})"
        at, name, args = f"{at}.function", fn.get("name"), fn.get("arguments")
    else:
        name, args = tc.get("name"), tc.get("arguments")
    if not isinstance(name, str) or not name:
        return None, f"{at}.name must be a non-empty string"
    if args is None:
        args = {}  # a call without arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"{at}.arguments is not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return None, f"{at}.arguments must be an object (got a JSON {_json_type(args)})"
    return {"name": name, "arguments": args}, None


def _demonstration(row: Any) -> tuple[Optional[list[dict]], Optional[str]]:
    if not isinstance(row, dict):
        return None, f"not a JSON object (got a JSON {_json_type(row)})"
    if "messages" not in row:
        return None, "needs 'messages' (a list of {role, content})"
    problem = _messages_problem(row["messages"])
    if problem:
        return None, problem
    out = []
    for i, m in enumerate(row["messages"]):
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""  # a tool-calls-only assistant message: content is always a string after loading
        calls = m.pop("tool_calls", None)  # null and [] mean no calls: dropped, as templates test for the key
        if calls is not None and calls != []:
            if m["role"] != "assistant" or not isinstance(calls, list):
                return None, f"messages[{i}].tool_calls must be a list on an assistant message"
            m["tool_calls"] = []
            for j, tc in enumerate(calls):
                call, problem = _tool_call(tc, f"messages[{i}].tool_calls[{j}]")
                if problem:
                    return None, problem
                m["tool_calls"].append(call)
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        return None, "no assistant message (nothing to learn from)"
    return out, None


def load_demonstrations(path: str, key: str = "sft.dataset") -> list[list[dict]]:
    """Chat conversations for SFT from a file of ``{"messages": [...]}`` rows (the formats tasks
    take); assistant ``tool_calls`` come back as ``[{"name", "arguments": dict}]`` whichever of the
    two shapes the file used.  Any bad row fails with ``<key>: <path> line <n>: <what is wrong>``."""
    demos = []
    for where, row, problem in _records(str(path), key):
        msgs, problem = (None, problem) if problem else _demonstration(row)
        if problem:
            raise ValueError(f"{key}: {path} {where}: {problem}")
        demos.append(msgs)
    if not demos:
        raise ValueError(f"{key}: {path}: no demonstrations")
    return demos

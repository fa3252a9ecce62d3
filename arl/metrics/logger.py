"""Per-step metrics sink: one JSON line per step, TensorBoard scalars, a console progress bar and,
when configured, a Weights & Biases run (``arl.metrics.wandb_run``).

Files in ``run_dir``: ``metrics.jsonl`` (``{"step": s, "wall_s": w, **metrics}`` per line, flushed
and fsync'ed per line), ``tb/`` (TensorBoard events) and ``wandb/``.  Call it from one process (rank 0).

Resume policy.  ``resume_step=s`` keeps the JSONL lines with ``step <= s`` (the steps the checkpoint
holds) and drops the rest, which the resumed run recomputes; a torn last line from a crash is dropped
too.  TensorBoard gets ``purge_step=s + 1`` so its curves are cut the same way.  ``resume_step=None``
is a fresh run: an existing ``metrics.jsonl`` is started over.

Progress bar (tqdm, stderr): counts logged steps against ``total_steps`` and shows the first metric
found for each label of ``progress_keys`` (reward, success, held-out success, kl, clip fraction).

Values: numbers (Python, numpy or 0-d torch), bools (logged as 0/1) and nested dicts (flattened with
"/").  Non-finite numbers are written as JSON ``null``, left out of TensorBoard, and reported once per
key as a ``RuntimeWarning``.  Anything else is a ValueError naming the key.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import warnings
from pathlib import Path
from typing import Mapping, Optional, Sequence

from ..config import WandbConfig
from .wandb_run import WandbRun

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"

# progress-bar label -> metric names looked for, first match wins (a key matches a name when it is
# the name or ends with "/" + name, so "loss/clip_frac" matches "clip_frac")
DEFAULT_PROGRESS = {
    "reward": ("reward/mean", "rollout/reward_mean"),
    "success": ("success/train",),
    "heldout": ("success/heldout",),
    "kl": ("approx_kl", "kl_mean"),
    "clip": ("clip_frac",),
}


def flatten(metrics: Mapping, prefix: str = "") -> dict:
    """Nested dicts -> one level with "/"-joined keys; values converted to int/float/None."""
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"metrics: key {k!r} is not a non-empty string")
        key = prefix + k
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "/"))
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # numpy / torch scalars
            v = v.item()
        if isinstance(v, bool):
            v = int(v)
        if v is None:
            out[key] = None
        elif isinstance(v, numbers.Integral):
            out[key] = int(v)
        elif isinstance(v, numbers.Real):
            out[key] = float(v)
        else:
            raise ValueError(f"metrics[{key!r}]: expected a number, got {type(v).__name__}")
    return out


def find_metric(metrics: Mapping, names: Sequence[str]):
    """First key of ``metrics`` matching one of ``names`` (exactly or as a "/"-suffix), else None."""
    for name in names:
        if name in metrics:
            return name
        for k in metrics:
            if k.endswith("/" + name):
                return k
    return None


def read_metrics(path) -> list:
    """Records of a metrics.jsonl; a torn (unparsable) last line is skipped, a torn middle line is an error."""
    path = Path(path)
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            raise ValueError(f"{path}: line {i + 1} has no integer 'step'")
        out.append(rec)
    return out


class MetricsLogger:
    def __init__(self, run_dir, jsonl: bool = True, tensorboard: bool = True, progress: bool = True,
                 total_steps: Optional[int] = None, resume_step: Optional[int] = None,
                 progress_keys: Optional[Mapping[str, Sequence[str]]] = None, wandb: Optional[WandbConfig] = None,
                 run_config: Optional[Mapping] = None):
        """``wandb``: the W&B run's settings (None: off); ``run_config``: the run's config it records."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if total_steps is not None and total_steps < 0:
            raise ValueError(f"MetricsLogger: total_steps must be >= 0, got {total_steps}")
        self.last_step = -1 if resume_step is None else int(resume_step)
        self.progress_keys = dict(progress_keys or DEFAULT_PROGRESS)
        self._warned: set = set()
        self._file = self._writer = self._bar = self._wandb = None
        done = self.last_step + 1  # steps already done, for the progress bar
        if jsonl:
            self._file, done = self._open_jsonl(self.run_dir / METRICS_FILE, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), purge_step=purge)
        if wandb is not None:
            self._wandb = WandbRun(wandb, self.run_dir, resume=resume_step is not None, run_config=run_config)
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=done, unit="step", dynamic_ncols=True)

    @staticmethod
    def _open_jsonl(path: Path, resume_step: Optional[int]):
        keep = []
        if resume_step is not None and path.exists():
            keep = [r for r in read_metrics(path) if r["step"] <= resume_step]
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w") as f:  # rewrite, then swap in: a crash here leaves the old file whole
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return open(path, "a"), len(keep)

    def _finite(self, metrics: dict) -> dict:
        out = {}
        for k, v in metrics.items():
            if isinstance(v, float) and not math.isfinite(v):
                if k not in self._warned:
                    self._warned.add(k)
                    warnings.warn(f"metrics[{k!r}] is {v} (first at this step); logged as null", RuntimeWarning,
                                  stacklevel=3)
                v = None
            out[k] = v
        return out

    def log(self, step: int, metrics: Mapping, wall_s: float) -> dict:
        """Record one step; returns the record written (non-finite values as None)."""
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            raise ValueError(f"log: step must be an int, got {type(step).__name__}")
        if step <= self.last_step:
            raise ValueError(f"log: step {step} is not after the last logged step {self.last_step}")
        flat = self._finite(flatten(metrics))
        for reserved in ("step", "wall_s"):
            if reserved in flat:
                raise ValueError(f"metrics[{reserved!r}]: reserved key (passed as log's argument)")
        wall = self._finite({"wall_s": float(wall_s)})["wall_s"]
        rec = {"step": int(step), "wall_s": wall, **flat}
        if self._file is not None:
            self._file.write(json.dumps(rec, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._writer is not None:
            for k, v in flat.items():
                if v is not None:
                    self._writer.add_scalar(k, v, global_step=int(step))
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, {"wall_s": wall, **flat})
        if self._bar is not None:
            self._bar.update(1)  # the bar counts logged steps, whatever the step numbering
            self._bar.set_postfix(self._postfix(flat), refresh=True)
        self.last_step = int(step)
        return rec

    def log_samples(self, step: int, rows: list) -> None:
        """A few evaluated episodes of ``step`` (``logging.wandb.samples``): a W&B table when W&B is
        on; the JSONL and TensorBoard sinks have the run's transcripts/ files instead."""
        if self._wandb is not None and rows:
            self._wandb.log_table(step, "heldout/samples", rows)

    def _postfix(self, flat: dict) -> dict:
        out = {}
        for label, names in self.progress_keys.items():
            k = find_metric(flat, names)
            if k is not None and flat[k] is not None:
                out[label] = f"{flat[k]:.3g}"
        return out

    def write(self, msg: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        for obj in (self._file, self._writer, self._bar, self._wandb):
            if obj is not None:
                obj.close()
        self._file = self._writer = self._bar = self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

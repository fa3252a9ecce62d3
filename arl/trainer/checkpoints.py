"""The run's checkpoint directory, ``<output_dir>/checkpoints``:

    step<N>/          DeepSpeed's checkpoint of step N (model, optimizer, client state: the run's clock,
                      the stabilizers' state), tag ``step<N>``
    step<N>/hf/       the policy of step N in HF format with the tokenizer (``trainer.checkpoint_hf``)
    step<N>/rollouts.pkl  the batches of steps N+1 .. N+staleness, generated (from older policies) while
                      step N trained: the rollouts in flight, which a resumed run trains on as the
                      uninterrupted run did instead of regenerating them from policy N
    latest_step       N of the newest complete checkpoint: what ``--resume`` and a rollback load
    latest            DeepSpeed's own pointer (not read by arl)

With ``trainer.keep_last: k`` only the newest k checkpoints stay; trainer rank 0 deletes the older
ones once the new one is complete (every rank's files, its HF export and latest_step written), so a
crash at any point leaves a whole checkpoint to resume from.
"""
from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Optional

LATEST_FILE = "latest_step"
HF_DIR = "hf"
ROLLOUTS_FILE = "rollouts.pkl"
_TAG = re.compile(r"step(\d+)")


def checkpoint_tag(step: int) -> str:
    return f"step{step}"


def latest_checkpoint(ckpt_dir: Path) -> Optional[int]:
    f = Path(ckpt_dir) / LATEST_FILE
    return int(f.read_text()) if f.exists() else None


def save_rollouts(step_dir: Path, batches: list) -> None:
    """The rollouts in flight at checkpoint ``step_dir`` (a list of ``RolloutBatch``), written whole
    or not at all."""
    path = Path(step_dir) / ROLLOUTS_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(list(batches), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_rollouts(step_dir: Path) -> list:
    """What ``save_rollouts`` wrote; [] for a checkpoint without (none in flight, or an older run)."""
    path = Path(step_dir) / ROLLOUTS_FILE
    if not path.exists():
        return []
    with open(path, "rb") as f:
        return pickle.load(f)


def checkpoint_steps(ckpt_dir: Path) -> list:
    """Steps of the checkpoint directories in ``ckpt_dir``, ascending."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if p.is_dir() and (m := _TAG.fullmatch(p.name)))


def rotate_checkpoints(ckpt_dir: Path, keep_last: Optional[int], current: int) -> list:
    """Delete the checkpoints older than ``current`` (the one just written) beyond the newest
    ``keep_last`` (``current`` counts as one); returns the deleted steps.  Newer directories than
    ``current`` (left by an earlier run in the same output_dir) are not this run's to delete."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"trainer.keep_last: must be >= 1, got {keep_last}")
    older = [s for s in checkpoint_steps(ckpt_dir) if s < current]
    drop = older[:max(0, len(older) - (keep_last - 1))]
    for s in drop:
        shutil.rmtree(Path(ckpt_dir) / checkpoint_tag(s))
    return drop

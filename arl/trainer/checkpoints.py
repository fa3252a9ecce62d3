"""The run's checkpoint directory, ``<output_dir>/checkpoints``:

    step<N>/          DeepSpeed's checkpoint of step N (model, optimizer, client state: the run's clock,
                      the stabilizers' state), tag ``step<N>``
    step<N>/hf/       the policy of step N in HF format with the tokenizer (``trainer.checkpoint_hf``)
    step<N>/rollouts.pkl  the batches of steps N+1 .. N+staleness, generated (from older policies) while
                      step N trained: the rollouts in flight, which a resumed run trains on as the
                      uninterrupted run did instead of regenerating them from policy N
    step<N>/config.json   the run's config when step N was written (what ``--resume`` checks against)
    latest_step       N of the newest complete checkpoint: what ``--resume`` and a rollback load
    latest            DeepSpeed's own pointer, the same tag (for DeepSpeed's tools; not read by arl)

A checkpoint is made visible by one atomic step (``write_checkpoint``): every rank writes its files
into ``.step<N>.partial/`` (DeepSpeed's files under that tag, then the HF export, the rollouts and
the config), trainer rank 0 syncs them to disk and renames the directory to ``step<N>`` (one
``os.replace``), then moves ``latest_step`` (a file replaced whole), then rotates.  A writer killed
at any point leaves ``latest_step`` on the previous complete checkpoint; the ``.partial`` directory
it leaves is removed by the next checkpoint.  A checkpoint that cannot be written (a full disk) is
one line naming the directory and the free space; the previous checkpoint stays as it was.

With ``trainer.keep_last: k`` only the newest k checkpoints stay; trainer rank 0 deletes the older
ones once ``latest_step`` names the new one, each by renaming it out of sight (``.step<N>.deleting``)
before removing its files, so a visible ``step<N>`` is always whole.
"""
from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

from . import faults

LATEST_FILE = "latest_step"
DS_LATEST_FILE = "latest"
HF_DIR = "hf"
ROLLOUTS_FILE = "rollouts.pkl"
CONFIG_FILE = "config.json"
_TAG = re.compile(r"step(\d+)")
_HIDDEN = re.compile(r"\.step\d+\.(partial|deleting)")  # a killed writer's or rotation's leftovers


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written (one line: the directory, the cause, the free space)."""


def checkpoint_tag(step: int) -> str:
    return f"step{step}"


def staging_tag(step: int) -> str:
    """The directory (DeepSpeed's tag) every rank writes checkpoint ``step`` into before it is made visible."""
    return f".step{step}.partial"


def latest_checkpoint(ckpt_dir: Path) -> Optional[int]:
    """N of ``latest_step``: the newest complete checkpoint (None: there is none).  One line when it
    names a checkpoint that is not there (removed by hand)."""
    f = Path(ckpt_dir) / LATEST_FILE
    if not f.exists():
        return None
    text = f.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{f}: expected a step number, found {text[:40]!r}")
    step = int(text)
    if not (Path(ckpt_dir) / checkpoint_tag(step)).is_dir():
        raise ValueError(f"{f} names step {step}, but {Path(ckpt_dir) / checkpoint_tag(step)} is missing")
    return step


def set_aside_latest(ckpt_dir: Path) -> Optional[int]:
    """A fresh run in an output_dir that holds an earlier run's checkpoints: ``latest_step`` is
    renamed to ``latest_step.earlier`` (its checkpoint directories stay), so that neither a rollback
    nor a trainer restart of this run loads the earlier run's state.  Returns that step."""
    f = Path(ckpt_dir) / LATEST_FILE
    if not f.exists():
        return None
    step = f.read_text().strip()
    os.replace(f, f.with_name(LATEST_FILE + ".earlier"))
    return int(step) if step.isdigit() else None


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
    ``current`` (left by an earlier run in the same output_dir) are not this run's to delete.  Each
    is renamed out of sight first: a rotation killed half-way leaves no half checkpoint visible."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise ValueError(f"trainer.keep_last: must be >= 1, got {keep_last}")
    older = [s for s in checkpoint_steps(ckpt_dir) if s < current]
    drop = older[:max(0, len(older) - (keep_last - 1))]
    for s in drop:
        gone = Path(ckpt_dir) / f".step{s}.deleting"
        os.replace(Path(ckpt_dir) / checkpoint_tag(s), gone)
        faults.checkpoint_stage("rotating")
        shutil.rmtree(gone)
    return drop


def clear_leftovers(ckpt_dir: Path) -> list:
    """Remove what killed writers and rotations left (``.step<N>.partial`` / ``.deleting``); trainer
    rank 0, while no rank writes.  Returns the names removed."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    left = sorted(p.name for p in ckpt_dir.iterdir() if _HIDDEN.fullmatch(p.name))
    for name in left:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return left


def _fsync_tree(root: Path) -> None:
    """Every file under ``root`` and the directories themselves on disk before the rename that
    publishes them (a rename can reach the disk before the data it names)."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(d))


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, replaced whole (a reader sees the old content or the new)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def publish(ckpt_dir: Path, step: int, keep_last: Optional[int]) -> None:
    """Trainer rank 0, every rank's files in ``.step<N>.partial``: make checkpoint ``step`` visible
    (one rename), then ``latest_step`` (and DeepSpeed's ``latest``), then rotate."""
    ckpt_dir = Path(ckpt_dir)
    staged, final = ckpt_dir / staging_tag(step), ckpt_dir / checkpoint_tag(step)
    _fsync_tree(staged)
    if final.exists():  # step N written before by a run that died before moving latest_step to it
        os.replace(final, ckpt_dir / f".step{step}.deleting")
        shutil.rmtree(ckpt_dir / f".step{step}.deleting")
    os.replace(staged, final)
    _fsync_dir(ckpt_dir)
    faults.checkpoint_stage("published")
    _replace_text(ckpt_dir / LATEST_FILE, str(step))
    faults.checkpoint_stage("latest")
    _replace_text(ckpt_dir / DS_LATEST_FILE, checkpoint_tag(step))
    rotate_checkpoints(ckpt_dir, keep_last, current=step)


def write_checkpoint(ckpt_dir: Path, step: int, rank: int, save_state: Callable[[str, str], None],
                     export_hf: Optional[Callable[[str], None]], extras: Callable[[Path], None],
                     keep_last: Optional[int], barrier: Callable[[], None]) -> None:
    """Checkpoint ``step``, made visible whole or not at all (every rank calls it).
    ``save_state(directory, tag)``: DeepSpeed's collective save; ``export_hf(path)``: the HF export
    (collective; None: not exported); ``extras(staged_dir)``: rank 0's own files (rollouts, config).
    A write that fails (a full disk) raises ``CheckpointError``, one line; the staged files go."""
    ckpt_dir = Path(ckpt_dir)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        clear_leftovers(ckpt_dir)
    barrier()  # no rank writes into a directory rank 0 is still clearing
    staged = ckpt_dir / staging_tag(step)
    try:
        save_state(str(ckpt_dir), staging_tag(step))
        faults.checkpoint_stage("deepspeed")
        if export_hf is not None:
            export_hf(str(staged / HF_DIR))
            faults.checkpoint_stage("hf")
        if rank == 0:
            extras(staged)
            faults.checkpoint_stage("extras")
            publish(ckpt_dir, step, keep_last)
    except (OSError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        if rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
        raise CheckpointError(write_failure(ckpt_dir, step, e)) from e
    barrier()  # a rollback right after this reads the same latest_step on every rank


def _free(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free"
    except OSError:
        return "free space unknown"


def write_failure(ckpt_dir: Path, step: int, e: BaseException) -> str:
    """The one line of a checkpoint that could not be written: where, why, the free space, and the
    checkpoint a resume would take (unchanged)."""
    try:
        last = latest_checkpoint(ckpt_dir)
    except ValueError:
        last = None
    kept = f"the step {last} checkpoint is intact" if last is not None else "no earlier checkpoint"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        why = "no space left on device"
    else:  # torch's zip writer reports a full disk as "unexpected pos" / "file write failed", errno lost
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    return f"checkpoint step {step}: writing {ckpt_dir} failed: {why} ({_free(ckpt_dir)}); {kept}"

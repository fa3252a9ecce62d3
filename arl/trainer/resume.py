"""Which checkpoint a run starts from (``python -m arl.train --resume [auto]``), decided by the
driver before any process starts:

* no flag: a fresh run (one line when ``output_dir`` already holds an earlier run's checkpoint:
  its ``latest_step`` is set aside as ``latest_step.earlier``, so that no rollback or trainer
  restart of this run loads it; ``--resume auto`` would continue it);
* ``--resume``: the last complete checkpoint in ``output_dir`` (``latest_step``); one line when
  there is none;
* ``--resume auto``: the last complete checkpoint when there is one, else a fresh run -- the same
  command, run again after the driver died, continues the run.

A resumed config must agree with the checkpoint's (``step<N>/config.json``; an older checkpoint:
``output_dir/config.json``) on every key that decides the checkpoint's shape or meaning
(``INCOMPATIBLE``: the model, the trainer ranks' layout, the algorithm and loss, the batches in
flight); a difference is one line naming the keys.  Anything else (steps, learning rate, logging,
evaluation) may change on resume.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from .checkpoints import CONFIG_FILE, checkpoint_tag, latest_checkpoint

MODES = ("last", "auto")
# dotted prefixes of the keys a resumed run must share with its checkpoint: the parameters and
# optimizer state's shapes and partitioning, what the loss means, and the shape of the in-flight batches
INCOMPATIBLE = ("model.name_or_path", "model.tiny", "model.dtype", "model.lora", "trainer.world_size",
                "trainer.zero_stage", "trainer.sequence_parallel", "trainer.offload", "algo", "loss", "critic",
                "rollout.group_size", "rollout.tasks_per_step", "rollout.staleness", "env.name", "sft.enabled")


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _covered(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in INCOMPATIBLE)


def config_mismatch(saved: dict, cfg: TrainConfig) -> list:
    """``key: saved -> now`` for every INCOMPATIBLE key on which ``saved`` (a config.json) and ``cfg``
    differ; a key one side lacks counts as differing."""
    a, b = _flat(saved), _flat(cfg.model_dump(mode="json"))
    missing = object()
    diff = []
    for k in sorted(set(a) | set(b)):
        if _covered(k) and a.get(k, missing) != b.get(k, missing):
            diff.append(f"{k}: {_show(a.get(k, missing))} -> {_show(b.get(k, missing))}")
    return diff


def _show(v) -> str:
    return "(none)" if not isinstance(v, (str, int, float, bool, list, dict, type(None))) else json.dumps(v)


def saved_config(run_dir: Path, step: int) -> Optional[dict]:
    """The config checkpoint ``step`` was written with (None: not recorded)."""
    for f in (run_dir / "checkpoints" / checkpoint_tag(step) / CONFIG_FILE, run_dir / "config.json"):
        if f.exists():
            return json.loads(f.read_text())
    return None


def resume_from(cfg: TrainConfig, mode: Optional[str]) -> Optional[int]:
    """The step this run resumes from (None: a fresh run) for ``mode`` (None, ``last``, ``auto``);
    ValueError, one line: ``--resume`` without a checkpoint, or a config the checkpoint's differs from."""
    run_dir = Path(cfg.output_dir)
    ckpt_dir = run_dir / "checkpoints"
    try:
        step = latest_checkpoint(ckpt_dir)
    except ValueError as e:
        if mode is None:
            return None  # a fresh run over a broken earlier one: nothing of it is read
        raise ValueError(f"--resume: {e}") from None
    if mode is None:
        if step is not None:
            print(f"arl.train: {run_dir} holds the step {step} checkpoint of an earlier run; this run starts fresh "
                  "and sets its latest_step aside (checkpoints/latest_step.earlier; --resume auto continues it "
                  "instead)", flush=True)
        return None
    if mode not in MODES:
        raise ValueError(f"--resume: unknown mode {mode!r} (--resume or --resume auto)")
    if step is None:
        if mode == "last":
            raise ValueError(f"--resume: no complete checkpoint in {ckpt_dir} (--resume auto starts fresh when there "
                             "is none)")
        return None
    saved = saved_config(run_dir, step)
    diff = config_mismatch(saved, cfg) if saved is not None else []
    if diff:
        raise ValueError(f"--resume: the step {step} checkpoint in {ckpt_dir} was written with another config: "
                         f"{'; '.join(diff)} (resume with its values, or use a new output_dir)")
    return step

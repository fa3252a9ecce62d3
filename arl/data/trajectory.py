"""One multi-turn trajectory, token in / token out: exactly the tokens the engine sampled.

Layout of ``tokens``: prompt, then alternating model turns and observations.  ``chunk_ids`` holds
the trajectory-local chunk index (0, 1, ...) of every model-generated token (one chunk per model
turn) and -1 on prompt, observation and tool-error tokens; the packer turns these into the global,
increasing ids that ``arl.policy_loss`` expects.  ``rollout_logp`` is the engine's logprob of each
sampled token (0 where the token was not sampled).

Serialization: ``to_dict``/``from_dict`` (JSON-safe), ``to_json``/``from_json``, pickling (queues
between processes), and ``save_trajectories``/``load_trajectories`` (a compact safetensors file for
checkpoints: token arrays concatenated, everything else in its JSON header).
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


class TrajectoryStatus(str, enum.Enum):
    OK = "ok"
    MASKED = "masked"  # unrecoverable environment fault: kept as a placeholder, never trained on
    FILTERED = "filtered"  # recoverable fault that was dropped (counted against the filter cap)


@dataclass
class Trajectory:
    tokens: np.ndarray  # [L] int32 token ids
    chunk_ids: np.ndarray  # [L] int32, trajectory-local chunk index or -1
    rollout_logp: np.ndarray  # [L] float32
    reward: float = 0.0
    group_id: int = 0
    policy_version: int = 0
    turns: list = field(default_factory=list)  # [(start, end)) token span of each model turn
    status: TrajectoryStatus = TrajectoryStatus.OK
    metadata: dict = field(default_factory=dict)  # free: task id, tool calls, faults, timings ...

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int32)
        self.chunk_ids = np.asarray(self.chunk_ids, dtype=np.int32)
        self.rollout_logp = np.asarray(self.rollout_logp, dtype=np.float32)
        self.status = TrajectoryStatus(self.status)
        if self.tokens.ndim != 1:
            raise ValueError(f"Trajectory.tokens: expected a 1-D array, got shape {self.tokens.shape}")
        L = self.tokens.shape[0]
        for name in ("chunk_ids", "rollout_logp"):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != L:
                raise ValueError(f"Trajectory.{name}: shape {arr.shape} does not match tokens ({L},)")
        self._validate()

    def _validate(self) -> None:
        """Everything the packer and ``arl.policy_loss`` rely on, as one-line errors naming the field."""
        L = len(self)
        if L and int(self.tokens.min()) < 0:
            i = int(np.argmax(self.tokens < 0))
            raise ValueError(f"Trajectory.tokens: negative token id {int(self.tokens[i])} at index {i}")
        if L and int(self.chunk_ids.min()) < -1:
            i = int(np.argmax(self.chunk_ids < -1))
            raise ValueError(f"Trajectory.chunk_ids: value {int(self.chunk_ids[i])} at index {i} (use -1 for untrained tokens)")
        tidx = np.flatnonzero(self.chunk_ids >= 0)
        c = self.chunk_ids[tidx]
        back = np.flatnonzero(c[1:] < c[:-1])
        if back.size:  # chunks are model turns in order: an id never comes back after a later one
            j = int(back[0]) + 1
            raise ValueError(
                f"Trajectory.chunk_ids: goes backwards at index {int(tidx[j])} ({int(c[j])} after {int(c[j - 1])})"
            )
        bad = np.flatnonzero(~np.isfinite(self.rollout_logp[tidx]))
        if bad.size:
            i = int(tidx[bad[0]])
            raise ValueError(f"Trajectory.rollout_logp: non-finite value {self.rollout_logp[i]} at trained index {i}")
        if not math.isfinite(float(self.reward)):
            raise ValueError(f"Trajectory.reward: must be finite, got {self.reward}")
        for k, t in enumerate(self.turns):
            if len(t) != 2 or not (0 <= int(t[0]) <= int(t[1]) <= L):
                raise ValueError(f"Trajectory.turns[{k}]: span {tuple(t)} is not a [start, end) inside [0, {L}]")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def loss_mask(self) -> np.ndarray:
        return self.chunk_ids >= 0

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_ids.max()) + 1 if len(self) and self.chunk_ids.max() >= 0 else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (checkpoints, queues between processes, debugging dumps)."""
        return {
            "tokens": self.tokens.tolist(),
            "chunk_ids": self.chunk_ids.tolist(),
            "rollout_logp": self.rollout_logp.tolist(),
            "reward": float(self.reward),
            "group_id": int(self.group_id),
            "policy_version": int(self.policy_version),
            "turns": [list(t) for t in self.turns],
            "status": self.status.value,
            "metadata": self.metadata,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        d = dict(d)
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise ValueError(f"Trajectory.from_dict: unknown key(s) {unknown}; known: {sorted(_FIELDS)}")
        missing = [k for k in ("tokens", "chunk_ids", "rollout_logp") if k not in d]
        if missing:
            raise ValueError(f"Trajectory.from_dict: missing key(s) {missing}")
        d["turns"] = [tuple(t) for t in d.get("turns", [])]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "Trajectory":
        return cls.from_dict(json.loads(s))


_FIELDS = {"tokens", "chunk_ids", "rollout_logp", "reward", "group_id", "policy_version", "turns", "status", "metadata"}
_ARRAYS = ("tokens", "chunk_ids", "rollout_logp")


def save_trajectories(path: str, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories to one safetensors file: the three token arrays concatenated (with
    offsets), scalars, turns and metadata as JSON in the header (metadata must be JSON-safe)."""
    from safetensors.numpy import save_file

    lengths = np.array([len(t) for t in trajectories], dtype=np.int64)
    tensors = {"offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    for name in _ARRAYS:
        parts = [getattr(t, name) for t in trajectories]
        dtype = np.float32 if name == "rollout_logp" else np.int32
        tensors[name] = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    rest = [{k: v for k, v in t.to_dict().items() if k not in _ARRAYS} for t in trajectories]
    save_file(tensors, path, metadata={"format": "arl.trajectories.v1", "records": json.dumps(rest)})


def load_trajectories(path: str) -> list[Trajectory]:
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != "arl.trajectories.v1":
            raise ValueError(f"load_trajectories: {path} is not an arl trajectories file (format={meta.get('format')!r})")
        arrays = {k: f.get_tensor(k) for k in ("offsets",) + _ARRAYS}
    off = arrays["offsets"]
    out = []
    for i, rec in enumerate(json.loads(meta["records"])):
        a, b = int(off[i]), int(off[i + 1])
        out.append(Trajectory.from_dict({**rec, **{k: arrays[k][a:b] for k in _ARRAYS}}))
    return out

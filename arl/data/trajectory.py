"""One multi-turn trajectory, token in / token out: exactly the tokens the engine sampled.

Layout of ``tokens``: prompt, then alternating model turns and observations.  ``chunk_ids`` holds
the trajectory-local chunk index (0, 1, ...) of every model-generated token (one chunk per model
turn) and -1 on prompt, observation and tool-error tokens; the packer turns these into the global,
increasing ids that ``arl.policy_loss`` expects.  ``rollout_logp`` is the engine's logprob of each
sampled token (0 where the token was not sampled).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

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
        L = self.tokens.shape[0]
        for name in ("chunk_ids", "rollout_logp"):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != L:
                raise ValueError(f"Trajectory.{name}: shape {arr.shape} does not match tokens ({L},)")

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
        d["turns"] = [tuple(t) for t in d.get("turns", [])]
        return cls(**d)

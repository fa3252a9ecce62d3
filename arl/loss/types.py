"""Plain containers passed between policy_loss, its validation and its backends."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class LossInputs:
    logp: torch.Tensor  # [T] current policy logprobs of the sampled tokens (differentiable)
    old_logp: torch.Tensor  # [T] behaviour-policy logprobs recomputed by the trainer
    rewards: torch.Tensor  # [N] final reward per trajectory
    group_ids: torch.Tensor  # [N] int, samples of the same task share an id
    cu_seqlens: torch.Tensor  # [N+1] int32 packed sequence boundaries
    chunk_ids: torch.Tensor  # [T] int32, -1 = not trained (prompt, observation, tool error)
    rollout_logp: Optional[torch.Tensor] = None  # [T] logprobs reported by the rollout engine
    ref_logp: Optional[torch.Tensor] = None  # [T] frozen reference policy, for KL
    entropy: Optional[torch.Tensor] = None  # [T] per-token entropy (differentiable)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    metrics: dict = field(default_factory=dict)  # name -> 0-dim detached tensor

"""Plain containers passed between policy_loss, its validation and its backends."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .group_adv import GroupAdvantages


@dataclass
class LossInputs:
    logp: torch.Tensor  # [T] current policy logprobs of the sampled tokens (differentiable)
    old_logp: torch.Tensor  # [T] behaviour-policy logprobs recomputed by the trainer
    advantages: Optional[torch.Tensor]  # [N] per-trajectory advantages (arl.algo.advantages, before packing)
    cu_seqlens: torch.Tensor  # [N+1] int32 packed sequence boundaries
    chunk_ids: torch.Tensor  # [T] int32, -1 = not trained (prompt, observation, tool error)
    rollout_logp: Optional[torch.Tensor] = None  # [T] logprobs reported by the rollout engine
    ref_logp: Optional[torch.Tensor] = None  # [T] frozen reference policy, for KL
    entropy: Optional[torch.Tensor] = None  # [T] per-token entropy (differentiable)
    group: Optional[GroupAdvantages] = None  # in-pass advantages' inputs (group_adv.py), instead of advantages

    @property
    def n_seq(self) -> int:
        return int(self.cu_seqlens.numel()) - 1


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar
    metrics: dict = field(default_factory=dict)  # name -> 0-dim detached tensor


@dataclass
class KernelLaunch:
    """What a kernel backend's forward launch hands to the shared autograd wrapper (fused.py)."""

    loss: torch.Tensor  # 0-dim, compute dtype
    grad_logp: Optional[torch.Tensor]  # [T] unnormalized dL/dlogp (times D), compute dtype; None: not wanted
    stats: torch.Tensor  # METRIC_KEYS values in order, then 1/D (compute dtype)
    # scale (grad_out / D, 0-dim) -> dL/dentropy [T], compute dtype; None without an entropy term
    entropy_grad: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

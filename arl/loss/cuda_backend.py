"""Backend "cuda": the fused CUDA kernel ``torch.ops.arl.policy_loss_cuda`` (csrc/cuda/policy_loss.cu),
the same algorithm as the C++ CPU op (csrc/common/policy_loss_core.h) with one warp per sequence.

Available only where ``arl._C_cuda`` was built (torch with CUDA and nvcc at install time) and a
GPU is present.  Shares the autograd wrapper of the CPU backend: forward saves dL/dlogp,
backward scales it.
"""
from __future__ import annotations

import torch

from .api import register_backend
from .cpu_backend import fused_policy_loss
from .config import LossConfig
from .types import LossInputs, LossOutput

try:
    import arl._C_cuda  # noqa: F401  registers torch.ops.arl.policy_loss_cuda

    _HAVE_OP = hasattr(torch.ops.arl, "policy_loss_cuda")
except ImportError:  # CPU build: no CUDA op library
    _HAVE_OP = False


def _available() -> bool:
    return _HAVE_OP and torch.cuda.is_available()


@register_backend("cuda", available=_available)
def cuda_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    if not inp.logp.is_cuda:
        raise ValueError(f"logp: backend 'cuda' needs CUDA tensors, got device {inp.logp.device}")
    ops = (torch.ops.arl.policy_loss_cuda, torch.ops.arl.policy_loss_entropy_grad_cuda)
    return fused_policy_loss(inp, cfg, normalizer, ops)

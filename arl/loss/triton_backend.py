"""Backend "triton": the fused Triton kernel (arl.kernels.policy_loss) behind an autograd.Function.

The kernel computes the loss and dL/dlogp, dL/dentropy in its forward launch; backward only
multiplies the saved gradients by grad_out / D (D, the aggregation denominator, needs global
counts, so it is applied here as one scalar rather than inside the kernel).  Once
differentiable: double backward is not supported.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..kernels import triton_available
from .api import register_backend
from .config import LossConfig
from .types import LossInputs, LossOutput


class _FusedPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, entropy, loss, grad_logp, grad_ent, denom):
        ctx.save_for_backward(grad_logp, grad_ent if grad_ent is not None else grad_logp, denom)
        ctx.has_ent = grad_ent is not None
        ctx.logp_dtype = logp.dtype
        ctx.ent_dtype = entropy.dtype if entropy is not None else None
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        g_logp, g_ent, denom = ctx.saved_tensors
        scale = grad_out.to(denom.dtype) / denom
        d_logp = (g_logp * scale).to(ctx.logp_dtype) if ctx.needs_input_grad[0] else None
        d_ent = (g_ent * scale).to(ctx.ent_dtype) if ctx.has_ent and ctx.needs_input_grad[1] else None
        return d_logp, d_ent, None, None, None, None


@register_backend("triton", available=triton_available)
def triton_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer: Optional[float] = None) -> LossOutput:
    from ..kernels.policy_loss import fused_policy_loss  # deferred: kernels decorate at import

    with torch.no_grad():
        loss, g_logp, g_ent, denom, metrics = fused_policy_loss(
            inp.logp.detach(), inp.old_logp, inp.rewards, inp.group_ids, inp.cu_seqlens, inp.chunk_ids, cfg,
            rollout_logp=inp.rollout_logp, ref_logp=inp.ref_logp,
            entropy=inp.entropy.detach() if inp.entropy is not None else None, normalizer=normalizer,
        )
    loss = _FusedPolicyLoss.apply(inp.logp, inp.entropy, loss, g_logp, g_ent, denom)
    return LossOutput(loss=loss, metrics=metrics)

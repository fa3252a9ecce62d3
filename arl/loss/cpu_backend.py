"""Backend "cpu": the fused C++ op ``torch.ops.arl.policy_loss`` (csrc/cpu/policy_loss.cpp).

One pass over the packed tokens computes the loss, every metric and dL/dlogp (saved, scaled by
1/D in place); backward returns it, multiplied by ``grad_out`` unless that is 1.  The entropy
gradient is not saved: it is ``-entropy_coef * coef_s / D`` on trained tokens, rebuilt in backward by a
small op, so peak extra memory stays at two T-sized buffers (three with an entropy term).
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import register_backend
from .config import LossConfig
from .reference import METRIC_KEYS
from .types import LossInputs, LossOutput

try:
    import arl._C  # noqa: F401  registers torch.ops.arl.*

    _HAVE_OP = hasattr(torch.ops.arl, "policy_loss")
except ImportError:  # not built: the backend reports itself unavailable
    _HAVE_OP = False

# option codes, matching csrc/common/policy_loss_core.h (enums Level, Surrogate, ...)
_LEVEL = {"token": 0, "sequence": 1, "chunk": 2, "none": 3}
_SURROGATE = {"ppo_clip": 0, "topr": 1}
_ADV_NORM = {"group_std": 0, "group_mean": 1, "none": 2}
_MISMATCH_MODE = {"mask": 0, "truncate": 1}
_LOSS_AGG = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
_KL = {"k1": 1, "k2": 2, "k3": 3}
_KERNEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def kernel_options(cfg: LossConfig, normalizer: Optional[float]) -> tuple[list[int], list[float]]:
    """LossConfig -> (iopts, fopts) in the order of the C++/CUDA ops (IOpt / FOpt enums)."""
    iopts = [
        _LEVEL[cfg.ratio_level], _SURROGATE[cfg.surrogate], _ADV_NORM[cfg.adv_norm], int(cfg.positive_only),
        _LEVEL[cfg.mismatch_level], _MISMATCH_MODE[cfg.mismatch_mode], _LOSS_AGG[cfg.loss_agg],
        _KL[cfg.kl_estimator] if cfg.kl_beta > 0 else 0, int(cfg.entropy_coef != 0), int(cfg.dual_clip is not None),
        int(cfg.log_ratio_clamp is not None), int(cfg.agg_constant is not None), int(normalizer is not None),
    ]
    fopts = [
        cfg.clip_low, cfg.clip_high, cfg.dual_clip or 0.0, cfg.adv_eps, cfg.gamma, cfg.mismatch_low,
        cfg.mismatch_high, cfg.agg_constant or 0.0, cfg.kl_beta, cfg.entropy_coef, cfg.log_ratio_clamp or 0.0,
        float(normalizer) if normalizer is not None else 0.0,
    ]
    return iopts, [float(x) for x in fopts]


def kernel_tensors(inp: LossInputs, cfg: LossConfig):
    """Token tensors in one dtype the kernels read (fp32, fp64 or bf16; mixed or fp16 inputs are
    converted to the reference's compute dtype), and the index tensors in the kernels' types."""
    cdt = torch.float64 if inp.logp.dtype == torch.float64 else torch.float32
    names = ("logp", "old_logp", "rollout_logp", "ref_logp", "entropy")
    need = {"rollout_logp": cfg.mismatch_level != "none", "ref_logp": cfg.kl_beta > 0}
    toks = {n: getattr(inp, n) for n in names if need.get(n, True) and getattr(inp, n) is not None}
    dtypes = {t.dtype for t in toks.values()}
    kdt = inp.logp.dtype if len(dtypes) == 1 and inp.logp.dtype in _KERNEL_DTYPES else cdt
    toks = {n: t.to(kdt).contiguous() for n, t in toks.items()}
    cid = inp.chunk_ids if inp.chunk_ids.dtype in (torch.int32, torch.int64) else inp.chunk_ids.to(torch.int64)
    idx = dict(
        rewards=inp.rewards.to(cdt).contiguous(), group_ids=inp.group_ids.to(torch.int64).contiguous(),
        cu_seqlens=inp.cu_seqlens.to(torch.int64).contiguous(), chunk_ids=cid.contiguous(),
    )
    return toks, idx


class _FusedPolicyLoss(torch.autograd.Function):
    """Differentiable w.r.t. logp and entropy; forward computes dL/dlogp, backward returns it."""

    @staticmethod
    def _run(inp, cfg, normalizer, main_op, need_grad):
        toks, idx = kernel_tensors(inp, cfg)
        iopts, fopts = kernel_options(cfg, normalizer)
        loss, grad, stats, seq_coef = main_op(
            toks["logp"], toks["old_logp"], toks.get("rollout_logp"), toks.get("ref_logp"), toks.get("entropy"),
            idx["rewards"], idx["group_ids"], idx["cu_seqlens"], idx["chunk_ids"], iopts, fopts, need_grad,
        )
        if need_grad:
            grad.mul_(stats[-1])  # in place, on memory just written: dL/dlogp for grad_out = 1
        return loss, grad, stats, seq_coef, idx

    @staticmethod
    def forward(ctx, logp, entropy, inp: LossInputs, cfg: LossConfig, normalizer, ops):
        main_op, ent_op = ops
        need_grad = ctx.needs_input_grad[0]
        loss, grad, stats, seq_coef, idx = _FusedPolicyLoss._run(inp, cfg, normalizer, main_op, need_grad)
        ctx.grad_logp = grad if need_grad else None
        ctx.rerun = (inp, cfg, normalizer, main_op)  # a second backward (retain_graph) recomputes
        ctx.ent_grad = ctx.needs_input_grad[1] and cfg.entropy_coef != 0
        ctx.ent_op = ent_op
        ctx.ent_coef = cfg.entropy_coef
        ctx.logp_dtype, ctx.ent_dtype = logp.dtype, entropy.dtype if entropy is not None else None
        ctx.save_for_backward(stats, seq_coef, idx["chunk_ids"], idx["cu_seqlens"])
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        stats, seq_coef, chunk_ids, cu_seqlens = ctx.saved_tensors
        scale = g_loss * stats[-1]  # grad_out / D
        g_logp = g_ent = None
        if ctx.needs_input_grad[0]:
            # The saved gradient is handed over, not copied: with ctx's reference dropped, autograd
            # can make it a leaf's .grad as is, and the usual grad_out == 1 (read on the CPU only:
            # no device sync) needs no multiply.  The caller may then change it in place, so a
            # second backward (retain_graph) recomputes it from the inputs.
            g_logp, ctx.grad_logp = ctx.grad_logp, None
            if g_logp is None:
                g_logp = _FusedPolicyLoss._run(*ctx.rerun, True)[1]
            if g_loss.is_cuda or float(g_loss) != 1.0:
                g_logp = g_logp * g_loss
            g_logp = g_logp.to(ctx.logp_dtype)
        if ctx.ent_grad:
            s = float(scale.item()) * -ctx.ent_coef
            g_ent = ctx.ent_op(chunk_ids, cu_seqlens, seq_coef, s).to(ctx.ent_dtype)
        return g_logp, g_ent, None, None, None, None


def fused_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer, ops) -> LossOutput:
    """Shared by the CPU and CUDA backends (they differ only in the op pair)."""
    loss, stats = _FusedPolicyLoss.apply(inp.logp, inp.entropy, inp, cfg, normalizer, ops)
    # one copy, then views: a clone per metric was 14 kernel launches per call on a GPU
    metrics = dict(zip(METRIC_KEYS, stats.detach().clone().unbind(0)))
    return LossOutput(loss=loss, metrics=metrics)


@register_backend("cpu", available=lambda: _HAVE_OP)
def cpu_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    if inp.logp.device.type != "cpu":
        raise ValueError(f"logp: backend 'cpu' needs CPU tensors, got device {inp.logp.device}")
    ops = (torch.ops.arl.policy_loss, torch.ops.arl.policy_loss_entropy_grad)
    return fused_policy_loss(inp, cfg, normalizer, ops)

"""The one autograd wrapper of the fused policy-loss kernels, and the kernel backends it serves.

Backends differ only in their forward launch (``KernelLaunch``: loss, unnormalized dL/dlogp,
metrics and 1/D, and how to build dL/dentropy):
  cpu     the C++ op torch.ops.arl.policy_loss (csrc/policy_loss/cpu.cpp, library arl._C)
  cuda    the CUDA op torch.ops.arl.policy_loss_cuda (csrc/policy_loss/cuda.cu, library arl._C_cuda)
  triton  the Triton kernel (triton_kernel.py, launched by triton_launch.py)
Each reports whether it can run here; the compiled libraries and Triton are imported lazily.  Each
declares the options it runs (``covers``): all three read the one option table, so each covers what
that table has a code for (options.py ``KERNEL_COVERS``); a config outside it runs on the reference.
All three compute the group estimators grpo, dr_grpo and rloo in the pass when given ``inp.group``
(rewards, group rows and the step's group table: group_adv.py) instead of advantages.

Memory: forward scales dL/dlogp by 1/D in place (memory just written) and backward hands that
buffer over, not a copy, multiplied by grad_out only when grad_out != 1.  The C++/CUDA ops do not
keep an entropy gradient: it is -entropy_coef * coef_s / D on trained tokens, rebuilt in backward
by a small op, so peak extra memory stays at two T-sized buffers (three with an entropy term).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch

from .._triton import triton_available
from .api import register_backend
from .config import LossConfig
from .options import KERNEL_COVERS, kernel_options, kernel_tensors
from .spec import METRIC_KEYS
from .types import KernelLaunch, LossInputs, LossOutput

Launcher = Callable[[LossInputs, LossConfig, Optional[float], bool], KernelLaunch]


class _FusedPolicyLoss(torch.autograd.Function):
    """Differentiable w.r.t. logp and entropy; forward computes dL/dlogp, backward returns it."""

    @staticmethod
    def _grad(launch: KernelLaunch) -> torch.Tensor:
        return launch.grad_logp.mul_(launch.stats[-1])  # dL/dlogp for grad_out = 1

    @staticmethod
    def forward(ctx, logp, entropy, launcher: Launcher, inp: LossInputs, cfg: LossConfig, normalizer):
        need_grad = ctx.needs_input_grad[0]
        out = launcher(inp, cfg, normalizer, need_grad)
        ctx.grad_logp = _FusedPolicyLoss._grad(out) if need_grad else None
        ctx.rerun = (launcher, inp, cfg, normalizer)  # a second backward (retain_graph) recomputes
        ctx.entropy_grad = out.entropy_grad if ctx.needs_input_grad[1] else None
        ctx.logp_dtype, ctx.ent_dtype = logp.dtype, entropy.dtype if entropy is not None else None
        ctx.save_for_backward(out.stats)
        ctx.mark_non_differentiable(out.stats)
        return out.loss, out.stats

    @staticmethod
    def backward(ctx, g_loss, _g_stats):
        (stats,) = ctx.saved_tensors
        g_logp = g_ent = None
        if ctx.needs_input_grad[0]:
            # The saved gradient is handed over, not copied: with ctx's reference dropped, autograd
            # can make it a leaf's .grad as is, and the usual grad_out == 1 (read on the CPU only:
            # no device sync) needs no multiply.  The caller may then change it in place, so a
            # second backward (retain_graph) recomputes it from the inputs.
            g_logp, ctx.grad_logp = ctx.grad_logp, None
            if g_logp is None:
                g_logp = _FusedPolicyLoss._grad(ctx.rerun[0](*ctx.rerun[1:], True))
            if g_loss.is_cuda or float(g_loss) != 1.0:
                g_logp = g_logp * g_loss
            g_logp = g_logp.to(ctx.logp_dtype)
        if ctx.entropy_grad is not None:
            g_ent = ctx.entropy_grad(g_loss * stats[-1]).to(ctx.ent_dtype)  # scale = grad_out / D
        return g_logp, g_ent, None, None, None, None


def fused_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer, launcher: Launcher) -> LossOutput:
    loss, stats = _FusedPolicyLoss.apply(inp.logp, inp.entropy, launcher, inp, cfg, normalizer)
    # one copy, then views: a clone per metric was 14 kernel launches per call on a GPU
    metrics = dict(zip(METRIC_KEYS, stats.detach().clone().unbind(0)))
    return LossOutput(loss=loss, metrics=metrics)


def _compiled_launch(main_op, ent_op, inp: LossInputs, cfg: LossConfig, normalizer, need_grad: bool) -> KernelLaunch:
    """Launch of the C++ / CUDA op pair (same schema): the entropy gradient is rebuilt by ent_op."""
    toks, idx = kernel_tensors(inp, cfg)
    iopts, fopts = kernel_options(cfg, normalizer, inp.group)
    loss, grad, stats, seq_coef = main_op(
        toks["logp"], toks["old_logp"], toks.get("rollout_logp"), toks.get("ref_logp"), toks.get("entropy"),
        idx.get("advantages"), idx["cu_seqlens"], idx["chunk_ids"], iopts, fopts, need_grad,
        idx.get("rewards"), idx.get("group_index"), idx.get("group_stats"),
    )
    ent = None
    if cfg.entropy_coef != 0:
        coef, cid, cu = cfg.entropy_coef, idx["chunk_ids"], idx["cu_seqlens"]
        ent = lambda scale: ent_op(cid, cu, seq_coef, float(scale.item()) * -coef)  # noqa: E731
    return KernelLaunch(loss=loss, grad_logp=grad if need_grad else None, stats=stats, entropy_grad=ent)


@functools.lru_cache(maxsize=None)
def _have_op(module: str, op: str) -> bool:
    """The compiled library imports and registers the op.  Not built: the backend is unavailable.
    Built but not loadable (e.g. compiled against another torch): also unavailable, with a warning
    naming why, since the silent fallback to a slower backend would hide it."""
    try:
        __import__(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            _warn_unloadable(module, e)
        return False
    except (ImportError, OSError) as e:
        _warn_unloadable(module, e)
        return False
    return hasattr(torch.ops.arl, op)


def _warn_unloadable(module: str, e: BaseException) -> None:
    warnings.warn(f"{module}: built but does not load ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                  "its backend is unavailable -- rebuild it against this torch (bash install.sh, or "
                  "python setup.py build_ext --inplace)", RuntimeWarning, stacklevel=3)


@register_backend("cpu", available=lambda: _have_op("arl._C", "policy_loss"), covers=KERNEL_COVERS)
def cpu_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    if inp.logp.device.type != "cpu":
        raise ValueError(f"logp: backend 'cpu' needs CPU tensors, got device {inp.logp.device}")
    launch = functools.partial(_compiled_launch, torch.ops.arl.policy_loss, torch.ops.arl.policy_loss_entropy_grad)
    return fused_policy_loss(inp, cfg, normalizer, launch)


@register_backend("cuda", available=lambda: _have_op("arl._C_cuda", "policy_loss_cuda") and torch.cuda.is_available(),
                  covers=KERNEL_COVERS)
def cuda_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    if not inp.logp.is_cuda:
        raise ValueError(f"logp: backend 'cuda' needs CUDA tensors, got device {inp.logp.device}")
    launch = functools.partial(_compiled_launch, torch.ops.arl.policy_loss_cuda,
                               torch.ops.arl.policy_loss_entropy_grad_cuda)
    return fused_policy_loss(inp, cfg, normalizer, launch)


@register_backend("triton", available=triton_available, covers=KERNEL_COVERS)
def triton_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    from .triton_launch import triton_launch  # Triton is optional, and its kernels compile at import

    return fused_policy_loss(inp, cfg, normalizer, triton_launch)

"""Fused lm_head -> per-token logprob (+ entropy), without a [T, V] logits tensor.

Math (z = hidden @ weight.T / temperature, one row per token, p = softmax(z)):

    logp[t]    = z[t, y_t] - logsumexp(z[t])
    entropy[t] = logsumexp(z[t]) - sum_v p[t, v] z[t, v]

Backward, with g / e the incoming gradients of logp / entropy:

    dz = g (onehot(y) - p) + e p (S - z),     S = sum_v p z
    grad_hidden = dz @ weight / temperature,  grad_weight = dz.T @ hidden / temperature

Implementations tile over tokens and vocab with an online logsumexp, keep only lse and S per
token ([T] each) between forward and backward, and recompute logit tiles in backward.  That is
one more matmul than the naive path (4 vs 3) in exchange for O(tile) instead of O(T*V) memory.

Backends live in a registry keyed by name; ``backend="auto"`` picks by device (``_AUTO``).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import torch

from .._triton import triton_available

LogprobFn = Callable[..., Tuple[torch.Tensor, Optional[torch.Tensor]]]
_BACKENDS: Dict[str, LogprobFn] = {}
_AVAILABLE: Dict[str, Callable[[], bool]] = {}
# device type -> backends to try, in order
# (on an H200 the cuBLAS-tiled torch path measured 4-8x faster than the Triton kernel, whose
# per-token-tile programs leave most SMs idle at T=2048; Triton stays selectable by name)
_AUTO: Dict[str, Tuple[str, ...]] = {"cuda": ("torch_chunked", "triton"), "cpu": ("torch_chunked",)}


def register_logprob_backend(name: str, available: Callable[[], bool] = lambda: True):
    def deco(fn: LogprobFn) -> LogprobFn:
        _BACKENDS[name] = fn
        _AVAILABLE[name] = available
        return fn

    return deco


def available_logprob_backends() -> list[str]:
    return [n for n in _BACKENDS if _AVAILABLE[n]()]


def _validate(hidden, weight, targets, temperature):
    if not isinstance(hidden, torch.Tensor) or hidden.ndim != 2:
        raise ValueError(f"hidden: expected a [T, H] tensor, got {getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        raise ValueError(f"weight: expected a [V, H] tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight: hidden size {weight.shape[1]} does not match hidden's {hidden.shape[1]}")
    if weight.shape[0] == 0:
        raise ValueError("weight: vocabulary is empty")
    if not isinstance(targets, torch.Tensor) or targets.ndim != 1 or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets: expected a [{hidden.shape[0]}] tensor, got {getattr(targets, 'shape', type(targets))}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected integer token ids, got {targets.dtype}")
    if not hidden.dtype.is_floating_point or weight.dtype != hidden.dtype:
        raise ValueError(f"weight: dtype {weight.dtype} must equal hidden's floating dtype {hidden.dtype}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"targets/weight: devices {targets.device}/{weight.device} differ from hidden's {hidden.device}")
    if targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= weight.shape[0]:
            bad = lo if lo < 0 else hi
            raise ValueError(f"targets: id {bad} outside the vocabulary [0, {weight.shape[0]})")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: must be a finite number > 0, got {temperature!r}")


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    backend: str = "auto",
    **tiles,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """logp [T] (float32; float64 for float64 inputs) of ``targets`` under softmax(hidden @ weight.T / temperature), and the
    entropy [T] of that distribution when ``with_entropy`` (else None).  Differentiable w.r.t.
    hidden and weight.  ``tiles`` (e.g. ``tile_t``, ``tile_v``) are passed to the backend."""
    _validate(hidden, weight, targets, temperature)
    if backend == "auto":
        order = _AUTO.get(hidden.device.type, ("torch_chunked",))
        backend = next((n for n in order if n in _BACKENDS and _AVAILABLE[n]()), "torch_chunked")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: unknown {backend!r}; choose from {['auto'] + sorted(_BACKENDS)}")
    if not _AVAILABLE[backend]():
        raise ValueError(f"backend: {backend!r} is not available here; available: {available_logprob_backends()}")
    return _BACKENDS[backend](hidden, weight, targets.long(), float(temperature), bool(with_entropy), **tiles)


@register_logprob_backend("naive")
def naive_logprobs(hidden, weight, targets, temperature=1.0, with_entropy=False):
    """The specification: full [T, V] logits, log_softmax, gather.  Tests and benches only."""
    logits = (hidden @ weight.t()).to(_acc_dtype(hidden.dtype)) / temperature
    logsm = torch.log_softmax(logits, dim=-1)
    logp = logsm.gather(1, targets.long()[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, ent


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for fp32/bf16/fp16 inputs, float64 for float64 ones (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def _tile_logits(h, w, inv_temp):
    """One [tt, tv] logit tile in the accumulation dtype (matmul in the inputs' dtype, as the
    naive path does)."""
    z = torch.mm(h, w.t())
    z = z.to(_acc_dtype(z.dtype))
    return z if inv_temp == 1.0 else z.mul_(inv_temp)


class _ChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, tile_t, tile_v):
        T, V = hidden.shape[0], weight.shape[0]
        dev, acc = hidden.device, _acc_dtype(hidden.dtype)
        logp = torch.empty(T, dtype=acc, device=dev)
        lse = torch.empty(T, dtype=acc, device=dev)
        S = torch.empty(T, dtype=acc, device=dev) if with_entropy else None
        for t0 in range(0, T, tile_t):
            t1 = min(T, t0 + tile_t)
            h, y = hidden[t0:t1], targets[t0:t1]
            n = t1 - t0
            m = torch.full((n,), -math.inf, dtype=acc, device=dev)  # running lse (no entropy) or max
            s = torch.zeros(n, dtype=acc, device=dev)  # sum exp(z - m)
            u = torch.zeros(n, dtype=acc, device=dev)  # sum exp(z - m) * z
            zy = torch.zeros(n, dtype=acc, device=dev)
            for v0 in range(0, V, tile_v):
                v1 = min(V, v0 + tile_v)
                z = _tile_logits(h, weight[v0:v1], inv_temp)
                hit = (y >= v0) & (y < v1)
                zy = torch.where(hit, z.gather(1, (y - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), zy)
                if not with_entropy:  # torch's fused logsumexp: no exp tile is allocated
                    m = torch.logaddexp(m, torch.logsumexp(z, 1))
                    del z  # free before the next tile is allocated
                    continue
                m_new = torch.maximum(m, z.amax(1))
                scale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile
                e = torch.sub(z, m_new[:, None]).exp_()  # one tile allocation, not two
                s = s * scale + e.sum(1)
                u = u * scale + e.mul_(z).sum(1)
                m = m_new
                del z, e
            lse_c = m + torch.log(s) if with_entropy else m
            lse[t0:t1] = lse_c
            logp[t0:t1] = zy - lse_c
            if with_entropy:
                S[t0:t1] = u / s
        ctx.save_for_backward(hidden, weight, targets, lse, S if with_entropy else lse)
        ctx.cfg = (inv_temp, with_entropy, tile_t, tile_v)
        ent = (lse - S) if with_entropy else None
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, S = ctx.saved_tensors
        inv_temp, with_entropy, tile_t, tile_v = ctx.cfg
        T, V = hidden.shape[0], weight.shape[0]
        dev, acc = hidden.device, _acc_dtype(hidden.dtype)
        use_ent = with_entropy and g_ent is not None
        if g_logp is None:
            g_logp = torch.zeros(T, dtype=acc, device=dev)
        g_logp = g_logp.to(acc)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # CPU: fp32 (or fp64) accumulators and grad matmuls, so low-precision inputs add no error.
        # GPU with bf16/fp16 inputs: tensor-core matmuls on dz rounded to the input dtype and grads
        # accumulated in it (an fp32 [V, H] accumulator alone would cost more than the 15% memory
        # budget at V=152k); with whole-vocab tiles grad_hidden is one matmul per token tile.
        lowp = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        gdt = hidden.dtype if lowp else acc
        grad_h = torch.zeros(hidden.shape, dtype=gdt, device=dev) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=gdt, device=dev) if need_w else None
        for t0 in range(0, T, tile_t):
            t1 = min(T, t0 + tile_t)
            h, y = hidden[t0:t1], targets[t0:t1]
            gl = g_logp[t0:t1, None]
            neg_gl_t = gl * -inv_temp
            lse_c = lse[t0:t1, None]
            if use_ent:
                ge, S_c = g_ent[t0:t1, None].to(acc), S[t0:t1, None]
            hf = h if lowp else h.to(acc)
            for v0 in range(0, V, tile_v):
                v1 = min(V, v0 + tile_v)
                w = weight[v0:v1]
                z = _tile_logits(h, w, inv_temp)
                p = torch.sub(z, lse_c).exp_()
                if use_ent:  # dz = p * (e * (S - z) - g) / temp
                    dz = z.neg_().add_(S_c).mul_(ge).sub_(gl).mul_(p)
                    if inv_temp != 1.0:
                        dz.mul_(inv_temp)
                else:  # dz = -g * p / temp, in one pass
                    dz = p.mul_(neg_gl_t)
                hit = (y >= v0) & (y < v1)
                if bool(hit.any()):
                    rows = hit.nonzero().squeeze(1)
                    dz[rows, y[rows] - v0] += g_logp[t0:t1][rows] * inv_temp
                if lowp:
                    dz = dz.to(gdt)
                if need_h:
                    grad_h[t0:t1].addmm_(dz, w.to(gdt))
                if need_w:
                    grad_w[v0:v1].addmm_(dz.t(), hf)
                del z, p, dz  # free before the next tile is allocated
        gh = grad_h.to(hidden.dtype) if need_h else None
        gw = grad_w.to(weight.dtype) if need_w else None
        return gh, gw, None, None, None, None, None


def _default_tiles(T: int, V: int, H: int, device_type: str = "cpu") -> Tuple[int, int]:
    if device_type == "cuda":
        # Whole-vocab rows: one cuBLAS matmul per token tile, fp32 logit tile capped at 24M
        # elements (96 MiB), token tiles a multiple of 64 for the tensor cores.
        return max(1, min(T, max(64, (24 << 20) // V // 64 * 64))), V
    # Long token tiles: the grad_weight matmul reduces over tile_t, and a short reduction
    # (e.g. 256) made it memory-bound (measured ~1.3x slower end to end at T=2048).  Tiles are
    # capped at 8M elements (32 MiB fp32) and at 1/16 of [T, V], so live tiles stay small.
    tile_v = min(V, 4096)
    tile_t = min(T, 2048, max(64, (T * V) // (16 * tile_v)))
    return max(tile_t, 1), tile_v


@register_logprob_backend("torch_chunked")
def chunked_logprobs(hidden, weight, targets, temperature=1.0, with_entropy=False, tile_t=None, tile_v=None):
    """Portable path (any device): torch matmuls on [tile_t, tile_v] tiles, online logsumexp."""
    dt, dv = _default_tiles(hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.device.type)
    tile_t, tile_v = int(tile_t or dt), int(tile_v or dv)
    if tile_t < 1 or tile_v < 1:
        raise ValueError(f"tile_t/tile_v: must be >= 1, got {tile_t}/{tile_v}")
    if hidden.shape[0] == 0:
        z = hidden.new_zeros(0, dtype=_acc_dtype(hidden.dtype)) + 0 * weight.sum()
        return z, (z.clone() if with_entropy else None)
    return _ChunkedLogprob.apply(hidden, weight, targets, 1.0 / temperature, with_entropy, tile_t, tile_v)


@register_logprob_backend("triton", available=triton_available)
def triton_logprobs(hidden, weight, targets, temperature=1.0, with_entropy=False, **tiles):
    """Tiled Triton kernels (GPU; on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
    from .triton_kernel import triton_fused_logprobs  # imported lazily: Triton is optional

    return triton_fused_logprobs(hidden, weight, targets, temperature, with_entropy, **tiles)

"""Triton kernels for the fused lm_head -> logprob (+ entropy) op (see arl/ops/logprob/api.py for
the math).

Three kernels, each over [BLOCK_T, BLOCK_V] logit tiles computed by looping tl.dot over BLOCK_H
slices of the hidden size, so no [T, V] tensor ever exists:

* ``_fwd``: one program per token block; walks the vocabulary with an online logsumexp (running
  max m, sum s = sum exp(z - m), and u = sum exp(z - m) z for the entropy).  Stores logp, lse, S.
* ``_bwd_hidden``: one program per token block (it owns those rows of grad_hidden, so no atomics);
  recomputes each tile's dz and accumulates dz @ W.
* ``_bwd_weight``: one program per vocab block (it owns those rows of grad_weight); recomputes dz
  over all token blocks and accumulates dz.T @ hidden.  Deterministic, no atomics.

One autotune-free config (big blocks): the interpreter costs milliseconds per program, and
autotuning with several configs fails under it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _logit_tile(h_ptr, w_ptr, offs_t, offs_v, T, V, H, inv_temp, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                BLOCK_H: tl.constexpr, LOWP: tl.constexpr):
    """[BLOCK_T, BLOCK_V] fp32 tile of hidden @ weight.T * inv_temp; -inf outside the vocabulary."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        hh = h0 + offs_h
        a = tl.load(h_ptr + offs_t[:, None] * H + hh[None, :], mask=(offs_t[:, None] < T) & (hh[None, :] < H),
                    other=0.0)
        b = tl.load(w_ptr + offs_v[:, None] * H + hh[None, :], mask=(offs_v[:, None] < V) & (hh[None, :] < H),
                    other=0.0)
        if LOWP:  # bf16/fp16 on a GPU: tensor-core dot, fp32 accumulation
            acc += tl.dot(a, tl.trans(b))
        else:  # fp32 exact (tests at 1e-5); also bf16 under the interpreter, whose bf16 dot is wrong
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    acc = acc * inv_temp
    return tl.where(offs_v[None, :] < V, acc, float("-inf"))


@triton.jit
def _fwd(h_ptr, w_ptr, y_ptr, logp_ptr, lse_ptr, s_ptr, T, V, H, inv_temp, WITH_ENT: tl.constexpr,
         BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, LOWP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    y = tl.load(y_ptr + offs_t, mask=tmask, other=0)
    m = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    u = tl.zeros((BLOCK_T,), dtype=tl.float32)
    zy = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        z = _logit_tile(h_ptr, w_ptr, offs_t, offs_v, T, V, H, inv_temp, BLOCK_T, BLOCK_V, BLOCK_H, LOWP)
        vmask = offs_v[None, :] < V
        zy += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
        m_new = tl.maximum(m, tl.max(z, axis=1))
        scale = tl.exp(m - m_new)
        e = tl.where(vmask, tl.exp(z - m_new[:, None]), 0.0)
        s = s * scale + tl.sum(e, axis=1)
        if WITH_ENT:
            u = u * scale + tl.sum(e * tl.where(vmask, z, 0.0), axis=1)  # no 0 * -inf
        m = m_new
    lse = m + tl.log(s)
    tl.store(logp_ptr + offs_t, zy - lse, mask=tmask)
    tl.store(lse_ptr + offs_t, lse, mask=tmask)
    if WITH_ENT:
        tl.store(s_ptr + offs_t, u / s, mask=tmask)


@triton.jit
def _dz_tile(z, offs_t, offs_v, y_ptr, g_ptr, ge_ptr, lse_ptr, s_ptr, T, V, inv_temp, WITH_ENT: tl.constexpr):
    """dz (already scaled by inv_temp) for one tile, from the recomputed logits z."""
    tmask = offs_t < T
    y = tl.load(y_ptr + offs_t, mask=tmask, other=-1)
    g = tl.load(g_ptr + offs_t, mask=tmask, other=0.0)
    lse = tl.load(lse_ptr + offs_t, mask=tmask, other=0.0)
    vmask = offs_v[None, :] < V
    p = tl.where(vmask & tmask[:, None], tl.exp(z - lse[:, None]), 0.0)
    dz = -g[:, None] * p
    if WITH_ENT:
        ge = tl.load(ge_ptr + offs_t, mask=tmask, other=0.0)
        S = tl.load(s_ptr + offs_t, mask=tmask, other=0.0)
        dz += ge[:, None] * p * (S[:, None] - tl.where(vmask, z, 0.0))  # p = 0 off-vocab; no 0 * -inf
    dz += tl.where(offs_v[None, :] == y[:, None], g[:, None], 0.0)
    return dz * inv_temp


@triton.jit
def _bwd_hidden(h_ptr, w_ptr, y_ptr, g_ptr, ge_ptr, lse_ptr, s_ptr, gh_ptr, T, V, H, inv_temp,
                WITH_ENT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                LOWP: tl.constexpr):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.arange(0, BLOCK_H)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        z = _logit_tile(h_ptr, w_ptr, offs_t, offs_v, T, V, H, inv_temp, BLOCK_T, BLOCK_V, BLOCK_H, LOWP)
        dz = _dz_tile(z, offs_t, offs_v, y_ptr, g_ptr, ge_ptr, lse_ptr, s_ptr, T, V, inv_temp, WITH_ENT)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + offs_h
            wmask = (offs_v[:, None] < V) & (hh[None, :] < H)
            w = tl.load(w_ptr + offs_v[:, None] * H + hh[None, :], mask=wmask, other=0.0)
            gmask = (offs_t[:, None] < T) & (hh[None, :] < H)
            gptrs = gh_ptr + offs_t[:, None] * H + hh[None, :]
            acc = tl.load(gptrs, mask=gmask, other=0.0)
            if LOWP:
                acc += tl.dot(dz.to(w.dtype), w)
            else:  # float64 running sum over vocab tiles: fp32 alone drifts past 1e-5 at V=5k
                acc += tl.dot(dz, w.to(tl.float32), input_precision="ieee").to(tl.float64)
            tl.store(gptrs, acc, mask=gmask)


@triton.jit
def _bwd_weight(h_ptr, w_ptr, y_ptr, g_ptr, ge_ptr, lse_ptr, s_ptr, gw_ptr, T, V, H, inv_temp,
                WITH_ENT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                LOWP: tl.constexpr):
    pid = tl.program_id(0)
    offs_v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_h = tl.arange(0, BLOCK_H)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        z = _logit_tile(h_ptr, w_ptr, offs_t, offs_v, T, V, H, inv_temp, BLOCK_T, BLOCK_V, BLOCK_H, LOWP)
        dz = _dz_tile(z, offs_t, offs_v, y_ptr, g_ptr, ge_ptr, lse_ptr, s_ptr, T, V, inv_temp, WITH_ENT)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + offs_h
            hmask = (offs_t[:, None] < T) & (hh[None, :] < H)
            hv = tl.load(h_ptr + offs_t[:, None] * H + hh[None, :], mask=hmask, other=0.0)
            gmask = (offs_v[:, None] < V) & (hh[None, :] < H)
            gptrs = gw_ptr + offs_v[:, None] * H + hh[None, :]
            acc = tl.load(gptrs, mask=gmask, other=0.0)
            if LOWP:
                acc += tl.dot(tl.trans(dz.to(hv.dtype)), hv)
            else:  # float64 running sum over token tiles (see _bwd_hidden)
                acc += tl.dot(tl.trans(dz), hv.to(tl.float32), input_precision="ieee").to(tl.float64)
            tl.store(gptrs, acc, mask=gmask)


def _blocks(T: int, V: int, H: int, interpret: bool):
    # The interpreter pays per program, not per element: one big block per axis is fastest there.
    if interpret:
        bt = max(16, min(128, triton.next_power_of_2(max(T, 1))))
        bv = max(16, min(256, triton.next_power_of_2(V)))
        bh = max(16, min(128, triton.next_power_of_2(H)))
        return bt, bv, bh
    return 64, 128, 64


def _lowp(hidden) -> bool:
    return hidden.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") != "1"


class _TritonLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, blocks):
        T, H = hidden.shape
        V = weight.shape[0]
        bt, bv, bh = blocks
        logp = torch.empty(T, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        S = torch.empty_like(logp) if with_entropy else lse  # dummy pointer when unused
        _fwd[(triton.cdiv(T, bt),)](hidden, weight, targets, logp, lse, S, T, V, H, inv_temp, WITH_ENT=with_entropy,
                                     BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, LOWP=_lowp(hidden))
        ctx.save_for_backward(hidden, weight, targets, lse, S)
        ctx.cfg = (inv_temp, with_entropy, blocks)
        return logp, ((lse - S) if with_entropy else None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, S = ctx.saved_tensors
        inv_temp, with_entropy, (bt, bv, bh) = ctx.cfg
        T, H = hidden.shape
        V = weight.shape[0]
        use_ent = with_entropy and g_ent is not None
        g = torch.zeros(T, dtype=torch.float32, device=hidden.device) if g_logp is None else g_logp.float().contiguous()
        ge = g_ent.float().contiguous() if use_ent else g
        args = (hidden, weight, targets, g, ge, lse, S)
        acc_dt = torch.float32 if _lowp(hidden) else torch.float64  # the grads' running sums
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = torch.zeros((T, H), dtype=acc_dt, device=hidden.device)
            _bwd_hidden[(triton.cdiv(T, bt),)](*args, gh, T, V, H, inv_temp, WITH_ENT=use_ent,
                                               BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, LOWP=_lowp(hidden))
            gh = gh.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            gw = torch.zeros((V, H), dtype=acc_dt, device=hidden.device)
            _bwd_weight[(triton.cdiv(V, bv),)](*args, gw, T, V, H, inv_temp, WITH_ENT=use_ent,
                                               BLOCK_T=bt, BLOCK_V=bv, BLOCK_H=bh, LOWP=_lowp(hidden))
            gw = gw.to(weight.dtype)
        return gh, gw, None, None, None, None


def triton_fused_logprobs(hidden, weight, targets, temperature=1.0, with_entropy=False, blocks=None):
    """Inputs as in ``arl.ops.logprob.fused_logprobs`` (validated there)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if hidden.device.type == "cpu" and not interpret:
        raise ValueError("hidden: the Triton logprob kernel needs a GPU tensor (or TRITON_INTERPRET=1)")
    T, H = hidden.shape
    V = weight.shape[0]
    if T == 0:
        z = torch.zeros(0, dtype=torch.float32, device=hidden.device) + 0 * weight.sum()
        return z, (z.clone() if with_entropy else None)
    blocks = tuple(blocks) if blocks is not None else _blocks(T, V, H, interpret)
    return _TritonLogprob.apply(hidden.contiguous(), weight.contiguous(), targets.long().contiguous(),
                                1.0 / float(temperature), bool(with_entropy), blocks)

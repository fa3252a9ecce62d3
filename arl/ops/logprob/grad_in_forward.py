"""The logprob head that produces its gradients during its forward, for a loss whose d loss / d logp
(and d loss / d entropy) is known from each token's own logits row before the backward runs.

Per token tile (whole vocabulary rows, z = hidden @ weight.T / temperature):

    z -> lse, logp (and S = sum_v p z, entropy = lse - S) -> g, e = coef.grad(tile, logp)
      -> dz = g (onehot(y) - p) + e p (S - z), scaled by 1/temperature
      -> grad_hidden[tile] = dz @ weight,  grad_weight += dz.T @ hidden[tile]

Three matmuls per tile and no logits recomputation (the bounded-memory backward of api.py needs a
fourth); the price is one [tile, V] row block instead of [tile_t, tile_v].  The entropy needs z
after exp(z - max) (for S) and after p (for its gradient): those pass through a small [rows, V]
scratch block in row groups, and the logits block is turned into dz in place.
``coef`` is the loss side's plan (arl/ops/policy_loss/local_grad.py: ``cuts(max_rows)`` gives tile
bounds that keep every dependency segment in one tile, ``grad(i0, i1, logp)`` the coefficients,
optionally ``entropy_grad``: False when ``grad`` never returns an entropy coefficient, which lets
the entropy path turn z into p during the statistics pass instead of recomputing exp); any object
with those methods works (``ConstantGrad`` for benches and tests).

The backward returns the stored gradients after checking that the loss's actual incoming
gradients equal the ones used (a one-line error otherwise: the plan and the loss disagree, which
is a bug, never silently a wrong gradient).
"""
from __future__ import annotations

from typing import Optional

import torch

from .api import _acc_dtype, _tile_logits, _validate

# |incoming - precomputed| <= _RTOL * max |gradient|: rounding of the loss kernel's own arithmetic
# passes, a wrong coefficient (relative error O(1)) does not
_RTOL = 1e-3


class ConstantGrad:
    """A plan with fixed coefficients: d loss / d logp = ``g``, d loss / d entropy = ``ge``."""

    def __init__(self, g: torch.Tensor, ge: Optional[torch.Tensor] = None):
        self.g, self.ge = g, ge

    @property
    def entropy_grad(self) -> bool:
        return self.ge is not None

    def cuts(self, max_rows: int):
        n = self.g.numel()
        return list(range(0, n, max_rows)) + [n]

    def grad(self, i0: int, i1: int, logp: torch.Tensor):
        return self.g[i0:i1].to(logp.dtype), (None if self.ge is None else self.ge[i0:i1].to(logp.dtype))


# the entropy path's row groups per tile: its scratch block is a quarter of the tile, and each group
# costs a few ops (on a loaded CPU every op pays a thread sync of ~ms: 1-row groups were 7x slower)
_GROUPS = 4


def default_tile_rows(T: int, V: int, device_type: str = "cpu", with_entropy: bool = False) -> int:
    """Rows of the one [rows, V] logit block: about T/8 (well under the [T, V] logits the naive
    head holds several of), at least 32M elements' worth (128 MiB fp32: the grad_weight update
    reduces over the rows, and short reductions are memory-bound).  With the entropy that budget
    holds the block and its [rows / _GROUPS, V] scratch together."""
    share = _GROUPS / (_GROUPS + 1) if with_entropy else 1.0
    # as api._default_tiles: an fp32 row block of at most 24M elements (64 rows above V ~ 393k)
    if device_type == "cuda":
        return max(1, min(T, max(64, int((24 << 20) * share) // V // 64 * 64)))
    return max(1, min(T, int(max((32 << 20) // V, -(-T // 8)) * share)))


def _check(name: str, got: Optional[torch.Tensor], want: torch.Tensor) -> None:
    got = torch.zeros_like(want) if got is None else got.to(want.dtype)
    err = float((got - want).abs().max()) if want.numel() else 0.0
    scale = max(float(want.abs().max()), float(got.abs().max())) if want.numel() else 0.0
    if err > _RTOL * scale:
        i = int((got - want).abs().argmax())
        raise RuntimeError(f"grad_in_forward head: the loss's d loss/d {name} differs from the plan's "
                           f"(max |diff| {err:.3g} at row {i}: got {float(got[i]):.6g}, planned {float(want[i]):.6g}); "
                           f"the loss config has no local gradient the plan knows (turn trainer.head_grad_in_forward off)")


def _entropy_stats(z: torch.Tensor, buf: torch.Tensor, keep_z: bool):
    """(lse, S = sum_v p z) of each row of z, in row groups through the scratch ``buf`` [r, V]
    (exp(z - max) needs a block of its own while z is still needed for S).  z is left as it is
    when ``keep_z`` (the entropy gradient reads it), else turned into p in place."""
    n, r = z.shape[0], buf.shape[0]
    m = z.amax(1)
    s = torch.empty(n, dtype=z.dtype, device=z.device)
    u = torch.empty(n, dtype=z.dtype, device=z.device)  # sum_v exp(z - m) z
    for r0 in range(0, n, r):
        zr = z[r0:r0 + r]
        k = zr.shape[0]
        ex = torch.sub(zr, m[r0:r0 + k, None], out=buf[:k]).exp_()
        torch.sum(ex, 1, out=s[r0:r0 + k])
        torch.bmm(ex.unsqueeze(1), zr.unsqueeze(2), out=u[r0:r0 + k].view(k, 1, 1))  # row dots, no temporary
        if not keep_z:
            torch.div(ex, s[r0:r0 + k, None], out=zr)
    return m + torch.log(s), u / s


def _entropy_dz(z: torch.Tensor, buf: torch.Tensor, lse, S, e, g) -> torch.Tensor:
    """z -> p (e (S - z) - g) in place, p = exp(z - lse) in row groups through ``buf``."""
    r, ne = buf.shape[0], -e
    for r0 in range(0, z.shape[0], r):
        zr = z[r0:r0 + r]
        k = zr.shape[0]
        p = torch.sub(zr, lse[r0:r0 + k, None], out=buf[:k]).exp_()
        # (z - S) (-e) is e (S - z) bit for bit (negation is exact), one pass fewer
        zr.sub_(S[r0:r0 + k, None]).mul_(ne[r0:r0 + k, None]).sub_(g[r0:r0 + k, None]).mul_(p)
    return z


class _GradInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, coef, cuts, scratch):
        T, V = hidden.shape[0], weight.shape[0]
        dev, acc = hidden.device, _acc_dtype(hidden.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # as api.py's backward: fp32 (fp64) matmuls on CPU; bf16/fp16 on a GPU with dz rounded to them
        lowp = hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)
        gdt = hidden.dtype if lowp else acc
        logp = torch.empty(T, dtype=acc, device=dev)
        ent = torch.empty(T, dtype=acc, device=dev) if with_entropy else None
        g_all = torch.zeros(T, dtype=acc, device=dev)
        e_all = None
        grad_h = torch.empty(hidden.shape, dtype=gdt, device=dev) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=gdt, device=dev) if need_w else None
        wg = weight.to(gdt)
        tile = max(b - a for a, b in zip(cuts[:-1], cuts[1:]))
        # the entropy path's scratch rows (the one [tile, V] logits block is all else it holds)
        rows = -(-tile // _GROUPS) if scratch is None else min(tile, scratch)
        buf = torch.empty(rows, V, dtype=acc, device=dev) if with_entropy else None
        keep_z = with_entropy and bool(getattr(coef, "entropy_grad", True))  # unknown plans: keep z
        for t0, t1 in zip(cuts[:-1], cuts[1:]):
            h, y = hidden[t0:t1], targets[t0:t1]
            z = _tile_logits(h, weight, inv_temp)  # [n, V], the one logits matmul
            zy = z.gather(1, y[:, None]).squeeze(1)
            if with_entropy:
                lse, S = _entropy_stats(z, buf, keep_z)  # z: kept, or p
                ent[t0:t1] = lse - S
            else:  # softmax by hand, in place: torch.logsumexp allocates two [n, V] temporaries
                m = z.amax(1)
                s = z.sub_(m[:, None]).exp_().sum(1)
                lse = m + torch.log(s)
                p = z.div_(s[:, None])
            lp = zy - lse
            logp[t0:t1] = lp
            g, e = coef.grad(t0, t1, lp)
            g = g.to(acc)
            g_all[t0:t1] = g
            if e is not None and with_entropy and not keep_z:
                raise RuntimeError("grad_in_forward head: the plan returned an entropy gradient but its "
                                   "entropy_grad said it has none")
            if not with_entropy:
                dz = p.mul_(-g[:, None])
            elif e is None:  # the entropy's value only
                dz = (z if not keep_z else z.sub_(lse[:, None]).exp_()).mul_(-g[:, None])
            else:
                e = e.to(acc)
                if e_all is None:
                    e_all = torch.zeros(T, dtype=acc, device=dev)
                e_all[t0:t1] = e
                dz = _entropy_dz(z, buf, lse, S, e, g)  # p (e (S - z) - g)
            dz[torch.arange(t1 - t0, device=dev), y] += g
            if inv_temp != 1.0:
                dz.mul_(inv_temp)
            z = p = None  # dz is the same block: nothing else of this tile stays
            if lowp:
                dz = dz.to(gdt)
            if need_h:
                torch.mm(dz, wg, out=grad_h[t0:t1])
            if need_w:
                grad_w.addmm_(dz.t(), h.to(gdt))
            dz = None  # free this block before the next tile's logits are allocated
        ctx.grads = (grad_h.to(hidden.dtype) if need_h else None, grad_w.to(weight.dtype) if need_w else None)
        ctx.planned = (g_all, e_all)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        g_all, e_all = ctx.planned
        _check("logp", g_logp, g_all)
        if e_all is not None or g_ent is not None:
            _check("entropy", g_ent, e_all if e_all is not None else torch.zeros_like(g_all))
        gh, gw = ctx.grads
        ctx.grads = ctx.planned = None  # one backward: free the stored gradients with it
        return gh, gw, None, None, None, None, None, None


def grad_in_forward_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, coef,
                             temperature: float = 1.0, with_entropy: bool = False, tile_rows: Optional[int] = None,
                             scratch_rows: Optional[int] = None):
    """logp [T] (and entropy [T] when ``with_entropy``) as ``fused_logprobs`` gives them, differentiable
    w.r.t. hidden and weight for a loss whose gradient ``coef`` plans (module docstring).  None when
    ``coef`` cannot tile these rows within ``tile_rows`` (a dependency segment is longer): the caller
    takes the ordinary path.  ``scratch_rows``: rows of the entropy path's scratch block (default: a
    ``_GROUPS``-th of the longest tile).  Under no_grad this is a plain forward that also computes
    the gradients: use the ordinary path there."""
    _validate(hidden, weight, targets, temperature)
    T, V = hidden.shape[0], weight.shape[0]
    rows = int(tile_rows or default_tile_rows(T, V, hidden.device.type, bool(with_entropy)))
    if rows < 1:
        raise ValueError(f"tile_rows: must be >= 1, got {rows}")
    if scratch_rows is not None and int(scratch_rows) < 1:
        raise ValueError(f"scratch_rows: must be >= 1, got {scratch_rows}")
    if T == 0:
        return None
    cuts = coef.cuts(rows)
    if cuts is None:
        return None
    return _GradInForward.apply(hidden, weight, targets.long(), 1.0 / float(temperature), bool(with_entropy), coef,
                                cuts, None if scratch_rows is None else int(scratch_rows))

"""d loss / d logp known before the gradient pass: the policy loss's per-token gradient when the old
logprobs ARE this pass's (``old_logp = logp.detach()``, the trainer's one-update-per-batch step).

Then every log-ratio is exactly 0 (token, chunk and sequence level alike: a mean of zeros), so
r = 1, and by the spec (spec.py) the surrogate pg_t = f(A_t, r_t, logp_t) of any registered
function f has two slopes at r = 1 per trained token: a_t = d f / d logp_t and b_t = d f / d r_t,
found here by autograd on f itself (so a new surrogate needs no code here).  With
c_t = scale * coef_t / D on trained tokens (0 elsewhere):

    dL/dlogp_u = w_u c_u a_u  +  mean over the ratio segment R(u) of  w_t c_t b_t    (d r_t / d logp_u = 1/|R|)
    + kl_beta * c_u * dkl_u/dlogp_u     (autograd on the registered KL estimator, per tile)
    dL/dentropy_u = -entropy_coef * c_u  (trained tokens, when an entropy is passed)

ppo_clip: a = 0, b = -A (no clip or dual clip is active at r = 1); topr and cispo: a = -A, b = 0
(their weights are stop-gradients, 1 at r = 1).  The slopes must not move with logp's value (they
are taken at two values of it; a surrogate whose slope does gets no plan: the ordinary backward).
A_t, coef_t and D are constants of the batch.  The mismatch weight w (no gradient) is a function
of the old logprobs, i.e. of this pass's logp values: at level ``token`` of the token's own, at
``chunk`` / ``sequence`` of its whole segment's.  So the gradient of a token depends on logp values
of other tokens exactly when a mismatch level is set and the segment is wider than the token: the
``dependency level`` (``LogpGrad.dependency``) is the mismatch level, widened to the ratio level
when some b != 0 (the ratio mean sums w over R).  A head that computes the gradient during its
forward must then see whole dependency segments in one token tile (``LogpGrad.cuts``); a segment
longer than its tile cap is the case with no local gradient, and the caller falls back to the
ordinary backward.  The entropy bonus is local too (its coefficient is a constant); the head needs
its whole vocabulary row for it, which arl/ops/logprob/grad_in_forward.py has.

Not covered (``local_logp_grad`` returns None): IPA's mixed loss (a different loss: the trainer
never asks), and a surrogate whose slopes at r = 1 depend on logp.  Tested against the spec's
autograd in tests/ops/test_logprob_grad_in_forward.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .config import LossConfig
from .group_adv import GroupAdvantages, in_pass_advantages
from .spec import KL_ESTIMATORS, SURROGATES, PackLayout, agg_denominator, discounted_advantage

_LEVEL_RANK = {"none": 0, "token": 1, "chunk": 2, "sequence": 3}


@dataclass
class LogpGrad:
    """The loss's gradient coefficients over the packed tokens (or, after ``rows``, over a subset of
    positions in their order).  ``grad(i0, i1, logp)`` -> (dL/dlogp, dL/dentropy or None) of
    positions i0:i1, given their logp values; only valid on tiles whose bounds come from ``cuts``."""

    cfg: LossConfig
    k: torch.Tensor  # [n] c * a: the token's own slope (d pg / d logp) on trained tokens, 0 elsewhere
    kr: Optional[torch.Tensor]  # [n] c * b: the slope through the ratio (d pg / d r); None: b = 0 everywhere
    const: Optional[torch.Tensor]  # [n] the whole dL/dlogp minus the KL part when w needs no logp (mismatch none)
    ratio_seg: torch.Tensor  # [n] ratio-level segment id (-1: untrained)
    mm_seg: Optional[torch.Tensor]  # [n] mismatch-level segment id (-1: untrained); None: mismatch none
    roll: Optional[torch.Tensor]  # [n] rollout logp (mismatch)
    kl_c: Optional[torch.Tensor]  # [n] scale * kl_beta * coef / D
    ref: Optional[torch.Tensor]  # [n] reference logp (KL)
    ent_c: Optional[torch.Tensor]  # [n] dL/dentropy
    dep_seg: Optional[torch.Tensor]  # [n] dependency segment id (-1: none); None: every token independent
    applied: bool = False  # set by the head that used it (arl/model/packed.py)

    @property
    def entropy_grad(self) -> bool:
        """Whether ``grad`` returns a d loss / d entropy (an entropy bonus is configured and passed)."""
        return self.ent_c is not None

    @property
    def dependency(self) -> str:
        return "token" if self.dep_seg is None else "segment"

    def rows(self, positions: torch.Tensor) -> Optional["LogpGrad"]:
        """The plan restricted to ``positions`` (the head's rows: packed index of each row's logp).
        None when a trained token is not among them (its logp is no head output)."""
        pos = positions.long()
        trained = self.ratio_seg >= 0
        if int(trained.sum()) != int(trained[pos].sum()):
            return None
        take = lambda x: None if x is None else x[pos]  # noqa: E731
        return LogpGrad(self.cfg, self.k[pos], take(self.kr), take(self.const), self.ratio_seg[pos], take(self.mm_seg),
                        take(self.roll), take(self.kl_c), take(self.ref), take(self.ent_c), take(self.dep_seg))

    def cuts(self, max_rows: int) -> Optional[list]:
        """Tile bounds [0, c_1, ..., n] with tiles of at most ``max_rows`` positions that never split a
        dependency segment; None when one segment alone is longer than ``max_rows``."""
        n = self.k.numel()
        if self.dep_seg is None:
            return list(range(0, n, max_rows)) + [n]
        # a cut before position j is forbidden when a segment has members on both sides of it
        seg = self.dep_seg.cpu()
        idx = (seg >= 0).nonzero().squeeze(1)
        ok = torch.ones(n + 1, dtype=torch.bool)
        if idx.numel():
            s = seg[idx]
            ns = int(s.max()) + 1
            first = torch.full((ns,), n, dtype=torch.long).scatter_reduce(0, s, idx, "amin")
            last = torch.full((ns,), -1, dtype=torch.long).scatter_reduce(0, s, idx, "amax")
            present = last >= 0
            cover = torch.zeros(n + 2, dtype=torch.long)
            cover.index_add_(0, first[present] + 1, torch.ones(int(present.sum()), dtype=torch.long))
            cover.index_add_(0, last[present] + 1, -torch.ones(int(present.sum()), dtype=torch.long))
            ok = cover.cumsum(0)[: n + 1] == 0
        allowed = ok.nonzero().squeeze(1).tolist()  # always holds 0 and n
        out, a, i = [0], 0, 0
        while a < n:
            while i + 1 < len(allowed) and allowed[i + 1] <= a + max_rows:
                i += 1
            if allowed[i] <= a:
                return None
            a = allowed[i]
            out.append(a)
        return out

    def grad(self, i0: int, i1: int, logp: torch.Tensor):
        """(dL/dlogp, dL/dentropy or None) of positions i0:i1 from their logp values."""
        cfg = self.cfg
        lp = logp.to(self.k.dtype)
        if self.const is not None:
            g = self.const[i0:i1].clone()
        else:
            w = self._mismatch_weight(i0, i1, lp)
            g = _pg_grad(cfg, w * self.k[i0:i1], None if self.kr is None else w * self.kr[i0:i1],
                         self.ratio_seg[i0:i1])
        if self.kl_c is not None:
            g = g + self.kl_c[i0:i1] * _kl_grad(lp, self.ref[i0:i1].to(lp.dtype), cfg)
        e = None if self.ent_c is None else self.ent_c[i0:i1]
        return g, e

    def _mismatch_weight(self, i0: int, i1: int, lp: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        seg = self.mm_seg[i0:i1]
        x = lp - self.roll[i0:i1].to(lp.dtype)  # old - rollout, old = this pass's logp
        if cfg.mismatch_level != "token":
            x = _segment_mean(x, seg)
        m = torch.exp(_clamp(x, cfg))
        if cfg.mismatch_mode == "mask":
            w = ((m >= cfg.mismatch_low) & (m <= cfg.mismatch_high)).to(lp.dtype)
        else:
            w = m.clamp_max(cfg.mismatch_high)
        return torch.where(seg >= 0, w, torch.zeros_like(w))


def _clamp(x: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    c = cfg.log_ratio_clamp
    return x if c is None else x.clamp(-c, c)


def _segment_mean(x: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Mean of x over each member's segment (members: seg >= 0; sums in float64, as the spec's)."""
    member = seg >= 0
    if not bool(member.any()):
        return torch.zeros_like(x)
    s = torch.where(member, seg, seg.new_zeros(()))
    base = int(s[member].min())
    s = (s - base).clamp_min(0)
    n = int(s.max()) + 1
    sums = torch.zeros(n, dtype=torch.float64, device=x.device).index_add(0, s[member], x[member].double())
    cnt = torch.bincount(s[member], minlength=n).to(torch.float64).clamp_min(1)
    return torch.where(member, (sums / cnt).to(x.dtype)[s], torch.zeros_like(x))


def _kl_grad(lp: torch.Tensor, ref: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """d kl / d logp of the registered estimator, by autograd on it (its clamp included)."""
    with torch.enable_grad():
        x = lp.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(KL_ESTIMATORS[cfg.kl_estimator](x, ref, cfg).sum(), x)
    return g


def _pg_grad(cfg: LossConfig, ka: torch.Tensor, kb: Optional[torch.Tensor], ratio_seg: torch.Tensor) -> torch.Tensor:
    """The surrogate's dL/dlogp from its weighted slopes: a token's own, plus its ratio segment's
    mean of the slope through r (the token itself at ratio level token)."""
    if kb is None:
        return ka
    return ka + (kb if cfg.ratio_level == "token" else _segment_mean(kb, ratio_seg))


def _surrogate_slopes(cfg: LossConfig, A: torch.Tensor) -> Optional[tuple]:
    """(a, b): d pg / d logp and d pg / d r of the registered surrogate at r = 1, per trained token,
    b None when 0 everywhere; None when a slope moves with logp (taken at logp = 0 and -1)."""
    fn, slopes = SURROGATES[cfg.surrogate], []
    for at in (0.0, -1.0):
        with torch.enable_grad():
            r = torch.ones_like(A).requires_grad_(True)
            lp = torch.full_like(A, at).requires_grad_(True)
            pg = fn(A, r, lp, cfg)[0]
            ga, gb = torch.autograd.grad(pg.sum(), (lp, r), allow_unused=True, materialize_grads=True)
        slopes.append((ga.detach(), gb.detach()))
    (a, b), (a2, b2) = slopes
    if not (torch.equal(a, a2) and torch.equal(b, b2)):
        return None
    return a, (b if bool(b.any()) else None)


def local_logp_grad(
    *,
    config: LossConfig,
    advantages: Optional[torch.Tensor] = None,
    cu_seqlens: torch.Tensor,
    chunk_ids: torch.Tensor,
    rollout_logp: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    with_entropy: bool = False,
    normalizer: Optional[float] = None,
    scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    group: Optional[GroupAdvantages] = None,
) -> Optional[LogpGrad]:
    """The gradient plan of ``policy_loss(logp, logp.detach(), ...)`` times ``scale`` (the caller's
    loss multiplier), for the same keyword arguments; ``with_entropy``: an entropy is passed;
    ``group``: in-pass advantages' inputs instead of ``advantages``."""
    cfg = config
    if cfg.mismatch_level != "none" and rollout_logp is None:
        raise ValueError(f"rollout_logp: required with mismatch_level={cfg.mismatch_level!r}")
    if cfg.kl_beta > 0 and ref_logp is None:
        raise ValueError(f"ref_logp: required with kl_beta={cfg.kl_beta}")
    if isinstance(normalizer, torch.Tensor):
        normalizer = float(normalizer.item())
    dev = chunk_ids.device
    if group is not None and advantages is None:
        advantages = in_pass_advantages(group)
    if advantages is None:
        raise ValueError("advantages: required, [N] per-trajectory advantages (see arl.algo.advantages)")
    lay = PackLayout(cu_seqlens.to(dev), chunk_ids, advantages.numel())
    tidx, T = lay.tidx, lay.T
    A = discounted_advantage(advantages.to(dev).to(dtype), lay, cfg.gamma)
    if cfg.positive_only:
        A = A.clamp_min(0)
    slopes = _surrogate_slopes(cfg, A)
    if slopes is None:
        return None
    # aggregation: per-token coefficient and denominator (spec.py, "Aggregation")
    n_s = lay.tokens_per_seq.to(dtype)
    S = int((lay.tokens_per_seq > 0).sum().item())
    coef = torch.ones(tidx.numel(), dtype=dtype, device=dev)
    if cfg.loss_agg == "seq-mean-token-mean":
        coef = coef / n_s[lay.seq_of_tok[tidx]]
    D = agg_denominator(cfg, S, tidx.numel(), n_s, normalizer)
    c = coef * (scale / max(D, 1e-30))

    def full(vals: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((T,), fill, dtype=vals.dtype, device=dev)
        out[tidx] = vals
        return out

    k = full(slopes[0] * c)
    kr = None if slopes[1] is None else full(slopes[1] * c)
    rseg_t, _ = lay.segment_of_trained(cfg.ratio_level)
    ratio_seg = full(rseg_t.long(), -1)
    mm_seg = roll = dep_seg = const = None
    if cfg.mismatch_level == "none":
        const = _pg_grad(cfg, k, kr, ratio_seg)  # w = 1: the whole pg gradient is a constant
    else:
        mm_seg = full(lay.segment_of_trained(cfg.mismatch_level)[0].long(), -1)
        roll = rollout_logp.to(dev)
        widen = kr is not None and _LEVEL_RANK[cfg.ratio_level] > _LEVEL_RANK[cfg.mismatch_level]
        level = cfg.ratio_level if widen else cfg.mismatch_level
        if level != "token":
            dep_seg = full(lay.segment_of_trained(level)[0].long(), -1)
    kl_c = ref = ent_c = None
    if cfg.kl_beta > 0:
        kl_c, ref = full(c * cfg.kl_beta), ref_logp.to(dev)
    if with_entropy and cfg.entropy_coef != 0:
        ent_c = full(c * -cfg.entropy_coef)
    return LogpGrad(cfg, k, kr, const, ratio_seg, mm_seg, roll, kl_c, ref, ent_c, dep_seg)

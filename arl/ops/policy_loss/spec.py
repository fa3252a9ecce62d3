"""The reference policy loss: plain differentiable torch, and the specification of every kernel.

Notation (packed batch of N trajectories, T tokens):
  s(t)  sequence of token t (from cu_seqlens); M_t = chunk_ids[t] >= 0 marks trained tokens.
  A chunk is a maximal run of trained tokens of one sequence with the same chunk id (ids are
  non-decreasing over the pack and strictly increase from one sequence to the next, so a run of
  equal ids never spans two sequences; untrained tokens inside a run do not split it).
  Delta(c) = number of chunks after c in its sequence.

Advantages: A_i [N] per trajectory is an input (computed once per step, before packing, by an
  estimator of arl/algo/advantages.py), or, in-pass, the group estimator of each sequence's reward
  and its group's step statistics (group_adv.py ``in_pass_advantages``, float64); either is rounded
  to the compute dtype.
  Token t gets A_t = gamma**Delta(c(t)) * A_s(t); positive_only
  clamps A_t at 0.  Underflow (gamma < 1 only; gamma = 1 leaves A_t = A_s exactly): gamma**Delta
  and the product are evaluated in float64, each taken as exactly 0 when below the smallest
  normal number of the compute dtype (fp32: 2**-126), and the product is rounded once to the
  compute dtype.  So no backend sees an fp32 subnormal (GPUs flush them, and pow and exp2 reach
  them at different Delta): every backend flushes at the same Delta.

Ratios: d_t = logp_t - old_logp_t; the level's log-ratio is the mean of d over the token's
  segment (token: itself; chunk: its chunk; sequence: the trained tokens of its sequence; the
  segment sums are accumulated in float64), clamped to +-log_ratio_clamp, and r_t = exp(.) — gradient flows to every token of the segment.

Mismatch weight w_t (no gradient): m = exp(clamp(mean over the level's segment of
  old_logp - rollout_logp)); mask: w = 1[low <= m <= high]; truncate: w = min(m, high);
  level none: w = 1.

Surrogate pg_t (a registered torch function of (A, r, logp, cfg); ``register_surrogate``):
  ppo_clip: pg1 = -A r, pg2 = -A clip(r, 1-clip_low, 1+clip_high); pg = pg2 if pg2 > pg1 else pg1;
            dual_clip c: if A < 0 and pg > -c A then pg = -c A.
  topr:     pg = -A * v * logp_t with v = 1 if A >= 0 else sg(min(r, 1)).
  cispo:    pg = -sg(clip(r, 1-clip_low, 1+clip_high)) * A * logp_t (MiniMax-M1): the weight is
            clipped, never the gradient, so every token keeps one; clipped = r outside the range.

Token loss l_t = w_t pg_t + kl_beta * kl_t - entropy_coef * H_t, kl from ref_logp (a registered
  torch function of (logp, ref, cfg); ``register_kl_estimator``):
  k1: logp - ref; k2: (logp - ref)^2 / 2; k3: exp(x) - x - 1 with x = clamp(ref - logp).

Aggregation: loss = sum_t M_t coef_t l_t / D with
  token-mean: coef 1, D = #trained tokens;  seq-mean-token-mean: coef 1/n_s, D = S;
  seq-mean-token-sum: coef 1, D = S;  seq-mean-token-sum-norm: coef 1, D = S * L,
  where n_s = trained tokens of sequence s, S = #sequences with n_s > 0, L = agg_constant or
  max n_s.  A given ``normalizer`` replaces D (the whole step's D, so that micro-batches and
  ranks sum to the step's loss).  Masked (mismatch) and zero-advantage tokens still count in D.
"""
from __future__ import annotations

import torch

from .config import LossConfig
from .group_adv import in_pass_advantages
from .registry import KL_ESTIMATORS, SURROGATES, register_kl_estimator, register_surrogate  # noqa: F401 (API)
from .types import LossInputs, LossOutput

METRIC_KEYS = (
    "clip_frac",
    "dual_clip_frac",
    "mismatch_masked_frac",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "adv_nonzero_frac",
    "tokens_kept",
    "pg_loss",
    "kl_mean",
    "entropy_mean",
)


class PackLayout:
    """Index bookkeeping of a packed batch, shared by the reference loss and tests."""

    def __init__(self, cu_seqlens: torch.Tensor, chunk_ids: torch.Tensor, n_seq: int):
        dev = chunk_ids.device
        cu = cu_seqlens.long()
        self.T = chunk_ids.numel()
        self.N = n_seq
        lengths = cu[1:] - cu[:-1]
        self.seq_of_tok = torch.repeat_interleave(torch.arange(n_seq, device=dev), lengths)
        self.trained = chunk_ids >= 0
        self.tidx = self.trained.nonzero().squeeze(1)  # trained token positions
        cid = chunk_ids[self.tidx].long()
        starts = torch.ones_like(cid, dtype=torch.bool)
        if cid.numel() > 1:
            starts[1:] = cid[1:] != cid[:-1]
        self.chunk_of_trained = torch.cumsum(starts.long(), 0) - 1  # dense chunk index per trained token
        self.C = int(self.chunk_of_trained[-1].item()) + 1 if cid.numel() else 0
        seq_t = self.seq_of_tok[self.tidx]
        self.chunk_seq = seq_t[starts]  # sequence of each chunk (chunks are in pack order)
        self.chunks_per_seq = torch.bincount(self.chunk_seq, minlength=n_seq)
        self.tokens_per_seq = torch.bincount(seq_t, minlength=n_seq)  # trained tokens n_s
        first_chunk = torch.cumsum(self.chunks_per_seq, 0) - self.chunks_per_seq
        rank = torch.arange(self.C, device=dev) - first_chunk[self.chunk_seq]
        self.chunks_after = self.chunks_per_seq[self.chunk_seq] - 1 - rank  # Delta(c)

    def segment_of_trained(self, level: str) -> tuple[torch.Tensor, int]:
        """Segment index of each trained token at a ratio level, and the number of segments."""
        if level == "token":
            return torch.arange(self.tidx.numel(), device=self.tidx.device), self.tidx.numel()
        if level == "chunk":
            return self.chunk_of_trained, self.C
        if level == "sequence":
            return self.seq_of_tok[self.tidx], self.N
        raise ValueError(f"unknown level {level!r}")

    def segment_mean(self, x: torch.Tensor, level: str) -> torch.Tensor:
        """Mean of x (over trained tokens) within each token's segment, broadcast back to tokens."""
        seg, n = self.segment_of_trained(level)
        if level == "token":
            return x
        # segment sums in float64: an fp32 running sum over thousands of tokens drifts past 1e-5
        sums = torch.zeros(n, dtype=torch.float64, device=x.device).index_add(0, seg, x.double())
        cnt = torch.bincount(seg, minlength=n).to(torch.float64).clamp_min(1)
        return (sums / cnt).to(x.dtype)[seg]


def _flush(x: torch.Tensor, tiny: float) -> torch.Tensor:
    return torch.where(x.abs() < tiny, torch.zeros_like(x), x)


def agg_denominator(cfg: LossConfig, S: int, n_tr: int, n_s: torch.Tensor, normalizer=None) -> float:
    """The aggregation's denominator D: S sequences with a trained token, n_tr trained tokens, n_s
    [N] trained tokens per sequence; a given ``normalizer`` (the step's global one) replaces it."""
    if normalizer is not None:
        return float(normalizer)
    if cfg.loss_agg == "token-mean":
        return float(n_tr)
    if cfg.loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return float(S)
    L = cfg.agg_constant if cfg.agg_constant is not None else float(n_s.max().item())
    return float(S) * L

def discounted_advantage(adv_seq: torch.Tensor, lay: PackLayout, gamma: float) -> torch.Tensor:
    """A_t = gamma**Delta(c(t)) * A_s(t) over trained tokens, with the underflow rule of the spec."""
    a = adv_seq[lay.seq_of_tok[lay.tidx]]
    if gamma == 1.0:
        return a
    tiny = torch.finfo(a.dtype).tiny
    disc = _flush(torch.pow(torch.tensor(gamma, dtype=torch.float64, device=a.device),
                            lay.chunks_after.to(torch.float64)), tiny)
    return _flush(a.double() * disc[lay.chunk_of_trained], tiny).to(a.dtype)


def _clamp(x: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    c = cfg.log_ratio_clamp
    return x if c is None else x.clamp(-c, c)


def _mismatch_weight(cfg: LossConfig, lay: PackLayout, old: torch.Tensor, roll) -> tuple:
    """w_t (no gradient) and which tokens it masked or truncated; ``roll``: the trained tokens'
    rollout logprobs (a callable, read only when the level is not none)."""
    if cfg.mismatch_level == "none":
        return torch.ones_like(old), torch.zeros_like(old, dtype=torch.bool)
    m = torch.exp(_clamp(lay.segment_mean(old - roll(), cfg.mismatch_level), cfg))
    if cfg.mismatch_mode == "mask":
        keep = (m >= cfg.mismatch_low) & (m <= cfg.mismatch_high)
        return keep.to(old.dtype), ~keep
    return m.clamp_max(cfg.mismatch_high), m > cfg.mismatch_high


# A surrogate or KL estimator is ONE torch function registered by name (registry.py).  The reference
# (this file) runs any registered name on any device; a fused backend runs only the names it declares
# (api.py ``register_backend(covers=...)``), so a new one trains with no kernel change.
@register_surrogate("ppo_clip")
def _ppo_clip(A: torch.Tensor, r: torch.Tensor, logp: torch.Tensor, cfg: LossConfig) -> tuple:
    pg1 = -A * r
    pg2 = -A * r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    clipped = pg2 > pg1
    pg = torch.where(clipped, pg2, pg1)
    dual = torch.zeros_like(logp, dtype=torch.bool)
    if cfg.dual_clip is not None:
        pg3 = -A * cfg.dual_clip
        dual = (A < 0) & (pg > pg3)
        pg = torch.where(dual, pg3, pg)
    return pg, clipped, dual


@register_surrogate("topr")
def _topr(A: torch.Tensor, r: torch.Tensor, logp: torch.Tensor, cfg: LossConfig) -> tuple:
    v = torch.where(A >= 0, torch.ones_like(r), r.detach().clamp_max(1.0))
    return -A * v * logp, (A < 0) & (r > 1), torch.zeros_like(logp, dtype=torch.bool)


@register_surrogate("cispo")
def _cispo(A: torch.Tensor, r: torch.Tensor, logp: torch.Tensor, cfg: LossConfig) -> tuple:
    v = r.detach().clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    return -v * A * logp, v != r.detach(), torch.zeros_like(logp, dtype=torch.bool)


register_kl_estimator("k1")(lambda logp, ref, cfg: logp - ref)
register_kl_estimator("k2")(lambda logp, ref, cfg: 0.5 * (logp - ref) ** 2)


@register_kl_estimator("k3")
def _k3(logp: torch.Tensor, ref: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    x = _clamp(ref - logp, cfg)
    return torch.exp(x) - x - 1



def _metrics(cfg, logp, old, r, A, w, pg, clipped, dual, altered, kl, ent) -> dict:
    """The op's metrics, detached, over the micro-batch's trained tokens (METRIC_KEYS)."""
    n_tr, cdt, dev = logp.numel(), logp.dtype, logp.device
    zero = torch.zeros((), dtype=cdt, device=dev)
    nf = float(max(n_tr, 1))
    d_tok = _clamp(logp - old, cfg)
    metrics = {
        "clip_frac": clipped.sum().to(cdt) / nf,
        "dual_clip_frac": dual.sum().to(cdt) / nf,
        "mismatch_masked_frac": altered.sum().to(cdt) / nf,
        "approx_kl": (torch.exp(d_tok) - 1 - d_tok).sum() / nf,
        "ratio_mean": r.sum() / nf,
        "ratio_max": r.max() if n_tr else zero,
        "adv_nonzero_frac": (A != 0).sum().to(cdt) / nf,
        "tokens_kept": (w > 0).sum().to(cdt),
        "pg_loss": (w * pg).sum() / nf,
        "kl_mean": kl.sum() / nf if kl is not None else zero,
        "entropy_mean": ent.sum() / nf if ent is not None else zero,
    }
    return {k: v.detach().to(cdt).reshape(()) for k, v in metrics.items()}


def reference_policy_loss(inp: LossInputs, cfg: LossConfig, normalizer=None) -> LossOutput:
    cdt = torch.float64 if inp.logp.dtype == torch.float64 else torch.float32
    adv = inp.advantages if inp.group is None else in_pass_advantages(inp.group)
    lay = PackLayout(inp.cu_seqlens, inp.chunk_ids, adv.numel())
    tidx = lay.tidx
    n_tr = tidx.numel()
    logp = inp.logp.to(cdt)[tidx]
    old = inp.old_logp.to(cdt)[tidx]

    # advantages: per trajectory (given or in-pass), discounted per chunk, broadcast to trained tokens
    A = discounted_advantage(adv.to(cdt), lay, cfg.gamma)
    if cfg.positive_only:
        A = A.clamp_min(0)
    r = torch.exp(_clamp(lay.segment_mean(logp - old, cfg.ratio_level), cfg))  # at the configured level
    w, altered = _mismatch_weight(cfg, lay, old, lambda: inp.rollout_logp.to(cdt)[tidx])
    pg, clipped, dual = SURROGATES[cfg.surrogate](A, r, logp, cfg)

    tok = w * pg
    kl = None
    if cfg.kl_beta > 0:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp, inp.ref_logp.to(cdt)[tidx], cfg)
        tok = tok + cfg.kl_beta * kl
    ent = None
    if inp.entropy is not None:
        ent = inp.entropy.to(cdt)[tidx]
        if cfg.entropy_coef != 0:
            tok = tok - cfg.entropy_coef * ent

    # aggregation
    n_s = lay.tokens_per_seq.to(cdt)
    S = int((lay.tokens_per_seq > 0).sum().item())
    if cfg.loss_agg == "seq-mean-token-mean":
        tok = tok / n_s[lay.seq_of_tok[tidx]]
    D = agg_denominator(cfg, S, n_tr, n_s, normalizer)
    loss = tok.sum() / max(D, 1e-30) if n_tr else inp.logp.to(cdt)[:0].sum()
    with torch.no_grad():
        metrics = _metrics(cfg, logp, old, r, A, w, pg, clipped, dual, altered, kl, ent)
    return LossOutput(loss=loss, metrics=metrics)

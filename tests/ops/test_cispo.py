"""CISPO (MiniMax-M1, arXiv 2506.13585), the surrogate written as one torch function (spec.py):
token loss -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp.  Checked against plain-Python
loops for values and gradients, with the gradient written down on its own (d loss / d logp_t =
-clip(r_t) * A_t * coef_t / D: the weight is a constant, so no token's gradient is dropped), against
the loop-by-loop scalar spec with every other option on, and through the trainer's paths (auto
dispatch to the reference, the head's gradient plan)."""
from __future__ import annotations

import math

import pytest
import torch

from arl import LossConfig, policy_loss
from arl.ops.policy_loss.api import choose_backend
from arl.ops.policy_loss.local_grad import local_logp_grad
from loss_utils import make_batch
from scalar_loss import scalar_policy_loss

F64 = dict(atol=1e-12, rtol=1e-10)


def _loop_cispo(b, cfg: LossConfig, normalizer=None):
    """(loss, dL/dlogp) with Python floats and loops: no mismatch, KL or entropy term."""
    lp, old, cid, cu = b.logp.tolist(), b.old_logp.tolist(), b.chunk_ids.tolist(), b.cu_seqlens.tolist()
    adv = b.advantages.tolist()
    seqs = [[t for t in range(cu[s], cu[s + 1]) if cid[t] >= 0] for s in range(len(cu) - 1)]
    chunks = []  # (sequence, tokens) in pack order
    for s, toks in enumerate(seqs):
        for t in toks:
            if chunks and chunks[-1][0] == s and cid[chunks[-1][1][-1]] == cid[t]:
                chunks[-1][1].append(t)
            else:
                chunks.append((s, [t]))
    n_tr = sum(len(x) for x in seqs)
    S = sum(1 for x in seqs if x)
    D = {"token-mean": n_tr, "seq-mean-token-mean": S, "seq-mean-token-sum": S,
         "seq-mean-token-sum-norm": S * max(len(x) for x in seqs)}[cfg.loss_agg]
    D = normalizer if normalizer is not None else D
    loss, grad = 0.0, [0.0] * len(lp)
    for ci, (s, toks) in enumerate(chunks):
        after = sum(1 for s2, _ in chunks[ci + 1:] if s2 == s)
        A = adv[s] * cfg.gamma ** after
        for t in toks:
            seg = {"token": [t], "chunk": toks, "sequence": seqs[s]}[cfg.ratio_level]
            r = math.exp(sum(lp[u] - old[u] for u in seg) / len(seg))
            w = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
            coef = 1.0 / len(seqs[s]) if cfg.loss_agg == "seq-mean-token-mean" else 1.0
            loss += coef * (-w * A * lp[t]) / D
            grad[t] = -w * A * coef / D
    return loss, grad


def _run(b, cfg, backend="auto", normalizer=None, **extra):
    lp = b.logp.clone().requires_grad_(True)
    out = policy_loss(lp, b.old_logp, config=cfg, normalizer=normalizer, backend=backend,
                      **b.kwargs(with_optional=False), **extra)
    out.loss.backward()
    return out, lp.grad


def test_hand_token_level():
    """Ratios 1.5, 1, 0.5 (A = a) and 1.5, 0.5 (A = -a), clip 0.2: weights 1.2, 1, 0.8, 1.2, 0.8;
    every token keeps a gradient, where ppo_clip zeroes the two clipped ones."""
    a = 1 / math.sqrt(2)
    d = [math.log(1.5), 0.0, math.log(0.5), math.log(1.5), math.log(0.5)]
    old = torch.full((5,), -1.0, dtype=torch.float64)
    b = make_batch(n_seq=2, seed=0, dtype=torch.float64)  # replaced field by field below
    b.logp, b.old_logp = old + torch.tensor(d, dtype=torch.float64), old
    b.advantages = torch.tensor([a, -a], dtype=torch.float64)
    b.cu_seqlens, b.chunk_ids = torch.tensor([0, 3, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32)
    out, g = _run(b, LossConfig(surrogate="cispo"))
    w, A = [1.2, 1.0, 0.8, 1.2, 0.8], [a, a, a, -a, -a]
    assert out.loss.item() == pytest.approx(sum(-wi * Ai * lp for wi, Ai, lp in zip(w, A, b.logp.tolist())) / 5,
                                            abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([-wi * Ai / 5 for wi, Ai in zip(w, A)], dtype=torch.float64), **F64)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.8)  # 1.0 is inside the range
    _, g_ppo = _run(b, LossConfig())
    assert g_ppo[0].item() == 0.0 and g_ppo[4].item() == 0.0 and bool((g != 0).all())


@pytest.mark.parametrize("level", ["token", "chunk", "sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("normalizer", [None, 321.5])
def test_matches_plain_python_loops(level, agg, normalizer):
    b = make_batch(n_seq=10, max_len=40, seed=31, dtype=torch.float64, binary_rewards=False, log_ratio_scale=0.5)
    cfg = LossConfig(surrogate="cispo", ratio_level=level, loss_agg=agg, gamma=0.9, clip_low=0.2, clip_high=0.28)
    out, g = _run(b, cfg, normalizer=normalizer)
    loss, grad = _loop_cispo(b, cfg, normalizer)
    assert out.loss.item() == pytest.approx(loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64), **F64)
    assert 0 < out.metrics["clip_frac"].item() < 1  # the clip is active on part of the batch


def test_no_token_gradient_is_dropped():
    """Ratios far outside the clip range: every trained token with A != 0 keeps its gradient."""
    b = make_batch(n_seq=12, max_len=40, seed=32, dtype=torch.float64, binary_rewards=False, log_ratio_scale=2.0)
    out, g = _run(b, LossConfig(surrogate="cispo"))
    _, g_ppo = _run(b, LossConfig())
    lay_adv = b.advantages.repeat_interleave((b.cu_seqlens[1:] - b.cu_seqlens[:-1]).long())
    live = (b.chunk_ids >= 0) & (lay_adv != 0)
    assert out.metrics["clip_frac"].item() > 0.5
    assert bool((g[live] != 0).all()) and bool((g[~live] == 0).all())
    assert bool((g_ppo[live] == 0).any())  # where ppo_clip drops some


@pytest.mark.parametrize("cfg", [
    LossConfig(surrogate="cispo", ratio_level="chunk", gamma=0.95, mismatch_level="chunk", mismatch_high=5.0,
               clip_high=0.28, kl_beta=0.1, entropy_coef=0.01),
    LossConfig(surrogate="cispo", ratio_level="sequence", mismatch_level="token", mismatch_mode="truncate",
               mismatch_high=1.05, loss_agg="seq-mean-token-sum", positive_only=True, kl_beta=0.1, kl_estimator="k2"),
], ids=["main_job_chunk", "sequence_truncate"])
def test_matches_the_scalar_spec_with_every_term(cfg):
    b = make_batch(n_seq=8, max_len=30, seed=33, dtype=torch.float64, binary_rewards=False, log_ratio_scale=0.5)
    extra = dict(rollout_logp=b.rollout_logp, ref_logp=b.ref_logp, entropy=b.entropy)
    out, g = _run(b, cfg, **extra)
    L = lambda x: x.tolist()  # noqa: E731
    loss, grad, metrics = scalar_policy_loss(L(b.logp), L(b.old_logp), L(b.advantages), L(b.cu_seqlens),
                                             L(b.chunk_ids), cfg, rollout=L(b.rollout_logp), ref=L(b.ref_logp),
                                             entropy=L(b.entropy))
    assert out.loss.item() == pytest.approx(loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64), **F64)
    for k, v in metrics.items():
        assert out.metrics[k].item() == pytest.approx(v, rel=1e-10, abs=1e-12), k


def test_auto_takes_the_reference_and_the_head_plan_is_the_autograd_gradient():
    """No kernel runs CISPO: auto is the reference (every device).  With old = logp (the trainer's
    skipped old pass) the head's plan (local_grad.py, from the function by autograd) is the loss's
    gradient."""
    cfg = LossConfig(surrogate="cispo", ratio_level="chunk", gamma=0.95, mismatch_level="chunk", mismatch_high=5.0,
                     clip_high=0.28)
    for dev in ("cpu", "cuda"):
        name, why = choose_backend(cfg, dev)
        assert name == "reference" and why.endswith(": torch reference"), why
    b = make_batch(n_seq=8, max_len=30, seed=34, dtype=torch.float64)
    b.old_logp = b.logp.clone()
    _, g = _run(b, cfg, rollout_logp=b.rollout_logp)
    plan = local_logp_grad(config=cfg, rollout_logp=b.rollout_logp, dtype=torch.float64,
                           **b.kwargs(with_optional=False))
    got, _ = plan.grad(0, b.logp.numel(), b.logp)
    torch.testing.assert_close(got, g, **F64)

"""The reference policy loss: hand-computed examples, an independent scalar implementation for
every option, the structural equivalences, micro-batching, gradcheck and bad inputs."""
import math
import zlib

import pytest
import torch

from arl import LossConfig, policy_loss
from arl.ops.policy_loss import METRIC_KEYS, PackLayout
from loss_utils import CONFIG_IDS, CONFIGS, make_batch, untrained_inside_chunk_batch
from scalar_loss import scalar_policy_loss

LN = math.log


A_HAND = 1 / math.sqrt(2)  # GRPO's advantages of rewards (1, 0) in one group (eps 0): +-0.5 / sqrt(0.5)


def _hand_batch():
    # seq0: prompt, chunk 0 (2 tokens), observation, chunk 1;  seq1: prompt, chunk 2 (2 tokens)
    old = torch.full((8,), -1.0, dtype=torch.float64)
    d = torch.tensor([0.0, LN(1.5), 0.0, 0.0, LN(0.5), 0.0, LN(1.5), LN(0.5)], dtype=torch.float64)
    return dict(
        logp=(old + d).requires_grad_(), old_logp=old,
        advantages=torch.tensor([A_HAND, -A_HAND], dtype=torch.float64),
        cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32),
        chunk_ids=torch.tensor([-1, 0, 0, -1, 1, -1, 2, 2], dtype=torch.int32),
    )


def _run(batch, cfg, normalizer=None):
    b = dict(batch)
    logp, old = b.pop("logp"), b.pop("old_logp")
    out = policy_loss(logp, old, config=cfg, normalizer=normalizer, **b)
    (g,) = torch.autograd.grad(out.loss, logp)
    return out, g


def test_hand_token_level_grpo():
    # A = +-0.5/std, std = sqrt(0.5) (Bessel) -> A0 = 1/sqrt(2), A1 = -1/sqrt(2)
    # ratios 1.5 (clipped at 1.2 for A>0), 1, 0.5 | 1.5 (unclipped for A<0), 0.5 (clipped at 0.8)
    out, g = _run(_hand_batch(), LossConfig())
    a = 1 / math.sqrt(2)
    assert out.loss.item() == pytest.approx(a * (-1.2 - 1.0 - 0.5 + 1.5 + 0.8) / 5, abs=1e-12)
    expect = torch.tensor([0, 0, -a, 0, -a * 0.5, 0, a * 1.5, 0], dtype=torch.float64) / 5
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=0)
    assert out.metrics["clip_frac"].item() == pytest.approx(0.4)
    assert out.metrics["ratio_max"].item() == pytest.approx(1.5)
    assert out.metrics["tokens_kept"].item() == 5


def test_hand_chunk_level_ipa_with_discount():
    # chunk ratios: sqrt(1.5) (clipped, A>0), 0.5, sqrt(0.75) (inside the clip range, A<0)
    # gamma=0.5: chunk 0 has one chunk after it in seq0 -> advantage A0/2
    out, g = _run(_hand_batch(), LossConfig(ratio_level="chunk", gamma=0.5))
    a = 1 / math.sqrt(2)
    r2 = math.sqrt(0.75)
    loss = (0.5 * a * (-1.2) * 2 + a * (-0.5) + a * r2 * 2) / 5
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    # chunk 2: d/dlogp_t = 2 tokens * (-A r) * (1/2 from the mean) / 5
    expect = torch.tensor([0, 0, 0, 0, -a * 0.5, 0, a * r2, a * r2], dtype=torch.float64) / 5
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=0)
    assert out.metrics["clip_frac"].item() == pytest.approx(2 / 5)


def test_hand_topr_and_dual_clip():
    a = 1 / math.sqrt(2)
    # TOPR, token level: positives plain -A*logp; negatives -A*min(r,1)*logp with r detached
    b = _hand_batch()
    out, g = _run(b, LossConfig(surrogate="topr"))
    lp = b["logp"].detach()
    loss = (-a * (lp[1] + lp[2] + lp[4]) + a * 1.0 * lp[6] + a * 0.5 * lp[7]) / 5
    assert out.loss.item() == pytest.approx(loss.item(), abs=1e-12)
    expect = torch.tensor([0, -a, -a, 0, -a, 0, a, a * 0.5], dtype=torch.float64) / 5
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=0)
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 5)  # the negative token with r > 1
    # dual clip c=1.4 caps the A<0, r=1.5 token at 1.4|A|
    out, g = _run(_hand_batch(), LossConfig(dual_clip=1.4))
    assert out.loss.item() == pytest.approx(a * (-1.2 - 1.0 - 0.5 + 1.4 + 0.8) / 5, abs=1e-12)
    assert g[6].item() == 0.0 and out.metrics["dual_clip_frac"].item() == pytest.approx(0.2)


def test_hand_given_advantages_and_positive_only():
    # the advantages Dr.GRPO (0.5, -0.5) and no baseline (1, 0) give rewards (1, 0): the op takes them as given
    b = _hand_batch()
    for a0, a1 in ((0.5, -0.5), (1.0, 0.0)):
        adv = torch.tensor([a0, a1], dtype=torch.float64)
        out, g = _run(dict(b, advantages=adv), LossConfig(ratio_level="sequence"))
        # sequence level: seq0 mean log-ratio (ln1.5 + 0 + ln0.5)/3, seq1 (ln1.5 + ln0.5)/2
        r0, r1 = math.exp(LN(0.75) / 3), math.exp(LN(0.75) / 2)
        pg0 = -a0 * (min(max(r0, 0.8), 1.2) if -a0 * min(max(r0, 0.8), 1.2) > -a0 * r0 else r0)
        pg1 = -a1 * (min(max(r1, 0.8), 1.2) if -a1 * min(max(r1, 0.8), 1.2) > -a1 * r1 else r1)
        assert out.loss.item() == pytest.approx((3 * pg0 + 2 * pg1) / 5, abs=1e-12)
    out, g = _run(b, LossConfig(positive_only=True))
    a = 1 / math.sqrt(2)
    assert out.loss.item() == pytest.approx(a * (-1.2 - 1.0 - 0.5) / 5, abs=1e-12)  # negatives zeroed, still /5
    assert out.metrics["adv_nonzero_frac"].item() == pytest.approx(3 / 5)


def test_hand_mismatch_kl_entropy_and_aggregation():
    a = 1 / math.sqrt(2)
    b = _hand_batch()
    roll = b["old_logp"].clone()
    roll[1] += LN(2.0)  # chunk 0: geometric-mean old/rollout ratio = sqrt(1/2) ~ 0.707 < 0.8 -> masked
    out, g = _run(dict(b, rollout_logp=roll), LossConfig(mismatch_level="chunk"))
    assert out.loss.item() == pytest.approx(a * (-0.5 + 1.5 + 0.8) / 5, abs=1e-12)
    assert out.metrics["mismatch_masked_frac"].item() == pytest.approx(2 / 5)
    assert out.metrics["tokens_kept"].item() == 3
    # truncate at token level: token 1 has m = 0.5 -> weight 0.5 (only m > high is truncated)
    out, _ = _run(dict(b, rollout_logp=roll), LossConfig(mismatch_level="token", mismatch_mode="truncate"))
    assert out.loss.item() == pytest.approx(a * (-1.2 * 0.5 - 1.0 - 0.5 + 1.5 + 0.8) / 5, abs=1e-12)
    # KL k1/k2/k3 against a reference 0.1 below logp, entropy bonus
    ref = b["logp"].detach() - 0.1
    ent = torch.full((8,), 2.0, dtype=torch.float64, requires_grad=True)
    for est, kl in (("k1", 0.1), ("k2", 0.005), ("k3", math.exp(-0.1) + 0.1 - 1)):
        cfg = LossConfig(kl_beta=0.5, kl_estimator=est, entropy_coef=0.01)
        bb = dict(b)
        logp, old = bb.pop("logp"), bb.pop("old_logp")
        out = policy_loss(logp, old, ref_logp=ref, entropy=ent, config=cfg, **bb)
        base = a * (-1.2 - 1.0 - 0.5 + 1.5 + 0.8) / 5
        assert out.loss.item() == pytest.approx(base + 0.5 * kl - 0.01 * 2.0, abs=1e-12)
        (ge,) = torch.autograd.grad(out.loss, ent)
        expect = torch.tensor([0, -0.01, -0.01, 0, -0.01, 0, -0.01, -0.01], dtype=torch.float64) / 5
        torch.testing.assert_close(ge, expect, atol=1e-12, rtol=0)
    # aggregations: seq0 has 3 trained tokens, seq1 has 2
    t = [-1.2 * a, -1.0 * a, -0.5 * a, 1.5 * a, 0.8 * a]
    aggs = {
        "seq-mean-token-mean": (sum(t[:3]) / 3 + sum(t[3:]) / 2) / 2,
        "seq-mean-token-sum": sum(t) / 2,
        "seq-mean-token-sum-norm": sum(t) / (2 * 3),
    }
    for agg, val in aggs.items():
        out, _ = _run(b, LossConfig(loss_agg=agg))
        assert out.loss.item() == pytest.approx(val, abs=1e-12), agg
    out, _ = _run(b, LossConfig(loss_agg="seq-mean-token-sum-norm", agg_constant=10.0))
    assert out.loss.item() == pytest.approx(sum(t) / 20, abs=1e-12)
    out, _ = _run(b, LossConfig(), normalizer=100.0)
    assert out.loss.item() == pytest.approx(sum(t) / 100, abs=1e-12)


def test_hand_untrained_token_inside_a_chunk():
    # chunk ids [0, 0, -1, 0, 1] | [-1, 2, 2], A = (1, -0.5), gamma 0.9, chunk ratio, token-mean over 6 tokens:
    # chunk 0 = tokens 0, 1, 3 (token 2 does not split it), r0 = exp(mean(0.1, -0.05, 0.04)), A = 0.9;
    # chunk 1: r1 = exp(0.3) clipped at 1.2 (A > 0), no gradient; chunk 2: r2 = exp(0.05), A = -0.5
    b = untrained_inside_chunk_batch(torch.float64)
    cfg = LossConfig(ratio_level="chunk", gamma=0.9, entropy_coef=0.01)
    logp = b.logp.clone().requires_grad_()
    ent = b.entropy.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, **dict(b.kwargs(), entropy=ent), config=cfg)
    g, ge = torch.autograd.grad(out.loss, (logp, ent))
    r0, r2 = math.exp(0.09 / 3), math.exp(0.05)
    ent_sum = 0.5 + 1.0 + 1.5 + 2.0 + 0.3 + 1.1
    loss = (3 * (-0.9 * r0) - 1.2 + 2 * (0.5 * r2) - 0.01 * ent_sum) / 6
    assert out.loss.item() == pytest.approx(loss, abs=1e-12)
    expect = torch.tensor([-0.9 * r0, -0.9 * r0, 0, -0.9 * r0, 0, 0, 0.5 * r2, 0.5 * r2], dtype=torch.float64) / 6
    torch.testing.assert_close(g, expect, atol=1e-12, rtol=0)
    torch.testing.assert_close(ge, torch.tensor([-0.01, -0.01, 0, -0.01, -0.01, 0, -0.01, -0.01],
                                                dtype=torch.float64) / 6, atol=1e-12, rtol=0)
    assert g[2].item() == 0.0 and ge[2].item() == 0.0
    assert out.metrics["clip_frac"].item() == pytest.approx(1 / 6)
    assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(0.3))


def test_log_ratio_clamp():
    b = _hand_batch()
    b["logp"] = (b["old_logp"] + torch.tensor([0, 30.0, 0, 0, -30.0, 0, 0, 0], dtype=torch.float64)).requires_grad_()
    out, g = _run(b, LossConfig(log_ratio_clamp=20.0))
    assert out.metrics["ratio_max"].item() == pytest.approx(math.exp(20.0))
    assert g[1].item() == 0.0 and torch.isfinite(out.loss)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_reference_matches_scalar_implementation(cfg):
    b = make_batch(n_seq=7, max_len=24, group_size=3, seed=zlib.crc32(str(cfg).encode()) % 1000, dtype=torch.float64)
    logp = b.logp.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, config=cfg, **b.kwargs())
    (g,) = torch.autograd.grad(out.loss, logp)
    L = lambda x: x.tolist()  # noqa: E731
    loss, grad, metrics = scalar_policy_loss(
        L(b.logp), L(b.old_logp), L(b.advantages), L(b.cu_seqlens), L(b.chunk_ids), cfg,
        rollout=L(b.rollout_logp), ref=L(b.ref_logp), entropy=L(b.entropy))
    assert out.loss.item() == pytest.approx(loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=torch.float64), atol=1e-10, rtol=1e-9)
    assert set(out.metrics) == set(METRIC_KEYS)
    for k, v in metrics.items():
        assert out.metrics[k].item() == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_one_token_chunks_equal_token_level():
    b = make_batch(n_seq=10, max_len=40, seed=1)
    ids = torch.full_like(b.chunk_ids, -1)
    tr = b.chunk_ids >= 0
    ids[tr] = torch.arange(int(tr.sum()), dtype=torch.int32)
    for sur in ("ppo_clip", "topr"):
        outs = []
        for level in ("token", "chunk"):
            logp = b.logp.clone().requires_grad_()
            kw = dict(b.kwargs(), chunk_ids=ids)
            out = policy_loss(logp, b.old_logp, config=LossConfig(ratio_level=level, surrogate=sur), **kw)
            outs.append((out.loss, torch.autograd.grad(out.loss, logp)[0]))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1], outs[1][1])


def test_one_chunk_per_sequence_equals_sequence_level():
    b = make_batch(n_seq=10, max_len=40, seed=2)
    ids = b.chunk_ids.clone()
    lay = PackLayout(b.cu_seqlens, b.chunk_ids, 10)
    ids[lay.tidx] = lay.seq_of_tok[lay.tidx].to(torch.int32)  # one chunk = all trained tokens of a sequence
    outs = []
    for level, chunk_ids in (("sequence", b.chunk_ids), ("chunk", ids)):
        logp = b.logp.clone().requires_grad_()
        out = policy_loss(logp, b.old_logp, config=LossConfig(ratio_level=level, loss_agg="seq-mean-token-mean"),
                          **dict(b.kwargs(), chunk_ids=chunk_ids))
        outs.append((out.loss, torch.autograd.grad(out.loss, logp)[0]))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])


def test_gamma_one_gives_the_given_advantages():
    # on-policy (logp == old) token level: dL/dlogp_t = -A_t / n_trained, so A_t = -grad * n
    b = make_batch(n_seq=9, max_len=30, seed=3, binary_rewards=False, estimator="none")
    logp = b.old_logp.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, config=LossConfig(gamma=1.0), **b.kwargs())
    (g,) = torch.autograd.grad(out.loss, logp)
    lay = PackLayout(b.cu_seqlens, b.chunk_ids, 9)
    A = -g[lay.tidx] * lay.tidx.numel()
    torch.testing.assert_close(A, b.advantages.float()[lay.seq_of_tok[lay.tidx]])


def _permute(b, perm):
    """Reorder the sequences of a packed batch; chunk ids renumbered to stay increasing."""
    cu = b.cu_seqlens.long()
    spans = [(int(cu[i]), int(cu[i + 1])) for i in perm]
    idx = torch.cat([torch.arange(s, e) for s, e in spans])
    lens = torch.tensor([e - s for s, e in spans])
    new_cu = torch.zeros(len(perm) + 1, dtype=torch.int32)
    new_cu[1:] = torch.cumsum(lens, 0)
    chunk = b.chunk_ids[idx].clone()
    tr = chunk >= 0
    c = chunk[tr].long()
    starts = torch.ones_like(c, dtype=torch.bool)
    starts[1:] = (c[1:] != c[:-1])
    chunk[tr] = (torch.cumsum(starts.long(), 0) - 1).to(torch.int32)
    return idx, dict(advantages=b.advantages[perm], cu_seqlens=new_cu, chunk_ids=chunk,
                     rollout_logp=b.rollout_logp[idx], ref_logp=b.ref_logp[idx], entropy=b.entropy[idx])


@pytest.mark.parametrize("cfg", [CONFIGS[i] for i in (0, 9, 17, 30, 45, 61)], ids=lambda c: c.ratio_level)
def test_permuting_sequences_leaves_loss_and_grads(cfg):
    b = make_batch(n_seq=12, max_len=30, group_size=3, seed=4, dtype=torch.float64)
    logp = b.logp.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, config=cfg, **b.kwargs())
    (g,) = torch.autograd.grad(out.loss, logp)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    idx, kw = _permute(b, perm)
    logp2 = b.logp[idx].clone().requires_grad_()
    out2 = policy_loss(logp2, b.old_logp[idx], config=cfg, **kw)
    (g2,) = torch.autograd.grad(out2.loss, logp2)
    torch.testing.assert_close(out2.loss, out.loss)
    torch.testing.assert_close(g2, g[idx])


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("level", ["token", "chunk", "sequence"])
def test_micro_batches_with_global_normalizer_reproduce_the_step(agg, level):
    b = make_batch(n_seq=12, max_len=30, group_size=3, seed=5, dtype=torch.float64)
    cfg = LossConfig(ratio_level=level, loss_agg=agg, agg_constant=64.0, kl_beta=0.05, entropy_coef=0.01)
    logp = b.logp.clone().requires_grad_()
    full = policy_loss(logp, b.old_logp, config=cfg, **b.kwargs())
    (g_full,) = torch.autograd.grad(full.loss, logp)
    lay = PackLayout(b.cu_seqlens, b.chunk_ids, 12)
    n_tr = lay.tidx.numel()
    S = int((lay.tokens_per_seq > 0).sum())
    D = {"token-mean": n_tr, "seq-mean-token-mean": S, "seq-mean-token-sum": S, "seq-mean-token-sum-norm": S * 64.0}[agg]
    total, grad = 0.0, torch.zeros_like(b.logp)
    cu = b.cu_seqlens.long()
    for seqs in ([0, 1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11]):
        lo, hi = int(cu[seqs[0]]), int(cu[seqs[-1] + 1])
        lp = b.logp[lo:hi].clone().requires_grad_()
        kw = dict(advantages=b.advantages[seqs], cu_seqlens=(cu[seqs[0]:seqs[-1] + 2] - lo).int(),
                  chunk_ids=b.chunk_ids[lo:hi], ref_logp=b.ref_logp[lo:hi], entropy=b.entropy[lo:hi])
        if not bool((kw["chunk_ids"] >= 0).any()):
            continue
        out = policy_loss(lp, b.old_logp[lo:hi], config=cfg, normalizer=D, **kw)
        total = total + out.loss.item()
        grad[lo:hi] = torch.autograd.grad(out.loss, lp)[0]
    assert total == pytest.approx(full.loss.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, g_full)


@pytest.mark.parametrize("cfg", [CONFIGS[i] for i in (0, 5, 13, 22, 26, 40, 55, 60)], ids=lambda c: f"{c.ratio_level}-{c.surrogate}-{c.loss_agg}")
def test_float64_gradcheck(cfg):
    b = make_batch(n_seq=5, max_len=10, group_size=2, seed=6, dtype=torch.float64, binary_rewards=False)
    kw = b.kwargs()
    ent = kw.pop("entropy").clone().requires_grad_()

    def f(lp, e):
        return policy_loss(lp, b.old_logp, entropy=e, config=cfg, **kw).loss

    assert torch.autograd.gradcheck(f, (b.logp.clone().requires_grad_(), ent), eps=1e-6, atol=1e-6)


def test_zero_advantage_gives_exactly_zero_gradient():
    # a zero-variance group's advantages are exactly 0 (tests/test_algo_advantages.py); the op keeps them 0
    b = make_batch(n_seq=6, max_len=20, group_size=3, seed=7)
    adv = torch.tensor([0.0, 0.0, 0.0, -0.4, 1.1, -0.7], dtype=torch.float64)
    logp = b.old_logp.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, config=LossConfig(), **dict(b.kwargs(), advantages=adv))
    (g,) = torch.autograd.grad(out.loss, logp)
    lay = PackLayout(b.cu_seqlens, b.chunk_ids, 6)
    in_g0 = lay.seq_of_tok < 3
    assert bool((g[in_g0] == 0).all())
    assert "zero_var_group_frac" not in out.metrics  # a step-level figure, reported with the advantages


def test_bf16_inputs_accumulate_in_fp32():
    b = make_batch(n_seq=8, max_len=50, seed=8)
    cfg = LossConfig(ratio_level="chunk", kl_beta=0.1, entropy_coef=0.01)
    kw16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() and k != "advantages" else v) for k, v in b.kwargs().items()}
    lp16 = b.logp.to(torch.bfloat16).requires_grad_()
    out = policy_loss(lp16, b.old_logp.to(torch.bfloat16), config=cfg, **kw16)
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert lp16.grad.dtype == torch.bfloat16
    # the same bf16 values widened to fp32 first: identical arithmetic, so identical results
    lp32 = lp16.detach().float().requires_grad_()
    kw32 = {k: (v.float() if v.is_floating_point() else v) for k, v in kw16.items()}
    ref = policy_loss(lp32, b.old_logp.to(torch.bfloat16).float(), config=cfg, **kw32)
    ref.loss.backward()
    assert out.loss.item() == ref.loss.item()
    assert torch.equal(lp16.grad, lp32.grad.to(torch.bfloat16))
    for k in METRIC_KEYS:
        assert out.metrics[k].dtype == torch.float32 and out.metrics[k].item() == ref.metrics[k].item(), k
    # and close to the exact math on those values (bf16 accumulation would be ~1e-2 off)
    lp64 = lp16.detach().double().requires_grad_()
    exact = policy_loss(lp64, b.old_logp.to(torch.bfloat16).double(), config=cfg,
                        **{k: (v.double() if v.is_floating_point() else v) for k, v in kw16.items()})
    exact.loss.backward()
    assert out.loss.item() == pytest.approx(exact.loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp16.grad.double(), lp64.grad, rtol=2.0 ** -7, atol=1e-7)


def test_batch_without_trained_tokens_gives_zero_loss():
    b = make_batch(n_seq=3, max_len=10, seed=9)
    ids = torch.full_like(b.chunk_ids, -1)
    logp = b.logp.clone().requires_grad_()
    out = policy_loss(logp, b.old_logp, config=LossConfig(), **dict(b.kwargs(), chunk_ids=ids))
    out.loss.backward()
    assert out.loss.item() == 0.0 and bool((logp.grad == 0).all())


# ---------------------------------------------------------------- bad inputs
def _good():
    # 4 sequences of 5 tokens; each: prompt, chunk, observation, chunk
    T = 20
    chunk = torch.tensor([-1, 0, 0, -1, 1, -1, 2, -1, 3, 3, -1, 4, 4, -1, 5, -1, -1, 6, -1, 7], dtype=torch.int32)
    gen = torch.Generator().manual_seed(10)
    old = -torch.rand(T, generator=gen)
    return dict(logp=old + 0.1, old_logp=old, advantages=torch.tensor([0.7, -0.7, 0.7, -0.7], dtype=torch.float64),
                cu_seqlens=torch.tensor([0, 5, 10, 15, 20], dtype=torch.int32),
                chunk_ids=chunk, rollout_logp=old - 0.01, ref_logp=old + 0.05, entropy=torch.rand(T, generator=gen))


def _call(kw, cfg=None, normalizer=None):
    kw = dict(kw)
    return policy_loss(kw.pop("logp"), kw.pop("old_logp"), config=cfg or LossConfig(), normalizer=normalizer, **kw)


def _bad_cases():
    g = _good()
    T = g["logp"].numel()
    cu = g["cu_seqlens"]
    tr = (g["chunk_ids"] >= 0).nonzero().squeeze(1)

    def with_(**kw):
        return dict(g, **kw)

    nan = g["logp"].clone()
    nan[tr[1]] = float("nan")
    nan[0] = float("nan")  # untrained position: allowed
    inf_a = g["advantages"].clone()
    inf_a[2] = float("inf")
    back = g["chunk_ids"].clone()
    back[9] = 2  # 3, 2 inside sequence 1
    cross = g["chunk_ids"].clone()
    cross[6] = 1  # sequence 1 starts with sequence 0's last chunk id
    dec_cu = cu.clone()
    dec_cu[2] = dec_cu[1] - 1
    cases = [
        ("logp", "empty batch", with_(logp=g["logp"][:0], old_logp=g["old_logp"][:0], chunk_ids=g["chunk_ids"][:0],
                                      cu_seqlens=torch.zeros(5, dtype=torch.int32))),
        ("advantages", "empty batch", with_(advantages=g["advantages"][:0], cu_seqlens=torch.tensor([0, T], dtype=torch.int32)[:1])),
        ("advantages", "required", with_(advantages=None)),
        ("advantages", "1-D floating tensor", with_(advantages=g["advantages"][None])),
        ("advantages", "1-D floating tensor", with_(advantages=torch.tensor([1, 0, 1, 0]))),
        ("old_logp", "shape", with_(old_logp=g["old_logp"][:-1])),
        ("ref_logp", "shape", with_(ref_logp=g["ref_logp"][:-1])),
        ("logp", "floating dtype", with_(logp=g["logp"].long())),
        ("chunk_ids", "integer dtype", with_(chunk_ids=g["chunk_ids"].float())),
        ("logp", "1-D", with_(logp=g["logp"][None])),
        ("logp", f"non-finite value nan at index {int(tr[1])}", with_(logp=nan)),
        ("advantages", "non-finite value inf at index 2", with_(advantages=inf_a)),
        ("cu_seqlens", "must start at 0", with_(cu_seqlens=cu + 1)),
        ("cu_seqlens", "decreases at index 2", with_(cu_seqlens=dec_cu)),
        ("cu_seqlens", "must equal the token count", with_(cu_seqlens=torch.cat([cu[:-1], cu[-1:] - 1]))),
        ("cu_seqlens", "expected N+1", with_(cu_seqlens=cu[:-1])),
        ("cu_seqlens", "expected N+1 = 4 (N = len(advantages))", with_(advantages=g["advantages"][:-1])),
        ("chunk_ids", "value -2", with_(chunk_ids=torch.where(g["chunk_ids"] < 0, -2, g["chunk_ids"]).int())),
        ("chunk_ids", "chunk 1 crosses from sequence 0 into sequence 1 at token index 6", with_(chunk_ids=cross)),
        ("chunk_ids", "goes backwards at token index 9 (2 after 3)", with_(chunk_ids=back)),
        ("rollout_logp", "device", with_(rollout_logp=g["rollout_logp"].to("meta"))),
    ]
    return cases


@pytest.mark.parametrize("arg,msg,kw", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_inputs_raise_one_line_errors(arg, msg, kw):
    with pytest.raises(ValueError) as e:
        _call(kw)
    text = str(e.value)
    assert text.startswith(arg + ":") and msg in text and "\n" not in text, text


def test_missing_optional_inputs_and_bad_normalizer():
    g = _good()
    for cfg, name in ((LossConfig(mismatch_level="chunk"), "rollout_logp"), (LossConfig(kl_beta=0.1), "ref_logp"),
                      (LossConfig(entropy_coef=0.01), "entropy")):
        with pytest.raises(ValueError, match=f"^{name}: required by"):
            _call(dict(g, **{name: None}), cfg)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="^normalizer:"):
            _call(g, normalizer=bad)
    with pytest.raises(ValueError, match="^backend: unknown"):
        kw = dict(g)
        policy_loss(kw.pop("logp"), kw.pop("old_logp"), backend="nope", **kw)


def test_validation_can_be_switched_off():
    g = _good()
    nan = g["logp"].clone()
    nan[1] = float("nan")
    with pytest.raises(ValueError, match="^logp: non-finite"):
        _call(dict(g, logp=nan))
    out = _call(dict(g, logp=nan), LossConfig(validate_inputs=False))  # the caller's responsibility now
    assert torch.isnan(out.loss)


@pytest.mark.parametrize("kw,msg", [
    (dict(clip_low=1.5), "clip_low"), (dict(dual_clip=0.5), "dual_clip"), (dict(gamma=0.0), "gamma"),
    (dict(ratio_level="turn"), "ratio_level"), (dict(loss_agg="sum"), "loss_agg"), (dict(clip_hi=0.3), "clip_hi"),
    (dict(mismatch_low=1.5), "mismatch_low"), (dict(kl_estimator="k4"), "kl_estimator"),
])
def test_bad_config_is_one_line(kw, msg):
    with pytest.raises(ValueError) as e:
        LossConfig(**kw)
    assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("level", ["token", "chunk"])
def test_step_advantages_let_groups_split_across_micro_batches(level):
    b = make_batch(n_seq=12, max_len=30, group_size=4, seed=11, dtype=torch.float64)  # advantages over the step
    cfg = LossConfig(ratio_level=level, gamma=0.9, positive_only=False)
    logp = b.logp.clone().requires_grad_()
    full = policy_loss(logp, b.old_logp, config=cfg, **b.kwargs())
    (g_full,) = torch.autograd.grad(full.loss, logp)
    lay = PackLayout(b.cu_seqlens, b.chunk_ids, 12)
    D = lay.tidx.numel()
    cu = b.cu_seqlens.long()
    total, grad = 0.0, torch.zeros_like(b.logp)
    for seqs in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10, 11]):
        lo, hi = int(cu[seqs[0]]), int(cu[seqs[-1] + 1])  # groups of 4 are split by these cuts
        lp = b.logp[lo:hi].clone().requires_grad_()
        out = policy_loss(lp, b.old_logp[lo:hi], advantages=b.advantages[seqs],
                          cu_seqlens=(cu[seqs[0]:seqs[-1] + 2] - lo).int(), chunk_ids=b.chunk_ids[lo:hi],
                          config=cfg, normalizer=D)
        assert set(out.metrics) == set(METRIC_KEYS)
        total += out.loss.item()
        grad[lo:hi] = torch.autograd.grad(out.loss, lp)[0]
    assert total == pytest.approx(full.loss.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, g_full)
    with pytest.raises(ValueError, match=r"^cu_seqlens: .*\(N = len\(advantages\)\)"):
        policy_loss(logp, b.old_logp, config=cfg, **dict(b.kwargs(), advantages=b.advantages[:-1]))
    with pytest.raises(ValueError, match="^advantages: 11 entries, but cu_seqlens has 12 sequences"):
        policy_loss(logp, b.old_logp, config=LossConfig(validate_inputs=False),
                    **dict(b.kwargs(), advantages=b.advantages[:-1]))


def test_unclamped_log_ratio_that_would_overflow_is_rejected():
    g = _good()
    lp = g["old_logp"].clone()
    lp[4] += 95.0
    with pytest.raises(ValueError, match=r"^logp: \|logp - old_logp\| = 95 at index 4 would overflow"):
        _call(dict(g, logp=lp), LossConfig(log_ratio_clamp=None))
    assert torch.isfinite(_call(dict(g, logp=lp), LossConfig()).loss)  # the default clamp handles it

"""The Triton fused policy loss (backend "triton") against the reference, under TRITON_INTERPRET=1
on CPU (tests/conftest.py) or compiled on a GPU.  Batches are small: the interpreter is slow."""
import pytest
import torch

from arl import LossConfig, policy_loss
from arl.ops._triton import triton_available
from arl.ops.policy_loss.spec import METRIC_KEYS, reference_policy_loss
from arl.ops.policy_loss.types import LossInputs
from loss_utils import CONFIG_IDS, CONFIGS, make_batch

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton needs a GPU or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = dict(atol=1e-5, rtol=1e-5)


def _batch(seed=4, **kw):
    kw.setdefault("n_seq", 8)
    kw.setdefault("max_len", 48)
    return make_batch(seed=seed, **kw).to(device=DEV)


def _run(b, cfg, backend, normalizer=None, with_optional=True):
    logp = b.logp.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)
    kw = b.kwargs(with_optional)
    if with_optional:
        kw["entropy"] = ent
    out = policy_loss(logp, b.old_logp, config=cfg, normalizer=normalizer, backend=backend, **kw)
    out.loss.backward()
    zero = lambda g, x: g if g is not None else torch.zeros_like(x)  # noqa: E731 - None == not in graph
    return out, zero(logp.grad, logp), zero(ent.grad, ent)


def _assert_same(b, cfg, normalizer=None, tol=TOL, with_optional=True):
    ro, rg, re_ = _run(b, cfg, "reference", normalizer, with_optional)
    to, tg, te = _run(b, cfg, "triton", normalizer, with_optional)
    assert to.loss.dim() == 0 and to.loss.dtype == ro.loss.dtype
    torch.testing.assert_close(to.loss, ro.loss, **tol)
    assert tg.dtype == b.logp.dtype
    torch.testing.assert_close(tg, rg, **tol, msg=lambda m: f"dL/dlogp: {m}")
    torch.testing.assert_close(te, re_, **tol, msg=lambda m: f"dL/dentropy: {m}")
    assert set(to.metrics) == set(METRIC_KEYS)
    for k in METRIC_KEYS:
        assert to.metrics[k].dim() == 0
        torch.testing.assert_close(to.metrics[k], ro.metrics[k], **tol, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.fixture(scope="module")
def batch():
    b = _batch()
    # the batch covers the edge cases the kernel must get right
    g = b.rewards.view(-1, 4)
    assert bool(((g == g[:, :1]).all(1)).any()), "want a zero-variance group"
    n_tr = torch.stack([(b.chunk_ids[s:e] >= 0).sum() for s, e in zip(b.cu_seqlens[:-1], b.cu_seqlens[1:])])
    assert bool((n_tr == 0).any()), "want a sequence with no trained token"
    return b


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference(batch, cfg):
    _assert_same(batch, cfg)


_BLOCK_CFGS = [
    LossConfig(ratio_level="chunk", gamma=0.9, mismatch_level="chunk", mismatch_high=1.1, mismatch_low=0.9),
    LossConfig(ratio_level="chunk", mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05,
               loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", gamma=0.95, mismatch_level="chunk", mismatch_low=0.95, mismatch_high=1.05),
    LossConfig(ratio_level="sequence", mismatch_level="token", mismatch_high=1.05, dual_clip=3.0),
    LossConfig(ratio_level="token", gamma=0.9, kl_beta=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("cfg", _BLOCK_CFGS, ids=range(len(_BLOCK_CFGS)))
def test_small_blocks_cross_block_edges(cfg):
    """Chunks, carries and the group loop spanning several blocks (a GPU uses 1024-token blocks)."""
    from arl.ops.policy_loss.triton_launch import triton_launch

    b = _batch(seed=5, n_seq=10, max_len=70, group_size=3)
    inp = LossInputs(logp=b.logp.clone().requires_grad_(True), old_logp=b.old_logp, rewards=b.rewards,
                     group_ids=b.group_ids, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids,
                     rollout_logp=b.rollout_logp, ref_logp=b.ref_logp, entropy=b.entropy.clone().requires_grad_(True))
    ref = reference_policy_loss(inp, cfg)
    ref.loss.backward()
    inp0 = LossInputs(logp=b.logp, old_logp=b.old_logp, rewards=b.rewards, group_ids=b.group_ids,
                      cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, rollout_logp=b.rollout_logp,
                      ref_logp=b.ref_logp, entropy=b.entropy)
    out = triton_launch(inp0, cfg, None, True, block=16, block_n=4)
    inv_d = out.stats[-1]
    metrics = dict(zip(METRIC_KEYS, out.stats.unbind(0)))
    torch.testing.assert_close(out.loss, ref.loss.detach(), **TOL)
    torch.testing.assert_close(out.grad_logp * inv_d, inp.logp.grad, **TOL)
    if cfg.entropy_coef:
        torch.testing.assert_close(out.entropy_grad(inv_d), inp.entropy.grad, **TOL)
    for k in METRIC_KEYS:
        torch.testing.assert_close(metrics[k], ref.metrics[k], **TOL, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[-2], LossConfig(ratio_level="sequence", loss_agg="seq-mean-token-mean")],
                         ids=["token", "ipa_chunk", "sequence"])
def test_normalizer_override(batch, cfg):
    _assert_same(batch, cfg, normalizer=1234.5)


def test_microbatches_with_global_normalizer_sum_to_whole(batch):
    cfg = CONFIGS[-2]
    n_tr = float((batch.chunk_ids >= 0).sum())
    whole, g_whole, _ = _run(batch, cfg, "triton", normalizer=n_tr)
    cu = batch.cu_seqlens
    total, grads = 0.0, []
    for lo, hi in ((0, 4), (4, 8)):  # group-aligned halves keep the group statistics
        t0, t1 = int(cu[lo]), int(cu[hi])
        logp = batch.logp[t0:t1].clone().requires_grad_(True)
        out = policy_loss(logp, batch.old_logp[t0:t1], rewards=batch.rewards[lo:hi], group_ids=batch.group_ids[lo:hi],
                          cu_seqlens=(cu[lo:hi + 1] - cu[lo]).to(torch.int32), chunk_ids=batch.chunk_ids[t0:t1],
                          rollout_logp=batch.rollout_logp[t0:t1], config=cfg, normalizer=n_tr, backend="triton")
        out.loss.backward()
        total = total + out.loss.detach()
        grads.append(logp.grad)
    torch.testing.assert_close(total, whole.loss.detach(), **TOL)
    torch.testing.assert_close(torch.cat(grads), g_whole, **TOL)


@pytest.mark.parametrize("cfg", [CONFIGS[-2], LossConfig(surrogate="topr", ratio_level="chunk", kl_beta=0.1, entropy_coef=0.01)],
                         ids=["ipa_chunk", "topr_kl_ent"])
def test_bf16_input(cfg):
    b = _batch(seed=4, dtype=torch.bfloat16)
    _assert_same(b, cfg)


@pytest.mark.parametrize("cfg", [CONFIGS[-2], LossConfig(ratio_level="sequence", gamma=0.9), LossConfig(log_ratio_clamp=None, dual_clip=2.0)],
                         ids=["ipa_chunk", "sequence_gamma", "no_clamp_dual"])
def test_extreme_log_ratios(cfg):
    """log-ratios around +-30: the default clamp (20) saturates, without clamp exp(30) stays finite."""
    b = _batch(seed=6, n_seq=6, max_len=24, log_ratio_scale=30.0)
    _assert_same(b, cfg, tol=dict(atol=1e-5, rtol=2e-5))


def test_single_token_chunks_and_long_sequence():
    """One 4096-token sequence of single-token chunks next to 1-token sequences."""
    lengths = [1, 4096, 3, 1]
    T = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    cid = torch.full((T,), -1, dtype=torch.int32)
    cid[0] = 0
    cid[1:4097:2] = torch.arange(1, 2049, dtype=torch.int32)  # every other token its own chunk
    cid[4097:4100] = torch.tensor([5000, 5000, -1], dtype=torch.int32)
    old = -torch.rand(T, generator=gen) * 3
    logp = old + torch.randn(T, generator=gen) * 0.5
    cu = torch.tensor([0, 1, 4097, 4100, 4101], dtype=torch.int32)
    kw = dict(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_ids=torch.tensor([0, 0, 1, 1]), cu_seqlens=cu,
              chunk_ids=cid, rollout_logp=old + 0.01 * torch.randn(T, generator=gen))
    kw = {k: v.to(DEV) for k, v in kw.items()}
    old, logp = old.to(DEV), logp.to(DEV)
    for cfg in (LossConfig(ratio_level="chunk", gamma=0.999, mismatch_level="chunk", mismatch_high=1.02),
                LossConfig(ratio_level="sequence", loss_agg="seq-mean-token-sum-norm")):
        res = {}
        for backend in ("reference", "triton"):
            lp = logp.clone().requires_grad_(True)
            out = policy_loss(lp, old, config=cfg, backend=backend, **kw)
            out.loss.backward()
            res[backend] = (out, lp.grad)
        torch.testing.assert_close(res["triton"][0].loss, res["reference"][0].loss, **TOL)
        torch.testing.assert_close(res["triton"][1], res["reference"][1], **TOL)
        for k in METRIC_KEYS:
            torch.testing.assert_close(res["triton"][0].metrics[k], res["reference"][0].metrics[k], **TOL)


def test_no_trained_token_at_all():
    b = _batch(seed=7, n_seq=3, max_len=8)
    b.chunk_ids[:] = -1
    out, g, _ = _run(b, CONFIGS[-2], "triton")
    ref, rg, _ = _run(b, CONFIGS[-2], "reference")
    assert out.loss.item() == 0.0 and not bool(g.any())
    for k in METRIC_KEYS:
        torch.testing.assert_close(out.metrics[k], ref.metrics[k], **TOL)


def _kw(b):
    return dict(rewards=b.rewards, group_ids=b.group_ids, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids)


@pytest.mark.parametrize("mutate,match", [
    (lambda b, kw: kw.update(chunk_ids=kw["chunk_ids"].flip(0)), "chunk_ids"),
    (lambda b, kw: kw.update(cu_seqlens=kw["cu_seqlens"][:-1]), "cu_seqlens"),
    (lambda b, kw: kw.update(rewards=kw["rewards"].clone().fill_(float("nan"))), "rewards"),
    (lambda b, kw: kw.update(group_ids=kw["group_ids"].float()), "group_ids"),
    (lambda b, kw: kw.update(normalizer=-1.0), "normalizer"),
    (lambda b, kw: kw.update(config=LossConfig(mismatch_level="chunk")), "rollout_logp"),
])
def test_bad_inputs_raise_through_triton(mutate, match):
    b = _batch(seed=8, n_seq=4, max_len=8)
    kw = _kw(b)
    mutate(b, kw)
    with pytest.raises(ValueError, match=match):
        policy_loss(b.logp, b.old_logp, backend="triton", **kw)


def test_bad_logp_raises_through_triton():
    b = _batch(seed=8, n_seq=4, max_len=8)
    logp = b.logp.clone()
    logp[int((b.chunk_ids >= 0).nonzero()[0, 0])] = float("inf")
    with pytest.raises(ValueError, match="logp"):
        policy_loss(logp, b.old_logp, backend="triton", **_kw(b))


@pytest.mark.parametrize("cfg", [
    LossConfig(ratio_level="chunk", gamma=0.9, mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05,
               kl_beta=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", dual_clip=3.0, mismatch_level="sequence", mismatch_low=0.5, mismatch_high=2.0),
], ids=["chunk", "sequence"])
def test_float64_gradcheck(cfg):
    b = _batch(seed=9, n_seq=4, max_len=6, group_size=2, binary_rewards=False, dtype=torch.float64, log_ratio_scale=0.05)
    kw = b.kwargs()
    kw.pop("entropy")

    def f(logp, ent):
        return policy_loss(logp, b.old_logp, entropy=ent, config=cfg, backend="triton", **kw).loss

    args = (b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    ref = policy_loss(b.logp, b.old_logp, entropy=b.entropy, config=cfg, backend="reference", **kw).loss
    torch.testing.assert_close(f(*args).detach(), ref, atol=1e-12, rtol=1e-10)

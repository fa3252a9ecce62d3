"""The C++ CPU op (backend "cpu") against the reference: loss, dL/dlogp, dL/dentropy and every
metric for every option combination, fp32 at atol = rtol = 1e-5; bf16 input; float64 gradcheck;
bad inputs; determinism across thread counts."""
from __future__ import annotations

import pytest
import torch

from arl import LossConfig, available_backends, policy_loss
from arl.ops.policy_loss import METRIC_KEYS
from arl.ops.policy_loss.api import _auto
from arl.ops.policy_loss.types import LossInputs
from loss_utils import CONFIG_IDS, CONFIGS, make_batch

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="arl._C policy_loss op not built")
TOL = dict(atol=1e-5, rtol=1e-5)


def run(b, cfg, backend, normalizer=None, grad=True):
    lp = b.logp.clone().requires_grad_(grad)
    ent = b.entropy.clone().requires_grad_(grad)
    out = policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      ref_logp=b.ref_logp, entropy=ent, config=cfg, normalizer=normalizer, backend=backend)
    if grad:
        out.loss.backward()
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return out, lp.grad, g_ent


def assert_same(b, cfg, normalizer=None, tol=TOL, grad_tol=None):
    ref, ref_g, ref_ge = run(b, cfg, "reference", normalizer)
    got, got_g, got_ge = run(b, cfg, "cpu", normalizer)
    assert got.loss.dtype == ref.loss.dtype and got.loss.shape == ()
    torch.testing.assert_close(got.loss, ref.loss, **tol)
    gt = grad_tol or tol
    torch.testing.assert_close(got_g, ref_g, **gt, msg=lambda m: f"dL/dlogp: {m}")
    torch.testing.assert_close(got_ge, ref_ge, **gt, msg=lambda m: f"dL/dentropy: {m}")
    assert set(got.metrics) == set(METRIC_KEYS) == set(ref.metrics)
    for k in METRIC_KEYS:
        assert got.metrics[k].shape == ()
        torch.testing.assert_close(got.metrics[k], ref.metrics[k], **tol, msg=lambda m: f"metric {k}: {m}")


BATCHES = [make_batch(n_seq=12, max_len=96, seed=1), make_batch(n_seq=9, min_len=1, max_len=7, group_size=3, seed=2,
                                                               binary_rewards=False, log_ratio_scale=1.0)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference(cfg):
    for b in BATCHES:
        assert_same(b, cfg)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[5], CONFIGS[-2], LossConfig(ratio_level="sequence", entropy_coef=0.01)])
def test_normalizer_override(cfg):
    assert_same(BATCHES[0], cfg, normalizer=1234.5)


def test_bf16_input():
    b = make_batch(n_seq=12, max_len=96, seed=3, dtype=torch.bfloat16)
    for cfg in (CONFIGS[-1], CONFIGS[-2], LossConfig(ratio_level="sequence", kl_beta=0.1, entropy_coef=0.01)):
        # loss/metrics are fp32 from the same bf16 values; the gradients are rounded to bf16
        assert_same(b, cfg, grad_tol=dict(atol=1e-5, rtol=1e-2))


def test_mixed_dtypes_are_converted_like_the_reference():
    b = make_batch(n_seq=6, max_len=40, seed=4)
    b.old_logp = b.old_logp.double()
    b.entropy = b.entropy.to(torch.bfloat16)
    assert_same(b, LossConfig(ratio_level="chunk", mismatch_level="chunk", entropy_coef=0.01, mismatch_high=5.0))


GRADCHECK_CFGS = [
    LossConfig(ratio_level="token", clip_high=0.28, kl_beta=0.1, kl_estimator="k3", entropy_coef=0.01),
    LossConfig(ratio_level="chunk", gamma=0.9, dual_clip=3.0, loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05),
    # TOPR detaches min(r, 1) for A < 0, which finite differences cannot see: check A >= 0 only
    LossConfig(ratio_level="chunk", surrogate="topr", adv_norm="none", positive_only=True),
    LossConfig(ratio_level="chunk", loss_agg="seq-mean-token-sum-norm", kl_beta=0.1, kl_estimator="k2"),
]


@pytest.mark.parametrize("cfg", GRADCHECK_CFGS, ids=[str(i) for i in range(len(GRADCHECK_CFGS))])
def test_gradcheck_float64(cfg):
    b = make_batch(n_seq=5, max_len=10, seed=5, dtype=torch.float64, log_ratio_scale=0.5)
    lp = b.logp.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)

    def f(lp, ent):
        return policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                           ref_logp=b.ref_logp, entropy=ent, config=cfg, backend="cpu").loss

    assert torch.autograd.gradcheck(f, (lp, ent), eps=1e-6, atol=1e-6)


def _bad_inputs():
    b = make_batch(n_seq=4, max_len=20, seed=6)
    cid = b.chunk_ids.clone()
    tr = (cid >= 0).nonzero().squeeze(1)
    cid[tr[-1]] = 0  # goes backwards
    lp_nan = b.logp.clone()
    lp_nan[tr[0]] = float("nan")
    cu_bad = b.cu_seqlens.clone()
    cu_bad[-1] += 1
    yield "shape", dict(old_logp=b.old_logp[:-1])
    yield "nan", dict(logp=lp_nan)
    yield "backwards", dict(chunk_ids=cid)
    yield "cu", dict(cu_seqlens=cu_bad)
    yield "rollout", dict(rollout_logp=None, config=LossConfig(mismatch_level="chunk"))
    yield "normalizer", dict(normalizer=-1.0)


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda c: c[0])
def test_bad_inputs_raise_the_reference_errors(case):
    b = make_batch(n_seq=4, max_len=20, seed=6)
    kw = dict(logp=b.logp, old_logp=b.old_logp, rollout_logp=b.rollout_logp, **b.kwargs(with_optional=False))
    kw.update(case[1])
    msgs = []
    for backend in ("reference", "cpu"):
        with pytest.raises(ValueError) as e:
            policy_loss(**kw, backend=backend)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "\n" not in msgs[1]


def test_unvalidated_bad_cu_seqlens_is_a_value_error_not_a_crash():
    b = make_batch(n_seq=4, max_len=20, seed=6)
    cu = b.cu_seqlens.clone()
    cu[2] = cu[3] + 5
    kw = b.kwargs(with_optional=False)
    kw["cu_seqlens"] = cu
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(b.logp, b.old_logp, **kw, config=LossConfig(validate_inputs=False), backend="cpu")


def test_auto_picks_cpu_on_cpu_tensors():
    b = make_batch(n_seq=4, max_len=20, seed=7)
    inp = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs(with_optional=False))
    assert _auto(inp) == "cpu"
    assert_same(b, LossConfig())  # and "auto" then equals the reference
    out = policy_loss(b.logp, b.old_logp, **b.kwargs(with_optional=False), backend="auto")
    torch.testing.assert_close(out.loss, run(b, LossConfig(), "reference", grad=False)[0].loss, **TOL)


def test_no_trained_tokens_and_no_grad_mode():
    b = make_batch(n_seq=3, max_len=20, seed=8)
    b.chunk_ids = torch.full_like(b.chunk_ids, -1)
    assert_same(b, LossConfig(ratio_level="chunk"))
    with torch.no_grad():
        out = policy_loss(b.logp, b.old_logp, **b.kwargs(with_optional=False), backend="cpu")
    assert out.loss.item() == 0.0


def test_deterministic_across_thread_counts():
    b = make_batch(n_seq=64, max_len=200, seed=9)
    cfg = CONFIGS[-2]
    before = torch.get_num_threads()
    res = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, g, _ = run(b, cfg, "cpu")
            res.append((out.loss, g, torch.stack([out.metrics[k] for k in METRIC_KEYS])))
    finally:
        torch.set_num_threads(before)
    for r in res[1:]:
        for x, y in zip(res[0], r):
            assert torch.equal(x, y)


def test_backward_twice_and_grad_out_scaling():
    """The saved gradient is returned as is for grad_out == 1: a second backward (retain_graph)
    and a scaled grad_out must still give the reference's gradients."""
    b = make_batch(n_seq=8, max_len=50, seed=11)
    cfg = CONFIGS[-2]
    ref_lp = b.logp.clone().requires_grad_(True)
    ref = policy_loss(ref_lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      config=cfg, backend="reference")
    (g_ref,) = torch.autograd.grad(ref.loss, ref_lp)
    lp = b.logp.clone().requires_grad_(True)
    out = policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      config=cfg, backend="cpu")
    (g1,) = torch.autograd.grad(out.loss, lp, retain_graph=True)
    g1_copy = g1.clone()
    g1.mul_(100.0)  # a caller scaling its gradient in place must not change the saved one
    (g2,) = torch.autograd.grad(out.loss, lp, grad_outputs=torch.tensor(-2.5), retain_graph=True)
    (g3,) = torch.autograd.grad(out.loss * 3.0, lp)
    torch.testing.assert_close(g1_copy, g_ref, **TOL)
    torch.testing.assert_close(g2, -2.5 * g_ref, **TOL)
    torch.testing.assert_close(g3, 3.0 * g_ref, **TOL)

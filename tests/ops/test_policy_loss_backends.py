"""Conformance of every kernel backend of the policy loss to the reference (the specification):
loss, dL/dlogp, dL/dentropy and every metric at fp32 atol = rtol = 1e-5 for every option
combination; normalizer override; bf16 and mixed-dtype inputs; float64 gradcheck; the
reference's bad-input errors; empty batches; second backward and grad_out scaling; micro-batches
summing to the whole; extreme log-ratios; long sequences.

Parametrized over the backends: "cpu" (C++ op), "triton" (under TRITON_INTERPRET=1 on CPU, see
conftest.py, or compiled on a GPU), "cuda" (GPU only).  Each backend runs on exactly the options it
declares (``register_backend(covers=...)``); outside them it refuses, and ``auto`` takes the
reference.  Checks that only make sense for one
backend are at the end, marked by backend.  Batches are small where Triton runs interpreted."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from arl import LossConfig, available_backends, policy_loss
from arl.ops._triton import triton_available
from arl.ops.policy_loss import METRIC_KEYS, LossInputs, reference_policy_loss
from arl.ops.policy_loss import spec
from arl.ops.policy_loss.api import _auto, backend_covers, choose_backend, not_covered
from arl.ops.policy_loss.group_adv import IN_PASS
from arl.ops.policy_loss.local_grad import local_logp_grad
from arl.algo.advantages import group_advantages
from loss_utils import ALL_CONFIG_IDS, ALL_CONFIGS, CONFIGS, Batch, make_batch, untrained_inside_chunk_batch

GPU = torch.cuda.is_available()
TOL = dict(atol=1e-5, rtol=1e-5)
BF16_GRAD_TOL = dict(atol=1e-5, rtol=1e-2)  # loss/metrics are fp32 from the same bf16 values; grads are bf16
DEVICE = {"cpu": "cpu", "cuda": "cuda", "triton": "cuda" if GPU else "cpu"}
_AVAIL = {"cpu": lambda: "cpu" in available_backends(), "triton": triton_available,
          "cuda": lambda: GPU and "cuda" in available_backends()}
_WHY = {"cpu": "arl._C policy_loss op not built", "triton": "Triton needs a GPU or TRITON_INTERPRET=1",
        "cuda": "no GPU or CUDA op not built"}


def _only(*names):
    return [pytest.param(n, marks=pytest.mark.skipif(not _AVAIL[n](), reason=_WHY[n])) for n in names]


BACKENDS = _only("cpu", "triton", "cuda")
KERNELS = ("cpu", "triton", "cuda")


def _declared(names):
    """(backend, config) of every grid config (every registered option) a backend declares it runs."""
    return [pytest.param(n, cfg, id=f"{n}-{cid}", marks=pytest.mark.skipif(not _AVAIL[n](), reason=_WHY[n]))
            for n in names for cfg, cid in zip(ALL_CONFIGS, ALL_CONFIG_IDS) if not_covered(n, cfg) is None]
GPU_BACKENDS = [n for n in ("cuda", "triton") if GPU and _AVAIL[n]()]


def _on(b, backend):
    return b.to(device=DEVICE[backend])


def _edge_batch():
    """Small enough for the interpreter, with a zero-variance group (advantages exactly 0) and an
    untrained sequence."""
    b = make_batch(n_seq=8, max_len=48, seed=4)
    g = b.advantages.view(-1, 4)
    assert bool((g == 0).all(1).any()), "want a zero-variance group"
    n_tr = torch.stack([(b.chunk_ids[s:e] >= 0).sum() for s, e in zip(b.cu_seqlens[:-1], b.cu_seqlens[1:])])
    assert bool((n_tr == 0).any()), "want a sequence with no trained token"
    return b


@pytest.fixture(scope="module")
def batch_sets():
    """Per backend the batches of test_matches_reference; the first one also takes the normalizer test."""
    edge = _edge_batch()
    cpu = [make_batch(n_seq=12, max_len=96, seed=1),
           make_batch(n_seq=9, min_len=1, max_len=7, group_size=3, seed=2, binary_rewards=False, log_ratio_scale=1.0)]
    gpu = cpu + [make_batch(n_seq=16, min_len=200, max_len=2500, seed=3)]  # several 1024-token blocks
    sets = {"cpu": cpu, "cuda": gpu, "triton": gpu + [edge] if GPU else [edge]}
    return {k: [_on(b, k) for b in v] for k, v in sets.items() if _AVAIL[k]()}


def run(b, cfg, backend, normalizer=None, grad=True):
    lp = b.logp.clone().requires_grad_(grad)
    ent = b.entropy.clone().requires_grad_(grad)
    out = policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      ref_logp=b.ref_logp, entropy=ent, config=cfg, normalizer=normalizer, backend=backend)
    if grad:
        out.loss.backward()
    zero = lambda g, x: g if g is not None else torch.zeros_like(x)  # noqa: E731 - None == not in graph
    return out, zero(lp.grad, lp), zero(ent.grad, ent)


def assert_same(b, cfg, backend, normalizer=None, tol=TOL, grad_tol=None):
    ref, ref_g, ref_ge = run(b, cfg, "reference", normalizer)
    got, got_g, got_ge = run(b, cfg, backend, normalizer)
    assert got.loss.shape == () and got.loss.dtype == ref.loss.dtype and got.loss.device == b.logp.device
    torch.testing.assert_close(got.loss, ref.loss, **tol)
    gt = grad_tol or tol
    assert got_g.dtype == b.logp.dtype
    torch.testing.assert_close(got_g, ref_g, **gt, msg=lambda m: f"dL/dlogp: {m}")
    torch.testing.assert_close(got_ge, ref_ge, **gt, msg=lambda m: f"dL/dentropy: {m}")
    assert set(got.metrics) == set(ref.metrics)
    assert set(ref.metrics) == set(METRIC_KEYS)
    for k in ref.metrics:
        assert got.metrics[k].shape == ()
        torch.testing.assert_close(got.metrics[k], ref.metrics[k], **tol, msg=lambda m, k=k: f"metric {k}: {m}")


# ------------------------------------------------------------------------------ every backend
@pytest.mark.parametrize("backend,cfg", _declared(KERNELS))
def test_matches_reference(batch_sets, cfg, backend):
    for b in batch_sets[backend]:
        assert_same(b, cfg, backend)


def _active(cfg, key):
    """Whether option ``key`` of ``cfg`` is in use (an estimator at kl_beta 0 or a mode at level none is not)."""
    return {"kl_estimator": cfg.kl_beta > 0, "mismatch_mode": cfg.mismatch_level != "none"}.get(key, True)


@pytest.mark.parametrize("backend", KERNELS)
def test_the_suite_runs_every_option_a_backend_declares(backend):
    """Each declared value is in some config test_matches_reference runs on that backend, and every
    registered surrogate and KL estimator is in the grid (run, or refused below)."""
    runs = [c for c in ALL_CONFIGS if not_covered(backend, c) is None]
    for key, values in backend_covers(backend).items():
        if key == "advantages_in_pass":  # in-pass estimators: test_in_pass_advantages.py runs each of IN_PASS
            assert set(values) <= set(IN_PASS), key
            continue
        assert set(values) <= {getattr(c, key) for c in runs if _active(c, key)}, key
    assert {c.surrogate for c in ALL_CONFIGS} == set(spec.SURROGATES)
    assert {c.kl_estimator for c in ALL_CONFIGS if c.kl_beta > 0} == set(spec.KL_ESTIMATORS)


def _mirror_ppo(A, r, logp, cfg):
    return spec.SURROGATES["ppo_clip"](A, r, logp, cfg)


@pytest.fixture
def unfused(monkeypatch):
    """A surrogate registered as one torch function and no kernel: ppo_clip under another name."""
    monkeypatch.setitem(spec.SURROGATES, "ppo_clip_mirror", _mirror_ppo)
    return LossConfig(surrogate="ppo_clip_mirror", ratio_level="chunk", gamma=0.9, mismatch_level="chunk",
                      mismatch_high=5.0, kl_beta=0.1, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_its_declared_set_a_backend_refuses_and_auto_takes_the_reference(unfused, backend):
    b = _on(make_batch(n_seq=8, max_len=40, seed=12), backend)
    with pytest.raises(ValueError) as e:
        run(b, unfused, backend)
    assert str(e.value).startswith(f"backend: {backend!r} does not run surrogate 'ppo_clip_mirror'")
    assert "\n" not in str(e.value)
    name, why = choose_backend(unfused, DEVICE[backend])
    assert name == "reference" and why.endswith(": torch reference"), why
    if DEVICE[backend] == "cpu":  # the C++ op is the CPU's one candidate
        assert why == "ppo_clip_mirror has no fused backend (cpu does not cover surrogate 'ppo_clip_mirror'): torch reference"
    auto, g_auto, ge_auto = run(b, unfused, "auto")
    ref, g_ref, ge_ref = run(b, unfused, "reference")
    assert auto.loss.item() == ref.loss.item() and torch.equal(g_auto, g_ref) and torch.equal(ge_auto, ge_ref)


def test_a_registered_surrogate_trains_through_the_reference_and_the_head_plan(unfused):
    """The mirror gives ppo_clip's loss, gradients and metrics on the reference, and the same
    grad-in-forward plan (local_grad.py derives it from the function by autograd)."""
    b = make_batch(n_seq=8, max_len=40, seed=13)
    ppo = LossConfig(**{**unfused.model_dump(), "surrogate": "ppo_clip"})
    got, g, ge = run(b, unfused, "auto")
    want, g_want, ge_want = run(b, ppo, "reference")
    assert got.loss.item() == want.loss.item() and torch.equal(g, g_want) and torch.equal(ge, ge_want)
    for k in METRIC_KEYS:
        assert torch.equal(got.metrics[k], want.metrics[k]), k
    kw = dict(b.kwargs(with_optional=False), rollout_logp=b.rollout_logp, ref_logp=b.ref_logp, with_entropy=True)
    p1, p2 = local_logp_grad(config=unfused, **kw), local_logp_grad(config=ppo, **kw)
    for x, y in zip(p1.grad(0, b.logp.numel(), b.logp), p2.grad(0, b.logp.numel(), b.logp)):
        assert torch.equal(x, y)


NORMALIZER_CFGS = [CONFIGS[0], CONFIGS[5], CONFIGS[-2], LossConfig(ratio_level="sequence", entropy_coef=0.01),
                   LossConfig(ratio_level="sequence", loss_agg="seq-mean-token-mean")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", NORMALIZER_CFGS, ids=range(len(NORMALIZER_CFGS)))
def test_normalizer_override(batch_sets, cfg, backend):
    assert_same(batch_sets[backend][0], cfg, backend, normalizer=1234.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["token", "chunk"])
def test_arbitrary_advantages_input(backend, level):
    """Advantages of no group estimator (fp32, any values, as turn credit's per-chunk ones) are used as given."""
    b = _on(make_batch(n_seq=8, max_len=40, seed=12, binary_rewards=False), backend)
    b.advantages = torch.randn(8, generator=torch.Generator().manual_seed(0)).to(b.logp.device)
    cfg = LossConfig(ratio_level=level, gamma=0.9, entropy_coef=0.01)
    assert_same(b, cfg, backend, normalizer=100.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [LossConfig(ratio_level="chunk", gamma=0.9, entropy_coef=0.01),
                                 LossConfig(ratio_level="chunk", mismatch_level="chunk", mismatch_high=5.0, kl_beta=0.1)],
                         ids=["vectorized", "serial"])
def test_untrained_token_inside_a_chunk(cfg, backend):
    """Chunk ids [0, 0, -1, 0, 1]: the -1 token does not split chunk 0 (its ratio is the mean over
    tokens 0, 1, 3), and gets gradient exactly 0 whatever its logprobs; values and gradients are
    the reference's (test_loss_reference.py checks the reference by hand)."""
    b = _on(untrained_inside_chunk_batch(), backend)
    assert_same(b, cfg, backend)
    _, g, ge = run(b, cfg, backend)
    assert g[2].item() == 0.0 and ge[2].item() == 0.0
    assert bool((g[[0, 1, 3]] != 0).all())


BF16_CFGS = [CONFIGS[-1], CONFIGS[-2], LossConfig(ratio_level="sequence", kl_beta=0.1, entropy_coef=0.01),
             LossConfig(surrogate="topr", ratio_level="chunk", kl_beta=0.1, entropy_coef=0.01)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_input(backend):
    if DEVICE[backend] == "cuda" or backend == "cpu":  # too slow for the interpreter
        b = _on(make_batch(n_seq=12, max_len=96, seed=3, dtype=torch.bfloat16), backend)
        for cfg in BF16_CFGS[:3]:
            assert_same(b, cfg, backend, grad_tol=BF16_GRAD_TOL)
    small = _on(make_batch(n_seq=8, max_len=48, seed=4, dtype=torch.bfloat16), backend)
    for cfg in BF16_CFGS[1::2]:
        assert_same(small, cfg, backend)  # bf16 gradients of a small batch: within fp32 tolerance


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_are_converted_like_the_reference(backend):
    b = _on(make_batch(n_seq=6, max_len=40, seed=4), backend)
    b.old_logp = b.old_logp.double()
    b.entropy = b.entropy.to(torch.bfloat16)
    assert_same(b, LossConfig(ratio_level="chunk", mismatch_level="chunk", entropy_coef=0.01, mismatch_high=5.0), backend)


GRADCHECK_CFGS = [
    LossConfig(ratio_level="token", clip_high=0.28, kl_beta=0.1, kl_estimator="k3", entropy_coef=0.01),
    LossConfig(ratio_level="chunk", gamma=0.9, dual_clip=3.0, loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05),
    # TOPR detaches min(r, 1) for A < 0, which finite differences cannot see: check A >= 0 only
    LossConfig(ratio_level="chunk", surrogate="topr", positive_only=True),
    LossConfig(ratio_level="chunk", loss_agg="seq-mean-token-sum-norm", kl_beta=0.1, kl_estimator="k2"),
]


@pytest.mark.parametrize("backend", _only("cpu", "cuda"))  # Triton: the tight gradcheck below (interpreter time)
@pytest.mark.parametrize("cfg", GRADCHECK_CFGS, ids=range(len(GRADCHECK_CFGS)))
def test_gradcheck_float64(cfg, backend):
    b = _on(make_batch(n_seq=5, max_len=10, seed=5, dtype=torch.float64, log_ratio_scale=0.5), backend)

    def f(lp, ent):
        return policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                           ref_logp=b.ref_logp, entropy=ent, config=cfg, backend=backend).loss

    args = (b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


TIGHT_GRADCHECK_CFGS = [
    LossConfig(ratio_level="chunk", gamma=0.9, mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05,
               kl_beta=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", dual_clip=3.0, mismatch_level="sequence", mismatch_low=0.5, mismatch_high=2.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", TIGHT_GRADCHECK_CFGS, ids=["chunk", "sequence"])
def test_float64_gradcheck_tight_and_value(cfg, backend):
    b = _on(make_batch(seed=9, n_seq=4, max_len=6, group_size=2, binary_rewards=False, dtype=torch.float64,
                       log_ratio_scale=0.05), backend)
    kw = b.kwargs()
    kw.pop("entropy")

    def f(logp, ent):
        return policy_loss(logp, b.old_logp, entropy=ent, config=cfg, backend=backend, **kw).loss

    args = (b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    ref = policy_loss(b.logp, b.old_logp, entropy=b.entropy, config=cfg, backend="reference", **kw).loss
    torch.testing.assert_close(f(*args).detach(), ref, atol=1e-12, rtol=1e-10)


def _bad_inputs(b):
    cid = b.chunk_ids.clone()
    tr = (cid >= 0).nonzero().squeeze(1)
    cid[tr[-1]] = 0  # goes backwards
    lp_nan, lp_inf = b.logp.clone(), b.logp.clone()
    lp_nan[tr[0]] = float("nan")
    lp_inf[tr[0]] = float("inf")
    cu_bad = b.cu_seqlens.clone()
    cu_bad[-1] += 1
    return {
        "shape": ("old_logp", dict(old_logp=b.old_logp[:-1])),
        "nan": ("logp", dict(logp=lp_nan)),
        "inf": ("logp", dict(logp=lp_inf)),
        "backwards": ("chunk_ids", dict(chunk_ids=cid)),
        "flipped": ("chunk_ids", dict(chunk_ids=b.chunk_ids.flip(0))),
        "cu": ("cu_seqlens", dict(cu_seqlens=cu_bad)),
        "cu_short": ("cu_seqlens", dict(cu_seqlens=b.cu_seqlens[:-1])),
        "advantages_nan": ("advantages", dict(advantages=b.advantages.clone().fill_(float("nan")))),
        "advantages_int": ("advantages", dict(advantages=b.advantages.long())),
        "advantages_short": ("cu_seqlens", dict(advantages=b.advantages[:-1])),
        "advantages_none": ("advantages", dict(advantages=None)),
        "rollout": ("rollout_logp", dict(rollout_logp=None, config=LossConfig(mismatch_level="chunk"))),
        "normalizer": ("normalizer", dict(normalizer=-1.0)),
    }


BAD_CASES = list(_bad_inputs(make_batch(n_seq=4, max_len=20, seed=6)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise_the_reference_errors(case, backend):
    b = _on(make_batch(n_seq=4, max_len=20, seed=6), backend)
    arg, change = _bad_inputs(b)[case]
    kw = dict(logp=b.logp, old_logp=b.old_logp, rollout_logp=b.rollout_logp, **b.kwargs(with_optional=False))
    kw.update(change)
    msgs = []
    for be in ("reference", backend):
        with pytest.raises(ValueError) as e:
            policy_loss(**kw, backend=be)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "\n" not in msgs[1] and msgs[1].startswith(arg), msgs


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_trained_tokens_and_no_grad_mode(backend):
    b = _on(make_batch(n_seq=3, max_len=20, seed=8), backend)
    b.chunk_ids = torch.full_like(b.chunk_ids, -1)
    assert_same(b, LossConfig(ratio_level="chunk"), backend)
    with torch.no_grad():
        out = policy_loss(b.logp, b.old_logp, **b.kwargs(with_optional=False), backend=backend)
    assert out.loss.item() == 0.0
    b = _on(make_batch(seed=7, n_seq=3, max_len=8), backend)
    b.chunk_ids[:] = -1
    out, g, _ = run(b, CONFIGS[-2], backend)
    ref, _, _ = run(b, CONFIGS[-2], "reference")
    assert out.loss.item() == 0.0 and not bool(g.any())
    for k in METRIC_KEYS:
        torch.testing.assert_close(out.metrics[k], ref.metrics[k], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_and_grad_out_scaling(backend):
    """The saved gradient is returned as is for grad_out == 1: a second backward (retain_graph)
    and a scaled grad_out must still give the reference's gradients."""
    b = _on(make_batch(n_seq=8, max_len=50, seed=11), backend)
    cfg = CONFIGS[-2]
    ref_lp = b.logp.clone().requires_grad_(True)
    ref = policy_loss(ref_lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      config=cfg, backend="reference")
    (g_ref,) = torch.autograd.grad(ref.loss, ref_lp)
    lp = b.logp.clone().requires_grad_(True)
    out = policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      config=cfg, backend=backend)
    (g1,) = torch.autograd.grad(out.loss, lp, retain_graph=True)
    g1_copy = g1.clone()
    g1.mul_(100.0)  # a caller scaling its gradient in place must not change the saved one
    (g2,) = torch.autograd.grad(out.loss, lp, grad_outputs=torch.tensor(-2.5, device=lp.device), retain_graph=True)
    (g3,) = torch.autograd.grad(out.loss * 3.0, lp)
    torch.testing.assert_close(g1_copy, g_ref, **TOL)
    torch.testing.assert_close(g2, -2.5 * g_ref, **TOL)
    torch.testing.assert_close(g3, 3.0 * g_ref, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_microbatches_with_global_normalizer_sum_to_whole(backend):
    batch = _on(_edge_batch(), backend)
    cfg = CONFIGS[-2]
    n_tr = float((batch.chunk_ids >= 0).sum())
    whole, g_whole, _ = run(batch, cfg, backend, normalizer=n_tr)
    cu = batch.cu_seqlens
    total, grads = 0.0, []
    for lo, hi in ((0, 3), (3, 8)):  # the step's advantages: any cut, groups split or not
        t0, t1 = int(cu[lo]), int(cu[hi])
        logp = batch.logp[t0:t1].clone().requires_grad_(True)
        out = policy_loss(logp, batch.old_logp[t0:t1], advantages=batch.advantages[lo:hi],
                          cu_seqlens=(cu[lo:hi + 1] - cu[lo]).to(torch.int32), chunk_ids=batch.chunk_ids[t0:t1],
                          rollout_logp=batch.rollout_logp[t0:t1], config=cfg, normalizer=n_tr, backend=backend)
        out.loss.backward()
        total = total + out.loss.detach()
        grads.append(logp.grad)
    torch.testing.assert_close(total, whole.loss.detach(), **TOL)
    torch.testing.assert_close(torch.cat(grads), g_whole, **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [CONFIGS[-2], LossConfig(ratio_level="sequence", gamma=0.9),
                                 LossConfig(log_ratio_clamp=None, dual_clip=2.0)],
                         ids=["ipa_chunk", "sequence_gamma", "no_clamp_dual"])
def test_extreme_log_ratios(cfg, backend):
    """log-ratios around +-30: the default clamp (20) saturates, without clamp exp(30) stays finite."""
    b = _on(make_batch(seed=6, n_seq=6, max_len=24, log_ratio_scale=30.0), backend)
    assert_same(b, cfg, backend, tol=dict(atol=1e-5, rtol=2e-5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token_chunks_and_long_sequence(backend):
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
    kw = dict(advantages=torch.from_numpy(group_advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])[0]), cu_seqlens=cu,
              chunk_ids=cid, rollout_logp=old + 0.01 * torch.randn(T, generator=gen))
    dev = DEVICE[backend]
    kw = {k: v.to(dev) for k, v in kw.items()}
    old, logp = old.to(dev), logp.to(dev)
    for cfg in (LossConfig(ratio_level="chunk", gamma=0.999, mismatch_level="chunk", mismatch_high=1.02),
                LossConfig(ratio_level="sequence", loss_agg="seq-mean-token-sum-norm")):
        res = {}
        for be in ("reference", backend):
            lp = logp.clone().requires_grad_(True)
            out = policy_loss(lp, old, config=cfg, backend=be, **kw)
            out.loss.backward()
            res[be] = (out, lp.grad)
        torch.testing.assert_close(res[backend][0].loss, res["reference"][0].loss, **TOL)
        torch.testing.assert_close(res[backend][1], res["reference"][1], **TOL)
        for k in METRIC_KEYS:
            torch.testing.assert_close(res[backend][0].metrics[k], res["reference"][0].metrics[k], **TOL)


# ------------------------------------------------------------------------------ one backend each
@pytest.mark.parametrize("backend", _only("cpu"))
def test_cpu_auto_picks_cpu_on_cpu_tensors(backend):
    b = make_batch(n_seq=4, max_len=20, seed=7)
    inp = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs(with_optional=False))
    assert _auto(inp) == "cpu"
    assert_same(b, LossConfig(), "cpu")
    out = policy_loss(b.logp, b.old_logp, **b.kwargs(with_optional=False), backend="auto")
    torch.testing.assert_close(out.loss, run(b, LossConfig(), "reference", grad=False)[0].loss, **TOL)


@pytest.mark.parametrize("backend", _only("cpu"))
def test_cpu_unvalidated_bad_cu_seqlens_is_a_value_error_not_a_crash(backend):
    b = make_batch(n_seq=4, max_len=20, seed=6)
    cu = b.cu_seqlens.clone()
    cu[2] = cu[3] + 5
    kw = b.kwargs(with_optional=False)
    kw["cu_seqlens"] = cu
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(b.logp, b.old_logp, **kw, config=LossConfig(validate_inputs=False), backend="cpu")


@pytest.mark.parametrize("backend", _only("cpu"))
def test_cpu_deterministic_across_thread_counts(backend):
    b = make_batch(n_seq=64, max_len=200, seed=9)
    before = torch.get_num_threads()
    res = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out, g, _ = run(b, CONFIGS[-2], "cpu")
            res.append((out.loss, g, torch.stack([out.metrics[k] for k in METRIC_KEYS])))
    finally:
        torch.set_num_threads(before)
    for r in res[1:]:
        for x, y in zip(res[0], r):
            assert torch.equal(x, y)


_BLOCK_CFGS = [
    LossConfig(ratio_level="chunk", gamma=0.9, mismatch_level="chunk", mismatch_high=1.1, mismatch_low=0.9),
    LossConfig(ratio_level="chunk", mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05,
               loss_agg="seq-mean-token-mean"),
    LossConfig(ratio_level="sequence", gamma=0.95, mismatch_level="chunk", mismatch_low=0.95, mismatch_high=1.05),
    LossConfig(ratio_level="sequence", mismatch_level="token", mismatch_high=1.05, dual_clip=3.0),
    LossConfig(ratio_level="token", gamma=0.9, kl_beta=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("backend", _only("triton"))
@pytest.mark.parametrize("cfg", _BLOCK_CFGS, ids=range(len(_BLOCK_CFGS)))
def test_triton_small_blocks_cross_block_edges(cfg, backend):
    """Chunks and carries spanning several blocks (a GPU uses 1024-token blocks)."""
    from arl.ops.policy_loss.triton_launch import triton_launch  # Triton is optional

    b = _on(make_batch(seed=5, n_seq=10, max_len=70, group_size=3), "triton")
    inp = LossInputs(logp=b.logp.clone().requires_grad_(True), old_logp=b.old_logp, advantages=b.advantages,
                     cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids,
                     rollout_logp=b.rollout_logp, ref_logp=b.ref_logp, entropy=b.entropy.clone().requires_grad_(True))
    ref = reference_policy_loss(inp, cfg)
    ref.loss.backward()
    plain = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs())
    out = triton_launch(plain, cfg, None, True, block=16)
    inv_d = out.stats[-1]
    torch.testing.assert_close(out.loss, ref.loss.detach(), **TOL)
    torch.testing.assert_close(out.grad_logp * inv_d, inp.logp.grad, **TOL)
    if cfg.entropy_coef:
        torch.testing.assert_close(out.entropy_grad(inv_d), inp.entropy.grad, **TOL)
    for k, v in zip(METRIC_KEYS, out.stats.unbind(0)):
        torch.testing.assert_close(v, ref.metrics[k], **TOL, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.mark.skipif(not GPU_BACKENDS, reason="no GPU backend here (needs a GPU)")
def test_gpu_auto_picks_a_gpu_backend():
    b = _on(make_batch(n_seq=3, max_len=20, seed=8), "cuda")
    inp = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs(with_optional=False))
    assert _auto(inp) == GPU_BACKENDS[0]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_bitwise_deterministic_run_to_run(backend):
    b = _on(make_batch(n_seq=64, max_len=600, seed=9), backend)
    res = []
    for _ in range(3):
        out, g, ge = run(b, CONFIGS[-2], backend)
        res.append((out.loss, g, ge, torch.stack([out.metrics[k] for k in METRIC_KEYS])))
    for r in res[1:]:
        for x, y in zip(res[0], r):
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_packed_agentic_batch_against_float64_reference(backend):
    """The bench layout (512 sequences, ~8 chunks each) at 256k tokens: the fp32 kernels against
    the float64 reference on CPU (the fp32 reference's own sums drift at this length)."""
    spec = importlib.util.spec_from_file_location(
        "bench_policy_loss", pathlib.Path(__file__).resolve().parents[2] / "bench" / "bench_policy_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for cfg in (bench.CONFIGS["chunk_level"], bench.CONFIGS["token_level"]):
        d = bench.agentic_batch(256 * 1024, "cuda", seed=1)
        lp = d.pop("logp").requires_grad_(True)
        d = {k: d[k] for k in bench.LOSS_KEYS}  # rewards and group ids are not loss inputs
        out = policy_loss(lp, **d, config=cfg, backend=backend)
        out.loss.backward()
        d64 = {k: (v.detach().cpu().double() if v.is_floating_point() else v.cpu()) for k, v in d.items()}
        lp64 = lp.detach().cpu().double().requires_grad_(True)
        ref = policy_loss(lp64, **d64, config=cfg, backend="reference")
        ref.loss.backward()
        torch.testing.assert_close(out.loss.cpu().double(), ref.loss, **TOL)
        torch.testing.assert_close(lp.grad.cpu().double(), lp64.grad, **TOL)
        for k in METRIC_KEYS:
            torch.testing.assert_close(out.metrics[k].cpu().double(), ref.metrics[k], **TOL, msg=lambda m, k=k: f"{k}: {m}")


UNDERFLOW_CFGS = [dict(ratio_level="chunk"), dict(ratio_level="chunk", kl_beta=0.1),  # C++: fast and serial path
                  dict(ratio_level="sequence", mismatch_level="chunk", mismatch_high=5.0)]  # Triton: the chunk table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_discount_underflow_flushes_at_the_same_delta(dtype, backend):
    """gamma**Delta past the compute dtype's smallest normal (spec.py's underflow rule): one long
    sequence of single-token chunks.  Every backend zeroes exactly the tokens whose float64
    A_s * gamma**Delta is below tiny, counted here with Python floats."""
    gamma, L = (0.95, 4096) if dtype == torch.float32 else (0.5, 1100)
    tiny = torch.finfo(dtype).tiny
    T = L + 1
    cid = torch.arange(T, dtype=torch.int32)  # sequence 0: L single-token chunks; sequence 1: one token
    cu = torch.tensor([0, L, T], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
    b = dict(logp=old + 0.1 * torch.randn(T, generator=gen, dtype=torch.float64), old_logp=old,
             rollout_logp=old + 0.01 * torch.randn(T, generator=gen, dtype=torch.float64),
             ref_logp=old + 0.1 * torch.randn(T, generator=gen, dtype=torch.float64),
             advantages=torch.from_numpy(group_advantages([1.0, 0.0], [0, 0])[0]), cu_seqlens=cu, chunk_ids=cid)
    b = {k: (v.to(dtype) if v.is_floating_point() else v).to(DEVICE[backend]) for k, v in b.items()}
    a = abs(float(b["advantages"][0]))  # |A_s|, both sequences, in the compute dtype
    flush = lambda x: 0.0 if abs(x) < tiny else x  # noqa: E731
    expect = sum(1 for d in range(L) if flush(a * flush(gamma ** d)) != 0) + 1
    assert 0 < expect - 1 < L  # the flush lands inside the sequence
    for cfg in (LossConfig(gamma=gamma, **kw) for kw in UNDERFLOW_CFGS):
        for be in ("reference", backend):
            lp = b["logp"].clone().requires_grad_(True)
            out = policy_loss(lp, **{k: v for k, v in b.items() if k != "logp"}, config=cfg, backend=be)
            frac = out.metrics["adv_nonzero_frac"].item()
            assert frac == float(torch.tensor(expect / T, dtype=dtype)), (be, cfg, frac * T, expect)
        assert_same(Batch(**b, entropy=torch.rand_like(b["logp"])), cfg, backend)


# ------------------------------------------------------------------ the op's weak places, pinned
# The C++ op has two loops: a vectorized one (fp32 without KL) and a serial one (KL on, or float64).
# Each test below runs both (a KL and a KL-free config, fp32 and float64) at every ratio level.
F64_TOL = dict(atol=1e-12, rtol=1e-10)  # float64 kernels against the float64 reference
LEVELS = ("token", "chunk", "sequence")
LOOPS = {"vectorized": {}, "serial": dict(kl_beta=0.1, kl_estimator="k3")}


def _dtypes():
    return [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


def _tol(dtype):
    return F64_TOL if dtype == torch.float64 else TOL


def _clamp_batch(C: float, dtype) -> Batch:
    """Log-ratios exactly at +-C, beyond and inside, at every level.  4 sequences of a prompt token
    and two 2-token chunks; per token (d = logp - old, exact in fp32):
      seq 0 (A < 0): [C, C], [C-1, C+1]          every level exactly at +C (token C+1 beyond)
      seq 1 (A > 0): [-C-1, -C+1], [-C, -C]      every level exactly at -C (token -C-1 beyond)
      seq 2 (A < 0): [C+2, C+4], [C+2, C+4]      every level beyond +C
      seq 3 (A > 0): [0.25, 0.75], [-C-4, -C-2]  inside / beyond -C / sequence inside"""
    d = [[C, C, C - 1, C + 1], [-C - 1, -C + 1, -C, -C], [C + 2, C + 4, C + 2, C + 4], [0.25, 0.75, -C - 4, -C - 2]]
    T, N = 5 * len(d), len(d)
    delta = torch.tensor([[0.0] + row for row in d], dtype=torch.float64).reshape(-1)
    chunk = torch.tensor([[-1, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1] for i in range(N)], dtype=torch.int32).reshape(-1)
    old = torch.full((T,), -8.0, dtype=torch.float64)
    logp = old + delta
    ref = logp.clone()
    ref[1::5] += C  # k3's x = ref - logp exactly at +C on one token per sequence, -C on another, beyond on a third
    ref[2::5] -= C
    ref[3::5] += C + 2.0
    cast = lambda x: x.to(dtype)  # noqa: E731
    return Batch(logp=cast(logp), old_logp=cast(old), rollout_logp=cast(old - 0.25 * delta.clamp(-1, 1)),
                 ref_logp=cast(ref), entropy=cast(torch.linspace(0.1, 2.0, T, dtype=torch.float64)),
                 advantages=torch.from_numpy(group_advantages([0.0, 1.0, 0.0, 1.0], [0, 0, 1, 1])[0]), cu_seqlens=torch.arange(0, T + 1, 5, dtype=torch.int32),
                 chunk_ids=chunk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("level", LEVELS)
def test_log_ratio_at_and_beyond_the_clamp(level, loop, dtype, backend):
    """The clamp boundary at every level, forward and backward: segments exactly at +-C pass the
    gradient (torch's clamp is closed), segments beyond it pass none, for both advantage signs."""
    C = 5.0
    b = _on(_clamp_batch(C, dtype), backend)
    cfg = LossConfig(ratio_level=level, log_ratio_clamp=C, gamma=0.9, mismatch_level=level, mismatch_mode="truncate",
                     mismatch_high=1.2, **LOOPS[loop])
    assert_same(b, cfg, backend, tol=_tol(dtype))
    # the spec at the boundary (unclipped there): tokens exactly at +-C, at every level, get a
    # gradient; sequence 2, beyond at every level, gets none
    _, g, _ = run(b.to(device="cpu"), LossConfig(ratio_level=level, log_ratio_clamp=C), "reference")
    assert bool((g[1:3] != 0).all()) and bool((g[8:10] != 0).all()) and not bool(g[11:15].any()), g


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("level", LEVELS)
def test_discount_on_both_loops(level, dtype, backend):
    """gamma != 1 with and without KL (the C++ serial and vectorized loops), many chunks per sequence."""
    b = _on(make_batch(n_seq=8, max_len=60, max_chunks=8, seed=22, dtype=dtype, binary_rewards=False), backend)
    for gamma in (0.9, 0.5):
        for extra in (LOOPS["vectorized"], LOOPS["serial"], dict(kl_beta=0.05, kl_estimator="k1", positive_only=True)):
            assert_same(b, LossConfig(ratio_level=level, gamma=gamma, **extra), backend, tol=_tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("level", LEVELS)
def test_dual_clip_on_every_level_and_loop(level, loop, dtype, backend):
    """Dual clip at c = 1.5, low enough that many negative-advantage segments reach it."""
    b = _on(make_batch(n_seq=10, max_len=40, seed=23, dtype=dtype, binary_rewards=False, log_ratio_scale=1.0),
            backend)
    cfg = LossConfig(ratio_level=level, dual_clip=1.5, clip_high=0.28, gamma=0.95 if level == "chunk" else 1.0,
                     **LOOPS[loop])
    assert_same(b, cfg, backend, tol=_tol(dtype))
    ref, _, _ = run(b.to(device="cpu"), cfg, "reference")
    assert 0 < ref.metrics["dual_clip_frac"].item() < ref.metrics["clip_frac"].item() + 1  # it triggers

"""The GPU backends ("cuda": csrc/cuda, "triton": compiled) against the reference on CUDA tensors:
loss, dL/dlogp, dL/dentropy and every metric for every option combination at fp32 atol = rtol =
1e-5; bf16 input; float64 gradcheck of the CUDA op; the reference's bad-input errors; run-to-run
bitwise determinism; a packed agentic batch of 256k tokens against the float64 reference.
Skipped on machines without a GPU (CI); run on a GPU node (see bench/gpu_check.sh)."""
from __future__ import annotations

import pytest
import torch

from arl import LossConfig, available_backends, policy_loss
from arl.ops.policy_loss import METRIC_KEYS
from arl.ops.policy_loss.api import _auto
from arl.ops.policy_loss.types import LossInputs
from loss_utils import CONFIG_IDS, CONFIGS, make_batch

GPU_BACKENDS = [b for b in ("cuda", "triton") if torch.cuda.is_available() and b in available_backends()]
pytestmark = pytest.mark.skipif(not GPU_BACKENDS, reason="no GPU backend here (needs a GPU)")
TOL = dict(atol=1e-5, rtol=1e-5)


def _cuda(b):
    return b.to(device="cuda")


def run(b, cfg, backend, normalizer=None, grad=True):
    lp = b.logp.clone().requires_grad_(grad)
    ent = b.entropy.clone().requires_grad_(grad)
    out = policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                      ref_logp=b.ref_logp, entropy=ent, config=cfg, normalizer=normalizer, backend=backend)
    if grad:
        out.loss.backward()
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return out, lp.grad, g_ent


def assert_same(b, cfg, backend, normalizer=None, tol=TOL, grad_tol=None, ref_b=None):
    ref, ref_g, ref_ge = run(ref_b if ref_b is not None else b, cfg, "reference", normalizer)
    got, got_g, got_ge = run(b, cfg, backend, normalizer)
    assert got.loss.shape == () and got.loss.is_cuda
    cast = lambda x: x.to(device=got.loss.device, dtype=x.dtype if ref_b is None else torch.float32)  # noqa: E731
    torch.testing.assert_close(got.loss, cast(ref.loss), **tol)
    gt = grad_tol or tol
    torch.testing.assert_close(got_g, cast(ref_g).to(got_g.dtype), **gt, msg=lambda m: f"dL/dlogp: {m}")
    torch.testing.assert_close(got_ge, cast(ref_ge).to(got_ge.dtype), **gt, msg=lambda m: f"dL/dentropy: {m}")
    assert set(got.metrics) == set(METRIC_KEYS)
    for k in METRIC_KEYS:
        torch.testing.assert_close(got.metrics[k], cast(ref.metrics[k]), **tol, msg=lambda m, k=k: f"metric {k}: {m}")


@pytest.fixture(scope="module")
def batches():
    return [_cuda(make_batch(n_seq=12, max_len=96, seed=1)),
            _cuda(make_batch(n_seq=9, min_len=1, max_len=7, group_size=3, seed=2, binary_rewards=False,
                             log_ratio_scale=1.0)),
            _cuda(make_batch(n_seq=16, min_len=200, max_len=2500, seed=3))]  # several 1024-token blocks


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference(batches, cfg, backend):
    for b in batches:
        assert_same(b, cfg, backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_normalizer_override_and_bf16(batches, backend):
    for cfg in (CONFIGS[0], CONFIGS[-2], LossConfig(ratio_level="sequence", entropy_coef=0.01)):
        assert_same(batches[0], cfg, backend, normalizer=1234.5)
    b = _cuda(make_batch(n_seq=12, max_len=96, seed=3, dtype=torch.bfloat16))
    for cfg in (CONFIGS[-1], CONFIGS[-2], LossConfig(ratio_level="sequence", kl_beta=0.1, entropy_coef=0.01)):
        assert_same(b, cfg, backend, grad_tol=dict(atol=1e-5, rtol=1e-2))


@pytest.mark.skipif("cuda" not in GPU_BACKENDS, reason="CUDA op not built")
@pytest.mark.parametrize("i", range(4))
def test_cuda_gradcheck_float64(i):
    cfg = [LossConfig(ratio_level="token", clip_high=0.28, kl_beta=0.1, kl_estimator="k3", entropy_coef=0.01),
           LossConfig(ratio_level="chunk", gamma=0.9, dual_clip=3.0, loss_agg="seq-mean-token-mean"),
           LossConfig(ratio_level="sequence", mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05),
           LossConfig(ratio_level="chunk", loss_agg="seq-mean-token-sum-norm", kl_beta=0.1, kl_estimator="k2")][i]
    b = _cuda(make_batch(n_seq=5, max_len=10, seed=5, dtype=torch.float64, log_ratio_scale=0.5))

    def f(lp, ent):
        return policy_loss(lp, b.old_logp, **b.kwargs(with_optional=False), rollout_logp=b.rollout_logp,
                           ref_logp=b.ref_logp, entropy=ent, config=cfg, backend="cuda").loss

    args = (b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_bad_inputs_raise_the_reference_errors(backend):
    b = _cuda(make_batch(n_seq=4, max_len=20, seed=6))
    cid = b.chunk_ids.clone()
    cid[(cid >= 0).nonzero().squeeze(1)[-1]] = 0  # goes backwards
    lp_nan = b.logp.clone()
    lp_nan[(b.chunk_ids >= 0).nonzero()[0, 0]] = float("nan")
    cases = [dict(old_logp=b.old_logp[:-1]), dict(logp=lp_nan), dict(chunk_ids=cid),
             dict(rollout_logp=None, config=LossConfig(mismatch_level="chunk")), dict(normalizer=-1.0)]
    for case in cases:
        kw = dict(logp=b.logp, old_logp=b.old_logp, rollout_logp=b.rollout_logp, **b.kwargs(with_optional=False))
        kw.update(case)
        msgs = []
        for be in ("reference", backend):
            with pytest.raises(ValueError) as e:
                policy_loss(**kw, backend=be)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1] and "\n" not in msgs[1]


def test_auto_picks_a_gpu_backend_and_no_trained_tokens():
    b = _cuda(make_batch(n_seq=3, max_len=20, seed=8))
    inp = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs(with_optional=False))
    assert _auto(inp) == GPU_BACKENDS[0]
    b.chunk_ids = torch.full_like(b.chunk_ids, -1)
    for backend in GPU_BACKENDS:
        assert_same(b, LossConfig(ratio_level="chunk"), backend)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_bitwise_deterministic_run_to_run(backend):
    b = _cuda(make_batch(n_seq=64, max_len=600, seed=9))
    res = []
    for _ in range(3):
        out, g, ge = run(b, CONFIGS[-2], backend)
        res.append((out.loss, g, ge, torch.stack([out.metrics[k] for k in METRIC_KEYS])))
    for r in res[1:]:
        for x, y in zip(res[0], r):
            assert torch.equal(x, y)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_packed_agentic_batch_against_float64_reference(backend):
    """The bench layout (512 sequences, ~8 chunks each) at 256k tokens: the fp32 kernels against
    the float64 reference on CPU (the fp32 reference's own sums drift at this length)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location(
        "bench_policy_loss", pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_policy_loss.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for cfg in (bench.CONFIGS["chunk_level"], bench.CONFIGS["token_level"]):
        d = bench.agentic_batch(256 * 1024, "cuda", seed=1)
        lp = d.pop("logp").requires_grad_(True)
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

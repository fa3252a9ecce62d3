"""The package installs and imports as documented; the C++ op library loads."""
import subprocess
import sys

import pytest


@pytest.mark.slow  # a fresh interpreter imports arl
def test_public_imports_from_outside_the_checkout(tmp_path):
    code = ("import arl, arl.ops.policy_loss, arl.ops.logprob; from arl import policy_loss, LossConfig, LossOutput, "
            "available_backends; print(arl.ops.policy_loss.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "arl.ops.policy_loss"


@pytest.mark.slow  # a fresh interpreter imports arl
def test_kernels_is_not_a_top_level_module(tmp_path):
    # `kernels` belongs to a Hugging Face package that transformers imports: arl must not shadow it
    code = "import importlib.util, arl; s = importlib.util.find_spec('kernels'); print(s.origin if s else None)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "/arl" not in out.stdout and "main/kernels" not in out.stdout, out.stdout


def test_cpp_policy_loss_op_matches_the_reference():
    """arl._C registers torch.ops.arl.policy_loss, and the raw op (no autograd wrapper) gives the
    reference's loss and 1/D on a small batch."""
    import torch

    import arl._C  # noqa: F401  registers torch.ops.arl.*
    from arl.ops.policy_loss import METRIC_KEYS, LossConfig, LossInputs, reference_policy_loss
    from arl.ops.policy_loss.options import kernel_options, kernel_tensors
    from loss_utils import make_batch

    assert hasattr(torch.ops.arl, "policy_loss") and hasattr(torch.ops.arl, "policy_loss_entropy_grad")
    b = make_batch(n_seq=6, max_len=30, seed=0)
    inp = LossInputs(logp=b.logp, old_logp=b.old_logp, **b.kwargs())
    cfg = LossConfig(ratio_level="chunk", kl_beta=0.1, entropy_coef=0.01)
    toks, idx = kernel_tensors(inp, cfg)
    loss, grad, stats, _ = torch.ops.arl.policy_loss(
        toks["logp"], toks["old_logp"], toks.get("rollout_logp"), toks.get("ref_logp"), toks.get("entropy"),
        idx["advantages"], idx["cu_seqlens"], idx["chunk_ids"], *kernel_options(cfg, None), True)
    assert grad.shape == b.logp.shape
    lp = b.logp.clone().requires_grad_(True)
    ref = reference_policy_loss(LossInputs(logp=lp, old_logp=b.old_logp, **b.kwargs()), cfg)
    ref.loss.backward()
    torch.testing.assert_close(loss, ref.loss.detach(), atol=1e-5, rtol=1e-5)
    n_tr = float((b.chunk_ids >= 0).sum())
    torch.testing.assert_close(stats[-1], torch.tensor(1.0 / n_tr), atol=0, rtol=1e-6)
    torch.testing.assert_close(grad * stats[-1], lp.grad, atol=1e-6, rtol=1e-5)  # the raw op's grad is unnormalized
    torch.testing.assert_close(stats[:len(METRIC_KEYS)], torch.stack([ref.metrics[k] for k in METRIC_KEYS]),
                               atol=1e-6, rtol=1e-5)


@pytest.mark.slow  # runs install.sh (a whole environment where none is)
def test_install_script_is_idempotent():
    """A second run of install.sh finds every pin satisfied and installs nothing (it only checks
    pins, rebuilds the C++ ops incrementally and imports arl)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(["bash", os.path.join(root, "install.sh")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[install] installing" not in out.stdout, out.stdout
    assert "[install] arl ready" in out.stdout


def test_an_op_that_is_built_but_does_not_load_is_named(tmp_path, monkeypatch):
    """Compiled against another torch (undefined symbol): the backend is unavailable, and a warning
    says why instead of a silent fallback; a module that was never built stays quiet."""
    import warnings

    from arl.ops.policy_loss.fused import _have_op

    (tmp_path / "arl_broken_op.py").write_text("raise ImportError('arl_broken_op.so: undefined symbol: _ZN3c10')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(RuntimeWarning, match=r"arl_broken_op: built but does not load \(.*undefined symbol"):
        assert _have_op.__wrapped__("arl_broken_op", "policy_loss") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _have_op.__wrapped__("arl_never_built_op", "policy_loss") is False

"""The FlexAttention tree path (arl/model/tree_flex.py) equals the per-segment SDPA path and the
ordinary packed forward.  On CPU torch has no FlexAttention backward, so the CPU test compares
no-grad forwards; the GPU test (bench/gpu_check.sh's tests stage) compares logprobs and every
parameter's gradient with the packed forward, the trainer's CUDA default."""
import numpy as np
import pytest
import torch

from arl.data.prefix_tree import build_layout
from arl.model.packed import packed_logprobs
from arl.model.shared_prefix import tree_hidden_states, tree_logprobs

from test_prefix_tree import tree_batch
from two_rank import tiny_qwen

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (FlexAttention's backward)")


def _packed(seqs, device):
    ids = torch.from_numpy(np.concatenate(seqs)).to(device)
    cu = torch.tensor([0] + np.cumsum([len(s) for s in seqs]).tolist(), dtype=torch.int32, device=device)
    return ids, cu


def test_block_mask_is_the_tree():
    """Query q reads key k iff k's segment is q's ancestor, or the same segment and k <= q."""
    from arl.model.tree_flex import FlexTreePlan

    layout = build_layout(tree_batch()[0])
    plan = FlexTreePlan(layout, torch.device("cpu"))
    C = layout.num_tokens
    got = plan.mask_mod(0, 0, torch.arange(C)[:, None], torch.arange(C)[None])
    want = torch.zeros(C, C, dtype=torch.bool)
    bounds = layout.seg_bounds.tolist()
    for s, chain in enumerate(layout.chains()):
        a, b = bounds[s], bounds[s + 1]
        for x, y in chain:
            want[a:b, x:y] = True
        want[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(got, want)


def test_flex_forward_equals_sdpa_forward_on_cpu():
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    model = tiny_qwen()
    with torch.no_grad():
        flex = tree_hidden_states(model, layout, kernel="flex")
        sdpa = tree_hidden_states(model, layout, kernel="sdpa")
        torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
        ids, cu = _packed(seqs, "cpu")
        lp_ref, _ = packed_logprobs(model, ids, cu)
        lp, _ = tree_logprobs(model, layout, kernel="flex")
        torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)


def test_unknown_kernel_is_one_line():
    with pytest.raises(ValueError, match=r"tree attention kernel: unknown 'flash'; choose from"):
        tree_hidden_states(tiny_qwen(), build_layout(tree_batch()[0]), kernel="flash")


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_gradients_equal_the_packed_forward_on_gpu(dtype):
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    model = tiny_qwen().to("cuda", dtype)
    ids, cu = _packed(seqs, "cuda")
    w = torch.randn(ids.numel(), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {}
    for name, fn in (("packed", lambda: packed_logprobs(model, ids, cu, attn="varlen_sdpa")[0]),
                     ("flex", lambda: tree_logprobs(model, layout, kernel="flex")[0])):
        model.zero_grad()
        lp = fn()
        (lp.float() * w).sum().backward()
        out[name] = (lp.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()})
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out["flex"][0], out["packed"][0], **tol)
    for n, g in out["packed"][1].items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(out["flex"][1][n], g, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")

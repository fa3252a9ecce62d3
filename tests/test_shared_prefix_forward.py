"""The forward over a shared-prefix layout (arl/model/shared_prefix.py) equals the ordinary packed
forward: logprobs, entropies, hidden states, the policy loss and every parameter's gradient, on a
tiny Qwen2 in float64 (rtol 1e-6) and float32 (a gradient within 1e-5 of its tensor's largest
entry: summing the suffixes' gradients before or after a layer rounds differently), over a 2-level tree with a
sequence that shares nothing; and through ``PolicyTrainer.rl_step`` on one gloo rank with the packer's
``share_prefix`` on and off (slow tier)."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from arl.config import OptimConfig, StabilizerConfig
from arl.data.packer import PackerConfig, pack_step
from arl.data.prefix_tree import build_layout
from arl.model.packed import packed_logprobs
from arl.model.shared_prefix import micro_batch_logprobs, tree_logprobs
from arl.ops.policy_loss import LossConfig, policy_loss
from arl.stabilizers import Stabilizers

from test_prefix_tree import _trajs, tree_batch
from two_rank import tiny_qwen

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28)
F64 = dict(rtol=1e-6, atol=1e-12)
F32 = dict(rtol=1e-4, atol=1e-6)


def assert_grad_close(got, want, tol, name):
    """Elementwise at ``tol``, with the absolute part scaled by the gradient's largest entry."""
    atol = tol["atol"] if tol is F64 else 1e-5 * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture
def float64_norms(monkeypatch):
    """HF's RMSNorm computes in float32 whatever the input dtype, so a float64 model is float32 at
    its norms (the two forwards then differ by float32 rounding of the gradient that the shared
    prefix sums before its norm, the unshared one after): a float64 norm for the float64 checks."""
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def _grads(model, fn, weights):
    model.zero_grad()
    logp, ent, hidden = fn()
    ((logp * weights).sum() + ent.sum() + hidden.sum()).backward()
    return (logp.detach(), ent.detach(), hidden.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, F64), (torch.float32, F32)], ids=["float64", "float32"])
def test_tree_forward_equals_packed_forward(dtype, tol, float64_norms):
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    assert layout.seg_parent.tolist().count(-1) == 2  # a 2-level tree and a sequence sharing nothing
    model = tiny_qwen().to(dtype)
    ids = torch.from_numpy(np.concatenate(seqs))
    cu = torch.tensor([0] + np.cumsum([len(s) for s in seqs]).tolist(), dtype=torch.int32)
    w = torch.randn(ids.numel(), dtype=dtype, generator=torch.Generator().manual_seed(0))
    kw = dict(with_entropy=True, return_hidden=True, temperature=0.9)
    for align in ("target", "next"):
        ref, g_ref = _grads(model, lambda: packed_logprobs(model, ids, cu, align=align, **kw), w)
        out, g = _grads(model, lambda: tree_logprobs(model, layout, align=align, **kw), w)
        for a, b in zip(ref, out):
            torch.testing.assert_close(b, a, **tol)
        assert set(g) == set(g_ref)
        for n in g_ref:
            assert_grad_close(g[n], g_ref[n], tol, n)


def test_tree_forward_under_gradient_checkpointing():
    """``model.gradient_checkpointing`` re-runs each layer in backward: the tree attention's plan must
    hold then too (float32, the tolerance above)."""
    seqs, _ = tree_batch()
    layout = build_layout(seqs)
    model = tiny_qwen().train()
    ids = torch.from_numpy(np.concatenate(seqs))
    cu = torch.tensor([0] + np.cumsum([len(s) for s in seqs]).tolist(), dtype=torch.int32)
    w = torch.randn(ids.numel(), generator=torch.Generator().manual_seed(0))
    ref, g_ref = _grads(model, lambda: packed_logprobs(model, ids, cu, with_entropy=True, return_hidden=True), w)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    out, g = _grads(model, lambda: tree_logprobs(model, layout, with_entropy=True, return_hidden=True), w)
    for a, b in zip(ref, out):
        torch.testing.assert_close(b, a, **F32)
    for n in g_ref:
        assert_grad_close(g[n], g_ref[n], F32, n)


def _micro_batch(share: bool):
    seqs, gids = tree_batch()
    trajs = _trajs(seqs, gids)
    stab = Stabilizers(StabilizerConfig(), LOSS)
    prep = stab.prepare(trajs, LOSS)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=4096, share_prefix=share), LOSS,
                       advantages=prep.advantages)
    stab.apply(packed, prep, LOSS)
    (mb,) = packed.ranks[0]
    return mb


def test_policy_loss_and_gradients_equal_with_the_switch(float64_norms):
    model = tiny_qwen().double()
    res = {}
    for share in (False, True):
        mb = _micro_batch(share)
        assert (mb.tree is not None) == share
        model.zero_grad()
        logp, _ = micro_batch_logprobs(model, mb, "cpu")
        noise = torch.randn(logp.shape, dtype=logp.dtype, generator=torch.Generator().manual_seed(1))
        old = logp.detach() + 0.01 * noise
        loss = policy_loss(logp, old, config=LOSS, backend="reference", **mb.loss_kwargs()).loss
        loss.backward()
        res[share] = (float(loss), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert res[True][0] == pytest.approx(res[False][0], rel=1e-6)
    for n, g in res[False][1].items():
        assert_grad_close(res[True][1][n], g, F64, n)


def test_tree_attention_refuses_other_attention_paths():
    layout = build_layout(tree_batch()[0])
    with pytest.raises(ValueError, match="trainer.share_prefix needs one of"):
        tree_logprobs(tiny_qwen(), layout, attn="hf_sdpa_packed")


def _worker(rank, world, port, result_dir):
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    res = {}
    for share in (False, True):
        tr = PolicyTrainer(tiny_qwen(), optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=0, total_steps=10)
        grads = {}
        for n, p in tr.module.named_parameters():  # this rank's gradient, summed over the micro-batches
            p.register_hook(lambda g, n=n: grads.__setitem__(n, grads.get(n, 0) + g.detach().clone()) or g)
        mbs = [_micro_batch(share)]
        res[share] = {"metrics": tr.rl_step(mbs, None, LOSS), "grads": grads, "old": tr.last_old_logps[0]}
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow
def test_rl_step_with_share_prefix_equals_the_unshared_step(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    off, on = res[False], res[True]
    assert on["metrics"]["head_grad_in_forward"] == off["metrics"]["head_grad_in_forward"] == 1.0
    for k in ("loss", "grad_norm"):
        assert on["metrics"][k] == pytest.approx(off["metrics"][k], rel=1e-5), k
    torch.testing.assert_close(on["old"], off["old"], **F32)
    assert set(on["grads"]) == set(off["grads"]) and off["grads"]
    for n, g in off["grads"].items():
        assert_grad_close(on["grads"][n], g, F32, n)

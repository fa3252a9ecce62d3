"""The head that produces its gradients in its forward (arl/ops/logprob/grad_in_forward.py, with the
loss's plan arl/ops/policy_loss/local_grad.py) against the specification: autograd through the
naive head and the reference policy loss with old = logp.detach().  Values (logp, entropy, loss)
and gradients (hidden, weight) for every loss config family, tiles that split the batch, the
fallbacks (a dependency segment longer than a tile, a trained token without a head row), and a
deliberately wrong coefficient, which the value comparison and the backward's own check both catch."""
import numpy as np
import pytest
import torch

from arl.ops.logprob import naive_logprobs
from arl.ops.logprob.grad_in_forward import ConstantGrad, grad_in_forward_logprobs
from arl.algo.advantages import group_advantages
from arl.ops.policy_loss import LossConfig, policy_loss
from arl.ops.policy_loss.local_grad import local_logp_grad

DT = torch.float64
V, H = 97, 16


def packed_batch(seed=0, n_seq=6, group=3):
    """A packed batch: sequences with a prompt and several trained chunks between untrained
    observations; hidden states for the head rows (positions with a next token)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(14, 40, n_seq)
    cu = np.concatenate([[0], np.cumsum(lens)])
    chunk, cid = [], 0
    for L in lens:
        c = np.full(L, -1)
        pos = int(rng.integers(2, 5))
        while pos < L:
            span = int(rng.integers(2, 7))
            c[pos:pos + span] = cid
            cid += 1
            pos += span + int(rng.integers(1, 4))
        chunk.append(c)
    T = int(cu[-1])
    cu_t = torch.tensor(cu, dtype=torch.int32)
    has_next = torch.ones(T, dtype=torch.bool)
    has_next[cu_t[1:].long() - 1] = False
    src = has_next.nonzero().squeeze(1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (T,), generator=g)
    return dict(
        T=T, cu=cu_t, chunk=torch.tensor(np.concatenate(chunk), dtype=torch.int32), src=src, dst=src + 1,
        targets=ids[src + 1], hidden=torch.randn(src.numel(), H, generator=g, dtype=DT),
        weight=torch.randn(V, H, generator=g, dtype=DT) * 0.5,
        advantages=torch.from_numpy(group_advantages(
            torch.tensor(rng.random(n_seq) < 0.5, dtype=torch.float32) + torch.tensor(rng.random(n_seq), dtype=torch.float32),
            torch.arange(n_seq) // group, "grpo", 1e-6)[0]), ref=torch.randn(T, generator=g, dtype=DT) * 0.3 - 4.0,
        noise=torch.randn(T, generator=g, dtype=DT))


def loss_kwargs(b, cfg, roll, advantages=None, normalizer=None):
    return dict(advantages=b["advantages"] if advantages is None else advantages, cu_seqlens=b["cu"],
                chunk_ids=b["chunk"], rollout_logp=roll, ref_logp=b["ref"] if cfg.kl_beta > 0 else None,
                normalizer=normalizer)


def rollout(b, temp, spread):
    """rollout logprobs = the model's own plus noise: mismatch weights that keep some tokens and
    segments and mask or truncate others."""
    with torch.no_grad():
        lp, _ = naive_logprobs(b["hidden"], b["weight"], b["targets"], temp)
    full = torch.zeros(b["T"], dtype=DT).index_copy(0, b["dst"], lp)
    return full + spread * b["noise"]


def run(b, cfg, head, temp=1.0, scale=1.0, **extra):
    """(logp, entropy, loss, grad_hidden, grad_weight) through ``head`` ("spec" or a plan builder)."""
    h = b["hidden"].clone().requires_grad_(True)
    w = b["weight"].clone().requires_grad_(True)
    scratch = extra.pop("scratch_rows", None)
    kw = loss_kwargs(b, cfg, extra.pop("roll"), **extra)
    if head == "spec":
        lp, ent = naive_logprobs(h, w, b["targets"], temp, with_entropy=True)
    else:
        plan = head(b, cfg, kw, scale)
        out = grad_in_forward_logprobs(h, w, b["targets"], plan, temp, with_entropy=True, tile_rows=extra_rows(b),
                                       scratch_rows=scratch)
        assert out is not None, "the plan should tile this batch"
        lp, ent = out
    logp = torch.zeros(b["T"], dtype=DT).index_copy(0, b["dst"], lp)
    entropy = torch.zeros(b["T"], dtype=DT).index_copy(0, b["dst"], ent)
    loss = policy_loss(logp, logp.detach(), config=cfg, entropy=entropy, backend="reference", **kw).loss * scale
    gh, gw = torch.autograd.grad(loss, (h, w))
    return logp.detach(), entropy.detach(), loss.detach(), gh, gw


def extra_rows(b):
    return max(45, b["src"].numel() // 5)  # several tiles per batch, each longer than any sequence (< 40)


def plan_of(b, cfg, kw, scale):
    kw = {k: v for k, v in kw.items()}
    return local_logp_grad(config=cfg, with_entropy=True, scale=scale, dtype=DT, **kw).rows(b["dst"])


def assert_same(a, b, rtol=1e-9):
    names = ("logp", "entropy", "loss", "grad_hidden", "grad_weight")
    for n, x, y in zip(names, a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


CONFIGS = {
    "grpo_token": LossConfig(),
    "chunk_ratio": LossConfig(ratio_level="chunk", gamma=0.9),
    "gspo_sequence": LossConfig(ratio_level="sequence", loss_agg="seq-mean-token-mean"),
    "dual_clip_dapo": LossConfig(clip_high=0.28, dual_clip=3.0),
    "topr_chunk": LossConfig(surrogate="topr", ratio_level="chunk", positive_only=True),
    "mismatch_token_truncate": LossConfig(mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.3),
    "mismatch_token_mask_chunk_ratio": LossConfig(ratio_level="chunk", mismatch_level="token", mismatch_high=1.5),
    # the main job's loss (configs/tiny_cpu.yaml)
    "main_job_chunk_mask": LossConfig(ratio_level="chunk", clip_high=0.28, gamma=0.95, mismatch_level="chunk",
                                      mismatch_high=5.0),
    "mismatch_sequence_truncate": LossConfig(ratio_level="token", mismatch_level="sequence", mismatch_mode="truncate",
                                             mismatch_high=1.1, loss_agg="seq-mean-token-sum"),
    "topr_mismatch_chunk": LossConfig(surrogate="topr", mismatch_level="chunk", loss_agg="seq-mean-token-sum-norm"),
    # a surrogate with no kernel: its plan comes from the registered function alone
    "cispo_main_job": LossConfig(surrogate="cispo", ratio_level="chunk", clip_high=0.28, gamma=0.95,
                                 mismatch_level="chunk", mismatch_high=5.0),
    "kl_k1": LossConfig(kl_beta=0.1, kl_estimator="k1"),
    "kl_k2_norm_const": LossConfig(kl_beta=0.2, kl_estimator="k2", loss_agg="seq-mean-token-sum-norm", agg_constant=50.0),
    "kl_k3_clamped": LossConfig(kl_beta=0.3, kl_estimator="k3", log_ratio_clamp=0.4, ratio_level="sequence"),
    "entropy_bonus": LossConfig(entropy_coef=0.05, ratio_level="chunk"),
    "everything": LossConfig(ratio_level="chunk", mismatch_level="sequence", mismatch_high=1.4, kl_beta=0.1,
                             entropy_coef=0.02, gamma=0.8, dual_clip=2.0, loss_agg="seq-mean-token-mean"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_values_and_gradients_match_the_spec(name):
    cfg = CONFIGS[name]
    b = packed_batch(seed=len(name))
    temp = 0.7 if "kl" in name else 1.0
    roll = rollout(b, temp, spread=0.25 if cfg.mismatch_level == "token" else 0.6)
    extra = dict(roll=roll)
    if "norm" in name:  # the step's normalizer and given advantages, as the trainer passes them
        extra.update(normalizer=123.0, advantages=torch.randn(b["advantages"].numel(), generator=torch.Generator().manual_seed(1)))
    spec = run(b, cfg, "spec", temp=temp, scale=2.0, **dict(extra))
    ours = run(b, cfg, plan_of, temp=temp, scale=2.0, **dict(extra))
    assert float(spec[3].abs().max()) > 0, "the batch should carry a gradient"
    assert_same(ours, spec)


@pytest.mark.parametrize("name", ["entropy_bonus", "everything"])
def test_entropy_row_groups_match_the_spec(name):
    """The entropy path's scratch rows (S and the entropy gradient in row groups) in groups that do
    not divide the tiles, with the loss's real plan."""
    cfg = CONFIGS[name]
    b = packed_batch(seed=len(name))
    roll = rollout(b, 1.0, spread=0.6)
    spec = run(b, cfg, "spec", scale=2.0, roll=roll)
    ours = run(b, cfg, plan_of, scale=2.0, roll=roll, scratch_rows=4)
    assert extra_rows(b) % 4 and b["src"].numel() % extra_rows(b)
    assert_same(ours, spec)


def test_mismatch_weights_are_mixed_in_the_batch():
    """The mismatch cases above really mask some segments and keep others (else they test nothing)."""
    for name in ("main_job_chunk_mask", "mismatch_token_mask_chunk_ratio"):
        cfg, b = CONFIGS[name], packed_batch(seed=len(name))
        roll = rollout(b, 1.0, spread=0.25 if cfg.mismatch_level == "token" else 0.6)
        with torch.no_grad():
            lp, _ = naive_logprobs(b["hidden"], b["weight"], b["targets"])
        logp = torch.zeros(b["T"], dtype=DT).index_copy(0, b["dst"], lp)
        m = policy_loss(logp, logp, config=cfg, backend="reference", **loss_kwargs(b, cfg, roll)).metrics
        assert 0.05 < float(m["mismatch_masked_frac"]) < 0.95, (name, float(m["mismatch_masked_frac"]))


def test_with_the_cpp_loss_and_fp32():
    """In the trainer: fp32, the C++ loss op's backward; the planned gradients pass its check."""
    from arl.ops.policy_loss import available_backends

    if "cpu" not in available_backends():
        pytest.skip("C++ policy-loss op not built")
    cfg = CONFIGS["main_job_chunk_mask"]
    b = packed_batch(seed=3)
    b = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == DT else v) for k, v in b.items()}
    with torch.no_grad():
        lp0, _ = naive_logprobs(b["hidden"], b["weight"], b["targets"])
    roll = torch.zeros(b["T"]).index_copy(0, b["dst"], lp0) + 0.6 * b["noise"]
    kw = loss_kwargs(b, cfg, roll)
    grads = []
    for use in (False, True):
        h, w = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
        if use:
            plan = local_logp_grad(config=cfg, with_entropy=True, **kw).rows(b["dst"])
            lp, ent = grad_in_forward_logprobs(h, w, b["targets"], plan, with_entropy=True, tile_rows=extra_rows(b))
        else:
            lp, ent = naive_logprobs(h, w, b["targets"], with_entropy=True)
        logp = torch.zeros(b["T"]).index_copy(0, b["dst"], lp)
        entropy = torch.zeros(b["T"]).index_copy(0, b["dst"], ent)
        loss = policy_loss(logp, logp.detach(), config=cfg, entropy=entropy, backend="cpu", **kw).loss
        grads.append(torch.autograd.grad(loss, (h, w)))
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)


def test_segment_longer_than_a_tile_falls_back():
    """Sequence-level mismatch needs whole sequences in one tile: with tiles shorter than a sequence
    the head declines (None) and the caller takes the ordinary path; token-level never declines."""
    b = packed_batch(seed=5)
    kw = loss_kwargs(b, CONFIGS["mismatch_sequence_truncate"], rollout(b, 1.0, 0.6))
    plan = local_logp_grad(config=CONFIGS["mismatch_sequence_truncate"], with_entropy=True, dtype=DT, **kw).rows(b["dst"])
    assert plan.cuts(8) is None
    assert grad_in_forward_logprobs(b["hidden"], b["weight"], b["targets"], plan, with_entropy=True, tile_rows=8) is None
    cuts = plan.cuts(64)
    seq_of_row = torch.repeat_interleave(torch.arange(b["cu"].numel() - 1), b["cu"].diff().long())[b["dst"]]
    trained = b["chunk"][b["dst"]] >= 0
    assert len(cuts) > 3
    for c in cuts[1:-1]:  # never between two trained rows of one sequence
        r = torch.arange(seq_of_row.numel())
        assert seq_of_row[trained & (r < c)].max() < seq_of_row[trained & (r >= c)].min()
    tok = local_logp_grad(config=CONFIGS["grpo_token"], with_entropy=True, dtype=DT, **kw).rows(b["dst"])
    assert tok.cuts(1) == list(range(b["src"].numel() + 1))


def test_trained_token_without_a_head_row_has_no_plan():
    """A sequence's first token has no logprob (nothing predicts it): trained there, no plan."""
    b = packed_batch(seed=6)
    chunk = b["chunk"].clone()
    chunk[0] = 0
    kw = dict(loss_kwargs(b, LossConfig(), None), chunk_ids=chunk)
    assert local_logp_grad(config=LossConfig(), **kw).rows(b["dst"]) is None


def test_a_wrong_coefficient_fails():
    """A plan whose coefficient is off by 1%: its gradients differ from the spec's (the value
    comparison above would fail), and in a real backward the head's check refuses it."""
    cfg = CONFIGS["chunk_ratio"]
    b = packed_batch(seed=7)
    roll = rollout(b, 1.0, 0.0)
    spec = run(b, cfg, "spec", roll=roll)

    def wrong(b_, cfg_, kw, scale):
        p = plan_of(b_, cfg_, kw, scale)
        p.const = p.const * 1.01
        return p

    with pytest.raises(RuntimeError, match="differs from the plan"):
        run(b, cfg, wrong, roll=roll)
    # the same wrong plan, backward fed its own coefficients (so the check passes): wrong gradients
    h, w = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
    p = wrong(b, cfg, loss_kwargs(b, cfg, roll), 1.0)
    g_rows, _ = p.grad(0, b["src"].numel(), torch.zeros(b["src"].numel(), dtype=DT))
    lp, ent = grad_in_forward_logprobs(h, w, b["targets"], ConstantGrad(g_rows), with_entropy=True)
    gh, gw = torch.autograd.grad((lp * g_rows).sum(), (h, w))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(gh, spec[3], rtol=1e-9, atol=1e-12)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(gw, spec[4], rtol=1e-9, atol=1e-12)


def test_constant_plan_matches_autograd_and_weight_without_grad():
    """The op alone: a fixed d loss/d logp and d loss/d entropy, a temperature, whole-batch and
    split tiles; a weight that needs no gradient gets none."""
    b = packed_batch(seed=8)
    g = torch.Generator().manual_seed(0)
    n = b["src"].numel()
    gl, ge = torch.randn(n, generator=g, dtype=DT), torch.randn(n, generator=g, dtype=DT)
    h, w = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
    lp, ent = naive_logprobs(h, w, b["targets"], 0.8, with_entropy=True)
    want = torch.autograd.grad((lp * gl).sum() + (ent * ge).sum(), (h, w))
    for rows in (None, 7):
        h2, w2 = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
        lp2, ent2 = grad_in_forward_logprobs(h2, w2, b["targets"], ConstantGrad(gl, ge), 0.8, with_entropy=True,
                                             tile_rows=rows)
        torch.testing.assert_close(lp2, lp.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent2, ent.detach(), rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad((lp2 * gl).sum() + (ent2 * ge).sum(), (h2, w2))
        for a, c in zip(got, want):
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    h3 = b["hidden"].clone().requires_grad_(True)
    lp3, ent3 = grad_in_forward_logprobs(h3, b["weight"], b["targets"], ConstantGrad(gl))
    assert ent3 is None
    (gh,) = torch.autograd.grad((lp3 * gl).sum(), (h3,))
    h4 = b["hidden"].clone().requires_grad_(True)
    (want_h,) = torch.autograd.grad((naive_logprobs(h4, b["weight"], b["targets"])[0] * gl).sum(), (h4,))
    torch.testing.assert_close(gh, want_h, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tile_rows,scratch_rows", [(7, 3), (10, 4), (None, 1), (9, 1000)])
def test_entropy_scratch_rows_match_autograd(tile_rows, scratch_rows):
    """Entropy with and without its gradient, scratch row groups that split tiles (or exceed
    them), T not a multiple of the tile, a temperature: values and gradients as autograd's."""
    b = packed_batch(seed=9)
    g = torch.Generator().manual_seed(2)
    n = b["src"].numel()
    assert n % 7 and n % 9 and n % 10
    gl, ge = torch.randn(n, generator=g, dtype=DT), torch.randn(n, generator=g, dtype=DT)
    for ge_ in (ge, None):
        h, w = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
        lp, ent = naive_logprobs(h, w, b["targets"], 0.8, with_entropy=True)
        loss = (lp * gl).sum() + (0.0 if ge_ is None else (ent * ge_).sum())
        want = torch.autograd.grad(loss, (h, w))
        h2, w2 = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
        # ConstantGrad says whether it has an entropy gradient (without one z becomes p in the
        # statistics pass); _Opaque does not (z is kept and exp recomputed)
        for plan in (ConstantGrad(gl, ge_), _Opaque(ConstantGrad(gl, ge_))):
            h2, w2 = b["hidden"].clone().requires_grad_(True), b["weight"].clone().requires_grad_(True)
            lp2, ent2 = grad_in_forward_logprobs(h2, w2, b["targets"], plan, 0.8, with_entropy=True,
                                                 tile_rows=tile_rows, scratch_rows=scratch_rows)
            torch.testing.assert_close(lp2, lp.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent2, ent.detach(), rtol=1e-12, atol=1e-12)
            loss2 = (lp2 * gl).sum() + (0.0 if ge_ is None else (ent2 * ge_).sum())
            for a, c in zip(torch.autograd.grad(loss2, (h2, w2)), want):
                torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)


class _Opaque:
    """A plan with only cuts and grad (no entropy_grad attribute)."""

    def __init__(self, plan):
        self.cuts, self.grad = plan.cuts, plan.grad


class _Hiding(ConstantGrad):
    entropy_grad = False  # but grad returns one


def test_plan_that_hides_its_entropy_gradient_fails():
    """z was turned into p on the plan's word: an entropy coefficient after that is refused."""
    b = packed_batch(seed=2)
    n = b["src"].numel()
    plan = _Hiding(torch.ones(n, dtype=DT), torch.ones(n, dtype=DT))
    h = b["hidden"].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="entropy_grad said it has none"):
        grad_in_forward_logprobs(h, b["weight"], b["targets"], plan, with_entropy=True)


def test_default_tile_rows_share_the_budget_with_the_scratch():
    """With the entropy, the tile and its scratch (a _GROUPS-th of it) fit the rows the plain path's
    one block gets (the 15% memory target at V=151936 rests on it)."""
    from arl.ops.logprob.grad_in_forward import _GROUPS, default_tile_rows

    for T in (100, 331, 512, 2048, 8192):
        for V_ in (32768, 151936):
            plain, ent = default_tile_rows(T, V_), default_tile_rows(T, V_, with_entropy=True)
            assert ent + -(-ent // _GROUPS) <= plain + 1 or ent == T, (T, V_, plain, ent)
            assert ent >= 1 and ent <= T


def test_entropy_holds_one_logits_block():
    """With the entropy (and its gradient) the op's extra peak is one [tile, V] logits block plus the
    [scratch, V] scratch block and [T] vectors: never a second logits block (bench_logprob's meter:
    allocations during fwd+bwd beyond the returned gradients)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
    from bench_logprob import peak_bytes

    T, V_, H_ = 100, 4096, 8
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H_, generator=g).requires_grad_(True)
    w = torch.randn(V_, H_, generator=g).requires_grad_(True)
    y = torch.randint(0, V_, (T,), generator=g)
    gl, ge = torch.randn(T, generator=g), torch.randn(T, generator=g)
    for ge_, scratch in ((ge, 3), (None, None)):  # default scratch: a _GROUPS-th of the tile (10 rows)
        def call():
            lp, ent = grad_in_forward_logprobs(h, w, y, ConstantGrad(gl, ge_), with_entropy=True, tile_rows=40,
                                               scratch_rows=scratch)
            loss = (lp * gl).sum() + (0.0 if ge_ is None else (ent * ge_).sum())
            return torch.autograd.grad(loss, (h, w))

        _, extra, _ = peak_bytes(call, "cpu")
        # slack: one vocabulary row's worth, for the [T] vectors (logp, entropy, g, lse, S, ...)
        assert extra <= (40 + (scratch or 10) + 1) * V_ * 4, (ge_ is None, extra)


def test_bad_scratch_rows():
    b = packed_batch(seed=1)
    with pytest.raises(ValueError, match="scratch_rows: must be >= 1"):
        grad_in_forward_logprobs(b["hidden"], b["weight"], b["targets"], ConstantGrad(torch.zeros(b["src"].numel())),
                                 with_entropy=True, scratch_rows=0)


@pytest.mark.parametrize("cfg", [LossConfig(ratio_level="chunk", gamma=0.9, entropy_coef=0.01),
                                 LossConfig(ratio_level="chunk", mismatch_level="chunk", mismatch_high=5.0, kl_beta=0.1,
                                            entropy_coef=0.01)], ids=["constant", "mismatch_kl"])
def test_plan_untrained_token_inside_a_chunk(cfg):
    """Chunk ids [0, 0, -1, 0, 1]: the plan's gradients are the reference's (old = logp.detach()), and
    exactly 0 on the -1 token."""
    from loss_utils import untrained_inside_chunk_batch

    b = untrained_inside_chunk_batch(DT)
    kw = dict(advantages=b.advantages, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, rollout_logp=b.rollout_logp,
              ref_logp=b.ref_logp if cfg.kl_beta > 0 else None)
    g, ge = local_logp_grad(config=cfg, with_entropy=True, dtype=DT, **kw).grad(0, b.logp.numel(), b.logp)
    lp = b.logp.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)
    out = policy_loss(lp, lp.detach(), config=cfg, entropy=ent, backend="reference", **kw)
    g_ref, ge_ref = torch.autograd.grad(out.loss, (lp, ent))
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=1e-9)
    torch.testing.assert_close(ge, ge_ref, atol=1e-12, rtol=1e-9)
    assert g[2].item() == 0.0 and ge[2].item() == 0.0 and bool((g[[0, 1, 3]] != 0).all())

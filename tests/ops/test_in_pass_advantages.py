"""Group-normalized advantages computed inside the fused pass (``loss.advantages_in_pass``,
arl/ops/policy_loss/group_adv.py) against the registry's float64 estimators (arl/algo/advantages.py),
the one definition: the advantages themselves, and loss, gradients and metrics of every backend
against the same backend fed the registry's advantages, for ragged, zero-variance and singleton
groups and a group split over micro-batches (the step's statistics, not the micro-batch's).

Backends: the torch reference, the C++ op, Triton (TRITON_INTERPRET=1 on CPU, conftest.py) and the
CUDA op where a GPU is present (compiled by tests/ops/test_cuda_compile.py otherwise).  Batches are
small where Triton runs interpreted."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from arl import LossConfig, available_backends, policy_loss
from arl.algo.advantages import group_advantages
from arl.config import AlgoConfig
from arl.data.packer import PackerConfig, pack_step
from arl.data.trajectory import Trajectory
from arl.ops._triton import triton_available
from arl.ops.policy_loss.api import choose_backend, not_covered
from arl.ops.policy_loss.group_adv import IN_PASS, GroupAdvantages, in_pass_advantages, step_groups
from arl.ops.policy_loss.local_grad import local_logp_grad
from arl.algo.step import step_advantages
from arl.algo.in_pass import attach_in_pass
from arl.algo.objectives import pg_inputs
from loss_utils import ADV_EPS, make_batch

GPU = torch.cuda.is_available()
TOL = dict(atol=1e-5, rtol=1e-5)  # the conformance suite's (test_policy_loss_backends.py)
ESTIMATORS = tuple(IN_PASS)
DEVICE = {"reference": "cpu", "cpu": "cpu", "triton": "cuda" if GPU else "cpu", "cuda": "cuda"}
_AVAIL = {"reference": lambda: True, "cpu": lambda: "cpu" in available_backends(), "triton": triton_available,
          "cuda": lambda: GPU and "cuda" in available_backends()}
BACKENDS = [pytest.param(n, marks=pytest.mark.skipif(not _AVAIL[n](), reason=f"{n} not available here"))
            for n in ("reference", "cpu", "triton", "cuda")]

# ragged groups: sizes 3, 1 (singleton), 4 (all equal: zero variance), 2, 5, 1, 3 -> 19 sequences
SIZES = (3, 1, 4, 2, 5, 1, 3)
IDS = np.repeat(np.array([7, -2, 40, 3, 11, 0, 9]), SIZES)  # any integers, not sorted


def _rewards(kind: str) -> np.ndarray:
    gen = np.random.default_rng(3)
    r = (gen.random(IDS.size) > 0.5).astype(np.float64) if kind == "binary" else gen.normal(size=IDS.size) * 0.37
    r[np.flatnonzero(IDS == 40)] = 0.1  # zero variance at a value with no exact binary form (0.1 * 4 / 4 != 0.1 in fp)
    return r


def _step(est: str, kind: str = "normal", n_seq: int = IDS.size, max_len: int = 9, dtype=torch.float32):
    """A packed batch of the step's sequences, its in-pass inputs and the registry's advantages."""
    b = make_batch(n_seq=n_seq, max_len=max_len, seed=11, dtype=dtype, log_ratio_scale=0.3)
    r = _rewards(kind)[:n_seq]
    sg = step_groups(r, IDS[:n_seq], np.ones(n_seq, bool), est, ADV_EPS)
    adv = torch.from_numpy(group_advantages(r, IDS[:n_seq], est, ADV_EPS)[0])
    return b, sg, adv


@pytest.mark.parametrize("kind", ["binary", "normal"])
@pytest.mark.parametrize("est", ESTIMATORS)
def test_in_pass_formula_is_the_registry_bit_for_bit(est, kind):
    r = _rewards(kind)
    sg = step_groups(r, IDS, np.ones(IDS.size, bool), est, ADV_EPS)
    want = group_advantages(r, IDS, est, ADV_EPS)[0]
    got = in_pass_advantages(sg.take(np.arange(IDS.size))).numpy()
    assert np.array_equal(got, want), (got, want)
    assert (got[np.flatnonzero(IDS == 40)] == 0).all() and (got[np.flatnonzero(IDS == -2)] == 0).all()
    # any subset, in any order (a micro-batch's sequences), reads the step's statistics
    sub = np.array([12, 0, 5, 18, 3])
    assert np.array_equal(in_pass_advantages(sg.take(sub)).numpy(), want[sub])


def test_filtered_trajectories_take_no_part_in_any_group():
    r, keep = _rewards("normal"), np.ones(IDS.size, bool)
    keep[[1, 4, 9]] = False  # FILTERED: not packed, in no group
    sg = step_groups(r, IDS, keep, "grpo", ADV_EPS)
    want = group_advantages(r[keep], IDS[keep], "grpo", ADV_EPS)[0]
    assert np.array_equal(in_pass_advantages(sg.take(np.flatnonzero(keep))).numpy(), want)
    with pytest.raises(ValueError, match="in no group"):
        sg.take([4])


def _run(b, backend, cfg, *, adv=None, group=None, normalizer=None, sl=slice(None), seqs=None):
    """Loss output and dL/dlogp, dL/dentropy of ``b`` (or of its sequences ``seqs``, tokens ``sl``)."""
    cu = b.cu_seqlens
    if seqs is not None:
        lo, hi = seqs
        sl = slice(int(cu[lo]), int(cu[hi]))
        cu = (cu[lo:hi + 1] - cu[lo]).to(torch.int32)
    lp = b.logp[sl].clone().requires_grad_(True)
    ent = b.entropy[sl].clone().requires_grad_(True)
    out = policy_loss(lp, b.old_logp[sl], advantages=adv, group=group, cu_seqlens=cu, chunk_ids=b.chunk_ids[sl],
                      rollout_logp=b.rollout_logp[sl], ref_logp=b.ref_logp[sl], entropy=ent, config=cfg,
                      normalizer=normalizer, backend=backend)
    out.loss.backward()
    z = lambda g, x: g if g is not None else torch.zeros_like(x)  # noqa: E731
    return out, z(lp.grad, lp), z(ent.grad, ent)


def _same(a, b, tol=TOL):
    (oa, ga, ea), (ob, gb, eb) = a, b
    torch.testing.assert_close(oa.loss, ob.loss, **tol)
    torch.testing.assert_close(ga, gb, **tol, msg=lambda m: f"dL/dlogp: {m}")
    torch.testing.assert_close(ea, eb, **tol, msg=lambda m: f"dL/dentropy: {m}")
    for k in ob.metrics:
        torch.testing.assert_close(oa.metrics[k], ob.metrics[k], **tol, msg=lambda m, k=k: f"metric {k}: {m}")


CFGS = [
    LossConfig(),  # GRPO: token ratio, one streaming pass
    LossConfig(ratio_level="chunk", gamma=0.9, mismatch_level="chunk", positive_only=True, entropy_coef=0.01),
    LossConfig(ratio_level="sequence", surrogate="topr", loss_agg="seq-mean-token-mean", kl_beta=0.1),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("est", ESTIMATORS)
@pytest.mark.parametrize("cfg", CFGS, ids=["token", "chunk-gamma", "sequence-topr"])
def test_in_pass_equals_the_registry_advantages(backend, est, cfg):
    b, sg, adv = _step(est)
    dev = DEVICE[backend]
    b = b.to(device=dev)
    given = _run(b, backend, cfg, adv=adv.to(dev))
    in_pass = _run(b, backend, cfg, group=sg.take(np.arange(IDS.size)).to(dev))
    _same(in_pass, given)
    # and both equal the specification fed the registry's advantages
    _same(in_pass, _run(b, "reference", cfg, adv=adv.to(dev)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("est", ESTIMATORS)
def test_a_group_split_over_micro_batches_uses_the_step_statistics(backend, est):
    """Micro-batches [0, 6), [6, 12), [12, 19): the cuts split group 40 (sequences 4-7, zero variance)
    and group 11 (sequences 10-14); the sum over micro-batches with the step's normalizer is the step."""
    b, sg, adv = _step(est)
    dev = DEVICE[backend]
    b = b.to(device=dev)
    cfg = LossConfig(ratio_level="chunk", gamma=0.95, mismatch_level="token")
    D = float((b.chunk_ids >= 0).sum())
    whole = _run(b, "reference", cfg, adv=adv.to(dev), normalizer=D)
    loss, grads, ents = 0.0, [], []
    for lo, hi in ((0, 6), (6, 12), (12, IDS.size)):
        g = sg.take(np.arange(lo, hi)).to(dev)
        out, gl, ge = _run(b, backend, cfg, group=g, normalizer=D, seqs=(lo, hi))
        loss, grads, ents = loss + out.loss.detach(), grads + [gl], ents + [ge]
    torch.testing.assert_close(loss, whole[0].loss.detach(), **TOL)
    torch.testing.assert_close(torch.cat(grads), whole[1], **TOL)
    torch.testing.assert_close(torch.cat(ents), whole[2], **TOL)
    # the micro-batch's own statistics would differ: the split group's advantages are not the micro-batch's
    own = group_advantages(_rewards("normal")[12:], IDS[12:], est, ADV_EPS)[0]
    assert not np.allclose(own, adv[12:].numpy())


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] != "reference"])
def test_float64_gradcheck_in_pass(backend):
    b, sg, _ = _step("grpo", n_seq=6, max_len=6, dtype=torch.float64)
    dev = DEVICE[backend]
    b = b.to(device=dev)
    g = sg.take(np.arange(6)).to(dev)
    cfg = LossConfig(ratio_level="chunk", gamma=0.9, entropy_coef=0.01)

    def f(lp, ent):
        return policy_loss(lp, b.old_logp, group=g, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, entropy=ent,
                           config=cfg, backend=backend).loss

    args = (b.logp.clone().requires_grad_(True), b.entropy.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_the_head_gradient_plan_takes_the_in_pass_inputs():
    b, sg, adv = _step("rloo")
    cfg = LossConfig(mismatch_level="token")
    kw = dict(config=cfg, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, rollout_logp=b.rollout_logp)
    a = local_logp_grad(advantages=adv, **kw)
    g = local_logp_grad(group=sg.take(np.arange(IDS.size)), **kw)
    n = b.logp.numel()
    torch.testing.assert_close(g.grad(0, n, b.logp)[0], a.grad(0, n, b.logp)[0], atol=0, rtol=0)


def test_the_capability_is_declared_like_any_option():
    cfg = LossConfig()
    for est in ESTIMATORS:
        assert not_covered("cpu", cfg, est) is None and not_covered("triton", cfg, est) is None
    assert not_covered("cpu", cfg, "gae") == "advantages_in_pass 'gae'"
    if _AVAIL["cpu"]():
        assert choose_backend(cfg, "cpu", "grpo")[0] == "cpu"
        name, why = choose_backend(cfg, "cpu", "none")
        assert name == "reference" and "advantages_in_pass 'none'" in why


def _bad(b, sg):
    g = sg.take(np.arange(IDS.size))
    out_of_range = GroupAdvantages(g.rewards, g.group_index.clone().fill_(len(SIZES)), g.stats, "grpo", ADV_EPS)
    return {
        "both": (dict(advantages=torch.zeros(IDS.size), group=g), "either advantages or group"),
        "range": (dict(group=out_of_range), "outside the 7 groups"),
        "dtype": (dict(group=GroupAdvantages(g.rewards.float(), g.group_index, g.stats, "grpo", ADV_EPS)),
                  "group.rewards: expected a 1-D torch.float64"),
        "short": (dict(group=sg.take(np.arange(3))), "3 rewards and 3 group indices for 19 sequences"),
        "estimator": (dict(group=GroupAdvantages(g.rewards, g.group_index, g.stats, "none", ADV_EPS)),
                      "estimator 'none' is not computed in the pass"),
        "nan": (dict(group=GroupAdvantages(g.rewards.clone().fill_(float("nan")), g.group_index, g.stats, "grpo",
                                           ADV_EPS)), "group.rewards: non-finite"),
    }


@pytest.mark.parametrize("backend", [p for p in BACKENDS if p.values[0] in ("reference", "cpu")])
@pytest.mark.parametrize("case", ["both", "range", "dtype", "short", "estimator", "nan"])
def test_bad_in_pass_inputs_are_one_line_errors(backend, case):
    b, sg, _ = _step("grpo")
    kw, msg = _bad(b, sg)[case]
    with pytest.raises(ValueError, match=msg):
        policy_loss(b.logp, b.old_logp, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, backend=backend, **kw)
    with pytest.raises(ValueError, match="not a group statistic"):
        step_groups(_rewards("normal"), IDS, np.ones(IDS.size, bool), "none", ADV_EPS)


@pytest.mark.skipif(not _AVAIL["cpu"](), reason="arl._C not built")
def test_cpu_op_checks_the_group_rows_without_validation():
    """validate_inputs off: the C++ op itself refuses a row outside the table (never reads past it)."""
    b, sg, _ = _step("grpo")
    g = sg.take(np.arange(IDS.size))
    g = GroupAdvantages(g.rewards, g.group_index.clone().fill_(-1), g.stats, "grpo", ADV_EPS)
    with pytest.raises(ValueError, match="group_index -1 at 0 is outside the 7 groups"):
        policy_loss(b.logp, b.old_logp, group=g, cu_seqlens=b.cu_seqlens, chunk_ids=b.chunk_ids, backend="cpu",
                    config=LossConfig(validate_inputs=False))


def _trajs(n_groups=5, size=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for _ in range(size):
            L = int(rng.integers(6, 14))
            cid = np.full(L, -1)
            cid[2:L // 2], cid[L // 2 + 1:] = 0, 1
            r = 0.5 if g == 1 else float(rng.integers(0, 2)) * 0.9 + rng.normal() * 0.01  # group 1: zero variance
            out.append(Trajectory(tokens=rng.integers(0, 50, L), chunk_ids=cid, rollout_logp=-rng.random(L),
                                  reward=r, group_id=10 * g, status="filtered" if (g, len(out)) == (3, 13) else "ok"))
    return out


@pytest.mark.parametrize("est", ESTIMATORS)
def test_the_trainer_path_packs_the_step_table_into_every_micro_batch(est):
    """rank 0's step (advantages -> pack with groups split -> attach_in_pass) and the loss call site
    (objectives.pg_inputs): every micro-batch's loss in the pass equals the one with the step's advantages."""
    trajs = _trajs()
    algo, loss_cfg = AlgoConfig(advantage=est), LossConfig(advantages_in_pass=True, ratio_level="chunk", gamma=0.9)
    prep = step_advantages(trajs, loss_cfg, algo=algo)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=40, num_ranks=2, keep_groups=False), loss_cfg,
                       advantages=prep.advantages)
    assert packed.split_groups, "want a group split over micro-batches"
    attach_in_pass(packed, prep, algo)
    for mb in packed.all_micro_batches():
        if mb.is_empty:
            continue
        T = mb.num_tokens
        logp = torch.from_numpy(-np.random.default_rng(mb.index).random(T)).float()
        adv, kw = pg_inputs(mb, "cpu")
        assert adv is None and kw["group"].estimator == est
        got = policy_loss(logp, mb.rollout_logp, config=loss_cfg, backend="auto", **kw)
        kw.pop("group")
        want = policy_loss(logp, mb.rollout_logp, config=loss_cfg, backend="reference",
                           advantages=mb.advantages.float(), **kw)
        torch.testing.assert_close(got.loss, want.loss, **TOL)


def test_attach_refuses_advantages_that_are_not_the_group_statistic():
    trajs = _trajs()
    algo = AlgoConfig(advantage="grpo")
    prep = step_advantages(trajs, LossConfig(), algo=algo)
    prep.advantages = prep.advantages * 0.5  # e.g. an advantage weight
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=400), LossConfig(), advantages=prep.advantages)
    with pytest.raises(ValueError, match="not the group estimator of its rewards"):
        attach_in_pass(packed, prep, algo)


def _rl_step_worker(rank, world, port, result_dir):
    import os

    from arl.config import OptimConfig
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env
    from two_rank import tiny_qwen

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    res = {}
    for in_pass in (False, True):
        trajs, algo = _trajs(), AlgoConfig(advantage="grpo")
        loss_cfg = LossConfig(ratio_level="chunk", gamma=0.95, advantages_in_pass=in_pass)
        prep = step_advantages(trajs, loss_cfg, algo=algo)
        packed = pack_step(prep.trajectories, PackerConfig(token_budget=40, keep_groups=False), loss_cfg,
                           advantages=prep.advantages)
        if in_pass:
            attach_in_pass(packed, prep, algo)
        torch.manual_seed(0)
        tr = PolicyTrainer(tiny_qwen(), optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=0, total_steps=10)
        grads = {}
        for n, p in tr.module.named_parameters():
            p.register_hook(lambda g, n=n: grads.__setitem__(n, grads.get(n, 0) + g.detach().clone()) or g)
        res[in_pass] = {"metrics": tr.rl_step(packed.ranks[0], None, loss_cfg), "grads": grads}
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow  # one gloo rank and a tiny model through PolicyTrainer.rl_step
def test_the_trainer_step_with_in_pass_advantages_is_the_same_update(tmp_path):
    """rl_step over micro-batches that split groups: the same loss and gradients with the advantages
    computed in the pass as with them given (the head's gradient plan included)."""
    import torch.multiprocessing as mp

    from arl.procs import free_port

    mp.spawn(_rl_step_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    given, in_pass = res[False], res[True]
    assert in_pass["metrics"]["loss"] == pytest.approx(given["metrics"]["loss"], rel=1e-6)
    assert in_pass["metrics"]["head_grad_in_forward"] == given["metrics"]["head_grad_in_forward"]
    assert set(in_pass["grads"]) == set(given["grads"]) and given["grads"]
    for n, g in given["grads"].items():
        torch.testing.assert_close(in_pass["grads"][n], g, rtol=1e-6, atol=1e-9)

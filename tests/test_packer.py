"""Packer properties (hypothesis): hard budget, every token once, equal micro-batch counts, balance,
determinism, global normalizer, chunk ids valid for policy_loss, micro-batched loss == step loss."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arl import LossConfig, policy_loss
from arl.data import (PackerConfig, Trajectory, TrajectoryStatus, estimated_compute, fill_bins, karmarkar_karp,
                      pack_step)
from scalar_loss import scalar_group_advantages

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def make_traj(i, L, rng, group_size=4, status=TrajectoryStatus.OK, version=0):
    """A prompt, then alternating model turns (chunk 0, 1, ...) and observations (-1)."""
    cid = np.full(L, -1, dtype=np.int32)
    if L > 1:
        pos, k = int(rng.integers(0, max(1, L // 3))), 0
        while pos < L:
            turn = int(rng.integers(1, max(2, L // 4)))
            cid[pos:pos + turn] = k
            k += 1
            pos += turn + int(rng.integers(0, max(2, L // 5)))
    return Trajectory(tokens=rng.integers(0, 32000, L), chunk_ids=cid, rollout_logp=-rng.random(L),
                      reward=float(rng.integers(0, 2)) if rng.random() < 0.8 else float(rng.normal()),
                      group_id=i // group_size, policy_version=version, status=status,
                      metadata={"i": i})


def make_step(seed, n, max_len, group_size=4, masked=0.0, filtered=0.0, sigma=1.0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(max(1, max_len / 6)), sigma, n), 1, max_len).astype(int)
    out = []
    for i, L in enumerate(lengths):
        u = rng.random()
        status = TrajectoryStatus.MASKED if u < masked else (
            TrajectoryStatus.FILTERED if u < masked + filtered else TrajectoryStatus.OK)
        out.append(make_traj(i, int(L), rng, group_size, status, version=int(rng.integers(0, 3))))
    return out


step_args = st.fixed_dictionaries(dict(
    seed=st.integers(0, 10**6), n=st.integers(1, 48), max_len=st.integers(1, 300),
    group_size=st.integers(1, 8), masked=st.sampled_from([0.0, 0.2]), filtered=st.sampled_from([0.0, 0.1]),
))
pack_args = st.fixed_dictionaries(dict(
    ranks=st.integers(1, 5), slack=st.integers(0, 400), keep_groups=st.booleans(), seed=st.integers(0, 3),
    attn=st.sampled_from([0.0, 1e-3, 0.05]),
))


def marker_advantages(trajs):
    """Distinct per-trajectory values: where each one lands shows the packer's bookkeeping."""
    return np.arange(len(trajs), dtype=np.float64) / 7.0 - 1.0


def pack(trajs, p, loss=None, advantages=None):
    budget = max([len(t) for t in trajs] + [1]) + p["slack"]
    cfg = PackerConfig(token_budget=budget, num_ranks=p["ranks"], keep_groups=p["keep_groups"],
                       seed=p["seed"], attn_coef=p["attn"])
    return cfg, pack_step(trajs, cfg, loss, advantages=advantages)


def packed_trajs(trajs):
    return [i for i, t in enumerate(trajs) if t.status != TrajectoryStatus.FILTERED]


def step_advantages_of(trajs, estimator="grpo"):
    """The step's advantages [len(trajs)] as computed before packing (one group normalization over the
    whole step; a MASKED placeholder is a group of its own, a FILTERED trajectory gets 0), written
    independently of arl/algo/advantages.py (tests/scalar_loss.py)."""
    idx = packed_trajs(trajs)
    adv = np.zeros(len(trajs))
    if idx:
        rewards = torch.tensor([trajs[i].reward for i in idx], dtype=torch.float32).double().tolist()
        gids = [-(i + 1) if trajs[i].status == TrajectoryStatus.MASKED else trajs[i].group_id for i in idx]
        adv[idx] = scalar_group_advantages(rewards, gids, estimator, 1e-6)[0]
    return adv


def effective_chunk_ids(t):
    return np.full(len(t), -1) if t.status == TrajectoryStatus.MASKED else t.chunk_ids


@settings(max_examples=60, **SETTINGS)
@given(step_args, pack_args)
def test_structure(s, p):
    trajs = make_step(**s)
    given = marker_advantages(trajs)
    cfg, ps = pack(trajs, p, advantages=given)
    B = cfg.token_budget
    assert len(ps.ranks) == p["ranks"]
    counts = {len(r) for r in ps.ranks}
    assert len(counts) == 1 and counts.pop() >= 1  # the same number of micro-batches on every rank
    seen = {}
    for r, rank in enumerate(ps.ranks):
        for j, mb in enumerate(rank):
            assert (mb.rank, mb.index) == (r, j)
            assert mb.num_tokens <= B  # the hard budget
            T, N = mb.num_tokens, mb.num_seqs
            assert mb.token_ids.dtype == torch.int64 and mb.position_ids.dtype == torch.int64
            assert mb.cu_seqlens.dtype == torch.int32 and mb.chunk_ids.dtype == torch.int32
            assert mb.position_ids.shape == mb.chunk_ids.shape == mb.rollout_logp.shape == (T,)
            for x in (mb.rewards, mb.group_ids, mb.advantages, mb.traj_indices, mb.policy_versions):
                assert x.shape == (N,)
            cu = mb.cu_seqlens.tolist()
            assert cu[0] == 0 and cu[-1] == T
            # chunk ids: dense, non-decreasing, strictly increasing across sequences
            c = mb.chunk_ids[mb.chunk_ids >= 0]
            if c.numel():
                assert c[0] == 0 and bool(((c[1:] - c[:-1]) >= 0).all()) and bool(((c[1:] - c[:-1]) <= 1).all())
            for k, i in enumerate(mb.traj_indices.tolist()):
                a, b = cu[k], cu[k + 1]
                assert i not in seen
                seen[i] = (r, j)
                t = trajs[i]
                assert np.array_equal(mb.token_ids[a:b].numpy(), t.tokens)  # every token, in order
                assert mb.position_ids[a:b].tolist() == list(range(b - a))
                assert np.array_equal(mb.rollout_logp[a:b].numpy(), t.rollout_logp)
                local = effective_chunk_ids(t)
                glob = mb.chunk_ids[a:b].numpy()
                assert np.array_equal(glob < 0, local < 0)
                # same chunk structure: equal local ids <=> equal global ids
                tr = local >= 0
                assert np.array_equal(np.diff(local[tr]) > 0, np.diff(glob[tr]) > 0)
                assert mb.rewards[k].item() == pytest.approx(t.reward, rel=1e-6, abs=1e-6)
                assert mb.advantages.dtype == torch.float64 and mb.advantages[k].item() == given[i]
                gid = -(i + 1) if t.status == TrajectoryStatus.MASKED else t.group_id  # placeholders: own group
                assert (mb.group_ids[k].item(), mb.policy_versions[k].item()) == (gid, t.policy_version)
    # exactly the non-filtered trajectories, each once
    assert sorted(seen) == packed_trajs(trajs)
    assert ps.skipped == [i for i, t in enumerate(trajs) if t.status == TrajectoryStatus.FILTERED]
    assert ps.num_tokens == sum(len(trajs[i]) for i in seen) == sum(ps.rank_tokens)
    # groups: kept whole when asked and they fit; flags agree with where members landed
    places = {}
    for i, rj in seen.items():
        if trajs[i].status != TrajectoryStatus.MASKED:  # placeholders are groups of their own
            places.setdefault(trajs[i].group_id, set()).add(rj)
    assert ps.split_groups == sorted(g for g, pl in places.items() if len(pl) > 1)
    if p["keep_groups"]:
        for g, pl in places.items():
            if sum(len(trajs[i]) for i in seen if trajs[i].group_id == g and trajs[i].status != TrajectoryStatus.MASKED) <= B:
                assert len(pl) == 1
    for mb in ps.all_micro_batches():
        assert mb.complete_groups == (not set(mb.group_ids.tolist()) & set(ps.split_groups))
    # empty micro-batches only on a rank with fewer units (kept groups / trajectories) than micro-batches
    for rank in ps.ranks:
        if any(mb.is_empty for mb in rank):
            ids = [i for mb in rank for i in mb.traj_indices.tolist()]
            if p["keep_groups"]:
                tokens = {}
                for i in seen:
                    tokens[trajs[i].group_id] = tokens.get(trajs[i].group_id, 0) + len(trajs[i])
                units = {trajs[i].group_id if tokens[trajs[i].group_id] <= B else ("t", i) for i in ids}
            else:
                units = set(ids)
            assert len(units) < len(rank)


@settings(max_examples=30, **SETTINGS)
@given(step_args, pack_args)
def test_deterministic_for_a_seed(s, p):
    trajs = make_step(**s)
    _, a = pack(trajs, p)
    _, b = pack(trajs, p)
    for x, y in zip(a.all_micro_batches(), b.all_micro_batches()):
        for k, v in x.__dict__.items():
            w = y.__dict__[k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, k


def whole_step_counts(trajs, cfg):
    n = np.array([int((effective_chunk_ids(trajs[i]) >= 0).sum()) for i in packed_trajs(trajs)])
    S = int((n > 0).sum())
    D = {"token-mean": n.sum(), "seq-mean-token-mean": S, "seq-mean-token-sum": S,
         "seq-mean-token-sum-norm": S * (cfg.agg_constant or (n.max() if n.size else 0))}[cfg.loss_agg]
    return float(D) if D > 0 else 1.0


@settings(max_examples=40, **SETTINGS)
@given(step_args, pack_args, st.sampled_from(AGGS), st.sampled_from([None, 100.0]))
def test_normalizer_is_the_whole_step_count(s, p, agg, const):
    trajs = make_step(**s)
    loss = LossConfig(loss_agg=agg, agg_constant=const)
    _, ps = pack(trajs, p, loss)
    expect = whole_step_counts(trajs, loss)
    assert ps.normalizer == expect and ps.loss_agg == agg
    assert all(mb.normalizer == expect for mb in ps.all_micro_batches())


def whole_step(trajs, idx, logp_of, adv):
    """The step as one packed batch, in trajectory order (chunk ids made increasing by hand), with the
    step's advantages ``adv`` [len(trajs)]."""
    cid, off = [], 0
    for i in idx:
        c = effective_chunk_ids(trajs[i]).astype(np.int64)
        c = np.where(c >= 0, c + off, -1)
        off = (c.max() + 1) if (c >= 0).any() else off
        cid.append(c)
    lengths = [len(trajs[i]) for i in idx]
    cu = torch.zeros(len(idx) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(np.cumsum(lengths), dtype=torch.int32)
    return dict(
        logp=torch.cat([logp_of[i] for i in idx]),
        advantages=torch.from_numpy(adv[idx]), cu_seqlens=cu, chunk_ids=torch.from_numpy(np.concatenate(cid).astype(np.int32)),
        rollout_logp=torch.cat([torch.from_numpy(trajs[i].rollout_logp).double() for i in idx]),
    )


LOSS_CONFIGS = [dict(ratio_level=lv, loss_agg=agg) for lv, agg in itertools.product(("token", "chunk", "sequence"), AGGS)]
LOSS_CONFIGS += [dict(ratio_level="chunk", gamma=0.95, mismatch_level="chunk", mismatch_high=5.0, surrogate="topr"),
                 dict(estimator="dr_grpo", loss_agg="seq-mean-token-sum-norm", agg_constant=64.0)]


@pytest.mark.parametrize("lc", LOSS_CONFIGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@settings(max_examples=5, **SETTINGS)
@given(s=step_args, p=pack_args)
def test_micro_batches_reproduce_step_loss_and_grad(lc, s, p):
    s = {**s, "n": max(s["n"], 2), "max_len": min(s["max_len"], 120)}
    trajs = make_step(**s)
    lc = dict(lc)
    adv = step_advantages_of(trajs, lc.pop("estimator", "grpo"))
    loss = LossConfig(**lc)
    p = {**p, "keep_groups": True, "slack": p["slack"] + 8 * s["max_len"]}  # every group fits: none split
    _, ps = pack(trajs, p, loss, advantages=adv)
    assert ps.split_groups == []
    idx = packed_trajs(trajs)
    if not idx:
        return
    gen = torch.Generator().manual_seed(s["seed"])
    old = {i: -torch.rand(len(trajs[i]), generator=gen, dtype=torch.float64) * 2 for i in idx}
    noise = {i: 0.3 * torch.randn(len(trajs[i]), generator=gen, dtype=torch.float64) for i in idx}
    leaf = {i: (old[i] + noise[i]).requires_grad_(True) for i in idx}
    w = whole_step(trajs, idx, leaf, adv)
    if not bool((w["chunk_ids"] >= 0).any()):
        return
    total = policy_loss(w.pop("logp"), torch.cat([old[i] for i in idx]), config=loss, **w).loss
    g_step = torch.autograd.grad(total, [leaf[i] for i in idx], allow_unused=True)
    acc = torch.zeros((), dtype=torch.float64)
    for mb in ps.all_micro_batches():
        if mb.is_empty or not bool(mb.loss_mask.any()):
            continue
        ids = mb.traj_indices.tolist()
        kw = mb.loss_kwargs()
        kw["rollout_logp"] = kw["rollout_logp"].double()
        # validation is on: a ValueError here means the packed chunk ids are not what policy_loss expects
        out = policy_loss(torch.cat([leaf[i] for i in ids]), torch.cat([old[i] for i in ids]), config=loss, **kw)
        acc = acc + out.loss
    g_mb = torch.autograd.grad(acc, [leaf[i] for i in idx], allow_unused=True)
    torch.testing.assert_close(acc, total.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(g_mb, g_step):
        if a is None or b is None:
            assert (a is None or not a.abs().max() > 0) and (b is None or not b.abs().max() > 0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_advantages_are_carried_not_computed():
    """Without given advantages the micro-batches carry none (policy_loss then refuses them: the op
    never normalizes groups); a wrong shape or a non-finite value is refused with one line."""
    trajs = make_step(seed=1, n=8, max_len=40)
    _, ps = pack(trajs, dict(ranks=2, slack=0, keep_groups=True, seed=0, attn=0.0))
    assert all(mb.advantages is None and mb.loss_kwargs()["advantages"] is None for mb in ps.all_micro_batches())
    cfg = PackerConfig(token_budget=200)
    with pytest.raises(ValueError, match="advantages: shape"):
        pack_step(trajs, cfg, advantages=np.zeros(3))
    bad = np.zeros(len(trajs))
    bad[2] = np.nan
    with pytest.raises(ValueError, match="advantages: non-finite value nan at index 2"):
        pack_step(trajs, cfg, advantages=bad)


# ---- balance -------------------------------------------------------------------------------

def brute_force_opt(w, k):
    w = np.asarray(w, dtype=np.float64)
    best = np.inf
    for assign in itertools.product(range(k), repeat=len(w) - 1):  # item 0 on set 0 (symmetry)
        loads = np.bincount(np.array((0,) + assign), weights=w, minlength=k)
        best = min(best, loads.max())
    return best


@settings(max_examples=60, **SETTINGS)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=8), st.integers(2, 3))
def test_karmarkar_karp_within_worst_case_bound(w, k):
    parts = karmarkar_karp(w, k)
    assert sorted(i for p in parts for i in p) == list(range(len(w)))
    got = max(sum(w[i] for i in p) for p in parts)
    assert got <= (4 / 3) * brute_force_opt(w, k) + 1e-9  # LDM worst-case ratio is below 4/3


@settings(max_examples=15, **SETTINGS)
@given(st.integers(0, 10**6), st.integers(2, 8), st.sampled_from([0.0, 1 / 49152, 1e-3]), st.booleans())
def test_balance_close_to_optimal_on_lognormal(seed, ranks, attn, keep_groups):
    rng = np.random.default_rng(seed)
    n = 64 * ranks
    lengths = np.clip(rng.lognormal(np.log(1024), 1.0, n), 64, 16384).astype(int)
    trajs = [Trajectory(tokens=np.zeros(L), chunk_ids=np.zeros(L), rollout_logp=np.zeros(L), group_id=i // 8)
             for i, L in enumerate(lengths)]
    ps = pack_step(trajs, PackerConfig(token_budget=65536, num_ranks=ranks, attn_coef=attn, keep_groups=keep_groups,
                                       seed=seed))
    cost = estimated_compute(lengths, attn)
    assert sum(ps.rank_compute) == pytest.approx(cost.sum())
    lower = max(cost.sum() / ranks, cost.max())  # no split can beat this
    assert max(ps.rank_compute) / lower <= 1.01
    assert ps.load_max_over_mean <= 1.01
    # length buckets: the longest trajectory of a rank is in its first micro-batch
    if not keep_groups:
        for rank in ps.ranks:
            longest = max(int(np.diff(mb.cu_seqlens.numpy()).max(initial=0)) for mb in rank)
            assert int(np.diff(rank[0].cu_seqlens.numpy()).max()) == longest


def test_fill_bins_exact_count_and_capacity():
    sizes = [9, 7, 5, 3, 3, 1]
    bins = fill_bins(sizes, range(6), 3, 10)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert fill_bins(sizes, range(6), 2, 10) is None
    assert fill_bins([4], [0], 3, 10) == [[0], [], []]  # fewer items than bins


# ---- policies and errors -------------------------------------------------------------------

def test_overlong_error_names_trajectory_and_lengths():
    rng = np.random.default_rng(0)
    trajs = [make_traj(0, 10, rng), make_traj(1, 40, rng)]
    with pytest.raises(ValueError, match=r"trajectories\[1\]: 40 tokens exceed token_budget=32") as e:
        pack_step(trajs, PackerConfig(token_budget=32))
    assert "\n" not in str(e.value)


def test_overlong_truncate_keeps_the_head():
    rng = np.random.default_rng(1)
    trajs = [make_traj(0, 10, rng), make_traj(1, 40, rng)]
    ps = pack_step(trajs, PackerConfig(token_budget=32, overlong="truncate", keep_groups=False))
    assert ps.truncated == [1] and ps.num_tokens == 42
    mb = next(mb for mb in ps.all_micro_batches() if 1 in mb.traj_indices.tolist())
    k = mb.traj_indices.tolist().index(1)
    a, b = mb.cu_seqlens[k].item(), mb.cu_seqlens[k + 1].item()
    assert b - a == 32 and np.array_equal(mb.token_ids[a:b].numpy(), trajs[1].tokens[:32])
    trained = int((trajs[0].chunk_ids >= 0).sum() + (trajs[1].chunk_ids[:32] >= 0).sum())
    assert ps.normalizer == trained


def test_masked_placeholders_are_packed_but_not_counted():
    rng = np.random.default_rng(2)
    ok = make_traj(0, 30, rng)
    ph = make_traj(1, 30, rng, status=TrajectoryStatus.MASKED)
    assert ph.num_trained_tokens > 0  # even with chunk ids, a placeholder is never trained
    ps = pack_step([ok, ph], PackerConfig(token_budget=100), LossConfig(loss_agg="token-mean"))
    assert ps.normalizer == ok.num_trained_tokens
    assert sorted(i for mb in ps.all_micro_batches() for i in mb.traj_indices.tolist()) == [0, 1]
    ps = pack_step([ph], PackerConfig(token_budget=100), LossConfig(loss_agg="seq-mean-token-sum"))
    assert ps.normalizer == 1.0  # nothing to train: a harmless positive denominator


def test_more_ranks_than_trajectories_gives_empty_micro_batches():
    rng = np.random.default_rng(3)
    ps = pack_step([make_traj(i, 10, rng, group_size=1) for i in range(2)], PackerConfig(token_budget=64, num_ranks=4))
    assert [len(r) for r in ps.ranks] == [1, 1, 1, 1]
    assert sum(mb.is_empty for mb in ps.all_micro_batches()) == 2
    empty = next(mb for mb in ps.all_micro_batches() if mb.is_empty)
    assert empty.num_tokens == 0 and empty.cu_seqlens.tolist() == [0]
    ps = pack_step([], PackerConfig(token_budget=64, num_ranks=2))
    assert [len(r) for r in ps.ranks] == [1, 1] and ps.num_tokens == 0


@pytest.mark.parametrize("kw, match", [
    (dict(token_budget=0), r"token_budget=0"),
    (dict(token_budget=8, num_ranks=0), r"num_ranks=0"),
    (dict(token_budget=8, attn_coef=-1.0), r"attn_coef=-1.0"),
    (dict(token_budget=8, overlong="drop"), r"overlong"),
    (dict(token_budget=8, budget=3), r"budget: unknown key"),
])
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        PackerConfig(**kw)
    assert "\n" not in str(e.value)


def test_rejects_non_trajectories():
    with pytest.raises(ValueError, match=r"trajectories\[0\]: expected a Trajectory, got dict"):
        pack_step([{"tokens": [1]}], PackerConfig(token_budget=8))


def test_micro_batch_to_and_loss_kwargs():
    rng = np.random.default_rng(4)
    ps = pack_step([make_traj(i, 20, rng) for i in range(4)], PackerConfig(token_budget=100))
    mb = ps.ranks[0][0].to("cpu")
    assert set(mb.loss_kwargs()) == {"advantages", "cu_seqlens", "chunk_ids", "rollout_logp", "normalizer"}


def test_many_micro_batches_reproduce_step_loss():
    """A fixed step that needs several micro-batches per rank (the property test above often fits
    a rank in one): the summed micro-batch losses and gradients still equal the step's."""
    rng = np.random.default_rng(5)
    trajs = [make_traj(i, int(rng.integers(20, 60)), rng, group_size=4) for i in range(48)]
    loss = LossConfig(ratio_level="chunk", loss_agg="seq-mean-token-mean", gamma=0.9)
    adv = step_advantages_of(trajs)
    ps = pack_step(trajs, PackerConfig(token_budget=300, num_ranks=2), loss, advantages=adv)
    assert ps.micro_batches_per_rank >= 3 and ps.split_groups == []
    idx = list(range(48))
    old = {i: -torch.rand(len(trajs[i]), dtype=torch.float64) for i in idx}
    leaf = {i: (old[i] + 0.2 * torch.randn(len(trajs[i]), dtype=torch.float64)).requires_grad_(True) for i in idx}
    w = whole_step(trajs, idx, leaf, adv)
    total = policy_loss(w.pop("logp"), torch.cat([old[i] for i in idx]), config=loss, **w).loss
    acc = 0
    for mb in ps.all_micro_batches():
        ids = mb.traj_indices.tolist()
        kw = {**mb.loss_kwargs(), "rollout_logp": mb.rollout_logp.double()}
        acc = acc + policy_loss(torch.cat([leaf[i] for i in ids]), torch.cat([old[i] for i in ids]),
                                config=loss, **kw).loss
    g1 = torch.autograd.grad(total, [leaf[i] for i in idx])
    g2 = torch.autograd.grad(acc, [leaf[i] for i in idx])
    torch.testing.assert_close(acc, total, rtol=1e-10, atol=1e-12)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("lc", [dict(ratio_level="chunk", gamma=0.9), dict(estimator="dr_grpo", loss_agg="seq-mean-token-sum")],
                         ids=["chunk_group_std", "group_mean"])
@settings(max_examples=5, **SETTINGS)
@given(s=step_args, p=pack_args)
def test_split_groups_with_step_advantages_reproduce_step_loss(lc, s, p):
    """Groups spread over micro-batches and ranks: with ``advantages=mb.advantages`` the summed
    micro-batch losses and gradients are still the step's."""
    s = {**s, "n": max(s["n"], 2), "max_len": min(s["max_len"], 120), "filtered": 0.0}
    trajs = make_step(**s)
    lc = dict(lc)
    est = lc.pop("estimator", "grpo")
    loss = LossConfig(**lc)
    ps_cfg, _ = pack(trajs, {**p, "keep_groups": False, "slack": p["slack"] % 40}, loss)
    idx = packed_trajs(trajs)
    gen = torch.Generator().manual_seed(s["seed"])
    old = {i: -torch.rand(len(trajs[i]), generator=gen, dtype=torch.float64) * 2 for i in idx}
    leaf = {i: (old[i] + 0.3 * torch.randn(len(trajs[i]), generator=gen, dtype=torch.float64)).requires_grad_(True)
            for i in idx}
    # the step's advantages, normalized over the whole step (as arl/algo/step.py does
    # before packing), handed to the packer; computed independently of arl/algo/advantages.py
    step_adv = step_advantages_of(trajs, est)
    w = whole_step(trajs, idx, leaf, step_adv)
    if not bool((w["chunk_ids"] >= 0).any()):
        return
    ps = pack_step(trajs, ps_cfg, loss, advantages=step_adv)
    total = policy_loss(w.pop("logp"), torch.cat([old[i] for i in idx]), config=loss, **w).loss
    acc = torch.zeros((), dtype=torch.float64)
    for mb in ps.all_micro_batches():
        if mb.is_empty or not bool(mb.loss_mask.any()):
            continue
        ids = mb.traj_indices.tolist()
        kw = {**mb.loss_kwargs(), "rollout_logp": mb.rollout_logp.double()}
        acc = acc + policy_loss(torch.cat([leaf[i] for i in ids]), torch.cat([old[i] for i in ids]), config=loss,
                                **kw).loss
    g1 = torch.autograd.grad(total, [leaf[i] for i in idx], allow_unused=True)
    g2 = torch.autograd.grad(acc, [leaf[i] for i in idx], allow_unused=True)
    torch.testing.assert_close(acc, total.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(g1, g2):
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        else:
            assert all(x is None or not x.abs().max() > 0 for x in (a, b))


def test_masked_placeholder_does_not_move_its_groups_advantages():
    """The step's advantages: a placeholder is a group of its own (it keeps its group id apart in the
    micro-batch too), so the real members' loss and gradient are those without it, and it trains nothing."""
    rng = np.random.default_rng(5)
    group = [make_traj(i, 20, rng, group_size=3) for i in range(3)]  # one group of 3
    for t, r in zip(group, (1.0, 0.0, 0.0)):
        t.reward = r
    ph = make_traj(2, 20, rng, group_size=3, status=TrajectoryStatus.MASKED)
    ph.reward = 0.0

    def grads(trajs):
        adv = step_advantages_of(trajs)
        (mb,) = pack_step(trajs, PackerConfig(token_budget=200), LossConfig(), advantages=adv).all_micro_batches()
        logp = (mb.rollout_logp.double() - 0.1).requires_grad_(True)
        kw = {**mb.loss_kwargs(), "rollout_logp": mb.rollout_logp.double()}
        policy_loss(logp, mb.rollout_logp.double(), config=LossConfig(), **kw).loss.backward()
        order = mb.traj_indices.tolist()
        cu = mb.cu_seqlens.tolist()
        return mb, {i: logp.grad[cu[k]:cu[k + 1]] for k, i in enumerate(order)}

    mb, g_ph = grads(group[:2] + [ph])
    assert sorted(mb.group_ids.tolist()) == sorted([group[0].group_id, group[1].group_id, -3])
    _, g0 = grads(group[:2])
    for i in (0, 1):
        assert g0[i].abs().max() > 0
        torch.testing.assert_close(g_ph[i], g0[i], rtol=0, atol=0)
    assert not g_ph[2].abs().max() > 0  # the placeholder trains nothing

"""Tests written against planted bugs (issue #34 item 6): each one fails when the bug named in its
docstring is put into the code, where the older tests passed.  Every expectation here is worked out
by hand (numbers in the comments), never from the function under test."""
import json

import numpy as np
import pytest
import torch

from arl.algo.advantages import group_advantages
from arl.config.stabilizers import StallConfig, TurnCreditConfig
from arl.data import PackerConfig, Trajectory, estimated_compute, karmarkar_karp, pack_step
from arl.env.tool_parsers import call_name_and_arguments, get_parser
from arl.ops.policy_loss import LossConfig
from arl.algo.ipa import ipa_mixed_loss
from arl.stabilizers import StabilizerConfig, Stabilizers
from arl.algo.gae import critic_chunk_inputs, critic_points, gae
from arl.stabilizers.stall import StallGuard
from arl.algo.turn_credit import chunk_process_rewards, turn_advantages


def _traj(turn_lens, reward=0.0, group=0, prompt=2, obs=1, **meta):
    """prompt (-1) | turn 0 | obs (-1) | turn 1 | ...; every token id 1."""
    chunks = [-1] * prompt
    for k, n in enumerate(turn_lens):
        if k:
            chunks += [-1] * obs
        chunks += [k] * n
    L = len(chunks)
    return Trajectory(tokens=np.ones(L, np.int64), chunk_ids=np.array(chunks, np.int32),
                      rollout_logp=np.zeros(L, np.float32), reward=reward, group_id=group, metadata=dict(meta))


# ------------------------------------------------------------------------- packer: compute, partition
def test_estimated_compute_is_linear_plus_quadratic_by_hand():
    """Plant: ``estimated_compute`` linear in the length (the balance test derives its expectation
    from ``estimated_compute`` itself).  compute(L) = L + attn_coef * L**2."""
    np.testing.assert_allclose(estimated_compute([10, 100, 1000], 0.01), [11.0, 200.0, 11000.0], rtol=1e-12)
    np.testing.assert_allclose(estimated_compute([7, 3], 0.0), [7.0, 3.0], rtol=1e-12)
    # through the packer: one rank, lengths 100 and 300, attn_coef 1/100: 100 + 100 + 300 + 900
    ps = pack_step([_traj([98]), _traj([298], group=1)], PackerConfig(token_budget=1024, attn_coef=0.01))
    assert ps.rank_compute == [pytest.approx(1400.0, rel=1e-12)]
    # the quadratic term decides the split: one 400-token sequence (400 + 1600 = 2000) against four of
    # 100 (4 * 200 = 800 in all) -- by tokens the ranks hold 400 and 400, by compute 2000 and 800
    trajs = [_traj([398], group=0)] + [_traj([98], group=1 + i) for i in range(4)]
    ps = pack_step(trajs, PackerConfig(token_budget=1024, num_ranks=2, attn_coef=0.01))
    assert sorted(ps.rank_compute) == [pytest.approx(800.0), pytest.approx(2000.0)]


def test_karmarkar_karp_one_rank_holds_every_item():
    """Plant: a partition bug at world size 1 (it showed only as an IndexError elsewhere)."""
    parts = karmarkar_karp([5.0, 1.0, 3.0, 2.0], 1)
    assert len(parts) == 1 and sorted(parts[0]) == [0, 1, 2, 3]
    assert karmarkar_karp([], 1) == [[]]
    assert karmarkar_karp([4.0], 1) == [[0]]
    # the packer at one rank: every trajectory on rank 0, all of the compute there
    trajs = [_traj([3 + i], group=i) for i in range(5)]
    ps = pack_step(trajs, PackerConfig(token_budget=64, num_ranks=1, attn_coef=0.0))
    assert len(ps.ranks) == 1
    assert sorted(i for mb in ps.ranks[0] for i in mb.traj_indices.tolist()) == [0, 1, 2, 3, 4]
    assert ps.rank_compute == [pytest.approx(sum(len(t) for t in trajs))]


def test_karmarkar_karp_two_ranks_content_by_hand():
    """Largest differencing on [8, 7, 6, 5, 4] into two sets, traced by hand: 8|7 (spread 1), 6|5
    (1), 4 with 8|7 -> {4, 7}|{8} (3), then {4,7}+5 | {8}+6: sums 16 and 14, heaviest first."""
    parts = karmarkar_karp([8.0, 7.0, 6.0, 5.0, 4.0], 2)
    assert [sorted(p) for p in parts] == [[1, 3, 4], [0, 2]]
    # [3, 3, 2, 2]: 3|3 and 2|2 (spread 0 each), merged heaviest with lightest: {3, 2} | {3, 2}
    parts = karmarkar_karp([3.0, 3.0, 2.0, 2.0], 2)
    assert sorted(map(sorted, parts)) == [[0, 3], [1, 2]]
    # more sets than items: the extra sets are empty, each item once
    parts = karmarkar_karp([2.0, 1.0], 3)
    assert sorted(map(sorted, parts)) == [[], [0], [1]]


# ----------------------------------------------------------------------------------- advantages
def test_grpo_advantages_use_eps_by_hand():
    """Plant: ``adv_eps`` dropped (caught before only by a 1.8e-9 difference).  With eps 0.5:
    group A rewards [1, 0, 0, 0]: mean 0.25, Bessel std sqrt(0.75 / 3) = 0.5, so (R - 0.25) / 1.0;
    group B [2, 4]: mean 3, std sqrt(2) -> -+1 / (sqrt(2) + 0.5); group C [3, 3]: equal, 0."""
    rewards = [1.0, 2.0, 0.0, 0.0, 3.0, 4.0, 0.0, 3.0]
    groups = [10, 20, 10, 10, 30, 20, 10, 30]
    adv, zero_var, G = group_advantages(rewards, groups, "grpo", 0.5)
    b = 1.0 / (np.sqrt(2.0) + 0.5)
    np.testing.assert_allclose(adv, [0.75, -b, -0.25, -0.25, 0.0, b, -0.25, 0.0], rtol=1e-12, atol=1e-15)
    assert (zero_var, G) == (1, 3)
    adv, _, _ = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]), "grpo", 0.0)
    np.testing.assert_allclose(adv, [1.5, -0.5, -0.5, -0.5], rtol=1e-12)  # eps 0: d / 0.5


# ---------------------------------------------------------------------------------- turn credit
def test_turn_credit_pays_no_process_reward_for_a_failed_tool_call():
    """Plant: the process reward paid for a chunk whose tool call errored (even if the env called
    the turn a new state)."""
    t = _traj([2, 2, 2, 2], turn_info=[{"new_state": True, "tool_error": False},
                                        {"new_state": True, "tool_error": True},
                                        {"new_state": False, "tool_error": False},
                                        {"new_state": True}])
    np.testing.assert_array_equal(chunk_process_rewards(t, 4, 0.25), [0.25, 0.0, 0.0, 0.25])
    # the critic's chunk rewards take the same rule (and the outcome on the last chunk)
    _, rew, _ = critic_chunk_inputs([t], np.array([1.0]), LossConfig(ratio_level="chunk", loss_agg="token-mean"),
                                    TurnCreditConfig(enabled=True, weight=1.0, process_reward=0.25))
    np.testing.assert_allclose(rew[0], [0.25, 0.0, 0.0, 1.25])
    # and turn credit's returns: two samples of one task reach a new state on turn 0, one of them with
    # a failed call; only the clean one is paid, so their shared first anchor compares pr with 0
    clean = _traj([2, 2], turn_info=[{"new_state": True, "tool_error": False}, {"new_state": False}])
    failed = _traj([2, 2], turn_info=[{"new_state": True, "tool_error": True}, {"new_state": False}])
    adv, _ = turn_advantages([clean, failed], np.zeros(2), LossConfig(ratio_level="chunk", gamma=1.0,
                                                                      loss_agg="token-mean"),
                             weight=1.0, process_reward=0.25)
    assert adv[0][0] > 0.5 and adv[1][0] == pytest.approx(-adv[0][0])  # 0.125 / (0.25 / sqrt(2) + eps)
    assert adv[0][1] == adv[1][1] == 0.0  # turn 1: equal returns (0) in the shared context


# ------------------------------------------------------------------------------------------ IPA
def test_ipa_imitation_is_normalized_over_the_whole_step_across_micro_batches():
    """Plant: the imitation NLL divided per micro-batch instead of by the step's ``il_normalizer``
    (every other IPA test has one micro-batch, where the two agree).  Two groups that cannot share a
    micro-batch: group 0 imitates 4 + 3 = 7 prefix tokens, group 1 imitates 6; the step's
    normalizer is 13, so every imitated token's gradient is -lambda_il / 13 in both micro-batches."""
    trajs = [_traj([4, 3, 2], 1.0, group=0, ipa_prefix_chunks=2, ipa_imitate=True),  # 2+4+1+3+1+2 = 13 tokens
             _traj([4, 3, 5], 0.0, group=0, ipa_prefix_chunks=2, ipa_imitate=False),  # 16
             _traj([6, 5], 1.0, group=1, ipa_prefix_chunks=1, ipa_imitate=True),  # 2+6+1+5 = 14
             _traj([6, 2], 0.0, group=1, ipa_prefix_chunks=1, ipa_imitate=False)]  # 11
    imitated = {0: [0, 1], 2: [0]}  # trajectory -> its imitated chunks
    loss_cfg = LossConfig(ratio_level="chunk", loss_agg="token-mean")
    lam_il = 0.5
    stab = Stabilizers(StabilizerConfig(ipa=dict(enabled=True, lambda_il=lam_il, lambda_rl=1.0)), loss_cfg)
    prep = stab.prepare(trajs, loss_cfg)
    assert len(prep.trajectories) == 4
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=30), loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep, loss_cfg)
    mbs = packed.all_micro_batches()
    assert len(mbs) == 2 and sorted(mb.num_tokens for mb in mbs) == [25, 29]  # two sizes, one group each

    il_total, il_by_hand, n_il = 0.0, 0.0, 0
    for mb in mbs:
        r = mb.ipa
        assert r["il_normalizer"] == 13.0
        T = mb.num_tokens
        logp = (-0.1 - torch.arange(T, dtype=torch.float64) / T).requires_grad_()
        loss, m = ipa_mixed_loss(logp, logp.detach(), mb=mb, il_mask=r["il_mask"], rl_chunk_ids=r["rl_chunk_ids"],
                                 loss_cfg=loss_cfg, il_normalizer=r["il_normalizer"],
                                 rl_normalizer=r["rl_normalizer"], lambda_il=r["lambda_il"], lambda_rl=0.0)
        loss.backward()
        il_total += float(loss.detach())
        # the imitated tokens, from the trajectories' layout (not from il_mask)
        want = torch.zeros(T, dtype=torch.bool)
        cu = mb.cu_seqlens.tolist()
        for j, i in enumerate(mb.traj_indices.tolist()):
            c = torch.from_numpy(prep.trajectories[i].chunk_ids.astype(np.int64))
            for k in imitated.get(i, ()):
                want[cu[j]:cu[j + 1]] |= c == k
        n_il += int(want.sum())
        il_by_hand += -float(logp.detach()[want].sum())
        np.testing.assert_allclose(logp.grad[want].numpy(), np.full(int(want.sum()), -lam_il / 13.0), rtol=1e-12)
        assert float(logp.grad[~want].abs().max()) == 0.0
    assert n_il == 13
    assert il_total == pytest.approx(lam_il * il_by_hand / 13.0, rel=1e-12)


# ---------------------------------------------------------------------------------- critic / GAE
def test_gae_keeps_the_outcome_of_a_truncated_tail_on_the_last_packed_chunk():
    """Plant: the critic losing the reward of chunks cut off by ``overlong="truncate"``.  Trajectory 0
    has turns of 4, 4, 4 tokens after a 2-token prompt (2+4+1+4+1+4 = 16 tokens); a budget of 12 keeps
    chunks 0 and 1 only, so its outcome 1.0 must land on chunk 1."""
    trajs = [_traj([4, 4, 4], 1.0, group=0), _traj([3], 0.5, group=1)]
    loss_cfg = LossConfig(ratio_level="chunk", gamma=1.0, loss_agg="token-mean")
    _, rew, _ = critic_chunk_inputs(trajs, np.array([1.0, 0.5]), loss_cfg, TurnCreditConfig())
    np.testing.assert_array_equal(rew[0], [0.0, 0.0, 1.0])
    np.testing.assert_array_equal(rew[1], [0.5])
    ps = pack_step(trajs, PackerConfig(token_budget=12, overlong="truncate", keep_groups=False), loss_cfg)
    assert ps.truncated == [0]
    seen = {}
    for mb in ps.all_micro_batches():
        if mb.is_empty:
            continue
        c = critic_points(mb, trajs, rew)
        for j, i in enumerate(mb.traj_indices.tolist()):
            seen[i] = c["rewards"][c["seq"] == j].tolist()
        # zero values, gamma = lambda = 1: every packed chunk's advantage is the return after it
        a, ret = gae(torch.zeros(c["pos"].numel(), dtype=torch.float64), c["rewards"], c["seq"], 1.0, 1.0)
        for j, i in enumerate(mb.traj_indices.tolist()):
            assert a[c["seq"] == j].tolist() == [trajs[i].reward] * int((c["seq"] == j).sum())
    assert seen == {0: [0.0, 1.0], 1: [0.5]}


# ------------------------------------------------------------------------------------ tool parser
def test_hermes_rejects_an_empty_tool_name():
    """Plant: the Hermes parser accepting a call whose ``name`` is an empty string."""
    p = get_parser("hermes")
    r = p.parse("<tool_call>\n" + json.dumps({"name": "", "arguments": {"key": "k1"}}) + "\n</tool_call>")
    assert len(r.calls) == 1 and not r.calls[0].ok
    assert r.calls[0].error == 'error: tool name must be a non-empty string, got ""'
    r = p.parse('<tool_call>{"name": "lookup", "arguments": {}}</tool_call><tool_call>{"name": "", "arguments": {}}'
                '</tool_call>')
    assert [c.ok for c in r.calls] == [True, False]
    with pytest.raises(ValueError, match="'name' must be a non-empty string, got ''"):
        call_name_and_arguments({"name": "", "arguments": {}})
    with pytest.raises(ValueError, match="non-empty string"):
        p.format_calls("", [{"name": "", "arguments": {}}])


# ------------------------------------------------------------------------------------ stall guard
def _no_signal(zero_var_frac):
    return {"train/skipped_no_signal": 1.0, "success/train": 0.0, "adv/zero_var_group_frac": zero_var_frac}


@pytest.mark.parametrize("fracs, cause", [
    ((1.0, 1.0, 1.0), "every group's rewards equal"),
    ((0.5, 0.5, 0.5), "no trajectory had an advantage"),
    ((0.0, 1.0, 1.0), "no trajectory had an advantage"),  # one step of the streak had unequal groups
    ((1.0, 1.0, 0.75), "no trajectory had an advantage"),
])
def test_stall_guard_names_the_cause_of_the_streak(fracs, cause):
    """Plant: the stall guard naming the wrong cause ("every group's rewards equal" when some group
    had unequal rewards and still no trajectory had an advantage)."""
    g = StallGuard(StallConfig(patience=3, action="stop", after_success=None))
    for f in fracs[:-1]:
        assert g.observe(_no_signal(f)).ok
    d = g.observe(_no_signal(fracs[-1]))
    assert d.action == "stop"
    assert d.reason == f"no learning signal for 3 steps ({cause}; success/train 0.00): the policy collapsed"


def test_stall_guard_cause_starts_over_with_each_streak_and_survives_a_checkpoint():
    g = StallGuard(StallConfig(patience=2, action="stop", after_success=None))
    g.observe(_no_signal(0.5))
    g.observe({"train/skipped_no_signal": 0.0})  # a step with signal ends the streak
    g.observe(_no_signal(1.0))
    assert "(every group's rewards equal;" in g.observe(_no_signal(1.0)).reason
    g = StallGuard(StallConfig(patience=2, action="stop", after_success=None))
    g.observe(_no_signal(0.5))
    back = StallGuard(StallConfig(patience=2, action="stop", after_success=None))
    back.load_state_dict(g.state_dict())
    assert "(no trajectory had an advantage;" in back.observe(_no_signal(1.0)).reason

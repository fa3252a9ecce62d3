"""The critic's math and plumbing in one process: GAE against a hand computation (several
trajectories, lambda 0 and 1), the value points the packer's micro-batches carry, the clipped value
loss and its autograd gradients, the config checks, and the head kept out of what is synced/exported.
The 2-rank DeepSpeed step (ZeRO 0-3), checkpoint/resume and export: tests/test_critic_ds.py."""
import numpy as np
import pytest
import torch

from arl.config import AlgoConfig, ConfigError, CriticConfig, StabilizerConfig, load_config
from arl.data import Trajectory
from arl.data.packer import PackerConfig, pack_step
from arl.ops.policy_loss import LossConfig
from arl.stabilizers import Stabilizers
from arl.algo.advantages import gae
from arl.algo.critic import VALUE_HEAD, Critic, attach_value_head, param_groups, without_value_head

from two_rank import random_chunk_ids, tiny_qwen

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, loss_agg="token-mean")
GAE = AlgoConfig(advantage="gae")

# three trajectories: values V_k and rewards r_k per chunk (laid out one after the other)
V = [0.5, 0.2, 0.8, 0.3, 0.1, 0.4]
R = [0.0, 0.1, 1.0, 0.0, 0.0, 1.0]
SEQ = [0, 0, 0, 1, 2, 2]


def _gae(gamma, lam):
    a, ret = gae(torch.tensor(V, dtype=torch.float64), torch.tensor(R, dtype=torch.float64), torch.tensor(SEQ), gamma, lam)
    return a.tolist(), ret.tolist()


def test_gae_matches_a_hand_computation():
    a, ret = _gae(0.9, 0.5)
    # trajectory 0: delta_2 = 1 - 0.8 = 0.2; delta_1 = 0.1 + 0.9*0.8 - 0.2 = 0.62; delta_0 = 0.9*0.2 - 0.5 = -0.32
    # A_2 = 0.2, A_1 = 0.62 + 0.45*0.2 = 0.71, A_0 = -0.32 + 0.45*0.71 = -0.0005
    # trajectory 1 (one chunk, reward 0): A = -0.3; trajectory 2: delta_1 = 0.6, delta_0 = 0.9*0.4 - 0.1 = 0.26,
    # A_1 = 0.6, A_0 = 0.26 + 0.45*0.6 = 0.53
    want = [-0.0005, 0.71, 0.2, -0.3, 0.53, 0.6]
    assert a == pytest.approx(want, abs=1e-12)
    assert ret == pytest.approx([x + v for x, v in zip(want, V)], abs=1e-12)


def test_gae_lambda_edges():
    a0, _ = _gae(0.9, 0.0)  # one-step TD errors
    assert a0 == pytest.approx([-0.32, 0.62, 0.2, -0.3, 0.26, 0.6], abs=1e-12)
    a1, ret1 = _gae(0.9, 1.0)  # Monte-Carlo: discounted return - V, and the return as target
    mc = [0.9 * 0.1 + 0.81 * 1.0, 0.1 + 0.9 * 1.0, 1.0, 0.0, 0.9 * 1.0, 1.0]
    assert a1 == pytest.approx([g - v for g, v in zip(mc, V)], abs=1e-12)
    assert ret1 == pytest.approx(mc, abs=1e-12)
    a, _ = gae(torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([0, 0]), 1.0, 1.0)
    assert a.tolist() == [1.0, 1.0]  # V = 0, gamma = lambda = 1: every chunk gets the outcome


def test_gae_rejects_misaligned_inputs():
    with pytest.raises(ValueError, match="one entry per chunk"):
        gae(torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(3, dtype=torch.long), 1.0, 1.0)


def trajectories(n=12, group=4, seed=0, masked=()):
    from arl.data import TrajectoryStatus

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(12, 40))
        out.append(Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=random_chunk_ids(rng, L),
                              rollout_logp=np.zeros(L, np.float32), reward=float(rng.random() > 0.5),
                              group_id=i // group,
                              status=TrajectoryStatus.MASKED if i in masked else TrajectoryStatus.OK))
    return out


def prepared(trajs, algo=GAE, stab=StabilizerConfig(), budget=80, world=2):
    s = Stabilizers(stab, LOSS, algo=algo)
    prep = s.prepare(trajs, LOSS)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=budget, num_ranks=world), LOSS,
                       advantages=prep.advantages)
    s.apply(packed, prep, LOSS)
    return prep, packed


def test_value_points_sit_before_each_packed_chunk():
    trajs = trajectories(masked=(3,))
    prep, packed = prepared(trajs)
    total = 0
    for mb in packed.all_micro_batches():
        if mb.is_empty:
            assert mb.critic is None
            continue
        c, seg = mb.critic, mb.segments
        cid, cu = mb.chunk_ids, mb.cu_seqlens
        P = c["pos"].numel()
        total += P
        # one point per trained chunk; the token after each point starts a new chunk of the same sequence
        assert P == int(cid.max()) + 1 if (cid >= 0).any() else P == 0
        for p, s, j in zip(c["pos"].tolist(), c["seg"].tolist(), c["seq"].tolist()):
            assert cid[p + 1] >= 0 and (cid[p] < 0 or cid[p] != cid[p + 1])
            assert int(cu[j]) <= p < int(cu[j + 1]) - 1
            assert int(seg["cu_seqlens"][s]) <= p + 1 < int(seg["cu_seqlens"][s + 1])  # its loss segment
            assert seg["advantages"][s] == 0.0  # no turn credit: the critic's baseline replaces the group's
        # the outcome reward on each sequence's last chunk, 0 elsewhere
        for j, i in enumerate(mb.traj_indices.tolist()):
            r = c["rewards"][c["seq"] == j].tolist()
            if r:
                assert r[:-1] == [0.0] * (len(r) - 1) and r[-1] == trajs[i].reward
                # diagnostics: turn indices count up from the first packed chunk; every point carries
                # its episode's whole return
                turns = c["turn"][c["seq"] == j].tolist()
                assert turns == list(range(turns[0], turns[0] + len(turns)))
                assert c["episode_return"][c["seq"] == j].tolist() == [trajs[i].reward] * len(r)
            else:
                assert i == 3  # the MASKED placeholder trains nothing
    assert total > 0 and all(mb.critic["normalizer"] == total for mb in packed.all_micro_batches() if not mb.is_empty)


def test_turn_credit_process_reward_and_step_advantage_enter_the_critic():
    trajs = trajectories()
    for t in trajs:  # every turn reached a new state
        t.metadata["turn_info"] = [{"new_state": True}] * 16
    stab = StabilizerConfig(turn_credit=dict(enabled=True, weight=1.0, process_reward=0.1))
    prep, packed = prepared(trajs, stab=stab)
    mb = next(m for m in packed.all_micro_batches() if not m.is_empty)
    for j, i in enumerate(mb.traj_indices.tolist()):
        r = mb.critic["rewards"][mb.critic["seq"] == j].tolist()
        assert r[:-1] == pytest.approx([0.1] * (len(r) - 1)) and r[-1] == pytest.approx(0.1 + trajs[i].reward)
        assert mb.critic["episode_return"][mb.critic["seq"] == j].tolist() == pytest.approx([sum(r)] * len(r))
    # the base chunk advantages are turn credit's step part only (the trajectory advantage is left out)
    from arl.algo.turn_credit import turn_advantages

    step_only, _ = turn_advantages(prep.trajectories, np.zeros(len(trajs)), LOSS, weight=1.0, process_reward=0.1)
    for a, b in zip(prep.chunk_advantages, step_only):
        np.testing.assert_array_equal(a, b)


class _MB:
    def __init__(self, pos, seg, seq, rewards, normalizer, turn=None, episode_return=None):
        turn = turn if turn is not None else [0] * len(pos)
        episode_return = episode_return if episode_return is not None else [0.0] * len(pos)
        self.critic = {"pos": torch.tensor(pos), "seg": torch.tensor(seg), "seq": torch.tensor(seq),
                       "rewards": torch.tensor(rewards, dtype=torch.float64), "normalizer": normalizer,
                       "turn": torch.tensor(turn, dtype=torch.int64),
                       "episode_return": torch.tensor(episode_return, dtype=torch.float64)}
        self.index, self.rank = 0, 0


def _head_model(H=6, dtype=torch.float64):
    m = torch.nn.Module()
    m.config = type("C", (), {"hidden_size": H})()
    m.register_parameter("w", torch.nn.Parameter(torch.zeros(1, dtype=dtype)))
    attach_value_head(m)
    return m


def test_value_loss_and_metrics_by_hand():
    cfg = CriticConfig(gamma=1.0, lam=1.0, clip=0.1)
    cr = Critic(cfg)
    mb = _MB([0, 1], [0, 1], [0, 0], [0.0, 1.0], normalizer=4.0)
    old_v = torch.tensor([0.0, 0.5], dtype=torch.float64)
    v = torch.tensor([0.3, 0.55], dtype=torch.float64, requires_grad=True)
    seg_adv, loss = cr.micro_batch(v, old_v, mb, torch.tensor([0.25, 0.0, 7.0], dtype=torch.float64))
    # lambda = gamma = 1: A = return - V_old = [1, 0.5], G = [1, 1]; segment 2 has no value point
    assert seg_adv.tolist() == pytest.approx([1.25, 0.5, 7.0])
    # chunk 0: unclipped (0.3-1)^2 = 0.49, clipped V = 0.1: 0.81 -> clipped term wins; chunk 1: 0.2025 both ways
    assert float(loss.detach()) == pytest.approx(0.5 * (0.81 + 0.2025) / 4.0)
    loss.backward()
    assert v.grad.tolist() == pytest.approx([0.0, (0.55 - 1.0) / 4.0])  # the clipped branch has no gradient in V
    m = cr.step_metrics(torch.device("cpu"))
    assert m["value/clip_frac"] == 0.5 and m["value/mean"] == pytest.approx(0.425)
    assert m["value/loss"] == pytest.approx(0.5 * (0.81 + 0.2025) / 2)
    res = np.array([1 - 0.3, 1 - 0.55])
    assert "value/explained_var" not in m  # returns that all agree: no figure
    two = _MB([0, 1], [0, 1], [0, 1], [0.0, 1.0], 2.0, episode_return=[0.0, 1.0])
    cr.micro_batch(torch.tensor([0.0, 0.1], dtype=torch.float64), torch.tensor([0.0, 0.1], dtype=torch.float64),
                   two, torch.zeros(2, dtype=torch.float64))
    m = cr.step_metrics(torch.device("cpu"))
    ret, res = np.array([0.0, 1.0]), np.array([0.0, 0.9])
    assert m["value/explained_var"] == pytest.approx(1 - res.var() / ret.var())
    # every episode failed: the targets vary only by the bootstrap values, so no figure
    fail = _MB([0, 1], [0, 1], [0, 0], [0.0, 0.0], 2.0, episode_return=[0.0, 0.0])
    boot = Critic(CriticConfig(gamma=1.0, lam=0.5, clip=None))  # target of chunk 0: 0.5 * V_1 = 0.05
    boot.micro_batch(torch.tensor([0.2, 0.1], dtype=torch.float64), torch.tensor([0.2, 0.1], dtype=torch.float64),
                     fail, torch.zeros(2, dtype=torch.float64))
    m = boot.step_metrics(torch.device("cpu"))
    assert m["value/return_mean"] == pytest.approx(0.025) and "value/explained_var" not in m


def test_whitened_advantages_by_hand():
    """``whiten``: the step's GAE advantages (all its micro-batches) to mean 0, variance 1, from the old
    values, added to the segments' own advantages; the value loss keeps the raw returns."""
    cfg = CriticConfig(gamma=1.0, lam=1.0, clip=None, whiten=True)
    mbs = [_MB([0, 1], [0, 1], [0, 0], [0.0, 1.0], normalizer=3.0), _MB([0], [0], [0], [0.0], normalizer=3.0),
           None]
    olds = [torch.tensor([0.0, 0.5], dtype=torch.float64), torch.tensor([0.25], dtype=torch.float64), None]
    cr = Critic(cfg)
    m = cr.begin_step([mb if mb is not None else type("E", (), {"critic": None})() for mb in mbs], olds,
                      torch.device("cpu"))
    raw = np.array([1.0, 0.5, -0.25])  # lambda = gamma = 1: return - V_old
    assert m["value/adv_raw_mean"] == pytest.approx(raw.mean()) and m["value/adv_raw_std"] == pytest.approx(raw.std())
    white = (raw - raw.mean()) / np.sqrt(raw.var() + 1e-8)
    seg, loss = cr.micro_batch(olds[0].clone().requires_grad_(), olds[0], mbs[0], torch.tensor([0.25, 0.0], dtype=torch.float64))
    assert seg.tolist() == pytest.approx([0.25 + white[0], white[1]])
    assert float(loss.detach()) == pytest.approx(0.5 * (1.0 + 0.25) / 3.0)  # targets G = [1, 1]: raw returns
    seg, _ = cr.micro_batch(olds[1].clone(), olds[1], mbs[1], torch.zeros(1, dtype=torch.float64))
    assert seg.tolist() == pytest.approx([white[2]])
    # one chunk in the step (no spread): its advantage is centred to 0, not divided by 0
    one = Critic(cfg)
    one.begin_step(mbs[1:2], olds[1:2], torch.device("cpu"))
    assert one.micro_batch(olds[1], olds[1], mbs[1], torch.zeros(1, dtype=torch.float64))[0].tolist() == [0.0]
    # a step whose advantages barely spread (all episodes agree: critic noise) is divided by the floor,
    # not by its own std: the noise stays small instead of becoming unit advantages
    quiet = [torch.tensor([0.01, 0.0], dtype=torch.float64), torch.tensor([-0.01], dtype=torch.float64)]
    flat = [_MB([0, 1], [0, 1], [0, 0], [0.0, 0.0], normalizer=3.0), _MB([0], [0], [0], [0.0], normalizer=3.0)]
    for floor in (0.1, 0.0):
        q = Critic(CriticConfig(gamma=1.0, lam=1.0, clip=None, whiten=True, whiten_min_std=floor))
        q.begin_step(flat, quiet, torch.device("cpu"))
        raw_q = np.array([-0.01, 0.0, 0.01])
        scale = max(np.sqrt(raw_q.var() + 1e-8), floor)
        got = q.micro_batch(quiet[0], quiet[0], flat[0], torch.zeros(2, dtype=torch.float64))[0].tolist()
        assert got == pytest.approx(((raw_q[:2] - raw_q.mean()) / scale).tolist())
    assert max(abs(x) for x in got) > 1.0  # no floor: the noise is scaled up to unit size
    with pytest.raises(ValueError, match="whiten_min_std: set, but critic.whiten is false"):
        CriticConfig(whiten_min_std=0.2)
    # whitening without the step's old values, or before begin_step: one line each
    with pytest.raises(ValueError, match="critic.whiten: needs the step's old values"):
        Critic(cfg).begin_step(mbs[:1], None, torch.device("cpu"))
    with pytest.raises(ValueError, match="critic.whiten: micro_batch before begin_step"):
        Critic(cfg).micro_batch(olds[0], olds[0], mbs[0], torch.zeros(2, dtype=torch.float64))
    # off: begin_step is a no-op and the advantages are the raw ones
    plain = Critic(CriticConfig(gamma=1.0, lam=1.0, clip=None))
    assert plain.begin_step(mbs[:1], None, torch.device("cpu")) == {}
    assert plain.micro_batch(olds[0], olds[0], mbs[0], torch.zeros(2, dtype=torch.float64))[0].tolist() == [1.0, 0.5]


def test_value_head_gradients_autograd_check():
    """d(value loss)/d(head weight, bias, hidden) against finite differences (float64), clipped and not."""
    torch.manual_seed(0)
    H = 6
    for clip in (None, 0.05):
        cr = Critic(CriticConfig(gamma=0.9, lam=0.8, clip=clip))
        model = _head_model(H)
        head = getattr(model, VALUE_HEAD)
        del head.weight, head.bias  # plain tensors from here: gradcheck's inputs
        mb = _MB([0, 2, 3, 5], [0, 1, 2, 3], [0, 0, 1, 1], [0.0, 1.0, 0.1, 0.0], normalizer=5.0)
        old_v = torch.randn(4, dtype=torch.float64) * 0.3

        def f(w, b, h):
            head.weight, head.bias = w, b
            v = cr.values(model, h, mb)
            return cr.micro_batch(v, old_v, mb, torch.zeros(4, dtype=torch.float64))[1]

        w = (torch.randn(1, H, dtype=torch.float64) * 0.3).requires_grad_()
        b = torch.randn(1, dtype=torch.float64).requires_grad_()
        h = torch.randn(7, H, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(f, (w, b, h), eps=1e-6, atol=1e-7)


def test_nan_values_fail_loudly():
    model = _head_model(4)
    mb = _MB([1], [0], [0], [1.0], 1.0)
    h = torch.zeros(3, 4, dtype=torch.float64)
    h[1, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="value head output nan at value point 0"):
        Critic(CriticConfig()).values(model, h, mb)
    with pytest.raises(ValueError, match="no value points"):
        Critic(CriticConfig()).values(model, h, type("M", (), {"critic": None})())


def test_head_is_zero_in_its_own_param_group_and_kept_out_of_the_policy_state():
    model = tiny_qwen()
    keys = set(model.state_dict())
    head = attach_value_head(model)
    assert float(head.weight.abs().sum() + head.bias.abs().sum()) == 0.0
    groups = param_groups(model, 1e-3, 10.0)
    assert groups[1]["lr"] == pytest.approx(1e-2) and "lr" not in groups[0]
    assert {id(p) for p in groups[1]["params"]} == {id(head.weight), id(head.bias)}
    assert len(groups[0]["params"]) + 2 == len(list(model.parameters()))
    assert set(without_value_head(model.state_dict())) == keys
    with pytest.raises(ValueError, match="already has"):
        attach_value_head(model)


def test_config_checks():
    ok = load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae", "critic.lam=0.9"])
    assert ok.algo.uses_critic() and ok.critic.lam == 0.9 and ok.algo.objective_name(False) == "critic"
    bad = {
        "critic.lam=1.5": "critic.lam",
        "critic.gamma=0": "critic.gamma",
        "critic.lr_mult=0": "critic.lr_mult",
        "critic.clip=-1": "critic.clip",
        "critic.bogus=1": "critic.bogus: unknown key",
    }
    for ov, msg in bad.items():
        with pytest.raises(ConfigError, match=msg) as e:
            load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae", ov])
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="algo.advantage: gae needs loss.ratio_level token or chunk"):
        load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae", "stabilizers.turn_credit.enabled=false",
                                              "loss.ratio_level=sequence"])
    with pytest.raises(ConfigError, match="algo.advantage: gae cannot be combined with stabilizers.ipa.enabled"):
        load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae", "stabilizers.turn_credit.enabled=false",
                                              "stabilizers.ipa.enabled=true"])
    assert not load_config("configs/tiny_cpu.yaml").algo.uses_critic()  # off by default
    # a critic setting without the critic is no silent no-op; the old switch names its replacement
    with pytest.raises(ConfigError, match="critic.whiten: set, but the critic is off"):
        load_config("configs/tiny_cpu.yaml", ["critic.whiten=true"])
    with pytest.raises(ConfigError, match="critic.enabled: moved to algo.advantage: gae"):
        load_config("configs/tiny_cpu.yaml", ["critic.enabled=true"])
    with pytest.raises(ConfigError, match="algo.objective: 'critic' does not go with algo.advantage 'grpo'"):
        load_config("configs/tiny_cpu.yaml", ["algo.objective=critic"])


def test_critic_off_prepares_exactly_what_it_did():
    trajs = trajectories(seed=3)
    for stab in (StabilizerConfig(), StabilizerConfig(turn_credit=dict(enabled=True))):
        a = prepared(trajs, algo=None, stab=stab)
        b = prepared(trajs, algo=AlgoConfig(advantage="grpo"), stab=stab)
        assert b[0].chunk_rewards is None
        np.testing.assert_array_equal(a[0].advantages, b[0].advantages)
        for x, y in zip(a[1].all_micro_batches(), b[1].all_micro_batches()):
            assert y.critic is None
            assert (x.segments is None) == (y.segments is None)
            if x.segments is not None:
                for k in x.segments:
                    assert torch.equal(x.segments[k], y.segments[k])


def test_dry_run_plan_shows_the_critic_memory():
    from arl.layout import plan

    on = plan(load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae"]))
    off = plan(load_config("configs/tiny_cpu.yaml"))
    H, T = 128, 4096
    assert on.trainer_bytes["critic head+grads+optim"] == pytest.approx((4 + 12 / 2) * (H + 1))  # fp32, ZeRO-2, dp 2
    assert on.trainer_bytes["critic values (micro-batch)"] == 3 * 4 * T
    assert on.trainer_bytes["total (fused)"] == pytest.approx(
        off.trainer_bytes["total (fused)"] + on.trainer_bytes["critic head+grads+optim"] + 3 * 4 * T)
    text = on.render()
    assert "critic head+grads+optim" in text and f"{H + 1} parameters" in text
    assert "critic" not in off.render()
    assert "old pass" not in text
    white = plan(load_config("configs/tiny_cpu.yaml", ["algo.advantage=gae", "critic.whiten=true"])).render()
    assert "critic.whiten: the no-grad old pass runs every step" in white


def test_calibration_by_turn_and_advantage_outcome_correlation_by_hand():
    """Mean value vs mean return per turn index (turns past the last bucket share it) and Pearson's r
    of the chunks' GAE advantages with their episodes' returns, over the step's micro-batches."""
    from arl.algo.critic import CALIB_TURNS

    cfg = CriticConfig(gamma=1.0, lam=1.0, clip=None)
    cr = Critic(cfg)
    # episode A: turns 0, 1 (return 1); episode B: turns 0 and CALIB_TURNS + 2 (return 0)
    mb1 = _MB([0, 1], [0, 1], [0, 0], [0.0, 1.0], 4.0, turn=[0, 1], episode_return=[1.0, 1.0])
    mb2 = _MB([0, 1], [0, 1], [0, 0], [0.0, 0.0], 4.0, turn=[0, CALIB_TURNS + 2], episode_return=[0.0, 0.0])
    olds = [torch.tensor([0.5, 0.25], dtype=torch.float64), torch.tensor([0.5, 0.75], dtype=torch.float64)]
    for mb, ov in zip((mb1, mb2), olds):
        cr.micro_batch(ov.clone(), ov, mb, torch.zeros(2, dtype=torch.float64))
    m = cr.step_metrics(torch.device("cpu"))
    # lambda = gamma = 1: G = reward-to-go = [1, 1] and [0, 0]; A = G - V_old
    assert m["value/calib/turn0_pred"] == pytest.approx(0.5) and m["value/calib/turn0_return"] == pytest.approx(0.5)
    assert m["value/calib/turn1_pred"] == pytest.approx(0.25) and m["value/calib/turn1_return"] == pytest.approx(1.0)
    last = f"value/calib/turn{CALIB_TURNS - 1}"
    assert m[last + "_pred"] == pytest.approx(0.75) and m[last + "_return"] == pytest.approx(0.0)
    assert not any(k.startswith("value/calib/turn2") for k in m)  # no chunk at turn 2: no figure
    a = np.array([0.5, 0.75, -0.5, -0.75])
    o = np.array([1.0, 1.0, 0.0, 0.0])
    assert m["value/adv_outcome_corr"] == pytest.approx(np.corrcoef(a, o)[0, 1])
    # one episode only: the returns do not vary, so no correlation figure (not a NaN)
    cr.micro_batch(olds[0].clone(), olds[0], mb1, torch.zeros(2, dtype=torch.float64))
    assert "value/adv_outcome_corr" not in cr.step_metrics(torch.device("cpu"))



def test_prompt_ev_ceiling_by_hand():
    """Between-task share of the outcome variance: tasks of equal difficulty give 0, tasks whose
    samples all agree give 1, all-equal outcomes give no figure."""
    from arl.algo.gae import prompt_ev_ceiling

    def trajs(gids):
        return [Trajectory(tokens=np.arange(4), chunk_ids=np.array([-1, 0, 0, 0]), rollout_logp=np.zeros(4),
                           reward=0.0, group_id=g) for g in gids]

    gids = [0, 0, 1, 1]
    assert prompt_ev_ceiling(trajs(gids), np.array([1.0, 0.0, 1.0, 0.0]))["value/prompt_ev_ceiling"] == pytest.approx(0.0)
    assert prompt_ev_ceiling(trajs(gids), np.array([1.0, 1.0, 0.0, 0.0]))["value/prompt_ev_ceiling"] == pytest.approx(1.0)
    # within: group 0 {1, 1, 0} var 2/9, group 1 {0, 0, 0} var 0 -> 3/6 * 2/9 = 1/9; total var of {1,1,0,0,0,0} = 2/9
    got = prompt_ev_ceiling(trajs([0, 0, 0, 1, 1, 1]), np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert got["value/prompt_ev_ceiling"] == pytest.approx(0.5)
    assert prompt_ev_ceiling(trajs(gids), np.ones(4)) == {}


def test_state_ev_ceiling_by_hand():
    """Chunks share a state when every token before them agrees; the ceiling is 1 - the mean unbiased
    within-state variance of the outcome over the revisited states' chunks / their unbiased variance."""
    from arl.algo.gae import state_ev_ceiling

    def traj(turn2: int):  # prompt [1 2], turn 1 [3 4], observation [5], turn 2 [turn2 6]
        return Trajectory(tokens=np.array([1, 2, 3, 4, 5, turn2, 6]), chunk_ids=np.array([-1, -1, 0, 0, -1, 1, 1]),
                          rollout_logp=np.zeros(7))

    # four samples share turn 1's state; turn 2's state is shared too (same turn 1 and observation)
    trajs = [traj(7), traj(8), traj(7), traj(8)]
    r = np.array([1.0, 0.0, 1.0, 0.0])
    got = state_ev_ceiling(trajs, r)
    # two states, each {1, 0, 1, 0}: nothing explained (unbiased: within 1/3 per state against 2/7 over
    # the 8 chunks, so a little below 0), full coverage
    assert got == {"value/state_ev_ceiling": pytest.approx(1 - (1 / 3) / (2 / 7)), "value/state_ev_coverage": 1.0}
    # a different turn 1 makes turn 2's state differ: [1 2 3 9 5 ...] vs [1 2 3 4 5 ...]
    t2 = [traj(7), traj(7)]
    t2 += [Trajectory(tokens=np.array([1, 2, 3, 9, 5, 7, 6]), chunk_ids=t2[0].chunk_ids, rollout_logp=np.zeros(7))
           for _ in range(2)]
    got = state_ev_ceiling(t2, np.array([1.0, 1.0, 0.0, 0.0]))
    # states: turn-1 {1,1,0,0} (4 chunks), turn-2 A {1,1}, turn-2 B {0,0}; g = [1,1,0,0,1,1,0,0]
    g = np.array([1, 1, 0, 0, 1, 1, 0, 0], dtype=float)
    within = (4 * np.var([1, 1, 0, 0], ddof=1) + 0 + 0) / 8
    assert got["value/state_ev_ceiling"] == pytest.approx(1 - within / g.var(ddof=1))
    assert got["value/state_ev_coverage"] == 1.0
    # no state visited twice, or all outcomes equal: no figure
    assert state_ev_ceiling(t2[:1], np.array([1.0])) == {}
    # progress states (task, turn, new states before it): turn 1 of all four shares (0, 0, 0); turn 2
    # is (0, 1, 1) after a turn 1 that reached a new state, (0, 1, 0) after one that did not
    prog = [Trajectory(tokens=t.tokens, chunk_ids=t.chunk_ids, rollout_logp=np.zeros(7),
                       metadata={"turn_info": [{"new_state": ns}, {"new_state": False}]})
            for t, ns in zip(t2 + t2[:2], (True, False, True, False, True, False))]
    r6 = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    got = state_ev_ceiling(prog, r6)
    # turn 1: {1,0,1,0,1,0}; turn 2 after progress: {1,1,1}, after none: {0,0,0}
    g = np.r_[r6, [1, 1, 1, 0, 0, 0]]
    within = (6 * np.var(r6, ddof=1)) / 12
    assert got["value/progress_ev_ceiling"] == pytest.approx(1 - within / g.var(ddof=1))
    assert got["value/progress_ev_coverage"] == 1.0
    assert "value/progress_ev_ceiling" not in state_ev_ceiling(t2, np.array([1.0, 1.0, 0.0, 0.0]))  # no new_state
    assert state_ev_ceiling(trajs, np.ones(4)) == {}

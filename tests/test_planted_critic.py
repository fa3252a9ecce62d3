"""Planted-bug tests (issue #54) for the critic objective and the step's advantages: each fails when
the bug its docstring names is put into the code, where the older tests passed.  Every expectation
is worked out by hand (the numbers in the comments), never from the function under test."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arl.algo.advantages import group_advantages
from arl.config import AlgoConfig, CriticConfig, StabilizerConfig
from arl.config.stabilizers import TurnCreditConfig
from arl.data import Trajectory
from arl.ops.policy_loss import LossConfig
from arl.algo.step import step_advantages
from arl.algo.turn_credit import turn_advantages
from arl.algo import objectives as obj_mod
from arl.algo.critic import VALUE_HEAD
from arl.algo.objectives import (CriticObjective, Forward, IPAObjective, Objective, SeparateCriticObjective,
                                    make_objective)

CPU = torch.device("cpu")


# ------------------------------------------------------------------------------------------ critic
class _MB:
    """One micro-batch of two chunks of one sequence (value points 0 and 1), two loss segments."""

    index, rank, is_empty, ipa = 0, 0, False, None

    def __init__(self):
        self.critic = {"pos": torch.tensor([0, 1]), "seg": torch.tensor([0, 1]), "seq": torch.tensor([0, 0]),
                       "rewards": torch.tensor([0.0, 1.0], dtype=torch.float64), "normalizer": 2.0,
                       "turn": torch.tensor([0, 1]), "episode_return": torch.tensor([1.0, 1.0], dtype=torch.float64)}
        self.segments = {"advantages": torch.tensor([0.25, 0.0], dtype=torch.float64)}

    def loss_kwargs(self):
        return {}


def _model():
    m = torch.nn.Module()
    m.config = SimpleNamespace(hidden_size=1)
    m.register_parameter("w", torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)))
    return m


def _stub_policy_loss(monkeypatch):
    """The policy loss as 0, recording the advantages it was given (the test is about the critic)."""
    seen = []

    def fake(logp, old, *, advantages, **kw):
        seen.append(advantages.tolist())
        return SimpleNamespace(loss=torch.zeros((), dtype=torch.float64), metrics={})

    monkeypatch.setattr(obj_mod, "policy_loss", fake)
    return seen


CFG = dict(gamma=1.0, lam=1.0, clip=0.1, value_coef=0.3)
# values this pass [0.3, 0.55], the old pass's [0.0, 0.5], chunk rewards [0, 1], gamma = lam = 1:
#   from the old values: A = [0.5 + 0.5, 1 - 0.5] = [1.0, 0.5], targets G = A + V_old = [1, 1];
#     value loss: chunk 0 clipped (V_old + 0.1 = 0.1): (0.1 - 1)^2 = 0.81 > (0.3 - 1)^2 = 0.49;
#     chunk 1: (0.55 - 1)^2 = 0.2025 either way -> 0.5 * (0.81 + 0.2025) / 2 = 0.253125
#   from this pass's values: A = [0.25 + 0.45, 1 - 0.55] = [0.7, 0.45], loss 0.5 * (0.49 + 0.2025) / 2
VLOSS_OLD = 0.5 * (0.81 + 0.2025) / 2
VLOSS_SELF = 0.5 * (0.49 + 0.2025) / 2


def _shared(monkeypatch, old_values):
    seen = _stub_policy_loss(monkeypatch)
    obj = CriticObjective("torch", CriticConfig(**CFG))
    model = _model()
    obj.prepare_model(model, 1.0)
    with torch.no_grad():
        getattr(model, VALUE_HEAD).weight.fill_(1.0)  # V = the hidden state itself
    hidden = torch.tensor([[0.3], [0.55]], dtype=torch.float64)
    fwd = Forward(logp=torch.zeros(2), entropy=None, old=torch.zeros(2), ref=None, hidden=hidden,
                  old_values=old_values)
    out = obj.loss(_MB(), fwd, LossConfig(), CPU)
    return seen, out


def test_critic_value_loss_is_weighted_by_value_coef_and_uses_the_old_pass(monkeypatch):
    """Plants: ``critic.value_coef`` dropped from the value loss; GAE and the value clip computed
    from this pass's values although the old pass gave its own."""
    seen, out = _shared(monkeypatch, torch.tensor([0.0, 0.5], dtype=torch.float64))
    assert seen == [pytest.approx([0.25 + 1.0, 0.5])]  # segment advantage + GAE from the old values
    assert float((out.total - out.loss).detach()) == pytest.approx(0.3 * VLOSS_OLD, rel=1e-12)
    # no old pass (one update per batch): V_old is this pass's own value, detached
    seen, out = _shared(monkeypatch, None)
    assert seen == [pytest.approx([0.25 + 0.7, 0.45])]
    assert float((out.total - out.loss).detach()) == pytest.approx(0.3 * VLOSS_SELF, rel=1e-12)


class _Separate:
    """What SeparateCriticObjective uses of its critic model: values and a backward."""

    def __init__(self):
        self.losses = []

    def values(self, mb):
        return torch.tensor([0.3, 0.55], dtype=torch.float64, requires_grad=True)

    def backward(self, loss):
        self.losses.append(float(loss.detach()))

    def empty(self):
        pass


def test_separate_critics_later_passes_fit_the_old_pass_weighted_by_value_coef():
    """Plants: the separate critic's value passes taking this pass's values for GAE / the clip, or
    leaving ``value_coef`` out of the critic's own loss."""
    obj = SeparateCriticObjective("torch", CriticConfig(model="separate", **CFG))
    obj.separate = _Separate()
    obj._value_pass([_MB()], [torch.tensor([0.0, 0.5], dtype=torch.float64)], CPU)
    assert obj.separate.losses == [pytest.approx(0.3 * VLOSS_OLD, rel=1e-12)]
    obj._value_pass([_MB()], None, CPU)
    assert obj.separate.losses[1] == pytest.approx(0.3 * VLOSS_SELF, rel=1e-12)


def test_critic_epochs_above_one_run_the_old_pass():
    """Plant: ``critic.epochs > 1`` without whitening runs no old pass (the later epochs then have
    no first-pass targets to fit: docs, CriticConfig.epochs)."""
    assert make_objective("critic", "torch", CriticConfig(model="separate", epochs=2)).needs_old_pass is True
    assert make_objective("critic", "torch", CriticConfig(model="separate", epochs=1)).needs_old_pass is False
    assert make_objective("critic", "torch", CriticConfig(whiten=True)).needs_old_pass is True
    assert make_objective("critic", "torch", CriticConfig()).needs_old_pass is False


def test_an_imitation_only_step_has_a_signal():
    """Plant: ``has_signal`` ignoring IPA's imitated tokens (a step whose only learning is imitation,
    every advantage 0, would be skipped)."""
    quiet = LossConfig()  # no KL, no entropy term
    imitation = {"adv_nonzero_frac": [0.0, 0.0], "ipa/il_tokens": [0.0, 7.0]}
    assert Objective.has_signal(imitation, quiet) and IPAObjective.has_signal(imitation, quiet)
    assert not Objective.has_signal({"adv_nonzero_frac": [0.0], "ipa/il_tokens": [0.0]}, quiet)


# ------------------------------------------------------------------------------------ advantages
def _one_chunk(reward, group=0):
    """prompt (2 tokens) | one model turn (3 tokens); every token id 1: one anchor per group."""
    chunks = np.array([-1, -1, 0, 0, 0], np.int32)
    return Trajectory(tokens=np.ones(5, np.int64), chunk_ids=chunks, rollout_logp=np.zeros(5, np.float32),
                      reward=reward, group_id=group)


SQRT_HALF = 0.5 ** 0.5  # the Bessel std of rewards {0, 1}: sqrt((0.25 + 0.25) / 1)


def test_adv_eps_reaches_the_step_and_defaults_to_1e_6():
    """Plants: ``algo.adv_eps`` ignored by the step (the estimator's default always); its default
    1e-4 instead of 1e-6.  GRPO of rewards {1, 0}: +-0.5 / (sqrt(0.5) + eps)."""
    assert AlgoConfig().adv_eps == 1e-6
    a, _, _ = group_advantages([1.0, 0.0], [0, 0])
    assert a.tolist() == pytest.approx([0.5 / (SQRT_HALF + 1e-6), -0.5 / (SQRT_HALF + 1e-6)], rel=1e-12)
    trajs = [_one_chunk(1.0), _one_chunk(0.0)]
    big = 0.5 / (SQRT_HALF + 1.0)  # 0.2928...
    out = step_advantages(trajs, LossConfig(), StabilizerConfig(), AlgoConfig(adv_eps=1.0))
    assert out.advantages.tolist() == pytest.approx([big, -big], rel=1e-12)
    # turn credit's anchor groups take the same eps: one chunk each, one anchor (the shared prompt)
    tc = StabilizerConfig(turn_credit=TurnCreditConfig(enabled=True, weight=1.0, process_reward=0.0))
    out = step_advantages(trajs, LossConfig(gamma=1.0), tc, AlgoConfig(adv_eps=1.0))
    assert [c.tolist() for c in out.chunk_advantages] == [pytest.approx([2 * big]), pytest.approx([-2 * big])]


def test_turn_credit_anchor_groups_use_the_configured_estimator():
    """Plant: turn credit's anchor groups always grpo whatever ``algo.advantage`` says.  dr_grpo of
    rewards {1, 0}: +-0.5 for the trajectory, +-0.5 again for the one anchor group (weight 1)."""
    tc = StabilizerConfig(turn_credit=TurnCreditConfig(enabled=True, weight=1.0, process_reward=0.0))
    out = step_advantages([_one_chunk(1.0), _one_chunk(0.0)], LossConfig(gamma=1.0), tc,
                          AlgoConfig(advantage="dr_grpo"))
    assert out.advantages.tolist() == [0.5, -0.5]
    assert [c.tolist() for c in out.chunk_advantages] == [[1.0], [-1.0]]
    chunk_adv, _ = turn_advantages([_one_chunk(1.0), _one_chunk(0.0)], np.zeros(2), LossConfig(gamma=1.0),
                                   weight=1.0, process_reward=0.0, estimator="rloo")
    assert [c.tolist() for c in chunk_adv] == [[1.0], [-1.0]]  # rloo: 1 - 0, 0 - 1


def test_turn_credit_under_none_adds_no_step_advantage():
    """Plant: turn credit under ``none`` adding the raw chunk returns (no baseline to compare them
    with, so the step advantage must be 0): the chunks keep the raw rewards [1, 0] and no more."""
    tc = StabilizerConfig(turn_credit=TurnCreditConfig(enabled=True, weight=1.0, process_reward=0.0))
    out = step_advantages([_one_chunk(1.0), _one_chunk(0.0)], LossConfig(gamma=1.0), tc, AlgoConfig(advantage="none"))
    assert out.advantages.tolist() == [1.0, 0.0]
    assert [c.tolist() for c in out.chunk_advantages] == [[1.0], [0.0]]
    chunk_adv, m = turn_advantages([_one_chunk(1.0), _one_chunk(0.0)], np.zeros(2), LossConfig(gamma=1.0),
                                   weight=1.0, process_reward=0.0, estimator="none")
    assert [c.tolist() for c in chunk_adv] == [[0.0], [0.0]] and m["stab/turn_step_adv_nonzero_frac"] == 0.0

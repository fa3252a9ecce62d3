"""Trainer objectives (arl/algo/objectives.py): the registry's errors, and a loss variant added
without touching the trainer step: a registered subclass runs through ``PolicyTrainer.rl_step`` on
one gloo rank and its gradient is exactly what its loss says."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from arl.config import OptimConfig, StabilizerConfig
from arl.data import Trajectory
from arl.data.packer import PackerConfig, pack_step
from arl.ops.policy_loss import LossConfig
from arl.stabilizers import Stabilizers
from arl.algo.objectives import OBJECTIVES, LossOut, Objective, make_objective, register_objective

from two_rank import random_chunk_ids, tiny_qwen

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28)


def micro_batches(ipa=False, n=8, group=4):
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(n):
        L = int(rng.integers(12, 40))
        meta = {"ipa_prefix_chunks": 1, "ipa_imitate": i % group == 0} if ipa else {}
        trajs.append(Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=random_chunk_ids(rng, L),
                                rollout_logp=np.full(L, -4.2, np.float32), reward=float(i % 2), group_id=i // group,
                                metadata=meta))
    stab = Stabilizers(StabilizerConfig(ipa=dict(enabled=ipa)), LOSS)
    prep = stab.prepare(trajs, LOSS)
    packed = pack_step(prep.trajectories, PackerConfig(token_budget=96, num_ranks=1), LOSS, advantages=prep.advantages)
    stab.apply(packed, prep, LOSS)
    return packed.ranks[0]


def test_registry_errors_are_one_line():
    assert {"policy_gradient", "ipa", "critic"} <= set(OBJECTIVES)
    with pytest.raises(ValueError, match="algo.objective: unknown objective 'ppo2' \\(registered: critic, ipa"):
        make_objective("ppo2", "reference")
    with pytest.raises(ValueError, match="'ipa' is already registered"):
        register_objective("ipa")(type("Again", (Objective,), {}))
    with pytest.raises(ValueError, match="critic needs the critic section"):
        make_objective("critic", "reference")


def test_the_objective_interface_is_narrow():
    """The base class has at most six hooks; what only a critic needs is the critic's own object
    (``objective.critic``, arl/algo/critic_role.py), None for the objectives without one."""
    hooks = sorted(n for n, v in vars(Objective).items()
                   if not n.startswith("_") and (callable(v) or isinstance(v, (staticmethod, classmethod))))
    assert hooks == ["begin_step", "end_step", "has_signal", "head_grad", "loss", "prepare_model"]
    assert len(hooks) <= 6
    assert make_objective("policy_gradient", "reference").critic is None
    assert make_objective("ipa", "reference").critic is None


def test_policy_gradient_refuses_ipa_micro_batches():
    mb = next(m for m in micro_batches(ipa=True) if not m.is_empty)
    with pytest.raises(ValueError, match="carries IPA roles but the objective is 'policy_gradient'"):
        make_objective("policy_gradient", "reference").loss(mb, None, LOSS, "cpu")


class _Half(Objective):
    """A variant: half the policy loss in backward, and a metric of its own."""

    def loss(self, mb, fwd, loss_cfg, device):
        out = super().loss(mb, fwd, loss_cfg, device)
        return LossOut(out.loss, 0.5 * out.total, {**out.metrics, "test/half": 1.0})


def _worker(rank, world, port, result_dir):
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    register_objective("test_half")(_Half)
    mbs = micro_batches()
    res = {}
    for name in ("policy_gradient", "test_half"):
        tr = PolicyTrainer(tiny_qwen(), optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=0, total_steps=10,
                           objective=name)
        grads = {}
        for n, p in tr.module.named_parameters():  # this rank's gradient, summed over the micro-batches
            p.register_hook(lambda g, n=n: grads.__setitem__(n, grads.get(n, 0) + g.detach().clone()) or g)
        res[name] = {"metrics": tr.rl_step(mbs, None, LOSS), "grads": grads, "objective": type(tr.objective).__name__}
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow
def test_a_registered_variant_runs_through_the_unchanged_step(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    pg, half = res["policy_gradient"], res["test_half"]
    assert half["objective"] == "_Half" and half["metrics"]["test/half"] == 1.0
    assert half["metrics"]["loss"] == pytest.approx(pg["metrics"]["loss"], rel=1e-6)  # the reported policy loss
    assert half["metrics"]["head_grad_in_forward"] == 0.0  # another loss: the policy loss's plan is not used
    assert set(half["grads"]) == set(pg["grads"]) and pg["grads"]
    for n, g in pg["grads"].items():
        torch.testing.assert_close(half["grads"][n], 0.5 * g, rtol=1e-5, atol=1e-8)


def test_ipa_objective_divides_imitation_by_the_step_normalizer():
    """The ipa objective hands the step-wide ``il_normalizer`` to the mixed loss (the trainer-side half
    of tests/test_planted.py's IPA case): over two micro-batches of one step (7 + 6 imitated tokens)
    every imitated token's gradient is -lambda_il / 13."""
    from arl.config import StabilizerConfig as S
    from arl.data.packer import PackerConfig as PC
    from arl.algo.objectives import Forward

    from test_planted import _traj

    trajs = [_traj([4, 3, 2], 1.0, group=0, ipa_prefix_chunks=2, ipa_imitate=True),
             _traj([4, 3, 5], 0.0, group=0, ipa_prefix_chunks=2, ipa_imitate=False),
             _traj([6, 5], 1.0, group=1, ipa_prefix_chunks=1, ipa_imitate=True),
             _traj([6, 2], 0.0, group=1, ipa_prefix_chunks=1, ipa_imitate=False)]
    loss_cfg = LossConfig(ratio_level="chunk", loss_agg="token-mean")
    stab = Stabilizers(S(ipa=dict(enabled=True, lambda_il=0.5, lambda_rl=0.0)), loss_cfg)
    prep = stab.prepare(trajs, loss_cfg)
    packed = pack_step(prep.trajectories, PC(token_budget=30), loss_cfg, advantages=prep.advantages)
    stab.apply(packed, prep, loss_cfg)
    mbs = packed.all_micro_batches()
    assert len(mbs) == 2
    obj = make_objective("ipa", "reference")
    n = 0
    for mb in mbs:
        logp = (-0.1 - torch.arange(mb.num_tokens, dtype=torch.float64) / mb.num_tokens).requires_grad_()
        out = obj.loss(mb, Forward(logp, None, logp.detach(), None), loss_cfg, "cpu")
        out.total.backward()
        il = mb.ipa["il_mask"].bool()
        n += int(il.sum())
        np.testing.assert_allclose(logp.grad[il].numpy(), -0.5 / 13.0, rtol=1e-12)
        assert float(logp.grad[~il].abs().max()) == 0.0
    assert n == 13

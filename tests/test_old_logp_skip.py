"""The old-logprob pass is skipped only where it is provably redundant: with one update per batch
and no dropout, the update that takes the old logprobs from the gradient pass equals the one after
a separate no-grad pass (weights after each of two steps, loss metrics, the engine-mismatch metric),
on 2 gloo ranks with several micro-batches per rank, for a turn-credit batch and an IPA batch.  With several updates per batch, or dropout, the pass is kept.
The grad-in-forward logprob head (arl/ops/logprob/grad_in_forward.py, on by default with the skip) is
tested here inside the real step too: its rank-local gradients equal the ordinary head's (ZeRO-2 and
ZeRO-3, 2 ranks; gradients, not weights: Adam's first step, g / (|g| + eps), turns rounding of tiny
gradients into weight differences of up to the learning rate)."""
import os

import numpy as np
import pytest
import torch

from arl.config import OptimConfig
from arl.data import Trajectory
from arl.data.packer import PackerConfig, pack_step
from arl.ops.policy_loss import LossConfig

from two_rank import random_chunk_ids, spawn_ranks, tiny_qwen

# 2 DeepSpeed ranks run both stages; the cases on one pytest worker, so that they run once (--dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("old_logp_skip")]
STAGES = [2, 3]

# token-level truncated mismatch weight: the old logprobs reach the loss twice (ratio and weight)
LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28, mismatch_level="token", mismatch_mode="truncate",
                  mismatch_high=2.0)
OPTIM = OptimConfig(lr=1e-2, grad_clip=1e6)
BUDGET = 96  # tokens per micro-batch: several micro-batches per rank


def tiny_model(dropout=0.0):
    return tiny_qwen(attention_dropout=dropout)


def trajectories(n=16, group=4, seed=0, ipa=False):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(12, 48))
        chunk = random_chunk_ids(rng, L)
        meta = {"ipa_prefix_chunks": 1, "ipa_imitate": i % group == 0} if ipa else {}
        # near the model's own logprobs (log 1/64 = -4.2), so the mismatch weight varies and truncates
        out.append(Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=chunk,
                              rollout_logp=(-4.2 + 0.5 * rng.normal(size=L)).astype(np.float32),
                              reward=float(rng.random() > 0.5), group_id=i // group, metadata=meta))
    return out


def batches(world):
    """Per step: (this world's packed micro-batches per rank, the loss config), as the stabilizers
    make them.  Step 1: the policy loss with turn-credit segments; step 2: IPA imitation + RL."""
    from arl.config import StabilizerConfig
    from arl.stabilizers import Stabilizers

    out = []
    for seed, cfg in ((0, StabilizerConfig(turn_credit=dict(enabled=True))), (1, StabilizerConfig(ipa=dict(enabled=True)))):
        stab = Stabilizers(cfg, LOSS)
        loss_cfg = stab.loss_config(0)
        prep = stab.prepare(trajectories(seed=seed, ipa=seed == 1), loss_cfg)
        packed = pack_step(prep.trajectories, PackerConfig(token_budget=BUDGET, num_ranks=world), loss_cfg,
                           advantages=prep.advantages)
        stab.apply(packed, prep, loss_cfg)
        out.append((packed.ranks, loss_cfg))
    return out


class Spy:
    """Counts calls of a trainer's ``old_logprobs`` (the real method runs)."""

    def __init__(self, tr):
        self.calls, self.fn = 0, tr.old_logprobs
        tr.old_logprobs = self

    def __call__(self, *a, **k):
        self.calls += 1
        return self.fn(*a, **k)


class GradLog:
    """Sums each parameter's gradient over the backward passes while ``on`` (tensor hooks: the rank's
    own gradient, before DeepSpeed reduces it over the ranks)."""

    def __init__(self, tr):
        self.on, self.sums = False, {}
        for n, p in tr.module.named_parameters():
            p.register_hook(lambda g, n=n: self._add(n, g))

    def _add(self, n, g):
        if self.on:
            self.sums[n] = self.sums.get(n, 0) + g.detach().clone()
        return g

    def done(self):
        self.on = False
        return self.sums


def _worker(rank, world, port, result_dir):
    import faulthandler

    import torch.distributed as dist

    from arl.trainer.dist import init_distributed, set_rank_env

    faulthandler.enable(all_threads=True)
    set_rank_env(rank, world, port)
    init_distributed("cpu")
    for stage in STAGES:  # one process group, fresh trainers per stage
        res = _stage_checks(rank, world, stage)
        if rank == 0:
            torch.save(res, os.path.join(result_dir, f"skip{stage}.pt"))
        dist.barrier()
    dist.destroy_process_group()
    from arl.procs import exit_process

    exit_process(0)  # as the launcher's ranks end: no finalization after the group is gone


def _stage_checks(rank, world, stage):
    import deepspeed

    from arl.trainer import PolicyTrainer
    from arl.trainer.rank import engine_mismatch, update_on_batch

    # the same arithmetic as keep's head (bitwise-comparable updates); gif: the grad-in-forward head
    # the ipa objective: IPA micro-batches (step 2) get the mixed loss, the others the policy loss
    kw = dict(optim=OPTIM, zero_stage=stage, total_steps=10, objective="ipa")
    skip = PolicyTrainer(tiny_model(), head_grad_in_forward=False, **kw)
    keep = PolicyTrainer(tiny_model(), **kw)
    gif = PolicyTrainer(tiny_model(), head_grad_in_forward=True, **kw)
    spy = Spy(skip)
    grads = {"skip": GradLog(skip), "gif": GradLog(gif)}

    def weights(tr):
        params = list(tr.module.named_parameters())
        ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else torch.no_grad()
        with ctx:
            return {n: p.detach().clone() for n, p in params}

    res = {"steps": [], "n_mb": []}
    for step, (ranks, loss_cfg) in enumerate(batches(world)):
        mbs = ranks[rank]
        res["n_mb"].append(sum(not mb.is_empty for mb in mbs))
        if step == 0:  # the turn-credit batch, on equal weights: this rank's summed gradients
            grads["skip"].on = grads["gif"].on = True
            res["gif_metrics"] = update_on_batch(gif, mbs, loss_cfg, updates=1)
        m_skip = update_on_batch(skip, mbs, loss_cfg, updates=1)
        if step == 0:
            res["grads"] = {k: g.done() for k, g in grads.items()}
        old = keep.old_logprobs(mbs)  # the pass as it always ran
        m_keep = keep.rl_step(mbs, old, loss_cfg)
        m_keep.update(engine_mismatch(mbs, old))
        res["steps"].append({"skip": m_skip, "keep": m_keep, "w_skip": weights(skip), "w_keep": weights(keep),
                             "ipa": any(mb.ipa is not None for mb in mbs)})
    res["skip_pass_calls"] = spy.calls
    res["needed"] = {"one_update": skip.old_pass_needed(1), "two_updates": skip.old_pass_needed(2)}
    # several updates per batch: the pass runs once, before the first update
    ranks, loss_cfg = batches(world)[0]
    update_on_batch(skip, ranks[rank], loss_cfg, updates=2)
    res["two_updates_pass_calls"] = spy.calls - res["skip_pass_calls"]
    # dropout: the train-mode forward is random, the pass stays; rl_step refuses to take old from it
    drop = PolicyTrainer(tiny_model(dropout=0.1), **kw)
    dspy = Spy(drop)
    res["dropout_randomness"] = drop.train_randomness
    res["dropout_needed"] = drop.old_pass_needed(1)
    update_on_batch(drop, ranks[rank], loss_cfg, updates=1)
    res["dropout_pass_calls"] = dspy.calls
    try:
        drop.rl_step(ranks[rank], None, loss_cfg)
        res["dropout_refused"] = ""
    except ValueError as e:
        res["dropout_refused"] = str(e)
    return res


@pytest.fixture(scope="module")
def skip_runs(tmp_path_factory):
    """Both stages' results, from one pair of ranks (a spawn costs seconds of imports per rank)."""
    d = tmp_path_factory.mktemp("skip")
    spawn_ranks(_worker, d)
    return d


@pytest.mark.parametrize("stage", STAGES)
def test_skipped_old_logp_pass_gives_the_same_update(stage, skip_runs):
    res = torch.load(skip_runs / f"skip{stage}.pt")
    assert min(res["n_mb"]) >= 2, f"expected several micro-batches per rank, got {res['n_mb']}"
    assert res["skip_pass_calls"] == 0, "one update, no dropout: the old-logprob pass should not run"
    assert res["needed"] == {"one_update": False, "two_updates": True}
    assert res["two_updates_pass_calls"] == 1
    assert res["dropout_needed"] and res["dropout_pass_calls"] == 1
    assert any("attention_dropout" in r for r in res["dropout_randomness"])
    assert "old_logps=None" in res["dropout_refused"]
    assert [s["ipa"] for s in res["steps"]] == [False, True]
    assert res["gif_metrics"]["head_grad_in_forward"] == 1.0, "the grad-in-forward head should have run"
    assert res["steps"][0]["skip"]["head_grad_in_forward"] == 0.0
    g_skip, g_gif = res["grads"]["skip"], res["grads"]["gif"]
    assert set(g_gif) == set(g_skip) and len(g_skip) > 0
    for n, g in g_skip.items():
        torch.testing.assert_close(g_gif[n], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=f"grad {n}")
    for k, s in enumerate(res["steps"]):
        m_skip, m_keep = s["skip"], s["keep"]
        assert m_skip["skipped_no_signal"] == m_keep["skipped_no_signal"] == 0.0, k
        assert set(m_skip) == set(m_keep), k
        assert ("logp_abs_diff_vs_rollout" in m_skip) == (not s["ipa"]), k  # IPA batches are left out of it
        for key, v in m_keep.items():
            assert m_skip[key] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, key)
        for n, w in s["w_keep"].items():  # after each of the two steps (Adam's moments carry over)
            torch.testing.assert_close(s["w_skip"][n], w, rtol=1e-5, atol=1e-6, msg=f"step {k + 1}: {n}")

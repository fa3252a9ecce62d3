"""The separate critic (``critic.model: separate``) in the DeepSpeed trainer, ZeRO 0 and 3, on 2 gloo
ranks against 1 rank (the same trajectories, packed for each world):

* step 1 is the critic's warm-up (``critic.warmup_steps: 1``): the critic trains, the policy's
  weights stay bitwise, its optimizer state and lr schedule too; the record says ``critic/warmup: 1``;
* step 2 trains both; policy and critic weights after each step equal the 1-rank run's (ZeRO 0);
* resume from the step-1 checkpoint: the critic's weights, Adam state and step count come back (the
  restored trainer's step 2 equals the uninterrupted one's);
* an empty micro-batch (one rank has one while the other computes) runs the critic's forward and
  backward too, so ZeRO-3's collectives pair up;
* the weight sync's state dict is the plain policy's (no critic, no value head)."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from test_critic_ds import CRITIC, LOSS, OPTIM, _weights, batches

from two_rank import tiny_qwen

# DeepSpeed ranks (1, then 2) run every case once; the tests on one pytest worker (--dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("critic_separate_ds")]

SEPARATE = CRITIC.model_copy(update={"model": "separate", "warmup_steps": 1})
STAGES = (0, 3)


def _trainer(stage):
    from arl.trainer import PolicyTrainer

    return PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=stage, total_steps=10, objective="critic",
                         critic=SEPARATE)


def _critic_weights(tr):
    import deepspeed

    sep = tr.objective.separate
    params = list(sep.engine.module.named_parameters())
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if tr.zero3 else torch.no_grad()
    with ctx:
        return {n: p.detach().clone() for n, p in params}


def _opt_state(engine):
    """This rank's Adam state by position: of the torch optimizer's parameters, or under ZeRO-3 of the
    fp32 partitions it steps (DeepSpeed takes them out of its param groups between steps)."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    flat = getattr(zero, "fp32_partitioned_groups_flat", None)
    params = flat if flat is not None else [p for g in inner.param_groups for p in g["params"]]
    return {i: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in inner.state.get(p, {}).items()}
            for i, p in enumerate(params)}


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        v.keys() == b[k].keys() and all(torch.equal(t, b[k][n]) if torch.is_tensor(t) else t == b[k][n]
                                        for n, t in v.items()) for k, v in a.items())


def _empty(mb):
    from dataclasses import replace

    return replace(mb, token_ids=mb.token_ids[:0], cu_seqlens=mb.cu_seqlens[:1], critic=None, segments=None)


def _checks(rank, world, result_dir):
    from arl.trainer.rank import update_on_batch

    steps = [r[rank] for r in batches(world)]
    if world == 2:  # an empty micro-batch on each rank, at different positions: the critic joins ZeRO's collectives
        steps = [s + [_empty(s[0])] if rank == 0 else [_empty(s[0])] + s for s in steps]
    res = {}
    for stage in STAGES:
        r = res[stage] = {}
        tr = _trainer(stage)
        w0, opt0, epoch0 = _weights(tr), _opt_state(tr.engine), tr.scheduler.last_epoch
        r["m1"] = update_on_batch(tr, steps[0], LOSS, updates=1)
        r["policy_still"] = all(torch.equal(w, w0[n]) for n, w in _weights(tr).items())
        r["opt_still"] = _same_state(opt0, _opt_state(tr.engine))
        r["epoch_still"] = tr.scheduler.last_epoch == epoch0
        r["c1"] = _critic_weights(tr)
        copt1 = _opt_state(tr.objective.separate.engine)
        r["copt_nonempty"] = any(torch.is_tensor(t) and bool(t.abs().sum() > 0) for v in copt1.values() for t in v.values())
        ck = os.path.join(result_dir, f"ck{world}_{stage}")
        tr.save_checkpoint(ck, "step1", {"step": 1})
        r["m2"] = update_on_batch(tr, steps[1], LOSS, updates=1)
        r["w2"], r["c2"] = _weights(tr), _critic_weights(tr)
        full = tr.full_state_dict()
        r["sync_keys_plain"] = rank != 0 or set(full) == set(tiny_qwen().state_dict())
        back = _trainer(stage)
        back.load_checkpoint(ck, "step1")
        sep = back.objective.separate
        r["steps_restored"] = sep.steps
        r["c1_restored"] = _critic_weights(back)
        r["copt_restored"] = _same_state(copt1, _opt_state(sep.engine))  # the critic's Adam state (this rank's part)
        r["m2_restored"] = update_on_batch(back, steps[1], LOSS, updates=1)
        r["w2_restored"], r["c2_restored"] = _weights(back), _critic_weights(back)
    return res


def _worker(rank, world, port, result_dir):
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    res = _checks(rank, world, result_dir)
    if rank == 0:
        torch.save(res, os.path.join(result_dir, f"sep{world}.pt"))
    import torch.distributed as dist

    dist.barrier()
    if world == 2:  # the epochs case in the same process group
        epochs = _epochs_checks(rank, world)
        if rank == 0:
            torch.save(epochs, os.path.join(result_dir, "epochs.pt"))
        dist.barrier()
    dist.destroy_process_group()
    from arl.procs import exit_process

    exit_process(0)


def _close(a: dict, b: dict, start: dict, what: str, atol: float = 1e-5) -> int:
    """Weights equal where they moved by ~lr (test_critic_ds's rule for Adam's first steps).  A second
    Adam step divides by a second-moment estimate that fp32 sums in another order (ZeRO's buckets,
    the ranks' reduction) shift where gradients are tiny: 1% of an lr step is allowed there."""
    n_moved = 0
    for n, w in a.items():
        big = (w - start[n]).abs() > 0.99 * OPTIM.lr
        torch.testing.assert_close(b[n][big], w[big], rtol=1e-4, atol=atol, msg=f"{what} {n}")
        n_moved += int(big.sum())
    return n_moved


@pytest.fixture(scope="module")
def sep_runs(tmp_path_factory):
    """1 rank, then 2 ranks (with the epochs case): every result of this module."""
    from arl.procs import free_port

    d = tmp_path_factory.mktemp("sep")
    for world in (1, 2):
        mp.spawn(_worker, args=(world, free_port(), str(d)), nprocs=world, join=True)
    return d


def test_separate_critic_two_ranks_as_one_zero_0_and_3(sep_runs):
    one, two = torch.load(sep_runs / "sep1.pt"), torch.load(sep_runs / "sep2.pt")
    w0 = tiny_qwen().state_dict()
    ref = one[0]
    c0 = {n: torch.zeros_like(t) if "arl_value_head" in n else w0.get(n, t) for n, t in ref["c1"].items()}
    assert "lm_head.weight" not in ref["c1"] and "arl_value_head.weight" in ref["c1"]  # no vocabulary matrix
    for world, res in ((1, one), (2, two)):
        for stage, r in res.items():
            what = f"world {world} ZeRO-{stage}"
            m1, m2 = r["m1"], r["m2"]
            assert m1["critic/warmup"] == 1.0 and m2["critic/warmup"] == 0.0, what
            assert "loss" not in m1 and "loss" in m2  # no policy loss in the warm-up
            assert m1["value/mean"] == 0.0 and m2["value/mean"] != 0.0  # the critic learned in step 1
            assert np.isfinite(m2["value/loss"]) and m2["skipped_no_signal"] == 0.0
            assert r["policy_still"] and r["opt_still"] and r["epoch_still"], what
            assert r["sync_keys_plain"], what
            # the same update as 1 rank, ZeRO 0
            assert _close(ref["c1"], r["c1"], c0, f"{what} critic step 1") > 0
            _close(ref["c2"], r["c2"], c0, f"{what} critic step 2", atol=OPTIM.lr * 1e-2)
            assert _close(ref["w2"], r["w2"], w0, f"{what} policy step 2", atol=OPTIM.lr * 1e-2) > 0
            # resume from step 1: the critic's weights, Adam state and warm-up count
            assert r["steps_restored"] == 1, what
            for n, c in r["c1"].items():
                assert torch.equal(r["c1_restored"][n], c), (what, n)
            for k in ("c2", "w2"):
                for n, w in r[k].items():
                    torch.testing.assert_close(r[f"{k}_restored"][n], w, rtol=1e-6, atol=1e-7, msg=f"{what} {k} {n}")
            assert r["m2_restored"]["value/loss"] == pytest.approx(m2["value/loss"], rel=1e-6)
            assert r["copt_nonempty"] and r["copt_restored"], what


EPOCHS = (1, 3)


def _epochs_checks(rank, world):
    """ZeRO-3 on 2 ranks (empty micro-batches included): the same two steps with ``critic.epochs`` 1
    and 3, no warm-up."""
    from arl.trainer import PolicyTrainer
    from arl.trainer.rank import update_on_batch

    steps = [r[rank] for r in batches(world)]
    steps = [s + [_empty(s[0])] if rank == 0 else [_empty(s[0])] + s for s in steps]
    res = {}
    for n in EPOCHS:
        cfg = SEPARATE.model_copy(update={"warmup_steps": 0, "epochs": n})
        tr = PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=3, total_steps=10, objective="critic", critic=cfg)
        m1 = update_on_batch(tr, steps[0], LOSS, updates=1)
        w1, c1 = _weights(tr), _critic_weights(tr)
        again = update_on_batch(tr, steps[0], LOSS, updates=1)  # its first pass: the fit the step left
        res[n] = {"m1": m1, "w1": w1, "c1": c1, "again": again, "steps": tr.objective.separate.steps}
    return res


def test_critic_epochs_fit_the_step_again_and_leave_the_policy_update(sep_runs):
    """``critic.epochs: 3``: the policy's update is the one epoch's (its advantages come from the values
    before the step), the reported value figures are the first pass's, the warm-up count moves by one
    trainer step, and the critic fits the batch closer than after one epoch."""
    res = torch.load(sep_runs / "epochs.pt")
    one, three = res[1], res[3]
    for n, w in one["w1"].items():
        torch.testing.assert_close(three["w1"][n], w, rtol=1e-5, atol=1e-7, msg=n)
    assert three["m1"]["value/loss"] == pytest.approx(one["m1"]["value/loss"], rel=1e-6)
    assert one["steps"] == three["steps"] == 2
    assert any(not torch.equal(three["c1"][n], c) for n, c in one["c1"].items())
    assert three["again"]["value/loss"] < one["again"]["value/loss"]

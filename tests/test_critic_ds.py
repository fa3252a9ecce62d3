"""The critic in the DeepSpeed trainer on 2 gloo ranks, several micro-batches each (one of them
holds no value point, and one on each rank is empty, at different positions), ZeRO 0, 1, 2 and 3 in
one pair of processes:

* a step trains the value head (it leaves 0) and logs every ``value/*`` metric; every stage gives
  the same weights, head included, after two steps (ZeRO 0 the reference);
* one update taking the values from the gradient pass equals one after an old pass that produces
  them (the old-logp skip's rule, for values); two updates per batch run the old pass with values;
* checkpoint/resume: the head's weights and Adam state come back exactly (the restored trainer's
  next step equals the uninterrupted one's);
* weight sync / export never see the head: ``full_state_dict`` has the plain model's keys and the HF
  export loads as a plain model;
* whitened advantages (``critic.whiten``) run the old pass and agree between ZeRO 0 and 3;
* with the critic off, the trainer is the one it was (same keys, same weights after a step as a
  trainer built without the argument)."""
import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from arl.config import AlgoConfig, CriticConfig, OptimConfig, StabilizerConfig
from arl.data import Trajectory, TrajectoryStatus
from arl.data.packer import PackerConfig, pack_step
from arl.ops.policy_loss import LossConfig

from two_rank import random_chunk_ids, tiny_qwen

pytestmark = pytest.mark.slow  # 2 DeepSpeed ranks per case

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28, loss_agg="token-mean")
OPTIM = OptimConfig(lr=1e-2, grad_clip=1e6)
GAE = AlgoConfig(advantage="gae")
CRITIC = CriticConfig(gamma=0.97, lam=0.9, lr_mult=3.0, value_coef=0.5, clip=0.2)
STAGES = (0, 1, 2, 3)


def critic_trainer(stage, critic=CRITIC):
    from arl.trainer import PolicyTrainer

    return PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=stage, total_steps=10, objective="critic", critic=critic)


def trajectories(seed, n=16, group=4):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(12, 48))
        status = TrajectoryStatus.MASKED if i == 5 else TrajectoryStatus.OK
        if i == 5:  # a long placeholder fills a micro-batch alone: one without any value point
            L = 90
        t = Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=random_chunk_ids(rng, L),
                       rollout_logp=np.zeros(L, np.float32), reward=float(rng.random() > 0.5), group_id=i // group,
                       status=status)
        t.metadata["turn_info"] = [{"new_state": bool(rng.random() > 0.5)} for _ in range(16)]
        out.append(t)
    return out


def batches(world, algo=GAE):
    from arl.stabilizers import Stabilizers

    out = []
    for seed in (0, 1):
        stab = Stabilizers(StabilizerConfig(turn_credit=dict(enabled=True)), LOSS, algo=algo)
        prep = stab.prepare(trajectories(seed), LOSS)
        packed = pack_step(prep.trajectories, PackerConfig(token_budget=96, num_ranks=world), LOSS,
                           advantages=prep.advantages)
        stab.apply(packed, prep, LOSS)
        out.append(packed.ranks)
    return out


def _worker(rank, world, port, result_dir):
    import faulthandler

    faulthandler.enable(all_threads=True)
    try:
        res = _checks(rank, world, port, result_dir)
        if rank == 0:
            torch.save(res, os.path.join(result_dir, "critic.pt"))
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        import sys
        import traceback

        print(f"rank {rank} raised:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    from arl.procs import exit_process

    exit_process(0)


def _weights(tr):
    import deepspeed

    params = list(tr.module.named_parameters())
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if tr.zero3 else torch.no_grad()
    with ctx:
        return {n: p.detach().clone() for n, p in params}


def _empty(mb):
    from dataclasses import replace

    return replace(mb, token_ids=mb.token_ids[:0], cu_seqlens=mb.cu_seqlens[:1], critic=None, segments=None)


def _checks(rank, world, port, result_dir):
    from arl.trainer import PolicyTrainer
    from arl.algo.critic import VALUE_HEAD
    from arl.trainer.dist import init_distributed, set_rank_env
    from arl.trainer.rank import update_on_batch

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    steps = [r[rank] for r in batches(world)]
    if world == 2:  # an empty micro-batch on each rank at different positions: its dummy pass joins ZeRO-3's
        steps = [s + [_empty(s[0])] if rank == 0 else [_empty(s[0])] + s for s in steps]  # gathers in order
    res = {"n_mb": [len(s) for s in steps], "points": [[int(mb.critic["pos"].numel()) if mb.critic else -1 for mb in s]
                                                        for s in steps], "stages": {}}
    plain_keys = set(tiny_qwen().state_dict())
    for stage in STAGES:
        r = res["stages"][stage] = {}
        tr = critic_trainer(stage)
        r["head_lr"] = [g["lr"] for g in tr._torch_opt.param_groups]
        r["m1"] = update_on_batch(tr, steps[0], LOSS, updates=1)
        r["w1"] = _weights(tr)
        tr.save_checkpoint(os.path.join(result_dir, f"ck{stage}"), "step1", {"step": 1})
        r["m2"] = update_on_batch(tr, steps[1], LOSS, updates=1)
        r["w2"] = _weights(tr)
        full = tr.full_state_dict()
        r["full_keys_plain"] = rank != 0 or set(full) == plain_keys
        hf = os.path.join(result_dir, f"hf{stage}")
        tr.export_hf(hf)
        # resume: a fresh trainer (head attached anew, at 0) restores step 1 and takes step 2 again
        back = critic_trainer(stage)
        back.load_checkpoint(os.path.join(result_dir, f"ck{stage}"), "step1")
        r["w1_restored"] = _weights(back)
        r["m2_restored"] = update_on_batch(back, steps[1], LOSS, updates=1)
        r["w2_restored"] = _weights(back)
        if stage == 2:  # an explicit old pass with values gives the same update as the skipped one
            keep = critic_trainer(stage)
            old_v = []
            old = keep.old_logprobs(steps[0], values=old_v)
            r["m1_old_pass"] = keep.rl_step(steps[0], old, LOSS, old_values=old_v)
            r["w1_old_pass"] = _weights(keep)
            try:
                keep.rl_step(steps[0], old, LOSS)
                r["mismatch_refused"] = ""
            except ValueError as e:
                r["mismatch_refused"] = str(e)
        if stage in (0, 3):  # whitened advantages: the old pass runs; ZeRO 3 as ZeRO 0
            wt = PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=stage, total_steps=10,
                               objective="critic", critic=CRITIC.model_copy(update={"whiten": True}))
            r["white_old_pass"] = wt.old_pass_needed(1)
            r["white_m"] = update_on_batch(wt, steps[0], LOSS, updates=1)
            import torch.distributed as dist

            each = [None] * world  # every rank's own figures: the statistics must be the step's, not the rank's
            dist.all_gather_object(each, {k: v for k, v in r["white_m"].items() if k.startswith("value/adv_raw")})
            r["white_each"] = each
            r["white_w"] = _weights(wt)
        if stage == 3:  # two updates per batch: the old pass gives the values, the clip can bite
            two = critic_trainer(stage)
            r["m_two"] = update_on_batch(two, steps[0], LOSS, updates=2)
        if stage == 0:  # critic off: the trainer without the argument, step for step
            for name, kw in (("none", {}), ("off", {"objective": "policy_gradient", "critic": CRITIC})):
                t = PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=stage, total_steps=10, **kw)
                plain = [r_[rank] for r_ in batches(world, algo=None)]
                r[f"off_{name}_m"] = update_on_batch(t, plain[0], LOSS, updates=1)
                r[f"off_{name}_w"] = _weights(t)
            r["off_head"] = hasattr(t.module, VALUE_HEAD)
            # a checkpoint resumed with the other critic setting: one line of ours, both ways
            t.save_checkpoint(os.path.join(result_dir, "ck_off"), "step1", {"step": 1})
            for ck, kw in (("ck0", {}), ("ck_off", {"objective": "critic", "critic": CRITIC})):
                other = PolicyTrainer(tiny_qwen(), optim=OPTIM, zero_stage=stage, total_steps=10, **kw)
                try:
                    other.load_checkpoint(os.path.join(result_dir, ck), "step1")
                    r[f"switch_{ck}"] = ""
                except ValueError as e:
                    r[f"switch_{ck}"] = str(e)
    return res


def test_critic_two_ranks_zero_0_to_3(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    check(tmp_path)


def check(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from arl.algo.critic import VALUE_HEAD

    res = torch.load(tmp_path / "critic.pt")
    assert min(res["n_mb"]) >= 2, res["n_mb"]
    assert any(p == 0 for s in res["points"] for p in s), f"want a micro-batch without value points: {res['points']}"
    head = [f"{VALUE_HEAD}.weight", f"{VALUE_HEAD}.bias"]
    ref = res["stages"][0]
    w0 = {**tiny_qwen().state_dict(), **{n: torch.zeros_like(ref["w1"][n]) for n in head}}
    moved = total = 0
    for stage, r in res["stages"].items():
        assert r["head_lr"] == pytest.approx([1e-2, 3e-2]), stage
        for m in (r["m1"], r["m2"]):
            for k in ("value/loss", "value/explained_var", "value/clip_frac", "value/mean"):
                assert k in m and np.isfinite(m[k]), (stage, k, m)
            assert m["skipped_no_signal"] == 0.0
        assert r["m1"]["value/mean"] == 0.0 and r["m1"]["value/clip_frac"] == 0.0  # V starts at 0; V_old = V
        assert float(r["w1"][head[0]].abs().sum()) > 0, stage  # the head trained
        assert r["m2"]["value/mean"] != 0.0
        for n in r["w2"]:  # every stage as ZeRO 0, after each of two steps
            # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is within ~100 eps, fp32
            # sums in another order (ZeRO's buckets) move it by anything up to lr, so those weights are left
            # out (as test_trainer_ds leaves out tiny gradients); test_trainer_ds's tolerances
            big = (ref["w1"][n] - w0[n]).abs() > 0.99 * OPTIM.lr
            torch.testing.assert_close(r["w1"][n][big], ref["w1"][n][big], rtol=1e-4, atol=1e-5,
                                       msg=f"ZeRO-{stage} step 1 {n}")
            torch.testing.assert_close(r["w2"][n][big], ref["w2"][n][big], rtol=1e-4, atol=1e-5,
                                       msg=f"ZeRO-{stage} step 2 {n}")
            moved += int(big.sum())
            total += big.numel()
        for n in r["w1"]:  # resume: exact weights, and the same next step (Adam state restored)
            assert torch.equal(r["w1_restored"][n], r["w1"][n]), (stage, n)
            torch.testing.assert_close(r["w2_restored"][n], r["w2"][n], rtol=1e-6, atol=1e-7,
                                       msg=f"ZeRO-{stage} resumed step {n}")
        assert r["m2_restored"]["value/loss"] == pytest.approx(r["m2"]["value/loss"], rel=1e-6)
        assert r["full_keys_plain"], stage
        # the HF export: a plain model without the head, loadable as is
        hf = tmp_path / f"hf{stage}"
        files = sorted(p.name for p in hf.iterdir())
        assert not any(VALUE_HEAD in k for f in hf.glob("*.safetensors") for k in load_file(str(f))), files
        m = AutoModelForCausalLM.from_pretrained(str(hf))
        assert not hasattr(m, VALUE_HEAD)
        for n, t in m.state_dict().items():
            torch.testing.assert_close(t, r["w2"][n], msg=f"ZeRO-{stage} export {n}")
    assert moved > 0.95 * total, (moved, total)  # nearly every weight is compared
    s2 = res["stages"][2]
    for n in s2["w1"]:
        torch.testing.assert_close(s2["w1_old_pass"][n], s2["w1"][n], rtol=1e-5, atol=1e-6, msg=n)
    for k in ("value/loss", "value/mean", "value/explained_var", "loss"):
        assert s2["m1_old_pass"][k] == pytest.approx(s2["m1"][k], rel=1e-5, abs=1e-7), k
    assert "old_values come with old_logps" in s2["mismatch_refused"]
    w0_white, w3_white = res["stages"][0]["white_w"], res["stages"][3]["white_w"]
    differs = 0
    for n, w in w0_white.items():
        big = (w - w0[n]).abs() > 0.99 * OPTIM.lr
        torch.testing.assert_close(w3_white[n][big], w[big], rtol=1e-4, atol=1e-5, msg=f"whitened ZeRO-3 {n}")
        differs += int(((w - ref["w1"][n]).abs() > 1e-3 * OPTIM.lr).sum())
    assert differs > 0  # whitening changed the update
    for stage in (0, 3):
        r = res["stages"][stage]
        assert r["white_old_pass"], stage
        m = r["white_m"]
        assert np.isfinite(m["value/adv_raw_mean"]) and m["value/adv_raw_std"] > 0, m
        # V = 0 before the first update: the raw advantages are GAE over zero values, i.e. the
        # lambda-returns of the chunk rewards, of every chunk of both ranks
        from arl.algo.advantages import gae

        raw = torch.cat([gae(torch.zeros(mb.critic["pos"].numel(), dtype=torch.float64), mb.critic["rewards"],
                             mb.critic["seq"], CRITIC.gamma, CRITIC.lam)[0]
                         for ranks in batches(2)[0] for mb in ranks if mb.critic is not None])
        assert m["value/adv_raw_mean"] == pytest.approx(float(raw.mean()), rel=1e-9) != 0.0
        assert m["value/adv_raw_std"] == pytest.approx(float(raw.std(unbiased=False)), rel=1e-9)
        assert r["white_each"][0] == r["white_each"][1], r["white_each"]
    two = res["stages"][3]["m_two"]
    assert np.isfinite(two["value/loss"]) and two["value/mean"] != 0.0  # the second update saw the moved head
    s0 = res["stages"][0]
    assert not s0["off_head"]
    assert s0["off_none_m"] == s0["off_off_m"] and "value/loss" not in s0["off_none_m"]
    for n, w in s0["off_none_w"].items():
        assert torch.equal(s0["off_off_w"][n], w), n
    assert set(s0["off_none_w"]) == set(s0["w1"]) - set(head)
    assert "saved with the critic on (algo.advantage gae), this run has it off" in s0["switch_ck0"], s0["switch_ck0"]
    assert "saved with the critic off (algo.advantage gae), this run has it on" in s0["switch_ck_off"], s0["switch_ck_off"]
    assert "\n" not in s0["switch_ck0"] + s0["switch_ck_off"]

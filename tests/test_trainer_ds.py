"""The DeepSpeed trainer step on 2 gloo ranks, 3 micro-batches each, equals a single-process torch
step on the whole batch: the same loss, the same full gradient of every parameter (gathered from
the ranks' partitions just before the optimizer applies it), the same global grad norm and the same
parameter update (ZeRO 0, 2 and 3), also for a model with tied input/output embeddings (one
parameter, used twice in forward, stays one after the step)."""
import os

import numpy as np
import pytest
import torch

from arl.config import OptimConfig
from arl.data import Trajectory
from arl.data.packer import PackerConfig, pack_step
from arl.model.tied import is_tied
from arl.ops.policy_loss import LossConfig, policy_loss
from arl.algo.step import step_advantages

from two_rank import random_chunk_ids, spawn_ranks, tiny_qwen

# 2 DeepSpeed ranks run every case; the cases on one pytest worker, so that they run once (--dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer_ds")]
CASES = [(2, False), (0, False), (3, False), (2, True), (0, True), (3, True)]

LOSS = LossConfig(ratio_level="chunk", gamma=0.95, clip_high=0.28)
OPTIM = OptimConfig(lr=1e-2, grad_clip=1e6)


def tiny_model(seed=0, tied=False):
    return tiny_qwen(seed, tie_word_embeddings=tied)


def trajectories(n=20, group=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(12, 60))
        chunk = random_chunk_ids(rng, L)
        out.append(Trajectory(tokens=rng.integers(0, 64, L), chunk_ids=chunk,
                              rollout_logp=rng.normal(0, 1, L).astype(np.float32),  # used as old-logp noise
                              reward=float(rng.random() > 0.5), group_id=i // group))
    return out


def pack(trajs, world):
    """As trainer rank 0 packs: with the step's advantages, computed once over the whole step."""
    adv = step_advantages(trajs, LOSS).advantages
    return pack_step(trajs, PackerConfig(token_budget=160, num_ranks=world), LOSS, advantages=adv)


def perturbed_old(logp, mb):
    return logp + 0.1 * mb.rollout_logp  # deterministic per token, whatever the packing


def _worker(rank, world, port, result_dir):
    import faulthandler

    import torch.distributed as dist

    from arl.trainer.dist import init_distributed, set_rank_env

    faulthandler.enable(all_threads=True)  # a native abort in a rank prints where every thread was
    try:
        set_rank_env(rank, world, port)
        init_distributed("cpu")
        for stage, tied in CASES:  # one process group, a fresh trainer per case
            _rank_checks(rank, world, stage, result_dir, tied)
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        # should the exit of a rank that raised then abort in native code (its process group still
        # up), mp.spawn reports only the SIGABRT: the cause is printed here first
        import sys
        import traceback

        print(f"rank {rank} raised:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    from arl.procs import exit_process

    exit_process(0)  # as the launcher's ranks end: no finalization after the group is gone


def _rank_checks(rank, world, stage, result_dir, tied):
    from arl.trainer import PolicyTrainer

    torch.manual_seed(0)
    model = tiny_model(tied=tied)
    tr = PolicyTrainer(model, optim=OPTIM, zero_stage=stage, total_steps=10, ref_model=tiny_model(tied=tied))
    step = pack(trajectories(), world)
    mbs = step.ranks[rank]
    raw = tr.old_logprobs(mbs)
    # the frozen reference starts as the policy: the same logprobs (partitioned too under ZeRO-3)
    ref_equal = all(a is None and b is None or torch.equal(a, b) for a, b in zip(raw, tr.ref_logprobs(mbs)))
    olds = [None if mb.is_empty else perturbed_old(o, mb) for mb, o in zip(mbs, raw)]
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    params = list(tr.module.named_parameters())
    grads = {}
    opt_step = tr.engine.optimizer.step

    def step_seeing_grads(*a, **kw):
        # the gradient the optimizer is about to apply, whole (a collective under ZeRO-2/3: every rank)
        if not grads:
            grads.update({n: safe_get_full_grad(p).detach().clone() for n, p in params})
        return opt_step(*a, **kw)

    tr.engine.optimizer.step = step_seeing_grads
    metrics = tr.rl_step(mbs, olds, LOSS)
    tr.engine.optimizer.step = opt_step
    from arl.trainer.dist import all_mean

    logged = all_mean(metrics, tr.device)  # what the run logs: the metrics averaged over the ranks
    n_mbs = all_mean({"n": float(len(mbs))}, tr.device)["n"]  # the packer gives every rank the same count
    state = {}

    def gathered():
        return deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else torch.no_grad()

    with gathered():
        for n, p in params:
            state[n] = p.detach().clone()
    # what weight sync and the HF export write: the whole model, also when ZeRO-3 partitioned it
    full = tr.full_state_dict()
    full_ok = rank != 0 or all(torch.equal(full[n], state[n]) for n in state)
    if tied:  # the head is the embedding, in the module and in what sync and export read
        full_ok = full_ok and is_tied(tr.module) and (rank != 0 or torch.equal(full["lm_head.weight"],
                                                                               full["model.embed_tokens.weight"]))
    # a batch without signal (every group's rewards equal): the weights must not move, although
    # Adam's momentum from the step above is nonzero; the step after it moves them again
    flat = [Trajectory(tokens=t.tokens, chunk_ids=t.chunk_ids, rollout_logp=t.rollout_logp, reward=1.0,
                       group_id=t.group_id) for t in trajectories(seed=1)]
    mbs0 = pack(flat, world).ranks[rank]
    m0 = tr.rl_step(mbs0, tr.old_logprobs(mbs0), LOSS)
    with gathered():
        still = all(torch.equal(p.detach(), state[n]) for n, p in params)
    m1 = tr.rl_step(mbs, tr.old_logprobs(mbs), LOSS)
    with gathered():
        moved = any(not torch.equal(p.detach(), state[n]) for n, p in params)
    # the step-wide advantages the stabilizers write into the micro-batches are what the loss uses,
    # also for micro-batches whose groups are complete: zeroed, the step has no signal
    mbz = pack(trajectories(), world).ranks[rank]
    for mb in mbz:
        mb.advantages = torch.zeros_like(mb.advantages)
    mz = tr.rl_step(mbz, tr.old_logprobs(mbz), LOSS)
    ref_after = tr.ref_logprobs(mbs)  # the reference did not move with the policy
    ref_still = all(a is None and b is None or torch.equal(a, b) for a, b in zip(raw, ref_after))
    skip = {"m0": m0, "m1": m1, "still": still, "moved": moved, "mz": mz, "ref_equal": ref_equal,
            "ref_still": ref_still, "full_ok": full_ok,
            "complete": sum(mb.complete_groups and not mb.is_empty for mb in mbz)}
    # the loop's metric averaging: a key reported by one rank only (empty micro-batches, IPA without RL
    # tokens) is averaged over the ranks that have it, not a collective of mismatched sizes
    from arl.trainer.dist import CHECK_ENV, all_mean, all_reduce

    skip["all_mean"] = all_mean({"a": float(rank + 1), **({"b": 5.0} if rank == 1 else {})}, tr.device)
    skip["all_sum"] = all_mean({"a": float(rank + 1), "n": float(rank + 3)}, tr.device, sums=("n",))  # counts add up
    # NCCL's device rule, checked here on gloo (the suite runs with ARL_CHECK_COLLECTIVES=1): a
    # tensor that did not come through to_comm is refused -- e.g. the CPU float64 tensor the
    # metric mean once all-reduced, which an NCCL group rejects
    assert os.environ.get(CHECK_ENV) == "1"
    try:
        all_reduce(torch.tensor([float(rank)], dtype=torch.float64))
        skip["raw_refused"] = False
    except RuntimeError as e:
        skip["raw_refused"] = "to_comm" in str(e)
    if rank == 0:
        torch.save({"metrics": metrics, "logged": logged, "grads": grads, "state": state, "n_mb": len(mbs),
                    "mean_n_mb": n_mbs, "skip": skip},
                   os.path.join(result_dir, f"ds_{stage}_{int(tied)}.pt"))


def single_process_reference(tied=False):
    model = tiny_model(tied=tied)
    step = pack(trajectories(), 1)
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay)
    from arl.model.packed import packed_logprobs

    from arl.metrics import per_turn_mean, success_logprob_mean

    total = 0.0
    turn_parts = {"ent": [], "logp": [], "cid": [], "cu": [], "ok": []}
    for mb in step.ranks[0]:
        with torch.no_grad():
            old = perturbed_old(packed_logprobs(model, mb.token_ids, mb.cu_seqlens)[0], mb)
            lp_e, ent = packed_logprobs(model, mb.token_ids, mb.cu_seqlens, with_entropy=True)
        for k, v in (("ent", ent), ("logp", lp_e), ("cid", mb.chunk_ids), ("cu", mb.cu_seqlens), ("ok", mb.rewards >= 1.0)):
            turn_parts[k].append(v)
        logp, _ = packed_logprobs(model, mb.token_ids, mb.cu_seqlens)
        # the step's advantages, as rl_step passes them (fp32 on the device)
        out = policy_loss(logp, old, config=LOSS, **{**mb.loss_kwargs(), "advantages": mb.advantages.float()})
        out.loss.backward()
        total += out.loss.item()
    gn = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())).item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    turn = per_turn_mean(turn_parts["ent"], turn_parts["cid"], turn_parts["cu"])
    turn.update(success_logprob_mean(turn_parts["logp"], turn_parts["cid"], turn_parts["cu"], turn_parts["ok"]))
    return total, gn, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, turn


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    """Every case's results, from one pair of ranks (a spawn costs seconds of imports per rank)."""
    d = tmp_path_factory.mktemp("ds")
    spawn_ranks(_worker, d)
    return d


@pytest.mark.parametrize("stage,tied", CASES)
def test_two_rank_deepspeed_step_equals_whole_batch_step(stage, tied, ds_runs):
    ds = torch.load(ds_runs / f"ds_{stage}_{int(tied)}.pt")
    skip = ds["skip"]
    assert ds["metrics"]["skipped_no_signal"] == 0.0
    assert skip["m0"]["skipped_no_signal"] == 1.0 and skip["still"], "a signal-free batch moved the weights"
    assert skip["m1"]["skipped_no_signal"] == 0.0 and skip["moved"] and skip["m1"]["lr"] == OPTIM.lr
    assert skip["complete"] > 0 and skip["mz"]["skipped_no_signal"] == 1.0, "rl_step ignored mb.advantages"
    assert skip["all_mean"] == {"a": 1.5, "b": 5.0}
    assert skip["all_sum"] == {"a": 1.5, "n": 7.0}
    assert skip["raw_refused"]
    assert skip["ref_equal"] and skip["ref_still"] and skip["full_ok"]
    loss, gn, grads, ref_state, turn = single_process_reference(tied)
    # per-turn entropy and the successful trajectories' mean logprob: all-reduced over the ranks,
    # equal to the whole batch's
    assert turn and "logp/success_mean" in turn
    for k, v in turn.items():
        assert ds["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # several micro-batches on every rank: DeepSpeed accumulates them, then averages over the ranks
    assert ds["n_mb"] == ds["mean_n_mb"] == 3
    # the logged loss is the whole step's loss (the sum of the micro-batch losses, each over the
    # step's global normalizer), whatever the number of ranks
    assert ds["logged"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    # the gradient the optimizer applied, whole, per parameter: the whole batch's (the ranks' sum of
    # micro-batch gradients); fp32 sums in another order, so relative to each parameter's own scale
    assert sorted(ds["grads"]) == sorted(grads)
    for n, g in grads.items():
        scale = g.abs().max().item()
        assert scale > 0, n  # every parameter takes part in the loss
        torch.testing.assert_close(ds["grads"][n], g, atol=1e-5 * scale, rtol=1e-4, msg=n)
    # the grad norm is global and exact
    assert ds["metrics"]["grad_norm"] == pytest.approx(gn, rel=1e-4)
    gmax = max(g.abs().max().item() for g in grads.values())
    for n, p in ref_state.items():
        big = grads[n].abs() > 1e-3 * gmax  # Adam's first step is ~lr*sign(g): compare where g is clearly nonzero
        torch.testing.assert_close(ds["state"][n][big], p[big], atol=1e-5, rtol=1e-4, msg=n)

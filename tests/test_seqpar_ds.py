"""trainer.sequence_parallel on DeepSpeed: 2 gloo ranks that split every micro-batch along the
sequence (one data-parallel replica) take the same step as one process on the whole batch -- the
same loss, the same full gradient of every parameter just before the optimizer applies it, the same
update -- at ZeRO 0, 2 and 3, with chunks and sequences split across the shard boundary; with LoRA
adapters; with the critic's shared value head (values read across the shard boundary); and a step
resumed from an SP checkpoint is bitwise the uninterrupted one.  All cases run
in one spawn of the two ranks (each case builds its own engine), so the suite pays one start-up."""
import os

import pytest
import torch

from arl.config import LoRAConfig
from arl.model.lora import apply_lora, hf_model
from arl.model.packed import packed_logprobs
from arl.ops.policy_loss import policy_loss
from test_trainer_ds import LOSS, OPTIM, pack, perturbed_old, single_process_reference, tiny_model, trajectories
from two_rank import spawn_ranks

# 2 DeepSpeed ranks; every test on one pytest worker: the module fixture (~24 s) is run once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("seqpar_ds")]
STAGES = (0, 2, 3)


def _lora_model():
    torch.manual_seed(1)
    model = apply_lora(tiny_model(), LoRAConfig(r=4))
    with torch.no_grad():  # B = 0 at init would leave A's gradient zero: the case would test half the adapter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def _step(tr, mbs, params, gather):
    """One rl_step; the full gradients the optimizer sees, the metrics, the parameters after."""
    from deepspeed.utils import safe_get_full_grad

    import deepspeed
    from arl.trainer.dist import all_mean

    olds = [perturbed_old(o, mb) for mb, o in zip(mbs, tr.old_logprobs(mbs))]
    grads, opt_step = {}, tr.engine.optimizer.step

    def step_seeing_grads(*a, **kw):
        if not grads:
            grads.update({n: safe_get_full_grad(p).detach().clone() for n, p in params if p.requires_grad})
        return opt_step(*a, **kw)

    tr.engine.optimizer.step = step_seeing_grads
    metrics = all_mean(tr.rl_step(mbs, olds, LOSS), tr.device, sums=("tokens_kept",))
    tr.engine.optimizer.step = opt_step
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if gather else torch.no_grad()
    with ctx:
        state = {n: p.detach().clone() for n, p in params}
    return metrics, grads, state


def _cases(rank, world, result_dir):
    from arl.trainer import PolicyTrainer

    out = {}
    for stage in STAGES:
        torch.manual_seed(0)
        tr = PolicyTrainer(tiny_model(), optim=OPTIM, zero_stage=stage, total_steps=10, sequence_parallel=world)
        step = pack(trajectories(), tr.sp.dp)  # one replica: the whole batch
        mbs = tr.sp.replica_parts(step.ranks)[rank]
        # chunks that straddle the shard boundary (the last token of rank 0's half and the first of rank 1's)
        half = [(int(mb.cu_seqlens[-1]) + 1) // 2 for mb in mbs]
        straddling = sum(int(mb.chunk_ids[h - 1] >= 0 and mb.chunk_ids[h - 1] == mb.chunk_ids[h])
                         for mb, h in zip(mbs, half))
        metrics, grads, state = _step(tr, mbs, list(tr.module.named_parameters()), stage == 3)
        out[stage] = {"metrics": metrics, "grads": grads, "state": state, "straddling": straddling,
                      "tokens": sum(int(mb.cu_seqlens[-1]) for mb in mbs)}  # every micro-batch whole on both ranks
    # LoRA at ZeRO 2: the adapters' gradients are the whole batch's
    tr = PolicyTrainer(_lora_model(), optim=OPTIM, zero_stage=2, total_steps=10, sequence_parallel=world)
    mbs = tr.sp.replica_parts(pack(trajectories(), tr.sp.dp).ranks)[rank]
    metrics, grads, state = _step(tr, mbs, list(tr.module.named_parameters()), False)
    out["lora"] = {"metrics": metrics, "grads": grads}
    # exact resume: step 1, checkpoint, step 2 -- against a fresh trainer loading the checkpoint, step 2
    ckpt = os.path.join(result_dir, "ckpt")
    batches = [tr.sp.replica_parts(pack(trajectories(seed=s), tr.sp.dp).ranks)[rank] for s in (1, 2)]
    runs = []
    for resumed in (False, True):
        torch.manual_seed(0)
        tr = PolicyTrainer(tiny_model(), optim=OPTIM, zero_stage=2, total_steps=10, sequence_parallel=world)
        if resumed:
            tr.load_checkpoint(ckpt, "s1")
        else:
            _step(tr, batches[0], list(tr.module.named_parameters()), False)
            tr.save_checkpoint(ckpt, "s1", {})
        runs.append(_step(tr, batches[1], list(tr.module.named_parameters()), False)[2])
    out["resume"] = runs
    out["critic"] = _critic_case(rank, world)
    return out


def _critic_case(rank, world):
    """The critic (GAE, shared value head) at ZeRO 2: the same step's gradients with the world as two
    data-parallel ranks (each its own micro-batches, whole) and as one SP group (every micro-batch
    split over both ranks): the value points each rank reads come from both shards."""
    from test_critic_ds import CRITIC, LOSS as CLOSS, batches

    from arl.trainer import PolicyTrainer
    from arl.trainer.rank import update_on_batch

    res = {}
    for sp in (1, world):
        torch.manual_seed(0)
        tr = PolicyTrainer(tiny_model(), optim=OPTIM, zero_stage=2, total_steps=10, objective="critic",
                           critic=CRITIC, sequence_parallel=sp)
        mbs = tr.sp.replica_parts(batches(tr.sp.dp)[0])[rank]
        params = list(tr.module.named_parameters())
        grads, opt_step = {}, tr.engine.optimizer.step

        def seeing(*a, _g=grads, _s=opt_step, **kw):
            from deepspeed.utils import safe_get_full_grad

            if not _g:
                _g.update({n: safe_get_full_grad(p).detach().clone() for n, p in params})
            return _s(*a, **kw)

        tr.engine.optimizer.step = seeing
        metrics = update_on_batch(tr, mbs, CLOSS, updates=1)
        res[sp] = {"grads": grads, "value_loss": metrics.get("value/loss"),
                   "points": sum(int(mb.critic["pos"].numel()) for mb in mbs if mb.critic is not None)}
    return res


def _worker(rank, world, port, result_dir):
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    out = _cases(rank, world, result_dir)
    if rank == 0:
        torch.save(out, os.path.join(result_dir, "sp.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("seqpar")
    spawn_ranks(_worker, d)
    return torch.load(d / "sp.pt", weights_only=False)


def _close_grads(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for n, g in want.items():  # the suite's fp32 gradient tolerance, relative to each parameter's scale
        assert g.abs().max() > 0, n
        torch.testing.assert_close(got[n], g, atol=1e-5 * g.abs().max().item(), rtol=1e-4, msg=n)


@pytest.mark.parametrize("stage", STAGES)
def test_sequence_parallel_step_equals_whole_batch_step(stage, sp_run):
    sp = sp_run[stage]
    loss, gn, grads, state, _ = single_process_reference()
    assert sp["tokens"] == sum(len(t.tokens) for t in trajectories())
    assert sp["straddling"] >= 1, "no chunk straddles a shard boundary: the case this test is for"
    assert sp["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    _close_grads(sp["grads"], grads)
    for n, p in state.items():
        torch.testing.assert_close(sp["state"][n], p, atol=1e-5, rtol=1e-4, msg=n)


def test_sequence_parallel_lora_gradients_equal_whole_batch(sp_run):
    model = _lora_model()
    total, grads = 0.0, {}
    for mb in pack(trajectories(), 1).ranks[0]:
        with torch.no_grad():
            old = perturbed_old(packed_logprobs(hf_model(model), mb.token_ids, mb.cu_seqlens)[0], mb)
        logp, _ = packed_logprobs(hf_model(model), mb.token_ids, mb.cu_seqlens)
        out = policy_loss(logp, old, config=LOSS, **{**mb.loss_kwargs(), "advantages": mb.advantages.float()})
        out.loss.backward()
        total += out.loss.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(".lora_" in n for n in grads)
    assert sp_run["lora"]["metrics"]["loss"] == pytest.approx(total, rel=1e-5, abs=1e-7)
    _close_grads(sp_run["lora"]["grads"], grads)


def test_sequence_parallel_resume_is_bitwise(sp_run):
    uninterrupted, resumed = sp_run["resume"]
    assert sorted(uninterrupted) == sorted(resumed)
    for n in uninterrupted:
        assert torch.equal(uninterrupted[n], resumed[n]), n


def test_sequence_parallel_critic_gradients_equal_data_parallel(sp_run):
    dp, sp = sp_run["critic"][1], sp_run["critic"][2]
    assert sp["points"] > 0 and sp["value_loss"] == pytest.approx(dp["value_loss"], rel=1e-5)
    assert any("value_head" in n for n in sp["grads"]), sorted(sp["grads"])
    _close_grads(sp["grads"], dp["grads"])

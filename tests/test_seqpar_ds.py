"""trainer.sequence_parallel on DeepSpeed: 2 gloo ranks that split every micro-batch along the
sequence (one data-parallel replica) take the same step as one process on the whole batch -- the
same loss, the same full gradient of every parameter just before the optimizer applies it, the same
update -- at ZeRO 0, 2 and 3, with chunks and sequences split across the shard boundary."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from test_trainer_ds import LOSS, OPTIM, pack, perturbed_old, single_process_reference, tiny_model, trajectories

pytestmark = pytest.mark.slow  # 2 DeepSpeed ranks per case


def _worker(rank, world, port, stage, result_dir):
    from deepspeed.utils import safe_get_full_grad

    import deepspeed
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import all_mean, init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    torch.manual_seed(0)
    tr = PolicyTrainer(tiny_model(), optim=OPTIM, zero_stage=stage, total_steps=10, sequence_parallel=world)
    step = pack(trajectories(), tr.sp.dp)  # one replica: the whole batch
    mbs = tr.sp.replica_parts(step.ranks)[rank]
    tokens = sum(int(mb.cu_seqlens[-1]) for mb in mbs)  # every micro-batch whole on both ranks
    # chunks that straddle the shard boundary (the last token of rank 0's half and the first of rank 1's)
    half = [(int(mb.cu_seqlens[-1]) + 1) // 2 for mb in mbs]
    straddling = sum(int(mb.chunk_ids[h - 1] >= 0 and mb.chunk_ids[h - 1] == mb.chunk_ids[h]) for mb, h in zip(mbs, half))
    olds = [perturbed_old(o, mb) for mb, o in zip(mbs, tr.old_logprobs(mbs))]
    params = list(tr.module.named_parameters())
    grads, opt_step = {}, tr.engine.optimizer.step

    def step_seeing_grads(*a, **kw):
        if not grads:
            grads.update({n: safe_get_full_grad(p).detach().clone() for n, p in params})
        return opt_step(*a, **kw)

    tr.engine.optimizer.step = step_seeing_grads
    metrics = all_mean(tr.rl_step(mbs, olds, LOSS), tr.device, sums=("tokens_kept",))
    ctx = deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else torch.no_grad()
    with ctx:
        state = {n: p.detach().clone() for n, p in params}
    if rank == 0:
        torch.save({"metrics": metrics, "grads": grads, "state": state, "tokens": tokens,
                    "straddling": straddling},
                   os.path.join(result_dir, "sp.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_sequence_parallel_step_equals_whole_batch_step(stage, tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(2, free_port(), stage, str(tmp_path)), nprocs=2, join=True)
    sp = torch.load(tmp_path / "sp.pt", weights_only=False)
    loss, gn, grads, state, _ = single_process_reference()
    assert sp["tokens"] == sum(len(t.tokens) for t in trajectories())
    assert sp["straddling"] >= 1, "no chunk straddles a shard boundary: the case this test is for"
    assert sp["metrics"]["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for n, g in grads.items():  # the suite's fp32 gradient tolerance, relative to each parameter's scale
        torch.testing.assert_close(sp["grads"][n], g, atol=1e-5 * g.abs().max().item(), rtol=1e-4, msg=n)
    for n, p in state.items():
        torch.testing.assert_close(sp["state"][n], p, atol=1e-5, rtol=1e-4, msg=n)

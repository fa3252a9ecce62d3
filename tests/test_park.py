"""Parking (``trainer.offload.while_generating``, arl/trainer/park.py): a trainer whose state goes to
host memory after every update and back before the next gives the same weights, bitwise, as one that
never parks (ZeRO 1 and 2, full fine-tuning with a reference model and LoRA), and a checkpoint saved
parked loads into the same state.  On this CPU machine DeepSpeed's moves are host to host, so this
checks the bookkeeping; the GPU memory it frees is bench/gpu_check.sh's."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from arl.config import ConfigError, LoRAConfig, OptimConfig, load_config

from test_lora import _micro_batches
from two_rank import tiny_qwen


@pytest.mark.parametrize("overrides,msg", [
    ([], "needs layout.colocate: true and rollout.staleness: 0"),
    (["layout.colocate=true", "rollout.staleness=0", "trainer.zero_stage=0"], "needs trainer.zero_stage 1 or 2 \\(got 0"),
    (["layout.colocate=true", "rollout.staleness=0", "trainer.zero_stage=3"], "needs trainer.zero_stage 1 or 2 \\(got 3"),
])
def test_parking_config_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config("configs/tiny_cpu.yaml", ["trainer.offload.while_generating=true", *overrides])
    ok = load_config("configs/tiny_cpu.yaml", ["trainer.offload.while_generating=true", "layout.colocate=true",
                                               "rollout.staleness=0"])
    assert ok.trainer.offload.while_generating


def _trainer(stage: int, lora: bool, park: bool):
    from arl.model.lora import apply_lora
    from arl.trainer import PolicyTrainer

    torch.manual_seed(0)
    model = apply_lora(tiny_qwen(), LoRAConfig(r=4)) if lora else tiny_qwen()
    return PolicyTrainer(model, optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=stage, total_steps=10,
                         ref_model=None if lora else tiny_qwen(), park_while_generating=park)


def _worker(rank, world, port, result_dir):
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    mbs, loss = _micro_batches()
    res = {}
    for stage in (1, 2):
        for lora in (False, True):
            out = {}
            for park in (False, True):
                tr = _trainer(stage, lora, park)
                for _ in range(3):  # update, then the engine's turn (parked), as the rank's step runs it
                    with tr.awake():
                        tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
                    tr.park()
                if park:
                    assert tr.parking.parked and tr.parking.num_parks == 3
                    tag = f"s{stage}{lora}"
                    tr.save_checkpoint(result_dir, tag=tag, client_state={})  # saved parked
                    again = _trainer(stage, lora, False)
                    again.load_checkpoint(result_dir, tag=tag)
                    out["loaded"] = again.full_state_dict()
                    with tr.awake():  # one more update after the checkpoint, from both
                        tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
                    again.rl_step(mbs, None, loss, ref_logps=again.ref_logprobs(mbs))
                    out["loaded_next"] = again.full_state_dict()
                else:
                    out["plain_at_3"] = tr.full_state_dict()
                    tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
                out[park] = tr.full_state_dict()
            res[(stage, lora)] = out
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow  # a gloo rank with DeepSpeed engines
def test_parked_updates_equal_resident_ones(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    start = tiny_qwen().state_dict()
    for key, out in res.items():
        assert any(not torch.equal(out[False][k], start[k]) for k in start), key  # the steps moved the weights
        for k, v in out[False].items():
            assert torch.equal(out[True][k], v), (key, k)
            assert torch.equal(out["loaded"][k], out["plain_at_3"][k]), (key, "checkpoint", k)
            assert torch.equal(out["loaded_next"][k], v), (key, "after the checkpoint", k)


def _gpu_worker(rank, world, port, result_dir):
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cuda")
    mbs, loss = _micro_batches()
    res = {}
    for lora in (False, True):
        out = {}
        for park in (False, True):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()  # what an earlier trainer may have left
            tr = _trainer(2, lora, park)
            for _ in range(2):
                with tr.awake():
                    tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                tr.park()
                out.setdefault("allocated", []).append((before - base, torch.cuda.memory_allocated() - base))
            with tr.awake():
                tr.rl_step(mbs, None, loss, ref_logps=tr.ref_logprobs(mbs))
            out[park] = tr.full_state_dict()
            del tr
            torch.cuda.empty_cache()
        res[lora] = out
    torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.sh runs it)")
def test_parking_frees_the_gpu(tmp_path):
    """ZeRO-2 on one NCCL rank: parked, the trainer holds (nearly) nothing on the GPU, and its updates
    equal the resident trainer's."""
    from arl.procs import free_port

    mp.spawn(_gpu_worker, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    for lora, out in res.items():
        for before, after in out["allocated"][len(out["allocated"]) // 2:]:  # the parking trainer's
            assert after < 0.1 * before, (lora, before, after)
        for k, v in out[False].items():
            torch.testing.assert_close(out[True][k], v, rtol=0, atol=1e-6, msg=f"lora={lora} {k}")

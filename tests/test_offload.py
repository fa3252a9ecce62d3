"""ZeRO-Offload (trainer.offload): on 2 gloo ranks the update with the optimizer (ZeRO-2) or the
optimizer and the parameters (ZeRO-3) in host memory equals the update without, and the config
refuses offloads its ZeRO stage cannot do, in one line."""
import os

import pytest
import torch
import torch.multiprocessing as mp

from arl.config import ConfigError, OffloadConfig, OptimConfig, load_config

from test_lora import _micro_batches
from two_rank import tiny_qwen


def test_offload_needs_its_zero_stage():
    with pytest.raises(ConfigError, match="trainer.offload.optimizer: cpu needs trainer.zero_stage >= 1"):
        load_config("configs/tiny_cpu.yaml", ["trainer.offload.optimizer=cpu", "trainer.zero_stage=0"])
    with pytest.raises(ConfigError, match="trainer.offload.params: cpu needs trainer.zero_stage 3 \\(got 2\\)"):
        load_config("configs/tiny_cpu.yaml", ["trainer.offload.params=cpu"])
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.offload.optimizer=cpu"])
    assert cfg.trainer.offload == OffloadConfig(optimizer="cpu")


def _worker(rank, world, port, result_dir):
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env

    set_rank_env(rank, world, port)
    init_distributed("cpu")
    mine, loss = _micro_batches(world, rank)
    res = {}
    for stage, off in ((2, None), (2, OffloadConfig(optimizer="cpu")), (3, None),
                       (3, OffloadConfig(optimizer="cpu", params="cpu"))):
        tr = PolicyTrainer(tiny_qwen(), optim=OptimConfig(lr=1e-2, grad_clip=1e6), zero_stage=stage, total_steps=10,
                           offload=off)
        ref = tiny_qwen()
        for _ in range(2):
            tr.rl_step(mine, None, loss.model_copy(update={"kl_beta": 0.0}))
        state = tr.full_state_dict()
        if rank == 0:
            res[(stage, off is not None)] = {k: v.clone() for k, v in state.items()}
            res["start"] = ref.state_dict()
    if rank == 0:
        torch.save(res, os.path.join(result_dir, "res.pt"))


@pytest.mark.slow
def test_offloaded_update_equals_the_resident_one(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    for stage in (2, 3):
        plain, off = res[(stage, False)], res[(stage, True)]
        assert any(not torch.equal(plain[k], res["start"][k]) for k in plain)  # the steps moved the weights
        for k, v in plain.items():
            torch.testing.assert_close(off[k], v, rtol=0, atol=1e-6, msg=f"ZeRO-{stage} {k}")

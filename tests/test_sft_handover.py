"""The SFT warm start hands the model to RL's trainer cleanly: ``run_sft`` removes its engine's
ZeRO gradient hooks, so each RL backward feeds RL's engine alone (with the SFT engine's hooks left
on the parameters, every RL backward also copied each gradient into the SFT engine's reduce bucket,
never flushed).  One DeepSpeed rank over gloo."""
import json
import os
import sys

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

pytestmark = pytest.mark.slow  # a spawned DeepSpeed rank


def _hooks(model) -> list:
    return sorted({len(p._post_accumulate_grad_hooks or {}) for p in model.parameters() if p.requires_grad})


def _worker(_index, port, result_dir):
    import torch

    from arl.config import load_config
    from arl.data.packer import PackerConfig, pack_step
    from arl.data.trajectory import Trajectory
    from arl.trainer import PolicyTrainer
    from arl.trainer.dist import init_distributed, set_rank_env
    from arl.trainer.sft import run_sft

    from two_rank import tiny_qwen

    set_rank_env(0, 1, port)
    init_distributed("cpu")
    cfg = load_config(None, ["trainer.world_size=1", "trainer.zero_stage=2", "sft.steps=2", "sft.batch_size=2",
                             "sft.micro_batch_tokens=64"])
    g = torch.Generator().manual_seed(0)

    def demo(n=12):
        return Trajectory(tokens=torch.randint(0, 64, (n,), generator=g).tolist(), chunk_ids=[-1] * 4 + [0] * (n - 4),
                          rollout_logp=[0.0] * n, reward=1.0, group_id=0, turns=[(4, n)])

    model = tiny_qwen()
    run_sft(cfg, model, [demo() for _ in range(4)], rank=0, world=1)
    after_sft = _hooks(model)
    rl = PolicyTrainer(model, optim=cfg.trainer.optim, zero_stage=2, total_steps=4)
    packed = pack_step([demo() for _ in range(4)], PackerConfig(token_budget=24, num_ranks=1, seed=0))
    m = rl.sft_step(packed.ranks[0], normalizer=packed.normalizer)  # several backwards, one update
    with open(os.path.join(result_dir, "out.json"), "w") as f:
        json.dump({"after_sft": after_sft, "with_rl": _hooks(model), "grad_norm": m["grad_norm"]}, f)


def test_the_sft_engine_lets_go_of_the_parameters(tmp_path):
    from arl.procs import free_port

    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["after_sft"] == [0]  # every parameter free of the SFT engine's hooks
    assert out["with_rl"] == [1]  # RL's engine, once per parameter
    assert out["grad_norm"] > 0

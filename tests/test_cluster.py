"""Roles of the processes that torchrun / the deepspeed launcher start (arl/launch.py)."""
import os

import pytest

from arl.config import load_config
from arl.launch import assign_role

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(name, *over):
    return load_config(os.path.join(ROOT, "configs", name), list(over))


def test_gpu_roles_two_nodes():
    cfg = _cfg("qwen2.5-7b_2x8gpu.yaml")
    lay = cfg.layout
    roles = [assign_role(cfg, r, 16, r % 8, 8) for r in range(16)]
    trainers = [r for r in roles if r.kind == "trainer"]
    # trainer ranks 0..world-1, each once, node-major, on the GPUs after the rollout GPUs
    assert sorted(r.trainer_rank for r in trainers) == list(range(cfg.trainer.world_size))
    assert all(r.local_rank >= lay.rollout_gpus and r.trainer_world == cfg.trainer.world_size for r in trainers)
    assert [r.trainer_rank for r in trainers if r.node == 1][0] == lay.trainer_gpus
    # one engine per node, led by its local rank 0, over that node's rollout GPUs
    leaders = [r for r in roles if r.kind == "rollout"]
    assert [(r.node, r.local_rank, r.engine) for r in leaders] == [(0, 0, 0), (1, 0, 1)]
    assert cfg.num_engines() == 2
    assert all(r.rollout_devices == list(range(lay.rollout_gpus)) for r in leaders)
    assert sum(r.kind == "idle" for r in roles) == 2 * (lay.rollout_gpus - 1)


def test_cpu_roles_and_wrong_world():
    cfg = _cfg("tiny_cpu.yaml")
    roles = [assign_role(cfg, r, 3, r, 3) for r in range(3)]
    assert [r.kind for r in roles] == ["rollout", "trainer", "trainer"]
    assert [r.trainer_rank for r in roles[1:]] == [0, 1]
    with pytest.raises(ValueError, match="WORLD_SIZE: the CPU layout needs trainer.world_size \\+ rollout engines = 3"):
        assign_role(cfg, 0, 2, 0, 2)
    two = _cfg("tiny_cpu.yaml", "rollout.engines=2")
    roles = [assign_role(two, r, 4, r, 4) for r in range(4)]
    assert [(r.kind, r.engine, r.trainer_rank) for r in roles] == [
        ("rollout", 0, None), ("rollout", 1, None), ("trainer", None, 0), ("trainer", None, 1)]
    gpu = _cfg("qwen2.5-7b_8gpu.yaml")
    with pytest.raises(ValueError, match="WORLD_SIZE: layout 1 node\\(s\\) x 8 GPUs needs 8 processes"):
        assign_role(gpu, 0, 4, 0, 4)


def test_plain_python_refuses_gpu_layout():
    from arl.launch import launch

    with pytest.raises(ValueError, match="launch them with torchrun or deepspeed"):
        launch(_cfg("qwen2.5-7b_8gpu.yaml"))


def test_engine_count_config_errors():
    from arl.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.engines: GPU layouts run one engine per node"):
        _cfg("qwen2.5-7b_2x8gpu.yaml", "rollout.engines=3")
    with pytest.raises(ConfigError, match="tasks_per_step = 16 must be a multiple of the number of engines \\(3\\)"):
        _cfg("tiny_cpu.yaml", "rollout.engines=3")
    with pytest.raises(ConfigError, match="rollout.weight_sync: 'file' writes to trainer rank 0's /dev/shm"):
        _cfg("qwen2.5-7b_2x8gpu.yaml", "rollout.weight_sync=file")
    assert _cfg("tiny_cpu.yaml").num_engines() == 1 and _cfg("qwen2.5-7b_8gpu.yaml").num_engines() == 1


def test_rollout_hooks_carry_the_stabilizers_judges_across_spawn():
    """The launcher hands the rollout process the stabilizers' judges (the rollout package imports no
    stabilizer): none when off; when on, picklable (spawn) and built from the run's config."""
    import pickle

    from arl.config import load_config
    from arl.launch import rollout_hooks
    from arl.stabilizers import DynamicSampler, IPAResampler

    off = rollout_hooks(load_config(None))
    assert off.make_sampler is None and off.start_chooser is None
    cfg = load_config(None, ["stabilizers.dynamic_sampling.enabled=true", "stabilizers.dynamic_sampling.max_rounds=2",
                             "stabilizers.ipa.enabled=true", "stabilizers.turn_credit.enabled=false",
                             "stabilizers.ipa.mode=parallel"])
    hooks = pickle.loads(pickle.dumps(rollout_hooks(cfg)))
    sampler = hooks.make_sampler(3)
    assert isinstance(sampler, DynamicSampler) and sampler.target == 3 and sampler.cfg.max_rounds == 2
    assert isinstance(hooks.start_chooser, IPAResampler) and hooks.start_chooser.start_chunks(4) == [1, 2, 3]

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


def _sleep_forever(*_):
    import time
    time.sleep(3600)


def test_dead_rollout_process_stops_the_trainers_with_one_line():
    """A rollout process killed from outside (OOM) sends nothing: the trainers, waiting for its
    batches, are stopped after the grace period instead of hanging."""
    import signal
    import time

    import torch.multiprocessing as mp

    from arl.launch import _join_watching
    from arl.procs import RunFailed

    ctx = mp.get_context("spawn")
    roll = ctx.Process(target=_sleep_forever, name="arl-rollout-0")
    roll.start()
    trainers = mp.start_processes(_sleep_forever, nprocs=1, join=False, start_method="spawn")
    os.kill(roll.pid, signal.SIGKILL)
    roll.join(10)
    t0 = time.monotonic()
    with pytest.raises(RunFailed, match=r"rollout process arl-rollout-0 \(pid \d+\) died with signal 9; the trainer"):
        _join_watching(trainers, [roll], grace_s=1.0)
    assert time.monotonic() - t0 < 30
    trainers.processes[0].join(10)
    assert not trainers.processes[0].is_alive()


def test_killed_trainer_rank_is_one_line():
    import signal

    import torch.multiprocessing as mp

    from arl.launch import _join_watching
    from arl.procs import RunFailed

    trainers = mp.start_processes(_sleep_forever, nprocs=1, join=False, start_method="spawn")
    os.kill(trainers.processes[0].pid, signal.SIGKILL)
    with pytest.raises(RunFailed, match="trainer process 0 terminated with signal SIGKILL"):
        _join_watching(trainers, [])


def _start_grandchild_then_sleep(q):
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    q.put(p.pid)
    time.sleep(3600)


def test_orphans_of_a_killed_rollout_process_are_killed():
    """vLLM's engine-core process outlives a SIGKILLed rollout process; the launcher adopts and ends it."""
    import signal

    import psutil
    import torch.multiprocessing as mp

    from arl.procs import adopt_orphans, kill_orphans

    adopt_orphans()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    roll = ctx.Process(target=_start_grandchild_then_sleep, args=(q,))
    roll.start()
    grandchild = psutil.Process(q.get(timeout=60))
    os.kill(roll.pid, signal.SIGKILL)
    roll.join(10)
    assert grandchild.is_running() and grandchild.ppid() == os.getpid()  # adopted, not init's
    kill_orphans(keep={c.pid for c in psutil.Process().children() if c.pid != grandchild.pid})
    grandchild.wait(10)


def test_queue_key_is_required_across_nodes_and_derived_on_one(monkeypatch, capsys):
    """The torchrun/deepspeed path's queue server: a launch over several nodes without ARL_AUTHKEY
    is one line before anything starts; on one node a key is derived and inherited by children."""
    from arl.launch import check_distributed_launch
    from arl.train import main

    monkeypatch.setenv("ARL_AUTHKEY", "")  # unset (and restored after the test: set_authkey writes it)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match=r"ARL_AUTHKEY: a launch over several nodes .* the same value on every node"):
        check_distributed_launch()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert main(["--config", "configs/tiny_cpu.yaml"]) == 2  # one line, exit 2, no process started
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.train: config error: ARL_AUTHKEY: a launch over several nodes") and "\n" not in err
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "16")  # the deepspeed launcher's name for it: one node
    check_distributed_launch()
    key = os.environ["ARL_AUTHKEY"]
    assert len(key) == 64
    monkeypatch.setenv("ARL_AUTHKEY", "given")
    check_distributed_launch()
    assert os.environ["ARL_AUTHKEY"] == "given"

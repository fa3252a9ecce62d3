"""The local launcher (arl/launch.py): what it refuses, what it hands the rollout processes, and how
it ends when one of its processes dies."""
import os

import pytest

from arl.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(name, *over):
    return load_config(os.path.join(ROOT, "configs", name), list(over))


def test_plain_python_refuses_gpu_layout():
    from arl.launch import launch

    with pytest.raises(ValueError, match="run on Ray \\(launcher: auto or ray\\), not launcher: local"):
        launch(_cfg("qwen2.5-7b_8gpu.yaml"))
    with pytest.raises(ValueError, match="launcher: local runs the CPU layout and the colocated GPU node"):
        _cfg("qwen2.5-7b_8gpu.yaml", "launcher=local")


def test_engine_count_config_errors():
    from arl.config import ConfigError

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

    # this worker's other descendants (the session's Ray cluster, tests/ray_session.py) are not ours
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    adopt_orphans()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    roll = ctx.Process(target=_start_grandchild_then_sleep, args=(q,))
    roll.start()
    grandchild = psutil.Process(q.get(timeout=60))
    os.kill(roll.pid, signal.SIGKILL)
    roll.join(10)
    assert grandchild.is_running() and grandchild.ppid() == os.getpid()  # adopted, not init's
    kill_orphans(keep=before | {c.pid for c in psutil.Process().children() if c.pid != grandchild.pid})
    grandchild.wait(10)

"""The local launcher (``launcher: local``, asked for: ``auto`` is Ray, arl/cluster), without Ray: this
process builds the model directory and the SFT demonstrations (arl/prepare.py), spawns one rollout
process per engine (``arl.rollout.worker``) and ``trainer.world_size`` trainer ranks
(``arl.trainer.rank``) on this machine, and waits.  Colocated (``layout.colocate``), the trainer
ranks start once every engine is up and asleep.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch.multiprocessing as mp

from .config import TrainConfig
from .prepare import model_dir_for, rollout_hooks, sft_demos, write_config
from .procs import RunFailed, adopt_orphans, exit_process, free_port, kill_orphans
from .rollout.colocate import ready_file, wait_ready
from .rollout.worker import rollout_process
from .trainer.rank import trainer_rank

# ---------------------------------------------------------------- one machine: spawn
ROLLOUT_DEATH_GRACE_S = 60.0  # a failing rollout's report reaches the trainers well within this

def launch(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run SFT + RL with ``cfg`` on this machine; returns the run directory (metrics.jsonl,
    checkpoints, hf/)."""
    if cfg.layout.device != "cpu" and not cfg.layout.colocate:
        raise ValueError("layout.device: 'cuda' configs with separate rollout and trainer GPUs run on Ray "
                         "(launcher: auto or ray), not launcher: local")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    adopt_orphans()
    model_dir = model_dir_for(cfg)
    run_dir = write_config(cfg)
    demos = sft_demos(cfg, model_dir)
    ctx = mp.get_context("spawn")
    batches, orders = ctx.Queue(), [ctx.Queue() for _ in range(cfg.num_engines())]
    me = os.getpid()  # children die with the launcher (die_with_parent), also when it is SIGKILLed
    hooks = rollout_hooks(cfg)
    ready = [ready_file(f"spawn{me}", e) for e in range(len(orders))]
    rolls = [ctx.Process(target=rollout_process, args=(cfg.model_dump(), model_dir, batches, q, me, e, hooks,
                                                       str(ready[e])),
                         daemon=False, name=f"arl-rollout-{e}")  # vLLM may start helper processes
             for e, q in enumerate(orders)]
    for roll in rolls:
        roll.start()
    try:
        if cfg.layout.colocate:  # the engines start (and go to sleep) before the trainers take the device
            wait_ready(ready, alive=lambda: all(r.is_alive() for r in rolls))
        sync_addr = ("127.0.0.1", free_port())  # used with rollout.weight_sync: group
        trainers = mp.start_processes(_spawned_trainer_rank, args=(cfg.trainer.world_size, free_port(), cfg.model_dump(),
                                                                   model_dir, demos, batches, orders, resume, me, sync_addr),
                                      nprocs=cfg.trainer.world_size, join=False, start_method="spawn")
        _join_watching(trainers, rolls)
    finally:
        _reap(rolls)
        kill_orphans(keep=_resource_tracker_pids())
        for f in ready:
            f.unlink(missing_ok=True)
    return run_dir


def _join_watching(trainers, rolls, grace_s: float = ROLLOUT_DEATH_GRACE_S) -> None:
    """Wait for the trainer ranks (raising as ``mp.spawn`` does when one fails) while watching the
    rollout processes: one that dies without a clean exit (killed, OOM) sends nothing, and the
    trainers would wait for its batches forever.  They get ``grace_s`` to end on their own (a rollout
    that reported its error lets them save), then are stopped with one line naming the process."""
    dead_since = None
    while not _join_once(trainers):
        dead = [r for r in rolls if r.exitcode not in (None, 0)]
        if not dead:
            continue
        dead_since = dead_since or time.monotonic()
        if time.monotonic() - dead_since >= grace_s:
            for p in trainers.processes:
                if p.is_alive():
                    p.terminate()
            r = dead[0]
            how = f"signal {-r.exitcode}" if r.exitcode < 0 else f"exit code {r.exitcode}"
            raise RunFailed(f"rollout process {r.name} (pid {r.pid}) died with {how}; the trainer ranks were "
                               f"stopped {grace_s:.0f} s later (resume from the last checkpoint with --resume)")


def _join_once(trainers) -> bool:
    """One second of ``trainers.join``; a rank killed by a signal (OOM) is one line, not a traceback."""
    try:
        return trainers.join(timeout=1.0)
    except mp.ProcessExitedException as e:
        raise RunFailed(f"trainer {e} (resume from the last checkpoint with --resume)") from None


def _resource_tracker_pids() -> set:
    """multiprocessing's resource tracker: it ends by itself and cleans up after the others."""
    from multiprocessing import resource_tracker
    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def _reap(procs) -> None:
    """The rollout processes, once the trainers are done: a minute to stop on their own, then
    terminated."""
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()


def _spawned_trainer_rank(*args) -> None:
    """A trainer rank started by this launcher: once it has finished and closed everything, the
    process ends without a finalization that could abort after the fact (``exit_process``).  A
    failure raises as usual, for the launcher to report."""
    trainer_rank(*args)
    exit_process(0)

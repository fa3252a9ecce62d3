"""The launchers: where the processes of a run come from, and what each one is.

``python -m arl.train`` started plainly (the CPU layout, or a colocated GPU node): ``launch`` builds
the model directory and the SFT demonstrations, spawns one rollout process per engine
(``arl.rollout.worker``) and ``trainer.world_size`` trainer ranks (``arl.trainer.rank``), and waits.
Colocated (``layout.colocate``), the trainer ranks start once every engine is up and asleep.

Started by torchrun or the deepspeed launcher (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT set; multi-node through ``--hostfile``): ``launch_distributed`` gives this
process its role (``assign_role``):

* GPU layout, per node: local ranks ``[0, rollout_gpus)`` are rollout devices, the next
  ``trainer_gpus`` are trainer ranks (trainer rank = node x trainer_gpus + local index).  Every
  node's local rank 0 leads that node's vLLM engine (engine index = node) over its rollout GPUs
  (tensor parallel x vLLM data parallel); the other rollout processes have nothing to run and exit
  (vLLM starts its own workers on those GPUs).
* Colocated GPU layout (``layout.colocate``, one node): every local rank is a trainer rank on its
  own GPU; local rank 0 also spawns the node's rollout process, whose engine spans all the node's
  GPUs and sleeps while the trainer steps (``arl.rollout.colocate``).
* CPU layout (how this launcher is tested here): ranks 0..E-1 are the rollout processes of the
  ``rollout.engines`` = E engines, the next trainer.world_size ranks the trainer ranks.

Channels, all from MASTER_ADDR and MASTER_PORT (the launcher's own port is not used by anyone):
  +1  the trainers' process group (DeepSpeed: gloo or NCCL), over trainer ranks only;
  +2  the batch queue and one order queue per engine between the rollout leaders and trainer
      rank 0 (a ``multiprocessing`` manager served by trainer rank 0 on MASTER_ADDR, authenticated with
      ARL_AUTHKEY: required over several nodes, derived on one, ``set_authkey``);
  +3  the weight-sync group: trainer rank 0 broadcasts into the workers of every engine.

Both launchers hand the rollout side the stabilizers' judges (``rollout_hooks``): the rollout
package acts on them without importing the stabilizers.
"""
from __future__ import annotations

import functools
import hashlib
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import List, Optional

import torch.multiprocessing as mp
from filelock import FileLock
from transformers import AutoTokenizer

from .config import TrainConfig
from .data import load_demonstrations
from .env import check_env, env_class, env_kwargs
from .env.door import check_door
from .env.tool_parsers import PARSERS
from .model.resolve import resolve_model
from .model.tiny import build_tiny_model
from .procs import RunFailed, adopt_orphans, exit_process, free_port, kill_orphans
from .rollout.colocate import ready_file, wait_ready
from .rollout.engine_args import check_engine_kwargs
from .rollout.lora_sync import lora_sync_mode
from .rollout.episode import ChatFormat
from .rollout.expert import sft_demonstrations, sft_source
from .rollout.worker import RolloutHooks, rollout_process, task_set
from .stabilizers import DynamicSampler, IPAResampler
from .trainer.rank import trainer_rank

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------- what every launcher prepares
def model_dir_for(cfg: TrainConfig) -> str:
    """The model directory: ``model.name_or_path`` (a local directory, or a hub id from the local
    HF cache: ``resolve_model``), or the locally built tiny model."""
    if cfg.model.name_or_path != "tiny":
        return resolve_model(cfg.model.name_or_path)
    return str(build_tiny_model(config=cfg.model.tiny, seed=cfg.seed, envs=(cfg.env.name,)))


def sft_demos(cfg: TrainConfig, model_dir: str) -> list:
    if sft_source(cfg) is None:
        return []
    return sft_demonstrations(cfg, ChatFormat(AutoTokenizer.from_pretrained(model_dir)))


def _parser_model_dir(cfg: TrainConfig) -> Optional[str]:
    """The model directory when the tool-call format is vLLM's (its parsers read the tokenizer)."""
    name = cfg.env.tool_parser or cfg.env.kwargs.get("parser")
    return model_dir_for(cfg) if isinstance(name, str) and name not in PARSERS else None


def _local_tokenizer(cfg: TrainConfig):
    """The model's tokenizer when the model is on this machine (not the tiny model: its template
    writes no tool calls), else None: the dry run may plan a model that is not converted yet."""
    if cfg.model.name_or_path == "tiny":
        return None
    try:
        return AutoTokenizer.from_pretrained(resolve_model(cfg.model.name_or_path))
    except Exception:  # not here (the dry run warns about that itself) or not loadable
        return None


def preflight(cfg: TrainConfig) -> list:
    """What ``--dry-run`` checks, and every launcher before it starts a process: the task dataset
    loads, the environment (with its reward function and tools) is made and resets its first task,
    the SFT demonstrations have a source, ``rollout.engine_kwargs`` names only vLLM engine arguments
    arl does not set itself.  Returns one line per check; one-line ValueError at the first failure."""
    lines = []
    check_engine_kwargs(cfg.rollout.engine_kwargs)  # by name against vLLM's EngineArgs (nothing imported)
    if cfg.rollout.engine_kwargs:
        lines.append(f"engine OK: rollout.engine_kwargs {', '.join(cfg.rollout.engine_kwargs)} are vLLM engine "
                     "arguments")
    lora_sync = lora_sync_mode(cfg)  # adapter for a model vLLM serves no adapters for: one line, now
    if lora_sync is not None:
        lines.append(f"lora sync OK: {lora_sync} (rollout.lora_sync: {cfg.rollout.lora_sync or 'null, the default'})")
    tasks = task_set(cfg)
    needs = env_class(cfg.env.name).needs_task
    if tasks is None and needs:
        raise ValueError(f"env.dataset: environment {cfg.env.name!r} plays tasks from data; give env.dataset")
    if tasks is not None:
        lines.append(f"tasks OK: {tasks.describe()}")
    check_env(cfg.env.name, env_kwargs(cfg.env, _parser_model_dir(cfg)),
              task=tasks.train_row(0) if tasks is not None else None)
    lines.append(f"env OK: {cfg.env.name} (made with its kwargs, first task reset)")
    source, demos = sft_source(cfg), None
    if source == "dataset":
        demos = load_demonstrations(cfg.sft.dataset, key="sft.dataset")
        lines.append(f"sft OK: {len(demos)} demonstrations in {cfg.sft.dataset}")
    elif source == "expert":
        lines.append(f"sft OK: demonstrations from the {cfg.env.name!r} expert")
    # the user's demonstrations and reward function, tried once (a bug here must not look like a
    # model that never succeeds)
    lines += check_door(cfg.env.name, env_kwargs(cfg.env, _parser_model_dir(cfg)),
                        tasks.train_row(0) if tasks is not None else None,
                        tasks.origin(0) if tasks is not None else "seed 0", demos, str(cfg.sft.dataset),
                        tokenizer=_local_tokenizer(cfg))
    return lines


def rollout_hooks(cfg: TrainConfig) -> RolloutHooks:
    """The stabilizers' judges the rollout side acts on (picklable, for spawned processes)."""
    s = cfg.stabilizers
    return RolloutHooks(
        make_sampler=functools.partial(DynamicSampler, s.dynamic_sampling) if s.dynamic_sampling.enabled else None,
        start_chooser=IPAResampler(s.ipa) if s.ipa.enabled else None)


def _write_config(cfg: TrainConfig) -> Path:
    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    return run_dir


# ---------------------------------------------------------------- one machine: spawn
ROLLOUT_DEATH_GRACE_S = 60.0  # a failing rollout's report reaches the trainers well within this

def launch(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run SFT + RL with ``cfg`` on this machine; returns the run directory (metrics.jsonl,
    checkpoints, hf/)."""
    if cfg.layout.device != "cpu" and not cfg.layout.colocate:
        raise ValueError("layout.device: 'cuda' configs with separate rollout and trainer GPUs run one process per "
                         "GPU: launch them with torchrun or deepspeed (see README), not plain python")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    adopt_orphans()
    model_dir = model_dir_for(cfg)
    run_dir = _write_config(cfg)
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


# ---------------------------------------------------------------- torchrun / deepspeed: roles
def under_launcher() -> bool:
    """True when started by torchrun or the deepspeed launcher (one process per device)."""
    return all(k in os.environ for k in LAUNCH_ENV)


@dataclass
class Role:
    kind: str  # "trainer", "rollout" (an engine's leader) or "idle"
    node: int
    local_rank: int
    trainer_rank: Optional[int] = None
    trainer_world: int = 0
    rollout_devices: List[int] = field(default_factory=list)  # local GPU indices of the engine
    engine: Optional[int] = None  # the engine a rollout leader runs (colocated: the trainer rank that starts it)


def assign_role(cfg: TrainConfig, rank: int, world: int, local_rank: int, local_world: int) -> Role:
    lay, n_tr, n_eng = cfg.layout, cfg.trainer.world_size, cfg.num_engines()
    if lay.device == "cpu":
        if world != n_tr + n_eng:
            raise ValueError(f"WORLD_SIZE: the CPU layout needs trainer.world_size + rollout engines = {n_tr + n_eng} "
                             f"processes (one rollout process per engine + the trainer ranks), got {world}")
        if rank < n_eng:
            return Role("rollout", 0, local_rank, trainer_world=n_tr, engine=rank)
        return Role("trainer", 0, local_rank, trainer_rank=rank - n_eng, trainer_world=n_tr)
    if world != lay.nodes * lay.gpus_per_node or local_world != lay.gpus_per_node:  # (colocated too)
        raise ValueError(f"WORLD_SIZE: layout {lay.nodes} node(s) x {lay.gpus_per_node} GPUs needs "
                         f"{lay.nodes * lay.gpus_per_node} processes, {lay.gpus_per_node} per node; the launcher "
                         f"started {world}, {local_world} per node")
    node = rank // local_world
    if lay.colocate:  # every GPU a trainer rank; local rank 0 also starts the node's engine over all of them
        return Role("trainer", node, local_rank, trainer_rank=node * lay.trainer_gpus + local_rank, trainer_world=n_tr,
                    rollout_devices=list(range(lay.gpus_per_node)) if local_rank == 0 else [],
                    engine=node if local_rank == 0 else None)
    if local_rank < lay.rollout_gpus:
        if local_rank == 0:
            return Role("rollout", node, local_rank, trainer_world=n_tr, rollout_devices=list(range(lay.rollout_gpus)),
                        engine=node)
        return Role("idle", node, local_rank, trainer_world=n_tr)
    i = local_rank - lay.rollout_gpus
    return Role("trainer", node, local_rank, trainer_rank=node * lay.trainer_gpus + i, trainer_world=n_tr)


def set_authkey(multi_node: bool) -> None:
    """The queue server's key, in ARL_AUTHKEY for this process and the ones it starts.  A launch on
    one node without it derives one (the server listens on MASTER_ADDR, the node's own address, and
    the key keeps other launches out); a launch over several nodes needs ARL_AUTHKEY set, the same
    secret on every node: one line otherwise, before anything starts."""
    if os.environ.get("ARL_AUTHKEY"):
        return
    if multi_node:
        raise ValueError("ARL_AUTHKEY: a launch over several nodes authenticates trainer rank 0's queue server "
                           "with it: export ARL_AUTHKEY=$(openssl rand -hex 16), the same value on every node "
                           "(or use launcher: ray)")
    seed = f"arl:{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    os.environ["ARL_AUTHKEY"] = hashlib.sha256(seed.encode()).hexdigest()


def _authkey() -> bytes:
    key = os.environ.get("ARL_AUTHKEY")
    if not key:
        raise RuntimeError("ARL_AUTHKEY: not set (launch_distributed sets it)")
    return key.encode()


class _QueueManager(BaseManager):
    pass


def serve_queues(host: str, port: int, engines: int = 1):
    """Trainer rank 0: serve the ``batches`` queue and one ``orders_<e>`` queue per engine on
    ``host`` (MASTER_ADDR: this node's address the others connect to, not every interface); returns
    them (local objects: the batch queue and the list of order queues)."""
    batches, orders = queue.Queue(), [queue.Queue() for _ in range(engines)]
    _QueueManager.register("batches", callable=lambda: batches)
    for e, q in enumerate(orders):
        _QueueManager.register(f"orders_{e}", callable=lambda q=q: q)
    server = _QueueManager(address=(host, port), authkey=_authkey()).get_server()
    threading.Thread(target=server.serve_forever, daemon=True, name="arl-queues").start()
    return batches, orders


def connect_queues(host: str, port: int, engine: int = 0, timeout_s: float = 600.0):
    """Engine ``engine``'s rollout leader: proxies of trainer rank 0's batch queue and of its own
    order queue (retries until trainer rank 0 serves them)."""
    _QueueManager.register("batches")
    _QueueManager.register(f"orders_{engine}")
    deadline = time.time() + timeout_s
    while True:
        m = _QueueManager(address=(host, port), authkey=_authkey())
        try:
            m.connect()
            return m.batches(), getattr(m, f"orders_{engine}")()
        except (ConnectionRefusedError, OSError):
            if time.time() > deadline:
                raise RuntimeError(f"rollout: trainer rank 0's queues at {host}:{port} did not come up "
                                   f"within {timeout_s:.0f} s") from None
            time.sleep(0.5)


def shared_model_dir(cfg: TrainConfig) -> str:
    """``model_dir_for`` once per machine: the processes of a node share the built tiny model."""
    lock = Path(os.environ.get("TMPDIR", "/tmp")) / f"arl-model-{os.environ['MASTER_PORT']}.lock"
    with FileLock(str(lock)):
        return model_dir_for(cfg)


def _local_world() -> int:
    """Processes of this launch on this node: torchrun sets LOCAL_WORLD_SIZE, deepspeed LOCAL_SIZE."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or os.environ["WORLD_SIZE"])


def check_distributed_launch() -> None:
    """What a torchrun / deepspeed launch needs before its processes start work (one-line ValueError)."""
    set_authkey(multi_node=int(os.environ["WORLD_SIZE"]) > _local_world())


def launch_distributed(cfg: TrainConfig, resume: bool = False) -> Optional[Path]:
    """This process's part of a torchrun / deepspeed launch; returns the run directory on the
    process that wrote it (trainer rank 0), None elsewhere."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = _local_world()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    set_authkey(multi_node=world > local_world)
    role = assign_role(cfg, rank, world, local_rank, local_world)
    if role.kind == "idle":
        return None
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = shared_model_dir(cfg)
    sync_addr = (host, port + 3)
    if role.kind == "rollout":
        if cfg.layout.device == "cuda":  # the engine's workers see this node's rollout GPUs only
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, role.rollout_devices))
        batches, orders = connect_queues(host, port + 2, role.engine)
        ready = ready_file(str(port), role.engine)
        try:
            rollout_process(cfg.model_dump(), model_dir, batches, orders, parent_pid=os.getppid(), engine=role.engine,
                            hooks=rollout_hooks(cfg), ready_file=str(ready))
        finally:
            ready.unlink(missing_ok=True)
        return None
    # a trainer rank: DeepSpeed sees the trainer ranks only (their own group on port + 1); the
    # device stays LOCAL_RANK (rollout GPUs come first on every node)
    r = role.trainer_rank
    batches = orders = None
    if r == 0:
        _write_config(cfg)
        batches, orders = serve_queues(host, port + 2, cfg.num_engines())
    engine_proc = None
    if cfg.layout.colocate:  # the engines start and go to sleep before any trainer rank loads
        # GPU: this node's engine (a child of local rank 0); CPU: every engine's rollout rank
        engines = [role.node] if cfg.layout.device == "cuda" else range(cfg.num_engines())
        if role.engine is not None:
            ready_file(str(port), role.engine).unlink(missing_ok=True)
            engine_proc = mp.get_context("spawn").Process(
                target=_colocated_rollout, args=(cfg.model_dump(), model_dir, host, port + 2, role.engine,
                                                 str(ready_file(str(port), role.engine))),
                daemon=False, name=f"arl-rollout-{role.engine}")
            engine_proc.start()
        wait_ready([ready_file(str(port), e) for e in engines],
                   alive=engine_proc.is_alive if engine_proc is not None else (lambda: True))
    os.environ.update(RANK=str(r), WORLD_SIZE=str(role.trainer_world), MASTER_PORT=str(port + 1),
                      LOCAL_WORLD_SIZE=str(cfg.layout.trainer_gpus or role.trainer_world))
    # torchrun's agent hosts the store of ITS world; this group's store is hosted by trainer rank 0
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    demos = sft_demos(cfg, model_dir)
    try:
        trainer_rank(r, role.trainer_world, None, cfg.model_dump(), model_dir, demos, batches, orders, resume,
                     sync_addr=sync_addr)
    finally:
        if engine_proc is not None:
            _reap([engine_proc])
            ready_file(str(port), role.engine).unlink(missing_ok=True)
    return Path(cfg.output_dir) if r == 0 else None


def _colocated_rollout(cfg_dict: dict, model_dir: str, host: str, queue_port: int, engine: int, ready: str) -> None:
    """The colocated node's rollout process, a child of its local rank 0 (it sees every GPU of the node)."""
    cfg = TrainConfig.model_validate(cfg_dict)
    batches, orders = connect_queues(host, queue_port, engine)
    rollout_process(cfg_dict, model_dir, batches, orders, parent_pid=os.getppid(), engine=engine,
                    hooks=rollout_hooks(cfg), ready_file=ready)

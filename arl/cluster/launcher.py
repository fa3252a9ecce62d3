"""``launcher: ray``: the run's trainer ranks and rollout engines as Ray actors in placement groups
(arl/cluster/placement.py), the batches and orders through one mailbox actor; docs/ray.md.

* Cluster: ``ray.address`` (else Ray's RAY_ADDRESS, which ``ray job submit`` sets for its
  entrypoint) joins that cluster; neither starts a local one (no dashboard, token auth with a token
  made for this run, never written to disk, its files under $TMPDIR/arl-ray-<pid>) and stops it at
  the end, on an error too.  On a joined cluster the actors get the driver's ARL_* / VLLM_* and
  thread settings (``actor_env``) and work in the driver's directory where their node has it.
* Trainer ranks: one actor per bundle of the trainers' group, each running ``trainer_rank`` with
  its own ``torch.distributed`` group; rank 0's actor picks MASTER_ADDR/MASTER_PORT (and the
  weight-sync port) on its node and the others are handed them.
* Engines: one actor per engine's group running ``rollout_process`` (the same loop as the other
  launchers).  ``batches`` and every ``orders`` are boxes of one mailbox actor
  (arl/cluster/mailbox.py): the items travel through Ray (authenticated), no socket of arl's own
  accepts pickles.  Each trainer rank fetches its micro-batches from Ray's object store (rank 0
  posts their references in the rank's box), not from rank 0 over ``torch.distributed``.

The CPU layout (what the tests run) and GPU layouts with separate trainer and rollout GPUs (each
actor sees its bundle's GPUs as Ray sets CUDA_VISIBLE_DEVICES; an engine's tensor / data parallel
workers are processes of its actor); colocated GPU layouts plan with ``--dry-run`` only (docs/ray.md).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from ..prepare import model_dir_for, rollout_hooks, sft_demos, write_config
from ..procs import free_port
from ..rollout.worker import rollout_process
from ..trainer.faults import KILL_ENV, LAUNCHER_PGID_ENV
from ..trainer.rank import trainer_rank
from . import reaper
from .mailbox import mailboxes
from .placement import NO_ROLE, ROLE_RESOURCES, Node, local_cpus, placement

AFTER_TRAINERS_S = 60.0  # how long the engines get to stop on their own once the trainers are done


class _Where:
    def node(self) -> str:
        """The Ray node this actor runs on (where the launcher records it)."""
        import ray

        return ray.get_runtime_context().get_node_id()


class TrainerActor(_Where):
    """One trainer rank (wrapped with ``ray.remote`` at launch: ray is imported only then)."""

    def master(self) -> tuple:
        """Rank 0: (host, rendezvous port, weight-sync port) on this actor's node."""
        import ray

        return ray.util.get_node_ip_address(), free_port(), free_port()

    def run(self, rank: int, world: int, master: tuple, cfg_dict: dict, model_dir: str, demos: list, batches,
            orders, parts, resume: bool, env: dict, cwd: str) -> None:
        host, port, sync_port = master
        os.environ.update(env)  # the test hook's kill point (fault_env), when set
        _enter(cwd)
        cuda = cfg_dict["layout"]["device"] == "cuda"  # Ray shows each rank its own GPU as device 0
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0" if cuda else str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=host, MASTER_PORT=str(port))
        _reported(trainer_rank, rank, world, None, cfg_dict, model_dir, demos, batches, orders, resume, None,
                  (host, sync_port), parts)


class EngineActor(_Where):
    """One rollout engine: the rollout process's loop, in this actor.  Ray restarts it when it dies
    (``ray.engine_restarts``) and runs ``run`` again; the new one tells trainer rank 0, which sends
    it where to start and the current weights (arl/trainer/restarts.py)."""

    def run(self, cfg_dict: dict, model_dir: str, batches, orders, engine: int, hooks, cwd: str) -> None:
        import ray

        _enter(cwd)
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not restarted:
            batches = _kill_hook(batches, engine)
        _reported(rollout_process, cfg_dict, model_dir, batches, orders, None, engine, hooks, None, restarted)


def _enter(cwd: str) -> None:
    """Work in the driver's directory (relative paths of the config) where this node has it: the
    same machine or a shared filesystem."""
    if os.path.isdir(cwd):
        os.chdir(cwd)


FORWARDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "HF_HOME", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "TMPDIR")


def actor_env() -> dict:
    """What a joined cluster's actors get from the driver's environment (a local cluster's inherit
    all of it): arl's and vLLM's switches and the thread and cache settings; never Ray's own."""
    return {k: v for k, v in os.environ.items() if k.startswith(("ARL_", "VLLM_")) or k in FORWARDED_ENV}


def join_address(cfg: TrainConfig) -> Optional[str]:
    """The cluster this run joins: ``ray.address``, else RAY_ADDRESS (Ray's own convention; ``ray job
    submit`` sets it for the entrypoint); None: arl starts a local cluster."""
    return cfg.ray.address or os.environ.get("RAY_ADDRESS") or None


def ray_temp_dir() -> Path:
    """A local cluster's session files (sockets, logs), this driver's own: no clash with another
    run's cluster; removed when the run ends well, kept (and named) when it fails."""
    return Path(tempfile.gettempdir()) / f"arl-ray-{os.getpid()}"


class ActorFailed(RuntimeError):
    """An actor's error as one line of text: the exception itself may not pickle (pydantic's do
    not), and Ray would then report only that."""


def _reported(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        raise ActorFailed(" ".join(f"{type(e).__name__}: {e}".split())[:2000]) from None


KILL_ENGINE_ENV = "ARL_TEST_KILL_ENGINE"  # test-only, "<engine>:<n>": that engine dies after its n-th batch


class _KillAfter:
    """Test hook: the batches channel of an engine that SIGKILLs its own process right after handing
    over its ``n``-th batch (a first incarnation only: the restarted engine lives)."""

    def __init__(self, channel, n: int):
        self.channel, self.n = channel, n

    def put(self, item) -> None:
        self.channel.put(item)
        if item[0] == "batch":
            self.n -= 1
            if self.n == 0:
                print(f"arl.train: test hook: engine {item[1]} kills itself ({KILL_ENGINE_ENV})", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def get(self, block: bool = True, timeout=None):
        return self.channel.get(block, timeout)


def _kill_hook(batches, engine: int):
    spec = os.environ.get(KILL_ENGINE_ENV, "")
    e, _, n = spec.partition(":")
    return _KillAfter(batches, int(n)) if spec and int(e) == engine else batches


def fault_env() -> dict:
    """Test only: the resume tests' kill point (arl/trainer/faults.py) for the trainer actors, with
    this driver's process group, which the hook kills as a user's kill of the job would."""
    if not os.environ.get(KILL_ENV):
        return {}
    return {KILL_ENV: os.environ[KILL_ENV], LAUNCHER_PGID_ENV: str(os.getpgrp())}


_REAPER = None  # the watcher of the local cluster this process started (arl/cluster/reaper.py)


def local_gpus(cfg: TrainConfig) -> int:
    """GPUs of the local cluster arl starts: this machine's on a GPU layout (CUDA_VISIBLE_DEVICES
    respected), none on the CPU layout."""
    if cfg.layout.device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def start_ray(cfg: TrainConfig, cpus: int, gpus: int = 0):
    """Ray, connected: a local cluster started here (``ray.address`` null), or the given one.
    Returns the ``ray`` module; ray is imported here, after RAY_AUTH_* are set, because Ray reads
    its auth mode when it is first imported."""
    address = join_address(cfg)
    if address is None:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)  # this run's: never written to disk
        _refresh_auth_if_imported()
        import ray

        global _REAPER
        _REAPER = reaper.start()  # this cluster goes with this process, even when it is SIGKILLed
        # Ray binds its services to the node's address, not loopback: the token is what keeps others out
        # address "local": a new cluster even when `ray start` left one this host would find
        ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False,
                 object_store_memory=512 * 2**20, namespace="arl", configure_logging=False,
                 _temp_dir=str(ray_temp_dir()))
        print(f"arl.train: ray: local cluster started ({cpus} CPUs{f', {gpus} GPUs' if gpus else ''}, token auth, "
              "no dashboard)", flush=True)
        return ray
    import ray

    try:
        ray.init(address=address, namespace="arl", configure_logging=False)
    except ConnectionError as e:  # also a cluster that refuses our token
        raise RuntimeError(f"ray.address: cannot join {address!r} ({str(e).splitlines()[0]}); is "
                           "RAY_AUTH_TOKEN the cluster's token?") from None
    print(f"arl.train: ray: joined the cluster at {address}", flush=True)
    return ray


def _refresh_auth_if_imported() -> None:
    """Ray already imported (a test, a library): make it re-read RAY_AUTH_MODE / RAY_AUTH_TOKEN."""
    if "ray" not in sys.modules:
        return
    # Ray 2.60 keeps these private; both are re-exported by authentication_token_setup
    from ray._private.authentication.authentication_token_setup import AuthenticationTokenLoader, _enable_token_auth

    _enable_token_auth()
    AuthenticationTokenLoader.instance().reset_cache()


def _check_reachable(address: str, timeout_s: float) -> None:
    """host:port answers within ``timeout_s`` (``auto`` is Ray's to resolve): one line, not a hang."""
    if address == "auto" or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise RuntimeError(f"ray.address: {address} unreachable within {timeout_s:g} s "
                           f"(ray.connect_timeout_s): {e}") from None


def cluster_of(ray) -> list:
    """The connected cluster's alive nodes as placement nodes: CPUs, GPUs and the node role their
    custom resources give (arl/cluster/placement.py: both or, on a cluster without any, neither:
    role-less; one: that role; neither on a cluster with roles: no bundle)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    roles = any(r in n["Resources"] for n in alive for r in ROLE_RESOURCES.values())
    return [Node(i, int(n["Resources"].get("CPU", 0)), int(n["Resources"].get("GPU", 0)),
                 _role(n["Resources"]) if roles else None, node_id=n["NodeID"], host=n.get("NodeManagerAddress", ""))
            for i, n in enumerate(alive)]


def _live_nodes(cfg: TrainConfig, ray) -> list:
    """The joined cluster's nodes; one line when ``ray.nodes`` asks for node roles that none of
    them carries (their bundles would otherwise land anywhere)."""
    nodes = cluster_of(ray)
    if any(g.role for g in cfg.ray.nodes) and not any(n.role for n in nodes):
        res = " / ".join(ROLE_RESOURCES.values())
        raise ValueError(f"ray.nodes gives node roles, but no node of the cluster at {join_address(cfg)} has {res}: "
                         "start those nodes with ray start --resources '{\"arl_trainer\": 1}' (or "
                         "'{\"arl_rollout\": 1}'), or drop the roles (docs/ray.md)")
    return nodes


def _role(resources: dict):
    has = [role for role, r in ROLE_RESOURCES.items() if resources.get(r, 0) > 0]
    return None if len(has) == len(ROLE_RESOURCES) else has[0] if has else NO_ROLE


def _check_file_sync(cfg: TrainConfig, placed) -> None:
    """File weight sync goes through trainer rank 0's /dev/shm: every engine must be on its machine
    (simulated nodes on one machine are; a real second machine is not)."""
    if cfg.rollout.sync_mode(cfg.layout.device, bool(cfg.layout.colocate)) != "file":
        return
    host = next(n.host for n in placed.nodes if placed.trainers[0] in n.bundles)
    far = [b.name for n in placed.nodes for b in n.bundles if b.role == "rollout" and n.host != host]
    if far:
        raise ValueError(f"rollout.weight_sync: file needs every engine on trainer rank 0's machine ({host}); "
                         f"{far[0]} is placed on another; use 'group'")


def launch_ray(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run SFT + RL with ``cfg`` on Ray; returns the run directory (as the local launcher, ``arl.launch.launch``)."""
    if cfg.layout.device == "cuda" and cfg.layout.colocate:
        raise ValueError("launcher: ray does not run colocated GPU layouts yet (--dry-run prints their placement); "
                         "run them with launcher: local (docs/ray.md)")
    cpus, gpus = local_cpus(cfg), local_gpus(cfg)
    address = join_address(cfg)
    if address is not None:  # before the model is built: an unreachable cluster fails at once
        _check_reachable(address, cfg.ray.connect_timeout_s)
    else:  # a local cluster is one node (this machine), sized to fit; one line if it cannot
        placed = placement(cfg, [Node(0, cpus, gpus)], "local cluster (this machine)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_dir = model_dir_for(cfg)
    run_dir = write_config(cfg)
    demos = sft_demos(cfg, model_dir)
    ray = start_ray(cfg, cpus=cpus, gpus=gpus)
    actors: list = []
    ended_well = False
    try:
        if address is not None:  # the plan on the live nodes (their roles); one line if it cannot fit
            placed = placement(cfg, _live_nodes(cfg, ray), source=f"the cluster at {address}")
            _check_file_sync(cfg, placed)
            print("arl.train: ray: " + placed.render().replace("\n", "\narl.train: ray: "), flush=True)
        _run(ray, cfg, placed, model_dir, demos, resume, actors, run_dir, joined=address is not None)
        ended_well = True
    finally:
        for a in actors:  # at once: workers left to notice a stopped cluster linger for tens of seconds
            ray.kill(a)
        ray.shutdown()  # a local cluster stops with it; on a joined one our groups go
        if address is None:
            _drop_temp_dir(ended_well)
    return run_dir


def _drop_temp_dir(ended_well: bool) -> None:
    """The local cluster's files: gone after a run that ended well; kept, with a line saying where,
    for one that failed (its actors' logs are there)."""
    d = ray_temp_dir()
    if ended_well:
        shutil.rmtree(d, ignore_errors=True)
    elif d.exists():
        print(f"arl.train: ray: the local cluster's logs are kept in {d}", flush=True)


def _run(ray, cfg: TrainConfig, placed, model_dir: str, demos: list, resume: bool, actors: list,
         run_dir: Path, joined: bool = False) -> None:
    """Places the groups and actors (appended to ``actors``, for the caller to kill), records where
    each runs (``ray_actors.json``) and runs them."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

    # unnamed groups and actors: two runs on one cluster do not collide; they go when this driver does
    roles = placed.roles  # the bundles then ask for their role's resource: only nodes of that role take them
    trainers_pg = placement_group([b.ray_resources(roles) for b in placed.trainers], strategy="PACK")
    engine_pgs = [placement_group([b.ray_resources(roles)], strategy="STRICT_PACK") for b in placed.engines]
    try:
        ray.get([pg.ready() for pg in [trainers_pg, *engine_pgs]], timeout=cfg.ray.connect_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"ray: the placement groups were not scheduled within {cfg.ray.connect_timeout_s:g} s "
                           "(ray.connect_timeout_s): the cluster lacks the resources --dry-run lists") from None
    # the mailbox holds no bundle (num_cpus 0): it must not take the CPUs the groups reserved
    box, batches, orders, parts = mailboxes(ray, len(placed.engines), len(placed.trainers))
    cfg_dict, hooks = cfg.model_dump(), rollout_hooks(cfg)
    Engine, Trainer = ray.remote(EngineActor), ray.remote(TrainerActor)
    # joined: set before the worker starts (torch reads the thread settings when it is imported)
    extra = {"runtime_env": {"env_vars": actor_env()}} if joined else {}
    restarts = cfg.ray.engine_restarts  # the interrupted run() is run again on the restarted actor
    engines = [Engine.options(num_cpus=b.cpus, num_gpus=b.gpus, max_restarts=restarts, max_task_retries=restarts,
                              **extra,
                              scheduling_strategy=InGroup(placement_group=pg, placement_group_bundle_index=0)).remote()
               for b, pg in zip(placed.engines, engine_pgs)]
    ranks = [Trainer.options(num_cpus=b.cpus, num_gpus=b.gpus, **extra,
                             scheduling_strategy=InGroup(placement_group=trainers_pg, placement_group_bundle_index=i))
             .remote() for i, b in enumerate(placed.trainers)]
    actors += engines + ranks + [box]
    _record_nodes(ray, run_dir, {f"engine {e}": a for e, a in enumerate(engines)} |
                  {f"trainer rank {r}": a for r, a in enumerate(ranks)})
    cwd = os.getcwd()
    running = {a.run.remote(cfg_dict, model_dir, batches, orders[e], e, hooks, cwd): f"engine {e}"
               for e, a in enumerate(engines)}
    master = ray.get(ranks[0].master.remote())
    world = len(ranks)
    env = fault_env()
    running.update({a.run.remote(r, world, master, cfg_dict, model_dir, demos, batches, orders, parts, resume, env,
                                 cwd):
                    f"trainer rank {r}" for r, a in enumerate(ranks)})
    _wait(ray, running)


def _record_nodes(ray, run_dir: Path, named: dict) -> None:
    """Where each actor runs, as its node says (not the plan): one line and ``ray_actors.json``
    ({actor: {node_id, host, role}}; role: the node's, from its resources)."""
    ids = dict(zip(named, ray.get([a.node.remote() for a in named.values()])))
    nodes = {n.node_id: n for n in cluster_of(ray)}
    where = {name: {"node_id": i, "host": nodes[i].host if i in nodes else "",
                    "role": (nodes[i].role or "any") if i in nodes else "?"} for name, i in ids.items()}
    (run_dir / "ray_actors.json").write_text(json.dumps(where, indent=2))
    print("arl.train: ray: actors on nodes " + ", ".join(f"{k} {v['node_id'][:8]}" for k, v in where.items()),
          flush=True)


def _wait(ray, running: dict) -> None:
    """Until every trainer rank is done; the first actor to fail ends the run with one line (its
    own traceback is in the log above).  The engines then get ``AFTER_TRAINERS_S`` to stop."""
    pending = dict(running)
    while any(name.startswith("trainer") for name in pending.values()):
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            name = pending.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"ray: {name} failed: {_first_line(e)}") from None
    deadline = time.time() + AFTER_TRAINERS_S
    while pending and time.time() < deadline:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.time()))
        for ref in done:
            pending.pop(ref)


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, ActorFailed):
        return str(cause)
    if isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__

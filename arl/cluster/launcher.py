"""``launcher: ray``: the run's trainer ranks and rollout engines as Ray actors in placement groups
(arl/cluster/placement.py), the batches and orders through one mailbox actor; docs/ray.md.

* Cluster: ``ray.address`` (else Ray's RAY_ADDRESS, which ``ray job submit`` sets for its
  entrypoint) joins that cluster; neither starts a local one (no dashboard, token auth with a token
  made for this run, never written to disk, its files under $TMPDIR/arl-ray-<pid>) and stops it at
  the end, on an error too.  On a joined cluster the actors get the driver's ARL_* / VLLM_* and
  thread settings (``actor_env``) and work in the driver's directory where their node has it.
* Actors (arl/cluster/actors.py): one per bundle of the trainers' group, each running
  ``trainer_rank`` with its own ``torch.distributed`` group (rank 0's actor picks
  MASTER_ADDR/MASTER_PORT and the weight-sync port on its node; the others are handed them), and
  one per engine running ``rollout_process`` (the same loop as the local launcher's).  ``batches`` and every ``orders`` are boxes of one mailbox actor
  (arl/cluster/mailbox.py): the items travel through Ray (authenticated), no socket of arl's own
  accepts pickles.  Each trainer rank fetches its micro-batches from Ray's object store (rank 0
  posts their references in the rank's box), not from rank 0 over ``torch.distributed``.

Every layout: the CPU layout (what the tests run); GPU layouts with separate trainer and rollout
GPUs (each actor sees its bundle's GPUs as Ray sets CUDA_VISIBLE_DEVICES; an engine's tensor / data
parallel workers are processes of its actor); colocated GPU layouts (``layout.colocate``): the
trainer actors hold the GPUs (one bundle each), engine ``e`` runs in the bundle of trainer rank
``e * g`` without a GPU request of its own and is shown its trainers' GPUs (``place_actors``).
Colocated, the trainer ranks start once every engine is up and asleep (the mailbox's ready box).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from ..config import TrainConfig
from ..prepare import model_dir_for, rollout_hooks, sft_demos, write_config
from . import reaper
from .actors import ActorFailed, place_actors, restart_env
from .mailbox import mailboxes
from .placement import NO_ROLE, ROLE_RESOURCES, Node, local_cpus, placement

AFTER_TRAINERS_S = 60.0  # how long the engines get to stop on their own once the trainers are done
ENGINE_UP_S = 1800.0
PEER_DEATH_S = 30.0  # a rank failing on its group waits this long for the peer death behind it  # a colocated engine's start (model load, profiling, CUDA graphs), as the local launcher's

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
        session_token_auth()
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


def session_token_auth() -> None:
    """Token auth with a token of this process's own, for a local cluster it starts: never written to
    disk (a plain ``ray.init()`` with RAY_AUTH_MODE unset writes one to ~/.ray/auth_token)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    _refresh_auth_if_imported()


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
    # (colocated engines have no bundle: they are on their trainer ranks' node, rank 0's: STRICT_PACK)
    far = [b.name for n in placed.nodes for b in n.bundles if b.role == "rollout" and n.host != host]
    if far:
        raise ValueError(f"rollout.weight_sync: file needs every engine on trainer rank 0's machine ({host}); "
                         f"{far[0]} is placed on another; use 'group'")


def launch_ray(cfg: TrainConfig, resume: bool = False) -> Path:
    """Run SFT + RL with ``cfg`` on Ray; returns the run directory (as the local launcher, ``arl.launch.launch``)."""
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
    """Places the groups, then runs the actors in them (appended to ``actors``, for the caller to
    kill); a trainer actor that dies starts every actor again from the last complete checkpoint, up
    to ``ray.trainer_restarts`` times (arl/trainer/restarts.py)."""
    from ray.util.placement_group import placement_group

    # unnamed groups and actors: two runs on one cluster do not collide; they go when this driver does
    roles = placed.roles  # the bundles then ask for their role's resource: only nodes of that role take them
    trainers_pg = placement_group([b.ray_resources(roles) for b in placed.trainers], strategy=placed.trainer_strategy)
    engine_pgs = [placement_group([b.ray_resources(roles)], strategy="STRICT_PACK") for b in placed.engines]
    try:
        ray.get([pg.ready() for pg in [trainers_pg, *engine_pgs]], timeout=cfg.ray.connect_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"ray: the placement groups were not scheduled within {cfg.ray.connect_timeout_s:g} s "
                           "(ray.connect_timeout_s): the cluster lacks the resources --dry-run lists") from None
    _restarting(ray, cfg, actors, lambda attempt, dead: _attempt(
        ray, cfg, placed, (trainers_pg, engine_pgs), model_dir, demos, resume or attempt > 0, actors, run_dir, joined,
        restart_env(attempt, dead)))


def _restarting(ray, cfg: TrainConfig, actors: list, attempt_fn) -> None:
    """``attempt_fn(attempt, dead_rank)`` until it returns; after a ``TrainerDied`` the attempt's
    actors are killed (every rank: the live ones wait on the dead one; every engine: the new ranks
    resume from the checkpoint, whose batches in flight the engines must make again) and the next
    attempt starts, at most ``ray.trainer_restarts`` times; then the death ends the run, one line."""
    attempt, dead = 0, None
    while True:
        try:
            attempt_fn(attempt, dead)
            return
        except TrainerDied as e:
            limit = cfg.ray.trainer_restarts
            if attempt >= limit:
                raise RuntimeError(f"ray: {e}; {attempt} of ray.trainer_restarts = {limit} restarts used, the run "
                                   "stops (the same command with --resume auto continues it)") from None
            attempt, dead = attempt + 1, e.rank
            for a in actors:  # the placement groups stay: the new actors take the same bundles
                ray.kill(a)
            actors.clear()
            print(f"arl.train: ray: {e}; trainer restart {attempt} of {limit}: every trainer rank and engine "
                  "again, from the last complete checkpoint", flush=True)


def _attempt(ray, cfg: TrainConfig, placed, groups: tuple, model_dir: str, demos: list, resume: bool, actors: list,
             run_dir: Path, joined: bool, env: dict) -> None:
    """One attempt of the run: the mailbox and the actors in the placement ``groups``, recorded
    (``ray_actors.json``), run to the end; ``env``: the trainer ranks' (test hooks, the restart's)."""
    trainers_pg, engine_pgs = groups
    # the mailbox holds no bundle (num_cpus 0): it must not take the CPUs the groups reserved
    mail = mailboxes(ray, placed.n_engines, len(placed.trainers))
    cfg_dict, hooks = cfg.model_dump(), rollout_hooks(cfg)
    # joined: set before the worker starts (torch reads the thread settings when it is imported)
    extra = {"runtime_env": {"env_vars": actor_env()}} if joined else {}
    ranks, engines = place_actors(ray, placed, trainers_pg, engine_pgs, cfg.ray.engine_restarts, extra)
    actors += engines + ranks + [mail.actor]
    _record_nodes(ray, run_dir, {f"engine {e}": a for e, a in enumerate(engines)} |
                  {f"trainer rank {r}": a for r, a in enumerate(ranks)})
    cwd = os.getcwd()
    colocated = bool(cfg.layout.colocate)  # the engines start (and go to sleep) before the trainers take the device
    running = {a.run.remote(cfg_dict, model_dir, mail.batches, mail.orders[e], e, hooks, cwd,
                            mail.ready if colocated else None): f"engine {e}"
               for e, a in enumerate(engines)}
    if colocated:
        _wait_up(ray, mail.ready, running, ENGINE_UP_S)
    master = ray.get(ranks[0].master.remote())
    world = len(ranks)
    running.update({a.run.remote(r, world, master, cfg_dict, model_dir, demos, mail.batches, mail.orders, mail.parts,
                                 resume, env, cwd):
                    f"trainer rank {r}" for r, a in enumerate(ranks)})
    _wait(ray, running)


def _wait_up(ray, ready, running: dict, timeout_s: float) -> None:
    """Until every engine has marked itself up (and asleep) in ``ready`` (an engine that marked, died
    and came back marks again: counted once); one line if one failed first (its own traceback is in
    the log above) or they were not up within ``timeout_s``."""
    import queue

    deadline, up = time.time() + timeout_s, set()
    while len(up) < len(running):
        try:
            up.add(ready.get(timeout=1.0)[1])
            continue
        except queue.Empty:
            pass
        done, _ = ray.wait(list(running), num_returns=1, timeout=0)
        if done:  # its mark may have come in after the last get timed out: take every mark there is first
            while True:
                try:
                    up.add(ready.get(block=False)[1])
                except queue.Empty:
                    break
            if len(up) >= len(running):
                break
        for ref in done:
            try:
                ray.get(ref)
                err = "ended"
            except ray.exceptions.RayError as e:
                err = f"failed: {_first_line(e)}"
            raise RuntimeError(f"ray: {running[ref]} {err} before its engine was up (colocated)")
        if time.time() > deadline:
            raise RuntimeError(f"rollout: the colocated engines were not up within {timeout_s:.0f} s")


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
    own traceback is in the log above), ``TrainerDied`` when a trainer actor died (its peers then
    fail too, on the broken group: the first death among them is named).  The engines then get
    ``AFTER_TRAINERS_S`` to stop."""
    pending = dict(running)
    while any(name.startswith("trainer") for name in pending.values()):
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            name = pending.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayError as e:
                died = _trainer_death(ray, name, e, pending)
                if died is not None:
                    raise died from None
                raise RuntimeError(f"ray: {name} failed: {_first_line(e)}") from None
    deadline = time.time() + AFTER_TRAINERS_S
    while pending and time.time() < deadline:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.time()))
        for ref in done:
            pending.pop(ref)


class TrainerDied(RuntimeError):
    """A trainer actor's process died (SIGKILL, OOM, a lost node): what ``ray.trainer_restarts`` restarts."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"trainer rank {rank} died ({text})")
        self.rank = rank


def _trainer_death(ray, name: str, e, pending: dict) -> "TrainerDied | None":
    """The dead trainer actor behind a trainer rank's failure: this one, or -- a rank whose peer
    died fails on the broken group, often first -- another whose death shows within
    ``PEER_DEATH_S``.  None: an error of the run itself (not restarted)."""
    if not name.startswith("trainer"):
        return None
    # the process is gone: killed, the OOM killer (ActorDiedError), Ray's memory monitor, a lost node
    deaths = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError)
    if isinstance(e, deaths):
        return TrainerDied(int(name.rsplit(" ", 1)[1]), _first_line(e))
    peers = [ref for ref, n in pending.items() if n.startswith("trainer")]
    done, _ = ray.wait(peers, num_returns=len(peers), timeout=PEER_DEATH_S) if peers else ([], [])
    for ref in done:
        try:
            ray.get(ref)
        except deaths as peer:
            return TrainerDied(int(pending[ref].rsplit(" ", 1)[1]), _first_line(peer))
        except ray.exceptions.RayError:
            pass
    return None


def _first_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None)
    if isinstance(cause, ActorFailed):
        return str(cause)
    if isinstance(cause, BaseException):
        text = f"{type(cause).__name__}: {cause}"
    else:
        text = f"{type(e).__name__}: {e}"
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__

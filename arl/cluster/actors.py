"""The actors of a Ray run (arl/cluster/launcher.py places them): a trainer rank and a rollout
engine, each running the same loop as under the local launcher, and where they go in their
placement groups (``place_actors``).  Their errors reach the driver as one line (``ActorFailed``);
the test hooks that kill an engine or a trainer rank on purpose are here too."""
from __future__ import annotations

import os
import signal
from typing import Optional

from ..procs import free_port
from ..rollout.worker import rollout_process
from ..trainer.faults import ATTEMPT_ENV, KILL_ENV, KILL_RANK_ENV, LAUNCHER_PGID_ENV
from ..trainer.restarts import DEAD_RANK_ENV
from ..trainer.rank import trainer_rank

class _Where:
    def node(self) -> str:
        """The Ray node this actor runs on (where the launcher records it)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def visible(self) -> str:
        """The GPUs this actor sees (CUDA_VISIBLE_DEVICES; a trainer rank's: the one Ray gave it)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")


class TrainerActor(_Where):
    """One trainer rank (wrapped with ``ray.remote`` at launch: ray is imported only then)."""

    def master(self) -> tuple:
        """Rank 0: (host, rendezvous port, weight-sync port) on this actor's node."""
        import ray

        return ray.util.get_node_ip_address(), free_port(), free_port()

    def run(self, rank: int, world: int, master: tuple, cfg_dict: dict, model_dir: str, demos: list, batches,
            orders, parts, resume: bool, env: dict, cwd: str) -> None:
        host, port, sync_port = master
        os.environ.update(env)  # the attempt, and the test hooks' kill points (restart_env)
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

    def __init__(self, gpus: Optional[str] = None):
        """``gpus``: a colocated engine's, its trainer ranks' (it asks Ray for none: they hold the
        bundles; Ray leaves CUDA_VISIBLE_DEVICES alone for an actor without GPUs).  A restart runs
        this again."""
        if gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus

    def run(self, cfg_dict: dict, model_dir: str, batches, orders, engine: int, hooks, cwd: str,
            ready=None) -> None:
        """``ready``: the box it marks once its engine is up (and, colocated, asleep)."""
        import ray

        _enter(cwd)
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not restarted:
            batches, orders = _kill_hook(batches, orders, engine)
        _reported(rollout_process, cfg_dict, model_dir, batches, orders, None, engine, hooks, ready, restarted)


def _enter(cwd: str) -> None:
    """Work in the driver's directory (relative paths of the config) where this node has it: the
    same machine or a shared filesystem."""
    if os.path.isdir(cwd):
        os.chdir(cwd)


class ActorFailed(RuntimeError):
    """An actor's error as one line of text: the exception itself may not pickle (pydantic's do
    not), and Ray would then report only that."""


def _reported(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as e:
        raise ActorFailed(" ".join(f"{type(e).__name__}: {e}".split())[:2000]) from None


# test-only, "<engine>:<n>" (comma-separated, one per engine): that engine dies after its n-th
# batch; "<engine>:join": on its first weight-sync group's join order, before it joins
KILL_ENGINE_ENV = "ARL_TEST_KILL_ENGINE"


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


class _KillAtJoin:
    """Test hook: the orders channel of an engine that SIGKILLs its own process when the first
    weight-sync join order comes (a first incarnation only)."""

    def __init__(self, channel, engine: int):
        self.channel, self.engine = channel, engine

    def put(self, item) -> None:
        self.channel.put(item)

    def get(self, block: bool = True, timeout=None):
        item = self.channel.get(block, timeout)
        if item[0] == "join_sync":
            print(f"arl.train: test hook: engine {self.engine} kills itself before joining the weight-sync group "
                  f"({KILL_ENGINE_ENV})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return item


def _kill_hook(batches, orders, engine: int) -> tuple:
    """(batches, orders) of engine ``engine``, one of them wrapped when KILL_ENGINE_ENV names it."""
    kills = dict(s.split(":", 1) for s in os.environ.get(KILL_ENGINE_ENV, "").split(",") if s)
    n = kills.get(str(engine))
    if n is None:
        return batches, orders
    return (batches, _KillAtJoin(orders, engine)) if n == "join" else (_KillAfter(batches, int(n)), orders)


def restart_env(attempt: int, dead_rank) -> dict:
    """The trainer actors' environment of an attempt (arl/trainer/restarts.py): its number and the
    rank whose death started it; and, test only, the kill points (arl/trainer/faults.py) with this
    driver's process group, which the mid-step hook kills as a user's kill of the job would."""
    env = {ATTEMPT_ENV: str(attempt)}
    if dead_rank is not None:
        env[DEAD_RANK_ENV] = str(dead_rank)
    if os.environ.get(KILL_RANK_ENV):
        env[KILL_RANK_ENV] = os.environ[KILL_RANK_ENV]
    if os.environ.get(KILL_ENV):
        env.update({KILL_ENV: os.environ[KILL_ENV], LAUNCHER_PGID_ENV: str(os.getpgrp())})
    return env


def place_actors(ray, placed, trainers_pg, engine_pgs: list, restarts: int, extra: dict) -> tuple:
    """(trainer rank actors, engine actors) in their groups' bundles.  Colocated, engine ``e`` runs
    in the bundle of trainer rank ``e * g`` asking for nothing (the trainers hold the GPUs) and is
    shown its trainer ranks' GPUs.  ``restarts``: Ray's restarts of a dead engine (its interrupted
    ``run`` is run again)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as InGroup

    Engine, Trainer = ray.remote(EngineActor), ray.remote(TrainerActor)
    ranks = [Trainer.options(num_cpus=b.cpus, num_gpus=b.gpus, **extra,
                             scheduling_strategy=InGroup(placement_group=trainers_pg, placement_group_bundle_index=i))
             .remote() for i, b in enumerate(placed.trainers)]
    opts = dict(max_restarts=restarts, max_task_retries=restarts, **extra)
    if placed.colocated:
        g = placed.engine_gpus
        engines = [Engine.options(num_cpus=0, num_gpus=0, **opts, scheduling_strategy=InGroup(
                       placement_group=trainers_pg, placement_group_bundle_index=e * g)).remote(gpus)
                   for e, gpus in enumerate(colocated_gpus(ray, ranks, g, placed.n_engines))]
    else:
        engines = [Engine.options(num_cpus=b.cpus, num_gpus=b.gpus, **opts, scheduling_strategy=InGroup(
                       placement_group=pg, placement_group_bundle_index=0)).remote()
                   for b, pg in zip(placed.engines, engine_pgs)]
    return ranks, engines


def colocated_gpus(ray, ranks: list, g: int, engines: int) -> list:
    """Each colocated engine's CUDA_VISIBLE_DEVICES: the GPUs Ray gave its ``g`` trainer ranks
    ``[e * g, (e + 1) * g)`` (one node's: the placement checked it)."""
    seen = ray.get([r.visible.remote() for r in ranks])
    return [",".join(seen[e * g:(e + 1) * g]) for e in range(engines)]

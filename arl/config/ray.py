"""The ``ray`` section: which Ray cluster a ``launcher: ray`` run uses, and the cluster shape that
``--dry-run`` plans against when no cluster is reachable (arl/cluster/placement.py)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class NodeGroup(_Section):
    """``count`` identical nodes of a Ray cluster."""

    count: int = Field(1, ge=1, description="Nodes of this shape.")
    cpus: int = Field(ge=1, description="Logical CPUs of each node (Ray's CPU resource).")
    gpus: int = Field(0, ge=0, description="GPUs of each node.")
    role: Optional[Literal["trainer", "rollout"]] = Field(
        None, description="trainer: only trainer ranks are placed here; rollout: only engines (dedicated rollout "
        "nodes); null: either. On a Ray cluster: the node's custom resource arl_trainer / arl_rollout (both: "
        "null; docs/ray.md).")


class RayConfig(_Section):
    """Ray placement of trainer ranks and rollout engines (``launcher: ray``; docs/ray.md)."""

    address: Optional[str] = Field(
        None, description="Ray cluster to join (auto, or host:port of the head); null: arl starts a local cluster "
        "itself (no dashboard, token auth) and stops it at the end.")
    connect_timeout_s: float = Field(
        60.0, gt=0, description="Seconds to reach ray.address (and for the placement groups to be scheduled) before "
        "the run fails with one line.")
    nodes: list[NodeGroup] = Field(
        [], description="Cluster shape --dry-run plans against (a joined cluster's live nodes replace it at launch; "
        "python -m arl.cluster.sim starts it on this machine): a list of {count, cpus, gpus, role}; empty: "
        "layout.nodes x layout.gpus_per_node (CPU layout: this machine).")
    gpus_per_engine: Optional[int] = Field(
        None, ge=1, description="GPUs of one rollout engine (tensor parallel x vLLM data parallel), one node's; "
        "null: layout.rollout_gpus, else rollout.tensor_parallel.")
    cpus_per_trainer: int = Field(1, ge=1, description="Logical CPUs reserved with each trainer rank's bundle.")
    cpus_per_engine: int = Field(1, ge=1, description="Logical CPUs reserved with each rollout engine's bundle.")
    engine_restarts: int = Field(
        2, ge=0, description="Times Ray restarts a rollout engine actor that died (it gets the current weights; "
        "under rollout.weight_sync: group every engine joins a new group, and under ZeRO-3 trainer rank 0 keeps a "
        "host copy of the synced weights for it); 0: an engine that dies ends the run.")
    trainer_restarts: int = Field(
        3, ge=0, description="Times a run restarts after a trainer actor died (SIGKILL, OOM, a lost node): every "
        "trainer rank and engine starts again in the same placement groups from the last complete checkpoint (its "
        "rollouts in flight, its weights into the engines; none yet: from the start), and the first step record after "
        "it says what was replayed (restart/*); 0: a dead trainer rank ends the run. An error of the run itself is "
        "never restarted.")


LAUNCHER_DESCRIPTION = (
    "auto: ray; ray: trainer ranks and rollout engines as Ray actors in placement groups on a local cluster arl "
    "starts or the one ray.address names (arl/cluster, docs/ray.md; every layout: CPU, separate trainer and rollout "
    "GPUs, colocated GPUs); local: this process spawns them without Ray (one machine: the CPU layout, the colocated "
    "GPU node).")
LauncherName = Literal["auto", "local", "ray"]


def check_ray(cfg) -> None:
    """Cross-checks of a config run on Ray (``cfg``: the TrainConfig), one line each."""
    if cfg.launcher_used() != "ray" or cfg.layout.device != "cuda":
        return
    tp, g = cfg.rollout.tensor_parallel, cfg.ray.gpus_per_engine
    if g is not None and g % tp:
        raise ValueError(f"ray.gpus_per_engine = {g} must be a multiple of rollout.tensor_parallel = {tp}")
    nodes = sum(n.count for n in cfg.ray.nodes) or cfg.layout.nodes
    if nodes > 1 and cfg.rollout.weight_sync == "file":
        raise ValueError("rollout.weight_sync: 'file' writes to trainer rank 0's /dev/shm, which engines on other "
                         "nodes cannot read; use 'group' (or 'auto') on a multi-node Ray cluster")

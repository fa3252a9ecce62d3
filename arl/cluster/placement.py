"""Where a run's actors go on a Ray cluster: resource bundles from the config, checked against the
cluster's nodes (pure Python: ``--dry-run`` prints it without Ray; ``arl.cluster.launcher`` turns
it into placement groups).

* Trainer ranks: one placement group, PACK (as few nodes as possible), one bundle per rank: one GPU
  (+ ``ray.cpus_per_trainer`` CPUs) on GPU layouts, CPUs only on the CPU layout.
* Rollout engines: one placement group each, STRICT_PACK (an engine's GPUs on one node): one bundle
  of ``gpus_per_engine`` GPUs (tensor parallel x vLLM data parallel) + ``ray.cpus_per_engine`` CPUs.
* Colocated (``layout.colocate``): the trainers' group is STRICT_PACK (one node); engines take no
  bundle of their own; engine ``e`` shares the GPUs of trainer bundles ``[e*g, (e+1)*g)`` (the
  trainer actors hold those GPUs; the engine actor runs in bundle ``e*g`` asking for none and is
  shown them: arl/cluster/actors.py).

Node roles (``ray.nodes[].role``): trainer bundles go to ``trainer`` or role-less nodes, engine
bundles to ``rollout`` or role-less ones (dedicated rollout nodes).  On a Ray cluster a role is a
custom resource of the node (``ROLE_RESOURCES``: ``ray start --resources '{"arl_trainer": 1}'``; a
role-less node has both, a node with neither takes no bundle once any node has one); each bundle
then asks ``ROLE_SHARE`` of its role's resource, so Ray can only put it on a node of its role.  The
fit below is arl's plan (first fit in node order, trainers first); Ray makes the actual choice among
nodes that fit, so a plan that does not fit here cannot be scheduled there either (same totals per
node, same roles).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from ..config import TrainConfig

# a node's role as Ray sees it: a custom resource of the node (any positive amount)
ROLE_RESOURCES = {"trainer": "arl_trainer", "rollout": "arl_rollout"}
ROLE_SHARE = 0.001  # what one bundle asks of its role's resource: a node with 1 of it takes 1000 bundles
NO_ROLE = "none"  # a live node without either role resource on a cluster that uses roles: it takes no bundle


@dataclass(frozen=True)
class Bundle:
    name: str  # "trainer rank 3", "engine 1"
    role: str  # "trainer" | "rollout"
    gpus: int
    cpus: int

    def resources(self) -> dict:
        """The bundle as Ray writes it."""
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}

    def ray_resources(self, roles: bool) -> dict:
        """What the bundle asks of Ray: its CPUs/GPUs, and on a cluster with node roles a share of
        its role's resource (only nodes of its role, or role-less ones, have it)."""
        return {**self.resources(), **({ROLE_RESOURCES[self.role]: ROLE_SHARE} if roles else {})}


@dataclass
class Node:
    index: int
    cpus: Optional[int]  # None: not known (a GPU layout without ray.nodes): CPUs are not checked
    gpus: int
    role: Optional[str] = None  # trainer | rollout | None (either) | NO_ROLE (neither)
    bundles: List[Bundle] = field(default_factory=list)
    node_id: str = ""  # a live node's Ray id (cluster_of); empty for a planned one
    host: str = ""  # a live node's address: simulated nodes on one machine share it

    def free(self) -> tuple:
        cpus = None if self.cpus is None else self.cpus - sum(b.cpus for b in self.bundles)
        return self.gpus - sum(b.gpus for b in self.bundles), cpus

    def takes(self, b: Bundle) -> bool:
        gpus, cpus = self.free()
        return self.role in (None, b.role) and gpus >= b.gpus and (cpus is None or cpus >= b.cpus)


class PlacementError(ValueError):
    """A placement that does not fit the cluster (one line: which bundle, what is missing)."""


def gpus_per_engine(cfg: TrainConfig) -> int:
    """GPUs of one engine: ``ray.gpus_per_engine``, else the layout's rollout GPUs per node, else
    tensor parallel; 0 on the CPU layout."""
    if cfg.layout.device != "cuda":
        return 0
    return cfg.ray.gpus_per_engine or cfg.layout.rollout_gpus or cfg.rollout.tensor_parallel


def bundles(cfg: TrainConfig) -> tuple:
    """(trainer bundles, engine bundles); colocated: no engine bundles (they share the trainers')."""
    cuda, r = cfg.layout.device == "cuda", cfg.ray
    trainers = [Bundle(f"trainer rank {i}", "trainer", 1 if cuda else 0, r.cpus_per_trainer)
                for i in range(cfg.trainer.world_size)]
    if cuda and cfg.layout.colocate:
        return trainers, []
    g = gpus_per_engine(cfg)
    return trainers, [Bundle(f"engine {e}", "rollout", g, r.cpus_per_engine) for e in range(cfg.num_engines())]


def cluster_nodes(cfg: TrainConfig) -> tuple:
    """(nodes, where the shape comes from): ``ray.nodes``, else the GPU layout's nodes (CPUs not
    checked), else the local cluster arl starts on the CPU layout, sized to the run's bundles
    (logical CPUs: Ray does not pin them to cores)."""
    if cfg.ray.nodes:
        nodes = [Node(0, g.cpus, g.gpus, g.role) for g in cfg.ray.nodes for _ in range(g.count)]
        for i, n in enumerate(nodes):
            n.index = i
        return nodes, "ray.nodes"
    lay = cfg.layout
    if lay.device == "cuda":
        return [Node(i, None, lay.gpus_per_node) for i in range(lay.nodes)], "layout (CPUs not checked)"
    return [Node(0, local_cpus(cfg), 0)], "local cluster (this machine)"


def local_cpus(cfg: TrainConfig) -> int:
    """Logical CPUs of the local cluster arl starts: what the bundles ask, at least this machine's."""
    trainers, engines = bundles(cfg)
    return max(sum(b.cpus for b in trainers + engines), os.cpu_count() or 1)


@dataclass
class Placement:
    nodes: List[Node]
    source: str
    trainers: List[Bundle]
    engines: List[Bundle]
    colocated: bool
    tensor_parallel: int
    engine_gpus: int
    n_engines: int
    launcher: str = "ray"

    @property
    def roles(self) -> bool:
        """Node roles in use: the bundles then carry their role's resource (``Bundle.ray_resources``)."""
        return any(n.role for n in self.nodes)

    @property
    def trainer_strategy(self) -> str:
        """The trainers' group: PACK (as few nodes as possible), STRICT_PACK colocated (one node: its
        engines are shown their ranks' GPUs and read the weights from rank 0's /dev/shm)."""
        return "STRICT_PACK" if self.colocated else "PACK"

    def node_of(self, name: str) -> int:
        return next(n.index for n in self.nodes if any(b.name == name for b in n.bundles))

    def render(self) -> str:
        t, e = self.trainers, self.engines
        head = "" if self.launcher == "ray" else "; what launcher=ray would place (this run: the processes above)"
        lines = [f"placement (Ray; cluster from {self.source}: {len(self.nodes)} node(s){head}):",
                 f"  trainers: 1 placement group, {self.trainer_strategy}, {len(t)} bundle(s) {_res(t[0])}"]
        if self.colocated:
            g, tp = self.engine_gpus, self.tensor_parallel
            lines += [f"  engine {i}: colocated on the GPUs of {_ranks(list(range(i * g, (i + 1) * g)))} (tensor parallel "
                      f"{tp} x data parallel {max(1, g // tp)}; no bundle of its own: in trainer rank {i * g}'s, asking for "
                      "no GPU)" for i in range(self.n_engines)]
        elif e:
            dp = max(1, e[0].gpus // self.tensor_parallel) if e[0].gpus else 1
            par = f" (tensor parallel {self.tensor_parallel} x data parallel {dp})" if e[0].gpus else ""
            lines.append(f"  engines: {len(e)} placement group(s), STRICT_PACK, 1 bundle {_res(e[0])} each{par}")
        if self.roles:
            res = ", ".join(f"{v} ({k})" for k, v in ROLE_RESOURCES.items())
            lines.append(f"  node roles: Ray custom resources {res}; each bundle asks {ROLE_SHARE:g} of its role's "
                         "(a role-less node has both)")
        for n in self.nodes:
            gpus, cpus = n.free()
            shape = f"{n.gpus} GPUs, {'?' if n.cpus is None else n.cpus} CPUs"
            shape += f", id {n.node_id[:8]}" if n.node_id else ""
            used = f"{n.gpus - gpus}/{n.gpus} GPUs" + ("" if n.cpus is None else f", {n.cpus - cpus}/{n.cpus} CPUs")
            role = "no arl role" if n.role == NO_ROLE else n.role or "any role"
            lines.append(f"  node {n.index} ({role}; {shape}): {_names(n.bundles)}  [{used} used]")
        return "\n".join(lines)


def _res(b: Bundle) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in b.resources().items()) + "}"


def _names(bs: List[Bundle]) -> str:
    """``trainer ranks 0-7, engine 0, engine 1``: consecutive trainer ranks as one range."""
    ranks = [int(b.name.rsplit(" ", 1)[1]) for b in bs if b.role == "trainer"]
    out = [_ranks(ranks)] if ranks else []
    out += [b.name for b in bs if b.role == "rollout"]
    return ", ".join(out) or "(nothing)"


def _ranks(ranks: List[int]) -> str:
    """Consecutive trainer ranks (first fit keeps them so) as one range."""
    return f"trainer ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"trainer rank {ranks[0]}"


def _place(nodes: List[Node], items: List[Bundle], role: str) -> None:
    """First fit, nodes of the bundle's own role before role-less ones; one line at the first that fits nowhere."""
    order = sorted(nodes, key=lambda n: (n.role != role, n.index))
    unplaced = []
    for b in items:
        node = next((n for n in order if n.takes(b)), None)
        if node is None:
            unplaced.append(b)
        else:
            node.bundles.append(b)
    if unplaced:
        where = f"{role} or role-less node" if any(n.role for n in nodes) else "node"
        raise PlacementError(_missing(unplaced, [n for n in nodes if n.role in (None, role)], where))


def _missing(unplaced: List[Bundle], eligible: List[Node], where: str) -> str:
    b = unplaced[0]
    if not eligible:
        return f"placement: {b.name} {_res(b)} does not fit: the cluster has no {where}"
    # the eligible node closest to taking it: fewest GPUs missing, then fewest CPUs
    def short(n):
        gpus, cpus = n.free()
        return max(0, b.gpus - gpus), 0 if cpus is None else max(0, b.cpus - cpus)
    best = min(eligible, key=short)
    g, c = short(best)
    miss = " and ".join(s for s in (f"{g} GPU(s)" if g else "", f"{c} CPU(s)" if c else "") if s)
    more = f"; {len(unplaced) - 1} more bundle(s) of this kind do not fit either" if len(unplaced) > 1 else ""
    return (f"placement: {b.name} {_res(b)} does not fit on any {where}: {miss} missing on the closest "
            f"(node {best.index}){more}")


def placement(cfg: TrainConfig, nodes: Optional[List[Node]] = None, source: str = "") -> Placement:
    """The run's placement on ``nodes`` (default: ``cluster_nodes``); PlacementError when it does not fit."""
    if nodes is None:
        nodes, source = cluster_nodes(cfg)
    trainers, engines = bundles(cfg)
    colocated = cfg.layout.device == "cuda" and bool(cfg.layout.colocate)
    _place(nodes, trainers, "trainer")
    _place(nodes, engines, "rollout")
    if colocated:  # every trainer bundle on one node (STRICT_PACK); an engine spans g of them
        hosts = {n.index for n in nodes if any(t in n.bundles for t in trainers)}
        if len(hosts) > 1:
            raise PlacementError(f"placement: colocated, the {len(trainers)} trainer bundles {_res(trainers[0])} must "
                                 f"fit on one node; they take nodes {sorted(hosts)}")
        g = gpus_per_engine(cfg)
        for e in range(cfg.num_engines()):
            hosts = {next(n.index for n in nodes if t in n.bundles) for t in trainers[e * g:(e + 1) * g]}
            if len(hosts) != 1 or len(trainers) < (e + 1) * g:
                raise PlacementError(f"placement: colocated engine {e} needs {g} GPUs of trainer bundles on one "
                                     f"node; trainer ranks {e * g}-{(e + 1) * g - 1} are not")
    return Placement(nodes, source, trainers, engines, colocated, cfg.rollout.tensor_parallel, gpus_per_engine(cfg),
                     cfg.num_engines(), cfg.launcher_used())

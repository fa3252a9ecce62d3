"""A simulated multi-node Ray cluster on this machine: one raylet per node of ``ray.nodes``, each
with its logical CPUs/GPUs and its node role as a custom resource (arl/cluster/placement.py), so a
``launcher: ray`` run joins it with ``ray.address`` exactly as it would join real machines
(docs/ray.md).  The CPUs are logical: Ray does not pin them to cores.

    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')
    python -m arl.cluster.sim --config configs/tiny_cpu.yaml --address-file /tmp/arl_sim/address \\
        'ray.nodes=[{count: 1, cpus: 2, role: trainer}, {count: 2, cpus: 1, role: rollout}]' &
    python -m arl.train --config configs/tiny_cpu.yaml launcher=ray rollout.engines=2 \\
        ray.address=$(cat /tmp/arl_sim/address)

Token auth is on: the cluster and the run share ``RAY_AUTH_TOKEN`` from the environment (this
tool does not make one: two processes must agree on it).  The first node is the head.  Its state
goes under ``--temp-dir`` (``RAY_TMPDIR``), apart from other Ray clusters on the machine.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import List

from ..config import load_config
from .placement import ROLE_RESOURCES, Node, cluster_nodes

OBJECT_STORE_BYTES = 150 * 2**20  # per node: the run's objects are small (orders, batch refs)
MAX_TEMP_DIR = 40  # + "/session_<date>_<time>_<pid>/sockets/plasma_store" stays within a socket path's 107


def node_resources(node: Node) -> dict:
    """The custom resources that give a simulated node its role (a role-less node: both)."""
    roles = list(ROLE_RESOURCES) if node.role is None else [node.role]
    return {ROLE_RESOURCES[r]: 1 for r in roles}


def start_cluster(nodes: List[Node], temp_dir: str, roles: bool = True):
    """A ``ray.cluster_utils.Cluster`` with one node per ``nodes`` entry (first: the head, no
    dashboard); ``roles`` False: no role resources.  Needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    set before ray is imported.  Returns (cluster, [Ray node id per entry])."""
    if os.environ.get("RAY_AUTH_MODE") != "token" or not os.environ.get("RAY_AUTH_TOKEN"):
        raise ValueError("arl.cluster.sim: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (the run joining the cluster "
                         "needs the same token)")
    temp_dir = os.path.abspath(temp_dir)
    if len(temp_dir) > MAX_TEMP_DIR:
        raise ValueError(f"arl.cluster.sim: --temp-dir {temp_dir} is longer than {MAX_TEMP_DIR} characters: Ray's "
                         "socket paths under it would pass the 107 characters of a Unix socket")
    os.makedirs(os.path.join(temp_dir, "ray"), exist_ok=True)
    os.environ["RAY_TMPDIR"] = temp_dir  # ray_current_cluster and the sessions go here, not /tmp/ray
    from ray.cluster_utils import Cluster

    cluster, ids = Cluster(), []
    for i, n in enumerate(nodes):
        args = dict(num_cpus=n.cpus or 0, num_gpus=n.gpus, object_store_memory=OBJECT_STORE_BYTES,
                    resources=node_resources(n) if roles else {})
        if i == 0:
            args.update(include_dashboard=False, temp_dir=temp_dir)
        ids.append(cluster.add_node(**args).node_id)
    cluster.wait_for_nodes()
    return cluster, ids


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m arl.cluster.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="the run's config: its ray.nodes is the cluster's shape")
    ap.add_argument("--address-file", required=True, help="where the head's address is written once all are up")
    ap.add_argument("--temp-dir", default="/tmp/arl_sim", help="Ray's state (keep it short: socket paths)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.ray.nodes:
            raise ValueError("arl.cluster.sim: the config has no ray.nodes (the cluster's shape)")
        nodes, _ = cluster_nodes(cfg)
        cluster, ids = start_cluster(nodes, args.temp_dir)
    except ValueError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        for n, i in zip(nodes, ids):
            print(f"arl.cluster.sim: node {n.index} {i[:8]} ({n.role or 'any role'}; {n.cpus} CPUs, {n.gpus} GPUs; "
                  f"resources {node_resources(n)})", flush=True)
        with open(args.address_file, "w") as f:
            f.write(cluster.address)
        print(f"arl.cluster.sim: {len(nodes)} node(s) up at {cluster.address}; stop with SIGTERM", flush=True)
        stop.wait()
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Ray placement from the config (arl/cluster/placement.py): bundles, the fit against the cluster's
nodes, the one-line error of a placement that does not fit, and what --dry-run prints."""
import os

import pytest

from arl.cluster.placement import Node, PlacementError, placement
from arl.config import load_config
from arl.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOUR = os.path.join(ROOT, "configs", "qwen2.5-7b_4node.yaml")


def _cfg(name, *over):
    return load_config(os.path.join(ROOT, "configs", name), list(over))


def _placed(p) -> dict:
    return {n.index: [b.name for b in n.bundles] for n in p.nodes}


def test_four_nodes_with_dedicated_rollout_nodes(capsys):
    p = placement(_cfg("qwen2.5-7b_4node.yaml"))
    got = _placed(p)
    assert got[0] == [f"trainer rank {i}" for i in range(8)] and got[1] == [f"trainer rank {i}" for i in range(8, 16)]
    assert got[2] == ["engine 0", "engine 1"] and got[3] == ["engine 2", "engine 3"]
    assert p.engines[0].resources() == {"CPU": 16, "GPU": 4} and p.trainers[0].resources() == {"CPU": 8, "GPU": 1}
    assert main(["--config", FOUR, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "processes: Ray actors, as placed below (launcher: ray)" in out
    assert "placement (Ray; cluster from ray.nodes: 4 node(s)):" in out
    assert "  trainers: 1 placement group, PACK, 16 bundle(s) {CPU: 8, GPU: 1}" in out
    assert ("  engines: 4 placement group(s), STRICT_PACK, 1 bundle {CPU: 16, GPU: 4} each (tensor parallel 4 x data "
            "parallel 1)") in out
    assert "  node 0 (trainer; 8 GPUs, 96 CPUs): trainer ranks 0-7  [8/8 GPUs, 64/96 CPUs used]" in out
    assert "  node 3 (rollout; 8 GPUs, 96 CPUs): engine 2, engine 3  [8/8 GPUs, 32/96 CPUs used]" in out


def test_two_node_config_is_placed_on_ray(capsys):
    assert main(["--config", os.path.join(ROOT, "configs", "qwen2.5-7b_2x8gpu.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "launcher: ray (auto: Ray): joins the Ray cluster at auto" in out
    assert "processes: Ray actors, as placed below (launcher: ray)" in out
    assert "  node 0 (any role; 8 GPUs, ? CPUs): trainer ranks 0-7  [8/8 GPUs used]" in out
    assert "  node 1 (any role; 8 GPUs, ? CPUs): trainer ranks 8-11, engine 0, engine 1  [8/8 GPUs used]" in out


def test_cpu_and_colocated_layouts():
    p = placement(_cfg("tiny_cpu.yaml", "rollout.engines=2"))
    assert _placed(p) == {0: ["trainer rank 0", "trainer rank 1", "engine 0", "engine 1"]}
    assert all(b.resources() == {"CPU": 1} for b in p.trainers + p.engines)
    one = placement(_cfg("qwen2.5-0.5b_1gpu.yaml"))  # the engine shares trainer rank 0's GPU
    assert one.engines == [] and _placed(one) == {0: ["trainer rank 0"]}
    assert "engine 0: colocated on the GPUs of trainer rank 0" in one.render()


@pytest.mark.parametrize("over, line", [
    (["trainer.world_size=20"],
     "placement: trainer rank 16 {CPU: 8, GPU: 1} does not fit on any trainer or role-less node: 1 GPU(s) missing on "
     "the closest (node 0); 3 more bundle(s) of this kind do not fit either"),
    (["ray.gpus_per_engine=12"],
     "placement: engine 0 {CPU: 16, GPU: 12} does not fit on any rollout or role-less node: 4 GPU(s) missing on the "
     "closest (node 2); 3 more bundle(s) of this kind do not fit either"),
    (["ray.cpus_per_engine=60"],
     "placement: engine 2 {CPU: 60, GPU: 4} does not fit on any rollout or role-less node: 24 CPU(s) missing on the "
     "closest (node 2); 1 more bundle(s) of this kind do not fit either"),
    (["ray.nodes=[{count: 2, cpus: 96, gpus: 8, role: trainer}]"],
     "placement: engine 0 {CPU: 16, GPU: 4} does not fit: the cluster has no rollout or role-less node"),
])
def test_a_placement_that_does_not_fit_is_one_line(over, line, capsys):
    with pytest.raises(PlacementError) as e:
        placement(load_config(FOUR, over))
    assert str(e.value) == line
    assert main(["--config", FOUR, "--dry-run", *over]) == 2
    err = capsys.readouterr().err
    assert err == f"arl.train: config error: {line}\n"


def test_given_nodes_and_cpu_shortage():
    cfg = _cfg("tiny_cpu.yaml", "ray.cpus_per_trainer=2")
    with pytest.raises(PlacementError, match=r"trainer rank 1 \{CPU: 2\} does not fit on any node: 1 CPU\(s\) missing"):
        placement(cfg, nodes=[Node(0, 3, 0)], source="test")

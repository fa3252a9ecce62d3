"""Bucketed weight sync (``rollout.sync_bucket_mb``), both paths, without an engine: the tensors
arrive bitwise equal, in fewer collectives (counted on a wrapped group) and fewer files than one
per tensor; mixed dtypes go in buckets of their own; a tensor over the bucket size is alone.
The group is a real gloo group between two threads of this process (trainer rank 0 and one
engine worker); the worker side is the vLLM worker extension over a stand-in model runner."""
import threading
from types import SimpleNamespace

import pytest
import torch

from arl.model.tied import EMBED, HEAD
from arl.procs import free_port
from arl.rollout.engine import write_sync_weights
from arl.rollout.weight_sync import (_safetensors, make_group, plan_buckets, receive, send, send_buckets,
                                     tensor_meta, WeightSyncWorkerExtension)


class Counting:
    """A group whose broadcasts are counted (both sides call ``broadcast`` once per collective)."""

    def __init__(self, group):
        self.group, self.broadcasts = group, 0

    def broadcast(self, t, src):
        self.broadcasts += 1
        return self.group.broadcast(t, src)

    def rank(self):
        return self.group.rank()


def _state():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=torch.float32: torch.randn(s, generator=g).to(dtype)  # noqa: E731
    return {EMBED: r(64, 16), "model.layers.0.q.weight": r(16, 16), "model.layers.0.norm.weight": r(16),
            "model.layers.0.q.bias": r(16, dtype=torch.bfloat16), "model.layers.0.big": r(40, 64),
            "model.layers.0.k.weight": r(8, 16, dtype=torch.bfloat16), "model.norm.weight": r(16),
            "model.scalar": r(), "model.steps": torch.arange(5, dtype=torch.int64), "model.empty": r(0, 4)}


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else t


def _equal_bitwise(got: dict, want: dict):
    assert list(sorted(got)) == list(sorted(want))
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_bits(got[k]), _bits(v)), k


def test_plan_buckets_per_dtype_size_cap_and_big_tensor_alone():
    state = _state()
    plan = plan_buckets(tensor_meta(state), 4096)  # bytes: the 40x64 fp32 tensor (10 KiB) is over it
    by = {}
    for name, dtype, shape, b, off in plan:
        by.setdefault(b, []).append((name, dtype, shape, off))
    assert [p[0] for p in plan] == list(state)  # every tensor once, in the state's order
    for b, entries in by.items():
        assert len({e[1] for e in entries}) == 1, entries  # one dtype per bucket
        off = 0
        for name, _, shape, o in entries:  # contiguous, in order
            assert o == off
            off += state[name].numel()
        nbytes = off * state[entries[0][0]].element_size()
        assert nbytes <= 4096 or len(entries) == 1, entries  # only a lone tensor exceeds the size
    big = [b for b, e in by.items() if any(n == "model.layers.0.big" for n, *_ in e)]
    assert len(by[big[0]]) == 1
    assert len(by) < len(state)
    # the embedding (64x16 fp32 = 4 KiB) fills a bucket exactly; 0 bytes: every tensor alone
    assert len({p[3] for p in plan_buckets(tensor_meta(state), 0)}) == len(state)
    # large buckets: one per dtype
    assert len({p[3] for p in plan_buckets(tensor_meta(state), 1 << 30)}) == 3


def _sync(state, bucket_bytes, tied=False, fail_after=None):
    """Trainer rank 0 (a thread) sends ``state``; the worker extension receives and "loads" it.
    Returns (loaded tensors, sender broadcasts, receiver broadcasts, the worker's error)."""
    port = free_port()
    box, loaded = {}, {}

    def trainer():
        g = Counting(make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=60))
        box["sender"] = g
        if bucket_bytes > 0:
            box["n"] = send_buckets(g, state, plan_buckets(tensor_meta(state), bucket_bytes), "cpu")
        else:
            send(g, state, "cpu")

    class Worker(WeightSyncWorkerExtension):
        device = torch.device("cpu")
        model_config = SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=tied))

        def reload_weights(self, weights_iterator, is_checkpoint_format):
            for i, (name, t) in enumerate(weights_iterator):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("load failed")
                loaded[name] = t.clone()  # what vLLM's load_weights does: copy into its parameter

    th = threading.Thread(target=trainer)
    th.start()
    w = Worker()
    w.arl_join_weight_sync("127.0.0.1", port, 2, "gloo", timeout_s=60)
    w._arl_sync_group = recv = Counting(w._arl_sync_group)
    meta = tensor_meta(state)
    err = None
    try:
        w.arl_receive_weights(meta, plan_buckets(meta, bucket_bytes) if bucket_bytes > 0 else None)
    except RuntimeError as e:
        err = e
    th.join(timeout=60)
    assert not th.is_alive(), "the sender hung"
    return loaded, box["sender"].broadcasts, recv.broadcasts, err


@pytest.mark.parametrize("bucket_bytes", [4096, 1 << 20])
def test_group_bucketed_arrives_bitwise_in_fewer_broadcasts(bucket_bytes):
    state = _state()
    loaded, sent, got, err = _sync(state, bucket_bytes)
    assert err is None
    _equal_bitwise(loaded, state)
    n_buckets = len({p[3] for p in plan_buckets(tensor_meta(state), bucket_bytes)})
    assert sent == got == n_buckets < len(state)
    base, sent0, got0, _ = _sync(state, 0)  # today's sync: one broadcast per tensor, same tensors
    _equal_bitwise(base, state)
    assert sent0 == got0 == len(state)


def test_group_bucketed_tied_head_and_failed_load_drains():
    """A tied model: the embedding crosses once and loads under both names.  A load that fails
    midway still takes every broadcast (the sender returns; the error reaches the caller)."""
    state = _state()
    loaded, *_ , err = _sync(state, 4096, tied=True)
    assert err is None and torch.equal(loaded[HEAD], state[EMBED]) and torch.equal(loaded[EMBED], state[EMBED])
    loaded, sent, got, err = _sync(state, 4096, fail_after=2)
    assert isinstance(err, RuntimeError) and "load failed" in str(err) and sent == got


@pytest.mark.parametrize("bucket_bytes", [4096, 0])
def test_file_bucketed_arrives_bitwise_in_fewer_files(tmp_path, bucket_bytes):
    state = _state()
    d = write_sync_weights(state, tmp_path / "v1", bucket_bytes)
    files = sorted(p.name for p in d.glob("*"))
    if bucket_bytes:
        assert len(files) == len({p[3] for p in plan_buckets(tensor_meta(state), bucket_bytes)}) < len(state)
        assert all(f.startswith("bucket-") and f.endswith(".safetensors") for f in files)
    else:
        assert files == ["model.safetensors"]
    _equal_bitwise(dict(_safetensors(str(d))), state)
    # rewritten unbucketed (or bucketed): no stale file of the other layout is left to load
    write_sync_weights(state, d, 0 if bucket_bytes else 4096)
    _equal_bitwise(dict(_safetensors(str(d))), state)


def test_bench_shapes_are_qwen2_05b_state_dict():
    """bench/bench_weight_sync.py's state dict is transformers' Qwen2ForCausalLM at Qwen2.5-0.5B's
    config (built on the meta device: no memory), the tied head left out as the sender does."""
    import importlib.util
    from pathlib import Path

    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = importlib.util.spec_from_file_location("bench_weight_sync",
                                                  Path(__file__).parents[1] / "bench" / "bench_weight_sync.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    c = bench.QWEN25_05B
    cfg = Qwen2Config(hidden_size=c["hidden"], num_hidden_layers=c["layers"], intermediate_size=c["intermediate"],
                      vocab_size=c["vocab"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                      tie_word_embeddings=c["tied"])
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    want = {k: list(v.shape) for k, v in model.state_dict().items() if k != HEAD}
    got = dict(bench.qwen2_shapes(**c))
    assert got == want
    assert 490e6 < sum(torch.Size(s).numel() for s in got.values()) < 500e6  # 0.49B parameters, as published


def test_sync_bucket_mb_default_by_device():
    from arl.config import load_config
    from arl.trainer.sync import GPU_BUCKET_MB, sync_bucket_mb

    cfg = load_config(None, [])
    assert cfg.rollout.sync_bucket_mb is None
    assert sync_bucket_mb(cfg, torch.device("cpu")) == 0 and sync_bucket_mb(cfg, torch.device("cuda", 0)) == GPU_BUCKET_MB
    cfg = load_config(None, ["rollout.sync_bucket_mb=64"])
    assert sync_bucket_mb(cfg, torch.device("cpu")) == sync_bucket_mb(cfg, torch.device("cuda", 0)) == 64

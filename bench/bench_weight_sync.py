"""Weight-sync benchmark: today's per-tensor sync against the bucketed one (``rollout.sync_bucket_mb``),
side by side in one run, at Qwen2.5-0.5B's shapes with random weights.

The state dict is built from a Qwen2 config (hidden 896, 24 layers, intermediate 4864, vocab
151936, 14 heads, 2 kv heads, tied embeddings: the head is not sent, as ``WeightSender`` does);
``--quick`` keeps 2 layers.  Two paths; the modes (per tensor, and each ``--bucket-mb``) are timed in
the same processes, interleaved in rotating order (the machine's load hits all alike), and each
mode's peak memory is taken again alone, in fresh processes, with one sync:

  group  trainer rank 0 and one engine worker, two processes over arl's gloo weight-sync group
         (``arl.rollout.weight_sync.make_group``).  per_tensor: ``send`` / ``receive`` (one broadcast
         per tensor, the whole model received, then loaded); bucketed: ``send_buckets`` /
         ``receive_buckets`` (one broadcast per bucket, streamed).  The worker "loads" by copying
         every tensor into its own preallocated parameters (what vLLM's load_weights does), and the
         time is the worker's, from a barrier to the last tensor loaded.
  file   ``write_sync_weights`` into /dev/shm, then the worker's reader (``_safetensors``) copies
         every tensor into preallocated parameters; time = write + read + load, in one process.

Figures per mode: sync_s (median of ``--reps`` after one warm-up round), collectives (broadcasts on the
sender; files for the file path), peak RSS of each process and its rise over the process's RSS
before the first sync (the sync's own transient memory), and whether every tensor arrived bitwise
(sha1 of each tensor's bytes on both sides).  Ratios: per_tensor time / bucketed time (> 1: bucketed
is faster).  The last stdout line is one JSON object.

  python bench/bench_weight_sync.py --quick
  python bench/bench_weight_sync.py                 # full 24 layers, bf16, buckets of 256 MiB
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_05B = dict(hidden=896, layers=24, intermediate=4864, vocab=151936, heads=14, kv_heads=2, tied=True)


def qwen2_shapes(hidden, layers, intermediate, vocab, heads, kv_heads, tied):
    """(name, shape) of a Qwen2ForCausalLM state dict in its order, the tied head left out."""
    hd = hidden // heads
    out = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", [hidden, hidden]), (p + "self_attn.q_proj.bias", [hidden]),
                (p + "self_attn.k_proj.weight", [kv_heads * hd, hidden]), (p + "self_attn.k_proj.bias", [kv_heads * hd]),
                (p + "self_attn.v_proj.weight", [kv_heads * hd, hidden]), (p + "self_attn.v_proj.bias", [kv_heads * hd]),
                (p + "self_attn.o_proj.weight", [hidden, hidden]),
                (p + "mlp.gate_proj.weight", [intermediate, hidden]), (p + "mlp.up_proj.weight", [intermediate, hidden]),
                (p + "mlp.down_proj.weight", [hidden, intermediate]),
                (p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden])]
    out.append(("model.norm.weight", [hidden]))
    if not tied:
        out.append(("lm_head.weight", [vocab, hidden]))
    return out


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _state(shapes, dtype, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    # drawn in the dtype itself: no float32 temporary raises the peak before the measurement
    return {n: torch.randn(s, generator=g, dtype=getattr(torch, dtype)) for n, s in shapes}


def _params(shapes, dtype):
    import torch

    return {n: torch.zeros(s, dtype=getattr(torch, dtype)) for n, s in shapes}


def _digests(d) -> dict:
    import torch

    return {k: hashlib.sha1(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() for k, v in d.items()}


class Counting:
    def __init__(self, group):
        self.group, self.broadcasts = group, 0

    def broadcast(self, t, src):
        self.broadcasts += 1
        return self.group.broadcast(t, src)


def _group_member(rank, port, shapes, dtype, sizes, reps, out):
    """One side of the group (0: trainer rank 0, 1: the engine worker).  Every sync of every mode
    (``sizes``: bucket MiB, 0 = per tensor) in rotating order, one warm-up round first."""
    import torch

    torch.set_num_threads(1)
    from arl.rollout.weight_sync import (make_group, plan_buckets, receive, receive_buckets, send, send_buckets,
                                         tensor_meta)

    data = _state(shapes, dtype, seed=0) if rank == 0 else _params(shapes, dtype)
    g = make_group("127.0.0.1", port, 0 if rank == 0 else None, 2, "gloo", timeout_s=600)
    meta = tensor_meta(data)
    plans = {mb: plan_buckets(meta, mb << 20) if mb > 0 else None for mb in sizes}
    rss0 = _rss_mib()
    times, counts, digests = {mb: [] for mb in sizes}, {}, {}
    counting = Counting(g)
    for r in range(reps + 1):  # round 0: warm-up, and the bitwise check
        for mb in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            plan = plans[mb]
            if rank == 1 and r == 0:
                for t in data.values():
                    t.zero_()
            g.barrier().wait()
            counting.broadcasts = 0
            t0 = time.perf_counter()
            if rank == 0:
                if plan is None:
                    send(counting, data, "cpu")
                else:
                    send_buckets(counting, data, plan, "cpu")
            else:
                named = receive(counting, meta, "cpu") if plan is None else receive_buckets(counting, plan, "cpu")
                for name, t in named:
                    data[name].copy_(t)  # what vLLM's load_weights does with each tensor
                del named
            dt = time.perf_counter() - t0
            if r == 0:
                counts[mb] = counting.broadcasts
                digests[mb] = _digests(data)  # hashes the tensors in place: no copy raises the peak
            else:
                times[mb].append(dt)
    peak = _peak_mib()  # alone in its process (one mode): the sync's own peak
    out.put({"rank": rank, "times": times, "broadcasts": counts, "rss_before_mib": rss0, "peak_mib": peak,
             "digests": digests})


def _file_member(shapes, dtype, sizes, reps, out):
    """Write + read + load of every mode in rotating order, one warm-up round first."""
    import torch

    torch.set_num_threads(1)
    from arl.rollout.engine import write_sync_weights
    from arl.rollout.weight_sync import _safetensors

    state, params = _state(shapes, dtype, seed=0), _params(shapes, dtype)
    want = _digests(state)
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    d = Path(tempfile.mkdtemp(prefix="arl-bench-sync-", dir=root))
    rss0 = _rss_mib()
    times, files, ok = {mb: [] for mb in sizes}, {}, {}
    try:
        for r in range(reps + 1):
            for mb in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
                if r == 0:
                    for t in params.values():
                        t.zero_()
                t0 = time.perf_counter()
                w = write_sync_weights(state, d / f"v{r}-{mb}", mb << 20)
                for name, t in _safetensors(str(w)):
                    params[name].copy_(t)
                dt = time.perf_counter() - t0
                if r == 0:
                    files[mb] = len(list(w.glob("*.safetensors")))
                    ok[mb] = _digests(params) == want
                else:
                    times[mb].append(dt)
                shutil.rmtree(w)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out.put({"times": times, "files": files, "rss_before_mib": rss0, "peak_mib": _peak_mib(), "bitwise": ok})


def _spawn(target, args_for, n):
    """Run ``n`` processes of ``target`` (spawned: a fresh RSS each) and collect their results."""
    from arl.procs import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=args_for(i, port, q)) for i in range(n)]
    for p in procs:
        p.start()
    res = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(res, key=lambda m: m.get("rank", 0))


def _med(ts):
    return round(statistics.median(ts), 4)


def run_group(shapes, dtype, sizes, reps, memory) -> dict:
    s, w = _spawn(_group_member, lambda i, port, q: (i, port, shapes, dtype, sizes, reps, q), 2)
    res = {mb: {"sync_s": _med(w["times"][mb]), "sync_s_all": [round(t, 4) for t in w["times"][mb]],
                "collectives": s["broadcasts"][mb], "bitwise": s["digests"][mb] == w["digests"][mb]} for mb in sizes}
    if memory:  # each mode alone in a fresh pair: one sync, its peak
        for mb in sizes:
            s, w = _spawn(_group_member, lambda i, port, q: (i, port, shapes, dtype, [mb], 0, q), 2)
            res[mb].update(sender_peak_mib=round(s["peak_mib"]), sender_rise_mib=round(s["peak_mib"] - s["rss_before_mib"]),
                           receiver_peak_mib=round(w["peak_mib"]),
                           receiver_rise_mib=round(w["peak_mib"] - w["rss_before_mib"]))
    return res


def run_file(shapes, dtype, sizes, reps, memory) -> dict:
    (m,) = _spawn(_file_member, lambda i, port, q: (shapes, dtype, sizes, reps, q), 1)
    res = {mb: {"sync_s": _med(m["times"][mb]), "sync_s_all": [round(t, 4) for t in m["times"][mb]],
                "files": m["files"][mb], "bitwise": m["bitwise"][mb]} for mb in sizes}
    if memory:
        for mb in sizes:
            (m,) = _spawn(_file_member, lambda i, port, q: (shapes, dtype, [mb], 0, q), 1)
            res[mb].update(peak_mib=round(m["peak_mib"]), rise_mib=round(m["peak_mib"] - m["rss_before_mib"]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, 3 reps (the full shape's embedding stays)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 24; --quick: 2)")
    ap.add_argument("--dtype", default="bfloat16", help="weights' dtype (bfloat16, float32)")
    ap.add_argument("--bucket-mb", default="256", help="bucket sizes to measure, comma-separated (MiB); the first "
                                                        "is the headline ratio")
    ap.add_argument("--reps", type=int, default=None, help="timed syncs per mode after one warm-up (default 7; quick 3)")
    ap.add_argument("--paths", default="group,file", help="group, file or both")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs (a fresh process per mode)")
    a = ap.parse_args()
    layers = a.layers or (2 if a.quick else QWEN25_05B["layers"])
    reps = a.reps or (3 if a.quick else 7)
    shapes = qwen2_shapes(**{**QWEN25_05B, "layers": layers})
    import math

    import torch

    item = torch.empty((), dtype=getattr(torch, a.dtype)).element_size()
    n_params = sum(math.prod(s) for _, s in shapes)
    sizes = [int(x) for x in a.bucket_mb.split(",")]
    out = {"model": "Qwen2.5-0.5B shapes (random weights)", "layers": layers, "dtype": a.dtype, "tensors": len(shapes),
           "params": n_params, "state_mib": round(n_params * item / 2**20), "reps": reps, "backend": "gloo"}
    runners = {"group": run_group, "file": run_file}
    modes = [0] + sizes
    name = lambda mb: "per_tensor" if mb == 0 else f"bucketed_{mb}mb"  # noqa: E731
    for path in a.paths.split(","):
        got = runners[path](shapes, a.dtype, modes, reps, not a.no_memory)
        res = {name(mb): got[mb] for mb in modes}
        for mb in modes:
            print(path, name(mb), json.dumps(got[mb]), flush=True)
        res["ratio_per_tensor_over_bucketed"] = round(got[0]["sync_s"] / got[sizes[0]]["sync_s"], 3)
        out[path] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Fused lm_head -> logprob vs materialized logits: peak memory and fwd+bwd time.

Variants, all computing logp[t] = log softmax(hidden @ weight.T / temp)[t, y_t] and then
backward of sum(logp * g) to BOTH hidden and weight:

* ``naive``    : matmul -> [T, V] logits -> log_softmax -> gather (eager torch)
* ``compiled`` : torch.compile(naive) (inductor; on CPU its C++ backend) -- the best plain torch
* ``arl``      : arl.ops.logprob.fused_logprobs, backend "auto" (CPU: chunked torch; GPU: Triton)
* ``arl_entropy``: the same with entropy computed too (extra figure; naive has no entropy)
* ``liger``    : Liger-Kernel 0.8.5's chunked selective-logprob autograd function (the path its
                 PPO/GRPO chunked losses use), when liger_kernel imports; else skipped with the
                 reason printed and recorded.

Peak memory (CPU): torch.profiler(profile_memory=True) records every allocation and free of
torch's CPU allocator with a signed byte count; the peak is the maximum running sum over ONE
fwd+bwd call, in time order, measured from the call's start.  So it counts everything the call
allocates -- logits, softmax buffers, outputs and the hidden/weight gradients it returns -- and
not the inputs, which exist before.  On CUDA, torch.cuda.max_memory_allocated over the call minus
the memory allocated before it (same definition).  Timings are wall-clock medians of ``--reps``
calls after a warm-up (which also compiles ``compiled``); the machine is shared, so they are noisy.

Targets (issue 4): arl peak memory <= 15% of naive, time <= 1.0x naive.
``peak_mem_ratio_vs_naive`` / ``time_ratio_vs_naive`` in the final JSON are the WORST (max) over
the cases run; per-case figures are under ``cases``.

    python bench/bench_logprob.py            # T=8192,H=1024,V=32768 and T=2048,H=1024,V=151936
    python bench/bench_logprob.py --quick    # small sizes, under a minute
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from arl.ops.logprob import fused_logprobs, naive_logprobs

FULL_CASES = [(8192, 1024, 32768), (2048, 1024, 151936)]
QUICK_CASES = [(1024, 128, 8192)]


def _liger_fn():
    """(fn, None) when Liger's chunked selective logprob imports, else (None, reason)."""
    try:
        from liger_kernel.chunked_loss.fused_linear_ppo import _ChunkedSelectiveLogProbFunction
    except Exception as exc:  # not installed, or its import fails on this machine
        return None, f"liger_kernel not importable: {type(exc).__name__}: {exc}"

    def fn(h, w, y, temp):
        return _ChunkedSelectiveLogProbFunction.apply(h, w, y, None, temp, 4096)

    return fn, None


def _variants(temp):
    naive = lambda h, w, y: naive_logprobs(h, w, y, temp)[0]
    compiled = torch.compile(naive, dynamic=False)
    out = {
        "naive": naive,
        "compiled": compiled,
        "arl": lambda h, w, y: fused_logprobs(h, w, y, temp)[0],
    }
    if _DEVICE.type == "cuda":  # the Triton kernel, side by side with auto's pick
        out["arl_triton"] = lambda h, w, y: fused_logprobs(h, w, y, temp, backend="triton")[0]
    liger, why = _liger_fn()
    if liger is not None:
        out["liger"] = lambda h, w, y: liger(h, w, y, temp)
    return out, why


def _step(fn, h, w, y, g):
    logp = fn(h, w, y)
    gh, gw = torch.autograd.grad((logp * g).sum(), (h, w))
    return gh, gw


def _step_entropy(h, w, y, g, ge, temp):
    logp, ent = fused_logprobs(h, w, y, temp, with_entropy=True)
    return torch.autograd.grad((logp * g).sum() + (ent * ge).sum(), (h, w))


def _peak_bytes(call):
    """(peak bytes allocated during call() above the level at its start, call()'s output)."""
    if torch.cuda.is_available() and torch.cuda.current_device() >= 0 and _DEVICE.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = call()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base), out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = call()
    events = sorted(
        ((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
    )
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return int(peak), out


def _time(call, reps) -> float:
    times = []
    for _ in range(reps):
        if _DEVICE.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = call()
        if _DEVICE.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


_DEVICE = torch.device("cpu")


def run_case(T, H, V, reps, temp, seed=0, only=None, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=gen).to(_DEVICE, dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=gen) * H ** -0.5).to(_DEVICE, dtype).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=gen).to(_DEVICE)
    g = torch.randn(T, generator=gen).to(_DEVICE)
    ge = torch.randn(T, generator=gen).to(_DEVICE)
    variants, liger_skip = _variants(temp)
    calls = {name: (lambda fn=fn: _step(fn, h, w, y, g)) for name, fn in variants.items()}
    calls["arl_entropy"] = lambda: _step_entropy(h, w, y, g, ge, temp)
    if only:
        calls = {k: v for k, v in calls.items() if k in only or k in ("naive", "arl")}
    res = {"T": T, "H": H, "V": V}
    ref = None
    grads_mb = (T * H + V * H) * h.element_size() / 2**20  # the returned grad_hidden + grad_weight
    for name, call in calls.items():
        warm = 0.0
        if name == "compiled":  # compile outside the measured calls
            t0 = time.perf_counter()
            del_me = call()
            warm = time.perf_counter() - t0
            del del_me
        peak, out = _peak_bytes(call)  # first eager call; also the correctness check vs naive
        if ref is None:
            ref = [o.detach().clone() for o in out]
        # arl_entropy differentiates a different loss (logp and entropy terms): no comparison
        err = None if name == "arl_entropy" else max(
            float((a - b).abs().max() / (b.abs().max() + 1e-30)) for a, b in zip(out, ref))
        del out
        res[name] = {"peak_mb": round(peak / 2**20, 1), "compile_s": round(warm, 2),
                     "max_rel_grad_diff_vs_naive": None if err is None else float(f"{err:.3g}")}
    # timed calls interleaved round by round, so load drift on a shared machine hits all variants alike
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            times[name].append(_time(call, 1))
    for name in calls:
        r = res[name]
        r["time_s"] = round(statistics.median(times[name]), 4)
        err = r["max_rel_grad_diff_vs_naive"]
        print(f"[T={T} H={H} V={V}] {name:12s} peak {r['peak_mb']:9.1f} MiB  fwd+bwd {r['time_s']:8.4f} s  "
              f"(compile {r['compile_s']:.1f} s, grad rel diff vs naive {'n/a' if err is None else f'{err:.2g}'})",
              flush=True)
    del ref
    if liger_skip:
        res["liger_skipped"] = liger_skip
        print(f"liger skipped: {liger_skip}", flush=True)
    base = res["naive"]
    for name in calls:
        if name != "naive":
            res[name]["peak_mem_ratio_vs_naive"] = round(res[name]["peak_mb"] / base["peak_mb"], 4)
            res[name]["time_ratio_vs_naive"] = round(res[name]["time_s"] / base["time_s"], 4)
            res[name]["peak_mem_ratio_vs_naive_excl_grads"] = round(
                (res[name]["peak_mb"] - grads_mb) / (base["peak_mb"] - grads_mb), 4)
    return res


def main(argv=None):
    global _DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per variant (median)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset (naive and arl always run): compiled,liger,arl_entropy")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="hidden/weight dtype (bfloat16 is what a GPU trains in; logits accumulate in fp32)")
    ap.add_argument("--case", type=int, default=None, help="run only this index of the size list")
    args = ap.parse_args(argv)
    _DEVICE = torch.device(args.device)
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.case is not None:
        cases = [cases[args.case]]
    reps = args.reps or 2
    only = set(args.variants.split(",")) if args.variants else None
    results = [run_case(T, H, V, reps, args.temperature, only=only, dtype=getattr(torch, args.dtype)) for T, H, V in cases]
    summary = {
        "bench": "logprob",
        "quick": bool(args.quick),
        "device": str(_DEVICE),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "peak_mem_ratio_vs_naive": max(r["arl"]["peak_mem_ratio_vs_naive"] for r in results),
        "time_ratio_vs_naive": max(r["arl"]["time_ratio_vs_naive"] for r in results),
        "peak_mem_ratio_vs_naive_excl_grads": max(r["arl"]["peak_mem_ratio_vs_naive_excl_grads"] for r in results),

        "targets": {"peak_mem_ratio_vs_naive": 0.15, "time_ratio_vs_naive": 1.0},
        "cases": results,
    }
    for other in ("compiled", "liger", "arl_entropy", "arl_triton"):
        if other in results[0]:
            for key in ("time_ratio_vs_naive", "peak_mem_ratio_vs_naive"):
                summary[f"{other}_{key}"] = max(r[other][key] for r in results)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

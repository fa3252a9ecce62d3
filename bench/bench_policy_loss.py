"""Policy-loss benchmark: forward+backward time and peak extra memory of every backend.

Layout: a packed agentic batch of 512 trajectories (groups of 8, binary rewards) with about 8
interaction chunks each — prompt, then model turn (a chunk, trained) / observation (untrained)
alternating — at 64k, 256k and 1M tokens (``--quick``: 64k only).

Configurations (both with ``validate_inputs=False`` so that timings compare the math):
  chunk_level  IPA: chunk ratio, chunk mismatch mask [0.8, 5.0], group_std advantages, gamma 0.95;
  token_level  GRPO with DAPO clip-higher (clip_high 0.28).

Methods: the reference in eager torch, ``torch.compile`` of the same reference function, the C++
op (backend "cpu"); on a GPU also the Triton and CUDA backends where they are registered.  Each
fused backend runs twice: with the step's grpo advantages given (``<backend>``) and with them
computed in the pass from rewards, group rows and the step's group table (``<backend>+in_pass``,
``loss.advantages_in_pass``; the table is built once per step, outside the timed call, as the
trainer does); their time ratio is the median over back-to-back pairs (``paired_ratio``).

Time: median over ``--repeats`` runs of forward + ``loss.backward()`` after warm-up (compile time
is excluded).  CPU timings on a shared machine are noisy: read the ratios, which come from one run.

Peak extra memory (CPU): the forward+backward runs once under ``torch.profiler`` with
``profile_memory=True``; every allocation and free it records (``kineto_results.events()``,
``[memory]`` entries with a byte count) is summed in time order and the maximum of that running
sum is the peak extra memory, i.e. bytes allocated beyond what existed before the call (inputs
excluded, gradient outputs included).  Allocations outside torch's allocator (the C++ op's
N-sized std::vector scratch) are not seen; they are O(sequences), not O(tokens).  On a GPU:
``torch.cuda.max_memory_allocated`` minus the memory allocated before the call.

On a GPU the script also prints the bytes each kernel must move (token inputs read, gradient
written, backward's read+write) over its time, against the HBM bandwidth (``--hbm-gbps``).

The last stdout line is one JSON object: for the chunk-level configuration at the largest size run,
``tokens``, ``speedup_vs_eager``, ``speedup_vs_compile`` and ``peak_extra_bytes_per_token`` of the
C++ op, the same three under ``token_level``, ``in_pass`` (per configuration: the fused backend's
time with in-pass advantages over its time with given ones, and both peaks), and every
measurement under ``runs``.  Ratios are reported, never asserted.

    python bench/bench_policy_loss.py --quick
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from arl import LossConfig, available_backends, policy_loss
from arl.algo.advantages import group_advantages
from arl.ops.policy_loss import LossInputs, reference_policy_loss
from arl.ops.policy_loss.group_adv import step_groups

N_SEQ, GROUP, CHUNKS = 512, 8, 8
LOSS_KEYS = ("old_logp", "rollout_logp", "advantages", "cu_seqlens", "chunk_ids")  # the batch's policy_loss inputs

CONFIGS = {
    "chunk_level": LossConfig(ratio_level="chunk", mismatch_level="chunk", mismatch_mode="mask", mismatch_low=0.8,
                              mismatch_high=5.0, gamma=0.95, validate_inputs=False),
    "token_level": LossConfig(ratio_level="token", clip_low=0.2, clip_high=0.28, validate_inputs=False),
}


def agentic_batch(T: int, device: str, seed: int = 0) -> dict:
    """512 trajectories summing to T tokens: prompt ~10%, then 8 (model turn, observation) pairs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(N_SEQ, generator=g) + 0.5
    lengths = (w / w.sum() * T).long().clamp_min(2 * CHUNKS + 2)
    lengths[-1] += T - int(lengths.sum())
    cu = torch.zeros(N_SEQ + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    chunk_ids = torch.full((T,), -1, dtype=torch.int32)
    next_id = 0
    for s in range(N_SEQ):
        b, L = int(cu[s]), int(lengths[s])
        prompt = L // 10
        turns = torch.linspace(b + prompt, b + L, 2 * CHUNKS + 1).long().tolist()
        for k in range(CHUNKS):
            lo, mid = turns[2 * k], turns[2 * k] + (turns[2 * k + 1] - turns[2 * k]) * 2 // 3 + 1
            chunk_ids[lo:min(mid, b + L)] = next_id
            next_id += 1
    old = -torch.rand(T, generator=g) * 3
    logp = old + torch.randn(T, generator=g) * 0.1
    rollout = old + torch.randn(T, generator=g) * 0.05
    rewards = (torch.rand(N_SEQ, generator=g) > 0.5).float()
    group_ids = torch.arange(N_SEQ) // GROUP
    return dict(
        logp=logp.to(device),
        old_logp=old.to(device),
        rollout_logp=rollout.to(device),
        advantages=torch.from_numpy(group_advantages(rewards, group_ids, "grpo", 1e-6)[0]).to(device),
        rewards=rewards.to(device),  # the trajectories' (peer_verl compares verl's advantages); not loss inputs
        group_ids=group_ids.to(device),
        cu_seqlens=cu.to(device),
        chunk_ids=chunk_ids.to(device),
    )


def in_pass_inputs(b: dict):
    """The batch's in-pass inputs: the step's group table, built once per step as the trainer does."""
    r, g = b["rewards"].cpu().double(), b["group_ids"].cpu()
    return step_groups(r, g, torch.ones(N_SEQ, dtype=torch.bool), "grpo", 1e-6).take(range(N_SEQ)).to(b["logp"].device)


def method_fns(cfg: LossConfig, device: str) -> dict:
    """name -> fn(logp, batch) returning the loss tensor (differentiable w.r.t. logp)."""
    def backend_fn(name):
        def fn(logp, b):
            kw = {k: b[k] for k in LOSS_KEYS}
            return policy_loss(logp, **kw, config=cfg, backend=name).loss
        return fn

    def ref_math(logp, old_logp, rollout_logp, advantages, cu_seqlens, chunk_ids):
        inp = LossInputs(logp=logp, old_logp=old_logp, rollout_logp=rollout_logp, advantages=advantages,
                         cu_seqlens=cu_seqlens, chunk_ids=chunk_ids)
        return reference_policy_loss(inp, cfg).loss

    compiled = torch.compile(ref_math)
    fns = {"eager": backend_fn("reference"), "compile": lambda logp, b: compiled(logp, **{k: b[k] for k in LOSS_KEYS})}
    avail = available_backends()
    kernels = ("cuda", "triton") if device == "cuda" else ("cpu",)
    for name in kernels:
        if name in avail:
            fns[name] = backend_fn(name)
            fns[f"{name}+in_pass"] = in_pass_fn(name, cfg)
    return fns


def in_pass_fn(name: str, cfg: LossConfig):
    """The fused backend ``name`` computing grpo in the pass; the step's table is the batch's ``group``."""
    def fn(logp, b):
        kw = {k: b[k] for k in LOSS_KEYS if k != "advantages"}
        return policy_loss(logp, **kw, group=b["group"], config=cfg, backend=name).loss
    return fn


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def fwd_bwd(fn, base, b):
    logp = base.detach().requires_grad_(True)
    fn(logp, b).backward()
    return logp.grad


def time_it(fn, base, b, device, warmup, repeats) -> float:
    for _ in range(warmup):
        fwd_bwd(fn, base, b)
    sync(device)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fwd_bwd(fn, base, b)
        sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def paired_ratio(fn_a, fn_b, base, b, device, repeats) -> float:
    """Median over ``repeats`` back-to-back pairs of time(fn_a) / time(fn_b): on a shared machine
    the load drifts between two separate medians, much less within a pair."""
    for fn in (fn_a, fn_b):
        fwd_bwd(fn, base, b)
    ratios = []
    for i in range(repeats):
        ts = {}
        for fn in ((fn_a, fn_b) if i % 2 else (fn_b, fn_a)):  # alternate which goes first
            sync(device)
            t0 = time.perf_counter()
            fwd_bwd(fn, base, b)
            sync(device)
            ts[fn] = time.perf_counter() - t0
        ratios.append(ts[fn_a] / ts[fn_b])
    return statistics.median(ratios)


def peak_extra_bytes(fn, base, b, device) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        g = fwd_bwd(fn, base, b)
        torch.cuda.synchronize()
        del g
        return int(torch.cuda.max_memory_allocated() - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        g = fwd_bwd(fn, base, b)
        del g
    evs = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, nb in evs:
        cur += nb
        peak = max(peak, cur)
    return int(peak)


def bytes_moved(cfg: LossConfig, T: int) -> int:
    """Minimum traffic of a fused fwd+bwd: token inputs + chunk ids read, saved gradient written,
    then read and the logp gradient written by backward (fp32)."""
    n_in = 2 + (cfg.mismatch_level != "none")
    return T * (4 * n_in + 4 + 4 + 4 + 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="64k tokens only, few repeats (< 1 minute)")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="token counts (default 64k 256k 1M)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth for the GPU figure (H200: 4800)")
    args = ap.parse_args()
    sizes = args.sizes or ([1 << 16] if args.quick else [1 << 16, 1 << 18, 1 << 20])
    repeats = args.repeats or (3 if args.quick else 7)
    dev = args.device
    print(f"device={dev} threads={torch.get_num_threads()} backends={available_backends()} sizes={sizes}", file=sys.stderr)

    runs = {}
    for cname, cfg in CONFIGS.items():
        fns = method_fns(cfg, dev)
        for T in sizes:
            b = agentic_batch(T, dev)
            b["group"] = in_pass_inputs(b)
            base = b["logp"]
            row = {}
            for m, fn in fns.items():
                # compile: the first calls build (and re-specialize) the forward and backward graphs;
                # fused ops are cheap, so more repeats make their median robust to scheduler noise
                fused_m = m not in ("eager", "compile")  # in-pass variants too
                t = time_it(fn, base, b, dev, warmup=4 if m == "compile" else 1,
                            repeats=repeats * 5 if fused_m else repeats)
                mem = peak_extra_bytes(fn, base, b, dev)
                row[m] = {"ms": round(t * 1e3, 3), "peak_extra_bytes_per_token": round(mem / T, 2)}
                if dev == "cuda" and m in ("cuda", "triton"):
                    gbps = bytes_moved(cfg, T) / t / 1e9
                    row[m]["gbps"] = round(gbps, 1)
                    row[m]["hbm_frac"] = round(gbps / args.hbm_gbps, 3)
            fused = "cpu" if "cpu" in row else next((k for k in ("cuda", "triton") if k in row), None)
            if fused:
                row["speedup_vs_eager"] = round(row["eager"]["ms"] / row[fused]["ms"], 2)
                row["speedup_vs_compile"] = round(row["compile"]["ms"] / row[fused]["ms"], 2)
                row["in_pass_time_ratio"] = round(paired_ratio(fns[f"{fused}+in_pass"], fns[fused], base, b, dev,
                                                               repeats * 10), 3)
            runs[f"{cname}/{T}"] = row
            line = "  ".join(f"{m} {v['ms']:8.2f} ms ({v['peak_extra_bytes_per_token']:5.1f} B/tok)"
                             for m, v in row.items() if isinstance(v, dict))
            ratios = (f"x{row.get('speedup_vs_eager', float('nan')):.1f} vs eager, "
                      f"x{row.get('speedup_vs_compile', float('nan')):.1f} vs compile, "
                      f"in-pass/given x{row.get('in_pass_time_ratio', float('nan')):.3f}")
            print(f"{cname:12s} T={T:8d}  {line}  | {fused}: {ratios}")
            if dev == "cuda":
                for m in ("cuda", "triton"):
                    if m in row:
                        print(f"{'':12s} {m}: {bytes_moved(cfg, T) / 1e6:.1f} MB moved, {row[m]['gbps']} GB/s "
                              f"= {100 * row[m]['hbm_frac']:.1f}% of {args.hbm_gbps:.0f} GB/s HBM")

    def summary(cname):
        T = max(sizes)
        row = runs[f"{cname}/{T}"]
        fused = "cpu" if "cpu" in row else next((k for k in ("cuda", "triton") if k in row), None)
        return {"tokens": T, "backend": fused, "speedup_vs_eager": row.get("speedup_vs_eager"),
                "speedup_vs_compile": row.get("speedup_vs_compile"),
                "peak_extra_bytes_per_token": row[fused]["peak_extra_bytes_per_token"] if fused else None}

    def in_pass(cname):
        row = runs[f"{cname}/{max(sizes)}"]
        fused = "cpu" if "cpu" in row else next((k for k in ("cuda", "triton") if k in row), None)
        if fused is None:
            return None
        return {"backend": fused, "time_ratio_vs_given": row["in_pass_time_ratio"],
                "peak_extra_bytes_per_token": row[f"{fused}+in_pass"]["peak_extra_bytes_per_token"],
                "given_peak_extra_bytes_per_token": row[fused]["peak_extra_bytes_per_token"]}

    out = summary("chunk_level")
    out["token_level"] = summary("token_level")
    out["in_pass"] = {c: in_pass(c) for c in CONFIGS}
    out["device"] = dev
    out["runs"] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Sequence parallelism: one long trajectory through the packed forward, the policy loss and backward,
on one rank (SP=1) and split over two gloo ranks (SP=2, Ulysses: arl/model/ulysses.py), in one run.

Model: the main job's tiny Qwen2 shape (configs/tiny_cpu.yaml: 2 layers, hidden 128, 4 heads, 2 kv
heads, vocabulary 1024; random weights) unless ``--layers/--hidden`` say otherwise.  Batch: ONE
trajectory of ``--tokens`` tokens (16384; ``--quick`` 4096) with model turns of 1-7 tokens between
observations, token-level clipped loss (the reference op) against old logprobs a little off.

Per SP size and rank: the step's peak memory beyond what exists before it (torch's allocation
profiler, bench_logprob.peak_bytes: activations, the attention's workspace, the head's rows, the
gradients), and the median step time over ``--reps``.  Then the longest trajectory whose step fits a
fixed per-rank cap, the SP=1 peak at ``--tokens`` (so SP=1's longest is ``--tokens``): SP=2 runs
``--tokens`` x 1, 1.5, 1.7, 1.8, ..., 2.2 and the longest of them whose largest rank peak stays
within the cap counts (a lower bound, to the grid's 0.1 step).  The last stdout line is one JSON object: ``peak_ratio_sp2`` (SP=2's largest
rank peak / SP=1's), ``longest_ratio_sp2``, ``step_time_ratio_sp2`` and every figure.

    python bench/bench_sequence_parallel.py            # 16k tokens
    python bench/bench_sequence_parallel.py --quick    # 4k tokens
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def _model(layers: int, hidden: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=3 * hidden, max_position_embeddings=1 << 20)
    return Qwen2ForCausalLM(cfg).float()


def _batch(T: int):
    import numpy as np

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (T,), generator=g)
    rng, chunk, pos, k = np.random.default_rng(2), np.full(T, -1, dtype=np.int32), 8, 0
    while pos < T - 1:  # model turns of 1-7 tokens between 1-4 observation tokens
        span = int(rng.integers(1, 8))
        chunk[pos:pos + span] = k
        k, pos = k + 1, pos + span + int(rng.integers(1, 5))
    noise = torch.randn(T, generator=g) * 0.05
    return ids, torch.tensor([0, T]), torch.from_numpy(chunk), noise


def _step(model, T: int, shard):
    from arl.model.ulysses import sp_logprobs
    from arl.ops.policy_loss import LossConfig, policy_loss

    dev = next(model.parameters()).device
    ids, cu, chunks, noise = (x.to(dev) for x in _batch(T))
    model.zero_grad(set_to_none=True)
    logp, _ = sp_logprobs(model, ids, cu, shard)
    old = (logp.detach() + noise).masked_fill(chunks < 0, 0.0)
    out = policy_loss(logp, old, advantages=torch.tensor([1.0], device=dev), cu_seqlens=cu.int(), chunk_ids=chunks.int(),
                      config=LossConfig(ratio_level="token", clip_high=0.28))
    out.loss.backward()
    return None


def _worker(rank, world, port, args, lengths, q):
    import torch.distributed as dist

    from arl.model.ulysses import plan_shard
    from bench_logprob import peak_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, args.threads // world))
    try:
        model = _model(args.layers, args.hidden).to(args.device if not cuda else f"cuda:{rank}")
        out = {}
        for T in lengths:
            shard = plan_shard(torch.tensor([0, T]), world, rank)
            _step(model, T, shard)  # warm-up
            peak, _, _ = peak_bytes(lambda: _step(model, T, shard), next(model.parameters()).device)
            times = []
            for _ in range(args.reps if T == args.tokens else 0):
                dist.barrier()
                t0 = time.perf_counter()
                _step(model, T, shard)
                dist.barrier()
                times.append(time.perf_counter() - t0)
            out[T] = {"peak_mb": round(peak / 2**20, 1), "step_s": round(statistics.median(times), 3) if times else None}
        q.put((rank, out, None))
    except BaseException as e:
        q.put((rank, None, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def run(world: int, args, lengths) -> dict:
    if args.device == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"bench_sequence_parallel: SP={world} on cuda needs {world} GPUs, "
                         f"this machine has {torch.cuda.device_count()}")
    """{T: {"peak_mb": the largest rank's, "step_s"}} over ``world`` ranks."""
    from arl.procs import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, lengths, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = [q.get(timeout=args.timeout) for _ in procs]
    for p in procs:
        p.join(60)
    errs = [e for _, o, e in got if o is None]
    if errs:
        raise SystemExit(f"bench_sequence_parallel: SP={world} failed: {errs[0]}")
    ranks = {r: o for r, o, _ in got}
    return {T: {"peak_mb": max(ranks[r][T]["peak_mb"] for r in ranks),
                "peak_mb_per_rank": [ranks[r][T]["peak_mb"] for r in sorted(ranks)],
                "step_s": ranks[0][T]["step_s"]} for T in lengths}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="4096 tokens, 1 rep")
    ap.add_argument("--tokens", type=int, default=None, help="the trajectory's length (default 16384, quick 4096)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--reps", type=int, default=None, help="timed steps (median; default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads shared by the ranks")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: one GPU per rank over NCCL (SP=2 needs two GPUs)")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (4096 if args.quick else 16384)
    args.reps = args.reps or (1 if args.quick else 3)
    T = args.tokens
    sp1 = run(1, args, [T])
    cap = sp1[T]["peak_mb"]
    print(f"[sp] SP=1 T={T}: peak {cap} MB, step {sp1[T]['step_s']} s", flush=True)
    grid = [int(T * f) // 2 * 2 for f in (1.0, 1.5, 1.7, 1.8, 1.9, 2.0, 2.1, 2.2)]
    sp2 = run(2, args, grid)
    for L in grid:
        print(f"[sp] SP=2 T={L}: peak per rank {sp2[L]['peak_mb_per_rank']} MB", flush=True)
    fits = [L for L in grid if sp2[L]["peak_mb"] <= cap]
    longest2 = max(fits) if fits else None
    summary = {
        "bench": "sequence_parallel", "quick": args.quick, "tokens": T, "layers": args.layers, "hidden": args.hidden,
        "threads": args.threads, "cap_mb": cap,
        "peak_ratio_sp2": round(sp2[T]["peak_mb"] / cap, 3),
        "longest_ratio_sp2": round(longest2 / T, 3) if longest2 else 0.0,
        "longest_tokens": {"sp1": T, "sp2": longest2, "sp2_grid_top": grid[-1]},
        "step_time_ratio_sp2": round(sp2[T]["step_s"] / sp1[T]["step_s"], 3),
        "sp1": sp1, "sp2": sp2,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

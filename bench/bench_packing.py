"""Packing benchmark: arl's packer vs a padded baseline and a greedy first-fit packer.

A step of ``--n`` trajectories with lognormal lengths clipped to [min_len, max_len] (GRPO groups of
``--group-size``) goes to ``--ranks`` data-parallel ranks under a ``--token-budget`` per micro-batch.

  padded     arrival order, micro-batches of a fixed sequence count (budget // max_len), each padded
             to its longest sequence, dealt round-robin to ranks;
  first_fit  arrival order, varlen micro-batches filled first-fit under the budget, dealt round-robin;
  arl        arl.data.pack_step (Karmarkar-Karp over ranks, bucketed best-fit, groups kept whole).

Figures (means over seeds; the rank load ratio also as the worst seed):
  padding_waste_pct       padded slots / all slots of the micro-batches as built (arl: measured from
                          the MicroBatch tensors against the trajectories' lengths);
  rank_load_max_over_mean estimated compute sum(L + attn_coef L^2) of the busiest rank / the mean,
                          padding included for the padded baseline (it is computed);
  idle_pct                compute the other ranks spend waiting for the busiest one;
  lockstep_max_over_mean  sum over micro-batch index j of the slowest rank's j-th micro-batch, over the
                          mean rank load: the ratio if ranks synchronize at every micro-batch;
  budget_fill_pct         real tokens / (micro-batches x budget): the fill if every micro-batch were
                          padded to the budget (static shapes);
  micro_batches           total, and per rank (min, max).
Wall times are for information only (shared, noisy CPU).

    python bench/bench_packing.py --quick
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from arl.data import PackerConfig, Trajectory, estimated_compute, pack_step
from arl.data.packer import DEFAULT_ATTN_COEF


def make_step(rng, n, median, sigma, lo, hi, group_size):
    lengths = np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(np.int64)
    trajs = []
    for i, L in enumerate(lengths):
        cid = np.full(L, -1, dtype=np.int32)
        prompt = L // 10
        turns = np.array_split(np.arange(prompt, L), 6)  # model, obs, model, obs, model, obs
        for k, span in enumerate(turns[0::2]):
            cid[span] = k
        trajs.append(Trajectory(tokens=rng.integers(0, 32000, L, dtype=np.int32), chunk_ids=cid,
                                rollout_logp=np.zeros(L, dtype=np.float32), reward=float(rng.integers(0, 2)),
                                group_id=i // group_size))
    return trajs, lengths


def figures(mb_slots, mb_real, mb_compute, mb_rank, ranks, budget):
    """Figures of a list of micro-batches (slots, real tokens, compute, rank of each)."""
    slots, real = float(sum(mb_slots)), float(sum(mb_real))
    load = np.bincount(np.asarray(mb_rank), weights=np.asarray(mb_compute, dtype=np.float64), minlength=ranks)
    per_rank = np.bincount(np.asarray(mb_rank), minlength=ranks)
    # ranks in lock step per micro-batch (e.g. ZeRO-3 gathers): the j-th micro-batches wait for the slowest
    slot = np.zeros((ranks, int(per_rank.max())))
    seen = np.zeros(ranks, dtype=np.int64)
    for c, r in zip(mb_compute, mb_rank):
        slot[r, seen[r]] = c
        seen[r] += 1
    return {
        "padding_waste_pct": 100.0 * (slots - real) / slots,
        "rank_load_max_over_mean": float(load.max() / load.mean()),
        "idle_pct": 100.0 * float(1 - load.mean() / load.max()),
        "lockstep_max_over_mean": float(slot.max(axis=0).sum() / load.mean()),
        "budget_fill_pct": 100.0 * real / (len(mb_slots) * budget),
        "micro_batches": len(mb_slots),
        "micro_batches_per_rank_min": int(per_rank.min()),
        "micro_batches_per_rank_max": int(per_rank.max()),
    }


def padded_baseline(lengths, ranks, budget, per_mb, attn):
    mbs = [lengths[i:i + per_mb] for i in range(0, len(lengths), per_mb)]
    longest = [int(m.max()) for m in mbs]
    return figures([len(m) * L for m, L in zip(mbs, longest)], [int(m.sum()) for m in mbs],
                   [len(m) * float(estimated_compute([L], attn)[0]) for m, L in zip(mbs, longest)],
                   [j % ranks for j in range(len(mbs))], ranks, budget)


def first_fit_baseline(lengths, ranks, budget, attn):
    bins, load = [], []
    for i, L in enumerate(lengths):
        for b in range(len(bins)):
            if load[b] + L <= budget:
                bins[b].append(i)
                load[b] += int(L)
                break
        else:
            bins.append([i])
            load.append(int(L))
    return figures(load, load, [float(estimated_compute(lengths[b], attn).sum()) for b in bins],
                   [j % ranks for j in range(len(bins))], ranks, budget)


def arl_packer(trajs, lengths, ranks, budget, attn, seed):
    t0 = time.perf_counter()
    ps = pack_step(trajs, PackerConfig(token_budget=budget, num_ranks=ranks, attn_coef=attn, seed=seed))
    dt = time.perf_counter() - t0
    mbs = ps.all_micro_batches()
    f = figures([mb.num_tokens for mb in mbs],
                [int(lengths[mb.traj_indices.numpy()].sum()) for mb in mbs],
                [mb.est_compute for mb in mbs], [mb.rank for mb in mbs], ranks, budget)
    f["split_groups"] = len(ps.split_groups)
    f["empty_micro_batches"] = sum(mb.is_empty for mb in mbs)
    f["pack_time_ms"] = 1e3 * dt
    return f


def mean_of(rows):
    return {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed instead of --seeds")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--token-budget", type=int, default=65536)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--median", type=float, default=1024.0, help="median of the lognormal lengths")
    ap.add_argument("--sigma", type=float, default=1.0, help="sigma of the lognormal lengths")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--attn-coef", type=float, default=DEFAULT_ATTN_COEF)
    ap.add_argument("--seeds", type=int, default=5)
    a = ap.parse_args()
    if a.token_budget < a.max_len:
        raise SystemExit(f"--token-budget={a.token_budget} must be >= --max-len={a.max_len}")
    per_mb = max(1, a.token_budget // a.max_len)
    seeds = range(1 if a.quick else a.seeds)
    rows = {"arl": [], "padded": [], "first_fit": []}
    totals = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        trajs, lengths = make_step(rng, a.n, a.median, a.sigma, a.min_len, a.max_len, a.group_size)
        totals.append(int(lengths.sum()))
        rows["arl"].append(arl_packer(trajs, lengths, a.ranks, a.token_budget, a.attn_coef, seed))
        rows["padded"].append(padded_baseline(lengths, a.ranks, a.token_budget, per_mb, a.attn_coef))
        rows["first_fit"].append(first_fit_baseline(lengths, a.ranks, a.token_budget, a.attn_coef))
        r = rows["arl"][-1]
        print(f"seed {seed}: tokens {int(lengths.sum())}  arl waste {r['padding_waste_pct']:.2f}% "
              f"load {r['rank_load_max_over_mean']:.4f} mbs {r['micro_batches']}  |  padded waste "
              f"{rows['padded'][-1]['padding_waste_pct']:.1f}% load {rows['padded'][-1]['rank_load_max_over_mean']:.3f}"
              f"  |  first-fit load {rows['first_fit'][-1]['rank_load_max_over_mean']:.3f} "
              f"mbs {rows['first_fit'][-1]['micro_batches']}", flush=True)
    res = {name: mean_of(r) for name, r in rows.items()}
    arl = res["arl"]
    out = {
        "padding_waste_pct": arl["padding_waste_pct"],
        "rank_load_max_over_mean": arl["rank_load_max_over_mean"],
        "rank_load_max_over_mean_worst_seed": max(r["rank_load_max_over_mean"] for r in rows["arl"]),
        "micro_batches": arl["micro_batches"],
        "micro_batches_per_rank": arl["micro_batches_per_rank_max"],
        "micro_batches_per_rank_lower_bound": float(np.mean([-(-t // (a.ranks * a.token_budget)) for t in totals])),
        "idle_pct": arl["idle_pct"],
        "lockstep_max_over_mean": arl["lockstep_max_over_mean"],
        "budget_fill_pct": arl["budget_fill_pct"],
        "split_groups": arl["split_groups"],
        "empty_micro_batches": arl["empty_micro_batches"],
        "pack_time_ms": arl["pack_time_ms"],
        "padded_padding_waste_pct": res["padded"]["padding_waste_pct"],
        "padded_rank_load_max_over_mean": res["padded"]["rank_load_max_over_mean"],
        "padded_micro_batches": res["padded"]["micro_batches"],
        "first_fit_padding_waste_pct": res["first_fit"]["padding_waste_pct"],
        "first_fit_rank_load_max_over_mean": res["first_fit"]["rank_load_max_over_mean"],
        "first_fit_micro_batches": res["first_fit"]["micro_batches"],
        "padded_lockstep_max_over_mean": res["padded"]["lockstep_max_over_mean"],
        "first_fit_lockstep_max_over_mean": res["first_fit"]["lockstep_max_over_mean"],
        "first_fit_micro_batches_per_rank_min_max": [res["first_fit"]["micro_batches_per_rank_min"],
                                                     res["first_fit"]["micro_batches_per_rank_max"]],
        "baselines": {"padded": res["padded"], "first_fit": res["first_fit"]},
        "config": {"n": a.n, "ranks": a.ranks, "token_budget": a.token_budget, "min_len": a.min_len,
                   "max_len": a.max_len, "median": a.median, "sigma": a.sigma, "group_size": a.group_size,
                   "attn_coef": a.attn_coef, "seeds": len(seeds), "padded_seqs_per_micro_batch": per_mb},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()

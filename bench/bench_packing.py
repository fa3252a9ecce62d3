"""Packing benchmark: arl's packer vs padded baselines (arrival order, and length-sorted), an LPT
balancer and a greedy first-fit packer.

A step of ``--n`` trajectories with lognormal lengths clipped to [min_len, max_len] (GRPO groups of
``--group-size``) goes to ``--ranks`` data-parallel ranks under a ``--token-budget`` per micro-batch.

  padded     arrival order, micro-batches of a fixed sequence count (budget // max_len), each padded
             to its longest sequence, dealt round-robin to ranks;
  first_fit  arrival order, varlen micro-batches filled first-fit under the budget, dealt round-robin;
  sorted_pad, lpt  the two strong baselines of the measured part below, scored by the same model;
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

Measured (unless ``--no-measure``): the same three plans, plus an LPT balancer, are *run*: every
micro-batch of every rank goes through the packed forward + backward of the main job's model shape
(random weights; ``arl.model.packed.packed_logprobs``, the trainer's own path) on a smaller step
(``--measure-n`` sequences), and a rank's time is the sum of its micro-batches' measured times.
The plans, on the same sequences:
  arl          as above;
  lpt          a strong balancer without arl's constraints: sequences in decreasing estimated
               compute, each to the least-loaded rank (LPT), then first-fit-decreasing varlen
               micro-batches under the budget on each rank (groups may be split);
  sorted_pad   a length-sorted padded batcher (the "group by length" of HF-style trainers):
               sequences sorted by length, micro-batches of as many as fit ``count x longest <=
               budget``, dealt to ranks by LPT on padded size; each sequence is run padded to its
               micro-batch's longest (pads computed, as in a padded batch).
Measured figures, medians over ``--repeats`` runs (the plans interleaved, in a rotating order):
  step_s                  the busiest rank's time (ranks run in parallel; a synchronous step waits);
  rank_time_max_over_mean balance from measured times; idle_pct likewise;
  padding_time_pct        sorted_pad only: the share of its time spent on pad tokens (its
                          micro-batches also run unpadded, to measure it);
  speedup_vs_*            the baseline's step_s over arl's.

    python bench/bench_packing.py --quick
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from arl.data import PackerConfig, Trajectory, estimated_compute, pack_step
from arl.data.packer import DEFAULT_ATTN_COEF


def make_step(rng, n, median, sigma, lo, hi, group_size, vocab=32000):
    lengths = np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(np.int64)
    trajs = []
    for i, L in enumerate(lengths):
        cid = np.full(L, -1, dtype=np.int32)
        prompt = L // 10
        turns = np.array_split(np.arange(prompt, L), 6)  # model, obs, model, obs, model, obs
        for k, span in enumerate(turns[0::2]):
            cid[span] = k
        trajs.append(Trajectory(tokens=rng.integers(0, vocab, L, dtype=np.int32), chunk_ids=cid,
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


# ---------------------------------------------------------------- measured step time
def lpt_plan(lengths, ranks, budget, attn):
    """Micro-batches per rank (lists of sequence indices): LPT over ranks, then FFD within each."""
    cost = estimated_compute(lengths, attn)
    load, per_rank = np.zeros(ranks), [[] for _ in range(ranks)]
    for i in np.argsort(-cost, kind="stable"):
        r = int(load.argmin())
        per_rank[r].append(int(i))
        load[r] += cost[i]
    plan = []
    for seqs in per_rank:
        bins, fill = [], []
        for i in sorted(seqs, key=lambda j: -lengths[j]):
            b = next((k for k in range(len(bins)) if fill[k] + lengths[i] <= budget), None)
            if b is None:
                bins.append([]), fill.append(0)
                b = len(bins) - 1
            bins[b].append(i)
            fill[b] += int(lengths[i])
        plan.append(bins)
    return plan


def sorted_pad_plan(lengths, ranks, budget):
    """Micro-batches per rank: length-sorted padded batches, dealt by LPT on padded size."""
    order = [int(i) for i in np.argsort(-lengths, kind="stable")]
    mbs, cur = [], []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > budget:
            mbs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        mbs.append(cur)
    load, plan = np.zeros(ranks), [[] for _ in range(ranks)]
    for mb in sorted(mbs, key=lambda m: -len(m) * lengths[m[0]]):
        r = int(load.argmin())
        plan[r].append(mb)
        load[r] += len(mb) * lengths[mb[0]]
    return plan


def _time_micro_batch(model, tokens, lengths):
    """Seconds of one packed forward + backward of the sequences ``tokens`` split at ``lengths``."""
    import torch

    from arl.model.packed import packed_logprobs

    ids = torch.as_tensor(np.concatenate(tokens), dtype=torch.long)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.as_tensor(np.cumsum(lengths), dtype=torch.int32)
    t0 = time.perf_counter()
    logp, _ = packed_logprobs(model, ids, cu)
    logp.sum().backward()
    return time.perf_counter() - t0


def run_plan(model, trajs, plan, pad: bool):
    """Measured seconds per rank of a plan (lists of sequence-index micro-batches per rank)."""
    out = []
    for rank_mbs in plan:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for mb in rank_mbs:
            longest = max(len(trajs[i].tokens) for i in mb)
            toks = [np.pad(trajs[i].tokens, (0, longest - len(trajs[i].tokens)) if pad else (0, 0)) for i in mb]
            total += _time_micro_batch(model, toks, [len(t) for t in toks])
        out.append(total)
    return np.asarray(out)


def plan_figures(plan, lengths, ranks, budget, attn, pad: bool):
    """Cost-model figures of a plan (sequence-index micro-batches per rank)."""
    slots, real, comp, rank_of = [], [], [], []
    for r, mbs in enumerate(plan):
        for mb in mbs:
            L = lengths[mb]
            width = int(L.max()) if pad else None
            slots.append(len(mb) * width if pad else int(L.sum()))
            real.append(int(L.sum()))
            comp.append(len(mb) * float(estimated_compute([width], attn)[0]) if pad
                        else float(estimated_compute(L, attn).sum()))
            rank_of.append(r)
    return figures(slots, real, comp, rank_of, ranks, budget)


def arl_plan(trajs, ranks, budget, attn, seed):
    """arl's micro-batches as sequence-index lists per rank (the packer's own truncation aside)."""
    ps = pack_step(trajs, PackerConfig(token_budget=budget, num_ranks=ranks, attn_coef=attn, seed=seed))
    return [[[int(i) for i in mb.traj_indices.tolist()] for mb in per_rank if not mb.is_empty] for per_rank in ps.ranks]


def measured(a):
    """Real step time of each plan on the main job's model shape; returns the figures."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arl.config.schema import TinyModelConfig
    from arl.data.packer import attn_coef_for

    t = TinyModelConfig()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=t.vocab_size, hidden_size=t.hidden, num_hidden_layers=t.layers,
                                         num_attention_heads=t.heads, num_key_value_heads=t.kv_heads,
                                         intermediate_size=t.intermediate, max_position_embeddings=a.measure_max_len,
                                         tie_word_embeddings=t.tie_word_embeddings)).float().train()
    attn = attn_coef_for(t.hidden)
    rng = np.random.default_rng(a.measure_seed)
    trajs, lengths = make_step(rng, a.measure_n, a.measure_median, a.sigma, a.min_len, a.measure_max_len,
                               a.group_size, vocab=t.vocab_size)
    budget = a.measure_budget
    plans = {"arl": (arl_plan(trajs, a.ranks, budget, attn, a.measure_seed), False),
             "lpt": (lpt_plan(lengths, a.ranks, budget, attn), False),
             "sorted_pad": (sorted_pad_plan(lengths, a.ranks, budget), True),
             "sorted_pad_unpadded": (sorted_pad_plan(lengths, a.ranks, budget), False)}
    for name, (plan, _) in plans.items():  # every plan trains every sequence exactly once
        assert sorted(i for r in plan for mb in r for i in mb) == list(range(len(trajs))), name
    run_plan(model, trajs, plans["lpt"][0], False)  # warm-up (allocator, thread pool)
    times = {name: [] for name in plans}
    names = list(plans)
    for rep in range(a.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            plan, pad = plans[name]
            times[name].append(run_plan(model, trajs, plan, pad))
    res = {}
    for name, reps in times.items():
        step = [float(r.max()) for r in reps]
        k = int(np.argsort(step)[len(step) // 2])  # the median repeat
        r = reps[k]
        res[name] = {"step_s": step[k], "step_s_min": min(step), "step_s_max": max(step),
                     "rank_time_max_over_mean": float(r.max() / r.mean()), "idle_pct": 100.0 * float(1 - r.mean() / r.max()),
                     "micro_batches": sum(len(x) for x in plans[name][0]),
                     "tokens_per_s": float(lengths.sum() / step[k])}
    pad_s, unpad_s = np.median([x.sum() for x in times["sorted_pad"]]), np.median([x.sum() for x in times["sorted_pad_unpadded"]])
    res["sorted_pad"]["padding_time_pct"] = 100.0 * float(1 - unpad_s / pad_s)
    slots = sum(len(mb) * max(lengths[i] for i in mb) for r in plans["sorted_pad"][0] for mb in r)
    res["sorted_pad"]["padding_waste_pct"] = 100.0 * float(1 - lengths.sum() / slots)
    del res["sorted_pad_unpadded"]
    out = {"measured": res,
           "measured_speedup_vs_sorted_pad": res["sorted_pad"]["step_s"] / res["arl"]["step_s"],
           "measured_speedup_vs_lpt": res["lpt"]["step_s"] / res["arl"]["step_s"],
           "measured_config": {"n": a.measure_n, "median": a.measure_median, "max_len": a.measure_max_len,
                               "token_budget": budget, "ranks": a.ranks, "repeats": a.repeats, "threads": a.threads,
                               "tokens": int(lengths.sum()), "model": t.model_dump()}}
    for name, r in res.items():
        print(f"measured {name:10s} step {r['step_s']:.3f} s ({r['step_s_min']:.3f}-{r['step_s_max']:.3f})  "
              f"rank max/mean {r['rank_time_max_over_mean']:.3f}  micro-batches {r['micro_batches']}", flush=True)
    return out


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
    ap.add_argument("--no-measure", action="store_true", help="cost-model figures only, no model run")
    ap.add_argument("--measure-n", type=int, default=256, help="sequences of the measured step")
    ap.add_argument("--measure-median", type=float, default=384.0)
    ap.add_argument("--measure-max-len", type=int, default=2048)
    ap.add_argument("--measure-budget", type=int, default=4096, help="token budget of the measured step")
    ap.add_argument("--measure-seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="measured repeats (median reported)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the measured runs")
    a = ap.parse_args()
    if a.quick:
        a.measure_n, a.repeats = min(a.measure_n, 64), min(a.repeats, 3)
    if a.token_budget < a.max_len:
        raise SystemExit(f"--token-budget={a.token_budget} must be >= --max-len={a.max_len}")
    per_mb = max(1, a.token_budget // a.max_len)
    seeds = range(1 if a.quick else a.seeds)
    rows = {"arl": [], "padded": [], "first_fit": [], "sorted_pad": [], "lpt": []}
    totals = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        trajs, lengths = make_step(rng, a.n, a.median, a.sigma, a.min_len, a.max_len, a.group_size)
        totals.append(int(lengths.sum()))
        rows["arl"].append(arl_packer(trajs, lengths, a.ranks, a.token_budget, a.attn_coef, seed))
        rows["padded"].append(padded_baseline(lengths, a.ranks, a.token_budget, per_mb, a.attn_coef))
        rows["first_fit"].append(first_fit_baseline(lengths, a.ranks, a.token_budget, a.attn_coef))
        rows["sorted_pad"].append(plan_figures(sorted_pad_plan(lengths, a.ranks, a.token_budget), lengths, a.ranks,
                                               a.token_budget, a.attn_coef, pad=True))
        rows["lpt"].append(plan_figures(lpt_plan(lengths, a.ranks, a.token_budget, a.attn_coef), lengths, a.ranks,
                                        a.token_budget, a.attn_coef, pad=False))
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
        "sorted_pad_padding_waste_pct": res["sorted_pad"]["padding_waste_pct"],
        "sorted_pad_rank_load_max_over_mean": res["sorted_pad"]["rank_load_max_over_mean"],
        "sorted_pad_lockstep_max_over_mean": res["sorted_pad"]["lockstep_max_over_mean"],
        "lpt_rank_load_max_over_mean": res["lpt"]["rank_load_max_over_mean"],
        "lpt_lockstep_max_over_mean": res["lpt"]["lockstep_max_over_mean"],
        "baselines": {k: res[k] for k in ("padded", "first_fit", "sorted_pad", "lpt")},
        "config": {"n": a.n, "ranks": a.ranks, "token_budget": a.token_budget, "min_len": a.min_len,
                   "max_len": a.max_len, "median": a.median, "sigma": a.sigma, "group_size": a.group_size,
                   "attn_coef": a.attn_coef, "seeds": len(seeds), "padded_seqs_per_micro_batch": per_mb},
    }
    if not a.no_measure:
        out.update(measured(a))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

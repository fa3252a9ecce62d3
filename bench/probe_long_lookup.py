"""Where a ``long_lookup`` policy fails: greedy held-out success on the whole task family and on
fork-free chains, and what its call is right after a fork (the ``go`` key, the ``no`` key, or
anything else, malformed calls included), and how its sampling policy splits between the two keys
of a fork on the expert's path (``fork_sampling``), and each failed episode's first wrong turn by
kind (``first_error``: a copy slip, a repeat, a distractor, a malformed call, ...), and, on a
task with marks, how often the turn after a marked key checks it (``after_mark``) and the sampling
policy's chance of that check on the expert's path (``p_check_mean`` in ``fork_sampling``).

    python bench/probe_long_lookup.py runs/cal/lh_sft/snapshots/sft500 --tasks 32
    python bench/probe_long_lookup.py MODEL_DIR --quick
    python bench/probe_long_lookup.py MODEL_DIR --tasks 12 --sighted-sft 200   # is the rule learnable?

It runs the config's engine and episode code (``arl.rollout``) on the HF model in MODEL_DIR; the
last stdout line is one JSON object: per family ``success`` and ``after_fork`` counts, and ``fork_sampling``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FAMILIES = {"whole": {}, "fork_free": {"min_forks": 0, "max_forks": 0}}


def first_error_kind(env, turn, last_obs) -> str:
    """'' for a turn that goes on along the chain (either way of a fork counts: ``after_fork``
    tells those apart), else what went wrong: malformed, distractor (peek/values), wrong_answer
    (wrong or before the value was shown), lookup_after_value, after_dead_end (a trap followed to
    its end), repeat (a key looked up before), copy (a key the last observation did not show; copy_added_prefix /
    copy_dropped_prefix: a shown key with a twin's letter added or dropped)."""
    from arl.env.long_lookup import DEAD_END

    if turn.kind == "error":
        return "malformed"
    if last_obs == DEAD_END:
        return "after_dead_end"
    shown = [w for w in (last_obs or "").split() if w in env.table or w == env.value] if last_obs else [env.chain[0]]
    if turn.kind == "answer":
        return "" if turn.answer == env.value and env.value in shown else "wrong_answer"
    if turn.tool != "lookup":
        return "distractor"
    if env.value in shown:
        return "lookup_after_value"
    key = turn.arguments.get("key")
    if key in shown:
        return ""
    if key in env._looked_up:
        return "repeat"
    if isinstance(key, str) and key[1:] in shown:
        return "copy_added_prefix"  # a twin's letter on a plain key
    if isinstance(key, str) and any(w[1:] == key for w in shown):
        return "copy_dropped_prefix"
    return "copy"


async def probe(config: str, model: str, n: int, overrides: tuple = ()) -> dict:
    from transformers import AutoTokenizer

    from arl.config import load_config
    from arl.data.tasks import EVAL_SEED_BASE
    from arl.env.long_lookup import MARK, LongLookupEnv, fork_ways
    from arl.env.toolcall import parse_turn
    from arl.rollout.episode import ChatFormat, run_episode
    from arl.rollout.worker import episode_config, run_engine

    cfg = load_config(config, [f"model.name_or_path={model}", *overrides])
    engine = run_engine(cfg, model)
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model))
    out = {}
    try:
        for name, kw in FAMILIES.items():
            after, order, letter, first_err, wins, won_after_no = Counter(), Counter(), Counter(), Counter(), [], [0]
            marks = Counter()

            async def one(i):
                env = LongLookupEnv(**{**cfg.env.kwargs, **kw}, max_turns=cfg.env.max_turns)
                step, last = env.step, [None]

                took_no, errored = [False], [False]

                async def recorded(text):
                    t = parse_turn(text, env.tool_specs)
                    if not errored[0]:  # the episode's first wrong turn, by kind
                        kind = first_error_kind(env, t, last[0])
                        if kind:
                            errored[0] = True
                            first_err[kind] += 1
                    ways = fork_ways(last[0])
                    if ways:  # this turn answers a fork
                        go_key, no_key, go_first = ways
                        key = t.arguments.get("key") if t.kind == "tool" else None
                        what = ("go" if key == go_key else "no" if key == no_key else
                                "malformed" if t.kind == "error" else "other")
                        after[what] += 1
                        took_no[0] |= what == "no"
                        # did it follow go, and was go listed first: a positional habit shows here
                        order[f"{what}|go_{'first' if go_first else 'second'}"] += 1
                        letter[f"{what}|go_{go_key[0]}"] += 1  # a letter habit shows here
                    if isinstance(last[0], str) and last[0].endswith(f" {MARK}"):  # this turn follows a mark
                        marks["seen"] += 1
                        marks["checked"] += t.kind == "tool" and t.tool == "peek"
                    res = await step(text)
                    last[0] = res.observation
                    return res

                env.step = recorded
                t = await run_episode(engine, env, fmt, EVAL_SEED_BASE + i, episode_config(cfg, greedy=True))
                wins.append(t.reward > 0)
                won_after_no[0] += bool(t.reward > 0 and took_no[0])

            await asyncio.gather(*(one(i) for i in range(n)))
            out[name] = {"tasks": n, "success": sum(wins) / n, "after_fork": dict(after),
                         "after_fork_by_order": dict(order), "after_fork_by_letter": dict(letter), "won_after_a_no": won_after_no[0],
                         "first_error": dict(first_err), "after_mark": dict(marks)}
    finally:
        await engine.close()
    return out


def first_of_two(a: float, b: float) -> float:
    """The chance of the first of two continuations with log-probs ``a`` and ``b``, between the two."""
    return 1.0 / (1.0 + math.exp(min(b - a, 700.0)))


async def fork_probs(config: str, model: str, n: int, overrides: tuple = ()) -> dict:
    """The sampling policy at forks: on the expert's path through ``n`` held-out tasks, the chance
    (at the rollout temperature, between the two keys) that the model's call takes the go key, and
    the first-listed key, and at each marked key the chance of checking it (``peek``) rather than looking
    it up.  A start that never samples one of the two cannot learn from comparing them."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arl.config import load_config
    from arl.data.tasks import EVAL_SEED_BASE
    from arl.env.long_lookup import LongLookupEnv, fork_ways
    from arl.env.toolcall import format_tool_call
    from arl.rollout.engine import Sample
    from arl.rollout.episode import ChatFormat, Episode, EpisodeConfig

    cfg = load_config(config, [f"model.name_or_path={model}", *overrides])
    fmt = ChatFormat(AutoTokenizer.from_pretrained(model))
    lm = AutoModelForCausalLM.from_pretrained(model).eval()
    temp = cfg.rollout.temperature

    def logp(ctx: list, cont: list) -> float:
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            lp = torch.log_softmax(lm(ids).logits[0, :-1].float() / temp, -1)
        return float(lp[len(ctx) - 1:].gather(1, ids[0, len(ctx):, None]).sum())

    p_go, p_first, p_check = [], [], []
    for i in range(n):
        env = LongLookupEnv(**cfg.env.kwargs, max_turns=cfg.env.max_turns)
        ep = Episode(env, fmt, EpisodeConfig(max_turns=cfg.env.max_turns,
                                             max_total_tokens=cfg.rollout.max_total_tokens), EVAL_SEED_BASE + i)
        await ep.start()
        for k, text in enumerate(env.expert_turns()[:-1]):
            ids = fmt.encode(text)
            await ep.apply(Sample(ids, [0.0] * len(ids), text, "stop"))
            if k in env.forks:
                go_key, no_key, go_first = fork_ways(env.table[env.chain[k]])
                a, b = (logp(ep.tokens, fmt.encode(format_tool_call("lookup", {"key": w}))) for w in (go_key, no_key))
                p = first_of_two(a, b)
                p_go.append(p)
                p_first.append(p if go_first else 1.0 - p)
            if k + 1 in env.marked:  # the observation shows chain key k+1 marked: check it, or look it up
                key = env.chain[k + 1]
                a, b = (logp(ep.tokens, fmt.encode(format_tool_call(tool, {"key": key}))) for tool in ("peek", "lookup"))
                p_check.append(first_of_two(a, b))
    mean = lambda xs: statistics.mean(xs) if xs else None  # noqa: E731 (a family may have no forks or marks)
    return {"forks": len(p_go), "temperature": temp, "p_go_mean": mean(p_go),
            "p_first_listed_mean": mean(p_first),
            "forks_sampling_both_1pct": sum(0.01 < p < 0.99 for p in p_go),
            "marks": len(p_check), "p_check_mean": mean(p_check)}


def sighted_sft(config: str, model: str, steps: int, lr: float, n: int, every: int = 50,
                overrides: tuple = ()) -> list:
    """Can the model learn the fork rule at all?  SFT of a copy of MODEL on the *sighted* expert's
    demonstrations (the run's own tasks: every fork follows ``go``; 16 per step, AdamW, seeds from
    3,000,000) in this process, with ``fork_sampling`` on ``n`` held-out tasks every ``every``
    steps.  If full supervision cannot move P(go) off 0.5, outcome reward cannot either."""
    import random
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arl.config import load_config
    from arl.rollout.episode import ChatFormat
    from arl.rollout.expert import expert_demos, expert_env_kwargs

    cfg = load_config(config, [f"model.name_or_path={model}", *overrides])
    tok = AutoTokenizer.from_pretrained(model)
    demos = expert_demos(cfg, ChatFormat(tok), 512, seed_base=3_000_000,
                         env_kwargs=expert_env_kwargs(cfg, keep_task_definition=True))
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model).train()
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)
    rng, curve = random.Random(0), []
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, steps + 1):
            batch = rng.sample(demos, min(16, len(demos)))
            ids = torch.zeros(len(batch), max(len(t) for t in batch), dtype=torch.long)
            labels = torch.full_like(ids, -100)
            for b, t in enumerate(batch):
                x = torch.as_tensor(t.tokens).long()
                ids[b, :len(t)] = x
                labels[b, :len(t)] = torch.where(torch.as_tensor(t.chunk_ids >= 0), x, -100)
            loss = lm(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            if step % every == 0 or step == steps:
                lm.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                fs = asyncio.run(fork_probs(config, tmp, n, overrides))
                curve.append({"step": step, "nll_per_token": round(float(loss), 5), "p_go_mean": fs["p_go_mean"],
                              "p_first_listed_mean": fs["p_first_listed_mean"]})
                print(f"sighted SFT step {step}: nll/token {float(loss):.4f}  P(go) {fs['p_go_mean']}",
                      file=sys.stderr, flush=True)
    return curve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF model directory with its tokenizer (a snapshot or a run's hf/)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. env.kwargs.slack=0")
    ap.add_argument("--config", default=str(ROOT / "configs" / "long_horizon_cpu.yaml"))
    ap.add_argument("--tasks", type=int, default=32, help="held-out tasks per family")
    ap.add_argument("--quick", action="store_true", help="4 tasks per family (and 2 sighted SFT steps)")
    ap.add_argument("--sighted-sft", type=int, default=0, metavar="STEPS",
                    help="also: SFT a copy on the sighted expert for STEPS steps, P(go) every 50 (learnability)")
    ap.add_argument("--sighted-lr", type=float, default=1e-3)
    args = ap.parse_args(argv)
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("HF_HUB_OFFLINE", "1"),
                 ("VLLM_LOGGING_LEVEL", "WARNING")):
        os.environ.setdefault(k, v)
    if not (Path(args.model) / "config.json").is_file():
        print(f"probe_long_lookup: error: {args.model} is no HF model directory (no config.json)", file=sys.stderr)
        return 2
    n = 4 if args.quick else args.tasks
    out = asyncio.run(probe(args.config, args.model, n, tuple(args.overrides)))
    out["fork_sampling"] = asyncio.run(fork_probs(args.config, args.model, n, tuple(args.overrides)))
    if args.sighted_sft:
        steps = min(args.sighted_sft, 2) if args.quick else args.sighted_sft
        out["sighted_sft"] = sighted_sft(args.config, args.model, steps, args.sighted_lr, min(n, 12),
                                         overrides=tuple(args.overrides))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

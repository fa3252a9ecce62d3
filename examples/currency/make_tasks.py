"""Generate the currency example's data: conversions that need two tools in sequence (``get_rate``
then ``calculator``), in six categories (a wording and a currency pair each), as train and held-out
JSONL, and demonstrations of one category for the SFT warm start.

    python -m examples.currency.make_tasks --out examples/currency/data

Deterministic for a seed; held-out rows come from their own seed stream and never repeat a training
or demonstrated question.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from .tools import _RATES, CURRENCIES, calculator, rate

SYSTEM = ("You are a careful assistant. Look up the exchange rate with get_rate, multiply with the "
          "calculator, then give the final answer as a number.")

# (question template, base, quote)
KINDS = [
    ("Convert {a} USD to EUR.", "USD", "EUR"),
    ("How many Japanese yen (JPY) do you get for {a} British pounds (GBP)?", "GBP", "JPY"),
    ("A hotel room costs {a} EUR. What is the price in US dollars (USD)?", "EUR", "USD"),
    ("I send {a} CHF to a friend in Canada. How many CAD does the friend receive?", "CHF", "CAD"),
    ("My salary is {a} GBP. How much is that in EUR?", "GBP", "EUR"),
    ("A laptop is priced at {a} CAD. What does it cost in JPY?", "CAD", "JPY"),
]


PAIRS = [(b, q) for b in CURRENCIES for q in CURRENCIES if b != q and ((b, q) in _RATES or (q, b) in _RATES)]


def problem(rng: random.Random, any_pair: bool = False) -> dict:
    """A random task; ``any_pair``: its wording with a currency pair drawn from all known ones."""
    k = rng.randrange(len(KINDS))
    text, base, quote = KINDS[k]
    a = rng.randint(100, 9999)
    if any_pair:
        base, quote = rng.choice(PAIRS)
        text = text.replace(KINDS[k][1], "{base}").replace(KINDS[k][2], "{quote}")
    r = rate(base, quote)
    expr = f"{a} * {r}"
    return {"prompt": text.format(a=a, base=base, quote=quote), "answer": calculator(expr), "kind": k,
            "calls": [{"name": "get_rate", "arguments": {"base": base, "quote": quote}},
                      {"name": "calculator", "arguments": {"expression": expr}}]}


def demonstration(row: dict) -> dict:
    rate_call, calc_call = row["calls"]
    r = rate(rate_call["arguments"]["base"], rate_call["arguments"]["quote"])
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [rate_call]},
        {"role": "tool", "content": r},
        {"role": "assistant", "content": "", "tool_calls": [calc_call]},
        {"role": "tool", "content": row["answer"]},
        {"role": "assistant", "content": f"The answer is {row['answer']}."},
    ]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="examples/currency/data")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=32)
    ap.add_argument("--demos", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--demo-kinds", default="0", help="comma-separated KINDS indices the demonstrations show")
    # the demonstrated category has one currency pair: its demonstrations teach a constant get_rate
    # call (docs/your_task.md, the currency section); these show its wording with every known pair instead
    ap.add_argument("--demos-any-pair", default="demos_any_pair.jsonl",
                    help="also write demonstrations of the same categories with any currency pair here ('' : none)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    train = [problem(rng) for _ in range(a.train)]
    kinds = {int(k) for k in a.demo_kinds.split(",")}
    demos = []
    while len(demos) < a.demos:
        r = problem(rng)
        if r["kind"] in kinds:
            demos.append(r)
    arng, any_pair = random.Random(a.seed + 2), []  # own stream: the other files do not change
    while len(any_pair) < (a.demos if a.demos_any_pair else 0):
        r = problem(arng, any_pair=True)
        if r["kind"] in kinds:
            any_pair.append(r)
    seen = {r["prompt"] for r in train + demos}
    erng, held = random.Random(a.seed + 1), []
    while len(held) < a.eval:
        r = problem(erng)
        if r["prompt"] not in seen:
            held.append(r)
            seen.add(r["prompt"])

    def write(name, rows):
        with open(out / name, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    write("train.jsonl", train)
    write("eval.jsonl", held)
    write("demos.jsonl", [demonstration(r) for r in demos])
    if a.demos_any_pair:
        write(a.demos_any_pair, [demonstration(r) for r in any_pair])
    print(f"wrote {len(train)} train, {len(held)} held-out tasks and {len(demos)} demonstrations "
          f"(+ {len(any_pair)} with any pair) to {out}")


if __name__ == "__main__":
    main()

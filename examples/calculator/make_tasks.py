"""Generate the calculator example's data: word problems whose numbers are too large to do in the
head (train and held-out JSONL) and tool-using demonstrations for the optional SFT warm start.

    python -m examples.calculator.make_tasks --out examples/calculator/data

Deterministic for a seed.  Held-out problems use their own seed stream and are checked against the
training set, so no held-out question is ever trained on (nor demonstrated).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from .tools import calculator, convert_units

SYSTEM = "You are a careful assistant. Use the tools for every calculation, then give the final answer as a number."

# (question template, tool name, argument builder) -- the tool call that solves it in one step
KINDS = [
    ("A warehouse holds {a} boxes and receives {b} more. How many boxes does it hold now?", "calculator",
     lambda a, b: {"expression": f"{a} + {b}"}),
    ("A library had {a} books and gave away {b} of them. How many books are left?", "calculator",
     lambda a, b: {"expression": f"{a} - {b}"}),
    ("Each crate holds {b} apples. How many apples are in {a} crates?", "calculator",
     lambda a, b: {"expression": f"{a} * {b}"}),
    ("A road is {a} km long. How long is it in meters?", "convert_units",
     lambda a, b: {"value": a, "from_unit": "km", "to_unit": "m"}),
    ("A truck carries {a} kg. How many grams is that?", "convert_units",
     lambda a, b: {"value": a, "from_unit": "kg", "to_unit": "g"}),
]
TOOLS = {"calculator": calculator, "convert_units": convert_units}


def problem(rng: random.Random) -> dict:
    k = rng.randrange(len(KINDS))
    text, tool, args_of = KINDS[k]
    a = rng.randint(1000, 99999)
    b = rng.randint(100, 9999) if k != 1 else rng.randint(100, a - 1)
    args = args_of(a, b)
    answer = TOOLS[tool](**args)
    return {"prompt": text.format(a=a, b=b), "answer": answer, "kind": k, "call": {"name": tool, "arguments": args}}


def demonstration(row: dict) -> dict:
    call = row["call"]
    return {"messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": row["answer"]},
        {"role": "assistant", "content": f"The answer is {row['answer']}."},
    ]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="examples/calculator/data")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--demos", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    # the demonstrations show addition only: subtraction, multiplication and the unit converter are
    # left for RL to find from the reward (with every kind demonstrated, SFT alone solved 100%)
    ap.add_argument("--demo-kinds", default="0", help="comma-separated KINDS indices the demonstrations show")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    train = [problem(rng) for _ in range(a.train)]
    kinds = {int(k) for k in a.demo_kinds.split(",")}
    demos = []
    while len(demos) < a.demos:  # from the same stream, never a training or held-out problem
        r = problem(rng)
        if r["kind"] in kinds:
            demos.append(r)
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
    print(f"wrote {len(train)} train, {len(held)} held-out tasks and {len(demos)} demonstrations to {out}")


if __name__ == "__main__":
    main()

"""Tasks of the MCP example: convert a length or mass with the server's ``convert`` tool, then one
step of arithmetic with its ``calculator`` (two tools in sequence).  ``answer``: the result to 2
decimals, computed as the server computes it.  ``python -m examples.mcp.make_tasks`` rewrites
examples/mcp/data/{train,eval}.jsonl (seeded: the same files every time)."""
from __future__ import annotations

import json
import random
from pathlib import Path

PAIRS = [("mi", "km"), ("ft", "m"), ("in", "cm"), ("lb", "kg"), ("oz", "g"), ("km", "mi")]
FACTOR = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344,
          "g": 0.001, "kg": 1.0, "lb": 0.45359237, "oz": 0.028349523125}


def task(rng: random.Random) -> dict:
    src, dst = rng.choice(PAIRS)
    value, times = rng.randint(2, 90), rng.randint(2, 9)
    converted = round(value * FACTOR[src] / FACTOR[dst], 2)
    answer = round(converted * times, 2)
    return {"prompt": f"One box holds {value} {src}. How many {dst} do {times} boxes hold?",
            "answer": f"{answer:g}",
            "calls": [{"name": "convert", "arguments": {"value": value, "from_unit": src, "to_unit": dst}},
                      {"name": "calculator", "arguments": {"expression": f"{converted:g} * {times}"}}]}


def main() -> None:
    rng, out = random.Random(0), Path(__file__).parent / "data"
    out.mkdir(exist_ok=True)
    for name, n in (("train", 64), ("eval", 16)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(task(rng)) + "\n" for _ in range(n)))


if __name__ == "__main__":
    main()

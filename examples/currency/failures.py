"""Why held-out episodes of the currency example fail, counted from a run's transcripts.

    python -m examples.currency.failures runs/currency/transcripts/heldout_step0.jsonl [...]

Each episode gets one kind, the first thing that went wrong, in this order: a fault; no tool call at
all; a turn that used the whole ``rollout.max_turn_tokens`` (cut off); a bad ``get_rate`` call (an
error, or the wrong pair); the calculator skipped; a bad calculator call (an error, or a result
that is not the answer); the turn limit hit before an answer; an answer whose number is not the
calculator's.  Also the first get_rate pair of the categories the demonstrations do not show
(1-5), and per category (``kind`` in the data): successes / episodes.
"""
from __future__ import annotations

import argparse
import collections
import json

from .reward import last_number

KINDS = ["success", "fault", "no tool call", "turn cut at max_turn_tokens", "bad get_rate call",
         "skipped calculator", "bad calculator call", "max_turns before answer", "wrong final number", "other"]


def classify(tr: dict, row: dict, max_turn_tokens: int, count_tokens=None) -> str:
    if tr["reward"] > 0 and tr["fault"] == "none":
        return "success"
    if tr["fault"] != "none":
        return "fault"
    turns = [s for s in tr["turns"] if s["role"] == "assistant"]
    calls = tr.get("calls", [])
    if not calls:
        return "no tool call"
    if any((s["tokens"] if "tokens" in s else count_tokens(s["text"]) if count_tokens else 0) >= max_turn_tokens
           for s in turns):
        return "turn cut at max_turn_tokens"
    rate = [c for c in calls if c["tool"] == "get_rate"]
    want = row["calls"][0]["arguments"]
    if not rate or rate[0]["error"] or {k: str(v).upper() for k, v in (rate[0]["args"] or {}).items()} != want:
        return "bad get_rate call"
    calc = [c for c in calls if c["tool"] == "calculator"]
    if not calc:
        return "max_turns before answer" if tr["truncated"] == "max_turns" else "skipped calculator"
    if calc[0]["error"]:
        return "bad calculator call"
    from .tools import calculator
    try:
        if calculator(calc[0]["args"]["expression"]) != row["answer"]:
            return "bad calculator call"
    except Exception:
        return "bad calculator call"
    if tr["truncated"] == "max_turns":
        return "max_turns before answer"
    if last_number(turns[-1]["text"]) != row["answer"]:
        return "wrong final number"
    return "other"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("transcripts", nargs="+", help="heldout_step<N>.jsonl files (a run's transcripts/) or arl.eval --out rows")
    ap.add_argument("--eval", default="examples/currency/data/eval.jsonl")
    ap.add_argument("--max-turn-tokens", type=int, default=64)
    ap.add_argument("--model", default="models/smollm2-135m-instruct",
                    help="its tokenizer counts a turn's tokens where the transcript does not say")
    a = ap.parse_args(argv)
    count_tokens = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(a.model)
        count_tokens = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    except Exception:
        pass
    held = [json.loads(x) for x in open(a.eval)]
    for path in a.transcripts:
        rows = [json.loads(x) for x in open(path)]
        counts, per_kind = collections.Counter(), collections.defaultdict(lambda: [0, 0])
        pairs = collections.Counter()  # the first get_rate call of the non-demonstrated categories
        for r in rows:
            tr = r["transcript"]
            row = next(h for h in held if h["prompt"] in tr["prompt"])
            kind = classify(tr, row, a.max_turn_tokens, count_tokens)
            counts[kind] += 1
            if row["kind"] != 0:
                first = next((c for c in r["transcript"].get("calls", []) if c["tool"] == "get_rate"), None)
                pairs["none" if first is None else "error" if first["error"] else
                      "{base}/{quote}".format(**first["args"]) if set(first["args"] or {}) == {"base", "quote"} else "other"] += 1
            per_kind[row["kind"]][0] += kind == "success"
            per_kind[row["kind"]][1] += 1
        print(f"{path}: {counts['success']}/{len(rows)} succeed")
        print("  " + ", ".join(f"{k}: {counts[k]}" for k in KINDS if counts[k]))
        print("  first get_rate pair, categories 1-5: " + ", ".join(f"{k}: {n}" for k, n in pairs.most_common()))
        print("  per category (successes/episodes): " + ", ".join(f"{k}: {s}/{n}" for k, (s, n) in sorted(per_kind.items())))


if __name__ == "__main__":
    main()

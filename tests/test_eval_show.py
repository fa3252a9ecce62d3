"""``arl.eval --show`` and the held-out transcripts: a scripted engine plays the currency example
(examples/currency) through the evaluation's own episode code; the transcript holds each turn's
text, its tool call and the observation after it, and the reward."""
from __future__ import annotations

import json

from arl.config import load_config
from arl.eval import show
from arl.rollout import ChatFormat
from arl.rollout.engine import Sample
from arl.rollout.transcript import format_transcript
from arl.rollout.worker import eval_samples, evaluate, evaluate_tasks, task_set

HELD = [json.loads(x) for x in open("examples/currency/data/eval.jsonl")]


class ScriptedEngine:
    """Answers each episode's turns from the held-out row's own calls (``generate_one`` is all an
    episode asks of an engine): get_rate, then calculator, then the answer."""

    def __init__(self, tokenizer, wrong_answer=False):
        self.tok, self.wrong = tokenizer, wrong_answer

    async def generate_one(self, tokens, sampling):
        text = self.tok.decode(tokens)
        row = next(r for r in HELD if r["prompt"] in text)
        k = text.count("<tool_call>") - text.count("<tool_call>", 0, text.index(row["prompt"]))
        if k < 2:
            out = "<tool_call>" + json.dumps(row["calls"][k]) + "</tool_call>"
        else:
            out = f"The answer is {'1' if self.wrong else row['answer']}."
        ids = self.tok.encode(out, add_special_tokens=False)
        return Sample(ids, [0.0] * len(ids), out, "stop")


def test_transcripts_show_turns_calls_observations_and_reward(tiny_tokenizer, arun, tmp_path, capsys):
    cfg = load_config("examples/currency/config.yaml", [f"output_dir={tmp_path}", "rollout.max_total_tokens=2048",
                                                      "trainer.micro_batch_tokens=2048"])
    fmt = ChatFormat(tiny_tokenizer)
    rows = arun(evaluate_tasks(ScriptedEngine(tiny_tokenizer), fmt, cfg, 3, task_set(cfg), transcripts=True))
    assert [r["success"] for r in rows] == [True] * 3
    tr = rows[0]["transcript"]
    assert HELD[0]["prompt"] in tr["prompt"] and tr["reward"] == 1.0 and tr["fault"] == "none"
    roles = [s["role"] for s in tr["turns"]]
    assert roles == ["assistant", "observation", "assistant", "observation", "assistant"]
    assert [s.get("call") for s in tr["turns"] if s["role"] == "assistant"] == ["get_rate", "calculator", None]
    rate = tr["turns"][1]["text"]
    assert "190.37" in rate  # GBP -> JPY, what get_rate answered
    assert HELD[0]["answer"] in tr["turns"][3]["text"] and HELD[0]["answer"] in tr["turns"][4]["text"]
    json.dumps(rows)  # a row with its transcript is JSON

    show(rows, 2)
    out = capsys.readouterr().out
    assert out.count("--- task") == 2 and "call calculator]" in out and "reward 1," in out
    assert "[observation]" in out and "How many Japanese yen" in out

    # a run's evaluation writes the same rows, transcripts included
    path = tmp_path / "transcripts" / "heldout_step0.jsonl"
    acc = arun(evaluate(ScriptedEngine(tiny_tokenizer, wrong_answer=True), fmt, cfg, 2, task_set(cfg), save_to=str(path)))
    saved = [json.loads(x) for x in path.read_text().splitlines()]
    assert acc == 0.0 and len(saved) == 2 and saved[0]["transcript"]["reward"] == 0.0
    assert "The answer is 1." in format_transcript(saved[0])
    # the first few, rendered, are what an evaluation sends for the W&B table (logging.wandb.samples)
    samples = eval_samples(saved, 1)
    assert samples == [{"seed": saved[0]["seed"], "success": False, "reward": 0.0,
                        "transcript": format_transcript(saved[0])}]
    assert eval_samples(saved, 0) == [] and len(eval_samples(saved, 5)) == 2

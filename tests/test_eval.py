"""``python -m arl.eval``: the held-out rows on the session's vLLM engine (one engine per test
session: the command's own engine start is left out), the table and output files, and the
command line's one-line errors (no engine)."""
import io
import json

import pytest
from rich.console import Console

from arl.config import load_config
from arl.eval import evaluate_model, main, render, summarize, write_out
from arl.rollout.worker import EVAL_SEED_BASE

SMALL = ["rollout.max_turn_tokens=24", "rollout.max_total_tokens=320", "env.max_turns=3", "env.kwargs.max_hops=2", "env.pool_size=4"]


@pytest.mark.slow  # the session vLLM engine
def test_held_out_rows_on_the_engine(vllm_engine, arun, tiny_model_dir, tmp_path):
    cfg = load_config(None, SMALL)
    rows = arun(evaluate_model(cfg, str(tiny_model_dir), 3, engine=vllm_engine))
    assert [r["task"] for r in rows] == [0, 1, 2] and [r["seed"] for r in rows] == [EVAL_SEED_BASE + i for i in range(3)]
    for r in rows:
        assert set(r) == {"task", "seed", "reward", "success", "turns", "tool_calls", "tool_errors", "fault",
                          "fault_reason", "truncated", "reward_exception"}
        assert 1 <= r["turns"] <= 3 and r["tool_calls"] + r["tool_errors"] <= r["turns"]
        assert r["success"] == (r["reward"] > 0 and r["fault"] == "none")
    # greedy: the same rows again (what the run's evaluation of these weights would give)
    assert arun(evaluate_model(cfg, str(tiny_model_dir), 3, engine=vllm_engine)) == rows
    assert vllm_engine.llm is not None  # an engine passed in is the caller's: not shut down

    s = summarize(rows)
    assert s["tasks"] == 3 and s["success"] == sum(r["success"] for r in rows) / 3
    buf = io.StringIO()
    render(rows, s, str(tiny_model_dir), cfg, Console(file=buf, width=200))
    text = buf.getvalue()
    assert "held-out success:" in text and str(EVAL_SEED_BASE + 2) in text and "tool calls" in text
    write_out(tmp_path / "rows.jsonl", rows, s, str(tiny_model_dir), None)
    assert [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()] == rows
    write_out(tmp_path / "sub" / "eval.json", rows, s, str(tiny_model_dir), "x.yaml")
    doc = json.loads((tmp_path / "sub" / "eval.json").read_text())
    assert doc["rows"] == rows and doc["tasks"] == 3 and doc["config"] == "x.yaml"


def _tokenizer_less_dir(tmp_path):
    d = tmp_path / "weights_only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.parametrize("argv,msg", [
    (lambda t, m: ["--model", str(t / "nope")], "--model: no such directory"),
    (lambda t, m: ["--model", str(t)], "has no config.json"),
    (lambda t, m: ["--model", str(_tokenizer_less_dir(t))], "--model: cannot load the tokenizer of"),
    (lambda t, m: ["--model", m, "--tasks", "0"], "--tasks: must be >= 1, got 0"),
    (lambda t, m: ["--model", m, "env.eval_tasks=0"], "--tasks: env.eval_tasks is 0 in the config; give --tasks N"),
    (lambda t, m: ["--model", m, "--out", str(t / "rows.csv")], "--out:"),
    (lambda t, m: ["--model", m, "env.max_turn=3"], "env.max_turn: unknown key"),
    (lambda t, m: ["--model", m, "--config", str(t / "missing.yaml")], "--config: no such file"),
    (lambda t, m: ["--model", m, "rollout.engine_kwargs.max_num_seq=8"],
     "rollout.engine_kwargs.max_num_seq: not a vLLM engine argument; did you mean max_num_seqs"),
], ids=["no-dir", "no-config-json", "no-tokenizer", "tasks-0", "eval-tasks-0", "out-suffix", "bad-key", "no-yaml",
        "engine-kwarg"])
def test_command_line_errors_are_one_line(argv, msg, tmp_path, tiny_model_dir, capsys):
    assert main(argv(tmp_path, str(tiny_model_dir))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.eval: error: ") and msg in err and "\n" not in err, err


def test_model_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2 and "--model" in capsys.readouterr().err

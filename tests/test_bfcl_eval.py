"""``python -m arl.eval --bench bfcl``'s scoring (arl/eval_bfcl.py): hand-written generations
(tests/fixtures/bfcl_generations.json) replayed through arl's episode code by a scripted engine (no
vLLM: the real engine's run is docs/bfcl.md's measurement) give per-category accuracies equal to
BFCL's own checkers' (tests/bfcl_ref.py); a checker exception marks its row and is counted; bad
command lines are one line."""
import asyncio
import json

import pytest

pytest.importorskip("bfcl_eval", reason="bash install.sh --bfcl")

from arl.config import load_config  # noqa: E402
from arl.env.bfcl import INSTALL_HINT, bfcl, load_entries, loader  # noqa: E402
from arl.eval import main as eval_main  # noqa: E402
from arl.eval_bfcl import DEFAULTS, default_parser, run_rows, summarize  # noqa: E402
from arl.rollout import ChatFormat, Sample  # noqa: E402
from bfcl_ref import CATEGORIES, FIXTURE, ref_multi_turn, ref_single  # noqa: E402


@pytest.fixture(scope="module")
def rows():
    return {r["id"]: r for r in load_entries(CATEGORIES, limit=4)}


# -- the eval harness on replayed generations ----------------------------------------------------------
class ReplayEngine:
    """Answers each episode's next model turn with its recorded text (the row is found by its first
    user message in the prompt)."""

    def __init__(self, fmt, script):
        self.fmt, self.script, self.count = fmt, script, {k: 0 for k in script}

    async def generate_one(self, tokens, sampling):
        prompt = self.fmt.tokenizer.decode(tokens)
        key = next(k for k in self.script if k in prompt)
        text = self.script[key][self.count[key]]
        self.count[key] += 1
        ids = self.fmt.encode(text) + [self.fmt.eos_token_id]
        return Sample(ids, [0.0] * len(ids), text, "stop")


def replay(rows, tiny_model_dir, monkeypatch=None, fail_id=None, transcripts=False):
    from transformers import AutoTokenizer

    fmt = ChatFormat(AutoTokenizer.from_pretrained(tiny_model_dir))
    gens = [(rows[g["id"]], [g["text"]]) for g in FIXTURE["single_turn"]]
    mt = FIXTURE["multi_turn"][1]
    gens.append((rows[mt["id"]], [t for turn in mt["turns"] for t in turn]))
    script = {e["question"][0][-1]["content"]: texts for e, texts in gens}
    cfg = load_config(None, DEFAULTS + [f"env.kwargs.categories={json.dumps(CATEGORIES)}", "env.tool_parser=hermes",
                                        "rollout.max_total_tokens=200000", "trainer.micro_batch_tokens=200000"])
    if fail_id is not None:  # fault injection: BFCL's checker raises on one row
        real = bfcl().ast_checker

        def flaky(func, out, answer, *a):
            if func == rows[fail_id]["function"]:
                raise KeyError("injected")
            return real(func, out, answer, *a)

        monkeypatch.setattr(bfcl(), "ast_checker", flaky)
    entries = [e for e, _ in gens]
    return entries, asyncio.run(run_rows(ReplayEngine(fmt, script), fmt, cfg, str(tiny_model_dir), entries, transcripts))


def test_harness_per_category_accuracy_equals_bfcls(rows, tiny_model_dir):
    entries, got = replay(rows, tiny_model_dir)
    summary = summarize(got, CATEGORIES)
    gens = FIXTURE["single_turn"] + [FIXTURE["multi_turn"][1]]
    ref = [ref_single(e, g["text"]) if "text" in g else ref_multi_turn(e, g["turns"]) for e, g in zip(entries, gens)]
    assert [r["valid"] for r in got] == ref and [r["id"] for r in got] == [e["id"] for e in entries]
    for c in CATEGORIES:
        mine = [ok for e, ok in zip(entries, ref) if e["category"] == c]
        assert summary["categories"][c]["accuracy"] == sum(mine) / len(mine), c
    agg = summary["aggregates"]
    assert agg["non-live AST"]["categories"] == ["simple_python"] and agg["irrelevance"]["accuracy"] == \
        (summary["categories"]["irrelevance"]["accuracy"] + summary["categories"]["live_irrelevance"]["accuracy"]) / 2
    assert agg["multi-turn"]["accuracy"] == 0.0 and summary["checker_errors"] == 0


def test_a_checker_exception_marks_its_row_and_the_run_goes_on(rows, tiny_model_dir, monkeypatch):
    entries, got = replay(rows, tiny_model_dir, monkeypatch, fail_id="simple_python_0")
    bad = [r for r in got if r["checker_error"]]
    assert [r["id"] for r in bad] == ["simple_python_0"] and not bad[0]["valid"]
    assert "injected" in bad[0]["error"] and bad[0]["fault"] == "recoverable"
    assert len(got) == len(entries) and summarize(got, CATEGORIES)["checker_errors"] == 1
    assert any(r["valid"] for r in got)  # the other rows were scored


# -- bad command lines, one line each -------------------------------------------------------------
def test_bfcl_not_installed_is_one_line(monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    bfcl.cache_clear()
    try:
        assert eval_main(["--bench", "bfcl", "--model", str(tiny_model_dir)]) == 2
        assert capsys.readouterr().err.strip() == f"arl.eval: error: {INSTALL_HINT}"
    finally:
        monkeypatch.undo()
        bfcl.cache_clear()


@pytest.mark.parametrize("argv,msg", [
    (["--categories", "live_simple,nope"], "bfcl: unknown category 'nope'; known: simple_python, "),
    (["--limit", "0"], "--limit: must be >= 1, got 0"),
    (["--out", "x.csv"], "--out: x.csv must end in .json"),
    (["rollout.max_turn_token=3"], "rollout.max_turn_token: unknown key"),
], ids=["category", "limit", "out", "override"])
def test_command_line_errors_are_one_line(argv, msg, capsys, tiny_model_dir):
    assert eval_main(["--bench", "bfcl", "--model", str(tiny_model_dir)] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("arl.eval: error: ") and msg in err and "\n" not in err, err


def test_tool_parser_follows_the_model_family(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert default_parser(tok) == "hermes"
    tok.chat_template = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endfor %}"
    assert default_parser(tok) == "llama3_json"


def test_show_prints_the_verdict_and_the_transcript(rows, tiny_model_dir, capsys):
    from arl.eval_bfcl import show

    entries, got = replay(rows, tiny_model_dir, transcripts=True)
    show(got, 2)
    out = capsys.readouterr().out
    assert "=== simple_python_0 (simple_python): BFCL valid" in out
    assert "=== simple_python_1 (simple_python): BFCL invalid (simple_function_checker:wrong_count" in out
    assert "The factorial of 5 is 120." in out


def test_a_template_without_tools_and_a_parser_that_cannot_read_hermes_is_one_line(capsys, tiny_model_dir):
    # the tiny model's template renders no tools: the prompt teaches Hermes, which qwen3_xml cannot read
    assert eval_main(["--bench", "bfcl", "--model", str(tiny_model_dir), "env.tool_parser=qwen3_xml"]) == 2
    err = capsys.readouterr().err.strip()
    assert "chat template does not render tools" in err and len(err.splitlines()) == 1, err

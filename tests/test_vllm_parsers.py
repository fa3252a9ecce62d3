"""vLLM's registered tool parsers through arl's door (env.tool_parser): Llama-3.1-style JSON calls and
Mistral-style [TOOL_CALLS] calls parsed, written back by the chat template, read by the tools env;
an unknown name and a parser that does not fit the model's tokenizer fail with one line.

No Llama/Mistral tokenizer is in the local HF cache: a byte-level tokenizer with each family's
special tokens and a template of tests/fixtures/tool_templates/ (its README says what they follow).
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from arl.env import make_env, make_parser
from arl.rollout.episode import ChatFormat

TEMPLATES = Path(__file__).parent / "fixtures" / "tool_templates"
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>"]
MISTRAL_SPECIAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]",
                   "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
RATE = {"type": "function", "function": {"name": "get_rate", "description": "FX rate", "parameters": {
    "type": "object", "properties": {"src": {"type": "string"}}, "required": ["src"]}}}


def byte_tokenizer(special, bos, eos, template):
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos)
    tok.add_special_tokens({"additional_special_tokens": [s for s in special if s not in (bos, eos)]})
    tok.chat_template = (TEMPLATES / template).read_text() if template else None
    return tok


@pytest.fixture(scope="module")
def llama_tok():
    return byte_tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", "llama31_style.jinja")


@pytest.fixture(scope="module")
def mistral_tok():
    return byte_tokenizer(MISTRAL_SPECIAL, "<s>", "</s>", "mistral_v11_style.jinja")


def calls(parsed):
    assert all(c.ok for c in parsed.calls), parsed
    return [(c.name, c.arguments) for c in parsed.calls]


def test_llama3_json_calls_through_the_registry(llama_tok):
    p = make_parser("llama3_json", llama_tok)
    p.tools = [RATE]
    assert calls(p.parse('{"name": "get_rate", "parameters": {"src": "EUR"}}')) == [("get_rate", {"src": "EUR"})]
    two = '<|python_tag|>{"name": "get_rate", "parameters": {"src": "EUR"}}; {"name": "get_rate", "parameters": {"src": "USD"}}'
    assert calls(p.parse(two)) == [("get_rate", {"src": "EUR"}), ("get_rate", {"src": "USD"})]
    assert p.parse("The rate is 1.1.").calls == [] and p.parse("The rate is 1.1.").content == "The rate is 1.1."
    bad = p.parse("Let me see. <|python_tag|>get_rate(src=EUR)")  # the format's marker, no call vLLM reads
    assert bad.content == "Let me see." and len(bad.calls) == 1
    assert bad.calls[0].error == ("error: a <|python_tag|> tool call the llama3_json format cannot read; write it "
                                  "as the format shows")
    # the template writes a demonstration's calls; the parser reads them back
    turn = p.format_calls("", [{"name": "get_rate", "arguments": {"src": "EUR"}},
                               {"type": "function", "function": {"name": "get_rate", "arguments": '{"src": "USD"}'}}])
    assert turn == '{"name": "get_rate", "parameters": {"src": "EUR"}}; {"name": "get_rate", "parameters": {"src": "USD"}}'
    assert calls(p.parse(turn)) == [("get_rate", {"src": "EUR"}), ("get_rate", {"src": "USD"})]


def test_mistral_calls_through_the_registry_keep_their_special_tokens(mistral_tok):
    p = make_parser("mistral", mistral_tok)
    two = '[TOOL_CALLS]get_rate[ARGS]{"src": "EUR"}[TOOL_CALLS]get_rate[ARGS]{"src": "USD"}'
    assert calls(p.parse(two)) == [("get_rate", {"src": "EUR"}), ("get_rate", {"src": "USD"})]
    turn = p.format_calls("", [{"name": "get_rate", "arguments": {"src": "EUR"}}])
    assert turn == '[TOOL_CALLS]get_rate[ARGS]{"src": "EUR"}' and calls(p.parse(turn)) == [("get_rate", {"src": "EUR"})]
    bad = p.parse('[TOOL_CALLS]get_rate[ARGS]["EUR"]')  # arguments not an object: an error for the model
    assert bad.calls and bad.calls[0].error and "JSON object" in bad.calls[0].error
    bad = p.parse('Let me see. [TOOL_CALLS]get_rate{src: EUR')  # unreadable: an error too, not the final answer
    assert len(bad.calls) == 1 and bad.calls[0].error.startswith("error: ")
    # [TOOL_CALLS] and [ARGS] are special tokens: the text the env reads keeps them (and only them)
    assert p.keep_tokens() == ("[ARGS]", "[TOOL_CALLS]")
    ids = mistral_tok.encode(two + "</s>", add_special_tokens=False)
    fmt = ChatFormat.__new__(ChatFormat)
    fmt.tokenizer = mistral_tok
    assert fmt.decode(ids) == 'get_rate{"src": "EUR"}get_rate{"src": "USD"}'  # what a plain decode loses
    assert fmt.decode(ids, p.keep_tokens()) == two


@pytest.fixture
def fxplug(tmp_path, monkeypatch):
    (tmp_path / "fxplug.py").write_text(
        "def get_rate(src: str) -> str:\n    '''FX rate.\n\n    Args:\n        src: currency\n    '''\n"
        "    return {'EUR': '1.1', 'USD': '1.0'}[src]\n\n"
        "def reward(task, episode):\n    return float(task['answer'] in episode.final_answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_tools_env_runs_mistral_calls(mistral_tok, fxplug):
    env = make_env("tools", tools=["fxplug:get_rate"], reward_fn="fxplug:reward", parser="mistral", tokenizer=mistral_tok)
    assert env.keep_tokens == ("[ARGS]", "[TOOL_CALLS]")

    async def play():
        await env.reset(0, task={"prompt": "EUR and USD?", "answer": "1.1"})
        r = await env.step('[TOOL_CALLS]get_rate[ARGS]{"src": "EUR"}[TOOL_CALLS]get_rate[ARGS]{"src": "USD"}')
        end = await env.step("EUR is 1.1")
        return r, end

    r, end = asyncio.run(play())
    assert r.observation == ["1.1", "1.0"] and not r.done and end.done and end.reward == 1.0


def test_unknown_or_unfitting_parser_fails_in_one_line(llama_tok, mistral_tok, fxplug):
    with pytest.raises(ValueError) as e:
        make_parser("llama3_jsn", llama_tok)
    assert "unknown 'llama3_jsn'" in str(e.value) and "llama3_json" in str(e.value) and "\n" not in str(e.value)
    # a model whose tokenizer lacks the format's marker: the Mistral tokenizer has no <|python_tag|>
    with pytest.raises(ValueError) as e:
        make_env("tools", reward_fn="fxplug:reward", parser="llama3_json", tokenizer=mistral_tok)
    msg = str(e.value)
    assert msg.startswith("env.tool_parser 'llama3_json' does not fit") and "<|python_tag|>" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="env.tool_parser 'mistral': vLLM's parsers read the model's tokenizer"):
        make_env("tools", reward_fn="fxplug:reward", parser="mistral")


@pytest.mark.parametrize("name,msg", [
    ("llama3_json", "env.tool_parser 'llama3_json' does not fit the model's tokenizer"),  # no <|python_tag|>
    ("llama3_jsn", "env.tool_parser: unknown 'llama3_jsn' (neither arl's nor vLLM's); close: llama3_json"),
])
def test_dry_run_fails_a_format_the_model_does_not_write(name, msg, tiny_model_dir, capsys):
    from arl.train import main

    assert main(["--dry-run", "--config", "configs/smollm2_tools_cpu.yaml", f"model.name_or_path={tiny_model_dir}",
                 f"env.tool_parser={name}"]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err, err


def test_dry_run_catches_a_parser_that_cannot_read_the_templates_calls(llama_tok, mistral_tok, fxplug):
    """A Llama-style model left on the default hermes parser would have every call count as its
    final answer: the check reads back the call the chat template writes, and names the formats
    that do read it."""
    from arl.env.door import check_door, format_mismatch

    wrong = format_mismatch(make_parser("hermes"), llama_tok)
    assert wrong.startswith("env.tool_parser 'hermes' cannot read the tool calls this model's chat template writes "
                            "('{\"name\": \"arl_probe\", \"parameters\": {\"n\": 1}}'); formats that read them: ")
    assert "llama3_json" in wrong.split("read them: ")[1].split(", ") and "\n" not in wrong
    assert format_mismatch(make_parser("llama3_json", llama_tok), llama_tok) is None
    assert format_mismatch(make_parser("mistral", mistral_tok), mistral_tok) is None
    no_calls = byte_tokenizer(MISTRAL_SPECIAL, "<s>", "</s>", None)
    no_calls.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert format_mismatch(make_parser("hermes"), no_calls) is None  # arl's prompt teaches the format then
    with pytest.raises(ValueError, match="^env.tool_parser 'hermes' cannot read"):
        check_door("tools", {"tools": ["fxplug:get_rate"], "reward_fn": "fxplug:reward"}, None, "-", None, "-",
                   tokenizer=llama_tok)


def test_dry_run_catches_a_parser_that_cannot_read_the_format_the_prompt_teaches(llama_tok, fxplug):
    """A template that does not render tools: the prompt teaches the hermes format in the system
    message (arl/rollout/episode.py), so a parser that cannot read it (qwen3_xml) would read no
    call; the dry run says so in one line.  The parser's own tokenizer is checked when the dry run
    has none (the tiny model).  (vLLM's llama3_json does read hermes' JSON, so it passes.)"""
    from arl.env.door import check_door, prompt_mismatch
    from arl.model.tiny import CHAT_TEMPLATE
    from arl.prepare import renders_tools

    plain = byte_tokenizer(LLAMA_SPECIAL + ["<tool_call>", "</tool_call>"], "<|begin_of_text|>", "<|eot_id|>", None)
    plain.chat_template = CHAT_TEMPLATE  # renders messages only: no tools, no tool calls
    kw = {"tools": ["fxplug:get_rate"], "reward_fn": "fxplug:reward"}
    want = ("env.tool_parser 'qwen3_xml': this model's chat template does not render tools, so the prompt teaches "
            "the hermes format (<tool_call>...</tool_call>), which 'qwen3_xml' cannot read; use env.tool_parser: "
            "hermes, or a model whose template renders tools")
    for given in (plain, None):
        with pytest.raises(ValueError) as e:
            check_door("tools", {**kw, "parser": "qwen3_xml", "tokenizer": plain}, None, "-", None, "-", tokenizer=given,
                       renders_tools=renders_tools)  # as arl.prepare.preflight calls it
        assert str(e.value) == want
    assert renders_tools(plain) is False and renders_tools(llama_tok) is True
    # hermes reads what the prompt teaches; a template that renders tools teaches its own format
    assert prompt_mismatch(make_parser("hermes"), False, [RATE]) is None
    assert prompt_mismatch(make_parser("llama3_json", plain), False, [RATE]) is None
    assert prompt_mismatch(make_parser("qwen3_xml", plain), False, None) is None  # no tools: nothing taught
    assert prompt_mismatch(make_parser("qwen3_xml", llama_tok), True, [RATE]) is None
    assert prompt_mismatch(make_parser("qwen3_xml", plain), False, [RATE]) == want


def test_preflight_hands_the_door_its_tools_rendering_check(monkeypatch):
    """The env layer cannot import the rollout layer's ChatFormat: the preflight passes it in."""
    import arl.prepare as prepare
    from arl.config import load_config

    seen = {}
    monkeypatch.setattr(prepare, "check_door", lambda *a, **kw: seen.update(kw) or [])
    prepare.preflight(load_config(None, []))
    assert seen["renders_tools"] is prepare.renders_tools

"""Planted-bug tests (issue #54) for the env side: tool-call parsing, the OpenEnv adapter and the dry
run's demonstration record (the Gymnasium adapter: tests/test_planted_gym.py).  Expectations written
out by hand."""
import pytest

from arl.env.door import demo_record
from arl.env.openenv_client import text_field
from arl.env.tool_parsers import call_name_and_arguments, get_parser
from arl.env.vllm_parsers import VLLMToolParser


# --------------------------------------------------------------------------------------- parsers
def test_a_vllm_call_with_null_arguments_is_a_call_with_none():
    """Plant: a vLLM-parsed call whose ``arguments`` is None made an error instead of ``{}`` (a
    tool without parameters; some parsers give None rather than "{}")."""
    for args in (None, "null", "{}"):
        c = VLLMToolParser._call("list_files", args)
        assert (c.name, c.arguments, c.error) == ("list_files", {}, None), args
    bad = VLLMToolParser._call("list_files", "[1]")
    assert bad.arguments is None and bad.error == "error: arguments must be a JSON object, got list"


def test_an_empty_arguments_string_is_no_arguments():
    """Plant: an empty arguments string raising instead of ``{}`` (demonstrations and templates
    write a parameterless call's arguments as "")."""
    assert call_name_and_arguments({"name": "now", "arguments": ""}) == ("now", {})
    assert call_name_and_arguments({"type": "function", "function": {"name": "now", "arguments": "  "}}) == ("now", {})
    with pytest.raises(ValueError, match="tool call 'now': arguments string is not JSON"):
        call_name_and_arguments({"name": "now", "arguments": "{"})


def test_hermes_reports_a_stray_closing_tag():
    """Plant: Hermes not reporting a ``</tool_call>`` with no ``<tool_call>`` before it (the model
    would never hear that its call was not read)."""
    p = get_parser("hermes")
    got = p.parse('I will look. </tool_call> then <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> done')
    assert [(c.name, c.arguments, c.error) for c in got.calls] == [
        (None, None, "error: </tool_call> without <tool_call>"), ("f", {"x": 1}, None)]
    assert got.content == "I will look.  then  done"
    alone = p.parse("answer 4</tool_call>")
    assert alone.errors == ["error: </tool_call> without <tool_call>"] and alone.content == "answer 4"


def test_llama3_json_keeps_its_python_tag_when_the_template_writes_none():
    """Plant: llama3_json's ``<|python_tag|>`` fallback dropped from ``keep_tokens`` (Llama 3.1's
    template writes JSON calls without the tag, but a model may emit it: decoding would skip the
    special token and the parser would never see the marker)."""
    from arl.rollout.episode import ChatFormat

    from test_vllm_parsers import LLAMA_SPECIAL, byte_tokenizer

    tok = byte_tokenizer(LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", "llama31_style.jinja")
    p = VLLMToolParser("llama3_json", tok)
    assert "<|python_tag|>" not in p.format_calls("", [{"name": "f", "arguments": {"a": 1}}])
    assert p.keep_tokens() == ("<|python_tag|>",)
    turn = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}'
    ids = tok.encode(turn, add_special_tokens=False)
    assert ChatFormat(tok).decode(ids, p.keep_tokens()) == turn
    assert [(c.name, c.arguments) for c in p.parse(turn).calls] == [("f", {"a": 1})]


# --------------------------------------------------------------------------------------- OpenEnv
def test_an_action_with_several_text_fields_names_none():
    """Plant: an OpenEnv action with several text fields silently taking the first (the turn would
    land in whichever field the schema lists first); arl asks for ``action_field`` instead."""
    two = {"title": "Act", "properties": {"thought": {"type": "string"}, "command": {"type": "string"},
                                          "n": {"type": "integer"}, "metadata": {"type": "string"}}}
    assert text_field(two, None, "action_field") is None
    assert text_field(two, "command", "action_field") == "command"
    one = {"title": "Act", "properties": {"message": {"type": "string"}, "metadata": {"type": "string"}}}
    assert text_field(one, None, "action_field") == "message"  # metadata is OpenEnv's own, not a text field


# ------------------------------------------------------------------------------ dry-run demo record
def test_the_demo_record_pairs_each_call_with_its_own_result():
    """Plants: the dry run's demonstration record mapping every call to the first tool result, or
    taking the first assistant message as the final answer (the reward function runs on it)."""
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "thinking", "tool_calls": [{"name": "a", "arguments": {"k": 1}},
                                                                       {"name": "b", "arguments": {}}]},
            {"role": "tool", "content": "ra"}, {"role": "tool", "content": "rb"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "c", "arguments": {}}]},
            {"role": "tool", "content": 3},
            {"role": "assistant", "content": "42"}]
    rec = demo_record(msgs)
    assert [(c["name"], c["result"]) for c in rec.tool_calls] == [("a", "ra"), ("b", "rb"), ("c", "3")]
    assert rec.tool_calls[0]["arguments"] == {"k": 1} and rec.final_answer == "42"
    # a call with no result after it (the demonstration ends): None, not a neighbour's
    rec = demo_record([{"role": "assistant", "content": "x", "tool_calls": [{"name": "a", "arguments": {}},
                                                                            {"name": "b", "arguments": {}}]},
                       {"role": "tool", "content": "ra"}])
    assert [c["result"] for c in rec.tool_calls] == ["ra", None] and rec.final_answer == "x"

import json

import pytest

from arl.env.toolcall import ToolSpec, format_answer, format_tool_call, parse_turn

TOOLS = [ToolSpec("lookup", {"key": "string"}), ToolSpec("add", {"a": "integer", "b": "number"}),
         ToolSpec("flag", {"on": "boolean"})]


def call(obj) -> str:
    return f"<tool_call>{json.dumps(obj)}</tool_call>"


def test_valid_call_and_thinking_prefix():
    t = parse_turn("I should look k1 up.\n" + format_tool_call("lookup", {"key": "k1"}), TOOLS)
    assert (t.kind, t.tool, t.arguments, t.error) == ("tool", "lookup", {"key": "k1"}, None)
    t = parse_turn(call({"name": "add", "arguments": {"a": 1, "b": 2.5}}) + "  \n", TOOLS)
    assert t.kind == "tool" and t.arguments == {"a": 1, "b": 2.5}


def test_answer():
    t = parse_turn("so it is\n" + format_answer(" v42 "), TOOLS)
    assert (t.kind, t.answer, t.tool) == ("answer", "v42", None)
    assert parse_turn("<answer></answer>", TOOLS).answer == ""


@pytest.mark.parametrize("text,expect,tool", [
    ("", "no tool call or answer", None),
    ("I think v42", "no tool call or answer", None),
    ('{"name": "lookup", "arguments": {"key": "k1"}}', "no tool call or answer", None),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}', "missing </tool_call>", None),
    ("<answer>v1", "missing </answer>", None),
    ('{"name": "lookup"}</tool_call>', "closing tag without opening tag", None),
    ("<tool_call>{name: lookup}</tool_call>", "bad JSON in tool call: Expecting property name", None),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "k1"}</tool_call>', "bad JSON", None),
    ("<tool_call></tool_call>", "bad JSON in tool call: Expecting value at char 0", None),
    ('<tool_call>{"name": "lookup", "arguments": {"key": "k1"}} x</tool_call>', "Extra data", None),
    ('<tool_call>["lookup"]</tool_call>', "must be a JSON object, got list", None),
    ('<tool_call>"lookup"</tool_call>', "must be a JSON object, got str", None),
    ('<tool_call>{"arguments": {}}</tool_call>', "missing key 'name'", None),
    ('<tool_call>{"name": "lookup"}</tool_call>', "missing key 'arguments'", None),
    ('<tool_call>{"name": "lookup", "arguments": {}, "id": 1}</tool_call>', "unexpected key 'id'", None),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "tool name must be a string", None),
    (call({"name": "search", "arguments": {"q": "x"}}), "unknown tool 'search'; tools: add, flag, lookup",
     "search"),
    (call({"name": "lookup", "arguments": "k1"}), "arguments must be a JSON object, got str", "lookup"),
    (call({"name": "lookup", "arguments": {}}), "lookup missing argument 'key'", "lookup"),
    (call({"name": "lookup", "arguments": {"key": "k1", "x": 1}}), "unexpected argument 'x'", "lookup"),
    (call({"name": "lookup", "arguments": {"key": 17}}), "'key' must be string, got int", "lookup"),
    (call({"name": "add", "arguments": {"a": 1.5, "b": 2}}), "'a' must be integer, got float", "add"),
    (call({"name": "add", "arguments": {"a": True, "b": 2}}), "'a' must be integer, got bool", "add"),
    (call({"name": "flag", "arguments": {"on": 1}}), "'on' must be boolean, got int", "flag"),
    (call({"name": "lookup", "arguments": {"key": "a"}}) * 2, "only one tool call per turn", None),
    (call({"name": "lookup", "arguments": {"key": "a"}}) + "<answer>v</answer>", "not both", None),
    ("<answer>v1</answer><answer>v2</answer>", "only one answer per turn", None),
    (call({"name": "lookup", "arguments": {"key": "a"}}) + " and then", "text after </tool_call>", None),
    ("<answer>v1</answer>.", "text after </answer>", None),
    ("<tool_call>" + "{" * 5000 + "</tool_call>", "bad JSON", None),
])
def test_malformed_turns_give_precise_errors(text, expect, tool):
    t = parse_turn(text, TOOLS)
    assert t.kind == "error" and t.is_error
    assert t.error.startswith("error: ") and expect in t.error, t.error
    assert t.tool == tool
    assert "\n" not in t.error and len(t.error) < 200


def test_never_raises_on_garbage():
    import random
    rng = random.Random(0)
    alphabet = ['<tool_call>', '</tool_call>', '<answer>', '</answer>', '{', '}', '"name"', ':',
                '"lookup"', '"arguments"', '"key"', ',', '"k1"', '[', ']', 'x', ' ', '\\', '\x00',
                'null', '1e999', 'NaN']
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        t = parse_turn(text, TOOLS)
        assert t.kind in ("tool", "answer", "error")
    assert parse_turn(None, TOOLS).kind == "error"  # type: ignore[arg-type]


def test_toolspec_rejects_unknown_type():
    with pytest.raises(ValueError, match="argument 'x' has unknown type 'float64'"):
        ToolSpec("f", {"x": "float64"})

"""The generic tool env: tools from callables/schemas, the hermes parser, reward functions, the
chat template's tools and k tool messages, and whole episodes driven by scripted model turns."""
from __future__ import annotations

import asyncio
import json
import math
import sys
import textwrap
import time
from typing import Literal, Optional

import pytest
from transformers import AutoTokenizer

from arl.env import ENVIRONMENTS, Fault, check_env, make_env
from arl.env.reward import EpisodeRecord, RewardError, load_reward_fn, normalize, score
from arl.env.tool_env import ToolEnv
from arl.env.tool_parsers import get_parser, register_parser
from arl.env.tools import load_tools, tool_from_callable, tool_from_schema
from arl.rollout import ChatFormat, Episode, EpisodeConfig, Sample, SamplingConfig
from arl.rollout.episode import demonstration


# --------------------------------------------------------------------------------------- tools
def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: the key, e.g. "k1"
    """
    return {"k1": "v7", "k2": "v9"}.get(key, "none")


async def add(a: int, b: int = 1) -> int:
    """Add two integers."""
    await asyncio.sleep(0)
    return a + b


def boom(why: str) -> str:
    """Always fails."""
    raise RuntimeError(why)


async def hang() -> str:
    """Never answers in time."""
    await asyncio.sleep(30)
    return "late"


def slow_sync() -> str:
    """A blocking tool slower than the timeout."""
    time.sleep(0.3)
    return "late"


def test_schema_from_a_typed_documented_callable():
    def search(query: str, k: int = 5, mode: Literal["web", "news"] = "web", lang: Optional[str] = None,
               tags: list[str] | None = None, opts: dict = None, score: float = 0.5, exact: bool = False):
        """Search the web.
        Returns the top hits.

        Longer notes the model does not need.

        Args:
            query (str): what to look for,
                several words allowed
            k: how many hits
        Returns:
            the hits
        """

    s = tool_from_callable(search).schema
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "search" and f["description"] == "Search the web. Returns the top hits."
    p = f["parameters"]
    assert p["required"] == ["query"] and p["type"] == "object"
    assert p["properties"] == {
        "query": {"type": "string", "description": "what to look for, several words allowed"},
        "k": {"type": "integer", "description": "how many hits"},
        "mode": {"type": "string", "enum": ["web", "news"]},
        "lang": {"type": ["string", "null"]},
        "tags": {"type": ["array", "null"], "items": {"type": "string"}},
        "opts": {"type": "object"},
        "score": {"type": "number"},
        "exact": {"type": "boolean"},
    }
    assert tool_from_callable(add).is_async and not tool_from_callable(lookup).is_async


def test_schema_equals_transformers_get_json_schema_for_documented_tools():
    """The example tools (every argument documented) read as HF's own tool schema, which
    ``apply_chat_template(tools=[fn])`` renders, apart from its ``return`` entry."""
    from transformers.utils import get_json_schema

    from examples.calculator.tools import TOOLS
    for fn in [*TOOLS, lookup]:
        hf = get_json_schema(fn)
        hf["function"].pop("return", None)
        assert tool_from_callable(fn).schema == hf, fn.__name__


def _untyped(a, b: int):
    """Doc."""


def _undocumented(a: int):
    pass


def _bad_doc(a: int):
    """Doc.

    Args:
        b: not a parameter
    """


@pytest.mark.parametrize("fn,msg", [
    (_untyped, "tool _untyped: parameter 'a' has no type annotation"),
    (_undocumented, "tool _undocumented: no docstring"),
    (_bad_doc, "tool _bad_doc: docstring describes 'b', which is not a parameter"),
    (lambda x: x, "needs a name"),
])
def test_schema_mistakes_are_one_line(fn, msg):
    with pytest.raises(ValueError) as e:
        tool_from_callable(fn)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_schema_given_in_openai_shape():
    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    a = tool_from_schema({"type": "function", "function": {"name": "sq", "description": "d", "parameters": params}},
                         lambda x: x * x)
    b = tool_from_schema({"name": "sq", "description": "d", "parameters": params}, lambda x: x * x)
    assert a.schema == b.schema and a.schema["function"]["parameters"] == params
    assert asyncio.run(a.call({"x": 3})) == "9"  # non-str results as JSON text
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        tool_from_schema({"name": "sq", "parameters": {"type": "object", "properties": {"x": {"type": 3}}}}, abs)
    with pytest.raises(ValueError, match="'name' must be a non-empty string"):
        tool_from_schema({"parameters": params}, abs)


def test_arguments_checked_against_the_schema_as_messages():
    t = tool_from_callable(add)
    assert t.check_arguments({"a": 1}) is None and t.check_arguments({"a": 1, "b": 2}) is None
    assert "'a' is a required property" in t.check_arguments({})
    assert "'c' was unexpected" in t.check_arguments({"a": 1, "c": 2})
    assert "at a: 'x' is not of type 'integer'" in t.check_arguments({"a": "x"})
    assert "at a: True is not of type 'integer'" in t.check_arguments({"a": True})
    assert "must be a JSON object, got list" in t.check_arguments([1])
    assert t.check_arguments({}).endswith("expected add(a: integer, b: integer?)")


# -------------------------------------------------------------------------------------- parser
def _call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def test_hermes_several_calls_with_content():
    p = get_parser("hermes")
    text = ("Let me check both.\n" + _call("lookup", {"key": "k1"}) + "\n"
            + '<tool_call>  {"name": "lookup", "arguments": "{\\"key\\": \\"k2\\"}"}  </tool_call>')
    r = p.parse(text)
    assert [(c.name, c.arguments, c.error) for c in r.calls] == [("lookup", {"key": "k1"}, None),
                                                                ("lookup", {"key": "k2"}, None)]
    assert r.content == "Let me check both."
    assert p.parse("The answer is 42.").calls == [] and p.parse("The answer is 42.").content == "The answer is 42."


def test_hermes_malformed_calls_among_valid_ones():
    p = get_parser("hermes")
    text = (_call("lookup", {"key": "k1"}) + "<tool_call>{not json}</tool_call>"
            + '<tool_call>{"name": "lookup"}</tool_call>' + '<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>'
            + '<tool_call>{"name": "lookup", "arguments": "nope"}</tool_call>' + "<tool_call>[1]</tool_call>"
            + _call("lookup", {"key": "k2"}))
    r = p.parse(text)
    assert [c.ok for c in r.calls] == [True, False, False, False, False, False, True]
    errs = r.errors
    assert errs[1].startswith("error: bad JSON in tool call")
    assert errs[2] == "error: tool call missing key 'arguments'" and r.calls[2].name == "lookup"
    assert errs[3] == "error: arguments must be a JSON object, got list"
    assert errs[4].startswith("error: arguments string is not JSON")
    assert errs[5] == "error: tool call must be a JSON object, got list"
    assert r.calls[6].arguments == {"key": "k2"}


def test_hermes_unclosed_and_stray_tags():
    p = get_parser("hermes")
    r = p.parse(_call("lookup", {"key": "k1"}) + '\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k2"}}')
    assert [c.ok for c in r.calls] == [True, False]
    assert r.calls[1].error == "error: <tool_call> without </tool_call>" and r.calls[1].name == "lookup"
    r = p.parse('<tool_call>{"name": "a", "arguments": {}}' + _call("b", {}))  # unclosed before the next call
    assert [(c.name, c.ok) for c in r.calls] == [("a", False), ("b", True)]
    r = p.parse('{"name": "a", "arguments": {}}</tool_call> done')
    assert len(r.calls) == 1 and r.calls[0].error == "error: </tool_call> without <tool_call>"


def test_hermes_format_calls_round_trips():
    p = get_parser("hermes")
    calls = [{"name": "lookup", "arguments": {"key": "k1"}},
             {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]  # OpenAI message shape
    text = p.format_calls("Checking.", calls)
    assert text == ('Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    r = p.parse(text)
    assert r.content == "Checking." and [(c.name, c.arguments) for c in r.calls] == [("lookup", {"key": "k1"}),
                                                                                   ("add", {"a": 1})]
    assert p.format_calls("", calls[:1]).startswith("<tool_call>\n")
    with pytest.raises(ValueError, match="unknown 'nope'"):
        get_parser("nope")

    @register_parser("hermes_again")
    class Again(type(p)):
        pass

    assert get_parser("hermes_again").parse(text).calls and get_parser("hermes").name == "hermes"


# -------------------------------------------------------------------------------------- reward
def test_reward_values_normalized():
    assert normalize(True) == (1.0, {}) and normalize(2) == (2.0, {})
    assert normalize({"a": 1, "b": 0.5}) == (1.5, {"a": 1.0, "b": 0.5})
    for bad, msg in [(math.nan, "not a finite number"), (math.inf, "not a finite number"), ({}, "empty dict"),
                     ("1", "must be a number, got str"), ({"a": None}, "component 'a' must be a number"),
                     (None, "must be a number, got NoneType")]:
        with pytest.raises(RewardError, match=msg):
            normalize(bad)


def test_score_sync_and_async():
    rec = EpisodeRecord(final_answer="v9")

    def sync_fn(task, episode):
        return float(episode.final_answer == task["answer"])

    async def async_fn(task, episode):
        return {"correct": float(episode.final_answer == task["answer"]), "len": -0.5}

    assert asyncio.run(score(sync_fn, {"answer": "v9"}, rec)) == (1.0, {})
    assert asyncio.run(score(async_fn, {"answer": "v9"}, rec)) == (0.5, {"correct": 1.0, "len": -0.5})


PLUGIN = textwrap.dedent('''
    def search(q: str) -> str:
        """Search."""
        return q

    def other(x: int) -> int:
        """Other."""
        return x

    TOOLS = [search, other]

    def reward(task, episode):
        return 1.0

    def bad_reward(x):
        return 1.0

    NOT_CALLABLE = 3
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    (tmp_path / "arl_tool_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "arl_tool_plugin"
    sys.modules.pop("arl_tool_plugin", None)


def test_load_tools_and_reward_by_import_path(plugin):
    assert [t.name for t in load_tools([f"{plugin}:TOOLS"])] == ["search", "other"]
    assert [t.name for t in load_tools(f"{plugin}:search")] == ["search"]
    assert load_reward_fn(f"{plugin}:reward")(task={}, episode=None) == 1.0
    env = make_env("tools", tools=[f"{plugin}:search"], reward_fn=f"{plugin}:reward")
    assert isinstance(env, ToolEnv) and env.tools[0]["function"]["name"] == "search" and env.stop == ()
    for call, msg in [
        (lambda: load_tools([f"{plugin}:search", f"{plugin}:TOOLS"]), "two tools named 'search'"),
        (lambda: load_tools(["no_such_mod_xyz:f"]), "tools[0]: cannot import 'no_such_mod_xyz' (ModuleNotFoundError"),
        (lambda: load_tools([f"{plugin}:nope"]), f"tools[0]: module '{plugin}' has no 'nope'"),
        (lambda: load_tools(["just_a_name"]), "expected an import path 'pkg.mod:name'"),
        (lambda: load_reward_fn(f"{plugin}:NOT_CALLABLE"), "is not callable"),
        (lambda: load_reward_fn(f"{plugin}:bad_reward"), "must accept keyword arguments task and episode"),
        (lambda: load_reward_fn("no_such_mod_xyz:f"), "reward_fn: cannot import"),
        (lambda: make_env("tools", tools=[f"{plugin}:search"]), "env.reward_fn: required"),
        (lambda: make_env("tools", reward_fn=f"{plugin}:reward", parser="xml"), "env.tool_parser: unknown 'xml'"),
        (lambda: make_env("tools", tools=[f"{plugin}:nope"], reward_fn=f"{plugin}:reward"),
         "env.kwargs.tools[0]: module"),
    ]:
        with pytest.raises(ValueError) as e:
            call()
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "tools" in ENVIRONMENTS
    kw = {"tools": [f"{plugin}:search"], "reward_fn": f"{plugin}:reward"}
    check_env("tools", kw, task={"prompt": "hi"})  # --dry-run with the first dataset row
    with pytest.raises(ValueError, match="failed to reset task 0 .ValueError: the tools env needs env.dataset"):
        check_env("tools", kw)


# ------------------------------------------------------------------------------- chat template
# Qwen2.5's template, trimmed: tools in the system message, assistant tool_calls in hermes text,
# consecutive tool messages merged into one user turn of <tool_response> blocks.
QWEN_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are helpful.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tc in message.tool_calls %}{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tc.name + '\", \"arguments\": ' + tc.arguments | tojson + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def plain_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)  # ChatML; tool role as its own turn, no tools


@pytest.fixture(scope="module")
def qwen_tok(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = QWEN_LIKE
    return tok


SCHEMAS = [tool_from_callable(lookup).schema]


def test_template_with_tools_and_merged_tool_messages(qwen_tok):
    fmt = ChatFormat(qwen_tok)
    assert fmt.supports_tools
    text = fmt.render_prompt("Be brief.", "Find k1.", SCHEMAS)
    assert text == ("<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n" + json.dumps(SCHEMAS[0], ensure_ascii=False)
                    + "\n</tools><|im_end|>\n<|im_start|>user\nFind k1.<|im_end|>\n<|im_start|>assistant\n")
    enc = fmt.encode
    assert fmt.observation_ids(["a", "b"]) == enc(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    assert fmt.observation_ids("a") == fmt.observation_ids(["a"])
    assert fmt.observation_ids(["a", "b", "c"], turn_ended_with_eos=True)[:len(enc("\n<|im_start|>"))] == enc("\n<|im_start|>")
    with pytest.raises(ValueError, match="non-empty list of str"):
        fmt.observation_ids([])


def test_template_without_tools_falls_back_to_the_system_message(plain_tok):
    fmt = ChatFormat(plain_tok)
    assert not fmt.supports_tools
    block = get_parser("hermes").tools_prompt(SCHEMAS)
    assert "<tools>\n" + json.dumps(SCHEMAS[0]) + "\n</tools>" in block and '"arguments": <args-json-object>' in block
    assert fmt.render_prompt("Be brief.", "Find k1.", SCHEMAS) == (
        f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n<|im_start|>user\nFind k1.<|im_end|>\n"
        "<|im_start|>assistant\n")
    msgs = [{"role": "user", "content": "Find k1."}]
    assert fmt.render_prompt("", msgs, SCHEMAS).startswith(f"<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user")
    # k tool messages, each its own turn in this template
    assert fmt.observation_ids(["a", "b"]) == fmt.encode(
        "<|im_end|>\n<|im_start|>tool\na<|im_end|>\n<|im_start|>tool\nb<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"env.tools\[0\]: expected an OpenAI function schema"):
        fmt.render_prompt("", "x", [object()])


# ------------------------------------------------------------------------------------ episodes
ROW = {"prompt": "Find the values of k1 and k2, then add 1 to the first digit.", "answer": "v9"}


def reward_sync(task, episode):
    ok = [c for c in episode.tool_calls if c["error"] is None]
    return {"correct": float(episode.final_answer == task["answer"]), "tool_use": 0.1 * len(ok)}


async def reward_async(task, episode):
    return reward_sync(task, episode)


def _sample(fmt, text):  # a turn the model ended with EOS
    ids = fmt.encode(text) + [fmt.eos_token_id]
    return Sample(ids, [-0.5] * len(ids), text, "stop")


async def _play(ep, turns):
    await ep.start()
    for text in turns:
        assert not ep.done
        await ep.apply(_sample(ep.fmt, text))
    return ep.trajectory()


TURNS = [
    "Both keys.\n" + _call("lookup", {"key": "k1"}) + "\n"
    + '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"k2\\"}"}\n</tool_call>',
    _call("add", {"a": 7}) + _call("add", {"a": "x"}) + "<tool_call>{oops}</tool_call>" + _call("nope", {}),
    "v9",
]


@pytest.mark.parametrize("reward_fn", [reward_sync, reward_async])
def test_episode_masks_observations_and_scores(qwen_tok, reward_fn):
    fmt = ChatFormat(qwen_tok)
    env = ToolEnv(tools=[lookup, add], reward_fn=reward_fn, system_prompt="Be brief.")
    ep = Episode(env, fmt, EpisodeConfig(max_total_tokens=4096), seed=0, task=ROW)
    assert ep.sampling().stop == ()  # the tools env ends a turn at EOS only
    t = asyncio.run(_play(ep, TURNS))
    assert t.reward == pytest.approx(1.3) and t.metadata["fault"] == "none"
    assert t.metadata["reward_components"] == pytest.approx({"correct": 1.0, "tool_use": 0.3})
    # the token stream is exactly the template's rendering of the whole chat
    tool_msgs = [["v7", "v9"], ["8", "error: add arguments at a: 'x' is not of type 'integer'; expected add(a: integer, b: integer?)",
                                "error: bad JSON in tool call: Expecting property name enclosed in double quotes at char 1",
                                "error: unknown tool 'nope'; tools: add, lookup"]]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ROW["prompt"]}]
    for k, text in enumerate(TURNS):
        chat.append({"role": "assistant", "content": text})
        chat += [{"role": "tool", "content": o} for o in (tool_msgs[k] if k < 2 else [])]
    full = qwen_tok.apply_chat_template(chat, tools=env.tools, tokenize=False)
    assert qwen_tok.decode(t.tokens.tolist()) == full.removesuffix("\n")
    # model turns are chunks 0..2 (their sampled ids exactly); prompt and observations -1
    ids = t.tokens.tolist()
    for k, (s, e) in enumerate(t.turns):
        assert ids[s:e] == fmt.encode(TURNS[k]) + [fmt.eos_token_id] and (t.chunk_ids[s:e] == k).all()
    (s0, e0), (s1, e1), (s2, _) = t.turns
    assert (t.chunk_ids[:s0] == -1).all() and (t.chunk_ids[e0:s1] == -1).all() and (t.chunk_ids[e1:s2] == -1).all()
    assert ids[e0:s1] == fmt.observation_ids(tool_msgs[0], turn_ended_with_eos=True)
    # one call record per call; the turn's info: first call
    m = t.metadata
    assert [(c["tool"], c["args"], c["error"]) for c in m["calls"]] == [
        ("lookup", {"key": "k1"}, False), ("lookup", {"key": "k2"}, False), ("add", {"a": 7}, False),
        ("add", None, True), (None, None, True), ("nope", None, True)]
    assert m["tool_calls"] == 5 and m["tool_errors"] == 3 and m["tools"] == {"lookup": 2, "add": 2, "nope": 1}
    assert [(d["tool"], d["tool_error"]) for d in m["turn_info"]] == [("lookup", False), ("add", True), (None, False)]


def test_reward_record_holds_the_chat_and_calls(qwen_tok):
    seen = {}

    def reward(task, episode):
        seen["record"] = episode
        return 0

    env = ToolEnv(tools=[lookup], reward_fn=reward)
    t = asyncio.run(_play(Episode(env, ChatFormat(qwen_tok), EpisodeConfig(max_total_tokens=4096), 0, task=ROW),
                          [_call("lookup", {"key": "k1"}), "  v7 "]))
    rec = seen["record"]
    assert t.reward == 0.0 and "reward_components" not in t.metadata
    assert rec.final_answer == "v7"
    assert rec.tool_calls == [{"name": "lookup", "arguments": {"key": "k1"}, "result": "v7", "error": None}]
    assert [m["role"] for m in rec.messages] == ["user", "assistant", "tool", "assistant"]
    assert rec.messages[2]["content"] == "v7"


def test_tool_failures_are_observations(qwen_tok):
    env = ToolEnv(tools=[boom, hang, slow_sync, lookup], reward_fn=reward_sync, tool_timeout_s=0.05,
                  max_calls_per_turn=3)
    fmt = ChatFormat(qwen_tok)
    ep = Episode(env, fmt, EpisodeConfig(max_total_tokens=4096), 0, task=ROW)
    t0 = time.perf_counter()
    t = asyncio.run(_play(ep, [_call("boom", {"why": "disk full"}) + _call("hang", {}) + _call("slow_sync", {})
                               + _call("lookup", {"key": "k1"}), "v9"]))
    assert time.perf_counter() - t0 < 5  # the hung async tool was cancelled
    assert t.metadata["fault"] == "none" and t.reward == 1.0
    obs = ["error: boom raised RuntimeError: disk full", "error: hang timed out after 0.05s",
           "error: slow_sync timed out after 0.05s",
           "error: more than 3 tool calls in one turn; this one was not run"]
    (_, e0), (s1, _) = t.turns
    assert t.tokens.tolist()[e0:s1] == fmt.observation_ids(obs, turn_ended_with_eos=True)
    assert t.metadata["tool_errors"] == 4 and t.metadata["turn_info"][0]["tool_error"]


@pytest.mark.parametrize("bad,why", [("raise", "reward_fn: ZeroDivisionError"), ("nan", "not a finite number"),
                                     ("str", "must be a number, got str")])
def test_broken_reward_is_a_recoverable_fault(qwen_tok, bad, why):
    async def reward(task, episode):
        return {"raise": lambda: 1 / 0, "nan": lambda: math.nan, "str": lambda: "1"}[bad]()

    env = ToolEnv(tools=[], reward_fn=reward)
    assert env.tools is None  # no tools: a single-turn task, plain prompt
    res = asyncio.run(_direct(env, "v9"))
    assert res.done and res.fault is Fault.RECOVERABLE and why in res.info["fault_reason"]
    ep = Episode(env, ChatFormat(qwen_tok), EpisodeConfig(), 0, task=ROW)
    t = asyncio.run(_play(ep, ["v9"]))
    assert t.metadata["fault"] == "recoverable" and t.reward == 0.0 and why in t.metadata["fault_reason"]


async def _direct(env, text):
    await env.reset(0, task=ROW)
    return await env.step(text)


def test_reset_needs_a_task_row(qwen_tok):
    env = ToolEnv(tools=[lookup], reward_fn=reward_sync, system_prompt="S")
    with pytest.raises(ValueError, match="the tools env needs env.dataset"):
        asyncio.run(env.reset(0))
    for row, msg in [({"question": "x"}, r"needs 'messages' \(the chat to start from\) or 'prompt'"),
                     ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\] must be"),
                     ({"prompt": 3}, "'prompt' must be a string")]:
        with pytest.raises(ValueError, match=msg):
            asyncio.run(env.reset(0, task=row))
    msgs = [{"role": "system", "content": "Row's own."}, {"role": "user", "content": "hi"}]
    assert asyncio.run(env.reset(0, task={"messages": msgs})) == msgs  # the row's system message wins
    assert asyncio.run(env.reset(0, task={"prompt": "hi"}))[0] == {"role": "system", "content": "S"}
    # an Episode with no row: the reset fails, reported as a fault naming the cause
    ep = Episode(env, ChatFormat(qwen_tok), EpisodeConfig(), 0)
    asyncio.run(ep.start())
    assert ep.fault is Fault.UNRECOVERABLE and "needs env.dataset" in ep.meta["fault_reason"]


def test_legacy_envs_keep_the_configured_stop_strings(qwen_tok):
    from arl.env.toy import ToyLookupEnv

    ep = Episode(ToyLookupEnv(), ChatFormat(qwen_tok), EpisodeConfig(sampling=SamplingConfig(stop=())), 0, task=ROW)
    assert ep.sampling().stop == ()  # toy_lookup's reset takes no task: not passed
    asyncio.run(ep.start())
    assert not ep.done and ep.fmt.decode(ep.tokens).endswith("assistant\n")


def test_demonstration_renders_like_the_template_and_the_rollout(qwen_tok):
    fmt = ChatFormat(qwen_tok)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Find k1 and k2."},
            {"role": "assistant", "content": "Both.", "tool_calls": [
                {"type": "function", "function": {"name": "lookup", "arguments": {"key": "k1"}}},
                {"type": "function", "function": {"name": "lookup", "arguments": {"key": "k2"}}}]},
            {"role": "tool", "content": "v7"}, {"role": "tool", "content": "v9"},
            {"role": "assistant", "content": "v7 v9"}]
    d = demonstration(fmt, chat, tools=SCHEMAS)
    full = qwen_tok.apply_chat_template(chat, tools=SCHEMAS, tokenize=False)
    assert qwen_tok.decode(d.tokens.tolist()) == full.removesuffix("\n")  # format_calls == the template's calls
    assert len(d.turns) == 2 and d.num_chunks == 2 and (d.rollout_logp == 0).all()
    (s0, e0), (s1, e1) = d.turns
    assert (d.chunk_ids[:s0] == -1).all() and (d.chunk_ids[e0:s1] == -1).all() and e1 == len(d.tokens)
    assert d.tokens[e0 - 1] == fmt.eos_token_id and d.tokens[-1] == fmt.eos_token_id
    # the same turns played through the tools env give the same tokens
    env = ToolEnv(tools=[lookup], reward_fn=reward_sync)
    turn0 = get_parser("hermes").format_calls("Both.", chat[2]["tool_calls"])
    t = asyncio.run(_play(Episode(env, fmt, EpisodeConfig(max_total_tokens=4096), 0, task={"messages": chat[:2]}),
                          [turn0, "v7 v9"]))
    assert t.tokens.tolist() == d.tokens.tolist() and t.chunk_ids.tolist() == d.chunk_ids.tolist()
    for bad, msg in [(chat[:2], "at least one assistant message"), (chat[:5], "must be the final assistant answer"),
                     (chat[:3] + chat[5:], r"messages\[2\]: an assistant turn before the last needs its tool messages")]:
        with pytest.raises(ValueError, match=msg):
            demonstration(fmt, bad, tools=SCHEMAS)

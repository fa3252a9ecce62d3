"""What ``--dry-run`` checks about the user's own pieces beyond "the env is made and resets": the
env's tool-call parser reads the calls the model's chat template writes (a Llama model on the
default ``hermes`` would otherwise have every call count as its final answer) and, where the
template does not render tools, the Hermes format the prompt then teaches; the demonstrations
call only declared tools, with arguments valid against each tool's schema, and the reward function
(an env's ``reward_fn``, as the tools env has) runs once -- on the first demonstration (or, without
demonstrations, on an episode that answered nothing) -- without raising.  Each failure is one line."""
from __future__ import annotations

import asyncio
import inspect
from typing import Callable, Dict, List, Mapping, Optional

from .registry import make_env
from .reward import EpisodeRecord, score
from .tool_parsers import PARSERS, ToolParser
from .tools import Tool, tool_from_schema
from .vllm_parsers import make_parser, template_call_turn, vllm_parser_names

_PROBE = [{"name": "arl_probe", "arguments": {"n": 1}}]


def _declared(env) -> Dict[str, Tool]:
    """The env's tools by name: its own ``Tool``s, else ones made from its OpenAI schemas."""
    own = getattr(env, "_tools", None)
    if isinstance(own, dict) and all(isinstance(t, Tool) for t in own.values()):
        return dict(own)
    return {t.name: t for t in (tool_from_schema(s, lambda **kw: None) for s in (env.tools or []))}


def check_demo_calls(env, demos: List[list], where: str) -> None:
    """Every ``tool_calls`` entry of ``demos`` names a declared tool with valid arguments."""
    if env.tools is None and not getattr(env, "_tools", None):
        return  # the env declares no schemas: its own parser judges the calls
    tools = _declared(env)
    for i, messages in enumerate(demos):
        for j, m in enumerate(messages):
            for k, call in enumerate(m.get("tool_calls") or []):
                at = f"{where} demonstration {i + 1} messages[{j}].tool_calls[{k}]"
                tool = tools.get(call["name"])
                if tool is None:
                    raise ValueError(f"sft.dataset: {at} calls {call['name']!r}, which is not a declared tool "
                                     f"(tools: {', '.join(sorted(tools)) or 'none'})")
                problem = tool.check_arguments(call["arguments"])
                if problem:
                    raise ValueError(f"sft.dataset: {at}: {problem}")


def format_mismatch(parser: ToolParser, tokenizer) -> Optional[str]:
    """None when ``parser`` reads back the call the model's chat template writes (or the template
    writes no calls: arl's prompt then teaches the format); else one line naming the formats that do."""
    try:
        turn = template_call_turn(tokenizer, "", _PROBE)
    except ValueError:
        return None

    def reads(p: ToolParser) -> bool:
        return [(c.name, c.arguments) for c in p.parse(turn).calls] == [("arl_probe", {"n": 1})]

    if reads(parser):
        return None
    readers = []
    for name in sorted(set(PARSERS) | set(vllm_parser_names())):
        try:
            if reads(make_parser(name, tokenizer)):
                readers.append(name)
        except Exception:  # a format that does not fit this tokenizer
            continue
    return (f"env.tool_parser {parser.name!r} cannot read the tool calls this model's chat template writes "
            f"({turn[:80]!r}); " + (f"formats that read them: {', '.join(readers)}" if readers
                                     else "no arl or vLLM format reads them"))


def prompt_mismatch(parser: ToolParser, renders_tools: bool, tools) -> Optional[str]:
    """None unless the env has ``tools``, the model's chat template does not render them
    (``renders_tools``: ``ChatFormat.supports_tools``) and ``parser`` cannot read the Hermes format;
    else one line.  Without a template that renders tools, the episode's prompt teaches the Hermes
    format in the system message (arl/rollout/episode.py), so a parser that does not read it
    (``qwen3_xml``) would read no call at all."""
    if not tools or renders_tools:
        return None
    hermes = PARSERS["hermes"]()
    got = parser.parse(hermes.format_calls("", _PROBE)).calls
    if [(c.name, c.arguments) for c in got] == [("arl_probe", {"n": 1})]:
        return None
    return (f"env.tool_parser {parser.name!r}: this model's chat template does not render tools, so the prompt "
            f"teaches the hermes format ({hermes.OPEN}...{hermes.CLOSE}), which {parser.name!r} cannot read; "
            "use env.tool_parser: hermes, or a model whose template renders tools")


def demo_record(messages: List[Mapping]) -> EpisodeRecord:
    """The ``EpisodeRecord`` a reward function would get had the model played ``messages``."""
    calls, i = [], 0
    while i < len(messages):
        m = messages[i]
        i += 1
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(str(messages[i].get("content", "")))
            i += 1
        for k, c in enumerate(m.get("tool_calls") or []):
            calls.append({"name": c["name"], "arguments": c["arguments"],
                          "result": results[k] if k < len(results) else None, "error": None})
    final = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "assistant"), "")
    return EpisodeRecord(messages=[dict(m) for m in messages], final_answer=final, tool_calls=calls)


def check_reward_once(env, task: Optional[dict], task_where: str, demo: Optional[list], demo_where: str) -> str:
    """Call the env's reward function once; one-line ValueError (type, message, row) if it raises
    or returns no finite score.  Returns what it scored, for the dry run's report."""
    fn = getattr(env, "reward_fn", None)
    if not callable(fn):
        return ""
    if demo is not None:
        record, on = demo_record(demo), f"the first demonstration ({demo_where} demonstration 1)"
    else:
        record, on = EpisodeRecord(messages=[], final_answer="", tool_calls=[]), "an episode that answered nothing"
    try:
        total, _ = asyncio.run(score(fn, task, record))
    except Exception as e:
        raise ValueError(f"env.reward_fn raised {type(e).__name__}: {e} on {on} with task {task_where}") from None
    return f"reward OK: env.reward_fn scored {total:g} on {on} with task {task_where}"


def check_door(name: str, kwargs: dict, task: Optional[dict], task_where: str, demos: Optional[List[list]],
               demo_where: str, tokenizer=None, renders_tools: Optional[Callable] = None) -> List[str]:
    """The checks above on the configured env (``tokenizer``: the model's, when it is on this
    machine: its chat template's call format is checked against the env's parser;
    ``renders_tools(tokenizer)``: whether the template renders tools, for the format the prompt
    teaches -- given by the caller, the rollout layer's ``ChatFormat`` being above this one); the dry
    run's report lines."""
    env = make_env(name, **kwargs)
    parser = getattr(env, "parser", None)
    if isinstance(parser, ToolParser):
        # a vLLM parser holds the model's tokenizer (also the tiny model's, which the dry run does not pass)
        tok = tokenizer if tokenizer is not None else getattr(parser, "tokenizer", None)
        wrong = format_mismatch(parser, tokenizer) if tokenizer is not None else None
        if wrong is None and tok is not None and renders_tools is not None:
            wrong = prompt_mismatch(parser, renders_tools(tok), getattr(env, "tools", None))
        if wrong:
            asyncio.run(env.close())
            raise ValueError(wrong)

    async def start():
        if task is not None and "task" in inspect.signature(env.reset).parameters:
            await env.reset(0, task=task)

    try:
        asyncio.run(start())
        lines = []
        if demos:
            check_demo_calls(env, demos, demo_where)
            lines.append("sft OK: the demonstrations call only declared tools, with valid arguments")
        said = check_reward_once(env, task, task_where, demos[0] if demos else None, demo_where)
        return lines + ([said] if said else [])
    finally:
        asyncio.run(env.close())

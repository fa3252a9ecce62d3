"""Parse one model turn into exactly one tool call or one final answer.

A turn is free text (the model's own thinking, trained on) followed by exactly one of::

    <tool_call>{"name": "lookup", "arguments": {"key": "k17"}}</tool_call>
    <answer>v42</answer>

Anything else -- malformed JSON, an unknown tool, missing/extra/mistyped arguments, two calls, a
call and an answer, no tag, an unclosed tag, text after the closing tag -- becomes a ``ParsedTurn``
of kind ``"error"`` whose ``error`` is a short, precise observation for the model.  Parsing never
raises on model text: the model is expected to produce garbage early in training.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

# JSON-schema-ish names of the argument types a tool may declare (kept to what models write).
_TYPES: Dict[str, tuple] = {"string": (str,), "integer": (int,), "number": (int, float),
                            "boolean": (bool,)}


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name, its arguments (name -> type name) and a one-line
    description used in the system prompt."""

    name: str
    params: Dict[str, str]
    description: str = ""

    def __post_init__(self):
        for arg, typ in self.params.items():
            if typ not in _TYPES:
                raise ValueError(f"ToolSpec {self.name!r}: argument {arg!r} has unknown type {typ!r};"
                                 f" choose from {sorted(_TYPES)}")

    def signature(self) -> str:
        return f"{self.name}({', '.join(f'{a}: {t}' for a, t in self.params.items())})"


@dataclass
class ParsedTurn:
    kind: str  # "tool" | "answer" | "error"
    tool: Optional[str] = None  # tool name when kind == "tool" (or the name it tried to call)
    arguments: Dict[str, Any] = field(default_factory=dict)
    answer: Optional[str] = None
    error: Optional[str] = None  # tool-error observation when kind == "error"

    @property
    def is_error(self) -> bool:
        return self.kind == "error"


def format_tool_call(name: str, arguments: Dict[str, Any]) -> str:
    """The canonical text of a tool call (what the expert demonstrator writes)."""
    return f"{TOOL_OPEN}{json.dumps({'name': name, 'arguments': arguments})}{TOOL_CLOSE}"


def format_answer(answer: str) -> str:
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def describe_tools(tools: Sequence[ToolSpec]) -> str:
    return "\n".join(f"- {t.signature()}: {t.description}" if t.description else f"- {t.signature()}"
                     for t in tools)


def _err(msg: str, tool: Optional[str] = None) -> ParsedTurn:
    return ParsedTurn(kind="error", tool=tool, error=f"error: {msg}")


def _check_args(spec: ToolSpec, args: Dict[str, Any]) -> Optional[str]:
    missing = [a for a in spec.params if a not in args]
    if missing:
        return f"{spec.name} missing argument {missing[0]!r}; expected {spec.signature()}"
    extra = [a for a in args if a not in spec.params]
    if extra:
        return f"{spec.name} got unexpected argument {extra[0]!r}; expected {spec.signature()}"
    for a, typ in spec.params.items():
        v = args[a]
        ok = isinstance(v, _TYPES[typ]) and not (typ in ("integer", "number") and isinstance(v, bool))
        if not ok:
            return f"{spec.name} argument {a!r} must be {typ}, got {type(v).__name__}"
    return None


def parse_turn(text: str, tools: Sequence[ToolSpec]) -> ParsedTurn:
    """Parse one model turn against the available ``tools`` (see the module docstring)."""
    if not isinstance(text, str):
        return _err(f"turn must be text, got {type(text).__name__}")
    n_call, n_ans = text.count(TOOL_OPEN), text.count(ANSWER_OPEN)
    if n_call and n_ans:
        return _err("a turn holds either one tool call or one answer, not both")
    if n_call > 1 or text.count(TOOL_CLOSE) > 1:
        return _err("only one tool call per turn")
    if n_ans > 1 or text.count(ANSWER_CLOSE) > 1:
        return _err("only one answer per turn")
    if n_call == 0 and n_ans == 0:
        if TOOL_CLOSE in text or ANSWER_CLOSE in text:
            return _err("closing tag without opening tag")
        return _err(f"no tool call or answer; write {TOOL_OPEN}...{TOOL_CLOSE} or "
                    f"{ANSWER_OPEN}...{ANSWER_CLOSE}")
    open_tag, close_tag = (TOOL_OPEN, TOOL_CLOSE) if n_call else (ANSWER_OPEN, ANSWER_CLOSE)
    start = text.index(open_tag) + len(open_tag)
    end = text.find(close_tag, start)
    if end < 0:
        return _err(f"missing {close_tag}")
    if text[end + len(close_tag):].strip():
        return _err(f"text after {close_tag}")
    body = text[start:end]
    if n_ans:
        return ParsedTurn(kind="answer", answer=body.strip())
    return _parse_call(body, tools)


def _parse_call(body: str, tools: Sequence[ToolSpec]) -> ParsedTurn:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return _err(f"bad JSON in tool call: {e.msg} at char {e.pos}")
    if not isinstance(obj, dict):
        return _err(f"tool call must be a JSON object, got {type(obj).__name__}")
    keys = set(obj)
    if keys != {"name", "arguments"}:
        missing = sorted({"name", "arguments"} - keys)
        if missing:
            return _err(f"tool call missing key {missing[0]!r}")
        return _err(f"tool call has unexpected key {sorted(keys - {'name', 'arguments'})[0]!r}")
    name, args = obj["name"], obj["arguments"]
    if not isinstance(name, str):
        return _err(f"tool name must be a string, got {type(name).__name__}")
    by_name = {t.name: t for t in tools}
    if name not in by_name:
        return _err(f"unknown tool {name!r}; tools: {', '.join(sorted(by_name))}", tool=name)
    if not isinstance(args, dict):
        return _err(f"arguments must be a JSON object, got {type(args).__name__}", tool=name)
    problem = _check_args(by_name[name], args)
    if problem:
        return _err(problem, tool=name)
    return ParsedTurn(kind="tool", tool=name, arguments=args)

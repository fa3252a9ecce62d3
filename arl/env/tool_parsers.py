"""Tool-call formats: how a model writes its calls in an assistant turn, by name.

A parser reads one assistant turn into ``ParsedCalls``: every call attempt in order (a malformed
one carries an ``error`` message for the model, never an exception) and the text outside the calls.
``format_calls(content, calls)`` writes a turn back in the model's native text (SFT demonstrations
are rendered with it), and ``tools_prompt(tools)`` is the system-prompt block that teaches the format
when the chat template cannot render tools itself.

``hermes`` (Hermes, Qwen2.5, Qwen3, SmolLM3 ...)::

    Let me check both.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>

Whitespace around the JSON is free; ``arguments`` may be a JSON-encoded string (decoded).
Register another format with ``@register_parser("name")`` on a ``ToolParser`` subclass.  
``make_parser`` (arl/env/vllm_parsers.py) also takes the names of vLLM's tool-parser registry
(``llama3_json``, ``mistral``, ``qwen3_xml``, ``pythonic`` ...); arl's own ``hermes`` wins there.
"""
from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type


@dataclass
class ParsedCall:
    name: Optional[str]  # the tool named (also when the call is otherwise malformed), or None
    arguments: Optional[Dict[str, Any]]  # None when malformed
    error: Optional[str] = None  # "error: ..." observation for the model when malformed
    text: str = ""  # the call's raw text

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class ParsedCalls:
    calls: List[ParsedCall] = field(default_factory=list)  # every call attempt, in order
    content: str = ""  # the turn's text outside the calls (stripped)

    @property
    def errors(self) -> List[Optional[str]]:
        return [c.error for c in self.calls]


class ToolParser(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedCalls:
        """Every call attempt in ``text``; never raises on model text."""

    @abc.abstractmethod
    def format_calls(self, content: str, calls: Sequence[Mapping]) -> str:
        """The native text of an assistant turn: ``content`` then ``calls`` ({name, arguments},
        or OpenAI's {"function": {name, arguments}}; arguments a dict or a JSON string)."""

    @abc.abstractmethod
    def tools_prompt(self, tools: Sequence[Mapping]) -> str:
        """System-prompt text listing ``tools`` (OpenAI schemas) and how to call them."""


PARSERS: Dict[str, Type[ToolParser]] = {}


def register_parser(name: str) -> Callable[[Type[ToolParser]], Type[ToolParser]]:
    def deco(cls: Type[ToolParser]) -> Type[ToolParser]:
        cls.name = name
        PARSERS[name] = cls
        return cls

    return deco


def get_parser(name: str) -> ToolParser:
    """arl's own parser ``name`` (``make_parser`` in arl/env/vllm_parsers.py also knows vLLM's)."""
    if name not in PARSERS:
        raise ValueError(f"parser: unknown {name!r}; choose from {sorted(PARSERS)}")
    return PARSERS[name]()


def call_name_and_arguments(call: Mapping) -> tuple:
    """``(name, arguments dict)`` of a call given as {name, arguments} or OpenAI's
    {"type": "function", "function": {name, arguments}} (arguments possibly a JSON string)."""
    if isinstance(call, ParsedCall):
        call = {"name": call.name, "arguments": call.arguments}
    if not isinstance(call, Mapping):
        raise ValueError(f"tool call: expected a dict with name and arguments, got {type(call).__name__}")
    fn = call.get("function", call)
    name, args = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call: 'name' must be a non-empty string, got {name!r}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"tool call {name!r}: arguments string is not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {name!r}: arguments must be an object, got {type(args).__name__}")
    return name, args


@register_parser("hermes")
class HermesParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedCalls:
        if not isinstance(text, str):
            return ParsedCalls([ParsedCall(None, None, f"error: turn must be text, got {type(text).__name__}")])
        calls, outside, pos = [], [], 0
        while True:
            start = text.find(self.OPEN, pos)
            stray = text.find(self.CLOSE, pos)
            if stray >= 0 and (start < 0 or stray < start):  # a closing tag with no opening one
                outside.append(text[pos:stray])
                calls.append(ParsedCall(None, None, f"error: {self.CLOSE} without {self.OPEN}", self.CLOSE))
                pos = stray + len(self.CLOSE)
                continue
            if start < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            body_start = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            nxt = text.find(self.OPEN, body_start)
            if end < 0 or 0 <= nxt < end:  # unclosed: the call runs to the next call or the end
                stop = nxt if nxt >= 0 else len(text)
                body = text[body_start:stop]
                call = self._parse_body(body)
                calls.append(ParsedCall(call.name, None, f"error: {self.OPEN} without {self.CLOSE}",
                                        text[start:stop]))
                pos = stop
                continue
            call = self._parse_body(text[body_start:end])
            call.text = text[start:end + len(self.CLOSE)]
            calls.append(call)
            pos = end + len(self.CLOSE)
        return ParsedCalls(calls, "".join(outside).strip())

    @staticmethod
    def _parse_body(body: str) -> ParsedCall:
        def err(msg: str, name: Optional[str] = None) -> ParsedCall:
            return ParsedCall(name, None, f"error: {msg}")

        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return err(f"bad JSON in tool call: {e.msg} at char {e.pos}")
        if not isinstance(obj, dict):
            return err(f"tool call must be a JSON object, got {type(obj).__name__}")
        name = obj.get("name")
        if "name" not in obj:
            return err("tool call missing key 'name'")
        if not isinstance(name, str) or not name:
            return err(f"tool name must be a non-empty string, got {json.dumps(name)}")
        extra = sorted(set(obj) - {"name", "arguments"})
        if extra:
            return err(f"tool call has unexpected key {extra[0]!r}; write name and arguments", name)
        if "arguments" not in obj:
            return err("tool call missing key 'arguments'", name)
        args = obj["arguments"]
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                return err(f"arguments string is not JSON: {e.msg} at char {e.pos}", name)
        if not isinstance(args, dict):
            return err(f"arguments must be a JSON object, got {type(args).__name__}", name)
        return ParsedCall(name, args)

    def format_calls(self, content: str, calls: Sequence[Mapping]) -> str:
        # what Qwen2.5's template writes for an assistant message with tool_calls
        blocks = []
        for c in calls:
            name, args = call_name_and_arguments(c)
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            blocks.append(f"{self.OPEN}\n{body}\n{self.CLOSE}")
        return "\n".join(([content] if content else []) + blocks)

    def tools_prompt(self, tools: Sequence[Mapping]) -> str:
        # Hermes / Qwen2.5's own wording, so a model trained on it recognizes the format
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                f"{self.OPEN}{self.CLOSE} XML tags:\n{self.OPEN}\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n' + self.CLOSE)

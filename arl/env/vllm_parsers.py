"""vLLM's registered tool-call parsers (``llama3_json``, ``mistral``, ``qwen3_xml``, ``pythonic`` ...)
as arl ``ToolParser``s, by the names ``vllm serve --tool-call-parser`` takes.

A vLLM parser reads a whole model turn (``extract_tool_calls``) with the model's tokenizer (several
look their marker token up in its vocabulary and refuse a tokenizer without it: a model whose
template writes another format fails when the env is made, i.e. at ``--dry-run``).  Each call it
finds becomes an arl ``ParsedCall`` (name + JSON-object arguments; several per turn where the
format allows); arguments that are not a JSON object are an ``error: ...`` for the model.  A turn
that holds the format's call marker (``<tool_call>``, ``[TOOL_CALLS]``) but no call vLLM can read
is one malformed call (an ``error: ...`` observation, the episode goes on); a turn without calls
is the final answer.

Of vLLM 0.32's 54 registered names, 45 construct on any tokenizer; 9 need their marker token in the
model's tokenizer: llama3_json, llama4_json (``<|python_tag|>``), mistral (``[TOOL_CALLS]``),
deepseek_v3, deepseek_v31, hy_v3, hy_v4, jamba, lfm2 (checked 2026-12-04 on the tests' tiny
Qwen-style tokenizer).  Special tokens the format writes stay in the text the env reads
(``keep_tokens``; decoding skips the others).

Demonstrations are written in the format by the model's own chat template (an assistant message
with ``tool_calls``); a template that does not render tool calls cannot write them (one-line error).
"""
from __future__ import annotations

import difflib
import functools
import json
from typing import Any, List, Mapping, Optional, Sequence

from .tool_parsers import PARSERS, ParsedCall, ParsedCalls, ToolParser, call_name_and_arguments

_SENTINEL = "\x00ARL_CALLS\x00"


def template_call_turn(tokenizer, content: str, calls: Sequence[Mapping]) -> str:
    """What ``tokenizer``'s chat template writes for an assistant message with ``content`` and
    ``calls`` (the text between the assistant header and the end of turn); one-line ValueError when
    the template does not render tool calls."""
    tool_calls = []
    for i, c in enumerate(calls):
        name, args = call_name_and_arguments(c)
        tool_calls.append({"id": f"call{i:07d}", "type": "function",  # ids: Mistral's templates want 9 chars
                           "function": {"name": name, "arguments": args}})
    user = [{"role": "user", "content": "u"}]
    probe = user + [{"role": "assistant", "content": content + _SENTINEL, "tool_calls": tool_calls}]
    try:
        # without tools: templates place them by the position of the last user message
        head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception as e:
        raise ValueError(f"the chat template cannot render tool calls ({type(e).__name__}: {e})") from None
    if not full.startswith(head.rstrip()) or _SENTINEL not in full:
        raise ValueError("the chat template does not render an assistant message as prompt + turn")
    turn = full[len(head):] if full.startswith(head) else full[len(head.rstrip()):]
    turn = turn.replace(_SENTINEL, "").rstrip()
    eos = tokenizer.eos_token or ""
    if eos and turn.endswith(eos):
        turn = turn[:-len(eos)]
    if any(c["function"]["name"] not in turn for c in tool_calls):
        raise ValueError("the chat template does not render tool calls")
    return turn.strip() if not content else turn


def vllm_parser_names() -> List[str]:
    """The names vLLM's ``ToolParserManager`` knows (imports vLLM: a few seconds)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers))


def make_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """arl's own parser ``name``, else vLLM's registered one over ``tokenizer`` (the model's
    tokenizer or its directory); one-line ValueError for a name neither knows."""
    if name in PARSERS:
        return PARSERS[name]()
    names = vllm_parser_names()
    if name not in names:
        raise ValueError(f"parser: unknown {name!r} (neither arl's nor vLLM's); "
                         f"{close_names(name, sorted(set(PARSERS) | set(names)))}")
    return VLLMToolParser(name, tokenizer)


def close_names(name: str, names: Sequence[str]) -> str:
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    return f"close: {', '.join(near)}" if near else f"choose from {', '.join(names)}"


def _load_tokenizer(tokenizer: Any):
    return _tokenizer_at(tokenizer) if isinstance(tokenizer, str) else tokenizer


@functools.lru_cache(maxsize=4)  # one load per process, not per episode's environment
def _tokenizer_at(tokenizer: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:
        raise ValueError(f"tool_parser: cannot load the tokenizer {tokenizer!r} ({type(e).__name__}: {e})") from None


class VLLMToolParser(ToolParser):
    """vLLM's parser ``name`` over ``tokenizer`` (a tokenizer or a model directory / hub id)."""

    def __init__(self, name: str, tokenizer: Any):
        from vllm.tool_parsers import ToolParserManager

        self.name, self.tools = name, []  # tools: the env's OpenAI schemas (some formats need them)
        if tokenizer is None:
            raise ValueError(f"tool_parser {name!r}: vLLM's parsers read the model's tokenizer; none was given")
        self.tokenizer = _load_tokenizer(tokenizer)
        cls = ToolParserManager.get_tool_parser(name)
        try:
            self._parser = cls(self.tokenizer)
        except Exception as e:  # e.g. llama3_json on a tokenizer without <|python_tag|>
            who = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
            raise ValueError(f"tool_parser {name!r} does not fit the model's tokenizer {who!r} "
                             f"({type(e).__name__}: {e})") from None

    def _request(self):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="arl",
                                     tools=self.tools or None)

    def parse(self, text: str) -> ParsedCalls:
        if not isinstance(text, str):
            return ParsedCalls([ParsedCall(None, None, f"error: turn must be text, got {type(text).__name__}")])
        try:
            got = self._parser.extract_tool_calls(text, self._request())
        except Exception:  # vLLM's parser failed on model text: as vLLM serves it, no call
            got = None
        if got is None or not got.tools_called:
            marker = self._marker()
            if marker and marker in text:  # the model meant a call vLLM cannot read: tell it, go on
                return ParsedCalls([ParsedCall(None, None, f"error: a {marker} tool call the {self.name} format "
                                               "cannot read; write it as the format shows", text)],
                                   text[:text.find(marker)].strip())
            return ParsedCalls([], (got.content if got is not None and got.content is not None else text).strip())
        return ParsedCalls([self._call(c.function.name, c.function.arguments) for c in got.tool_calls],
                           (got.content or "").strip())

    def _marker(self) -> Optional[str]:
        """The text that opens a call in this format (``<tool_call>``, ``[TOOL_CALLS]``), if vLLM's
        parser names one."""
        for attr in ("tool_call_start_token", "bot_token"):
            v = getattr(self._parser, attr, None)
            if isinstance(v, str) and v:
                return v
        return None

    @staticmethod
    def _call(name: Optional[str], arguments: Any) -> ParsedCall:
        text = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        if not isinstance(name, str) or not name:
            return ParsedCall(None, None, f"error: tool name must be a non-empty string, got {name!r}", text)
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as e:
            return ParsedCall(name, None, f"error: arguments are not JSON: {e.msg} at char {e.pos}", text)
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return ParsedCall(name, None, f"error: arguments must be a JSON object, got {type(args).__name__}", text)
        return ParsedCall(name, args, None, text)

    def format_calls(self, content: str, calls: Sequence[Mapping]) -> str:
        """The turn as the model's chat template writes an assistant message with ``tool_calls``."""
        try:
            return template_call_turn(self.tokenizer, content, calls)
        except ValueError as e:
            raise ValueError(f"tool_parser {self.name!r}: {e}; cannot write demonstrations in this format") from None

    def keep_tokens(self) -> tuple:
        """Special tokens the format writes (Mistral's ``[TOOL_CALLS]``): the turn's text must keep
        them (decoding skips special tokens otherwise).  Found in the template's own rendering of a
        probe call, else the parser's ``bot_token``."""
        special = set(getattr(self.tokenizer, "all_special_tokens", ())) | {
            t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if t.special}
        special.discard(self.tokenizer.eos_token)
        try:
            probe = self.format_calls("", [{"name": "arl_probe", "arguments": {"a": 1}}])
            found = tuple(sorted(t for t in special if t and t in probe))
        except ValueError:
            found = ()
        bot = getattr(self._parser, "bot_token", None)
        return found if found or bot not in special else (bot,)

    def tools_prompt(self, tools: Sequence[Mapping]) -> str:
        raise ValueError(f"tool_parser {self.name!r}: the model's chat template must render the tools itself")

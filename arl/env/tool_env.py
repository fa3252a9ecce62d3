"""``tools``: the generic tool-use environment -- your tools, your reward, your dataset.

    env:
      name: tools
      dataset: data/train.jsonl           # one task per row
      reward_fn: "my_pkg.reward:score"    # fn(task=row, episode=EpisodeRecord)
      kwargs:
        tools: ["my_pkg.tools:search", "my_pkg.tools:calculator"]
      tool_parser: hermes                 # how the model writes its calls: arl's hermes or any vLLM
                                          # parser name (llama3_json, mistral, ...; arl/env/tool_parsers.py)

A task row starts the chat: ``messages`` (system/user messages) or ``prompt`` (the user message,
after ``system_prompt`` when given; a row's own system message wins).  The tools' OpenAI schemas
are the env's ``tools``: the chat template renders them.  Each model turn (which ends at the end
of sequence: ``stop = ()``) may hold any number of calls; they run concurrently, each under
``tool_timeout_s``, and each answers with one tool message (a failed, invalid or timed-out call
answers ``error: ...`` and the episode goes on).  A turn without a call is the final answer: the
reward function scores the episode and it ends.  A reward function that raises or returns a
non-finite or non-numeric score is a recoverable fault (the episode is retried or filtered).
"""
from __future__ import annotations

import asyncio
import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from .base import Environment, Fault, StepResult
from .registry import register_env
from .reward import EpisodeRecord, load_reward_fn, score
from .tool_parsers import ParsedCall
from .tools import Tool, load_tools
from .vllm_parsers import make_parser

_ROLES = ("system", "user", "assistant")


def start_messages(task: Mapping, system_prompt: str = "") -> List[Dict[str, str]]:
    """The chat a task row starts with (see the module docstring); one-line ValueError otherwise."""
    if "messages" in task:
        msgs = task["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("task row: 'messages' must be a non-empty list of {role, content}")
        out = []
        for i, m in enumerate(msgs):
            if not (isinstance(m, Mapping) and m.get("role") in _ROLES and isinstance(m.get("content"), str)):
                raise ValueError(f"task row: messages[{i}] must be {{role: {'/'.join(_ROLES)}, content: str}}, "
                                 f"got {m!r:.80}")
            out.append({"role": m["role"], "content": m["content"]})
    elif "prompt" in task:
        if not isinstance(task["prompt"], str):
            raise ValueError(f"task row: 'prompt' must be a string, got {type(task['prompt']).__name__}")
        out = [{"role": "user", "content": task["prompt"]}]
    else:
        raise ValueError(f"task row: needs 'messages' (the chat to start from) or 'prompt' (the user "
                         f"message); it has {sorted(map(str, task))}")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


@register_env("tools")
class ToolEnv(Environment):
    needs_task = True  # its tasks are dataset rows (env.dataset)
    stop = ()  # a turn ends at the end of sequence: it may hold several calls

    def __init__(self, tools: Sequence[Union[str, Callable, Tool]] = (), reward_fn: Union[str, Callable, None] = None,
                 parser: str = "hermes", tool_timeout_s: float = 10.0, system_prompt: Optional[str] = None,
                 max_calls_per_turn: int = 8, tokenizer: Any = None):
        if reward_fn is None:
            raise ValueError("env.reward_fn: required by the tools env (an import path 'pkg.mod:fn', "
                             "called as fn(task=row, episode=record))")
        if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
            raise ValueError(f"env.kwargs.tools: expected a list of import paths 'pkg.mod:fn', got {tools!r:.80}")
        loaded = load_tools(list(tools), key="env.kwargs.tools")  # import paths (config) or callables/Tools
        self._tools: Dict[str, Tool] = {t.name: t for t in loaded}
        self.tools = [t.schema for t in loaded] or None  # no tools: a single-turn task
        self.reward_fn = (load_reward_fn(reward_fn, key="env.reward_fn") if isinstance(reward_fn, str)
                          else reward_fn)
        if not callable(self.reward_fn):
            raise ValueError(f"env.reward_fn: not callable ({type(reward_fn).__name__})")
        try:  # tokenizer: the model's (a directory), for vLLM's parsers; arl's own need none
            self.parser = make_parser(parser, tokenizer)
        except ValueError as e:
            raise ValueError(f"env.{'' if str(e).startswith('tool_parser') else 'tool_'}{e}") from None
        self.parser.tools = self.tools or []
        self.keep_tokens = self.parser.keep_tokens() if hasattr(self.parser, "keep_tokens") else ()
        if not tool_timeout_s > 0:
            raise ValueError(f"env.kwargs.tool_timeout_s: must be > 0, got {tool_timeout_s}")
        if max_calls_per_turn < 1:
            raise ValueError(f"env.kwargs.max_calls_per_turn: must be >= 1, got {max_calls_per_turn}")
        self.tool_timeout_s, self.max_calls_per_turn = float(tool_timeout_s), int(max_calls_per_turn)
        self.system_prompt = system_prompt or ""
        self._active = False

    async def reset(self, seed: int, task: Optional[Mapping] = None) -> List[Dict[str, str]]:
        if task is None:
            raise ValueError("the tools env needs env.dataset (one task row per episode); reset got no task")
        if not isinstance(task, Mapping):
            raise ValueError(f"task row: expected a dict, got {type(task).__name__}")
        self.messages = start_messages(task, self.system_prompt)
        self.task, self.calls, self.turns, self._active = task, [], 0, True
        return [dict(m) for m in self.messages]

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed, task=row) first")
        self.turns += 1
        parsed = self.parser.parse(action_text)
        self.messages.append({"role": "assistant", "content": action_text})
        if not parsed.calls:
            return await self._finish(parsed.content)
        done = await asyncio.gather(*(self._run(i, c) for i, c in enumerate(parsed.calls)))
        obs = []
        for d in done:
            text = d["result"] if d["error"] is None else d["error"]
            obs.append(text)
            self.messages.append({"role": "tool", "name": d["name"] or "", "content": text})
        self.calls += done
        first = done[0]
        info = {"fault": Fault.NONE, "tool": first["name"], "args": first["arguments"],
                "tool_error": any(d["error"] is not None for d in done), "turn": self.turns,
                "calls": [{"name": d["name"], "arguments": d["arguments"], "error": d["error"]} for d in done]}
        return StepResult(obs, 0.0, False, info)

    async def _run(self, i: int, call: ParsedCall) -> Dict[str, Any]:
        """One call -> {name, arguments, result, error}; never raises."""
        out = {"name": call.name, "arguments": call.arguments, "result": None, "error": None}
        tool = self._tools.get(call.name) if call.name else None
        if i >= self.max_calls_per_turn:
            out["error"] = f"error: more than {self.max_calls_per_turn} tool calls in one turn; this one was not run"
        elif call.error is not None:
            out["error"] = call.error
        elif tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            out["error"] = f"error: unknown tool {call.name!r}; tools: {known}"
        elif (problem := tool.check_arguments(call.arguments)) is not None:
            out["error"] = f"error: {problem}"
        else:
            try:
                out["result"] = await asyncio.wait_for(tool.call(call.arguments), self.tool_timeout_s)
            except asyncio.TimeoutError:
                out["error"] = f"error: {call.name} timed out after {self.tool_timeout_s:g}s"
            except Exception as e:  # the tool's own failure: the model reads it and may retry
                out["error"] = f"error: {call.name} raised {type(e).__name__}: {e}"
        return out

    async def _finish(self, final_answer: str) -> StepResult:
        self._active = False
        info = {"fault": Fault.NONE, "tool": None, "tool_error": False, "turn": self.turns}
        record = EpisodeRecord(messages=copy.deepcopy(self.messages), final_answer=final_answer,
                               tool_calls=copy.deepcopy(self.calls))
        try:
            total, comps = await score(self.reward_fn, self.task, record)
        except Exception as e:  # the user's reward: retry or filter the episode, never train on it
            why = f"reward_fn: {type(e).__name__}: {e}"
            info.update(fault=Fault.RECOVERABLE, fault_reason=why, reward_exception=f"{type(e).__name__}: {e}")
            return StepResult(why, 0.0, True, info)
        info["reward_components"] = comps
        return StepResult("", total, True, info)

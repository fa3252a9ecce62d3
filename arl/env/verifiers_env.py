"""``verifiers``: a verifiers 0.4 environment (prime-rl's; ``import verifiers.v1 as vf``) behind arl's door,
with arl's engine as its model (token-in/token-out: arl samples every turn with its own tokens and template).

    env:
      name: verifiers
      kwargs:
        taskset: guess_taskset              # verifiers' taskset.id: a package exporting its Taskset (+ Env)
        taskset_args: {size: 1000}          # its TasksetConfig fields
        eval_taskset_args: {split: test}    # the held-out tasks: these fields over taskset_args

verifiers does not install beside arl's pins (docs/envs.md): the environment runs in a server process from
a venv of its own (``bash install.sh --verifiers``; arl/env/verifiers_server.py, shared per process and
taskset, arl/env/verifiers_client.py).  There verifiers loads the taskset and its ``Env`` as its own CLI
does, and the ``Env.run`` plays with arl as the one agent: each ``interaction.turn(...)`` (a plain taskset:
one turn) sends the messages since the model's last reply -- with their roles -- to arl, and arl's reply
back.  The task's ``vf.Toolset``s' schemas go to the chat template; arl parses a turn's calls
(``env.tool_parser``) and the server runs them (arl/env/verifiers_tools.py), their results the next
``tool`` turn, until a turn without calls ends the segment.  When ``run`` returns, the ``@vf.reward``s
score the trace (their weighted sum is the reward, each a ``reward_components`` entry; ``@vf.metric``s are
``env/<name>`` counts).  Seeds: training seed s is task s (wrapping), ``EVAL_SEED_BASE + i`` held-out task i.

Faults, one line each: no verifiers venv (naming the install flag), a taskset that fails to load (its
error) or that arl cannot carry fail the constructor (so ``--dry-run``); a server that dies, an exception
in the env's ``run``, a late or non-finite reply, or a ``@vf.reward`` that raises (logged as a reward
exception) mid-episode is a recoverable fault (retried, then filtered; a dead server restarts at the next
``reset``).  Not carried (one line at load): a taskset that ships its own ``Harness`` (its program owns the
sampling loop), container tasks, envs with several agent seats; rewards that need a runtime are skipped
(verifiers' offline scoring); an observation mixing roles is a recoverable fault.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import uuid
from typing import Any, Dict, Optional

from ..config import EVAL_SEED_BASE
from .base import Environment, Fault, StepResult
from .registry import register_env
from .vllm_parsers import make_parser
from .verifiers_client import shared_server, verifiers_python


@register_env("verifiers")
class VerifiersEnv(Environment):
    observation_role = "user"  # set per observation from the env's messages (user or tool)
    stop = ()  # a turn ends at the end of sequence

    def __init__(self, taskset: str, taskset_args: Optional[Dict[str, Any]] = None,
                 eval_taskset_args: Optional[Dict[str, Any]] = None, python: Optional[str] = None,
                 path: Optional[list] = None, start_timeout_s: float = 120.0, timeout_s: float = 60.0,
                 max_turns: int = 8, parser: str = "hermes", tokenizer: Any = None):
        if not isinstance(taskset, str) or not taskset:
            raise ValueError(f"env.kwargs.taskset: a verifiers taskset id (an importable package), got {taskset!r}")
        py = verifiers_python(python)
        try:  # how the model writes tool calls (env.tool_parser), for a taskset with vf.Toolsets
            self.parser = make_parser(parser, tokenizer)
        except ValueError as e:
            raise ValueError(f"env.{'' if str(e).startswith('tool_parser') else 'tool_'}{e}") from None
        self.keep_tokens = self.parser.keep_tokens() if hasattr(self.parser, "keep_tokens") else ()
        # the taskset is found on the paths given, the cwd, then PYTHONPATH, which the server inherits (the
        # YAML's directory is on it).  Never arl's sys.path: arl's site-packages would shadow the venv's.
        dirs = [os.path.abspath(p) for p in (path or [])] + [os.getcwd()]
        spec = json.dumps({"taskset": taskset, "args": dict(taskset_args or {}), "path": dirs,
                           "eval_args": None if eval_taskset_args is None else dict(eval_taskset_args)}, sort_keys=True)
        self.what, self._key = taskset, (py, spec, float(start_timeout_s))
        self._server = shared_server(self._key)
        self.max_turns, self.timeout_s, self._ep = int(max_turns), float(timeout_s), None

    async def _ask(self, **msg) -> dict:
        reply = await asyncio.wait_for(asyncio.wrap_future(self._server.request(**msg)), self.timeout_s)
        if reply.get("error") and reply.get("where") in ("reset", "step"):
            raise RuntimeError(reply["error"])
        return reply

    def _drop(self) -> None:
        if self._ep is not None and not self._server.dead:
            self._server.request(op="drop", ep=self._ep)
        self._ep = None

    async def reset(self, seed: int) -> list:
        self._drop()  # an episode arl ended early (max_turns, a token limit) is abandoned on the server
        self._server = shared_server(self._key)  # restarted if it died
        self._ep, held = uuid.uuid4().hex, seed >= EVAL_SEED_BASE
        try:
            reply = await self._ask(op="reset", ep=self._ep, seed=seed - EVAL_SEED_BASE if held else seed,
                                    split="eval" if held else "train")
        except Exception as e:
            raise ValueError(f"verifiers taskset {self.what!r} reset failed ({type(e).__name__}: {e})") from None
        if "messages" not in reply:
            raise ValueError(f"verifiers taskset {self.what!r}: the env ended before the model's first turn ({reply})")
        self.tools = reply.get("tools") or None  # the episode's vf.Toolsets, rendered by the chat template
        self.parser.tools = self.tools or []
        return reply["messages"]

    async def step(self, action_text: str) -> StepResult:
        if self._ep is None:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        parsed = self.parser.parse(action_text) if self.tools else None
        calls = [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in (parsed.calls if parsed else [])]
        try:
            reply = await self._ask(op="step", ep=self._ep, text=parsed.content if calls else action_text, calls=calls)
            if reply.get("error") and reply.get("where") != "reward":  # the env's run() raised: this episode is lost
                raise RuntimeError(f"{reply['error']} (in the env's run)")
        except Exception as e:
            detail = str(e) or f"no reply within {self.timeout_s:g}s"
            why = (f"verifiers server for {self.what!r} died mid-episode ({detail})" if self._server.dead
                   else f"verifiers taskset {self.what!r}: {type(e).__name__}: {detail}")
            self._drop()  # a late reply is not read as the next one's; the server forgets the episode
            return StepResult(why, 0.0, True, {"fault": Fault.RECOVERABLE, "fault_reason": why})
        out = {"fault": Fault.NONE, "tool": None, "tool_error": False}
        if reply.get("where") == "reward":  # a @vf.reward raised: retried or filtered, its message in arl's log
            self._ep, why = None, f"verifiers reward: {reply['error']}"
            return StepResult(why, 0.0, True, dict(out, fault=Fault.RECOVERABLE, fault_reason=why,
                                                   reward_exception=reply["error"]))
        if reply.get("done"):
            self._ep = None
            counts = {k: v for k, v in (reply.get("metrics") or {}).items() if _finite(v)}
            if counts:
                out["counts"] = counts
            if not _finite(reply.get("reward")):
                why = f"verifiers taskset {self.what!r}: reward {reply.get('reward')!r} is not a finite number"
                return StepResult(why, 0.0, True, {"fault": Fault.RECOVERABLE, "fault_reason": why})
            return StepResult("", float(reply["reward"]), True, dict(out, reward_components=reply.get("rewards") or {}))
        msgs = reply["messages"]
        roles = {m["role"] for m in msgs}
        if len(roles) != 1 or not roles <= {"user", "tool"}:
            why = f"verifiers taskset {self.what!r}: an observation of roles {sorted(roles)}; arl renders one (user or tool)"
            self._drop()
            return StepResult(why, 0.0, True, {"fault": Fault.RECOVERABLE, "fault_reason": why})
        self.observation_role = roles.pop()  # read by the episode right after this step
        texts = [m["content"] for m in msgs]
        if calls:  # arl's tool-call counts; a call that failed (malformed, unknown, raised) reads "error: ..."
            out["calls"] = [dict(c, error=t.startswith("error")) for c, t in zip(calls, texts)]
        return StepResult(texts[0] if len(texts) == 1 else texts, 0.0, False, out)

    async def close(self) -> None:
        self._drop()


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

"""The environment contract every rollout relies on.

An episode: ``obs = await env.reset(seed)`` (deterministic for a seed) gives the task as the first
user message; then the model writes a turn, ``await env.step(action_text)`` parses it (a tool call
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or a final ``<answer>...</answer>``)
and returns the observation (tool output, or a tool-error message for a malformed call — never an
exception), the reward (the outcome reward when ``done``), and ``info["fault"]``.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field

TOOL_CALL_END = "</tool_call>"
ANSWER_END = "</answer>"
STOP_STRINGS = (TOOL_CALL_END, ANSWER_END)  # generation of one model turn stops at either


class Fault(str, enum.Enum):
    NONE = "none"
    RECOVERABLE = "recoverable"  # tool timeout, transient error: retry or filter
    UNRECOVERABLE = "unrecoverable"  # sandbox failed to start or died: mask + placeholder


@dataclass
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)  # "fault": Fault, "tool": str|None, "tool_error": bool, ...

    @property
    def fault(self) -> Fault:
        return Fault(self.info.get("fault", Fault.NONE))


class Environment(abc.ABC):
    """Async, one episode at a time per instance; pooled by the rollout manager."""

    #: describes the tools and the answer format; rendered as the system message
    system_prompt: str = ""
    #: hard cap on model turns; the rollout ends the episode with reward 0 past it
    max_turns: int = 8

    @abc.abstractmethod
    async def reset(self, seed: int) -> str:
        """Start an episode; return the first user message (the task)."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply one model turn (raw text, including the closing tag)."""

    async def close(self) -> None:  # release processes, temp dirs
        return None

    def expert_turns(self) -> list[str] | None:
        """Model turns of an expert demonstration for the current episode (for SFT), if the
        environment has a demonstrator; otherwise None."""
        return None

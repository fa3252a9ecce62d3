"""The environment contract every rollout relies on.

An episode: ``obs = await env.reset(seed)`` (deterministic for a seed) gives the task: the first
user message (a str) or the chat messages (system/user) that start the conversation.  An env whose
``reset`` takes a ``task`` parameter gets the dataset row too (``reset(seed, task=row)``) when a
dataset is configured.  Then the model writes a turn, ``await env.step(action_text)`` parses it
(today's envs: one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or a final
``<answer>...</answer>``; the generic ``tools`` env: any number of calls, no call = the answer)
and returns the observation (tool output -- one str, or one str per tool call -- or a tool-error
message for a malformed call, never an exception), the reward (the outcome reward when ``done``,
optionally with ``info["reward_components"]``), and ``info["fault"]``.  ``info["counts"]``
(``{name: number}``, any turn) are the env's own event counts: summed per episode, they are logged per
step as ``env/<name>`` (the step's total), e.g. which way a model took at a fork.

``tools`` (OpenAI function schemas) go to the chat template with the prompt; ``stop`` are the
strings that end one model turn (``()``: end of sequence only).
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
    observation: str | list  # one message, or a list of str: one tool message per call, in order
    reward: float = 0.0
    done: bool = False
    # "fault": Fault, "tool": str|None, "tool_error": bool, "args", "calls": [per-call dicts],
    # "reward_components": {name: float} (when done), "counts": {name: number} (summed per episode),
    # "reward_exception": "KeyError: 'answer'" (the reward function raised: logged, counted) ...
    info: dict = field(default_factory=dict)

    @property
    def fault(self) -> Fault:
        return Fault(self.info.get("fault", Fault.NONE))


class Environment(abc.ABC):
    """Async, one episode at a time per instance; pooled by the rollout manager."""

    #: describes the tools and the answer format; rendered as the system message
    system_prompt: str = ""
    #: hard cap on model turns; the rollout ends the episode with reward 0 past it.  Set from the
    #: config's ``env.max_turns`` (the one limit) for environments whose constructor takes it
    max_turns: int = 8
    #: whether ``reset`` needs a task row (``env.dataset``) rather than making the task from the seed
    needs_task: bool = False
    #: OpenAI function schemas ``{"type": "function", "function": {name, description, parameters}}``
    #: rendered into the prompt by the chat template (None: the system prompt describes the tools)
    tools: list | None = None
    #: strings that end one model turn (kept in its text); ``()``: the end-of-sequence token only
    stop: tuple = STOP_STRINGS
    #: special tokens the env reads in a turn's text (a tool-call format marked by them, e.g.
    #: Mistral's ``[TOOL_CALLS]``); every other special token is left out of the text
    keep_tokens: tuple = ()
    #: the chat role observations are rendered in: ``tool`` (tool results) or ``user`` (a text
    #: game, a user simulator: the model reads them as the user's next turn)
    observation_role: str = "tool"

    @abc.abstractmethod
    async def reset(self, seed: int) -> str | list:
        """Start an episode; return the first user message (the task) or the chat messages that
        start it.  A subclass may take ``task: dict | None = None`` (the dataset row)."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply one model turn (raw text, including the closing tag)."""

    async def close(self) -> None:  # release processes, temp dirs
        return None

    @classmethod
    def demo_kwargs(cls, kwargs: dict) -> dict:
        """The constructor arguments of the environment the SFT demonstrator plays, from the run's
        (default: the same): a demonstrator that knows only part of the task family.  IPA's expert
        prefixes play the run's own tasks."""
        return kwargs

    def expert_turns(self) -> list[str] | None:
        """Model turns of an expert demonstration for the current episode (for SFT), if the
        environment has a demonstrator; otherwise None."""
        return None

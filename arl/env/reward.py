"""The user's reward function: ``fn(task=row, episode=record)`` -> a score.

``task`` is the dataset row of the episode; ``episode`` an ``EpisodeRecord`` (the chat, the final
answer, every tool call with its result).  ``fn`` may be sync (run in a thread, so a slow one does
not stall other episodes) or async, and returns a number (float/int/bool) or a dict of named
numeric components, summed into the reward and logged one by one::

    def reward(task, episode):
        return {"correct": float(episode.final_answer.strip() == task["answer"]),
                "format": -0.1 * sum(c["error"] is not None for c in episode.tool_calls)}

A NaN/inf, a non-number or an empty dict is a ``RewardError`` (one line): a broken reward must not
train the model quietly.
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from .tools import call_maybe_async, import_object


class RewardError(ValueError):
    """The reward function returned something that is not a finite score."""


@dataclass
class EpisodeRecord:
    messages: List[Dict[str, Any]] = field(default_factory=list)  # the chat so far: system/user, assistant (text), tool
    final_answer: Optional[str] = None  # text of the last assistant turn (the one without tool calls)
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)  # {name, arguments, result, error}


def load_reward_fn(spec: str, key: str = "reward_fn") -> Callable:
    """``"pkg.mod:fn"`` -> the function; a one-line ValueError naming ``key`` otherwise."""
    fn = import_object(spec, key)
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r} is not callable")
    try:
        inspect.signature(fn).bind(task=None, episode=None)
    except TypeError:
        raise ValueError(f"{key}: {spec!r} must accept keyword arguments task and episode") from None
    except ValueError:  # no signature (some builtins): find out when it is called
        pass
    return fn


def _finite(x: Any, what: str) -> float:
    if isinstance(x, numbers.Real):  # bool, int, float, numpy scalars
        v = float(x)
        if not math.isfinite(v):
            raise RewardError(f"{what} is {v}, not a finite number")
        return v
    raise RewardError(f"{what} must be a number, got {type(x).__name__}")


def normalize(value: Any, name: str = "reward_fn") -> Tuple[float, Dict[str, float]]:
    """``(total, components)`` of a reward function's return value (components: {} for a number)."""
    if isinstance(value, dict):
        if not value:
            raise RewardError(f"{name} returned an empty dict (give at least one component)")
        comps = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise RewardError(f"{name} component names must be str, got {type(k).__name__}")
            comps[k] = _finite(v, f"{name} component {k!r}")
        return math.fsum(comps.values()), comps
    return _finite(value, f"{name} result"), {}


async def score(fn: Callable, task: Any, episode: EpisodeRecord) -> Tuple[float, Dict[str, float]]:
    """Call ``fn(task=task, episode=episode)`` (sync in a thread, or async) and normalize its result.
    The function's own exceptions propagate; a bad result is a ``RewardError``."""
    out = await call_maybe_async(fn, task=task, episode=episode)
    name = getattr(fn, "__qualname__", None) or "reward_fn"
    return normalize(out, name)

"""Capped process-reward shaping: each per-turn checkpoint earns ``per_checkpoint``, the sum is capped
at ``cap`` (< the success reward, so the outcome dominates), and the bonus is added to the outcome.

Checkpoints come from the trajectory's metadata.  Preferred: ``metadata["turn_info"]``, one dict per
model turn, recorded by the episode from ``StepResult.info`` (``arl.rollout.episode`` records it for every turn):
``{"tool": name or None, "tool_error": bool, "call": canonical call text (optional),
"new_state": bool (optional), "observation": str or "obs_digest": str (optional)}``; without ``call`` the tool call
parsed from ``metadata["turn_texts"][k]`` identifies the call.
  * valid_tool_call: a turn with a tool and no tool error, counted once per distinct ``call`` (a
    repeated identical call earns nothing: rewarding "called a tool" teaches tool spam);
  * new_state: ``new_state`` if the env reports it, else an observation of a valid call not seen
    before in the episode.
Fallback without ``turn_info``: valid calls = ``tool_calls - tool_errors`` from the episode's
counters; new states are then unknown (0).  Only OK trajectories are shaped (MASKED/FILTERED keep
their reward).  Rewards are returned, trajectories are not modified.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..data.trajectory import Trajectory, TrajectoryStatus
from ..config import ShapingConfig

# a tool call in a model turn's text (the monitors parse them the same way)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class ToolCall:
    name: Optional[str]
    key: str  # canonical text: identical calls have identical keys
    payload: str


def parse_calls(text: str) -> list:
    out = []
    for payload in _CALL.findall(text):
        try:
            obj = json.loads(payload)
            name = obj.get("name") if isinstance(obj, dict) else None
            key = json.dumps(obj, sort_keys=True)
        except (json.JSONDecodeError, TypeError):
            name, key = None, " ".join(payload.split())
        out.append(ToolCall(name if isinstance(name, str) else None, key, payload))
    return out


def count_checkpoints(t: Trajectory, kinds: Sequence[str]) -> int:
    info = t.metadata.get("turn_info")
    if info is None:
        if "valid_tool_call" not in kinds:
            return 0
        return max(0, int(t.metadata.get("tool_calls", 0)) - int(t.metadata.get("tool_errors", 0)))
    texts = t.metadata.get("turn_texts")
    n, calls, states = 0, set(), set()
    # IPA-replayed expert turns (chunks < ipa_prefix_chunks) earn nothing, but what they called and
    # revealed counts as seen, so the sampled continuation is not paid for repeating them
    replayed = int(t.metadata.get("ipa_prefix_chunks", 0))
    for k, turn in enumerate(info):
        if not isinstance(turn, dict):
            raise ValueError(f"metadata['turn_info'][{k}]: expected a dict, got {type(turn).__name__}")
        if not turn.get("tool") or turn.get("tool_error"):
            continue
        earned = 0
        call = turn.get("call")
        if call is None and texts is not None and k < len(texts):  # the turn's canonical tool call
            call = tuple(c.key for c in parse_calls(texts[k])) or None
        call = k if call is None else call  # without any call text every valid call is distinct
        if "valid_tool_call" in kinds and call not in calls:
            earned += 1
        calls.add(call)
        if "new_state" in kinds:
            if "new_state" in turn:
                earned += bool(turn["new_state"])
            else:  # an observation not seen before in the episode (text or the episode's digest of it)
                obs = turn.get("observation", turn.get("obs_digest"))
                if obs is not None and obs not in states:
                    states.add(obs)
                    earned += 1
        if k >= replayed:
            n += earned
    return n


def shape_rewards(trajs: Sequence[Trajectory], cfg: ShapingConfig):
    """``(rewards [N] float64, metrics)``: outcome + min(cap, per_checkpoint * checkpoints)."""
    outcome = np.array([float(t.reward) for t in trajs], dtype=np.float64)
    if not cfg.enabled:
        return outcome, {}
    ok = np.array([t.status is TrajectoryStatus.OK for t in trajs], dtype=bool)
    counts = np.array([count_checkpoints(t, cfg.checkpoints) if o else 0 for t, o in zip(trajs, ok)], dtype=np.int64)
    raw = cfg.per_checkpoint * counts
    bonus = np.where(ok, np.minimum(raw, cfg.cap), 0.0)
    m = int(ok.sum())
    metrics = {
        "stab/shaping_bonus_mean": float(bonus[ok].mean()) if m else 0.0,
        "stab/shaping_checkpoints_mean": float(counts[ok].mean()) if m else 0.0,
        "stab/shaping_capped_frac": float((raw[ok] > cfg.cap).mean()) if m else 0.0,
    }
    return outcome + bonus, metrics

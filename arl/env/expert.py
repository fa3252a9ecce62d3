"""Replay an environment's expert demonstration into a transcript (SFT warm-start data)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from .base import Environment, StepResult


async def expert_transcript(env: Environment, seed: int
                            ) -> Optional[Tuple[str, List[Tuple[str, StepResult]]]]:
    """``(task, [(model_turn, step_result), ...])`` of the expert solving episode ``seed``, or None
    when the environment has no demonstrator for it.  Run with faults off: a fault makes the
    expert's fixed turns diverge from the episode."""
    task = await env.reset(seed)
    turns = env.expert_turns()
    if turns is None:
        return None
    out = []
    for t in turns:
        res = await env.step(t)
        out.append((t, res))
        if res.done:
            break
    return task, out

"""``gym``: a Gymnasium-style text environment (a game, a user simulator) behind arl's door.

    env:
      name: gym
      kwargs:
        env_id: "my_games:GuessNumber-v0"   # gymnasium.make's id: "module:Id" imports the module
        make_kwargs: {high: 20}             # (which registers Id) first
        system_prompt: "Guess the number."

The environment is written as Gymnasium documents it: ``reset(seed=, options=) -> (obs, info)``,
``step(action) -> (obs, reward, terminated, truncated, info)``, with text observations and text
actions (``gymnasium.spaces.Text``).  Each model turn (to the end of sequence) is the action, as
text; each observation is the ``user``'s next message (``observation_role``), so a game or a user
simulator answers as the user, not as a tool.  The first observation is the task (after
``system_prompt``).  Rewards: Gymnasium gives one per step; arl trains on the outcome, the
episode's return (the sum), given when it ends (``terminated`` or ``truncated``; past
``env.max_turns`` arl ends it with reward 0).

What the adapter cannot carry, and what happens then (one-line errors): a non-text observation
(an array, a dict: ``Box``/``Dict`` spaces are not language); a non-finite reward (the episode is
a recoverable fault); an env whose ``reset``/``step`` raises (``reset``: the run stops at
``--dry-run``; ``step``: an unrecoverable fault of that episode, as any env that breaks).  Vector
envs and Gymnasium's own sampling loop are not used: arl drives one episode per instance.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

from .base import Environment, Fault, StepResult
from .registry import register_env

INSTALL_HINT = "pip install 'arl[gym]' (gymnasium==1.4.0) or bash install.sh --gym"


def _gymnasium():
    try:
        import gymnasium
    except ImportError:
        raise ValueError(f"env.name: gym needs the gymnasium package, which is not installed: {INSTALL_HINT}") from None
    return gymnasium


def _text(obs: Any, where: str) -> str:
    if not isinstance(obs, str):
        raise ValueError(f"{where}: observation must be text (a gymnasium.spaces.Text env), got {type(obs).__name__}")
    return obs


@register_env("gym")
class GymEnv(Environment):
    observation_role = "user"  # the game answers as the user
    stop = ()  # a turn (the action) ends at the end of sequence

    def __init__(self, env_id: str, make_kwargs: Optional[Dict[str, Any]] = None, system_prompt: str = "",
                 max_turns: int = 8):
        gym = _gymnasium()
        if not isinstance(env_id, str) or not env_id:
            raise ValueError(f"env.kwargs.env_id: a gymnasium id ('module:Id-v0' or a registered id), got {env_id!r}")
        try:  # the env checker stays on: it says what a non-Gymnasium-shaped env does wrong
            self.env = gym.make(env_id, **(make_kwargs or {}))
        except Exception as e:
            raise ValueError(f"env.kwargs.env_id: gymnasium.make({env_id!r}) failed ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        self.env_id, self.system_prompt, self.max_turns = env_id, system_prompt or "", int(max_turns)
        self._return, self._active = 0.0, False

    async def reset(self, seed: int) -> str:
        obs, _info = self.env.reset(seed=int(seed))
        self._return, self._turns, self._active = 0.0, 0, True
        return _text(obs, f"gym env {self.env_id!r} reset")

    async def step(self, action_text: str) -> StepResult:
        if not self._active:
            raise ValueError("step: no episode in progress; call reset(seed) first")
        self._turns += 1
        obs, reward, terminated, truncated, info = self.env.step(action_text.strip())
        info = dict(info or {})
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            self._active = False
            return StepResult(f"gym env {self.env_id!r}: reward {reward!r} is not a finite number", 0.0, True,
                              {"fault": Fault.RECOVERABLE, "fault_reason": f"reward {reward!r} is not finite"})
        self._return += float(reward)
        done = bool(terminated or truncated)
        out = {"fault": Fault.NONE, "turn": self._turns, "tool": None, "tool_error": False,
               "truncated": bool(truncated and not terminated)}
        counts = {k: v for k, v in info.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        if counts:  # the env's own numeric info: summed per episode, logged as env/<name>
            out["counts"] = counts
        if done:
            self._active = False
            return StepResult("", self._return, True, out)
        return StepResult(_text(obs, f"gym env {self.env_id!r} step"), 0.0, False, out)

    async def close(self) -> None:
        self.env.close()

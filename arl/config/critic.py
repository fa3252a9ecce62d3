"""The ``critic`` section: a turn-level value head on the policy and GAE over chunks
(arl/trainer/critic.py, arl/stabilizers/gae.py).  On when ``algo.advantage: gae``; setting any key
here without it is an error (arl/config/algo.py ``check_algo``)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gamma: float = Field(
        1.0, gt=0, le=1, description="GAE discount per chunk (model turn), in (0, 1]; the loss's own gamma does not "
        "act on a one-chunk segment.")
    lam: float = Field(
        0.95, ge=0, le=1, description="GAE lambda: 0 gives one-step TD advantages, 1 the Monte-Carlo return minus V.")
    lr_mult: float = Field(
        1.0, gt=0, description="The value head's learning rate is trainer.optim.lr * lr_mult (its own param group).")
    value_coef: float = Field(
        0.5, ge=0, description="Weight of the value loss beside the policy loss (one backward).")
    clip: Optional[float] = Field(
        0.2, gt=0, description="PPO value clip: |V - V_old| <= clip inside the value loss, in reward units; null: "
        "unclipped.")
    whiten: bool = Field(
        False, description="Shift and scale the GAE advantages to mean 0, variance 1 over the step's chunks (all "
        "ranks); costs a no-grad forward per step; value targets stay the raw returns.")

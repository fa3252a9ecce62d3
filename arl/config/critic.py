"""The ``critic`` section: a turn-level value head on the policy and GAE over chunks
(arl/trainer/critic.py, arl/stabilizers/gae.py).  On when ``algo.advantage: gae``; setting any key
here without it is an error (arl/config/algo.py ``check_algo``)."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # discount per chunk in GAE (the loss's own gamma does not act on a one-chunk segment)
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)  # GAE lambda: 0 = one-step TD advantages, 1 = Monte-Carlo return - V
    lr_mult: float = Field(1.0, gt=0)  # the value head's lr = trainer.optim.lr * lr_mult (its own param group)
    value_coef: float = Field(0.5, ge=0)  # weight of the value loss beside the policy loss (one backward)
    clip: Optional[float] = Field(0.2, gt=0)  # PPO value clip: |V - V_old| <= clip inside the loss; None: unclipped
    # GAE advantages shifted and scaled to mean 0, variance 1 over the step's chunks (all ranks), as
    # PPO trainers do; costs the no-grad old pass (the step's values before its first loss). Value
    # targets stay the raw returns.
    whiten: bool = False


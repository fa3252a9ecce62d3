"""The ``critic`` section: a turn-level value head on the policy and GAE over chunks
(arl/trainer/critic.py, arl/stabilizers/gae.py).  Off by default."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
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

def check_critic(critic: CriticConfig, stab, loss) -> None:
    """The critic's advantages reach the loss as turn credit's do, one segment per chunk: the same loss
    levels are required, and IPA (which splits chunks its own way) is excluded."""
    if not critic.enabled:
        return
    if stab.ipa.enabled:
        raise ValueError("critic.enabled: cannot be combined with stabilizers.ipa.enabled (the IPA loss splits "
                         "chunks its own way)")
    if loss.ratio_level == "sequence" or loss.mismatch_level == "sequence" or loss.loss_agg != "token-mean":
        raise ValueError(
            "critic.enabled: needs loss.ratio_level token or chunk, loss.mismatch_level none, token or chunk and "
            f"loss.loss_agg token-mean (got {loss.ratio_level}, {loss.mismatch_level}, {loss.loss_agg})")

"""The ``critic`` section: a turn-level value head on the policy and GAE over chunks
(arl/algo/critic.py, arl/algo/gae.py).  On when ``algo.advantage: gae``; setting any key
here without it is an error (arl/config/algo.py ``check_algo``)."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CriticConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Literal["shared", "separate"] = Field(
        "shared", description="shared: a value head on the policy's trunk, trained in the policy's backward "
        "(H + 1 parameters). separate: a second copy of the start policy (lm_head dropped) with its own value head, "
        "DeepSpeed engine and AdamW, trained by its own backward (a second model's weights, gradients and optimizer "
        "state; not with model.lora).")
    warmup_steps: int = Field(
        0, ge=0, description="The first N optimizer steps fit only the critic, on rollouts of the frozen start "
        "policy (its weights, optimizer state and lr schedule untouched); needs model: separate.")
    epochs: int = Field(
        1, ge=1, description="Passes of the separate critic over each step's micro-batches, one optimizer step each "
        "(verl's critic ppo_epochs): the later passes fit the same targets (the first pass's GAE returns, value clip "
        "around its values); costs one more critic forward and backward of the step's tokens per pass; needs model: "
        "separate.")

    gamma: float = Field(
        1.0, gt=0, le=1, description="GAE discount per chunk (model turn), in (0, 1]; the loss's own gamma does not "
        "act on a one-chunk segment.")
    lam: float = Field(
        0.95, ge=0, le=1, description="GAE lambda: 0 gives one-step TD advantages, 1 the Monte-Carlo return minus V.")
    lr_mult: float = Field(
        1.0, gt=0, description="The value head's learning rate is trainer.optim.lr * lr_mult (its own param group).")
    value_coef: float = Field(
        0.5, ge=0, description="Weight of the value loss beside the policy loss (one backward); with model: separate "
        "it scales the critic's own loss (under Adam it matters only against trainer.optim.grad_clip).")
    clip: Optional[float] = Field(
        0.2, gt=0, description="PPO value clip: |V - V_old| <= clip inside the value loss, in reward units; null: "
        "unclipped.")
    whiten: bool = Field(
        False, description="Shift and scale the GAE advantages to mean 0, variance 1 over the step's chunks (all "
        "ranks); costs a no-grad forward per step; value targets stay the raw returns.")
    whiten_min_std: float = Field(
        0.1, ge=0, description="With whiten: the advantages are divided by max(their std, this), in reward units. A "
        "step whose episodes all agree (all fail, or all succeed) has advantages that are only the critic's own "
        "bootstrap noise (std ~0.005 measured); dividing by their std would turn that noise into unit advantages.")

    @model_validator(mode="after")
    def _check(self) -> "CriticConfig":
        if self.warmup_steps > 0 and self.model != "separate":
            # the head shares the policy's DeepSpeed optimizer: a head-only step would still step the
            # policy's param group (Adam's state and step count) and its lr schedule
            raise ValueError("warmup_steps: needs critic.model: separate (the shared value head is stepped by "
                             "the policy's optimizer, which a warm-up must leave untouched)")
        if self.epochs > 1 and self.model != "separate":
            # the shared head's extra passes would run the policy's trunk and step its optimizer
            raise ValueError("epochs: needs critic.model: separate (the shared head is stepped by the policy's optimizer)")
        if not self.whiten and self.whiten_min_std != type(self).model_fields["whiten_min_std"].default:
            raise ValueError("whiten_min_std: set, but critic.whiten is false (the floor acts only on whitened advantages)")
        return self

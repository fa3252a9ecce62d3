"""Positive-only curriculum: ``positive_only`` (negative advantages zeroed inside the RL surrogate;
their tokens still count in the normalizer -- not rejection-sampling fine-tuning) until
``until_step`` or until the success rate reaches ``until_success`` (whichever comes first), then
both signs.  The switch latches: a later dip in success does not switch back (no oscillation).
"""
from __future__ import annotations

from typing import Optional

from ..config import CurriculumConfig


class PositiveOnlyCurriculum:
    def __init__(self, cfg: CurriculumConfig):
        self.cfg = cfg
        self.switched_at: Optional[int] = None  # step at which both signs were switched on

    def positive_only(self, step: int, success_rate: Optional[float] = None) -> Optional[bool]:
        """The ``positive_only`` flag for this step; None when the curriculum is off (keep the
        loss config's own value)."""
        c = self.cfg
        if not c.enabled:
            return None
        if self.switched_at is None:
            done = (c.until_step is not None and step >= c.until_step) or (
                c.until_success is not None and success_rate is not None and success_rate >= c.until_success)
            if done:
                self.switched_at = int(step)
        return self.switched_at is None

    def metrics(self) -> dict:
        return {"stab/positive_only": float(self.cfg.enabled and self.switched_at is None)} if self.cfg.enabled else {}

    def state_dict(self) -> dict:
        return {"switched_at": self.switched_at}

    def load_state_dict(self, s: dict) -> None:
        self.switched_at = s["switched_at"]

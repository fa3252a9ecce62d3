"""Loss-coefficient schedules: an adaptive KL controller and a linear entropy-bonus decay.

AdaptiveKL (proportional controller, Ziegler et al. 2019 style): after each step with measured KL
to the reference ``kl``, ``e = clip(kl / target - 1, -0.2, 0.2)`` and
``beta <- clamp(beta * (1 + e * n_steps / horizon), min_beta, max_beta)``: KL above target raises
beta, below lowers it, by at most 20%/horizon per step.  A non-finite measurement is ignored
(beta unchanged) and counted.  Entropy: ``start + (end - start) * min(step, steps) / steps``.
"""
from __future__ import annotations

import math

from ..config import AdaptiveKLConfig, EntropyScheduleConfig


class AdaptiveKLController:
    def __init__(self, cfg: AdaptiveKLConfig):
        self.cfg = cfg
        self.beta = float(cfg.init_beta)
        self.last_kl = float("nan")
        self.skipped = 0

    def update(self, kl: float, n_steps: int = 1) -> float:
        kl = float(kl)
        if not math.isfinite(kl):
            self.skipped += 1
            return self.beta
        c = self.cfg
        self.last_kl = kl
        e = min(max(kl / c.target - 1.0, -0.2), 0.2)
        self.beta = min(max(self.beta * (1.0 + e * n_steps / c.horizon), c.min_beta), c.max_beta)
        return self.beta

    def metrics(self) -> dict:
        return {"stab/kl_beta": self.beta, "stab/kl_skipped": self.skipped}

    def state_dict(self) -> dict:
        return {"beta": self.beta, "last_kl": self.last_kl, "skipped": self.skipped}

    def load_state_dict(self, s: dict) -> None:
        self.beta, self.last_kl, self.skipped = float(s["beta"]), float(s["last_kl"]), int(s["skipped"])


def entropy_coef(cfg: EntropyScheduleConfig, step: int) -> float:
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    f = min(step, cfg.steps) / cfg.steps
    return cfg.start + (cfg.end - cfg.start) * f

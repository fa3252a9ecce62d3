"""Tool latency and fault injection shared by environments (seeded, so episodes replay exactly).

Latency is lognormal, given by its median and 99th percentile (the way tool latency is usually
reported): ``latency = median * exp(sigma * z)``, ``z ~ N(0, 1)``, ``sigma = ln(p99/median) / z99``.
Faults are drawn once per tool call: with probability ``unrecoverable_rate`` the tool server dies
(the episode ends, ``Fault.UNRECOVERABLE``); with probability ``recoverable_rate`` the call fails
transiently (``Fault.RECOVERABLE``, the episode goes on).  A latency draw above ``timeout_s`` is a
tool timeout (recoverable) after waiting ``timeout_s``.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Tuple

from .base import Fault

Z99 = 2.3263478740408408  # standard normal 0.99 quantile


@dataclass(frozen=True)
class LatencyModel:
    median_s: float = 0.0
    p99_s: float = 0.0

    def __post_init__(self):
        if not (self.median_s >= 0 and math.isfinite(self.median_s)):
            raise ValueError(f"latency median_s must be a finite number >= 0, got {self.median_s}")
        if self.median_s > 0 and not (self.p99_s >= self.median_s and math.isfinite(self.p99_s)):
            raise ValueError(f"latency p99_s must be finite and >= median_s ({self.median_s}), "
                             f"got {self.p99_s}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_s / self.median_s) / Z99 if self.median_s > 0 else 0.0

    def sample(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


@dataclass(frozen=True)
class FaultConfig:
    recoverable_rate: float = 0.0
    unrecoverable_rate: float = 0.0
    timeout_s: Optional[float] = None

    def __post_init__(self):
        for name in ("recoverable_rate", "unrecoverable_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.recoverable_rate + self.unrecoverable_rate > 1.0:
            raise ValueError("recoverable_rate + unrecoverable_rate must be <= 1, got "
                             f"{self.recoverable_rate + self.unrecoverable_rate}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")


# fault kind -> (fault class, observation shown to the model)
FAULT_KINDS = {
    "died": (Fault.UNRECOVERABLE, "error: tool server died"),
    "transient": (Fault.RECOVERABLE, "error: tool unavailable, try again"),
    "timeout": (Fault.RECOVERABLE, "error: tool timed out, try again"),
}


def draw_tool_call(fault_rng: random.Random, latency_rng: random.Random, faults: FaultConfig,
                   latency: LatencyModel) -> Tuple[Optional[str], float]:
    """One tool call's fate: (fault kind or None, seconds to wait).  Faults and latency use
    separate streams so that turning latency on does not reshuffle the faults of an episode."""
    u, lat = fault_rng.random(), latency.sample(latency_rng)
    if u < faults.unrecoverable_rate:
        return "died", lat
    if u < faults.unrecoverable_rate + faults.recoverable_rate:
        return "transient", lat
    if faults.timeout_s is not None and lat > faults.timeout_s:
        return "timeout", faults.timeout_s
    return None, lat

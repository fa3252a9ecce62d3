"""Stall guard: a run whose steps carry no learning signal must not step on silently.

A step has no signal when no rank had a non-zero advantage and there was no KL, entropy or
imitation term: the optimizer stepped with learning rate 0 (``train/skipped_no_signal``,
arl/trainer/policy.py).  Every ``patience`` consecutive such steps the guard judges the streak by
its mean ``success/train``: below ``SOLVED`` every group fails alike, the policy collapsed or is
stuck, and ``action`` is taken (stop, rollback, or warn: a printed line); at or above it the groups
are solved, which is no fault: one note (once per process), and the run goes on.

A collapse can also keep a trickle of signal: turn credit's anchors or a lone lucky group give a
step an advantage now and then, resetting the streak above, while every episode fails.  So the
guard also counts steps in a row at success/train 0 once the run's best success/train reached
``after_success``; every ``patience`` of them is a collapse too (same action).
"""
from __future__ import annotations

import math
from typing import Optional

from ..config.stabilizers import StallConfig
from .monitors import Decision

SOLVED = 0.5  # the streak's mean success/train at or above this: the groups are solved, not collapsed
_MEANS = ("success/train", "tools/valid_rate")  # averaged over the streak for the message


class StallGuard:
    def __init__(self, cfg: Optional[StallConfig] = None):
        cfg = cfg if cfg is not None else StallConfig()
        self.patience, self.action = int(cfg.patience or 0), cfg.action
        self.after_success = cfg.after_success
        self.noted = False  # the "solved" note was printed
        self.best = 0.0  # the run's best success/train
        self.lost = 0  # steps in a row at success/train 0 since the best reached after_success
        self._reset()

    def _reset(self) -> None:
        self.streak = 0
        self.sums = {}  # key -> [sum, count] over the streak
        self.all_equal = True  # every step of the streak had adv/zero_var_group_frac 1

    def observe(self, metrics: dict, success_rate: Optional[float] = None) -> Decision:
        """Count this step's record; at every ``patience``-th step of a streak, the verdict."""
        return self._no_signal(metrics, success_rate).merge(self._lost(metrics, success_rate))

    def _lost(self, metrics: dict, success_rate: Optional[float]) -> Decision:
        v = metrics.get("success/train", success_rate)
        if self.after_success is None or v is None or not math.isfinite(float(v)):
            return Decision()  # no evidence either way: the streak holds
        if metrics.get("status/ok") == 0:
            return Decision()  # no episode finished OK (environment faults, all masked): no evidence either
        v = float(v)
        if self.best < self.after_success or v > 0:
            self.best, self.lost = max(self.best, v), 0
            return Decision()
        self.lost += 1
        if not self.patience or self.lost % self.patience:
            return Decision()
        valid = metrics.get("tools/valid_rate")
        why = (f"success/train 0 for {self.lost} steps after the run reached {self.best:.2f}"
               + (f" (tools/valid_rate {float(valid):.2f} on the last)" if valid is not None else "")
               + ": the policy collapsed")
        if self.action == "warn":
            return Decision(notes=[f"{why} (stabilizers.stall.action=warn: going on)"])
        return Decision(self.action, [why])

    def _no_signal(self, metrics: dict, success_rate: Optional[float]) -> Decision:
        x = metrics.get("train/skipped_no_signal")
        if x is None or not float(x) >= 0.5:  # a record without it (or NaN) is no evidence of a stall
            self._reset()
            return Decision()
        self.streak += 1
        for k in _MEANS:
            v = metrics.get(k, success_rate if k == "success/train" else None)
            if v is not None and math.isfinite(float(v)):
                s = self.sums.setdefault(k, [0.0, 0])
                s[0], s[1] = s[0] + float(v), s[1] + 1
        self.all_equal &= float(metrics.get("adv/zero_var_group_frac", 0.0)) >= 1.0
        if not self.patience or self.streak % self.patience:
            return Decision()
        return self._verdict()

    def _verdict(self) -> Decision:
        means = {k: s / n for k, (s, n) in self.sums.items() if n}
        success = means.get("success/train")
        cause = "every group's rewards equal" if self.all_equal else "no trajectory had an advantage"
        figures = ", ".join(f"{k} {v:.2f}" for k, v in means.items())
        why = f"no learning signal for {self.streak} steps ({cause}{'; ' + figures if figures else ''})"
        if success is not None and success >= SOLVED:
            if self.noted:
                return Decision()
            self.noted = True
            if success >= 1.0:
                return Decision(notes=[f"every group solved for {self.streak} steps: nothing left to learn "
                                       "from this task set"])
            return Decision(notes=[f"{why}: groups are solved or out of reach, nothing left to learn from "
                                   "this task set"])
        if success is None:
            why += ": no success/train to tell a collapse from solved tasks"
        else:
            why += ": the policy collapsed" if success == 0 else ": the policy is stuck"
        if self.action == "warn":
            return Decision(notes=[f"{why} (stabilizers.stall.action=warn: going on)"])
        return Decision(self.action, [why])

    def metrics(self) -> dict:
        return {"stab/no_signal_streak": self.streak, "stab/zero_success_streak": self.lost}

    def state_dict(self) -> dict:
        return {"streak": self.streak, "sums": {k: list(v) for k, v in self.sums.items()},
                "all_equal": self.all_equal, "best": self.best, "lost": self.lost}

    def load_state_dict(self, s: dict) -> None:
        self.streak = int(s["streak"])
        self.sums = {k: [float(a), int(n)] for k, (a, n) in s["sums"].items()}
        self.all_equal = bool(s["all_equal"])
        self.best, self.lost = float(s.get("best", 0.0)), int(s.get("lost", 0))  # older checkpoints: none

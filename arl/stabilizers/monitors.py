"""Behaviour monitors and the alarm.

Per step, from the batch's trajectories (``behaviour_metrics``):
  ``monitor/tool_freq/<tool>`` calls per trajectory of each tool, ``monitor/tool_calls_per_traj``,
  ``monitor/tool_error_rate`` (tool errors per model turn), ``monitor/repeat_call_frac`` (calls
  that repeat an identical earlier call of the same trajectory), ``monitor/looping_frac``
  (trajectories repeating one identical call >= ``loop_min_repeats`` times: retry loops, cycles),
  ``monitor/destructive_calls`` and ``monitor/destructive_traj_frac`` (tool-call payloads matching
  a destructive-command pattern: rm -rf, kill, shutil.rmtree, os.remove, mkfs, ...).
Tool-call texts come from ``metadata["turn_texts"]`` if the rollout recorded them, else from
decoding each model turn's tokens with the ``decode`` callable (the tokenizer's decode).

``Alarm`` watches any metric (these, the loss metrics, the stabilizers'): a rule fires when the
value leaves ``running mean +- (z * running std + min_delta)`` in its ``direction`` after
``min_history`` values, crosses the absolute bound ``above``, or is non-finite.  A firing value is
not folded into the running statistics.  The decision is "continue", "rollback" (the loop restores
the last checkpoint) or "stop"; stop wins, and rollbacks past ``max_rollbacks`` become stop (the
stall guard's too, arl/stabilizers/stall.py: ``Decision.merge``, then ``Alarm.charge``).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..algo.shaping import parse_calls
from ..config import AlarmRule, MonitorConfig
from ..data.trajectory import Trajectory

DESTRUCTIVE_PATTERNS = (
    r"\brm\s+(-\w+\s+)*-\w*[rRf]",  # rm -rf / rm -r / rm -f
    r"\b(kill|pkill|killall)\s+-?\w+",
    r"\bshutil\.rmtree\b",
    r"\bos\.(remove|unlink|rmdir|removedirs|kill|killpg)\s*\(",
    r"\.unlink\s*\(",
    r"\bmkfs(\.\w+)?\b",
    r"\bdd\s+if=",
    r"\bchmod\s+(-\w+\s+)*777\s+/",
    r"\b(shutdown|reboot|halt)\b",
    r":\(\)\s*\{\s*:\s*\|\s*:\s*&\s*\}\s*;\s*:",  # fork bomb
    r">\s*/dev/(sd|nvme|hd)\w*",
)
def turn_texts(t: Trajectory, decode: Optional[Callable] = None) -> list:
    texts = t.metadata.get("turn_texts")
    if texts is not None:
        return list(texts)
    if decode is None:
        return []
    return [decode(t.tokens[a:b].tolist()) for a, b in t.turns]


def compile_patterns(extra: Sequence[str] = ()) -> list:
    out = []
    for i, p in enumerate(tuple(DESTRUCTIVE_PATTERNS) + tuple(extra)):
        try:
            out.append(re.compile(p, re.I))
        except re.error as e:
            raise ValueError(f"destructive_patterns[{i - len(DESTRUCTIVE_PATTERNS)}]: bad regex {p!r}: {e}") from None
    return out


def behaviour_metrics(trajs: Sequence[Trajectory], cfg: MonitorConfig, decode: Optional[Callable] = None,
                      patterns: Optional[list] = None) -> dict:
    patterns = patterns if patterns is not None else compile_patterns(cfg.destructive_patterns)
    n = max(len(trajs), 1)
    tool_counts: Counter = Counter()
    calls = repeats = looping = destructive = destructive_trajs = turns = errors = 0
    for t in trajs:
        parsed = [c for text in turn_texts(t, decode) for c in parse_calls(text)]
        if "tools" in t.metadata:
            tool_counts.update({str(k): int(v) for k, v in t.metadata["tools"].items()})
        else:
            tool_counts.update(c.name for c in parsed if c.name)
        seen = Counter(c.key for c in parsed)
        calls += len(parsed)
        repeats += sum(v - 1 for v in seen.values())
        looping += bool(seen) and max(seen.values()) >= cfg.loop_min_repeats
        bad = sum(any(p.search(c.payload) for p in patterns) for c in parsed)
        destructive += bad
        destructive_trajs += bad > 0
        turns += len(t.turns)
        errors += int(t.metadata.get("tool_errors", 0))
    out = {f"monitor/tool_freq/{k}": v / n for k, v in sorted(tool_counts.items())}
    out.update({
        "monitor/tool_calls_per_traj": sum(tool_counts.values()) / n,
        "monitor/tool_error_rate": errors / turns if turns else 0.0,
        "monitor/repeat_call_frac": repeats / calls if calls else 0.0,
        "monitor/looping_frac": looping / n,
        "monitor/destructive_calls": destructive,
        "monitor/destructive_traj_frac": destructive_trajs / n,
    })
    return out


@dataclass
class _Running:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0  # Welford sum of squares (plain) or EMA variance

    def std(self, ema: float) -> float:
        if ema > 0:
            return math.sqrt(max(self.m2, 0.0))
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0

    def add(self, x: float, ema: float) -> None:
        self.n += 1
        if ema > 0 and self.n > 1:
            d = x - self.mean
            self.mean += (1 - ema) * d
            self.m2 = ema * (self.m2 + (1 - ema) * d * d)
        else:
            d = x - self.mean
            self.mean += d / self.n
            self.m2 += d * (x - self.mean)
            if ema > 0:
                self.m2 = 0.0


_RANK = {"continue": 0, "rollback": 1, "stop": 2}


@dataclass
class Decision:
    action: str = "continue"  # "continue" | "rollback" | "stop"
    reasons: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # lines the loop prints whatever the action

    @property
    def ok(self) -> bool:
        return self.action == "continue"

    @property
    def reason(self) -> str:
        """One line for the log (the loop prints it when the run stops or rolls back)."""
        return "; ".join(map(str, self.reasons)) or self.action

    def merge(self, other: "Decision") -> "Decision":
        """Both decisions' reasons and notes; the stronger action (stop > rollback > continue)."""
        action = max(self.action, other.action, key=_RANK.__getitem__)
        return Decision(action, self.reasons + other.reasons, self.notes + other.notes)


class Alarm:
    def __init__(self, rules: Sequence[AlarmRule], ema: float = 0.0, max_rollbacks: int = 3):
        self.rules, self.ema, self.max_rollbacks = list(rules), float(ema), int(max_rollbacks)
        self.stats: dict = {}
        self.rollbacks = 0  # survives load_state_dict: a restored checkpoint must not reset it

    def _fires(self, r: AlarmRule, x: float) -> Optional[str]:
        if not math.isfinite(x):
            return f"{r.signal} is {x}"
        if r.above is not None and x > r.above:
            return f"{r.signal}={x:.6g} above {r.above:.6g}"
        s = self.stats.get(r.signal)
        if s is None or s.n < r.min_history:
            return None
        band = r.z * s.std(self.ema) + r.min_delta
        d = x - s.mean
        if (r.direction in ("up", "both") and d > band) or (r.direction in ("down", "both") and -d > band):
            return f"{r.signal}={x:.6g} jumped from running mean {s.mean:.6g} (band {band:.3g})"
        return None

    def observe(self, metrics: dict) -> Decision:
        """Check every rule against this step's metrics, then fold the quiet values in; a rollback
        spends one of ``max_rollbacks``."""
        return self.charge(self.check(metrics))

    def check(self, metrics: dict) -> Decision:
        """``observe`` without the rollback budget (``charge``), for decisions merged with others."""
        dec = Decision()
        fired = set()
        for r in self.rules:
            if r.signal not in metrics:
                continue
            why = self._fires(r, float(metrics[r.signal]))
            if why is not None:
                fired.add(r.signal)
                dec.reasons.append(f"{r.action}: {why}")
                if r.action == "stop" or dec.action == "continue":
                    dec.action = r.action
        for sig in {r.signal for r in self.rules} - fired:
            if sig in metrics and math.isfinite(float(metrics[sig])):
                self.stats.setdefault(sig, _Running()).add(float(metrics[sig]), self.ema)
        return dec

    def charge(self, dec: Decision) -> Decision:
        """A rollback (any source's) counts; past ``max_rollbacks`` it becomes stop."""
        if dec.action == "rollback":
            self.rollbacks += 1
            if self.rollbacks > self.max_rollbacks:
                dec.action = "stop"
                dec.reasons.append(f"stop: rollbacks {self.rollbacks} > max_rollbacks {self.max_rollbacks}")
        return dec

    def state_dict(self) -> dict:
        return {"stats": {k: (v.n, v.mean, v.m2) for k, v in self.stats.items()}, "rollbacks": self.rollbacks}

    def load_state_dict(self, s: dict) -> None:
        self.stats = {k: _Running(int(n), float(m), float(m2)) for k, (n, m, m2) in s["stats"].items()}
        self.rollbacks = max(self.rollbacks, int(s.get("rollbacks", 0)))

"""Step records in step order, each with the held-out evaluation of its policy version."""
from __future__ import annotations

from typing import Optional


class OrderedLog:
    """Step records wait for the held-out evaluation of their policy version (which runs in the
    rollout process, concurrently with training) and are written in step order."""

    def __init__(self, logger, eval_versions: set):
        self.logger, self.eval_versions, self.pending, self.evals = logger, eval_versions, [], {}
        self.samples: dict = {}  # version -> a few evaluated episodes (the W&B table)

    def add(self, step: int, record: dict, wall_s: float) -> None:
        self.pending.append((step, record, wall_s))
        self.flush()

    def eval_result(self, version: int, success: float, samples: Optional[list] = None) -> None:
        self.evals[version] = success
        if samples:
            self.samples[version] = samples
        self.flush()

    def unanswered(self, upto: int) -> list:
        """Evaluated versions up to ``upto`` (those ordered so far) with no result yet."""
        return sorted(v for v in self.eval_versions if v <= upto and v not in self.evals)

    def drop_eval(self, version: int) -> None:
        """Version ``version``'s evaluation will not come: its record is written without it."""
        self.eval_versions.discard(version)
        self.flush()

    def waiting(self) -> bool:
        return any(s in self.eval_versions and s not in self.evals for s, _, _ in self.pending)

    def flush(self, force: bool = False) -> None:
        while self.pending:
            step, rec, wall = self.pending[0]
            if step in self.eval_versions and step not in self.evals and not force:
                return
            if step in self.evals:
                rec["success/heldout"] = self.evals[step]
            self.logger.log(step, rec, wall_s=wall)
            if step in self.samples:
                self.logger.log_samples(step, self.samples.pop(step))
            self.pending.pop(0)

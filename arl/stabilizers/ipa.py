"""IPA chunk initialization resampling (arXiv 2512.24873), the rollout side: which chunk of an expert
trajectory each rollout starts from.

Bookkeeping (arl/data/expert.py).  An expert demonstration is rendered token-level as a
``Trajectory`` (expert turn j is chunk j, observations untrained).  A ``StartState`` at chunk k is
the expert prefix up to the first token of chunk k plus the expert turns to replay in the
environment; the rollout side continues from there and tags each trajectory with
``metadata["ipa_prefix_chunks"] = k`` (and ``ipa_imitate``), which the loss reads (arl/algo/ipa.py).

Schedules.  sequential: start at the last chunk (only the final turn is sampled) and move one chunk
back every ``steps_per_chunk`` steps, or as soon as the success rate reaches ``advance_at_success``;
parallel: start at each anchor fraction of the expert's chunks.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..config import IPAResampleConfig
from ..data.expert import start_state
from ..data.trajectory import Trajectory


class IPAResampler:
    """Which chunk each expert's rollouts start from, per step (see module doc)."""

    def __init__(self, cfg: IPAResampleConfig):
        self.cfg = cfg
        self.offset = 0  # sequential: chunks back from the last one
        self._since = 0  # steps at the current offset

    def start_chunks(self, num_chunks: int) -> list:
        if num_chunks < 1:
            raise ValueError(f"num_chunks: must be >= 1, got {num_chunks}")
        if self.cfg.mode == "sequential":
            return [max(0, num_chunks - 1 - self.offset)]
        return sorted({min(int(a * num_chunks), num_chunks - 1) for a in self.cfg.anchors})

    def start_states(self, experts: Sequence[Trajectory]) -> list:
        return [start_state(e, k) for e in experts for k in self.start_chunks(len(e.turns))]

    def advance(self, success_rate: Optional[float] = None) -> None:
        """Call once per step (sequential mode), with the success rate of the resampled rollouts."""
        self._since += 1
        thr = self.cfg.advance_at_success
        if self._since >= self.cfg.steps_per_chunk or (thr is not None and success_rate is not None and success_rate >= thr):
            self.offset += 1
            self._since = 0

    def metrics(self) -> dict:
        return {"stab/ipa_offset": self.offset} if self.cfg.mode == "sequential" else {}

    def state_dict(self) -> dict:
        return {"offset": self.offset, "since": self._since}

    def load_state_dict(self, s: dict) -> None:
        self.offset, self._since = int(s["offset"]), int(s["since"])

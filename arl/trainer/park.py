"""The trainer's state waits in host memory during the engine's turn (``trainer.offload.while_generating``).

Colocated and alternating (arl/rollout/colocate.py), the trainer is idle from the weight sync until
the next batch arrives, while the engine generates on the same GPU.  Parked, the trainer's weights,
gradients and optimizer state are in (pinned) host memory over that span, so the engine's KV cache
can have that GPU memory; they return before the next update.  verl's ``param_offload`` /
``optimizer_offload`` and OpenRLHF's ``--deepspeed_enable_sleep`` do the same between phases.

What moves: every DeepSpeed engine's ZeRO state through DeepSpeed's own ``offload_states`` /
``reload_states`` (ZeRO 1 and 2: the fp32 partition, the model's trainable weights, gradients and
Adam's moments), and the parameters no ZeRO optimizer owns (LoRA's frozen base weights, a frozen
reference model) by this module.  ZeRO 0 and 3 are refused by the config: DeepSpeed 0.19 has no
``offload_states`` for stage 0's optimizer wrappers, and ZeRO-3's frozen parameters are partitions
it does not move.  At one rank ZeRO-1 keeps the same bytes as stage 0.

The checkpoint and the HF export read parked tensors where they are (host memory); anything that
runs the model (an update, a rollback's restore) unparks first (``PolicyTrainer.awake``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch


def _engines(trainer) -> list:
    """The trainer's DeepSpeed engines: the policy's and a separate critic's."""
    out = [trainer.engine]
    separate = getattr(trainer.objective, "separate", None)
    if getattr(separate, "engine", None) is not None:
        out.append(separate.engine)
    return out


def _frozen_params(trainer) -> List[torch.nn.Parameter]:
    """Parameters no ZeRO optimizer owns: frozen ones of every engine's module, the reference model's."""
    mods = [e.module for e in _engines(trainer)] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    seen, out = set(), []
    for m in mods:
        for p in m.parameters():
            if not p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class Parking:
    """``park()`` moves the trainer's GPU state to host memory, ``unpark()`` brings it back; both are
    idempotent.  On a CPU trainer both run (DeepSpeed's moves are host to host): the tests exercise
    the bookkeeping, a GPU run the memory (bench/gpu_check.sh)."""

    def __init__(self, trainer):
        self.tr = trainer
        self.parked = False
        self.num_parks = 0
        self._home: list = []  # (parameter, its device) of the frozen ones moved by park()

    def park(self) -> None:
        if self.parked:
            return
        pin = torch.cuda.is_available()
        for eng in _engines(self.tr):
            eng.offload_states(pin_memory=pin)
        self._home = []
        for p in _frozen_params(self.tr):
            if p.device.type != "cpu":
                self._home.append((p, p.device))
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                host.copy_(p.data)
                p.data = host
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.parked = True
        self.num_parks += 1

    def unpark(self) -> None:
        if not self.parked:
            return
        for eng in _engines(self.tr):
            eng.reload_states()
        for p, device in self._home:
            p.data = p.data.to(device)
        self._home = []
        self.parked = False

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Unparked for the block, parked again after it if it was parked before."""
        was = self.parked
        self.unpark()
        try:
            yield
        finally:
            if was:
                self.park()

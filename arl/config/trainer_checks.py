"""Cross-checks of the trainer section against the rest of a config: the loss kernel against the loss
options, ``trainer.sequence_parallel`` (arl/trainer/seqpar.py) against the ranks and the parts without
an SP path."""
from __future__ import annotations

from ..ops.policy_loss.api import not_covered


def check_backend(cfg) -> None:
    """An explicit loss kernel that does not run the configured loss: one line."""
    backend = cfg.trainer.backend
    if backend != "auto" and (gap := not_covered(backend, cfg.loss)) is not None:
        raise ValueError(f"trainer.backend: {backend!r} does not run loss.{gap}; "
                         "use auto (the torch reference where no kernel covers the loss) or reference")


def check_sequence_parallel(cfg) -> None:
    """One line when the SP size does not split the trainer ranks, or meets a part with no SP path yet:
    the shared-prefix tree attention, and the critic (its values read whole hidden states)."""
    sp, world = cfg.trainer.sequence_parallel, cfg.trainer.world_size
    if world % sp:
        raise ValueError(f"trainer.sequence_parallel: {sp} must divide trainer.world_size ({world})")
    if sp > 1 and cfg.trainer.share_prefix is True:
        raise ValueError("trainer.sequence_parallel: not with trainer.share_prefix: true yet (the tree attention has "
                         "no sequence-parallel path); set share_prefix to auto or false")
    if sp > 1 and cfg.algo.uses_critic():
        raise ValueError("trainer.sequence_parallel: not with a critic (algo.advantage: gae) yet: its values read "
                         "whole hidden states")

"""Cross-checks of ``trainer.sequence_parallel`` (arl/trainer/seqpar.py) against the rest of a config."""
from __future__ import annotations


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

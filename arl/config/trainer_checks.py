"""Cross-checks of the trainer section against the rest of a config: the loss kernel against the loss
options, ``trainer.sequence_parallel`` (arl/trainer/seqpar.py) against the ranks and the parts without
an SP path."""
from __future__ import annotations

from typing import Optional

from ..ops.policy_loss.api import not_covered
from ..ops.policy_loss.group_adv import IN_PASS


def in_pass_estimator(cfg) -> Optional[str]:
    """The group estimator the loss pass computes (``loss.advantages_in_pass``), or None: the
    advantages are computed before packing and given."""
    return cfg.algo.advantage if cfg.loss.advantages_in_pass else None


def check_in_pass(cfg) -> None:
    """``loss.advantages_in_pass`` needs advantages that are exactly a group statistic of the rewards."""
    if not cfg.loss.advantages_in_pass:
        return
    st = cfg.stabilizers
    why = (f"algo.advantage {cfg.algo.advantage!r} (the pass computes {', '.join(IN_PASS)})"
           if cfg.algo.advantage not in IN_PASS else
           "stabilizers.turn_credit.enabled (per-chunk advantages)" if st.turn_credit.enabled else
           "stabilizers.extreme.enabled (advantage weights)" if st.extreme.enabled else
           "stabilizers.ipa.enabled (IPA's mixed loss)" if st.ipa.enabled else None)
    if why is not None:
        raise ValueError(f"loss.advantages_in_pass: not with {why}; set it false (advantages before packing)")


def check_backend(cfg) -> None:
    """An explicit loss kernel that does not run the configured loss: one line."""
    check_in_pass(cfg)
    backend = cfg.trainer.backend
    if backend != "auto" and (gap := not_covered(backend, cfg.loss, in_pass_estimator(cfg))) is not None:
        raise ValueError(f"trainer.backend: {backend!r} does not run loss.{gap}; "
                         "use auto (the torch reference where no kernel covers the loss) or reference")


def check_sequence_parallel(cfg) -> None:
    """One line when the SP size does not split the trainer ranks, or meets a part with no SP path yet:
    the shared-prefix tree attention, and the separate critic (its own trunk runs unsplit)."""
    sp, world = cfg.trainer.sequence_parallel, cfg.trainer.world_size
    if world % sp:
        raise ValueError(f"trainer.sequence_parallel: {sp} must divide trainer.world_size ({world})")
    if sp > 1 and cfg.trainer.share_prefix is True:
        raise ValueError("trainer.sequence_parallel: not with trainer.share_prefix: true yet (the tree attention has "
                         "no sequence-parallel path); set share_prefix to auto or false")
    if sp > 1 and cfg.algo.uses_critic() and cfg.critic.model == "separate":
        raise ValueError("trainer.sequence_parallel: not with critic.model: separate yet (the critic's own trunk has "
                         "no sequence-parallel path); use critic.model: shared")

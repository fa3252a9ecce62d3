"""What the trainer asks of a run's critic beyond the objective's six hooks: ``objective.critic``.

An objective without a critic has ``critic = None`` and the trainer skips every call below; the
critic objectives (objectives.py) hold one of these, which reads their value head (``value``) and,
for ``critic.model: separate``, their second trunk (``separate``, critic_model.py):

* ``build``: after the policy's engine, the critic's own (separate) and the trainer's collective
  for the step's value statistics;
* ``check_old`` / ``old_values``: the no-grad old pass's values, which come with its logprobs;
* ``zero_touch``: an empty micro-batch's exact 0 through the critic's parameters, so every rank joins
  the same collectives;
* ``frozen`` / ``frozen_step``: the separate critic's warm-up steps, which leave the policy alone;
* ``save`` / ``load`` / ``head_mismatch``: its checkpoint beside the policy's.
"""
from __future__ import annotations


class CriticRole:
    """The shared critic (a value head on the policy's trunk): nothing of its own to build or save."""

    def __init__(self, objective):
        self.objective = objective  # a CriticObjective (objectives.py)

    def build(self, build_engine, device, attn: str, all_sum) -> None:
        """After the policy's engine: ``build_engine(module, params)`` -> (engine, optimizer, scheduler)
        makes an engine like the policy's; ``all_sum(tensor, device)`` sums over the trainer's ranks."""
        self.objective.value.all_sum = all_sum

    def check_old(self, old_logps, old_values) -> None:
        if (old_values is None) != (old_logps is None):
            raise ValueError("rl_step: with the critic, old_values come with old_logps (both from old_logprobs(mbs, "
                             "values=[])) or neither (both from the gradient pass)")

    def old_values(self, model, hidden, mb):
        """The old pass's values of micro-batch ``mb`` (detached)."""
        return self.objective.value.values(model, hidden, mb).detach()

    def zero_touch(self, model, hidden):
        """An empty micro-batch's extra term (exactly 0) over the dummy forward's ``hidden`` states, so
        the critic's parameters join every rank's collectives; None when the critic has its own."""
        return self.objective.value.touch(model, hidden)

    def frozen(self) -> bool:
        """Whether this step leaves the policy alone (``frozen_step`` runs instead of the policy's)."""
        return False

    def frozen_step(self, mbs, old_values, device) -> dict:
        raise NotImplementedError("the shared critic has no step without the policy")

    def save(self, directory: str, tag: str) -> None:
        """Beside the policy's checkpoint ``directory/tag``: the critic's own state (a collective)."""

    def load(self, directory: str, tag) -> None:
        """What ``save`` wrote (``tag`` None: the policy's checkpoint's 'latest')."""

    def head_mismatch(self, directory: str) -> str:
        """The one-line error for a checkpoint saved without this critic's value head."""
        return _switched(directory, on=True)


class SeparateCriticRole(CriticRole):
    """``critic.model: separate``: a second trunk with its own engine, warm-up and checkpoint."""

    def build(self, build_engine, device, attn: str, all_sum) -> None:
        super().build(build_engine, device, attn, all_sum)
        self.objective.separate.build(build_engine, device, attn)

    def old_values(self, model, hidden, mb):
        return self.objective.separate.values(mb).detach()

    def zero_touch(self, model, hidden):
        self.objective.separate.empty()  # the critic's own forward (and backward, with grad on) for its collectives
        return None

    def frozen(self) -> bool:
        obj = self.objective
        return obj.separate.steps < obj.value.cfg.warmup_steps

    def frozen_step(self, mbs, old_values, device) -> dict:
        """A warm-up step: the critic alone fits values on the frozen policy's rollouts; the policy runs
        no forward, backward or optimizer step, so its weights, Adam state and lr schedule stay."""
        obj = self.objective
        begin = obj.begin_step(mbs, old_values, device)
        obj._value_pass(mbs, old_values, device)
        return {**obj.end_step(device), **begin, "critic/warmup": 1.0}

    def save(self, directory: str, tag: str) -> None:
        self.objective.separate.save(directory, tag)

    def load(self, directory: str, tag) -> None:
        self.objective.separate.load(directory, tag)

    def head_mismatch(self, directory: str) -> str:
        return (f"--resume: the checkpoint in {directory} was saved with critic.model: shared (a value head on the "
                "policy), this run has critic.model: separate: resume with the setting it was saved with")


def _switched(directory: str, on: bool) -> str:
    return (f"--resume: the checkpoint in {directory} was saved with the critic {'off' if on else 'on'} "
            f"(algo.advantage gae), this run has it {'on' if on else 'off'}: resume with the setting it was saved with")


def head_mismatch(critic, directory: str) -> str:
    """The one-line error for a checkpoint whose value head the policy does not have (or lacks);
    ``critic``: the run's ``objective.critic`` (None: the run has no critic)."""
    return critic.head_mismatch(directory) if critic is not None else _switched(directory, on=False)


def check_old_values(objective, old_logps, old_values) -> None:
    """``rl_step``'s rule for the old pass's extras: the critic's own, or none without a critic."""
    if objective.critic is not None:
        objective.critic.check_old(old_logps, old_values)
    elif old_values is not None:
        raise ValueError(f"rl_step: old_values given, but the {objective.name!r} objective has no old values")

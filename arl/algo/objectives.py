"""Trainer objectives: what one micro-batch's forward is turned into before ``backward``.

The trainer step (``PolicyTrainer.rl_step``) is forward -> ``objective.loss(mb, fwd, loss_cfg)`` ->
backward for every objective; the objective is chosen once per run (``algo.objective``, resolved by
``AlgoConfig.objective_name``):

* ``policy_gradient``: the clipped / TOPR policy loss (``arl.ops.policy_loss``) over the step's
  advantages (turn credit: one loss segment per chunk).
* ``ipa``: IPA resampling's imitation NLL on the expert prefix + the chunk-level RL loss on the
  resampled chunks (arl/algo/ipa.py).
* ``critic``: a value head on the trunk (arl/algo/critic.py), or on a second trunk with its own
  optimizer (``critic.model: separate``, arl/algo/critic_model.py); GAE over this forward's (or
  the old pass's) values gives each chunk's advantage; the value loss joins the policy loss (shared)
  or the critic's own backward (separate).

A new objective is a subclass and a ``@register_objective("name")`` line; the trainer step does not
change.  The base class has six hooks: ``prepare_model`` (before DeepSpeed wraps the model: extra
heads, param groups), ``begin_step`` / ``end_step`` (step-wide statistics, collectives, an own
optimizer's step), ``head_grad`` (the logprob head's gradient plan, or None), ``loss`` and
``has_signal``.  What only a critic needs (its own engine, warm-up steps that leave the policy alone,
its checkpoint, the old pass's values, an empty micro-batch's exact 0 through its parameters) is the
critic's own object, ``objective.critic`` (critic_role.py; None without a critic), which the trainer
asks for explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.policy_loss import LossConfig, policy_loss
from ..ops.policy_loss.local_grad import local_logp_grad
from .critic import Critic, attach_value_head, param_groups
from .critic_model import CriticModel
from .critic_role import CriticRole, SeparateCriticRole
from .ipa import ipa_mixed_loss


@dataclass
class Forward:
    """One micro-batch's gradient-pass outputs, on the trainer's device."""

    logp: torch.Tensor  # [T] logprobs, with the graph
    entropy: Optional[torch.Tensor]  # [T] token entropy, with the graph
    old: torch.Tensor  # [T] the 'old' policy's logprobs (this pass's, detached, when no old pass ran)
    ref: Optional[torch.Tensor]  # [T] the reference policy's logprobs (KL), or None
    hidden: Optional[torch.Tensor] = None  # [T, H] final hidden states, when the objective asks for them
    old_values: Optional[torch.Tensor] = None  # the old pass's extras (critic: values), or None


@dataclass
class LossOut:
    loss: torch.Tensor  # the policy loss: what ``metrics['loss']`` reports
    total: torch.Tensor  # what goes into backward (the policy loss plus any auxiliary term)
    metrics: dict


def pg_inputs(mb, device) -> tuple:
    """``(advantages, policy_loss keyword arguments)`` of a micro-batch, on ``device``: the packed
    per-trajectory advantages, or turn credit's per-chunk segments when the micro-batch has them, or
    (``loss.advantages_in_pass``) None and the in-pass inputs as ``group``."""
    kw = mb.loss_kwargs()
    if mb.segments is not None:
        kw.update(mb.segments)
    adv = kw.pop("advantages")
    if mb.group_adv is not None and mb.segments is None:
        adv, kw["group"] = None, mb.group_adv.to(device)
    adv = adv.to(device, torch.float32) if adv is not None else None  # None: the op's one-line error
    return adv, {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


OBJECTIVES: dict = {}


def register_objective(name: str):
    def deco(cls):
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is already registered")
        cls.name = name
        OBJECTIVES[name] = cls
        return cls

    return deco


def make_objective(name: str, backend: str, critic=None) -> "Objective":
    """The run's objective; the critic's class follows ``critic.model`` (shared or separate)."""
    if name not in OBJECTIVES:
        raise ValueError(f"algo.objective: unknown objective {name!r} (registered: {', '.join(sorted(OBJECTIVES))})")
    cls = OBJECTIVES[name]
    if cls is CriticObjective and critic is not None:
        cls = CRITIC_MODELS[critic.model]
    return cls(backend, critic)


def _pg_head_grad(mb, loss_cfg: LossConfig, ref, scale: float, device):
    """The plain policy loss's head-gradient plan for one micro-batch."""
    adv, kw = pg_inputs(mb, device)
    return local_logp_grad(config=loss_cfg, ref_logp=ref, with_entropy=True, advantages=adv, scale=scale, **kw)


@register_objective("policy_gradient")
class Objective:
    """The policy loss over the step's advantages; the base every objective extends (six hooks)."""

    needs_hidden = False  # the forward also returns final hidden states
    needs_old_pass = False  # the no-grad old pass must run before every step
    critic: Optional[CriticRole] = None  # the run's critic (critic_role.py), asked for by the trainer

    def __init__(self, backend: str, critic=None):
        self.backend = backend

    def prepare_model(self, model: torch.nn.Module, lr: float) -> list:
        """The optimizer's parameters (or param groups) of ``model``, before DeepSpeed wraps it."""
        return [p for p in model.parameters() if p.requires_grad]

    def begin_step(self, mbs, old_values, device) -> dict:
        """Before the step's first loss (every rank: it may run collectives); returns metrics."""
        return {}

    def head_grad(self, mb, loss_cfg: LossConfig, ref, scale: float, device):
        """The logprob head's d loss / d logp plan (old = this pass's logp, detached), or None.  The
        plan is the policy loss's own gradient: a subclass with another ``loss`` gets None (the
        ordinary backward) unless it overrides this too."""
        if type(self).loss is not Objective.loss:
            return None
        return _pg_head_grad(mb, loss_cfg, ref, scale, device)

    def loss(self, mb, fwd: Forward, loss_cfg: LossConfig, device) -> LossOut:
        if mb.ipa is not None:
            raise ValueError(f"micro-batch {mb.index}: carries IPA roles but the objective is {self.name!r} "
                             "(algo.objective: ipa goes with stabilizers.ipa.enabled)")
        adv, kw = pg_inputs(mb, device)
        out = policy_loss(fwd.logp, fwd.old, config=loss_cfg, entropy=fwd.entropy, ref_logp=fwd.ref,
                          advantages=adv, backend=self.backend, **kw)
        return LossOut(out.loss, out.loss, out.metrics)

    def end_step(self, device) -> dict:
        """After the step's last backward, before the optimizer step (every rank); returns metrics."""
        return {}

    @staticmethod
    def has_signal(metrics: dict, loss_cfg: LossConfig, end: Optional[dict] = None) -> bool:
        """Whether this rank's step has anything for the policy to learn: an advantage, imitated tokens,
        a KL / entropy term, or ``end_step``'s non-empty figures (the shared critic's value loss, which
        the policy's optimizer steps); the trainer takes the any over ranks."""
        return (bool(end) or any(v > 0 for v in metrics.get("adv_nonzero_frac", ()))
                or any(v > 0 for v in metrics.get("ipa/il_tokens", ()))
                or loss_cfg.kl_beta > 0 or loss_cfg.entropy_coef > 0)


@register_objective("ipa")
class IPAObjective(Objective):
    """IPA resampling: imitation on the expert prefix + chunk-level RL on the resampled chunks.  A
    micro-batch without IPA roles (none while stabilizers.ipa is on) takes the plain policy loss."""

    def head_grad(self, mb, loss_cfg, ref, scale, device):
        if mb.ipa is None:  # the plain policy loss: its plan
            return _pg_head_grad(mb, loss_cfg, ref, scale, device)
        return None  # no local-gradient plan for the mixed loss

    def loss(self, mb, fwd, loss_cfg, device) -> LossOut:
        r = mb.ipa
        if r is None:
            return super().loss(mb, fwd, loss_cfg, device)
        adv = mb.advantages.to(device, torch.float32) if mb.advantages is not None else None
        loss, metrics = ipa_mixed_loss(
            fwd.logp, fwd.old, mb=mb, il_mask=r["il_mask"], rl_chunk_ids=r["rl_chunk_ids"], loss_cfg=loss_cfg,
            il_normalizer=r["il_normalizer"], rl_normalizer=r["rl_normalizer"], lambda_il=r["lambda_il"],
            lambda_rl=r["lambda_rl"], advantages=adv, entropy=fwd.entropy, ref_logp=fwd.ref, backend=self.backend)
        return LossOut(loss, loss, metrics)


def _segments(mb):
    if mb.segments is None:
        raise ValueError("critic: the micro-batch has no per-chunk loss segments (arl/algo/step.py attach_roles "
                         "sets them under algo.advantage: gae)")
    return {**mb.loss_kwargs(), **mb.segments}


@register_objective("critic")
class CriticObjective(Objective):
    """Policy loss with GAE advantages from a value head on the trunk, plus the clipped value loss
    (``critic.model: shared``; ``separate``: ``SeparateCriticObjective``)."""

    needs_hidden = True  # the objective has values (old pass: ``critic.old_values``)

    def __init__(self, backend: str, critic=None):
        super().__init__(backend)
        if critic is None:
            raise ValueError("algo.objective: critic needs the critic section (CriticConfig)")
        self.value = Critic(critic)  # values, GAE and the value loss of each micro-batch
        self.model = None
        # whitening needs every chunk's old value before the step's first loss; the critic's later
        # epochs fit the first pass's targets, which the old values fix
        self.needs_old_pass = bool(critic.whiten) or critic.epochs > 1
        self.critic = CriticRole(self)

    def prepare_model(self, model, lr):
        attach_value_head(model)
        self.model = model
        return param_groups(model, lr, self.value.cfg.lr_mult)

    def head_grad(self, mb, loss_cfg, ref, scale, device):
        return None  # the advantages come out of this forward's values

    def begin_step(self, mbs, old_values, device) -> dict:
        return self.value.begin_step(mbs, old_values, device)

    def _values(self, mb, fwd) -> torch.Tensor:
        return self.value.values(self.model, fwd.hidden, mb)

    def _losses(self, mb, fwd, loss_cfg, device):
        """``(policy loss output, value loss)`` of one micro-batch."""
        kw = _segments(mb)
        v = self._values(mb, fwd)
        old_v = v.detach() if fwd.old_values is None else fwd.old_values.to(device)
        adv, vloss = self.value.micro_batch(v, old_v, mb, kw.pop("advantages"))
        kw = {k: (t.to(device) if isinstance(t, torch.Tensor) else t) for k, t in kw.items()}
        out = policy_loss(fwd.logp, fwd.old, config=loss_cfg, entropy=fwd.entropy, ref_logp=fwd.ref,
                          advantages=adv.to(device, torch.float32), backend=self.backend, **kw)
        return out, self.value.cfg.value_coef * vloss

    def loss(self, mb, fwd, loss_cfg, device) -> LossOut:
        out, vloss = self._losses(mb, fwd, loss_cfg, device)
        return LossOut(out.loss, out.loss + vloss, out.metrics)

    def end_step(self, device) -> dict:
        return self.value.step_metrics(device)  # non-empty: the value loss had points to fit (a signal)


class SeparateCriticObjective(CriticObjective):
    """``critic.model: separate``: the values come from a second trunk (arl/algo/critic_model.py),
    whose own backward takes the value loss and whose own optimizer steps in ``end_step``; the
    policy's backward carries the policy loss only.  The first ``critic.warmup_steps`` steps are the
    critic's alone (``critic.frozen_step``, critic_role.py)."""

    def __init__(self, backend: str, critic=None):
        super().__init__(backend, critic)
        self.separate = None
        self._fit = None  # the step's (micro-batches, old values): what the critic's later epochs fit again
        self.critic = SeparateCriticRole(self)

    def prepare_model(self, model, lr):
        self.separate = CriticModel(self.value, model, lr)  # the start weights, before DeepSpeed wraps either
        return [p for p in model.parameters() if p.requires_grad]

    def begin_step(self, mbs, old_values, device) -> dict:
        self._fit = (mbs, old_values)
        return self.value.begin_step(mbs, old_values, device)

    def _values(self, mb, fwd) -> torch.Tensor:
        return self.separate.values(mb)

    def _value_pass(self, mbs, old_values, device) -> None:
        """One critic forward and backward over the step's micro-batches (values against the targets
        from ``old_values``; without them, from this pass's own values)."""
        for i, mb in enumerate(mbs):
            if mb.is_empty:
                self.separate.empty()
                continue
            v = self.separate.values(mb)
            old_v = v.detach() if old_values is None else old_values[i].to(device)
            _, vloss = self.value.micro_batch(v, old_v, mb, _segments(mb)["advantages"])
            self.separate.backward(self.value.cfg.value_coef * vloss)

    def loss(self, mb, fwd, loss_cfg, device) -> LossOut:
        out, vloss = self._losses(mb, fwd, loss_cfg, device)
        self.separate.backward(vloss)
        return LossOut(out.loss, out.loss, out.metrics)

    def end_step(self, device) -> dict:
        value = self.value.step_metrics(device)  # a collective: the same on every rank
        out = self.separate.step(apply=bool(value))
        if value and self.value.cfg.epochs > 1:
            mbs, old_values = self._fit
            for _ in range(self.value.cfg.epochs - 1):
                self._value_pass(mbs, old_values, device)
                self.separate.step(apply=True, count=False)
            self.value.discard()  # the metrics are the first pass's (the values before this step's fit)
        self._fit = None
        return {**value, **out, "critic/warmup": 0.0}

    @staticmethod
    def has_signal(metrics: dict, loss_cfg: LossConfig, end: Optional[dict] = None) -> bool:
        return Objective.has_signal(metrics, loss_cfg)  # the value loss is the critic's optimizer's, not the policy's


CRITIC_MODELS = {"shared": CriticObjective, "separate": SeparateCriticObjective}  # critic.model -> objective

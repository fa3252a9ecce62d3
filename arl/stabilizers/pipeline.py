"""``Stabilizers``: the few calls per step trainer rank 0 makes; holds every stabilizer's state.  The
step's advantages and loss roles are the algorithm's (arl/algo/step.py): ``prepare`` and ``apply``
hand on to it, for a caller that holds only this object."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..algo.extreme import length_metrics
from ..algo.step import StepAdvantages, attach_roles, step_advantages
from ..config.algo import AlgoConfig
from ..config.stabilizers import StabilizerConfig, check_turn_credit_loss
from ..data.trajectory import Trajectory
from ..ops.policy_loss.config import LossConfig
from .curriculum import PositiveOnlyCurriculum
from .ipa import IPAResampler
from .monitors import Alarm, Decision, behaviour_metrics, compile_patterns
from .schedules import AdaptiveKLController, entropy_coef
from .stall import StallGuard


PreparedBatch = StepAdvantages  # what prepare() returns: the step's advantages and every stabilizer metric


class Stabilizers:
    """Per step, trainer rank 0 calls::

        loss_cfg = stab.loss_config(step, success_rate)   # curriculum, KL beta, entropy coef
        packed, prep = prepare_step(trajs, loss_cfg, packer_cfg, cfg.stabilizers, cfg.algo)  # arl/algo/step.py
        metrics = {**stab.observe(trajs), **prep.metrics}  # lengths, monitors; the advantages'
        ... every rank: rl_step(...) ...
        decision = stab.after_step(step, record, success_rate)   # KL controller, IPA schedule, alarms, stall
        if decision.action != "continue": ...              # "stop" or "rollback" to the last checkpoint

    Dynamic sampling and IPA's start states act on the rollout side; their judges
    (``DynamicSampler``, ``IPAResampler``) are handed to it by the launcher.
    """

    def __init__(self, cfg: Optional[StabilizerConfig] = None, loss_cfg: Optional[LossConfig] = None,
                 decode: Optional[Callable] = None, algo: Optional[AlgoConfig] = None):
        self.cfg = cfg if cfg is not None else StabilizerConfig()
        self.algo = algo if algo is not None else AlgoConfig()  # the estimator; gae: GAE's per-chunk inputs
        self.loss_cfg = loss_cfg if loss_cfg is not None else LossConfig()
        self.decode = decode  # tokenizer decode, for monitors when trajectories carry no turn texts
        self.curriculum = PositiveOnlyCurriculum(self.cfg.curriculum)
        self.kl = AdaptiveKLController(self.cfg.kl)
        self.ipa = IPAResampler(self.cfg.ipa)
        check_turn_credit_loss(self.cfg, self.loss_cfg)
        m = self.cfg.monitors
        self.alarm = Alarm(m.alarms, m.ema, m.max_rollbacks)
        self.stall = StallGuard(self.cfg.stall)
        self._patterns = compile_patterns(m.destructive_patterns)

    # -- the batch ------------------------------------------------------------------------------
    def observe(self, trajs: Sequence[Trajectory]) -> dict:
        """The batch's early-warning signals: lengths of failures and successes (always on) and, with
        the monitors on, the behaviour metrics."""
        metrics = length_metrics(trajs, self.cfg.extreme)
        if self.cfg.monitors.enabled:
            metrics.update(behaviour_metrics(trajs, self.cfg.monitors, self.decode, self._patterns))
        return metrics

    def prepare(self, trajs: Sequence[Trajectory], loss_cfg: Optional[LossConfig] = None) -> PreparedBatch:
        """The step's advantages (arl/algo/step.py) with ``observe``'s metrics."""
        adv = step_advantages(trajs, loss_cfg if loss_cfg is not None else self.loss_cfg, self.cfg, self.algo)
        adv.metrics = {**self.observe(trajs), **adv.metrics}
        return adv

    def apply(self, packed, prep: PreparedBatch, loss_cfg: Optional[LossConfig] = None) -> None:
        """Each micro-batch's loss roles (arl/algo/step.py ``attach_roles``)."""
        attach_roles(packed, prep, loss_cfg if loss_cfg is not None else self.loss_cfg, self.cfg.ipa)

    # -- loss config ------------------------------------------------------------------------------
    def loss_config(self, step: int, success_rate: Optional[float] = None) -> LossConfig:
        """The LossConfig for this step: the base one with the curriculum's ``positive_only``, the
        KL controller's ``kl_beta`` and the entropy schedule's ``entropy_coef`` (each only if on)."""
        update = {}
        po = self.curriculum.positive_only(step, success_rate)
        if po is not None:
            update["positive_only"] = po
        if self.cfg.kl.enabled:
            update["kl_beta"] = self.kl.beta
        if self.cfg.entropy.enabled:
            update["entropy_coef"] = entropy_coef(self.cfg.entropy, step)
        return self.loss_cfg.model_copy(update=update) if update else self.loss_cfg

    # -- after the optimizer step ---------------------------------------------------------------
    def after_step(self, step: int, metrics: dict, success_rate: Optional[float] = None) -> Decision:
        """Feed the step's metrics (loss, rollout, prepare's): KL controller, IPA schedule, alarms,
        stall guard.  Returns their merged decision (stop wins; a rollback of either spends the
        alarm's budget); ``stab_metrics()`` has the controllers' state to log."""
        if self.cfg.kl.enabled:  # a missing signal counts as skipped (stab/kl_skipped), never silently
            self.kl.update(float(metrics.get(self.cfg.kl.signal, float("nan"))))
        if self.cfg.ipa.enabled and self.cfg.ipa.mode == "sequential":
            self.ipa.advance(success_rate)
        dec = self.alarm.check(metrics) if self.cfg.monitors.enabled else Decision()
        # the stall guard runs with the monitors off too: it is on by default
        return self.alarm.charge(dec.merge(self.stall.observe(metrics, success_rate)))

    def stab_metrics(self) -> dict:
        out = dict(self.curriculum.metrics())
        out.update(self.stall.metrics())
        if self.cfg.kl.enabled:
            out.update(self.kl.metrics())
        if self.cfg.ipa.enabled:
            out.update(self.ipa.metrics())
        if self.cfg.monitors.enabled or self.cfg.stall.action == "rollback":  # either can spend the budget
            out["stab/rollbacks"] = self.alarm.rollbacks
        return out

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict(), "kl": self.kl.state_dict(),
                "ipa": self.ipa.state_dict(), "alarm": self.alarm.state_dict(), "stall": self.stall.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        """Restore (resume or rollback); the alarm's rollback count never goes back."""
        self.curriculum.load_state_dict(s["curriculum"])
        self.kl.load_state_dict(s["kl"])
        self.ipa.load_state_dict(s["ipa"])
        self.alarm.load_state_dict(s["alarm"])
        if "stall" in s:  # checkpoints from before the stall guard have none: the streak starts at 0
            self.stall.load_state_dict(s["stall"])

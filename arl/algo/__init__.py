"""The algorithm: how a finished rollout batch becomes a loss.  Read the modules in this order.

Trainer rank 0, once per step, before packing (``prepare_step`` in step.py):

1. shaping.py      rewards = outcome + capped process rewards (``stabilizers.shaping``)
2. extreme.py      long failures masked or down-weighted (``stabilizers.extreme``)
3. advantages.py   A_i = the ``algo.advantage`` estimator over the step's groups (grpo, dr_grpo, rloo, none;
                   gae: the critic's)
4. turn_credit.py  per-chunk advantages A_{i,k} (``stabilizers.turn_credit``)
5. gae.py          under the critic: each chunk's reward and value point, GAE's inputs
6. step.py         the above in order, packing, and each micro-batch's roles (turn credit's segments,
                   the critic's value points, IPA's imitation / RL split: ipa.py; with
                   ``loss.advantages_in_pass`` the step's group table: in_pass.py)

Every trainer rank, per micro-batch, after its forward (``PolicyTrainer.rl_step``):

7. objectives.py   the ``Objective``: forward -> loss (policy gradient, IPA's mixed loss, critic)
8. critic.py       the critic's value head, GAE per micro-batch, the value loss; critic_model.py: the
                   separate critic's own trunk; critic_role.py: what the trainer asks of a critic beyond
                   the objective (its engine, warm-up steps, checkpoint, old values)

The loss op itself is arl/ops/policy_loss; the step that runs forward and backward is arl/trainer.
This face imports only the estimators: ``import arl`` loads them (they fill the config's table).
"""
from .advantages import ESTIMATORS, Estimator, gae, get_estimator, group_advantages, register_estimator

__all__ = ["ESTIMATORS", "Estimator", "gae", "get_estimator", "group_advantages", "register_estimator"]

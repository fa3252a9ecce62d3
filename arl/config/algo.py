"""The ``algo`` section: which advantage estimator and which trainer objective (arl/algo/) a run uses.
The loss's own options stay in ``loss``.

``ESTIMATORS`` is the table of estimator names a config may choose.  It lives here, below the
algorithm, so that loading a config checks the name without importing arl/algo (which sits above
config); arl/algo/advantages.py defines the estimators and fills it (``register_estimator``), and
``import arl`` imports that module first, so the built-in names are always there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable
    kind: Literal["group", "critic"]
    baseline: bool  # False: advantages are the raw rewards (no group comparison, so no step term either)
    doc: str


ESTIMATORS: dict[str, Estimator] = {}  # filled by arl/algo/advantages.py


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"algo.advantage: unknown estimator {name!r} (registered: {', '.join(sorted(ESTIMATORS))})")
    return ESTIMATORS[name]


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: str = Field("grpo", description=(
        "Advantage estimator, computed per step in float64 before packing: grpo (group mean/std), dr_grpo "
        "(group mean only), rloo (leave-one-out mean), none (raw reward), gae (the critic: a value head and GAE "
        "over chunks; the critic section's settings apply)."))
    adv_eps: float = Field(1e-6, gt=0, description="Added to the group std before dividing (grpo; turn credit's "
                                                   "anchor groups too).")
    objective: Literal["auto", "policy_gradient", "ipa", "critic"] = Field("auto", description=(
        "Trainer objective: auto picks critic under advantage gae, ipa when stabilizers.ipa.enabled, else "
        "policy_gradient; name one to check the config agrees."))

    @field_validator("advantage")
    @classmethod
    def _known(cls, v: str) -> str:
        get_estimator(v)  # one line naming the registered estimators
        return v

    def uses_critic(self) -> bool:
        return ESTIMATORS[self.advantage].kind == "critic"

    def objective_name(self, ipa_enabled: bool) -> str:
        """The objective a run trains with (``auto`` resolved)."""
        if self.objective != "auto":
            return self.objective
        if self.uses_critic():
            return "critic"
        return "ipa" if ipa_enabled else "policy_gradient"


def check_algo(algo: AlgoConfig, critic, stab, loss) -> None:
    """Cross-checks of ``algo`` against the sections it drives (one line each)."""
    if algo.uses_critic():
        if stab.ipa.enabled:
            raise ValueError("algo.advantage: gae cannot be combined with stabilizers.ipa.enabled (the IPA loss "
                             "splits chunks its own way)")
        if loss.ratio_level == "sequence" or loss.mismatch_level == "sequence" or loss.loss_agg != "token-mean":
            raise ValueError(
                "algo.advantage: gae needs loss.ratio_level token or chunk, loss.mismatch_level none, token or chunk "
                f"and loss.loss_agg token-mean (got {loss.ratio_level}, {loss.mismatch_level}, {loss.loss_agg})")
    else:
        default = type(critic)()
        changed = [k for k in type(critic).model_fields if getattr(critic, k) != getattr(default, k)]
        if changed:
            raise ValueError(f"critic.{changed[0]}: set, but the critic is off (it is on with algo.advantage: gae)")
    name = algo.objective_name(stab.ipa.enabled)
    if algo.uses_critic() != (name == "critic"):
        raise ValueError(f"algo.objective: {name!r} does not go with algo.advantage {algo.advantage!r} (the critic "
                         "objective is the gae estimator's, and only its)")
    if (name == "ipa") != stab.ipa.enabled:
        raise ValueError(f"algo.objective: {name!r} needs stabilizers.ipa.enabled "
                         f"{'true' if name == 'ipa' else 'false'}")


# keys that moved out of their section: the old spelling fails with one line naming the new one
MOVED = {
    ("loss", "adv_norm"): "algo.advantage (group_std -> grpo, group_mean -> dr_grpo, none -> none)",
    ("loss", "adv_eps"): "algo.adv_eps",
    ("critic", "enabled"): "algo.advantage: gae (the critic is on exactly under the gae estimator)",
    ("layout", "launcher"): "launcher (auto: Ray; torchrun and the deepspeed launcher are gone, docs/ray.md)",
    ("layout", "hostfile"): "a Ray cluster: ray start on each node, then ray.address (docs/ray.md: multi-node)",
}


def check_moved(data: dict, sections: dict) -> None:
    """Raise for a moved key present in raw config ``data`` (unless its section's model still has it)."""
    for (sec, key), new in MOVED.items():
        body = data.get(sec)
        if isinstance(body, dict) and key in body and key not in sections[sec].model_fields:
            raise ValueError(f"{sec}.{key}: moved to {new}")

"""The policy-loss op (PPO/GRPO, DAPO, GSPO, IPA chunk level, TOPR): entry point and backend
registry (api.py), options (config.py), the specification (spec.py), the registries of surrogates
and KL estimators written as one torch function each (registry.py), the one kernel option table
(options.py) and the fused kernel backends behind one autograd wrapper (fused.py)."""
from . import fused  # noqa: F401  registers the kernel backends (each reports whether it can run here)
from .api import available_backends, policy_loss, register_backend
from .config import LossConfig
from .registry import register_kl_estimator, register_surrogate
from .spec import METRIC_KEYS, PackLayout, reference_policy_loss
from .types import LossInputs, LossOutput

__all__ = [
    "LossConfig", "LossInputs", "LossOutput", "METRIC_KEYS", "PackLayout", "available_backends", "policy_loss",
    "reference_policy_loss", "register_backend", "register_kl_estimator", "register_surrogate",
]

"""The policy-loss family (PPO/GRPO, DAPO, GSPO, IPA chunk level, TOPR) and its backends."""
from .api import available_backends, policy_loss, register_backend, step_advantages
from .config import LossConfig
from .reference import METRIC_KEYS, PackLayout, reference_policy_loss
from .types import LossInputs, LossOutput

__all__ = [
    "LossConfig", "LossInputs", "LossOutput", "METRIC_KEYS", "PackLayout", "available_backends",
    "policy_loss", "reference_policy_loss", "register_backend", "step_advantages",
]

# Kernel backends register themselves on import (each reports whether it can run here).
import importlib as _importlib

for _mod in ("cpu_backend", "triton_backend", "cuda_backend"):
    try:
        _importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:  # backend not written yet; any other import error is a bug
        if _e.name != f"{__name__}.{_mod}":
            raise

"""arl: agentic reinforcement learning for LLMs with fused chunk-level policy-loss kernels."""
from .ops.policy_loss import LossConfig, LossOutput, available_backends, policy_loss
from .algo import advantages as _estimators  # noqa: F401  the built-in estimators, which a config's algo.advantage names

__version__ = "0.1.0"
__all__ = ["LossConfig", "LossOutput", "available_backends", "policy_loss", "__version__"]

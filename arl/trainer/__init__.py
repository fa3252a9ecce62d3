"""Trainer side: process groups, the DeepSpeed policy trainer (RL and SFT steps)."""
from .policy import PolicyTrainer, deepspeed_config, lr_lambda

__all__ = ["PolicyTrainer", "deepspeed_config", "lr_lambda"]

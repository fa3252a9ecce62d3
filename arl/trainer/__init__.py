"""Trainer side: the DeepSpeed policy trainer (RL and SFT steps), the trainer rank process, its
collectives and its link to the rollout processes."""
from .policy import PolicyTrainer, deepspeed_config, lr_lambda

__all__ = ["PolicyTrainer", "deepspeed_config", "lr_lambda"]

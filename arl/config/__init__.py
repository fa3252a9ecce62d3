"""The one config schema (``TrainConfig`` and its sections) and its loader."""
from .algo import AlgoConfig, check_algo
from .critic import CriticConfig
from .ray import NodeGroup, RayConfig
from .load import BUILTIN_DEFAULT, ConfigError, dump_config, load_config
from .schema import (EVAL_SEED_BASE, WANDB_PIN, ArchConfig, DatasetConfig, EnvConfig, LayoutConfig, LoggingConfig, LoRAConfig,
                     ModelConfig, OffloadConfig, OptimConfig, RolloutConfig, SFTConfig, TinyModelConfig, TrainConfig,
                     TrainerConfig, WandbConfig)
from .stabilizers import (AdaptiveKLConfig, AlarmRule, CurriculumConfig, DynamicSamplingConfig, EntropyScheduleConfig,
                          ExtremeTrajectoryConfig, IPAResampleConfig, MonitorConfig, ShapingConfig, StabilizerConfig,
                          StallConfig, TurnCreditConfig, check_turn_credit_loss)

__all__ = [
    "EVAL_SEED_BASE", "WANDB_PIN", "AdaptiveKLConfig", "AlgoConfig", "AlarmRule", "ArchConfig", "BUILTIN_DEFAULT", "ConfigError",
    "CriticConfig", "CurriculumConfig", "DatasetConfig", "DynamicSamplingConfig", "EntropyScheduleConfig",
    "EnvConfig", "ExtremeTrajectoryConfig", "IPAResampleConfig", "LayoutConfig", "LoggingConfig", "LoRAConfig",
    "ModelConfig", "NodeGroup", "RayConfig", "OffloadConfig", "MonitorConfig", "OptimConfig", "RolloutConfig", "SFTConfig", "ShapingConfig",
    "StabilizerConfig", "StallConfig", "TinyModelConfig", "TrainConfig", "TrainerConfig", "TurnCreditConfig",
    "WandbConfig", "check_algo", "check_turn_credit_loss", "dump_config", "load_config",
]

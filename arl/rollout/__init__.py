"""Rollouts: engine interface (vLLM backend), token-in/token-out episodes, async manager."""
from .engine import ENGINES, RolloutEngine, Sample, SamplingConfig, VLLMEngine, make_engine, register_engine, write_sync_weights
from .episode import ChatFormat, Episode, EpisodeConfig, run_episode
from .manager import RolloutBatch, RolloutConfig, RolloutManager, placeholder

__all__ = ["ENGINES", "ChatFormat", "Episode", "EpisodeConfig", "RolloutBatch", "RolloutConfig", "RolloutEngine",
           "RolloutManager", "Sample", "SamplingConfig", "VLLMEngine", "make_engine", "placeholder",
           "register_engine", "run_episode", "write_sync_weights"]

"""Rollouts: engine interface (vLLM backend), token-in/token-out episodes, the async manager, the
weight-sync receivers and the rollout process (``worker``)."""
from .engine import ENGINES, RolloutEngine, Sample, SamplingConfig, VLLMEngine, make_engine, register_engine, write_sync_weights
from .episode import ChatFormat, Episode, EpisodeConfig, run_episode
from .manager import RolloutManager, fill_batch

__all__ = ["ENGINES", "ChatFormat", "Episode", "EpisodeConfig", "RolloutEngine", "RolloutManager", "Sample",
           "SamplingConfig", "VLLMEngine", "fill_batch", "make_engine", "register_engine", "run_episode",
           "write_sync_weights"]

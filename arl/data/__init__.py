"""Trajectory data model shared by rollouts, the packer and the trainer."""
from .packer import MicroBatch, PackedStep, PackerConfig, attn_coef_for, estimated_compute, pack_step, step_normalizer
from .partition import fill_bins, karmarkar_karp
from .trajectory import Trajectory, TrajectoryStatus, load_trajectories, save_trajectories

__all__ = [
    "MicroBatch", "PackedStep", "PackerConfig", "Trajectory", "TrajectoryStatus", "attn_coef_for",
    "estimated_compute", "fill_bins", "karmarkar_karp", "load_trajectories", "pack_step",
    "save_trajectories", "step_normalizer",
]

"""Trajectory data model shared by rollouts, the packer and the trainer; tasks from data files."""
from .packer import MicroBatch, PackedStep, PackerConfig, attn_coef_for, estimated_compute, pack_step, step_normalizer
from .partition import fill_bins, karmarkar_karp
from .tasks import EVAL_SEED_BASE, Rows, TaskSet, load_demonstrations, read_tasks
from .trajectory import Trajectory, TrajectoryStatus, load_trajectories, save_trajectories

__all__ = [
    "EVAL_SEED_BASE", "MicroBatch", "PackedStep", "PackerConfig", "Rows", "TaskSet", "Trajectory", "TrajectoryStatus",
    "attn_coef_for", "estimated_compute", "fill_bins", "karmarkar_karp", "load_demonstrations", "load_trajectories",
    "pack_step", "read_tasks", "save_trajectories", "step_normalizer",
]

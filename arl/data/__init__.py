"""Trajectory data model shared by rollouts, the packer and the trainer."""
from .trajectory import Trajectory, TrajectoryStatus

__all__ = ["Trajectory", "TrajectoryStatus"]

"""Training metrics: trajectory statistics, the per-step logger (JSONL, TensorBoard, progress bar)
and the curves plot (``python -m arl.plot RUN_DIR``)."""
from .trajectory_stats import (advantage_stats, per_turn_mean, per_turn_sums, success_logprob_mean,
                               success_logprob_sums, trajectory_metrics, turn_means)

__all__ = ["trajectory_metrics", "advantage_stats", "per_turn_sums", "per_turn_mean", "turn_means",
           "success_logprob_sums", "success_logprob_mean", "MetricsLogger"]


def __getattr__(name):  # the logger pulls in TensorBoard: import it only when asked for
    if name == "MetricsLogger":
        from .logger import MetricsLogger
        return MetricsLogger
    raise AttributeError(name)

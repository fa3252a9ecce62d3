"""Training metrics: trajectory statistics, the per-step logger (JSONL, TensorBoard, progress bar)
and the curves plot (``python -m arl.plot RUN_DIR``).

One step of the RL loop, on rank 0 (key names are what the plot and the progress bar look for)::

    m = trajectory_metrics(batch.trajectories, tokenizer, current_version=version, rollout_s=t_rollout)
    m.update(batch.metrics)                                  # the rollout manager's rollout/* counters
    m.update({f"train/{k}": v for k, v in rl_out.items()})   # clip_frac, approx_kl, kl_mean, grad_norm ...
    m.update(turn_means(ent_sums, ent_counts))                # entropy/turn_k (all-reduced per_turn_sums)
    m.update(success_logprob_mean(logps, chunk_ids, cu_seqlens, success))   # logp/success_mean
    m["success/heldout"] = success_rate(eval_trajectories)    # when an evaluation ran this step
    m["train/tokens_per_s"] = step_tokens / t_train
    logger.log(step, m, wall_s=time.time() - t_start)
"""
from .trajectory_stats import (advantage_stats, per_turn_mean, per_turn_sums, rollout_rates, success_logprob_mean,
                               success_logprob_sums, success_rate, trajectory_metrics, turn_means)

__all__ = ["trajectory_metrics", "rollout_rates", "success_rate", "advantage_stats", "per_turn_sums", "per_turn_mean", "turn_means",
           "success_logprob_sums", "success_logprob_mean", "MetricsLogger"]


def __getattr__(name):  # the logger pulls in TensorBoard: import it only when asked for
    if name == "MetricsLogger":
        from .logger import MetricsLogger
        return MetricsLogger
    raise AttributeError(name)

"""Training metrics: trajectory statistics and the per-step logger (JSONL, TensorBoard, progress
bar); the curves are drawn by ``python -m arl.plot RUN_DIR``.

One step of the RL loop, on rank 0 (key names are what the plot and the progress bar look for)::

    m = trajectory_metrics(batch.trajectories, tokenizer, rollout_s=t_rollout)
    m.update(batch.metrics)                                  # the rollout manager's rollout/* counters
    m.update(prepared.metrics)                               # the step's advantages (adv/*), stabilizers
    m.update({f"train/{k}": v for k, v in rl_out.items()})   # clip_frac, approx_kl, kl_mean, grad_norm ...
    m.update(turn_means(ent_sums, ent_counts))                # entropy/turn_k (all-reduced per_turn_sums)
    m.update(success_logprob_mean(logps, chunk_ids, cu_seqlens, success))   # logp/success_mean
    m["success/heldout"] = success_rate(eval_trajectories)    # when an evaluation ran this step
    m["train/tokens_per_s"] = step_tokens / t_train
    logger.log(step, m, wall_s=time.time() - t_start)
"""
from .logger import MetricsLogger
from .trajectory_stats import (per_turn_mean, per_turn_sums, rollout_rates, success_logprob_mean, success_logprob_sums,
                               success_rate, trajectory_metrics, turn_means)

__all__ = ["trajectory_metrics", "rollout_rates", "success_rate", "per_turn_sums", "per_turn_mean", "turn_means",
           "success_logprob_sums", "success_logprob_mean", "MetricsLogger"]


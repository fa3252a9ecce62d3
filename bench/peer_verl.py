"""verl's policy losses (``verl.trainer.ppo.core_algos``) against arl's C++ op on one batch.

The batch is bench_policy_loss's packed agentic batch (512 trajectories in groups of 8, 8 model
turns each separated by observations), given to each in its native layout: arl packed ``[T]`` with
``chunk_ids`` (-1 = prompt/observation), verl padded ``[N, L]`` responses (a response starts at the
first model token) with ``response_mask`` 0 on observation and padding tokens.  Both get the same
per-trajectory advantages (arl's ``group_advantages``, broadcast to verl's tokens; verl's own
``compute_grpo_outcome_advantage`` is checked to give the same values), so the timed calls compare
the loss math alone.

Semantics, where they agree and where they do not:
* vanilla (PPO/GRPO, token ratio, DAPO clip-higher, dual-clip c=3): verl's ``vanilla`` and arl's
  ``ratio_level=token, dual_clip=3`` are the same function (log-ratio clamped to +-20, then
  ``max(-A r, -A clip(r))``, then ``min(., -c A)`` for A < 0), aggregated ``token-mean``.
* GSPO: verl's ``gspo`` computes ``exp(sg[mean_seq(d)] + logp - sg[logp])`` per token (value: the
  sequence ratio; gradient: ratio * dlogp_t), arl's ``ratio_level=sequence`` the sequence ratio
  with the gradient through the mean (ratio / n_s per token, summed over the sequence's n_s tokens
  by ``seq-mean-token-mean``): the same loss and gradient under ``seq-mean-token-mean``.  verl
  clamps that log-ratio at +10 only, arl at +-20 (neither binds here).  verl's GSPO has no
  dual-clip; arl applies ``dual_clip`` at every ratio level, so arl GSPO with ``dual_clip=3``
  differs from verl's wherever A < 0 and the sequence ratio exceeds 3 (measured below as
  ``gspo_dual_clip``: the fraction of tokens it changes and the loss difference).
* Aggregation names are shared (token-mean, seq-mean-token-mean, seq-mean-token-sum,
  seq-mean-token-sum-norm) except verl's ``token-sum`` (arl: none); ``seq-mean-token-sum-norm``
  divides by verl's padded response length (``loss_mask.shape[-1]``) by default, by arl's longest
  trained-token count (or ``agg_constant``).
* Masks: verl masks by ``response_mask`` on a padded tensor (the prompt is not in it); arl by
  ``chunk_ids < 0`` on the packed tensor, whose chunk ids also carry the turn structure for
  chunk-level ratios and discounts (verl has no chunk level).
"""
from __future__ import annotations

import statistics
import time

import torch

from arl import LossConfig, policy_loss
from arl.algo.advantages import group_advantages
from arl.ops.policy_loss import PackLayout

CLIP_LOW, CLIP_HIGH, DUAL_C = 0.2, 0.28, 3.0
GSPO_LOW, GSPO_HIGH = 3e-4, 4e-4  # the GSPO paper's clip range (verl's GSPO example uses the same)

ARL_CONFIGS = {
    "vanilla": LossConfig(ratio_level="token", clip_low=CLIP_LOW, clip_high=CLIP_HIGH, dual_clip=DUAL_C,
                          loss_agg="token-mean", validate_inputs=False),
    "gspo": LossConfig(ratio_level="sequence", clip_low=GSPO_LOW, clip_high=GSPO_HIGH,
                       loss_agg="seq-mean-token-mean", validate_inputs=False),
    "gspo_dual_clip": LossConfig(ratio_level="sequence", clip_low=GSPO_LOW, clip_high=GSPO_HIGH, dual_clip=DUAL_C,
                                 loss_agg="seq-mean-token-mean", validate_inputs=False),
}
VERL_MODES = {"vanilla": ("vanilla", "token-mean", CLIP_LOW, CLIP_HIGH),
              "gspo": ("gspo", "seq-mean-token-mean", GSPO_LOW, GSPO_HIGH)}


def verl_config(low: float, high: float):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=8, clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high,
                       clip_ratio_c=DUAL_C, ppo_micro_batch_size_per_gpu=1)


def spread_batch(b: dict, noise: float, seed: int = 1) -> dict:
    """The batch with the current logprobs ``noise`` away from the old ones (so clipping, the
    dual-clip and whole-sequence ratios all bind somewhere)."""
    g = torch.Generator().manual_seed(seed)
    cu = b["cu_seqlens"].long()
    n = cu.numel() - 1
    # a few whole sequences far off-policy (log-ratio +1.2: ratio 3.3), for the sequence level
    shift = torch.where(torch.rand(n, generator=g) < 0.05, 1.2, 0.0) + torch.randn(n, generator=g) * 0.05
    out = dict(b)
    out["logp"] = (b["old_logp"] + torch.randn(b["old_logp"].shape, generator=g) * noise
                   + torch.repeat_interleave(shift, cu[1:] - cu[:-1]))
    return out


def padded_layout(b: dict):
    """verl's layout of the packed batch: ``index [N, L]`` into the pack (-1 = padding) and
    ``mask [N, L]`` (1 on model tokens); a response starts at its sequence's first model token."""
    cu, chunk = b["cu_seqlens"].long(), b["chunk_ids"]
    N = cu.numel() - 1
    starts = []
    for s in range(N):
        tr = (chunk[cu[s]:cu[s + 1]] >= 0).nonzero()
        starts.append(int(cu[s]) + (int(tr[0]) if tr.numel() else int(cu[s + 1] - cu[s])))
    lens = [int(cu[s + 1]) - starts[s] for s in range(N)]
    L = max(lens)
    index = torch.full((N, L), -1, dtype=torch.long)
    for s in range(N):
        index[s, :lens[s]] = torch.arange(starts[s], starts[s] + lens[s])
    valid = index >= 0
    mask = torch.zeros(N, L)
    mask[valid] = (chunk[index[valid]] >= 0).float()
    return index, mask


def to_padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(index.shape, dtype=x.dtype)
    v = index >= 0
    out[v] = x[index[v]]
    return out


def verl_inputs(b: dict, adv_seq: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> dict:
    return {"old_log_prob": to_padded(b["old_logp"], index), "log_prob": to_padded(b["logp"], index),
            "advantages": adv_seq[:, None].expand(index.shape).contiguous() * mask, "response_mask": mask}


def verl_fn(mode: str):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    name, agg, low, high = VERL_MODES[mode]
    fn, cfg = get_policy_loss_fn(name), verl_config(low, high)

    def run(logp, v):
        loss, _ = fn(v["old_log_prob"], logp, v["advantages"], v["response_mask"], loss_agg_mode=agg, config=cfg)
        return loss
    return run


def arl_fn(cfg: LossConfig):
    def run(logp, b):
        return policy_loss(logp, b["old_logp"], advantages=b["advantages"], cu_seqlens=b["cu_seqlens"],
                           chunk_ids=b["chunk_ids"], config=cfg, backend="cpu").loss
    return run


def fwd_bwd(fn, base, inputs):
    logp = base.detach().clone().requires_grad_(True)
    loss = fn(logp, inputs)
    loss.backward()
    return loss.detach(), logp.grad


def median_s(fn, base, inputs, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fwd_bwd(fn, base, inputs)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fwd_bwd(fn, base, inputs)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def verl_advantages_agree(b: dict, adv_seq: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> float:
    """max |verl's GRPO outcome advantage - arl's group_advantages| over the model tokens."""
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.zeros(mask.shape)
    last = (mask * torch.arange(mask.shape[1])).argmax(1)
    scores[torch.arange(mask.shape[0]), last] = b["rewards"]
    adv, _ = compute_grpo_outcome_advantage(scores, mask, np.asarray(b["group_ids"].tolist()), epsilon=1e-6)
    return float(((adv - adv_seq[:, None] * mask).abs() * mask).max())


def both_inputs(b: dict):
    """(arl's inputs, verl's inputs, index, mask, layout) of the batch ``b``, same advantages."""
    adv_seq = torch.from_numpy(group_advantages(b["rewards"], b["group_ids"], "grpo", 1e-6)[0]).to(b["rewards"].dtype)
    index, mask = padded_layout(b)
    lay = PackLayout(b["cu_seqlens"], b["chunk_ids"], b["rewards"].numel())
    return {**b, "advantages": adv_seq}, verl_inputs(b, adv_seq, index, mask), index, mask, lay


def agreement(b: dict, mode: str, inputs=None) -> dict:
    """verl's and arl's loss and gradient (on every model token, and zero elsewhere) for ``mode``."""
    arl_in, v_in, index, mask, _ = inputs or both_inputs(b)
    v_loss, v_grad = fwd_bwd(verl_fn(mode), v_in["log_prob"], v_in)
    a_loss, a_grad = fwd_bwd(arl_fn(ARL_CONFIGS[mode]), b["logp"], arl_in)
    a_grad_padded = to_padded(a_grad, index) * mask
    scale = float(v_grad.abs().max())
    row = {
        "verl_loss": float(v_loss), "arl_loss": float(a_loss),
        "loss_rel_diff": abs(float(a_loss) - float(v_loss)) / max(abs(float(v_loss)), 1e-30),
        "grad_max_abs_diff": float((a_grad_padded - v_grad * mask).abs().max()),
        "grad_max_abs": scale,
        "grad_off_mask_max_abs": {"verl": float((v_grad * (1 - mask)).abs().max()),
                                  "arl": float(a_grad[b["chunk_ids"] < 0].abs().max())},
    }
    row["grad_rel_diff"] = row["grad_max_abs_diff"] / max(scale, 1e-30)
    return row


def compare(b: dict, repeats: int, peak_fn) -> dict:
    """Time, peak extra memory and agreement of verl vs arl for every mode on the batch ``b``."""
    inputs = both_inputs(b)
    arl_in, v_in, index, mask, lay = inputs
    adv_seq = arl_in["advantages"]
    out = {"tokens": int(b["logp"].numel()), "trained_tokens": int(lay.tidx.numel()),
           "verl_padded_shape": list(index.shape), "verl_mask_tokens": int(mask.sum()),
           "advantage_max_abs_diff_vs_verl_grpo": verl_advantages_agree(b, adv_seq, index, mask)}
    for mode in VERL_MODES:
        vf, af = verl_fn(mode), arl_fn(ARL_CONFIGS[mode])
        row = agreement(b, mode, inputs)
        # interleaved repeats: load from other processes hits both alike
        tv, ta = [], []
        for _ in range(2):
            tv.append(median_s(vf, v_in["log_prob"], v_in, warmup=1, repeats=repeats))
            ta.append(median_s(af, b["logp"], arl_in, warmup=1, repeats=repeats * 5))
        row["verl_ms"], row["arl_ms"] = round(1e3 * min(tv), 3), round(1e3 * min(ta), 3)
        row["speedup_arl_vs_verl"] = round(row["verl_ms"] / row["arl_ms"], 2)
        row["verl_peak_extra_mb"] = round(peak_fn(vf, v_in["log_prob"], v_in) / 2**20, 2)
        row["arl_peak_extra_mb"] = round(peak_fn(af, b["logp"], arl_in) / 2**20, 2)
        out[mode] = row
    # arl's dual-clip at the sequence level: what verl's GSPO leaves out
    a_loss, _ = fwd_bwd(arl_fn(ARL_CONFIGS["gspo_dual_clip"]), b["logp"], arl_in)
    seq_r = torch.exp(lay.segment_mean(b["logp"][lay.tidx] - b["old_logp"][lay.tidx], "sequence"))
    A = adv_seq[lay.seq_of_tok[lay.tidx]]
    out["gspo_dual_clip"] = {
        "tokens_changed_frac": float(((A < 0) & (seq_r.clamp(1 - GSPO_LOW, None) > DUAL_C)).float().mean()),
        "arl_loss_with_dual_clip": float(a_loss), "verl_gspo_loss": out["gspo"]["verl_loss"],
        "loss_rel_diff": abs(float(a_loss) - out["gspo"]["verl_loss"]) / max(abs(out["gspo"]["verl_loss"]), 1e-30),
    }
    return out

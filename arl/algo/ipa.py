"""IPA chunk initialization resampling (arXiv 2512.24873), the loss side: imitate the expert prefix,
reinforce the resampled continuation.

A rollout that started from chunk k of an expert trajectory carries ``metadata["ipa_prefix_chunks"] = k``
(and ``ipa_imitate``; which k, and the start states, are the rollout side's: arl/stabilizers/ipa.py).
Chunks < k are *prefix* (imitation), chunks >= k *resampled* (RL).  This module turns the tags into
each micro-batch's loss roles and computes the mixed loss:

``lambda_il * NLL(prefix chunk tokens of imitating sequences) / il_normalizer
 + lambda_rl * policy_loss(resampled chunks only, normalizer=rl_normalizer)``; both normalizers are
step-global (``ipa_normalizers``), like every loss term in arl.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..data.packer import step_normalizer
from ..data.trajectory import Trajectory, TrajectoryStatus
from ..ops.policy_loss import policy_loss
from ..ops.policy_loss.config import LossConfig


def _prefix_chunks(t: Trajectory) -> int:
    return int(t.metadata.get("ipa_prefix_chunks", 0))


def ipa_normalizers(trajs: Sequence[Trajectory], loss_cfg: LossConfig):
    """``(il_normalizer, rl_normalizer)`` over the whole step: imitated prefix tokens, and the
    ``loss_agg`` denominator of the resampled (chunk >= k) tokens.  Same trajectory list as packed."""
    il, rl = 0, []
    for t in trajs:
        if t.status is TrajectoryStatus.FILTERED:
            continue
        if t.status is TrajectoryStatus.MASKED:
            rl.append(0)
            continue
        k = _prefix_chunks(t)
        c = t.chunk_ids
        if t.metadata.get("ipa_imitate", False):
            il += int(((c >= 0) & (c < k)).sum())
        rl.append(int((c >= k).sum()))
    return float(max(il, 1)), step_normalizer(rl, loss_cfg)


def split_chunk_roles(mb, trajs: Sequence[Trajectory]):
    """``(il_mask [T] bool, rl_chunk_ids [T] int32)`` of a packed micro-batch: tokens of prefix chunks
    of imitating sequences, and the chunk ids with every prefix chunk set to -1 (ids made dense)."""
    cu = mb.cu_seqlens.tolist()
    trained = (mb.chunk_ids >= 0).numpy()
    prefix = np.zeros(mb.num_tokens, dtype=bool)
    il = np.zeros(mb.num_tokens, dtype=bool)
    for j, i in enumerate(mb.traj_indices.tolist()):
        t = trajs[i]
        a, b = cu[j], cu[j + 1]
        k = _prefix_chunks(t)
        local = t.chunk_ids[: b - a]
        p = trained[a:b] & (local < k)
        prefix[a:b] = p
        if t.metadata.get("ipa_imitate", False):
            il[a:b] = p
    rl = mb.chunk_ids.numpy().astype(np.int64).copy()
    rl[prefix] = -1
    keep = rl >= 0
    if keep.any():
        _, dense = np.unique(rl[keep], return_inverse=True)
        rl[keep] = dense
    return torch.from_numpy(il), torch.from_numpy(rl.astype(np.int32))


def ipa_mixed_loss(logp: torch.Tensor, old_logp: torch.Tensor, *, mb, il_mask: torch.Tensor,
                   rl_chunk_ids: torch.Tensor, loss_cfg: LossConfig, il_normalizer: float, rl_normalizer: float,
                   lambda_il: float = 1.0, lambda_rl: float = 1.0, advantages: Optional[torch.Tensor] = None,
                   entropy: Optional[torch.Tensor] = None, ref_logp: Optional[torch.Tensor] = None,
                   backend: str = "reference"):
    """``(loss, metrics)``: lambda_il * imitation NLL + lambda_rl * chunk-level RL loss (see module doc)."""
    if il_mask.shape != logp.shape or rl_chunk_ids.shape != logp.shape:
        raise ValueError(f"il_mask/rl_chunk_ids: shapes {tuple(il_mask.shape)}/{tuple(rl_chunk_ids.shape)} "
                         f"do not match logp {tuple(logp.shape)}")
    if not (il_normalizer > 0 and rl_normalizer > 0):
        raise ValueError(f"il_normalizer/rl_normalizer: must be > 0, got {il_normalizer}/{rl_normalizer}")
    m = il_mask.to(logp.device)
    nll = -(logp * m.to(logp.dtype)).sum() / il_normalizer
    kw = mb.loss_kwargs()
    mb_adv = kw.pop("advantages")  # the micro-batch's, unless the caller passes its own
    advantages = advantages if advantages is not None else mb_adv
    kw.update(chunk_ids=rl_chunk_ids.to(logp.device), normalizer=rl_normalizer)
    kw = {k: (v.to(logp.device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    has_rl = bool((rl_chunk_ids >= 0).any())
    if has_rl:
        rl = policy_loss(logp, old_logp, config=loss_cfg, advantages=advantages, entropy=entropy, ref_logp=ref_logp,
                         backend=backend, **kw)
        rl_loss, metrics = rl.loss, dict(rl.metrics)
    else:
        rl_loss, metrics = logp.sum() * 0.0, {}
    loss = lambda_il * nll + lambda_rl * rl_loss
    n_il = int(m.sum())
    metrics.update({"ipa/il_nll": float(nll.detach()) * il_normalizer / max(n_il, 1), "ipa/il_tokens": n_il,
                    "ipa/rl_loss": float(rl_loss.detach()), "ipa/rl_tokens": int((rl_chunk_ids >= 0).sum())})
    return loss, metrics

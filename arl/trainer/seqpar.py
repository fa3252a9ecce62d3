"""``trainer.sequence_parallel``: the trainer ranks in groups of N consecutive ranks, each group one
data-parallel replica that splits every micro-batch along the sequence (Ulysses:
arl/model/ulysses.py).  The packer plans micro-batches for world / N replicas; every rank of a group
gets its replica's micro-batches, runs its 1/N of the tokens through the model, and the loss sees
the whole batch's logprobs, so it is the same on every rank of the group.

Gradients need no new collective: each rank's backward yields its tokens' share of the micro-batch
gradient, and the trainer's usual scaling (loss x world, DeepSpeed's mean over the world) sums the
shares of a group and the replicas alike.  Only the step's logged sums count each micro-batch once
per replica (``dp``), not once per rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..model.ulysses import check_heads, plan_shard, sp_logprobs
from .dist import rank, world_size


class SequenceParallel:
    def __init__(self, size: int, model_config=None):
        world, me = world_size(), rank()
        if size < 1 or world % size:
            raise ValueError(f"trainer.sequence_parallel: {size} must divide trainer.world_size ({world})")
        if size > 1 and model_config is not None:
            check_heads(model_config, size)
        self.size, self.dp, self.rank, self.group = size, world // size, me % size, None
        if size > 1:  # every rank creates every group, in the same order (torch.distributed's rule)
            for g in range(self.dp):
                grp = dist.new_group(list(range(g * size, (g + 1) * size)))
                if me // size == g:
                    self.group = grp

    @property
    def on(self) -> bool:
        return self.size > 1

    def replica_parts(self, parts: list) -> list:
        """Per rank, its replica's micro-batches, from the packer's per-replica lists."""
        return [parts[r // self.size] for r in range(len(parts) * self.size)]

    def logprobs(self, model, mb, device: torch.device, temperature: float, with_entropy: bool,
                 return_hidden: bool = False):
        """The micro-batch's whole [T] logprobs (and entropies); with ``return_hidden`` also this rank's
        hidden rows (``ShardRows``: the critic reads its value points through them)."""
        shard = plan_shard(mb.cu_seqlens, self.size, self.rank, self.group)
        return sp_logprobs(model, mb.token_ids.to(device), mb.cu_seqlens.to(device), shard, temperature=temperature,
                           with_entropy=with_entropy, return_hidden=return_hidden)

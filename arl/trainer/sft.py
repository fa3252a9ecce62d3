"""The SFT warm start: NLL on demonstrations, packed like the RL batches, before RL begins."""
from __future__ import annotations

import random
from typing import Optional, Tuple

from ..config import OptimConfig, TrainConfig
from ..data.packer import PackerConfig, pack_step
from .models import dtype_of
from .policy import PolicyTrainer


def run_sft(cfg: TrainConfig, model, demos: list, rank: int, world: int) -> Tuple[dict, Optional[dict]]:
    """SFT of ``model`` in place on ``demos`` (trajectories); returns the last step's metrics and,
    under ZeRO-3 (whose engine leaves ``model``'s parameters partitioned), the gathered state dict on
    every rank."""
    s = cfg.sft
    optim = OptimConfig(lr=s.lr, grad_clip=cfg.trainer.optim.grad_clip)
    tr = PolicyTrainer(model, optim=optim, zero_stage=cfg.trainer.zero_stage, total_steps=max(s.steps, 1),
                       dtype=dtype_of(cfg), attn=cfg.model.attn_implementation)
    rng = random.Random(cfg.seed)
    per_step = max(world, min(len(demos), s.batch_size))
    last = {}
    for step in range(s.steps):
        batch = rng.sample(demos, per_step) if len(demos) >= per_step else demos
        packed = pack_step(batch, PackerConfig(token_budget=s.micro_batch_tokens, num_ranks=world, seed=step))
        last = tr.sft_step(packed.ranks[rank], normalizer=packed.normalizer)
    return last, (tr.full_state_dict(rank0_only=False) if tr.zero3 else None)

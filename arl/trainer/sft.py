"""The SFT warm start: NLL on demonstrations, packed like the RL batches, before RL begins."""
from __future__ import annotations

import random
from typing import Optional, Tuple

from ..config import OptimConfig, TrainConfig
from ..data.packer import PackerConfig, pack_step
from .models import dtype_of
from .policy import PolicyTrainer


class SFTSteps:
    """SFT of ``model`` in place on ``demos`` (trajectories), one ``step()`` at a time: the warm start
    runs ``sft.steps`` of them; continued SFT (``bench/sft_continue.py``) keeps calling ``step()``, on
    the same demonstration draws and learning rate the warm start would have gone on with."""

    def __init__(self, cfg: TrainConfig, model, demos: list, rank: int, world: int):
        s = cfg.sft
        optim = OptimConfig(lr=s.lr, grad_clip=cfg.trainer.optim.grad_clip)  # constant lr: no end to reach
        self.tr = PolicyTrainer(model, optim=optim, zero_stage=cfg.trainer.zero_stage, total_steps=max(s.steps, 1),
                                dtype=dtype_of(cfg), attn=cfg.model.attn_implementation, offload=cfg.trainer.offload)
        self.cfg, self.demos, self.rank, self.world = cfg, demos, rank, world
        self.rng = random.Random(cfg.seed)
        self.per_step = max(world, min(len(demos), s.batch_size))
        self.done = 0  # steps taken

    def step(self) -> dict:
        demos, n = self.demos, self.per_step
        batch = self.rng.sample(demos, n) if len(demos) >= n else demos
        packed = pack_step(batch, PackerConfig(token_budget=self.cfg.sft.micro_batch_tokens, num_ranks=self.world,
                                               seed=self.done))
        self.done += 1
        return self.tr.sft_step(packed.ranks[self.rank], normalizer=packed.normalizer)


def run_sft(cfg: TrainConfig, model, demos: list, rank: int, world: int) -> Tuple[dict, Optional[dict]]:
    """SFT of ``model`` in place on ``demos`` (trajectories); returns the last step's metrics and,
    under ZeRO-3 (whose engine leaves ``model``'s parameters partitioned), the gathered state dict on
    every rank."""
    run = SFTSteps(cfg, model, demos, rank, world)
    last = {}
    for _ in range(cfg.sft.steps):
        last = run.step()
    state = run.tr.full_state_dict(rank0_only=False) if run.tr.zero3 else None
    # RL builds its own engine over the same parameters: this one's ZeRO gradient hooks would go on
    # firing in every RL backward, copying each gradient into its reduce bucket, never flushed (its
    # 5e8-element buffer held, and a full bucket's flush finds the gradients RL's step cleared)
    run.tr.engine.destroy()
    return last, state

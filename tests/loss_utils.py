"""Shared generators of packed policy-loss batches for the reference and kernel tests."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from arl import LossConfig
from arl.algo.advantages import group_advantages
from arl.ops.policy_loss.spec import KL_ESTIMATORS, SURROGATES

ADV_EPS = 1e-6  # the estimators' eps (algo.advantage's default)


@dataclass
class Batch:
    logp: torch.Tensor
    old_logp: torch.Tensor
    rollout_logp: torch.Tensor
    ref_logp: torch.Tensor
    entropy: torch.Tensor
    advantages: torch.Tensor  # [N] float64, the estimator's (arl.algo.advantages), as the trainer passes them
    cu_seqlens: torch.Tensor
    chunk_ids: torch.Tensor

    def kwargs(self, with_optional: bool = True) -> dict:
        kw = dict(advantages=self.advantages, cu_seqlens=self.cu_seqlens, chunk_ids=self.chunk_ids)
        if with_optional:
            kw.update(rollout_logp=self.rollout_logp, ref_logp=self.ref_logp, entropy=self.entropy)
        return kw

    def to(self, **kw) -> "Batch":
        """dtype applies to the token float tensors only (advantages stay float64, as the estimator
        gives them); device to all of them."""
        ints = {k: v for k, v in kw.items() if k == "device"}
        return Batch(**{k: v.to(**kw) if v.is_floating_point() and k != "advantages" else v.to(**ints)
                        for k, v in self.__dict__.items()})


def agentic_layout(lengths, gen: torch.Generator, max_chunks: int = 8, untrained_frac: float = 0.3):
    """Chunk ids for sequences of the given lengths: a prompt, then alternating model turns
    (trained, one chunk each) and observations (-1).  Ids increase over the whole pack."""
    chunk_ids = []
    next_id = 0
    for L in lengths:
        ids = torch.full((L,), -1, dtype=torch.int32)
        if L > 1 and torch.rand((), generator=gen) > 0.05:  # ~5% of sequences have no trained token
            prompt = int(torch.randint(0, max(1, L // 3), (), generator=gen))
            k = int(torch.randint(1, max_chunks + 1, (), generator=gen))
            cuts = sorted(torch.randint(prompt, L, (2 * k,), generator=gen).tolist())
            for a, b in zip(cuts[0::2], cuts[1::2]):
                if b > a:
                    ids[a:b] = next_id
                    next_id += 1
        elif L == 1 and torch.rand((), generator=gen) > 0.3:
            ids[0] = next_id
            next_id += 1
        chunk_ids.append(ids)
    return torch.cat(chunk_ids)


def make_batch(n_seq: int = 8, min_len: int = 1, max_len: int = 64, group_size: int = 4, seed: int = 0,
               max_chunks: int = 8, log_ratio_scale: float = 0.3, dtype=torch.float32,
               binary_rewards: bool = True, estimator: str = "grpo") -> Batch:
    """A random packed batch; its advantages are ``estimator``'s over binary (or normal) rewards in
    groups of ``group_size`` consecutive sequences."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n_seq,), generator=gen).tolist()
    T = sum(lengths)
    cu = torch.zeros(n_seq + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    chunk_ids = agentic_layout(lengths, gen, max_chunks=max_chunks)
    old = -torch.rand(T, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(T, generator=gen, dtype=torch.float64) * log_ratio_scale
    rollout = old + torch.randn(T, generator=gen, dtype=torch.float64) * 0.1
    ref = old + torch.randn(T, generator=gen, dtype=torch.float64) * 0.2
    entropy = torch.rand(T, generator=gen, dtype=torch.float64) * 2
    if binary_rewards:
        rewards = (torch.rand(n_seq, generator=gen) > 0.5).to(torch.float64)
    else:
        rewards = torch.randn(n_seq, generator=gen, dtype=torch.float64)
    group_ids = torch.arange(n_seq) // group_size
    adv = torch.from_numpy(group_advantages(rewards, group_ids, estimator, ADV_EPS)[0])
    return Batch(logp.to(dtype), old.to(dtype), rollout.to(dtype), ref.to(dtype), entropy.to(dtype), adv, cu, chunk_ids)


def config_grid():
    """Option combinations that matter: every ratio level x surrogate x aggregation, plus the
    mismatch, dual-clip, discount, positive-only, KL and entropy switches on top of a base."""
    out = []
    for level, sur, agg in itertools.product(
        ("token", "sequence", "chunk"), ("ppo_clip", "topr"),
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    ):
        out.append(dict(ratio_level=level, surrogate=sur, loss_agg=agg))
    extras = [
        dict(clip_high=0.28, dual_clip=3.0),
        dict(gamma=0.95),
        dict(positive_only=True),
        dict(mismatch_level="chunk", mismatch_mode="mask", mismatch_low=0.9, mismatch_high=1.1),
        dict(mismatch_level="token", mismatch_mode="truncate", mismatch_high=1.05),
        dict(mismatch_level="sequence", mismatch_mode="mask", mismatch_low=0.97, mismatch_high=1.03),
        dict(kl_beta=0.1, kl_estimator="k1"), dict(kl_beta=0.1, kl_estimator="k2"), dict(kl_beta=0.1, kl_estimator="k3"),
        dict(entropy_coef=0.01),
        dict(agg_constant=128.0, loss_agg="seq-mean-token-sum-norm"),
        dict(log_ratio_clamp=None),
    ]
    for level in ("token", "sequence", "chunk"):
        for e in extras:
            out.append(dict(ratio_level=level, **e))
    # the two production presets
    out.append(dict(ratio_level="chunk", surrogate="ppo_clip", gamma=0.95,
                    mismatch_level="chunk", mismatch_mode="mask", mismatch_low=0.8, mismatch_high=5.0))
    out.append(dict(ratio_level="token", clip_high=0.28, loss_agg="token-mean"))
    return out


def config_id(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


CONFIGS = [LossConfig(**d) for d in config_grid()]
CONFIG_IDS = [config_id(d) for d in config_grid()]


def registry_grid():
    """The grid's rows for the registered surrogates and KL estimators it does not name (a loss
    written as one torch function): every ratio level x aggregation, and a KL row per level, in
    registration order.  Kept apart from ``config_grid`` so its indices stay put."""
    out = []
    for sur in (s for s in SURROGATES if s not in ("ppo_clip", "topr")):
        for level, agg in itertools.product(("token", "sequence", "chunk"), (
                "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")):
            out.append(dict(ratio_level=level, surrogate=sur, loss_agg=agg))
        out.append(dict(ratio_level="chunk", surrogate=sur, gamma=0.95, mismatch_level="chunk", mismatch_high=5.0,
                        kl_beta=0.1, entropy_coef=0.01, clip_high=0.28))
    for est in (k for k in KL_ESTIMATORS if k not in ("k1", "k2", "k3")):
        for level in ("token", "sequence", "chunk"):
            out.append(dict(ratio_level=level, kl_beta=0.1, kl_estimator=est))
    return out


# every registered option: the conformance suite runs each backend on the ones it declares
ALL_CONFIGS = CONFIGS + [LossConfig(**d) for d in registry_grid()]
ALL_CONFIG_IDS = CONFIG_IDS + [config_id(d) for d in registry_grid()]


UNTRAINED_INSIDE_D = (0.1, -0.05, 3.0, 0.04, 0.3, 0.0, 0.2, -0.1)  # logp - old_logp per token


def untrained_inside_chunk_batch(dtype=torch.float32) -> Batch:
    """Two sequences, chunk ids [0, 0, -1, 0, 1] and [-1, 2, 2], advantages (1, -0.5): an untrained
    token (index 2) inside chunk 0, with logprobs, rollout, reference and entropy far from its
    neighbours' (they must not reach the loss)."""
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7, -1.0, -0.3, -2.5], dtype=torch.float64)
    logp = old + torch.tensor(UNTRAINED_INSIDE_D, dtype=torch.float64)
    rollout = old - 0.01 * torch.arange(1, 9, dtype=torch.float64)
    rollout[2] = old[2] - 10.0
    ref = logp - 0.1
    ref[2] = logp[2] + 5.0
    entropy = torch.tensor([0.5, 1.0, 9.0, 1.5, 2.0, 0.7, 0.3, 1.1], dtype=torch.float64)
    return Batch(logp.to(dtype), old.to(dtype), rollout.to(dtype), ref.to(dtype), entropy.to(dtype),
                 torch.tensor([1.0, -0.5], dtype=torch.float64), torch.tensor([0, 5, 8], dtype=torch.int32),
                 torch.tensor([0, 0, -1, 0, 1, -1, 2, 2], dtype=torch.int32))

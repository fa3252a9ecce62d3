"""The packer: one step's trajectories -> equal numbers of packed micro-batches per data-parallel rank.

Guarantees (tested in tests/test_packer.py):
  * no micro-batch holds more than ``token_budget`` tokens (the budget is hard);
  * every token of every packed trajectory is in exactly one micro-batch;
  * every rank gets the same number of micro-batches;
  * ranks carry near-equal estimated compute, ``sum over sequences of L + attn_coef * L**2``
    (dense layers scale with L, attention with L**2; for a standard decoder the ratio of the two is
    about L / (12 * hidden_size), hence the default ``attn_coef = 1 / (12 * 4096)``), split with
    Karmarkar-Karp (largest differencing);
  * the same input and seed give the same micro-batches.

How: trajectories are grouped into *units*: a whole GRPO group when ``keep_groups`` and the group
fits in the budget, otherwise single trajectories.  Units are split across ranks by Karmarkar-Karp
on estimated compute; each rank then fills the smallest common number ``m`` of micro-batches best-fit
in decreasing length, so long trajectories share micro-batches with long ones (length buckets:
micro-batch j of every rank holds similar lengths, which keeps lock-stepped ranks in step).  A rank
holding fewer units than ``m`` gets empty micro-batches (``is_empty``): the trainer still runs its
collectives for them (for ZeRO-3, a forward on any dummy token with the loss multiplied by 0) but must
not call ``policy_loss`` on them.

Too-long trajectories (``overlong``): ``"error"`` (default) raises one ValueError naming the
trajectory and both lengths; ``"truncate"`` keeps its first ``token_budget`` tokens (the tail is
not trained; its index is listed in ``PackedStep.truncated``).  Trajectories with status FILTERED were
dropped by the rollout filter and are skipped (``PackedStep.skipped``); MASKED placeholders are packed
(they keep the batch size) with every chunk id forced to -1, so they add nothing to the normalizer.

Shared prefixes (``share_prefix``): the sequences of a micro-batch that share a token prefix (a
group's prompt, the batch-wide system + tools block) get a ``tree`` (arl/data/prefix_tree.py): the
forward computes each shared prefix once.  The micro-batch's tensors keep the ordinary layout, so the
loss sees the same tokens; budget and balancing count the tokens computed (a group's own sharing;
sharing across the groups of a micro-batch comes on top).  A micro-batch sharing nothing has no tree.

Loss normalizer: every micro-batch carries the step's global denominator D of ``loss_agg`` (all
ranks, all micro-batches; see arl/ops/policy_loss/spec.py), so that the sum over ranks and micro-batches of
``policy_loss(..., normalizer=mb.normalizer)`` is the whole step's loss.  With DeepSpeed, which divides
by the accumulation steps and averages over ranks, scale each micro-batch loss by GAS * world size.

Advantages: the packer computes none.  The step's advantages are computed once, over the whole step
(arl/algo/step.py, with the estimators of arl/algo/advantages.py), and given to
``pack_step(..., advantages=)``; each micro-batch then carries its sequences' values in ``advantages``,
which ``loss_kwargs`` hands to ``policy_loss`` (with ``loss.advantages_in_pass`` rank 0 adds each
micro-batch's rows of the step's group table instead: ``group_adv``, arl/algo/in_pass.py).
Group ids stay here as trajectory bookkeeping only: ``keep_groups`` (default) keeps a group together
whenever it fits in the budget, each micro-batch says so in ``complete_groups``, and
``PackedStep.split_groups`` lists the groups that did not fit.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import numpy as np
import torch
from pydantic import ConfigDict, model_validator

from ..errors import OneLineErrors, finite_vector
from ..ops.policy_loss.config import LossConfig
from .partition import fill_bins, karmarkar_karp
from .prefix_tree import MIN_SHARED, PrefixLayout, build_layout, layout_compute
from .trajectory import Trajectory, TrajectoryStatus

DEFAULT_ATTN_COEF = 1.0 / (12 * 4096)


def attn_coef_for(hidden_size: int) -> float:
    """Attention's per-token-pair cost relative to a token's dense-layer cost, ~1 / (12 hidden)."""
    return 1.0 / (12 * hidden_size)


class PackerConfig(OneLineErrors):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token_budget: int  # hard cap on tokens per micro-batch
    num_ranks: int = 1  # data-parallel ranks
    attn_coef: float = DEFAULT_ATTN_COEF  # compute(L) = L + attn_coef * L**2
    keep_groups: bool = True  # a group that fits the budget stays in one micro-batch
    overlong: Literal["error", "truncate"] = "error"
    seed: int = 0  # breaks ties between equal lengths / costs
    share_prefix: bool = False  # lay each shared token prefix out once per micro-batch (prefix_tree.py)
    min_shared: int = MIN_SHARED  # shortest prefix laid out once

    @model_validator(mode="after")
    def _check(self) -> "PackerConfig":
        if self.token_budget < 1:
            raise ValueError(f"token_budget={self.token_budget}: must be >= 1")
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks={self.num_ranks}: must be >= 1")
        if not self.attn_coef >= 0:
            raise ValueError(f"attn_coef={self.attn_coef}: must be >= 0")
        if self.min_shared < 1:
            raise ValueError(f"min_shared={self.min_shared}: must be >= 1")
        return self


@dataclass
class MicroBatch:
    """One packed micro-batch of N sequences and T tokens, ready for the packed forward and
    ``policy_loss(logp, old_logp, **mb.loss_kwargs())``."""

    token_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restart at 0 for every sequence
    cu_seqlens: torch.Tensor  # [N+1] int32
    chunk_ids: torch.Tensor  # [T] int32, -1 untrained; dense, increasing over the micro-batch
    rollout_logp: torch.Tensor  # [T] float32
    rewards: torch.Tensor  # [N] float32
    group_ids: torch.Tensor  # [N] int64
    advantages: Optional[torch.Tensor]  # [N] float64, the step's advantages of these sequences (None: not given)
    traj_indices: torch.Tensor  # [N] int64, index of each sequence in the step's trajectory list
    policy_versions: torch.Tensor  # [N] int64
    normalizer: float  # the step's global loss denominator for the configured loss_agg
    rank: int
    index: int  # position among its rank's micro-batches
    est_compute: float
    complete_groups: bool  # every group present here is entirely here
    ipa: Optional[dict] = None  # IPA resampling's loss roles (arl/algo/step.py attach_roles): il_mask, rl_chunk_ids, normalizers
    segments: Optional[dict] = None  # turn credit (arl/algo/step.py attach_roles): per-chunk loss segments, policy_loss overrides
    critic: Optional[dict] = None  # the critic (arl/algo/step.py attach_roles): value points, arl/algo/gae.py critic_points
    tree: Optional[PrefixLayout] = None  # share_prefix: the computed layout (None: ordinary packing)
    group_adv: Optional[object] = None  # loss.advantages_in_pass: GroupAdvantages of these sequences (rank 0)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())

    @property
    def computed_tokens(self) -> int:
        """Tokens the forward computes: fewer than ``num_tokens`` when prefixes are shared."""
        return self.tree.num_tokens if self.tree is not None else self.num_tokens

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def is_empty(self) -> bool:
        return self.num_seqs == 0

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.chunk_ids >= 0

    def loss_kwargs(self) -> dict:
        """Keyword arguments of ``arl.policy_loss`` that come from the batch (``advantages`` None when
        the packer was given none: the op then refuses the call)."""
        return dict(advantages=self.advantages, cu_seqlens=self.cu_seqlens, chunk_ids=self.chunk_ids,
                    rollout_logp=self.rollout_logp, normalizer=self.normalizer)

    def to(self, device) -> "MicroBatch":
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**kw)


@dataclass
class PackedStep:
    ranks: list  # ranks[r] = list of MicroBatch, the same length for every r
    normalizer: float
    loss_agg: str
    rank_compute: list  # estimated compute per rank
    rank_tokens: list
    num_tokens: int
    rank_computed_tokens: list = field(default_factory=list)  # tokens the forwards compute (share_prefix: fewer)
    split_groups: list = field(default_factory=list)  # group ids spread over several micro-batches
    truncated: list = field(default_factory=list)  # trajectory indices cut to the budget
    skipped: list = field(default_factory=list)  # FILTERED trajectory indices (not packed)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0])

    @property
    def load_max_over_mean(self) -> float:
        mean = sum(self.rank_compute) / len(self.rank_compute)
        return max(self.rank_compute) / mean if mean > 0 else 1.0

    def all_micro_batches(self) -> list:
        return [mb for rank in self.ranks for mb in rank]


def estimated_compute(lengths, attn_coef: float) -> np.ndarray:
    L = np.asarray(lengths, dtype=np.float64)
    return L + attn_coef * L * L


def step_normalizer(trained_per_seq: Sequence[int], cfg: LossConfig) -> float:
    """The whole step's denominator D of ``cfg.loss_agg`` (arl/ops/policy_loss/spec.py), from the number of
    trained tokens of every sequence.  A step with nothing to train gets 1 (every term is 0 anyway)."""
    n = np.asarray(trained_per_seq, dtype=np.int64)
    S = int((n > 0).sum())
    if cfg.loss_agg == "token-mean":
        D = float(n.sum())
    elif cfg.loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        D = float(S)
    else:  # seq-mean-token-sum-norm
        L = cfg.agg_constant if cfg.agg_constant is not None else float(n.max() if n.size else 0)
        D = S * L
    return D if D > 0 else 1.0


@dataclass
class _Seq:  # a trajectory as packed (possibly truncated, chunk ids forced to -1 if MASKED)
    index: int
    tokens: np.ndarray
    chunk_ids: np.ndarray
    rollout_logp: np.ndarray
    reward: float
    group_id: int
    version: int


def _prepare(trajectories: Sequence[Trajectory], cfg: PackerConfig):
    seqs, truncated, skipped = [], [], []
    B = cfg.token_budget
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise ValueError(f"trajectories[{i}]: expected a Trajectory, got {type(t).__name__}")
        if t.status == TrajectoryStatus.FILTERED:
            skipped.append(i)
            continue
        tok, cid, lp = t.tokens, t.chunk_ids, t.rollout_logp
        if len(t) > B:
            if cfg.overlong == "error":
                raise ValueError(
                    f"trajectories[{i}]: {len(t)} tokens exceed token_budget={B} "
                    f"(raise the budget, or overlong='truncate' keeps the first {B})"
                )
            tok, cid, lp = tok[:B], cid[:B], lp[:B]
            truncated.append(i)
        gid = int(t.group_id)
        if t.status == TrajectoryStatus.MASKED:
            # a placeholder trains nothing and must not move its group's mean/std either:
            # it becomes a group of its own (negative ids never collide with rollout groups)
            cid = np.full_like(cid, -1)
            gid = -(i + 1)
        seqs.append(_Seq(i, tok, cid, lp, float(t.reward), gid, int(t.policy_version)))
    return seqs, truncated, skipped


def _size(seqs: list, members: list, cfg: PackerConfig) -> tuple:
    """(tokens computed, estimated compute) of ``members`` in one micro-batch, and their layout
    (None: ordinary packing)."""
    sel = [seqs[k] for k in sorted(members, key=lambda k: seqs[k].index)]
    toks = [s.tokens for s in sel]
    layout = (build_layout(toks, cfg.min_shared, trained=[s.chunk_ids >= 0 for s in sel])
              if cfg.share_prefix and len(toks) > 1 else None)
    if layout is None:
        lengths = np.array([len(t) for t in toks], dtype=np.int64)
        return int(lengths.sum()), float(estimated_compute(lengths, cfg.attn_coef).sum()), None
    return layout.num_tokens, layout_compute(layout, cfg.attn_coef), layout


def _units(seqs: list, cfg: PackerConfig) -> tuple:
    """Lists of positions in ``seqs`` that must share a micro-batch, and the (tokens, compute) of each."""
    if not cfg.keep_groups:
        units = [[k] for k in range(len(seqs))]
        return units, [_size(seqs, u, cfg)[:2] for u in units]
    groups: dict = {}
    for k, s in enumerate(seqs):
        groups.setdefault(s.group_id, []).append(k)
    units, sizes = [], []
    for members in groups.values():
        size = _size(seqs, members, cfg)[:2]
        if size[0] <= cfg.token_budget:
            units.append(members)
            sizes.append(size)
        else:
            units.extend([k] for k in members)
            sizes.extend(_size(seqs, [k], cfg)[:2] for k in members)
    return units, sizes


def _build(seqs: list, members: list, adv: Optional[np.ndarray], normalizer: float, rank: int, index: int,
           cfg: PackerConfig, complete: bool) -> MicroBatch:
    members = sorted(members, key=lambda k: seqs[k].index)
    sel = [seqs[k] for k in members]
    lengths = np.array([len(s.tokens) for s in sel], dtype=np.int64)
    cu = np.zeros(len(sel) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    T = int(cu[-1])

    def cat(name, dtype):
        return np.concatenate([getattr(s, name) for s in sel]).astype(dtype) if sel else np.zeros(0, dtype)

    tokens = cat("tokens", np.int64)
    local = cat("chunk_ids", np.int64)
    seq_of = np.repeat(np.arange(len(sel)), lengths)
    pos = np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], lengths)
    # dense global chunk ids: a new chunk starts where the local id or the sequence changes
    tidx = np.flatnonzero(local >= 0)
    c, s = local[tidx], seq_of[tidx]
    starts = np.ones(tidx.size, dtype=bool)
    starts[1:] = (c[1:] != c[:-1]) | (s[1:] != s[:-1])
    chunk = np.full(T, -1, dtype=np.int32)
    chunk[tidx] = np.cumsum(starts) - 1
    _, est, layout = _size(seqs, members, cfg) if sel else (0, 0.0, None)
    return MicroBatch(
        token_ids=torch.from_numpy(tokens),
        position_ids=torch.from_numpy(pos),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        chunk_ids=torch.from_numpy(chunk),
        rollout_logp=torch.from_numpy(cat("rollout_logp", np.float32)),
        rewards=torch.tensor([x.reward for x in sel], dtype=torch.float32),
        group_ids=torch.tensor([x.group_id for x in sel], dtype=torch.int64),
        advantages=None if adv is None else torch.tensor([adv[x.index] for x in sel], dtype=torch.float64),
        traj_indices=torch.tensor([x.index for x in sel], dtype=torch.int64),
        policy_versions=torch.tensor([x.version for x in sel], dtype=torch.int64),
        normalizer=normalizer,
        rank=rank,
        index=index,
        est_compute=est,
        complete_groups=complete,
        tree=layout,
    )


def pack_step(trajectories: Sequence[Trajectory], cfg: PackerConfig, loss: Optional[LossConfig] = None,
              advantages: Optional[np.ndarray] = None) -> PackedStep:
    """Pack one step's trajectories into micro-batches for ``cfg.num_ranks`` ranks (see module doc).
    ``advantages``: [len(trajectories)] the step's advantages, carried into the micro-batches."""
    loss = loss if loss is not None else LossConfig()
    if advantages is not None:
        advantages = finite_vector("advantages", advantages, len(trajectories))
    seqs, truncated, skipped = _prepare(trajectories, cfg)
    R, B = cfg.num_ranks, cfg.token_budget
    lengths = np.array([len(s.tokens) for s in seqs], dtype=np.int64)
    trained = np.array([int((s.chunk_ids >= 0).sum()) for s in seqs], dtype=np.int64)
    normalizer = step_normalizer(trained, loss)

    units, sizes = _units(seqs, cfg)  # tokens and compute as computed (shared prefixes once)
    unit_tokens = [t for t, _ in sizes]
    unit_cost = [c for _, c in sizes]
    perm = np.random.default_rng(cfg.seed).permutation(len(units))
    rank_of = [-1] * len(units)
    rank_units = karmarkar_karp(unit_cost, R, order=perm.tolist())
    rank_units.sort(key=lambda us: (-sum(unit_cost[u] for u in us), min(us, default=-1)))
    for r, us in enumerate(rank_units):
        for u in us:
            rank_of[u] = r

    # bucketed fill: decreasing tokens, ties by the seeded order
    pos = np.empty(len(units), dtype=np.int64)
    pos[perm] = np.arange(len(units))
    m = max([1] + [-(-sum(unit_tokens[u] for u in us) // B) for us in rank_units])
    while True:
        bins = []
        for us in rank_units:
            order = sorted(us, key=lambda u: (-unit_tokens[u], pos[u]))
            b = fill_bins(unit_tokens, order, m, B)
            if b is None:
                break
            bins.append(b)
        if len(bins) == R:
            break
        m += 1

    # a group is split when its members' units landed in different micro-batches
    where: dict = {}
    for r, rank_bins in enumerate(bins):
        for j, b in enumerate(rank_bins):
            for u in b:
                for k in units[u]:
                    where.setdefault(seqs[k].group_id, set()).add((r, j))
    split = sorted(g for g, places in where.items() if len(places) > 1)
    split_set = set(split)

    ranks = []
    for r, rank_bins in enumerate(bins):
        mbs = []
        for j, b in enumerate(rank_bins):
            members = [k for u in b for k in units[u]]
            complete = not any(seqs[k].group_id in split_set for k in members)
            mbs.append(_build(seqs, members, advantages, normalizer, r, j, cfg, complete))
        ranks.append(mbs)
    return PackedStep(
        ranks=ranks,
        normalizer=normalizer,
        loss_agg=loss.loss_agg,
        rank_compute=[sum(mb.est_compute for mb in rank) for rank in ranks],
        rank_tokens=[sum(mb.num_tokens for mb in rank) for rank in ranks],
        rank_computed_tokens=[sum(mb.computed_tokens for mb in rank) for rank in ranks],
        num_tokens=int(lengths.sum()),
        split_groups=split,
        truncated=truncated,
        skipped=skipped,
    )

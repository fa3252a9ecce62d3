"""Ulysses sequence parallelism for the packed forward (DeepSpeed-Ulysses, arXiv 2309.14509).

A packed micro-batch of T tokens is split into P equal contiguous shards, one per rank of a
sequence-parallel (SP) group.  Everything in a layer but attention works token by token, so each
rank runs it on its own T/P tokens.  Around attention one all-to-all turns [T/P tokens, all heads]
into [all T tokens, H/P heads], attention runs on whole sequences (the ordinary varlen attention with
the batch's own cu_seqlens), and a second all-to-all turns the output back.  Activation memory per
rank is about 1/P of the unsplit forward; what crosses the wire per layer is q, k, v and the output:
4 x T x H x D / P elements per rank.

Shards are equal: T is padded to a multiple of P with pad tokens that form one extra sequence at the
end, which attends only to itself and is cut off by the caller.  Heads: the query heads must divide
by P; key/value heads are scattered as they are when they divide by P, else expanded to the query
heads first (grouped-query attention then moves more bytes, with the same result).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from .packed import (_ALIGN, _attention_implementation, _base_model, _check_cu_seqlens, _flash_available,
                     _head_logprobs, _varlen_sdpa_attention, position_ids_from_cu_seqlens, register_attention)

ARL_ULYSSES = "arl_ulysses"  # name under which the SP attention is registered in transformers


@dataclasses.dataclass(frozen=True)
class SPShard:
    """One rank's share of a packed micro-batch: tokens ``[start, stop)`` of the padded batch."""
    group: Optional[object]  # the SP process group (None: the default group)
    size: int
    rank: int
    total: int        # T, the batch's real tokens
    padded: int       # T rounded up to a multiple of ``size``
    cu_seqlens: torch.Tensor  # [N+1] or [N+2] (with the pad sequence) over the padded batch

    @property
    def local(self) -> int:
        return self.padded // self.size

    @property
    def start(self) -> int:
        return self.rank * self.local

    @property
    def stop(self) -> int:
        return self.start + self.local

    @property
    def real(self) -> int:
        """How many of this rank's tokens are real (the rest are padding)."""
        return max(0, min(self.stop, self.total) - self.start)


def plan_shard(cu_seqlens: torch.Tensor, size: int, rank: int, group=None) -> SPShard:
    """The shard of rank ``rank`` of ``size`` over the batch ``cu_seqlens`` describes."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"sequence_parallel: rank {rank} of {size} is not a rank of the group")
    cu = cu_seqlens.long()
    total = int(cu[-1])
    padded = -(-total // size) * size
    if padded > total:  # the pad tokens: one sequence of their own
        cu = torch.cat([cu, cu.new_tensor([padded])])
    return SPShard(group, size, rank, total, padded, cu)


class _AllToAll(torch.autograd.Function):
    """all_to_all over dim 0 split in ``size`` blocks; its backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # not empty_like: it keeps a permuted input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_tokens(x: torch.Tensor, shard: SPShard) -> torch.Tensor:
    """[heads, T/P, D] on every rank -> [heads/P, T, D]: this rank's head block over every token."""
    P, (h, t, d) = shard.size, x.shape
    y = _AllToAll.apply(x.reshape(P, h // P, t, d), shard.group)  # y[i]: rank i's tokens, my heads
    return y.permute(1, 0, 2, 3).reshape(h // P, P * t, d)


def tokens_to_heads(x: torch.Tensor, shard: SPShard) -> torch.Tensor:
    """The inverse: [heads/P, T, D] -> [heads, T/P, D]."""
    P, (hp, T, d) = shard.size, x.shape
    y = _AllToAll.apply(x.reshape(hp, P, T // P, d).permute(1, 0, 2, 3), shard.group)  # y[i]: my tokens, head block i
    return y.reshape(P * hp, T // P, d)


_ACTIVE: list = []  # the shard of the forward in progress (a stack: one per nested forward)


@contextlib.contextmanager
def active(shard: SPShard, keep: bool = False):
    """The shard the attention reads.  ``keep``: left in place after the forward, for gradient
    checkpointing's recomputation in backward (as the attention implementation is, packed.py); the
    next forward replaces it."""
    _ACTIVE.append(shard)
    try:
        yield
    finally:
        _ACTIVE.pop()
        if keep:
            _ACTIVE[:] = [shard]


def _ulysses_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                       **kwargs):
    """transformers attention function: query [1, heads, T/P, D], key/value [1, kv_heads, T/P, D] of
    this rank's tokens -> ([1, T/P, heads, D], None), attention over whole sequences."""
    if not _ACTIVE:
        raise RuntimeError("arl_ulysses: attention called outside a sequence-parallel forward")
    shard = _ACTIVE[-1]
    P, heads, kv = shard.size, query.shape[1], key.shape[1]
    if kv % P:  # grouped-query attention whose kv heads do not split: give every query head its own
        key, value = key.repeat_interleave(heads // kv, dim=1), value.repeat_interleave(heads // kv, dim=1)
    q, k, v = (heads_to_tokens(x[0], shard)[None] for x in (query, key, value))
    out, _ = inner_attention(q.device)(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                       sliding_window=sliding_window, cu_seqlens=shard.cu_seqlens)
    # out: [1, T, heads/P, D] -> [heads/P, T, D] -> this rank's tokens, every head
    local = tokens_to_heads(out[0].transpose(0, 1), shard)
    return local.transpose(0, 1)[None].contiguous(), None


def _sdpa_inner(module, q, k, v, mask, cu_seqlens, **kw):
    return _varlen_sdpa_attention(module, q, k, v, mask, cu_seq_lens_q=cu_seqlens, **kw)


def _flash_inner(module, q, k, v, mask, cu_seqlens, **kw):
    from transformers.integrations.flash_attention import flash_attention_forward

    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return flash_attention_forward(module, q, k, v, mask, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                                   max_length_k=longest, **kw)


def inner_attention(device: torch.device):
    """The attention over whole sequences between the two all-to-alls: flash-attn's varlen kernel
    where it runs (CUDA with flash_attn installed, as ``attn: auto`` picks for the unsplit forward),
    else arl's varlen SDPA."""
    return _flash_inner if _flash_available(device) else _sdpa_inner


def register_with_transformers() -> None:
    register_attention(ARL_ULYSSES, _ulysses_attention)


def check_heads(config, size: int) -> None:
    """One line when the model's heads do not split over ``size`` ranks."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or heads % size:
        raise ValueError(f"trainer.sequence_parallel: {size} must divide the model's attention heads ({heads})")


def sp_hidden_states(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, shard: SPShard) -> torch.Tensor:
    """This rank's final hidden states [T/P, H] of the packed batch ``input_ids`` [T] (every rank of
    the group passes the whole batch: token ids are small next to the activations).  Rows past
    ``shard.real`` are padding."""
    _check_cu_seqlens(input_ids, cu_seqlens)
    check_heads(model.config, shard.size)
    register_with_transformers()
    device = input_ids.device
    cu = shard.cu_seqlens.to(device)
    ids = torch.zeros(shard.padded, dtype=torch.long, device=device)
    ids[:shard.total] = input_ids.long()
    pos = position_ids_from_cu_seqlens(cu, shard.padded)
    sl = slice(shard.start, shard.stop)
    keep = getattr(model, "is_gradient_checkpointing", False) and model.training and torch.is_grad_enabled()
    with active(shard, keep), _attention_implementation(model, ARL_ULYSSES):
        out = _base_model(model)(input_ids=ids[sl][None], position_ids=pos[sl][None], use_cache=False)
    return out.last_hidden_state[0]


class _SumOverGroup(torch.autograd.Function):
    """all_reduce(sum) whose backward passes the gradient through: every rank of the group computes
    the same loss from the summed vector, so each rank's own entries get that loss's gradient once."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


@dataclasses.dataclass(frozen=True)
class ShardRows:
    """This rank's final hidden states of a sequence-parallel forward (rows ``[shard.start, shard.stop)``
    of the padded batch), as the objective's ``hidden``: ``hidden[k]`` indexes the rows; what reads
    hidden states at global positions goes through ``select``."""
    rows: torch.Tensor
    shard: SPShard

    def __getitem__(self, k):
        return self.rows[k]

    def select(self, pos: torch.Tensor, fn) -> torch.Tensor:
        """``fn(hidden[pos])`` -> [len(pos)] for global positions ``pos`` on every rank of the group: each
        rank applies ``fn`` to the rows it holds and one all-reduce sums the group's vectors (the
        gradient reaches each rank's own rows).  ``fn`` runs on every rank, on one row when the rank
        holds none of ``pos``, so every rank's backward reaches the same parameters."""
        sh, pos = self.shard, pos.to(self.rows.device).long()
        mine = ((pos >= sh.start) & (pos < sh.start + sh.real)).nonzero().squeeze(1)
        local = pos.index_select(0, mine) - sh.start
        v = fn(self.rows.index_select(0, local if local.numel() else local.new_zeros(1)))
        full = v.new_zeros(pos.numel())
        full = full.index_copy(0, mine, v) if local.numel() else full + v.sum() * 0.0
        return _SumOverGroup.apply(full, sh.group)


def sp_logprobs(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, shard: SPShard, temperature: float = 1.0,
                with_entropy: bool = False, align: str = "target", backend: str = "auto", return_hidden: bool = False):
    """``packed_logprobs``' [T] logprobs (and entropies) of the WHOLE batch on every rank of the SP
    group, each rank computing its own tokens' rows through the fused head.  The loss then sees the
    batch whole, so chunk and sequence aggregates that straddle a shard boundary are exact, and its
    gradient flows back to each rank's own rows only.  What crosses the wire is the [T] vectors
    (4 bytes a token each), next to the all-to-alls' 4 x T x hidden / P per layer."""
    if align not in _ALIGN:
        raise ValueError(f"align: unknown {align!r}; choose from {sorted(_ALIGN)}")
    hidden = sp_hidden_states(model, input_ids, cu_seqlens, shard)
    T, device = shard.total, hidden.device
    has_next = torch.ones(T, dtype=torch.bool, device=device)
    has_next[cu_seqlens[1:].to(device).long() - 1] = False
    mine = torch.zeros(T, dtype=torch.bool, device=device)
    mine[shard.start:shard.start + shard.real] = True
    src = (has_next & mine).nonzero().squeeze(1)  # global positions this rank predicts from
    lp, ent = _head_logprobs(model, hidden.index_select(0, src - shard.start), input_ids.to(device)[src + 1],
                             temperature=temperature, with_entropy=with_entropy, backend=backend)
    dst = src + _ALIGN[align]
    zeros = torch.zeros(T, dtype=lp.dtype, device=device)
    logp = _SumOverGroup.apply(zeros.index_copy(0, dst, lp), shard.group)
    entropy = _SumOverGroup.apply(zeros.index_copy(0, dst, ent), shard.group) if with_entropy else None
    return (logp, entropy, ShardRows(hidden, shard)) if return_hidden else (logp, entropy)

"""Tree attention in one FlexAttention call (the GPU path of ``trainer.share_prefix``).

``arl_tree_sdpa`` (arl/model/shared_prefix.py) makes one SDPA call per segment, gathering each
segment's ancestors' K/V: exact everywhere, but on a GPU a micro-batch of hundreds of segments is
hundreds of small kernels per layer.  Here the whole layout is one ``flex_attention`` call over
the C computed tokens with a block-sparse mask: query q may read key k when k's segment is an
ancestor of q's, or the same segment and k <= q.  Blocks the mask rules out are skipped, so the
work is the tree's, not C x C.  The mask is built once per forward and shared by every layer.

torch runs FlexAttention's backward only on GPUs (2.13: "does not support backward on CPU"), so
the trainer takes this path on CUDA; on CPU it serves no-grad forwards and the tests that compare
it with the SDPA path.  ``torch.compile`` makes the fused kernel (eager flex is a reference that
materializes the scores).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..data.prefix_tree import PrefixLayout

ARL_TREE_FLEX = "arl_tree_flex"
BLOCK = 128  # FlexAttention's block size: the mask's sparsity is counted in BLOCK x BLOCK tiles


class FlexTreePlan:
    """The layout as a FlexAttention block mask: per computed token its segment, per segment pair
    whether the key's segment is the query's ancestor."""

    def __init__(self, layout: PrefixLayout, device: torch.device):
        from torch.nn.attention.flex_attention import create_block_mask

        bounds = layout.seg_bounds.tolist()
        S, C = layout.num_segments, layout.num_tokens
        lengths = torch.tensor([bounds[s + 1] - bounds[s] for s in range(S)])
        seg = torch.repeat_interleave(torch.arange(S), lengths).to(device)
        anc = torch.zeros(S, S, dtype=torch.bool)
        parent = layout.seg_parent.tolist()
        for s in range(S):
            p = parent[s]
            while p >= 0:
                anc[s, p] = True
                p = parent[p]
        anc = anc.to(device)

        def mask_mod(b, h, q, k):
            return anc[seg[q], seg[k]] | ((seg[q] == seg[k]) & (k <= q))

        self.mask_mod = mask_mod
        self.block_mask = create_block_mask(mask_mod, None, None, C, C, device=str(device), BLOCK_SIZE=BLOCK)


@functools.lru_cache(maxsize=None)
def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention  # dynamic after a recompile: C varies


def tree_flex_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                        sliding_window=None, arl_tree: Optional[FlexTreePlan] = None, **kwargs):
    """transformers attention function: query [1, heads, C, D], key/value [1, kv_heads, C, D] ->
    ([1, C, heads, D], None) over the tree of ``arl_tree``."""
    if arl_tree is None or not isinstance(arl_tree, FlexTreePlan):
        raise ValueError("arl_tree_flex: called without a FlexTreePlan (use tree_hidden_states)")
    if sliding_window is not None:
        raise ValueError(f"sliding_window: {sliding_window} is not supported by {ARL_TREE_FLEX}")
    if dropout and module.training:
        raise ValueError(f"attention dropout {dropout} is not supported by {ARL_TREE_FLEX}")
    gqa = query.shape[1] != key.shape[1]
    out = _flex(query.is_cuda)(query, key, value, block_mask=arl_tree.block_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


_REGISTERED = False


def register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ARL_TREE_FLEX, tree_flex_attention)
        _REGISTERED = True

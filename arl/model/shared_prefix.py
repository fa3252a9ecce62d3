"""The forward over a shared-prefix layout (arl/data/prefix_tree.py): each shared prefix is computed
once, and every segment's queries attend to [its ancestors' K/V ; its own K/V], causal within the
segment (Prefix Grouper, arXiv 2506.05433, extended to a tree).  A token's K/V depend only on the
tokens before it, so the hidden states, logprobs and (autograd summing the gradient of every
suffix into its prefix) the parameter gradients equal the ordinary packed forward's.

Attention ``tree_sdpa`` is registered with transformers' ``AttentionInterface`` like
``varlen_sdpa`` (no mask function: no mask is built): one SDPA call per segment, a causal one for
a segment without ancestors, else one over the gathered [ancestors ; own] keys with a lower-right
causal mask: exact on any device.  On CUDA the default is one FlexAttention call over the whole
tree instead (``arl_tree_flex``, arl/model/tree_flex.py; ``kernel`` picks).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..data.prefix_tree import PrefixLayout
from .packed import (_ALIGN, _attention_implementation, _base_model, _head_logprobs, packed_hidden_states,
                     packed_logprobs)
from .tree_flex import ARL_TREE_FLEX, FlexTreePlan
from .tree_flex import register as register_flex

ARL_TREE_SDPA = "arl_tree_sdpa"
_TREE_ATTENTION = ("auto", "varlen_sdpa")  # the attn settings the tree forward serves (on any device)


class _TreePlan:
    """Per segment: its query length, its keys' length and mask (None: the segment alone, plain
    causal), and one index over the computed positions gathering every segment's keys back to back
    ([ancestors ; own] per segment).  One gather and one split per layer, not one slice per segment:
    the backward of a slice or a gather writes a zero tensor of the whole input's size, so per
    segment that is O(segments x tokens) per layer (profiled at the main job's shape, ~25 segments
    per micro-batch: the ordinary packed forward's per-sequence slices spend ~30% of its
    forward + backward in those fills)."""

    def __init__(self, layout: PrefixLayout, device: torch.device):
        bounds = layout.seg_bounds.tolist()
        self.q_lens, self.k_lens, self.masks, idx = [], [], [], []
        for s, chain in enumerate(layout.chains()):
            a, b = bounds[s], bounds[s + 1]
            own = torch.arange(a, b)
            keys = torch.cat([torch.arange(x, y) for x, y in chain] + [own]) if chain else own
            n_k = keys.numel()
            self.q_lens.append(b - a)
            self.k_lens.append(n_k)
            idx.append(keys)
            self.masks.append(None if not chain else
                              torch.ones(b - a, n_k, dtype=torch.bool, device=device).tril(n_k - (b - a)))
        self.key_index = torch.cat(idx).to(device)


def _tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, arl_tree: Optional[_TreePlan] = None, **kwargs):
    """transformers attention function: query [1, heads, C, D], key/value [1, kv_heads, C, D] ->
    ([1, C, heads, D], None) over the tree of ``arl_tree``."""
    if arl_tree is None:  # an ordinary forward of a model left on this implementation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise ValueError(f"sliding_window: {sliding_window} is not supported by arl_tree_sdpa")
    if query.shape[0] != 1:
        raise ValueError(f"query: tree attention expects batch 1, got {query.shape[0]}")
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention: SDPA reads the kv heads as they are
    ks = key.index_select(2, arl_tree.key_index).split(arl_tree.k_lens, dim=2)
    vs = value.index_select(2, arl_tree.key_index).split(arl_tree.k_lens, dim=2)
    qs = query.split(arl_tree.q_lens, dim=2)
    p = dropout if module.training else 0.0
    outs = []
    for q, k, v, mask in zip(qs, ks, vs, arl_tree.masks):
        # enable_gqa, not repeat_kv: an expanded copy of every segment's [ancestors ; own] keys,
        # saved for backward, was the largest activation at the calculator shape (G=8: +7% peak)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, scale=scaling, is_causal=mask is None, enable_gqa=gqa))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ARL_TREE_SDPA, _tree_sdpa_attention)
        _REGISTERED = True


TREE_KERNELS = ("auto", "sdpa", "flex")


def _tree_kernel(kernel: str, device: torch.device) -> str:
    """auto: one FlexAttention call on CUDA (arl/model/tree_flex.py), per-segment SDPA elsewhere
    (torch has no FlexAttention backward on CPU)."""
    if kernel not in TREE_KERNELS:
        raise ValueError(f"tree attention kernel: unknown {kernel!r}; choose from {list(TREE_KERNELS)}")
    return ("flex" if device.type == "cuda" else "sdpa") if kernel == "auto" else kernel


def tree_hidden_states(model, layout: PrefixLayout, attn: str = "auto", kernel: str = "auto") -> torch.Tensor:
    """Final hidden states [C, H] of the layout's computed tokens."""
    if attn not in _TREE_ATTENTION:
        raise ValueError(f"attn: {attn!r} has no shared-prefix path; trainer.share_prefix needs one of "
                         f"{list(_TREE_ATTENTION)}")
    device = next(model.parameters()).device
    ids = layout.token_ids.to(device)
    if _tree_kernel(kernel, device) == "flex":
        register_flex()
        impl, plan = ARL_TREE_FLEX, FlexTreePlan(layout, device)
    else:
        _register()
        impl, plan = ARL_TREE_SDPA, _TreePlan(layout, device)
    with _attention_implementation(model, impl):
        out = _base_model(model)(input_ids=ids[None], position_ids=layout.position_ids.to(device)[None],
                                 use_cache=False, arl_tree=plan)
    return out.last_hidden_state[0]


def tree_logprobs(model, layout: PrefixLayout, temperature: float = 1.0, with_entropy: bool = False,
                  align: str = "target", attn: str = "auto", backend: str = "auto", return_hidden: bool = False,
                  head_grad=None, kernel: str = "auto", **tiles):
    """``packed_logprobs`` of the micro-batch's packed tokens, computed over ``layout``: the same
    outputs over the same [T] packed slots (hidden states [T, H] with ``return_hidden``).
    ``head_grad``: the loss's plan over the packed slots; used when no trained slot shares its head
    row with another slot (then every other slot of a shared row is untrained: gradient 0)."""
    if align not in _ALIGN:
        raise ValueError(f"align: unknown {align!r}; choose from {sorted(_ALIGN)}")
    hidden = tree_hidden_states(model, layout, attn=attn, kernel=kernel)
    device = hidden.device
    T = layout.src.numel()
    head_row = layout.head_row.to(device)
    t = (head_row >= 0).nonzero().squeeze(1)
    dst = t + _ALIGN[align]
    plan = None
    if head_grad is not None:
        head_grad.applied = False
        plan = head_grad.rows(layout.head_first.to(device) + _ALIGN[align])
        if plan is not None:
            plan.applied = False
    lp, ent = _head_logprobs(model, hidden.index_select(0, layout.head_src.to(device)), layout.head_tgt.to(device),
                             grad_plan=plan, temperature=temperature, with_entropy=with_entropy, backend=backend,
                             **tiles)
    if plan is not None:
        head_grad.applied = plan.applied
    rows = head_row.index_select(0, t)
    zeros = torch.zeros(T, dtype=lp.dtype, device=device)  # float32 (float64 for a float64 model)
    logp = zeros.index_copy(0, dst, lp.index_select(0, rows))
    entropy = zeros.index_copy(0, dst, ent.index_select(0, rows)) if with_entropy else None
    if return_hidden:
        return logp, entropy, hidden.index_select(0, layout.src.to(device))
    return logp, entropy


def micro_batch_hidden_states(model, mb, device, attn: str = "auto") -> torch.Tensor:
    """``packed_hidden_states`` [T, H] of a packer micro-batch: over its shared-prefix layout when it
    has one (the separate critic's trunk, arl/algo/critic_model.py)."""
    if mb.tree is not None:
        return tree_hidden_states(model, mb.tree, attn=attn).index_select(0, mb.tree.src.to(device))
    return packed_hidden_states(model, mb.token_ids.to(device), mb.cu_seqlens.to(device), attn=attn)


def micro_batch_logprobs(model, mb, device, **kw):
    """``packed_logprobs`` of a packer micro-batch: over its shared-prefix layout when it has one."""
    if mb.tree is not None:
        return tree_logprobs(model, mb.tree, **kw)
    return packed_logprobs(model, mb.token_ids.to(device), mb.cu_seqlens.to(device), **kw)

"""Packed (varlen) forward of Hugging Face causal LMs: many sequences in one [T] row, attention
never crossing a sequence boundary, no padding and no [T, T] mask.

Inputs: ``input_ids`` [T] and ``cu_seqlens`` [N+1] (0 = c_0 < c_1 < ... < c_N = T; sequence i is
``input_ids[c_i:c_{i+1}]``).  Position ids restart at 0 in every sequence.

Attention paths (registry ``_ATTENTION``, ``attn="auto"`` picks the first available of
``_AUTO_ORDER``):

* ``flash_attention_2``: transformers' flash-attn varlen path, fed cu_seqlens directly (GPU, when
  flash-attn is installed).
* ``varlen_sdpa``: arl's attention function registered with transformers' ``AttentionInterface``:
  one causal SDPA call per sequence, O(sum L_i^2) work, exact.  Any device.  No mask is built (the
  name has no mask function, so transformers' mask creation returns None).
* ``hf_sdpa_packed``: transformers' own packed-sequence support (sequence starts detected from
  position ids, turned into a block-diagonal causal [T, T] mask for SDPA).  Verified exact by
  tests/test_packed_forward.py; kept selectable, not the default, because its mask is O(T^2).

Logprob alignment (``packed_logprobs``): the model's distribution at position t predicts token
t+1 of the same sequence.  The last token of a sequence predicts nothing and the first token is
predicted by nothing, so with

* ``align="target"`` (default; the layout of ``Trajectory.rollout_logp``): out[t] = log p(ids[t] |
  ids[c_i:t]); 0.0 at the FIRST token of every sequence;
* ``align="next"``: out[t] = log p(ids[t+1] | ids[c_i:t+1]); 0.0 at the LAST token of every sequence.

Those boundary entries are exactly 0.0, carry no gradient and are never computed (the lm_head
only runs on the T - N positions that have a next token).  Entropy follows the same alignment.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional, Tuple

import torch

from ..ops.logprob import fused_logprobs
from ..ops.logprob.grad_in_forward import grad_in_forward_logprobs

ARL_VARLEN_SDPA = "arl_varlen_sdpa"  # name under which arl's attention is registered in transformers


def _check_cu_seqlens(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids: expected a non-empty [T] tensor, got {getattr(input_ids, 'shape', input_ids)}")
    if input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids: expected integer token ids, got {input_ids.dtype}")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a [N+1] tensor with N >= 1, got {getattr(cu_seqlens, 'shape', cu_seqlens)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != input_ids.shape[0]:
        raise ValueError(f"cu_seqlens: must start at 0 and end at T={input_ids.shape[0]}, got {cu[0]}..{cu[-1]}")
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if min(lens) <= 0:
        bad = next(i for i, n in enumerate(lens) if n <= 0)
        raise ValueError(f"cu_seqlens: sequence {bad} has length {lens[bad]}; lengths must be >= 1")


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """[T] int64 positions restarting at 0 at every sequence start."""
    cu = cu_seqlens.long()
    T = int(cu[-1]) if total is None else int(total)
    lens = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=T)
    return torch.arange(T, device=cu.device) - starts


def _varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           sliding_window=None, cu_seq_lens_q=None, **kwargs):
    """transformers attention function: query [1, heads, T, D], key/value [1, kv_heads, T, D] ->
    ([1, T, heads, D], None), causal within each cu_seqlens segment and nothing across."""
    if cu_seq_lens_q is None:  # an ordinary (unpacked) forward of a model left on this implementation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    if sliding_window is not None:
        raise ValueError(f"sliding_window: {sliding_window} is not supported by arl_varlen_sdpa")
    if query.shape[0] != 1:
        raise ValueError(f"query: packed attention expects batch 1, got {query.shape[0]}")
    rep = query.shape[1] // key.shape[1]
    if rep > 1:  # grouped-query attention: expand kv heads (same as transformers' repeat_kv)
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    bounds = cu_seq_lens_q.tolist()
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
            dropout_p=dropout if module.training else 0.0, scale=scaling, is_causal=True,
        )
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


_REGISTERED: set = set()


def register_attention(name: str, fn) -> None:
    """``fn`` under ``name`` in transformers' AttentionInterface, once per process."""
    if name not in _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
        _REGISTERED.add(name)


def _register_with_transformers() -> None:
    register_attention(ARL_VARLEN_SDPA, _varlen_sdpa_attention)


def _flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


# attn name -> (available(device), transformers implementation name, pass cu_seqlens kwargs?)
_ATTENTION: Dict[str, Tuple[Callable[[torch.device], bool], str, bool]] = {
    "flash_attention_2": (_flash_available, "flash_attention_2", True),
    "varlen_sdpa": (lambda d: True, ARL_VARLEN_SDPA, True),
    "hf_sdpa_packed": (lambda d: True, "sdpa", False),
}
_AUTO_ORDER = ("flash_attention_2", "varlen_sdpa")


@contextlib.contextmanager
def _attention_implementation(model, impl: str):
    """Swap the model's attention implementation for one call (every layer reads config's).  Under
    gradient checkpointing the layers run their forward again during backward, after this call has
    returned: then the implementation stays set (measured: restoring it made the recomputation use
    plain SDPA across sequence boundaries, and torch.utils.checkpoint failed).  arl's varlen SDPA
    without cu_seqlens is transformers' SDPA, so the model's other forwards are unchanged."""
    cfg = model.config
    old = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = impl
    keep = getattr(model, "is_gradient_checkpointing", False) and model.training and torch.is_grad_enabled()
    try:
        yield
    finally:
        if not keep:
            cfg._attn_implementation_internal = old


def _base_model(model):
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or base is model:
        raise ValueError(f"model: {type(model).__name__} has no base model under base_model_prefix")
    return base


def packed_hidden_states(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                         position_ids: Optional[torch.Tensor] = None, attn: str = "auto") -> torch.Tensor:
    """Final hidden states [T, H] (after the last norm, before lm_head) of a packed batch."""
    _check_cu_seqlens(input_ids, cu_seqlens)
    device = input_ids.device
    if attn == "auto":
        attn = next(n for n in _AUTO_ORDER if _ATTENTION[n][0](device))
    if attn not in _ATTENTION:
        raise ValueError(f"attn: unknown {attn!r}; choose from {['auto'] + sorted(_ATTENTION)}")
    available, impl, pass_cu = _ATTENTION[attn]
    if not available(device):
        raise ValueError(f"attn: {attn!r} is not available on {device}")
    if impl == ARL_VARLEN_SDPA:
        _register_with_transformers()
    T = input_ids.shape[0]
    if position_ids is None:
        position_ids = position_ids_from_cu_seqlens(cu_seqlens.to(device), T)
    elif position_ids.shape != input_ids.shape:
        raise ValueError(f"position_ids: shape {tuple(position_ids.shape)} must equal input_ids' {tuple(input_ids.shape)}")
    kwargs = {}
    if pass_cu:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    with _attention_implementation(model, impl):
        out = _base_model(model)(input_ids=input_ids[None].long(), position_ids=position_ids[None].long(),
                                 use_cache=False, **kwargs)
    return out.last_hidden_state[0]


def _lm_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model: {type(model).__name__} has no lm_head weight")
    if getattr(head, "bias", None) is not None:
        raise ValueError("model: lm_head with a bias is not supported by the fused logprob op")
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, key, None) not in (None, 1.0):
            raise ValueError(f"model.config.{key}: logit post-processing is not supported by the fused logprob op")
    return head.weight


def _head_op(targets: torch.Tensor, grad_plan, kw: dict):
    """(h, w) -> (logp, entropy): the grad-in-forward head when ``grad_plan`` is given and can tile
    these rows (then ``grad_plan.applied`` is set), else the fused op."""
    def op(h, w):
        if grad_plan is not None and torch.is_grad_enabled():
            k = {n: v for n, v in kw.items() if n in ("temperature", "with_entropy")}
            out = grad_in_forward_logprobs(h, w, targets, grad_plan, **k)
            grad_plan.applied = out is not None
            if out is not None:
                return out
        return fused_logprobs(h, w, targets, **kw)

    return op


def _head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, grad_plan=None, **kw):
    """The fused op on the lm_head weight.  Under DeepSpeed ZeRO-3 the weight is partitioned and
    only gathered around the head module's own forward (and again for its backward), so the op is
    run *as* that forward: the module's hooks gather the weight and route its gradient."""
    weight = _lm_head_weight(model)
    op = _head_op(targets, grad_plan, kw)
    if not hasattr(weight, "ds_id"):  # a plain (or ZeRO-0/1/2) parameter
        return op(hidden, weight)
    head = model.get_output_embeddings()
    head.forward = lambda h: op(h, head.weight)
    try:
        return head(hidden)
    finally:
        del head.forward  # back to the class's forward


_ALIGN = {"target": 1, "next": 0}  # offset from the predicting position to the output slot


def packed_logprobs(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, align: str = "target", attn: str = "auto",
                    backend: str = "auto", return_hidden: bool = False, head_grad=None, **tiles):
    """Per-token logprobs [T] (float32) of the packed tokens under ``model`` (see the module
    docstring for ``align`` and the boundary convention), and entropies [T] when asked.  With
    ``return_hidden`` a third output: the final hidden states [T, H] the logprobs came from (the
    critic's value head reads them: one forward for both).
    ``head_grad``: the loss's gradient plan over the [T] output slots
    (arl.ops.policy_loss.local_grad.LogpGrad): the head then produces its gradients in its forward
    (arl/ops/logprob/grad_in_forward.py) where the plan allows; ``head_grad.applied`` says whether."""
    if align not in _ALIGN:
        raise ValueError(f"align: unknown {align!r}; choose from {sorted(_ALIGN)}")
    hidden = packed_hidden_states(model, input_ids, cu_seqlens, attn=attn)
    T, device = input_ids.shape[0], hidden.device
    has_next = torch.ones(T, dtype=torch.bool, device=device)
    has_next[cu_seqlens[1:].to(device).long() - 1] = False
    src = has_next.nonzero().squeeze(1)
    dst = src + _ALIGN[align]
    plan = None
    if head_grad is not None:
        head_grad.applied = False
        plan = head_grad.rows(dst)  # None: a trained slot has no head row
        if plan is not None:
            plan.applied = False
    lp, ent = _head_logprobs(model, hidden.index_select(0, src), input_ids.to(device)[src + 1], grad_plan=plan,
                             temperature=temperature, with_entropy=with_entropy, backend=backend, **tiles)
    if plan is not None:
        head_grad.applied = plan.applied
    zeros = torch.zeros(T, dtype=lp.dtype, device=device)  # float32 (float64 for a float64 model)
    logp = zeros.index_copy(0, dst, lp)
    entropy = zeros.index_copy(0, dst, ent) if with_entropy else None
    if return_hidden:
        return logp, entropy, hidden
    return logp, entropy

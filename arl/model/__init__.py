"""arl.model: packed (varlen) forward of Hugging Face causal LMs and the fused lm_head -> logprob op."""
from ..ops.logprob import available_logprob_backends, fused_logprobs, naive_logprobs, register_logprob_backend
from .packed import packed_hidden_states, packed_logprobs, position_ids_from_cu_seqlens

__all__ = [
    "available_logprob_backends", "fused_logprobs", "naive_logprobs", "register_logprob_backend",
    "packed_hidden_states", "packed_logprobs", "position_ids_from_cu_seqlens",
]

"""arl.model: the packed (varlen) forward of Hugging Face causal LMs (packed.py) and the tiny model
built locally for the toy runs and tests (tiny.py).  The fused lm_head -> logprob op lives in
arl.ops.logprob."""
from .packed import packed_hidden_states, packed_logprobs, position_ids_from_cu_seqlens

__all__ = ["packed_hidden_states", "packed_logprobs", "position_ids_from_cu_seqlens"]

"""arl.model: the packed (varlen) forward of Hugging Face causal LMs (packed.py), the tiny model
built locally for the toy runs and tests (tiny.py), where ``model.name_or_path`` points
(resolve.py: a local directory or the local HF cache), tied embeddings (tied.py) and the GGUF
converter (gguf.py, ``python -m arl.model.gguf``).  The fused lm_head -> logprob op lives in
arl.ops.logprob."""
from .packed import packed_hidden_states, packed_logprobs, position_ids_from_cu_seqlens

__all__ = ["packed_hidden_states", "packed_logprobs", "position_ids_from_cu_seqlens"]

"""The fused lm_head -> per-token logprob (+ entropy) op: registry and torch paths (api.py), Triton kernel."""
from .api import available_logprob_backends, chunked_logprobs, fused_logprobs, naive_logprobs, register_logprob_backend

__all__ = ["available_logprob_backends", "chunked_logprobs", "fused_logprobs", "naive_logprobs",
           "register_logprob_backend"]

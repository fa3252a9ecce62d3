"""Test-session setup.  TRITON_INTERPRET must be set before any Triton kernel is decorated, so it
is set here, at collection time, on machines without a GPU."""
import os

try:
    import torch

    _has_gpu = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_gpu = False
if not _has_gpu:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# collectives refuse tensors not placed on the communication device (NCCL's rule, checked on gloo);
# inherited by the trainer ranks the tests spawn
os.environ.setdefault("ARL_CHECK_COLLECTIVES", "1")

# session-scoped vLLM engine + tiny model fixtures (rollout tests)
from vllm_fixture import arun, engine_loop, tiny_model_dir, tiny_tokenizer, vllm_engine  # noqa: E402,F401
# one Ray cluster per worker that the slow tests' Ray runs join (RAY_ADDRESS)
from ray_session import _join_ray_session, ray_session  # noqa: E402,F401

"""Whether the Triton kernels of arl.ops can run here (shared by every op with a Triton kernel).

Triton is optional: without it (or without a GPU and without TRITON_INTERPRET=1) the kernels
report themselves unavailable and the ops fall back to the C++ or torch paths.
"""
from __future__ import annotations

import os

import torch


def triton_available() -> bool:
    """Triton importable, and either a GPU or the interpreter (TRITON_INTERPRET=1) to run on."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return torch.cuda.is_available()

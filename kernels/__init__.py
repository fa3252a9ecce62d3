"""arl.kernels: Triton kernels (installed from kernels/ as arl.kernels, never as top-level
``kernels``, a name that belongs to a Hugging Face package).

Triton is optional: on a machine without it (or without a GPU and without TRITON_INTERPRET=1)
the kernels report themselves unavailable and arl falls back to the C++ or reference path.
"""
from __future__ import annotations

import os


def triton_available() -> bool:
    """Triton importable, and either a GPU or the interpreter (TRITON_INTERPRET=1) to run on."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    import torch

    return torch.cuda.is_available()

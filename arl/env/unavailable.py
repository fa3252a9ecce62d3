"""Ecosystem environment packages arl has no adapter for yet, and why: ``env.name: openenv`` or
``env.name: verifiers`` fails with this one line (at ``--dry-run``) instead of "unknown env".

Both packages' declared dependencies conflict with arl's pins (checked 2026-12-05 with
``python -m pip install --dry-run PKG==X -c /work/venv-constraints.txt`` against this machine's
package sources), so no install extra can add them without changing an installed package:

- ``openenv==0.10.0`` (the current OpenEnv package, the one TRL's OpenEnv guide drives;
  ``openenv-core==0.3.0`` is its older name and ships the same ``openenv`` module): it needs
  ``fastmcp<4`` (every fastmcp 3.x needs ``mcp<2.0``; arl pins ``mcp==2.3.0``) and ``gradio>=4``
  (gradio 4.x needs ``markupsafe~=2.0``; arl pins ``MarkupSafe==3.0.3``; later gradios conflict with
  the pillow/pandas/huggingface-hub/fastapi pins).  ``openenv-core==0.3.0`` allows fastmcp 4.x, but
  fastmcp 4.2.3 needs ``certifi>=2026.10.19`` (arl pins 2026.5.20).  Installed without its
  dependencies it does not import: ``openenv.core`` imports ``fastmcp`` unconditionally.
- ``verifiers==0.4.0``: it needs ``mcp==2.0.0`` (arl pins 2.3.0) and ``openai<3.0.0`` (arl pins
  3.63.0).  Its 0.4 stack (``verifiers.v1``) also owns the sampling loop (harnesses calling a model
  client through an interception server), which an arl adapter would have to drive token-in/out.
"""
from __future__ import annotations

from typing import Dict

UNAVAILABLE: Dict[str, str] = {
    "openenv": ("env.name: openenv has no arl adapter yet: openenv==0.10.0 needs fastmcp<4 (so mcp<2.0; "
                "arl pins mcp==2.3.0) and gradio>=4 (MarkupSafe~=2.0; arl pins 3.0.3) -- see docs/envs.md; "
                "port the env to arl.env.Environment or serve its tools over MCP (env.name: mcp)"),
    "verifiers": ("env.name: verifiers has no arl adapter yet: verifiers==0.4.0 needs mcp==2.0.0 "
                  "(arl pins 2.3.0) and openai<3 (arl pins 3.63.0) -- see docs/envs.md; serve its tools "
                  "over MCP (env.name: mcp) with the dataset and reward as the tools env's"),
}

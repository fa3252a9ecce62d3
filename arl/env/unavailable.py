"""Ecosystem environment packages arl has no adapter for yet, and why: ``env.name: verifiers``
fails with this one line (at ``--dry-run``) instead of "unknown env".

Its declared dependencies conflict with arl's pins (checked 2026-12-05 with
``python -m pip install --dry-run PKG==X -c /work/venv-constraints.txt`` against this machine's
package sources), so no install extra can add it without changing an installed package.  (OpenEnv
conflicts too, but its environments are servers: ``env.name: openenv`` runs them from a venv of
their own, ``bash install.sh --openenv``, and talks to them over HTTP/WebSocket; docs/envs.md.)

- ``verifiers==0.4.0``: it needs ``mcp==2.0.0`` (arl pins 2.3.0) and ``openai<3.0.0`` (arl pins
  3.63.0).  Its 0.4 stack (``verifiers.v1``) also owns the sampling loop (harnesses calling a model
  client through an interception server), which an arl adapter would have to drive token-in/out.
"""
from __future__ import annotations

from typing import Dict

UNAVAILABLE: Dict[str, str] = {
    "verifiers": ("env.name: verifiers has no arl adapter yet: verifiers==0.4.0 needs mcp==2.0.0 "
                  "(arl pins 2.3.0) and openai<3 (arl pins 3.63.0) -- see docs/envs.md; serve its tools "
                  "over MCP (env.name: mcp) with the dataset and reward as the tools env's"),
}

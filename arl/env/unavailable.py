"""Ecosystem environment packages arl has no adapter for yet, and why: such an ``env.name`` fails with
its one line here (at ``--dry-run``) instead of "unknown env".  Empty today.

Both packages that conflict with arl's pins (checked 2026-12-05 by resolving each against arl's
installed set: ``python -m pip freeze > pins.txt`` in arl's venv, then ``python -m pip install
--dry-run PKG==X -c pins.txt``) now have adapters that run them from a venv of their own, so no
install extra changes arl's packages (docs/envs.md):

- ``openenv==0.10.0``: its servers run from ``.venv-openenv`` (``bash install.sh --openenv``); arl
  speaks their HTTP/WebSocket protocol (``env.name: openenv``).
- ``verifiers==0.4.0`` (needs ``mcp==2.0.0`` and ``openai<3``; arl pins 2.3.0 and 3.63.0): a server
  script runs from ``.venv-verifiers`` (``bash install.sh --verifiers``) and plays its ``Env.run``
  with arl's engine as the model (``env.name: verifiers``); without that venv the adapter fails with
  one line naming the flag.
"""
from __future__ import annotations

from typing import Dict

UNAVAILABLE: Dict[str, str] = {}

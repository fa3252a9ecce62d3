#!/usr/bin/env bash
# One-shot GPU check for a fresh GPU node (no network): build the CUDA op, trainer steps from a
# recorded rollout (DeepSpeed ZeRO-2 over NCCL, bf16, the CUDA loss, the fused logprob head, the
# packed forward with varlen SDPA) checked against the same steps in fp32 on CPU, the trainer's
# tokens/s and MFU, then the GPU tests (CUDA + compiled Triton against the reference, fuzz) and
# the kernel benches.  Every stage is time-boxed against one deadline and logs to $OUT (default
# ./gpu_check_out), so one failing stage never hides the others.
#   bash bench/gpu_check.sh --prepare [bench/gpu_prepare.py args]   # here, on CPU, first
#   bash bench/gpu_check.sh [deadline_seconds=540]                   # on the GPU node
#   STAGES="build smoke trainer_gpu" bash bench/gpu_check.sh         # a subset (build is needed first)
#   STAGES="build bfcl" BFCL_MODEL=DIR bash bench/gpu_check.sh 960   # BFCL on a model the node has (below)
# --prepare records the trainer stages' inputs into $PREP (default gpu_check_in/, gitignored: the
# policy, its rollout batch, the fp32 CPU reference, the wheels the node lacks) and prints the
# device run's carry list and command.  It starts a vLLM engine and the main job, so it runs under
# the heavy-work lock $ARL_HEAVY_LOCK (default /tmp/arl-heavy.lock; empty: no lock).
# On the node, wheels in $PREP/wheels/ (and .whl/) are installed to /tmp/site first.
set -u
PREP=${PREP:-gpu_check_in}
if [ "${1:-}" = "--prepare" ]; then
  shift
  LOCK=${ARL_HEAVY_LOCK-/tmp/arl-heavy.lock}
  cd "$(dirname "$0")/.." || exit 1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  if [ -n "$LOCK" ] && command -v flock > /dev/null; then
    exec flock "$LOCK" python3 bench/gpu_prepare.py --out "$PREP" "$@"
  fi
  exec python3 bench/gpu_prepare.py --out "$PREP" "$@"
fi
DEADLINE=${1:-540}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DS_BUILD_OPS=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
T0=$(date +%s)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
STAGES=${STAGES:-build smoke trainer_ref trainer_gpu trainer_perf trainer_lora tests bench_logprob bench_policy_loss profile}
case " $STAGES " in *" bfcl "*) STAGES="$STAGES bfcl_eval bfcl_train bfcl_steps" ;; esac  # bfcl: its three parts
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

WHEELS=$(ls "$PREP"/wheels/*.whl .whl/*.whl 2> /dev/null)
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS \
    > "$OUT/wheels.log" 2>&1 && export PYTHONPATH=/tmp/site
  echo "[wheels] rc=$? $(echo $WHEELS | wc -w) wheels" | tee -a "$OUT/summary.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nproc; } > "$OUT/env.txt" 2>&1

# trainer steps from the recorded rollout: the fp32 reference on this node's CPU (CUDA hidden; in
# the background while the CUDA op builds; the one --prepare made stands in if it fails), then the
# GPU run checked against it, then throughput (the CUDA loss; Triton's when the build failed: the
# result JSON names the backend used)
TRAIN="python3 bench/gpu_trainer_check.py"
STEP_ARGS="--data $PREP --steps 3 --updates 2"
HAVE_PREP=0; [ -f "$PREP/meta.json" ] && HAVE_PREP=1
REF_PID=
if [ $HAVE_PREP = 1 ]; then
  THREADS=${REF_THREADS:-4}  # the build beside it compiles a handful of files: cores to spare
  rm -f "$OUT/trainer_ref.pt"
  stage trainer_ref 150 env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=$THREADS $TRAIN steps $STEP_ARGS --device cpu \
    --dtype float32 --loss-backend reference --out "$OUT/trainer_ref.pt" --json "$OUT/trainer_ref.json" &
  REF_PID=$!
else
  echo "[trainer_*] skipped: no $PREP/meta.json (run bash bench/gpu_check.sh --prepare here first)" | tee -a "$OUT/summary.txt"
fi
stage build 240 env MAX_JOBS=16 python3 setup.py build_ext --inplace
stage smoke 60 python3 -c "
import torch, arl
from arl.ops.logprob import available_logprob_backends
print('backends', arl.available_backends(), 'logprob', available_logprob_backends())
assert 'cuda' in arl.available_backends() and 'triton' in arl.available_backends()"
[ -n "$REF_PID" ] && wait "$REF_PID"
if [ $HAVE_PREP = 1 ]; then
  LOSS=$(python3 -c "import arl; b = arl.available_backends(); print('cuda' if 'cuda' in b else 'triton')" 2> /dev/null)
  REF=$OUT/trainer_ref.pt; [ -f "$REF" ] || REF=$PREP/reference_cpu.pt
  stage trainer_gpu 120 $TRAIN steps $STEP_ARGS --device cuda --dtype bfloat16 --loss-backend "${LOSS:-cuda}" \
    --reference "$REF" --json "$OUT/trainer_gpu.json"
  stage trainer_perf 150 $TRAIN perf --data "$PREP" --device cuda --dtype bfloat16 --loss-backend "${LOSS:-cuda}" \
    --arch qwen2.5-0.5b --tokens 65536 --micro-batch-tokens 16384 --json "$OUT/trainer_perf.json"
  # the same steps with LoRA r=16 adapters (model.lora): throughput and memory beside full fine-tuning
  stage trainer_lora 90 $TRAIN perf --data "$PREP" --device cuda --dtype bfloat16 --loss-backend "${LOSS:-cuda}" \
    --arch qwen2.5-0.5b --tokens 65536 --micro-batch-tokens 16384 --lora 16 --json "$OUT/trainer_lora.json"
fi
# tests: xdist (when there) spreads the per-config Triton compiles over the cores
XDIST=$(python3 -c "import xdist; print('-n 12')" 2>/dev/null)
stage tests 190 env ARL_FUZZ_EXAMPLES=1500 ARL_FUZZ_TRITON_EXAMPLES=30 python3 -m pytest -p no:cacheprovider -q \
  $XDIST --timeout 200 -rfE --junitxml="$OUT/junit.xml" \
  tests/ops/test_policy_loss_backends.py tests/ops/test_policy_loss_options.py tests/ops/test_fused_logprob.py \
  tests/test_tree_flex.py tests/test_park.py \
  "tests/ops/test_loss_fuzz.py::test_fuzz_backend_matches_reference[cuda]" \
  "tests/ops/test_loss_fuzz.py::test_fuzz_backend_matches_reference[triton]"
stage bench_logprob 80 python3 bench/bench_logprob.py --dtype bfloat16
# trainer.share_prefix on GPU (FlexAttention tree path) vs today's step, SmolLM2 calculator shape:
# its auto default stays off on GPU until this has measured it (docs/share_prefix.md)
stage bench_share_prefix 120 python3 bench/bench_trainer.py --shapes calc --reps 3
stage bench_policy_loss 240 python3 bench/bench_policy_loss.py
if [ "$(nvidia-smi -L 2> /dev/null | wc -l)" -ge 2 ]; then  # Ulysses all-to-alls over NCCL need two GPUs
  stage bench_sequence_parallel 120 python3 bench/bench_sequence_parallel.py --quick --device cuda
fi
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
# BFCL on the GPU (stage bfcl, not in the default STAGES): the model $BFCL_MODEL (an HF directory
# the node has: none travels with the tree) evaluated greedily on a slice of BFCL (AST, live AST,
# irrelevance, multi-turn), then two RL steps of the multi-turn recipe from it ($BFCL_CONFIG) and
# a check of their metrics.  It needs arl's whole install (vLLM, Ray, bfcl-eval: bash install.sh
# --bfcl), which this check's own stages do not, and a model with a 16k-token context (Qwen3).
case " $STAGES " in *" bfcl_eval "*|*" bfcl_train "*|*" bfcl_steps "*)
  BFCL_CONFIG=${BFCL_CONFIG:-examples/bfcl/gpu/qwen3-0.6b_multi.yaml}
  BFCL_RUN=${BFCL_RUN:-/tmp/arl_gpu_check_bfcl}
  # the recipe's limits (arl.eval puts its own defaults over a --config's)
  BFCL_LIMITS="env.kwargs.system_prompt=/no_think rollout.max_turn_tokens=512 rollout.max_total_tokens=16384 trainer.micro_batch_tokens=16384"
  MISSING=$(python3 -c "import importlib.util as u; print(' '.join(m for m in ('vllm', 'ray', 'bfcl_eval') if u.find_spec(m) is None))" 2>&1)
  if [ -z "${BFCL_MODEL:-}" ] || [ ! -f "$BFCL_MODEL/config.json" ]; then
    echo "[bfcl] skipped: BFCL_MODEL='${BFCL_MODEL:-}' is not an HF model directory" | tee -a "$OUT/summary.txt"
  elif [ -n "$MISSING" ]; then
    echo "[bfcl] skipped: this node lacks $MISSING (arl's install: bash install.sh --bfcl)" | tee -a "$OUT/summary.txt"
  else
    # shellcheck disable=SC2086
    stage bfcl_eval 300 python3 -m arl.eval --bench bfcl --model "$BFCL_MODEL" --config "$BFCL_CONFIG" \
      --categories simple_python,live_simple,irrelevance,multi_turn_base --limit 5 --out "$OUT/bfcl_eval.json" $BFCL_LIMITS
    rm -rf "$BFCL_RUN"
    stage bfcl_train 420 python3 -m arl.train --config "$BFCL_CONFIG" model.name_or_path="$BFCL_MODEL" \
      output_dir="$BFCL_RUN" trainer.steps=2 rollout.tasks_per_step=4 rollout.group_size=4 env.eval_tasks=0 \
      stabilizers.dynamic_sampling.enabled=false
    cp "$BFCL_RUN/metrics.jsonl" "$OUT/bfcl_metrics.jsonl" 2> /dev/null
    stage bfcl_steps 30 python3 - "$BFCL_RUN/metrics.jsonl" <<'PY'
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if r.get("step", 0) >= 1 and "train/loss" in r]
assert [r["step"] for r in steps] == [1, 2], f"expected RL steps 1 and 2, got {[r['step'] for r in steps]}"
assert all(math.isfinite(r["train/loss"]) and math.isfinite(r.get("train/grad_norm", 0.0)) for r in steps), steps
keys = ("rollout/reward_mean", "rollout/turns_mean", "rollout/tool_calls", "train/skipped_no_signal",
        "train/logp_abs_diff_vs_rollout", "train/grad_norm", "time/step_s")
print("; ".join(f"step {r['step']}: " + ", ".join(f"{k.split('/')[1]} {r.get(k, float('nan')):.4g}" for k in keys)
                for r in steps))
PY
  fi ;;
esac
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$OUT/summary.txt"

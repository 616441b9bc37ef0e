#!/usr/bin/env bash
# The GPU campaign in one command (issue 14 item 4): the CUDA tests and every benchmark's GPU
# rows, one report. Written for a lent device (tools' `run`: one call, a bounded time), so:
#   * nothing is installed: it runs from the checkout with PYTHONPATH (the device image has torch,
#     onnx, onnxscript, matplotlib, pytest; its torch may be older than the 2.13 pyproject asks for,
#     and the report says which one ran);
#   * every step has its own time limit, and a step that fails or runs out is reported, not fatal;
#   * everything lands in $OUT (default benchmarks/results/gpu): gpu_report.md (each step's command,
#     exit code, seconds and the end of its log) and gpu_results.tar.gz (every JSON the benchmarks
#     wrote) and gpu_logs.tar.gz (each step's whole log) -- three files, within what a device call
#     brings back.
# Usage:  OUT=$OUT bash benchmarks/gpu.sh            (measured on an H200, 2026-11-27: cuda_tests
#   40-55 s, hf_models_step ~18 s per process (16 of them), train_step 100 s; the rest unmeasured,
#   so well over one device call's 10 minutes: give a call a DEADLINE, the next one ONLY the rest)
#   DEADLINE=S   stop starting steps S seconds in, and cut each step's limit to what is left (a
#                device call's limit is fixed: what ran is reported rather than all being lost)
#   ONLY="a b"   run only the named steps (e.g. ONLY="cuda_tests hf_models_step")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
LOGS="$(mktemp -d)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# cuBLAS reads this when it makes its handle: the bit-identity tests run in deterministic mode
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
DEADLINE="${DEADLINE:-100000}"
PY="${PYTHON:-python3}"
Q=()
[[ "${QUICK:-0}" == 1 ]] && Q=(--quick)
REPORT="$OUT/gpu_report.md"

{
  echo "# metaopt GPU campaign, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
  "$PY" -c 'import sys, torch, onnx; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, "onnx", onnx.__version__, "gpu visible", torch.cuda.is_available())' 2>&1
  git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100
  echo '```'
} > "$REPORT"

step() {  # step NAME SECONDS COMMAND...: run it, append its outcome to the report
  local name=$1 limit=$2
  shift 2
  if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then return; fi
  local left=$((DEADLINE - SECONDS))
  if ((left < 20)); then
    printf '\n## %s: not run, %s s before the deadline\n' "$name" "$left" >> "$REPORT"
    echo "$name: not run (deadline)"
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  local status="ok"
  [[ $rc -ne 0 ]] && status="FAILED (exit $rc)"
  [[ $rc -eq 124 || $rc -eq 137 ]] && status="TIMED OUT after ${limit}s"
  {
    echo
    echo "## $name: $status, $((SECONDS - t0)) s"
    echo '`'"$*"'`'
    echo '```'
    tail -n "${TAIL:-40}" "$LOGS/$name.log"
    echo '```'
  } >> "$REPORT"
  echo "$name: $status ($((SECONDS - t0)) s)"
}

# CUDA tests: the CUDA-only module, the CUDA variants of the kernel and executor tests, the CUDA
# checkpoint test (they skip on a machine without a GPU, which is every CI run).
# test_cuda_training: grads against float64 (reference programs and zoo models), recompute and
# offload bit-identity with dropout, AMP, optimizer steps. xdist: the device has 16 cores.
# test_meta_executor's cuda test: steps after warm-up under torch.cuda.set_sync_debug_mode("error")
# (the device side of Executor("meta")'s proof that a step never reads the host).
step cuda_tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider -n "${XDIST:-6}" tests/runtime/test_cuda.py \
  tests/runtime/test_cuda_training.py tests/runtime/test_executor.py tests/fleet/test_io.py \
  tests/ops/test_kernels.py tests/runtime/test_meta_executor.py tests/ops/test_attention_fusion.py \
  -k "cuda or CUDA"
# The same HF GPT-2 / BERT / LLaMA and torchvision ResNet-50 on both sides (issue 14 item 3): eager,
# metaopt, torch checkpoint, metaopt recompute, a fresh process each; memory is
# torch.cuda.max_memory_allocated on both sides. One round only here (16 processes, ~18 s each on an H200: about 5 min).
step hf_models_step 360 "$PY" benchmarks/hf_models_step.py --device cuda --rounds 1 "${Q[@]}"
# Where a step's time goes, eager beside metaopt (torch.profiler: top kernels, launches, busy time)
step profile_step 150 "$PY" benchmarks/profile_step.py --device cuda --models gpt2,llama "${Q[@]}"
step train_step 120 "$PY" benchmarks/train_step.py --device cuda "${Q[@]}"
step executor_overhead 60 "$PY" benchmarks/executor_overhead.py --device cuda "${Q[@]}"
step recompute 150 "$PY" benchmarks/recompute.py --device cuda "${Q[@]}"
step offload 150 "$PY" benchmarks/offload.py --device cuda "${Q[@]}"
step memory_pictures 120 "$PY" benchmarks/memory_pictures.py --device cuda "${Q[@]}"
# ResNet-50's two bars from paired steps in one process (the CPU could not settle them)
step paired_step 150 "$PY" benchmarks/paired_step.py --device cuda --models resnet50 --processes 1 "${Q[@]}"
# The founding table measured: each row's predicted largest batch run once (budget under the card)
if [[ "${QUICK:-0}" == 1 ]]; then
  step paddle_table 150 "$PY" benchmarks/paddle_table.py --measure --layers 4 --budget-gib 16
else
  step paddle_table 240 "$PY" benchmarks/paddle_table.py --measure --budget-gib "${PADDLE_BUDGET_GIB:-32}"
fi

(cd benchmarks/results && tar czf - --exclude=gpu ./*.json 2>/dev/null) > "$OUT/gpu_results.tar.gz"
(cd "$LOGS" && tar czf - ./*.log 2>/dev/null) > "$OUT/gpu_logs.tar.gz"  # each step's whole log
echo "report: $REPORT"

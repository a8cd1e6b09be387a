#!/usr/bin/env bash
# The H200 run, in one `run` call: kernel checks and timings (bf16, real sizes), engine greedy
# outputs on GPU vs CPU/transformers (tiny models), then the throughput benchmark for both models x
# both workloads with kvfleet and the hf baseline. Writes $OUT/{log.txt,kernels.json,
# engine_check.json,results.json} and prints a short table last.
#
#   bash bench/gpu_run.sh [STAGE ...]     stages: kernels engine kvfleet async hf hf-issue profile host-profile
#                                         tp tp-check tp-bench (2+ GPUs)
#                                         (default: kernels engine kvfleet hf)
#   async scheduling A/B in one call:     bash bench/gpu_run.sh async
#   BUDGET_S=560 (stop starting new steps when they would not finish inside it)
#   two GPUs, two stage lists at once (each process its own OUT and runs folder):
#     CUDA_VISIBLE_DEVICES=1 OUT=$OUT/b bash bench/gpu_run.sh engine hf & CUDA_VISIBLE_DEVICES=0 OUT=$OUT/a bash bench/gpu_run.sh async; wait
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvfleet-out}
RUNS=${RUNS:-/tmp/kvfleet-runs-${CUDA_VISIBLE_DEVICES:-all}}
mkdir -p "$OUT" "$RUNS"
export PYTHONPATH="$PWD/engine:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
STAGES=${*:-kernels engine kvfleet hf}
LOG="$OUT/log.txt"
c=$(git rev-parse HEAD 2>/dev/null) && echo "$c" > bench/.commit

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
step() {  # step NAME MAX_SECONDS CMD...: run if it can finish in the budget (else skip), log everything
  local name=$1 max=$2; shift 2
  local rem; rem=$(left)
  if (( rem < 20 )); then echo "SKIP $name (budget left ${rem}s)" | tee -a "$LOG"; return; fi
  (( max > rem - 5 )) && max=$(( rem - 5 ))
  echo "=== $name (limit ${max}s, t+$(( $(date +%s) - START ))s)" | tee -a "$LOG"
  timeout -k 5 "$max" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc" | tee -a "$LOG"
  tail -n 25 "$LOG" | grep -E "^  |req in|error|Error" | tail -n 12
  return $rc
}
merge() {
  $PY - "$OUT/results.json" "$RUNS" <<'PYEOF'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[2]).glob("*.json"))}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs, indent=1))
PYEOF
}
bench() {  # bench NAME MAX_SECONDS ARGS...
  local name=$1 max=$2; shift 2
  step "bench $name" "$max" $PY -m kvfleet.engine.bench.throughput --load-format dummy --dtype bfloat16 \
    --out "$RUNS/$name.json" --label "$name" "$@"
  local rc=$?
  merge
  return $rc
}
bench_kv() {  # kvfleet at vLLM's H200 limits (1024 seqs); if that run fails, once more at 256 seqs
  local name=$1 max=$2; shift 2
  bench "$name" "$max" "$@"
  local rc=$?  # 124: out of time (retrying would only eat the budget); anything else: a failure
  if [[ ! -f "$RUNS/$name.json" && $rc -ne 124 ]]; then
    bench "$name-256seqs" "$max" "$@" --max-num-seqs 256 --max-num-batched-tokens 8192
  fi
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} 2>&1 | tee -a "$LOG"

for s in $STAGES; do case $s in
kernels)
  step kernels 120 $PY bench/gpu_kernels.py "$OUT/kernels.json"
  # the engine runs below use the decode tile this sweep found fastest
  [[ -s /tmp/kvfleet-decode-tile ]] && export KVFLEET_DECODE_TILE=$(cat /tmp/kvfleet-decode-tile)
  echo "KVFLEET_DECODE_TILE=${KVFLEET_DECODE_TILE:-default}" | tee -a "$LOG" ;;
engine) step engine 120 $PY bench/gpu_engine_check.py "$OUT/engine_check.json" ;;
kvfleet)  # the runs expected to gain most from the last change first, in case the budget runs out
  bench_kv kvfleet-llama-3.1-8b-chat-mix 150 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet
  bench_kv kvfleet-qwen3-0.6b-chat-mix 120 --model bench/models/qwen3-0.6b --workload chat-mix --backend kvfleet
  bench_kv kvfleet-llama-3.1-8b-random-1024-128 150 --model bench/models/llama-3.1-8b --workload random-1024-128 --backend kvfleet --decode-probe 256x1024
  bench_kv kvfleet-qwen3-0.6b-random-1024-128 120 --model bench/models/qwen3-0.6b --workload random-1024-128 --backend kvfleet --decode-probe 256x1024 ;;
async)  # A/B of async scheduling (kvfleet.engine.async_step) in one call: a GPU check (CUDA event + pinned
  # copy path) that its outputs equal the synchronous engine's, then each kvfleet run without and with
  # the flag back to back, Qwen3 first (host-bound: where the gain is predicted), Llama last
  step async-check 120 $PY -m pytest -q -p no:cacheprovider tests/engine/test_async_scheduling.py
  for run in "qwen3-0.6b random-1024-128 120" "qwen3-0.6b chat-mix 120" "llama-3.1-8b chat-mix 150" \
             "llama-3.1-8b random-1024-128 150"; do
    set -- $run
    bench_kv "kvfleet-$1-$2-sync" "$3" --model "bench/models/$1" --workload "$2" --backend kvfleet --no-async-scheduling
    bench_kv "kvfleet-$1-$2-async" "$3" --model "bench/models/$1" --workload "$2" --backend kvfleet --async-scheduling
  done ;;
hf)
  bench hf-llama-3.1-8b-random-1024-128 90 --model bench/models/llama-3.1-8b --workload random-1024-128 --backend hf --num-prompts 256 --hf-batch-size 64
  bench hf-llama-3.1-8b-chat-mix 240 --model bench/models/llama-3.1-8b --workload chat-mix --backend hf --num-prompts 64 --hf-batch-size 64
  bench hf-qwen3-0.6b-random-1024-128 60 --model bench/models/qwen3-0.6b --workload random-1024-128 --backend hf --num-prompts 256 --hf-batch-size 64
  # 64 chat-mix requests did not finish in 90 s (v1, v3): HF generate runs each batch to its longest output
  bench hf-qwen3-0.6b-chat-mix 120 --model bench/models/qwen3-0.6b --workload chat-mix --backend hf --num-prompts 32 --hf-batch-size 32 ;;
hf-issue)  # the issue's table only: Llama with the hf baseline
  bench hf-llama-3.1-8b-random-1024-128 90 --model bench/models/llama-3.1-8b --workload random-1024-128 --backend hf --num-prompts 256 --hf-batch-size 64
  bench hf-llama-3.1-8b-chat-mix 240 --model bench/models/llama-3.1-8b --workload chat-mix --backend hf --num-prompts 64 --hf-batch-size 64
  bench hf-qwen3-0.6b-random-1024-128 60 --model bench/models/qwen3-0.6b --workload random-1024-128 --backend hf --num-prompts 256 --hf-batch-size 64 ;;
profile) step profile 60 $PY bench/gpu_profile.py "$OUT/profile.txt" ;;
host-profile)  # cProfile of the host side of a Qwen3 chat-mix run (slowed by the profiler: not a reported figure)
  step host-profile 120 $PY -m kvfleet.engine.bench.throughput --load-format dummy --dtype bfloat16 \
    --model bench/models/qwen3-0.6b --workload chat-mix --backend kvfleet --out /tmp/kvfleet-profiled.json \
    --profile-host "$OUT/host-profile.txt" ;;
tp-check)  # issue 8 diagnosis on nvidia-h200-x2 (~6 min; found that the "hang" was the teardown, see NOTES). The link and NCCL
  # alone (peer access, transports via NCCL_DEBUG, host time per all-reduce with and without the flight recorder, an
  # all-reduce captured in a graph; NCCL's defaults: cuMem on); the direct NCCL binding eager and in a graph; then the
  # engine (which sets NCCL_CUMEM_ENABLE=0 unless set) at TP 2 against TP 1
  # and transformers: eager, with graphs over torch.distributed, with graphs over the direct binding. Every rank
  # dumps its stacks every 30 s while a check runs, so a hang shows where each waits.
  NCCL_DEBUG=INFO step tp-diag 75 $PY bench/gpu_tp_diag.py "$OUT/tp_diag.json"
  grep -E "via |NCCL version|P2P|SHM" "$LOG" | sort | uniq -c | head -20
  export KVFLEET_HANG_DUMP_S=30
  t="$PY -m pytest -q -s -p no:cacheprovider"
  # step limits above the tests' own timeouts (120 s, 90 s), so a hang ends in the test's stack dump
  step tp-direct-nccl 130 $t tests/engine/test_direct_nccl.py -k two_gpus
  step tp-engine-graphs-nccl 100 $t tests/engine/test_tensor_parallel.py -k "two_gpus_engine and cuda-graphs-nccl"
  step tp-engine-piecewise-nccl 100 $t tests/engine/test_tensor_parallel.py -k "two_gpus_engine and piecewise"
  step tp-engine-eager 100 $t tests/engine/test_tensor_parallel.py -k "two_gpus_engine and eager"
  step tp-engine-graphs-torch 100 $t tests/engine/test_tensor_parallel.py -k "two_gpus_engine and cuda-graphs and not nccl"
  unset KVFLEET_HANG_DUMP_S
  TORCH_NCCL_TRACE_BUFFER_SIZE=0 step tp-diag-no-flight-recorder 45 $PY bench/gpu_tp_diag.py "$OUT/tp_diag_nofr.json"
  ;;
tp-bench)  # the benchmarks alone (~5 min): TP_ENV holds settings other than the defaults, e.g.
  # TP_ENV="KVFLEET_TP_CUDA_GRAPHS=0" bash bench/gpu_run.sh tp-bench   (empty: the defaults)
  echo "TP benchmarks with: ${TP_ENV:-the defaults}" | tee -a "$LOG"
  PY="env ${TP_ENV:-} python3" bench kvfleet-llama-3.1-8b-chat-mix-tp2 100 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet --tensor-parallel-size 2 --decode-probe 256x1024
  bench kvfleet-llama-3.1-8b-chat-mix-tp1 75 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet --decode-probe 256x1024
  PY="env ${TP_ENV:-} python3" bench kvfleet-llama-3.1-70b-chat-mix-tp2 150 --model bench/models/llama-3.1-70b --workload chat-mix --backend kvfleet --tensor-parallel-size 2 --num-prompts 128 --decode-probe 64x1024 ;;
tp)  # issue 8 in one call (~6 min): the 2-GPU checks (engine at TP 2 vs TP 1 and transformers: eager, whole and
  # piecewise decode graphs, torch.distributed and direct NCCL all-reduces; the direct binding alone), then the
  # benchmarks: 8B chat-mix at TP 2 and TP 1, the 70B at TP 2, and 8B TP 2 with the direct NCCL all-reduce.
  # (results/tp-v2 ran this with the direct binding as the default and torch.distributed as the last row)
  export KVFLEET_HANG_DUMP_S=30
  t="$PY -m pytest -q -s -p no:cacheprovider"
  step tp-direct-nccl 130 $t tests/engine/test_direct_nccl.py -k two_gpus
  step tp-engine 200 $t tests/engine/test_tensor_parallel.py -k "two_gpus_engine"
  unset KVFLEET_HANG_DUMP_S
  bench kvfleet-llama-3.1-8b-chat-mix-tp2 100 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet --tensor-parallel-size 2 --decode-probe 256x1024
  bench kvfleet-llama-3.1-8b-chat-mix-tp1 75 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet --decode-probe 256x1024
  bench kvfleet-llama-3.1-70b-chat-mix-tp2 170 --model bench/models/llama-3.1-70b --workload chat-mix --backend kvfleet --tensor-parallel-size 2 --num-prompts 128 --decode-probe 64x1024
  PY="env KVFLEET_TP_ALLREDUCE=nccl python3" bench kvfleet-llama-3.1-8b-chat-mix-tp2-direct-nccl 100 --model bench/models/llama-3.1-8b --workload chat-mix --backend kvfleet --tensor-parallel-size 2 --decode-probe 256x1024 ;;
*) echo "unknown stage $s" ;;
esac; done

echo "=== summary (t+$(( $(date +%s) - START ))s)"
$PY bench/summarize.py "$OUT" 2>&1 | tee "$OUT/summary.txt"

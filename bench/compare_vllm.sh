#!/usr/bin/env bash
# Issue 16: kvfleet against vLLM 0.26.0 in one lease on the H200, in stages that fit separate `run` calls
# (each <= 10 min; results accumulate in $RUNS while the machine stays warm, and every call returns all of
# them so far as $OUT/results.tgz, plus log.txt and summary.md).
#
#   bash bench/compare_vllm.sh STAGE ...
#
# stages (minutes are estimates from bench/results/v3 and vLLM's start times in the issue):
#   wheels            copy the carried .whl-parts/partN to /tmp/whl; once all are there, install vLLM into
#                     /tmp/site (bench/vllm_wheels.sh install, ~1 min); never fails the call
#   profile           bench/gpu_profile_issue16.py: prefill attention at long contexts (our kernel's tiles
#                     against torch's flash SDPA), decode step at batch 1 against its floor, one long-prompt
#                     step and one batch-1 decode step under torch.profiler, Triton compiles after warm-up (~1.5)
#   step-profile      bench/gpu_step_profile.py: the burst's prefill step (8 x 1024), a long-prompt step (1 x 8192),
#                     the burst's whole work (300 x 1024/128, no HTTP) and its prompts to the first token only,
#                     through kvfleet, then vLLM in process, timed and under torch.profiler: kernel ms by kind side
#                     by side, the burst's decoding among them (~2 + ~3)
#   host-profile      bench/gpu_host_profile.py: host time against GPU time of eager mixed/prefill forwards
#                     per prefill kernel, launch costs, cProfile of a mixed forward (~1.5)
#   kv-diag           where mixed steps wait: bench/gpu_sync_probe.py (which allocator calls wait for queued
#                     GPU work), then kvfleet offline chat-mix with --sync-debug (labelled sync-debug) (~1.5)
#   shared-check      bench/gpu_shared_prefix.py: the shared-prefix decode pass against the reference in bf16, one
#                     layer's decode attention with and without it at the offline workloads' shapes, greedy
#                     tokens of an engine with it on and off (~1)
#   kv-llama          kvfleet offline, Llama-3.1-8B: the 2 public workloads + the 3 classes, one engine (~2.5)
#   vllm-llama        vLLM offline, same (~3.5; vLLM starts in ~1 min)
#   kv-qwen vllm-qwen the same for Qwen3-0.6B, public workloads only (~1 / ~2)
#   kv-online         kvfleet serve: start to healthy, then 0.5, 4, 12 req/s and 300 at once (~2.5)
#   vllm-online       vllm serve, same (~4.5: ~2 min to healthy)
#   kv-fp8 vllm-fp8   --quantization fp8, Llama-3.1-8B chat-mix and random-1024-128 (~2 / ~3)
#   burst-timeline    kvfleet serve's 300-at-once burst and the same 300 prompts offline, each with the engine's step
#                     timeline (KVFLEET_STEP_TIMELINE), summed up side by side by bench/step_timeline.py: are the
#                     steps slower online or do they start later (~3; step_timeline.txt into $OUT)
#   ab-nowarmup       kvfleet serve without the warm-up before /health (KVFLEET_WARMUP=0), 0.5 req/s only (~1)
#   ab-prefill        kvfleet long-prompt + shared-prefix once per setting in PREFILL_AB (~1.2 each): other
#                     Triton prefill tiles or kernels (PREFILL_AB="KVFLEET_PREFILL_KERNEL=v2
#                     KVFLEET_PREFILL_KERNEL=v2-paged"), each result labelled by its setting
#   ab-online         kvfleet serve once per setting in ONLINE_AB (~2 each), each labelled by its setting
#   ab-fp8            kvfleet --quantization fp8 once per setting in FP8_AB (~1.5 each)
#   ab-args           kvfleet offline WORKLOADS_AB once per setting in ARGS_AB, each engine flags
#                     (ARGS_AB="--block-size=64": a setting's flags joined by commas), labelled by its flags
#   ab-online-args    kvfleet serve once per setting in ARGS_AB (its flags on the server), labelled alike
#   attn-sweep        the prefill attention sweep alone, with SWEEP_CASES / SWEEP_TMA_TILES / SWEEP_BLOCK_SIZE
#                     passed through (bench/gpu_attention_sweep.py; ~1 for a few tiles of the 1k-prompt cases;
#                     into attn-sweep-b<block size>/)
#   gpu-tests         the `gpu`-marked tests (pytest -m gpu) under GPU_TESTS (default tests/engine: the decode graphs
#                     for short contexts against eager; the 2-GPU ones skip on one GPU) (~1)
#   decode-sweep      bench/gpu_decode_sweep.py: decode attention's tile (KVFLEET_DECODE_TILE: the default's one
#                     K/V buffer against 5-6 stages' two) at B = 16..256, 1k-4k keys, against the copy floor (~1;
#                     into decode-sweep/, its txt into $OUT)
#   penalties         bench/gpu_penalties.py: the sampler's penalties on their ids' columns against the [B, V]
#                     counts and masks they replaced, B = 64..1,024 over 128k logits, equal or status 1 (~0.5;
#                     into penalties/, its txt into $OUT)
#   gemm-sweep        bench/gpu_small_m_gemm_sweep.py alone: bf16 linear layers of Llama-3.1-8B at M = 1..16, cuBLAS
#                     against the Triton small-M GEMM (its default config and a grid around it), the crossover M
#                     for KVFLEET_SMALL_M_GEMM_MAX and a batch-1 step's estimate (~1.5; SWEEP_BUDGET_S, default 80,
#                     cuts the grid; into gemm-sweep/, its txt into $OUT)
#   gluon-check       bench/gpu_gluon_attention_check.py: the Gluon FA3-style prefill prototype against float32 and
#                     v2 on fresh prompts, then its speed (~2; a hung kernel ends the stage with status 3, what ran
#                     kept; into gluon-check/, its txt into $OUT)
#   gluon-engine      bench/gpu_gluon_engine_check.py: KVFLEET_PREFILL_KERNEL=gluon and gluon-chunks inside the
#                     attention op (steps like the long-prompt and shared-prefix workloads' against the torch op in
#                     float32, and against v2; status 1 if wrong), then Qwen3-0.6B greedy on long prompts in chunks
#                     with each choice (~2.5; into gluon-engine/)
#   sweeps            kernel sweeps: bench/gpu_attention_sweep.py (prefill attention kernels and tiles) and
#                     bench/gpu_fp8_sweep.py (FP8 matmul paths at small M), bench/gpu_decode_step.py (the
#                     decode step's kernel-count knobs, graph step at batch 1/4/16) (~6)
#   extras            bench/carry_extras.sh install: a carried .whl-srv into /tmp/srv (kvfleet serve's HTTP stack and
#                     gguf, before vLLM's wheels are in), carried SmolLM2 GGUF pieces into /tmp/gguf; never fails
#   real-check        bench/gpu_real_weights_check.py on the joined SmolLM2 GGUF (real weights): greedy tokens
#                     against transformers on the GPU, float32 identical or status 1, bfloat16 agreement (~1.5;
#                     into real-check/, its JSON into $OUT); SKIP while GGUF pieces are missing
#   first-tokens      bench/first_tokens.py over every online burst JSON in $RUNS (both servers): when the first
#                     tokens began and their pace, a late start told from slower work (first_tokens.txt into $OUT)
#   phases            bench/offline_phases.py for every offline row both engines ran with XARGS=--step-trace: the
#                     prefill phase (to the last first token) and the decode tail, the tail's steps by batch, kvfleet
#                     against vLLM (offline_phases.txt into $OUT)
#   summary           the comparison table of everything in $RUNS (also printed after every call)
#
# Knobs: BUDGET_S (default 570: stop starting stages that would not end inside it), KV_ENV (extra environment
# for kvfleet, e.g. "KVFLEET_PREFILL_TILE=128,64,8,3"), LABEL (tags kvfleet results of a non-default
# setting), WORKLOADS_LLAMA, WORKLOADS_QWEN, WORKLOADS_FP8, WORKLOADS_AB, LOADS (name:rate:requests,...),
# ONLINE_ARGS (more flags for the online stage), XARGS (more flags for every offline run: "--step-trace"),
# PREFILL_AB (space-separated settings, each VAR=VALUE[,VAR=VALUE...] for one run), ARGS_AB (space-separated settings, each --flag=V[,--flag=V...]),
# LLAMA/QWEN (model folders: a dry run on CPU takes tiny ones), PROFILE_MODEL (step-profile's and host-profile's;
# default LLAMA), STEP_PROFILE_ARGS (more flags for the kvfleet side of
# step-profile: "--dry" on CPU), STEP_PROFILE_SCENARIOS (both sides' scenarios, e.g. "long-prompts"; default all;
# results into step-profile-<model folder's name>/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvfleet-out}
RUNS=${RUNS:-/tmp/kvfleet-compare}
mkdir -p "$OUT" "$RUNS"
# /tmp/site: vLLM's wheels (bench/vllm_wheels.sh); /tmp/srv: .whl-srv (bench/carry_extras.sh), after vLLM's pins
export PYTHONPATH="$PWD/engine:$PWD/operator:/tmp/site:/tmp/srv${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s)
LOG="$OUT/log.txt"
LLAMA=${LLAMA:-bench/models/llama-3.1-8b}   # (overridable for a dry run on CPU with tiny models)
QWEN=${QWEN:-bench/models/qwen3-0.6b}
PROFILE_MODEL=${PROFILE_MODEL:-$LLAMA}   # the model step-profile and host-profile run (e.g. "$QWEN")
WORKLOADS_LLAMA=${WORKLOADS_LLAMA:-chat-mix random-1024-128 long-prompt shared-prefix parallel-sampling}
WORKLOADS_QWEN=${WORKLOADS_QWEN:-chat-mix random-1024-128}
WORKLOADS_FP8=${WORKLOADS_FP8:-chat-mix random-1024-128}
WORKLOADS_AB=${WORKLOADS_AB:-long-prompt shared-prefix}
PREFILL_AB=${PREFILL_AB:-KVFLEET_PREFILL_KERNEL=v2-paged}
ARGS_AB=${ARGS_AB:---block-size=64}
ONLINE_AB=${ONLINE_AB:-KVFLEET_GIL_SWITCH_INTERVAL_MS=0.5}
FP8_AB=${FP8_AB:-KVFLEET_FP8_SMALL_M_MAX=0}
KV_ENV=${KV_ENV:-}
LABEL=${LABEL:-}
# KVFLEET_COMMIT names the commit of the files that travelled (the copy's .git may point elsewhere)
c=${KVFLEET_COMMIT:-$(git rev-parse HEAD 2>/dev/null)} && echo "$c" > bench/.commit

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
step() {  # step NAME MAX_SECONDS CMD...: run if it can finish inside the budget, log everything
  local name=$1 max=$2; shift 2
  local rem; rem=$(left)
  if (( rem < max / 2 || rem < 30 )); then echo "SKIP $name (needs ~${max}s, ${rem}s left)" | tee -a "$LOG"; return 124; fi
  (( max > rem - 10 )) && max=$(( rem - 10 ))
  echo "=== $name (limit ${max}s, t+$(( $(date +%s) - START ))s)" | tee -a "$LOG"
  local from; from=$(wc -l < "$LOG")
  timeout -k 10 "$max" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name rc=$rc t+$(( $(date +%s) - START ))s" | tee -a "$LOG"
  tail -n +"$((from + 1))" "$LOG" | grep -E "out tok/s|healthy|TTFT|error|Error|Traceback|KV cache:|captured|warm-up|greedy check" \
    | tail -n 8
  return $rc
}
offline() {  # offline BACKEND MODEL MAX_S WORKLOADS... (extra flags in XARGS)
  local backend=$1 model=$2 max=$3; shift 3
  local envs=""; [[ $backend == kvfleet ]] && envs=$KV_ENV
  local label=(); [[ $backend == kvfleet && -n $LABEL ]] && label=(--label "$LABEL")
  step "$backend $(basename "$model") $*${XARGS:+ $XARGS}" "$max" env $envs $PY -m kvfleet.engine.bench.throughput \
    --backend "$backend" --model "$model" --load-format dummy --dtype bfloat16 --workloads "$@" \
    --out-dir "$RUNS" "${label[@]}" ${XARGS:-}
}
online() {  # online ENGINE MAX_S [flags]
  local engine=$1 max=$2; shift 2
  local envs=""; [[ $engine == kvfleet ]] && envs=$KV_ENV
  step "online $engine $*" "$max" env $envs $PY -m kvfleet.engine.bench.compare online --engine "$engine" \
    --model "$LLAMA" --out-dir "$RUNS" ${LOADS:+--loads "$LOADS"} ${ONLINE_ARGS:-} "$@"
}
setting_env() { echo "${1//,KVFLEET_/ KVFLEET_}"; }   # VAR=V[,VAR=V...] -> VAR=V VAR=V
setting_label() { echo "${1//KVFLEET_/}" | tr 'A-Z' 'a-z' | tr '_=,' '-.-'; }
args_label() { local a=${1//--/}; echo "$a" | tr '=,' '.-'; }   # --block-size=64 -> block-size.64
need_server() {   # kvfleet serve's HTTP stack comes with vLLM's wheels on the GPU image (it has no uvicorn of its own)
  local why; why=$($PY -c "import uvicorn, fastapi" 2>&1 | tail -n 1) && return 0
  echo "SKIP $1: kvfleet serve's HTTP stack does not import ($why): carry .whl-srv (extras) or vLLM's wheels" \
    | tee -a "$LOG"
  return 1
}
need_vllm() {
  if PYTHONPATH=/tmp/site $PY -c "import vllm" 2>/dev/null; then return 0; fi
  echo "SKIP $1: vLLM is not installed yet (carry the remaining .whl-parts and run the wheels stage)" | tee -a "$LOG"
  return 1
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${c:-unknown}; stages: $*; KV_ENV='${KV_ENV}' LABEL='${LABEL}'"
} 2>&1 | tee -a "$LOG"

for s in "$@"; do case $s in
wheels)
  bash bench/vllm_wheels.sh install 2>&1 | tee -a "$LOG" ;;
profile)
  step profile 180 env $KV_ENV $PY bench/gpu_profile_issue16.py "$RUNS/profile"
  cp "$RUNS/profile/profile.txt" "$OUT/" 2>/dev/null ;;
step-profile)
  sp="$RUNS/step-profile-$(basename "$PROFILE_MODEL")"
  scen=(); [[ -n ${STEP_PROFILE_SCENARIOS:-} ]] && scen=(--scenarios "$STEP_PROFILE_SCENARIOS")
  step "step-profile kvfleet" 240 env $KV_ENV $PY bench/gpu_step_profile.py run --engine kvfleet --model "$PROFILE_MODEL" \
    --out "$sp" "${scen[@]}" ${STEP_PROFILE_ARGS:-}
  need_vllm "$s" && step "step-profile vllm" 300 $PY bench/gpu_step_profile.py run --engine vllm --model "$PROFILE_MODEL" \
    --out "$sp" "${scen[@]}" \
    && $PY bench/gpu_step_profile.py compare "$sp" >> "$LOG" 2>&1
  cp "$sp/step_profile_compare.txt" "$OUT/" 2>/dev/null ;;
host-profile)
  step host-profile 200 env $KV_ENV $PY bench/gpu_host_profile.py "$RUNS/host-profile" "$PROFILE_MODEL"
  cp "$RUNS/host-profile/host_profile.txt" "$OUT/" 2>/dev/null ;;
kv-diag)
  step sync-probe 60 env $KV_ENV $PY bench/gpu_sync_probe.py "$RUNS/sync-probe"
  cp "$RUNS/sync-probe/sync_probe.txt" "$OUT/" 2>/dev/null
  LABEL=sync-debug XARGS="--sync-debug" offline kvfleet "$LLAMA" 150 chat-mix ;;
kv-llama) offline kvfleet "$LLAMA" 240 $WORKLOADS_LLAMA ;;
vllm-llama) need_vllm "$s" && offline vllm "$LLAMA" 330 $WORKLOADS_LLAMA ;;
kv-qwen) offline kvfleet "$QWEN" 120 $WORKLOADS_QWEN ;;
vllm-qwen) need_vllm "$s" && offline vllm "$QWEN" 180 $WORKLOADS_QWEN ;;
kv-online) need_server "$s" && online kvfleet 240 ${LABEL:+--label "$LABEL"} ;;
vllm-online) need_vllm "$s" && online vllm 400 --health-limit-s 300 ;;
kv-fp8) XARGS="--quantization fp8" offline kvfleet "$LLAMA" 200 $WORKLOADS_FP8 ;;
vllm-fp8) need_vllm "$s" && XARGS="--quantization fp8" offline vllm "$LLAMA" 260 $WORKLOADS_FP8 ;;
burst-timeline)
  # the 300-at-once burst online and the same 300 prompts in process, each with the engine's step timeline
  need_server "$s" && KV_ENV="$KV_ENV KVFLEET_STEP_TIMELINE=$RUNS/timeline-online-burst.jsonl" LOADS=burst:inf:300 \
    online kvfleet 150 --label timeline
  KV_ENV="$KV_ENV KVFLEET_STEP_TIMELINE=$RUNS/timeline-offline-burst.jsonl" LABEL=timeline \
    XARGS="--num-prompts 300 --max-num-batched-tokens 8192" \
    offline kvfleet "$LLAMA" 120 random-1024-128
  $PY bench/step_timeline.py compare "$RUNS/timeline-online-burst.jsonl" "$RUNS/timeline-offline-burst.jsonl" \
    --json "$RUNS/step_timeline.json" > "$OUT/step_timeline.txt" 2>&1
  tee -a "$LOG" < "$OUT/step_timeline.txt" ;;
ab-nowarmup)
  need_server "$s" && KV_ENV="$KV_ENV KVFLEET_WARMUP=0" LOADS=low:0.5:16 online kvfleet 120 --label nowarmup ;;
ab-prefill)
  for setting in $PREFILL_AB; do
    KV_ENV="$KV_ENV $(setting_env "$setting")" LABEL=$(setting_label "$setting") \
      offline kvfleet "$LLAMA" 150 $WORKLOADS_AB
  done ;;
ab-online)
  need_server "$s" && for setting in $ONLINE_AB; do
    KV_ENV="$KV_ENV $(setting_env "$setting")" online kvfleet 240 --label "$(setting_label "$setting")"
  done ;;
ab-fp8)
  for setting in $FP8_AB; do
    KV_ENV="$KV_ENV $(setting_env "$setting")" LABEL=$(setting_label "$setting") XARGS="--quantization fp8" \
      offline kvfleet "$LLAMA" 200 $WORKLOADS_FP8
  done ;;
ab-args)
  for setting in $ARGS_AB; do
    LABEL=$(args_label "$setting") XARGS="${setting//,/ }" offline kvfleet "$LLAMA" 200 $WORKLOADS_AB
  done ;;
ab-online-args)
  need_server "$s" && for setting in $ARGS_AB; do
    ONLINE_ARGS="${ONLINE_ARGS:-} ${setting//,/ }" online kvfleet 240 --label "$(args_label "$setting")"
  done ;;
attn-sweep)
  b=${SWEEP_BLOCK_SIZE:-16}
  step "attention-sweep block $b" 150 env $KV_ENV $PY bench/gpu_attention_sweep.py "$RUNS/attn-sweep-b$b"
  cp "$RUNS/attn-sweep-b$b/attention_sweep.txt" "$OUT/attention_sweep_b$b.txt" 2>/dev/null ;;
gpu-tests)
  step gpu-tests 150 env $KV_ENV $PY -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/engine} ;;
decode-sweep)
  step decode-sweep 120 env $KV_ENV $PY bench/gpu_decode_sweep.py "$RUNS/decode-sweep"
  cp "$RUNS/decode-sweep/decode_sweep.txt" "$OUT/" 2>/dev/null ;;
penalties)
  step penalties 90 env $KV_ENV $PY bench/gpu_penalties.py "$RUNS/penalties"
  cp "$RUNS/penalties/penalties.txt" "$OUT/" 2>/dev/null ;;
gemm-sweep)
  step gemm-sweep 150 env $KV_ENV $PY bench/gpu_small_m_gemm_sweep.py "$RUNS/gemm-sweep"
  cp "$RUNS/gemm-sweep/small_m_gemm_sweep.txt" "$OUT/" 2>/dev/null ;;
gluon-check)
  step gluon-check 150 env $KV_ENV $PY bench/gpu_gluon_attention_check.py "$RUNS/gluon-check"
  cp "$RUNS/gluon-check/gluon_attention_check.txt" "$OUT/" 2>/dev/null ;;
gluon-engine)
  step gluon-engine 180 env $KV_ENV $PY bench/gpu_gluon_engine_check.py "$RUNS/gluon-engine" "$QWEN" ;;
sweeps)
  step attention-sweep 150 env $KV_ENV $PY bench/gpu_attention_sweep.py "$RUNS/attn-sweep"
  cp "$RUNS/attn-sweep/"*.txt "$OUT/" 2>/dev/null
  step fp8-sweep 120 env $KV_ENV $PY bench/gpu_fp8_sweep.py "$RUNS/fp8-sweep"
  cp "$RUNS/fp8-sweep/"*.txt "$OUT/" 2>/dev/null
  step decode-step 150 env $KV_ENV $PY bench/gpu_decode_step.py "$RUNS/decode-step" "$LLAMA"
  cp "$RUNS/decode-step/"*.txt "$OUT/" 2>/dev/null ;;
shared-check)
  step shared-check 180 env $KV_ENV $PY bench/gpu_shared_prefix.py "$RUNS/shared-check" "$QWEN"
  cp "$RUNS/shared-check/"*.json "$OUT/" 2>/dev/null ;;
extras)
  bash bench/carry_extras.sh install 2>&1 | tee -a "$LOG" ;;
real-check)
  gguf=$(bash bench/carry_extras.sh install 2>&1 | tee -a "$LOG" | tail -n 1)
  if [[ -f $gguf ]]; then
    step real-check 240 env $KV_ENV $PY bench/gpu_real_weights_check.py "$RUNS/real-check" "$gguf"
    cp "$RUNS/real-check/real_weights_check.json" "$OUT/" 2>/dev/null
  else
    echo "SKIP real-check: the SmolLM2 GGUF is not here yet ($gguf)" | tee -a "$LOG"
  fi ;;
first-tokens)
  runs=("$RUNS"/*-online-burst*.json)
  if [[ -e ${runs[0]} ]]; then
    $PY bench/first_tokens.py compare "${runs[@]}" --json "$RUNS/first_tokens.json" > "$OUT/first_tokens.txt" 2>&1
    tee -a "$LOG" < "$OUT/first_tokens.txt"
  else
    echo "SKIP first-tokens: no online burst in $RUNS yet" | tee -a "$LOG"
  fi ;;
phases)
  # every offline row both engines ran with --step-trace (XARGS=--step-trace): prefill phase and tail side by side
  : > "$OUT/offline_phases.txt"
  for kv in "$RUNS"/kvfleet-*.json; do
    vl=${kv/\/kvfleet-/\/vllm-}
    [[ -e $vl ]] && grep -q '"step_trace"' "$kv" && grep -q '"step_trace"' "$vl" || continue
    row=$(basename "$kv" .json); row=${row#kvfleet-}
    { echo "## $row"; $PY bench/offline_phases.py compare "$kv" "$vl"; echo; } >> "$OUT/offline_phases.txt" 2>&1
  done
  if [[ -s $OUT/offline_phases.txt ]]; then tee -a "$LOG" < "$OUT/offline_phases.txt"
  else echo "SKIP phases: no row of both engines with a step trace in $RUNS (run them with XARGS=--step-trace)" \
    | tee -a "$LOG"; fi ;;
summary) ;;
*) echo "unknown stage $s" | tee -a "$LOG" ;;
esac; done

echo "=== summary (t+$(( $(date +%s) - START ))s)"
$PY -m kvfleet.engine.bench.compare summary "$RUNS" --out "$OUT/summary.md" 2>&1 | tail -n 60
tar czf "$OUT/results.tgz" -C "$RUNS" . 2>/dev/null
ls -la "$OUT"

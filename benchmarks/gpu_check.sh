#!/usr/bin/env bash
# `make gpu-check`: on a machine with CUDA (the device tool runs it over a copy of the tree). Installs the
# project offline, runs the GPU tests, then the kernel and decode benchmarks; results go under $OUT
# (default: benchmarks/results/gpu). QUICK=1: small sizes. PEFT=0: skip the PEFT comparison.
# STEPS picks steps (default "tests kernels sweep resources decode full profile peft"; "resources" lists the
# LoRA kernels' registers, shared memory and occupancy; "full" is the decode step without the few-adapter
# graphs, --graph-few-adapters 0; also "serial" (decode with each LoRA added after its GEMM instead of on a side
# stream, --no-lora-side-stream), "mixed" (eager mixed steps by kernel, decode.py --mixed), "ncu" (Nsight
# Compute on the distinct-adapter LoRA expands), "gemv" (kernel_bench.py --lora-gemv-sweep), "prefill"
# (prefill.py: one prefill layer's kernels at 8,192 tokens), "sharing",
# "smollm2" (offline.py: the default model's shape with random bf16 weights and its demo adapters, decode at
# batch 64 and 256, against transformers + PEFT), "throughput", "serving", which pass
# $THROUGHPUT_ARGS / $SERVING_ARGS on, and "engine_throughput" (issue 22's six offline workloads against
# vLLM's figures; $ENGINE_THROUGHPUT_ARGS, e.g. "--workloads decode_base,prefill"), "step_host" (step_host.py:
# the host's work per decode step and per chunked-prefill step beside the same decodes; $STEP_HOST_ARGS, e.g.
# "--idle-ms 20"), "graph_launch" (experiments/graph_launch.py: host µs of graph replays; $GRAPH_LAUNCH_GROUPS,
# default "gate_up"), "stage_host" (experiments/stage_host.py --device cuda: host µs of a graphed step's build and
# staging, $STAGE_HOST_ARGS; "stage_host_before" runs this tree's script over the .device-before tree's
# installed package), and "engine_throughput_before" (the same on the tree `make device-before REV=...`
# extracted into .device-before, before this tree's run, for a before/after pair in one command),
# "copy_host" (experiments/copy_host.py: host µs of a step's device copies, back to back, after a synchronize
# and after an idle), "serving_switches" (serving.py with issue 22's two switches on and off, alternated),
# "serving_before" (serving.py there) and "step_host_before" (this tree's step_host.py over the .device-before
# tree's package). At most 8 files come back from the device tool: pick steps to fit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
STEPS="${STEPS:-tests kernels sweep resources decode full profile peft}"
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
has tests && run gpu_tests python -m pytest -m gpu -q -rs -x tests/kernels tests/e2e tests/engine
has kernels && run kernels python benchmarks/kernel_bench.py "${quick[@]}" --out "$OUT/kernels.json"
has sweep && run lora_sweep python benchmarks/kernel_bench.py --lora-sweep --out "$OUT/lora_sweep.json"
has gemv && run lora_gemv_sweep python benchmarks/kernel_bench.py --lora-gemv-sweep --out "$OUT/lora_gemv_sweep.json"
has resources && run kernel_resources python benchmarks/experiments/kernel_resources.py \
  --out "$OUT/kernel_resources.json"
# Nsight Compute on the distinct-adapter layer's four expands: occupancy, stall reasons, speed of light.
has ncu && run ncu_lora_expand ncu --clock-control none --kernel-name regex:_lora_expand_kernel --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
  python benchmarks/experiments/kernel_resources.py --adapters 64 --out "$OUT/kernel_resources_ncu.json"
has decode && run decode python benchmarks/decode.py "${quick[@]}" --out "$OUT/decode.json"
has full && run decode_full python benchmarks/decode.py "${quick[@]}" --graph-few-adapters 0 \
  --out "$OUT/decode_full.json"
has serial && run decode_serial python benchmarks/decode.py "${quick[@]}" --no-lora-side-stream \
  --out "$OUT/decode_serial.json"
has mixed && run decode_mixed python benchmarks/decode.py "${quick[@]}" --mixed --out "$OUT/decode_mixed.json"
has prefill && run prefill python benchmarks/prefill.py --out "$OUT/prefill.json"
has profile && run decode_profile python benchmarks/decode.py "${quick[@]}" --profile --out "$OUT/decode_profile.json"
has peft && [ "${PEFT:-1}" = 1 ] && run vs_peft python benchmarks/decode.py "${quick[@]}" --vs-peft --out "$OUT/decode_vs_peft.json"
has smollm2 && run offline_smollm2 python benchmarks/offline.py --device cuda --batches 64,256 --prompt-len 16 \
  --new-tokens 256 --random-weights benchmarks/smollm2_config.json --out "$OUT/offline_smollm2_cuda.json"
has sharing && run sharing python benchmarks/sharing.py --device cuda --out "$OUT/sharing_cuda.json"
# shellcheck disable=SC2086  # the ARGS variables hold several words on purpose
has throughput && run throughput python benchmarks/throughput.py --device cuda ${THROUGHPUT_ARGS:-} \
  --out "$OUT/throughput_cuda.json"
# The same workloads (and the serving rates) on the tree of `make device-before` first, then this tree is
# installed again.
# shellcheck disable=SC2086
if has engine_throughput_before || has serving_before || has step_host_before || has stage_host_before; then
  [ -d .device-before ] || { echo "!! the *_before steps need .device-before (make device-before)"; exit 1; }
  OUT="$(cd "$OUT" && pwd)"                      # absolute: these steps run inside .device-before
  cd .device-before && python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
  has engine_throughput_before && run engine_throughput_before python benchmarks/engine_throughput.py \
    "${quick[@]}" --device cuda ${ENGINE_THROUGHPUT_ARGS:-} --out "$OUT/engine_throughput_before.json"
  has serving_before && run serving_before python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} \
    --out "$OUT/serving_cuda_before.json"
  # This tree's scripts (the before tree may lack them or their options), over the before tree's package.
  has step_host_before && run step_host_before python ../benchmarks/step_host.py "${quick[@]}" --device cuda \
    ${STEP_HOST_ARGS:-} --out "$OUT/step_host_before.json"
  has stage_host_before && run stage_host_before python ../benchmarks/experiments/stage_host.py "${quick[@]}" \
    --device cuda ${STAGE_HOST_ARGS:-} --out "$OUT/stage_host_before.json"
  cd .. && python -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
fi
# shellcheck disable=SC2086
has engine_throughput && run engine_throughput python benchmarks/engine_throughput.py "${quick[@]}" --device cuda \
  ${ENGINE_THROUGHPUT_ARGS:-} --out "$OUT/engine_throughput.json"
# shellcheck disable=SC2086
has step_host && run step_host python benchmarks/step_host.py "${quick[@]}" --device cuda ${STEP_HOST_ARGS:-} \
  --out "$OUT/step_host.json"
# shellcheck disable=SC2086
has stage_host && run stage_host python benchmarks/experiments/stage_host.py "${quick[@]}" --device cuda \
  ${STAGE_HOST_ARGS:-} --out "$OUT/stage_host.json"
has copy_host && run copy_host python benchmarks/experiments/copy_host.py "${quick[@]}" --out "$OUT/copy_host.json"
has graph_launch && run graph_launch python benchmarks/experiments/graph_launch.py \
  --groups "${GRAPH_LAUNCH_GROUPS:-gate_up}" --out "$OUT/graph_launch.json"
# shellcheck disable=SC2086
has serving && run serving python benchmarks/serving.py --device cuda ${SERVING_ARGS:-} --out "$OUT/serving_cuda.json"
# Issue 22's two switches off (the synchronous engine, eager mixed steps) against the defaults, alternated for
# $SERVING_ROUNDS rounds (default 2) on one machine; $SERVING_ARGS as above.
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

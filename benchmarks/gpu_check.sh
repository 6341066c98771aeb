#!/usr/bin/env bash
# `make gpu-check`: on a machine with CUDA (the device tool runs it over a copy of the tree). Installs the
# project offline, runs the GPU tests, then the kernel and decode benchmarks; results go under $OUT
# (default: benchmarks/results/gpu). Set QUICK=1 for small sizes, PEFT=0 to skip the PEFT comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
status=0
run() { echo "+ $*"; "$@" || status=1; }
quick=(); [ "${QUICK:-0}" = 1 ] && quick=(--quick)

run pip install --quiet --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
run python -m pytest -m gpu -q -rs tests/kernels tests/e2e 2>&1 | tee "$OUT/gpu_tests.txt"
run python benchmarks/kernels.py "${quick[@]}" --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.txt"
run python benchmarks/decode.py "${quick[@]}" --out "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt"
if [ "${PEFT:-1}" = 1 ]; then
  run python benchmarks/decode.py "${quick[@]}" --vs-peft --out "$OUT/decode_vs_peft.json" 2>&1 | tee "$OUT/vs_peft.txt"
fi
exit $status

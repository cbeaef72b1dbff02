# The commands of the README: `make test`, `make demo` and `make bench-quick`. Each sets
# up .venv on a fresh machine. Torch comes from $(TORCH) and is installed only when it is missing, so
# that CI can pin the CPU wheel (TORCH=torch==2.13.0) instead of pulling CUDA packages.
PY ?= python3
TORCH ?= torch
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip

.PHONY: install test lint demo bench bench-quick gpu-wheels clean

$(PYTHON):
	$(PY) -m venv $(VENV)

install: $(PYTHON)
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH)"
	$(PIP) install -q "scikit-build-core>=0.10" "nanobind>=2.4"
	$(PIP) install -q --no-build-isolation -e ".[test]"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PYTHON) -m pytest --durations=30

demo: install
	$(PYTHON) -m snapcore.demo

bench: install
	$(PIP) install -q -e ".[bench]" --no-build-isolation
	$(PYTHON) benchmarks/bench_save.py
	$(PYTHON) benchmarks/simulate.py

# Every quick scenario of the benchmark harness (python -m benchmarks), under two minutes:
# one JSON per scenario and PNG plots in benchmarks/results/<date>-<host>/.
bench-quick: install
	$(PIP) install -q -e ".[bench]" --no-build-isolation
	$(PYTHON) -m benchmarks run --quick

# What benchmarks/gpu_check.sh needs on the GPU machine and its image lacks (it has Python
# 3.12 and reaches no package index): zstandard's wheel, into .whl/ (git-ignored), which
# the device call carries.
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 -d .whl zstandard fastjsonschema

clean:
	rm -rf build $(VENV)

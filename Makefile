# `make demo` and `make test` each create the environment (.venv) first. On a machine without an
# NVIDIA GPU the environment gets a CPU build of torch, never a multi-GB CUDA build.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAS_GPU),yes)
TORCH_SPEC ?= torch>=2.4
else
TORCH_SPEC ?= torch==2.13.0+cpu
endif
# Extra pip options for the torch install (for example an index that serves CPU builds).
TORCH_PIP_ARGS ?=

.PHONY: env demo test bench bench-quick clean

env: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	$(PY) -c "import torch, lightning, lightning_crossbow; print('torch', torch.__version__, '| lightning', lightning.__version__, '| cuda', torch.cuda.is_available())"
	touch $@

demo: env
	$(PY) examples/train.py

test: env
	$(PY) -m pytest -q

# Benchmarks run one after another (never two at once on a small machine), then the report:
# benchmarks/RESULTS.md and benchmarks/plots/*.png from the JSON in benchmarks/out/
# (bench-quick's report goes to benchmarks/out/quick/, leaving the committed results alone).
bench: env
	$(PY) benchmarks/hardware.py
	$(PY) benchmarks/accuracy.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/tuner.py
	$(PY) benchmarks/heterogeneous.py
	$(PY) benchmarks/heterogeneous.py --batch-size 64 --throughput-only --out benchmarks/out/heterogeneous_b64.json
	$(PY) benchmarks/report.py

bench-quick: env
	$(PY) benchmarks/hardware.py --quick
	$(PY) benchmarks/accuracy.py --quick
	$(PY) benchmarks/throughput.py --quick
	$(PY) benchmarks/distributed.py --quick
	$(PY) benchmarks/tuner.py --quick
	$(PY) benchmarks/heterogeneous.py --quick
	$(PY) benchmarks/report.py --quick

clean:
	rm -rf $(VENV) lightning_logs outputs multirun .pytest_cache

# Two entry points (see README): `make demo` and `make test`. Both create .venv on
# first use. On a machine without CUDA the CPU build of torch is installed first
# (`pip install torch==2.13.0` resolves to a local CPU wheel here), so nothing pulls a
# multi-GB CUDA build; a machine that already has torch (e.g. a GPU box) keeps its own.
# DeepSpeed (for the ALST peer's smoke test) goes to $(VENV)/alst, apart from the venv's
# packages: where it imports, Accelerate imports it on every save_pretrained, which costs
# seconds and prints a warning on a CPU. The tests put that folder on the path of the one
# benchmark process that needs it.
# Each `make demo` trains a fresh run in runs/demo-DATE-TIME, so an earlier demo run is
# never replaced; continue an interrupted one with
# `.venv/bin/longtrain train --out runs/demo-DATE-TIME --resume`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q "torch>=2.6"; \
	  else $(PY) -m pip install -q "torch==2.13.0"; fi; fi
	$(PY) -m pip install -q -e ".[test,lora,plot]"
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/alst "deepspeed>=0.19" hjson py-cpuinfo msgpack einops ninja \
	  || echo "DeepSpeed not installed: the ALST peer's smoke test will skip"
	touch $(STAMP)

install: $(STAMP)

DEMO_OUT ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)

demo: $(STAMP)
	$(VENV)/bin/longtrain train --out $(DEMO_OUT)

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks scripts examples
	$(PY) -m pytest -n 2 --dist worksteal

clean:
	rm -rf $(VENV) runs

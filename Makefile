# ds3d developer entry points. `make demo` runs the main job on embedded defaults; `make test`
# runs the test suite. Both install what they need into .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export DS_ACCELERATOR ?= cpu
export DS_BUILD_OPS := 0

.PHONY: setup warm test test-fast demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # the CPU wheel; a bare "torch" pulls CUDA
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# DeepSpeed JIT-builds its shared-memory comm op (~40 s) on first init; build it once, up front,
# so parallel first inits do not queue on the build lock inside tests.
warm: setup
	$(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

test: warm
	$(BIN)/pytest -q -ra --durations=40

test-fast: setup
	$(BIN)/pytest -q -ra -m "not slow"

demo: warm
	$(BIN)/python -m ds3d.daemon.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

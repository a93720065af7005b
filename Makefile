# ds3d developer entry points. `make demo` runs the main job on embedded defaults; `make test`
# runs the test suite. Both install what they need into .venv first (idempotent).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export DS_ACCELERATOR ?= cpu
export DS_BUILD_OPS := 0

# Tests run in two tiers under pytest-xdist. The first, 2-wide: the unit tests (no processes
# of ds3d's own) and the S3-only integration modules, which spend their time waiting on
# object-store servers (moto, Ceph RGW, outages and retries) rather than computing. The second,
# 3-wide: everything that starts training processes (ds3dd with real workers, the agent, the
# drills), a module per xdist worker (module fixtures are shared): the workers are forked from
# a preloaded forkserver (daemon/agent.py), so these tests mostly wait on the jobs they drive
# (timeouts, outages, polls): 2-wide they kept the 2 cores ~40% busy (19.5 min), 3-wide they
# take ~15.5 min, and each must hold under two busy loops, a heavier load than a third test.
# The `timing` tests (wall-clock bounds) then run alone. Each test's time is kept in
# build/test-results/*.xml (JUnit), to see where the tiers spend theirs. Every part always runs; `make test`
# fails if any fails (pytest's "no tests collected" excepted for the timing run).
PARALLEL_TESTS := tests/unit tests/integration/test_s3_conformance.py \
	tests/integration/test_s3_commit.py tests/integration/test_s3_rgw.py \
	tests/integration/test_multipart_resume.py tests/integration/test_upload_crash.py
# mypy resolves `ds3d.daemon`, `ds3d.checkpoints`... through links to the top-level folders:
# the editable install maps them with an import hook, which mypy cannot follow.
TYPECHECK := build/typecheck

.PHONY: setup warm bytecode lint test test-fast demo clean

setup: $(VENV)/.installed

# The installed packages are byte-compiled once, all cores, after pip (which installs without
# compiling, .ci/run): where PYTHONDONTWRITEBYTECODE is set, as on the CI VM, an import writes
# no .pyc, and every process compiled again what it imported without one (a forkserver's
# torch._dynamo, DeepSpeed and the trainer: 4.9 instead of 2.9 CPU-s, at every agent start).
# One file of torch's test helpers is Python 3.12 syntax: compile errors are not fatal.
$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # the CPU wheel; a bare "torch" pulls CUDA
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -c 'import compileall, sysconfig; \
		compileall.compile_dir(sysconfig.get_path("purelib"), quiet=2, workers=0)'
	touch $@

# ds3d's own modules, byte-compiled for the same reason (each ds3dd, ds3dctl, agent and worker
# imports them); only what changed since the last run is compiled again.
bytecode: setup
	$(BIN)/python -m compileall -q -j 0 daemon trainer checkpoints protos

# DeepSpeed JIT-builds its shared-memory comm op (~40 s) on first init; build it once, up front,
# so parallel first inits do not queue on the build lock inside tests. A stale build lock in the
# cache (a process killed while it held it) is cleared first: torch would wait on it forever.
warm: setup
	$(BIN)/python -m ds3d.daemon.extension_cache

lint: setup
	@mkdir -p $(TYPECHECK)/ds3d
	@for d in daemon trainer checkpoints; do ln -sfn ../../../$$d $(TYPECHECK)/ds3d/$$d; done
	@ln -sfn ../../../protos/ds3d/v1 $(TYPECHECK)/ds3d/v1
	$(BIN)/ruff check .
	$(BIN)/mypy

test: warm lint bytecode
	@status=0; \
	$(BIN)/pytest -q -ra -n 2 -m "not timing" --durations=20 $(PARALLEL_TESTS) \
		--junitxml=build/test-results/unit-and-s3.xml || status=1; \
	$(BIN)/pytest -q -ra -n 3 --dist loadfile -m "not timing" --durations=40 \
		$(addprefix --ignore=,$(PARALLEL_TESTS)) tests \
		--junitxml=build/test-results/processes.xml || status=1; \
	$(BIN)/pytest -q -ra -m timing tests; rc=$$?; \
	[ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=1; \
	exit $$status

test-fast: setup
	$(BIN)/pytest -q -ra -m "not slow"

demo: warm
	$(BIN)/python -m ds3d.daemon.demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

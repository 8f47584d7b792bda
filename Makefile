# The two commands a fresh machine needs: `make demo` and `make test`.
# Both bootstrap .venv idempotently. On a machine without CUDA, torch==2.13.0 (the CPU build)
# is installed before the package, so that the package's `torch` requirement is already met
# and pip never pulls a multi-GB CUDA build.

PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.mqnc-installed
PYTEST_ARGS ?=

.PHONY: venv test test-long demo lint format env clean compat notebooks

# Plain `make` is `make venv`: the environment, with the package and its extras installed.
.DEFAULT_GOAL := venv

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade --quiet pip

$(STAMP): $(VPY) pyproject.toml
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA device found: installing the package with its default torch"; \
		$(VPY) -m pip install --quiet -e '.[test,hf,notebooks,dev,fast]'; \
	else \
		echo "No CUDA device: installing torch==2.13.0 (CPU build) first"; \
		$(VPY) -m pip install --quiet torch==2.13.0; \
		$(VPY) -m pip install --quiet -e '.[test,hf,notebooks,dev,sm90,fast]'; \
	fi
	@touch $(STAMP)

venv: $(STAMP)

# `make test`: the suite less the long tier (correctness/conftest.py LONG_TIER, the GPU scripts'
# dry runs), on TEST_WORKERS pytest-xdist workers (one torch thread each), a test file per worker
# so that module fixtures are built once; TEST_WORKERS=0 runs it in one process. `make
# test-long`: the long tier alone, one fixture per worker. CI runs both. docs/testing-time.md.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VPY) -m pytest correctness -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-long: $(STAMP)
	$(VPY) -m pytest correctness -q -m long -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/mqnc demo

env: $(STAMP)
	$(VENV)/bin/mqnc env

# `make notebooks`: execute notebooks/*.ipynb in place, so that they are stored with their outputs
# (figures as PNG) from the repository's results file and the default model and fabric
# (correctness/test_notebooks.py checks that the stored outputs are current).
notebooks: $(STAMP)
	env -u MQNC_RESULTS -u MQNC_FIG_DIR -u MQNC_MODEL -u MQNC_FABRIC MPLBACKEND=Agg \
		$(VPY) -m jupyter nbconvert --to notebook --execute --inplace \
		--ExecutePreprocessor.record_timing=False notebooks/*.ipynb

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The launch-exact sm_90 compile tests (every production variant; the NVSHMEM device kernels at
# PE 1 / sequence 1) under the GPU machine's triton (3.6.0), in a side venv (torch 2.13.0 CPU,
# triton from PyPI, NVSHMEM's bitcode, this package editable, no other extras): registers and
# spills differ between triton versions, and the GPU runs 3.6.0; and the tile choice and split
# policy, which above 32 heads depend on the triton version (test_tiles, test_grid).
COMPAT        ?= .venv-compat
COMPAT_TRITON ?= 3.6.0

compat:
	@test -x $(COMPAT)/bin/python || $(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet torch==2.13.0 triton==$(COMPAT_TRITON) \
		numpy einops tqdm pytest hypothesis nvidia-nvshmem-cu13==3.4.5
	$(COMPAT)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(COMPAT)/bin/python -m pytest correctness/test_compile_sm90.py \
		correctness/test_nvshmem_kernels.py correctness/test_grid.py correctness/test_tiles.py \
		-q -rs -s $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT) .pytest_cache .hypothesis

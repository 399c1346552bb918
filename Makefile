# Reduce Lab: two commands do all the set-up on a fresh machine.
#   make lab    create .venv, install, copy the notebooks to reducelab-notebooks/ (once)
#               and open JupyterLab there (127.0.0.1 only)
#   make test   create .venv, install, run the unit tests, the fault suite, the browser
#               test and nbval on every notebook
# Other targets: make unit (tests without the browser), make nbval (and nbval-other-cpu,
# the same with torch on other CPU kernels), make test-spawn (the
# LocalGroup tests and notebook 01 with the spawn start method), make notebooks
# (re-execute every notebook top to bottom and save), make bench, make workshop-bench,
# make mutation (mutation testing of the core modules, slow), make clean.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# On a laptop whose pip would pick a CUDA build of torch, point this at the CPU wheels:
#   make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
PORT ?= 8888
LAB_DIR ?= reducelab-notebooks

.PHONY: install browser lab test test-spawn unit nbval nbval-other-cpu notebooks bench workshop-bench mutation wheel clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "Reduce Lab needs Python 3.11 or newer: constraints.txt pins numpy 2.4.6, IPython 9.18.1,"; \
	  echo "SciPy 1.17.1 and scikit-learn 1.9.1, which need it. '$(PYTHON)' here is:"; \
	  echo "  $$(command -v $(PYTHON) >/dev/null && $(PYTHON) --version 2>&1 || echo not found)"; \
	  echo "Name a newer one, e.g. make $(or $(MAKECMDGOALS),install) PYTHON=python3.11 (or python3.12)."; exit 1; }
	@echo "Installing Reduce Lab into $(VENV): torch (CPU), JupyterLab, ipywidgets, matplotlib"
	@echo "and the test tools. The first time this takes a few minutes; later runs skip it."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar off $(PIP_EXTRA) -c constraints.txt -e ".[lab,test]" \
	  | grep --line-buffered -E '^(Collecting|Successfully installed)' || true
	@$(BIN)/python -c "import reducelab, torch, jupyterlab" || \
	  (echo "The install failed: run '$(BIN)/python -m pip install -c constraints.txt -e .[lab,test]' to see why."; exit 1)
	touch $(STAMP)

install: $(STAMP)

# The browser test drives the system Chromium (Debian package 'chromium'); nothing is
# downloaded at test time. Installed here when missing and we are root with apt-get.
browser:
	@if command -v chromium >/dev/null 2>&1 || [ -n "$$CHROMIUM" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "Installing Chromium for the browser test (Debian package 'chromium')"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
	  echo "make test needs Chromium for its browser test: install the package 'chromium'"; \
	  echo "(e.g. sudo apt-get install chromium) or set CHROMIUM=/path/to/chromium."; exit 1; \
	fi

# JupyterLab opens a working copy in reducelab-notebooks/ (ignored by git), made on the
# first run and never overwritten: the tracked notebooks stay as the tests expect them.
lab: install
	$(BIN)/python -m reducelab lab $(LAB_DIR) --port $(PORT) --no-browser

# nbval compares every stored output with a fresh run of its notebook.
NBVAL := $(BIN)/python -m pytest -q --nbval-sanitize-with tests/nbval_sanitize.cfg \
  --nbval-cell-timeout=120 -p no:cacheprovider -p tests.nbval_report --nbval
# Torch on other CPU kernels than this machine's: ATen's scalar code instead of AVX2 or
# AVX-512, and oneDNN (bfloat16 matmuls) without AVX. They round differently, so a stored
# output that records this CPU's rounding fails the second nbval pass.
OTHER_CPU := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41

# --durations: every CI log names its 30 slowest tests, where a cut of CI time starts.
# Ranks wait on sockets and pipes much of the time: on 2 cores one pytest left the CPUs
# 48 % idle (unit tests) and 36 % idle (one nbval pass), 28 Nov. So the unit tests run on
# TEST_WORKERS pytest-xdist workers (a file stays on one worker: its module-scoped groups
# expect it), and the two nbval passes run side by side (every notebook writes only under
# its own tempfile directories). The browser test runs alone: its Run All times are what
# the notebooks' headers claim (benchmarks/store_run_times.py).
TEST_WORKERS ?= 2
UNIT = $(BIN)/python -m pytest tests -q --ignore=tests/browser -n $(TEST_WORKERS) --dist loadfile
test: install browser
	$(UNIT) --durations=30
	$(BIN)/python -m pytest tests/browser -q --durations=20
	$(MAKE) --no-print-directory test-spawn
	$(MAKE) --no-print-directory -j2 --output-sync=target nbval nbval-other-cpu

# For a hosted service (Colab, a hub without a shared environment): the wheel learners
# install with `%pip install reducelab-<version>-py3-none-any.whl`, notebooks included.
wheel: install
	$(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w dist .
	@ls dist/reducelab-*.whl

# Where there is no forkserver (Windows; macOS too, if a learner chooses), ranks start with
# spawn. This runs the LocalGroup tests and notebook 01 with spawn forced on Linux.
test-spawn: install
	REDUCELAB_START_METHOD=spawn $(BIN)/python -m pytest -q tests/test_group.py \
	  tests/faults/test_learner_code.py
	REDUCELAB_START_METHOD=spawn $(NBVAL) notebooks/01_all_reduce.ipynb

unit: install
	$(UNIT)

nbval: install
	$(NBVAL) notebooks

# The stored outputs again, with torch on other CPU kernels (see OTHER_CPU above).
nbval-other-cpu: install
	$(OTHER_CPU) $(NBVAL) notebooks

# Restart the kernel, run all, save: how every committed notebook is produced.
notebooks: install
	cd notebooks && for nb in [0-9]*.ipynb; do \
	  ../$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=300 --ExecutePreprocessor.store_widget_state=True \
	    "$$nb" || exit 1; done

bench: install
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[bench]"
	$(BIN)/python benchmarks/bench.py

# The first start in a fresh kernel, and a class of K learners on one machine.
workshop-bench: install
	$(BIN)/python benchmarks/workshop.py

# Mutation testing (Cosmic Ray) of the core modules, each with the tests that reach it
# (benchmarks/mutation.toml); survivors go to benchmarks/results/mutation-latest.md. Hours
# on 2 cores, so not part of make test: MODULES="capture cli" runs some, SAMPLE=4 every
# 4th mutant.
MODULES ?=
SAMPLE ?= 1
mutation: install
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[mutation]"
	$(BIN)/python benchmarks/mutation.py $(MODULES) --sample $(SAMPLE)

clean:
	rm -rf $(VENV) helpers/*.egg-info

# Reduce Lab: two commands do all the set-up on a fresh machine.
#   make lab    create .venv, install, open JupyterLab on notebooks/ (127.0.0.1 only)
#   make test   create .venv, install, run the unit tests, the fault suite and nbval
# Other targets: make notebooks (re-execute every notebook top to bottom and save),
# make bench (the start-up and round-trip benchmark), make clean.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# On a laptop whose pip would pick a CUDA build of torch, point this at the CPU wheels:
#   make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)
PORT ?= 8888

.PHONY: install lab test unit nbval notebooks bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(PIP_EXTRA) -c constraints.txt -e ".[lab,test]"
	touch $(STAMP)

install: $(STAMP)

lab: install
	@echo "Starting JupyterLab on http://127.0.0.1:$(PORT)/ (the URL with its token follows)"
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(PORT) \
	  --ServerApp.root_dir=notebooks --no-browser $(ROOT_FLAG)

test: install
	$(BIN)/python -m pytest tests -q
	$(BIN)/python -m pytest -q --nbval notebooks --nbval-sanitize-with tests/nbval_sanitize.cfg \
	  --nbval-cell-timeout=120 -p no:cacheprovider

unit: install
	$(BIN)/python -m pytest tests -q

nbval: install
	$(BIN)/python -m pytest -q --nbval notebooks --nbval-sanitize-with tests/nbval_sanitize.cfg \
	  --nbval-cell-timeout=120 -p no:cacheprovider

# Restart the kernel, run all, save: how every committed notebook is produced.
notebooks: install
	cd notebooks && for nb in [0-9]*.ipynb; do \
	  ../$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=300 "$$nb" || exit 1; done

bench: install
	$(BIN)/python benchmarks/bench_start.py

clean:
	rm -rf $(VENV) helpers/*.egg-info

# Two commands a learner needs: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test bench html clean-venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

lab: $(STAMP)  ## start JupyterLab on the notebooks
	$(VENV)/bin/jupyter lab notebooks/

test: $(STAMP)  ## every test, notebooks included
	$(PY) -m pytest

bench: $(STAMP)  ## CPU benchmarks (tables and plots under benchmarks/results/)
	$(PY) benchmarks/memory_time.py

html: $(STAMP)  ## static, executed HTML of the series under _build/html/
	$(PY) scripts/build_html.py --out _build/html

clean-venv:
	rm -rf $(VENV)

# Two commands a learner needs: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: lab test bench html grade reset-exercise clean-venv

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

ANSWERS ?= exercises
grade: $(STAMP)  ## grade your answers in exercises/: the score card (ANSWERS=solutions: the reference; DETAILS=1: what each failing check asserted)
	PYTHONDONTWRITEBYTECODE=1 $(PY) -m lessons.course.grade run --answers $(ANSWERS) $(if $(DETAILS),--details)

reset-exercise: $(STAMP)  ## restore one stub, your file kept as NAME.py.bak-...: make reset-exercise NAME=absorb
	@test -n "$(NAME)" || { echo "usage: make reset-exercise NAME=<exercise>  (python -m lessons.course.grade list)"; exit 2; }
	$(PY) -m lessons.course.grade reset $(NAME)

clean-venv:
	rm -rf $(VENV)

# Two commands a learner needs: `make lab` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# `make lab` installs what the notebooks need (NVRTC included, so the GPU sections compile their
# kernels without a GPU); `make test` adds the test tools (pytest, nbval, Playwright, MPI).
LAB_EXTRAS  ?= gpu
TEST_EXTRAS ?= test,distributed
LAB_STAMP   := $(VENV)/.installed-lab
TEST_STAMP  := $(VENV)/.installed-test
# the extras each stamp was made with: changing LAB_EXTRAS or TEST_EXTRAS installs again
EXTRAS_FILE := $(VENV)/.installed-extras
# pip's requirement: the package, with its extras when there are any ("make lab LAB_EXTRAS=")
spec = $(if $(strip $(1)),.[$(strip $(1))],.)
# Extra JupyterLab arguments: make lab LAB_ARGS="--no-browser --port 8890"
LAB_ARGS ?=
# Test workers (pytest-xdist); extra pytest arguments: make test PYTEST_ARGS="-m 'not browser'"
JOBS        ?= auto
PYTEST_ARGS ?=

.PHONY: lab test bench html grade reset-exercise clean-venv

.PHONY: FORCE
$(EXTRAS_FILE): FORCE
	@mkdir -p $(VENV)
	@echo 'lab=[$(strip $(LAB_EXTRAS))] test=[$(strip $(TEST_EXTRAS))]' | cmp -s - $@ \
		|| echo 'lab=[$(strip $(LAB_EXTRAS))] test=[$(strip $(TEST_EXTRAS))]' > $@

$(LAB_STAMP): pyproject.toml $(EXTRAS_FILE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e "$(call spec,$(LAB_EXTRAS))"
	touch $@

$(TEST_STAMP): $(LAB_STAMP)
	$(PY) -m pip install --quiet -e "$(call spec,$(TEST_EXTRAS))"
	touch $@

lab: $(LAB_STAMP)  ## JupyterLab on your copies of the notebooks (my_notebooks/, made once, never overwritten)
	$(PY) scripts/lab.py $(LAB_ARGS)

# bytecode is written (__pycache__, ignored by git) even where the environment turns it off: every
# worker, notebook kernel and MPI rank would otherwise compile the package and the tests anew
test: $(TEST_STAMP)  ## every test, notebooks included, on all cores
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n $(JOBS) $(PYTEST_ARGS)

# your measurements go to an ignored folder; BENCH_OUT=benchmarks/results replaces the recorded ones
BENCH_OUT ?= benchmarks/results/local
bench: $(TEST_STAMP)  ## CPU benchmarks: tables and plots under benchmarks/results/local/ (BENCH_OUT=...)
	$(PY) benchmarks/memory_time.py --out $(BENCH_OUT)

html: $(LAB_STAMP)  ## static, executed HTML of the series under _build/html/
	$(PY) scripts/build_html.py --out _build/html

ANSWERS ?= exercises
grade: $(LAB_STAMP)  ## grade your answers in exercises/: the score card (ANSWERS=solutions: the reference; DETAILS=1: what each failing check asserted)
	PYTHONDONTWRITEBYTECODE=1 $(PY) -m lessons.course.grade run --answers $(ANSWERS) $(if $(DETAILS),--details)

reset-exercise: $(LAB_STAMP)  ## restore one stub, your file kept as NAME.py.bak-...: make reset-exercise NAME=absorb
	@test -n "$(NAME)" || { echo "usage: make reset-exercise NAME=<exercise>  ($(PY) -m lessons.course.grade list)"; exit 2; }
	$(PY) -m lessons.course.grade reset $(NAME)

clean-venv:
	rm -rf $(VENV)

"""The grader is tested too: it passes the reference answers, fails every known-wrong answer
with a hint that names its mistake, and grades untouched stubs as "not attempted".

The grader runs for real, in a subprocess (``python -m pytest -c grading/pytest.ini ...``),
as ``make grade`` runs it, with ``--no-shrink`` (failing examples are not minimised: same
verdicts, much faster); the JSON report it writes is what these tests read.
"""
from __future__ import annotations

import ast
import io
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import pytest

from lessons.course import grade
from lessons.course.grade import EXERCISES, CheckResult, ExerciseResult, check, format_score_card, reset, summarise

ROOT = Path(__file__).resolve().parents[1]
NAMES = [ex.name for ex in EXERCISES]

# The classic mistakes that must each have a known-wrong answer in mutants/.
REQUIRED_MISTAKES = {
    "alpha_missing_on_o", "alpha_missing_on_l", "top_left_causal", "zero_padding_as_mask",
    "lse_inf_for_empty", "head_modulo", "scale_1_over_d", "no_guard", "last_partial_tile_dropped",
}


def _load_mistakes():
    spec = importlib.util.spec_from_file_location("_grading_mistakes", ROOT / "grading" / "mistakes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MISTAKES = _load_mistakes()


def _mutants():
    """(path, exercise, mistake) for every file in mutants/, read without importing it."""
    found = []
    for path in sorted((ROOT / "mutants").glob("*.py")):
        consts = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        consts[target.id] = node.value.value
        found.append((path, consts.get("EXERCISE"), consts.get("MISTAKE")))
    return found


MUTANTS = _mutants()


def start_grader(tmp_path, *, answers=None, files=None, names=(), extra=()):
    """Start the grader as ``make grade`` runs it; :func:`finish` waits for it."""
    report = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    report.write_text("")
    cmd = grade.pytest_command(answers, names, answer_files=files, report=report, extra=["--no-shrink", *extra])
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, report


def finish(started):
    """(report dict, return code, stdout) of a grader run started by :func:`start_grader`."""
    proc, report = started
    stdout, stderr = proc.communicate(timeout=900)
    text = report.read_text()
    assert text, f"the grader wrote no report:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return json.loads(text), proc.returncode, stdout


def run_grader(tmp_path, **kwargs):
    return finish(start_grader(tmp_path, **kwargs))


def _listing(folder: Path):
    return sorted((str(p.relative_to(folder)), p.stat().st_mtime_ns) for p in folder.rglob("*"))


# --- the pieces are all there and agree ---------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_every_exercise_has_stub_solution_and_checks(name):
    for path in (ROOT / "exercises" / f"{name}.py", ROOT / "solutions" / f"{name}.py",
                 ROOT / "grading" / "stubs" / f"{name}.py", ROOT / "grading" / f"test_{name}.py"):
        assert path.is_file(), f"missing {path.relative_to(ROOT)}"
    assert f'EXERCISE = "{name}"' in (ROOT / "grading" / f"test_{name}.py").read_text()


def test_no_stray_exercises():
    for folder in ("exercises", "solutions", "grading/stubs"):
        found = {p.stem for p in (ROOT / folder).glob("*.py")}
        assert found == set(NAMES), f"{folder}/ holds {sorted(found)}, the registry lists {NAMES}"


def _functions(path):
    tree = ast.parse(path.read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


def _signature(fn: ast.FunctionDef) -> str:
    return ast.unparse(fn.args)


@pytest.mark.parametrize("name", NAMES)
def test_stub_and_solution_have_the_same_functions(name):
    stub = _functions(ROOT / "grading" / "stubs" / f"{name}.py")
    sol = _functions(ROOT / "solutions" / f"{name}.py")
    assert stub.keys() == sol.keys()
    for fname in stub:
        assert _signature(stub[fname]) == _signature(sol[fname]), f"{name}.{fname}"
        assert ast.get_docstring(stub[fname]) == ast.get_docstring(sol[fname]), f"{name}.{fname} docstring"
        body = stub[fname].body
        assert len(body) == 2 and isinstance(body[1], ast.Raise) and \
            ast.unparse(body[1].exc) == "NotImplementedError", f"stub {name}.{fname} must only raise"
        doc = ast.get_docstring(stub[fname])
        # the task, not the answer: no update spelled out line by line (the notebook derives it)
        answer_lines = [line for line in doc.splitlines()
                        if re.search(r"\balpha\s*=\s*exp|\bm_new\s*=|=\s*alpha\s*\*|=\s*exp\(\w+_a\s*-|\bh\s*//", line)]
        assert doc and "Rule" not in doc and not answer_lines, f"{name}.{fname}: the docstring spells out the answer: {answer_lines}"


@pytest.mark.parametrize("name", NAMES)
def test_shipped_exercise_is_the_stub(name):
    mine = (ROOT / "exercises" / f"{name}.py").read_bytes()
    if mine != (ROOT / "grading" / "stubs" / f"{name}.py").read_bytes():
        pytest.skip(f"exercises/{name}.py has been edited (your work); its stub is grading/stubs/{name}.py")


def _exercises_readme_rows():
    """[(notebook number, module name)] of the table in exercises/README.md, in its order."""
    text = (ROOT / "exercises" / "README.md").read_text()
    return re.findall(r"^\| (\d\d) \| `(\w+)\.py` \|", text, re.M)


def test_exercises_readme_table_is_the_registry():
    rows = _exercises_readme_rows()
    assert rows == [(ex.notebook[:2], ex.name) for ex in EXERCISES], (
        f"exercises/README.md lists {rows}; lessons.course.grade.EXERCISES has "
        f"{[(ex.notebook[:2], ex.name) for ex in EXERCISES]}")


def test_grading_commands_use_the_course_interpreter():
    """The commands exercises/README.md gives, and the one ``make reset-exercise`` suggests without NAME,
    run the interpreter ``make lab`` built (``.venv/bin/python``, ``$(PY)`` in the Makefile): a bare
    ``python`` is another one, without pytest-timeout and the rest, until the venv is activated. The
    suggested command must also work: it lists every exercise."""
    readme = (ROOT / "exercises" / "README.md").read_text()
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    ") and line.strip()]
    assert commands, "exercises/README.md shows no commands"
    wrong = [c for c in commands if c.split()[0] not in ("make", ".venv/bin/python")]
    assert not wrong, f"exercises/README.md: commands that run neither make nor .venv/bin/python: {wrong}"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^VENV\s*:=\s*\.venv$", makefile, re.M) and re.search(r"^PY\s*:=\s*\$\(VENV\)/bin/python$",
                                                                        makefile, re.M), "the Makefile's PY is not .venv/bin/python"
    usage = re.search(r'echo "usage: make reset-exercise NAME=<exercise>\s+\((.*)\)"', makefile)
    assert usage, "the Makefile's reset-exercise recipe prints no usage line"
    suggested = usage.group(1).split()
    assert suggested[0] == "$(PY)", f"make reset-exercise suggests {usage.group(1)!r}, not the venv's interpreter"
    listed = subprocess.run([sys.executable, *suggested[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[1] for line in listed.stdout.splitlines() if line.strip()] == NAMES, listed.stdout


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_ends_with_its_exercise(path):
    """Just before the self-test: a "Your turn" cell naming the exercise files, then a cell grading exactly
    the exercises the registry files under this notebook."""
    cells = json.loads(path.read_text())["cells"]
    texts = ["".join(c["source"]) for c in cells]
    selftest = next((i for i, t in enumerate(texts) if t.startswith("## Self-test")), None)
    assert selftest is not None and selftest >= 2, f"{path.name}: no self-test after an exercise"
    task, grader = cells[selftest - 2], cells[selftest - 1]
    assert task["cell_type"] == "markdown" and texts[selftest - 2].startswith("## Your turn"), (
        f"{path.name}: the cell before the grading cell is not \"## Your turn\"")
    names = {ex.name for ex in EXERCISES if ex.notebook == path.stem}
    assert names, f"{path.name}: no exercise in lessons.course.grade.EXERCISES"
    for name in names:
        assert f"exercises/{name}.py" in texts[selftest - 2], f"{path.name}: \"Your turn\" never names exercises/{name}.py"
    code = texts[selftest - 1]
    assert grader["cell_type"] == "code" and "from lessons.course.grade import check" in code, (
        f"{path.name}: the cell after \"Your turn\" does not grade")
    graded = set(re.findall(r'"(\w+)"', code)) & set(NAMES)
    assert graded == names, f"{path.name}: its grading cell checks {sorted(graded)}, the registry {sorted(names)}"


def test_every_classic_mistake_has_a_mutant():
    assert MUTANTS, "mutants/ is empty"
    for path, exercise, mistake in MUTANTS:
        assert exercise in NAMES, f"{path.name} declares EXERCISE = {exercise!r}"
        assert mistake in MISTAKES.MISTAKES, f"{path.name} declares MISTAKE = {mistake!r}, not in grading/mistakes.py"
    missing = REQUIRED_MISTAKES - {m for _, _, m in MUTANTS}
    assert not missing, f"no mutant makes these mistakes: {sorted(missing)}"


# --- the grader against the reference answers, the stubs and the mutants ---------------------

@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("grader")


@pytest.fixture(scope="module")
def solutions_run(module_tmp):
    return run_grader(module_tmp, answers=ROOT / "solutions")


def test_reference_solutions_pass_every_check(solutions_run):
    report, code, stdout = solutions_run
    records = report["records"]
    not_passed = [(r["exercise"], r["test"], r["outcome"], r["message"]) for r in records if r["outcome"] != "passed"]
    assert not not_passed, not_passed
    assert code == 0
    per_exercise = defaultdict(int)
    for r in records:
        per_exercise[r["exercise"]] += 1
    assert set(per_exercise) == set(NAMES)
    assert min(per_exercise.values()) >= 5, dict(per_exercise)
    assert [r["status"] for r in report["results"]] == ["passed"] * len(NAMES)
    assert "score card" in stdout and f"{len(NAMES)} passed" in stdout


def test_every_named_mistake_is_checked_for(solutions_run):
    named = {k for r in solutions_run[0]["records"] for k in r["catches"]}
    assert named == set(MISTAKES.MISTAKES), (
        f"never checked: {sorted(set(MISTAKES.MISTAKES) - named)}; unknown: {sorted(named - set(MISTAKES.MISTAKES))}")


@pytest.fixture(scope="module")
def exercises_run(module_tmp):
    before = _listing(ROOT / "exercises")
    result = run_grader(module_tmp, answers=ROOT / "exercises")
    return result, before, _listing(ROOT / "exercises")


def test_grading_writes_nothing_into_exercises(exercises_run):
    _, before, after = exercises_run
    assert after == before, "grading changed the exercises/ folder"


def test_untouched_stubs_grade_as_not_attempted(exercises_run):
    (report, code, stdout), _, _ = exercises_run
    pristine = {n for n in NAMES if (ROOT / "exercises" / f"{n}.py").read_bytes()
                == (ROOT / "grading" / "stubs" / f"{n}.py").read_bytes()}
    if not pristine:
        pytest.skip("every exercise has been edited")
    for r in report["records"]:
        if r["exercise"] in pristine:
            assert r["outcome"] == "not attempted", (r["exercise"], r["test"], r["outcome"], r["message"])
    status = {r["name"]: r["status"] for r in report["results"]}
    assert {status[n] for n in pristine} == {"not attempted"}
    assert "Traceback" not in stdout
    if pristine == set(NAMES):
        assert code == 0 and f"{len(NAMES)} not attempted" in stdout


def _rounds():
    """Group the mutants so that each grader run holds at most one per exercise."""
    rounds: list[dict] = []
    for path, exercise, mistake in MUTANTS:
        for r in rounds:
            if exercise not in r:
                r[exercise] = (path, mistake)
                break
        else:
            rounds.append({exercise: (path, mistake)})
    return rounds


@pytest.fixture(scope="module")
def mutant_runs(module_tmp):
    """{mutant file name: (its ExerciseResult dict, its records, the score card text)}."""
    out = {}
    rounds = _rounds()
    started = [start_grader(module_tmp, names=sorted(r), files={ex: p for ex, (p, _) in r.items()}) for r in rounds]
    for r, run in zip(rounds, started):
        report, code, stdout = finish(run)
        assert code == 1, f"the grader should exit 1 when checks fail, got {code}"
        results = {x["name"]: x for x in report["results"]}
        for exercise, (path, _) in r.items():
            records = [x for x in report["records"] if x["exercise"] == exercise]
            out[path.name] = (results[exercise], records, report["score_card"])
    return out


@pytest.mark.parametrize("path, exercise, mistake", MUTANTS, ids=[p.stem for p, _, _ in MUTANTS])
def test_mutant_fails_with_a_hint_naming_its_mistake(mutant_runs, path, exercise, mistake):
    result, records, card = mutant_runs[path.name]
    assert result["status"] == "failed", f"{path.name} was graded {result['status']}"
    failed = [r for r in records if r["outcome"] == "failed"]
    assert any(mistake in r["catches"] for r in failed), (
        f"{path.name}: no failing check names {mistake!r}; failing: {[(r['test'], r['catches']) for r in failed]}")
    text = MISTAKES.hint_text(mistake)
    assert result["hints"] and result["hints"][0] == text, (
        f"{path.name}: the first hint should name {mistake!r}, got {result['hints']}")
    flat = " ".join(card.replace("│", " ").split())          # the table's wrapped hint column, unwrapped
    assert exercise in flat and " ".join(text.split()) in flat, f"the score card does not show the hint:\n{card}"
    others = [MISTAKES.hint_text(k) for k in MISTAKES.MISTAKES if k != mistake]
    assert not [h for h in result["hints"] if h in others], (
        f"{path.name} makes only {mistake!r}, but the card also names {[h for h in result['hints'] if h in others]}")


# --- summarise, score card, check and reset, in process ------------------------------------

def _rec(ex, outcome, hints=(), advice=(), test="t"):
    return {"exercise": ex, "test": test, "outcome": outcome, "hints": list(hints), "advice": list(advice)}


def test_summarise_statuses_and_hint_order():
    results = {r.name: r for r in summarise([
        _rec("absorb", "passed"), _rec("absorb", "failed", ["B"], ["x"]), _rec("absorb", "failed", ["A", "B"]),
        _rec("causal", "not attempted"), _rec("causal", "not attempted"),
        _rec("paged", "passed"), _rec("paged", "not attempted"),
        _rec("gqa_decode", "passed"), _rec("gqa_decode", "skipped"),
    ])}
    assert results["absorb"] == ExerciseResult("absorb", "failed", 1, 2, 0, ("B", "A"), ("t", "t"))
    advice_only = summarise([_rec("absorb", "failed", [], ["x"]), _rec("absorb", "failed", [], ["y", "x"])])
    assert advice_only[0].hints == ("x", "y")           # no named mistake: the checks' advice instead
    assert results["causal"].status == "not attempted"
    assert results["paged"].status == "incomplete"
    assert results["gqa_decode"].status == "passed" and results["gqa_decode"].total == 1
    assert [r.name for r in summarise([_rec("gqa_decode", "passed"), _rec("online_softmax", "passed")])] == \
        ["online_softmax", "gqa_decode"]
    with pytest.raises(ValueError, match="unknown outcome"):
        summarise([_rec("absorb", "xfailed")])


def _crec(outcome, catches, test="t"):
    """A record as the grader writes it: the hints are the named mistakes' texts, in the order of catches."""
    return {"exercise": "absorb", "test": test, "outcome": outcome, "catches": list(catches),
            "hints": [MISTAKES.hint_text(k) for k in catches] if outcome == "failed" else [], "advice": []}


def test_only_the_hint_of_the_mistake_made():
    on_o, on_l = MISTAKES.hint_text("alpha_missing_on_o"), MISTAKES.hint_text("alpha_missing_on_l")
    # a check without a named mistake (tile size) also fails: its advice waits until the mistake is fixed
    tile = {"exercise": "absorb", "test": "tile", "outcome": "failed", "catches": [], "hints": [],
            "advice": ["the tile size must not change the result"]}
    (r,) = summarise([_crec("passed", ["alpha_missing_on_l"], "l"), _crec("failed", ["alpha_missing_on_o"], "o"),
                      tile])
    assert r.hints == (on_o,)
    # alpha missing on o: the check of l passes, the check of o fails, the check of o / l fails
    (r,) = summarise([_crec("passed", ["alpha_missing_on_l"], "l"), _crec("failed", ["alpha_missing_on_o"], "o"),
                      _crec("failed", ["alpha_missing_on_o", "alpha_missing_on_l"], "o/l")])
    assert r.hints == (on_o,)
    # only the shared check failed, the distinguishing check of l passed: o is the one left
    (r,) = summarise([_crec("passed", ["alpha_missing_on_l"], "l"),
                      _crec("failed", ["alpha_missing_on_o", "alpha_missing_on_l"], "o/l")])
    assert r.hints == (on_o,)
    # both distinguishing checks failed: both mistakes were made, both hints shown
    (r,) = summarise([_crec("failed", ["alpha_missing_on_l"], "l"), _crec("failed", ["alpha_missing_on_o"], "o"),
                      _crec("failed", ["alpha_missing_on_o", "alpha_missing_on_l"], "o/l")])
    assert set(r.hints) == {on_o, on_l}
    # a parametrised check that passes in one case and fails in another still confirms its mistake
    (r,) = summarise([_crec("passed", ["no_guard"], "e[1]"), _crec("failed", ["no_guard"], "e[2]")])
    assert r.hints == (MISTAKES.hint_text("no_guard"),)
    # every named mistake ruled out by its own passing check: the failure's own message is shown instead
    rec = _crec("failed", ["alpha_missing_on_o", "alpha_missing_on_l"], "o/l")
    rec["message"] = "AssertionError: o / l is wrong"
    (r,) = summarise([_crec("passed", ["alpha_missing_on_l"], "l"), _crec("passed", ["alpha_missing_on_o"], "o"), rec])
    assert r.hints == ("AssertionError: o / l is wrong",)


def test_a_checks_written_advice_comes_before_the_bare_failure_messages():
    # two checks without a named mistake fail: one has only its assertion's message (the grader's advice then),
    # one has advice written for it; the written advice is shown first, however the checks are ordered
    bare = {"exercise": "absorb", "test": "by_hand", "outcome": "failed", "catches": [], "hints": [], "bare": True,
            "message": "AssertionError: 683 splits, expected 8", "advice": ["AssertionError: 683 splits, expected 8"]}
    other = {**bare, "test": "random", "message": "AssertionError: 5954 splits, expected 1",
             "advice": ["AssertionError: 5954 splits, expected 1"]}
    written = {**bare, "test": "one_wave", "message": "AssertionError: assert 683 == 8", "bare": False,
               "advice": ["the most splits that fit in one wave, not the cheapest"]}
    (r,) = summarise([bare, written, other])
    assert r.hints == ("the most splits that fit in one wave, not the cheapest",
                       "AssertionError: 683 splits, expected 8", "AssertionError: 5954 splits, expected 1")
    # a message two checks share still ranks above one of a single check, among the messages
    (r,) = summarise([other, bare, {**bare, "test": "again"}])
    assert r.hints == ("AssertionError: 683 splits, expected 8", "AssertionError: 5954 splits, expected 1")


def test_untouched_stub_is_answered_without_running_the_grader(workspace, monkeypatch):
    def no_pytest(*args, **kwargs):
        raise AssertionError("the grader was started for an untouched stub")
    monkeypatch.setattr(grade.subprocess, "run", no_pytest)
    res = check("absorb", file=workspace / "absorb.py")
    assert res.status == "not attempted" and str(res).startswith("absorb: not attempted")
    assert grade.is_untouched_stub("absorb", workspace / "absorb.py")
    (workspace / "absorb.py").write_text((workspace / "absorb.py").read_text() + "\n# started\n")
    assert not grade.is_untouched_stub("absorb", workspace / "absorb.py")
    assert not grade.is_untouched_stub("absorb", workspace / "missing.py")


def test_run_prints_the_score_card_first_and_details_on_request(tmp_path):
    import io
    answers = tmp_path / "answers"
    answers.mkdir()
    (answers / "absorb.py").write_bytes((ROOT / "mutants" / "absorb__alpha_missing_on_o.py").read_bytes())
    short, long = io.StringIO(), io.StringIO()
    assert grade.run(answers, ["absorb"], out=short) == 1
    text = short.getvalue()
    assert text.lstrip().startswith("score card") and "absorb" in text
    assert "FAILURES" not in text and "Traceback" not in text and "DETAILS=1" in text
    assert __import__("re").search(r"\b\d+ of \d+ checks failed", text)
    assert grade.run(answers, ["absorb"], details=True, out=long) == 1
    text = long.getvalue()
    assert text.index("score card") < text.index("FAILURES") and "test_o_after_every_tile" in text
    assert text.count("score card") == 1, "the details repeat the score card"


def test_score_card_has_one_line_per_exercise():
    results = summarise([_rec("absorb", "failed", ["alpha missing on o: rescale o"]), _rec("causal", "not attempted"),
                         _rec("paged", "passed")])
    card = format_score_card(results, answers="exercises/")
    assert "alpha missing on o" in card and "not attempted" in card and "1 check passed" in card
    assert "FAILED" not in card and "1 of 1 check failed" in card
    assert "3 exercises graded: 1 passed, 1 failed, 1 not attempted" in card


@pytest.fixture()
def workspace(tmp_path):
    """A temporary copy of the stubs as an exercises folder."""
    ex = tmp_path / "exercises"
    ex.mkdir()
    for n in NAMES:
        (ex / f"{n}.py").write_bytes((ROOT / "grading" / "stubs" / f"{n}.py").read_bytes())
    return ex


def test_reset_keeps_the_learners_file(workspace):
    target = workspace / "absorb.py"
    mine = target.read_text() + "\n# my answer\n"
    target.write_text(mine)
    when = datetime(2024, 5, 6, 7, 8, 9)
    backup = reset("absorb", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs", now=when)
    assert backup == workspace / "absorb.py.bak-20240506-070809"
    assert backup.read_text() == mine
    assert target.read_bytes() == (ROOT / "grading" / "stubs" / "absorb.py").read_bytes()


def test_reset_never_overwrites_a_backup(workspace):
    when = datetime(2024, 5, 6, 7, 8, 9)
    existing = workspace / "absorb.py.bak-20240506-070809"
    existing.write_text("an older backup")
    (workspace / "absorb.py").write_text("attempt two")
    backup = reset("absorb", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs", now=when)
    assert backup == workspace / "absorb.py.bak-20240506-070809-2"
    assert existing.read_text() == "an older backup" and backup.read_text() == "attempt two"
    (workspace / "absorb.py").write_text("attempt three")
    third = reset("absorb", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs", now=when)
    assert third.name == "absorb.py.bak-20240506-070809-3" and third.read_text() == "attempt three"


def test_reset_of_an_untouched_stub_or_unknown_name(workspace):
    before = _listing(workspace)
    assert reset("causal", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs") is None
    assert _listing(workspace) == before
    with pytest.raises(ValueError, match="unknown exercise"):
        reset("nope", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs")
    (workspace / "paged.py").unlink()                      # a deleted exercise is simply restored
    assert reset("paged", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs") is None
    assert (workspace / "paged.py").read_bytes() == (ROOT / "grading" / "stubs" / "paged.py").read_bytes()


def test_reset_recreates_a_missing_exercises_folder(tmp_path):
    gone = tmp_path / "exercises"                          # deleted by hand
    assert reset("absorb", exercises_dir=gone, stubs_dir=ROOT / "grading" / "stubs") is None
    assert sorted(p.name for p in gone.iterdir()) == ["absorb.py"]
    assert (gone / "absorb.py").read_bytes() == (ROOT / "grading" / "stubs" / "absorb.py").read_bytes()


def test_reset_refuses_a_folder_where_the_answer_file_belongs(workspace):
    (workspace / "causal.py").unlink()
    (workspace / "causal.py").mkdir()
    (workspace / "causal.py" / "notes.txt").write_text("mine")
    before = _listing(workspace)
    with pytest.raises(IsADirectoryError, match="causal.py is a folder"):
        reset("causal", exercises_dir=workspace, stubs_dir=ROOT / "grading" / "stubs")
    assert _listing(workspace) == before


def test_command_line_reset_without_exercises_folder_or_with_a_folder_in_the_way(tmp_path, monkeypatch, capsys):
    root = tmp_path / "repo"
    (root / "grading").mkdir(parents=True)
    (root / "grading" / "stubs").symlink_to(ROOT / "grading" / "stubs")
    monkeypatch.setattr(grade, "repo_root", lambda: root)
    assert grade.main(["reset", "absorb"]) == 0
    out = capsys.readouterr()
    assert "was missing; created it" in out.out and "Errno" not in out.out + out.err
    assert (root / "exercises" / "absorb.py").read_bytes() == (ROOT / "grading" / "stubs" / "absorb.py").read_bytes()
    (root / "exercises" / "causal.py").mkdir()
    assert grade.main(["reset", "causal"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "causal.py is a folder" in err and "Traceback" not in err


def test_an_answer_calling_sys_exit_at_import_is_reported(workspace):
    (workspace / "absorb.py").write_text("import sys\nsys.exit(3)\n")
    res = check("absorb", file=workspace / "absorb.py")
    assert res.status == "failed"
    assert "could not import" in str(res) and "sys.exit(3)" in str(res) and "AssertionError" not in str(res)


def test_command_line_list_and_bad_name(capsys):
    assert grade.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(n in listed for n in NAMES)
    assert grade.main(["reset", "nope"]) == 2
    assert "unknown exercise" in capsys.readouterr().err


def test_check_result_lines():
    done = ExerciseResult("absorb", "passed", 9, 0, 0)
    assert str(CheckResult("absorb", "passed", "", done)) == "absorb: all 9 checks passed"
    half = ExerciseResult("absorb", "incomplete", 4, 0, 5)
    assert str(CheckResult("absorb", "incomplete", "", half)).startswith("absorb: incomplete: 4 of 9 checks passed, 5 ")
    failed = ExerciseResult("absorb", "failed", 6, 3, 0, ("alpha missing on o: rescale o",))
    assert str(CheckResult("absorb", "failed", failed.hints[0], failed)) == \
        "absorb: 3 of 9 checks failed. Hint: alpha missing on o: rescale o"
    two = ExerciseResult("absorb", "failed", 6, 3, 0, ("alpha missing on o: rescale o", "no -inf guard"))
    assert str(CheckResult("absorb", "failed", two.hints[0], two)) == \
        "absorb: 3 of 9 checks failed. Hint: alpha missing on o: rescale o (1 more hint: `make grade` shows them all)"
    three = ExerciseResult("absorb", "failed", 6, 3, 0, ("a", "b", "c"))
    assert str(CheckResult("absorb", "failed", "a", three)).endswith("Hint: a (2 more hints: `make grade` shows them all)")
    assert str(CheckResult("absorb", "error", "timeout")) == "absorb: could not grade: timeout"


def test_check_reports_each_state_in_one_line(workspace):
    stub = check("absorb", file=workspace / "absorb.py")
    assert stub.status == "not attempted" and str(stub).startswith("absorb: not attempted")
    bad = check("absorb", file=ROOT / "mutants" / "absorb__alpha_missing_on_o.py")
    assert bad.status == "failed" and "alpha missing on o" in str(bad)
    (workspace / "absorb.py").write_text("def absorb(:\n")
    broken = check("absorb", file=workspace / "absorb.py")
    assert broken.status == "failed" and "could not import" in str(broken)
    assert sorted(p.name for p in workspace.iterdir()) == sorted(f"{n}.py" for n in NAMES)


def test_check_of_a_file_that_is_not_python_says_so(tmp_path):
    # the notebook or a copy saved as text, given to check(file=...): no module spec can be made for it, and the
    # learner is told the answer is a .py file, not "AttributeError: 'NoneType' object has no attribute 'loader'"
    source = (ROOT / "solutions" / "decode_splits.py").read_text()
    for name in ("decode_splits.txt", "decode_splits.ipynb", "decode_splits"):
        (tmp_path / name).write_text(source)
        result = check("decode_splits", file=tmp_path / name)
        assert result.status == "failed" and "NoneType" not in result.hint, result
        assert f"could not import {tmp_path / name}: an answer is a Python file whose name ends in .py" \
            in result.hint, result


def test_check_grades_the_folder_lessons_answers_names(monkeypatch):
    """make html sets LESSONS_ANSWERS=grading/stubs: a page says "not attempted" whatever the builder's
    exercises/ holds; another folder (here the reference solutions) is graded as it is."""
    monkeypatch.setenv("LESSONS_ANSWERS", "grading/stubs")
    assert check("absorb").status == "not attempted"
    monkeypatch.setenv("LESSONS_ANSWERS", "solutions")
    done = check("absorb")
    assert done.status == "passed" and str(done).startswith("absorb: all ") and done.result.failed == 0


# --- answers that loop, print or touch files ---------------------------------------------------

@pytest.fixture()
def solved(tmp_path):
    """A temporary copy of the reference answers as an answers folder."""
    ex = tmp_path / "answers"
    ex.mkdir()
    for n in NAMES:
        (ex / f"{n}.py").write_bytes((ROOT / "solutions" / f"{n}.py").read_bytes())
    return ex


def _with_line_after_imports(path: Path, line: str):
    text = path.read_text()
    path.write_text(text.replace("import numpy as np\n", f"import numpy as np\n{line}\n", 1))


def test_an_answer_that_deletes_or_overwrites_files_loses_no_file(solved, tmp_path):
    """ring_step deletes gqa_decode.py and overwrites itself at import: the grader writes the deleted
    file back, keeps the overwritten one's content as a backup, and fails ring_step saying so."""
    mine = {n: (solved / f"{n}.py").read_bytes() for n in NAMES}
    _with_line_after_imports(solved / "ring_step.py", 'import pathlib; pathlib.Path(__file__).with_name('
                             '"gqa_decode.py").unlink(); pathlib.Path(__file__).write_text("# gone\\n")')
    ring = (solved / "ring_step.py").read_bytes()
    report, code, _ = run_grader(tmp_path, answers=solved, names=("ring_step", "gqa_decode"))
    status = {r["name"]: r for r in report["results"]}
    assert code == 1 and status["gqa_decode"]["status"] == "passed"
    hint = status["ring_step"]["hints"][0]
    assert status["ring_step"]["status"] == "failed" and status["ring_step"]["failed"] == 1, status["ring_step"]
    assert "gqa_decode.py was deleted while this check ran; the grader wrote it back" in hint
    backups = sorted(solved.glob("ring_step.py.bak-*"))
    assert len(backups) == 1 and f"ring_step.py changed while this check ran; its content from before grading " \
        f"is saved as {backups[0].name}" in hint
    assert backups[0].read_bytes() == ring and (solved / "ring_step.py").read_text() == "# gone\n"
    assert all((solved / f"{n}.py").read_bytes() == mine[n] for n in NAMES if n != "ring_step")
    assert sorted(p.name for p in solved.iterdir()) == sorted([f"{n}.py" for n in NAMES] + [backups[0].name])


def test_an_endless_loop_fails_its_exercise_and_the_rest_is_graded(solved, tmp_path):
    """A loop in an answer's function fails that check at the time limit and the exercise's other
    checks at once; a loop at import fails the import; the other exercises are graded as usual."""
    _with_line_after_imports(solved / "paged.py", "while True:\n    pass")
    text = (solved / "merge_states.py").read_text()
    (solved / "merge_states.py").write_text(text.replace(
        "def merge_states(o_a, lse_a, o_b, lse_b):\n", "def merge_states(o_a, lse_a, o_b, lse_b):\n"
        "    while True:\n        try:\n            pass\n        except Exception:\n            pass\n", 1))
    assert "while True" in (solved / "merge_states.py").read_text()
    started = datetime.now()
    report, code, _ = run_grader(tmp_path, answers=solved, names=("paged", "merge_states", "absorb"),
                                 extra=["--check-timeout", "2"])
    assert (datetime.now() - started).total_seconds() < 60
    status = {r["name"]: r for r in report["results"]}
    assert code == 1 and status["absorb"]["status"] == "passed"
    merge, paged = status["merge_states"], status["paged"]
    assert merge["status"] == "failed" and merge["passed"] == 0 and merge["failed"] >= 5, merge
    assert merge["hints"][0] == "this check ran longer than 2 s (an endless loop?); the limit is the grader's " \
                                "--check-timeout"
    assert sum("ran longer than" in r["message"] for r in report["records"] if r["exercise"] == "merge_states") == 1
    assert paged["status"] == "failed" and paged["passed"] == 0
    assert "could not import" in paged["hints"][0] and "the import ran longer than 2 s" in paged["hints"][0]


def test_an_endless_loop_that_catches_everything_still_ends_at_the_time_limit(solved, tmp_path):
    """merge_states loops calling a function inside ``try: ... except: pass``, which also catches the
    time limit's failure when it lands in the call: the alarm fires again every second until one gets
    out of the loop, and the exercise fails with the time limit's message."""
    text = (solved / "merge_states.py").read_text()
    (solved / "merge_states.py").write_text(text.replace(
        "def merge_states(o_a, lse_a, o_b, lse_b):\n", "def _tick():\n    return 1\n\n\n"
        "def merge_states(o_a, lse_a, o_b, lse_b):\n"
        "    while True:\n        try:\n            _tick()\n        except:  # noqa: E722\n            pass\n", 1))
    assert "except:  # noqa" in (solved / "merge_states.py").read_text()
    proc, report = start_grader(tmp_path, answers=solved, names=("merge_states",), extra=["--check-timeout", "1"])
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the grader was still running 120 s after it started")
    merge = json.loads(report.read_text())["results"][0]
    assert proc.returncode == 1 and merge["status"] == "failed" and merge["passed"] == 0, merge
    assert merge["hints"][0] == "this check ran longer than 1 s (an endless loop?); the limit is the grader's " \
                                "--check-timeout"


def test_an_answer_that_prints_a_lot_is_graded_and_its_output_not_shown(solved):
    """5 MB printed at import and at every call: the score card is as for the quiet answer."""
    _with_line_after_imports(solved / "merge_states.py", 'print("x" * 5_000_000)')
    text = (solved / "merge_states.py").read_text()
    (solved / "merge_states.py").write_text(text.replace(
        "def merge_states(o_a, lse_a, o_b, lse_b):\n", "def merge_states(o_a, lse_a, o_b, lse_b):\n"
        '    print("y" * 100_000)\n', 1))
    out = io.StringIO()
    assert grade.run(solved, ["merge_states"], out=out) == 0
    text = out.getvalue()
    assert "merge_states" in text and "all " in text and " passed, none failed" in text and len(text) < 5000


def test_numpy_error_handling_set_by_one_answer_does_not_fail_another(solved, tmp_path):
    """absorb.py calls np.seterr(all="raise") and os.chdir at import: its own checks still pass, and the
    reference merge_states, graded after it, is not failed by an underflow in the reference's exp."""
    _with_line_after_imports(solved / "absorb.py", 'np.seterr(all="raise"); import os; os.chdir("/")')
    report, code, _ = run_grader(tmp_path, answers=solved, names=("absorb", "merge_states"))
    failed = [(r["exercise"], r["test"], r["message"]) for r in report["records"] if r["outcome"] != "passed"]
    assert code == 0 and not failed, failed
    assert [r["status"] for r in report["results"]] == ["passed", "passed"]


def test_a_thread_left_running_by_an_answer_does_not_hold_the_grader(solved, tmp_path):
    """absorb.py starts a (non-daemon) thread that sleeps for an hour: the grader still ends once every
    check has run, with the score card and its exit status."""
    _with_line_after_imports(solved / "absorb.py", "import threading, time; "
                             "threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()")
    started = datetime.now()
    report, code, stdout = run_grader(tmp_path, answers=solved, names=("absorb",))
    assert (datetime.now() - started).total_seconds() < 120
    assert code == 0 and [r["status"] for r in report["results"]] == ["passed"] and "score card" in stdout


def test_what_a_failing_answer_prints_is_shortened_in_the_details(tmp_path):
    """A wrong absorb that prints 200,000 characters per call: the details (make grade DETAILS=1) show
    the start and end of each check's output, not all of it."""
    answers = tmp_path / "answers"
    answers.mkdir()
    (answers / "absorb.py").write_text((ROOT / "mutants" / "absorb__alpha_missing_on_o.py").read_text() + (
        "\n\n_absorb = absorb\n\n\ndef absorb(*args, **kwargs):\n    print('x' * 200_000)\n"
        "    return _absorb(*args, **kwargs)\n"))
    out = io.StringIO()
    assert grade.run(answers, ["absorb"], details=True, out=out) == 1
    text = out.getvalue()
    assert "alpha missing on o" in text and "Captured stdout call" in text
    assert "characters of this output left out by the grader" in text and len(text) < 60_000


def test_an_answer_that_ends_the_grading_process_fails_alone(solved):
    """causal.py calls os._exit(0) at import: the grading process ends without its report, so each
    exercise is graded in a process of its own; causal fails saying why, the others are graded."""
    _with_line_after_imports(solved / "causal.py", "import os; os._exit(0)")
    out = io.StringIO()
    assert grade.run(solved, ["online_softmax", "causal", "merge_states"], out=out) == 1
    rows = [line.split("│")[1:-1] for line in out.getvalue().splitlines() if line.startswith("│")]
    hint = " ".join(" ".join(r[-1].split()) for r in rows if len(r) == 4 and (r[1].strip() in ("causal", ""))
                    and not r[2].strip().startswith("all")).strip()
    status = {r[1].strip(): r[2].strip() for r in rows if len(r) == 4 and r[1].strip()}
    assert status == {"online_softmax": "all 12 checks passed", "causal": "1 of 1 check failed",
                      "merge_states": "all 8 checks passed"}, status
    assert hint == ("- the grading process ended without a report while grading causal (exit status 0): does "
                    "the answer call os._exit, kill its own process or crash Python?"), hint
    assert "3 exercises graded: 2 passed, 1 failed" in out.getvalue()


# --- decode_splits: answers a learner plausibly writes get the hint that fits -------------------------------

_DECODE_SPLITS_WRONG = {
    # a float count: the rule is right, only the type is wrong (no hint naming a mistake in the rule)
    "float": ("return float(min(pages, max(1, wave // blocks_per_split)))",
              "decode_splits returns an int"),
    # the count of least wave_time: several waves, cheaper in the model, not the kernel's rule
    "cheapest": ("return min(range(1, pages + 1), key=lambda s: (wave_time(s, blocks_per_split, pages, wave), s))",
                 "not the count of least wave_time"),
    # round() instead of floor: 528 / 200 = 2.64 -> 3 splits spill 72 blocks into a second wave
    "round": ("return min(pages, max(1, round(wave / blocks_per_split)))",
              MISTAKES.hint_text("fewest_splits_filling_the_wave")),
}


@pytest.mark.parametrize("kind", sorted(_DECODE_SPLITS_WRONG))
def test_decode_splits_wrong_answers_get_the_hint_that_fits(kind, tmp_path):
    body, hint = _DECODE_SPLITS_WRONG[kind]
    source = (ROOT / "solutions" / "decode_splits.py").read_text()
    right = "    return min(pages, max(1, wave // blocks_per_split))       # the most that fit one wave, 1..pages\n"
    assert source.count(right) == 1
    answer = tmp_path / "decode_splits.py"
    answer.write_text(source.replace(right, f"    {body}\n"))
    result = check("decode_splits", file=answer)
    assert result.status == "failed", result
    assert any(hint in h for h in result.result.hints), result.result.hints
    # no hint names a mistake this answer does not make
    named = {MISTAKES.hint_text(k) for k in MISTAKES.MISTAKES} - {hint}
    assert not set(result.result.hints) & named, result.result.hints


def test_decode_splits_the_cheapest_count_is_told_first_why_the_pick_stays_in_one_wave(tmp_path):
    """The count of least wave_time is the mistake the stub warns of: the one-line check in the notebook shows the
    advice written for it, not the assertion of the first check it fails."""
    body, hint = _DECODE_SPLITS_WRONG["cheapest"]
    source = (ROOT / "solutions" / "decode_splits.py").read_text()
    right = "    return min(pages, max(1, wave // blocks_per_split))       # the most that fit one wave, 1..pages\n"
    answer = tmp_path / "decode_splits.py"
    answer.write_text(source.replace(right, f"    {body}\n"))
    result = check("decode_splits", file=answer)
    assert result.status == "failed" and hint in result.hint, result


def test_decode_splits_wave_time_floor_plus_one_is_told_apart_from_the_pages(tmp_path):
    """blocks // wave + 1 waves is right unless the blocks fill whole waves; its hint says so, and never the one
    about the pages per block."""
    source = (ROOT / "solutions" / "decode_splits.py").read_text()
    right = "    waves = -(-num_splits * blocks_per_split // wave)"
    assert source.count(right) == 1
    answer = tmp_path / "decode_splits.py"
    answer.write_text(source.replace(right, "    waves = num_splits * blocks_per_split // wave + 1"))
    result = check("decode_splits", file=answer)
    assert result.result.hints == (MISTAKES.hint_text("waves_floor_plus_one"),)
    # the case of the hint, computed here: 66 splits of 8 blocks fill a wave of 528 exactly
    assert -(-66 * 8 // 528) == 1 and 66 * 8 // 528 + 1 == 2


# --- swizzle_128b: answers a learner plausibly writes get the hint that fits, or none that misleads ------------

_SWIZZLE_SLOT = "    return chunk ^ (row % 8)\n"
_SWIZZLE_OFFSET = "    return 128 * row + 16 * swizzle_128b(row, col // 8) + 2 * (col % 8)\n"
_SWIZZLE_PASSES = ("    slots = [swizzle_128b(r, chunk) for r in rows]\n"
                   "    return max(slots.count(s) for s in set(slots))\n")


def _swizzle_answer(tmp_path, replacements):
    source = (ROOT / "solutions" / "swizzle_128b.py").read_text()
    for old, new in replacements.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    answer = tmp_path / "swizzle_128b.py"
    answer.write_text(source)
    return answer


_SWIZZLE_WRONG = {
    # a float slot: the rule is right, only the type is wrong (the offset built on it is a float too)
    "float_slot": ({_SWIZZLE_SLOT: "    return float(chunk ^ (row % 8))\n"},
                   "swizzle_128b returns an int"),
    # the 64-byte swizzle's pattern: no named mistake, so the advice of the slot checks comes first
    "swizzle_64b": ({_SWIZZLE_SLOT: "    return chunk ^ ((row >> 1) & 3)\n"},
                    "swizzle_128b(row, chunk) is chunk XOR (row % 8)"),
    # rows 64 bytes apart: not a mistake in the XOR nor in the bytes per value
    "row_stride_64": ({_SWIZZLE_OFFSET: "    return 64 * row + 16 * swizzle_128b(row, col // 8) + 2 * (col % 8)\n"},
                      "128 x row + 16 x swizzle_128b(row, col // 8) + 2 x (col % 8)"),
    # col / 8: a float chunk index, so the XOR raises; the error is shown, not a named mistake
    "true_division": ({_SWIZZLE_OFFSET: "    return 128 * row + 16 * swizzle_128b(row, col / 8) + 2 * (col % 8)\n"},
                      "128 x row + 16 x swizzle_128b(row, col // 8) + 2 x (col % 8)"),
    # banks counted modulo 31: a wrong bank mapping in read_passes, the slots right
    "banks_mod_31": ({_SWIZZLE_PASSES: "    from collections import Counter\n    banks = Counter()\n"
                                       "    for r in rows:\n"
                                       "        start = swizzled_offset(r, 8 * chunk) // 4\n"
                                       "        banks.update({(start + i) % 31 for i in range(4)})\n"
                                       "    return max(banks.values())\n"},
                     "read_passes is the most of the rows' chunks that share one slot"),
}


@pytest.mark.parametrize("kind", sorted(_SWIZZLE_WRONG))
def test_swizzle_128b_wrong_answers_get_the_hint_that_fits(kind, tmp_path):
    replacements, hint = _SWIZZLE_WRONG[kind]
    result = check("swizzle_128b", file=_swizzle_answer(tmp_path, replacements))
    assert result.status == "failed", result
    assert result.result.hints and hint in result.result.hints[0], result.result.hints
    # no hint names a mistake this answer does not make
    assert not set(result.result.hints) & {MISTAKES.hint_text(k) for k in MISTAKES.MISTAKES}, result.result.hints


_SWIZZLE_RIGHT = {
    "bit_tricks": {_SWIZZLE_SLOT: "    return chunk ^ (row & 7)\n",
                   _SWIZZLE_OFFSET: "    return (row << 7) | (swizzle_128b(row, col >> 3) << 4) | ((col & 7) << 1)\n"},
    "lookup_table": {_SWIZZLE_SLOT: "    return [[c ^ r for c in range(8)] for r in range(8)][row % 8][chunk]\n"},
    "library": {_SWIZZLE_SLOT: "    from lessons.gpu.source import wgmma_swizzle\n"
                               "    return wgmma_swizzle(row, 8 * chunk, row + 1, 64) % 128 // 16\n",
                _SWIZZLE_OFFSET: "    from lessons.gpu.source import wgmma_swizzle\n"
                                 "    return wgmma_swizzle(row, col, row + 1, 64)\n"},
    "numpy": {_SWIZZLE_SLOT: "    import numpy as np\n    return np.int64(chunk) ^ np.int64(row % 8)\n",
              _SWIZZLE_PASSES: "    import numpy as np\n"
                               "    slots = np.bitwise_xor(chunk, np.asarray(list(rows)) % 8)\n"
                               "    return int(np.bincount(slots, minlength=8).max())\n"},
    "banks": {_SWIZZLE_PASSES: "    from collections import Counter\n    banks = Counter()\n    for r in rows:\n"
                               "        start = swizzled_offset(r, 8 * chunk) // 4\n"
                               "        banks.update({(start + i) % 32 for i in range(4)})\n"
                               "    return max(banks.values())\n"},
}


@pytest.mark.parametrize("kind", sorted(_SWIZZLE_RIGHT))
def test_swizzle_128b_right_answers_written_differently_pass(kind, tmp_path):
    result = check("swizzle_128b", file=_swizzle_answer(tmp_path, _SWIZZLE_RIGHT[kind]))
    assert result.status == "passed", (result.status, result.result.hints if result.result else None)

"""The grader's plumbing: which answers to grade, how to import them, and the score card.

Options (besides pytest's own):

    --answers DIR         folder holding one module per exercise (default: exercises,
                          or the GRADE_ANSWERS environment variable)
    --answer NAME=PATH    grade the file PATH as the answer to exercise NAME (repeatable)
    --grade-report PATH   also write the per-check results as JSON
    --no-shrink           report failing Hypothesis examples unshrunk (faster, same verdicts)

Each ``test_<name>.py`` sets ``EXERCISE = "<name>"`` and takes the ``answer`` fixture:
the answer module, imported by path without writing bytecode, whose functions turn
``NotImplementedError`` into a skip marked "not attempted". Checks carry
``@pytest.mark.catches(...)`` (mistake keys, see ``mistakes.py``) and/or
``@pytest.mark.hint(text)``; a failure shows them on the score card.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

sys.dont_write_bytecode = True        # never write __pycache__ next to an answer

from lessons.course.grade import format_score_card, get_exercise, summarise  # noqa: E402

from mistakes import hint_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_ATTEMPTED = "not attempted"

settings.register_profile(
    "grading", max_examples=20, deadline=None, derandomize=True, database=None, print_blob=False,
    report_multiple_bugs=False, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
settings.register_profile(        # same examples, same verdicts; a failing example is reported unshrunk
    "grading-no-shrink", parent=settings.get_profile("grading"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("grading")


def pytest_addoption(parser):
    group = parser.getgroup("grading")
    group.addoption("--answers", default=os.environ.get("GRADE_ANSWERS", "exercises"),
                    help="folder of answer modules to grade (default: exercises)")
    group.addoption("--answer", action="append", default=[], metavar="NAME=PATH",
                    help="grade PATH as the answer to exercise NAME (overrides --answers for it)")
    group.addoption("--grade-report", default=None, metavar="PATH", help="write the results as JSON")
    group.addoption("--no-shrink", action="store_true",
                    help="do not shrink failing Hypothesis examples (faster; same verdicts, larger examples)")


def _resolve(path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (ROOT / p).exists():
        p = ROOT / p
    return p.resolve()


def pytest_configure(config):
    config.addinivalue_line("markers", "catches(*mistakes): mistakes (keys of grading/mistakes.py) "
                                       "a failure of this check points to")
    config.addinivalue_line("markers", "hint(text): advice shown on the score card when this check fails")
    overrides = {}
    for item in config.getoption("--answer"):
        name, sep, path = item.partition("=")
        if not sep:
            raise pytest.UsageError(f"--answer wants NAME=PATH, got {item!r}")
        try:
            get_exercise(name)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from None
        overrides[name] = _resolve(path)
    config._grading = {"answers": _resolve(config.getoption("--answers")), "overrides": overrides,
                       "modules": {}}
    config.pluginmanager.register(ScoreCard(config), "grading-score-card")
    if config.getoption("--no-shrink"):
        settings.load_profile("grading-no-shrink")


def answer_path(config, name: str) -> Path:
    g = config._grading
    return g["overrides"].get(name, g["answers"] / f"{name}.py")


class Answer:
    """The learner's module seen through the grader: ``NotImplementedError`` becomes a skip."""

    def __init__(self, module, name: str, path: Path):
        self._module, self._name, self._path = module, name, path

    def __repr__(self) -> str:                 # what a failing check's details show for `answer`
        return f"<your {self._name} in {self._path}>"

    def __getattr__(self, attr):
        try:
            obj = getattr(self._module, attr)
        except AttributeError:
            raise AttributeError(f"{self._path} defines no {attr!r} (keep the names and signatures of "
                                 f"the stub)") from None
        if not callable(obj) or isinstance(obj, type):
            return obj

        @functools.wraps(obj)
        def call(*args, **kwargs):
            try:
                return obj(*args, **kwargs)
            except NotImplementedError:
                pytest.skip(f"{NOT_ATTEMPTED}: {self._name}.{attr} still raises NotImplementedError")
        return call


def load_answer(config, name: str) -> Answer:
    """Import ``<answers>/<name>.py`` by path (once per run) without writing bytecode."""
    path = answer_path(config, name)
    cache = config._grading["modules"]
    if path in cache:
        return cache[path]
    if not path.is_file():
        pytest.fail(f"no answer file {path}", pytrace=False)
    modname = f"_graded_{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        spec.loader.exec_module(module)
    except NotImplementedError:
        del sys.modules[modname]
        pytest.skip(f"{NOT_ATTEMPTED}: importing {path.name} raises NotImplementedError")
    except SystemExit as exc:                            # a BaseException; KeyboardInterrupt still stops the run
        del sys.modules[modname]
        pytest.fail(f"could not import {path} (it called sys.exit({exc.code!r}) at import; "
                    f"keep such code under `if __name__ == \"__main__\":`)", pytrace=False)
    except Exception as exc:
        del sys.modules[modname]
        pytest.fail(f"could not import {path}: {type(exc).__name__}: {exc}", pytrace=False)
    finally:
        sys.dont_write_bytecode = before
    cache[path] = Answer(module, name, path)
    return cache[path]


@pytest.fixture(scope="module")
def answer(request):
    """The answer module for this test file's ``EXERCISE``."""
    return load_answer(request.config, request.module.EXERCISE)


# --- collecting results -------------------------------------------------------------------

def _hints(item) -> tuple[list[str], list[str]]:
    """(the named mistakes' hints, the other advice) of a check, from its markers."""
    mistakes = [hint_text(k) for m in item.iter_markers("catches") for k in m.args]
    return mistakes, [m.args[0] for m in item.iter_markers("hint")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    module = getattr(item, "module", None)
    rep._grading_exercise = getattr(module, "EXERCISE", None)
    rep._grading_catches = [k for m in item.iter_markers("catches") for k in m.args]
    rep._grading_hints = _hints(item)


def _skip_reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2])
    return str(lr)


def _failure_message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


class ScoreCard:
    """Collects one record per check and prints the score card (pytest_terminal_summary)."""

    def __init__(self, config):
        self.config = config
        self.records: dict[str, dict] = {}

    def pytest_runtest_logreport(self, report):
        exercise = getattr(report, "_grading_exercise", None)
        if exercise is None:
            return
        rec = self.records.setdefault(report.nodeid, {
            "exercise": exercise, "test": report.nodeid.split("::", 1)[-1], "outcome": "passed",
            "catches": report._grading_catches, "hints": [], "advice": [], "message": ""})
        if report.failed:
            message = _failure_message(report)
            mistakes, advice = report._grading_hints if report.when == "call" else ([], [])
            rec.update(outcome="failed", message=message, hints=mistakes,
                       advice=advice or ([message] if message and not mistakes else []))
        elif report.skipped and rec["outcome"] != "failed":
            reason = _skip_reason(report)
            rec["outcome"] = NOT_ATTEMPTED if NOT_ATTEMPTED in reason else "skipped"
            rec["message"] = reason

    def label(self) -> str:
        g = self.config._grading
        label = str(g["answers"])
        try:
            label = str(g["answers"].relative_to(ROOT)) + "/"
        except ValueError:
            pass
        if g["overrides"]:
            label += " (" + ", ".join(f"{n} = {p.name}" for n, p in g["overrides"].items()) + ")"
        return label

    def pytest_sessionfinish(self, session):
        path = self.config.getoption("--grade-report")
        if not path:
            return
        records = list(self.records.values())
        results = summarise(records)
        g = self.config._grading
        Path(path).write_text(json.dumps({
            "answers": str(g["answers"]),
            "overrides": {k: str(v) for k, v in g["overrides"].items()},
            "records": records,
            "results": [dict(r.__dict__, hints=list(r.hints), failed_tests=list(r.failed_tests))
                        for r in results],
            "score_card": format_score_card(results, answers=self.label()),
        }, indent=1))

    def pytest_terminal_summary(self, terminalreporter):
        results = summarise(list(self.records.values()))
        if not results:
            return
        terminalreporter.write_line("")
        width = max(80, min(terminalreporter._tw.fullwidth, 120))
        for line in format_score_card(results, answers=self.label(), width=width).rstrip().splitlines():
            terminalreporter.write_line(line)

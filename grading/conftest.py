"""The grader's plumbing: which answers to grade, how to import them, and the score card.

Options (besides pytest's own):

    --answers DIR         folder holding one module per exercise (default: exercises,
                          or the GRADE_ANSWERS environment variable)
    --answer NAME=PATH    grade the file PATH as the answer to exercise NAME (repeatable)
    --grade-report PATH   also write the per-check results as JSON
    --no-shrink           report failing Hypothesis examples unshrunk (faster, same verdicts)
    --check-timeout SEC   time limit of each check, import included (default 60; 0: none)

Each ``test_<name>.py`` sets ``EXERCISE = "<name>"`` and takes the ``answer`` fixture:
the answer module, imported by path without writing bytecode, whose functions turn
``NotImplementedError`` into a skip marked "not attempted". Checks carry
``@pytest.mark.catches(...)`` (mistake keys, see ``mistakes.py``) and/or
``@pytest.mark.hint(text)``; a failure shows them on the score card.

Two guards keep a broken answer from taking the grader or the learner's files with it:

* a check that runs past ``--check-timeout`` seconds (an endless loop, in the answer's
  functions or at its import) fails with that message, and the exercise's remaining
  checks fail at once instead of each waiting out the limit (pytest-timeout's "signal"
  method, SIGALRM, in the main thread; elsewhere no limit);
* the files of the answers folder (and of each ``--answer`` file) are read before the
  first check and compared after each one: a file the answer deleted is written back,
  and a file that changed stays as it is now with its content from before grading saved
  beside it as ``NAME.bak-YYYYmmdd-HHMMSS`` (never overwriting a file). Either way the
  exercise whose check was running fails, and its first hint says what happened.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import signal
import sys
import threading
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings
from pytest_timeout import HAVE_SIGALRM, PYTEST_FAILURE_MESSAGE

sys.dont_write_bytecode = True        # never write __pycache__ next to an answer

from lessons.course.grade import _backup_path, format_score_card, get_exercise, summarise  # noqa: E402

from mistakes import hint_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_ATTEMPTED = "not attempted"
CHECK_TIMEOUT = 60.0          # seconds per check (its setup, the import included, and its call); the solutions take < 1 s
SNAPSHOT_MAX_BYTES = 4 << 20  # files of the answers folder larger than this are not guarded
CAPTURED_KEEP = 4000          # characters of an answer's printed output a failing check's report shows

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
    group.addoption("--check-timeout", type=float, default=CHECK_TIMEOUT, metavar="SECONDS",
                    help=f"fail a check that runs longer than this (default {CHECK_TIMEOUT:g}; 0: no limit)")


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
    if config.getoption("--check-timeout") < 0:
        raise pytest.UsageError(f"--check-timeout must be >= 0 seconds, got {config.getoption('--check-timeout')}")
    if config.getoption("--check-timeout") and not config.pluginmanager.has_plugin("timeout"):
        raise pytest.UsageError("--check-timeout needs the pytest-timeout plugin, which is disabled "
                                "(-p no:timeout); give --check-timeout 0 to grade without a time limit")
    answers = _resolve(config.getoption("--answers"))
    config._grading = {"answers": answers, "overrides": overrides, "modules": {}, "timed_out": {},
                       "files": _snapshot([answers, *overrides.values()]),
                       "start": (np.geterr(), np.geterrcall(), os.getcwd())}
    config.pluginmanager.register(ScoreCard(config), "grading-score-card")
    if config.getoption("--no-shrink"):
        settings.load_profile("grading-no-shrink")


def answer_path(config, name: str) -> Path:
    g = config._grading
    return g["overrides"].get(name, g["answers"] / f"{name}.py")


class Answer:
    """The learner's module seen through the grader: ``NotImplementedError`` becomes a skip, and
    the time limit's failure (``--check-timeout``, through pytest-timeout) a :class:`CheckTimeout`."""

    def __init__(self, module, name: str, path: Path, config):
        self._module, self._name, self._path, self._config = module, name, path, config

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
            except pytest.fail.Exception as exc:
                if not _is_timeout(self._config, exc):
                    raise
                raise CheckTimeout(_timeout_message(self._config)).with_traceback(exc.__traceback__) from None
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
    if spec is None or spec.loader is None:              # a name without .py (the notebook, a copy saved as text)
        pytest.fail(f"could not import {path}: an answer is a Python file whose name ends in .py "
                    f"(exercises/{name}.py)", pytrace=False)
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
    except pytest.fail.Exception as exc:                  # pytest-timeout's, at the time limit
        if not _is_timeout(config, exc):
            raise
        del sys.modules[modname]
        limit = config.getoption("--check-timeout")
        pytest.fail(f"could not import {path}: the import ran longer than {limit:g} s (an endless loop "
                    f"outside the functions? keep such code under `if __name__ == \"__main__\":`)", pytrace=False)
    except Exception as exc:
        del sys.modules[modname]
        pytest.fail(f"could not import {path}: {type(exc).__name__}: {exc}", pytrace=False)
    finally:
        sys.dont_write_bytecode = before
    cache[path] = Answer(module, name, path, config)
    return cache[path]


@pytest.fixture(scope="module")
def answer(request):
    """The answer module for this test file's ``EXERCISE``."""
    return load_answer(request.config, request.module.EXERCISE)


# --- guards: a time limit per check, and the answers' files kept -----------------------------

class CheckTimeout(BaseException):
    """A check ran past ``--check-timeout`` in the answer's code. pytest-timeout stops it with pytest's
    ``Failed``, which Hypothesis takes for a failing example and runs again (endlessly, for an endless
    loop); leaving the answer it becomes this BaseException, which Hypothesis does not catch."""


class NotRunAfterTimeout(Exception):
    """A check not run because an earlier check of its exercise timed out (a failure, whose message
    is not advice of its own: the timed-out check's message is the one to read)."""


def _exercise_of(item):
    return getattr(getattr(item, "module", None), "EXERCISE", None)


def _timeout_message(config) -> str:
    return (f"this check ran longer than {config.getoption('--check-timeout'):g} s (an endless loop?); "
            f"the limit is the grader's --check-timeout")


def _is_timeout(config, exc) -> bool:
    """Whether ``exc`` is pytest-timeout's failure at the grader's time limit."""
    limit = config.getoption("--check-timeout")
    return bool(limit) and isinstance(exc, pytest.fail.Exception) and str(exc) == PYTEST_FAILURE_MESSAGE % limit


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Each check (its setup, where the answer module is imported, included) under ``--check-timeout``
    as pytest-timeout's limit, with its "signal" method (SIGALRM) where there is one and this is the
    main thread (where signals arrive); elsewhere no limit (its "thread" method would end the process)."""
    limit = item.config.getoption("--check-timeout")
    if not (HAVE_SIGALRM and threading.current_thread() is threading.main_thread()):
        limit = 0
    if item.config.pluginmanager.has_plugin("timeout"):     # (0: none, whatever --timeout or PYTEST_TIMEOUT say)
        item.add_marker(pytest.mark.timeout(limit, method="signal", func_only=False))
    return (yield)


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's SIGALRM fires once; an answer's ``except:`` (or ``except BaseException``) in its
    loop can swallow that one failure, so the alarm is made to fire again every second until the check
    ends (pytest-timeout's cancel stops it: ``setitimer(ITIMER_REAL, 0)``)."""
    armed = yield
    if settings.method == "signal" and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, settings.timeout, 1.0)
    return armed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Once a check of an exercise timed out, its other checks fail at once (their setup still
    runs: pytest keeps its fixtures' state)."""
    config = item.config
    first = config._grading["timed_out"].get(_exercise_of(item))
    if first is not None:
        raise NotRunAfterTimeout(f"not run: the check {first} of this exercise ran past the time limit")
    try:
        return (yield)
    except (CheckTimeout, pytest.fail.Exception) as exc:
        if isinstance(exc, CheckTimeout) or _is_timeout(config, exc):
            config._grading["timed_out"].setdefault(_exercise_of(item), item.name)
        raise


def _end_time_limit(item):
    """Stop the check's time limit (pytest-timeout's cancel; nothing to do with the plugin disabled)."""
    cancel = getattr(item.config.pluginmanager.hook, "pytest_timeout_cancel_timer", None)
    if cancel is not None:
        cancel(item=item)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    """The teardown (where the answers' files are put right) runs without the time limit."""
    _end_time_limit(item)


def _snapshot(places) -> dict:
    """``{path: bytes}`` of the regular files in each folder of ``places`` (not recursing) and of
    each file in it, those up to :data:`SNAPSHOT_MAX_BYTES`."""
    files = {}
    for place in places:
        paths = sorted(place.iterdir()) if place.is_dir() else [place]
        for path in paths:
            try:
                if path.is_file() and not path.is_symlink() and path.stat().st_size <= SNAPSHOT_MAX_BYTES:
                    files[path] = path.read_bytes()
            except OSError:
                pass
    return files


def _restore_files(files: dict) -> list[str]:
    """Put right what a check did to the snapshot ``files`` (updated in place); say what was done."""
    done = []
    for path, before in list(files.items()):
        try:
            now = path.read_bytes() if path.is_file() else None
        except OSError:
            now = None
        if now == before:
            continue
        if now is None and not os.path.lexists(path):         # deleted (or its folder was): write it back
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.grading-tmp")
            tmp.write_bytes(before)
            os.replace(tmp, path)
            done.append(f"{path.name} was deleted while this check ran; the grader wrote it back")
            continue
        backup = _backup_path(path, datetime.now())       # changed, or something else is in its place
        with open(backup, "xb") as fh:                     # "x": never overwrites a file
            fh.write(before)
        done.append(f"{path.name} changed while this check ran; its content from before grading "
                    f"is saved as {backup.name}")
        if now is None:
            del files[path]
        else:
            files[path] = now
    return done


class AnswerFilesChanged(Exception):
    """An answer deleted or changed a file of the answers folder (which was put right)."""


@pytest.fixture(autouse=True)
def _same_numpy_and_folder_for_every_check(request):
    """After each check, the floating-point error handling and working folder the grader started with:
    an answer's ``np.seterr(all="raise")`` or ``os.chdir`` (at its import, say) never reaches the
    reference computations of the exercises graded after it."""
    yield
    errors, handler, cwd = request.config._grading["start"]
    np.seterr(**errors)
    np.seterrcall(handler)
    if os.getcwd() != cwd:
        os.chdir(cwd)


@pytest.fixture(autouse=True)
def _keep_answer_files(request):
    """After each check, the answers folder's files as they were before grading (see the module's text)."""
    yield
    done = _restore_files(request.config._grading["files"])
    if done:
        raise AnswerFilesChanged("; ".join(done) + " (does the answer write or delete files?)")


def pytest_sessionfinish(session, exitstatus):
    session.config._grading["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the grader now if an answer left a thread running (a non-daemon thread would hold the
    process, and ``make grade`` with it, until the thread ends: forever, for an endless one). The
    score card and the report are written by then."""
    grading = getattr(config, "_grading", None)
    if grading is None or "exitstatus" not in grading or hasattr(config, "workerinput"):
        return                                            # (an xdist worker ends as xdist says)
    left = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if left:
        sys.stderr.write(f"grader: an answer left {len(left)} thread(s) running "
                         f"({', '.join(t.name for t in left)}); ending without waiting for them\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(grading["exitstatus"])


# --- collecting results -------------------------------------------------------------------

def _hints(item) -> tuple[list[str], list[str]]:
    """(the named mistakes' hints, the other advice) of a check, from its markers."""
    mistakes = [hint_text(k) for m in item.iter_markers("catches") for k in m.args]
    return mistakes, [m.args[0] for m in item.iter_markers("hint")]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and call.when != "teardown":
        _end_time_limit(item)       # a setup or call that failed (at the time limit, say) is timed no more
    outcome = yield
    rep = outcome.get_result()
    module = getattr(item, "module", None)
    rep._grading_exercise = getattr(module, "EXERCISE", None)
    rep._grading_catches = [k for m in item.iter_markers("catches") for k in m.args]
    rep._grading_hints = _hints(item)
    excinfo = call.excinfo
    rep._grading_files = str(excinfo.value) if excinfo is not None and excinfo.errisinstance(AnswerFilesChanged) else ""
    rep._grading_not_run = excinfo is not None and excinfo.errisinstance(NotRunAfterTimeout)
    rep._grading_timeout = (_timeout_message(item.config) if excinfo is not None and (
        excinfo.errisinstance(CheckTimeout) or _is_timeout(item.config, excinfo.value)) else "")
    rep.sections = [(title, _shortened(text) if title.startswith("Captured") else text) for title, text in rep.sections]


def _shortened(text: str, keep: int = CAPTURED_KEEP) -> str:
    """What an answer printed, as a failing check's report shows it: the first and last ``keep // 2``
    characters when there is more (an answer printing in a loop would fill the terminal)."""
    if len(text) <= keep:
        return text
    half = keep // 2
    return (f"{text[:half]}\n... ({len(text) - 2 * half:,} characters of this output left out by the grader) ...\n"
            f"{text[-half:]}")


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
            "catches": report._grading_catches, "hints": [], "advice": [], "message": "", "files": []})
        if report._grading_files:                        # the answer deleted or changed files: shown first
            rec["files"].append(report._grading_files)
            if rec["outcome"] != "failed":
                rec.update(outcome="failed", message=report._grading_files)
        elif report.failed:
            message = _failure_message(report)
            mistakes, advice = report._grading_hints if report.when == "call" else ([], [])
            if report._grading_not_run:                  # the check that timed out says why
                mistakes, advice, message = [], [], ""
            elif report._grading_timeout:                # no mistake of the check's: it never finished
                mistakes, advice, message = [], [report._grading_timeout], report._grading_timeout
            bare = bool(message) and not advice and not mistakes     # its failure's message is all it says
            rec.update(outcome="failed", message=message, hints=mistakes, advice=advice or ([message] if bare else []),
                       bare=bare)
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

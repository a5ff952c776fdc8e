"""Grading the exercises: the exercise list, the score card, a live check, and reset.

The grader is pytest: the tests in ``grading/`` import each answer module by path
from a folder (``exercises/`` by default, ``solutions/`` for the reference answers)
and a small plugin (``grading/conftest.py``) prints a score card at the end, one
line per exercise: passed, failed (with a hint naming the likely mistake), or not
attempted (the stub still raises ``NotImplementedError``).

Command line (``python -m lessons.course.grade ...``)::

    run [--answers DIR] [--details] [NAME ...]
                                     grade, print the score card, then (--details) what each
                                     failing check asserted (same as ``make grade [DETAILS=1]``)
    check NAME [--file PATH]         grade one exercise, print one line
    reset NAME                       restore the stub; your file is kept as NAME.py.bak-YYYYmmdd-HHMMSS
    list                             the exercises, in lesson order

The plain pytest command is ``python -m pytest grading --answers exercises``.
Grading only reads the answer files: nothing is written into ``exercises/``
(not even ``__pycache__``), unless an answer deletes or changes a file there: then the
grader writes the deleted file back, or saves the changed one's old content beside it,
and fails that exercise saying so. Each check has a time limit (60 s; pytest's
``--check-timeout``), so an endless loop fails its exercise instead of hanging the run;
an answer that ends the grading process (``os._exit``, a crash) fails alone, the other
exercises being graded again one process each.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

__all__ = [
    "Exercise", "EXERCISES", "ExerciseResult", "CheckResult", "STATUSES",
    "repo_root", "get_exercise", "summarise", "format_score_card", "is_untouched_stub",
    "pytest_command", "run", "check", "reset", "main",
]

STATUSES = ("passed", "failed", "incomplete", "not attempted")
"""What an exercise can be: every check passed; at least one failed; some passed and the
rest are still stubs; every check hit a stub (``NotImplementedError``)."""


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``name`` (the module ``exercises/<name>.py``), the ``notebook`` that
    teaches it (e.g. ``"02_flash_attention_tile_by_tile"``) and a one-line ``title``."""

    name: str
    notebook: str
    title: str


EXERCISES: tuple[Exercise, ...] = (
    Exercise("online_softmax", "01_online_softmax",
             "online softmax: running max and sum, 1-D and row-wise"),
    Exercise("absorb", "02_flash_attention_tile_by_tile",
             "the absorb step: fold one tile into (m, l, o)"),
    Exercise("causal", "03_query_blocks_and_causal",
             "causal mask in the tiled loop; the NaN of a fully masked tile"),
    Exercise("backward", "04_backward_pass",
             "the backward pass tile by tile: recompute P from L, D = rowsum(dO * O)"),
    Exercise("peak_memory", "05_io_awareness",
             "peak memory of textbook vs flash: quadratic vs linear"),
    Exercise("rescale_tiles", "06_kernel_ladder",
             "lazy rescaling: the key tiles where a block of rows must still rescale"),
    Exercise("paged", "07_paged_attention",
             "paged lookup through a block table, partial last block"),
    Exercise("flash_decoding", "08_flash_decoding_and_ring",
             "flash-decoding: four workers, merged (m, l, o) triples"),
    Exercise("merge_states", "08_flash_decoding_and_ring",
             "merge_states in the normalised (o, lse) form, empty states"),
    Exercise("ring_step", "08_flash_decoding_and_ring",
             "one ring-attention step: fold the KV block a device holds"),
    Exercise("gqa_decode", "09_paged_gqa_decode",
             "GQA head mapping in a paged decode"),
    Exercise("decode_splits", "10_decode_kernel_ladder",
             "the split count of a decode launch from the wave model"),
    Exercise("swizzle_128b", "11_hopper_kernels",
             "the 128-byte swizzle: where each 16-byte chunk sits, and the bank conflicts it removes"),
)


def repo_root() -> Path:
    """The repository root: the folder holding ``lessons/``, ``grading/`` and ``exercises/``.

    Raises FileNotFoundError if ``grading/`` is not beside the ``lessons`` package
    (the grader runs from a checkout of the repository, not from an installed wheel).
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "grading" / "conftest.py").is_file():
        raise FileNotFoundError(f"grading/ not found under {root}: run the grader from a checkout of the repository")
    return root


def get_exercise(name: str) -> Exercise:
    """The :class:`Exercise` called ``name``; ValueError listing the valid names otherwise."""
    for ex in EXERCISES:
        if ex.name == name:
            return ex
    raise ValueError(f"unknown exercise {name!r}; the exercises are: {', '.join(e.name for e in EXERCISES)}")


# --- results -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExerciseResult:
    """How one exercise did: counts of checks ``passed``/``failed``/``not_attempted``,
    its ``status`` (one of :data:`STATUSES`), the ``hints`` to show (most frequent first)
    and the names of the ``failed_tests``."""

    name: str
    status: str
    passed: int
    failed: int
    not_attempted: int
    hints: tuple[str, ...] = ()
    failed_tests: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.not_attempted


def _ranked(lists) -> list[str]:
    """Distinct strings of ``lists``, the one in the most lists first (ties: first seen first)."""
    lists = [list(dict.fromkeys(x)) for x in lists]
    count = Counter(h for x in lists for h in x)
    first = {h: i for i, h in enumerate(dict.fromkeys(h for x in lists for h in x))}
    return sorted(count, key=lambda h: (-count[h], first[h]))


def _named_mistakes(recs, failed) -> list[list[str]]:
    """Per failed check, the hints of the named mistakes it really points to.

    A check that catches exactly one mistake *distinguishes* it: if that check passed,
    the mistake was not made, and its hint is dropped from every other failure; if it
    failed, the mistake is confirmed, and a failure that names several mistakes then
    shows only the confirmed ones. So an answer missing alpha on o, which fails the
    check of o (alpha on o only) and the check of o / l (either alpha), but passes the
    check of l, gets only "alpha missing on o".
    """
    def pairs(r):
        catches, hints = list(r.get("catches") or ()), list(r.get("hints") or ())
        if len(catches) != len(hints):               # a record without keys: its hints are kept as they are
            return [(None, h) for h in hints]
        return list(zip(catches, hints))

    def single(r):
        catches = r.get("catches") or ()
        return catches[0] if len(catches) == 1 else None

    confirmed = {single(r) for r in failed} - {None}
    ruled_out = {single(r) for r in recs if r["outcome"] == "passed"} - {None} - confirmed
    kept = [[(k, h) for k, h in pairs(r) if k is None or k not in ruled_out] for r in failed]
    confirmed |= {x[0][0] for x in kept if len(x) == 1 and x[0][0] is not None}
    if confirmed:
        kept = [[(k, h) for k, h in x if k is None or k in confirmed] for x in kept]
    return [[h for _, h in x] for x in kept]


def summarise(records, *, max_hints: int = 3) -> list[ExerciseResult]:
    """Fold per-test records into one :class:`ExerciseResult` per exercise, in lesson order.

    ``records``: iterable of dicts with keys ``exercise`` (str), ``test`` (str),
    ``outcome`` (``"passed"``, ``"failed"``, ``"not attempted"`` or ``"skipped"``; a
    plain skip counts for nothing), optionally ``catches`` (list of mistake keys the
    check distinguishes, see ``grading/mistakes.py``), and for failures ``hints`` (list
    of str: the named mistakes' hints, in the order of ``catches``) and ``advice``
    (list of str: other advice, or the failure message, when ``bare`` is true: the check has
    no advice of its own). An exercise is ``failed`` if
    any check failed, ``not attempted`` if every check hit a stub, ``incomplete`` if
    some passed and the rest hit a stub, else ``passed``. The hints shown are those of
    the mistakes actually made (a mistake whose own check passed is ruled out; one whose
    own check failed is confirmed and shown alone), the one named by the most failures
    first; only when no named mistake is left, the advice written for the failed checks
    ranked the same way, then the failure messages of the checks without such advice;
    at most ``max_hints``. Raises
    ValueError for an unknown outcome.
    """
    by_name: dict[str, list[dict]] = {}
    for rec in records:
        if rec["outcome"] not in ("passed", "failed", "not attempted", "skipped"):
            raise ValueError(f"unknown outcome {rec['outcome']!r} in record {rec!r}")
        by_name.setdefault(rec["exercise"], []).append(rec)
    order = {ex.name: i for i, ex in enumerate(EXERCISES)}
    results = []
    for name in sorted(by_name, key=lambda n: (order.get(n, len(order)), n)):
        recs = by_name[name]
        count = Counter(r["outcome"] for r in recs)
        failed = [r for r in recs if r["outcome"] == "failed"]
        named = _named_mistakes(recs, failed)
        if any(named):                               # the mistakes made; other advice after they are fixed
            advice = messages = []
        else:                                        # no named mistake: the checks' advice, then what failed
            # (a check with no advice of its own, ``bare``, has its failure's message for advice: it comes after
            # the advice written for the checks, which says more than an assertion)
            advice = [[] if r.get("bare") else list(r.get("advice") or ()) for r in failed]
            messages = [[r["message"]] if r.get("message") and not own else [] for r, own in zip(failed, advice)]
        files = [m for r in recs for m in (r.get("files") or ())]
        hints = files + _ranked(named) + _ranked(advice) + _ranked(messages)
        hints = [h for h in dict.fromkeys(hints) if h][:max_hints]
        if count["failed"]:
            status = "failed"
        elif count["not attempted"] and count["passed"]:
            status = "incomplete"
        elif count["not attempted"]:
            status = "not attempted"
        else:
            status = "passed"
        results.append(ExerciseResult(name=name, status=status, passed=count["passed"], failed=count["failed"],
                                      not_attempted=count["not attempted"], hints=tuple(hints),
                                      failed_tests=tuple(r["test"] for r in failed)))
    return results


def _checks(n: int) -> str:
    return f"{n} check" + ("" if n == 1 else "s")


def _status_text(r: ExerciseResult) -> str:
    if r.status == "passed":
        return f"all {_checks(r.total)} passed" if r.total > 1 else "1 check passed"
    if r.status == "failed":
        return f"{r.failed} of {_checks(r.total)} failed"
    if r.status == "incomplete":
        return f"{r.passed} of {_checks(r.total)} passed, {r.not_attempted} not written yet"
    return "not attempted"


#: The first line of every score card starts with this (see :func:`format_score_card`).
SCORE_CARD_TITLE = "score card: "


def format_score_card(results, *, answers: str = "exercises", width: int = 100) -> str:
    """The score card as plain text (a rich table): one row per exercise.

    ``results``: list of :class:`ExerciseResult`; ``answers``: the folder graded, for
    the title. Failed rows show their hints (see :func:`summarise`).
    """
    from rich.console import Console
    from rich.table import Table

    lesson = {ex.name: ex.notebook[:2] for ex in EXERCISES}
    table = Table(title=f"{SCORE_CARD_TITLE}{answers}", title_justify="left", show_lines=False, expand=False)
    table.add_column("nb", no_wrap=True)
    table.add_column("exercise", no_wrap=True)
    table.add_column("result", no_wrap=True)
    table.add_column("hint / next step", overflow="fold")
    for r in results:
        if r.status == "failed":
            note = "\n".join(f"- {h}" for h in r.hints) or "make grade DETAILS=1 shows the failing checks"
        elif r.status == "not attempted":
            note = f"open exercises/{r.name}.py"
        elif r.status == "incomplete":
            note = f"{r.not_attempted} check(s) still hit NotImplementedError"
        else:
            note = ""
        table.add_row(lesson.get(r.name, "--"), r.name, _status_text(r), note)
    tally = Counter(r.status for r in results)
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False, soft_wrap=False)
    console.print(table)
    counts = ", ".join(f"{tally[s]} {s}" for s in STATUSES if tally[s])
    console.print(f"{len(results)} exercise{'s' * (len(results) != 1)} graded: {counts}" if results
                  else "no exercise graded")
    return buf.getvalue()


# --- running the grader ---------------------------------------------------------------------

def pytest_command(answers=None, names=(), *, answer_files=None, report=None, extra=()) -> list[str]:
    """The pytest command line that grades ``names`` (all exercises if empty).

    ``answers``: folder of answer modules (default ``exercises``); ``answer_files``: a
    dict ``{name: path}`` grading one file for one exercise instead; ``report``: a path
    for the JSON report; ``extra``: more pytest arguments. Run it from :func:`repo_root`.
    """
    root = repo_root()
    for n in names:
        get_exercise(n)
    targets = [str(root / "grading" / f"test_{n}.py") for n in names] or [str(root / "grading")]
    cmd = [sys.executable, "-m", "pytest", "-c", str(root / "grading" / "pytest.ini"), *targets, "-q", "--tb=short"]
    if answers is not None:
        cmd += ["--answers", str(answers)]
    for n, path in (answer_files or {}).items():
        get_exercise(n)
        cmd += ["--answer", f"{n}={path}"]
    if report is not None:
        cmd += ["--grade-report", str(report)]
    return cmd + list(extra)


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)          # the grader has its own options (grading/pytest.ini)
    return env


def run(answers="exercises", names=(), *, details: bool = False, out=None) -> int:
    """Grade ``names`` (default: all) from the folder ``answers``; print the score card first.

    The score card comes first, then one line counting the failed checks; with
    ``details=True`` pytest's report of each failing check (its assertion and the
    lines of the grading test) follows the card. ``out``: a text stream (default
    ``sys.stdout``). Returns pytest's exit status (0: nothing failed; 1: a check failed).

    Should the grading process end without its report (an answer calling ``os._exit``,
    killing its process or crashing Python), each exercise is graded again in a process of
    its own, and an exercise whose process ends so is failed, saying so, on the card.
    """
    out = sys.stdout if out is None else out
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pytest_command(answers, names, report=report, extra=["--tb=short" if details else "--tb=no"])
        proc = subprocess.run(cmd, cwd=repo_root(), env=_env(), capture_output=True, text=True)
        if report.is_file():
            data = json.loads(report.read_text())
            records, card, returncode, pytest_out = data["records"], data["score_card"], proc.returncode, proc.stdout
        else:
            records, card, returncode, pytest_out = _grade_one_by_one(answers, names, details, Path(tmp))
            if not records:
                out.write(proc.stdout + proc.stderr)
                return proc.returncode or 1
    results = summarise(records)
    out.write(card)
    failed = sum(r.failed for r in results)
    total = sum(r.total for r in results)
    if failed:
        out.write(f"{failed} of {_checks(total)} failed.")
        if details:
            out.write(" The failing checks, as pytest reports them:\n\n")
            out.write(_failure_details(pytest_out))
        else:
            out.write(" For what each failing check asserted: make grade DETAILS=1\n")
    elif total:
        out.write(f"{total - sum(r.not_attempted for r in results)} of {_checks(total)} passed, none failed.\n")
    return returncode


def _grade_one_by_one(answers, names, details: bool, tmp: Path):
    """Grade each exercise of ``names`` (all if empty) in a process of its own: ``(records, score card,
    exit status, pytest's output)``. An exercise whose process ends without a report gets one failed
    record saying so; no records at all when no exercise could be graded (the grader itself is broken)."""
    records, outputs, returncode, graded = [], [], 0, 0
    for name in names or [ex.name for ex in EXERCISES]:
        report = tmp / f"report-{name}.json"
        cmd = pytest_command(answers, [name], report=report, extra=["--tb=short" if details else "--tb=no"])
        proc = subprocess.run(cmd, cwd=repo_root(), env=_env(), capture_output=True, text=True)
        outputs.append(proc.stdout)
        if report.is_file():
            records += json.loads(report.read_text())["records"]
            returncode, graded = max(returncode, proc.returncode), graded + 1
            continue
        records.append({"exercise": name, "test": f"grading/test_{name}.py", "outcome": "failed", "catches": [],
                        "hints": [], "files": [], "message": "",
                        "advice": [f"the grading process ended without a report while grading {name} (exit status "
                                   f"{proc.returncode}): does the answer call os._exit, kill its own process or "
                                   f"crash Python?"]})
        returncode = max(returncode, 1)
    if not graded:
        return [], "", returncode, ""
    label = Path(answers).resolve()
    try:
        label = f"{label.relative_to(repo_root())}/"
    except ValueError:
        pass
    return records, format_score_card(summarise(records), answers=str(label)), returncode, "\n".join(outputs)


def _failure_details(pytest_output: str) -> str:
    """The FAILURES section of pytest's output, without the grader's own score card after it."""
    lines = pytest_output.splitlines()
    start = next((i for i, line in enumerate(lines) if "FAILURES" in line and line.startswith("=")), None)
    if start is None:
        return pytest_output
    # the section ends at pytest's next "=" heading, or earlier at the score card that the grader's
    # terminal summary prints (pytest writes it inside the FAILURES section, before the short summary)
    stop = next((i for i in range(start + 1, len(lines))
                 if (lines[i].startswith("=") and "FAILURES" not in lines[i])
                 or lines[i].startswith(SCORE_CARD_TITLE)), len(lines))
    return "\n".join(lines[start:stop]).rstrip() + "\n"


@dataclass(frozen=True)
class CheckResult:
    """The outcome of :func:`check` for one exercise; prints as one short line.

    ``status`` is one of :data:`STATUSES` or ``"error"`` (the grader could not run);
    ``hint`` the first hint of a failure (or the error), followed in the printed line by how many
    more hints the score card of ``make grade`` holds; ``result`` the full :class:`ExerciseResult`
    when grading ran.
    """

    name: str
    status: str
    hint: str = ""
    result: ExerciseResult | None = field(default=None, repr=False)

    def __str__(self) -> str:
        r = self.result
        if self.status == "passed":
            return f"{self.name}: all {_checks(r.passed)} passed"
        if self.status == "not attempted":
            return f"{self.name}: not attempted yet (write your answer in exercises/{self.name}.py and save it)"
        if self.status == "incomplete":
            return (f"{self.name}: incomplete: {r.passed} of {_checks(r.total)} passed, {r.not_attempted} "
                    f"still raise NotImplementedError")
        if self.status == "failed":
            more = len(r.hints) - 1 if r.hints else 0
            extra = f" ({more} more hint{'s' * (more > 1)}: `make grade` shows them all)" if more > 0 else ""
            return f"{self.name}: {r.failed} of {_checks(r.total)} failed. Hint: {self.hint}{extra}"
        return f"{self.name}: could not grade: {self.hint}"

    __repr__ = __str__

    def _repr_pretty_(self, p, cycle):  # IPython shows the one line
        p.text(str(self))


def is_untouched_stub(name: str, file=None) -> bool:
    """True when the answer file (``file``, default ``exercises/<name>.py``) is byte for byte
    the stub in ``grading/stubs/``: nothing attempted, no need to start the grader.
    False when either file is missing or differs. Raises ValueError for an unknown ``name``."""
    get_exercise(name)
    root = repo_root()
    target = Path(file) if file is not None else root / "exercises" / f"{name}.py"
    stub = root / "grading" / "stubs" / f"{name}.py"
    try:
        return target.is_file() and stub.is_file() and target.read_bytes() == stub.read_bytes()
    except OSError:
        return False


def check(name: str, *, file=None, timeout: float = 600.0) -> CheckResult:
    """Grade one exercise now and return a one-line :class:`CheckResult` (for a notebook cell).

    ``name``: an exercise name (see :data:`EXERCISES`); ``file``: grade this file instead of
    ``exercises/<name>.py``; without it, the environment variable ``LESSONS_ANSWERS`` may name another
    folder of answers (relative to the repository; ``make html`` sets ``grading/stubs``, so a static
    page shows what a new learner sees, not the answers of whoever built it). An untouched stub (the
    same bytes as ``grading/stubs/<name>.py``) answers "not attempted" at once; otherwise runs the grader in a subprocess, so the file
    on disk is graded as it is now (save it first). Never raises for the learner's code: a stub gives
    ``not attempted``, a broken module or a grader crash gives ``failed`` or ``error``.
    Raises ValueError only for an unknown ``name``.
    """
    get_exercise(name)
    if file is None and os.environ.get("LESSONS_ANSWERS"):
        file = repo_root() / os.environ["LESSONS_ANSWERS"] / f"{name}.py"
    if is_untouched_stub(name, file):
        return CheckResult(name, "not attempted")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        files = {name: Path(file).resolve()} if file is not None else None
        cmd = pytest_command(None, [name], answer_files=files, report=report, extra=["--no-shrink"])
        try:
            proc = subprocess.run(cmd, cwd=repo_root(), env=_env(), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return CheckResult(name, "error", f"the grader took longer than {timeout:.0f} s")
        if not report.is_file():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return CheckResult(name, "error", " | ".join(tail) or f"pytest exited with {proc.returncode}")
        data = json.loads(report.read_text())
    results = {r.name: r for r in summarise(data["records"])}
    if name not in results:
        return CheckResult(name, "error", "no checks were collected")
    r = results[name]
    return CheckResult(name, r.status, r.hints[0] if r.hints else "", r)


# --- reset -----------------------------------------------------------------------------------

def _backup_path(target: Path, now: datetime) -> Path:
    stamp = now.strftime("%Y%m%d-%H%M%S")
    candidate = target.with_name(f"{target.name}.bak-{stamp}")
    n = 2
    while candidate.exists():
        candidate = target.with_name(f"{target.name}.bak-{stamp}-{n}")
        n += 1
    return candidate


def reset(name: str, *, exercises_dir=None, stubs_dir=None, now: datetime | None = None) -> Path | None:
    """Restore ``exercises/<name>.py`` to its stub, first saving the current file beside it.

    The learner's file is copied to ``<name>.py.bak-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... if
    that exists; an existing backup is never overwritten), then the stub from
    ``grading/stubs/`` replaces it. A file that already is the stub is left alone.
    ``exercises_dir``/``stubs_dir`` default to the repository's folders; ``now`` to the
    current time. A missing exercises folder is created again. Returns the backup's path,
    or None when no backup was needed.
    Raises ValueError for an unknown ``name``, FileNotFoundError if the stub is missing,
    IsADirectoryError if ``<name>.py`` is a folder (nothing is changed then), and the
    OSError of a folder that cannot be created or written.
    """
    get_exercise(name)
    root = None if exercises_dir is not None and stubs_dir is not None else repo_root()
    exercises_dir = Path(exercises_dir) if exercises_dir is not None else root / "exercises"
    stubs_dir = Path(stubs_dir) if stubs_dir is not None else root / "grading" / "stubs"
    stub = stubs_dir / f"{name}.py"
    if not stub.is_file():
        raise FileNotFoundError(f"no stub for {name!r} at {stub}")
    stub_bytes = stub.read_bytes()
    target = exercises_dir / f"{name}.py"
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder, not your answer file: move or rename it, "
                                f"then reset again")
    exercises_dir.mkdir(parents=True, exist_ok=True)     # deleted by hand: make it again
    backup = None
    if target.exists():
        mine = target.read_bytes()
        if mine == stub_bytes:
            return None
        backup = _backup_path(target, now or datetime.now())
        with open(backup, "xb") as fh:          # "x": fails rather than overwrite
            fh.write(mine)
        if backup.read_bytes() != mine:
            raise OSError(f"backup {backup} does not match {target}; {target} left as it was")
    tmp = target.with_name(f".{target.name}.reset-tmp")
    tmp.write_bytes(stub_bytes)
    os.replace(tmp, target)
    return backup


# --- command line ----------------------------------------------------------------------------

def main(argv=None) -> int:
    """``python -m lessons.course.grade {run,check,reset,list}``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lessons.course.grade", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="grade and print the score card")
    p_run.add_argument("--answers", default="exercises", help="folder of answer modules (default: exercises)")
    p_run.add_argument("--details", action="store_true", help="after the score card, what each failing check asserted")
    p_run.add_argument("names", nargs="*", help="exercises to grade (default: all)")
    p_check = sub.add_parser("check", help="grade one exercise, print one line")
    p_check.add_argument("name")
    p_check.add_argument("--file", default=None, help="grade this file instead of exercises/NAME.py")
    p_reset = sub.add_parser("reset", help="restore a stub, keeping your file as NAME.py.bak-...")
    p_reset.add_argument("name")
    sub.add_parser("list", help="list the exercises")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            return run(args.answers, args.names, details=args.details)
        if args.command == "check":
            res = check(args.name, file=args.file)
            print(res)
            return 0 if res.status in ("passed",) else 1
        if args.command == "reset":
            get_exercise(args.name)
            target = repo_root() / "exercises" / f"{args.name}.py"
            folder_existed = target.parent.is_dir()
            existed = target.exists()
            backup = reset(args.name)
            if not folder_existed:
                print(f"the folder {target.parent} was missing; created it")
            if backup is not None:
                print(f"saved your file as {backup}\nrestored the stub {target}")
            elif existed:
                print(f"{target} is already the stub; nothing to do")
            else:
                print(f"{target} was missing; restored the stub")
            return 0
        for ex in EXERCISES:
            print(f"{ex.notebook[:2]}  {ex.name:<16} {ex.title}")
        return 0
    except (ValueError, OSError) as exc:                 # OSError: FileNotFoundError, IsADirectoryError, ...
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

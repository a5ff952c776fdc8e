"""The control flow every notebook's "On the GPU" section shares, written once.

A section (:mod:`lessons.gpu.lesson`) is a :class:`Section` spec: the builds it compiles, what it runs
at one :class:`Place` (inputs, launch, reference) and what it prints. :func:`run_section` compiles the
builds with NVRTC for sm_80 and sm_90 (while g++ builds the emulator's library), runs the spec on a CUDA
device, checked against NumPy and timed with CUDA events, or says plainly why not; runs it on the CPU
emulator, labelled as such and never timed; and reports, as a :class:`GpuLesson`. A failed run is a
note, not an exception: the notebook goes on.

Every section takes ``use_device`` (None = a CUDA device when there is one, False = never) and
``emulate`` (None = the emulator only when the GPU did not run; True/False = always/never); anything
but None, True or False is a TypeError naming the argument.
"""
from __future__ import annotations

import html
import re
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable

import numpy as np

from lessons.core.checks import check_flag
from lessons.gpu.compile import ARCHS, KernelCompileError, compile_report, nvrtc_version, resources_text
from lessons.gpu.emulator import EmulatedModule, EmulatorError, emulator_available
from lessons.gpu.launch import Runner, open_device

__all__ = ["GPU", "EMULATOR", "TOLERANCE", "WIDTH", "KernelCheck", "GpuLesson", "Place", "Section", "Table",
           "run_section", "compare", "format_seconds"]

#: float32 kernels against the float64 reference on the same float32 inputs (outputs of order 1)
TOLERANCE = MappingProxyType({"atol": 2e-5, "rtol": 2e-5})
#: the two places a kernel can run; a check is always labelled with one of them
GPU, EMULATOR = "GPU", "emulator"
EMULATOR_LABEL = "emulator (the same CUDA C on the CPU, not the GPU)"
#: columns the summary's prose is wrapped at (tables are kept whole)
WIDTH = 100


def format_seconds(seconds: float) -> str:
    """``seconds`` in us, ms or s with 3-4 significant digits, e.g. ``'147.3 us'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass(frozen=True)
class KernelCheck:
    """One run of a kernel against the NumPy reference (:func:`compare`): ``where`` (``"GPU"`` or
    ``"emulator"``), ``case`` (in words), float64 ``output``, ``reference``, ``lse``, ``reference_lse``
    (lse None when not checked); ``max_error`` max |output - reference| (inf where the kernel wrote
    NaN/inf); ``lse_error`` the same over rows NumPy sees keys for (inf if the -inf rows differ);
    ``agrees`` within ``atol + rtol * |reference|``; ``median_seconds`` of one launch (CUDA events) or None.
    """

    where: str
    case: str
    output: np.ndarray
    reference: np.ndarray
    lse: np.ndarray | None
    reference_lse: np.ndarray | None
    max_error: float
    lse_error: float | None
    atol: float
    rtol: float
    agrees: bool
    median_seconds: float | None = None

    def line(self) -> str:
        """One line: the errors, the verdict and (on the GPU) the median time."""
        text = f"max |out - NumPy| = {self.max_error:.1e}"
        if self.lse_error is not None:
            text += f", max |lse - NumPy| = {self.lse_error:.1e}"
        text += f" -> {'agrees' if self.agrees else 'DOES NOT AGREE'} within {self.atol:g} + {self.rtol:g}*|NumPy|"
        if self.median_seconds is not None:
            text += f"; median time {format_seconds(self.median_seconds)} (CUDA events)"
        return text


def compare(where, case, output, reference, lse=None, reference_lse=None, *, seconds=None,
            atol=TOLERANCE["atol"], rtol=TOLERANCE["rtol"]) -> KernelCheck:
    """A :class:`KernelCheck` of ``output`` (and ``lse``) against NumPy's. ValueError when the shapes differ."""
    out, ref = np.asarray(output, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"kernel output has shape {out.shape}, the reference {ref.shape}")
    with np.errstate(invalid="ignore"):
        diff = np.abs(out - ref)
    max_error = float(np.max(np.where(np.isfinite(diff), diff, np.inf), initial=0.0))
    agrees = bool(np.all(np.isfinite(out)) and np.allclose(out, ref, atol=atol, rtol=rtol))
    lse_error = ref_lse = None
    if lse is not None:
        lse, ref_lse = np.asarray(lse, dtype=np.float64), np.asarray(reference_lse, dtype=np.float64)
        if lse.shape != ref_lse.shape:
            raise ValueError(f"kernel lse has shape {lse.shape}, the reference {ref_lse.shape}")
        empty = np.isneginf(ref_lse)
        if not np.array_equal(np.isneginf(lse), empty) or np.isnan(lse).any():
            lse_error = float("inf")
        else:
            lse_error = float(np.max(np.abs(lse[~empty] - ref_lse[~empty]), initial=0.0))
        agrees &= bool(lse_error <= atol + rtol * float(np.max(np.abs(ref_lse[~empty]), initial=0.0)))
    return KernelCheck(where, case, out, ref, lse, ref_lse, max_error, lse_error, atol, rtol, agrees, seconds)


class Table(str):
    """A table in a summary, kept whole under its ``title`` line (in HTML: a folding ``<details>``)."""

    title: str = ""

    def __new__(cls, text: str, title: str = ""):
        obj = super().__new__(cls, text)
        obj.title = title
        return obj


def _wrap(line: str) -> str:
    """``line`` wrapped at :data:`WIDTH` columns, between words only, continuation lines indented 2 more."""
    if len(line) <= WIDTH:
        return line
    indent = line[: len(line) - len(line.lstrip())]
    # an absolute value such as "|lse - NumPy|" stays on one line
    kept = re.sub(r"\|[^|\n]*\|", lambda m: m.group(0).replace(" ", "\0"), line.strip())
    return textwrap.fill(kept, WIDTH, initial_indent=indent, subsequent_indent=indent + "  " * bool(indent),
                         break_long_words=False, break_on_hyphens=False).replace("\0", " ")


def _text(block) -> str:
    """One block of the summary as text: prose wrapped line by line, a table under its wrapped title."""
    if isinstance(block, Table):
        return (_wrap(block.title) + "\n" if block.title else "") + str(block)
    return "\n".join(_wrap(line) for line in block.split("\n"))


@dataclass(frozen=True)
class GpuLesson:
    """What one "On the GPU" section found: ``notebook``, ``title`` (the kernel in words), ``builds``
    compiled, ``compiled`` (by NVRTC), ``status`` (one sentence: compiled, run or not, where),
    ``resources`` (:class:`~lessons.gpu.compile.KernelResources` per entry point and arch), ``checks``
    (:class:`KernelCheck` s), ``notes`` (what was skipped and why), ``details`` (the section's numbers),
    ``summary`` (the text printed, ``str(result)``, prose wrapped at 100 columns), ``blocks`` (the
    same as paragraphs and :class:`Table` s, which ``_repr_html_`` folds away) and ``failed`` (the places,
    ``"GPU"`` or ``"emulator"``, whose run raised: the notes say how).
    """

    notebook: str
    title: str
    builds: tuple
    compiled: bool
    status: str
    resources: tuple
    checks: tuple
    notes: tuple
    details: MappingProxyType = field(repr=False)
    summary: str = field(repr=False)
    blocks: tuple = field(default=(), repr=False)
    failed: tuple = ()

    def __str__(self) -> str:
        return self.summary

    def _repr_pretty_(self, printer, cycle) -> None:   # IPython's plain-text view: the summary, not the fields
        printer.text(self.summary)

    def _repr_html_(self) -> str:
        return "<div>" + "".join(
            f"<details><summary>{html.escape(b.title)}</summary><pre>{html.escape(str(b))}</pre></details>"
            if isinstance(b, Table) else f"<p style='white-space: pre-wrap'>{html.escape(b)}</p>"
            for b in self.blocks) + "</div>"

    @property
    def ran_on_device(self) -> bool:
        """True when something ran on a CUDA device (a GPU check, or the timings of notebook 05)."""
        return any(c.where == GPU for c in self.checks) or bool(self.details.get("timings"))

    @property
    def ok(self) -> bool:
        """True when no run raised and every check that ran agreed with NumPy (also when nothing could
        run: no compiler, no device)."""
        return not self.failed and all(c.agrees for c in self.checks)

    def checks_on(self, where: str) -> tuple:
        """The checks that ran on ``"GPU"`` or ``"emulator"``; ValueError for anything else."""
        if where not in (GPU, EMULATOR):
            raise ValueError(f"where must be 'GPU' or 'emulator', got {where!r}")
        return tuple(c for c in self.checks if c.where == where)


@dataclass
class Place:
    """Where a spec runs: a :class:`~lessons.gpu.launch.Runner` (``put``, ``host``, ``kernel``, ``name``,
    ``xp`` are the place's) and the label of its checks, ``where`` (:data:`GPU` or :data:`EMULATOR`).
    Only a GPU place is timed."""

    runner: Runner
    where: str

    def __getattr__(self, name):
        if name == "runner":            # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    @property
    def timed(self) -> bool:
        return self.where == GPU

    def seconds(self, fn, **kwargs) -> float | None:
        """Median seconds of ``fn()`` (CUDA events) at a GPU place; None on the emulator (never timed)."""
        return self.runner.median_seconds(fn, **kwargs) if self.timed else None

    def launch(self, launcher, args, *, timed=False, **kwargs):
        """(``launcher(*args, **kwargs)`` here, NumPy arrays moved here first; its median seconds at a GPU
        place when ``timed`` is True or the keyword arguments to time it with, else None)."""
        fn, args = self.kernel(launcher), [self.put(x) if isinstance(x, np.ndarray) else x for x in args]
        seconds = self.seconds(lambda: fn(*args, **(kwargs if timed is True else timed))) if timed else None
        return fn(*args, **kwargs), seconds

    def check(self, case, result, reference, **kwargs) -> KernelCheck:
        """:func:`compare` of a kernel's ``result`` here, ``(out, lse)`` or ``(out,)``, with NumPy's
        ``reference`` of the same form; ``kwargs``: seconds, atol, rtol."""
        lse = self.host(result[1]) if len(result) > 1 else None
        return compare(self.where, case, self.host(result[0]), reference[0], lse,
                       reference[1] if len(reference) > 1 else None, **kwargs)

    def verify(self, case, launcher, args, reference, *, timed=False, tolerance=TOLERANCE, **kwargs) -> KernelCheck:
        """:meth:`check` (within ``tolerance``) of :meth:`launch`, its median seconds with it."""
        result, seconds = self.launch(launcher, args, timed=timed, **kwargs)
        return self.check(case, result, reference, seconds=seconds, **tolerance)


@dataclass
class Section:
    """One notebook's "On the GPU" section, for :func:`run_section`: ``notebook``, ``title`` (as in
    :class:`GpuLesson`); ``builds`` NVRTC compiles and reports; ``run(place) -> (checks, details)`` (None:
    nothing runs); ``report(result) -> blocks`` or the blocks: the lines after the checks (str lines, ""
    between paragraphs, :class:`Table` s; it may add to ``result.details``); ``timings(place) -> (rows,
    blocks)``: what only a GPU measures; ``emulator_builds`` (default ``builds``); ``entries`` reported
    (default all); ``once_per_arch``: entries reported once per arch; ``details`` known beforehand.
    """

    notebook: str
    title: str
    builds: list
    run: Callable | None = None
    report: Callable | list | None = None
    timings: Callable | None = None
    emulator_builds: list | None = None
    entries: tuple | None = None
    once_per_arch: tuple = ()
    details: dict = field(default_factory=dict)


def _compile(section: Section, device) -> tuple:
    """(resources, status, compiled) of the builds on sm_80 and sm_90; run_section ends the status."""
    entries = section.entries or tuple(dict.fromkeys(e for b in section.builds for e in b.entries))
    kernel = f"CUDA kernel ({', '.join(entries)}) was" if len(entries) == 1 else \
        f"CUDA kernels ({', '.join(entries)}) were"
    try:
        version = ".".join(map(str, nvrtc_version()))
    except ImportError:
        return (), (f"The {kernel} not compiled: CuPy/NVRTC are not installed (pip install cupy-cuda12x "
                    f"nvidia-cuda-nvrtc-cu12); the NumPy reference still runs."), False
    except Exception as err:
        return (), f"The {kernel} not compiled: NVRTC could not be loaded ({err}).", False
    try:
        on_device = device is not None and device.backend == "cupy"     # a real device reports its own arch
        rows = [r for r in compile_report(ARCHS, builds=section.builds, use_device=on_device) if r.entry in entries]
    except KernelCompileError as err:
        return (), f"The {kernel.rsplit(' ', 1)[0]} failed to compile: {str(err).splitlines()[0]}", False
    seen = set()
    rows = tuple(r for r in rows if r.entry not in section.once_per_arch
                 or not ((r.entry, r.arch) in seen or seen.add((r.entry, r.arch))))
    return rows, f"The {kernel} compiled for {' and '.join(ARCHS)} with NVRTC {version}", True


def _guarded(fn, notes: list, failed: list, where: str):
    """``fn()``, or None with a sentence in ``notes`` and ``where`` in ``failed`` when it raised (a failed
    launch must not stop the notebook)."""
    try:
        return fn()
    except Exception as err:
        notes.append(f"The {where} run failed: {type(err).__name__}: {str(err).splitlines()[0]}")
        failed.append(where)
        return None


def run_section(section: Section, use_device=None, emulate=None) -> GpuLesson:
    """Compile, run on the device or say why not, run on the emulator, compare, report: a
    :class:`GpuLesson`. A failed compile or launch is reported, never raised; TypeError for a
    ``use_device`` or ``emulate`` (see the module docstring) that is not None, True or False."""
    emulate = check_flag(emulate, "emulate", none=True)
    device, why_not = open_device(use_device)
    emulate = ((device is None) if emulate is None else emulate) and section.run is not None
    emulator_note = building = None
    if emulate and emulator_available():           # g++ builds the emulator's library while NVRTC compiles
        with ThreadPoolExecutor(max_workers=1) as pool:
            building = pool.submit(lambda: [EmulatedModule(b) for b in (section.emulator_builds or section.builds)])
            resources, status, compiled = _compile(section, device)
    else:
        resources, status, compiled = _compile(section, device)
        if emulate:
            emulate, emulator_note = False, "The emulator was not run: it needs a C++ compiler (g++ or clang++)."
    try:
        building and building.result()
    except EmulatorError as err:
        emulate, emulator_note = False, f"The emulator could not build the kernel: {str(err).splitlines()[0]}"
    checks, notes, failed, details, timings, extra = [], [], [], dict(section.details), (), []
    places = [Place(device, GPU)] if device is not None and section.run is not None else []
    for place in places + ([Place(Runner("emulator"), EMULATOR)] if emulate else []):
        got = _guarded(lambda: section.run(place), notes, failed, place.where)
        for key, value in (got[1] if got else {}).items():    # the first place that ran (the GPU) gives them
            details.setdefault(key, value)
        checks += got[0] if got else []
    if device is not None and section.timings is not None:
        got = _guarded(lambda: section.timings(Place(device, GPU)), notes, failed, GPU)
        if got is not None and got[0]:
            timings, extra = tuple(got[0]), list(got[1])
    if section.timings is not None:
        details["timings"] = timings
    if compiled and device is None:
        status += f", but not run: {why_not}."
    elif compiled:
        ran = any(c.where == GPU for c in checks) or bool(timings)
        status += f" and run on {device.name}." if ran else f", but the run on {device.name} failed (see below)."
    # the report sees a draft whose details it may add to (numbers computed from the checks)
    draft = GpuLesson(section.notebook, section.title, tuple(section.builds), compiled, status, resources,
                      tuple(checks), tuple(notes), details, "")
    report = section.report(draft) if callable(section.report) else section.report
    extra = list(report or []) + extra
    notes += [f"Nothing was timed: {why_not}; the GPU run and its timing are skipped."] if device is None else []
    notes += [emulator_note] if emulator_note else []
    notes += sorted({f"Resources of {r.entry} ({r.arch}) not reported: {r.reason}." for r in resources
                     if not r.reported})
    blocks = _blocks(section.title, status, resources, device, checks, extra, notes)
    return replace(draft, details=MappingProxyType(details), blocks=tuple(blocks), failed=tuple(failed),
                   summary="\n\n".join(_text(b) for b in blocks))


def _blocks(title, status, resources, device, checks, extra, notes) -> list:
    """The summary as paragraphs (str) and tables (:class:`Table`), in order."""
    blocks = [f"On the GPU: {title}\n{status}"]
    if resources:
        who = "the device and ptxas report" if any(r.source == "device" for r in resources) else "ptxas reports"
        blocks.append(Table(textwrap.indent(resources_text(resources), "  "), f"What {who} (registers per "
                            f"thread, static shared memory bytes per block, spilled bytes):"))
    for where, label in ((GPU, f"On the GPU ({device.name if device else ''})"),
                         (EMULATOR, f"On the {EMULATOR_LABEL}")):
        lines = [f"  {c.case}: {c.line()}" for c in checks if c.where == where]
        if lines:
            blocks.append("\n".join([f"{label}, against NumPy:", *lines]))
    paragraph = []
    for item in extra + [""]:            # str lines join into paragraphs ("" ends one); tables stand alone
        if isinstance(item, Table) or item == "":
            blocks += ["\n".join(paragraph)] if paragraph else []
            blocks += [item] if isinstance(item, Table) else []
            paragraph = []
        else:
            paragraph.append(item)
    return blocks + (["\n".join(notes)] if notes else [])

"""The backward kernels on a real GPU: the recorded H200 run, or a live run where a CUDA device is present.

Without a GPU a learner still sees how the backward kernels did on one: ``benchmarks/gpu_backward.py``
ran on one NVIDIA H200 on 2026-12-01 and its ``results.csv`` ships with the repository
(``benchmarks/results/gpu_h200_2026-12-01/backward/``; machine, driver and commit in the README one
folder up). :func:`recorded_backward` reads it, labelled as recorded; :func:`measure_backward` times the
same four implementations on the CUDA device at hand (small N, seconds), labelled as live, with the
benchmark's own code (:mod:`lessons.gpu.measure`); :func:`backward_results` picks one. Every figure
shown is computed from those rows (:func:`backward_summary`, :func:`backward_table`,
:func:`backward_findings`, and :func:`lessons.views.backward.recorded_backward_figure`): no number
here is typed in except the goals set before the run (:data:`TORCH_GOAL`).

A row is a dict, as the benchmark writes it: ``impl`` (``"naive"``, ``"kernel"``, ``"mma"``,
``"torch"``), ``n`` (sequence length, queries = keys), ``d`` (head dim), ``heads``, ``causal`` (bool),
``dtype`` (storage dtype of q, k, v, dO), ``seconds`` (median of CUDA-event timings of one backward;
None when it was not run), ``tflops`` (10 N^2 d FLOPs per head over ``seconds``, 1e12 FLOP/s),
``peak_bytes`` (peak extra device memory of one backward call beyond its inputs, bytes; None when not
run) and ``note`` (why it was not run, or the tensor-core kernel's difference from the CUDA-core one).
Source of the algorithm: Dao 2023 (FlashAttention-2), Alg. 2; of the textbook backward: Dao et al.
2022, App. B.2.
"""
from __future__ import annotations

import csv
import datetime
import inspect
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lessons.core.checks import check_flag, check_int, check_int_sequence

__all__ = ["RECORDED_DIR", "BACKWARD_CSV", "csv_lines", "typed_csv_rows", "IMPLS", "IMPL_TITLES", "TORCH_GOAL", "BackwardRun", "BackwardSummary",
           "recorded_label", "read_backward_csv", "recorded_backward", "measure_backward", "backward_results",
           "backward_row", "backward_summary", "backward_table", "backward_findings", "FlashBackendComparison",
           "flash_backend_comparison"]

ROOT = Path(__file__).resolve().parents[2]
#: the recorded H200 run shipped in the repository (README.md: machine, driver, commit)
RECORDED_DIR = ROOT / "benchmarks" / "results" / "gpu_h200_2026-12-01"
#: its backward rows, written by ``benchmarks/gpu_backward.py``
BACKWARD_CSV = RECORDED_DIR / "backward" / "results.csv"
#: the implementations, in the order the benchmark runs them
IMPLS = ("naive", "kernel", "mma", "torch")
#: what a learner reads for each implementation
IMPL_TITLES = {"naive": "naive CuPy (P, dP, dS in HBM)",
               "kernel": "our kernels, CUDA cores (fp32 FMAs)",
               "mma": "our kernels, tensor cores (mma.sync)",
               "torch": "torch SDPA backward"}
#: the stretch goal set for the tensor-core backward before it was measured: this fraction of torch's speed
#: (stated against torch's FlashAttention-2 backend, forward and backward together: see
#: :func:`flash_backend_comparison`; :func:`backward_findings` holds the backward alone to SDPA's default too)
TORCH_GOAL = 0.3

#: the backward CSV's columns and how each is read (causal as its text, "True"/"False")
_TYPES = dict(impl=str, n=int, d=int, heads=int, causal=str, dtype=str, seconds=float, tflops=float,
              peak_bytes=int, note=str)
_COLUMNS = tuple(_TYPES)
_TITLE = re.compile(r"^#.* on one (?P<machine>.+?), (?P<date>\d{4}-\d{2}-\d{2}) \(commit (?P<commit>[0-9a-f]{7,40})\)")
_DRIVER = re.compile(r"driver (?P<driver>[\d.]+), CUDA (?P<cuda>[\d.]+)")


@dataclass(frozen=True)
class BackwardRun:
    """Backward timings from one GPU: ``rows`` (tuple of row dicts, see the module docstring), ``label``
    (where and when they were measured, printed with every figure) and ``live`` (True: measured now on
    this machine's device; False: read from a recorded run)."""

    rows: tuple
    label: str
    live: bool


@dataclass(frozen=True)
class BackwardSummary:
    """The figures of one (N, d, dtype) of a :class:`BackwardRun`, every one computed from its rows.

    ``seconds``, ``tflops``, ``peak_bytes``: ``{impl: value}`` for the implementations that ran (seconds,
    1e12 FLOP/s, bytes of extra device memory); ``x_naive``: ``{impl: naive seconds / impl seconds}``, the
    speed-up over the naive CuPy backward (above 1: faster); ``of_torch``: ``{impl: torch seconds / impl
    seconds}``, the fraction of torch SDPA's backward speed; ``memory_ratio``: the tensor-core backward's
    extra memory over the naive one's (None where either did not run); ``goal_met``: whether the
    tensor-core backward reached :data:`TORCH_GOAL` of torch's speed (None where either did not run).
    """

    n: int
    d: int
    dtype: str
    label: str
    seconds: dict
    tflops: dict
    peak_bytes: dict
    x_naive: dict
    of_torch: dict
    memory_ratio: float | None
    goal_met: bool | None


def recorded_label(directory=None) -> str:
    """How figures of the recorded run in ``directory`` (default :data:`RECORDED_DIR`) are labelled, read from
    its README.md: ``"recorded on one NVIDIA H200, 2026-12-01 (driver 580.159.04, CUDA 13.0, commit 5ea12bd)"``.

    The README's title gives machine, date and commit (``# ... on one <machine>, <date> (commit <hash>)``), a
    later line ``driver <version>, CUDA <version>``. Raises FileNotFoundError without the README, ValueError
    when it does not say those things.
    """
    path = (RECORDED_DIR if directory is None else _path(directory, "directory")) / "README.md"
    text = (_shipped(path) if directory is None else path).read_text()
    title = _TITLE.match(text.splitlines()[0]) if text else None
    driver = _DRIVER.search(text)
    if title is None or driver is None:
        raise ValueError(f"{path} must start with '# ... on one <machine>, <YYYY-MM-DD> (commit <hash>)' and name "
                         f"'driver <version>, CUDA <version>'")
    return (f"recorded on one {title['machine']}, {title['date']} (driver {driver['driver']}, CUDA {driver['cuda']}, "
            f"commit {title['commit']})")


def _path(value, name):
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or path, got {type(value).__name__} {value!r}")
    return Path(value)


def _shipped(path: Path) -> Path:
    """``path``, a file of the recorded run, or FileNotFoundError saying where it comes from: the recorded
    run ships with the repository, not with an installed (``pip install .``) package."""
    if not path.exists():
        raise FileNotFoundError(f"the recorded GPU run is not here: {path} ships with the repository (a git "
                                f"checkout), not with an installed package; pass the path of a copy")
    return path


#: the columns a run fills in when an implementation ran, and leaves empty when it did not
_MEASURED = ("seconds", "tflops", "peak_bytes")


def csv_lines(path, columns) -> list[tuple[int, dict]]:
    """(line number, {column: text}) for each non-blank line of the CSV at ``path`` after its header.

    ``columns``: the names the header must have. Raises ValueError naming the file (and line) for a file
    that is not UTF-8 text, a missing column, or a line with more or fewer fields than the header.
    """
    with open(path, newline="", encoding="utf-8") as f:
        try:
            lines = list(enumerate(csv.reader(f), start=1))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not UTF-8 text ({err})") from None
    header = lines[0][1] if lines else []
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{path} must have the columns {list(columns)}; missing {missing}")
    out = []
    for line, fields in lines[1:]:
        if not fields:                      # a blank line, as csv.DictReader skips it
            continue
        if len(fields) != len(header):
            raise ValueError(f"{path}, line {line}: {len(fields)} fields, the header has {len(header)}")
        out.append((line, dict(zip(header, fields))))
    return out


def typed_csv_rows(path, columns: dict) -> list[tuple[int, dict]]:
    """(line number, row) for each line of the CSV at ``path``, ``columns`` (name -> int, float or str)
    typed, an empty int/float field as None. Raises TypeError for a ``path`` that is not a str or path,
    ValueError naming the file and line for what :func:`csv_lines` refuses, or a number that is malformed,
    negative or not finite."""
    path = _path(path, "path")
    rows = []
    for line, raw in csv_lines(path, columns):
        row = {}
        for column, kind in columns.items():
            text = raw[column]
            if kind is str or text == "":
                row[column] = text if kind is str else None
                continue
            try:
                value = kind(text)
            except ValueError:
                raise ValueError(f"{path}, line {line}: column {column!r} must be {kind.__name__}, got {text!r}") from None
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{path}, line {line}: column {column!r} must be a finite non-negative number, "
                                 f"got {text!r}")
            row[column] = value
        rows.append((line, row))
    return rows


def read_backward_csv(path=None) -> list[dict]:
    """The rows of a backward ``results.csv`` (default :data:`BACKWARD_CSV`), typed.

    Returns one dict per line with the columns ``impl`` (str), ``n``, ``d``, ``heads`` (int), ``causal``
    (bool), ``dtype`` (str), ``seconds`` (float, seconds), ``tflops`` (float, 1e12 FLOP/s), ``peak_bytes``
    (int, bytes), ``note`` (str); ``seconds``, ``tflops`` and ``peak_bytes`` are None where the line leaves
    them empty (a skipped implementation).
    Raises FileNotFoundError when the file is not there (an installed package without the repository),
    TypeError for a ``path`` that is not a str or path, ValueError naming the file, line and column for a
    missing column, a line with more or fewer fields than the header, an ``impl`` not in :data:`IMPLS`, a
    malformed, negative or non-finite number, ``seconds`` of 0, a line giving some of ``seconds``,
    ``tflops``, ``peak_bytes`` but not all, ``causal`` other than True/False, the same (impl, n, d, heads,
    causal, dtype) twice, a file that is not UTF-8 text, or a file without rows.
    """
    path = _shipped(BACKWARD_CSV) if path is None else _path(path, "path")
    rows, seen = [], {}
    for line, row in typed_csv_rows(path, _TYPES):
        if row["impl"] not in IMPLS:
            raise ValueError(f"{path}, line {line}: column 'impl' must be one of {list(IMPLS)}, got {row['impl']!r}")
        if row["causal"] not in ("True", "False"):
            raise ValueError(f"{path}, line {line}: column 'causal' must be True or False, got {row['causal']!r}")
        row["causal"] = row["causal"] == "True"
        for column in ("n", "d", "heads"):
            if row[column] is None or row[column] < 1:
                raise ValueError(f"{path}, line {line}: column {column!r} must be a positive int, got {row[column]!r}")
        given = [c for c in _MEASURED if row[c] is not None]
        if given and len(given) != len(_MEASURED):
            raise ValueError(f"{path}, line {line}: columns {list(_MEASURED)} are all given (the implementation "
                             f"ran) or all empty (it did not); got only {given}")
        if row["seconds"] == 0:
            raise ValueError(f"{path}, line {line}: column 'seconds' must be above 0, got {row['seconds']!r}")
        key = tuple(row[c] for c in ("impl", "n", "d", "heads", "causal", "dtype"))
        if key in seen:
            raise ValueError(f"{path}, line {line}: the same (impl, n, d, heads, causal, dtype) {key} as line "
                             f"{seen[key]}")
        seen[key] = line
        rows.append({c: row[c] for c in _COLUMNS})
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def recorded_backward(path=None, directory=None) -> BackwardRun:
    """The recorded backward run: :func:`read_backward_csv` of ``path`` (default :data:`BACKWARD_CSV`) with
    :func:`recorded_label` of ``directory`` (default :data:`RECORDED_DIR`, the folder holding its README)."""
    return BackwardRun(tuple(read_backward_csv(path)), recorded_label(directory), live=False)


def measure_backward(sizes=(1024, 2048), head_dims=(64, 128), *, heads: int = 8, warmup: int = 2,
                     repeats: int = 5, seed: int = 0) -> BackwardRun:
    """Time the four backward implementations on the CUDA device now, as ``benchmarks/gpu_backward.py`` does.

    For each head dim ``d`` in ``head_dims`` and N in ``sizes``: q, k, v, dO float16 of shape (heads, N, d),
    standard normal (``numpy.random.default_rng(seed)``), O and lse from :func:`lessons.gpu.flash_attention_gpu`;
    then :func:`lessons.gpu.measure.naive_backward` (naive), :func:`lessons.gpu.flash_attention_backward_gpu`
    (kernel), :func:`lessons.gpu.flash_attention_backward_mma_gpu` (mma, d = 64 or 128) and torch SDPA's
    backward (torch, where torch with CUDA is installed) are each timed (median of ``repeats`` CUDA-event
    timings after ``warmup``, seconds) and their peak extra device memory measured (bytes). With the
    defaults the timings take seconds (after NVRTC has compiled the kernels, once). Returns a
    :class:`BackwardRun` labelled ``"measured live on <device>, <date>"``; an implementation that could not
    run (skipped, or failed: out of memory, a GPU older than sm_80 for the tensor cores) has
    ``seconds = None`` and says why in ``note``.
    Raises RuntimeError without a CUDA device; TypeError for ``sizes`` or ``head_dims`` that are not sequences
    of ints, or a non-int (bools included) ``heads``, ``warmup``, ``repeats``, ``seed``; ValueError for sizes,
    head dims, heads or repeats below 1, a negative ``warmup`` or ``seed``, empty ``sizes`` or ``head_dims``.
    """
    import numpy as np

    import lessons.gpu as gpu
    from lessons.gpu.measure import (backward_flops, median_cuda_seconds, naive_backward, peak_cupy, sdpa_backward,
                                     torch_seconds_and_peak)

    sizes, head_dims, heads, warmup, repeats, seed = _check_measure(sizes, head_dims, heads, warmup, repeats, seed)
    if not gpu.device_available():
        raise RuntimeError("measure_backward needs a CUDA device; without one use recorded_backward()")
    import cupy

    try:
        import torch
        torch_reason = None if torch.cuda.is_available() else "skipped: torch has no CUDA device"
    except ImportError:
        torch, torch_reason = None, "skipped: torch is not installed"
    rng = np.random.default_rng(seed)
    rows = []
    for d in head_dims:
        for n in sizes:
            q, k, v, do = (cupy.asarray(rng.standard_normal((heads, n, d), dtype=np.float32).astype(np.float16))
                           for _ in range(4))
            o, lse = gpu.flash_attention_gpu(q, k, v)
            calls = {"naive": lambda: naive_backward(cupy, q, k, v, do),
                     "kernel": lambda: gpu.flash_attention_backward_gpu(q, k, v, o, lse, do),
                     "mma": lambda: gpu.flash_attention_backward_mma_gpu(q, k, v, o, lse, do)}
            for impl in IMPLS:
                row = dict(impl=impl, n=n, d=d, heads=heads, causal=False, dtype="float16", seconds=None, tflops=None,
                           peak_bytes=None, note="")
                if impl == "mma" and d not in (64, 128):
                    row["note"] = "skipped: the tensor-core backward takes d = 64 or 128"
                elif impl == "torch" and torch_reason:
                    row["note"] = torch_reason
                else:
                    try:
                        if impl == "torch":
                            seconds, peak = torch_seconds_and_peak(torch, sdpa_backward(torch, q, k, v, do), warmup,
                                                                   repeats)
                            torch.cuda.empty_cache()
                        else:
                            seconds = median_cuda_seconds(cupy, calls[impl], warmup, repeats)
                            peak = peak_cupy(cupy, calls[impl])
                        row.update(seconds=seconds, peak_bytes=int(peak))
                    except Exception as err:     # out of memory, a GPU older than sm_80 for mma, ...
                        row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
                if row["seconds"] is not None:
                    row["tflops"] = backward_flops(n, d, heads, False) / row["seconds"] / 1e12
                rows.append(row)
                cupy.get_default_memory_pool().free_all_blocks()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return BackwardRun(tuple(rows), f"measured live on {gpu.device_name()}, {when}", live=True)


def _check_measure(sizes, head_dims, heads, warmup, repeats, seed):
    sizes, head_dims = check_int_sequence(sizes, "sizes", min=1), check_int_sequence(head_dims, "head_dims", min=1)
    heads, repeats = check_int(heads, "heads", min=1), check_int(repeats, "repeats", min=1)
    warmup, seed = check_int(warmup, "warmup", min=0), check_int(seed, "seed", min=0)
    return sizes, head_dims, heads, warmup, repeats, seed


def backward_results(live=None, **measure) -> BackwardRun:
    """What notebook 04 shows: :func:`measure_backward` (``**measure`` passed on) when ``live`` is True, or
    when it is None and a CUDA device is present; else :func:`recorded_backward`. ``**measure`` is checked
    whichever is shown, so a misspelt or bad argument is an error on a machine without a GPU too.
    Raises RuntimeError for ``live=True`` without a device, TypeError for a ``live`` that is not a bool or
    None or an argument :func:`measure_backward` does not take, TypeError/ValueError as
    :func:`measure_backward` for bad values."""
    live = check_flag(live, "live", none=True)
    try:
        bound = inspect.signature(measure_backward).bind(**measure)
    except TypeError as err:
        raise TypeError(f"backward_results passes **measure to measure_backward: {err}") from None
    bound.apply_defaults()
    _check_measure(**bound.arguments)
    if live is None:
        from lessons.gpu.compile import device_available
        live = device_available()
    return measure_backward(**measure) if live else recorded_backward()


def _check_run(run):
    if not isinstance(run, BackwardRun):
        raise TypeError(f"run must be a BackwardRun (recorded_backward() or measure_backward()), got {type(run).__name__}")
    return run


def _pick_n(run, n, d, dtype):
    ns = sorted({r["n"] for r in run.rows if r["d"] == d and r["dtype"] == dtype and not r["causal"]})
    if not ns:
        have = sorted({(r["d"], r["dtype"]) for r in run.rows})
        raise ValueError(f"the run has no rows with d = {d} and dtype {dtype!r}; it has (d, dtype) {have}")
    if n is None:
        return ns[-1]
    n = check_int(n, "n", min=1)
    if n not in ns:
        raise ValueError(f"n must be one of the run's sequence lengths {ns} at d = {d}, got {n}")
    return n


def backward_row(run, impl: str, n: int, d: int, dtype: str = "float16") -> dict | None:
    """The non-causal row of ``impl`` at (``n``, ``d``, ``dtype``) in ``run`` if it ran there (``seconds`` not
    None), else None. Raises TypeError for a run that is not a :class:`BackwardRun` or a non-int ``n``/``d``
    (bools included), ValueError for an ``impl`` not in :data:`IMPLS` or ``n``/``d`` below 1."""
    run = _check_run(run)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    n, d = check_int(n, "n", min=1), check_int(d, "d", min=1)
    for r in run.rows:
        if (r["impl"], r["n"], r["d"], r["dtype"], r["causal"]) == (impl, n, d, dtype, False) and r["seconds"] is not None:
            return r
    return None


def backward_summary(run, n=None, d: int = 64, dtype: str = "float16") -> BackwardSummary:
    """The figures of ``run`` at (``n``, ``d``, ``dtype``), non-causal; ``n`` default: the largest N it has
    (8192 in the recorded run). See :class:`BackwardSummary` for the fields and their units.
    Raises TypeError for a run that is not a :class:`BackwardRun`, ValueError for an (``n``, ``d``, ``dtype``)
    the run has no rows for (the message lists what it has).
    """
    run = _check_run(run)
    d = check_int(d, "d", min=1)
    n = _pick_n(run, n, d, dtype)
    ran = {impl: r for impl in IMPLS if (r := backward_row(run, impl, n, d, dtype)) is not None}
    seconds = {impl: r["seconds"] for impl, r in ran.items()}
    x_naive = {impl: seconds["naive"] / s for impl, s in seconds.items()} if "naive" in seconds else {}
    of_torch = {impl: seconds["torch"] / s for impl, s in seconds.items()} if "torch" in seconds else {}
    peak = {impl: r["peak_bytes"] for impl, r in ran.items()}
    memory_ratio = peak["mma"] / peak["naive"] if {"mma", "naive"} <= peak.keys() and peak["naive"] else None
    goal_met = of_torch["mma"] >= TORCH_GOAL if "mma" in of_torch else None
    return BackwardSummary(n, d, dtype, run.label, seconds, {impl: r["tflops"] for impl, r in ran.items()}, peak,
                           x_naive, of_torch, memory_ratio, goal_met)


def _mib(b) -> str:
    return f"{b / 2**20:,.0f} MiB" if b >= 2**20 else f"{b / 2**20:.2f} MiB"


def backward_table(run, n=None, head_dims=(64, 128), dtype: str = "float16") -> str:
    """A Markdown table of ``run`` at sequence length ``n`` (default: the largest it has): one line per
    implementation and head dim with the time (ms), TFLOP/s, peak extra device memory (MiB), the speed-up
    over the naive CuPy backward and the fraction of torch's speed; ``-`` with the reason where an
    implementation did not run. Its caption gives the run's label. Head dims the run lacks are left out.
    Raises TypeError/ValueError as :func:`backward_summary` (ValueError too when no head dim is there).
    """
    run = _check_run(run)
    wanted = tuple(dict.fromkeys(check_int_sequence(head_dims, "head_dims", min=1)))     # each once
    ds = [d for d in wanted if any(r["d"] == d and r["dtype"] == dtype for r in run.rows)]
    if not ds:
        raise ValueError(f"head_dims {list(wanted)}: the run has none of them in {dtype!r}")
    if n is None:
        n = min(_pick_n(run, None, d, dtype) for d in ds)
    lines = [f"Attention backward, N = {n}, batch 1, {run.rows[0]['heads']} heads, {dtype} (TFLOP/s: 10 N^2 d FLOPs "
             f"per head), {run.label}:", "",
             "| implementation | d | time (ms) | TFLOP/s | extra memory | x naive CuPy | of torch's speed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d in ds:
        s = backward_summary(run, n, d, dtype)
        for impl in IMPLS:
            if impl in s.seconds:
                lines.append(f"| {IMPL_TITLES[impl]} | {d} | {s.seconds[impl] * 1e3:.2f} | {s.tflops[impl]:.1f} | "
                             f"{_mib(s.peak_bytes[impl])} | "
                             f"{format(s.x_naive[impl], '.2f') + 'x' if impl in s.x_naive else '-'} | "
                             f"{format(s.of_torch[impl], '.2f') + 'x' if impl in s.of_torch else '-'} |")
            else:
                why = next((r["note"] for r in run.rows if (r["impl"], r["n"], r["d"], r["dtype"]) == (impl, n, d, dtype)),
                           "not in this run")
                lines.append(f"| {IMPL_TITLES[impl]} | {d} | - | - | - | - | {why or 'not run'} |")
    return "\n".join(lines)


def backward_findings(run, n=None, d: int = 64, dtype: str = "float16") -> list[str]:
    """What ``run`` says at (``n``, ``d``), in sentences for the notebook, every number from its rows: the
    tensor-core backward's time and speed-up over naive CuPy, the extra memory of each, its fraction of torch's
    speed against :data:`TORCH_GOAL`, and whether the CUDA-core backward beat the naive one. A sentence whose
    implementations did not run is left out. Raises as :func:`backward_summary`."""
    s = backward_summary(run, n, d, dtype)
    out = [f"{run.label}; N = {s.n}, d = {s.d}, {s.dtype}:"]
    if {"mma", "naive"} <= s.seconds.keys():
        out.append(f"tensor-core backward {s.seconds['mma'] * 1e3:.2f} ms ({s.tflops['mma']:.0f} TFLOP/s): "
                   f"{s.x_naive['mma']:.1f}x faster than the naive CuPy backward ({s.seconds['naive'] * 1e3:.2f} ms).")
        out.append(f"extra device memory: {_mib(s.peak_bytes['mma'])} against {_mib(s.peak_bytes['naive'])} for the "
                   f"naive backward ({s.memory_ratio:.2%} of it).")
    if "mma" in s.of_torch:
        out.append(f"against torch SDPA's default backward ({s.seconds['torch'] * 1e3:.2f} ms): {s.of_torch['mma']:.2f}x its "
                   f"speed; {TORCH_GOAL}x of it: {'reached' if s.goal_met else 'not reached'}.")
    if {"kernel", "naive"} <= s.seconds.keys():
        faster = s.x_naive["kernel"] > 1
        out.append(f"CUDA-core backward {s.seconds['kernel'] * 1e3:.2f} ms: {s.x_naive['kernel']:.2f}x the naive "
                   f"backward's speed, {'faster' if faster else 'NOT faster'} than it.")
    return out


@dataclass(frozen=True)
class FlashBackendComparison:
    """Our forward and backward together against torch's FlashAttention-2 backend, both recorded on an H200.

    ``ours_seconds``: our FA-2 forward rung (``flash_attention_mma_fa2``) plus our tensor-core backward, in
    seconds; ``ours_tflops``: 14 N^2 d FLOPs per head (4 forward + 10 backward) over that, 1e12 FLOP/s;
    ``torch_tflops``: the FlashAttention-2 backend's forward + backward TFLOP/s as recorded with the same
    count; ``fraction``: ours over torch's; ``goal_met``: ``fraction >= TORCH_GOAL``;
    ``backward_fraction``: the backward alone, the backend's backward seconds (its forward + backward minus
    its forward, both recorded) over ours; ``day_to_day``: how far apart the two days measured the same
    thing, torch SDPA's default forward at this shape (its TFLOP/s on the day of our run over the other
    day's, minus 1), a yardstick for how close a fraction may come to the goal before the days' difference
    decides it; ``label``: where each figure was recorded."""

    n: int
    d: int
    forward_seconds: float
    backward_seconds: float
    ours_seconds: float
    ours_tflops: float
    torch_tflops: float
    fraction: float
    goal_met: bool
    backward_fraction: float
    day_to_day: float
    label: str


def flash_backend_comparison(n: int = 8192, d: int = 64, run=None, forward_rows=None,
                             backends_path=None) -> FlashBackendComparison:
    """What the goal for the tensor-core backward was stated against: torch's FlashAttention-2 backend
    (``mma.sync``, like our kernels), forward and backward together, at N = ``n``, head dim ``d``, float16,
    8 heads, non-causal.

    Ours: the FA-2 forward rung's recorded time (:func:`lessons.gpu.ladder.recorded`, 2026-12-01 run) plus
    the tensor-core backward's (``run``, default the recorded :func:`recorded_backward`). torch's: the
    ``FLASH_ATTENTION`` row of the 2026-11-30 run's ``sdpa_backends.txt``
    (:func:`lessons.gpu.ladder.sdpa_backends` with ``part="fwd+bwd"``), the backend forced by torch's
    ``sdpa_kernel``. Both on one NVIDIA H200, on two days; the label says which figure came from where.
    ``forward_rows``, ``backends_path``: other recorded files (tests).
    Raises TypeError/ValueError as :func:`backward_summary`; ValueError when either run lacks that shape
    (the message names which).
    Source: Dao 2023 (FlashAttention-2), Sec. 3 (the FLOP count: the backward does 2.5 times the forward's
    matmuls).
    """
    from lessons.gpu import ladder
    run = recorded_backward() if run is None else run
    s = backward_summary(run, n, d, "float16")
    if "mma" not in s.seconds:
        raise ValueError(f"the backward run has no tensor-core row at N = {s.n}, d = {s.d}")
    fwd = ladder.recorded("mma_fa2", s.n, s.d, "float16", rows=forward_rows)
    if fwd is None:
        raise ValueError(f"the recorded forward run has no FA-2 rung row at N = {s.n}, d = {s.d}")
    both = ladder.sdpa_backends(s.n, False, backends_path, part="fwd+bwd")
    forward = ladder.sdpa_backends(s.n, False, backends_path)
    torch = both.get("FLASH_ATTENTION", {}).get(s.d)
    torch_fwd = forward.get("FLASH_ATTENTION", {}).get(s.d)
    if torch is None or torch_fwd is None:
        raise ValueError(f"sdpa_backends.txt has no FLASH_ATTENTION row at N = {s.n}, d = {s.d}")
    heads = run.rows[0]["heads"]
    if fwd.get("heads", heads) != heads:
        raise ValueError(f"the forward row has {fwd['heads']} heads and the backward run {heads}: their times "
                         f"cannot be added")
    total = fwd["seconds"] + s.seconds["mma"]
    flops = s.n ** 2 * s.d * heads                   # 4 of these per forward, 10 per backward
    ours = 14 * flops / total / 1e12
    torch_backward_seconds = 14 * flops / (torch * 1e12) - 4 * flops / (torch_fwd * 1e12)
    sdpa_today = ladder.recorded("sdpa", s.n, s.d, "float16", rows=forward_rows)
    default_then = forward.get("CUDNN_ATTENTION", {}).get(s.d)
    day_to_day = sdpa_today["tflops"] / default_then - 1 if sdpa_today and default_then else float("nan")
    ours_label = (f"ours {run.label}" if run.label == ladder.RECORDED_LABEL
                  else f"our forward {ladder.RECORDED_LABEL}, our backward {run.label}")
    label = f"{ours_label}; torch's {ladder.PROFILED_LABEL.replace('Nsight Compute on', 'recorded on')}"
    return FlashBackendComparison(s.n, s.d, fwd["seconds"], s.seconds["mma"], total, ours, torch, ours / torch,
                                  ours / torch >= TORCH_GOAL, torch_backward_seconds / s.seconds["mma"], day_to_day,
                                  label)

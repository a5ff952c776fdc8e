"""The "On the GPU" section of every notebook: the notebook's algorithm as a CUDA kernel.

One function per notebook. Each compiles the kernel that notebook's algorithm became
(:mod:`lessons.gpu.source`), reports the registers and shared memory ptxas gives it for
sm_80 and sm_90, and then

* with a CUDA device (and CuPy): runs it on the notebook's data, prints the largest
  difference from the NumPy reference of the series, and a median time measured with
  CUDA events;
* without one: says plainly that the kernel was compiled but not run, and runs the same
  CUDA C through the CPU emulator (:mod:`lessons.gpu.emulator`) on a small case, compared
  with the same NumPy reference and labelled as the emulator, never as the GPU.

==================================  =========================================================
notebook                            function
==================================  =========================================================
``01_online_softmax``               :func:`online_softmax_on_gpu`
``02_flash_attention_tile_by_tile`` :func:`flash_attention_on_gpu` (with the kernel's trace)
``03_query_blocks_and_causal``      :func:`causal_on_gpu`
``04_io_awareness``                 :func:`io_on_gpu` (compile report; naive vs kernel timing)
``05_paged_attention``              :func:`paged_decode_on_gpu`
``06_flash_decoding_and_ring``      :func:`flash_decoding_on_gpu`
``07_paged_gqa_decode``             :func:`paged_gqa_on_gpu`
==================================  =========================================================

Each returns a :class:`GpuLesson`: the numbers as attributes (for tests) and a text
summary (``str(result)``, what the notebook prints). Nothing here needs a GPU or CuPy
to import or to run; what could not run is skipped with a sentence saying why.
Kernels compute in float32, so every comparison is against the float64 NumPy reference
fed the same float32-rounded inputs.
"""
from __future__ import annotations

import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType, SimpleNamespace

import numpy as np

from lessons.schedules.variants import run_variant
from lessons.schedules.causal import count_tiles
from lessons.course.data import load_sample
from lessons.schedules.gqa_decode import paged_decode, write_paged_batch
from lessons.schedules.split_kv import flash_decoding
from lessons.schedules.flash import flash_attention
from lessons.schedules.paged import paged_flash_attention, write_paged_cache
from lessons.core.reference import attention
from lessons.core.checks import check_positive_int
from lessons.schedules.softmax import safe_softmax
from lessons.gpu.compile import (ARCHS, KernelCompileError, _config, _number, compile_report, compile_report_table, device_available,
                      device_name, nvrtc_version)
from lessons.gpu.emulator import EmulatedModule, EmulatorError, emulator_available
from lessons.gpu.launch import (flash_attention_gpu, flash_attention_mma_gpu, flash_decoding_gpu, mma_probe_gpu, online_softmax_gpu,
                     paged_decode_gpu)
from lessons.gpu.source import (MMA_BLOCK_Q, STATIC_SMEM_LIMIT, default_builds, flash_attention_build, flash_attention_config,
                     flash_attention_mma_build, flash_attention_mma_config, online_softmax_build, paged_decode_build)
from lessons.gpu.measure import median_cuda_seconds, naive_attention
from lessons.gpu.trace_compare import first_divergence

__all__ = [
    "GpuLesson", "KernelCheck", "online_softmax_on_gpu", "flash_attention_on_gpu", "causal_on_gpu",
    "io_on_gpu", "tensor_cores_on_gpu", "kernel_row_trace", "paged_decode_on_gpu", "flash_decoding_on_gpu",
    "paged_gqa_on_gpu", "resources_text",
    "trace_table", "softmax_demo_rows", "split_pages", "CAUSAL_CASES", "TOLERANCE",
]

#: float32 kernels against the float64 reference on the same float32 inputs (outputs of order 1)
TOLERANCE = MappingProxyType({"atol": 2e-5, "rtol": 2e-5})
#: the two places a kernel can run; a check is always labelled with one of them
GPU, EMULATOR = "GPU", "emulator"
_EMULATOR_LABEL = "emulator (the same CUDA C on CPU threads, not the GPU)"


# ---------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelCheck:
    """One run of a kernel, compared with the NumPy reference.

    ``where``: ``"GPU"`` (a CUDA device) or ``"emulator"`` (the CUDA C on CPU threads);
    ``case``: what was run, in words; ``output``, ``reference``: float64 arrays of the
    same shape (kernel, NumPy); ``lse``, ``reference_lse``: float64 arrays or None;
    ``max_error``: max |output - reference| (inf if the kernel wrote NaN/inf where NumPy
    has a finite value); ``lse_error``: the same for lse over rows NumPy sees keys for
    (inf if the -inf rows differ), None without lse; ``agrees``: within
    ``atol + rtol * |reference|`` everywhere, -inf lse exactly where NumPy has it;
    ``median_seconds``: GPU time of one launch (CUDA events, seconds) or None.
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
        """One line: where, what, the errors and (on the GPU) the median time."""
        text = f"max |out - NumPy| = {self.max_error:.1e}"
        if self.lse_error is not None:
            text += f", max |lse - NumPy| = {self.lse_error:.1e}"
        verdict = "agrees" if self.agrees else "DOES NOT AGREE"
        text += f" -> {verdict} within {self.atol:g} + {self.rtol:g}*|NumPy|"
        if self.median_seconds is not None:
            text += f"; median time {_format_seconds(self.median_seconds)} (CUDA events)"
        return text


@dataclass(frozen=True)
class GpuLesson:
    """What one notebook's "On the GPU" section found.

    ``notebook``: the notebook's name; ``title``: the kernel in words; ``builds``: the
    :class:`~lessons.gpu.source.KernelBuild` s compiled; ``compiled``: whether NVRTC
    compiled them; ``status``: one sentence on what happened to the kernel (compiled,
    run or not, and where); ``resources``: :class:`~lessons.gpu.compile.KernelResources`
    per entry point and architecture (registers/thread, static shared memory bytes/block);
    ``checks``: the :class:`KernelCheck` s, GPU and/or emulator; ``notes``: sentences on
    what was skipped and why; ``details``: lesson-specific numbers (read-only mapping);
    ``summary``: the text the notebook prints (also ``str(result)``).
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

    def __str__(self) -> str:
        return self.summary

    @property
    def ran_on_device(self) -> bool:
        """True when something ran on a CUDA device (a GPU check, or the timings of notebook 04)."""
        return any(c.where == GPU for c in self.checks) or bool(self.details.get("timings"))

    @property
    def ok(self) -> bool:
        """True when every check that ran agreed with NumPy (also when none could run)."""
        return all(c.agrees for c in self.checks)

    def checks_on(self, where: str) -> tuple:
        """The checks that ran on ``"GPU"`` or ``"emulator"``; ValueError for anything else."""
        if where not in (GPU, EMULATOR):
            raise ValueError(f"where must be 'GPU' or 'emulator', got {where!r}")
        return tuple(c for c in self.checks if c.where == where)

    def table(self):
        """The resources as a :class:`rich.table.Table` (:func:`lessons.gpu.compile_report_table`)."""
        return compile_report_table(list(self.resources))


# ---------------------------------------------------------------------------
# shared machinery
# ---------------------------------------------------------------------------

def _format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def resources_text(resources) -> str:
    """A plain-text table of :class:`~lessons.gpu.compile.KernelResources` rows.

    Columns: entry point, architecture, storage dtype, compile-time constants, threads
    per block, registers per thread, static shared memory per block (bytes) and spilled
    bytes per thread (stores + loads); "not reported" where neither the device nor ptxas
    gave the number. Returns ``""`` for no rows.
    """
    rows = list(resources)
    if not rows:
        return ""
    head = ("kernel", "arch", "dtype", "config", "threads", "registers", "smem bytes", "spills")
    body = [(r.entry, r.arch, r.dtype, r.config, str(r.threads_per_block), _number(r.registers),
             _number(r.smem_bytes, "{:,}"), _number(r.spill_bytes)) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    right = {4, 5, 6, 7}

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(head)] + [fmt(b) for b in body])


def _indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


class _Device:
    """The CUDA device, through CuPy: arrays in and out, and CUDA-event timing."""

    backend = "cupy"

    def __init__(self):
        import cupy

        self.xp = cupy
        self.name = device_name() or "a CUDA device"

    def put(self, x):
        return self.xp.asarray(x)

    def kernel(self, launcher):
        """``launcher`` (e.g. :func:`lessons.gpu.flash_attention_gpu`) bound to this device's backend."""
        return partial(launcher, backend=self.backend)

    @staticmethod
    def get(x) -> np.ndarray:
        return x.get() if hasattr(x, "get") else np.asarray(x)

    def median_seconds(self, fn, *, warmup: int = 3, repeats: int = 20) -> float:
        """Median seconds of ``fn()`` on the device's stream, measured with CUDA events."""
        return median_cuda_seconds(self.xp, fn, warmup, repeats)


def _open_device(use_device):
    """(device or None, why not): a :class:`_Device` when one should and can be used."""
    if use_device is False:
        return None, "the GPU was not used (use_device=False)"
    if not device_available():
        try:
            import cupy  # noqa: F401
        except ImportError:
            return None, "CuPy is not installed (pip install cupy-cuda12x), so no CUDA device can be used"
        return None, "no CUDA device"
    try:
        return _Device(), None
    except Exception as err:  # a broken driver or CuPy install
        return None, f"the CUDA device could not be opened ({type(err).__name__}: {err})"


def _compile(builds, device, why_not: str | None, entries=None):
    """Compile ``builds`` for sm_80 and sm_90; returns (resources, status sentence, compiled).

    ``entries``: the entry points to report (default: all of each build's).
    """
    entries = tuple(dict.fromkeys(e for b in builds for e in b.entries)) if entries is None else tuple(entries)
    names = ", ".join(entries)
    kernel, was = ("CUDA kernel", "was") if len(entries) == 1 else ("CUDA kernels", "were")
    try:
        version = ".".join(map(str, nvrtc_version()))
    except ImportError:
        return (), (f"The {kernel} ({names}) {was} not compiled: CuPy/NVRTC are not installed "
                    f"(pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12); the NumPy reference still runs."), False
    except Exception as err:
        return (), f"The {kernel} ({names}) {was} not compiled: NVRTC could not be loaded ({err}).", False
    try:
        on_device = getattr(device, "backend", None) == "cupy"     # a real device reports its own arch
        rows = tuple(r for r in compile_report(ARCHS, builds=builds, use_device=on_device) if r.entry in entries)
    except KernelCompileError as err:
        return (), f"The {kernel} ({names}) failed to compile: {str(err).splitlines()[0]}", False
    archs = " and ".join(ARCHS)
    if device is not None:
        return rows, (f"The {kernel} ({names}) {was} compiled for {archs} with NVRTC {version} "
                      f"and run on {device.name}."), True
    return rows, (f"The {kernel} ({names}) {was} compiled for {archs} with NVRTC {version}, "
                  f"but not run: {why_not}."), True


def _prepare(builds, use_device, emulate, emulator_builds=None, entries=None):
    """Open the device, compile the builds (NVRTC) while g++ builds the emulator's libraries.

    Returns ``SimpleNamespace(device, why_not, resources, status, compiled, emulate, emulator_note)``.
    ``emulate``: None = only without a device. The emulator libraries are built in a
    background thread (a g++ process) so that they compile at the same time as NVRTC.
    """
    device, why_not = _open_device(use_device)
    want_emulator = (device is None) if emulate is None else bool(emulate)
    note = None
    future = None
    pool = None
    if want_emulator:
        if emulator_available():
            pool = ThreadPoolExecutor(max_workers=1)
            future = pool.submit(lambda: [EmulatedModule(b) for b in (emulator_builds or builds)])
        else:
            want_emulator = False
            note = "The emulator was not run: it needs a C++ compiler (g++ or clang++)."
    resources, status, compiled = _compile(builds, device, why_not, entries)
    if future is not None:
        try:
            future.result()
        except EmulatorError as err:
            want_emulator = False
            note = f"The emulator could not build the kernel: {str(err).splitlines()[0]}"
        finally:
            pool.shutdown()
    return SimpleNamespace(device=device, why_not=why_not, resources=resources, status=status,
                           compiled=compiled, emulate=want_emulator, emulator_note=note)


def _check(where, case, output, reference, lse=None, reference_lse=None, *, seconds=None,
           atol=TOLERANCE["atol"], rtol=TOLERANCE["rtol"]) -> KernelCheck:
    """Compare a kernel's output (and lse) with NumPy's; see :class:`KernelCheck`."""
    out = np.asarray(output, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"kernel output has shape {out.shape}, the reference {ref.shape}")
    with np.errstate(invalid="ignore"):
        diff = np.abs(out - ref)
    max_error = float(np.max(np.where(np.isfinite(diff), diff, np.inf), initial=0.0))
    agrees = bool(np.all(np.isfinite(out)) and np.allclose(out, ref, atol=atol, rtol=rtol))
    lse_error = None
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        ref_lse = np.asarray(reference_lse, dtype=np.float64)
        if lse.shape != ref_lse.shape:
            raise ValueError(f"kernel lse has shape {lse.shape}, the reference {ref_lse.shape}")
        empty = np.isneginf(ref_lse)
        if not np.array_equal(np.isneginf(lse), empty) or np.isnan(lse).any():
            lse_error = float("inf")
        else:
            lse_error = float(np.max(np.abs(lse[~empty] - ref_lse[~empty]), initial=0.0))
        agrees &= bool(lse_error <= atol + rtol * float(np.max(np.abs(ref_lse[~empty]), initial=0.0)))
        reference_lse = ref_lse
    return KernelCheck(where=where, case=case, output=out, reference=ref, lse=lse, reference_lse=reference_lse,
                       max_error=max_error, lse_error=lse_error, atol=atol, rtol=rtol, agrees=agrees,
                       median_seconds=seconds)


def _run_guarded(fn, notes: list, where: str):
    """Run ``fn()``; on any error add a sentence to ``notes`` and return None."""
    try:
        return fn()
    except Exception as err:  # a launch failure must not stop the notebook
        notes.append(f"The {where} run failed: {type(err).__name__}: {str(err).splitlines()[0]}")
        return None


def _summary(title: str, prep, checks, notes, extra_lines=()) -> str:
    lines = [f"On the GPU: {title}", prep.status]
    if prep.resources:
        lines += ["", "What ptxas reports (registers per thread, static shared memory bytes per block, "
                      "spilled bytes):",
                  _indent(resources_text(prep.resources))]
    gpu_checks = [c for c in checks if c.where == GPU]
    emu_checks = [c for c in checks if c.where == EMULATOR]
    if gpu_checks:
        lines += ["", f"On the GPU ({prep.device.name}), against NumPy:"]
        lines += [f"  {c.case}: {c.line()}" for c in gpu_checks]
    if emu_checks:
        lines += ["", f"On the {_EMULATOR_LABEL}, against NumPy:"]
        lines += [f"  {c.case}: {c.line()}" for c in emu_checks]
    lines += list(extra_lines)
    all_notes = list(notes)
    if prep.device is None:
        all_notes.append(f"Nothing was timed: {prep.why_not}; the GPU run and its timing are skipped.")
    if prep.emulator_note:
        all_notes.append(prep.emulator_note)
    all_notes += sorted({f"Resources of {r.entry} ({r.arch}) not reported: {r.reason}." for r in prep.resources
                         if not r.reported})
    if all_notes:
        lines += [""] + all_notes
    return "\n".join(lines)


def _result(notebook, title, builds, prep, checks, notes, details, extra_lines=()) -> GpuLesson:
    ran = any(c.where == GPU for c in checks) or bool(details.get("timings"))
    if prep.device is not None and prep.compiled and not ran:     # the device was there, the run failed
        prep.status = prep.status.replace(f" and run on {prep.device.name}.",
                                          f", but the run on {prep.device.name} failed (see below).")
    return GpuLesson(notebook=notebook, title=title, builds=tuple(builds), compiled=prep.compiled,
                     status=prep.status, resources=prep.resources, checks=tuple(checks), notes=tuple(notes),
                     details=MappingProxyType(dict(details)),
                     summary=_summary(title, prep, checks, notes, extra_lines))


def _f32(*arrays):
    return tuple(np.ascontiguousarray(a, dtype=np.float32) for a in arrays)


def _f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


# ---------------------------------------------------------------------------
# 01 online softmax
# ---------------------------------------------------------------------------

def softmax_demo_rows(n_cols: int = 700, *, seed: int = 0) -> np.ndarray:
    """The small batch the online-softmax kernel is checked on: float32 (3, n_cols).

    Row 0: scores ``3 * N(0, 1)``; row 1: the same but its first ``n_cols * 3 // 7``
    entries ``-inf`` (with tiles of 256 its whole first tile is masked: the NaN trap of
    notebook 01, section 5); row 2: all ``-inf`` (a row that sees nothing: y = 0, lse = -inf).
    """
    rng = np.random.default_rng(seed)
    x = (3.0 * rng.standard_normal((3, n_cols))).astype(np.float32)
    x[1, : n_cols * 3 // 7] = -np.inf
    x[2] = -np.inf
    return x


def _softmax_reference(x):
    x64 = np.asarray(x, dtype=np.float64)
    return safe_softmax(x64), np.logaddexp.reduce(x64, axis=-1)


def online_softmax_on_gpu(x=None, *, tile: int = 256, timing_shape=(2048, 8192), use_device=None,
                          emulate=None) -> GpuLesson:
    """Notebook 01: the online-softmax kernel (one thread block per row) against NumPy.

    Parameters
    ----------
    x : float array (n_cols,) or (n_rows, n_cols) to check the kernel on; default
        :func:`softmax_demo_rows` (3 rows, 700 columns: 3 tiles, a masked first tile, an
        all-masked row). Cast to float32.
    tile : columns per tile = threads per block (a multiple of 32 up to 1024).
    timing_shape : (rows, cols) of the random float32 scores timed on a GPU.
    use_device : None = use a CUDA device when there is one; False = never.
    emulate : None = run the CPU emulator only when the GPU did not run; True/False = always/never.

    Returns a :class:`GpuLesson`; the references are :func:`lessons.schedules.softmax.safe_softmax`
    and ``numpy.logaddexp.reduce`` (lse) in float64. Raises the launcher's
    TypeError/ValueError for a bad ``x`` or ``tile``.
    Source: Milakov & Gimelshein 2018, Alg. 3.
    """
    x = softmax_demo_rows() if x is None else np.ascontiguousarray(x, dtype=np.float32)
    build = online_softmax_build(tile, "float32")
    prep = _prepare([build], use_device, emulate)
    ref_y, ref_lse = _softmax_reference(x)
    case = f"{' x '.join(map(str, x.shape))} scores, tiles of {tile}"
    checks, notes = [], []
    dev = prep.device
    if dev is not None:
        def on_gpu():
            y, lse = dev.kernel(online_softmax_gpu)(dev.put(x), tile=tile)
            out = [_check(GPU, case, dev.get(y), ref_y, dev.get(lse), ref_lse)]
            big = (np.random.default_rng(1).standard_normal(timing_shape) * 3).astype(np.float32)
            big_d = dev.put(big)
            seconds = dev.median_seconds(lambda: dev.kernel(online_softmax_gpu)(big_d, tile=tile))
            y, lse = dev.kernel(online_softmax_gpu)(big_d, tile=tile)
            ry, rl = _softmax_reference(big)
            out.append(_check(GPU, f"{timing_shape[0]} x {timing_shape[1]} random scores", dev.get(y), ry,
                              dev.get(lse), rl, seconds=seconds))
            return out
        checks += _run_guarded(on_gpu, notes, "GPU") or []
    if prep.emulate:
        got = _run_guarded(lambda: online_softmax_gpu(x, tile=tile, backend="emulator"), notes, "emulator")
        if got is not None:
            checks.append(_check(EMULATOR, case, got[0], ref_y, got[1], ref_lse))
    extra = []
    emu = [c for c in checks if c.where == EMULATOR]
    if emu and x.ndim == 2 and x.shape[0] >= 3:
        c = emu[0]
        extra.append(f"  row 2 sees nothing: y = {np.unique(c.output[2]).tolist()}, lse = {c.lse[2]}; "
                     f"row 1's masked first tile left no NaN: {bool(np.isfinite(c.output[1]).all())}")
    return _result("01_online_softmax", "online softmax kernel (lessons/gpu/kernels/online_softmax.cu)",
                   [build], prep, checks, notes, {"x": x}, extra)


# ---------------------------------------------------------------------------
# 02 flash attention forward, with the trace
# ---------------------------------------------------------------------------

def _g(x, digits=6):
    return f"{float(x):.{digits}g}"


def trace_table(gpu_row, numpy_row, where: str) -> str:
    """Text table of one row's trace: the kernel's (m, alpha, l) per tile beside NumPy's.

    ``gpu_row``: :class:`~lessons.gpu.trace_compare.GpuRowTrace`; ``numpy_row``:
    :class:`lessons.core.trace.RowTrace` (same tiles); ``where``: the column label
    ("GPU" or "emulator"). The last column is the largest relative difference of the
    three, ``|kernel - NumPy| / max(|NumPy|, 1e-30)`` (0 where both are -inf).
    Tiles are counted from 1, as on the stepper (``gpu_row.tile`` holds 0-based indices).
    """
    head = ["tile", "keys", f"m {where}", "m NumPy", f"alpha {where}", "alpha NumPy", f"l {where}", "l NumPy",
            "max rel diff"]
    body = []
    for i in range(min(len(gpu_row), len(numpy_row))):
        rel = _relative(gpu_row, numpy_row, i)
        keys = f"{numpy_row.key_start[i]}-{numpy_row.key_stop[i] - 1}"
        body.append([str(int(gpu_row.tile[i]) + 1), keys, _g(gpu_row.m[i]), _g(numpy_row.m[i]),
                     _g(gpu_row.alpha[i]), _g(numpy_row.alpha[i]), _g(gpu_row.l[i]), _g(numpy_row.l[i]),
                     f"{rel:.1e}"])
    widths = [max(len(r[j]) for r in [head, *body]) for j in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *body])


def _relative(gpu_row, numpy_row, i) -> float:
    worst = 0.0
    for f in ("m", "alpha", "l"):
        a, b = float(getattr(gpu_row, f)[i]), float(getattr(numpy_row, f)[i])
        if a == b:
            continue
        worst = max(worst, abs(a - b) / max(abs(b), 1e-30) if np.isfinite(a - b) else float("inf"))
    return worst


def _trace_report(gpu_trace, q, k, v, row, block_q, block_k, where, label):
    """Replay the kernel's trace of ``row`` beside NumPy's; returns (details, lines)."""
    _, np_trace = flash_attention(*_f64(q, k, v), tile=block_k, block_q=block_q, return_trace=True)
    np_row = np_trace.row(row)
    g_row = gpu_trace.row(*label)
    found = first_divergence(g_row, np_row, rtol=1e-4, atol=1e-6)
    broken = run_variant("no_alpha_on_l", *_f64(q[row:row + 1], k, v), block_k)
    broken_row = SimpleNamespace(m=broken.m[:, 0], alpha=broken.alpha[:, 0], l=broken.l[:, 0])
    found_broken = first_divergence(g_row, broken_row, rtol=1e-4, atol=1e-6)
    rel = max((_relative(g_row, np_row, i) for i in range(min(len(g_row), len(np_row)))), default=0.0)
    lines = ["", f"Row {row}, tile by tile: the {where}'s trace (trace build, -DFA_TRACE) beside NumPy's "
                 f"(lessons.flash_attention, block_q={block_q}, tile={block_k}):",
             _indent(trace_table(g_row, np_row, where))]
    if found is None:
        lines.append(f"  first_divergence: none - every tile agrees within rounding (rtol 1e-4, atol 1e-6); "
                     f"largest relative difference {rel:.1e}.")
    else:
        lines.append(f"  first_divergence: {found}")
    if found_broken is not None:
        b = found_broken
        lines.append(f"  What a real difference looks like: against a fold that forgets alpha on l (lessons.schedules.variants "
                     f"'no_alpha_on_l'), first_divergence names tile {b.tile + 1}: {b.quantity} = {b.gpu:.6g} in the "
                     f"{where}'s trace, {b.numpy:.6g} in the broken fold.")
    details = {"gpu_row": g_row, "numpy_row": np_row, "divergence": found, "broken_divergence": found_broken,
               "max_relative_difference": rel}
    return details, lines


def flash_attention_on_gpu(*, layer: int = 0, head: int = 0, row: int = 93, block_k: int = 16,
                           all_heads: bool = True, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 02: the FlashAttention-2 forward kernel on the real sample, and its trace.

    Parameters
    ----------
    layer, head : the sample head checked (and traced), as in the notebook (layer 0, head 0).
    row : the query row whose trace is replayed beside NumPy's (93, the token "and").
    block_k : keys per tile (the notebook's 16); ``block_q`` is the kernel's default for d = 32.
    all_heads : on a GPU, run all 6 x 12 heads of the sample in one launch (False: only
        ``layer``/``head``). The emulator always runs the one head.
    use_device, emulate : as in :func:`online_softmax_on_gpu`.

    The kernel output is checked against :func:`lessons.attention`; the trace build's
    ``(m, alpha, l)`` per tile for ``row`` is compared with :func:`lessons.flash_attention`'s
    trace by :func:`lessons.gpu.first_divergence`. Returns a :class:`GpuLesson` whose
    ``details`` hold ``gpu_row``, ``numpy_row``, ``divergence`` (None when every tile
    agrees), ``broken_divergence`` and ``model_error`` (vs the model's own output).
    Source: Dao 2023 (FlashAttention-2), Alg. 1.
    """
    sample = load_sample()
    q, k, v = _f32(*sample.qkv(layer, head, dtype=np.float32))
    d = q.shape[1]
    block_q, block_k = flash_attention_config(d, None, block_k)
    build = flash_attention_build(d, "float32", False, block_q, block_k)
    trace_build = flash_attention_build(d, "float32", True, block_q, block_k)
    prep = _prepare([build, trace_build], use_device, emulate, emulator_builds=[trace_build])
    ref, ref_lse = attention(*_f64(q, k, v), return_lse=True)
    case = f"layer {layer}, head {head} (128 x 32)"
    checks, notes, extra, details = [], [], [], {}
    dev = prep.device
    if dev is not None:
        def on_gpu():
            heads = None
            if all_heads:
                heads = (f"all {sample.q.shape[0]} x {sample.q.shape[1]} heads of the sample, one launch",
                         *_f32(sample.q, sample.k, sample.v))
            out = _flash_gpu_checks(dev, case, (q, k, v), (ref, ref_lse), heads, block_q=block_q, block_k=block_k)
            trace_run = dev.kernel(flash_attention_gpu)(*(dev.put(x) for x in (q, k, v)), block_q=block_q,
                                                        block_k=block_k, trace_rows=[row])
            return out, trace_run[2]
        got = _run_guarded(on_gpu, notes, "GPU")
        if got is not None:
            checks += got[0]
            details, lines = _trace_report(got[1], q, k, v, row, block_q, block_k, GPU, (row,))
            extra += lines
    if prep.emulate:
        got = _run_guarded(lambda: flash_attention_gpu(q, k, v, block_q=block_q, block_k=block_k, trace_rows=[row],
                                                       backend="emulator"), notes, "emulator")
        if got is not None:
            checks.append(_check(EMULATOR, case + ", trace build", got[0], ref, got[1], ref_lse))
            if not details:
                details, lines = _trace_report(got[2], q, k, v, row, block_q, block_k, EMULATOR, (row,))
                extra += lines
    kernel_checks = [c for c in checks if c.case.startswith(case)]
    if kernel_checks and layer in sample.context:
        model = sample.model_output(layer, head)
        err = float(np.abs(kernel_checks[-1].output - model).max())
        details["model_error"] = err
        extra.append(f"  The model's own output for this head (PyTorch, float32, before q, k, v were stored in "
                     f"float16) is {err:.1e} from the kernel's and {float(np.abs(ref - model).max()):.1e} from "
                     f"NumPy's: the float16 rounding of the inputs, not the kernel.")
    details.update(block_q=block_q, block_k=block_k, row=row, token=sample.tokens[row])
    return _result("02_flash_attention_tile_by_tile",
                   f"FlashAttention-2 forward kernel (lessons/gpu/kernels/flash_attention.cu), "
                   f"block_q={block_q}, block_k={block_k}, d={d}", [build, trace_build], prep, checks, notes,
                   details, extra)


def _check_query_row(row, n_q: int) -> int:
    """``row`` as an int in [0, n_q); ValueError naming it otherwise (bools refused)."""
    if isinstance(row, bool) or not isinstance(row, numbers.Integral) or not 0 <= row < n_q:
        raise ValueError(f"row must be an int in [0, {n_q}), got {row!r}")
    return int(row)


def kernel_row_trace(q, k, v, tile, row, *, causal=False, block_q=64, scale=None, use_device=None):
    """The forward kernel's own trace of one query row, for ``TileStepper(kernel=kernel_row_trace)``.

    Parameters
    ----------
    q (Nq, d), k (Nk, d), v (Nk, d) : float arrays (the kernel computes in float32).
    tile : int, keys per tile: the kernel's ``block_k``.
    row : int, the query row traced.
    causal, block_q, scale : as :func:`lessons.flash_attention` (the stepper passes its options).
        The kernel uses ``block_q`` when its tile rules allow it with ``block_k = tile``; without
        causal masking the row's trace does not depend on ``block_q``, so another is tried.

    Runs the trace build (``-DFA_TRACE``) of :func:`lessons.gpu.flash_attention_gpu` on the GPU
    when there is one (and ``use_device`` is not False), else on the CPU emulator. Returns
    ``(where, gpu_row)``: ``where`` ``"GPU (<name>)"`` or ``"emulator"``, ``gpu_row`` a
    :class:`lessons.gpu.GpuRowTrace` of ``(m, alpha, l)`` per absorbed tile.
    With causal masking the tiles a row absorbs depend on ``block_q``, so give the stepper's
    block size: with lesson 3's ``schedule=block_schedule(16)`` pass
    ``kernel=functools.partial(kernel_row_trace, block_q=16)``.
    Raises ValueError for q, k, v that are not 2-D, a ``row`` outside ``[0, Nq)``, a ``tile`` below 1,
    or when no ``block_q`` lets the kernel take ``block_k = tile`` (e.g. an odd tile needs
    block_q 128, whose tiles may not fit shared memory); RuntimeError when neither a GPU nor
    a C++ compiler for the emulator is there.
    Source: Dao 2023 (FlashAttention-2), Alg. 1.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 2:
            raise ValueError(f"{name} must be 2-D (N, d): one head, as the stepper holds it; got shape {np.shape(x)}")
    q, k, v = _f32(q, k, v)
    d = q.shape[-1]
    tile = check_positive_int(tile, "tile")
    row = _check_query_row(row, q.shape[0])
    tries = [block_q] + ([] if causal else [b for b in (128, 64, 32, 16, 8, 4) if b != block_q])
    config, why = None, None
    for bq in tries:
        try:
            config = flash_attention_config(d, bq, tile)
            break
        except ValueError as err:
            why = why or err
    if config is None:
        raise ValueError(f"the kernel cannot take tile={tile} keys with d={d}"
                         f"{' and block_q=' + str(block_q) if causal else ''}: {why}")
    device, _ = _open_device(use_device)
    if device is not None:
        out = device.kernel(flash_attention_gpu)(*(device.put(x) for x in (q, k, v)), scale=scale, causal=causal,
                                                 block_q=config[0], block_k=config[1], trace_rows=[row])
        return f"GPU ({device.name})", out[2].row(row)
    if not emulator_available():
        raise RuntimeError("no CUDA device and no C++ compiler (g++) for the emulator")
    out = flash_attention_gpu(q, k, v, scale=scale, causal=causal, block_q=config[0], block_k=config[1],
                              trace_rows=[row], backend="emulator")
    return "emulator", out[2].row(row)


def _heads_reference(qa, ka, va, **options):
    """lessons.attention per (layer, head) of (L, H, N, d) arrays: (out (L, H, Nq, d), lse (L, H, Nq))."""
    refs = [attention(*_f64(qa[i, j], ka[i, j], va[i, j]), return_lse=True, **options)
            for i in range(qa.shape[0]) for j in range(qa.shape[1])]
    return (np.stack([r[0] for r in refs]).reshape(qa.shape),
            np.stack([r[1] for r in refs]).reshape(qa.shape[:-1]))


def _flash_gpu_checks(dev, case, qkv, reference, heads=None, **options):
    """GPU checks of the forward kernel: every head in one launch (``heads`` = (case, q, k, v) of
    shape (L, H, N, d), or None), then the one head ``qkv`` against ``reference`` = (out, lse)."""
    out = []
    if heads is not None:
        label, qa, ka, va = heads
        qd, kd, vd = dev.put(qa), dev.put(ka), dev.put(va)
        seconds = dev.median_seconds(lambda: dev.kernel(flash_attention_gpu)(qd, kd, vd, **options))
        o, lse = dev.kernel(flash_attention_gpu)(qd, kd, vd, **options)
        ro, rl = _heads_reference(qa, ka, va, causal=options.get("causal", False))
        out.append(_check(GPU, label, dev.get(o), ro, dev.get(lse), rl, seconds=seconds))
    qd, kd, vd = (dev.put(x) for x in qkv)
    seconds = dev.median_seconds(lambda: dev.kernel(flash_attention_gpu)(qd, kd, vd, **options))
    o, lse = dev.kernel(flash_attention_gpu)(qd, kd, vd, **options)
    out.append(_check(GPU, case, dev.get(o), reference[0], dev.get(lse), reference[1], seconds=seconds))
    return out


# ---------------------------------------------------------------------------
# 03 causal, Nq != Nk
# ---------------------------------------------------------------------------

#: (Nq, Nk) of notebook 03's GPU check: fewer queries than keys (a chunk against a longer
#: cache), and more queries than keys (the first Nq - Nk rows see nothing)
CAUSAL_CASES = ((40, 128), (128, 96))


def _causal_case(sample_qkv, nq, nk):
    """The last ``nq`` queries against the first ``nk`` keys (aligned bottom-right)."""
    q, k, v = sample_qkv
    return np.ascontiguousarray(q[-nq:]), np.ascontiguousarray(k[:nk]), np.ascontiguousarray(v[:nk])


def causal_on_gpu(*, layer: int = 0, head: int = 0, cases=CAUSAL_CASES, all_heads: bool = True,
                  use_device=None, emulate=None) -> GpuLesson:
    """Notebook 03: the forward kernel with ``causal=True`` and Nq != Nk, on the real sample.

    Each case ``(Nq, Nk)`` takes the last Nq queries and the first Nk keys of one head
    (all 72 heads at once on a GPU with ``all_heads``). The kernel aligns the mask
    bottom-right (query i sees key j iff ``j <= i + Nk - Nq``) and must give out = 0,
    lse = -inf (no NaN) for the rows that see no key. Checked against
    :func:`lessons.attention` ``(causal=True)``; ``details["empty_rows"]`` maps each case
    to the number of such rows and ``details["tiles"]`` to :func:`lessons.schedules.causal.count_tiles`
    for the kernel's tile sizes.
    Raises ValueError for a case with Nq or Nk outside 1..128.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.1.
    """
    sample = load_sample()
    n = sample.q.shape[2]
    cases = tuple((int(a), int(b)) for a, b in cases)
    for nq, nk in cases:
        if not (1 <= nq <= n and 1 <= nk <= n):
            raise ValueError(f"cases must hold (Nq, Nk) pairs in 1..{n}, got {(nq, nk)}")
    qkv = _f32(*sample.qkv(layer, head, dtype=np.float32))
    d = qkv[0].shape[1]
    block_q, block_k = flash_attention_config(d)
    build = flash_attention_build(d, "float32", False, block_q, block_k)
    prep = _prepare([build], use_device, emulate)
    checks, notes, extra = [], [], []
    empty_rows, tiles = {}, {}
    for nq, nk in cases:
        q, k, v = _causal_case(qkv, nq, nk)
        ref, ref_lse = attention(*_f64(q, k, v), causal=True, return_lse=True)
        empty_rows[(nq, nk)] = int(np.isneginf(ref_lse).sum())
        tiles[(nq, nk)] = count_tiles(nq, nk, block_q, block_k, causal=True)
        case = f"Nq={nq}, Nk={nk}, causal, layer {layer} head {head}"
        if prep.device is not None:
            heads = None
            if all_heads:
                heads = (f"Nq={nq}, Nk={nk}, causal, all {sample.q.shape[0] * sample.q.shape[1]} heads",
                         *_f32(sample.q[:, :, -nq:], sample.k[:, :, :nk], sample.v[:, :, :nk]))
            checks += _run_guarded(partial(_flash_gpu_checks, prep.device, case, (q, k, v), (ref, ref_lse), heads,
                                           causal=True), notes, "GPU") or []
        if prep.emulate:
            got = _run_guarded(partial(flash_attention_gpu, q, k, v, causal=True, backend="emulator"),
                               notes, "emulator")
            if got is not None:
                checks.append(_check(EMULATOR, case, got[0], ref, got[1], ref_lse))
    extra.append("")
    for (nq, nk), c in tiles.items():
        kernel = [x for x in checks if x.case.startswith(f"Nq={nq}, Nk={nk}, causal, layer")]
        line = (f"Nq={nq}, Nk={nk} in tiles of {block_q} x {block_k}: {c.full} full, {c.diagonal} diagonal, "
                f"{c.skipped} skipped (lessons.schedules.causal.count_tiles); rows that see no key: {empty_rows[(nq, nk)]}")
        if kernel and empty_rows[(nq, nk)]:
            ck = kernel[-1]
            empty = np.isneginf(ck.reference_lse)
            line += (f" - the kernel wrote out = 0 there: {bool((ck.output[empty] == 0).all())}, "
                     f"lse = -inf: {bool(np.isneginf(ck.lse[empty]).all())}, NaN anywhere: "
                     f"{bool(np.isnan(ck.output).any() or np.isnan(ck.lse).any())}")
        extra.append(line)
    return _result("03_query_blocks_and_causal",
                   f"FlashAttention-2 forward kernel, causal (bottom-right), block_q={block_q}, block_k={block_k}",
                   [build], prep, checks, notes,
                   {"empty_rows": empty_rows, "tiles": tiles, "block_q": block_q, "block_k": block_k}, extra)


# ---------------------------------------------------------------------------
# 04 IO: compile report, naive vs kernel timing
# ---------------------------------------------------------------------------

def io_on_gpu(*, ns=(1024, 2048, 4096), d: int = 64, heads: int = 8, repeats: int = 5,
              use_device=None) -> GpuLesson:
    """Notebook 04: what the kernels cost on chip, and (with a GPU) naive CuPy vs the kernel.

    Compiles every kernel of the series (:func:`lessons.gpu.compile_report`, head dim 128,
    float16) plus the forward kernel for head dim ``d``, and reports registers/thread and
    static shared memory/block for sm_80 and sm_90. ``details["smem_formula"]`` holds,
    per forward build, the bytes the tile formula of :mod:`lessons.gpu.source` gives
    (``4 * (block_q (d+1) + 2 block_k (d+1) + block_q (block_k+1))``) and what ptxas reports.

    With a device, for each N in ``ns`` (``heads`` heads, float16 inputs): the median time
    (CUDA events, ``repeats`` runs after 2 warm-ups) of naive attention in CuPy (the full
    score matrix in float32, :func:`lessons.gpu.measure.naive_attention`) and of :func:`lessons.gpu.flash_attention_gpu`, and the largest
    difference between the two outputs. Without one the timing is skipped with a sentence.
    Source: Dao et al. 2022, Sec. 2-3 (IO-awareness); Dao 2023, Alg. 1.
    """
    builds = list(default_builds(128, "float16")) + [flash_attention_build(d, "float16")]
    prep = _prepare(builds, use_device, emulate=False)
    notes, extra, details = [], [], {}
    formula = {}
    for b in builds:
        if b.kernel != "flash_attention":
            continue
        reported = [r.smem_bytes for r in prep.resources
                    if r.entry == "flash_attention_forward" and r.config == _config(b)] if prep.compiled else []
        formula[b.describe()] = (b.smem_bytes, reported)
    details["smem_formula"] = formula
    if prep.compiled:
        extra += ["", "Shared memory of the forward kernel, from its tiles (float32 q, k, v and p tiles, +1 column "
                      "against bank conflicts) and from ptxas:"]
        for b in builds:
            if b.kernel == "flash_attention":
                c = dict(b.defines)
                bytes_, reported = formula[b.describe()]
                extra.append(f"  d={c['HEAD_DIM']}, block_q={c['BLOCK_Q']}, block_k={c['BLOCK_K']}: "
                             f"4 * ({c['BLOCK_Q']}*{c['HEAD_DIM'] + 1} + 2*{c['BLOCK_K']}*{c['HEAD_DIM'] + 1} + "
                             f"{c['BLOCK_Q']}*{c['BLOCK_K'] + 1}) = {bytes_:,} bytes; ptxas: "
                             f"{' and '.join(_number(r, '{:,}') for r in reported)} bytes (sm_80 and sm_90)")
        extra.append(f"  A block may declare at most {STATIC_SMEM_LIMIT // 1024} KiB of static shared memory: "
                     f"flash_attention_config picks the largest block_k that fits it.")
    dev = prep.device
    timings = []
    if dev is not None:
        source = "lessons.gpu.measure"

        def naive(q, k, v):
            return naive_attention(dev.xp, q, k, v)

        def timer(fn):
            return dev.median_seconds(fn, warmup=2, repeats=repeats)

        def on_gpu():
            rows = []
            rng = np.random.default_rng(0)
            for n in ns:
                q, k, v = (dev.put(rng.standard_normal((heads, n, d)).astype(np.float16)) for _ in range(3))
                t_naive = timer(lambda q=q, k=k, v=v: naive(q, k, v))
                t_kernel = timer(lambda q=q, k=k, v=v: dev.kernel(flash_attention_gpu)(q, k, v))
                err = float(abs(dev.get(dev.kernel(flash_attention_gpu)(q, k, v)[0]).astype(np.float64)
                                - dev.get(naive(q, k, v)).astype(np.float64)).max())
                rows.append({"n": n, "naive_seconds": t_naive, "kernel_seconds": t_kernel, "max_difference": err})
                del q, k, v
            return rows
        timings = _run_guarded(on_gpu, notes, "GPU") or []
        if timings:
            extra += ["", f"Median time on {dev.name}, {heads} heads, d={d}, float16 inputs "
                          f"(naive: {source}; CUDA events, {repeats} runs):",
                      f"  {'N':>6} {'naive CuPy':>12} {'kernel':>12} {'naive/kernel':>13} {'max |diff|':>11}"]
            for r in timings:
                extra.append(f"  {r['n']:>6} {_format_seconds(r['naive_seconds']):>12} "
                             f"{_format_seconds(r['kernel_seconds']):>12} "
                             f"{r['naive_seconds'] / r['kernel_seconds']:>12.2f}x {r['max_difference']:>11.1e}")
    details["timings"] = tuple(timings)
    return _result("04_io_awareness", "every kernel of the series, compiled (registers and shared memory)",
                   builds, prep, [], notes, details, extra)


# ---------------------------------------------------------------------------
# 04 (continued) the advanced kernel: the same fold on tensor cores
# ---------------------------------------------------------------------------

#: the tensor-core kernel (P rounded to float16 before P V) against float64 NumPy on float16 inputs
MMA_TOLERANCE = MappingProxyType({"atol": 3e-3, "rtol": 5e-3})


def tensor_cores_on_gpu(*, layer: int = 0, head: int = 0, row: int = 93, n: int = 8192, d: int = 64,
                        heads: int = 8, repeats: int = 5, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 04: the forward pass on tensor cores (``mma.sync.m16n8k16``), checked and timed.

    Compiles :func:`lessons.gpu.flash_attention_mma_gpu` for the sample's head dim (32, with
    the trace build) and for ``d`` and reports registers and shared memory for sm_80 and
    sm_90. Then, on a GPU or else on the emulator: one tensor-core instruction alone
    (:func:`lessons.gpu.mma_probe_gpu`, 16x16 @ 16x8) against NumPy; the kernel on the
    sample head ``layer``/``head`` (float16) against :func:`lessons.attention`; and the
    trace of ``row`` beside :func:`lessons.flash_attention`'s (block_q 64, tile = block_k).
    With a GPU it also times, for ``heads`` heads of N = ``n``, d = ``d`` float16 inputs,
    naive CuPy, the CUDA-core kernel and the tensor-core kernel (median of ``repeats``
    CUDA-event runs after 2 warm-ups, seconds, and TFLOP/s at 4 N^2 d flops per head);
    ``details["timings"]`` holds them (empty without a device).
    Raises ValueError (before running anything) for a ``row`` outside the sample's 128 rows,
    ``n``, ``heads`` or ``repeats`` below 1, or a ``d`` the kernel cannot take.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.3; PTX ISA, mma.m16n8k16.
    """
    sample = load_sample()
    q, k, v = (np.ascontiguousarray(x, dtype=np.float16) for x in sample.qkv(layer, head, dtype=np.float32))
    _check_query_row(row, q.shape[0])
    for name, value in (("n", n), ("heads", heads), ("repeats", repeats)):
        check_positive_int(value, name)
    flash_attention_mma_config(d)                                   # d: a multiple of 16 in 16..256
    d_sample = q.shape[1]
    block_k = flash_attention_mma_config(d_sample)
    trace_build = flash_attention_mma_build(d_sample, "float16", trace=True)
    builds = [trace_build, flash_attention_mma_build(d, "float16")]
    prep = _prepare(builds, use_device, emulate, emulator_builds=[trace_build])
    # mma_probe does not depend on the head dim: report it once per architecture, from the first build
    probes = {}
    prep.resources = tuple(r for r in prep.resources
                           if r.entry != "mma_probe" or probes.setdefault(r.arch, r) is r)
    ref, ref_lse = attention(*_f64(q, k, v), return_lse=True)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)
    case = f"layer {layer}, head {head} (128 x {d_sample}, float16)"
    checks, notes, extra, details = [], [], [], {}

    def run_checks(where, run_probe, run_kernel):
        checks.append(_check(where, "one mma.sync, 16x16 @ 16x8", run_probe(), _f64(a)[0] @ _f64(b)[0],
                             atol=1e-4, rtol=1e-4))
        out, lse, trace = run_kernel()
        checks.append(_check(where, case, out, ref, lse, ref_lse, **MMA_TOLERANCE))
        return trace

    dev = prep.device
    trace, where = None, None
    if dev is not None:
        trace = _run_guarded(lambda: run_checks(
            GPU, lambda: dev.get(dev.kernel(mma_probe_gpu)(dev.put(a), dev.put(b))),
            lambda: [dev.get(x) if i < 2 else x for i, x in enumerate(
                dev.kernel(flash_attention_mma_gpu)(*(dev.put(x) for x in (q, k, v)), trace_rows=[row]))]),
            notes, "GPU")
        where = GPU
    if prep.emulate:
        got = _run_guarded(lambda: run_checks(
            EMULATOR, lambda: mma_probe_gpu(a, b, backend="emulator"),
            lambda: flash_attention_mma_gpu(q, k, v, trace_rows=[row], backend="emulator")), notes, "emulator")
        if trace is None:
            trace, where = got, EMULATOR
    if trace is not None:
        details, lines = _trace_report(trace, q, k, v, row, MMA_BLOCK_Q, block_k, where, (row,))
        extra += lines
    timings = []
    if dev is not None:
        def on_gpu():
            x = [dev.put(rng.standard_normal((heads, n, d)).astype(np.float16)) for _ in range(3)]
            flops = 4.0 * n * n * d * heads
            runs = {"naive CuPy": lambda: naive_attention(dev.xp, *x),
                    "CUDA cores": lambda: dev.kernel(flash_attention_gpu)(*x),
                    "tensor cores": lambda: dev.kernel(flash_attention_mma_gpu)(*x)}
            rows = []
            for name, fn in runs.items():
                seconds = dev.median_seconds(fn, warmup=2, repeats=repeats)
                rows.append({"kernel": name, "seconds": seconds, "tflops": flops / seconds / 1e12})
            return rows
        timings = _run_guarded(on_gpu, notes, "GPU") or []
        if timings:
            extra += ["", f"Median time on {dev.name}, {heads} heads, N={n}, d={d}, float16 (CUDA events, "
                          f"{repeats} runs):"]
            extra += [f"  {t['kernel']:>12}: {_format_seconds(t['seconds']):>10}  {t['tflops']:7.1f} TFLOP/s"
                      for t in timings]
    details.update(timings=tuple(timings), block_k=block_k, row=row, token=sample.tokens[row])
    return _result("04_io_awareness", f"FlashAttention-2 forward on tensor cores "
                   f"(lessons/gpu/kernels/flash_attention_mma.cu), block_q={MMA_BLOCK_Q}, block_k={block_k}",
                   builds, prep, checks, notes, details, extra)


# ---------------------------------------------------------------------------
# 05 paged decode, one sequence, one head group
# ---------------------------------------------------------------------------

def _notebook05_data():
    """The data of notebook 05: one real head, a 100-token sequence in a shuffled pool of 16 pages."""
    q_all, k_all, v_all = load_sample().qkv(0, 0, dtype=np.float64)
    seq_len, block_size = 100, 16
    block_table, k_cache, v_cache = write_paged_cache(k_all[:seq_len], v_all[:seq_len], block_size,
                                                      num_blocks=16, seed=3)
    return q_all[seq_len - 1], block_table, k_cache, v_cache, seq_len, block_size


def _used_slots(block_table, seq_len, num_blocks, block_size) -> np.ndarray:
    """Bool (num_blocks, block_size): the slots a sequence of ``seq_len`` tokens occupies."""
    used = np.zeros((num_blocks, block_size), dtype=bool)
    for j, page in enumerate(np.asarray(block_table)[: -(-seq_len // block_size)]):
        used[int(page), : min(block_size, seq_len - j * block_size)] = True
    return used


def paged_decode_on_gpu(q=None, block_table=None, k_cache=None, v_cache=None, seq_len=None, block_size=None,
                        *, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 05: the paged decode kernel on one sequence and one head group.

    Parameters (notebook 05's names; all None = rebuild the notebook's data: the query of
    token 99 of the real sample, 100 tokens in 16 shuffled pages of 16 slots, NaN in every
    unused slot)
    ----------
    q : (d,) one decode query; block_table : int (num_blocks_per_seq,);
    k_cache, v_cache : (num_blocks, block_size, d); seq_len : int; block_size : int.

    The kernel (vLLM layout ``(num_blocks, block_size, num_kv_heads, d)``, here one KV head
    serving one query head) is checked against :func:`lessons.paged_flash_attention`. Then
    the unused slots are refilled with ``+inf`` and ``1e30``: the kernel's output must not
    change by a bit (it never reads past ``seq_len``); ``details["garbage_identical"]``.
    Raises ValueError when only some of the data arguments are given.
    Source: Kwon et al. 2023 (PagedAttention), Sec. 4.
    """
    given = [x is not None for x in (q, block_table, k_cache, v_cache, seq_len, block_size)]
    if any(given) and not all(given):
        raise ValueError("pass all of q, block_table, k_cache, v_cache, seq_len, block_size, or none of them")
    if not any(given):
        q, block_table, k_cache, v_cache, seq_len, block_size = _notebook05_data()
    ref, ref_lse = paged_flash_attention(*_f64(q), block_table, *_f64(k_cache, v_cache), seq_len, block_size,
                                         return_lse=True)
    d = np.shape(q)[-1]
    qk = np.ascontiguousarray(np.asarray(q, dtype=np.float32).reshape(1, 1, d))
    kc = np.ascontiguousarray(np.asarray(k_cache, dtype=np.float32)[:, :, None, :])
    vc = np.ascontiguousarray(np.asarray(v_cache, dtype=np.float32)[:, :, None, :])
    tables = np.ascontiguousarray(np.asarray(block_table, dtype=np.int32).reshape(1, -1))
    lens = np.array([seq_len], dtype=np.int32)
    build = paged_decode_build(d, block_size, 1, 1, "float32")
    prep = _prepare([build], use_device, emulate, entries=("paged_decode",))
    used = _used_slots(block_table, seq_len, kc.shape[0], block_size)
    case = f"seq_len {seq_len} in pages of {block_size} (pages {list(map(int, np.asarray(block_table)))})"
    checks, notes, extra, details = [], [], [], {}

    def garbage_runs(run):
        outs = []
        for fill in (np.inf, 1e30):
            kg = np.where(used[:, :, None, None], kc, np.float32(fill)).astype(np.float32)
            vg = np.where(used[:, :, None, None], vc, np.float32(fill)).astype(np.float32)
            outs.append(run(kg, vg))
        return outs

    dev = prep.device
    if dev is not None:
        def on_gpu():
            args = [dev.put(x) for x in (qk, kc, vc, tables, lens)]
            seconds = dev.median_seconds(lambda: dev.kernel(paged_decode_gpu)(*args, check_tables=False))
            o, lse = dev.kernel(paged_decode_gpu)(*args)
            check = _check(GPU, case, dev.get(o)[0, 0], ref, dev.get(lse)[0, 0], ref_lse, seconds=seconds)
            same = garbage_runs(lambda kg, vg: dev.get(dev.kernel(paged_decode_gpu)(qk, kg, vg, tables, lens)[0]))
            return check, all(np.array_equal(s, dev.get(o)) for s in same)
        got = _run_guarded(on_gpu, notes, "GPU")
        if got is not None:
            checks.append(got[0])
            details["garbage_identical"] = got[1]
    if prep.emulate:
        def on_emulator():
            o, lse = paged_decode_gpu(qk, kc, vc, tables, lens, backend="emulator")
            same = garbage_runs(lambda kg, vg: paged_decode_gpu(qk, kg, vg, tables, lens, backend="emulator")[0])
            return _check(EMULATOR, case, o[0, 0], ref, lse[0, 0], ref_lse), all(np.array_equal(s, o) for s in same)
        got = _run_guarded(on_emulator, notes, "emulator")
        if got is not None:
            checks.append(got[0])
            details.setdefault("garbage_identical", got[1])
    if "garbage_identical" in details:
        where = checks[0].where
        held = "NaN" if np.isnan(kc[~used]).all() else "other values"
        extra.append(f"  Unused slots (they held {held}) refilled with +inf, then 1e30: the {where} output is bit for "
                     f"bit the same: {details['garbage_identical']} (nothing past seq_len is read).")
    details["used_slots"] = int(used.sum())
    return _result("05_paged_attention", f"paged decode kernel (lessons/gpu/kernels/paged_decode.cu), one sequence, "
                   f"one head, block_size={block_size}", [build], prep, checks, notes, details, extra)


# ---------------------------------------------------------------------------
# 06 flash-decoding: split-KV + merge
# ---------------------------------------------------------------------------

def split_pages(n_pages: int, num_splits: int) -> list:
    """The pages ``[start, stop)`` split ``s`` of the flash-decoding kernel takes.

    ``per = ceil(n_pages / num_splits)``; split s takes ``[s * per, min((s + 1) * per, n_pages))``,
    empty (start >= stop) past the end. Raises ValueError for n_pages < 0 or num_splits < 1.
    """
    if n_pages < 0 or num_splits < 1:
        raise ValueError(f"need n_pages >= 0 and num_splits >= 1, got {n_pages}, {num_splits}")
    per = -(-n_pages // num_splits) if n_pages else 0
    return [(min(s * per, n_pages), min((s + 1) * per, n_pages)) for s in range(num_splits)]


def flash_decoding_on_gpu(q=None, k=None, v=None, num_splits: int = 6, *, block_size: int = 16,
                          use_device=None, emulate=None) -> GpuLesson:
    """Notebook 06: the split-KV flash-decoding kernel and its merge kernel.

    Parameters
    ----------
    q : (d,) one decode query; k, v : (Nk, d). Default (all None): notebook 06's data, the
        last query of layer 0, head 0 of the real sample against its 128 keys.
    num_splits : workers (thread blocks) per (sequence, head): the notebook's 6.
    block_size : page size of the cache the keys are written into (shuffled pages).

    The kernel splits by pages (see :func:`split_pages`); each split's partial state
    ``(m, l, o)`` is checked against :func:`lessons.attention` over that split's keys
    (``o / l`` and ``m + log l``; an empty split must have ``l = 0``), and the merged
    output against :func:`lessons.flash_decoding` and :func:`lessons.attention`.
    ``details["splits"]`` lists per split: pages, keys, kernel lse and NumPy lse.
    Raises ValueError when only some of q, k, v are given.
    Source: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding).
    """
    given = [x is not None for x in (q, k, v)]
    if any(given) and not all(given):
        raise ValueError("pass all of q, k, v or none of them")
    if not any(given):
        q_all, k, v = load_sample().qkv(0, 0, dtype=np.float64)
        q = q_all[-1]
    q, k, v = _f32(q, k, v)
    nk, d = k.shape
    k_cache, v_cache, tables, lens = write_paged_batch([k[:, None, :]], [v[:, None, :]], block_size, seed=0)
    kc, vc = _f32(k_cache, v_cache)
    tables, lens = tables.astype(np.int32), lens.astype(np.int32)
    qk = np.ascontiguousarray(q.reshape(1, 1, d))
    ref, ref_lse = attention(*_f64(q, k, v), return_lse=True)
    np_out = flash_decoding(*_f64(q, k, v), num_splits, tile=block_size)
    build = paged_decode_build(d, block_size, 1, 1, "float32")
    prep = _prepare([build], use_device, emulate, entries=("paged_decode_split", "merge_splits"))
    n_pages = -(-nk // block_size)
    splits = split_pages(n_pages, num_splits)
    case = f"{nk} keys in {n_pages} pages of {block_size}, num_splits={num_splits}"
    checks, notes, extra, details = [], [], [], {}

    def partial_checks(where, parts):
        m, l, o = (np.asarray(parts[x], dtype=np.float64)[0, 0] for x in ("m", "l", "o"))
        rows = []
        for s, (p0, p1) in enumerate(splits):
            a, b = p0 * block_size, min(p1 * block_size, nk)
            if b > a:
                r_o, r_lse = attention(*_f64(q, k[a:b], v[a:b]), return_lse=True)
                got_lse = m[s] + np.log(l[s]) if l[s] > 0 else -np.inf
                ok = (l[s] > 0 and np.allclose(o[s] / l[s], r_o, **TOLERANCE)
                      and abs(got_lse - r_lse) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(r_lse))
            else:
                r_lse, got_lse, ok = -np.inf, (m[s] + np.log(l[s]) if l[s] > 0 else -np.inf), l[s] == 0
            rows.append({"split": s, "pages": (p0, p1), "keys": (a, max(a, b)), "lse": float(got_lse),
                         "numpy_lse": float(r_lse), "agrees": bool(ok)})
        return rows

    dev = prep.device
    if dev is not None:
        def on_gpu():
            args = [dev.put(x) for x in (qk, kc, vc, tables, lens)]
            seconds = dev.median_seconds(lambda: dev.kernel(flash_decoding_gpu)(*args, num_splits, check_tables=False))
            o, lse, parts = dev.kernel(flash_decoding_gpu)(*args, num_splits, return_partials=True)
            parts = {x: dev.get(y) for x, y in parts.items()}
            return _check(GPU, case, dev.get(o)[0, 0], ref, dev.get(lse)[0, 0], ref_lse, seconds=seconds), parts
        got = _run_guarded(on_gpu, notes, "GPU")
        if got is not None:
            checks.append(got[0])
            details["splits"] = partial_checks(GPU, got[1])
    if prep.emulate:
        got = _run_guarded(lambda: flash_decoding_gpu(qk, kc, vc, tables, lens, num_splits, return_partials=True,
                                                      backend="emulator"), notes, "emulator")
        if got is not None:
            checks.append(_check(EMULATOR, case, got[0][0, 0], ref, got[1][0, 0], ref_lse))
            details.setdefault("splits", partial_checks(EMULATOR, got[2]))
    if "splits" in details:
        where = checks[0].where
        extra += ["", f"The partial states, one per split (the kernel splits by pages: per = ceil({n_pages} / "
                      f"{num_splits}) = {-(-n_pages // num_splits)}), beside attention over the same keys:",
                  f"  {'split':>5} {'pages':>7} {'keys':>9} {'lse ' + where:>14} {'lse NumPy':>10}  agrees"]
        for r in details["splits"]:
            keys = f"{r['keys'][0]}-{r['keys'][1] - 1}" if r["keys"][1] > r["keys"][0] else "none"
            pages = f"{r['pages'][0]}-{r['pages'][1] - 1}" if r["pages"][1] > r["pages"][0] else "none"
            extra.append(f"  {r['split']:>5} {pages:>7} {keys:>9} {_g(r['lse'], 7):>14} {_g(r['numpy_lse'], 7):>10}  "
                         f"{r['agrees']}")
        final = checks[-1] if checks[-1].where == EMULATOR else checks[0]
        diff = float(np.abs(final.output - np_out).max())
        details["numpy_flash_decoding_difference"] = diff
        extra.append(f"  The merged output differs from lessons.flash_decoding (NumPy, {num_splits} splits by keys) by "
                     f"{diff:.1e}.")
    details["split_pages"] = splits
    return _result("06_flash_decoding_and_ring", f"flash-decoding kernels (paged_decode_split + merge_splits), "
                   f"num_splits={num_splits}", [build], prep, checks, notes, details, extra)


# ---------------------------------------------------------------------------
# 07 paged decode with GQA
# ---------------------------------------------------------------------------

def _notebook07_data():
    """The data of notebook 07 (same generator, seeds and order): 4 sequences, 8 heads on 2 KV heads."""
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, d, block_size = 8, 2, 64, 16
    lengths = [1, 15, 16, 37]
    keys = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    values = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    k_cache, v_cache, block_tables, seq_lens = write_paged_batch(keys, values, block_size, seed=1)
    q = rng.standard_normal((len(lengths), num_heads, d))
    return q, k_cache, v_cache, block_tables, seq_lens


def paged_gqa_on_gpu(q=None, k_cache=None, v_cache=None, block_tables=None, seq_lens=None, *,
                     use_device=None, emulate=None) -> GpuLesson:
    """Notebook 07: the paged decode kernel with grouped-query heads, on a batch.

    Parameters (notebook 07's names; all None = rebuild the notebook's data: 4 sequences
    of 1, 15, 16 and 37 tokens, 8 query heads on 2 KV heads, d = 64, pages of 16, NaN in
    the unused slots)
    ----------
    q : (num_seqs, num_heads, d); k_cache, v_cache : (num_blocks, block_size, num_kv_heads, d);
    block_tables : int (num_seqs, max_blocks_per_seq), -1 = padding; seq_lens : int (num_seqs,).

    Checked against :func:`lessons.paged_decode`. ``details["heads_per_block"]`` is how
    many query heads of one group a thread block serves (each page it loads is used that
    many times). Raises ValueError when only some of the data arguments are given.
    Source: Kwon et al. 2023, Sec. 4; Ainslie et al. 2023 (GQA), Sec. 2; Dao 2023, Alg. 1.
    """
    given = [x is not None for x in (q, k_cache, v_cache, block_tables, seq_lens)]
    if any(given) and not all(given):
        raise ValueError("pass all of q, k_cache, v_cache, block_tables, seq_lens, or none of them")
    if not any(given):
        q, k_cache, v_cache, block_tables, seq_lens = _notebook07_data()
    q32, kc, vc = _f32(q, k_cache, v_cache)
    tables = np.ascontiguousarray(np.asarray(block_tables), dtype=np.int32)
    lens = np.ascontiguousarray(np.asarray(seq_lens), dtype=np.int32)
    ref, ref_lse = paged_decode(*_f64(q32, kc, vc), block_tables, seq_lens, return_lse=True)
    num_seqs, num_heads, d = q32.shape
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    build = paged_decode_build(d, block_size, num_heads, num_kv_heads, "float32")
    hpb = dict(build.defines)["HEADS_PER_BLOCK"]
    prep = _prepare([build], use_device, emulate, entries=("paged_decode",))
    case = (f"{num_seqs} sequences (lengths {lens.tolist()}), {num_heads} heads on {num_kv_heads} KV heads, "
            f"d={d}, pages of {block_size}")
    checks, notes = [], []
    dev = prep.device
    if dev is not None:
        def on_gpu():
            args = [dev.put(x) for x in (q32, kc, vc, tables, lens)]
            seconds = dev.median_seconds(lambda: dev.kernel(paged_decode_gpu)(*args, check_tables=False))
            o, lse = dev.kernel(paged_decode_gpu)(*args)
            return _check(GPU, case, dev.get(o), ref, dev.get(lse), ref_lse, seconds=seconds)
        got = _run_guarded(on_gpu, notes, "GPU")
        if got is not None:
            checks.append(got)
    if prep.emulate:
        got = _run_guarded(lambda: paged_decode_gpu(q32, kc, vc, tables, lens, backend="emulator"), notes, "emulator")
        if got is not None:
            checks.append(_check(EMULATOR, case, got[0], ref, got[1], ref_lse))
    group = num_heads // num_kv_heads
    extra = [f"  Grid: {num_heads // hpb} x {num_seqs} thread blocks; each serves {hpb} query heads of one group of "
             f"{group}, so every page of a KV head it loads is used {hpb} times."]
    return _result("07_paged_gqa_decode", f"paged GQA decode kernel (lessons/gpu/kernels/paged_decode.cu), "
                   f"HEADS_PER_BLOCK={hpb}", [build], prep, checks, notes,
                   {"heads_per_block": hpb, "group": group}, extra)

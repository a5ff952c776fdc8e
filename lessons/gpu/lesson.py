"""The "On the GPU" section of every notebook but 06, 10 and 11 (the kernel ladders): the notebook's algorithm as a CUDA kernel.

Each section is a short :class:`lessons.gpu.harness.Section` spec (builds of :mod:`lessons.gpu.source`,
inputs, a launch at one place, the NumPy reference, what it prints) run by
:func:`lessons.gpu.harness.run_section`: compiled for sm_80 and sm_90, run and timed on a CUDA device
when there is one, else run on the CPU emulator and labelled so, never as the GPU. Each returns a
:class:`GpuLesson` (numbers as attributes, ``str(result)`` the text printed) and takes ``use_device``
and ``emulate`` as the harness's module docstring says. Nothing here needs a GPU or CuPy. Kernels
compute in float32 (float16 on tensor cores), checked against float64 NumPy on the same rounded inputs.

======================  ================================================================================
notebook                function
======================  ================================================================================
01 online softmax       :func:`online_softmax_on_gpu`
02 flash attention      :func:`flash_attention_on_gpu` (with the kernel's trace)
03 query blocks/causal  :func:`causal_on_gpu`
04 backward pass        :func:`lessons.gpu.backward.backward_on_gpu` (with the kernels' trace)
05 io awareness         :func:`io_on_gpu` (compile report; naive vs kernel), :func:`tensor_cores_on_gpu`
07 paged attention      :func:`paged_decode_on_gpu`
08 flash-decoding       :func:`flash_decoding_on_gpu`
09 paged GQA decode     :func:`paged_gqa_on_gpu`
======================  ================================================================================
"""
from __future__ import annotations

from types import MappingProxyType, SimpleNamespace

import numpy as np

from lessons.core.checks import as_float_array, check_flag, check_int, check_int_sequence, check_positive_int
from lessons.core.reference import attention
from lessons.course.data import decode_query_case, gqa_batch_case, load_sample, paged_case, softmax_demo_rows
from lessons.gpu.compile import NOT_REPORTED, _config
from lessons.gpu.harness import TOLERANCE, GpuLesson, KernelCheck, Section, Table, format_seconds, run_section
# kernel_row_trace (the stepper's hook) lives in launch; notebooks saved earlier import it from here
from lessons.gpu.launch import (flash_attention_gpu, flash_attention_mma_gpu, flash_decoding_gpu, kernel_row_trace,
                                mma_probe_gpu, online_softmax_gpu, paged_decode_gpu)
from lessons.gpu.measure import attention_flops, naive_attention
from lessons.gpu.source import (MMA_BLOCK_Q, STATIC_SMEM_LIMIT, default_builds, flash_attention_build,
                                flash_attention_config, flash_attention_mma_build, flash_attention_mma_config,
                                online_softmax_build, paged_decode_build)
from lessons.gpu.trace_compare import compare_rows, comparison_lines, trace_table
from lessons.schedules.causal import count_tiles
from lessons.schedules.flash import flash_attention
from lessons.schedules.gqa_decode import paged_decode, write_paged_batch
from lessons.schedules.paged import paged_flash_attention
from lessons.schedules.softmax import safe_softmax
from lessons.schedules.split_kv import flash_decoding, split_ranges
from lessons.schedules.variants import run_variant

__all__ = ["GpuLesson", "KernelCheck", "online_softmax_on_gpu", "flash_attention_on_gpu", "causal_on_gpu", "io_on_gpu",
           "tensor_cores_on_gpu", "kernel_row_trace", "paged_decode_on_gpu", "flash_decoding_on_gpu",
           "paged_gqa_on_gpu", "CAUSAL_CASES", "TOLERANCE", "MMA_TOLERANCE"]

#: the tensor-core kernel (P rounded to float16 before P V) against float64 NumPy on float16 inputs
MMA_TOLERANCE = MappingProxyType({"atol": 3e-3, "rtol": 5e-3})
#: (Nq, Nk) of notebook 03: fewer queries than keys, and more (the first Nq - Nk rows see nothing)
CAUSAL_CASES = ((40, 128), (128, 96))
#: how the paged launchers are timed: the block tables were checked by the untimed launch
TIMED_PAGED = MappingProxyType({"check_tables": False})


def _f32(*arrays):
    return tuple(np.ascontiguousarray(a, dtype=np.float32) for a in arrays)


def _f64(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


def _data(names: str, values, default) -> tuple:
    """``values`` when every one is given, ``default()`` when none is; ValueError for some."""
    if any(x is not None for x in values) and any(x is None for x in values):
        raise ValueError(f"pass all of {names}, or none of them")
    return default() if values[0] is None else tuple(values)


def _run(notebook, title, builds, run=None, report=None, *, use_device, emulate, **spec) -> GpuLesson:
    return run_section(Section(notebook, title, list(builds), run, report, **spec), use_device, emulate)


def _table(title: str, lines) -> Table:
    return Table("\n".join("  " + r for r in lines), title)


def _softmax_reference(x):
    x64 = np.asarray(x, dtype=np.float64)
    return safe_softmax(x64), np.logaddexp.reduce(x64, axis=-1)


def online_softmax_on_gpu(x=None, *, tile: int = 256, timing_shape=(2048, 8192), use_device=None,
                          emulate=None) -> GpuLesson:
    """Notebook 01: the online-softmax kernel (one thread block per row) against NumPy.

    ``x``: float (n_cols,) or (n_rows, n_cols), cast to float32 (default
    :func:`lessons.course.data.softmax_demo_rows`: 3 x 700, a masked first tile, an all-masked row);
    ``tile``: columns per tile = threads per block (a multiple of 32 up to 1024); ``timing_shape``:
    (rows, cols) of random float32 scores timed on a GPU. References: :func:`lessons.safe_softmax`,
    ``numpy.logaddexp.reduce`` (lse), float64. Raises, before compiling, TypeError for an ``x`` without a
    float dtype, a non-int ``tile`` or ``timing_shape``; ValueError for an empty ``x`` or one not 1-D/2-D,
    a ``tile`` the kernel cannot take, a ``timing_shape`` not two ints >= 1.
    Source: Milakov & Gimelshein 2018, Alg. 3.
    """
    if x is not None:
        x = np.ascontiguousarray(as_float_array(x, "x", (1, 2)), dtype=np.float32)
        if x.size == 0:
            raise ValueError(f"x must hold at least one score, got shape {x.shape}")
    demo = x is None                 # the report's two sentences are about the demo rows
    x = softmax_demo_rows() if demo else x
    timing_shape = check_int_sequence(timing_shape, "timing_shape", min=1, count=2)

    def run(place):
        runs = [(f"{' x '.join(map(str, x.shape))} scores, tiles of {tile}", x, False)]
        if place.timed:
            runs.append((f"{timing_shape[0]} x {timing_shape[1]} random scores",
                         (np.random.default_rng(1).standard_normal(timing_shape) * 3).astype(np.float32), True))
        return [place.verify(case, online_softmax_gpu, [s], _softmax_reference(s), timed=timed, tile=tile)
                for case, s, timed in runs], {}

    def report(r):
        if not r.checks or not demo:
            return []
        c = r.checks[0]
        return [f"  row 2 sees nothing: y = {np.unique(c.output[2]).tolist()}, lse = {c.lse[2]}; "
                f"row 1's masked first tile left no NaN: {bool(np.isfinite(c.output[1]).all())}"]

    return _run("01_online_softmax", "online softmax kernel (lessons/gpu/kernels/online_softmax.cu)",
                [online_softmax_build(tile, "float32")], run, report, details={"x": x}, use_device=use_device,
                emulate=emulate)


def _trace_report(place, gpu_trace, q, k, v, row, block_q, block_k) -> dict:
    """The kernel's trace of ``row`` beside NumPy's and beside a fold that forgets alpha on l."""
    _, np_trace = flash_attention(*_f64(q, k, v), tile=block_k, block_q=block_q, return_trace=True)
    broken = run_variant("no_alpha_on_l", *_f64(q[row:row + 1], k, v), block_k)
    return compare_rows(gpu_trace.row(row), np_trace.row(row), SimpleNamespace(
        m=broken.m[:, 0], alpha=broken.alpha[:, 0], l=broken.l[:, 0]), place.where)


def _trace_lines(details, row, block_q, block_k) -> list:
    if "gpu_row" not in details:
        return []
    where = details["trace_from"]
    return [_table(f"Row {row}, tile by tile: the {where}'s trace (trace build, -DFA_TRACE) beside NumPy's "
                   f"(lessons.flash_attention, block_q={block_q}, tile={block_k}):",
                   trace_table(details["gpu_row"], details["numpy_row"], where).split("\n")),
            *comparison_lines(details, "a fold that forgets alpha on l (lessons.schedules.variants 'no_alpha_on_l')")]


def _forward_checks(place, case, qkv, reference, heads=None, **options) -> list:
    """Timed checks of the forward kernel: on a GPU first every head in one launch (``heads``: (case, q, k, v),
    each (L, H, N, d), or None) against :func:`lessons.attention` per head; then ``qkv`` against ``reference``."""
    runs = [(case, qkv, reference)]
    if heads is not None and place.timed:
        q, k, v = heads[1:]
        refs = [attention(*_f64(q[i, j], k[i, j], v[i, j]), return_lse=True, causal=options.get("causal", False))
                for i, j in np.ndindex(q.shape[:2])]
        runs.insert(0, (heads[0], heads[1:], (np.stack([x[0] for x in refs]).reshape(q.shape),
                                              np.stack([x[1] for x in refs]).reshape(q.shape[:-1]))))
    return [place.verify(label, flash_attention_gpu, arrays, ref, timed=True, **options) for label, arrays, ref in runs]


def flash_attention_on_gpu(*, layer: int = 0, head: int = 0, row: int = 93, block_k: int = 16,
                           all_heads: bool = True, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 02: the FlashAttention-2 forward kernel on one head of the real sample, and its trace.

    ``layer``, ``head``: the head checked and traced; ``row``: the query row whose trace is replayed
    beside :func:`lessons.flash_attention`'s (93, the token "and"; :func:`lessons.gpu.first_divergence`);
    ``block_k``: keys per tile (``block_q``: the kernel's default for d = 32); ``all_heads``: on a GPU,
    also all 6 x 12 heads in one launch. Output checked against :func:`lessons.attention`. ``details``:
    ``gpu_row``, ``numpy_row``, ``divergence`` (None: every tile agrees), ``broken_divergence``,
    ``model_error`` (vs the model's own output). TypeError for a non-int ``layer``, ``head``, ``row``,
    ``block_k`` or a non-bool ``all_heads``; ValueError for one outside the sample (``row`` in 0..127)
    or a ``block_k`` the kernel cannot take. Source: Dao 2023 (FlashAttention-2), Alg. 1.
    """
    sample = load_sample()
    q, k, v = _f32(*sample.qkv(layer, head, dtype=np.float32))
    row, all_heads = check_int(row, "row", min=0, max=q.shape[0] - 1), check_flag(all_heads, "all_heads")
    d = q.shape[1]
    block_q, block_k = flash_attention_config(d, None, block_k)
    trace_build = flash_attention_build(d, "float32", True, block_q, block_k)
    ref = attention(*_f64(q, k, v), return_lse=True)
    case = f"layer {layer}, head {head} (128 x 32)"
    heads = (f"all {sample.q.shape[0]} x {sample.q.shape[1]} heads of the sample, one launch",
             *_f32(sample.q, sample.k, sample.v)) if all_heads else None

    def run(place):
        checks = _forward_checks(place, case, (q, k, v), ref, heads, block_q=block_q, block_k=block_k) \
            if place.timed else []
        (out, lse, trace), _ = place.launch(flash_attention_gpu, (q, k, v), block_q=block_q, block_k=block_k,
                                            trace_rows=[row])
        checks.append(place.check(case + ", trace build", (out, lse), ref))
        return checks, _trace_report(place, trace, q, k, v, row, block_q, block_k)

    def report(r):
        lines = _trace_lines(r.details, row, block_q, block_k)
        if r.checks and layer in sample.context:
            model = sample.model_output(layer, head)
            err = r.details["model_error"] = float(np.abs(r.checks[-1].output - model).max())
            lines.append(f"  The model's own output for this head (PyTorch, float32, before q, k, v were stored in "
                         f"float16) is {err:.1e} from the kernel's and {float(np.abs(ref[0] - model).max()):.1e} from "
                         f"NumPy's: the float16 rounding of the inputs, not the kernel.")
        return lines

    return _run("02_flash_attention_tile_by_tile", f"FlashAttention-2 forward kernel (lessons/gpu/kernels/"
                f"flash_attention.cu), block_q={block_q}, block_k={block_k}, d={d}",
                [flash_attention_build(d, "float32", False, block_q, block_k), trace_build], run, report,
                emulator_builds=[trace_build], use_device=use_device, emulate=emulate,
                details=dict(block_q=block_q, block_k=block_k, row=row, token=sample.tokens[row]))


def causal_on_gpu(*, layer: int = 0, head: int = 0, cases=CAUSAL_CASES, all_heads: bool = True,
                  use_device=None, emulate=None) -> GpuLesson:
    """Notebook 03: the forward kernel with ``causal=True`` and Nq != Nk, on the real sample.

    Each case ``(Nq, Nk)`` takes the last Nq queries and first Nk keys of one head (all 72 heads at once
    on a GPU with ``all_heads``). Mask aligned bottom-right (query i sees key j iff ``j <= i + Nk - Nq``);
    rows that see no key must give out = 0, lse = -inf (no NaN). Checked against :func:`lessons.attention`
    ``(causal=True)``; ``details["empty_rows"]``: such rows per case; ``details["tiles"]``:
    :func:`lessons.count_tiles` per case. TypeError for ``cases`` that are not (Nq, Nk) pairs of ints or
    a non-bool ``all_heads``; ValueError for no cases or an Nq or Nk outside 1..128.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.1.
    """
    sample = load_sample()
    n = sample.q.shape[2]
    if isinstance(cases, (str, bytes)) or not hasattr(cases, "__iter__"):
        raise TypeError(f"cases must be a sequence of (Nq, Nk) pairs, got {type(cases).__name__} {cases!r}")
    cases = tuple(cases)
    if not cases:
        raise ValueError("cases must hold at least one (Nq, Nk) pair, got none")
    for case in cases:
        if isinstance(case, (str, bytes)) or not hasattr(case, "__len__") or len(case) != 2:
            raise TypeError(f"cases must hold (Nq, Nk) pairs, got {case!r}")
    cases = tuple((check_int(a, "cases (Nq)"), check_int(b, "cases (Nk)")) for a, b in cases)
    all_heads = check_flag(all_heads, "all_heads")
    for nq, nk in cases:
        if not (1 <= nq <= n and 1 <= nk <= n):
            raise ValueError(f"cases must hold (Nq, Nk) pairs in 1..{n}, got {(nq, nk)}")
    q, k, v = _f32(*sample.qkv(layer, head, dtype=np.float32))
    block_q, block_k = flash_attention_config(q.shape[1])
    data = {}                          # (nq, nk) -> (q, k, v), reference, all heads
    for nq, nk in cases:
        qkv = _f32(q[-nq:], k[:nk], v[:nk])
        heads = (f"Nq={nq}, Nk={nk}, causal, all {sample.q.shape[0] * sample.q.shape[1]} heads",
                 *_f32(sample.q[:, :, -nq:], sample.k[:, :, :nk], sample.v[:, :, :nk])) if all_heads else None
        data[(nq, nk)] = (qkv, attention(*_f64(*qkv), causal=True, return_lse=True), heads)
    empty_rows = {c: int(np.isneginf(ref[1]).sum()) for c, (_, ref, _) in data.items()}
    tiles = {c: count_tiles(*c, block_q, block_k, causal=True) for c in cases}

    def run(place):
        return [c for (nq, nk), (qkv, ref, heads) in data.items()
                for c in _forward_checks(place, f"Nq={nq}, Nk={nk}, causal, layer {layer} head {head}", qkv, ref,
                                         heads, causal=True)], {}

    def report(r):
        lines = [""]
        for (nq, nk), c in tiles.items():
            lines.append(f"Nq={nq}, Nk={nk} in tiles of {block_q} x {block_k}: {c.full} full, {c.diagonal} diagonal, "
                         f"{c.skipped} skipped (lessons.schedules.causal.count_tiles); rows that see no key: "
                         f"{empty_rows[(nq, nk)]}")
            kernel = [x for x in r.checks if x.case.startswith(f"Nq={nq}, Nk={nk}, causal, layer")]
            if kernel and empty_rows[(nq, nk)]:
                ck = kernel[-1]
                empty = np.isneginf(ck.reference_lse)
                lines[-1] += (f" - the kernel wrote out = 0 there: {bool((ck.output[empty] == 0).all())}, "
                              f"lse = -inf: {bool(np.isneginf(ck.lse[empty]).all())}, NaN anywhere: "
                              f"{bool(np.isnan(ck.output).any() or np.isnan(ck.lse).any())}")
        return lines

    return _run("03_query_blocks_and_causal", f"FlashAttention-2 forward kernel, causal (bottom-right), "
                f"block_q={block_q}, block_k={block_k}", [flash_attention_build(q.shape[1], "float32", False,
                                                                                block_q, block_k)], run, report,
                details={"empty_rows": empty_rows, "tiles": tiles, "block_q": block_q, "block_k": block_k},
                use_device=use_device, emulate=emulate)


def io_on_gpu(*, ns=(1024, 2048, 4096), d: int = 64, heads: int = 8, repeats: int = 5,
              use_device=None) -> GpuLesson:
    """Notebook 05: what the kernels cost on chip, and (with a GPU) naive CuPy vs the kernel.

    Compiles every kernel of the series (:func:`lessons.gpu.compile_report`, head dim 128, float16) and
    the forward kernel for head dim ``d``: registers/thread and static shared memory/block on sm_80 and
    sm_90. ``details["smem_formula"]``: per forward build, the bytes of the tile formula of
    :mod:`lessons.gpu.source` (``4 * (block_q (d+1) + 2 block_k (d+1) + block_q (block_k+1))``) and those
    reported (None where nobody did). With a device, for each N in ``ns`` (``heads`` heads, float16): the
    median seconds (CUDA events, ``repeats`` runs after 2 warm-ups) of naive attention in CuPy
    (:func:`lessons.gpu.measure.naive_attention`, float32 scores) and of :func:`lessons.gpu.flash_attention_gpu`,
    and the largest difference of their outputs (``details["timings"]``). TypeError for ``ns`` not a
    sequence of ints or a non-int ``d``, ``heads``, ``repeats``; ValueError for no ``ns`` or any value
    below 1. Source: Dao et al. 2022, Sec. 2-3 (IO-awareness); Dao 2023, Alg. 1.
    """
    ns = check_int_sequence(ns, "ns", min=1)
    heads, repeats = check_positive_int(heads, "heads"), check_positive_int(repeats, "repeats")
    builds = list(default_builds(128, "float16")) + [flash_attention_build(d, "float16")]
    forward = [b for b in builds if b.kernel == "flash_attention"]

    def timings(place):
        rows, rng, launch = [], np.random.default_rng(0), place.kernel(flash_attention_gpu)
        for n in ns:
            q, k, v = (place.put(rng.standard_normal((heads, n, d)).astype(np.float16)) for _ in range(3))
            t_naive = place.seconds(lambda: naive_attention(place.xp, q, k, v), warmup=2, repeats=repeats)
            t_kernel = place.seconds(lambda: launch(q, k, v), warmup=2, repeats=repeats)
            err = float(abs(place.host(launch(q, k, v)[0]).astype(np.float64)
                            - place.host(naive_attention(place.xp, q, k, v)).astype(np.float64)).max())
            rows.append({"n": n, "naive_seconds": t_naive, "kernel_seconds": t_kernel, "max_difference": err})
        return rows, [_table(f"Median time on {place.name}, {heads} heads, d={d}, float16 inputs (naive: "
                             f"lessons.gpu.measure; CUDA events, {repeats} runs):",
                             [f"{'N':>6} {'naive CuPy':>12} {'kernel':>12} {'naive/kernel':>13} {'max |diff|':>11}",
                              *(f"{r['n']:>6} {format_seconds(r['naive_seconds']):>12} "
                                f"{format_seconds(r['kernel_seconds']):>12} "
                                f"{r['naive_seconds'] / r['kernel_seconds']:>12.2f}x {r['max_difference']:>11.1e}"
                                for r in rows)])]

    def report(r):
        formula = r.details["smem_formula"] = {
            b.describe(): (b.smem_bytes, [x.smem_bytes for x in r.resources if x.entry == "flash_attention_forward"
                                          and x.config == _config(b)]) for b in forward}
        if not r.compiled:
            return []
        lines = ["", "Shared memory of the forward kernel, from its tiles (float32 q, k, v and p tiles, +1 column "
                     "against bank conflicts) and as reported:"]
        for b in forward:
            c, (bytes_, reported) = dict(b.defines), formula[b.describe()]
            shown = " and ".join(NOT_REPORTED if x is None else f"{x:,}" for x in reported)
            lines.append(f"  d={c['HEAD_DIM']}, block_q={c['BLOCK_Q']}, block_k={c['BLOCK_K']}: 4 * ({c['BLOCK_Q']}*"
                         f"{c['HEAD_DIM'] + 1} + 2*{c['BLOCK_K']}*{c['HEAD_DIM'] + 1} + {c['BLOCK_Q']}*"
                         f"{c['BLOCK_K'] + 1}) = {bytes_:,} bytes; reported: {shown} bytes (sm_80 and sm_90)")
        return lines + [f"  A block may declare at most {STATIC_SMEM_LIMIT // 1024} KiB of static shared memory: "
                        f"flash_attention_config picks the largest block_k that fits it."]

    return _run("05_io_awareness", "every kernel of the series, compiled (registers and shared memory)", builds,
                report=report, timings=timings, use_device=use_device, emulate=False)


def tensor_cores_on_gpu(*, layer: int = 0, head: int = 0, row: int = 93, n: int = 8192, d: int = 64,
                        heads: int = 8, repeats: int = 5, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 05: the forward pass on tensor cores (``mma.sync.m16n8k16``), checked and timed.

    Compiles :func:`lessons.gpu.flash_attention_mma_gpu` for the sample's head dim (32, with the trace
    build) and for ``d``. On a GPU, else the emulator: one tensor-core instruction alone
    (:func:`lessons.gpu.mma_probe_gpu`, 16x16 @ 16x8) against NumPy; the kernel on head ``layer``/``head``
    (float16) against :func:`lessons.attention`; the trace of ``row`` beside :func:`lessons.flash_attention`'s.
    With a GPU it also times, for ``heads`` heads of N = ``n``, d = ``d`` (float16), naive CuPy, the CUDA-core
    and the tensor-core kernels (median of ``repeats`` CUDA-event runs after 2 warm-ups; seconds, TFLOP/s at
    4 N^2 d flops per head): ``details["timings"]`` (empty without one). TypeError for a non-int ``row``,
    ``n``, ``heads``, ``repeats``; ValueError for a ``row`` outside the sample's 128, ``n``, ``heads`` or
    ``repeats`` below 1, or a ``d`` the kernel cannot take.
    Source: Dao 2023 (FlashAttention-2), Alg. 1 and Sec. 3.3; PTX ISA, mma.m16n8k16.
    """
    sample = load_sample()
    q, k, v = (np.ascontiguousarray(x, dtype=np.float16) for x in sample.qkv(layer, head, dtype=np.float32))
    check_int(row, "row", min=0, max=q.shape[0] - 1)
    for name, value in (("n", n), ("heads", heads), ("repeats", repeats)):
        check_positive_int(value, name)
    flash_attention_mma_config(d)                                   # d: a multiple of 16 in 16..256
    d_sample = q.shape[1]
    block_k = flash_attention_mma_config(d_sample)
    trace_build = flash_attention_mma_build(d_sample, "float16", trace=True)
    ref = attention(*_f64(q, k, v), return_lse=True)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)

    def run(place):
        probe = place.check("one mma.sync, 16x16 @ 16x8", [place.launch(mma_probe_gpu, (a, b))[0]],
                            [_f64(a)[0] @ _f64(b)[0]], atol=1e-4, rtol=1e-4)
        (out, lse, trace), _ = place.launch(flash_attention_mma_gpu, (q, k, v), trace_rows=[row])
        return [probe, place.check(f"layer {layer}, head {head} (128 x {d_sample}, float16)", (out, lse), ref,
                                   **MMA_TOLERANCE)], _trace_report(place, trace, q, k, v, row, MMA_BLOCK_Q, block_k)

    def timings(place):
        x = [place.put(rng.standard_normal((heads, n, d)).astype(np.float16)) for _ in range(3)]
        runs = {"naive CuPy": lambda: naive_attention(place.xp, *x),
                "CUDA cores": lambda: place.kernel(flash_attention_gpu)(*x),
                "tensor cores": lambda: place.kernel(flash_attention_mma_gpu)(*x)}
        rows = [{"kernel": name, "seconds": place.seconds(fn, warmup=2, repeats=repeats)} for name, fn in runs.items()]
        for t in rows:
            t["tflops"] = attention_flops(n, d, heads) / t["seconds"] / 1e12
        return rows, [_table(f"Median time on {place.name}, {heads} heads, N={n}, d={d}, float16 (CUDA events, "
                             f"{repeats} runs):", [f"{'kernel':>12}  {'time':>10}  {'TFLOP/s':>7}", *(
                                 f"{t['kernel']:>12}: {format_seconds(t['seconds']):>10}  {t['tflops']:7.1f}"
                                 for t in rows)])]

    return _run("05_io_awareness", f"FlashAttention-2 forward on tensor cores (lessons/gpu/kernels/"
                f"flash_attention_mma.cu), block_q={MMA_BLOCK_Q}, block_k={block_k}",
                [trace_build, flash_attention_mma_build(d, "float16")], run,
                lambda r: _trace_lines(r.details, row, MMA_BLOCK_Q, block_k), timings=timings,
                emulator_builds=[trace_build], once_per_arch=("mma_probe",),
                details=dict(block_k=block_k, row=row, token=sample.tokens[row]), use_device=use_device,
                emulate=emulate)


def paged_decode_on_gpu(q=None, block_table=None, k_cache=None, v_cache=None, seq_len=None, block_size=None,
                        *, use_device=None, emulate=None) -> GpuLesson:
    """Notebook 07: the paged decode kernel on one sequence and one head group.

    Notebook 07's data (all None: :func:`lessons.course.data.paged_case`, the query of token 99 of the
    sample, 100 tokens in 16 shuffled pages of 16 slots, NaN in every unused slot): ``q`` (d,) one decode
    query, ``block_table`` int (num_blocks_per_seq,), ``k_cache``, ``v_cache`` (num_blocks, block_size, d),
    ``seq_len``, ``block_size`` ints. The kernel (vLLM layout ``(num_blocks, block_size, num_kv_heads, d)``,
    one KV head) is checked against :func:`lessons.paged_flash_attention`; then the unused slots are refilled
    with ``+inf`` and ``1e30`` and the output must not change by a bit (``details["garbage_identical"]``:
    nothing past ``seq_len`` is read). ValueError when only some data arguments are given or ``q`` is not
    one (d,) vector; else what :func:`lessons.paged_flash_attention` raises.
    Source: Kwon et al. 2023 (PagedAttention), Sec. 4.
    """
    q, block_table, k_cache, v_cache, seq_len, block_size = _data(
        "q, block_table, k_cache, v_cache, seq_len, block_size", (q, block_table, k_cache, v_cache, seq_len,
                                                                   block_size), paged_case)
    q = as_float_array(q, "q", (1,))                     # one decode query: (1, d) is not silently reshaped
    k_cache, v_cache = as_float_array(k_cache, "k_cache"), as_float_array(v_cache, "v_cache")   # never cast
    ref = paged_flash_attention(*_f64(q), block_table, *_f64(k_cache, v_cache), seq_len, block_size, return_lse=True)
    d = np.shape(q)[-1]
    qk = np.ascontiguousarray(np.asarray(q, dtype=np.float32).reshape(1, 1, d))
    kc, vc = (np.ascontiguousarray(np.asarray(x, dtype=np.float32)[:, :, None, :]) for x in (k_cache, v_cache))
    tables = np.ascontiguousarray(np.asarray(block_table, dtype=np.int32).reshape(1, -1))
    lens = np.array([seq_len], dtype=np.int32)
    used = np.zeros(kc.shape[:2], dtype=bool)            # the slots the sequence occupies
    for j, page in enumerate(np.asarray(block_table)[: -(-seq_len // block_size)]):
        used[int(page), : min(block_size, seq_len - j * block_size)] = True
    garbage = [tuple(np.where(used[:, :, None, None], x, np.float32(fill)).astype(np.float32) for x in (kc, vc))
               for fill in (np.inf, 1e30)]
    case = f"seq_len {seq_len} in pages of {block_size} (pages {list(map(int, np.asarray(block_table)))})"

    def run(place):
        (o, lse), seconds = place.launch(paged_decode_gpu, (qk, kc, vc, tables, lens), timed=TIMED_PAGED)
        o, lse = place.host(o), place.host(lse)
        same = [np.array_equal(place.host(place.kernel(paged_decode_gpu)(qk, kg, vg, tables, lens)[0]), o)
                for kg, vg in garbage]
        return [place.check(case, (o[0, 0], lse[0, 0]), ref, seconds=seconds)], {"garbage_identical": all(same)}

    def report(r):
        if "garbage_identical" not in r.details:
            return []
        held = "NaN" if np.isnan(kc[~used]).all() else "other values"
        return [f"  Unused slots (they held {held}) refilled with +inf, then 1e30: the {r.checks[0].where} output is "
                f"bit for bit the same: {r.details['garbage_identical']} (nothing past seq_len is read)."]

    return _run("07_paged_attention", f"paged decode kernel (lessons/gpu/kernels/paged_decode.cu), one sequence, "
                f"one head, block_size={block_size}", [paged_decode_build(d, block_size, 1, 1, "float32")], run,
                report, entries=("paged_decode",), details={"used_slots": int(used.sum())},
                use_device=use_device, emulate=emulate)


def flash_decoding_on_gpu(q=None, k=None, v=None, num_splits: int = 6, *, block_size: int = 16,
                          use_device=None, emulate=None) -> GpuLesson:
    """Notebook 08: the split-KV flash-decoding kernel and its merge kernel.

    ``q`` (d,) one decode query, ``k``, ``v`` (Nk, d) (all None: :func:`lessons.course.data.decode_query_case`);
    ``num_splits``: workers (thread blocks) per (sequence, head); ``block_size``: the page size of the
    shuffled cache. The kernel splits by pages (:func:`lessons.schedules.split_kv.split_ranges`); each
    split's partial state ``(m, l, o)`` is checked against :func:`lessons.attention` over its keys (``o / l``,
    ``m + log l``; an empty split must have ``l = 0``), the merged output against :func:`lessons.attention`
    and :func:`lessons.flash_decoding`. ``details["splits"]``: per split, pages, keys, kernel and NumPy lse.
    ValueError when only some of q, k, v are given, for ``q`` not 1-D, ``k`` or ``v`` not 2-D, a d that is
    not k's, or a ``v`` shaped unlike ``k``; TypeError for a non-float array or a non-int ``num_splits``/
    ``block_size``. Source: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding).
    """
    if _data("q, k, v", (q, k, v), lambda: None) is not None:
        q, k, v = as_float_array(q, "q", (1,)), as_float_array(k, "k", (2,)), as_float_array(v, "v", (2,))
        if q.shape[0] != k.shape[1] or v.shape != k.shape:
            raise ValueError(f"q (d,), k (Nk, d) and v (Nk, d) must agree, got shapes {q.shape}, {k.shape}, {v.shape}")
    q, k, v = _f32(*(decode_query_case() if q is None else (q, k, v)))
    num_splits, block_size = check_positive_int(num_splits, "num_splits"), check_positive_int(block_size, "block_size")
    nk, d = k.shape
    k_cache, v_cache, tables, lens = write_paged_batch([k[:, None, :]], [v[:, None, :]], block_size, seed=0)
    inputs = (np.ascontiguousarray(q.reshape(1, 1, d)), *_f32(k_cache, v_cache), tables.astype(np.int32),
              lens.astype(np.int32), num_splits)
    ref = attention(*_f64(q, k, v), return_lse=True)
    n_pages = -(-nk // block_size)
    splits = split_ranges(n_pages, num_splits)

    def partial_checks(parts):
        m, l, o = (np.asarray(parts[x], dtype=np.float64)[0, 0] for x in ("m", "l", "o"))
        rows = []
        for s, (p0, p1) in enumerate(splits):
            a, b = p0 * block_size, min(p1 * block_size, nk)
            got_lse = m[s] + np.log(l[s]) if l[s] > 0 else -np.inf
            r_lse, ok = -np.inf, l[s] == 0
            if b > a:
                r_o, r_lse = attention(*_f64(q, k[a:b], v[a:b]), return_lse=True)
                ok = (l[s] > 0 and np.allclose(o[s] / l[s], r_o, **TOLERANCE)
                      and abs(got_lse - r_lse) <= TOLERANCE["atol"] + TOLERANCE["rtol"] * abs(r_lse))
            rows.append({"split": s, "pages": (p0, p1), "keys": (a, max(a, b)), "lse": float(got_lse),
                         "numpy_lse": float(r_lse), "agrees": bool(ok)})
        return rows

    def run(place):
        (o, lse, parts), seconds = place.launch(flash_decoding_gpu, inputs, return_partials=True, timed=TIMED_PAGED)
        return [place.check(f"{nk} keys in {n_pages} pages of {block_size}, num_splits={num_splits}",
                            (place.host(o)[0, 0], place.host(lse)[0, 0]), ref, seconds=seconds)], \
            {"splits": partial_checks({x: place.host(y) for x, y in parts.items()})}

    def span(a, b):
        return f"{a}-{b - 1}" if b > a else "none"

    def report(r):
        if "splits" not in r.details:
            return []
        where, per = r.checks[0].where, -(-n_pages // num_splits)
        diff = float(np.abs(r.checks[0].output - flash_decoding(*_f64(q, k, v), num_splits, tile=block_size)).max())
        r.details["numpy_flash_decoding_difference"] = diff
        return [_table(f"The partial states, one per split (the kernel splits by pages: per = ceil({n_pages} / "
                       f"{num_splits}) = {per}), beside attention over the same keys:",
                       [f"{'split':>5} {'pages':>7} {'keys':>9} {'lse ' + where:>14} {'lse NumPy':>10}  agrees",
                        *(f"{s['split']:>5} {span(*s['pages']):>7} {span(*s['keys']):>9} {s['lse']:>14.7g} "
                          f"{s['numpy_lse']:>10.7g}  {s['agrees']}" for s in r.details["splits"])]),
                f"  The merged output differs from lessons.flash_decoding (NumPy, {num_splits} splits by keys) by "
                f"{diff:.1e}."]

    return _run("08_flash_decoding_and_ring", f"flash-decoding kernels (paged_decode_split + merge_splits), "
                f"num_splits={num_splits}", [paged_decode_build(d, block_size, 1, 1, "float32")], run, report,
                entries=("paged_decode_split", "merge_splits"), details={"split_pages": splits},
                use_device=use_device, emulate=emulate)


def paged_gqa_on_gpu(q=None, k_cache=None, v_cache=None, block_tables=None, seq_lens=None, *,
                     use_device=None, emulate=None) -> GpuLesson:
    """Notebook 09: the paged decode kernel with grouped-query heads, on a batch.

    Notebook 09's data (all None: :func:`lessons.course.data.gqa_batch_case`, 4 sequences of 1, 15, 16 and
    37 tokens, 8 query heads on 2 KV heads, d = 64, pages of 16, NaN in the unused slots): ``q`` (num_seqs,
    num_heads, d); ``k_cache``, ``v_cache`` (num_blocks, block_size, num_kv_heads, d); ``block_tables`` int
    (num_seqs, max_blocks_per_seq), -1 = padding; ``seq_lens`` int (num_seqs,). Checked against
    :func:`lessons.paged_decode`. ``details["heads_per_block"]``: the query heads of one group a thread
    block serves (each page it loads is used that many times). ValueError when only some data arguments
    are given; else what :func:`lessons.paged_decode` raises.
    Source: Kwon et al. 2023, Sec. 4; Ainslie et al. 2023 (GQA), Sec. 2; Dao 2023, Alg. 1.
    """
    q, k_cache, v_cache, block_tables, seq_lens = _data("q, k_cache, v_cache, block_tables, seq_lens",
                                                        (q, k_cache, v_cache, block_tables, seq_lens), gqa_batch_case)
    named = ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))
    q32, kc, vc = _f32(*(as_float_array(x, name) for x, name in named))        # never cast silently
    tables, lens = (np.ascontiguousarray(np.asarray(x), dtype=np.int32) for x in (block_tables, seq_lens))
    ref = paged_decode(*_f64(q32, kc, vc), block_tables, seq_lens, return_lse=True)
    (num_seqs, num_heads, d), (block_size, num_kv_heads) = q32.shape, kc.shape[1:3]
    build = paged_decode_build(d, block_size, num_heads, num_kv_heads, "float32")
    hpb, group = dict(build.defines)["HEADS_PER_BLOCK"], num_heads // num_kv_heads
    case = (f"{num_seqs} sequences (lengths {lens.tolist()}), {num_heads} heads on {num_kv_heads} KV heads, "
            f"d={d}, pages of {block_size}")

    return _run("09_paged_gqa_decode", f"paged GQA decode kernel (lessons/gpu/kernels/paged_decode.cu), "
                f"HEADS_PER_BLOCK={hpb}", [build],
                lambda place: ([place.verify(case, paged_decode_gpu, (q32, kc, vc, tables, lens), ref,
                                             timed=TIMED_PAGED)], {}),
                [f"  Grid: {num_heads // hpb} x {num_seqs} thread blocks; each serves {hpb} query heads of one group "
                 f"of {group}, so every page of a KV head it loads is used {hpb} times."],
                entries=("paged_decode",), details={"heads_per_block": hpb, "group": group},
                use_device=use_device, emulate=emulate)

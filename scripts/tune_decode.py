"""Time the split decode kernel at split counts around its automatic pick: the decode split sweep.

    python scripts/tune_decode.py [--out DIR] [--shapes 64x4096 8x32768 1x131072] [--repeats 3]
                                  [--target-seconds 0.05] [--copy-mib 2048] [--time-budget 40]
    python scripts/tune_decode.py --emulator [--out DIR] [--shapes 2x64]
    python scripts/tune_decode.py --prefetch ...   (the same sweep for the prefetch build)
    python scripts/tune_decode.py --cp-async ...   (the same sweep for the cp.async build)

For each shape (``SEQSxTOKENS``: sequences x tokens, every sequence full length)
:func:`lessons.gpu.paged_decode_split_gpu` runs with ``num_splits=None`` (the launcher's own pick,
:func:`lessons.gpu.source.decode_splits`; the count it picked is read back from its partial states) and with
each other count of :func:`split_counts`. On a GPU:
fp16, 32 query heads on 8 KV heads, d = 128, pages of 16, on the decode benchmark's shapes 64 x 4096,
8 x 32768 and 1 x 131072, with ``benchmarks/gpu_decode.py``'s cache (pages scattered at random), bytes
(:func:`gpu_decode.kv_bytes`), copy rate and timing (:func:`gpu_decode.kernel_seconds`: CUDA events around a
batch of back-to-back launches, median of ``--repeats``; one launch between two events, as
:func:`lessons.gpu.measure.median_cuda_seconds` times, would add Python's launch overhead to a 0.2 ms kernel),
so its rows read like that benchmark's. Per row:
seconds, TB/s of K/V read, % of the device copy rate, ``x_auto`` (the automatic pick's seconds over the
row's: above 1 is faster than the pick) and the largest difference from the automatic pick's output.
Only the split count is swept: the kernel's other knobs (heads per block, keys per step) are fixed by its
build and source. ``--prefetch`` sweeps the ``paged_decode_prefetch`` rung instead (``prefetch=True``: each lane
group's next K/V rows loaded while it absorbs the current ones, 3 blocks per SM, so its automatic pick fills a
wave of 3 blocks per SM) and writes ``decode_splits_prefetch.csv`` / ``.md``; ``--cp-async`` sweeps the
``paged_decode_cp_async`` rung (``cp_async=True``: K/V rows copied into a ring of shared memory with cp.async, two
steps ahead, 4 blocks per SM as the plain build, so its automatic pick is the plain build's) and writes
``decode_splits_cp_async.csv`` / ``.md``. At most one of the two (an argparse error otherwise). The builds and
their launcher keywords: :data:`BUILDS`.

Writes ``decode_splits.csv`` and ``decode_splits.md`` (its last line names the fastest count per shape) into
``--out``, after each shape, so a run cut short keeps what it measured; a count that would start after
``--time-budget`` seconds is skipped (noted). Without a CUDA device it says so and exits 0; so it does, writing
nothing, when the rung swept (``paged_decode_split``, ``paged_decode_prefetch`` with ``--prefetch``,
``paged_decode_cp_async`` with ``--cp-async``) is named in
``$GPU_CHECK_LEFT_OUT`` (:func:`lessons.gpu.ladder.rungs_left_out`: its first run on this machine failed,
``scripts/first_run.py``). ``--emulator``
runs a tiny shape (default 2 x 64, 4 query heads on 2 KV heads, d = 128, pages of 16) at each of its split
counts once on the CPU emulator, untimed, and compares each output with NumPy's :func:`lessons.paged_decode`.
Exit status 0, or 1 when a launch failed, an output was not finite, the launcher picked another count than
:func:`auto_splits` or (on the emulator) an output differs from NumPy.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lessons  # noqa: E402
import lessons.gpu as gpu  # noqa: E402
from lessons.core.checks import check_int  # noqa: E402
from lessons.gpu.ladder import DECODE_LAUNCH_OPTIONS, LEFT_OUT_REASON, rungs_left_out  # noqa: E402
from lessons.gpu.source import (H200_NUM_SMS, cheaper_than_pick, decode_split_sweep,  # noqa: E402
                                paged_decode_split_auto_splits, paged_decode_split_blocks_per_sm)

import gpu_decode  # noqa: E402  (benchmarks/gpu_decode.py: the decode benchmark's cache, bytes and timing)

#: the columns of the CSV
COLUMNS = ("shape", "num_seqs", "seq_len", "num_splits", "auto", "seconds", "tb_per_s", "pct_of_copy", "x_auto",
           "max_abs_diff", "note")
#: split counts tried at every shape where they are within :data:`SPAN` of the automatic pick
ABSOLUTE_SPLITS = (1, 2, 4, 8, 16, 32, 64, 132, 264)
SPAN = 16
#: the most splits the launcher takes (a grid's z extent)
MAX_SPLITS = 65535
#: the most sequences it takes (a grid's y extent, the same limit)
MAX_SEQS = MAX_SPLITS
#: fp16 output against NumPy in float64: a few units in the last place of values of magnitude about 1
EMULATOR_TOLERANCE = 3e-3
STEM = "decode_splits"


class Build(NamedTuple):
    """One build of the split decode kernel a sweep can time: the suffix of its results' file stem and what its
    title calls it."""

    suffix: str
    title: str


#: the decode rung each sweep times -> its :class:`Build`; the launcher keywords of each come from
#: :data:`lessons.gpu.ladder.DECODE_LAUNCH_OPTIONS` (:func:`launch_options`)
BUILDS = {
    "paged_decode_split": Build("", "split decode kernel"),
    "paged_decode_prefetch": Build("_prefetch", "split decode kernel's prefetch build"),
    "paged_decode_cp_async": Build("_cp_async", "split decode kernel's cp.async build"),
}
#: the rung swept without ``--prefetch`` or ``--cp-async``
DEFAULT_RUNG = "paged_decode_split"


class Geometry(NamedTuple):
    """Heads, head dim and page size of one sweep; fp16 throughout."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


GPU_GEOMETRY = Geometry(gpu_decode.NUM_HEADS, gpu_decode.NUM_KV_HEADS, gpu_decode.HEAD_DIM, gpu_decode.BLOCK_SIZE)
EMULATOR_GEOMETRY = Geometry(4, 2, 128, 16)
GPU_SHAPES = gpu_decode.SHAPES
#: the largest K/V cache a shape of --shapes may need: 256 GiB, more than a GPU of this course holds (an H200: 141 GB)
MAX_KV_BYTES = 1 << 38
EMULATOR_SHAPES = ((2, 64),)


def parse_shape(text: str) -> tuple[int, int]:
    """``"64x4096"`` -> ``(64, 4096)`` (sequences, tokens each); an ArgumentTypeError naming ``text``
    for anything else, or a count below 1."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or min(int(p) for p in parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not SEQSxTOKENS with both at least 1 (e.g. 64x4096)")
    return int(parts[0]), int(parts[1])


def _build(rung: str) -> Build:
    """The :class:`Build` of ``rung`` (a key of :data:`BUILDS`); ValueError naming ``rung`` otherwise."""
    if rung not in BUILDS:
        raise ValueError(f"rung must be one of {list(BUILDS)}, got {rung!r}")
    return BUILDS[rung]


def launch_options(rung: str = DEFAULT_RUNG) -> dict:
    """The keywords ``paged_decode_split_gpu`` and ``paged_decode_split_auto_splits`` take for ``rung``'s build:
    ``{}``, ``{"prefetch": True}`` or ``{"cp_async": True}`` (:data:`lessons.gpu.ladder.DECODE_LAUNCH_OPTIONS`);
    ValueError naming ``rung`` when it is not a key of :data:`BUILDS`."""
    _build(rung)
    return dict(DECODE_LAUNCH_OPTIONS.get(rung, {}))


def build_name(rung: str = DEFAULT_RUNG) -> str:
    """What a sweep's title calls the kernel it times: ``split decode kernel`` and its prefetch or cp.async
    build."""
    return _build(rung).title


def shape_name(num_seqs: int, seq_len: int) -> str:
    return f"{num_seqs}x{seq_len}"


def auto_splits(num_seqs: int, seq_len: int, geometry: Geometry, num_sms: int, rung: str = DEFAULT_RUNG) -> int:
    """The split count ``paged_decode_split_gpu(..., num_splits=None, **launch_options(rung))`` picks for full
    sequences of ``seq_len`` tokens: :func:`lessons.gpu.source.paged_decode_split_auto_splits`, the function the
    launcher asks, for the table's ``ceil(seq_len / block_size)`` pages, ``num_sms`` SMs (the launcher uses the
    H200's 132 SMs on the emulator) and the blocks per SM of ``rung``'s build (a key of :data:`BUILDS`)."""
    g = geometry
    pages = -(-seq_len // g.block_size)
    return paged_decode_split_auto_splits(num_seqs, pages * g.block_size, g.head_dim, g.block_size, g.num_heads,
                                          g.num_kv_heads, num_sms=num_sms, **launch_options(rung))


def split_counts(auto: int, pages: int, model: tuple[int, ...] = ()) -> list[int]:
    """The split counts swept at one shape, ascending, each once: the automatic pick ``auto``; its
    neighbours ``auto - 1`` and ``auto + 1`` (the pick is the most splits whose blocks fit in one wave: is one
    more, which spills into a second wave, slower on the GPU as the wave model says?);
    ``auto // 4``, ``auto // 2``, ``2 auto``, ``4 auto``; each of :data:`ABSOLUTE_SPLITS` from
    ``auto / SPAN`` to ``auto * SPAN``; and the counts in ``model`` (:func:`model_counts`: those the wave model
    finds faster than the pick, over several waves). Only counts in ``1..min(pages, MAX_SPLITS)`` are kept (a
    split of no page does nothing). On an H200 (32 query heads on 8 KV heads, pages of 16): 64 x 4096
    (auto 1) -> 1 2 4 8 16; 8 x 32768 (auto 8) -> 1 2 4 7 8 9 16 32 33 41 64; 1 x 131072 (auto 66) ->
    8 16 32 33 64 65 66 67 132 264. (At 8 x 32768, 33 and 41 come from the model.) TypeError/ValueError naming
    ``auto``, ``pages`` or ``model`` for a count that is not an int of at least 1."""
    auto = check_int(auto, "auto", min=1)
    pages = check_int(pages, "pages", min=1)
    if not isinstance(model, (tuple, list)):
        raise TypeError(f"model must be a tuple of split counts, got {type(model).__name__} {model!r}")
    model = [check_int(s, f"model[{i}]", min=1) for i, s in enumerate(model)]
    near = {auto, auto - 1, auto + 1, auto // 4, auto // 2, 2 * auto, 4 * auto}
    wide = {s for s in ABSOLUTE_SPLITS if auto <= s * SPAN and s <= auto * SPAN}
    return sorted(s for s in near | wide | set(model) if 1 <= s <= min(pages, MAX_SPLITS))


def model_counts(num_seqs: int, seq_len: int, auto: int, geometry: Geometry, num_sms: int,
                 rung: str = DEFAULT_RUNG) -> tuple[int, ...]:
    """The split counts up to ``auto * SPAN`` that the wave model (:func:`lessons.gpu.source.decode_split_cost`)
    finds faster than the automatic pick ``auto`` (:func:`auto_splits` of the same shape, build and SMs): the
    fewest such count and the fastest (fewest on a tie), or ``()`` when none is. They take several waves, which the pick never does (more partial states to merge, and
    blocks that do not finish in step); timing them tests the model. On an H200, 8 x 32768 tokens: (33, 41)
    (4 waves x 63 pages and 5 x 50, against the pick's 1 x 256); 64 x 4096 and 1 x 131072: ()."""
    g = geometry
    pages = -(-seq_len // g.block_size)
    sweep = decode_split_sweep(num_seqs, seq_len, num_heads=g.num_heads, num_kv_heads=g.num_kv_heads,
                               head_dim=g.head_dim, block_size=g.block_size, num_sms=num_sms,
                               blocks_per_sm=paged_decode_split_blocks_per_sm(**launch_options(rung)),
                               max_splits=min(pages, auto * SPAN, MAX_SPLITS))
    cheaper = cheaper_than_pick(sweep)                 # (the sweep's pick is auto: the same rule, wave and shape)
    return tuple(sorted({cheaper[0], sweep["best"]})) if cheaper else ()


def plan(shapes, geometry: Geometry, num_sms: int, rung: str = DEFAULT_RUNG) -> list[tuple[int, int, int, list[int]]]:
    """``(num_seqs, seq_len, auto, split counts)`` per shape, in the order given (``auto``: the automatic pick of
    ``rung``'s build)."""
    out = []
    for num_seqs, seq_len in shapes:
        auto = auto_splits(num_seqs, seq_len, geometry, num_sms, rung)
        model = model_counts(num_seqs, seq_len, auto, geometry, num_sms, rung)
        out.append((num_seqs, seq_len, auto, split_counts(auto, -(-seq_len // geometry.block_size), model)))
    return out


def new_row(num_seqs: int, seq_len: int, num_splits: int, auto: bool) -> dict:
    """A row of :data:`COLUMNS` with nothing measured yet."""
    return dict(shape=shape_name(num_seqs, seq_len), num_seqs=num_seqs, seq_len=seq_len, num_splits=num_splits,
                auto=auto, seconds=None, tb_per_s=None, pct_of_copy=None, x_auto=None, max_abs_diff=None, note="")


def add_note(row: dict, note: str) -> None:
    row["note"] = f"{row['note']}; {note}" if row["note"] else note


def add_ratios(rows) -> list[dict]:
    """``x_auto`` of each row: its shape's automatic row's seconds over the row's (above 1: faster than
    the pick); None where either was not timed. Returns ``rows``."""
    auto = {r["shape"]: r["seconds"] for r in rows if r["auto"]}
    for r in rows:
        base = auto.get(r["shape"])
        r["x_auto"] = base / r["seconds"] if base and r["seconds"] else None
    return rows


def best_splits(rows) -> dict[str, dict]:
    """The fastest timed row of each shape (on a tie the fewer splits), by shape name, in row order."""
    best = {}
    for r in rows:
        if r["seconds"] is not None:
            old = best.get(r["shape"])
            if old is None or (r["seconds"], r["num_splits"]) < (old["seconds"], old["num_splits"]):
                best[r["shape"]] = r
    return best


def best_line(rows) -> str:
    """``fastest: 64x4096 s=1 (auto), 8x32768 s=16 (1.04x auto)``, or that nothing was timed."""
    best = best_splits(rows)
    if not best:
        return "fastest: nothing was timed"
    return "fastest: " + ", ".join(
        f"{shape} s={r['num_splits']} " + ("(auto)" if r["auto"] else f"({r['x_auto']:.2f}x auto)"
                                           if r["x_auto"] else "(auto not timed)")
        for shape, r in best.items())


def _cell(value, fmt="{}"):
    return "-" if value is None else fmt.format(value)


def markdown(rows, title: str) -> str:
    """The rows as a Markdown table under ``title``, then the line of :func:`best_line`."""
    lines = [f"# {title}", "",
             "| shape | splits | auto | time (ms) | TB/s | % of copy rate | x auto | max abs diff vs auto | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['num_splits']} | {'auto' if r['auto'] else ''} | "
                     f"{_cell(r['seconds'] and r['seconds'] * 1e3, '{:.3f}')} | {_cell(r['tb_per_s'], '{:.2f}')} | "
                     f"{_cell(r['pct_of_copy'], '{:.0f}%')} | {_cell(r['x_auto'], '{:.3f}')} | "
                     f"{_cell(r['max_abs_diff'], '{:.1e}')} | {r['note']} |")
    return "\n".join(lines + ["", best_line(rows)]) + "\n"


def stem(rung: str = DEFAULT_RUNG) -> str:
    """The results' file stem of ``rung``'s sweep: ``decode_splits``, ``decode_splits_prefetch`` for the prefetch
    build, ``decode_splits_cp_async`` for the cp.async build."""
    return STEM + _build(rung).suffix


def write_results(rows, out: Path, title: str, rung: str = DEFAULT_RUNG) -> None:
    """``decode_splits.csv`` (:data:`COLUMNS`) and ``decode_splits.md`` (:func:`markdown`) in ``out``
    (``decode_splits_prefetch.*`` or ``decode_splits_cp_async.*`` for those builds: :func:`stem`)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem(rung)}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    (out / f"{stem(rung)}.md").write_text(markdown(rows, title))


def _launch(inputs, num_splits, backend: str, rung: str = DEFAULT_RUNG, **kwargs):
    """One ``paged_decode_split_gpu`` call of ``rung``'s build on ``inputs`` (q, k_cache, v_cache, block_tables,
    seq_lens)."""
    return gpu.paged_decode_split_gpu(*inputs, num_splits, check_tables=False, backend=backend,
                                      **launch_options(rung), **kwargs)


def picked_splits(inputs, backend: str, rung: str = DEFAULT_RUNG) -> int:
    """The split count the launcher picks itself on ``inputs``: the last axis of its partial states."""
    return int(_launch(inputs, None, backend, rung=rung, return_partials=True)[2]["m"].shape[-1])


def sweep_shape(inputs, num_seqs: int, seq_len: int, auto: int, counts, backend: str, measure=None,
                check=None, progress=None, budget_spent=lambda: False,
                rung: str = DEFAULT_RUNG) -> tuple[list[dict], bool]:
    """The rows of one shape (ascending split count) and whether all went well. The automatic pick runs
    first (``num_splits=None``; its row holds the count the launcher picked, with a note and ``ok`` False
    when that is not ``auto``); each row's output is compared with its. ``measure(row, fn)`` times
    ``fn`` into the row (None: untimed); ``check(row, out)``: False when the float64 output ``out``
    (num_seqs, num_heads, d) is wrong; ``progress(label)`` before each run; once ``budget_spent()``
    the remaining counts are not run (noted). ``rung``: the build run (a key of :data:`BUILDS`)."""
    rows, ok, auto_out = [], True, None
    for s in [auto] + [s for s in counts if s != auto]:
        row = new_row(num_seqs, seq_len, s, s == auto)
        if progress is not None:
            progress(f"{row['shape']} s={s}" + (" (auto)" if row["auto"] else ""))
        if budget_spent():
            add_note(row, "skipped: time budget spent")
            rows.append(row)
            continue
        fn = (lambda: _launch(inputs, None, backend, rung=rung)) if row["auto"] else (
            lambda s=s: _launch(inputs, s, backend, rung=rung))
        try:
            picked = picked_splits(inputs, backend, rung) if row["auto"] else s
            if picked != s:
                row["num_splits"] = picked
                add_note(row, f"the launcher picked {picked} splits, auto_splits {auto}")
                ok = False
            first = fn()[0]
            out = np.asarray(first.get() if hasattr(first, "get") else first, np.float64)
            if measure is not None:
                measure(row, fn)
        except Exception as err:        # a launch that fails: a note, and the other counts still run
            add_note(row, f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
            rows.append(row)
            ok = False
            continue
        if row["auto"]:
            auto_out = out
        if auto_out is not None:
            row["max_abs_diff"] = float(np.abs(out - auto_out).max())
        if not np.isfinite(out).all():
            add_note(row, "output not finite")
            ok = False
        if check is not None and not check(row, out):
            ok = False
        rows.append(row)
    return sorted(rows, key=lambda r: r["num_splits"]), ok


def host_inputs(num_seqs: int, seq_len: int, geometry: Geometry, seed: int = 0):
    """``(q, k_cache, v_cache, block_tables, seq_lens)`` as NumPy arrays: fp16 standard normal, each sequence's
    ``ceil(seq_len / block_size)`` pages scattered at random over a cache with 3 pages to spare."""
    g, rng = geometry, np.random.default_rng(seed)
    pages = -(-seq_len // g.block_size)
    num_blocks = num_seqs * pages + 3
    k_cache, v_cache = (rng.standard_normal((num_blocks, g.block_size, g.num_kv_heads, g.head_dim))
                        .astype(np.float16) for _ in range(2))
    q = rng.standard_normal((num_seqs, g.num_heads, g.head_dim)).astype(np.float16)
    tables = rng.permutation(num_blocks)[:num_seqs * pages].reshape(num_seqs, pages).astype(np.int32)
    return q, k_cache, v_cache, tables, np.full((num_seqs,), seq_len, np.int32)


def run_emulator(args) -> tuple[list[dict], bool]:
    """Every split count of each shape once on the CPU emulator, each output against NumPy's paged decode
    (float64; at most :data:`EMULATOR_TOLERANCE` apart)."""
    rows, ok = [], True
    for num_seqs, seq_len, auto, counts in plan(args.shapes, EMULATOR_GEOMETRY, H200_NUM_SMS, args.rung):
        inputs = host_inputs(num_seqs, seq_len, EMULATOR_GEOMETRY)
        reference = lessons.paged_decode(*(x.astype(np.float64) for x in inputs[:3]), *inputs[3:])

        def check(row, out, reference=reference):
            err = float(np.abs(out - reference).max())
            add_note(row, f"emulator: not timed; max abs diff from NumPy {err:.1e}")
            return err <= EMULATOR_TOLERANCE

        shape_rows, shape_ok = sweep_shape(inputs, num_seqs, seq_len, auto, counts, "emulator", check=check,
                                           rung=args.rung)
        rows += shape_rows
        ok = ok and shape_ok
    return rows, ok


def device_sms(cupy) -> int:
    """Streaming multiprocessors of the current CUDA device."""
    return int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])


def run_gpu(args, sms: int, progress=None) -> tuple[list[dict], bool]:
    """The sweep on the CUDA device (``sms`` SMs), written to ``args.out`` after each shape."""
    import cupy

    copy_bps = gpu_decode.device_copy_rate(cupy, args.copy_mib, args.repeats)
    title = (f"The {build_name(args.rung)} at split counts around its pick, on {gpu.device_name()} ({sms} SMs): fp16, "
             f"{GPU_GEOMETRY.num_heads} query heads on {GPU_GEOMETRY.num_kv_heads} KV heads, "
             f"d = {GPU_GEOMETRY.head_dim}, pages of {GPU_GEOMETRY.block_size}; device copy rate (read + write) "
             f"{copy_bps / 1e12:.2f} TB/s")
    k_cache, v_cache = gpu_decode.random_caches(cupy, args.shapes)
    host_rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    rows, ok = [], True
    for num_seqs, seq_len, auto, counts in plan(args.shapes, GPU_GEOMETRY, sms, args.rung):
        q, tables, lens = gpu_decode.shape_inputs(cupy, host_rng, k_cache.shape[0], num_seqs, seq_len)
        nbytes = gpu_decode.kv_bytes(num_seqs, seq_len)

        def measure(row, fn, nbytes=nbytes):
            row["seconds"] = gpu_decode.kernel_seconds(cupy, fn, args.target_seconds, args.repeats)
            row["tb_per_s"] = nbytes / row["seconds"] / 1e12
            row["pct_of_copy"] = gpu_decode.pct_of_copy(nbytes, row["seconds"], copy_bps)

        shape_rows, shape_ok = sweep_shape((q, k_cache, v_cache, tables, lens), num_seqs, seq_len, auto, counts,
                                           "cupy", measure=measure, progress=progress,
                                           budget_spent=lambda: time.perf_counter() - t0 > args.time_budget,
                                           rung=args.rung)
        rows += add_ratios(shape_rows)
        ok = ok and shape_ok
        write_results(rows, args.out, title, args.rung)
        del q, tables, lens
        cupy.get_default_memory_pool().free_all_blocks()
    return rows, ok


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / STEM, help="folder of the results")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=None, metavar="SEQSxTOKENS",
                   help="default 64x4096 8x32768 1x131072 (2x64 with --emulator)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-seconds", type=float, default=0.05,
                   help="about this long per timed batch of calls (calls = target / one call's time, 1..50)")
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--time-budget", type=float, default=40.0,
                   help="seconds after which the counts not yet timed are skipped")
    p.add_argument("--emulator", action="store_true", help="run each count once on the CPU emulator")
    builds = p.add_mutually_exclusive_group()          # args.rung: the rung swept, a key of BUILDS
    builds.add_argument("--prefetch", dest="rung", action="store_const", const="paged_decode_prefetch",
                        default=DEFAULT_RUNG,
                        help="sweep the prefetch build (paged_decode_prefetch) instead of the plain split kernel")
    builds.add_argument("--cp-async", dest="rung", action="store_const", const="paged_decode_cp_async",
                        default=DEFAULT_RUNG,
                        help="sweep the cp.async build (paged_decode_cp_async) instead of the plain split kernel")
    args = p.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out must be a folder (it is made if missing), but {args.out} is a file")
    for name in ("repeats", "copy_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.target_seconds > 0 or not args.time_budget >= 0:
        p.error(f"--target-seconds must be above 0 and --time-budget at least 0, got {args.target_seconds} "
                f"and {args.time_budget}")
    args.shapes = list(dict.fromkeys(args.shapes or (EMULATOR_SHAPES if args.emulator else GPU_SHAPES)))
    g = EMULATOR_GEOMETRY if args.emulator else GPU_GEOMETRY
    for num_seqs, seq_len in args.shapes:
        if num_seqs > MAX_SEQS:
            p.error(f"--shapes {shape_name(num_seqs, seq_len)}: at most {MAX_SEQS} sequences (a grid's y extent), "
                    f"got {num_seqs}")
        nbytes = gpu_decode.kv_bytes(num_seqs, seq_len, g.num_kv_heads, g.head_dim)
        if nbytes > MAX_KV_BYTES:
            p.error(f"--shapes {shape_name(num_seqs, seq_len)}: its K/V cache is {nbytes / 2**30:,.0f} GiB "
                    f"({g.num_kv_heads} KV heads, d = {g.head_dim}, fp16); at most {MAX_KV_BYTES // 2**30} GiB")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.emulator:
        rows, ok = run_emulator(args)
        g = EMULATOR_GEOMETRY
        write_results(rows, args.out, f"The {build_name(args.rung)} at split counts around its pick, on the CPU "
                                      f"emulator (not timed): fp16, {g.num_heads} query heads on {g.num_kv_heads} "
                                      f"KV heads, d = {g.head_dim}, pages of {g.block_size}", args.rung)
        print(markdown(rows, "decode split sweep (emulator)"))
        counted = f"{len(rows)} split count" + ("" if len(rows) == 1 else "s")
        print(f"{counted}: " + ("all match NumPy" if ok else "NOT ALL MATCH NumPy (see the note column)")
              + f"; results in {args.out}")
        return 0 if ok else 1
    if args.rung in rungs_left_out():
        print(f"decode split sweep not run: the {args.rung} rung {LEFT_OUT_REASON} (it is in "
              f"GPU_CHECK_LEFT_OUT); nothing written")
        return 0
    if not gpu.device_available():
        print("decode split sweep not run: no CUDA device (CuPy sees none). Run this script with --emulator to "
              "check it on the CPU")
        return 0
    import cupy

    from lessons.gpu.measure import progress_steps

    sms = device_sms(cupy)
    total = sum(len(counts) for *_, counts in plan(args.shapes, GPU_GEOMETRY, sms, args.rung))
    with progress_steps(total, "split counts") as step:
        rows, ok = run_gpu(args, sms, step)
    print(markdown(rows, "decode split sweep"))
    print(best_line(rows) + ("" if ok else "; SOME RUNS FAILED (see the note column)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

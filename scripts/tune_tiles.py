"""Time every tile configuration of one forward rung on the GPU: the tuning sweep.

    python scripts/tune_tiles.py [--rung mma_fa2_lazy|mma_fa2_wide|mma_fa2_lean|regtile|regtile_wide] [--out DIR] [--n 8192]
                                 [--heads 8] [--head-dims 64 128] [--warmup 2] [--repeats 7]
    python scripts/tune_tiles.py --emulator [--rung ...] [--out DIR]

``--rung mma_fa2_lazy`` (the default): each ``(block_q, block_k, min_blocks)`` of
:func:`lessons.gpu.source.flash_attention_mma_fa2_lazy_configs` (default one first:
:data:`lessons.gpu.source.FA2_LAZY_CONFIGS`) through :func:`lessons.gpu.flash_attention_mma_fa2_lazy_gpu`,
float16; the reference row is the FA-2 rung (``flash_attention_mma_fa2_gpu``, its fixed tiles).
``--rung mma_fa2_wide``: the same for the wide-warp rung (32 query rows per warp), each configuration of
:func:`lessons.gpu.source.flash_attention_mma_fa2_wide_configs` through
:func:`lessons.gpu.flash_attention_mma_fa2_wide_gpu`, beside the FA-2 rung.
``--rung mma_fa2_lean``: the same for the lean rung (the wide-warp rung whose key tiles that need no mask run in a
loop without mask code, V's inf/NaN test in a pre-pass kernel, timed with it), each configuration of
:func:`lessons.gpu.source.flash_attention_mma_fa2_lean_configs` through
:func:`lessons.gpu.flash_attention_mma_fa2_lean_gpu`, beside the FA-2 rung.
``--rung regtile``: each ``(block_q, block_k)`` of :data:`lessons.gpu.source.REGTILE_SWEEP` (default one
first: :func:`lessons.gpu.source.flash_attention_regtile_config`) through
:func:`lessons.gpu.flash_attention_regtile_gpu`, float32; the reference row is naive CuPy attention in float32
(S in device memory: the rung's target is a multiple of its speed).
``--rung regtile_wide``: the same for the wide register-tiled rung (16 lanes per row group, 8 rows x 4 keys
per thread), each ``(block_q, block_k)`` of :data:`lessons.gpu.source.REGTILE_WIDE_SWEEP` (default one first:
:func:`lessons.gpu.source.flash_attention_regtile_wide_config`) through
:func:`lessons.gpu.flash_attention_regtile_wide_gpu`, beside the same naive CuPy row.

Each runs on batch 1, ``--heads`` heads, N = ``--n`` queries and keys, not causal, and reports the median of
``--repeats`` CUDA-event timings after ``--warmup`` runs (:func:`lessons.gpu.measure.median_cuda_seconds`,
as the benchmarks time), TFLOP/s (4 N^2 d per head), ``x_default`` (the default configuration's seconds over
this one's, per head dim), ``x_reference`` (the reference row's seconds over this one's), the registers per
thread (from the kernel loaded on the device) and the largest difference from the default configuration's output.

Writes ``<stem>.csv`` and ``<stem>.md`` into ``--out`` (stem ``fa2_configs``, ``fa2_wide_configs``,
``fa2_lean_configs``, ``regtile_configs`` or ``regtile_wide_configs``). Without a CUDA device it says so and exits 0. So it does, writing
nothing, for a rung named in ``$GPU_CHECK_LEFT_OUT`` (:func:`lessons.gpu.ladder.rungs_left_out`: the rung's first run
on this machine failed, ``scripts/first_run.py``); only the swept rung counts, the FA-2 sweeps' mma_fa2 reference
row is not left out. ``--emulator`` runs every configuration once at a tiny N on the CPU emulator (a check of this
script: nothing is timed, and each output is compared with NumPy's attention). Exit status 0, or 1 when an output
is not finite or (on the emulator) differs from NumPy.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lessons  # noqa: E402
import lessons.gpu as gpu  # noqa: E402
from lessons.gpu import source  # noqa: E402
from lessons.gpu.ladder import LEFT_OUT_REASON, rungs_left_out  # noqa: E402
from lessons.gpu.measure import attention_flops, median_cuda_seconds, naive_attention, progress_steps  # noqa: E402

#: the columns of the CSV
COLUMNS = ("impl", "d", "block_q", "block_k", "min_blocks", "default", "n", "heads", "dtype", "seconds", "tflops",
           "x_default", "x_reference", "registers", "max_abs_diff", "note")
LAZY, WIDE, LEAN, PLAIN, REGTILE, NAIVE = "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean", "mma_fa2", "regtile", "naive"
REGTILE_WIDE = "regtile_wide"
#: the FA-2 rungs whose tiles are swept: their defaults, their legal configurations, their build and launcher
FA2_TILED = {LAZY: (source.FA2_LAZY_CONFIGS, source.flash_attention_mma_fa2_lazy_configs,
                    gpu.flash_attention_mma_fa2_lazy_build, gpu.flash_attention_mma_fa2_lazy_gpu),
             WIDE: (source.FA2_WIDE_CONFIGS, source.flash_attention_mma_fa2_wide_configs,
                    gpu.flash_attention_mma_fa2_wide_build, gpu.flash_attention_mma_fa2_wide_gpu),
             LEAN: (source.FA2_LEAN_CONFIGS, source.flash_attention_mma_fa2_lean_configs,
                    gpu.flash_attention_mma_fa2_lean_build, gpu.flash_attention_mma_fa2_lean_gpu)}
#: the register-tiled (CUDA-core, float32) rungs whose tiles are swept: their default tiles per head dim, the tiles
#: swept per head dim, their build and launcher
REGTILE_TILED = {REGTILE: (source.flash_attention_regtile_config, source.REGTILE_SWEEP,
                           gpu.flash_attention_regtile_build, gpu.flash_attention_regtile_gpu),
                 REGTILE_WIDE: (source.flash_attention_regtile_wide_config, source.REGTILE_WIDE_SWEEP,
                                gpu.flash_attention_regtile_wide_build, gpu.flash_attention_regtile_wide_gpu)}


class Sweep(NamedTuple):
    """What one rung's sweep runs: its configurations per head dim (the default first), its reference row,
    the dtype, the output files' stem and the table's title."""

    rung: str
    reference: str
    dtype: str
    stem: str
    title: str

    def configs(self, d: int) -> list[tuple]:
        if self.rung in FA2_TILED:
            defaults, legal, _, _ = FA2_TILED[self.rung]
            return [defaults[d]] + [c for c in legal(d) if c != defaults[d]]
        config, sweep, _, _ = REGTILE_TILED[self.rung]
        default = (*config(d), None)
        return [default] + [(bq, bk, None) for bq, bk in sweep[d] if (bq, bk, None) != default]

    def reference_config(self, d: int) -> tuple:
        return gpu.flash_attention_mma_fa2_config(d) if self.reference == PLAIN else (None, None, None)


SWEEPS = {LAZY: Sweep(LAZY, PLAIN, "float16", "fa2_configs", "lazy-rescaling FA-2 rung"),
          WIDE: Sweep(WIDE, PLAIN, "float16", "fa2_wide_configs", "wide-warp FA-2 rung (32 rows per warp)"),
          LEAN: Sweep(LEAN, PLAIN, "float16", "fa2_lean_configs",
                      "lean FA-2 rung (the wide-warp rung with unmasked interior tiles)"),
          REGTILE: Sweep(REGTILE, NAIVE, "float32", "regtile_configs", "register-tiled CUDA-core rung"),
          REGTILE_WIDE: Sweep(REGTILE_WIDE, NAIVE, "float32", "regtile_wide_configs",
                              "wide register-tiled CUDA-core rung")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rung", choices=sorted(SWEEPS), default=LAZY, help="the rung whose tiles are swept")
    p.add_argument("--out", type=Path, default=None,
                   help="folder of the results (default benchmarks/results/<stem>: fa2_configs, fa2_wide_configs, "
                        "fa2_lean_configs, regtile_configs or regtile_wide_configs, after the rung)")
    p.add_argument("--n", type=int, default=None, help="queries and keys (default 8192; 80 with --emulator)")
    p.add_argument("--heads", type=int, default=None, help="heads (default 8; 1 with --emulator)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=(64, 128))
    p.add_argument("--warmup", type=int, default=2, help="untimed runs of each configuration first (default 2)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed runs of each configuration; the median is reported (default 7)")
    p.add_argument("--emulator", action="store_true", help="run once per configuration on the CPU emulator")
    args = p.parse_args(argv)
    args.n = args.n if args.n is not None else (80 if args.emulator else 8192)
    args.heads = args.heads if args.heads is not None else (1 if args.emulator else 8)
    args.out = args.out if args.out is not None else ROOT / "benchmarks" / "results" / SWEEPS[args.rung].stem
    if args.out.exists() and not args.out.is_dir():
        p.error(f"--out must be a folder (it is made if missing), but {args.out} is a file")
    args.head_dims = list(dict.fromkeys(args.head_dims))          # each once, in the order given
    for name in ("n", "heads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def runs(head_dims, rung: str = LAZY):
    """(impl, d, (block_q, block_k, min_blocks)) to run, in order: per head dim the rung's default configuration
    first (the others are compared with it), then the rest, then the reference row (min_blocks None for the
    register-tiled rungs; all None for naive CuPy)."""
    sweep = SWEEPS[rung]
    out = []
    for d in head_dims:
        out += [(sweep.rung, d, c) for c in sweep.configs(d)]
        out.append((sweep.reference, d, sweep.reference_config(d)))
    return out


def add_ratios(rows) -> list[dict]:
    """``x_default`` and ``x_reference`` of each row: the head dim's default configuration's (or reference
    row's) seconds over the row's (above 1: faster); None where either was not timed. Returns ``rows``."""
    default = {r["d"]: r["seconds"] for r in rows if r["default"]}
    reference = {r["d"]: r["seconds"] for r in rows if r["impl"] in (PLAIN, NAIVE)}
    for r in rows:
        for column, base in (("x_default", default.get(r["d"])), ("x_reference", reference.get(r["d"]))):
            r[column] = base / r["seconds"] if base and r["seconds"] else None
    return rows


def _registers(build):
    """Registers per thread of ``build``'s entry point: from the kernel loaded on the device where there is
    one, else ptxas's report for sm_90; None when nobody reports (never raises)."""
    if build is None:
        return None
    try:
        arch = gpu.device_arch() or "sm_90"
        return gpu.kernel_resources(build, arch)[build.entries[0]].registers
    except Exception:  # no NVRTC, a broken driver: the column stays empty
        return None


def _launch(impl, d, config, q, k, v, backend, xp):
    """(build or None, a callable running one forward) of one row."""
    bq, bk, mb = config
    if impl in FA2_TILED:
        _, _, build, launch = FA2_TILED[impl]
        return (build(d, "float16", False, bq, bk, mb),
                lambda: launch(q, k, v, block_q=bq, block_k=bk, min_blocks=mb, backend=backend))
    if impl == PLAIN:
        return gpu.flash_attention_mma_fa2_build(d), lambda: gpu.flash_attention_mma_fa2_gpu(q, k, v, backend=backend)
    if impl in REGTILE_TILED:
        _, _, build, launch = REGTILE_TILED[impl]
        return (build(d, "float32", False, bq, bk),
                lambda: launch(q, k, v, block_q=bq, block_k=bk, backend=backend))
    return None, lambda: (naive_attention(xp, q, k, v),)


def measure(args, progress=None) -> tuple[list[dict], bool]:
    """One row per configuration (and the reference per head dim); ``ok`` False when an output was not finite
    or, on the emulator, differed from NumPy. ``progress``: a callable given each row's label before it runs."""
    sweep = SWEEPS[args.rung]
    backend = "emulator" if args.emulator else "cupy"
    if args.emulator:
        xp = np
    else:
        import cupy as xp
    rng = np.random.default_rng(0)
    rows, ok, inputs, default_out = [], True, {}, {}
    for impl, d, config in runs(args.head_dims, args.rung):
        bq, bk, mb = config
        label = f"{impl} d={d}" + (f" {bq}x{bk}" if bq else "") + (f" min_blocks={mb}" if mb else "")
        if progress is not None:
            progress(label)
        if d not in inputs:
            host = [rng.standard_normal((args.heads, args.n, d)).astype(sweep.dtype) for _ in range(3)]
            inputs[d] = (host, [xp.asarray(x) for x in host])
        host, (q, k, v) = inputs[d]
        build, call = _launch(impl, d, config, q, k, v, backend, xp)
        row = dict(impl=impl, d=d, block_q=bq, block_k=bk, min_blocks=mb,
                   default=impl == sweep.rung and config == sweep.configs(d)[0], n=args.n, heads=args.heads,
                   dtype=sweep.dtype, seconds=None, tflops=None, x_default=None, x_reference=None,
                   registers=_registers(build), max_abs_diff=None, note="")
        try:
            first = call()[0]                          # (compiles; its output is the one compared)
            out = np.asarray(first.get() if hasattr(first, "get") else first, np.float64)
            if not args.emulator:
                row["seconds"] = median_cuda_seconds(xp, call, args.warmup, args.repeats)
                row["tflops"] = attention_flops(args.n, d, args.heads) / row["seconds"] / 1e12
            else:
                row["note"] = "emulator: not timed"
        except Exception as err:     # a launch that fails: a note, and the other configurations still run
            row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            ok = False
            rows.append(row)
            continue
        if row["default"]:
            default_out[d] = out
        row["max_abs_diff"] = float(np.abs(out - default_out[d]).max()) if d in default_out else None
        if not np.isfinite(out).all():
            row["note"] = (row["note"] + "; " if row["note"] else "") + "output not finite"
            ok = False
        if args.emulator:
            ref = np.stack([lessons.attention(*(x[h].astype(np.float64) for x in host)) for h in range(args.heads)])
            err = float(np.abs(out - ref).max())
            if err > (3e-3 if sweep.dtype == "float16" else 1e-4):       # fp16 rounding, or float32's
                row["note"] += f"; differs from NumPy by {err:.1e}"
                ok = False
        rows.append(row)
        if not args.emulator:
            xp.get_default_memory_pool().free_all_blocks()
    return add_ratios(rows), ok


def _cell(value, fmt="{}"):
    return "-" if value is None else fmt.format(value)


def table(rows, title: str):
    """A :class:`rich.table.Table` of the rows."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("rung", "d", "block_q", "block_k", "min_blocks", "median ms", "TFLOP/s", "x default", "x reference",
                "registers", "max |diff| vs default", "note"):
        t.add_column(col, justify="left" if col in ("rung", "note") else "right")
    for r in rows:
        t.add_row(r["impl"] + (" (default)" if r["default"] else ""), str(r["d"]), _cell(r["block_q"]),
                  _cell(r["block_k"]), _cell(r["min_blocks"]), _cell(r["seconds"] and r["seconds"] * 1e3, "{:.3f}"),
                  _cell(r["tflops"], "{:.1f}"), _cell(r["x_default"], "{:.3f}"), _cell(r["x_reference"], "{:.3f}"),
                  _cell(r["registers"]), _cell(r["max_abs_diff"], "{:.1e}"), r["note"])
    return t


def write_results(rows, out: Path, title: str, stem: str = SWEEPS[LAZY].stem) -> None:
    """``<stem>.csv`` (the columns of :data:`COLUMNS`) and ``<stem>.md`` (the table) in ``out``."""
    from rich.console import Console

    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    with open(Path("/dev/null"), "w") as sink:
        console = Console(record=True, width=170, file=sink)
        console.print(table(rows, title))
    (out / f"{stem}.md").write_text("```\n" + console.export_text() + "```\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    sweep = SWEEPS[args.rung]
    if not args.emulator and args.rung in rungs_left_out():
        print(f"GPU tuning not run: the {args.rung} rung {LEFT_OUT_REASON} (it is in GPU_CHECK_LEFT_OUT); "
              f"nothing written")
        return 0
    if not args.emulator and not gpu.device_available():
        print("GPU tuning not run: no CUDA device (CuPy sees none). The configurations still compile without one: "
              "tests/test_gpu_mma_fa2_lazy.py, tests/test_gpu_ladder.py; run this script with --emulator to check "
              "it on the CPU")
        return 0
    where = "the CPU emulator (not timed)" if args.emulator else gpu.device_name()
    title = (f"{sweep.title}, every configuration swept, on {where}: batch 1, {args.heads} heads, N = {args.n}, "
             f"{sweep.dtype}; reference: {sweep.reference}")
    from rich.console import Console

    with progress_steps(len(runs(args.head_dims, args.rung)), "configurations") as step:
        rows, ok = measure(args, step)
    Console(width=170).print(table(rows, title))
    write_results(rows, args.out, title, sweep.stem)
    print(f"results in {args.out}" + ("" if ok else "; SOME CONFIGURATIONS FAILED (see the note column)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

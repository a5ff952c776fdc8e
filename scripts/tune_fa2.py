"""Time every legal tile configuration of the lazy-rescaling FA-2 rung on the GPU.

    python scripts/tune_fa2.py [--out DIR] [--n 8192] [--heads 8] [--head-dims 64 128] [--warmup 2] [--repeats 7]
    python scripts/tune_fa2.py --emulator [--out DIR]

For each head dim and each ``(block_q, block_k, min_blocks)`` of
:func:`lessons.gpu.source.flash_attention_mma_fa2_lazy_configs` (the default one is
:data:`lessons.gpu.source.FA2_LAZY_CONFIGS`), it runs :func:`lessons.gpu.flash_attention_mma_fa2_lazy_gpu`
on batch 1, ``--heads`` heads, N = ``--n`` queries and keys, float16, not causal, and reports the median of
``--repeats`` CUDA-event timings after ``--warmup`` runs (:func:`lessons.gpu.measure.median_cuda_seconds`,
as the benchmarks time), TFLOP/s (4 N^2 d per head), the speed-up over the default configuration at that
head dim (``x_default``: the default's seconds over this one's), the registers per thread (from the kernel
loaded on the device) and the largest difference from the default configuration's output. The FA-2 rung
(``flash_attention_mma_fa2_gpu``, its fixed tiles) is timed beside them as a reference row.

Writes ``fa2_configs.csv`` and ``fa2_configs.md`` (a table) into ``--out``. Without a CUDA device it
says so and exits 0. ``--emulator`` runs every configuration once at a tiny N on the CPU emulator (a check
of this script: nothing is timed, and each output is compared with NumPy's attention). Exit status 0, or 1
when an output is not finite or (on the emulator) differs from NumPy.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lessons  # noqa: E402
import lessons.gpu as gpu  # noqa: E402
from lessons.gpu.measure import attention_flops, median_cuda_seconds  # noqa: E402
from lessons.gpu.source import FA2_LAZY_CONFIGS, flash_attention_mma_fa2_lazy_configs  # noqa: E402

#: the columns of fa2_configs.csv
COLUMNS = ("impl", "d", "block_q", "block_k", "min_blocks", "default", "n", "heads", "dtype", "seconds", "tflops",
           "x_default", "registers", "max_abs_diff", "note")
LAZY, PLAIN = "mma_fa2_lazy", "mma_fa2"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fa2_configs")
    p.add_argument("--n", type=int, default=None, help="queries and keys (default 8192; 80 with --emulator)")
    p.add_argument("--heads", type=int, default=None, help="heads (default 8; 1 with --emulator)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=(64, 128))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--emulator", action="store_true", help="run once per configuration on the CPU emulator")
    args = p.parse_args(argv)
    args.n = args.n if args.n is not None else (80 if args.emulator else 8192)
    args.heads = args.heads if args.heads is not None else (1 if args.emulator else 8)
    for name in ("n", "heads", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def runs(head_dims):
    """(impl, d, (block_q, block_k, min_blocks)) to run, in order: per head dim the default lazy configuration
    first (the others are compared with it), then the rest, then the FA-2 rung."""
    out = []
    for d in head_dims:
        default = FA2_LAZY_CONFIGS[d]
        out.append((LAZY, d, default))
        out += [(LAZY, d, c) for c in flash_attention_mma_fa2_lazy_configs(d) if c != default]
        out.append((PLAIN, d, gpu.flash_attention_mma_fa2_config(d)))
    return out


def add_ratios(rows) -> list[dict]:
    """``x_default`` of each row: the default lazy configuration's seconds at its head dim over the row's
    (above 1: faster than the default); None where either was not timed. Returns ``rows``."""
    default = {r["d"]: r["seconds"] for r in rows if r["impl"] == LAZY and r["default"]}
    for r in rows:
        base = default.get(r["d"])
        r["x_default"] = base / r["seconds"] if base and r["seconds"] else None
    return rows


def _registers(build):
    """Registers per thread of ``build``'s entry point: from the kernel loaded on the device where there is
    one, else ptxas's report for sm_90; None when nobody reports (never raises)."""
    try:
        arch = gpu.device_arch() or "sm_90"
        return gpu.kernel_resources(build, arch)[build.entries[0]].registers
    except Exception:  # no NVRTC, a broken driver: the column stays empty
        return None


def measure(args, progress=None) -> tuple[list[dict], bool]:
    """One row per configuration (and the FA-2 rung per head dim); ``ok`` False when an output was not finite
    or, on the emulator, differed from NumPy. ``progress``: a callable given each row's label before it runs."""
    backend = "emulator" if args.emulator else "cupy"
    if args.emulator:
        xp = np
    else:
        import cupy as xp
    rng = np.random.default_rng(0)
    rows, ok, inputs, default_out = [], True, {}, {}
    for impl, d, (bq, bk, mb) in runs(args.head_dims):
        label = f"{impl} d={d} {bq}x{bk} min_blocks={mb}"
        if progress is not None:
            progress(label)
        if d not in inputs:
            host = [rng.standard_normal((args.heads, args.n, d)).astype(np.float16) for _ in range(3)]
            inputs[d] = (host, [xp.asarray(x) for x in host])
        host, (q, k, v) = inputs[d]
        if impl == LAZY:
            build = gpu.flash_attention_mma_fa2_lazy_build(d, "float16", False, bq, bk, mb)
            call = lambda: gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v, block_q=bq, block_k=bk,  # noqa: E731
                                                                 min_blocks=mb, backend=backend)
        else:
            build = gpu.flash_attention_mma_fa2_build(d)
            call = lambda: gpu.flash_attention_mma_fa2_gpu(q, k, v, backend=backend)  # noqa: E731
        row = dict(impl=impl, d=d, block_q=bq, block_k=bk, min_blocks=mb,
                   default=impl == LAZY and (bq, bk, mb) == FA2_LAZY_CONFIGS[d], n=args.n, heads=args.heads,
                   dtype="float16", seconds=None, tflops=None, x_default=None, registers=_registers(build),
                   max_abs_diff=None, note="")
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
            if err > 3e-3:
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
    for col in ("rung", "d", "block_q", "block_k", "min_blocks", "median ms", "TFLOP/s", "x default", "registers",
                "max |diff| vs default", "note"):
        t.add_column(col, justify="left" if col in ("rung", "note") else "right")
    for r in rows:
        t.add_row(r["impl"] + (" (default)" if r["default"] else ""), str(r["d"]), str(r["block_q"]),
                  str(r["block_k"]), str(r["min_blocks"]), _cell(r["seconds"] and r["seconds"] * 1e3, "{:.3f}"),
                  _cell(r["tflops"], "{:.1f}"), _cell(r["x_default"], "{:.3f}"), _cell(r["registers"]),
                  _cell(r["max_abs_diff"], "{:.1e}"), r["note"])
    return t


def write_results(rows, out: Path, title: str) -> None:
    """``fa2_configs.csv`` (the columns of :data:`COLUMNS`) and ``fa2_configs.md`` (the table) in ``out``."""
    from rich.console import Console

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fa2_configs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    with open(Path("/dev/null"), "w") as sink:
        console = Console(record=True, width=160, file=sink)
        console.print(table(rows, title))
    (out / "fa2_configs.md").write_text("```\n" + console.export_text() + "```\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.emulator and not gpu.device_available():
        print("GPU tuning not run: no CUDA device (CuPy sees none). The configurations still compile without one: "
              "tests/test_gpu_mma_fa2_lazy.py; run this script with --emulator to check it on the CPU")
        return 0
    where = "the CPU emulator (not timed)" if args.emulator else gpu.device_name()
    title = (f"lazy-rescaling FA-2 rung, every legal configuration, on {where}: batch 1, {args.heads} heads, "
             f"N = {args.n}, float16")
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("configurations", total=len(runs(args.head_dims)))
        started = []

        def step(label):
            if started:
                bar.advance(task)
            started.append(label)
            bar.update(task, description=label)

        rows, ok = measure(args, step)
        bar.update(task, completed=len(started), description="configurations")
    Console(width=160).print(table(rows, title))
    write_results(rows, args.out, title)
    print(f"results in {args.out}" + ("" if ok else "; SOME CONFIGURATIONS FAILED (see the note column)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

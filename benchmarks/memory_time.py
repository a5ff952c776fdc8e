"""Peak memory and time: textbook attention vs flash attention, on this CPU.

    python benchmarks/memory_time.py            # N = 512, 2048, 8192; d = 64; fp64 and fp32
    python benchmarks/memory_time.py --quick    # N = 128, 256; prints the table, writes nothing

For each N and dtype, with Nq = Nk = N and d = dv = 64:

* peak memory: one call of each algorithm under ``tracemalloc`` (NumPy reports
  its buffers to it); the inputs are made beforehand and not counted, the output is.
* time: the best of ``--repeats`` calls, measured WITHOUT tracemalloc, textbook
  and flash alternating so both see the same background load (the median is in
  the CSV too).

Block sizes. flash_attention runs with ``tile = block_q = 256`` by default: a
256 x 256 score tile is 512 KiB in float64 (256 KiB in float32), about one
core's L2 cache, and at N = 8192 the loop makes 32 x 32 = 1024 absorb calls, so
Python's per-tile overhead (tens of microseconds) is small next to the tile's
arithmetic. Much smaller tiles pay that overhead many more times; much larger
ones spill out of cache and approach the textbook's memory. The peak of flash is
then the (N, d) output plus a few tile-sized temporaries, against the textbook's
several (N, N) arrays.

BLAS threads. The timed runs use one BLAS thread (``--blas-threads 1``, set
with threadpoolctl for this process only; the environment is left alone).
NumPy's elementwise work (the exp, the max, the sums) is single-threaded
anyway, so this compares the two algorithms per core; and on a machine shared
with other work, a multi-threaded BLAS makes flash's many small matrix products
wait for busy cores and slows them many times over (measured here on 2 busy
cores: flash 2.1 s with 2 BLAS threads, 0.14 s with 1, at N = 2048). Pass
``--blas-threads 0`` to keep the BLAS default.

Writes ``memory_time.md``, ``memory_time.csv`` and ``memory_time.png`` into
``--out`` (default ``benchmarks/results``; with ``--quick`` nothing is written
unless ``--out`` is given).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:                      # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from lessons.cost.traffic import loglog_slope  # noqa: E402
from lessons.cost.memory import measure_case  # noqa: E402

MIB = 2 ** 20
FULL_NS = (512, 2048, 8192)
QUICK_NS = (128, 256)
DTYPES = ("float64", "float32")


def machine_info() -> str:
    """One line: CPU count, Python, NumPy and its BLAS (threadpoolctl if installed, else numpy's config).

    Call it inside the thread limit so that the BLAS thread count reported is the one used.
    """
    parts = [f"{os.cpu_count()} CPUs ({platform.machine()})", f"Python {platform.python_version()}",
             f"NumPy {np.__version__}"]
    blas = None
    try:
        from threadpoolctl import threadpool_info
        libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
        if libs:
            i = libs[0]
            blas = f"{i.get('internal_api')} {i.get('version')}, {i.get('num_threads')} thread(s) used"
            if i.get("architecture"):
                blas += f", {i['architecture']} kernels"
    except ImportError:
        pass
    if blas is None:
        try:
            cfg = np.show_config(mode="dicts")
            b = cfg["Build Dependencies"]["blas"]
            blas = f"{b.get('name')} {b.get('version')}"
        except Exception:                           # older NumPy: no dict mode
            blas = "unknown"
    parts.append(f"BLAS {blas}")
    if os.environ.get("OPENBLAS_CORETYPE"):
        parts.append(f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}")
    return "; ".join(parts)


def blas_threads(n: int):
    """Context manager limiting BLAS to ``n`` threads (0: no limit); a no-op without threadpoolctl."""
    if n == 0:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("threadpoolctl is not installed: BLAS keeps its default thread count", file=sys.stderr)
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def run(ns, dtypes, *, d, tile, block_q, repeats, seed=0):
    """Measure every (N, dtype) with a rich progress bar; returns a list of CaseResult."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    calls_per_case = 2 * (1 + repeats)
    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as progress:
        task = progress.add_task("measuring", total=len(ns) * len(dtypes) * calls_per_case)
        for n in ns:
            for dtype in dtypes:
                def step(label, n=n, dtype=dtype):
                    progress.update(task, advance=1, description=f"N={n:>5} {dtype}: {label}")
                results.append(measure_case(n, d, dtype=dtype, tile=tile, block_q=block_q,
                                            repeats=repeats, seed=seed, on_step=step))
    return results


def table_rows(results):
    """The table as rows of strings (header first)."""
    rows = [["N", "dtype", "peak MiB textbook", "peak MiB flash", "ratio",
             "time s textbook", "time s flash", "ratio"]]
    for r in results:
        rows.append([str(r.n), r.dtype, f"{r.peak_textbook / MIB:.1f}", f"{r.peak_flash / MIB:.2f}",
                     _times(r.memory_ratio), f"{r.time_textbook:.3f}", f"{r.time_flash:.3f}",
                     _times(r.time_ratio)])
    return rows


def _times(x: float) -> str:
    return f"{x:.0f}x" if x >= 10 else f"{x:.2f}x"


def write_markdown(path, results, info, *, tile, block_q, repeats):
    rows = table_rows(results)
    lines = ["# Peak memory and time: textbook vs flash attention (CPU, NumPy)", "",
             f"Nq = Nk = N, d = dv = {results[0].d}; flash_attention with tile = {tile}, "
             f"block_q = {block_q}. Peak memory: one call under tracemalloc, inputs not counted. "
             f"Time: best of {repeats} calls without tracemalloc (medians in memory_time.csv). "
             "Memory ratio = textbook / flash (how many times less flash needs); time ratio = "
             "flash / textbook (above 1: flash is slower). Made by `python benchmarks/memory_time.py`.", "",
             "| " + " | ".join(rows[0]) + " |",
             "|" + "|".join(["---:"] * len(rows[0])) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += ["", "Peak memory grows with N like (fitted log-log slope): " + ", ".join(
        f"{dt} textbook {s_t:.2f}, flash {s_f:.2f}" for dt, s_t, s_f in slopes(results)) + ".",
        "", f"Machine: {info}.", ""]
    Path(path).write_text("\n".join(lines), encoding="utf-8")


def write_csv(path, results):
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["n", "d", "dtype", "tile", "block_q", "peak_bytes_textbook", "peak_bytes_flash",
                    "memory_ratio", "time_s_textbook_best", "time_s_flash_best", "time_ratio_best",
                    "time_s_textbook_median", "time_s_flash_median", "max_abs_diff"])
        for r in results:
            w.writerow([r.n, r.d, r.dtype, r.tile, r.block_q, r.peak_textbook, r.peak_flash,
                        f"{r.memory_ratio:.3f}", f"{r.time_textbook:.6f}", f"{r.time_flash:.6f}",
                        f"{r.time_ratio:.4f}", f"{r.median_textbook:.6f}", f"{r.median_flash:.6f}",
                        f"{r.max_abs_diff:.3e}"])


def slopes(results):
    """[(dtype, textbook slope, flash slope)] of log peak memory against log N."""
    out = []
    for dt in dict.fromkeys(r.dtype for r in results):
        rs = [r for r in results if r.dtype == dt]
        if len(rs) >= 2:
            ns = [r.n for r in rs]
            out.append((dt, loglog_slope(ns, [r.peak_textbook for r in rs]),
                        loglog_slope(ns, [r.peak_flash for r in rs])))
    return out


def plot(path, results, info, *, tile, block_q):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.6), dpi=110)
    colors = {"textbook": "tab:red", "flash": "tab:blue"}
    styles = {"float64": ("o", "-"), "float32": ("s", "--")}
    slope = {(dt, "textbook"): s_t for dt, s_t, _ in slopes(results)}
    slope |= {(dt, "flash"): s_f for dt, _, s_f in slopes(results)}
    for dt in dict.fromkeys(r.dtype for r in results):
        rs = [r for r in results if r.dtype == dt]
        ns = [r.n for r in rs]
        marker, ls = styles.get(dt, ("^", ":"))
        for algo in ("textbook", "flash"):
            mem = [(r.peak_textbook if algo == "textbook" else r.peak_flash) / MIB for r in rs]
            sec = [r.time_textbook if algo == "textbook" else r.time_flash for r in rs]
            s = slope.get((dt, algo))
            label = f"{algo} {dt}" + (f" (slope {s:.2f})" if s is not None else "")
            ax_m.plot(ns, mem, marker=marker, ls=ls, color=colors[algo], label=label)
            ax_t.plot(ns, sec, marker=marker, ls=ls, color=colors[algo], label=f"{algo} {dt}")
    ns_all = sorted({r.n for r in results})
    one_s = [r.score_bytes / MIB for r in results if r.dtype == "float64"]
    if len(one_s) == len(ns_all):
        ax_m.plot(ns_all, one_s, ls=":", color="0.5", label="one (N, N) float64 score matrix")
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns_all, [str(n) for n in ns_all])
        ax.set_xlabel("sequence length N (Nq = Nk)")
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _pos: f"{y:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    ax_m.set_ylabel("peak memory during the call (MiB)")
    ax_m.set_title("Peak memory: textbook ~ N², flash ~ tiles + (N, d) output")
    ax_m.legend(fontsize=8, title="log-log slope of peak vs N", title_fontsize=8)
    ax_t.set_ylabel("time per call (s, best of repeats)")
    ax_t.set_title("Time: the same arithmetic, done tile by tile")
    ax_t.legend(fontsize=8)
    fig.suptitle(f"Textbook vs flash attention in NumPy, d = {results[0].d}, "
                 f"tile = block_q = {tile}" if tile == block_q else
                 f"Textbook vs flash attention in NumPy, d = {results[0].d}, tile = {tile}, block_q = {block_q}",
                 fontsize=11)
    fig.text(0.5, 0.01, info, ha="center", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def print_table(results):
    from rich.console import Console
    from rich.table import Table

    rows = table_rows(results)
    t = Table(title="textbook vs flash attention")
    for h in rows[0]:
        t.add_column(h, justify="right")
    for r in rows[1:]:
        t.add_row(*r)
    Console().print(t)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Peak memory (tracemalloc) and time of lessons.attention vs lessons.flash_attention.",
        epilog="example: python benchmarks/memory_time.py --quick")
    parser.add_argument("--quick", action="store_true",
                        help=f"small N only ({', '.join(map(str, QUICK_NS))}), 1 repeat; writes files only with --out")
    parser.add_argument("--ns", type=int, nargs="+", help=f"sequence lengths (default {' '.join(map(str, FULL_NS))})")
    parser.add_argument("--d", type=int, default=64, help="head dimension (default 64)")
    parser.add_argument("--tile", type=int, default=256, help="flash key tile, block_k (default 256)")
    parser.add_argument("--block-q", type=int, default=256, help="flash query block (default 256)")
    parser.add_argument("--repeats", type=int, help="timed calls per algorithm (default 5; 1 with --quick)")
    parser.add_argument("--blas-threads", type=int, default=1,
                        help="BLAS threads during the runs, via threadpoolctl (default 1; 0 = BLAS default)")
    parser.add_argument("--out", type=Path, help="folder for the .md/.csv/.png (default benchmarks/results)")
    args = parser.parse_args(argv)
    for name in ("d", "tile", "block_q", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1, got {value}")
    if args.blas_threads < 0:
        parser.error(f"argument --blas-threads: must be 0 or more, got {args.blas_threads}")
    if args.ns is not None and min(args.ns) < 1:
        parser.error(f"argument --ns: every N must be at least 1, got {args.ns}")

    ns = args.ns or (QUICK_NS if args.quick else FULL_NS)
    repeats = args.repeats or (1 if args.quick else 5)
    out = args.out if args.out is not None else (None if args.quick else ROOT / "benchmarks" / "results")

    with blas_threads(args.blas_threads):
        info = machine_info()
        results = run(ns, DTYPES, d=args.d, tile=args.tile, block_q=args.block_q, repeats=repeats)
    print_table(results)
    print(f"Machine: {info}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_markdown(out / "memory_time.md", results, info, tile=args.tile, block_q=args.block_q, repeats=repeats)
        write_csv(out / "memory_time.csv", results)
        plot(out / "memory_time.png", results, info, tile=args.tile, block_q=args.block_q)
        print(f"wrote {out / 'memory_time.md'}, memory_time.csv, memory_time.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the GPU benchmarks share: the device, peak memory, torch timing, the run loop and the outputs.

Used by ``benchmarks/gpu_attention.py`` (the forward) and ``benchmarks/gpu_backward.py``. A
benchmark gives the implementations to time (a function per name, or the reason one is skipped)
and the plot's styles; everything else is here. A result row is a dict: ``impl``, ``n``, ``d``,
``heads``, ``causal``, ``dtype``, ``seconds`` (median of CUDA-event timings, None when not run),
``tflops``, ``peak_bytes`` (peak extra device memory of one call, bytes) and ``note`` (why not run).
Importing this module imports neither CuPy nor torch.
"""
from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from lessons.gpu.measure import make_peak_hook, peak_cupy, torch_seconds_and_peak  # noqa: F401 (re-exported)

__all__ = ["device_or_reason", "make_peak_hook", "peak_cupy", "load_torch", "torch_seconds_and_peak", "benchmark", "main",
           "timed_rows", "format_row", "write_results", "results_figure", "plot_results", "read_results", "replot"]


def device_or_reason():
    """(cupy module, None) with a CUDA device, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed (pip install cupy-cuda12x)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no CUDA device"
    except Exception as err:  # CUDARuntimeError without a driver or device
        return None, f"no CUDA device ({type(err).__name__}: {err})"
    return cupy, None


def load_torch():
    """(torch module, None) when torch with CUDA is installed, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, None


def timed_rows(args, cupy, torch, impls, calls, *, dtype, d, n, flops, t0, skip=lambda impl: None):
    """One row per name in ``impls`` for one (dtype, d, N), printed as it is made.

    ``calls[impl]``: a function run once per timing; for ``"torch"`` a function returning
    ``(seconds, peak_bytes)`` itself. ``skip(impl)``: a reason not to run it, or None. A row is
    skipped once ``args.time_budget`` seconds have passed since ``t0``; a failure (out of memory,
    ...) is a note, not an exception. CuPy's (and torch's) pools are emptied after each run.
    """
    from lessons.gpu.measure import median_cuda_seconds

    rows = []
    for impl in impls:
        row = dict(impl=impl, n=n, d=d, heads=args.heads, causal=args.causal, dtype=dtype,
                   seconds=None, tflops=None, peak_bytes=None, note="")
        why = "time budget spent" if time.perf_counter() - t0 > args.time_budget else skip(impl)
        if why:
            row["note"] = f"skipped: {why}"
        else:
            try:
                if impl == "torch":
                    seconds, peak = calls[impl]()
                else:
                    seconds = median_cuda_seconds(cupy, calls[impl], args.warmup, args.repeats)
                    peak = peak_cupy(cupy, calls[impl])
                row.update(seconds=seconds, tflops=flops / seconds / 1e12, peak_bytes=int(peak))
            except Exception as err:     # out of memory, missing cuBLAS, ...
                row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row) -> str:
    """One row as a line: implementation, dtype, N, d, then ms, TFLOP/s and peak MiB, or the note."""
    head = f"{row['impl']:>7} {row['dtype']:>8} N={row['n']:>6} d={row['d']:>4}"
    if row["seconds"] is None:
        return f"{head}  {row['note']}"
    return (f"{head}  {row['seconds'] * 1e3:9.3f} ms  "
            f"{row['tflops']:7.2f} TFLOP/s  peak {row['peak_bytes'] / 2**20:9.1f} MiB")


def write_results(rows, out: Path, meta: dict, *, what: str) -> None:
    """results.json, results.csv and results.md (a table titled ``what``, the device, heads) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{what}, {meta['device']}, batch 1, {meta['heads']} heads"
                        + (", causal" if meta["causal"] else ""))
    for col in ("impl", "dtype", "N", "d", "median ms", "TFLOP/s", "peak MiB", "note"):
        table.add_column(col, justify="left" if col in ("impl", "dtype", "note") else "right")
    for r in rows:
        done = r["seconds"] is not None
        table.add_row(r["impl"], r["dtype"], str(r["n"]), str(r["d"]),
                      f"{r['seconds'] * 1e3:.3f}" if done else "-", f"{r['tflops']:.2f}" if done else "-",
                      f"{r['peak_bytes'] / 2**20:.1f}" if done else "-", r["note"])
    with open(Path("/dev/null"), "w") as sink:
        console = Console(record=True, width=140, file=sink)
        console.print(table)
    (out / "results.md").write_text("```\n" + console.export_text() + "```\n")


def results_figure(rows, *, impls, dtypes, style, speed, title):
    """Two rows of panels (speed, peak memory) x one column per head dim; log2 N on x. Returns the Figure.

    ``style[impl]``: (colour, marker, label); ``speed``: (row -> value, y label) for the top
    panels; ``title``: the figure's title. float16 lines solid, others dashed. One legend for the
    whole figure, outside the axes on the right (one entry per implementation drawn, one per dtype
    line style), so it never covers a line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    value, ylabel = speed
    head_dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(head_dims), figsize=(4.6 * len(head_dims) + 3.4, 7.5), squeeze=False,
                             sharex=True, layout="constrained")
    drawn_impls, drawn_dtypes = [], []
    for col, d in enumerate(head_dims):
        for dtype in dtypes:
            for impl in impls:
                pts = sorted((r["n"], value(r), r["peak_bytes"]) for r in rows
                             if r["d"] == d and r["impl"] == impl and r["dtype"] == dtype and r["seconds"] is not None)
                if not pts:
                    continue
                drawn_impls += [impl] if impl not in drawn_impls else []
                drawn_dtypes += [dtype] if dtype not in drawn_dtypes else []
                color, marker, label = style[impl]
                line = dict(marker=marker, color=color, label=f"{label}, {dtype}",
                            linestyle="-" if dtype == "float16" else "--")
                n, top, mem = zip(*pts)
                axes[0, col].plot(n, top, **line)
                axes[1, col].plot(n, [max(m, 1) / 2**20 for m in mem], **line)
        axes[0, col].set_title(f"d = {d}")
        axes[0, col].set_ylabel(ylabel)
        axes[1, col].set_ylabel("peak extra device memory (MiB)")
        axes[1, col].set_xlabel("sequence length N")
        sizes = sorted({r["n"] for r in rows})
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=style[i][0], marker=style[i][1], label=style[i][2]) for i in impls
               if i in drawn_impls]
    handles += [Line2D([], [], color="#555555", linestyle="-" if dt == "float16" else "--", label=dt)
                for dt in dtypes if dt in drawn_dtypes]
    fig.legend(handles=handles, loc="outside right center", fontsize=8, frameon=False)
    fig.suptitle(title)
    return fig


def dtype_caption(rows) -> str:
    """How the plot tells the dtypes apart, for the dtypes that have a time in ``rows``:
    ``"solid float16, dashed float32"``, or just ``"float16"`` when only one was run."""
    timed = sorted({r["dtype"] for r in rows if r["seconds"] is not None}, key=lambda d: d != "float16")
    if len(timed) == 1:
        return timed[0]
    return ", ".join(("solid " if d == "float16" else "dashed ") + d for d in timed)


def plot_results(rows, path: Path, *, impls, dtypes, style, speed, title) -> None:
    """:func:`results_figure` of ``rows`` saved as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = results_figure(rows, impls=impls, dtypes=dtypes, style=style, speed=speed, title=title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_results(path: Path) -> list[dict]:
    """The rows of a ``results.csv`` written by :func:`write_results`, typed as the run made them:
    n, d, heads, peak_bytes int; causal bool; seconds, tflops float; None where the row was not run."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            done = bool(r["seconds"])
            rows.append(dict(r, n=int(r["n"]), d=int(r["d"]), heads=int(r["heads"]), causal=r["causal"] == "True",
                             seconds=float(r["seconds"]) if done else None, tflops=float(r["tflops"]) if done else None,
                             peak_bytes=int(r["peak_bytes"]) if done else None))
    if not rows:
        raise ValueError(f"{path} holds no result rows")
    return rows


def replot(csv_path: Path, plot, png_name: str) -> Path:
    """Draw the plot of a recorded run again from its ``results.csv`` (no new measurement): ``plot``
    is the benchmark's ``plot_results(rows, path, meta)``; the device name comes from the title of
    ``results.md`` beside the CSV ("GPU" when it is not there). Writes ``png_name`` beside the CSV
    and returns its path. FileNotFoundError when the CSV is missing."""
    csv_path = Path(csv_path)
    rows = read_results(csv_path)
    device = "GPU"
    md = csv_path.with_name("results.md")
    if md.is_file():
        for line in md.read_text().splitlines():
            if ", batch 1," in line:
                device = line.split(", batch 1,")[0].strip().split(", ", 1)[-1]
                break
    path = csv_path.with_name(png_name)
    plot(rows, path, dict(device=device, heads=rows[0]["heads"], causal=rows[0]["causal"]))
    return path


def benchmark(args, cupy, run_size, on_group=None):
    """Every row: ``run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0)`` for each of
    ``args.dtypes`` x ``args.head_dims`` x ``args.sizes``, CuPy's pool emptied after each. ``on_group``: called
    with the rows so far after each (dtype, d, N), so that a run cut short (a time limit, a kernel that hangs)
    leaves what it measured on disk."""
    import numpy as np

    torch, torch_reason = load_torch()
    rows = []
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        for d in args.head_dims:
            for n in args.sizes:
                rows.extend(run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0))
                cupy.get_default_memory_pool().free_all_blocks()
                if on_group is not None:
                    on_group(list(rows))
    return rows


def main(args, run_size, write_results, *, kernels: str = "kernels") -> int:
    """Run the benchmark and write its results into ``args.out``; without a CUDA device print why and
    return 0 (``kernels``: what still compiles without one, in words)."""
    cupy, reason = device_or_reason()
    if cupy is None:
        print(f"GPU benchmark not run: {reason}. The {kernels} still compile without a GPU: "
              f"python -c 'import lessons.gpu as g; print(g.gpu_status())'")
        return 0
    import lessons.gpu as gpu

    meta = dict(device=gpu.device_name(), heads=args.heads, causal=args.causal, warmup=args.warmup,
                repeats=args.repeats, cupy=cupy.__version__)
    print(f"device: {meta['device']}")
    # written after each (dtype, d, N): the last write holds every row
    benchmark(args, cupy, run_size, on_group=lambda so_far: write_results(so_far, args.out, meta))
    print(f"results in {args.out}")
    return 0

"""Attention on the GPU: naive CuPy vs the series' RawKernel vs torch's scaled_dot_product_attention.

    python benchmarks/gpu_attention.py [--out DIR] [--sizes 1024 2048 ...] [--head-dims 64 128]

For each storage dtype (``--dtypes``, default float16 and float32), sequence length N and
head dim d (batch 1, ``--heads`` heads):

* ``naive``  - CuPy: S = scale * Q K^T in float32 (N x N per head), softmax, then P V;
* ``kernel`` - :func:`lessons.gpu.flash_attention_gpu` (FlashAttention-2 loop, float32 FMAs
  on CUDA cores, no tensor cores: a lesson, not a tuned kernel);
* ``regtile`` - :func:`lessons.gpu.flash_attention_regtile_gpu` (the same loop register-tiled:
  each thread a block of S and O, 16-byte shared loads; float32 only);
* ``mma_async`` - :func:`lessons.gpu.flash_attention_mma_async_gpu` (the tensor-core kernel with
  cp.async double-buffered K/V tiles and ldmatrix fragment loads; float16 only);
* ``mma_fa2`` - :func:`lessons.gpu.flash_attention_mma_fa2_gpu` (the tensor-core kernel along
  FlashAttention-2's recipe: 128-row blocks over 8 warps at d = 64, ldmatrix.x4 from swizzled
  shared memory, exp2; float16 only, d = 64 or 128);
* ``mma``    - :func:`lessons.gpu.flash_attention_mma_gpu` (the same loop on tensor cores,
  ``mma.sync.m16n8k16``; float16 only);
* ``torch``  - ``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention or
  cuDNN kernels on tensor cores for float16), where torch with CUDA is installed.

Reported: median time of ``--repeats`` runs after ``--warmup`` runs, measured with CUDA
events (seconds); TFLOP/s counting 4 N^2 d flops per head (2 for Q K^T, 2 for P V;
halved when causal); peak device memory allocated during one call beyond the inputs
(bytes: CuPy through a memory hook on its pool, torch through max_memory_allocated).
Writes results.json, results.csv, results.md and gpu_attention.png into ``--out``.
Without a CUDA device it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLS = ("naive", "kernel", "regtile", "mma", "mma_async", "mma_fa2", "torch")
DTYPES = ("float16", "float32")


def attention_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """Floating-point operations of one attention forward: 4 N^2 d per head (half if causal)."""
    return 4.0 * n * n * d * heads * (0.5 if causal else 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="naive CuPy vs RawKernel vs torch SDPA attention")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds; configurations not started by then are recorded as skipped")
    args = p.parse_args(argv)
    for name in ("heads", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


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


def make_peak_hook(cupy):
    """A CuPy memory hook that tracks the bytes held in the pool and their peak."""

    class PeakHook(cupy.cuda.MemoryHook):
        name = "PeakHook"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kwargs):      # CuPy passes device_id, size, mem_size, ...
            self.current += kwargs["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs):
            self.current -= kwargs["mem_size"]

    return PeakHook()


def peak_cupy(cupy, fn):
    hook = make_peak_hook(cupy)
    cupy.cuda.Device().synchronize()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    del result
    return hook.peak


def run_torch(torch, q, k, v, causal, warmup, repeats):
    import torch.nn.functional as F

    tq, tk, tv = (torch.as_tensor(x, device="cuda").unsqueeze(0) for x in (q, k, v))   # (1, H, N, d)

    def fn():
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return statistics.median(times), peak


def load_torch():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, None


def benchmark(args, cupy):
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
    return rows


def run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0):
    """The rows of one (dtype, d, N): each implementation timed, or the reason it was not."""
    import numpy as np

    import lessons.gpu as gpu
    from lessons.gpu.measure import median_cuda_seconds, naive_attention

    shape = (args.heads, n, d)
    q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(3))
    flops = attention_flops(n, d, args.heads, args.causal)
    calls = {
        "naive": lambda: naive_attention(cupy, q, k, v, args.causal),
        "kernel": lambda: gpu.flash_attention_gpu(q, k, v, causal=args.causal),
        "mma": lambda: gpu.flash_attention_mma_gpu(q, k, v, causal=args.causal),
        "regtile": lambda: gpu.flash_attention_regtile_gpu(q, k, v, causal=args.causal),
        "mma_async": lambda: gpu.flash_attention_mma_async_gpu(q, k, v, causal=args.causal),
        "mma_fa2": lambda: gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=args.causal),
    }
    rows = []
    for impl in IMPLS:
        row = dict(impl=impl, n=n, d=d, heads=args.heads, causal=args.causal, dtype=dtype,
                   seconds=None, tflops=None, peak_bytes=None, note="")
        if time.perf_counter() - t0 > args.time_budget:
            row["note"] = "skipped: time budget spent"
        elif impl == "torch" and torch is None:
            row["note"] = f"skipped: {torch_reason}"
        elif impl in ("mma", "mma_async", "mma_fa2") and dtype != "float16":
            row["note"] = "skipped: tensor cores take float16/bfloat16"
        elif impl == "regtile" and dtype != "float32":
            row["note"] = "skipped: the register-tiled kernel takes float32"
        else:
            try:
                if impl == "torch":
                    seconds, peak = run_torch(torch, q, k, v, args.causal, args.warmup, args.repeats)
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
    head = f"{row['impl']:>7} {row['dtype']:>8} N={row['n']:>6} d={row['d']:>4}"
    if row["seconds"] is None:
        return f"{head}  {row['note']}"
    return (f"{head}  {row['seconds'] * 1e3:9.3f} ms  "
            f"{row['tflops']:7.2f} TFLOP/s  peak {row['peak_bytes'] / 2**20:9.1f} MiB")


def write_results(rows, out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention forward, {meta['device']}, batch 1, {meta['heads']} heads"
                        + (", causal" if meta["causal"] else ""))
    for col in ("impl", "dtype", "N", "d", "median ms", "TFLOP/s", "peak MiB", "note"):
        table.add_column(col, justify="left" if col in ("impl", "dtype", "note") else "right")
    for r in rows:
        done = r["seconds"] is not None
        table.add_row(r["impl"], r["dtype"], str(r["n"]), str(r["d"]),
                      f"{r['seconds'] * 1e3:.3f}" if done else "-", f"{r['tflops']:.2f}" if done else "-",
                      f"{r['peak_bytes'] / 2**20:.1f}" if done else "-", r["note"])
    console = Console(record=True, width=140, file=open("/dev/null", "w"))
    console.print(table)
    (out / "results.md").write_text("```\n" + console.export_text() + "```\n")
    plot_results(rows, out / "gpu_attention.png", meta)


def plot_results(rows, path: Path, meta: dict) -> None:
    """Two rows of panels (TFLOP/s, peak memory) x one column per head dim; log2 N on x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(head_dims), figsize=(5.2 * len(head_dims), 7.5), squeeze=False,
                             sharex=True)
    style = {"naive": ("tab:red", "o", "naive CuPy (S materialised)"),
             "kernel": ("tab:blue", "s", "RawKernel, CUDA cores"),
             "mma": ("tab:purple", "D", "RawKernel, tensor cores"),
             "regtile": ("tab:cyan", "v", "RawKernel, CUDA cores, register-tiled"),
             "mma_async": ("tab:olive", "P", "RawKernel, tensor cores + ldmatrix + cp.async"),
             "mma_fa2": ("tab:brown", "X", "RawKernel, tensor cores, FA-2 recipe"),
             "torch": ("tab:green", "^", "torch SDPA")}
    for col, d in enumerate(head_dims):
        for dtype in DTYPES:
            for impl in IMPLS:
                pts = sorted((r["n"], r["tflops"], r["peak_bytes"]) for r in rows
                             if r["d"] == d and r["impl"] == impl and r["dtype"] == dtype and r["seconds"] is not None)
                if not pts:
                    continue
                color, marker, label = style[impl]
                line = dict(marker=marker, color=color, label=f"{label}, {dtype}",
                            linestyle="-" if dtype == "float16" else "--")
                n, tf, mem = zip(*pts)
                axes[0, col].plot(n, tf, **line)
                axes[1, col].plot(n, [m / 2**20 for m in mem], **line)
        axes[0, col].set_title(f"d = {d}")
        axes[0, col].set_ylabel("TFLOP/s (higher is better)")
        axes[1, col].set_ylabel("peak extra device memory (MiB)")
        axes[1, col].set_xlabel("sequence length N")
        sizes = sorted({r["n"] for r in rows})
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.grid(True, which="both", alpha=0.3)
        axes[0, col].legend(fontsize=8)
    fig.suptitle(f"Attention forward on {meta['device']}\nbatch 1, {meta['heads']} heads; solid float16, dashed float32"
                 + (", causal" if meta["causal"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    cupy, reason = device_or_reason()
    if cupy is None:
        print(f"GPU benchmark not run: {reason}. The kernels still compile without a GPU: "
              f"python -c 'import lessons.gpu as g; print(g.gpu_status())'")
        return 0
    import lessons.gpu as gpu

    meta = dict(device=gpu.device_name(), heads=args.heads, causal=args.causal, warmup=args.warmup,
                repeats=args.repeats, cupy=cupy.__version__)
    print(f"device: {meta['device']}")
    rows = benchmark(args, cupy)
    write_results(rows, args.out, meta)
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

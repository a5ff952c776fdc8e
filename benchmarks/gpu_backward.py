"""The attention backward on the GPU: naive CuPy (P materialised) vs the series' RawKernels vs torch SDPA.

    python benchmarks/gpu_backward.py [--out DIR] [--sizes 1024 2048 ...] [--head-dims 64 128]

For each storage dtype (``--dtypes``, default float16), sequence length N and head dim d
(batch 1, ``--heads`` heads), given q, k, v, dO and the forward's O and lse:

* ``naive``  - CuPy, float32: S = scale Q K^T, P = softmax(S), dV = P^T dO, dP = dO V^T,
  dS = P * (dP - rowsum(P * dP)), dQ = scale dS K, dK = scale dS^T Q; P, dP and dS are each
  (heads, N, N) in device memory;
* ``kernel`` - :func:`lessons.gpu.flash_attention_backward_gpu` (D, dK/dV and dQ kernels,
  float32 FMAs on CUDA cores; P recomputed from lse, never stored);
* ``mma``    - :func:`lessons.gpu.backward.flash_attention_backward_mma_gpu` (the same three passes
  with every product on tensor cores, mma.sync m16n8k16; float16 with d = 64 or 128 only); its
  note gives its largest difference from ``kernel``, relative to the largest gradient;
* ``torch``  - the backward of ``torch.nn.functional.scaled_dot_product_attention``
  (``torch.autograd.grad`` on a retained graph), where torch with CUDA is installed.

Reported: median time of ``--repeats`` backward calls after ``--warmup`` (CUDA events, seconds);
TFLOP/s counting the backward's 5 matmuls, 10 N^2 d flops per head (halved when causal; the
kernel's separate dQ pass actually does 14 N^2 d); peak device memory allocated during one
backward call beyond its inputs (bytes: CuPy through a memory hook on its pool, torch through
max_memory_allocated). Writes results.json, results.csv, results.md and gpu_backward.png into
``--out``. Without a CUDA device it prints why and exits 0.
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

IMPLS = ("naive", "kernel", "mma", "torch")
DTYPES = ("float16", "float32")


def backward_flops(n: int, d: int, heads: int, causal: bool) -> float:
    """Floating-point operations of one attention backward: 5 matmuls of 2 N^2 d each per head
    (S, dV, dP, dQ, dK; FlashAttention-2's count), halved when causal."""
    return 10.0 * n * n * d * heads * (0.5 if causal else 1.0)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="attention backward: naive CuPy vs RawKernels vs torch SDPA")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_backward")
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds; configurations not started by then are recorded as skipped")
    args = p.parse_args(argv)
    for name in ("heads", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
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


def naive_backward(xp, q, k, v, do, causal=False):
    """The textbook backward in CuPy, float32, with P, dP and dS materialised: (dq, dk, dv) in q's dtype.

    ``xp``: the array module (``cupy``; ``numpy`` in tests). ``q``, ``do`` (heads, Nq, d); ``k``, ``v``
    (heads, Nk, d); ``scale = 1/sqrt(d)``; causal bottom-right aligned.
    Source: Dao et al. 2022, App. B.2 (the standard backward)."""
    from lessons.gpu.measure import naive_probabilities

    p, scale = naive_probabilities(xp, q, k, causal)
    q32, k32, v32, do32 = (x.astype(xp.float32) for x in (q, k, v, do))
    dv = xp.matmul(p.transpose(0, 2, 1), do32)
    dp = xp.matmul(do32, v32.transpose(0, 2, 1))
    dp -= (p * dp).sum(axis=-1, keepdims=True)
    ds = xp.multiply(p, dp, out=dp)
    dq = xp.matmul(ds, k32) * scale
    dk = xp.matmul(ds.transpose(0, 2, 1), q32) * scale
    return dq.astype(q.dtype), dk.astype(q.dtype), dv.astype(q.dtype)


def peak_cupy(cupy, fn):
    """Peak bytes CuPy's pool held beyond what it held before ``fn()``."""

    class PeakHook(cupy.cuda.MemoryHook):
        name = "PeakHook"

        def __init__(self):
            self.current = self.peak = 0

        def malloc_postprocess(self, **kwargs):
            self.current += kwargs["mem_size"]
            self.peak = max(self.peak, self.current)

        def free_postprocess(self, **kwargs):
            self.current -= kwargs["mem_size"]

    hook = PeakHook()
    cupy.cuda.Device().synchronize()
    with hook:
        result = fn()
        cupy.cuda.Device().synchronize()
    del result
    return hook.peak


def load_torch():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    return torch, None


def run_torch(torch, q, k, v, do, causal, warmup, repeats):
    """Median seconds and peak extra bytes of SDPA's backward (the forward is run once, outside)."""
    import torch.nn.functional as F

    tq, tk, tv = (torch.as_tensor(x, device="cuda").unsqueeze(0).requires_grad_() for x in (q, k, v))
    tdo = torch.as_tensor(do, device="cuda").unsqueeze(0)
    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    def fn():
        return torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)

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
    grads = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del grads, out
    return statistics.median(times), peak


def run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0):
    """The rows of one (dtype, d, N): each implementation timed, or the reason it was not."""
    import numpy as np

    import lessons.gpu as gpu
    from lessons.gpu.backward import flash_attention_backward_mma_gpu
    from lessons.gpu.measure import median_cuda_seconds

    shape = (args.heads, n, d)
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(4))
    o, lse = gpu.flash_attention_gpu(q, k, v, causal=args.causal)
    flops = backward_flops(n, d, args.heads, args.causal)
    calls = {
        "naive": lambda: naive_backward(cupy, q, k, v, do, args.causal),
        "kernel": lambda: gpu.flash_attention_backward_gpu(q, k, v, o, lse, do, causal=args.causal),
        "mma": lambda: flash_attention_backward_mma_gpu(q, k, v, o, lse, do, causal=args.causal),
    }
    rows = []
    for impl in IMPLS:
        row = dict(impl=impl, n=n, d=d, heads=args.heads, causal=args.causal, dtype=dtype,
                   seconds=None, tflops=None, peak_bytes=None, note="")
        if time.perf_counter() - t0 > args.time_budget:
            row["note"] = "skipped: time budget spent"
        elif impl == "torch" and torch is None:
            row["note"] = f"skipped: {torch_reason}"
        elif impl == "mma" and (dtype != "float16" or d not in (64, 128)):
            row["note"] = "skipped: the tensor-core backward takes float16 with d = 64 or 128"
        else:
            try:
                if impl == "torch":
                    seconds, peak = run_torch(torch, q, k, v, do, args.causal, args.warmup, args.repeats)
                else:
                    seconds = median_cuda_seconds(cupy, calls[impl], args.warmup, args.repeats)
                    peak = peak_cupy(cupy, calls[impl])
                row.update(seconds=seconds, tflops=flops / seconds / 1e12, peak_bytes=int(peak))
                if impl == "mma":
                    row["note"] = mma_difference(cupy, calls["mma"](), calls["kernel"]())
            except Exception as err:     # out of memory, missing cuBLAS, ...
                row["note"] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            cupy.get_default_memory_pool().free_all_blocks()
            if torch is not None:
                torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def mma_difference(xp, mma_grads, kernel_grads) -> str:
    """``max |mma - kernel| / max |kernel|`` of each gradient, as a note: the two backward kernels
    compute the same gradients and differ by the 16-bit rounding of P and dS (a few 1e-3 at most)."""
    parts = []
    for name, a, b in zip(("dq", "dk", "dv"), mma_grads, kernel_grads):
        a, b = a.astype(xp.float32), b.astype(xp.float32)
        parts.append(f"{name} {float(xp.abs(a - b).max() / max(float(xp.abs(b).max()), 1e-30)):.1e}")
    return "vs kernel: " + ", ".join(parts)


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


def format_row(row) -> str:
    head = f"{row['impl']:>7} {row['dtype']:>8} N={row['n']:>6} d={row['d']:>4}"
    if row["seconds"] is None:
        return f"{head}  {row['note']}"
    return (f"{head}  {row['seconds'] * 1e3:9.3f} ms  "
            f"{row['tflops']:7.2f} TFLOP/s  peak {row['peak_bytes'] / 2**20:9.1f} MiB")


def write_results(rows, out: Path, meta: dict) -> None:
    """results.json, results.csv, results.md (a table) and gpu_backward.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"attention backward, {meta['device']}, batch 1, {meta['heads']} heads"
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
    plot_results(rows, out / "gpu_backward.png", meta)


def plot_results(rows, path: Path, meta: dict) -> None:
    """Two rows of panels (time, peak memory) x one column per head dim; log2 N on x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_dims = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(head_dims), figsize=(5.2 * len(head_dims), 7.5), squeeze=False, sharex=True)
    style = {"naive": ("tab:red", "o", "naive CuPy (P, dP, dS materialised)"),
             "kernel": ("tab:blue", "s", "RawKernels (P recomputed from lse)"),
             "mma": ("tab:purple", "D", "RawKernels on tensor cores (mma.sync)"),
             "torch": ("tab:green", "^", "torch SDPA backward")}
    for col, d in enumerate(head_dims):
        for dtype in DTYPES:
            for impl in IMPLS:
                pts = sorted((r["n"], r["seconds"], r["peak_bytes"]) for r in rows
                             if r["d"] == d and r["impl"] == impl and r["dtype"] == dtype and r["seconds"] is not None)
                if not pts:
                    continue
                color, marker, label = style[impl]
                line = dict(marker=marker, color=color, label=f"{label}, {dtype}",
                            linestyle="-" if dtype == "float16" else "--")
                n, sec, mem = zip(*pts)
                axes[0, col].plot(n, [s * 1e3 for s in sec], **line)
                axes[1, col].plot(n, [max(m, 1) / 2**20 for m in mem], **line)
        axes[0, col].set_title(f"d = {d}")
        axes[0, col].set_ylabel("backward time (ms, lower is better)")
        axes[1, col].set_ylabel("peak extra device memory (MiB)")
        axes[1, col].set_xlabel("sequence length N")
        sizes = sorted({r["n"] for r in rows})
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.grid(True, which="both", alpha=0.3)
        axes[0, col].legend(fontsize=8)
    fig.suptitle(f"Attention backward on {meta['device']}\nbatch 1, {meta['heads']} heads; "
                 f"solid float16, dashed float32" + (", causal" if meta["causal"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    cupy, reason = device_or_reason()
    if cupy is None:
        print(f"GPU benchmark not run: {reason}. The backward kernels still compile without a GPU: "
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

"""The attention backward on the GPU: naive CuPy (P materialised) vs the series' RawKernels vs torch SDPA.

    python benchmarks/gpu_backward.py [--out DIR] [--sizes 1024 2048 ...] [--head-dims 64 128]

For each storage dtype (``--dtypes``, default float16), sequence length N and head dim d
(batch 1, ``--heads`` heads), given q, k, v, dO and the forward's O and lse:

* ``naive``  - CuPy, float32: S = scale Q K^T, P = softmax(S), dV = P^T dO, dP = dO V^T,
  dS = P * (dP - rowsum(P * dP)), dQ = scale dS K, dK = scale dS^T Q; P, dP and dS are each
  (heads, N, N) in device memory;
* ``kernel`` - :func:`lessons.gpu.flash_attention_backward_gpu` (D, dK/dV and dQ kernels,
  float32 FMAs on CUDA cores; P recomputed from lse, never stored);
* ``mma``    - :func:`lessons.gpu.flash_attention_backward_mma_gpu` (the same three passes with
  every product on tensor cores, mma.sync m16n8k16; float16 with d = 64 or 128 only); its note
  gives its largest difference from ``kernel``, relative to the largest gradient;
* ``torch``  - the backward of ``torch.nn.functional.scaled_dot_product_attention``
  (``torch.autograd.grad`` on a retained graph), where torch with CUDA is installed.

Reported: median time of ``--repeats`` backward calls after ``--warmup`` (CUDA events, seconds);
TFLOP/s counting the backward's 5 matmuls, 10 N^2 d flops per head (halved when causal; the
kernel's separate dQ pass actually does 14 N^2 d); peak device memory allocated during one
backward call beyond its inputs (bytes: CuPy through a memory hook on its pool, torch through
max_memory_allocated). Writes results.json, results.csv, results.md and gpu_backward.png into
``--out``. Without a CUDA device it prints why and exits 0. ``--replot CSV`` draws the plot again from a
recorded ``results.csv`` (no GPU needed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402
from benchmarks._common import format_row, timed_rows, torch_seconds_and_peak  # noqa: E402,F401
from lessons.gpu.measure import backward_flops, naive_backward, sdpa_backward  # noqa: E402,F401

IMPLS = ("naive", "kernel", "mma", "torch")
DTYPES = ("float16", "float32")


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
    p.add_argument("--replot", type=Path, metavar="CSV",
                   help="draw gpu_backward.png again from a recorded results.csv, beside it (nothing is measured)")
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds; configurations not started by then are recorded as skipped")
    args = p.parse_args(argv)
    for name in ("heads", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args


def run_torch(torch, q, k, v, do, causal, warmup, repeats):
    """Median seconds and peak extra bytes of SDPA's backward (the forward is run once, outside)."""
    return torch_seconds_and_peak(torch, sdpa_backward(torch, q, k, v, do, causal), warmup, repeats)


def run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0):
    """The rows of one (dtype, d, N): each implementation timed, or the reason it was not."""
    import numpy as np

    import lessons.gpu as gpu

    shape = (args.heads, n, d)
    q, k, v, do = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(4))
    o, lse = gpu.flash_attention_gpu(q, k, v, causal=args.causal)
    flops = backward_flops(n, d, args.heads, args.causal)
    calls = {
        "naive": lambda: naive_backward(cupy, q, k, v, do, args.causal),
        "kernel": lambda: gpu.flash_attention_backward_gpu(q, k, v, o, lse, do, causal=args.causal),
        "mma": lambda: gpu.flash_attention_backward_mma_gpu(q, k, v, o, lse, do, causal=args.causal),
        "torch": lambda: run_torch(torch, q, k, v, do, args.causal, args.warmup, args.repeats),
    }

    def skip(impl):
        if impl == "torch" and torch is None:
            return torch_reason
        if impl == "mma" and (dtype != "float16" or d not in (64, 128)):
            return "the tensor-core backward takes float16 with d = 64 or 128"
        return None

    rows = timed_rows(args, cupy, torch, IMPLS, calls, dtype=dtype, d=d, n=n, flops=flops, t0=t0, skip=skip)
    for row in rows:
        if row["impl"] == "mma" and row["seconds"] is not None:
            row["note"] = mma_difference(cupy, calls["mma"](), calls["kernel"]())
            print(f"{'':>7} {row['note']}", flush=True)
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def mma_difference(xp, mma_grads, kernel_grads) -> str:
    """``max |mma - kernel| / max |kernel|`` of each gradient, as a note: the two backward kernels
    compute the same gradients and differ by the 16-bit rounding of P and dS (a few 1e-3 at most)."""
    parts = []
    for name, a, b in zip(("dq", "dk", "dv"), mma_grads, kernel_grads):
        a, b = a.astype(xp.float32), b.astype(xp.float32)
        parts.append(f"{name} {float(xp.abs(a - b).max() / max(float(xp.abs(b).max()), 1e-30)):.1e}")
    return "vs kernel: " + ", ".join(parts)


def write_results(rows, out: Path, meta: dict) -> None:
    """results.json, results.csv, results.md (a table) and gpu_backward.png in ``out``."""
    _common.write_results(rows, out, meta, what="attention backward")
    plot_results(rows, out / "gpu_backward.png", meta)


def plot_results(rows, path: Path, meta: dict) -> None:
    """Two rows of panels (time, peak memory) x one column per head dim; log2 N on x."""
    from lessons.views.backward import IMPL_COLOURS, IMPL_MARKERS    # the notebook's colours and markers

    labels = {"naive": "naive CuPy (P, dP, dS materialised)", "kernel": "RawKernels (P recomputed from lse)",
              "mma": "RawKernels on tensor cores (mma.sync)", "torch": "torch SDPA backward"}
    style = {impl: (IMPL_COLOURS[impl], IMPL_MARKERS[impl], label) for impl, label in labels.items()}
    _common.plot_results(rows, path, impls=IMPLS, dtypes=DTYPES, style=style,
                         speed=(lambda r: r["seconds"] * 1e3, "backward time (ms, lower is better)"),
                         title=f"Attention backward on {meta['device']}\nbatch 1, {meta['heads']} heads; "
                               f"{_common.dtype_caption(rows)}" + (", causal" if meta["causal"] else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(f"wrote {_common.replot(args.replot, plot_results, 'gpu_backward.png')}")
        return 0
    return _common.main(args, run_size, write_results, kernels="backward kernels")


if __name__ == "__main__":
    sys.exit(main())

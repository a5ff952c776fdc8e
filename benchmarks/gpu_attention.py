"""Attention on the GPU: naive CuPy vs the series' RawKernel vs torch's scaled_dot_product_attention.

    python benchmarks/gpu_attention.py [--out DIR] [--sizes 1024 2048 ...] [--head-dims 64 128]

For each storage dtype (``--dtypes``, default float16 and float32), sequence length N and
head dim d (batch 1, ``--heads`` heads):

* ``naive``  - CuPy: S = scale * Q K^T in float32 (N x N per head), softmax, then P V;
* ``kernel`` - :func:`lessons.gpu.flash_attention_gpu` (FlashAttention-2 loop, float32 FMAs
  on CUDA cores, no tensor cores: a lesson, not a tuned kernel);
* ``regtile`` - :func:`lessons.gpu.flash_attention_regtile_gpu` (the same loop register-tiled:
  each thread a block of S and O, 16-byte shared loads; float32 only);
* ``regtile_wide`` - :func:`lessons.gpu.flash_attention_regtile_wide_gpu` (``regtile`` with 16 lanes per row
  group: each thread 8 rows x 4 keys of S, P read 4 keys at a time; float32 only);
* ``mma_async`` - :func:`lessons.gpu.flash_attention_mma_async_gpu` (the tensor-core kernel with
  cp.async double-buffered K/V tiles and ldmatrix fragment loads; float16 only);
* ``mma_fa2`` - :func:`lessons.gpu.flash_attention_mma_fa2_gpu` (the tensor-core kernel along
  FlashAttention-2's recipe: 128-row blocks over 8 warps at d = 64, ldmatrix.x4 from swizzled
  shared memory, exp2; float16 only, d = 64 or 128);
* ``mma_fa2_lazy`` - :func:`lessons.gpu.flash_attention_mma_fa2_lazy_gpu` (``mma_fa2`` rescaling o only
  on tiles where a row's max moved, with 64-key tiles at d = 128 in dynamic shared memory; as ``mma_fa2``
  otherwise);
* ``mma_fa2_wide`` - :func:`lessons.gpu.flash_attention_mma_fa2_wide_gpu` (``mma_fa2_lazy`` with 32 query rows
  per warp, FlashAttention-2's warp shape: each K/V fragment feeds two mmas; Q read from shared memory);
* ``mma_fa2_lean`` - :func:`lessons.gpu.flash_attention_mma_fa2_lean_gpu` (``mma_fa2_wide`` whose key tiles that need
  no mask run in a loop compiled without mask code, copied without per-chunk bounds tests, with V's inf/NaN test
  moved into a pre-pass kernel that flags V's tiles; the pre-pass is timed with it);
* ``wgmma`` - :func:`lessons.gpu.flash_attention_wgmma_gpu` (the Hopper rung: TMA copies into a
  2-stage mbarrier pipeline, wgmma products, a producer and two consumer warpgroups; float16
  only, d = 64 or 128, compute capability 9.0 only);
* ``wgmma_overlap`` - :func:`lessons.gpu.flash_attention_wgmma_overlap_gpu` (the Hopper rung with
  each tile's softmax overlapped with the previous tile's P V, 3 stages; as ``wgmma`` otherwise);
* ``wgmma_pingpong`` - :func:`lessons.gpu.flash_attention_wgmma_pingpong_gpu` (``wgmma_overlap`` with the
  two consumer warpgroups taking turns to issue their products);
* ``mma``    - :func:`lessons.gpu.flash_attention_mma_gpu` (the same loop on tensor cores,
  ``mma.sync.m16n8k16``; float16 only);
* ``torch``  - ``torch.nn.functional.scaled_dot_product_attention`` (FlashAttention or
  cuDNN kernels on tensor cores for float16), where torch with CUDA is installed.

Reported: median time of ``--repeats`` runs after ``--warmup`` runs, measured with CUDA
events (seconds); TFLOP/s counting 4 N^2 d flops per head (2 for Q K^T, 2 for P V;
halved when causal); peak device memory allocated during one call beyond the inputs
(bytes: CuPy through a memory hook on its pool, torch through max_memory_allocated).
A rung named in ``$GPU_CHECK_LEFT_OUT`` (:func:`lessons.gpu.ladder.rungs_left_out`: ``scripts/gpu_check.sh``
names each rung whose first run on this machine failed) is not run: its rows say why, so that a kernel that
hangs or faults cannot take the CUDA context, and the timings of every rung after it, with it.
Writes results.json, results.csv, results.md and gpu_attention.png into ``--out``.
Without a CUDA device it prints why and exits 0. ``--replot CSV`` draws the plot again from a
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
from lessons.gpu.ladder import HOPPER_RUNGS, LEFT_OUT_REASON, RUNGS, rungs_left_out  # noqa: E402
from lessons.gpu.measure import attention_flops  # noqa: E402  (4 N^2 d per head, half when causal)

#: (torch SDPA, the reference every ratio is taken against, comes second: a spent time budget skips the last rows)
IMPLS = ("naive", "torch", "kernel", "regtile", "regtile_wide", "mma", "mma_async", "mma_fa2", "mma_fa2_lazy",
         "mma_fa2_wide", "mma_fa2_lean", "wgmma", "wgmma_overlap", "wgmma_pingpong")
DTYPES = ("float16", "float32")
#: the ladder's name of each implementation timed here where the two differ ("kernel" is the scalar rung)
RUNG_OF_IMPL = {r.impl: r.name for r in RUNGS if r.impl is not None and r.impl != r.name}


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
    p.add_argument("--replot", type=Path, metavar="CSV",
                   help="draw gpu_attention.png again from a recorded results.csv, beside it (nothing is measured)")
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds; configurations not started by then are recorded as skipped")
    args = p.parse_args(argv)
    for name in ("heads", "warmup", "repeats"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def run_torch(torch, q, k, v, causal, warmup, repeats):
    """Median seconds and peak extra bytes of torch's scaled_dot_product_attention."""
    import torch.nn.functional as F

    tq, tk, tv = (torch.as_tensor(x, device="cuda").unsqueeze(0) for x in (q, k, v))   # (1, H, N, d)
    return torch_seconds_and_peak(torch, lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal),
                                  warmup, repeats)


def run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0):
    """The rows of one (dtype, d, N): each implementation timed, or the reason it was not."""
    import numpy as np

    import lessons.gpu as gpu
    from lessons.gpu.measure import naive_attention

    shape = (args.heads, n, d)
    q, k, v = (cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(3))
    flops = attention_flops(n, d, args.heads, args.causal)
    calls = {
        "naive": lambda: naive_attention(cupy, q, k, v, args.causal),
        "kernel": lambda: gpu.flash_attention_gpu(q, k, v, causal=args.causal),
        "mma": lambda: gpu.flash_attention_mma_gpu(q, k, v, causal=args.causal),
        "regtile": lambda: gpu.flash_attention_regtile_gpu(q, k, v, causal=args.causal),
        "regtile_wide": lambda: gpu.flash_attention_regtile_wide_gpu(q, k, v, causal=args.causal),
        "mma_async": lambda: gpu.flash_attention_mma_async_gpu(q, k, v, causal=args.causal),
        "mma_fa2": lambda: gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=args.causal),
        "mma_fa2_lazy": lambda: gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v, causal=args.causal),
        "mma_fa2_wide": lambda: gpu.flash_attention_mma_fa2_wide_gpu(q, k, v, causal=args.causal),
        "mma_fa2_lean": lambda: gpu.flash_attention_mma_fa2_lean_gpu(q, k, v, causal=args.causal),
        "wgmma": lambda: gpu.flash_attention_wgmma_gpu(q, k, v, causal=args.causal),
        "wgmma_overlap": lambda: gpu.flash_attention_wgmma_overlap_gpu(q, k, v, causal=args.causal),
        "wgmma_pingpong": lambda: gpu.flash_attention_wgmma_pingpong_gpu(q, k, v, causal=args.causal),
        "torch": lambda: run_torch(torch, q, k, v, args.causal, args.warmup, args.repeats),
    }

    def skip(impl):
        if impl == "torch" and torch is None:
            return torch_reason
        hopper = impl in HOPPER_RUNGS
        if (impl in ("mma", "mma_async", "mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean") or hopper) \
                and dtype != "float16":
            return "tensor cores take float16/bfloat16"
        if hopper and gpu.device_arch() != "sm_90":
            return "the Hopper rungs (wgmma, TMA) run on compute capability 9.0 only"
        if (impl in ("mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean") or hopper) and d not in (64, 128):
            return "this kernel takes head dims 64 and 128"
        if impl in ("regtile", "regtile_wide") and dtype != "float32":
            return "the register-tiled kernel takes float32"
        if RUNG_OF_IMPL.get(impl, impl) in rungs_left_out():       # (gpu_check.sh's first run failed here)
            return LEFT_OUT_REASON
        return None

    return timed_rows(args, cupy, torch, IMPLS, calls, dtype=dtype, d=d, n=n, flops=flops, t0=t0, skip=skip)


def write_results(rows, out: Path, meta: dict) -> None:
    """results.json, results.csv, results.md (a table) and gpu_attention.png in ``out``."""
    _common.write_results(rows, out, meta, what="attention forward")
    plot_results(rows, out / "gpu_attention.png", meta)


def plot_results(rows, path: Path, meta: dict) -> None:
    """Two rows of panels (TFLOP/s, peak memory) x one column per head dim; log2 N on x."""
    style = {"naive": ("tab:red", "o", "naive CuPy (S materialised)"),
             "kernel": ("tab:blue", "s", "RawKernel, CUDA cores"),
             "mma": ("tab:purple", "D", "RawKernel, tensor cores"),
             "regtile": ("tab:cyan", "v", "RawKernel, CUDA cores, register-tiled"),
             "regtile_wide": ("#9edae5", ">", "RawKernel, CUDA cores, register-tiled, 16-lane row groups"),
             "mma_async": ("tab:olive", "P", "RawKernel, tensor cores + ldmatrix + cp.async"),
             "mma_fa2": ("tab:brown", "X", "RawKernel, tensor cores, FA-2 recipe"),
             "mma_fa2_lazy": ("gold", "d", "RawKernel, tensor cores, FA-2 + lazy rescaling"),
             "mma_fa2_wide": ("tab:blue", "<", "RawKernel, tensor cores, FA-2 + 32 rows per warp"),
             "mma_fa2_lean": ("#dbdb8d", "8", "RawKernel, tensor cores, FA-2 + lean interior tiles"),
             "wgmma": ("tab:pink", "*", "RawKernel, Hopper: TMA + wgmma"),
             "wgmma_overlap": ("tab:gray", "h", "RawKernel, Hopper: + softmax overlapped"),
             "wgmma_pingpong": ("black", "p", "RawKernel, Hopper: + ping-pong consumers"),
             "torch": ("tab:green", "^", "torch SDPA")}
    _common.plot_results(rows, path, impls=IMPLS, dtypes=DTYPES, style=style,
                         speed=(lambda r: r["tflops"], "TFLOP/s (higher is better)"),
                         title=f"Attention forward on {meta['device']}\nbatch 1, {meta['heads']} heads; "
                               f"{_common.dtype_caption(rows)}" + (", causal" if meta["causal"] else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        print(f"wrote {_common.replot(args.replot, plot_results, 'gpu_attention.png')}")
        return 0
    return _common.main(args, run_size, write_results)


if __name__ == "__main__":
    sys.exit(main())

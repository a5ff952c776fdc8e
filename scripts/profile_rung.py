"""One launch of one rung of the kernel ladder, for Nsight Compute to profile.

    ncu --clock-control none -k "$(python scripts/profile_rung.py RUNG --entry)" --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight ... python scripts/profile_rung.py RUNG [--d 128]

RUNG is a forward rung with a kernel of ours (``lessons.gpu.ladder.RUNGS``: scalar, regtile, regtile_wide, mma,
mma_async, mma_fa2, mma_fa2_lazy, mma_fa2_wide, mma_fa2_lean, wgmma, wgmma_overlap, wgmma_pingpong) or a decode
rung,
``paged_decode_split``, ``paged_decode_prefetch`` or ``paged_decode_cp_async``.
The script runs the rung's launcher twice on random inputs: the first launch compiles and warms up,
the second is the one to profile (``--launch-skip 1``). Forward rungs: N = ``--n`` queries and keys
(default 8192), ``--heads`` heads (8), head dim ``--d`` (128), in the rung's dtype (float32 for the
CUDA-core rungs, float16 for the tensor-core ones), as the recorded benchmark runs them. The decode
rungs: 64 sequences x 4096 tokens, fp16, 32 query heads on 8 KV heads, d = 128, pages of 16 scattered
over the cache, as ``benchmarks/gpu_decode.py`` runs it. ``--entry`` prints the name of the kernel to
filter on and exits. ``--emulator`` runs the same at a small size on the CPU emulator (a check of this
script; it profiles nothing). ``scripts/gpu_check.sh`` runs it under ncu for the rungs it profiles.
Exit status 0, or 2 when there is no CUDA device (and ``--emulator`` was not given).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lessons.gpu as gpu  # noqa: E402
from lessons.gpu import ladder  # noqa: E402

#: the decode rungs this script can run, and the name of their kernel
DECODE_ENTRIES = {n: ladder.decode_rung_entry(n) for n in ("paged_decode_split", "paged_decode_prefetch",
                                                             "paged_decode_cp_async")}
FORWARD_RUNGS = tuple(r.name for r in ladder.RUNGS if r.kernel is not None)


def entry(rung: str, d: int) -> str:
    """The kernel name Nsight Compute should filter on for ``rung`` at head dim ``d``."""
    return DECODE_ENTRIES[rung] if rung in DECODE_ENTRIES else ladder.rung_entry(rung, d)


def _normal(xp, rng, shape, dtype):
    """Standard normal values of ``shape`` in ``dtype``: drawn on the device when ``xp`` is CuPy (a
    decode cache is a gigabyte; no host copy of it in float64), else by the NumPy generator ``rng``."""
    if xp is np:
        return rng.standard_normal(shape).astype(dtype)
    return xp.random.standard_normal(shape, dtype=np.float32).astype(dtype)


def forward_inputs(xp, rung: str, n: int, heads: int, d: int, seed: int = 0):
    """q, k, v of shape (heads, n, d) in the rung's dtype, on the device (``xp`` CuPy) or the host."""
    rng = np.random.default_rng(seed)
    dtype = ladder.rung(rung).dtype
    return tuple(_normal(xp, rng, (heads, n, d), dtype) for _ in range(3))


def decode_inputs(xp, num_seqs: int, seq_len: int, seed: int = 0):
    """q (num_seqs, 32, 128), k and v caches (pages of 16, 8 KV heads, 128), scattered block tables and
    full-length seq_lens, fp16 / int32, as ``benchmarks/gpu_decode.py`` builds them."""
    rng = np.random.default_rng(seed)
    pages = -(-seq_len // 16)
    num_blocks = num_seqs * pages
    k_cache, v_cache = (_normal(xp, rng, (num_blocks, 16, 8, 128), np.float16) for _ in range(2))
    tables = xp.asarray(rng.permutation(num_blocks).reshape(num_seqs, pages).astype(np.int32))
    lens = xp.asarray(np.full(num_seqs, seq_len, np.int32))
    q = _normal(xp, rng, (num_seqs, 32, 128), np.float16)
    return q, k_cache, v_cache, tables, lens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rung", choices=FORWARD_RUNGS + tuple(DECODE_ENTRIES))
    p.add_argument("--d", type=int, default=128, choices=(64, 128), help="head dim of a forward rung")
    p.add_argument("--n", type=int, default=8192, help="queries and keys of a forward rung")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--entry", action="store_true", help="print the kernel name to profile and exit")
    p.add_argument("--emulator", action="store_true", help="run at a small size on the CPU emulator instead")
    args = p.parse_args(argv)
    if args.entry:
        print(entry(args.rung, args.d))
        return 0
    if args.emulator:
        backend, xp = "emulator", np
        n, heads, num_seqs, seq_len = 200, 1, 2, 100
    else:
        if not gpu.device_available():
            print("no CUDA device: nothing to profile")
            return 2
        import cupy

        backend, xp = "cupy", cupy
        n, heads, num_seqs, seq_len = args.n, args.heads, 64, 4096
    if args.rung in DECODE_ENTRIES:
        inputs = decode_inputs(xp, num_seqs, seq_len)
        launch = getattr(gpu, ladder.decode_rung(args.rung).launcher.rsplit(".", 1)[1])
        options = ladder.DECODE_LAUNCH_OPTIONS.get(args.rung, {})
        run = lambda: launch(*inputs, check_tables=False, backend=backend, **options)      # noqa: E731
    else:
        inputs = forward_inputs(xp, args.rung, n, heads, args.d)
        launch = getattr(gpu, ladder.rung(args.rung).launcher.rsplit(".", 1)[1])
        run = lambda: launch(*inputs, backend=backend)                          # noqa: E731
    for _ in range(2):                               # compile and warm up, then the launch to profile
        out = run()[0]
    if backend == "cupy":
        xp.cuda.Device().synchronize()
    finite = bool(np.isfinite(np.asarray(out.get() if hasattr(out, "get") else out, np.float64)).all())
    print(f"ran {args.rung} ({entry(args.rung, args.d)}) twice on {backend}; output finite: {finite}")
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())

"""First contact of the Hopper rungs with a GPU: their two products alone, then one small forward each.

    python scripts/hopper_smoke.py [--emulator]

The Hopper rung (``flash_attention_wgmma.cu``) was built and checked on the CPU emulator; the emulator
does TMA, mbarriers and wgmma by the author's reading of the PTX ISA. A misreading could give wrong
numbers or, worse, a copy that never completes and a kernel that never ends. ``scripts/gpu_check.sh``
runs this script first, under a short time limit, and skips the rung in its later steps (benchmark,
tests, sanitizer) when it fails, so one wrong layout cannot eat the GPU time of every other check.

It prints, for d = 64 and 128: the largest error of ``wgmma_probe_gpu`` (S = A B^T with both operands
through TMA and the K-major descriptor; O = S16 V through the MN-major one) and of a causal forward of
each Hopper rung (``flash_attention_wgmma_gpu``, ``flash_attention_wgmma_overlap_gpu``,
``flash_attention_wgmma_pingpong_gpu``) against NumPy's attention; with ``--rung NAME``, of that rung
only (the probe goes with ``wgmma``), so that ``gpu_check.sh`` can run each rung in its own process under
its own time limit and leave out only the rungs that fail or hang. Exit status 0 when all are within
tolerance, 1 otherwise, 2 when there is no device of compute capability 9.0 (and ``--emulator`` was not
given).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lessons  # noqa: E402
import lessons.gpu as gpu  # noqa: E402
from lessons.gpu import ladder  # noqa: E402
from lessons.gpu.source import WGMMA_CONFIGS  # noqa: E402


def check(label: str, got, want, atol: float) -> bool:
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    ok = bool(np.isfinite(err) and err <= atol)
    print(f"{label:<44} max |diff| {err:.2e} (tolerance {atol:.0e}): {'ok' if ok else 'WRONG'}", flush=True)
    return ok


#: each Hopper rung's forward, as the ladder names it
FORWARDS = {name: getattr(gpu, ladder.rung(name).launcher.rsplit(".", 1)[1]) for name in ladder.HOPPER_RUNGS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulator", action="store_true", help="run on the CPU emulator instead")
    parser.add_argument("--rung", choices=sorted(FORWARDS), action="append",
                        help="check this rung only (repeatable; default: all three; the probe goes with wgmma)")
    args = parser.parse_args(argv)
    rungs = [r for r in FORWARDS if r in (args.rung or FORWARDS)]
    backend = "emulator" if args.emulator else "cupy"
    if not args.emulator and not (gpu.device_available() and gpu.device_arch() == "sm_90"):
        print("no CUDA device of compute capability 9.0: nothing to check")
        return 2
    rng = np.random.default_rng(0)
    ok = True
    for d, (_, bk) in WGMMA_CONFIGS.items():
        a, b, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((64, d), (bk, d), (bk, d)))
        if "wgmma" in rungs:
            s, o = gpu.wgmma_probe_gpu(a, b, v, backend=backend)
            s_ref = a.astype(np.float64) @ b.astype(np.float64).T
            ok &= check(f"d={d} probe S = A B^T (K-major, TMA)", s, s_ref, 1e-2)
            ok &= check(f"d={d} probe O = S16 V (MN-major)", o, np.asarray(s, np.float16).astype(np.float64) @ v,
                        5e-2)
        q, k, vv = (rng.standard_normal((2, n, d)).astype(np.float16) for n in (200, 300, 300))
        ref = np.stack([lessons.attention(*(x[h].astype(np.float64) for x in (q, k, vv)), causal=True)
                        for h in range(2)])
        for name in rungs:
            out, _ = FORWARDS[name](q, k, vv, causal=True, backend=backend)
            ok &= check(f"d={d} {name} 200 x 300, causal, 2 heads", out, ref, 5e-3)
    what = ", ".join(rungs)
    print(f"works here: {what}" if ok else f"WRONG HERE: {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

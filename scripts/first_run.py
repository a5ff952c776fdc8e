"""First contact with a GPU of every rung that has never run on one: a few small launches each, against NumPy.

    python scripts/first_run.py [--rung NAME ...] [--emulator]

What it checks. The rungs of :func:`lessons.gpu.ladder.first_run_rungs`: the forward rungs with a kernel of ours
and no recorded GPU row, then the decode rungs the recorded decode run lacks (today regtile_wide, mma_fa2_lazy,
mma_fa2_wide, mma_fa2_lean, wgmma, wgmma_overlap, wgmma_pingpong, paged_decode_prefetch,
paged_decode_cp_async). ``--rung NAME`` (repeatable) checks
those rungs only; by default all of them, in ladder order. Per rung, one line per check (the largest
difference from the reference, the tolerance, ok or WRONG):

* the Hopper rungs (wgmma, wgmma_overlap, wgmma_pingpong), at d = 64 and 128: with ``wgmma``, first its two
  products alone (``wgmma_probe_gpu``: S = A B^T with both operands through TMA and the K-major descriptor;
  O = S16 V through the MN-major one); then a causal forward of the rung, 2 heads, 200 queries x 300 keys,
  float16;
* the other forward rungs (regtile_wide in float32, mma_fa2_lazy, mma_fa2_wide and mma_fa2_lean in float16: the
  rung's dtype in the ladder; the lean rung's launcher runs its pre-pass kernel too), at d = 64 and 128: the same causal forward; then one launch of 1 head x 1024 queries
  x 1024 keys at d = 128, not causal: many blocks, every tile full (256 x 256 with ``--emulator``: there
  1024 x 1024 takes about 45 s for each FA-2 rung on two cores);
* the decode rungs (paged_decode_prefetch: ``paged_decode_split_gpu(..., prefetch=True)``; paged_decode_cp_async:
  ``cp_async=True``): fp16, 32 query heads
  on 8 KV heads, d = 128, pages of 16, five sequences of 517, 64, 37, 1 and 0 tokens whose pages lie scattered
  in the cache, every slot past a sequence's end and every unused page holding NaN (a read of one would show),
  with the launcher's own split count and with 3 splits; output and lse.

Every forward is checked against :func:`lessons.attention` in float64 on the same (rounded) inputs, the decode
rung against the same attention per sequence and query head over the keys its block table names (as
tests/test_gpu_kernels.py's ``decode_reference`` computes it); tolerance 1e-5 for float32 output, 5e-3 for
float16 output, 1e-4 for the lse (float32 in every kernel). A launch that raises (a CUDA error, an illegal
address) counts as wrong. The last line reads ``works here: NAMES`` when every rung checked is within
tolerance, else ``WRONG HERE: NAMES`` (the rungs that are not); a rung that cannot run on this device is named
after ``cannot run here:``, with the reason.

Why. These kernels were built and checked on the CPU emulator only, and the emulator runs them by the author's
reading of the PTX ISA (TMA, mbarriers, wgmma) and of CUDA. A misreading could give wrong numbers or, worse,
a copy that never completes, a kernel that never ends, an illegal address that takes the CUDA context with
it, and in a benchmark process every rung timed after it. ``scripts/gpu_check.sh`` runs this script first,
once per rung, each in its own process under its own time limit, and names each rung that fails, hangs or
cannot run in ``GPU_CHECK_LEFT_OUT``; its later steps (benchmarks, sweeps, tests, sanitizer, Nsight Compute)
leave those rungs out (:func:`lessons.gpu.ladder.rungs_left_out`), so one wrong layout cannot spend the GPU
time, or the results, of every other check.

A launch that never ends (a copy that never lands, an mbarrier phase nobody completes, a named barrier one
warpgroup never reaches) ends this process: each launch, with the compile its first call does, gets
``--hang-seconds`` (default 30 on a GPU; none with ``--emulator``, whose launches take minutes, unless given;
at most a day).
Past that, Python's ``faulthandler`` writes every thread's stack to stderr (its first line ``Timeout (0:00:30)!``,
then the line of this script whose launch hung) and exits with status 1, from a thread of its own that needs
neither the interpreter lock nor the blocked CUDA call to return. So a Hopper rung that deadlocks costs its
process about that long, not the whole time limit ``scripts/gpu_check.sh`` gives it.

Exit status: 0 when every rung asked for ran and is within tolerance; 1 when one is not (or a launch raised, or
hung); 2 when none is wrong but one cannot run here: the Hopper rungs need a device of compute capability 9.0, the
others one of 8.0 or newer (the architectures the series compiles for), and ``--emulator`` was not given.
``--emulator`` runs everything on the CPU emulator instead (a check of this script).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import inspect
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lessons  # noqa: E402
import lessons.gpu as gpu  # noqa: E402
from lessons.gpu import ladder  # noqa: E402
from lessons.gpu.source import WGMMA_CONFIGS  # noqa: E402

#: the rungs this script knows, in ladder order
RUNGS = ladder.first_run_rungs()
HOPPER = frozenset(ladder.HOPPER_RUNGS)
DECODE = frozenset(r.name for r in ladder.DECODE_RUNGS)
#: largest |difference| allowed per output dtype (the lse is float32 in every kernel)
TOLERANCE = {"float32": 1e-5, "float16": 5e-3}
LSE_TOLERANCE = 1e-4
#: seconds one launch may take on a GPU, with the NVRTC compile and module load of its first call, before this
#: process ends itself (a few seconds are plenty; a launch that is still running then is taken as hung)
HANG_SECONDS = 30.0
#: the largest bound --hang-seconds takes: a day (faulthandler's timer overflows the platform's time_t far above it)
MAX_HANG_SECONDS = 86400.0
#: the bound in force (main sets it from --hang-seconds; None: no bound)
_hang_seconds: float | None = None


@contextlib.contextmanager
def bounded():
    """Run the body (a launch and the copy of its results to the host) under the hang bound: past
    ``_hang_seconds`` faulthandler dumps every thread's stack to the process's stderr and exits it with status 1.
    Nothing when no bound is set (or the process has no stderr)."""
    if _hang_seconds is None or sys.__stderr__ is None:
        yield
        return
    faulthandler.dump_traceback_later(_hang_seconds, exit=True, file=sys.__stderr__)   # (fd 2, even under capture)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
#: the causal forward of every forward rung: heads, queries, keys
SMALL = (2, 200, 300)
#: the full-tile launch of the non-Hopper forward rungs: queries = keys, one head, d = 128 (smaller on the emulator)
BIG_N, BIG_N_EMULATOR, BIG_D = 1024, 256, 128
#: the decode check: the sequences' lengths; query heads, KV heads, head dim, page size
DECODE_SEQ_LENS = (517, 64, 37, 1, 0)
DECODE_HEADS, DECODE_KV_HEADS, DECODE_D, DECODE_PAGE = 32, 8, 128, 16


def check(label: str, got, want, atol: float) -> bool:
    """Print and return whether ``got`` is within ``atol`` of ``want`` everywhere (equal infinities, such as an
    empty sequence's lse of -inf, count as no difference; a NaN where ``want`` has none is wrong)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        print(f"{label:<72} shape {got.shape}, expected {want.shape}: WRONG", flush=True)
        return False
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        diff = np.where(same, 0.0, np.abs(got - want))
    err = float(diff.max()) if diff.size else 0.0
    ok = bool(np.isfinite(err) and err <= atol)
    print(f"{label:<72} max |diff| {err:.2e} (tolerance {atol:.0e}): {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def launcher(name: str):
    """The launcher of rung ``name`` (a function of :mod:`lessons.gpu`) and the keywords that make it this rung's
    build (the prefetch rung: ``prefetch=True``)."""
    r = ladder.decode_rung(name) if name in DECODE else ladder.rung(name)
    return getattr(gpu, r.launcher.rsplit(".", 1)[1]), dict(ladder.DECODE_LAUNCH_OPTIONS.get(name, {}))


def attention64(q, k, v, causal: bool):
    """float64 attention of each head of (heads, n, d) arrays, and its lse."""
    pairs = [lessons.attention(*(x[h].astype(np.float64) for x in (q, k, v)), causal=causal, return_lse=True)
             for h in range(q.shape[0])]
    return np.stack([o for o, _ in pairs]), np.stack([lse for _, lse in pairs])


def check_forward(label: str, run, rng, heads: int, nq: int, nk: int, d: int, dtype: str, causal: bool) -> bool:
    q, k, v = (rng.standard_normal((heads, n, d)).astype(dtype) for n in (nq, nk, nk))
    with bounded():
        out, lse = run(q, k, v, causal=causal)[:2]
    ref, ref_lse = attention64(q, k, v, causal)
    ok = check(f"{label} out", out, ref, TOLERANCE[dtype])
    return check(f"{label} lse", lse, ref_lse, LSE_TOLERANCE) and ok


def check_hopper(name: str, backend: str, rng) -> bool:
    run, _ = launcher(name)
    call = lambda *x, **kw: run(*x, backend=backend, **kw)      # noqa: E731
    ok = True
    for d, (_, bk) in WGMMA_CONFIGS.items():
        if name == "wgmma":
            a, b, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((64, d), (bk, d), (bk, d)))
            with bounded():
                s, o = gpu.wgmma_probe_gpu(a, b, v, backend=backend)
            s_ref = a.astype(np.float64) @ b.astype(np.float64).T
            ok &= check(f"wgmma d={d} probe S = A B^T (K-major, TMA)", s, s_ref, 1e-2)
            ok &= check(f"wgmma d={d} probe O = S16 V (MN-major)", o,
                        np.asarray(s, np.float16).astype(np.float64) @ v, 5e-2)
        heads, nq, nk = SMALL
        ok &= check_forward(f"{name} d={d} {nq} x {nk}, causal, {heads} heads, float16", call, rng, heads, nq, nk, d,
                            "float16", True)
    return ok


def check_forward_rung(name: str, backend: str, rng) -> bool:
    run, _ = launcher(name)
    dtype = ladder.rung(name).dtype
    call = lambda *x, **kw: run(*x, backend=backend, **kw)      # noqa: E731
    ok = True
    heads, nq, nk = SMALL
    for d in (64, 128):
        ok &= check_forward(f"{name} d={d} {nq} x {nk}, causal, {heads} heads, {dtype}", call, rng, heads, nq, nk, d,
                            dtype, True)
    n = BIG_N_EMULATOR if backend == "emulator" else BIG_N
    ok &= check_forward(f"{name} d={BIG_D} {n} x {n}, 1 head, {dtype}", call, rng, 1, n, n, BIG_D, dtype, False)
    return ok


def paged_cache(rng, seq_lens, num_heads, num_kv_heads, d, block_size):
    """``(q, k_cache, v_cache, tables, lens)`` in float16 and the float64 reference ``(out, lse)`` per sequence
    and query head: the sequences stored in one shuffled page pool by
    :func:`lessons.schedules.gqa_decode.write_paged_batch` (a quarter of spare pages), the reference from
    :func:`lessons.paged_decode` on the same float16 values. Each slot past a sequence's end, each unused page
    and each table entry past a sequence's pages (-1; every row has at least one) is never to be read, so the
    cache holds NaN there."""
    from lessons.schedules.gqa_decode import write_paged_batch

    def stored(n, heads):                          # float16 values, held in float64 for the reference
        return rng.standard_normal((n, heads, d)).astype(np.float16).astype(np.float64)

    keys, values = [stored(n, num_kv_heads) for n in seq_lens], [stored(n, num_kv_heads) for n in seq_lens]
    k64, v64, tables, lens = write_paged_batch(keys, values, block_size, seed=int(rng.integers(2**31)))
    tables = np.pad(tables, ((0, 0), (0, 1)), constant_values=-1).astype(np.int32)
    q64 = stored(len(seq_lens), num_heads)
    out, lse = lessons.paged_decode(q64, k64, v64, tables, lens, return_lse=True)
    args = (q64.astype(np.float16), k64.astype(np.float16), v64.astype(np.float16), tables, lens.astype(np.int32))
    return args, (out, lse)


def check_decode(name: str, backend: str, rng) -> bool:
    run, options = launcher(name)
    args, (ref, ref_lse) = paged_cache(rng, DECODE_SEQ_LENS, DECODE_HEADS, DECODE_KV_HEADS, DECODE_D, DECODE_PAGE)
    splits = [None] + ([3] if "num_splits" in inspect.signature(run).parameters else [])
    shape = f"{len(DECODE_SEQ_LENS)} seqs, {DECODE_HEADS}/{DECODE_KV_HEADS} heads, d={DECODE_D}, fp16"
    ok = True
    for num_splits in splits:
        with bounded():
            out, lse = run(*args, num_splits, backend=backend, **options)[:2]
        label = f"{name} {shape}, {'auto' if num_splits is None else num_splits} splits"
        ok &= check(f"{label} out", out, ref, TOLERANCE["float16"])
        ok &= check(f"{label} lse", lse, ref_lse, LSE_TOLERANCE)
    return ok


def needed_cc(name: str) -> int:
    """The compute capability rung ``name`` needs: 90 exactly for the Hopper rungs, at least 80 for the others."""
    return 90 if name in HOPPER else 80


def why_not_here(name: str, cc: int | None) -> str | None:
    """Why rung ``name`` cannot run on a device of compute capability ``cc`` (None: no device), or None."""
    need = needed_cc(name)
    what = f"compute capability {need // 10}.{need % 10}" + ("" if name in HOPPER else " or newer")
    if cc is None:
        return f"needs a CUDA device of {what}; CuPy sees none"
    if (cc != need) if name in HOPPER else (cc < need):
        return f"needs a CUDA device of {what}; this one is {cc // 10}.{cc % 10}"
    return None


def check_rung(name: str, backend: str) -> bool:
    """All checks of one rung (each rung draws its inputs from its own seed), False when one is wrong or raised."""
    rng = np.random.default_rng(RUNGS.index(name))
    what = check_hopper if name in HOPPER else check_decode if name in DECODE else check_forward_rung
    try:
        return what(name, backend, rng)
    except Exception as err:       # a CUDA error, an illegal address: this rung is wrong here, say so and go on
        first = str(err).splitlines()[0] if str(err) else ""
        print(f"{name}: raised {type(err).__name__}: {first[:200]}", flush=True)
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rung", choices=RUNGS, action="append",
                        help="check this rung only (repeatable; default: every rung of first_run_rungs())")
    parser.add_argument("--emulator", action="store_true", help="run on the CPU emulator instead")
    parser.add_argument("--hang-seconds", type=float, default=None, metavar="S",
                        help=f"end the process (status 1, every thread's stack on stderr) when one launch takes "
                             f"longer than S seconds, its compile included (default {HANG_SECONDS:g} on a GPU, "
                             f"no bound with --emulator; 0: no bound; at most {MAX_HANG_SECONDS:g})")
    args = parser.parse_args(argv)
    if args.hang_seconds is not None and not (math.isfinite(args.hang_seconds)
                                              and 0 <= args.hang_seconds <= MAX_HANG_SECONDS):
        parser.error(f"--hang-seconds must be a number of seconds from 0 to {MAX_HANG_SECONDS:g} (a day), "
                     f"got {args.hang_seconds}")
    global _hang_seconds
    hang = args.hang_seconds if args.hang_seconds is not None else (None if args.emulator else HANG_SECONDS)
    _hang_seconds = hang or None
    rungs = [r for r in RUNGS if r in (args.rung or RUNGS)]
    backend = "emulator" if args.emulator else "cupy"
    cc = None
    if not args.emulator and gpu.device_available():
        cc = int(gpu.device_arch().removeprefix("sm_"))
    works, wrong, cannot = [], [], []
    for name in rungs:
        why = None if args.emulator else why_not_here(name, cc)
        if why is not None:
            print(f"{name}: cannot run here: {why}", flush=True)
            cannot.append((name, why))
        elif check_rung(name, backend):
            works.append(name)
        else:
            wrong.append(name)
    not_run = "; ".join(f"{name} ({why})" for name, why in cannot)
    if wrong:
        print(f"WRONG HERE: {', '.join(wrong)}")
        return 1
    if works:
        print(f"works here: {', '.join(works)}" + (f"; cannot run here: {not_run}" if cannot else ""))
    else:
        print(f"cannot run here: {not_run}")
    return 2 if cannot else 0


if __name__ == "__main__":
    sys.exit(main())

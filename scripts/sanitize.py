"""Small GPU runs of each kernel, for compute-sanitizer (memcheck, racecheck, initcheck).

    compute-sanitizer --tool memcheck python scripts/sanitize.py flash_attention

Each driver runs its kernel on a few awkward shapes (partial tiles, causal with
Nq != Nk, empty sequences, empty splits, the trace build) and compares with NumPy, so a
clean sanitizer report comes with a correct answer. CuPy's memory pool is switched off:
every array is its own cudaMalloc, so a read or write past an array's end is outside
an allocation and memcheck sees it. For the paged kernels the unused slots of the
cache are left *uninitialised* (never written), so initcheck reports any read past
``seq_len``. Exit status 0 when every result matches, 1 otherwise, 2 without a device.
``--emulator`` runs the same drivers on the CPU (NumPy arrays), a dry run of this script.
On a GPU, the driver of a rung named in ``$GPU_CHECK_LEFT_OUT`` (:func:`lessons.gpu.ladder.rungs_left_out`:
``scripts/gpu_check.sh`` names each rung whose first run on this machine failed, ``scripts/first_run.py``) launches
nothing: it prints ``skipped:`` and why, and passes.
"""
from __future__ import annotations

import argparse
import functools
import sys

import numpy as np

from lessons import attention
from lessons.gpu import launch
from lessons.gpu.compile import device_available

KERNELS = ("online_softmax", "flash_attention", "flash_attention_regtile", "flash_attention_regtile_wide",
           "flash_attention_mma", "flash_attention_mma_async", "paged_decode", "flash_decoding", "flash_backward",
           "paged_decode_split", "flash_attention_mma_fa2", "flash_attention_mma_fa2_lazy",
           "flash_attention_mma_fa2_wide", "flash_attention_mma_fa2_lean", "flash_backward_mma", "flash_attention_wgmma",
           "flash_attention_wgmma_overlap", "flash_attention_wgmma_pingpong")


def left_out(backend: str, rung: str) -> bool:
    """True, after printing why, when ``rung`` is not to run here: on a GPU (``backend`` "cupy"), a rung named in
    ``$GPU_CHECK_LEFT_OUT`` (its first run on this machine failed). On the emulator every rung runs."""
    from lessons.gpu.ladder import LEFT_OUT_REASON, rungs_left_out

    if backend == "cupy" and rung in rungs_left_out():
        print(f"  skipped: the {rung} rung {LEFT_OUT_REASON}")
        return True
    return False


def of_rung(rung: str):
    """A driver of the ladder's rung ``rung``: skipped (and passing) where :func:`left_out` says so."""
    def wrap(driver):
        @functools.wraps(driver)
        def run(cp, backend) -> bool:
            return True if left_out(backend, rung) else driver(cp, backend)
        run.rung = rung
        return run
    return wrap


def host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _close(name, got, ref, atol, rtol=1e-3) -> bool:
    got = host(got).astype(np.float64)
    ok = bool(np.all(np.isfinite(got) == np.isfinite(ref))) and np.allclose(got, ref, atol=atol, rtol=rtol,
                                                                            equal_nan=False)
    err = np.nanmax(np.abs(np.where(np.isfinite(ref), got - ref, 0.0))) if got.size else 0.0
    print(f"  {name}: {'ok' if ok else 'MISMATCH'} (max |diff| {err:.2e})")
    return ok


def run_online_softmax(cp, backend) -> bool:
    rng = np.random.default_rng(0)
    x = 3 * rng.standard_normal((3, 300))
    x[1] = -np.inf
    x = x.astype(np.float32)
    y, lse, _ = launch.online_softmax_gpu(cp.asarray(x), trace_rows=[0, 1], backend=backend)
    m = x.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.exp(x - m)
        ref = np.where(np.isfinite(m), p / p.sum(axis=1, keepdims=True), 0.0)
    return _close("online_softmax", y, ref, 1e-6)


def _forward(cp, backend, launcher, label, rng, cases, atol) -> bool:
    """Run ``launcher`` (one of the forward kernels, with a trace of the first and last rows) on
    each case ``(lead, nq, nk, d, causal, dtype)`` and compare every head with NumPy's attention;
    ``atol``: the tolerance per dtype name."""
    ok = True
    for lead, nq, nk, d, causal, dtype in cases:
        q, k, v = (rng.standard_normal((*lead, n, d)).astype(dtype) for n in (nq, nk, nk))
        out, lse, _ = launcher(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal, trace_rows=[0, nq - 1],
                               backend=backend)
        for idx in np.ndindex(*lead):
            ref = attention(q[idx].astype(np.float64), k[idx].astype(np.float64), v[idx].astype(np.float64),
                            causal=causal)
            name = np.dtype(dtype).name
            ok &= _close(f"{label} {lead} {nq}x{nk} d={d} causal={causal} {name}", host(out)[idx], ref, atol[name])
    return ok


@of_rung("scalar")
def run_flash_attention(cp, backend) -> bool:
    return _forward(cp, backend, launch.flash_attention_gpu, "flash", np.random.default_rng(1),
                    [((2,), 70, 45, 64, True, np.float16), ((), 33, 100, 80, False, np.float32),
                     ((), 5, 3, 3, True, np.float32)], {"float16": 2e-3, "float32": 1e-5})


@of_rung("mma")
def run_flash_attention_mma(cp, backend) -> bool:
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)
    ok = _close("mma_probe 16x16 @ 16x8", launch.mma_probe_gpu(cp.asarray(a), cp.asarray(b), backend=backend),
                a.astype(np.float64) @ b.astype(np.float64), 1e-4, 1e-4)
    return ok & _forward(cp, backend, launch.flash_attention_mma_gpu, "flash_mma", rng,
                         [((2,), 70, 45, 64, True, np.float16), ((), 33, 100, 80, False, np.float16),
                          ((), 5, 3, 16, True, np.float16), ((), 20, 40, 256, False, np.float16)], {"float16": 3e-3})


@of_rung("regtile")
def run_flash_attention_regtile(cp, backend) -> bool:
    rng = np.random.default_rng(5)
    ok = _forward(cp, backend, launch.flash_attention_regtile_gpu, "regtile", rng,
                  [((2,), 70, 45, 64, True, np.float32), ((), 33, 100, 128, False, np.float32),
                   ((), 5, 3, 4, True, np.float32)], {"float32": 1e-5})
    # the tuning sweep's tiles over 48 KiB: the same kernel with its shared memory dynamic
    for d, block_q, block_k in ((64, 64, 64), (128, 64, 64)):
        big = functools.partial(launch.flash_attention_regtile_gpu, block_q=block_q, block_k=block_k)
        ok &= _forward(cp, backend, big, f"regtile {block_q}x{block_k} (dynamic)", rng,
                       [((2,), 70, 150, d, True, np.float32)], {"float32": 1e-5})
    return ok


@of_rung("regtile_wide")
def run_flash_attention_regtile_wide(cp, backend) -> bool:
    # the wide build (16 lanes per row group, P read 4 keys at a time) with its default tiles, 64 x 64 in dynamic
    # shared memory at d = 64 and 128, then 32 rows x 128 keys (8 keys per thread) on partial blocks, causal
    rng = np.random.default_rng(9)
    ok = _forward(cp, backend, launch.flash_attention_regtile_wide_gpu, "regtile_wide", rng,
                  [((2,), 70, 45, 64, True, np.float32), ((), 33, 100, 128, False, np.float32),
                   ((), 5, 3, 4, True, np.float32)], {"float32": 1e-5})
    for d in (64, 128):
        other = functools.partial(launch.flash_attention_regtile_wide_gpu, block_q=32, block_k=128)
        ok &= _forward(cp, backend, other, "regtile_wide 32x128", rng, [((2,), 70, 300, d, True, np.float32)],
                       {"float32": 1e-5})
    return ok


@of_rung("mma_async")
def run_flash_attention_mma_async(cp, backend) -> bool:
    return _forward(cp, backend, launch.flash_attention_mma_async_gpu, "mma_async", np.random.default_rng(6),
                    [((2,), 70, 45, 64, True, np.float16), ((), 33, 100, 128, False, np.float16),
                     ((), 5, 3, 16, True, np.float16)], {"float16": 3e-3})


@of_rung("mma_fa2")
def run_flash_attention_mma_fa2(cp, backend) -> bool:
    # partial query and key blocks, causal with Nq > Nk (empty rows) and Nq < Nk, both head dims, the trace build
    return _forward(cp, backend, launch.flash_attention_mma_fa2_gpu, "mma_fa2", np.random.default_rng(7),
                    [((2,), 70, 45, 64, True, np.float16), ((), 150, 100, 64, False, np.float16),
                     ((), 33, 100, 128, True, np.float16), ((), 5, 3, 128, False, np.float16)], {"float16": 3e-3})


@of_rung("mma_fa2_lazy")
def run_flash_attention_mma_fa2_lazy(cp, backend) -> bool:
    # the FA-2 rung's cases with the default tiles (at d = 128: 64-key tiles in 64 KiB of dynamic shared
    # memory), then every other legal (block_q, block_k, min_blocks) on partial blocks, causal, 3 key tiles
    from lessons.gpu.source import FA2_LAZY_CONFIGS, flash_attention_mma_fa2_lazy_configs

    return _tiled_fa2(cp, backend, launch.flash_attention_mma_fa2_lazy_gpu, "mma_fa2_lazy", FA2_LAZY_CONFIGS,
                      flash_attention_mma_fa2_lazy_configs, 9)


@of_rung("mma_fa2_wide")
def run_flash_attention_mma_fa2_wide(cp, backend) -> bool:
    # the same cases for the wide-warp rung (32 rows per warp, Q in its own shared-memory region: 64 KiB at
    # d = 128 by default, 96 KiB with 64-key tiles), then every other legal configuration
    from lessons.gpu.source import FA2_WIDE_CONFIGS, flash_attention_mma_fa2_wide_configs

    return _tiled_fa2(cp, backend, launch.flash_attention_mma_fa2_wide_gpu, "mma_fa2_wide", FA2_WIDE_CONFIGS,
                      flash_attention_mma_fa2_wide_configs, 11)


@of_rung("mma_fa2_lean")
def run_flash_attention_mma_fa2_lean(cp, backend) -> bool:
    # the same cases for the lean rung (each launch is two kernels: the pre-pass that flags V's tiles, then the
    # main kernel, whose unmasked loop copies whole tiles with no per-chunk bounds test), then every other legal
    # configuration (lessons.gpu.source.FA2_LEAN_SWEEP); and inputs of whole key tiles only, where every tile but
    # the causal diagonal's runs in the unmasked loop
    from lessons.gpu.source import FA2_LEAN_CONFIGS, flash_attention_mma_fa2_lean_configs

    ok = _tiled_fa2(cp, backend, launch.flash_attention_mma_fa2_lean_gpu, "mma_fa2_lean", FA2_LEAN_CONFIGS,
                    flash_attention_mma_fa2_lean_configs, 13)
    return ok & _forward(cp, backend, launch.flash_attention_mma_fa2_lean_gpu, "mma_fa2_lean whole tiles",
                         np.random.default_rng(14), [((2,), 128, 256, 64, False, np.float16),
                                                     ((), 256, 256, 128, True, np.float16)], {"float16": 3e-3})


def _tiled_fa2(cp, backend, launcher, name, defaults, configs, seed) -> bool:
    from functools import partial

    ok = _forward(cp, backend, launcher, name, np.random.default_rng(seed),
                  [((2,), 70, 45, 64, True, np.float16), ((), 150, 100, 64, False, np.float16),
                   ((), 33, 100, 128, True, np.float16), ((), 5, 3, 128, False, np.float16)], {"float16": 3e-3})
    for d in (64, 128):
        for bq, bk, mb in configs(d):
            if (bq, bk, mb) != defaults[d]:
                run = partial(launcher, block_q=bq, block_k=bk, min_blocks=mb)
                ok &= _forward(cp, backend, run, f"{name} {bq}x{bk} min_blocks={mb}",
                               np.random.default_rng(d + bq + bk + mb), [((), 70, 150, d, True, np.float16)],
                               {"float16": 3e-3})
    return ok


def _paged(cp, rng, seq_lens, num_heads=8, num_kv_heads=2, d=64, block_size=16):
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 2
    tables = np.full((len(seq_lens), max(pages) + 1), -1, np.int32)
    k_host = np.zeros((num_blocks, block_size, num_kv_heads, d), np.float32)
    v_host = np.zeros_like(k_host)
    k_dev = cp.empty(k_host.shape, np.float32)           # left uninitialised where unused
    v_dev = cp.empty(v_host.shape, np.float32)
    free = iter(rng.permutation(num_blocks))
    for s, n in enumerate(seq_lens):
        for b in range(pages[s]):
            page = int(next(free))
            tables[s, b] = page
            used = min(block_size, n - b * block_size)
            k_host[page, :used] = rng.standard_normal((used, num_kv_heads, d))
            v_host[page, :used] = rng.standard_normal((used, num_kv_heads, d))
            k_dev[page, :used] = cp.asarray(k_host[page, :used])
            v_dev[page, :used] = cp.asarray(v_host[page, :used])
    q = rng.standard_normal((len(seq_lens), num_heads, d)).astype(np.float32)
    group = num_heads // num_kv_heads
    ref = np.zeros(q.shape)
    for s, n in enumerate(seq_lens):
        t = np.arange(n)
        for h in range(num_heads):
            kk = k_host[tables[s, t // block_size], t % block_size, h // group].astype(np.float64)
            vv = v_host[tables[s, t // block_size], t % block_size, h // group].astype(np.float64)
            ref[s, h] = attention(q[s, h].astype(np.float64), kk, vv)
    args = (cp.asarray(q), k_dev, v_dev, cp.asarray(tables), cp.asarray(np.array(seq_lens, np.int32)))
    return args, ref


@of_rung("paged_decode")
def run_paged_decode(cp, backend) -> bool:
    args, ref = _paged(cp, np.random.default_rng(2), [37, 0, 16, 1])
    out, _, _ = launch.paged_decode_gpu(*args, trace_rows=[(0, 0), (3, 7)], backend=backend)
    return _close("paged_decode", out, ref, 1e-5)


@of_rung("flash_decoding")
def run_flash_decoding(cp, backend) -> bool:
    args, ref = _paged(cp, np.random.default_rng(3), [37, 0, 16, 1])
    ok = True
    for num_splits in (1, 3, 8):                          # 8 splits > 3 pages: empty splits
        out, _, _ = launch.flash_decoding_gpu(*args, num_splits, trace_rows=[(0, 1)], backend=backend)
        ok &= _close(f"flash_decoding num_splits={num_splits}", out, ref, 1e-5)
    return ok


def run_paged_decode_split(cp, backend) -> bool:
    args, ref = _paged(cp, np.random.default_rng(5), [37, 0, 16, 1], d=128)
    ok = True
    # the split rung, the prefetch rung and the cp.async rung
    for rung, options in (("paged_decode_split", {}), ("paged_decode_prefetch", dict(prefetch=True)),
                          ("paged_decode_cp_async", dict(cp_async=True))):
        if left_out(backend, rung):
            continue
        for num_splits in (None, 1, 3, 8):               # auto, one pass, splits, empty splits
            out, _ = launch.paged_decode_split_gpu(*args, num_splits, backend=backend, **options)
            ok &= _close(f"{rung} num_splits={num_splits}", out, ref, 1e-5)
    return ok


def run_flash_backward(cp, backend) -> bool:
    from lessons import attention_backward
    from lessons.gpu.backward import flash_attention_backward_gpu

    rng = np.random.default_rng(4)
    ok = True
    # partial blocks, causal with Nq > Nk (rows that see nothing) and Nq < Nk, 16-bit storage, the trace build
    for lead, nq, nk, d, causal, dtype, trace_block in [((2,), 70, 45, 64, True, np.float16, 1),
                                                        ((), 33, 100, 128, True, np.float32, None),
                                                        ((), 5, 3, 16, False, np.float32, 0)]:
        q, k, v, do = (rng.standard_normal((*lead, n, d)).astype(dtype) for n in (nq, nk, nk, nq))
        o, lse = launch.flash_attention_gpu(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                                            backend=backend)
        grads = flash_attention_backward_gpu(cp.asarray(q), cp.asarray(k), cp.asarray(v), o, lse, cp.asarray(do),
                                             causal=causal, trace_block=trace_block, backend=backend)
        for idx in np.ndindex(*lead):
            ref = attention_backward(*(x[idx].astype(np.float64) for x in (q, k, v, do)), causal=causal)
            for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
                ok &= _close(f"backward {name} {lead} {nq}x{nk} d={d} causal={causal} {np.dtype(dtype).name}",
                             host(got)[idx], r, 2e-2 if dtype == np.float16 else 1e-4, 1e-2)
    return ok


def run_flash_backward_mma(cp, backend) -> bool:
    from lessons import attention_backward
    from lessons.gpu.backward import flash_attention_backward_mma_gpu

    rng = np.random.default_rng(5)
    ok = True
    # partial blocks of 64 keys / rows, causal with Nq > Nk (rows that see nothing) and Nq < Nk, both head dims
    for lead, nq, nk, d, causal in [((2,), 70, 45, 64, True), ((), 33, 100, 128, True), ((), 5, 3, 64, False)]:
        q, k, v, do = (rng.standard_normal((*lead, n, d)).astype(np.float16) for n in (nq, nk, nk, nq))
        o, lse = launch.flash_attention_mma_gpu(cp.asarray(q), cp.asarray(k), cp.asarray(v), causal=causal,
                                                backend=backend)
        grads = flash_attention_backward_mma_gpu(cp.asarray(q), cp.asarray(k), cp.asarray(v), o, lse,
                                                 cp.asarray(do), causal=causal, backend=backend)
        for idx in np.ndindex(*lead):
            ref = attention_backward(*(x[idx].astype(np.float64) for x in (q, k, v, do)), causal=causal)
            for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
                ok &= _close(f"backward_mma {name} {lead} {nq}x{nk} d={d} causal={causal} float16",
                             host(got)[idx], r, 2e-2, 1e-2)
    return ok


def _hopper_forward(cp, backend, rung: str, launcher) -> bool:
    """One Hopper rung on HOPPER_CASES (with its trace build), unless it cannot run here: not compute
    capability 9.0 (then it says why and passes; a rung left out after its first run never gets here)."""
    if backend == "cupy" and cp.cuda.Device().compute_capability != "90":
        print("  skipped: the Hopper rungs run on compute capability 9.0 only")
        return True
    return _forward(cp, backend, launcher, rung, np.random.default_rng(8), HOPPER_CASES, {"float16": 3e-3})


#: the Hopper rungs' cases: both head dims, a stage reused (3+ key tiles), causal with empty rows, one tile
HOPPER_CASES = [((2,), 70, 45, 64, True, np.float16), ((), 150, 300, 64, False, np.float16),
                ((), 33, 200, 128, True, np.float16), ((), 5, 3, 128, False, np.float16)]


@of_rung("wgmma")
def run_flash_attention_wgmma(cp, backend) -> bool:
    # the Hopper rung
    return _hopper_forward(cp, backend, "wgmma", launch.flash_attention_wgmma_gpu)


@of_rung("wgmma_overlap")
def run_flash_attention_wgmma_overlap(cp, backend) -> bool:
    # the Hopper rung with softmax overlapped with the products (two wgmma groups in flight, 3 stages)
    return _hopper_forward(cp, backend, "wgmma_overlap", launch.flash_attention_wgmma_overlap_gpu)


@of_rung("wgmma_pingpong")
def run_flash_attention_wgmma_pingpong(cp, backend) -> bool:
    # the overlapped rung with the consumers taking turns (named barriers bar.sync / bar.arrive)
    return _hopper_forward(cp, backend, "wgmma_pingpong", launch.flash_attention_wgmma_pingpong_gpu)


def main(argv=None) -> int:
    """Command line: ``python scripts/sanitize.py KERNEL``; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", nargs="?", choices=KERNELS + ("all",))
    parser.add_argument("--list", action="store_true", help="print the kernels that have a driver, one per line")
    parser.add_argument("--emulator", action="store_true", help="run on the CPU instead of a GPU")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(KERNELS))
        return 0
    if args.kernel is None:
        parser.error("name a KERNEL (or all, or --list)")
    if args.emulator:
        xp, backend = np, "emulator"
    else:
        if not device_available():
            print("no CUDA device: nothing to sanitize")
            return 2
        import cupy as xp

        backend = "cupy"
        xp.cuda.set_allocator(None)                        # one cudaMalloc per array
        xp.cuda.set_pinned_memory_allocator(None)
    names = KERNELS if args.kernel == "all" else (args.kernel,)
    ok = True
    for name in names:
        print(f"{name}:")
        ok &= globals()[f"run_{name}"](xp, backend)
    if backend == "cupy":
        xp.cuda.runtime.deviceSynchronize()
    print("all results match NumPy" if ok else "SOME RESULTS DIFFER FROM NUMPY")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

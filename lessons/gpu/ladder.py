"""The kernel ladder: every attention forward of the series as a named rung, slowest first.

Each :class:`Rung` says what it changes over the rung below, what that change should do
(bytes moved, instructions per FMA, occupancy), which instruction in its PTX proves the
change is there (``tests/test_gpu_ladder.py`` greps for it), and what it measured on a GPU,
if it was measured. Figures come from one run on one NVIDIA H200 on 2026-12-01
(``benchmarks/results/gpu_h200_2026-12-01/``: ``forward/results.csv``, ``decode/results.csv``;
command, machine, driver and commit in its README). The Nsight Compute notes in
:attr:`Rung.limit` come from the run before it, 2026-11-30 (``PROFILED_DIR``, with
``sdpa_backends.txt``), and say so. A rung without a row in the recorded run says
"not yet measured on a GPU" and is never given a number it did not earn. With a CUDA device
present, :func:`measure_ladder` times every rung live with CUDA events
(:func:`lessons.gpu.measure.median_cuda_seconds`).

FLOPs are counted as in ``benchmarks/gpu_attention.py``: ``4 N^2 d`` per head (2 for Q K^T,
2 for P V). Source of the algorithm of every rung: Dao 2023 (FlashAttention-2), Alg. 1.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from pathlib import Path

from lessons.core.checks import check_flag, check_int, check_int_sequence
from lessons.cost.traffic import H200, flash_io, textbook_io
from lessons.gpu.measure import attention_flops  # 4 N^2 d per head, half when causal
from lessons.gpu.recorded import RECORDED_DIR, _shipped, typed_csv_rows  # RECORDED_DIR: the H200 run (forward/, backward/, decode/)

__all__ = ["Rung", "RUNGS", "RECORDED_DIR", "RECORDED_CSV", "RECORDED_ON", "RECORDED_LABEL", "PROFILED_DIR", "PROFILED_LABEL",
           "SDPA_KERNEL", "NOT_MEASURED", "rung", "attention_flops", "recorded_rows", "recorded", "ladder_table",
           "rung_intensity", "rung_tiles", "rung_build", "measure_ladder", "ladder_points", "speedup_claim", "CLAIM",
           "ladder_markdown", "rung_notes_markdown", "rung_evidence", "overlap_evidence", "SERIALISED_WGMMA", "Target", "TARGETS",
           "target_outcomes", "targets_markdown", "TARGET_KINDS",
           "DECODE_RUNGS", "DECODE_LAUNCH_OPTIONS", "DECODE_RECORDED", "decode_rung", "decode_rung_build", "decode_rung_entry", "recorded_copy_rate", "decode_recorded_rows",
           "decode_recorded", "decode_table", "decode_markdown", "DECODE_SHAPES", "split_sweep_markdown", "sdpa_backends", "sdpa_kernels",
           "SWEEP_FILES", "recorded_sweep", "best_tiles", "sweep_markdown",
           "HOPPER_RUNGS", "LEFT_OUT_VARIABLE", "LEFT_OUT_REASON", "kernel_rungs", "first_run_rungs", "rungs_left_out"]

ROOT = Path(__file__).resolve().parents[2]
#: its forward table: every rung, naive CuPy and torch SDPA at N = 1024, 4096, 8192, d = 64, 128
RECORDED_CSV = RECORDED_DIR / "forward" / "results.csv"
#: machine and date of the recorded run, short enough for a legend entry
RECORDED_ON = "recorded on one NVIDIA H200, 2026-12-01"
#: how every recorded figure is labelled (machine, date, driver, CUDA, commit: RECORDED_DIR/README.md, env.txt)
RECORDED_LABEL = f"{RECORDED_ON} (driver 580.159.04, CUDA 13.0, commit 5ea12bd)"
#: the run before it, which has the Nsight Compute notes quoted in Rung.limit and sdpa_backends.txt
PROFILED_DIR = ROOT / "benchmarks" / "results" / "gpu_h200_2026-11-30"
#: how the Nsight Compute notes of that run are credited
PROFILED_LABEL = "Nsight Compute on one NVIDIA H200, 2026-11-30 (commit 1b1cd0d)"
#: the kernel torch SDPA dispatched to on the H200 (profiler kernel names, fp16, N = 8192; 2026-11-30 run)
SDPA_KERNEL = "cuDNN cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16 (132 persistent blocks of 384 threads)"
#: what a rung without a GPU figure shows
NOT_MEASURED = "not yet measured on a GPU"


@dataclass(frozen=True)
class Rung:
    """One kernel variant of the ladder.

    name: short key (``"regtile"``); title: what a learner reads; impl: its key in the
    recorded results (``results.csv`` column ``impl``), None if it was never measured;
    kernel: the ``.cu`` file in ``lessons/gpu/kernels/``, or the entry point where one file holds
    two rungs (``flash_attention_wgmma_pingpong``; None for CuPy/torch); launcher:
    the function that runs it; dtype: the storage dtype it is timed in; changed: what this
    rung changes over the one below; predicted: the effect that change should have (bytes,
    instructions, occupancy), with numbers where the code fixes them; ptx_grep: the PTX
    instruction the change is about (None when there is no kernel of ours); limit: what
    bounds it, from Nsight Compute where it was profiled (the 2026-11-30 run, :data:`PROFILED_LABEL`).
    """

    name: str
    title: str
    impl: str | None
    kernel: str | None
    launcher: str
    dtype: str
    changed: str
    predicted: str
    ptx_grep: str | None
    limit: str


RUNGS = (
    Rung("naive", "naive CuPy (S materialised)", "naive", None, "lessons.gpu.measure.naive_attention", "float32",
         "the textbook: S = scale Q K^T written to HBM in float32, softmax, then P V (cuBLAS matmuls)",
         "HBM traffic grows with N^2: at N = 8192 S is 256 MiB per head (2 GiB for 8 heads), against 6 MiB of "
         "Q, K, V per head at d = 64 (12 MiB at d = 128)",
         None, "HBM traffic of S and the separate softmax passes"),
    Rung("scalar", "CUDA cores, one thread per row slice", "kernel", "flash_attention", "lessons.gpu.flash_attention_gpu",
         "float32",
         "the fold over key tiles (m, l, o per row) in one kernel: S and P never leave the chip",
         "HBM traffic drops to Q, K, V read once per query block plus O written once; but each FMA of "
         "S = Q K^T waits for one 4-byte shared-memory load",
         "fma.rn.ftz.f32", "shared-memory loads: L1/TEX pipe 94% busy (ncu, d = 64, 2026-11-30 run)"),
    Rung("regtile", "CUDA cores, register-tiled", "regtile", "flash_attention_regtile",
         "lessons.gpu.flash_attention_regtile_gpu", "float32",
         "each thread owns a block of S (4 rows x 4 keys at d = 64) and of O (4 x 8), read from shared memory "
         "16 bytes at a time (ld.shared.v4); since the measured build, also exp2 with log2(e) in the scale and "
         "plain FMAs for P V where V is all finite",
         "shared loads per FMA in S: 1/8 at d = 64, 6/32 at d = 128 (the scalar rung: 1); aim: >= 3x naive CuPy. "
         "Measured (2026-12-01, before exp2 and the plain P V loop): 1.9x the scalar rung at both head dims, but "
         "only 2.7x naive at d = 64 and 1.4x at d = 128: the aim is not met",
         "ld.shared.v4.f32", "not profiled yet (the Nsight Compute run of 2026-11-30 predates it)"),
    Rung("regtile_wide", "CUDA cores, register-tiled, 8 rows x 4 keys per thread", None, "flash_attention_regtile_wide",
         "lessons.gpu.flash_attention_regtile_wide_gpu", "float32",
         "the register-tiled kernel with REGTILE_WIDE: 16-lane row groups instead of 8, so a thread owns 8 rows x "
         "4 keys of S in 64 x 64 tiles; P read 4 keys per 16-byte load; a thread's rows interleaved so that a "
         "warp's two row groups start in different banks; the S and P V loops unrolled by 2",
         "shared loads per FMA: 12 / 128 in S at both head dims; in P V 12 / 128 at d = 64, 16 / 256 at d = 128 "
         "(the plain build: 8 / 64 or 6 / 32 in S, 6 / 32 in P V); in SASS the two loops are 88-90% FFMA "
         "(lessons.gpu.sass; the plain build's 72-76%). Compile report (NVRTC 12.9 and 13.0, no spills): "
         "d = 64: 168 registers, 52 224 bytes of dynamic shared memory, 3 blocks per SM; d = 128: 208 registers, "
         "84 992 bytes, 2 blocks per SM (the plain build: 4); aim: >= 3x naive CuPy",
         "ld.shared.v4.f32", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("mma", "tensor cores, mma.sync", "mma", "flash_attention_mma", "lessons.gpu.flash_attention_mma_gpu",
         "float16",
         "both products (Q K^T and P V) on tensor cores, mma.sync.m16n8k16, float16 in, float32 accumulate",
         "one warp instruction does 16 x 8 x 16 multiply-adds (4096 FLOPs) instead of 32 FMAs; bound by "
         "occupancy instead: 167-168 registers per thread at d = 64 and 218-226 at d = 128 (NVRTC 12.9, sm_80 / "
         "sm_90) allow 3 and 2 blocks of 4 warps per SM (the build profiled on 2026-11-30 ran 2)",
         "mma.sync.aligned.m16n8k16", "occupancy 12.5%, no warp eligible 57% of cycles, synchronous loads (ncu, 2026-11-30 run)"),
    Rung("mma_async", "tensor cores + ldmatrix, cp.async", "mma_async", "flash_attention_mma_async",
         "lessons.gpu.flash_attention_mma_async_gpu", "float16",
         "K/V tiles copied by cp.async into two shared-memory stages (tile j + 1 in flight while tile j is "
         "multiplied); K and V fragments loaded by ldmatrix.x2 (.trans for V)",
         "the loads the mma rung stalls on overlap the previous tile's products; one ldmatrix per V fragment "
         "instead of four 16-bit loads and two packs; two stages double the shared memory, so block_k drops to "
         "32 at d = 128. Measured (2026-12-01): confirmed at d = 128 only, 1.21x the mma rung; at d = 64 it is "
         "0.95x, no gain",
         "ldmatrix.sync.aligned.m8n8.x2.trans", "not profiled yet (the Nsight Compute run of 2026-11-30 predates it)"),
    Rung("mma_fa2", "tensor cores, FlashAttention-2's recipe", "mma_fa2", "flash_attention_mma_fa2",
         "lessons.gpu.flash_attention_mma_fa2_gpu", "float16",
         "128 query rows over 8 warps at d = 64 (64 over 4 at d = 128), registers capped for 2 blocks per SM; "
         "Q loaded once into registers; K and V by ldmatrix.x4 (.trans for V) from XOR-swizzled shared memory; "
         "exp2 (ex2.approx) with log2(e) in the scale; masks only in tiles that reach n_k or the diagonal; "
         "V's inf/NaN fixed only in chunks that hold one",
         "2 blocks per SM: 16 warps at d = 64 (occupancy 25%, the mma rung's 12.5%); half the ldmatrix "
         "instructions of the .x2 rung; one ex2 per probability instead of expf; at d = 64 K and V read from "
         "HBM once per 128 query rows (half the mma rung's traffic); aim: >= 0.5x SDPA. Measured (2026-12-01): "
         "1.9x / 2.0x the mma rung at d = 64 / 128, but 0.43x / 0.30x SDPA: the aim is not met",
         "ex2.approx.ftz.f32", "not profiled yet (the Nsight Compute run of 2026-11-30 predates it)"),
    Rung("mma_fa2_lazy", "tensor cores, FA-2 + lazy rescaling, 64-key tiles", None, "flash_attention_mma_fa2_lazy",
         "lessons.gpu.flash_attention_mma_fa2_lazy_gpu", "float16",
         "the mma_fa2 kernel with two switches: each warp votes (__any_sync) on whether any of its 16 rows' max "
         "moved and skips o *= alpha when none did (alpha is then exactly 1.0); K/V stages in dynamic shared "
         "memory, so d = 128 takes 64-key tiles (64 KiB) instead of 32",
         "a warp-tile that skips saves 32 multiplies per thread at d = 64, 64 at d = 128, and on a long row most "
         "skip (lessons.cost.rescale.rescale_share counts them); at d = 128 half the tiles per row, so half the "
         "barriers, cp.async waits and row max/sum shuffles per key; 2 blocks per SM. Output bitwise the mma_fa2 "
         "rung's with the same tiles; aim: >= 0.5x SDPA",
         "vote.sync.any.pred", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("mma_fa2_wide", "tensor cores, FA-2's warp shape: 32 rows per warp", None, "flash_attention_mma_fa2_wide",
         "lessons.gpu.flash_attention_mma_fa2_wide_gpu", "float16",
         "the lazy kernel with WARP_ROWS=32: each warp owns 32 query rows (two m-tiles), so a 128-row block is 4 "
         "warps and each K and V fragment feeds two mma instead of one; Q's fragments move to shared memory and "
         "are read again at each tile, as in FlashAttention-2's forward kernel",
         "half the K and V bytes per mma; with Q's reads, 0.625x the shared-memory bytes per mma of 16-row warps "
         "at 64-key tiles, 0.75x at 32-key tiles (the d = 128 default); two independent mma in flight per "
         "fragment; 2 blocks (8 warps) per SM. Output bitwise the lazy rung's with the same tiles; "
         "aim: >= 0.5x SDPA",
         "mma.sync.aligned.m16n8k16", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("mma_fa2_lean", "tensor cores, FA-2 + lean interior tiles", None, "flash_attention_mma_fa2_lean",
         "lessons.gpu.flash_attention_mma_fa2_lean_gpu", "float16",
         "the wide kernel with FA2_LEAN: at d = 64 the key tiles that need no mask run first, in a loop compiled "
         "without mask code (at d = 128 one loop: two do not fit 255 registers on sm_80); a tile wholly inside "
         "n_k is copied without a bounds test per chunk; V's inf/NaN test moves to a pre-pass kernel that writes "
         "one flag per head and key tile, so an interior tile only reads its flag (ld.global.nc.u32, in no "
         "other rung's PTX) and its barrier is a plain __syncthreads()",
         "counted from SASS (lessons.gpu.sass.tensor_tile, sm_90, NVRTC 12.9), one warp issues on an interior "
         "tile 760 instructions at d = 64, 5.94 per HMMA (the wide rung: 982, 7.67), and 673 at d = 128, 5.26 "
         "per HMMA (the wide rung: 801, 6.26): the issue-slot ceiling rises from 52% to 67% of the tensor peak "
         "at d = 64 and from 64% to 76% at d = 128; the pre-pass reads V once more. Compile report (NVRTC 12.9, "
         "float16 and bfloat16, no spills): d = 64, 128 x 64 tiles: 242-243 registers (the wide rung: 223-225), "
         "48 KiB; d = 128, 128 x 32: 255 registers (the wide rung: 254-255), 64 KiB; 2 blocks per SM. Output "
         "bitwise the wide rung's with the same tiles; aim: >= 0.5x SDPA",
         "ld.global.nc.u32", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("wgmma", "Hopper: TMA + wgmma", None, "flash_attention_wgmma",
         "lessons.gpu.flash_attention_wgmma_gpu", "float16",
         "sm_90a only: a producer warpgroup copies Q once and each K/V tile by TMA (one instruction per "
         "64-column panel, zeros past n_k, swizzled by the copy) into 2 stages handed over by mbarriers, and "
         "checks V for inf/NaN; two consumer warpgroups of 64 rows multiply with wgmma (K and V read from "
         "shared memory through descriptors, P from registers), spending no instructions on copies or ldmatrix; "
         "the lazy rescale of mma_fa2_lazy",
         "127 registers at d = 64, 127 at d = 128, x 384 threads, 83 008 / 99 392 bytes of dynamic shared "
         "memory: 1 block (12 warps) per SM; per 16-key step of P V one wgmma replaces 8-16 mma.sync and 4-8 "
         "ldmatrix.x4 per warp; 128-key tiles at d = 64 halve the barriers per key; aim: >= 0.75x SDPA, which "
         "FlashAttention-3 reaches only with the next two rungs' changes: expect this one below it",
         "wgmma.mma_async.sync.aligned", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("wgmma_overlap", "Hopper: + softmax overlapped with wgmma", None, "flash_attention_wgmma_overlap",
         "lessons.gpu.flash_attention_wgmma_overlap_gpu", "float16",
         "the wgmma rung's steps in FlashAttention-3's order (Alg. 2): each consumer issues S_j = Q K_j^T and "
         "O += P_{j-1} V_{j-1} together, waits only for the first (wgmma.wait_group 1) and computes tile j's "
         "softmax while the second runs; 3 K/V stages instead of 2",
         "the exponentials hide behind the previous tile's P V instead of idling the tensor cores (at d = 128 "
         "they alone take half as long as the products: FlashAttention-3, Sec. 3.1); 156 registers at d = 64, "
         "157 at d = 128 (S, P and O live at once), 115 804 / 132 188 bytes of dynamic shared memory, no "
         "serialised wgmma; output bitwise the wgmma rung's",
         "wgmma.wait_group.sync.aligned 1", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("wgmma_pingpong", "Hopper: + consumers taking turns (ping-pong)", None, "flash_attention_wgmma_pingpong",
         "lessons.gpu.flash_attention_wgmma_pingpong_gpu", "float16",
         "the overlapped rung with the two consumer warpgroups taking turns to issue: each waits on its named "
         "barrier (bar.sync) before it issues and hands the turn over (bar.arrive) after (FlashAttention-3, "
         "Sec. 3.1)",
         "one warpgroup's products cover the other's softmax, so the tensor cores are fed by one after the other "
         "instead of both at once and then neither; output bitwise the overlapped rung's; 156 registers at "
         "d = 64, 157 at d = 128, shared memory as the overlapped rung (same file, second entry point)",
         "bar.arrive", "not yet run on a GPU: built and checked on the CPU emulator only"),
    Rung("sdpa", "torch SDPA (the reference point)", "torch", None,
         "torch.nn.functional.scaled_dot_product_attention", "float16",
         "not ours: what a tuned library does on this GPU (Hopper wgmma + TMA, warp specialisation)",
         "near the tensor-core roof: one persistent block of 3 warpgroups per SM",
         None, "tuned by NVIDIA for sm_90"),
)



#: the Hopper rungs (sm_90a), in ladder order
HOPPER_RUNGS = ("wgmma", "wgmma_overlap", "wgmma_pingpong")
#: the variable through which ``scripts/gpu_check.sh`` tells its later steps which rungs to leave out
LEFT_OUT_VARIABLE = "GPU_CHECK_LEFT_OUT"
#: what a step says of a rung it leaves out
LEFT_OUT_REASON = "failed its first run on this machine (scripts/first_run.py)"


def kernel_rungs() -> tuple:
    """The names of every rung with a kernel of ours, forward rungs (:data:`RUNGS`) then decode rungs
    (:data:`DECODE_RUNGS`), in ladder order: the names :func:`rungs_left_out` accepts."""
    return tuple(r.name for r in RUNGS + DECODE_RUNGS if r.kernel is not None)


def first_run_rungs() -> tuple:
    """The rungs of ours that have never run on a GPU, in ladder order: the forward rungs with a kernel of
    ours and no recorded row (``impl is None``), then the decode rungs the recorded decode run lacks
    (:func:`decode_recorded` is None). ``scripts/gpu_check.sh`` gives each a first contact
    (``scripts/first_run.py --rung NAME``, in its own process under its own time limit) before its other
    steps, and leaves out of them every rung that fails, hangs or cannot run there."""
    forward = tuple(r.name for r in RUNGS if r.kernel is not None and r.impl is None)
    return forward + tuple(r.name for r in DECODE_RUNGS if decode_recorded(r) is None)


def rungs_left_out(environ=None) -> frozenset:
    """The rungs that ``scripts/gpu_check.sh`` leaves out of its later steps on this machine (benchmarks,
    sweeps, tests, sanitizer, Nsight Compute): the names in ``$GPU_CHECK_LEFT_OUT``, space-separated, which it
    sets for each rung whose first run (``scripts/first_run.py --rung NAME``) failed, hung or could not run;
    ``all`` stands for every rung of :func:`first_run_rungs`. ``environ``: a mapping, default ``os.environ``.
    Returns a frozenset of names from :func:`kernel_rungs` (empty when the variable is unset or blank).
    ValueError naming the variable and the valid names for anything else."""
    import os

    value = (os.environ if environ is None else environ).get(LEFT_OUT_VARIABLE, "")
    names = set(value.split())
    if "all" in names:
        names = (names - {"all"}) | set(first_run_rungs())
    valid = kernel_rungs()
    unknown = sorted(names - set(valid))
    if unknown:
        raise ValueError(f"{LEFT_OUT_VARIABLE} must hold names of rungs with a kernel of ours, {list(valid)}, "
                         f"or 'all' (every rung of first_run_rungs()), space-separated; got {unknown}")
    return frozenset(names)


def _rung(r) -> Rung:
    if isinstance(r, Rung):
        return r
    if not isinstance(r, str):
        raise TypeError(f"rung must be a Rung or a rung's name, got {type(r).__name__} {r!r}")
    return rung(r)


def rung(name: str) -> Rung:
    """The rung called ``name`` (one of ``[r.name for r in RUNGS]``); ValueError for another name,
    TypeError for a ``name`` that is not a str."""
    if not isinstance(name, str):
        raise TypeError(f"rung must be a rung's name (a str), got {type(name).__name__} {name!r}")
    for r in RUNGS:
        if r.name == name:
            return r
    raise ValueError(f"rung must be one of {[r.name for r in RUNGS]}, got {name!r}")


def recorded_rows(path: Path | None = None) -> list[dict]:
    """The rows of a recorded forward ``results.csv`` (default :data:`RECORDED_CSV`): impl, n, d,
    heads, causal, dtype, seconds, tflops, note, with numbers as int/float and None where a run
    was skipped (``benchmarks/gpu_attention.py`` writes these files; the 2026-11-30 one,
    ``PROFILED_DIR / "results.csv"``, reads the same way). Raises FileNotFoundError when the
    file is not there (an installed package without the repo), ValueError naming the file and
    line for a missing column, a line of the wrong length, a malformed or negative number, an
    empty or zero n/d/heads, ``seconds`` of 0, ``causal`` other than True/False."""
    path = _shipped(RECORDED_CSV) if path is None else path
    columns = dict(impl=str, n=int, d=int, heads=int, causal=str, dtype=str, seconds=float, tflops=float, note=str)
    rows = []
    for line, r in typed_csv_rows(path, columns):
        for column in ("n", "d", "heads"):
            if not r[column]:
                raise ValueError(f"{path}, line {line}: column {column!r} must be a positive int, got {r[column]!r}")
        if r["causal"] not in ("True", "False"):
            raise ValueError(f"{path}, line {line}: column 'causal' must be True or False, got {r['causal']!r}")
        if r["seconds"] == 0:
            raise ValueError(f"{path}, line {line}: column 'seconds' must be above 0, got 0")
        rows.append(dict(r, causal=r["causal"] == "True"))
    return rows


def _rows(rows) -> list:
    """``rows`` (default: the recorded H200 run) as a list of row dicts; TypeError otherwise."""
    if rows is None:
        return recorded_rows()
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"rows must be a list of row dicts (recorded_rows() or measure_ladder()), got "
                        f"{type(rows).__name__}")
    return list(rows)


def _check_shape(rows, n, ds) -> tuple:
    """(n, [d, ...]) checked as ints >= 1, and present in ``rows`` at n with one of the ds at least."""
    n = check_int(n, "n", min=1)
    ds = [check_int(d, "d", min=1) for d in ds]
    have = sorted({(r["n"], r["d"]) for r in rows})
    if not any((n, d) in have for d in ds):
        raise ValueError(f"the run has no rows at n = {n}, d = {ds[0] if len(ds) == 1 else ds}; it has (n, d) {have}")
    return n, ds


def recorded(r: Rung | str, n: int = 8192, d: int = 64, dtype: str | None = None, rows=None) -> dict | None:
    """The recorded H200 row of rung ``r`` at ``(n, d)`` in ``dtype`` (default: the rung's),
    or None when that rung was not measured there. ``rows``: default the recorded H200 run;
    rows from :func:`measure_ladder` (impl = the rung's name) work too."""
    r = _rung(r)
    n, d = check_int(n, "n", min=1), check_int(d, "d", min=1)
    rows = _rows(rows)
    dtype = r.dtype if dtype is None else dtype
    keys = {r.name} | ({r.impl} if r.impl else set())      # recorded runs use impl, live ones the name
    for row in rows:
        if row["impl"] in keys and row["n"] == n and row["d"] == d and row["dtype"] == dtype \
                and not row["causal"] and row["seconds"] is not None:
            return row
    return None


def ladder_table(n: int = 8192, d: int = 64, rows=None) -> list[dict]:
    """One dict per rung at ``(n, d)``: name, title, dtype, ms, tflops (None: not measured),
    x_naive (speed-up over naive CuPy in the same dtype), x_previous (over the nearest measured
    rung below), x_sdpa (fraction of SDPA's float16 TFLOP/s), figure (text, recorded or
    NOT_MEASURED). ``rows``: measured rows (default: the recorded H200 run).
    Raises TypeError for a non-int ``n``/``d`` (bools included) or rows that are not row dicts,
    ValueError when the run has no rows at (``n``, ``d``) (the message lists what it has)."""
    rows = _rows(rows)
    n, (d,) = _check_shape(rows, n, [d])
    return _table(n, d, rows)


def _table(n, d, rows) -> list[dict]:
    sdpa = recorded("sdpa", n, d, rows=rows)
    out, previous = [], None
    for r in RUNGS:
        row = recorded(r, n, d, rows=rows)
        naive = recorded("naive", n, d, r.dtype, rows=rows)
        entry = dict(name=r.name, title=r.title, dtype=r.dtype, ms=None, tflops=None, x_naive=None,
                     x_previous=None, x_sdpa=None, figure=NOT_MEASURED)
        if row is not None:
            entry.update(ms=row["seconds"] * 1e3, tflops=row["tflops"],
                         figure=f"{row['seconds'] * 1e3:.2f} ms, {row['tflops']:.1f} TFLOP/s")
            if naive is not None:
                entry["x_naive"] = naive["seconds"] / row["seconds"]
            if previous is not None:
                entry["x_previous"] = previous["seconds"] / row["seconds"]
            if sdpa is not None:
                entry["x_sdpa"] = row["tflops"] / sdpa["tflops"]
            previous = row
        out.append(entry)
    return out


def rung_tiles(r: Rung | str, d: int = 64) -> tuple[int, int]:
    """``(block_q, block_k)``: the default tiles of rung ``r``'s kernel at head dim ``d`` (its
    ``lessons.gpu.source`` config function), and 128-row query blocks with 64-key tiles for SDPA (Dao 2023).
    TypeError for an ``r`` that is neither a Rung nor a name; ValueError for the naive rung (it has no tiles)
    or a ``d`` the rung's kernel cannot take."""
    from lessons.gpu import source

    r = _rung(r)
    if r.name == "naive":
        raise ValueError("the naive rung has no tiles: it writes the whole of S to HBM")
    if r.name == "sdpa":
        return 128, 64
    if r.name in ("mma", "mma_async"):                       # (their configs give block_k alone)
        config = {"mma": source.flash_attention_mma_config, "mma_async": source.flash_attention_mma_async_config}
        return source.MMA_BLOCK_Q, config[r.name](d)
    if r.name in ("mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean"):   # (theirs give min_blocks as well)
        config = {"mma_fa2": source.flash_attention_mma_fa2_config, "mma_fa2_lazy": source.flash_attention_mma_fa2_lazy_config,
                  "mma_fa2_wide": source.flash_attention_mma_fa2_wide_config,
                  "mma_fa2_lean": source.flash_attention_mma_fa2_lean_config}
        bq, bk, _ = config[r.name](d)
        return bq, bk
    config = {"scalar": source.flash_attention_config, "regtile": source.flash_attention_regtile_config,
              "regtile_wide": source.flash_attention_regtile_wide_config,
              **{name: source.flash_attention_wgmma_config for name in HOPPER_RUNGS}}
    return tuple(config[r.name](d))


def rung_intensity(r: Rung | str, n: int = 8192, d: int = 64) -> float:
    """Arithmetic intensity (FLOPs per HBM byte, one head) of rung ``r`` by the IO model of
    :mod:`lessons.cost.traffic`: textbook for the naive rung (S in HBM), FA-2 loop order with
    the rung's own tiles (:func:`rung_tiles`) for ours, 128-row query blocks and 64-key tiles for SDPA
    (Dao 2023). TypeError for an ``r`` that is neither a Rung nor a name; ValueError for a ``d`` the rung's
    kernel cannot take."""
    r = _rung(r)
    es = 4 if r.dtype == "float32" else 2
    if r.name == "naive":
        return textbook_io(n, d, element_size=es).intensity
    bq, bk = rung_tiles(r, d)
    return flash_io(n, d, m_bytes=H200.sram_bytes, element_size=es, order="fa2", block_q=bq, block_k=bk).intensity


def rung_build(r: Rung | str, d: int = 64):
    """The :class:`lessons.gpu.source.KernelBuild` of a rung with a kernel of ours at head dim
    ``d``; ValueError for the rungs without one (naive, sdpa); TypeError for an ``r`` that is neither a
    Rung nor a name."""
    from lessons.gpu import source

    r = _rung(r)
    if r.kernel is None:
        raise ValueError(f"rung {r.name!r} has no kernel of ours to build")
    return {"scalar": lambda: source.flash_attention_build(d, r.dtype),
            "regtile": lambda: source.flash_attention_regtile_build(d, r.dtype),
            "regtile_wide": lambda: source.flash_attention_regtile_wide_build(d, r.dtype),
            "mma": lambda: source.flash_attention_mma_build(d, r.dtype),
            "mma_async": lambda: source.flash_attention_mma_async_build(d, r.dtype),
            "mma_fa2": lambda: source.flash_attention_mma_fa2_build(d, r.dtype),
            "mma_fa2_lazy": lambda: source.flash_attention_mma_fa2_lazy_build(d, r.dtype),
            "mma_fa2_wide": lambda: source.flash_attention_mma_fa2_wide_build(d, r.dtype),
            "mma_fa2_lean": lambda: source.flash_attention_mma_fa2_lean_build(d, r.dtype),
            "wgmma": lambda: source.flash_attention_wgmma_build(d, r.dtype),
            "wgmma_overlap": lambda: source.flash_attention_wgmma_overlap_build(d, r.dtype),
            "wgmma_pingpong": lambda: source.flash_attention_wgmma_overlap_build(d, r.dtype)}[r.name]()


def measure_ladder(n: int = 8192, d: int = 64, heads: int = 8, warmup: int = 2, repeats: int = 7,
                   seed: int = 0) -> list[dict]:
    """Time every rung on the CUDA device now (median of CUDA events), in each rung's dtype.

    Returns rows shaped like :func:`recorded_rows` (impl = the rung's name; note says why a
    rung was skipped, e.g. torch missing), which :func:`ladder_table` takes as ``rows``.
    Raises RuntimeError without a CUDA device, TypeError/ValueError naming the argument for a
    non-int (bools included) or out-of-range ``n``, ``d``, ``heads``, ``warmup``, ``repeats``, ``seed``.
    """
    import numpy as np

    import lessons.gpu as gpu
    from lessons.gpu.measure import median_cuda_seconds, naive_attention

    n, d, heads = check_int(n, "n", min=1), check_int(d, "d", min=1), check_int(heads, "heads", min=1)
    warmup, repeats = check_int(warmup, "warmup", min=0), check_int(repeats, "repeats", min=1)
    seed = check_int(seed, "seed", min=0)
    if not gpu.device_available():
        raise RuntimeError("measure_ladder needs a CUDA device; without one show the recorded table")
    import cupy

    rng = np.random.default_rng(seed)
    host = [rng.standard_normal((heads, n, d), dtype=np.float32) for _ in range(3)]
    flops = attention_flops(n, d, heads)
    out = []
    for dtype in ("float32", "float16"):
        q, k, v = (cupy.asarray(x.astype(dtype)) for x in host)
        calls = {"naive": lambda: naive_attention(cupy, q, k, v),
                 "scalar": lambda: gpu.flash_attention_gpu(q, k, v)}
        if dtype == "float32":
            calls["regtile"] = lambda: gpu.flash_attention_regtile_gpu(q, k, v)
            calls["regtile_wide"] = lambda: gpu.flash_attention_regtile_wide_gpu(q, k, v)
        else:
            calls["mma"] = lambda: gpu.flash_attention_mma_gpu(q, k, v)
            calls["mma_async"] = lambda: gpu.flash_attention_mma_async_gpu(q, k, v)
            calls["mma_fa2"] = lambda: gpu.flash_attention_mma_fa2_gpu(q, k, v)
            calls["mma_fa2_lazy"] = lambda: gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v)
            calls["mma_fa2_wide"] = lambda: gpu.flash_attention_mma_fa2_wide_gpu(q, k, v)
            calls["mma_fa2_lean"] = lambda: gpu.flash_attention_mma_fa2_lean_gpu(q, k, v)
            if gpu.device_arch() == "sm_90":
                calls["wgmma"] = lambda: gpu.flash_attention_wgmma_gpu(q, k, v)
                calls["wgmma_overlap"] = lambda: gpu.flash_attention_wgmma_overlap_gpu(q, k, v)
                calls["wgmma_pingpong"] = lambda: gpu.flash_attention_wgmma_pingpong_gpu(q, k, v)
            else:
                out.extend(dict(impl=name, n=n, d=d, heads=heads, causal=False, dtype=dtype, seconds=None,
                                tflops=None, note="skipped: the Hopper rungs run on compute capability 9.0 only")
                           for name in HOPPER_RUNGS)
            try:
                import torch
                import torch.nn.functional as F

                tq, tk, tv = (torch.as_tensor(x, device="cuda").unsqueeze(0) for x in (q, k, v))
                calls["sdpa"] = lambda: F.scaled_dot_product_attention(tq, tk, tv)
            except ImportError:
                out.append(dict(impl="sdpa", n=n, d=d, heads=heads, causal=False, dtype=dtype, seconds=None,
                                tflops=None, note="skipped: torch is not installed"))
        for name, fn in calls.items():
            seconds = median_cuda_seconds(cupy, fn, warmup, repeats)
            out.append(dict(impl=name, n=n, d=d, heads=heads, causal=False, dtype=dtype, seconds=seconds,
                            tflops=flops / seconds / 1e12, note=""))
        cupy.get_default_memory_pool().free_all_blocks()
    return out


def ladder_points(n: int = 8192, ds=(64, 128), rows=None) -> list[dict]:
    """What the ladder's roofline draws: one dict per (rung, d) with name, title, d, precision
    (``"fp32"`` or ``"bf16"``, the roof its dtype runs under; fp16 shares bf16's), intensity
    (FLOPs per HBM byte, :func:`rung_intensity`), tflops (measured, None when not) and figure.
    A head dim the run lacks is drawn as not measured; a repeated one once. TypeError for ``ds`` that is
    not a sequence of ints; ValueError when the run has no rows at ``n`` with any of ``ds``, or for a head
    dim some rung's kernel cannot take."""
    ds = tuple(dict.fromkeys(check_int_sequence(ds, "ds", min=1)))
    rows = _rows(rows)
    n, ds = _check_shape(rows, n, list(ds))
    out = []
    for d in ds:
        for entry in _table(n, d, rows):
            r = rung(entry["name"])
            try:
                intensity = rung_intensity(r, n, d)
            except ValueError as err:
                raise ValueError(f"ds: the {r.name} rung cannot run at d = {d} ({err})") from None
            out.append(dict(name=r.name, title=r.title, d=d, precision="fp32" if r.dtype == "float32" else "bf16",
                            intensity=intensity, tflops=entry["tflops"], figure=entry["figure"]))
    return out


#: the seed's claim: FlashAttention is 2-4x faster (wall clock) than standard attention (Dao et al. 2022, Sec. 4)
CLAIM = (2.0, 4.0)


def speedup_claim(n: int = 8192, rows=None) -> dict:
    """Where "FlashAttention is 2-4x faster than standard attention" (:data:`CLAIM`) stands on the
    measured GPU: for each head dim, the wall-clock speed-up over naive CuPy (same dtype) of our
    best measured rung and of SDPA. Returns ``{d: {"ours": (rung name, x), "sdpa": x, "holds": bool}}``
    ("ours" None and "holds" None when no rung of ours was measured; "holds": our best rung is at
    least :data:`CLAIM` [0] times naive). ``rows``: default the recorded H200 run.
    A head dim the run lacks at ``n`` gets None for all three. Raises TypeError/ValueError as
    :func:`ladder_table` when the run has no rows at ``n`` with d = 64 or 128.
    Source of the claim: Dao et al. 2022, Sec. 4 (2-4x over standard attention on GPT-2 / long-range arena)."""
    rows = _rows(rows)
    n, _ = _check_shape(rows, n, [64, 128])
    out = {}
    for d in (64, 128):
        table = _table(n, d, rows)
        ours = [(e["name"], e["x_naive"]) for e in table if e["name"] not in ("naive", "sdpa") and e["x_naive"]]
        best = max(ours, key=lambda t: t[1]) if ours else None
        sdpa = next(e["x_naive"] for e in table if e["name"] == "sdpa")
        out[d] = {"ours": best, "sdpa": sdpa, "holds": None if best is None else best[1] >= CLAIM[0]}
    return out


def sdpa_kernels(n: int = 8192, d: int = 64, heads: int = 8) -> list[str]:
    """The CUDA kernels torch's ``scaled_dot_product_attention`` launches now, on this machine's GPU,
    for one fp16 forward at ``(n, d)`` with ``heads`` heads, batch 1 (torch profiler, CUDA
    activity; memory copies and fills left out), in launch order without repeats. This is what
    :data:`SDPA_KERNEL` recorded on the H200. Raises RuntimeError saying why when torch or a CUDA
    device is missing, TypeError/ValueError naming the argument for a non-int or ``< 1`` ``n``,
    ``d``, ``heads``."""
    n, d, heads = check_int(n, "n", min=1), check_int(d, "d", min=1), check_int(heads, "heads", min=1)
    try:
        import torch
        import torch.nn.functional as F
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        raise RuntimeError("sdpa_kernels needs torch (pip install torch); without it show SDPA_KERNEL, "
                           "the recorded one") from None
    if not torch.cuda.is_available():
        raise RuntimeError("sdpa_kernels needs a CUDA device torch can use; without one show SDPA_KERNEL")
    q, k, v = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v)                  # warm-up: backend choice, autotuning
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels = [name for name in names if not name.lower().startswith(("memcpy", "memset"))]
    return list(dict.fromkeys(kernels))


def sdpa_backends(n: int = 8192, causal: bool = False, path: Path | None = None, part: str = "fwd") -> dict:
    """torch SDPA's forward speed per backend, as recorded in the 2026-11-30 H200 run
    (``PROFILED_DIR/sdpa_backends.txt``: each backend forced in turn, fp16, 8 heads, CUDA events;
    TFLOP/s counted as here, 4 N^2 d per head). Returns ``{backend: {d: forward TFLOP/s}}`` for the rows
    with this ``n`` and ``causal``, e.g. ``["FLASH_ATTENTION"][64]``: torch's own FlashAttention-2
    kernel (mma.sync, like our rungs). ``part="fwd+bwd"``: the forward and backward together instead
    (TFLOP/s counted as 3.5 times the forward's FLOPs: the backward does 2.5 times). Raises
    FileNotFoundError when the file is missing, ValueError for another ``part``, when the file has no row
    for ``n`` and ``causal`` or has a row it cannot read (the message names the line)."""
    n = check_int(n, "n", min=1)
    causal = check_flag(causal, "causal")
    if part not in ("fwd", "fwd+bwd"):
        raise ValueError(f"part must be 'fwd' or 'fwd+bwd', got {part!r}")
    path = _shipped(PROFILED_DIR / "sdpa_backends.txt") if path is None else Path(path)
    out: dict = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = dict(f.split("=", 1) for f in line.split()[:3] if "=" in f)
        if set(fields) != {"N", "d", "causal"} or "fwd" not in line:
            continue                                         # the header line (torch version, device)
        if int(fields["N"]) != n or fields["causal"] != str(causal):
            continue
        words = line.split()
        try:
            tflops = float(words[words.index(part) + 3])     # "fwd 0.488 ms 281.4 TF/s | fwd+bwd 1.808 ms ..."
            out.setdefault(words[3], {})[int(fields["d"])] = tflops
        except (ValueError, IndexError):
            raise ValueError(f"{path}, line {number}: expected 'N=.. d=.. causal=.. <backend> {part} <ms> ms "
                             f"<TF/s> TF/s', got {line!r}") from None
    if not out:
        raise ValueError(f"{path} has no row with N = {n}, causal = {causal}")
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def ladder_markdown(n: int = 8192, d: int = 64, rows=None, *, notes: bool = True) -> str:
    """A Markdown table of the ladder at ``(n, d)``: rung, what changed, predicted effect, the
    instruction its PTX must hold, the figure (recorded/live or "not yet measured on a GPU")
    and its speed-up over naive CuPy, the previous measured rung and its fraction of SDPA.
    ``notes=False`` leaves out the two columns of prose (what changed, predicted effect), which are
    the same at every shape: :func:`rung_notes_markdown` gives them once. TypeError naming ``notes``
    for a non-bool; the errors of :func:`ladder_table` otherwise."""
    from lessons.core.checks import check_flag

    notes = check_flag(notes, "notes")
    head = ["rung"] + (["what changed", "predicted effect"] if notes else []) + \
        ["PTX holds", "time, TFLOP/s", "x naive", "x previous", "of SDPA"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r, e in zip(RUNGS, ladder_table(n, d, rows)):
        prose = f" {r.changed} | {r.predicted} |" if notes else ""
        lines.append(f"| {r.title} ({r.dtype}) |{prose} "
                     f"{'`' + r.ptx_grep + '`' if r.ptx_grep else '-'} | {e['figure']} | {_fmt(e['x_naive'], '.2f')} | "
                     f"{_fmt(e['x_previous'], '.2f')} | {_fmt(e['x_sdpa'], '.0%')} |")
    return "\n".join(lines)


def rung_notes_markdown(rungs=None) -> str:
    """Each rung's prose once, as Markdown: a bold line with its title, dtype and name, then *what changed*
    over the rung below and the *predicted effect* (bytes, instructions, occupancy), then what bounds it
    (``limit``). ``rungs``: a sequence of :class:`Rung` (default :data:`RUNGS`; :data:`DECODE_RUNGS` works too).
    TypeError for anything else."""
    rungs = RUNGS if rungs is None else rungs
    if not isinstance(rungs, (tuple, list)) or not rungs or not all(isinstance(r, Rung) for r in rungs):
        raise TypeError(f"rungs must be a non-empty sequence of Rung (ladder.RUNGS), got {rungs!r}")
    parts = []
    for r in rungs:
        parts.append(f"**{r.title}** ({r.dtype}, `{r.name}`)\n\n"
                     f"* *what changed:* {r.changed}\n* *predicted effect:* {r.predicted}\n* *what bounds it:* {r.limit}")
    return "\n\n".join(parts)


def rung_entry(r: Rung | str, d: int = 64) -> str:
    """The name of the entry point that runs rung ``r``'s forward at head dim ``d`` (what a profiler such as
    Nsight Compute filters on, ``ncu -k NAME``): the rung's own where its file holds several forwards
    (``flash_attention_wgmma_pingpong``), else the file's first (a file may hold a probe too).
    ValueError for a rung without a kernel of ours; TypeError for an ``r`` that is neither a Rung nor a name."""
    r = _rung(r)
    build = rung_build(r, d)
    return r.kernel if r.kernel in build.entries else build.entries[0]


def rung_evidence(d: int = 64, arch: str = "sm_90") -> list[dict]:
    """What the compiler says of each rung with a kernel of ours at head dim ``d``, no GPU needed:
    name, arch, registers per thread, shared memory (static + dynamic, bytes), spilled bytes, and how
    many times the rung's instruction (:attr:`Rung.ptx_grep`) occurs in its PTX. A rung built for one
    architecture only (the Hopper rung: sm_90a) is compiled for that one. Needs CuPy/NVRTC."""
    from lessons.gpu.compile import compile_kernel, compile_ptx, entry_ptx

    out = []
    for r in RUNGS:
        if r.kernel is None:
            continue
        build = rung_build(r, d)
        rung_arch = build.arch or arch
        entry = rung_entry(r, d)
        res = compile_kernel(build, rung_arch).resources[entry]
        out.append(dict(name=r.name, arch=rung_arch, registers=res.registers,
                        smem_bytes=res.smem_bytes + build.dynamic_smem_bytes,
                        spill_bytes=res.spill_store_bytes + res.spill_load_bytes, instruction=r.ptx_grep,
                        count=entry_ptx(compile_ptx(build, rung_arch), entry).count(r.ptx_grep)))
    return out


#: what ptxas writes when it serialises wgmma (warnings C7513/C7515: a register of a product in flight is
#: written by ordinary code, so it waits for every product before each one)
SERIALISED_WGMMA = "Potential Performance Loss"


def overlap_evidence(d: int = 64) -> dict:
    """What the compiler says of the overlapped Hopper rung beside the plain one at head dim ``d``
    (64 or 128), no GPU needed (needs CuPy/NVRTC): ``registers``, ``smem_bytes`` (dynamic) and
    ``stages`` and ``serialised`` (whether ptxas's log says :data:`SERIALISED_WGMMA`), each
    ``{"wgmma": ..., "wgmma_overlap": ...}``; in the overlapped rung's PTX,
    ``wait_group_1`` (how many ``wgmma.wait_group.sync.aligned 1``: the wait that leaves P V running) and
    ``ex2_between_waits`` (how many ``ex2.approx`` lie between that wait and the next
    ``wgmma.wait_group.sync.aligned 0``: P's exponentials, computed while P V runs; alpha's come after that wait, in
    the lazy rescale's branch); ``s_per_thread`` (the
    values of S_j one consumer thread holds: 64 x block_k / 128) and ``log_warnings`` (the overlapped
    rung's ptxas log lines that hold "warning"). TypeError/ValueError naming ``d`` for another head dim.
    Source: PTX ISA 8.x, ``wgmma.wait_group``; Shah et al. 2024 (FlashAttention-3), Alg. 2."""
    from lessons.gpu import source
    from lessons.gpu.compile import compile_kernel, compile_ptx, entry_ptx

    d = check_int(d, "d")
    if d not in source.WGMMA_CONFIGS:
        raise ValueError(f"d must be one of {sorted(source.WGMMA_CONFIGS)} (the Hopper rungs' head dims), got {d}")
    _, bk = source.WGMMA_CONFIGS[d]
    out, logs = dict(registers={}, smem_bytes={}, stages={}, serialised={}), {}
    for name in ("wgmma", "wgmma_overlap"):
        build = rung_build(name, d)
        compiled = compile_kernel(build, build.arch)
        logs[name] = compiled.log
        out["registers"][name] = compiled.resources[rung_entry(name, d)].registers
        out["smem_bytes"][name] = build.dynamic_smem_bytes
        out["stages"][name] = dict(build.defines).get("STAGES", source.WGMMA_STAGES)
        out["serialised"][name] = SERIALISED_WGMMA in compiled.log
    ptx = entry_ptx(compile_ptx(build, build.arch), rung_entry("wgmma_overlap", d))
    wait_1, wait_0 = "wgmma.wait_group.sync.aligned 1", "wgmma.wait_group.sync.aligned 0"
    out["wait_group_1"] = ptx.count(wait_1)
    between = ptx.split(wait_1, 1)[1].split(wait_0, 1)[0] if wait_1 in ptx else ""
    out["ex2_between_waits"] = between.count("ex2.approx")
    out["s_per_thread"] = 64 * bk // 128
    out["log_warnings"] = [line for line in logs["wgmma_overlap"].splitlines() if "warning" in line.lower()]
    return out


# ---------------------------------------------------------------------------
# the decode ladder: one query per head against a long paged KV cache
# ---------------------------------------------------------------------------
# Decoding does a few FLOPs per byte of K/V read (4 at 4 query heads per KV head in fp16: one multiply-add per
# query head and value), so a decode rung is judged by bytes, not
# FLOPs: the K/V read rate as a fraction of the device's copy rate (benchmarks/gpu_decode.py).

#: the recorded decode figures of the same H200 run (fp16, 32 query heads on 8 KV heads, d = 128, pages of 16;
#: columns kernel, num_seqs, seq_len, num_splits, seconds, kv_bytes, tb_per_s, pct_of_copy, max_abs_diff)
DECODE_RECORDED = RECORDED_DIR / "decode" / "results.csv"

DECODE_RUNGS = (
    Rung("paged_decode", "one block per sequence and head group", "paged_decode", "paged_decode",
         "lessons.gpu.paged_decode_gpu", "float16",
         "the FA-2 loop over the pages of the block table; a GQA group's 4 query heads share each page the block "
         "stages in shared memory",
         "num_seqs x 8 blocks: 512 at 64 sequences, 8 at one (for 132 SMs); K and V read 2 bytes per thread per load",
         "ld.global.nc.u16", "too little parallelism per sequence, scalar loads (2026-11-30 run)"),
    Rung("flash_decoding", "split over the keys, partial states merged", "flash_decoding", "paged_decode",
         "lessons.gpu.flash_decoding_gpu", "float16",
         "each (sequence, group) cut into num_splits ranges of pages, one block each; a second kernel "
         "merges the partial (m, l, o) with the lse rule",
         "num_splits times more blocks, so one long sequence fills the GPU; the loads stay scalar",
         "ld.global.nc.u16", "scalar loads, one page staged per barrier"),
    Rung("paged_decode_split", "GQA group per block, 16-byte loads, splits from the shape", "paged_decode_split",
         "paged_decode_split", "lessons.gpu.paged_decode_split_gpu", "float16",
         "16 lanes read a 256-byte key row, 16 bytes each; each lane group issues 4 keys' K and V loads before "
         "using any and keeps its own (m, l, o), merged in shared memory at the end; one reduce-scatter sums the "
         "16 partial dots of 4 keys x 4 heads, so each lane does one (key, head)'s softmax; num_splits from "
         "decode_splits (132 SMs x 4 blocks)",
         "16 KiB in flight per block (8 rows of 256 bytes per warp), 4 blocks per SM at 128 registers, no spills: "
         "enough to keep HBM busy; aim: 70% of the copy rate. Measured (2026-12-01): 68% at 64 x 4096, 51% at "
         "8 x 32768, 66% at 1 x 131072, 5-15x flash_decoding: not met. The 51% ran 9 splits: a second wave of 48 "
         "blocks, as long as the first; decode_splits now picks 8, one wave, not yet measured",
         "ld.global.nc.v4.u32", "not profiled yet (the Nsight Compute run of 2026-11-30 predates it)"),
    Rung("paged_decode_prefetch", "+ the next step's rows loaded while this step's are used", "paged_decode_prefetch",
         "paged_decode_split", "lessons.gpu.paged_decode_split_gpu", "float16",
         "the split kernel built with PREFETCH=1 (paged_decode_split_gpu(..., prefetch=True)): each lane group "
         "issues its next step's K and V loads before it absorbs this step's, into a second register set (the "
         "two take turns); so 3 blocks per SM instead of 4, and num_splits fills a wave of 132 x 3",
         "the next step's rows are on their way while this step computes, where the split rung then has none of "
         "its own in flight. Compile report (NVRTC 12.9, sm_80 / sm_90, no spills): 168 registers, 3 blocks per "
         "SM, 12 warps instead of 16 (at 4 blocks: 388 / 452 bytes of spill stores and loads). SASS (sm_90): "
         "a step's rows asked for 720 instructions before their first use (the split rung: 115), 734.5 "
         "instructions per step (the split rung: 731); output bitwise the split rung's; aim: 70% of the copy rate",
         "ld.global.nc.v4.u32", "not yet measured on a GPU"),
    Rung("paged_decode_cp_async", "+ rows copied to shared memory with cp.async, two steps ahead",
         "paged_decode_cp_async", "paged_decode_split", "lessons.gpu.paged_decode_split_gpu", "float16",
         "the split kernel built with ASYNC_STAGES=3 (paged_decode_split_gpu(..., cp_async=True)): each thread "
         "copies its 16-byte pieces of K and V into a ring of 3 steps in shared memory (cp.async, sm_80+), "
         "issuing step i + 2's copies before waiting for step i's (cp.async.wait_group 2); it reads back only "
         "its own pieces, so no barrier; ring and final merge share the block's 48 KiB",
         "the rows in flight wait in shared memory, not registers: the split rung's 128 registers and 4 blocks per "
         "SM, with two steps (32 KiB per block, 128 KiB per SM) on their way during every step, against the 22 KiB "
         "per SM Little's law asks at the copy rate; one shared-memory read per piece more than the split rung; "
         "aim: 70% of the copy rate",
         "cp.async.cg.shared.global", "not yet measured on a GPU"),
)

#: launcher keywords of a decode rung that is another build of the same launcher (its name -> keywords): the
#: prefetch rung is ``paged_decode_split_gpu(..., prefetch=True)``, the cp.async rung ``cp_async=True``; the rung's
#: build, the decode benchmark and
#: the profiling script all read this
DECODE_LAUNCH_OPTIONS = {"paged_decode_prefetch": {"prefetch": True}, "paged_decode_cp_async": {"cp_async": True}}


def decode_rung(name: str) -> Rung:
    """The decode rung called ``name`` (one of ``[r.name for r in DECODE_RUNGS]``); ValueError otherwise."""
    for r in DECODE_RUNGS:
        if r.name == name:
            return r
    raise ValueError(f"decode rung must be one of {[r.name for r in DECODE_RUNGS]}, got {name!r}")


def decode_rung_build(r: Rung | str, d: int = 128):
    """The :class:`lessons.gpu.source.KernelBuild` of a decode rung at head dim ``d`` (32 query heads on 8
    KV heads, pages of 16, the rung's dtype)."""
    from lessons.gpu import source

    r = decode_rung(r) if isinstance(r, str) else r
    if r.kernel == "paged_decode":
        return source.paged_decode_build(d, 16, 32, 8, r.dtype)
    return source.paged_decode_split_build(d, 16, 32, 8, r.dtype, **DECODE_LAUNCH_OPTIONS.get(r.name, {}))


def decode_rung_entry(r: Rung | str) -> str:
    """The entry point that runs decode rung ``r``'s key loop (what a profiler filters on, ``ncu -k NAME``):
    ``paged_decode`` for the one-pass rung, ``paged_decode_split`` for flash-decoding (its merge is a second
    kernel), ``paged_decode_gqa_split`` for the split, prefetch and cp.async rungs. ValueError for another name."""
    r = decode_rung(r) if isinstance(r, str) else r
    return {"paged_decode": "paged_decode", "flash_decoding": "paged_decode_split"}.get(r.name, "paged_decode_gqa_split")


def decode_recorded_rows(path: Path | None = None) -> list[dict]:
    """The recorded decode rows (default :data:`DECODE_RECORDED`, written by ``benchmarks/gpu_decode.py``)
    as dicts: name (the kernel, e.g. ``"flash_decoding"``), variant (the rest of the ``kernel`` column:
    ``"s=8"``, ``"auto"`` or ``""``), num_seqs, seq_len, num_splits (int), ms, kv_bytes (int),
    tb_per_s (K/V bytes read per second / 1e12), pct (of the device copy rate, float) and
    max_abs_diff (against NumPy). FileNotFoundError without the file; ValueError naming the file and
    line for a missing column, a line of the wrong length, an empty, malformed or negative number."""
    path = _shipped(DECODE_RECORDED) if path is None else path
    columns = dict(kernel=str, num_seqs=int, seq_len=int, num_splits=int, seconds=float, kv_bytes=int, tb_per_s=float,
                   pct_of_copy=float, max_abs_diff=float)
    rows = []
    for line, r in typed_csv_rows(path, columns):
        empty = [c for c, kind in columns.items() if kind is not str and r[c] is None]
        if empty:
            raise ValueError(f"{path}, line {line}: columns {empty} must not be empty")
        name, _, variant = r["kernel"].partition(" ")
        rows.append(dict(name=name, variant=variant, num_seqs=r["num_seqs"], seq_len=r["seq_len"],
                         num_splits=r["num_splits"], ms=r["seconds"] * 1e3, kv_bytes=r["kv_bytes"],
                         tb_per_s=r["tb_per_s"], pct=r["pct_of_copy"], max_abs_diff=r["max_abs_diff"]))
    return rows


#: the keys of a decode row (decode_recorded_rows) that the decode tables read
_DECODE_KEYS = ("name", "num_seqs", "seq_len", "num_splits", "pct")


def recorded_copy_rate(rows=None) -> float | None:
    """The device's copy rate (bytes/s) in a decode run (``rows`` as :func:`decode_recorded_rows` gives them, default
    the recorded run): a row's K/V read rate over its share of the copy rate, every row of a run sharing the one copy
    rate it was measured against; None when no row has a share above 0. The errors of reading ``rows``."""
    for r in _decode_rows(rows):
        if r["pct"] > 0:
            return r["tb_per_s"] * 1e12 * 100 / r["pct"]
    return None


def _decode_rows(rows) -> list:
    """``rows`` (default: the recorded decode run) as a list of row dicts with the keys the tables read;
    TypeError for rows that are not dicts, ValueError naming the first row that lacks a key."""
    if rows is None:
        return decode_recorded_rows()
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"rows must be a list of decode row dicts (decode_recorded_rows()), got {type(rows).__name__}")
    for i, row in enumerate(rows):
        missing = [k for k in _DECODE_KEYS if k not in row]
        if missing:
            raise ValueError(f"rows[{i}] lacks {missing}: a decode row has {list(_DECODE_KEYS)} "
                             f"(see decode_recorded_rows)")
    return list(rows)


def _decode_best(r: Rung, rows) -> dict:
    """``{(num_seqs, seq_len): the row of rung r with the highest pct}`` (several split counts were run)."""
    best = {}
    for row in rows:
        if r.impl is not None and row["name"] == r.impl:
            key = (row["num_seqs"], row["seq_len"])
            if key not in best or row["pct"] > best[key]["pct"]:
                best[key] = row
    return best


def decode_recorded(r: Rung | str, rows=None) -> dict | None:
    """``{(num_seqs, seq_len): % of the copy rate}`` recorded for decode rung ``r`` (the best split
    count where several were run), or None when the rung was never measured on a GPU.
    ``rows``: default :func:`decode_recorded_rows`. TypeError for an ``r`` that is neither a Rung nor a name."""
    if not isinstance(r, (Rung, str)):
        raise TypeError(f"r must be a decode Rung or its name, got {type(r).__name__} {r!r}")
    r = decode_rung(r) if isinstance(r, str) else r
    return {key: row["pct"] for key, row in _decode_best(r, _decode_rows(rows)).items()} or None


def _pct(p: float) -> str:
    """A share in percent: whole percents, one decimal below 1% (so 0.14% does not read as 0%)."""
    return f"{p:.1f}%" if p < 1 else f"{p:.0f}%"


def decode_table(rows=None) -> list[dict]:
    """One dict per decode rung: name, title, pct (``{(num_seqs, seq_len): % of the copy rate}`` or
    None), splits (``{(num_seqs, seq_len): num_splits}`` of those rows, or None) and figure (text:
    the recorded percentages with their split counts, or :data:`NOT_MEASURED`). ``rows``: default the
    recorded run; TypeError/ValueError as for a row list that is not decode rows."""
    rows = _decode_rows(rows)
    out = []
    for r in DECODE_RUNGS:
        best = _decode_best(r, rows)
        items = sorted(best.items(), key=lambda kv: -kv[0][0])
        figure = NOT_MEASURED if not best else ", ".join(
            f"{s} x {n}: {_pct(row['pct'])} ({row['num_splits']} split{'s' if row['num_splits'] > 1 else ''})"
            for (s, n), row in items)
        out.append(dict(name=r.name, title=r.title, pct={k: row["pct"] for k, row in best.items()} or None,
                        splits={k: row["num_splits"] for k, row in best.items()} or None, figure=figure))
    return out


def decode_markdown(rows=None) -> str:
    """A Markdown table of the decode rungs: rung, what changed, the instruction its PTX holds and its
    share of the device copy rate per shape (sequences x tokens; the split count of that row)."""
    lines = ["| rung | what changed | PTX holds | K/V read rate, % of the copy rate |", "| --- | --- | --- | --- |"]
    for r, e in zip(DECODE_RUNGS, decode_table(rows)):
        lines.append(f"| {r.title} (`{r.name}`) | {r.changed} | `{r.ptx_grep}` | {e['figure']} |")
    return "\n".join(lines)


#: the decode shapes of the benchmark and the decode target, (sequences, tokens each): 32 query heads on 8 KV
#: heads, d = 128, fp16, pages of 16 (``benchmarks/gpu_decode.py``)
DECODE_SHAPES = ((64, 4096), (8, 32768), (1, 131072))


def split_sweep_markdown(sweeps: dict, rows=None) -> str:
    """A Markdown table of the wave model per decode shape: blocks per split, pages, the wave; the count
    :func:`lessons.gpu.source.decode_splits` picks (the most splits whose blocks fit in one wave) and one split
    more, each with its modelled time ``waves x pages per block``; the counts of the sweep the model finds cheaper
    than the pick (all of several waves): how many, the fewest splits among them and the cheapest (the sweep's
    ``best``), with how much under the pick it is; the least any count could take (every slot of every
    wave busy: ``blocks per split x pages / wave``); and the split count of the split rung's best recorded row
    at that shape ("-" where none). ``sweeps``: ``{(num_seqs, seq_len): lessons.gpu.source.decode_split_sweep(
    num_seqs, seq_len, ...)}`` (give ``max_splits`` = the pages for the model's full sweep); ``rows``: the decode
    rows (default the recorded run). TypeError for a ``sweeps`` that is not such a dict (naming the key or the
    missing fields), ValueError for a sweep whose costs leave out its pick (:func:`lessons.gpu.source.
    check_split_sweep`)."""
    from lessons.gpu.source import cheaper_than_pick, check_split_sweep, decode_split_terms
    if not isinstance(sweeps, dict) or not sweeps:
        raise TypeError(f"sweeps must be a non-empty dict {{(num_seqs, seq_len): decode_split_sweep(...)}}, "
                        f"got {sweeps!r:.80}")
    for k, v in sweeps.items():
        if not (isinstance(k, tuple) and len(k) == 2
                and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in k)):
            raise TypeError(f"sweeps must be keyed by (num_seqs, seq_len), two ints, got the key {k!r}")
        check_split_sweep(v, f"sweeps[{k!r}]")
    ran = next(e for e in decode_table(rows) if e["name"] == "paged_decode_split")["splits"] or {}

    def cost(sw, k):
        waves, pages_per_block = decode_split_terms(k, sw["blocks_per_split"], sw["pages"], sw["wave"])
        return f"{k}: {waves} x {pages_per_block} = {waves * pages_per_block}"

    lines = ["| shape | blocks per split | pages | wave | picks: most that fit in a wave | one split more "
             "| counts the model finds cheaper (of those costed) | every slot busy | the recorded split rung ran |",
             "| --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: |"]
    for (seqs, tokens), sw in sweeps.items():
        pick, best, costs = sw["pick"], sw["best"], sw["costs"]
        more = cost(sw, pick + 1) if pick + 1 <= sw["pages"] else f"- ({sw['pages']} pages)"
        cheaper = cheaper_than_pick(sw)
        cheapest = (f"none of 1..{max(costs):,}" if not cheaper else
                    f"{len(cheaper)} of 1..{max(costs):,}; the fewest splits {cost(sw, cheaper[0])}; the cheapest "
                    f"{cost(sw, best)}, {100 * (1 - costs[best] / costs[pick]):.1f}% under the pick")
        lines.append(f"| {seqs} x {tokens:,} | {sw['blocks_per_split']} | {sw['pages']:,} | {sw['wave']} "
                     f"| **{cost(sw, pick)}** | {more} | {cheapest} | {sw['bound']:.1f} "
                     f"| {ran.get((seqs, tokens), '-')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the ladder's targets, and whether the recorded run met them
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    """One target of the ladder: ``rung`` (a name in :data:`RUNGS` or :data:`DECODE_RUNGS`; None when
    no rung for it has been built) must reach ``goal`` in ``metric`` (``"x_naive"``: speed-up over
    naive CuPy in the same dtype; ``"x_sdpa"``: fraction of torch SDPA's TFLOP/s; ``"pct_of_copy"``:
    K/V read rate in % of the device copy rate) at every shape in ``shapes`` (head dims for the
    forward at N = 8192, (num_seqs, seq_len) for decode). ``also``: later rungs of the same kind whose
    figure counts too (the best of ``rung`` and ``also`` at each shape, named with it)."""

    what: str
    rung: str | None
    metric: str
    goal: float
    shapes: tuple
    also: tuple = ()


TARGETS = (
    Target("fp32 CUDA-core forward: >= 3x naive CuPy (register tiling)", "regtile", "x_naive", 3.0, (64, 128),
           also=("regtile_wide",)),
    Target("fp16 tensor-core forward (mma.sync): >= 0.5x torch SDPA", "mma_fa2", "x_sdpa", 0.5, (64, 128),
           also=("mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean")),
    Target("Hopper rung (wgmma + TMA, sm_90a): >= 0.75x torch SDPA", "wgmma_pingpong", "x_sdpa", 0.75, (64, 128),
           also=("wgmma", "wgmma_overlap")),
    Target("decode: K/V read at >= 70% of the device copy rate", "paged_decode_split", "pct_of_copy", 70.0,
           ((64, 4096), (8, 32768), (1, 131072)), also=("paged_decode_prefetch", "paged_decode_cp_async")),
)


def target_outcomes(n: int = 8192, rows=None, decode_rows=None) -> list[dict]:
    """Each of :data:`TARGETS` against a run: what, rung, metric, goal, measured (``{shape: value}``, the best of
    the target's rung and its ``also`` rungs, None where none of them was measured at that shape; None when the
    rung is not built), by (``{shape: the rung that gave it}``, None where not measured), pending (the ``also``
    rungs measured at none of the shapes, in order), needs (forward targets: ``{d: the TFLOP/s the goal asks
    for}``, the goal times naive CuPy's or SDPA's recorded TFLOP/s; decode: ``{shape: the K/V read rate it asks
    for, TB/s}``, the goal times the recorded copy rate; None where the run has no reference), needs_peak (``{shape:
    that as a share of the H200's peak}``: fp32 CUDA cores, 16-bit tensor cores or HBM), met (True, False, or
    None when not built or not measured at every shape) and outcome (text: "met", "not met",
    "not built" or :data:`NOT_MEASURED`). ``rows``/``decode_rows``: default the recorded H200 run.
    Raises TypeError/ValueError as :func:`ladder_table` when ``rows`` has no rows at ``n`` with any
    head dim a target names."""
    rows = _rows(rows)
    n, _ = _check_shape(rows, n, sorted({d for t in TARGETS if t.metric != "pct_of_copy" for d in t.shapes}))
    out = []
    for t in TARGETS:
        measured = by = needs = needs_peak = None
        pending = []
        if t.rung is not None and t.metric in ("x_naive", "x_sdpa"):
            dtype = _rung(t.rung).dtype
            base = {d: recorded("naive", n, d, dtype, rows=rows) if t.metric == "x_naive" else
                    recorded("sdpa", n, d, rows=rows) for d in t.shapes}
            needs = {d: None if b is None else t.goal * b["tflops"] for d, b in base.items()}
            peak = H200.peak_flops["fp32" if dtype == "float32" else "bf16"] / 1e12
            needs_peak = {d: None if v is None else v / peak for d, v in needs.items()}
        elif t.metric == "pct_of_copy":
            copy = recorded_copy_rate(decode_rows)
            if copy is not None:
                needs = {sh: t.goal / 100 * copy / 1e12 for sh in t.shapes}
                needs_peak = {sh: v / (H200.hbm_bytes_per_s / 1e12) for sh, v in needs.items()}
        if t.rung is not None and t.metric == "pct_of_copy":
            pcts = {name: decode_recorded(name, decode_rows) or {} for name in (t.rung, *t.also)}
            measured, by = {}, {}
            for sh in t.shapes:
                here = [(pct[sh], name) for name, pct in pcts.items() if sh in pct]
                measured[sh], by[sh] = max(here) if here else (None, None)
            pending = [name for name in t.also if not pcts[name]]
        elif t.rung is not None:
            figures = {d: [(e[t.metric], e["name"]) for e in _table(n, d, rows)
                           if e["name"] in (t.rung, *t.also) and e[t.metric] is not None] for d in t.shapes}
            measured, by = {}, {}
            for d, here in figures.items():
                measured[d], by[d] = max(here) if here else (None, None)
            seen = {name for here in figures.values() for _, name in here}
            pending = [r for r in t.also if r not in seen]
        if measured is None:
            met, outcome = None, "not built"
        elif any(v is None for v in measured.values()):
            met, outcome = None, NOT_MEASURED
        else:
            met = all(v >= t.goal for v in measured.values())
            outcome = "met" if met else "not met"
        out.append(dict(what=t.what, rung=t.rung, metric=t.metric, goal=t.goal, measured=measured, by=by, pending=pending,
                        needs=needs, needs_peak=needs_peak, met=met, outcome=outcome))
    return out


#: the kinds of target :func:`targets_markdown` can keep: the forward rungs' (speed-ups), decode's (copy rate),
#: and the Hopper rungs' (a forward target too, whose rung is one of :data:`HOPPER_RUNGS`)
TARGET_KINDS = ("forward", "decode", "hopper")


def _of_kind(outcome: dict, kind: str | None) -> bool:
    """Whether a :func:`target_outcomes` entry is a target of ``kind`` (None: every kind)."""
    if kind is None:
        return True
    if kind == "hopper":
        return outcome["rung"] in HOPPER_RUNGS
    return (outcome["metric"] == "pct_of_copy") == (kind == "decode")


def _ladder_order(names) -> list:
    """``names`` of rungs in the order the ladders list them (RUNGS, then DECODE_RUNGS)."""
    order = [r.name for r in (*RUNGS, *DECODE_RUNGS)]
    return sorted(names, key=order.index)


def targets_markdown(n: int = 8192, rows=None, decode_rows=None, *, kind: str | None = None) -> str:
    """A Markdown table of :func:`target_outcomes`: target, rungs, what the goal asks for (TFLOP/s and share of
    the H200's peak, forward targets), measured value per shape (the rung that gave it, where the target counts
    more than one), outcome. ``kind``: None for every target, ``"forward"`` or ``"decode"`` for those of one kind
    only, ``"hopper"`` for the forward target of the Hopper rungs alone (:data:`TARGET_KINDS`; ValueError naming
    ``kind`` otherwise)."""
    if kind is not None and kind not in TARGET_KINDS:
        raise ValueError(f"kind must be None or one of {TARGET_KINDS}, got {kind!r}")
    def value(metric, v):
        return "-" if v is None else f"{v:.0f}%" if metric == "pct_of_copy" else f"{v:.2f}x"

    def shape(s):
        return f"d = {s}" if isinstance(s, int) else f"{s[0]} x {s[1]}"

    also = {t.rung: t.also for t in TARGETS}
    lines = ["| target | rung | the goal asks for | measured | outcome |", "| --- | --- | --- | --- | --- |"]
    for o in target_outcomes(n, rows, decode_rows):
        if not _of_kind(o, kind):
            continue
        several = bool(also.get(o["rung"]))
        got = "-" if o["measured"] is None else ", ".join(
            f"{shape(s)}: {value(o['metric'], v)}" + (f" ({o['by'][s]})" if several and v is not None else "")
            for s, v in o["measured"].items())
        names = ", ".join(f"`{r}`" for r in _ladder_order((o["rung"], *also.get(o["rung"], ())))) if o["rung"] else "-"
        wait = (f" (not yet measured: {', '.join(f'`{r}`' for r in o['pending'])})"
                if o["pending"] and o["outcome"] != NOT_MEASURED else "")
        if not o["needs"]:
            asks = "-"
        elif o["metric"] == "pct_of_copy":         # the same rate at every shape: said once
            v = next(iter(o["needs"].values()))
            asks = f"{v:.1f} TB/s of K/V read ({next(iter(o['needs_peak'].values())):.0%} of the HBM peak)"
        else:
            peak = "FP32" if _rung(o["rung"]).dtype == "float32" else "tensor-core"
            asks = ", ".join(f"{shape(d)}: {v:.0f} TFLOP/s ({o['needs_peak'][d]:.0%} of the {peak} peak)"
                             if v is not None else f"{shape(d)}: -" for d, v in o["needs"].items())
        lines.append(f"| {o['what']} | {names} | {asks} | {got} | **{o['outcome']}**{wait} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the tuning sweeps of a recorded run (scripts/tune_tiles.py): which tiles were fastest
# ---------------------------------------------------------------------------

#: rung -> its tuning sweep's CSV within a recorded run's folder (``scripts/tune_tiles.py --rung RUNG``)
SWEEP_FILES = {"mma_fa2_lean": "fa2_lean_configs/fa2_lean_configs.csv",
               "mma_fa2_wide": "fa2_wide_configs/fa2_wide_configs.csv", "mma_fa2_lazy": "fa2_configs/fa2_configs.csv",
               "regtile": "regtile_configs/regtile_configs.csv",
               "regtile_wide": "regtile_wide_configs/regtile_wide_configs.csv"}
#: the sweep CSV's columns and how each is read (``default`` as its text, "True"/"False")
_SWEEP_TYPES = dict(impl=str, d=int, block_q=int, block_k=int, min_blocks=int, default=str, n=int, heads=int,
                    dtype=str, seconds=float, tflops=float, x_default=float, x_reference=float, note=str)


def _sweep_rung(rung) -> str:
    if not isinstance(rung, str):
        raise TypeError(f"rung must be a str naming a swept rung, got {type(rung).__name__}")
    if rung not in SWEEP_FILES:
        raise ValueError(f"rung must be one of {sorted(SWEEP_FILES)} (the rungs with a tuning sweep), got {rung!r}")
    return rung


def recorded_sweep(rung: str, directory=None) -> list[dict] | None:
    """The rows of ``rung``'s tuning sweep in a recorded run (``directory``, default :data:`RECORDED_DIR`), or
    None when that run holds no sweep of it. A row: impl (the rung, or the reference row's implementation),
    d, block_q, block_k, min_blocks (ints; None for the naive reference), default ("True"/"False": the rung's
    default tiles then), n, heads, dtype, seconds (median, s; None where not timed), tflops (1e12 FLOP/s),
    x_default and x_reference (the default's or the reference row's seconds over this row's), note.
    Raises TypeError/ValueError for a ``rung`` without a sweep, ValueError naming the file for a malformed CSV."""
    path = Path(RECORDED_DIR if directory is None else directory) / SWEEP_FILES[_sweep_rung(rung)]
    if not path.is_file():
        return None
    return [row for _, row in typed_csv_rows(path, _SWEEP_TYPES)]


def best_tiles(rung: str, directory=None) -> dict | None:
    """Per head dim, the fastest timed configuration of ``rung``'s recorded sweep (a row of
    :func:`recorded_sweep`, with ``x_best_default``: the default row's seconds over the best's, 1.0 when the
    default is the fastest), or None when the run holds no sweep of it or timed none of the rung's rows."""
    return _best_of(recorded_sweep(rung, directory), rung)


def _best_of(rows, rung: str) -> dict | None:
    """:func:`best_tiles` of the sweep ``rows`` (None or a list of :func:`recorded_sweep` rows)."""
    timed = [r for r in rows or () if r["impl"] == rung and r["seconds"]]
    if not timed:
        return None
    out = {}
    for d in sorted({r["d"] for r in timed}):
        here = [r for r in timed if r["d"] == d]
        best = min(here, key=lambda r: r["seconds"])
        default = next((r for r in here if r["default"] == "True"), None)
        out[d] = dict(best, x_best_default=default["seconds"] / best["seconds"] if default else None)
    return out


def sweep_markdown(rung: str, directory=None) -> str:
    """A Markdown table of ``rung``'s recorded tuning sweep (tiles, min_blocks, ms, TFLOP/s, x default, x
    reference), the fastest row per head dim in bold; a sentence saying it was not timed on a GPU yet where the
    recorded run holds no timed sweep of it."""
    rows = recorded_sweep(rung, directory)
    best = _best_of(rows, rung)
    if best is None:
        return (f"The tiles of `{rung}` have not been timed on a GPU yet: `scripts/tune_tiles.py --rung {rung}` "
                f"times every legal choice, and `scripts/gpu_check.sh` runs it.")
    lines = ["| d | implementation | block_q x block_k | min_blocks | ms | TFLOP/s | x default | x reference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tiles = "-" if r["block_q"] is None else f"{r['block_q']} x {r['block_k']}"
        cells = [str(r["d"]), r["impl"] + (" (default)" if r["default"] == "True" else ""), tiles,
                 "-" if r["min_blocks"] is None else str(r["min_blocks"]),
                 "-" if r["seconds"] is None else f"{r['seconds'] * 1e3:.3f}",
                 "-" if r["tflops"] is None else f"{r['tflops']:.1f}",
                 "-" if r["x_default"] is None else f"{r['x_default']:.2f}",
                 "-" if r["x_reference"] is None else f"{r['x_reference']:.2f}"]
        fastest = r["impl"] == rung and r["d"] in best and best[r["d"]]["seconds"] == r["seconds"]
        lines.append("| " + " | ".join(f"**{c}**" if fastest else c for c in cells) + " |")
    return "\n".join(lines)

"""Decode kernels on the GPU: how fast each reads the KV cache, against the device's copy rate.

    python benchmarks/gpu_decode.py --out DIR

Decoding attention does a few FLOPs per byte of K and V it reads (4 here: one multiply-add per query
head for each 2-byte value, 4 query heads per KV head), so its speed limit is the
memory system: the question for a decode kernel is what fraction of the device's copy rate it
reads the cache at. Measured here:

* the copy rate: one device-to-device copy of a ``--copy-mib`` buffer (cudaMemcpyAsync), bytes
  read + written / time;
* each decode kernel, fp16, 32 query heads on 8 KV heads, d = 128, pages of 16 tokens, on the
  shapes (sequences x tokens) 64 x 4096, 8 x 32768 and 1 x 131072, every sequence full length,
  pages scattered at random over one shared cache:
  ``paged_decode`` (one block per sequence and head group), ``flash_decoding`` with 8 and 32 splits,
  ``paged_decode_split`` (one block per sequence, GQA group and split, 16-byte loads) with the
  split count :func:`lessons.gpu.source.decode_splits` picks, and with one split fewer and one more
  (a check of the wave model that picks it: :func:`kernel_runs`); ``paged_decode_prefetch`` (the same
  kernel, each lane group's next K/V rows loaded while it absorbs the current ones, 3 blocks per SM)
  and ``paged_decode_cp_async`` (the same kernel, K/V rows copied into a ring in shared memory with cp.async
  two steps ahead, 4 blocks per SM), each with its own pick.

Bytes counted (:func:`kv_bytes`): every K and V value of the used tokens once, for each KV head
(what a kernel must read at least; query, output and block tables are under 0.1% of it).
Time: CUDA events around ``calls`` back-to-back launches (one launch already queued before the
first event, so Python's launch overhead hides behind the GPU's work), median of ``--repeats``,
divided by ``calls``. The launchers run with ``check_tables=False`` (no host copy inside the
timed region). Each kernel's output is checked against ``flash_decoding`` with 32 splits
(max |diff| in the table). A rung named in ``$GPU_CHECK_LEFT_OUT`` (:func:`lessons.gpu.ladder.rungs_left_out`:
``scripts/gpu_check.sh`` names each rung whose first run on this machine failed) is not run, and results.md says
why (:func:`skip_reason`). Writes results.md and results.csv into ``--out``. Without a CUDA
device it prints why and exits 0.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lessons.gpu.ladder import DECODE_LAUNCH_OPTIONS, LEFT_OUT_REASON, rungs_left_out  # noqa: E402

#: (num_seqs, seq_len) of the measured shapes
SHAPES = ((64, 4096), (8, 32768), (1, 131072))
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
#: the decode kernels measured: (label, launcher name, num_splits; None = the launcher's own choice)
KERNELS = (("paged_decode", "paged_decode_gpu", None),
           ("flash_decoding s=8", "flash_decoding_gpu", 8),
           ("flash_decoding s=32", "flash_decoding_gpu", 32),
           ("paged_decode_split auto", "paged_decode_split_gpu", None),
           ("paged_decode_prefetch auto", "paged_decode_split_gpu", None),
           ("paged_decode_cp_async auto", "paged_decode_split_gpu", None))
#: launcher keywords per rung (the first word of a label): the ladder's, so the prefetch rung is the split
#: launcher's prefetch build
RUNG_OPTIONS = DECODE_LAUNCH_OPTIONS
FIELDS = ("kernel", "num_seqs", "seq_len", "num_splits", "seconds", "kv_bytes", "tb_per_s", "pct_of_copy",
          "max_abs_diff")


def auto_splits(num_seqs: int, seq_len: int, num_sms: int, prefetch: bool = False, cp_async: bool = False) -> int:
    """The split count the split launcher picks itself at one shape (its own function,
    :func:`lessons.gpu.source.paged_decode_split_auto_splits`), for the plain, ``prefetch`` or ``cp_async``
    build."""
    from lessons.gpu.source import paged_decode_split_auto_splits

    return paged_decode_split_auto_splits(num_seqs, seq_len, HEAD_DIM, BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS,
                                          num_sms=num_sms, prefetch=prefetch, cp_async=cp_async)


def kernel_runs(num_seqs: int, seq_len: int, num_sms: int) -> list[tuple]:
    """The ``(label, launcher name, num_splits)`` runs at one shape: :data:`KERNELS`, then
    ``paged_decode_split`` with the split count ``decode_splits`` picks minus one and plus one
    (``"paged_decode_split s=N"``; none below 1 or above the sequence's pages), so a run shows
    whether the pick was the fastest of its neighbours. 8 x 32768 on 132 SMs: s=7 and s=9 (auto is 8)."""
    auto = auto_splits(num_seqs, seq_len, num_sms)
    pages = -(-seq_len // BLOCK_SIZE)
    near = [s for s in (auto - 1, auto + 1) if 1 <= s <= pages]
    return list(KERNELS) + [(f"paged_decode_split s={s}", "paged_decode_split_gpu", s) for s in near]


def skip_reason(label: str, environ=None) -> str | None:
    """Why the run ``label`` (its first word is its rung) is not run on this machine, or None: the rung is in
    ``$GPU_CHECK_LEFT_OUT`` (``environ``: a mapping, default ``os.environ``), its first run here failed."""
    return LEFT_OUT_REASON if label.split()[0] in rungs_left_out(environ) else None


def kv_bytes(num_seqs: int, seq_len: int, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
             element_size: int = 2) -> int:
    """Bytes of K and V a decode step must read: ``2 * num_seqs * seq_len * num_kv_heads * head_dim *
    element_size`` (K and V, each value once; GQA's query heads share it). 64 x 4096 tokens, 8 KV heads,
    d = 128, fp16: 1 GiB."""
    return 2 * num_seqs * seq_len * num_kv_heads * head_dim * element_size


def copy_rate(nbytes: int, seconds: float) -> float:
    """Bytes per second of a device copy of ``nbytes``: read once and written once, ``2 nbytes / seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    return 2 * nbytes / seconds


def pct_of_copy(nbytes: int, seconds: float, copy_bytes_per_s: float) -> float:
    """The read rate ``nbytes / seconds`` as a percentage of the copy rate (bytes/s)."""
    if seconds <= 0 or copy_bytes_per_s <= 0:
        raise ValueError(f"seconds and copy_bytes_per_s must be positive, got {seconds}, {copy_bytes_per_s}")
    return 100.0 * nbytes / seconds / copy_bytes_per_s


def result_row(kernel: str, num_seqs: int, seq_len: int, num_splits, seconds: float, copy_bytes_per_s: float,
               max_abs_diff: float) -> dict:
    """One row of the results: the K/V bytes of the shape, TB/s (10^12 bytes/s) and % of the copy rate."""
    nbytes = kv_bytes(num_seqs, seq_len)
    return dict(kernel=kernel, num_seqs=num_seqs, seq_len=seq_len, num_splits=num_splits, seconds=seconds,
                kv_bytes=nbytes, tb_per_s=nbytes / seconds / 1e12,
                pct_of_copy=pct_of_copy(nbytes, seconds, copy_bytes_per_s), max_abs_diff=max_abs_diff)


def format_row(r: dict) -> str:
    """``paged_decode_split auto  seqs=64 len=4096 splits=1: 0.300 ms, KV 3.58 TB/s = 85% of the copy rate``."""
    return (f"{r['kernel']:<24} seqs={r['num_seqs']} len={r['seq_len']} splits={r['num_splits']}: "
            f"{r['seconds'] * 1e3:.3f} ms, KV {r['tb_per_s']:.2f} TB/s = {r['pct_of_copy']:.0f}% of the copy rate "
            f"(max |diff| {r['max_abs_diff']:.1e})")


def markdown(rows, copy_tb_per_s: float, device: str, skipped=()) -> str:
    """The results as a Markdown table, headed by the device and its copy rate; then one line per
    ``(label, reason)`` of ``skipped``, the runs left out."""
    lines = [f"# Decode kernels on {device}", "",
             f"Device copy rate (read + write): {copy_tb_per_s:.2f} TB/s. fp16, {NUM_HEADS} query heads on "
             f"{NUM_KV_HEADS} KV heads, d = {HEAD_DIM}, pages of {BLOCK_SIZE}.", "",
             "| kernel | seqs x tokens | splits | time (ms) | K/V read (GiB) | TB/s | % of copy rate | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['num_seqs']} x {r['seq_len']} | {r['num_splits']} | "
                     f"{r['seconds'] * 1e3:.3f} | {r['kv_bytes'] / 2**30:.2f} | {r['tb_per_s']:.2f} | "
                     f"{r['pct_of_copy']:.0f}% | {r['max_abs_diff']:.1e} |")
    if skipped:
        lines.append("")
        lines += [f"Not run: {label}: {why}." for label, why in skipped]
    return "\n".join(lines) + "\n"


def write_results(rows, out: Path, copy_tb_per_s: float, device: str, skipped=()) -> None:
    """results.csv (one row per kernel and shape, :data:`FIELDS`) and results.md (with the runs ``skipped``,
    ``(label, reason)`` pairs, named below its table) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in FIELDS})
    (out / "results.md").write_text(markdown(rows, copy_tb_per_s, device, skipped))


def stream_seconds(cupy, fn, calls: int, repeats: int) -> float:
    """Seconds per call of ``fn`` on the device: ``calls`` calls between two CUDA events, one call queued
    before the first event (so the GPU is busy from the first event on), median over ``repeats``."""
    times = []
    for _ in range(repeats):
        fn()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return statistics.median(times)


def kernel_seconds(cupy, fn, target_seconds: float, repeats: int) -> float:
    """Seconds per call of ``fn``, timed as every row here is: one call timed alone sizes the batch
    (``calls = target_seconds / its time``, 1..50), then :func:`stream_seconds` of that batch, median of
    ``repeats``."""
    one = stream_seconds(cupy, fn, 1, 1)
    calls = int(min(50, max(1, target_seconds / one)))
    return stream_seconds(cupy, fn, calls, repeats)


def device_copy_rate(cupy, copy_mib: int, repeats: int) -> float:
    """The device's copy rate in bytes/s (read + written, :func:`copy_rate`): 10 device-to-device copies
    (cudaMemcpyAsync) of a ``copy_mib`` MiB buffer per timing, median of ``repeats``."""
    import numpy as np

    nbytes = copy_mib * 2**20
    src, dst = cupy.ones(nbytes, dtype=np.uint8), cupy.empty(nbytes, dtype=np.uint8)
    seconds = stream_seconds(cupy, lambda: dst.data.copy_from_device_async(src.data, nbytes), 10, repeats)
    return copy_rate(nbytes, seconds)


def random_caches(cupy, shapes, num_kv_heads: int = NUM_KV_HEADS, head_dim: int = HEAD_DIM,
                  block_size: int = BLOCK_SIZE):
    """``(k_cache, v_cache)``, fp16 standard normal on the device (seed 0), each
    (num_blocks, block_size, num_kv_heads, head_dim): as many pages as the largest of ``shapes``
    ((num_seqs, seq_len) pairs) uses, so one cache serves every shape."""
    import numpy as np

    num_blocks = max(n * -(-length // block_size) for n, length in shapes)
    cupy.random.seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = cupy.random.standard_normal(cache_shape, dtype=np.float32).astype(np.float16)
    v_cache = cupy.random.standard_normal(cache_shape, dtype=np.float32).astype(np.float16)
    return k_cache, v_cache


def shape_inputs(cupy, host_rng, num_blocks: int, num_seqs: int, seq_len: int, num_heads: int = NUM_HEADS,
                 head_dim: int = HEAD_DIM, block_size: int = BLOCK_SIZE):
    """``(q, block_tables, seq_lens)`` of one shape on the device: every sequence ``seq_len`` tokens long,
    its ``ceil(seq_len / block_size)`` pages drawn by ``host_rng`` (a NumPy Generator) without repeats from
    the cache's ``num_blocks``; q fp16 (num_seqs, num_heads, head_dim) standard normal; int32 tables
    (num_seqs, pages) and seq_lens (num_seqs,)."""
    import numpy as np

    pages = -(-seq_len // block_size)
    tables = cupy.asarray(host_rng.permutation(num_blocks)[:num_seqs * pages].reshape(num_seqs, pages)
                          .astype(np.int32))
    lens = cupy.full((num_seqs,), seq_len, dtype=np.int32)
    q = cupy.asarray(host_rng.standard_normal((num_seqs, num_heads, head_dim)).astype(np.float16))
    return q, tables, lens


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="K/V read rate of the decode kernels against the device copy rate")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--target-seconds", type=float, default=0.05,
                   help="about this long per timed batch of calls (calls = target / one call's time, 1..50)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    import lessons.gpu as gpu

    if not gpu.device_available():
        print("no CUDA device (or CuPy is not installed): nothing measured. On a GPU machine run "
              "`python benchmarks/gpu_decode.py --out DIR`.")
        return 0
    import cupy

    device = gpu.device_name() or "a CUDA device"
    sms = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["multiProcessorCount"])
    print(f"device: {device}, {sms} SMs")
    copy_bps = device_copy_rate(cupy, args.copy_mib, args.repeats)
    print(f"device copy: {copy_bps / 1e12:.2f} TB/s (read+write, {args.copy_mib} MiB)")

    # one cache for every shape: as many pages as the largest shape uses, scattered by random tables
    k_cache, v_cache = random_caches(cupy, SHAPES)
    host_rng = np.random.default_rng(0)
    rows, skipped = [], {}
    for num_seqs, seq_len in SHAPES:
        q, tables, lens = shape_inputs(cupy, host_rng, k_cache.shape[0], num_seqs, seq_len)
        reference, _ = gpu.flash_decoding_gpu(q, k_cache, v_cache, tables, lens, 32, check_tables=False)
        for label, launcher, splits in kernel_runs(num_seqs, seq_len, sms):
            why = skip_reason(label)
            if why is not None:
                print(f"{label:<24} seqs={num_seqs} len={seq_len}: skipped: {why}", flush=True)
                skipped[label] = why
                continue
            run = getattr(gpu, launcher)
            call_args = (q, k_cache, v_cache, tables, lens) + ((splits,) if splits else ())
            options = RUNG_OPTIONS.get(label.split()[0], {})
            fn = lambda: run(*call_args, check_tables=False, **options)        # noqa: E731
            out, _ = fn()
            diff = float(cupy.abs(out.astype(np.float32) - reference.astype(np.float32)).max())
            cupy.cuda.Device().synchronize()
            seconds = kernel_seconds(cupy, fn, args.target_seconds, args.repeats)
            if launcher == "paged_decode_split_gpu" and splits is None:
                splits_used = auto_splits(num_seqs, seq_len, sms, **options)
            else:
                splits_used = splits or 1
            row = result_row(label, num_seqs, seq_len, splits_used, seconds, copy_bps, diff)
            rows.append(row)
            print(format_row(row), flush=True)
        del tables, lens, q, reference
    write_results(rows, args.out, copy_bps / 1e12, device, list(skipped.items()))
    print(f"wrote {args.out / 'results.md'} and results.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())

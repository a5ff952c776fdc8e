"""Flash Attention, tile by tile: the shared code of the notebook series.

The core is one fold over key tiles (:mod:`lessons.core.state`); every lesson is a
different schedule of it. Start with :func:`attention` (the textbook reference)
and :func:`flash_attention` (the tiled, one-pass version).
"""
from lessons.schedules.variants import example_case, run_variant, run_variants
from lessons.schedules.causal import causal_mask, count_tiles, masked_rows_report, tile_schedule
from lessons.schedules.gqa_decode import kv_cache_bytes, paged_decode
from lessons.schedules.split_kv import flash_decoding, merge_states, reduce_states
from lessons.course.data import Sample, late_max_case, load_sample, make_case, random_case
from lessons.schedules.flash import flash_attention
from lessons.cost.traffic import flash_block_sizes, flash_io, loglog_slope, measure_peak_memory, roofline_points, textbook_io
from lessons.cost.traffic import compare_traffic
from lessons.schedules.paged import paged_flash_attention
from lessons.core.reference import attention
from lessons.schedules.ring import ring_attention
from lessons.schedules.softmax import fused_softmax_matmul, online_softmax, safe_softmax, softmax_traffic
from lessons.core.state import State, absorb, correction_factor, finalize, merge
from lessons.core.trace import RowTrace, TileStep, Trace
from lessons import gpu  # the same algorithms as CUDA kernels (lessons.gpu.gpu_status() says what ran)

__all__ = [
    "attention", "flash_attention",
    "State", "absorb", "merge", "finalize", "correction_factor",
    "Trace", "TileStep", "RowTrace",
    "paged_flash_attention", "merge_states", "reduce_states", "flash_decoding", "ring_attention",
    "paged_decode", "kv_cache_bytes",
    "Sample", "load_sample", "make_case", "random_case", "late_max_case",
    "safe_softmax", "online_softmax", "fused_softmax_matmul", "softmax_traffic",
    "run_variant", "run_variants", "example_case",
    "tile_schedule", "count_tiles", "causal_mask", "masked_rows_report",
    "textbook_io", "flash_io", "flash_block_sizes", "measure_peak_memory", "roofline_points", "loglog_slope",
    "compare_traffic",
]

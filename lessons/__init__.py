"""Flash Attention, tile by tile: the shared code of the notebook series.

The core is one fold over key tiles (:mod:`lessons.state`); every lesson is a
different schedule of it. Start with :func:`attention` (the textbook reference)
and :func:`flash_attention` (the tiled, one-pass version).
"""
from .broken import example_case, run_variant, run_variants
from .causal import causal_mask, count_tiles, masked_rows_report, tile_schedule
from .decode import kv_cache_bytes, paged_decode
from .decoding import flash_decoding, merge_states, reduce_states
from .data import Sample, late_max_case, load_sample, make_case, random_case
from .flash import flash_attention
from .io import flash_block_sizes, flash_io, loglog_slope, measure_peak_memory, roofline_points, textbook_io
from .paged import paged_flash_attention
from .reference import attention
from .ring import ring_attention
from .softmax import fused_softmax_matmul, online_softmax, safe_softmax, softmax_traffic
from .state import State, absorb, correction_factor, finalize, merge
from .trace import RowTrace, TileStep, Trace
from . import gpu  # the same algorithms as CUDA kernels (lessons.gpu.gpu_status() says what ran)

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
]

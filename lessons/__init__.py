"""Flash Attention, tile by tile: the shared code of the notebook series.

The core is one fold over key tiles (:mod:`lessons.core.state`); every lesson is a
different schedule of it. Start with :func:`attention` (the textbook reference)
and :func:`flash_attention` (the tiled, one-pass version).

Where each notebook's code lives (modules under ``lessons/``, kernels under
``lessons/gpu/kernels/``, exercises under ``exercises/``):

===================  ====================  ====================  =================================  =========================
notebook             schedule              view                  kernel                             exercise
===================  ====================  ====================  =================================  =========================
01 online softmax    schedules.softmax     views.softmax         online_softmax.cu                  online_softmax
02 flash attention   schedules.flash       views.flash,          flash_attention.cu,                absorb
                                           views.stepper         flash_attention_mma.cu
03 query blocks,     schedules.causal      views.causal          flash_attention.cu                 causal
   causal            (core.causal_rule)                          (causal=True)
04 backward pass     schedules.backward,   views.backward        flash_attention_backward.cu        backward
                     cost.backward
05 IO awareness      cost.traffic,         views.traffic,        flash_attention.cu,                peak_memory
                     cost.memory           views.gpu             flash_attention_mma.cu
06 kernel ladder     gpu.ladder,           views.ladder,         flash_attention.cu,                rescale_tiles
                     gpu.sass,             views.rescale,        flash_attention_regtile.cu,
                     cost.rescale,         views.register_tiles  flash_attention_mma.cu,
                     cost.fragments,                             flash_attention_mma_async.cu,
                     cost.register_tiles                         flash_attention_mma_fa2.cu
07 paged attention   schedules.paged       views.paged           paged_decode.cu                    paged
08 flash-decoding,   schedules.split_kv,   views.split_kv,       paged_decode.cu                    merge_states,
   ring              schedules.ring        views.ring            (num_splits)                       flash_decoding, ring_step
09 paged GQA decode  schedules.gqa_decode  views.paged           paged_decode.cu                    gqa_decode
10 decode kernel     gpu.ladder,           views.pipeline,       paged_decode.cu,                   decode_splits
   ladder            gpu.decode_loads,     views.decode_loads,   paged_decode_split.cu
                     gpu.source            views.decode_splits
11 Hopper kernels    gpu.hopper,           views.pipeline,       flash_attention_wgmma.cu,          swizzle_128b
                     gpu.warpgroup_pipes,  views.register_tiles  flash_attention_wgmma_overlap.cu
                     gpu.ladder,
                     gpu.source
===================  ====================  ====================  =================================  =========================

Real multi-process ring attention (MPI ranks, notebook 08) lives in :mod:`lessons.distributed`.

Every notebook's GPU section is in :mod:`lessons.gpu.lesson`; the fold, the oracle, the
trace and the input checks every schedule shares are in :mod:`lessons.core`.
"""
from lessons.schedules.variants import example_case, run_variant, run_variants
from lessons.schedules.causal import causal_mask, count_tiles, masked_rows_report, tile_schedule
from lessons.schedules.gqa_decode import kv_cache_bytes, paged_decode
from lessons.schedules.split_kv import flash_decoding, merge_states, reduce_states
from lessons.course.data import Sample, late_max_case, load_sample, make_case, random_case
from lessons.schedules.flash import flash_attention
from lessons.schedules.backward import attention_backward, flash_attention_backward
from lessons.cost.traffic import flash_block_sizes, flash_io, loglog_slope, measure_peak_memory, roofline_points, textbook_io
from lessons.cost.traffic import compare_traffic
from lessons.cost.rescale import expected_rescale_share, rescale_share
from lessons.schedules.paged import paged_flash_attention
from lessons.core.reference import attention
from lessons.schedules.ring import ring_attention
from lessons.schedules.softmax import fused_softmax_matmul, online_softmax, safe_softmax, softmax_traffic
from lessons.core.state import State, absorb, correction_factor, finalize, merge
from lessons.core.trace import RowTrace, TileStep, Trace
from lessons import gpu  # the same algorithms as CUDA kernels (lessons.gpu.gpu_status() says what ran)

__all__ = [
    "attention", "flash_attention",
    "attention_backward", "flash_attention_backward",
    "State", "absorb", "merge", "finalize", "correction_factor",
    "Trace", "TileStep", "RowTrace",
    "paged_flash_attention", "merge_states", "reduce_states", "flash_decoding", "ring_attention",
    "paged_decode", "kv_cache_bytes",
    "Sample", "load_sample", "make_case", "random_case", "late_max_case",
    "safe_softmax", "online_softmax", "fused_softmax_matmul", "softmax_traffic",
    "run_variant", "run_variants", "example_case",
    "tile_schedule", "count_tiles", "causal_mask", "masked_rows_report",
    "textbook_io", "flash_io", "flash_block_sizes", "measure_peak_memory", "roofline_points", "loglog_slope",
    "compare_traffic", "rescale_share", "expected_rescale_share",
]

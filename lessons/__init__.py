"""Flash Attention, tile by tile: the shared code of the notebook series.

The core is one fold over key tiles (:mod:`lessons.state`); every lesson is a
different schedule of it. Start with :func:`attention` (the textbook reference)
and :func:`flash_attention` (the tiled, one-pass version).
"""
from .flash import flash_attention
from .reference import attention
from .state import State, absorb, correction_factor, finalize, merge
from .trace import RowTrace, TileStep, Trace

__all__ = [
    "attention", "flash_attention",
    "State", "absorb", "merge", "finalize", "correction_factor",
    "Trace", "TileStep", "RowTrace",
]

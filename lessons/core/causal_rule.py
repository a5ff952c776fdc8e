"""The causal rule, once: who sees whom, and which tiles are skipped, diagonal or full.

Bottom-right aligned, as FlashAttention-2 does: query row ``i`` of ``Nq`` sees key
``j`` of ``Nk`` iff ``j <= i + Nk - Nq`` (for ``Nq == Nk`` the usual lower triangle;
with ``Nq < Nk`` the queries are the last ``Nq`` tokens of the sequence). The
reference, :func:`lessons.flash_attention`, ring attention, the tile schedule of
notebook 03 and its figures all ask this module, so their tiles agree by construction.

Source: Dao 2023, FlashAttention-2, Sec. 3.1 (causal masking, skipped blocks) and the
bottom-right alignment of its ``causal=True``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FULL", "DIAGONAL", "SKIPPED", "TILE_KINDS", "last_visible_key", "causal_visible", "tile_kind"]

FULL, DIAGONAL, SKIPPED = "full", "diagonal", "skipped"
TILE_KINDS = (FULL, DIAGONAL, SKIPPED)


def last_visible_key(rows, nq: int, nk: int):
    """The last key each query row may see: ``i + Nk - Nq`` (below 0: it sees none).

    ``rows``: an int or int array of query indices; returns the same shape.
    """
    return rows + (nk - nq)


def causal_visible(rows: np.ndarray, cols: np.ndarray, nq: int, nk: int) -> np.ndarray:
    """Bool (R, C): True where query ``rows[r]`` may see key ``cols[c]`` (``j <= i + Nk - Nq``).

    ``rows`` (R,) and ``cols`` (C,) are int index arrays into the (Nq, Nk) score matrix.
    """
    return cols[None, :] <= last_visible_key(rows[:, None], nq, nk)


def tile_kind(row_start, row_stop, key_start, key_stop, nq, nk, causal=True):
    """Classify the tile rows ``[row_start, row_stop)`` x keys ``[key_start, key_stop)``.

    Returns ``"full"``, ``"diagonal"`` or ``"skipped"`` (always ``"full"`` when not
    causal). The tile is skipped when even its last row cannot see its first key,
    full when its first row sees its last key, diagonal otherwise (computed, then
    masked inside).
    """
    if not causal:
        return FULL
    if key_start > last_visible_key(row_stop - 1, nq, nk):
        return SKIPPED
    if key_stop - 1 <= last_visible_key(row_start, nq, nk):
        return FULL
    return DIAGONAL

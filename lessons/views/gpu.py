"""Pictures of the tensor-core kernel: which lane of a warp holds which score.

``mma.sync.m16n8k16`` spreads its 16 x 8 float32 result C over the 32 lanes of a warp by
a fixed layout (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"):
lane ``4 g + t`` holds ``C[g][2t]``, ``C[g][2t+1]``, ``C[g+8][2t]`` and ``C[g+8][2t+1]``.
:func:`score_lanes` gives that map for the warp's 16 x ``keys`` score block, and
:func:`mma_fragment_figure` draws it: every lane holds two whole rows' worth of
bookkeeping (rows g and g + 8), and a row is shared by the four lanes of one quad.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from lessons.views.plot import new_figure

__all__ = ["score_lanes", "mma_fragment_figure"]


def score_lanes(keys: int = 16) -> np.ndarray:
    """Lane (0..31) holding each score of a warp's 16-row score block, as an int (16, keys) array.

    ``keys`` is a positive multiple of 8: the block is ``keys // 8`` results of
    ``mma.m16n8k16`` side by side, each with the C layout ``lane = 4 (row % 8) + (col % 8) // 2``.
    Raises ValueError for other ``keys``. Source: PTX ISA, mma.m16n8k16 fragment layout.
    """
    if isinstance(keys, bool) or not isinstance(keys, (int, np.integer)) or keys < 8 or keys % 8:
        raise ValueError(f"keys must be a positive multiple of 8 (whole 16x8 mma tiles), got {keys!r}")
    rows, cols = np.indices((16, int(keys)))
    return 4 * (rows % 8) + (cols % 8) // 2


def mma_fragment_figure(keys: int = 16, *, highlight_lane: int = 5, figsize=(7.2, 6.0), dpi=90) -> Figure:
    """The warp's 16 x ``keys`` scores coloured by the quad (4 lanes) that holds them.

    Each cell shows its lane number; the cells of ``highlight_lane`` (0..31) are outlined:
    two rows, g and g + 8, two neighbouring columns in every 8-key tile. Returns a Figure.
    Raises ValueError for a bad ``keys`` or ``highlight_lane``.
    """
    lanes = score_lanes(keys)
    if isinstance(highlight_lane, bool) or not isinstance(highlight_lane, (int, np.integer)) \
            or not 0 <= highlight_lane < 32:
        raise ValueError(f"highlight_lane must be an int in 0..31, got {highlight_lane!r}")
    fig = new_figure(figsize, dpi)
    ax = fig.add_subplot(1, 1, 1)
    quad = lanes // 4                                     # g: the row group, 0..7
    colours = [f"C{i}" for i in range(8)]
    for (r, c), lane in np.ndenumerate(lanes):
        ax.add_patch(Rectangle((c, r), 1, 1, facecolor=colours[quad[r, c]], alpha=0.35, edgecolor="white"))
        ax.text(c + 0.5, r + 0.5, str(lane), ha="center", va="center", fontsize=8)
        if lane == highlight_lane:
            ax.add_patch(Rectangle((c, r), 1, 1, fill=False, edgecolor="black", linewidth=2.2))
    for x in range(8, keys, 8):                           # boundaries between mma results
        ax.axvline(x, color="black", linewidth=1.2)
    ax.axhline(8, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlim(0, keys)
    ax.set_ylim(16, 0)
    ax.set_xticks(np.arange(keys) + 0.5, [str(c) for c in range(keys)], fontsize=8)
    ax.set_yticks(np.arange(16) + 0.5, [str(r) for r in range(16)], fontsize=8)
    ax.set_xlabel("key in the tile (each block of 8 is one 16x8 mma result)")
    ax.set_ylabel("query row of the warp")
    ax.set_aspect("equal")
    g, t = divmod(highlight_lane, 4)
    ax.set_title(f"Which lane holds which score (colour: the quad of 4 lanes that shares a row).\n"
                 f"Lane {highlight_lane} (outlined) holds rows {g} and {g + 8}: their m, l and alpha "
                 f"live in its registers", fontsize=10)
    fig.tight_layout()
    return fig

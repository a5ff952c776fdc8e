"""A picture for lazy rescaling: per key tile, the share of row blocks that still rescale their output.

The counts come from :func:`lessons.cost.rescale.rescale_share` and the curve for independent scores
from :func:`lessons.cost.rescale.expected_tile_share`; this module only draws.
"""
from __future__ import annotations

import numpy as np

from lessons.cost.rescale import RescaleCount, expected_rescale_share, expected_tile_share
from lessons.views.plot import new_figure, tidy

__all__ = ["RESCALE_COLOURS", "rescale_figure"]

#: one colour per counted case, in the order given; the curve for independent scores is black
RESCALE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")


def rescale_figure(counts, *, title: str | None = None):
    """Per key tile, the share of row blocks whose running max moved there (so they rescale ``o``), for
    each counted case, and the same share for independent scores (a black curve).

    ``counts``: a dict from a label (e.g. ``"d = 64"``) to a :class:`lessons.cost.rescale.RescaleCount`,
    1 to 4 of them, all with the same ``n_keys``, ``block_rows`` and ``block_k`` (they share the
    x axis and the curve). The curve is left out when a count is causal (it assumes no mask).
    ``title``: the figure's title; None for one that names N, the block sizes and the share.
    Left: every tile on a linear axis; right: the same on a log axis, where the early tiles (almost
    every block rescales) and the ``1 / tile`` tail are both visible. Returns a Figure.

    Raises TypeError for a ``counts`` that is not a dict of RescaleCount, ValueError for none, more
    than 4, or counts of different shapes.
    """
    if not isinstance(counts, dict) or not all(isinstance(c, RescaleCount) for c in counts.values()):
        raise TypeError(f"counts must be a dict from a label to a RescaleCount, got {type(counts).__name__}")
    if not 1 <= len(counts) <= len(RESCALE_COLOURS):
        raise ValueError(f"counts must hold 1 to {len(RESCALE_COLOURS)} cases, got {len(counts)}")
    shapes = {(c.n_keys, c.block_rows, c.block_k) for c in counts.values()}
    if len(shapes) != 1:
        raise ValueError(f"counts must share n_keys, block_rows and block_k, got {sorted(shapes)}")
    ((n_keys, block_rows, block_k),) = shapes
    causal = any(c.causal for c in counts.values())
    tiles = np.arange(1, -(-n_keys // block_k) + 1)

    fig = new_figure((11.0, 4.4))
    panels = (fig.add_axes([0.075, 0.13, 0.40, 0.72]), fig.add_axes([0.575, 0.13, 0.40, 0.72]))
    for ax, log in zip(panels, (False, True)):
        for (label, c), colour in zip(counts.items(), RESCALE_COLOURS):
            ax.plot(tiles, c.tile_share, ls="none", marker="o", ms=3.2, color=colour, alpha=0.8,
                    label=f"{label}: counted ({c.share:.1%} of all (row block, tile) pairs)")
        if not causal:
            ax.plot(tiles, expected_tile_share(n_keys, block_rows=block_rows, block_k=block_k), color="black",
                    lw=1.4, label=f"independent scores: 1 - (1 - 1/tile)^{block_rows} "
                                  f"({expected_rescale_share(n_keys, block_rows=block_rows, block_k=block_k):.1%})")
        ax.set_ylim(0, 1.04)
        ax.set_xlabel("key tile (1 = the first)", fontsize=9.5)
        ax.grid(True, which="major", color="#eeeeee", lw=0.6)
        tidy(ax)
        if log:
            ax.set_xscale("log")
            ax.set_xlim(0.9, tiles[-1] * 1.1)
            ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= tiles[-1]]
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.minorticks_off()
            ax.set_title("the same, tiles on a log axis", fontsize=9.5, loc="left")
        else:
            ax.set_xlim(0, tiles[-1] + 1)
            ax.set_ylabel(f"share of row blocks ({block_rows} query rows)\nthat must rescale o", fontsize=9.5)
            ax.set_title("every tile", fontsize=9.5, loc="left")
            ax.legend(fontsize=8.5, frameon=False, loc="upper right")
    if title is None:
        title = (f"Lazy rescaling: at which key tiles a block of {block_rows} query rows still moves its max, "
                 f"N = {n_keys} keys in tiles of {block_k}" + (", causal" if causal else ""))
    fig.suptitle(title, fontsize=10.5, x=0.075, y=0.97, ha="left")
    return fig

"""Which cells of a key tile's scores and of the output one thread owns in the register-tiled rungs, plain and
wide: one thread's cells dark, the rest of its warp light.

The ownership comes from :func:`lessons.cost.register_tiles.register_tile` (``thread_rows``, ``thread_keys``,
``thread_columns``: the kernel's index rules); this module only draws it.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from lessons.cost.register_tiles import RegisterTile

from lessons.views.plot import new_figure

__all__ = ["ownership_figure", "OWNER_COLOURS"]

#: other warps, the rest of warp 0, thread 0
OWNER_COLOURS = ("#eeeeee", "#a6cee3", "#1f4e99")


def _owners(tile: RegisterTile, what: str) -> np.ndarray:
    """block_q x (block_k or d) array: 2 where thread 0 owns the cell, 1 where another thread of warp 0 does, else 0."""
    width = tile.block_k if what == "s" else tile.head_dim
    grid = np.zeros((tile.block_q, width), dtype=int)
    for ty in range(32 // tile.lanes):                    # the row groups of warp 0
        for tx in range(tile.lanes):
            cols = tile.thread_keys(tx) if what == "s" else tile.thread_columns(tx)
            mark = 2 if (ty, tx) == (0, 0) else 1
            for r in tile.thread_rows(ty):
                grid[r, list(cols)] = mark
    return grid


def ownership_figure(tiles: dict):
    """One row of two panels per entry of ``tiles`` (title -> :class:`lessons.cost.register_tiles.RegisterTile`):
    the ``block_q x block_k`` score tile and the ``block_q x d`` output, with thread 0's cells dark, the other
    threads of its warp light. All panels share one scale (a cell is one score or one output element), so the
    tiles' sizes compare at a glance. Returns a Figure. TypeError for ``tiles`` not a non-empty dict of
    RegisterTile."""
    if not isinstance(tiles, dict) or not tiles or not all(isinstance(t, RegisterTile) for t in tiles.values()):
        raise TypeError("tiles must be a non-empty dict of title -> RegisterTile (lessons.cost.register_tiles)")
    rows_max = max(t.block_q for t in tiles.values())
    keys_max = max(t.block_k for t in tiles.values())
    d_max = max(t.head_dim for t in tiles.values())
    fig = new_figure((10.5, 0.9 + 2.3 * len(tiles) * rows_max / 64))
    grid = fig.add_gridspec(len(tiles), 2, width_ratios=[keys_max, d_max], hspace=0.45, wspace=0.12,
                            left=0.07, right=0.98, top=0.86, bottom=0.1)
    cmap = ListedColormap(OWNER_COLOURS)
    for i, (title, t) in enumerate(tiles.items()):
        for j, (what, label, width) in enumerate((("s", "keys of the tile", keys_max), ("o", "output columns", d_max))):
            ax = fig.add_subplot(grid[i, j])
            ax.imshow(_owners(t, what), cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
                      extent=(0, t.block_k if what == "s" else t.head_dim, t.block_q, 0))
            ax.set_xlim(0, width)
            ax.set_ylim(rows_max, 0)
            ax.set_aspect("equal")
            ax.tick_params(labelsize=7)
            ax.set_xlabel(label, fontsize=8)
            if j == 0:
                ax.set_ylabel("query rows", fontsize=8)
                ax.set_title(f"{title}: S, {t.block_q} x {t.block_k}; thread 0 owns {t.rows} x {t.keys}",
                             fontsize=9, loc="left")
            else:
                ax.set_title(f"o: thread 0 owns {t.rows} rows x {4 * t.chunks} columns "
                             f"({t.lanes} lanes share a row)", fontsize=9, loc="left")
    fig.legend(handles=[Patch(color=OWNER_COLOURS[2], label="thread 0"),
                        Patch(color=OWNER_COLOURS[1], label="the other 31 threads of its warp"),
                        Patch(color=OWNER_COLOURS[0], label="other warps")],
               loc="upper center", ncol=3, fontsize=8, frameon=False)
    return fig

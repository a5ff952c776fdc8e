"""Which cells of a key tile's scores and of the output one thread owns in the register-tiled rungs, plain and
wide: one thread's cells dark, the rest of its warp light. And the issue-slot ceiling of each CUDA-core rung's
product loops (:func:`lessons.gpu.sass.fma_loop_table`) beside what a target asks and what a GPU measured, and what
each tensor-core rung issues per HMMA on an interior key tile, by class (:func:`lessons.gpu.sass.tensor_tile_table`).

The ownership comes from :func:`lessons.cost.register_tiles.register_tile` (``thread_rows``, ``thread_keys``,
``thread_columns``: the kernel's index rules); this module only draws it.
"""
from __future__ import annotations

import numbers

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from lessons.core.checks import check_positive_real
from lessons.cost.register_tiles import RegisterTile

from lessons.views.plot import count_ranges, new_figure, tidy

__all__ = ["ownership_figure", "OWNER_COLOURS", "issue_ceiling_figure", "CLASS_COLOURS", "hmma_slots_figure",
           "warpgroup_pipes_figure"]

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
    """One column per entry of ``tiles`` (title -> :class:`lessons.cost.register_tiles.RegisterTile`): on top the
    ``block_q x block_k`` score tile, below it the ``block_q x d`` output, with thread 0's cells dark (and outlined,
    so that one cell still shows), the other threads of its warp light, and the tile's edge drawn. All panels of a
    row share one scale (a cell is one score or one output element), so the tiles' sizes compare at a glance.
    Returns a Figure. TypeError for ``tiles`` not a non-empty dict of RegisterTile."""
    from matplotlib.patches import Rectangle

    if not isinstance(tiles, dict) or not tiles or not all(isinstance(t, RegisterTile) for t in tiles.values()):
        raise TypeError("tiles must be a non-empty dict of title -> RegisterTile (lessons.cost.register_tiles)")
    rows_max = max(t.block_q for t in tiles.values())
    keys_max = max(t.block_k for t in tiles.values())
    d_max = max(t.head_dim for t in tiles.values())
    n = len(tiles)
    width = 10.5
    panel = (width - 1.0) / n                                  # inches per panel, across
    height = 1.3 + panel * rows_max / keys_max + panel * rows_max / d_max
    fig = new_figure((width, height))
    grid = fig.add_gridspec(2, n, height_ratios=[rows_max / keys_max, rows_max / d_max], hspace=0.35, wspace=0.15,
                            left=0.06, right=0.98, top=1 - 0.75 / height, bottom=0.45 / height)
    cmap = ListedColormap(OWNER_COLOURS)
    for j, (title, t) in enumerate(tiles.items()):
        for i, (what, label, cols, cols_max) in enumerate((("s", "keys of the tile", t.block_k, keys_max),
                                                           ("o", "output columns", t.head_dim, d_max))):
            ax = fig.add_subplot(grid[i, j])
            owners = _owners(t, what)
            ax.imshow(owners, cmap=cmap, vmin=0, vmax=2, interpolation="nearest", extent=(0, cols, t.block_q, 0))
            for r, c in zip(*np.nonzero(owners == 2)):
                ax.add_patch(Rectangle((c, r), 1, 1, fill=False, edgecolor=OWNER_COLOURS[2], lw=1.2))
            ax.add_patch(Rectangle((0, 0), cols, t.block_q, fill=False, edgecolor="black", lw=1))
            ax.set_xlim(-0.5, cols_max + 0.5)
            ax.set_ylim(rows_max + 0.5, -0.5)
            ax.set_aspect("equal")
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(False)
            ax.tick_params(labelsize=7)
            ax.set_xlabel(label, fontsize=8)
            if j == 0:
                ax.set_ylabel("query rows", fontsize=8)
            if what == "s":
                ax.set_title(f"{title}\nS tile {t.block_q} x {t.block_k}: thread 0 owns {t.rows} rows x {t.keys} keys",
                             fontsize=9, loc="left")
            else:
                ax.set_title(f"o: thread 0 owns {t.rows} rows x {4 * t.chunks} columns ({t.lanes} lanes share a row)",
                             fontsize=9, loc="left")
    fig.legend(handles=[Patch(color=OWNER_COLOURS[2], label="thread 0"),
                        Patch(color=OWNER_COLOURS[1], label="the other 31 threads of its warp"),
                        Patch(color=OWNER_COLOURS[0], label="other warps"),
                        Patch(facecolor="white", edgecolor="black", label="the block's tile (white: outside it)")],
               loc="upper center", ncol=4, fontsize=8, frameon=False)
    return fig


#: one colour per CUDA-core rung, in ladder order
RUNG_COLOURS = ("#bdbdbd", "#6baed6", "#1f4e99")


def issue_ceiling_figure(table, *, peak_flops: float, needs=None, measured=None, measured_label: str = "measured",
                         needs_label: str = "what the target asks"):
    """Bars: the issue-slot ceiling (TFLOP/s) of each rung in ``table`` (rows of
    :func:`lessons.gpu.sass.fma_loop_table`), grouped by head dim: solid up to the whole key tile's ceiling
    (``tile_ceiling``, where rows have it) with its FFMA share written above, pale from there up to what the
    product loops alone allow (``ceiling``). A line
    across each group at ``needs[d]`` (TFLOP/s a target asks for there, e.g. 3x naive CuPy), a diamond at
    ``measured[rung][d]`` (TFLOP/s a GPU measured; ``measured_label`` says where), and the FP32 peak
    ``peak_flops`` (FLOP/s) as the top line. Returns a Figure. TypeError for a ``table`` that is not a non-empty
    list of such rows (each with rung, d, share and ceiling), or ``needs`` / ``measured`` that are not dicts;
    ValueError for a ``peak_flops`` that is not a positive finite number, or a row whose ceiling is not a number
    in 0..``peak_flops`` (a table made for another peak)."""
    keys = ("rung", "d", "share", "ceiling")
    if not isinstance(table, (list, tuple)) or not table or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                                    for r in table):
        raise TypeError(f"table must be a non-empty list of rows from lessons.gpu.sass.fma_loop_table() (each with "
                        f"{', '.join(keys)})")
    peak_flops = check_positive_real(peak_flops, "peak_flops", "number of FLOP/s")
    for row in table:
        for key in ("ceiling", "tile_ceiling"):
            c = row.get(key, 0.0)
            if isinstance(c, (bool, np.bool_)) or not isinstance(c, numbers.Real) or not 0 <= c <= peak_flops:
                raise ValueError(f"table: the {key} of {row['rung']} at d={row['d']} must be a number of FLOP/s in "
                                 f"0..peak_flops={peak_flops:g}, got {c!r}")
        if row.get("tile_ceiling", 0.0) > row["ceiling"]:
            raise ValueError(f"table: the tile_ceiling of {row['rung']} at d={row['d']} is above its ceiling: a tile "
                             f"holds the product loops, so it cannot allow more than they do")
    for name, value in (("needs", needs), ("measured", measured)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict or None, got {type(value).__name__} {value!r}")
    needs, measured = needs or {}, measured or {}
    if not all(isinstance(v, dict) for v in measured.values()):
        raise TypeError("measured must map each rung to a dict {d: TFLOP/s}")
    ds = list(dict.fromkeys(r["d"] for r in table))
    rungs = list(dict.fromkeys(r["rung"] for r in table))
    colours = dict(zip(rungs, RUNG_COLOURS * (len(rungs) // len(RUNG_COLOURS) + 1)))
    width = 0.8 / len(rungs)
    fig = new_figure((9.5, 4.6))
    ax = fig.add_axes([0.08, 0.13, 0.62, 0.74])
    peak = peak_flops / 1e12
    ax.axhline(peak, color="black", lw=1)
    ax.text(len(ds) - 0.5, peak, f"FP32 peak {peak:.0f}", ha="right", va="bottom", fontsize=8)
    drew_need = drew_measured = drew_loops = False
    for i, d in enumerate(ds):
        for j, name in enumerate(rungs):
            row = next((r for r in table if r["d"] == d and r["rung"] == name), None)
            if row is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            top, share = row["ceiling"] / 1e12, row["share"]
            if "tile_ceiling" in row:
                ax.bar(x, top, width * 0.9, color=colours[name], alpha=0.3)
                drew_loops = True
                top, share = row["tile_ceiling"] / 1e12, row["tile_share"]
            ax.bar(x, top, width * 0.9, color=colours[name], label=name if i == 0 else None)
            ax.text(x, row["ceiling"] / 1e12 + 0.8, f"{top:.0f}\n({share:.0%})", ha="center", va="bottom", fontsize=7.5)
            value = measured.get(name, {}).get(d)
            if value is not None:
                ax.plot(x, value, marker="D", ms=7, color="#d62728", mec="white", linestyle="none",
                        label=measured_label if not drew_measured else None, zorder=3)
                drew_measured = True
        if needs.get(d) is not None:
            ax.hlines(needs[d], i - 0.45, i + 0.45, colors="#d62728", linestyles="--", lw=1.5,
                      label=needs_label if not drew_need else None, zorder=2)
            drew_need = True
    ax.set_xticks(range(len(ds)), [f"d = {d}" for d in ds])
    ax.set_xlim(-0.5, len(ds) - 0.5)
    ax.set_ylim(0, peak * 1.12)
    ax.set_ylabel("TFLOP/s (FP32)")
    ax.set_title("The ceiling issue slots put on each CUDA-core rung\n"
                 "(the products' FFMA share of the instructions a key tile issues x the FP32 peak)", fontsize=10,
                 loc="left")
    tidy(ax)
    handles, labels = ax.get_legend_handles_labels()
    if drew_loops:
        handles.append(Patch(facecolor="#808080", alpha=0.3, label="pale: the product loops alone"))
        labels.append(handles[-1].get_label())
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return fig


#: colours of the instruction classes of :data:`lessons.gpu.sass.ISSUE_CLASSES` (and "other"), in that order:
#: the tensor cores' own dark, then what feeds them, what the softmax costs, and the overheads in greys
CLASS_COLOURS = {"tensor": "#1f4e99", "shared loads": "#6baed6", "copies": "#9ecae1", "exponentials": "#e6550d",
                 "other float": "#fdae6b", "integer and address": "#969696", "control and sync": "#d9d9d9",
                 "other": "#756bb1"}


def _rows_by_head_dim(table, step: float, d_gap: float) -> tuple[list, list, list, float]:
    """The layout of a figure with one bar group per row of ``table``: the rows grouped by head dim in the order
    the dims first appear, the instruction classes they hold (those of :data:`CLASS_COLOURS` first, in its order),
    each row's y (``step`` apart, ``d_gap`` more between head dims) and the y below the last row."""
    ds = list(dict.fromkeys(r["d"] for r in table))
    order = [r for d in ds for r in table if r["d"] == d]
    names = [c for c in CLASS_COLOURS if any(r["classes"].get(c) for r in order)]
    names += [c for r in order for c in r["classes"] if c not in CLASS_COLOURS and c not in names and r["classes"][c]]
    ys, y = [], 0.0
    for k, row in enumerate(order):
        if k and row["d"] != order[k - 1]["d"]:
            y += d_gap                                 # a gap between head dims
        ys.append(y)
        y += step
    return order, names, ys, y


def hmma_slots_figure(table):
    """Horizontal stacked bars: per row of ``table`` (rows of :func:`lessons.gpu.sass.tensor_tile_table`, grouped
    by head dim in the order given) the instructions one warp issues per ``HMMA`` on an interior key tile, split by
    instruction class (each ``classes[name] / hmma``), a dashed line at ``clocks`` (one HMMA per that many clocks
    per scheduler: what the tensor peak needs) and, at each bar's end, the ceiling it puts on the rate ("at most",
    ``ceiling`` in TFLOP/s and ``peak_share``). Returns a Figure. TypeError for a ``table`` that is not a
    non-empty list of such rows (rung, d, hmma, instructions, classes, clocks, peak_share, ceiling); ValueError for
    a row whose classes do not sum to its instructions, whose ``hmma`` is not above 0, or whose rows mix clocks."""
    keys = ("rung", "d", "hmma", "instructions", "classes", "clocks", "peak_share", "ceiling")
    if not isinstance(table, (list, tuple)) or not table or not all(isinstance(r, dict) and all(k in r for k in keys)
                                                                    for r in table):
        raise TypeError(f"table must be a non-empty list of rows from lessons.gpu.sass.tensor_tile_table() (each with "
                        f"{', '.join(keys)})")
    for row in table:
        if not isinstance(row["classes"], dict) or sum(row["classes"].values()) != row["instructions"]:
            raise ValueError(f"table: the classes of {row['rung']} at d={row['d']} must be a dict that sums to its "
                             f"{row['instructions']} instructions, got {row['classes']!r}")
        if isinstance(row["hmma"], (bool, np.bool_)) or not isinstance(row["hmma"], numbers.Integral) or row["hmma"] < 1:
            raise ValueError(f"table: hmma of {row['rung']} at d={row['d']} must be an int above 0, got {row['hmma']!r}")
    clocks = {row["clocks"] for row in table}
    if len(clocks) != 1:
        raise ValueError(f"table: every row must need the same clocks per HMMA (one arch), got {sorted(clocks)}")
    (clocks,) = clocks
    order, names, ys, y = _rows_by_head_dim(table, step=1.0, d_gap=0.6)
    longest = max(max(r["instructions"] / r["hmma"] for r in order), clocks)   # (the peak's line stays in view)
    height = 1.3 + 0.36 * y
    fig = new_figure((10.0, height))
    ax = fig.add_axes([0.185, 0.75 / height, 0.6, 1 - 1.25 / height])
    for row, yy in zip(order, ys):
        left = 0.0
        for name in names:
            width = row["classes"].get(name, 0) / row["hmma"]
            if width:
                ax.barh(yy, width, 0.72, left=left, color=CLASS_COLOURS.get(name, "#ffffff"), edgecolor="white",
                        lw=0.5, label=name if row is order[0] or name not in ax.get_legend_handles_labels()[1] else None)
                left += width
        ax.text(left + 0.15, yy, f"at most {row['ceiling'] / 1e12:.0f} TFLOP/s ({row['peak_share']:.0%})",
                va="center", ha="left", fontsize=8)
    ax.axvline(clocks, color="#d62728", ls="--", lw=1.3, zorder=3)
    ax.text(clocks + 0.1, -0.62, f"{clocks} per HMMA: what the tensor peak needs", color="#d62728", ha="left",
            va="center", fontsize=8)
    ax.set_yticks(ys, [f"{r['rung']}, d = {r['d']}" for r in order])
    ax.set_ylim(y - 0.4, -1.0)
    ax.set_xlim(0, longest * 1.33)
    ax.set_xlabel("instructions one warp issues per HMMA, on an interior key tile (by class)", fontsize=9)
    ax.set_title("What a tensor-core rung issues beside its HMMA\n(one scheduler issues one instruction per clock)",
                 fontsize=10, loc="left")
    tidy(ax)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False,
              title="class", title_fontsize=8)
    return fig


def warpgroup_pipes_figure(table):
    """Horizontal bars, per row of ``table`` (rows of :func:`lessons.gpu.warpgroup_pipes.warpgroup_table`, grouped
    by head dim in the order given): three bars of clocks per consumer warp and key tile, the tensor cores' T, the
    special function unit's M (exponentials) and the issue slot's I (stacked by instruction class), and, beside
    them, the most of the tensor peak the rung's order allows ("at most", ``ceiling`` in TFLOP/s and ``share``).
    Returns a Figure. TypeError for a ``table`` that is not a non-empty list of such rows (rung, d, tensor_clocks,
    mufu_clocks, issue_clocks, classes, share, ceiling); ValueError for a row whose classes do not sum to its
    issue clocks; TypeError or ValueError naming ``table[i]['key']`` for a value of the wrong kind, a negative one
    or one that is not finite."""
    from lessons.gpu.warpgroup_pipes import _check_rows

    _check_rows(table, ("rung", "d", "tensor_clocks", "mufu_clocks", "issue_clocks", "classes", "share", "ceiling"))
    for row in table:
        if sum(row["classes"].values()) != row["issue_clocks"]:
            raise ValueError(f"table: the classes of {row['rung']} at d={row['d']} must be a dict that sums to its "
                             f"{row['issue_clocks']} issue clocks, got {row['classes']!r}")
    bar, gap = 0.26, 0.5
    order, names, ys, y = _rows_by_head_dim(table, step=3 * bar + gap, d_gap=0.5)
    ds = {r["d"] for r in order}
    longest = max(max(r["tensor_clocks"], r["mufu_clocks"], r["issue_clocks"]) for r in order)
    height = 2.2 + 1.05 * len(order) + 0.3 * len(ds)
    fig = new_figure((10.0, height))
    ax = fig.add_axes([0.2, 1.5 / height, 0.78, 1 - 2.1 / height])
    seen = set()

    def label(name):
        if name in seen:
            return None
        seen.add(name)
        return name

    clocks = count_ranges([row["classes"] for row in order], unit="clock")   # each issue class's, in its legend entry

    for row, yy in zip(order, ys):
        ax.barh(yy, row["tensor_clocks"], bar, color="#08306b", edgecolor="white", lw=0.5, hatch="///",
                label=label("T: tensor cores busy (HGMMA)"))
        ax.barh(yy + bar, row["mufu_clocks"], bar, color="#a63603", edgecolor="white", lw=0.5, hatch="///",
                label=label("M: special function unit busy (8 clocks per MUFU)"))
        left = 0.0
        for name in names:
            width = row["classes"].get(name, 0)
            if width:
                ax.barh(yy + 2 * bar, width, bar, left=left, color=CLASS_COLOURS.get(name, "#ffffff"),
                        edgecolor="white", lw=0.3, label=label(f"I, issue slots: {name} ({clocks[name]})"))
                left += width
        for k, (what, value) in enumerate((("T", row["tensor_clocks"]), ("M", row["mufu_clocks"]),
                                           ("I", row["issue_clocks"]))):
            ax.text(value + longest * 0.01, yy + k * bar, f"{what} = {value:.0f}", va="center", ha="left", fontsize=7.5)
        ax.text(longest * 1.1, yy + bar, f"in its order at most\n{row['ceiling'] / 1e12:.0f} TFLOP/s "
                f"({row['share']:.0%} of the peak)", va="center", ha="left", fontsize=8)
    ax.set_yticks([yy + bar for yy in ys], [f"{r['rung']}, d = {r['d']}" for r in order])
    ax.set_ylim(y - gap + 0.1, -0.4)
    ax.set_xlim(0, longest * 1.4)
    ax.set_xlabel("clocks per consumer warp and interior key tile, on its sub-partition", fontsize=9)
    ax.set_title("Three pipes of a Hopper rung's consumer warp: tensor cores, exponentials, issue slots\n"
                 "(the longest bounds the tile; the order of the steps decides how much of the rest overlaps)",
                 fontsize=10, loc="left")
    tidy(ax)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.55, 0.1 / height), ncol=3, fontsize=7.5,
               frameon=False)
    return fig

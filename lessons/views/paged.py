"""Pictures for the paged lessons: the page pool, GQA head groups, KV-cache sizes.

Nothing here computes attention. :func:`paged_cache_figure` draws what a
:class:`lessons.schedules.paged.PagedTrace` recorded (block table, pages read, step by step);
:func:`gqa_groups_figure` draws :func:`lessons.schedules.gqa_decode.kv_head_of`;
:func:`kv_bytes_figure` plots :func:`lessons.schedules.gqa_decode.kv_cache_bytes`.
All return a ``matplotlib.figure.Figure`` (no pyplot state); the tile colours are
the series' own (:data:`lessons.views.flash.TILE_COLOURS`).
"""
from __future__ import annotations

import numbers

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.ticker import FuncFormatter

from lessons.core.checks import check_int
from lessons.views.plot import new_figure
from lessons.schedules.gqa_decode import kv_cache_bytes, kv_head_of
from lessons.views.flash import TILE_COLOURS
from lessons.schedules.paged import PagedTrace

__all__ = ["page_states", "paged_cache_figure", "gqa_groups_figure", "kv_bytes_figure", "HEAD_COLOURS"]

OTHER_PAGE = "#f4f4f4"     # a page of another sequence, or free
UNUSED_SLOT = "#ffffff"    # a slot past seq_len in the last page (never read)
#: Colours of KV heads (query heads take their KV head's colour).
HEAD_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


def page_states(trace: PagedTrace, step: int, row: int = 0) -> dict[int, str]:
    """State of each page of the sequence after ``step`` absorbed blocks of query row ``row``.

    Returns ``{page: "done" | "current" | "pending"}`` for the pages in the block table
    (pages not in it are absent). ``step`` is an int in ``0..len(trace.row(row))``.
    Raises TypeError for a non-PagedTrace, ValueError for a step out of range.
    """
    if not isinstance(trace, PagedTrace):
        raise TypeError(f"trace must be a lessons.schedules.paged.PagedTrace, got {type(trace).__name__}")
    rt = trace.row(row)
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step <= len(rt):
        raise ValueError(f"step must be an int in 0..{len(rt)} (blocks absorbed), got {step!r}")
    table = [int(p) for p in trace.block_table]
    states = {}
    for j, page in enumerate(table):
        states[page] = "done" if j < step - 1 else ("current" if j == step - 1 else "pending")
    return states


def paged_cache_figure(trace: PagedTrace, step=None, *, row=0, pages_per_row=16, figsize=None, dpi=80) -> Figure:
    """The block table and the page pool, with the sequence's pages highlighted.

    Top: the block table, one box per logical block holding its physical page number.
    Bottom: every page of the pool as ``block_size`` slots; the sequence's pages are
    coloured by state after ``step`` blocks (grey: not read yet, orange: being read,
    pale blue: done), slots past ``seq_len`` in the last page are white and hatched
    (never read), pages of other sequences or free pages are pale grey. Arrows go from
    each table entry to its page (for tables of more than 16 entries, only the current one).

    Parameters
    ----------
    trace : PagedTrace with ``block_table`` set (from :func:`lessons.paged_flash_attention`
        with ``return_trace=True`` or :func:`lessons.schedules.paged.paged_schedule`).
    step : int in 0..number of blocks, default: all blocks absorbed.
    row : query row of the trace whose steps are drawn.
    pages_per_row : int >= 1, pages drawn per line of the pool.

    Returns the Figure; raises TypeError/ValueError for a bad trace or step.
    """
    if not isinstance(trace, PagedTrace) or trace.block_table is None:
        raise TypeError("trace must be a lessons.schedules.paged.PagedTrace that recorded its block_table")
    pages_per_row = check_int(pages_per_row, "pages_per_row", min=1)
    rt = trace.row(row)
    step = len(rt) if step is None else step
    states = page_states(trace, step, row)
    table = [int(p) for p in trace.block_table]
    bs, nk, num_blocks = trace.block_k, trace.nk, trace.num_blocks
    fill = {page: min(bs, nk - j * bs) for j, page in enumerate(table)}
    logical = {page: j for j, page in enumerate(table)}
    n_rows = -(-num_blocks // pages_per_row)
    if figsize is None:
        figsize = (10.0, 2.2 + 1.0 * n_rows)
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.01, 0.02, 0.98, 0.86])
    ax.set_axis_off()
    page_w, gap = 1.0, 0.25
    slot_w = page_w / bs
    pool_top = 0.0
    centres = {}
    for p in range(num_blocks):
        r, c = divmod(p, pages_per_row)
        x0, y0 = c * (page_w + gap), pool_top - (r + 1) * 1.0
        mine = p in states
        for s in range(bs):
            used = mine and s < fill[p]
            colour = TILE_COLOURS[states[p]] if used else (UNUSED_SLOT if mine else OTHER_PAGE)
            ax.add_patch(Rectangle((x0 + s * slot_w, y0), slot_w, 0.45, facecolor=colour,
                                   edgecolor="white" if used else "#dddddd", linewidth=0.8,
                                   hatch="///" if mine and not used else None))
        ax.add_patch(Rectangle((x0, y0), page_w, 0.45, fill=False, edgecolor="#333333" if mine else "#bbbbbb",
                               linewidth=1.6 if mine else 0.8))
        label = f"page {p}" + (f"\nblock {logical[p]}" if mine else "")
        ax.text(x0 + page_w / 2, y0 - 0.06, label, ha="center", va="top", fontsize=7.5, linespacing=1.1,
                color="#222222" if mine else "#999999", fontweight="bold" if mine else "normal")
        centres[p] = (x0 + page_w / 2, y0 + 0.45)
    # the block table, above the pool
    width = min(pages_per_row, num_blocks) * (page_w + gap) - gap
    box_w = min(0.9, width / max(len(table), 1) - 0.1)
    table_y = 0.55
    ax.text(0, table_y + 0.62, f"block table of the sequence (seq_len = {nk}, block_size = {bs})",
            fontsize=10, va="bottom")
    for j, page in enumerate(table):
        x0 = j * (box_w + 0.1)
        ax.add_patch(Rectangle((x0, table_y), box_w, 0.4, facecolor=TILE_COLOURS[states[page]],
                               edgecolor="#333333", linewidth=1.0))
        ax.text(x0 + box_w / 2, table_y + 0.2, str(page), ha="center", va="center", fontsize=9, fontweight="bold")
        ax.text(x0 + box_w / 2, table_y + 0.44, f"block {j}" if len(table) <= 12 else str(j), ha="center",
                va="bottom", fontsize=7, color="#666666")
        if len(table) <= 16 or states[page] == "current":   # many arrows would hide the pool
            ax.add_patch(FancyArrowPatch((x0 + box_w / 2, table_y), centres[page], arrowstyle="-|>",
                                         mutation_scale=8, linewidth=0.7,
                                         color="#a34a00" if states[page] == "current" else "#888888",
                                         connectionstyle="arc3,rad=0.0", zorder=0.5))
    ax.set_xlim(-0.1, max(width, len(table) * (box_w + 0.1)) + 0.1)
    ax.set_ylim(pool_top - n_rows * 1.0 - 0.3, table_y + 0.95)
    handles = [Patch(facecolor=TILE_COLOURS[s], label=t) for s, t in
               (("pending", "not read yet"), ("current", "being read (one tile)"), ("done", "absorbed"))]
    handles += [Patch(facecolor=UNUSED_SLOT, edgecolor="#999999", hatch="///", label="slot past seq_len (never read)"),
                Patch(facecolor=OTHER_PAGE, edgecolor="#bbbbbb", label="other sequences / free")]
    fig.legend(handles=handles, loc="upper center", ncol=5, frameon=False, fontsize=8, bbox_to_anchor=(0.5, 1.0))
    return fig


def gqa_groups_figure(num_heads=8, kv_heads=(8, 2, 1), *, figsize=None, dpi=80) -> Figure:
    """Which KV head each query head reads, for several ``num_kv_heads`` side by side.

    One panel per entry of ``kv_heads`` (8 = MHA, 1 = MQA, in between GQA): query
    heads on top, KV heads below, a line from query head h to KV head
    ``h // (num_heads // num_kv_heads)`` (:func:`lessons.schedules.gqa_decode.kv_head_of`).
    Returns the Figure; raises the errors of ``kv_head_of``.
    """
    kv_heads = list(kv_heads)
    maps = [kv_head_of(num_heads, g) for g in kv_heads]
    fig = new_figure(figsize or (3.4 * len(kv_heads), 2.6), dpi)
    for i, (g, mapping) in enumerate(zip(kv_heads, maps)):
        ax = fig.add_subplot(1, len(kv_heads), i + 1)
        ax.set_axis_off()
        name = "MHA" if g == num_heads else ("MQA" if g == 1 else "GQA")
        ax.set_title(f"{name}: {num_heads} query heads, {g} KV head{'s' if g > 1 else ''}", fontsize=10)
        xq = np.arange(num_heads)
        xk = (np.arange(g) + 0.5) * num_heads / g - 0.5
        for h in range(num_heads):
            colour = HEAD_COLOURS[mapping[h] % len(HEAD_COLOURS)]
            ax.plot([xq[h], xk[mapping[h]]], [1, 0], color=colour, linewidth=1.4, zorder=1)
            ax.add_patch(Rectangle((xq[h] - 0.35, 1), 0.7, 0.35, facecolor=colour, edgecolor="#333333", zorder=2))
        for kv in range(g):
            ax.add_patch(Rectangle((xk[kv] - 0.45, -0.45), 0.9, 0.45, facecolor=HEAD_COLOURS[kv % len(HEAD_COLOURS)],
                                   edgecolor="#333333", hatch="..", zorder=2))
        ax.text(-0.6, 1.17, "q", ha="right", va="center", fontsize=9)
        ax.text(-0.6, -0.22, "K,V", ha="right", va="center", fontsize=9)
        ax.text((num_heads - 1) / 2, -0.75, f"KV cache: {g}/{num_heads} of MHA", ha="center", fontsize=9)
        ax.set_xlim(-1.4, num_heads)
        ax.set_ylim(-0.95, 1.45)
    fig.subplots_adjust(left=0.02, right=0.98, top=0.85, bottom=0.02, wspace=0.12)
    return fig


def _tokens_label(x, _pos=None) -> str:
    return f"{x / 1024:g}K" if x >= 1024 else f"{x:g}"


def _gib_label(x, _pos=None) -> str:
    return f"{x:g}" if x >= 1 else f"1/{1 / x:g}"


def kv_bytes_figure(seq_lens, *, num_layers=32, num_heads=32, head_dim=128, kv_heads=(32, 8, 1), dtype="float16",
                    batch_size=1, budget_bytes=None, figsize=(7.5, 4.0), dpi=80) -> Figure:
    """KV-cache size against context length for several ``num_kv_heads`` (MHA, GQA, MQA).

    ``seq_lens``: 1-D ints (the x axis, tokens); the sizes come from
    :func:`lessons.schedules.gqa_decode.kv_cache_bytes` and are drawn in GiB on log-log axes.
    ``budget_bytes``, if given, draws a horizontal line (e.g. one GPU's memory).
    Returns the Figure.
    """
    seq_lens = [int(n) for n in seq_lens]
    fig = new_figure(figsize, dpi)
    ax = fig.add_subplot(1, 1, 1)
    for i, g in enumerate(kv_heads):
        name = "MHA" if g == num_heads else ("MQA" if g == 1 else "GQA")
        gib = [kv_cache_bytes(n, num_layers, g, head_dim, dtype, batch_size=batch_size) / 2**30 for n in seq_lens]
        ax.plot(seq_lens, gib, marker="o", markersize=3.5, color=HEAD_COLOURS[i % len(HEAD_COLOURS)],
                label=f"{name}, {g} KV head{'s' if g > 1 else ''}")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / 2**30, color="#a34a00", linestyle="--", linewidth=1)
        ax.text(seq_lens[0], budget_bytes / 2**30 * 1.12, f"{budget_bytes / 2**30:.0f} GiB", color="#a34a00",
                fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    ax.yaxis.set_major_formatter(FuncFormatter(_gib_label))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache (GiB)")
    dtype_name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    ax.set_title(f"KV cache: {num_layers} layers × head_dim {head_dim}, {dtype_name}, batch {batch_size}",
                 fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(frameon=False, fontsize=9)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig

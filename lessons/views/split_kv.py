"""Pictures for flash-decoding and ring attention.

Nothing here computes attention: :func:`flash_decoding_figure` draws the partials
that :func:`lessons.flash_decoding` returns (``return_partials=True``) and their
weights from :func:`lessons.schedules.split_kv.merge_weights`; :func:`ring_figure` draws
what a :class:`lessons.schedules.ring.RingTrace` recorded. Both return a
``matplotlib.figure.Figure`` (no pyplot state).
"""
from __future__ import annotations

import numbers

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, Patch, Rectangle

from lessons.core.checks import as_float_array, check_int
from lessons.views.plot import new_figure
from lessons.schedules.split_kv import merge_weights, split_ranges
from lessons.views.flash import EXACT_COLOUR, OUTPUT_COLOUR
from lessons.schedules.ring import RingTrace

__all__ = ["flash_decoding_figure", "split_strip_figure", "ring_figure", "WORKER_COLOURS"]

#: One colour per worker / KV block (cycled).
WORKER_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                  "#9c755f", "#bab0ac"]


def _colour(i: int) -> str:
    return WORKER_COLOURS[i % len(WORKER_COLOURS)]


def flash_decoding_figure(o_parts, lse_parts, out, exact=None, *, dims=8, figsize=(10.0, 5.2), dpi=80) -> Figure:
    """The keys split over workers, each worker's weight, and partial vs merged outputs.

    Parameters
    ----------
    o_parts : float array (num_splits, dv), the workers' normalised partial outputs of
        one query (``flash_decoding(q, k, v, n, return_partials=True)``).
    lse_parts : float array (num_splits,), their lse (``-inf`` for an empty worker).
    out : float array (dv,), the merged output.
    exact : float array (dv,), the textbook output (drawn as green ticks), optional.
    dims : int, how many output dimensions to draw.

    Top left: each worker's share of the softmax mass, ``exp(lse_i - lse)``
    (:func:`lessons.schedules.split_kv.merge_weights`). Top right: ``lse_i``. Bottom: the first
    ``dims`` output dimensions of every partial (coloured dots), the merged output
    (dark line) and the exact output (green ticks); its title says when only the first
    ``dims`` of ``dv`` are drawn.
    Returns the Figure; raises TypeError for non-float arrays or a ``dims`` that is not an
    int, ValueError for mismatched shapes (``exact`` must have the shape of ``out``) or ``dims < 1``.
    """
    o_parts, lse_parts, out = (as_float_array(x, name).astype(float) for x, name in
                               ((o_parts, "o_parts"), (lse_parts, "lse_parts"), (out, "out")))
    if o_parts.ndim != 2 or lse_parts.shape != o_parts.shape[:1] or out.shape != o_parts.shape[1:]:
        raise ValueError(f"need o_parts (num_splits, dv), lse_parts (num_splits,), out (dv,); got "
                         f"{o_parts.shape}, {lse_parts.shape}, {out.shape}")
    if exact is not None:
        exact = as_float_array(exact, "exact").astype(float)
        if exact.shape != out.shape:
            raise ValueError(f"exact must have the shape of out {out.shape} (dv,), got {exact.shape}")
    n, dv = o_parts.shape
    dims = min(check_int(dims, "dims", min=1), dv)
    w = merge_weights(lse_parts)
    fig = new_figure(figsize, dpi)
    grid = fig.add_gridspec(2, 2, height_ratios=[1.0, 1.3], hspace=0.45, wspace=0.22, left=0.07, right=0.86,
                            top=0.92, bottom=0.1)
    ax_w = fig.add_subplot(grid[0, 0])
    ax_l = fig.add_subplot(grid[0, 1])
    ax_o = fig.add_subplot(grid[1, :])
    workers = np.arange(n)
    ax_w.bar(workers, w, color=[_colour(i) for i in workers])
    ax_w.set_title("weight of each worker in the merge: exp(lse_i − lse)", fontsize=10)
    ax_w.set_ylim(0, 1.05)
    finite = np.isfinite(lse_parts)
    ax_l.bar(workers[finite], lse_parts[finite], color=[_colour(i) for i in workers[finite]])
    for i in workers[~finite]:
        ax_l.text(i, 0, "empty\n(−∞)", ha="center", va="bottom", fontsize=8, color="#666666")
    ax_l.axhline(0, color="#999999", linewidth=0.6)
    ax_l.set_title("lse_i = m_i + log l_i of each worker", fontsize=10)
    for ax in (ax_w, ax_l):
        ax.set_xticks(workers)
        ax.set_xlabel("worker", fontsize=9)
    x = np.arange(dims)
    spread = 0.6 / max(n, 1)
    for i in workers[finite]:
        ax_o.scatter(x - 0.3 + (i + 0.5) * spread, o_parts[i, :dims], s=14 + 120 * w[i], color=_colour(i),
                     alpha=0.85, zorder=2, label=f"worker {i}" if n <= 10 else None)
    ax_o.plot(x, out[:dims], color=OUTPUT_COLOUR, marker="D", markersize=5, linewidth=1.5, label="merged", zorder=3)
    if exact is not None:
        ax_o.scatter(x, exact[:dims], marker="_", s=500, color=EXACT_COLOUR, linewidths=2.5, label="exact", zorder=4)
    ax_o.set_xticks(x)
    ax_o.set_xlabel("output dimension", fontsize=9)
    shown = f" (first {dims} of {dv} dims)" if dims < dv else ""
    ax_o.set_title(f"partial outputs o_i (dot size = weight) and their merge{shown}", fontsize=10)
    ax_o.legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    for ax in (ax_w, ax_l, ax_o):
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(labelsize=8)
    return fig


def split_strip_figure(nk: int, num_splits: int, *, figsize=(10.0, 1.3), dpi=80) -> Figure:
    """The keys ``0..nk-1`` as a strip coloured by the worker that folds them.

    Uses :func:`lessons.schedules.split_kv.split_ranges`; empty workers are listed at the right, and the
    title gives the chunk size and, when it differs, the size of the last non-empty chunk.
    Returns the Figure.
    """
    ranges = split_ranges(nk, num_splits)
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.02, 0.42, 0.96, 0.34])
    for i, (a, b) in enumerate(ranges):
        if b > a:
            ax.add_patch(Rectangle((a, 0), b - a, 1, facecolor=_colour(i), edgecolor="white", linewidth=1.5))
            ax.text((a + b) / 2, 0.5, f"w{i}", ha="center", va="center", fontsize=8, color="white", fontweight="bold")
    empty = [i for i, (a, b) in enumerate(ranges) if b == a]
    ax.set_xlim(0, max(nk, 1))
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("key position", fontsize=9)
    note = f";  empty workers: {', '.join(map(str, empty))}" if empty else ""
    sizes = [b - a for a, b in ranges if b > a]
    last = f" (last: {sizes[-1]})" if sizes and sizes[-1] != sizes[0] else ""
    ax.set_title(f"{nk} keys over {num_splits} workers (contiguous chunks of {sizes[0] if sizes else 0}{last}){note}",
                 fontsize=9, loc="left")
    return fig


def ring_figure(trace: RingTrace, step=None, *, figsize=(10.0, 4.2), dpi=80) -> Figure:
    """Ring attention at one ring step: the ring of devices, and the whole schedule.

    Left: the devices on a ring at ring step ``step`` (counted from 1, as the text and
    the slider count them); device r shows the query block ``Q`` and the KV block it
    holds now, coloured by the block that travels (the KV block for the ``"kv"``
    schedule, the query block with its state for ``"q"``); an arrow shows where that
    block goes next. A device that has nothing to fold at this step (the block is wholly
    above the causal diagonal, or a block is empty) is drawn hatched.
    Right: the schedule, rows = devices, columns = ring steps 1..world_size, each cell
    the travelling block held (``trace.holds`` or ``trace.q_holds``, block numbers
    0-based), hatched where nothing was folded (``trace.folded``); the current step is
    outlined.

    ``trace``: RingTrace (``ring_attention(..., return_trace=True)``); ``step``: int in
    ``1..world_size``, default the last. Returns the Figure; raises TypeError for
    another trace and ValueError for a step outside ``1..world_size``.
    """
    if not isinstance(trace, RingTrace):
        raise TypeError(f"trace must be a lessons.schedules.ring.RingTrace, got {type(trace).__name__}")
    ws = trace.world_size
    step = ws if step is None else step
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 1 <= step <= ws:
        raise ValueError(f"step must be an int in 1..{ws} (ring steps count from 1), got {step!r}")
    t_now = int(step) - 1                                       # array index of this ring step
    q_schedule = getattr(trace, "schedule", "kv") == "q"
    q_holds = trace.q_holds if trace.q_holds is not None else np.tile(np.arange(ws), (ws, 1))
    travelling = q_holds if q_schedule else trace.holds
    fig = new_figure(figsize, dpi)
    ax_r = fig.add_axes([0.01, 0.04, 0.36, 0.82])
    ax_s = fig.add_axes([0.45, 0.16, 0.53, 0.66])
    # the ring
    ax_r.set_axis_off()
    ax_r.set_aspect("equal")
    angles = np.pi / 2 - 2 * np.pi * np.arange(ws) / ws
    pos = np.stack([np.cos(angles), np.sin(angles)], 1)
    radius = min(0.32, 1.6 / max(ws, 1))
    for r in range(ws):
        b = int(travelling[t_now, r])
        busy = bool(trace.folded[t_now, r])
        ax_r.add_patch(Circle(pos[r], radius, facecolor=_colour(b) if busy else "#ffffff", edgecolor=_colour(b),
                              linewidth=2.0, hatch=None if busy else "///", zorder=2))
        ax_r.text(*pos[r], f"Q{int(q_holds[t_now, r])}\nKV{int(trace.holds[t_now, r])}", ha="center", va="center",
                  fontsize=8 if ws <= 8 else 6, color="white" if busy else "#333333", fontweight="bold", zorder=3)
        nxt = pos[(r + 1) % ws]
        if ws > 1:
            d = nxt - pos[r]
            u = d / np.linalg.norm(d)
            ax_r.add_patch(FancyArrowPatch(pos[r] + u * radius * 1.05, nxt - u * radius * 1.05, arrowstyle="-|>",
                                           mutation_scale=10, color="#888888", connectionstyle="arc3,rad=-0.25",
                                           zorder=1))
    ax_r.set_xlim(-1.45, 1.45)
    ax_r.set_ylim(-1.45, 1.45)
    what = ("device r folds its KV block\ninto the query block it holds, then sends\nthat block and its (m, l, o) "
            "to r + 1" if q_schedule else "device r folds the KV block it holds,\nthen sends it to r + 1")
    ax_r.set_title(f"ring step {step} of {ws}: {what}", fontsize=9)
    # the schedule
    for t in range(ws):
        for r in range(ws):
            b = int(travelling[t, r])
            busy = bool(trace.folded[t, r])
            ax_s.add_patch(Rectangle((t, r), 1, 1, facecolor=_colour(b) if busy else "#ffffff",
                                     edgecolor="white" if busy else _colour(b), hatch=None if busy else "///",
                                     linewidth=1.0, alpha=1.0 if t <= t_now else 0.35))
            if ws <= 16:
                ax_s.text(t + 0.5, r + 0.5, str(b), ha="center", va="center", fontsize=8,
                          color=("white" if busy else "#333333") if t <= t_now else "#999999")
    ax_s.add_patch(Rectangle((t_now, 0), 1, ws, fill=False, edgecolor="#222222", linewidth=2.2))
    ax_s.set_xlim(0, ws)
    ax_s.set_ylim(ws, 0)
    ticks = np.arange(ws) + 0.5
    ax_s.set_xticks(ticks, [str(t + 1) for t in range(ws)], fontsize=8)
    ax_s.set_yticks(ticks, [str(r) for r in range(ws)], fontsize=8)
    ax_s.set_xlabel("ring step (from 1)", fontsize=9)
    ax_s.set_ylabel("device r (0-based)", fontsize=9)
    folded = int(trace.folded.sum())
    held = "query block (with its state)" if q_schedule else "KV block"
    ax_s.set_title(f"{held} held by each device (block numbers 0-based);\n"
                   f"{folded} of {ws * ws} (step, device) pairs fold a block", fontsize=9)
    ax_s.legend(handles=[Patch(facecolor="#ffffff", edgecolor="#666666", hatch="///",
                               label="nothing to fold (above the causal diagonal, or empty)")],
                loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False, fontsize=8)
    return fig

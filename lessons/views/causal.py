"""The score matrix as a grid of tiles, and a stepper over the FA-2 loop with a causal mask.

:func:`schedule_figure` draws the (Nq, Nk) score matrix cut into ``block_q x block_k``
tiles at one step of the loop: the tile in SRAM now, the tiles processed and
discarded, those not reached yet, and those never materialised (skipped, wholly
above the causal diagonal). :class:`BlockStepper` replays a
:class:`lessons.core.trace.Trace` over that picture and shows the running ``(m, l)``
of every row of the current query block. Both only draw what
:func:`lessons.schedules.causal.tile_schedule` and :func:`lessons.flash_attention` recorded.
"""
from __future__ import annotations

import numpy as np
from matplotlib import patheffects
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch, Rectangle

from lessons.views.plot import new_figure
from lessons.core.causal_rule import FULL, last_visible_key, tile_kind
from lessons.core.checks import check_flag
from lessons.schedules.causal import DIAGONAL, SKIPPED, TileVisit, causal_mask
from lessons.views.flash import TILE_COLOURS
from lessons.views.softmax import figure_png
from lessons.views.stepper import StepperShell, format_value
from lessons.core.trace import Trace

__all__ = ["GRID_LABELS", "tile_state", "schedule_figure", "block_state_text", "BlockStepper"]

#: Legend text of each tile state in the grid.
GRID_LABELS = {
    "current": "in SRAM now",
    "done": "processed and discarded",
    "pending": "not reached yet",
    "skipped": "never materialised (skipped)",
}
_MASKED = "#4b2a7a"          # masked scores inside a computed diagonal tile (drawn at alpha 0.35)
_DIAGONAL_LINE = "#c0392b"


def _check_visits(visits):
    visits = list(visits)
    if not visits or not all(isinstance(t, TileVisit) for t in visits):
        raise TypeError("visits must be a non-empty list of TileVisit (lessons.schedules.causal.tile_schedule)")
    return visits


def _check_causal(visits, causal) -> bool:
    """``causal`` as a bool, if it is how ``visits`` were made: every tile the kind the causal rule (or
    its absence) gives it. A schedule whose tiles are all full under the rule fits either."""
    causal = check_flag(causal, "causal")
    nq, nk = visits[-1].row_stop, max(t.key_stop for t in visits)
    if causal and any(t.kind != tile_kind(t.row_start, t.row_stop, t.key_start, t.key_stop, nq, nk) for t in visits):
        raise ValueError("visits were made with causal=False: pass causal=False (no tile is skipped or masked)")
    if not causal and any(t.kind != FULL for t in visits):
        raise ValueError("visits were made with causal=True: pass causal=True (some tiles are skipped or masked)")
    return causal


def _computed(visits):
    return sum(t.step is not None for t in visits)


def tile_state(visit, step):
    """State of one tile after ``step`` computed tiles (0 = before the loop).

    ``"skipped"`` for a skipped tile; else ``"done"`` if its step is before the
    current one, ``"current"`` if it is the ``step``-th computed tile, ``"pending"`` after.
    """
    if visit.step is None:
        return "skipped"
    if visit.step < step - 1:
        return "done"
    return "current" if visit.step == step - 1 else "pending"


def _rect(x0, x1, y0, y1):
    return [(x0, y0), (x0, y1), (x1, y1), (x1, y0)]


def schedule_figure(visits, step, *, causal=True, figsize=(6.4, 5.6), dpi=90, title=True):
    """The score matrix grid after ``step`` computed tiles of the FA-2 loop.

    Parameters
    ----------
    visits : list of :class:`lessons.schedules.causal.TileVisit` from :func:`lessons.schedules.causal.tile_schedule`.
    step : int in ``0..number of computed tiles``.
    causal : bool, draw the causal boundary and the masked scores inside diagonal tiles
        (pass what the schedule was made with; a schedule that the other value would have
        made differently is a ValueError).
    figsize, dpi : the Figure's size; title : draw a title naming the current tile.
        Blocks and tiles are counted from 1 in the title and the step labels (``TileVisit``
        indices stay 0-based: title "query block 1" is ``q_block == 0``).

    Returns a Figure: keys along x, query rows down y, one rectangle per tile in
    the colours of :data:`lessons.views.flash.TILE_COLOURS`; the current query block is
    marked on the left (its rows' ``m, l, o`` live on chip while its key tiles stream by).
    Raises TypeError for bad visits or a ``causal`` that is not True/False, ValueError for a step
    out of range or visits made with the other ``causal``.
    """
    visits = _check_visits(visits)
    causal = _check_causal(visits, causal)
    total = _computed(visits)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= total:
        raise ValueError(f"step must be an int in 0..{total}, got {step!r}")
    nq, nk = visits[-1].row_stop, max(t.key_stop for t in visits)
    fig = new_figure(figsize, dpi)
    height = fig.get_figheight()
    ax = fig.add_axes([0.1, 0.55 / height, 0.76, 1 - 1.65 / height])    # room for the title and legend above
    states = [tile_state(t, step) for t in visits]
    polys = [_rect(t.key_start, t.key_stop, t.row_start, t.row_stop) for t in visits]
    ax.add_collection(PolyCollection(polys, facecolors=[TILE_COLOURS[s] for s in states], edgecolors="white",
                                     linewidths=2.0, zorder=1))
    skipped = [p for p, s in zip(polys, states) if s == "skipped"]
    if skipped:
        ax.add_collection(PolyCollection(skipped, facecolors="none", edgecolors="#9a9a9a", hatch="////",
                                         linewidths=0.0, zorder=2))
    if causal:
        mask = causal_mask(nq, nk)
        # masked scores exist only in diagonal tiles already computed (in SRAM now or processed)
        cells = [_rect(j, j + 1, i, i + 1) for t, s in zip(visits, states)
                 if t.kind == DIAGONAL and s in ("current", "done")
                 for i in range(t.row_start, t.row_stop) for j in range(t.key_start, t.key_stop) if not mask[i, j]]
        if cells:
            ax.add_collection(PolyCollection(cells, facecolors=_MASKED, alpha=0.35, linewidths=0, zorder=2))
        xs, ys = [], []
        for i in range(nq):
            edge = min(max(last_visible_key(i, nq, nk) + 1, 0), nk)     # the rule: keys j <= i + Nk - Nq
            xs += [edge, edge]
            ys += [i, i + 1]
        ax.plot(xs, ys, color=_DIAGONAL_LINE, lw=1.6, zorder=3)
    if step:
        cur = next(t for t in visits if t.step == step - 1)
        ax.add_patch(Rectangle((nk * 1.015, cur.row_start), 0.025 * nk, cur.row_stop - cur.row_start,
                               color=TILE_COLOURS["current"], clip_on=False, zorder=4))
        ax.text(nk * 1.055, (cur.row_start + cur.row_stop) / 2, "m, l, o of\nthese rows\non chip", fontsize=8,
                va="center", ha="left", color="#7a3b00", clip_on=False)
        ax.add_patch(Rectangle((cur.key_start, cur.row_start), cur.key_stop - cur.key_start,
                               cur.row_stop - cur.row_start, fill=False, edgecolor="#7a3b00", lw=2.0, zorder=5))
    if len(visits) <= 64:
        outline = [patheffects.withStroke(linewidth=3, foreground="white")]
        for t in visits:
            if t.step is not None:
                ax.text((t.key_start + t.key_stop) / 2, (t.row_start + t.row_stop) / 2, str(t.step + 1),
                        ha="center", va="center", fontsize=9, color="#333333", zorder=7, path_effects=outline)
    ax.set_xlim(0, nk)
    ax.set_ylim(nq, 0)
    ax.set_aspect("equal" if 0.25 < nq / nk < 4 else "auto")
    ax.set_xlabel(f"key j  ({nk} keys, tiles of {visits[0].key_stop - visits[0].key_start})", fontsize=9.5)
    ax.set_ylabel(f"query row i  (blocks of {visits[0].row_stop - visits[0].row_start})", fontsize=9.5)
    ax.tick_params(labelsize=8.5)
    handles = [Patch(facecolor=TILE_COLOURS[s], edgecolor="#888888", lw=0.6, hatch="////" if s == "skipped" else None,
                     label=GRID_LABELS[s]) for s in ("current", "done", "pending", "skipped")]
    if causal:
        handles.append(Patch(facecolor=_MASKED, alpha=0.35, label="masked score (computed, set to −inf)"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.01, 1 - 0.3 / height), ncol=2, frameon=False,
               fontsize=8.5)
    if title:
        if step:
            kind = "on the diagonal: masked inside" if cur.kind == DIAGONAL else "full: no mask needed"
            text = f"step {step} of {total}: query block {cur.q_block + 1}, key tile {cur.k_block + 1} ({kind})"
        else:
            text = f"before the loop: {total} tiles to compute"
        fig.text(0.02, 1 - 0.06 / height, text, fontsize=10, ha="left", va="top", color="#7a3b00", fontweight="bold")
    return fig


def block_state_text(trace, step) -> str:
    """The BlockStepper's table as plain text: the current query block after ``step`` computed tiles.

    ``trace``: :class:`lessons.core.trace.Trace` of :func:`lessons.flash_attention`;
    ``step``: int in ``1..len(trace.steps)`` (1-based, as on the stepper's slider).
    Returns a str: a heading (query rows, key tile counted from 1, keys) then one line per
    row of the block with ``m`` before and after, ``alpha`` and ``l`` as recorded.
    Raises TypeError for a trace that is not a Trace, ValueError for a step out of range.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a lessons.core.trace.Trace, got {type(trace).__name__}")
    n = len(trace.steps)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 1 <= step <= n:
        raise ValueError(f"step must be an int in 1..{n}, got {step!r}")
    s = trace.steps[step - 1]
    lines = [f"query block rows {s.row_start}-{s.row_stop - 1} after key tile {s.tile + 1} "
             f"(keys {s.key_start}-{s.key_stop - 1})",
             f"{'row':>4} {'m before':>10} {'m':>10} {'alpha':>10} {'l':>10}"]
    for r in range(s.row_stop - s.row_start):
        values = (float(s.m_before[r]), float(s.m[r]), float(s.alpha[r]), float(s.l[r]))
        lines.append(f"{s.row_start + r:>4} " + " ".join(f"{format_value(x):>10}" for x in values))
    return "\n".join(lines)


class BlockStepper(StepperShell):
    """Step through the FA-2 loop over the score-matrix grid (ipywidgets).

    A view: the grid comes from ``visits`` (:func:`lessons.schedules.causal.tile_schedule`), the
    numbers from ``trace`` (:func:`lessons.flash_attention` with
    ``return_trace=True``, made with the same sizes and ``causal``).

    Parameters
    ----------
    trace : :class:`lessons.core.trace.Trace`; visits : list of :class:`lessons.schedules.causal.TileVisit`;
    causal : bool (as both were made); step : the first step shown (default 1).

    Attributes: ``slider`` (IntSlider over computed steps), ``play`` (Play),
    ``image`` (widgets.Image, PNG of :func:`schedule_figure`), ``table`` (HTML:
    per row of the current query block, ``m`` before and after, ``alpha``, ``l``),
    ``readouts`` (dict of widgets.HTML: ``scores_in_sram``, ``textbook_scores``,
    ``skipped``), ``widget`` (the whole box).

    Raises ValueError if the trace's steps are not the schedule's computed tiles, or the
    visits were made with the other ``causal`` (see :func:`schedule_figure`).
    """

    def __init__(self, trace, visits, *, causal=True, step=1, interval=900):
        if not isinstance(trace, Trace):
            raise TypeError(f"trace must be a lessons.core.trace.Trace, got {type(trace).__name__}")
        self.visits = _check_visits(visits)
        computed = [t for t in self.visits if t.step is not None]
        if [(s.row_start, s.key_start, s.key_stop) for s in trace.steps] != \
                [(t.row_start, t.key_start, t.key_stop) for t in computed]:
            raise ValueError("trace steps do not match the schedule's computed tiles (same sizes and causal?)")
        causal = _check_causal(self.visits, causal)
        self.trace, self.causal = trace, bool(causal)
        self._build_shell(len(computed), step=step, label="tiles computed", interval=interval,
                          readouts=("scores_in_sram", "textbook_scores", "skipped"), table_width="360px")

    def _render(self):
        step = self.slider.value
        s = self.trace.steps[step - 1]
        rows, keys = s.row_stop - s.row_start, s.key_stop - s.key_start
        skipped_total = sum(t.kind == SKIPPED for t in self.visits)
        cur = next(t for t in self.visits if t.step == step - 1)
        skipped_so_far = sum(t.kind == SKIPPED and t.order < cur.order for t in self.visits)
        r = self.readouts
        r["scores_in_sram"].value = f"scores in SRAM now: <b>{format_value(rows)} × {format_value(keys)}</b>"
        r["textbook_scores"].value = (f"textbook S: <b>{format_value(self.trace.nq)} × "
                                      f"{format_value(self.trace.nk)}</b>")
        r["skipped"].value = (f"tiles skipped so far: <b>{format_value(skipped_so_far)}</b> "
                              f"of {format_value(skipped_total)}")
        self.table.value = self._table(s)
        self.image.value = figure_png(schedule_figure(self.visits, step, causal=self.causal))

    @staticmethod
    def _table(s):
        head = "".join(f"<th style='padding:1px 6px'>{h}</th>" for h in ("row", "m before", "m", "α", "l"))
        body = []
        for r in range(s.row_stop - s.row_start):
            moved = s.m[r] > s.m_before[r] and np.isfinite(s.m_before[r])
            al = "color:#a34a00;font-weight:bold;" if moved else ""
            cells = [format_value(s.row_start + r), format_value(float(s.m_before[r])), format_value(float(s.m[r])),
                     f"<span style='{al}'>{format_value(float(s.alpha[r]))}</span>", format_value(float(s.l[r]))]
            body.append("<tr>" + "".join(f"<td style='padding:1px 6px;text-align:right'>{c}</td>" for c in cells)
                        + "</tr>")
        return (f"<div style='font-size:12px;margin-bottom:3px'><b>query block rows {s.row_start}–{s.row_stop - 1}"
                f"</b> after key tile {s.tile + 1} (keys {s.key_start}–{s.key_stop - 1})</div>"
                "<table style='border-collapse:collapse;font-size:12px;font-family:monospace'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
                "<div style='font-size:11px;color:#666;margin-top:4px'>m = −inf, l = 0: the row has seen no "
                "visible key yet. α in bold orange: the max moved.</div>")

"""Pictures of one query row going through the tiled loop, drawn from a RowTrace.

Nothing here computes attention: every number comes from a
:class:`lessons.core.trace.RowTrace` (what the schedule recorded after each absorbed
tile) and the exact output of the textbook reference. The drawings are plain
matplotlib (``matplotlib.figure.Figure``, no pyplot state), so they work in a
notebook, in a widget (as PNG bytes) and in tests.

A *step* ``t`` means "the first ``t`` tiles of this row have been absorbed";
``t = 0`` is the empty state, ``t = len(row_trace)`` the end of the loop.

The figure has four panels:

* the scores ``s_j`` computed so far, with the running max ``m`` as a staircase;
* the key row as tiles: not loaded yet (grey), in SRAM now (orange), processed
  and discarded (pale blue), and, for masked schedules, skipped (hatched);
* the normalised accumulator ``o / l`` per output dimension against the exact
  output (green ticks);
* the max error ``|o/l - exact|`` after each step (log scale).

Source of the loop being drawn: Dao et al. 2022, Alg. 1; Dao 2023, Alg. 1.
"""
from __future__ import annotations

import io

import numpy as np
import PIL.Image
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from lessons.views.plot import new_figure
from lessons.core.trace import RowTrace
from lessons.core.checks import check_int

__all__ = [
    "TILE_COLOURS", "TILE_LABELS", "EXACT_COLOUR", "OUTPUT_COLOUR",
    "tile_spans", "tile_states", "StepFigure", "step_figure", "final_step_figure",
    "key_row_figure",
]

#: Fill colour of a tile in each state (matplotlib colour strings).
TILE_COLOURS = {
    "pending": "#d0d0d0",   # grey: not loaded yet, never in memory with the others
    "current": "#f28e2b",   # orange: the one tile in SRAM now
    "done": "#a6cee3",      # pale blue: processed and discarded
    "skipped": "#ffffff",   # white, hatched: never loaded (masked out, e.g. causal)
}
#: Legend text of each tile state.
TILE_LABELS = {
    "pending": "not loaded yet",
    "current": "in SRAM now",
    "done": "processed and discarded",
    "skipped": "skipped (fully masked)",
}
EXACT_COLOUR = "#2ca02c"     # green: the exact answer
OUTPUT_COLOUR = "#1f4e79"    # dark blue: the running o / l
_MAX_COLOUR = "#333333"      # the running max staircase
_ERROR_FLOOR = 1e-18         # log-scale floor for an error of exactly 0


# --------------------------------------------------------------------------- tile bookkeeping

def _check_row_trace(row_trace) -> RowTrace:
    if not isinstance(row_trace, RowTrace):
        raise TypeError(f"row_trace must be a lessons.core.trace.RowTrace (trace.row(i)), got {type(row_trace).__name__}")
    return row_trace


def _check_step(row_trace: RowTrace, step) -> int:
    step = check_int(step, "step")
    if not 0 <= step <= len(row_trace):
        raise ValueError(f"step must be in 0..{len(row_trace)} (tiles absorbed by this row), got {step}")
    return int(step)


def _check_exact(row_trace: RowTrace, exact) -> np.ndarray:
    exact = np.asarray(exact, dtype=float)
    if exact.shape != row_trace.o.shape[1:]:
        raise ValueError(f"exact must have shape {row_trace.o.shape[1:]} (dv,) to match the trace, got {exact.shape}")
    return exact


def tile_spans(row_trace) -> list[tuple[int, int, int]]:
    """Every key tile of the row as ``(tile index, key_start, key_stop)``, in key order.

    Tiles the row absorbed come from the trace; the rest of ``[0, Nk)`` is cut into
    ``row_trace.tile_size`` keys per tile (those are tiles a masked schedule skipped).
    Returns a list of int triples covering ``[0, Nk)`` without gaps.
    """
    row_trace = _check_row_trace(row_trace)
    ts, nk = row_trace.tile_size, row_trace.nk
    seen = {int(t): (int(a), int(b)) for t, a, b in zip(row_trace.tile, row_trace.key_start, row_trace.key_stop)}
    spans = []
    for t, start in enumerate(range(0, nk, ts)):
        a, b = seen.get(t, (start, min(start + ts, nk)))
        spans.append((t, a, b))
    return spans


def tile_states(row_trace, step) -> list[str]:
    """The state of every tile (in :func:`tile_spans` order) after ``step`` absorbed tiles.

    ``"done"`` for tiles absorbed before the step's tile, ``"current"`` for the tile
    absorbed at this step (the one in SRAM now), ``"pending"`` for tiles the row will
    absorb later, ``"skipped"`` for tiles it never absorbs. ``step`` is an int in
    ``0..len(row_trace)``; raises ValueError outside that range.
    """
    row_trace = _check_row_trace(row_trace)
    step = _check_step(row_trace, step)
    order = [int(t) for t in row_trace.tile]
    states = {}
    for i, t in enumerate(order):
        states[t] = "done" if i < step - 1 else ("current" if i == step - 1 else "pending")
    return [states.get(t, "skipped") for t, _, _ in tile_spans(row_trace)]


# --------------------------------------------------------------------------- the figure

def _keys(n):
    return f"{n} key" if n == 1 else f"{n} keys"


def _rect(x0, x1, y0, y1):
    return [(x0, y0), (x0, y1), (x1, y1), (x1, y0)]


class StepFigure:
    """One matplotlib Figure showing a row's state after any step; redraws fast.

    Build it once per trace, then call :meth:`show` for each step: it only updates
    colours, data and texts of existing artists. :meth:`png` renders the current
    step to PNG bytes, redrawing only those artists over a cached background
    (matplotlib's blitting), which keeps a step well under 100 ms.

    Parameters
    ----------
    row_trace : RowTrace, from ``trace.row(i)``
    exact : array (dv,), the exact output of that row (textbook attention)
    step : int in 0..len(row_trace), the step drawn first (default: the last)
    titles : bool, draw the step's title and the rescale message above the panels
        (a widget that shows them as text passes False: text is the slowest artist).
    figsize : (width, height) in inches (default 10 x 6.6, or 10 x 5.7 without
        titles); dpi : pixels per inch.

    Attributes: ``figure``; the axes ``ax_scores``, ``ax_keys``, ``ax_out``,
    ``ax_err``; ``tiles`` (a PolyCollection, one polygon per tile in
    :func:`tile_spans` order, facecolours from :data:`TILE_COLOURS`);
    ``out_dots`` (the o / l markers); ``step``.

    Raises TypeError/ValueError for a non-RowTrace, an ``exact`` of the wrong
    shape, or a step out of range.
    """

    def __init__(self, row_trace, exact, step=None, *, titles=True, figsize=None, dpi=80):
        self.dpi = dpi
        self.titles = bool(titles)
        if figsize is None:
            figsize = (10.0, 6.6) if self.titles else (10.0, 5.7)
        self.figure = new_figure(figsize, dpi)
        self.set_trace(row_trace, exact, step)

    # -- building -----------------------------------------------------------------------
    def set_trace(self, row_trace, exact, step=None):
        """Replace the trace (new tile size, data or row): rebuilds the axes. Returns self."""
        self.row_trace = rt = _check_row_trace(row_trace)
        self.exact = _check_exact(rt, exact)
        self.spans = tile_spans(rt)
        self._errors = rt.errors(self.exact) if len(rt) else np.zeros(0)
        self._outputs = rt.output
        self._key_step = np.full(rt.nk, -1, dtype=int)      # which step absorbs key j (-1: never)
        self._key_score = np.full(rt.nk, np.nan)
        for i, (a, b) in enumerate(zip(rt.key_start, rt.key_stop)):
            self._key_step[a:b] = i
            self._key_score[a:b] = np.where(np.isfinite(rt.scores[i]), rt.scores[i], np.nan)
        self._background = None
        self._dynamic = []

        fig = self.figure
        fig.clear()
        height = fig.get_figheight()
        top_inch = 1.1 if self.titles else 0.45          # room above the legend
        outer = fig.add_gridspec(2, 1, height_ratios=[1.0, 1.25], hspace=0.42, left=0.07, right=0.985,
                                 top=1 - top_inch / height, bottom=0.56 / height)
        top = outer[0].subgridspec(2, 1, height_ratios=[1.0, 0.3], hspace=0.06)
        bottom = outer[1].subgridspec(1, 2, width_ratios=[1.75, 1.0], wspace=0.2)
        self.ax_scores = fig.add_subplot(top[0])
        self.ax_keys = fig.add_subplot(top[1], sharex=self.ax_scores)
        self.ax_out = fig.add_subplot(bottom[0])
        self.ax_err = fig.add_subplot(bottom[1])
        self.title = fig.text(0.07, 1 - 0.12 / height, "", ha="left", va="top", fontsize=13,
                              fontweight="bold", visible=self.titles)
        self.subtitle = fig.text(0.07, 1 - 0.43 / height, "", ha="left", va="top", fontsize=10.5,
                                 color="#a34a00", visible=self.titles)
        if self.titles:
            self._dynamic += [self.title, self.subtitle]
        self._build_scores()
        self._build_keys()
        self._build_output()
        self._build_errors()
        self.show(len(rt) if step is None else step)
        return self

    @staticmethod
    def _tidy(ax, hide=("top", "right")):
        ax.tick_params(labelsize=9)
        for side in hide:
            ax.spines[side].set_visible(False)

    def _build_scores(self):
        ax, rt = self.ax_scores, self.row_trace
        nk = rt.nk
        finite = self._key_score[np.isfinite(self._key_score)]
        lo = min(0.0, finite.min()) if finite.size else 0.0
        hi = max(0.0, finite.max()) if finite.size else 1.0
        pad = 0.1 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + 2.0 * pad)
        ax.set_xlim(0, nk)
        w = 0.12 if nk <= 256 else 0.0
        heights = np.nan_to_num(self._key_score, nan=0.0)
        self.unseen = Rectangle((0, 0), 0, 1, transform=ax.get_xaxis_transform(), facecolor="#f0f0f0",
                                lw=0, zorder=0.5)
        ax.add_patch(self.unseen)
        self.unseen_text = ax.text(0, 0.5, "scores not computed yet", transform=ax.get_xaxis_transform(),
                                   ha="center", va="center", color="#8c8c8c", fontsize=10, style="italic",
                                   zorder=0.6)
        self.bars = PolyCollection([_rect(j + w, j + 1 - w, 0.0, h) for j, h in enumerate(heights)],
                                   linewidths=0, zorder=1)
        ax.add_collection(self.bars)
        ax.axhline(0.0, color="#999999", lw=0.6, zorder=0)
        (self.max_line,) = ax.plot([], [], color=_MAX_COLOUR, lw=1.8, zorder=3, label="running max m")
        self.max_text = ax.text(0, 0, "", fontsize=9.5, color=_MAX_COLOUR, va="bottom", ha="left", zorder=4)
        self._dynamic += [self.unseen, self.unseen_text, self.bars, self.max_line, self.max_text]
        ax.set_ylabel("score $s_j$", fontsize=10)
        ax.tick_params(labelbottom=False)
        self._tidy(ax)
        states = ["pending", "current", "done"] + (["skipped"] if (self._key_step < 0).any() else [])
        handles = [Patch(facecolor=TILE_COLOURS[s], edgecolor="#888888", lw=0.6,
                         hatch="////" if s == "skipped" else None, label=TILE_LABELS[s]) for s in states]
        handles.append(self.max_line)
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=len(handles),
                  frameon=False, fontsize=9.5, handlelength=1.6, columnspacing=1.4, borderaxespad=0.2)

    def _build_keys(self):
        ax, rt = self.ax_keys, self.row_trace
        nt = len(self.spans)
        edge = 1.5 if nt <= 64 else (0.5 if nt <= 256 else 0.0)
        self.tiles = PolyCollection([_rect(a, b, 0.0, 1.0) for _, a, b in self.spans],
                                    edgecolors="white", linewidths=edge, zorder=1)
        ax.add_collection(self.tiles)
        self._dynamic.append(self.tiles)
        absorbed = set(int(t) for t in rt.tile)
        skipped = [_rect(a, b, 0.0, 1.0) for t, a, b in self.spans if t not in absorbed]
        if skipped:
            hatch = PolyCollection(skipped, facecolors="none", edgecolors="#9a9a9a", hatch="////",
                                   linewidths=0.0, zorder=2)
            ax.add_collection(hatch)
            self._dynamic.append(hatch)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xlim(0, rt.nk)
        if nt <= 32:   # tile numbers under the strip; tile boundaries as minor ticks
            ax.set_xticks([(a + b) / 2 for _, a, b in self.spans], [str(t + 1) for t, _, _ in self.spans])
            ax.set_xticks([a for _, a, _ in self.spans] + [rt.nk], minor=True)
            ax.tick_params(axis="x", which="major", length=0, pad=3)
            ax.tick_params(axis="x", which="minor", length=4)
            ax.set_xlabel(f"key tiles 1–{nt} ({_keys(rt.tile_size)} each, {rt.nk} keys in all)", fontsize=10, labelpad=2)
        else:
            ax.set_xlabel(f"key position j  (tiles of {_keys(rt.tile_size)})", fontsize=10, labelpad=2)
        self._tidy(ax, ("top", "right", "left"))

    def _build_output(self):
        ax = self.ax_out
        dv = self.exact.shape[0]
        x = np.arange(dv)
        values = np.concatenate([self._outputs.ravel(), self.exact])
        lo, hi = (values.min(), values.max()) if values.size else (-1.0, 1.0)
        pad = 0.08 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + 3.5 * pad)
        ax.set_xlim(-1, dv)
        size = float(np.clip(420.0 / max(dv, 1), 3.0, 11.0))
        self.gaps = LineCollection([], colors="#b8b8b8", linewidths=1.0, zorder=1)
        ax.add_collection(self.gaps)
        (exact_marks,) = ax.plot(x, self.exact, ls="none", marker="_", ms=size * 1.3, mew=2.4,
                                 color=EXACT_COLOUR, zorder=3, label="exact output (textbook attention)")
        (self.out_dots,) = ax.plot(x, np.zeros(dv), ls="none", marker="o", ms=size * 0.55,
                                   color=OUTPUT_COLOUR, zorder=4, label="o / l after this tile")
        self._dynamic += [self.gaps, exact_marks, self.out_dots]
        ax.axhline(0.0, color="#999999", lw=0.6, zorder=0)
        ax.set_xlabel("output dimension", fontsize=10)
        ax.set_title("running output o / l against the exact answer", fontsize=10.5, loc="left")
        ax.legend(loc="upper right", fontsize=9, ncol=2, frameon=False, borderaxespad=0.1)
        self._tidy(ax)

    def _build_errors(self):
        ax, n = self.ax_err, len(self.row_trace)
        err = np.maximum(self._errors, _ERROR_FLOOR)
        ax.set_yscale("log")
        top = max(err.max() if n else 1.0, 1e-10) * 5
        bottom = min(err.min() if n else 1e-17, 1e-16) / 5
        ax.set_ylim(bottom, top)
        ax.set_xlim(0.5, max(n, 1) + 0.5)
        ax.axhspan(bottom, 1e-12, color="#e5f5e0", zorder=0, lw=0)
        ax.text(0.03, 1e-12, "rounding level (float64)", transform=ax.get_yaxis_transform(), fontsize=8.5,
                color="#41883a", va="top", ha="left")
        (self.err_line,) = ax.plot([], [], color="#c44e52", lw=1.6, marker="o" if n <= 40 else None, ms=4,
                                   zorder=2)
        (self.err_now,) = ax.plot([], [], ls="none", marker="o", ms=9, mfc="none", mec="#c44e52",
                                  mew=1.8, zorder=3, clip_on=False)
        self._dynamic += [self.err_line, self.err_now]
        ax.set_xlabel("tiles absorbed", fontsize=10)
        ax.set_title("max |o/l − exact| after each tile", fontsize=10.5, loc="left")
        if n <= 16:
            ax.set_xticks(np.arange(1, n + 1))
        self._tidy(ax)

    # -- stepping -----------------------------------------------------------------------
    def show(self, step):
        """Set every artist to the state after ``step`` absorbed tiles (0..len(row_trace)). Returns self."""
        rt = self.row_trace
        step = _check_step(rt, step)
        self.step = step
        n = len(rt)
        self.tiles.set_facecolors([TILE_COLOURS[s] for s in tile_states(rt, step)])

        # scores computed so far, coloured like their tile; later keys are not computed yet
        ks = self._key_step
        key_state = np.where((ks >= 0) & (ks < step - 1), 0, np.where(ks == step - 1, 1, 2))
        self.bars.set_facecolors(_BAR_PALETTE[key_state])
        later = [(a, b) for a, b in zip(rt.key_start[step:], rt.key_stop[step:])]
        if later:
            a0, b0 = min(a for a, _ in later), max(b for _, b in later)
            self.unseen.set_x(a0)
            self.unseen.set_width(b0 - a0)
            self.unseen_text.set_x((a0 + b0) / 2)
        self.unseen.set_visible(bool(later))
        self.unseen_text.set_visible(bool(later) and (b0 - a0) >= 0.15 * rt.nk if later else False)

        if step:
            a, b = int(rt.key_start[step - 1]), int(rt.key_stop[step - 1])
            m, alpha = rt.m[step - 1], rt.alpha[step - 1]
            self.max_line.set_data(np.stack([rt.key_start[:step], rt.key_stop[:step]], axis=1).ravel(),
                                   np.repeat(rt.m[:step], 2))
            self.max_text.set_text(f" m = {m:.3g} ")
            self.max_text.set_position((b, m))
            self.max_text.set_ha("left" if b < 0.85 * rt.nk else "right")
            self.title.set_text(f"Query row {rt.row}: tile {step} of {n} absorbed (keys {a}–{b - 1})")
            if rt.rescaled[step - 1]:
                self.subtitle.set_text(f"The max moved {rt.m_before[step - 1]:.3g} → {m:.3g}: "
                                       f"l and o so far are rescaled by α = {alpha:.3g}")
            elif step == 1:
                self.subtitle.set_text("First tile: m, l and o start here")
            else:
                self.subtitle.set_text("The max did not move: α = 1, nothing to rescale")
            out = self._outputs[step - 1]
            x = np.arange(out.shape[0])
            self.out_dots.set_data(x, out)
            self.gaps.set_segments(np.stack([np.stack([x, self.exact], 1), np.stack([x, out], 1)], axis=1))
        else:
            self.max_line.set_data([], [])
            self.max_text.set_text("")
            self.title.set_text(f"Query row {rt.row}: before the first tile ({n} to absorb)")
            self.subtitle.set_text("Empty state: m = −∞, l = 0, o = 0")
            self.gaps.set_segments([])
        self.out_dots.set_visible(bool(step))

        err = np.maximum(self._errors[:step], _ERROR_FLOOR)
        self.err_line.set_data(np.arange(1, step + 1), err)
        self.err_now.set_data([step] if step else [], err[-1:])
        return self

    def png(self) -> bytes:
        """The current step as PNG bytes (``figsize * dpi`` pixels).

        The first call draws the whole figure without the changing artists and
        keeps it as a background; later calls restore it and draw only those
        artists (matplotlib blitting), then encode with Pillow.
        """
        canvas = self.figure.canvas
        if self._background is None:
            for a in self._dynamic:
                a.set_animated(True)
            canvas.draw()
            self._background = canvas.copy_from_bbox(self.figure.bbox)
            for a in self._dynamic:
                a.set_animated(False)
        else:
            canvas.restore_region(self._background)
        renderer = canvas.get_renderer()
        for a in sorted(self._dynamic, key=lambda a: a.get_zorder()):
            if a.get_visible():
                a.draw(renderer)
        rgba = np.asarray(canvas.buffer_rgba())
        buf = io.BytesIO()
        PIL.Image.fromarray(rgba[..., :3]).save(buf, format="PNG", compress_level=1)
        return buf.getvalue()


_BAR_PALETTE = np.array([to_rgba("#6fa8cf"), to_rgba(TILE_COLOURS["current"]), (0.0, 0.0, 0.0, 0.0)])


def step_figure(row_trace, exact, step, **kwargs) -> Figure:
    """The Figure of ``row_trace`` after ``step`` absorbed tiles (see :class:`StepFigure`)."""
    return StepFigure(row_trace, exact, step, **kwargs).figure


def final_step_figure(row_trace, exact, **kwargs) -> Figure:
    """The Figure of the last step: every tile processed, o / l on the green exact ticks.

    ``row_trace``: RowTrace (``trace.row(i)``); ``exact``: array (dv,) from the
    textbook reference. A static picture for renderings where widgets are not live;
    ``kwargs`` go to :class:`StepFigure` (``dpi`` defaults to 100 here).
    """
    row_trace = _check_row_trace(row_trace)
    kwargs.setdefault("dpi", 100)
    return StepFigure(row_trace, exact, len(row_trace), **kwargs).figure


def key_row_figure(row_trace, step, *, figsize=(10.0, 1.3), dpi=80) -> Figure:
    """Only the key row as tiles after ``step`` absorbed tiles (a small Figure).

    The tiles are one PolyCollection (``fig.axes[0].collections[0]``) whose
    facecolours follow :func:`tile_states` and :data:`TILE_COLOURS`.
    """
    row_trace = _check_row_trace(row_trace)
    states = tile_states(row_trace, step)
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.03, 0.42, 0.94, 0.34])
    spans = tile_spans(row_trace)
    ax.add_collection(PolyCollection([_rect(a, b, 0, 1) for _, a, b in spans],
                                     facecolors=[TILE_COLOURS[s] for s in states],
                                     edgecolors="white", linewidths=1.5 if len(spans) <= 64 else 0.3))
    ax.set_xlim(0, row_trace.nk)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(handles=[Patch(facecolor=TILE_COLOURS[s], label=TILE_LABELS[s]) for s in ("pending", "current", "done")],
              loc="lower left", bbox_to_anchor=(0, 1.02), ncol=3, frameon=False, fontsize=9)
    ax.set_xlabel("key position j", fontsize=9)
    return fig

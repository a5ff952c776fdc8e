"""Pictures and a widget for the online-softmax lesson.

Nothing here computes a softmax: the figures draw what
:func:`lessons.schedules.softmax.online_softmax` (its trace), :func:`lessons.schedules.softmax.softmax_traffic`
and :func:`lessons.schedules.variants.run_variant` recorded. Plain matplotlib
(``matplotlib.figure.Figure``, no pyplot state) and ipywidgets.
"""
from __future__ import annotations

import html
import io

import ipywidgets as widgets
import numpy as np

from lessons.core.checks import check_int
from lessons.views.plot import new_figure, tidy
from lessons.schedules.variants import VARIANTS, VariantTrace
from lessons.views.flash import EXACT_COLOUR, OUTPUT_COLOUR, TILE_COLOURS
from lessons.schedules.softmax import OnlineSoftmaxTrace, SoftmaxTraffic
from lessons.views.stepper import format_value

__all__ = ["traffic_figure", "online_softmax_figure", "variant_errors_figure", "VariantExplorer",
           "figure_png"]

_ALPHA_COLOUR = "#a34a00"
_FLOOR = 1e-18
_VARIANT_COLOURS = {
    "textbook": "#2ca02c", "no_alpha_on_l": "#d62728", "no_alpha_on_o": "#ff7f0e", "stale_m": "#9467bd",
    "finite_init": "#8c564b", "fa1_per_tile": "#1f77b4", "no_guard": "#e377c2",
}


def figure_png(fig, dpi=None) -> bytes:
    """PNG bytes of a Figure (for widgets.Image and for saving). ``dpi`` defaults to the figure's."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def traffic_figure(traffics):
    """Bar chart of reads and writes per element for each softmax algorithm.

    ``traffics``: a sequence of :class:`lessons.schedules.softmax.SoftmaxTraffic` (e.g. one per
    method from :func:`lessons.schedules.softmax.softmax_traffic`). Returns a Figure.
    Raises TypeError for anything else.
    """
    traffics = list(traffics)
    if not traffics or not all(isinstance(t, SoftmaxTraffic) for t in traffics):
        raise TypeError("traffics must be a non-empty sequence of SoftmaxTraffic")
    fig = new_figure((7.2, 3.0))
    ax = fig.add_axes([0.2, 0.2, 0.55, 0.68])
    y = np.arange(len(traffics))[::-1]
    per = np.array([t.n * t.rows for t in traffics], dtype=float)
    reads = np.array([t.reads for t in traffics]) / per
    writes = np.array([t.writes for t in traffics]) / per
    ax.barh(y, reads, color="#6fa8cf", label="reads of x")
    ax.barh(y, writes, left=reads, color=TILE_COLOURS["current"], label="writes of softmax(x)")
    for yi, t, r, w in zip(y, traffics, reads, writes):
        total = r + w
        ax.text(total + 0.08, yi, f"{t.passes} pass{'es' if t.passes > 1 else ''}, "
                f"{total:g} access{'es' if total != 1 else ''}", va="center", fontsize=9)
    ax.set_yticks(y, [t.method for t in traffics])
    ax.set_xlim(0, max(reads + writes) + 2.2)
    ax.set_xlabel("memory accesses per element of x", fontsize=10)
    ax.set_title(f"softmax over rows of n = {traffics[0].n}: traffic counted while running", fontsize=10.5,
                 loc="left")
    ax.legend(loc="lower right", bbox_to_anchor=(1.4, 0.0), frameon=False, fontsize=9)
    tidy(ax)
    return fig


def online_softmax_figure(x, trace, row=0):
    """Pass 1 of the online softmax, tile by tile: the values, the running max ``m`` and sum ``l``.

    ``x``: the 1-D input (n,) or 2-D (rows, n) that was passed to
    :func:`lessons.schedules.softmax.online_softmax`; ``trace``: its :class:`OnlineSoftmaxTrace`;
    ``row``: which row to draw. Top: the values with the running max as a staircase,
    tiles where the max moved marked with their ``alpha``. Bottom: ``l`` after each tile.
    Returns a Figure. Raises TypeError/ValueError for a trace that does not fit ``x`` (another
    shape, or other values: its running max must end at the max of each row of ``x``) and for a
    ``row`` that is not an int in ``-rows..rows-1``.
    """
    if not isinstance(trace, OnlineSoftmaxTrace):
        raise TypeError(f"trace must be an OnlineSoftmaxTrace, got {type(trace).__name__}")
    x2 = np.atleast_2d(np.asarray(x, dtype=float))
    if not len(trace) or trace.key_stop[-1] != x2.shape[1] or trace.m.shape[1] != x2.shape[0]:
        raise ValueError(f"trace does not fit x of shape {np.shape(x)}")
    rows = x2.shape[0]
    row = check_int(row, "row")
    if not -rows <= row < rows:
        raise ValueError(f"row must be in -{rows}..{rows - 1} (x has {rows} rows), got {row}")
    if not np.array_equal(trace.m[-1], x2.max(axis=1), equal_nan=True):    # the max is exact, in any dtype
        raise ValueError(f"trace does not fit x: its running max ends at {trace.m[-1].tolist()}, x's row maxima "
                         f"are {x2.max(axis=1).tolist()} (a trace of other values?)")
    xs = x2[row]
    n = xs.shape[0]
    fig = new_figure((9.0, 4.6))
    gs = fig.add_gridspec(2, 1, height_ratios=[1.6, 1.0], hspace=0.38, left=0.08, right=0.98, top=0.86, bottom=0.11)
    ax, axl = fig.add_subplot(gs[0]), fig.add_subplot(gs[1], sharex=None)
    for i, (a, b) in enumerate(zip(trace.key_start, trace.key_stop)):
        ax.axvspan(a - 0.5, b - 0.5, color="#f3f3f3" if i % 2 else "#e6e6e6", lw=0, zorder=0)
        ax.text((a + b - 1) / 2, 0.97, f"tile {i + 1}", transform=ax.get_xaxis_transform(), ha="center", va="top",
                fontsize=8.5, color="#666666")
    finite = np.isfinite(xs)
    ax.bar(np.arange(n)[finite], xs[finite], width=0.7, color="#6fa8cf", zorder=1, label="x")
    m = trace.m[:, row]
    edges = np.stack([trace.key_start - 0.5, trace.key_stop - 0.5], axis=1).ravel()
    ax.plot(edges, np.repeat(m, 2), color="#333333", lw=1.8, zorder=2, label="running max m after the tile")
    for i in range(len(trace)):
        if i and trace.l[i - 1, row] > 0 and m[i] > trace.m_before[i, row]:      # the max moved: a rescale
            ax.annotate(f"α = {trace.alpha[i, row]:.3g}", (trace.key_start[i] - 0.5, m[i]),
                        xytext=(3, 4), textcoords="offset points", fontsize=9, color=_ALPHA_COLOUR,
                        fontweight="bold")
    ax.axhline(0, color="#999999", lw=0.6)
    ax.set_xlim(-0.5, n - 0.5)
    lo, hi = min(0.0, xs[finite].min(initial=0.0)), max(xs[finite].max(initial=0.0), np.nanmax(np.where(np.isfinite(m), m, np.nan), initial=0.0))
    ax.set_ylim(lo - 0.1 * (hi - lo or 1.0), hi + 0.45 * (hi - lo or 1.0))
    ax.set_ylabel("x", fontsize=10)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=9, frameon=False)
    tidy(ax)
    centres = (trace.key_start + trace.key_stop - 1) / 2
    axl.plot(centres, trace.l[:, row], marker="o", color=OUTPUT_COLOUR, lw=1.5)
    for c, val in zip(centres, trace.l[:, row]):
        axl.annotate(f"{val:.3g}", (c, val), xytext=(0, 5), textcoords="offset points", ha="center", fontsize=8.5)
    axl.set_xlim(-0.5, n - 0.5)
    axl.set_ylabel("l", fontsize=10)
    axl.set_xlabel("element index j, from 0 (tiles of %d, counted from 1)" % (trace.key_stop[0] - trace.key_start[0]),
                   fontsize=10)
    axl.set_title("running sum l = Σ exp(x_j − m) over the elements seen, against the current m", fontsize=10,
                  loc="left")
    axl.margins(y=0.3)
    tidy(axl)
    fig.suptitle("Pass 1 of the online softmax: one sweep gives both the max and the sum", fontsize=11.5,
                 x=0.08, y=0.995, ha="left")
    return fig


def _check_traces(traces):
    traces = dict(traces)
    if not traces or not all(isinstance(t, VariantTrace) for t in traces.values()):
        raise TypeError("traces must map variant names to VariantTrace (lessons.schedules.variants.run_variants)")
    return traces


def variant_errors_figure(traces, row=None, *, title=None):
    """The error of each variant's running result against the exact one, tile by tile (log scale).

    ``traces``: ``{name: VariantTrace}`` from :func:`lessons.schedules.variants.run_variants`;
    ``row``: one query row (an int in ``-rows..rows-1``), or None for the worst row at each
    tile. Non-finite results (inf, NaN) are drawn at the top of the axis with an ``x``; the
    first divergence of each variant (of that row, when ``row`` is given) is circled. Tiles
    are labelled from 1 (tile 1 is ``error[0]``). Returns a Figure; raises TypeError /
    ValueError for a ``row`` that is not an int in range.
    """
    traces = _check_traces(traces)
    if row is not None:
        rows = min(t.error.shape[1] for t in traces.values())
        row = check_int(row, "row")
        if not -rows <= row < rows:
            raise ValueError(f"row must be in -{rows}..{rows - 1} (the case has {rows} query rows), got {row}")
    fig = new_figure((9.0, 4.2))
    ax = fig.add_axes([0.08, 0.13, 0.6, 0.75])
    top = 1e6
    any_nonfinite = False
    for k, (name, t) in enumerate(traces.items()):
        err = t.error if row is None else t.error[:, [row]]
        err = err.max(axis=1)
        tiles = np.arange(len(err)) + 0.04 * (k - len(traces) / 2)     # a small offset so lines do not hide
        colour = _VARIANT_COLOURS.get(name, "#555555")
        shown = np.where(np.isfinite(err), np.maximum(err, _FLOOR), top)
        ax.plot(tiles, shown, marker="o", ms=4, lw=1.5, color=colour, label=t.title)
        bad = ~np.isfinite(err)
        if bad.any():
            any_nonfinite = True
            ax.plot(tiles[bad], np.full(bad.sum(), top), ls="none", marker="x", ms=9, mew=2, color=colour)
        f = t.first_divergence if row is None else next(iter(np.flatnonzero(t.diverged[:, row])), None)
        if f is not None:
            ax.plot([tiles[f]], [shown[f]], ls="none", marker="o", ms=13, mfc="none", mec=colour, mew=1.8)
    ax.set_yscale("log")
    ax.set_ylim(_FLOOR / 3, top * 30)
    ax.axhspan(_FLOOR / 3, 1e-12, color="#e5f5e0", lw=0, zorder=0)
    ax.text(0.01, 1e-12, "rounding level (float64)", transform=ax.get_yaxis_transform(), fontsize=8.5,
            color="#41883a", va="top")
    if any_nonfinite:
        ax.text(0.99, top * 1.6, "× = inf or NaN", transform=ax.get_yaxis_transform(), fontsize=8.5,
                color="#444444", va="bottom", ha="right")
    n = max(len(t) for t in traces.values())
    ax.set_xticks(range(n), [str(i + 1) for i in range(n)])            # tiles counted from 1, as on the stepper
    ax.set_xlabel("tile", fontsize=10)
    ax.set_ylabel("max |running result − exact|", fontsize=10)
    ax.set_title(title or ("every row (worst at each tile)" if row is None else f"query row {row}"),
                 fontsize=10.5, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=9,
              title="variant (circle: first divergence)", title_fontsize=9)
    tidy(ax)
    return fig


class VariantExplorer:
    """Toggle between broken variants of the update and step through their traces (ipywidgets).

    A view only: every number comes from the :class:`lessons.schedules.variants.VariantTrace`
    objects it is given.

    Parameters
    ----------
    traces : ``{case_name: {variant_name: VariantTrace}}`` (e.g. one
        :func:`lessons.schedules.variants.run_variants` per :func:`lessons.schedules.variants.example_case`).
    case, variant : the initial choices (default: the first of each).

    Attributes: ``case`` and ``variant`` (ToggleButtons), ``row`` and ``slider``
    (IntSliders: query row, tiles absorbed), ``verdict`` and ``table`` (HTML),
    ``image`` (widgets.Image, PNG of the running output against the exact one),
    ``widget`` (the whole box).
    """

    def __init__(self, traces, *, case=None, variant=None):
        self.traces = {c: _check_traces(t) for c, t in dict(traces).items()}
        if not self.traces:
            raise ValueError("traces must hold at least one case")
        cases = list(self.traces)
        variants = list(next(iter(self.traces.values())))
        case = cases[0] if case is None else case
        variant = variants[0] if variant is None else variant
        if case not in cases:
            raise ValueError(f"case must be one of {cases}, got {case!r}")
        if variant not in variants:
            raise ValueError(f"variant must be one of {variants}, got {variant!r}")
        style = {"description_width": "initial"}
        self.case = widgets.ToggleButtons(options=cases, value=case, description="case", style=style)
        self.variant = widgets.ToggleButtons(
            options=[(VARIANTS[v].title if v in VARIANTS else v, v) for v in variants], value=variant,
            description="variant", style={"button_width": "190px", **style})
        self.row = widgets.IntSlider(value=0, min=0, max=0, description="query row", style=style,
                                     continuous_update=False)
        self.slider = widgets.IntSlider(value=1, min=1, max=1, description="tiles so far", style=style)
        self.verdict = widgets.HTML()
        self.table = widgets.HTML()
        self.image = widgets.Image(format="png")
        self._busy = False
        self._reload()
        for w in (self.case, self.variant, self.row):
            w.observe(self._on_change, names="value")
        self.slider.observe(self._on_change, names="value")
        self.widget = widgets.VBox([self.case, self.variant, widgets.HBox([self.row, self.slider]), self.verdict,
                                    widgets.HBox([self.image, self.table], layout={"flex_flow": "row wrap"})])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def current(self) -> VariantTrace:
        """The trace on show."""
        return self.traces[self.case.value][self.variant.value]

    def _reload(self):
        t = self.current
        self._busy = True
        try:
            self.row.max = t.m.shape[1] - 1
            self.slider.max = len(t)
            self.slider.value = min(self.slider.value, len(t))
        finally:
            self._busy = False
        self._render()

    def _on_change(self, change):
        if self._busy:
            return
        if change["owner"] is self.slider or change["owner"] is self.row:
            self._render()
        else:
            self._reload()

    def _render(self):
        t, r, step = self.current, self.row.value, self.slider.value
        change = VARIANTS[t.variant].change if t.variant in VARIANTS else ""
        colour = "#2b7a2b" if t.harmless else "#b00020"
        self.verdict.value = (f"<div style='max-width:900px'><b>{html.escape(t.title)}</b>: "
                              f"<code>{html.escape(change)}</code><br>"
                              f"<span style='color:{colour}'>{html.escape(t.verdict)}</span></div>")
        self.table.value = self._table(t, r, step)
        self.image.value = figure_png(self._figure(t, r, step))

    @staticmethod
    def _table(t, r, step):
        head = "".join(f"<th style='padding:1px 6px'>{h}</th>" for h in ("tile", "keys", "m", "α", "l",
                                                                          "error", ""))
        rows = []
        for i in range(step):
            err = t.error[i, r]
            bad = t.diverged[i, r]
            mark = "<span style='color:#b00020'>left the exact result</span>" if bad else "exact"
            cells = [str(i + 1), f"{t.key_start[i]}–{t.key_stop[i] - 1}", format_value(float(t.m[i, r])),
                     format_value(float(t.alpha[i, r])), format_value(float(t.l[i, r])),
                     format_value(float(err)), mark]
            bg = f"background:{TILE_COLOURS['current']}40;" if i == step - 1 else ""
            rows.append(f"<tr style='{bg}'>" + "".join(f"<td style='padding:1px 6px;text-align:right'>{c}</td>"
                                                          for c in cells) + "</tr>")
        return ("<table style='border-collapse:collapse;font-size:12px;font-family:monospace'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")

    @staticmethod
    def _figure(t, r, step):
        fig = new_figure((5.6, 3.2), dpi=90)
        ax = fig.add_axes([0.14, 0.16, 0.8, 0.7])
        dims = t.output.shape[2]
        tiles = np.arange(len(t))
        for j in range(dims):
            ax.plot(tiles, t.exact[:, r, j], color=EXACT_COLOUR, lw=2.5, alpha=0.45,
                    label="exact (keys seen so far)" if j == 0 else None)
            y = t.output[:step, r, j]
            finite = np.isfinite(y)
            ax.plot(tiles[:step][finite], y[finite], color=OUTPUT_COLOUR, marker="o", ms=4, lw=1.3,
                    label="this variant" if j == 0 else None)
            if (~finite).any():
                ax.plot(tiles[:step][~finite], np.full((~finite).sum(), 0.94), ls="none", marker="x", ms=9, mew=2,
                        color="#b00020", label="inf / NaN (drawn at the top)" if j == 0 else None,
                        transform=ax.get_xaxis_transform())
        ax.axvline(step - 1, color=TILE_COLOURS["current"], lw=1.2, zorder=0)
        ax.set_xticks(tiles, [str(i + 1) for i in tiles])                 # tiles counted from 1
        ax.set_xlabel("tile", fontsize=9)
        ax.set_title(f"row {r}: running output, every output dimension", fontsize=9.5, loc="left")
        ax.legend(fontsize=8, frameon=False, loc="best")
        tidy(ax)
        return fig


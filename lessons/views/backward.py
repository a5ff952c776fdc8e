"""Pictures and a stepper for the FlashAttention-2 backward pass (Dao 2023, Alg. 2).

:func:`backward_figure` draws one step of the loop: the (Nq, Nk) score grid cut
into ``block_q x block_k`` tiles with the current key block (``K_j, V_j`` and the
accumulating ``dK_j, dV_j`` held on chip) and the query block streaming past it
(``Q_i, dO_i, L_i, D_i`` read; ``dQ_i`` read, updated, written back), beside the
error of each running gradient against the textbook one. :class:`BackwardStepper`
replays a :class:`lessons.schedules.backward.BackwardTrace` over that picture.
:func:`backward_cost_figure` draws the measured peak memory and the counted HBM
traffic and FLOPs. All of them only display what the trace and the cost
functions recorded; no gradient is computed here.
"""
from __future__ import annotations

import ipywidgets as widgets
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import NullLocator

from lessons.schedules.backward import BackwardTrace
from lessons.views.flash import TILE_COLOURS
from lessons.views.plot import new_figure, tidy
from lessons.views.softmax import figure_png
from lessons.views.stepper import format_value

__all__ = ["GRADIENT_COLOURS", "backward_figure", "backward_step_text", "BackwardStepper", "backward_cost_figure"]

#: Line colour of each gradient in the error panel.
GRADIENT_COLOURS = {"dq": "#1f77b4", "dk": "#d62728", "dv": "#2ca02c"}
_FLOOR = 1e-17           # errors of exactly 0 are drawn here on the log axis


def _check_trace(trace):
    if not isinstance(trace, BackwardTrace):
        raise TypeError(f"trace must be a lessons.schedules.backward.BackwardTrace, got {type(trace).__name__}")
    if not trace.steps:
        raise ValueError("trace has no steps to show")
    return trace


def _check_step(trace, step):
    n = len(trace.steps)
    if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)) or not 1 <= step <= n:
        raise ValueError(f"step must be an int in 1..{n}, got {step!r}")
    return int(step)


def _tiles(trace, causal):
    """Every (key block, query block) tile in visit order with its state index among computed steps."""
    index = {(s.key_block, s.query_block): n for n, s in enumerate(trace.steps)}
    tiles = []
    for j, c0 in enumerate(range(0, trace.nk, trace.block_k)):
        for i, r0 in enumerate(range(0, trace.nq, trace.block_q)):
            c1, r1 = min(c0 + trace.block_k, trace.nk), min(r0 + trace.block_q, trace.nq)
            tiles.append((j, i, r0, r1, c0, c1, index.get((j, i))))
    return tiles


def _state(n, step):
    if n is None:
        return "skipped"
    return "done" if n < step - 1 else ("current" if n == step - 1 else "pending")


def backward_figure(trace, step, exact, *, causal=False, figsize=(10.5, 4.6), dpi=90):
    """One step of the FA-2 backward loop: the tile grid and the running gradients' errors.

    Parameters
    ----------
    trace : :class:`lessons.schedules.backward.BackwardTrace` (``return_trace=True``).
    step : int in ``1..len(trace)`` (1-based, as on the stepper's slider).
    exact : ``(dq, dk, dv)`` from :func:`lessons.attention_backward` on the same input.
    causal : bool, whether the trace was made with ``causal=True`` (skipped tiles drawn hatched).

    Returns a Figure with two panels. Left: keys along x, query rows down y; tiles
    in :data:`lessons.views.flash.TILE_COLOURS` (current, done, pending, skipped),
    the current key block's column outlined (on chip for the whole inner loop) and
    the current query block's row marked (streaming past). Right: max |running - exact|
    of dQ, dK, dV after every step (log scale; exact zeros drawn at 1e-17), the
    current step marked, key-block boundaries dashed.
    Raises TypeError for a trace that is not a BackwardTrace, ValueError for a bad step or exact.
    """
    trace = _check_trace(trace)
    step = _check_step(trace, step)
    errors = trace.errors(exact)
    s = trace.steps[step - 1]
    nq, nk = trace.nq, trace.nk
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.06, 0.2, 0.40, 0.62])
    polys, colours, hatched = [], [], []
    for j, i, r0, r1, c0, c1, n in _tiles(trace, causal):
        state = _state(n, step)
        poly = [(c0, r0), (c0, r1), (c1, r1), (c1, r0)]
        polys.append(poly)
        colours.append(TILE_COLOURS[state])
        if state == "skipped":
            hatched.append(poly)
        elif len(trace.steps) <= 64:
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, str(n + 1), ha="center", va="center", fontsize=8.5,
                    color="#333333", zorder=6)
    ax.add_collection(PolyCollection(polys, facecolors=colours, edgecolors="white", linewidths=2.0, zorder=1))
    if hatched:
        ax.add_collection(PolyCollection(hatched, facecolors="none", edgecolors="#9a9a9a", hatch="////",
                                         linewidths=0.0, zorder=2))
    # the key block on chip: a column, outlined across every query block
    ax.add_patch(Rectangle((s.key_start, 0), s.key_stop - s.key_start, nq, fill=False, edgecolor="#7a3b00",
                           lw=2.4, zorder=5))
    ax.add_patch(Rectangle((s.key_start, -0.06 * nq), s.key_stop - s.key_start, 0.04 * nq, color="#7a3b00",
                           clip_on=False, zorder=5))
    ax.text((s.key_start + s.key_stop) / 2, -0.08 * nq, "K_j, V_j, dK_j, dV_j on chip", ha="center", va="bottom",
            fontsize=8.5, color="#7a3b00", clip_on=False)
    # the query block streaming past: a bar on the right
    ax.add_patch(Rectangle((nk * 1.015, s.row_start), 0.03 * nk, s.row_stop - s.row_start,
                           color=TILE_COLOURS["current"], clip_on=False, zorder=4))
    ax.text(nk * 1.06, (s.row_start + s.row_stop) / 2, "Q_i, dO_i, L_i, D_i in;\ndQ_i += dS K_j out",
            fontsize=8, va="center", ha="left", color="#7a3b00", clip_on=False)
    ax.set_xlim(0, nk)
    ax.set_ylim(nq, 0)
    ax.set_aspect("equal" if 0.25 < nq / nk < 4 else "auto")
    ax.set_xlabel(f"key j  ({nk} keys, blocks of {trace.block_k})", fontsize=9.5)
    ax.set_ylabel(f"query row i  (blocks of {trace.block_q})", fontsize=9.5)
    ax.tick_params(labelsize=8.5)
    handles = [Patch(facecolor=TILE_COLOURS[k], edgecolor="#888888", lw=0.6, hatch="////" if k == "skipped" else None,
                     label=label) for k, label in (("current", "tile recomputed now"), ("done", "done, discarded"),
                                                   ("pending", "not reached yet"), ("skipped", "skipped (causal)"))
               if k != "skipped" or causal]
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.02, 0.005), ncol=4, frameon=False, fontsize=8.5)
    kind = "on the diagonal: masked inside" if s.kind == "diagonal" else "full"
    fig.text(0.02, 0.975, f"step {step} of {len(trace)}: key block {s.key_block + 1} (outer loop), "
                          f"query block {s.query_block + 1} (inner loop), {kind}",
             fontsize=10.5, ha="left", va="top", color="#7a3b00", fontweight="bold")

    ex = fig.add_axes([0.63, 0.2, 0.35, 0.62])
    steps = np.arange(1, len(trace) + 1)
    for col, name in enumerate(("dq", "dk", "dv")):
        ex.semilogy(steps, np.maximum(errors[:, col], _FLOOR), marker="o", ms=3.5, lw=1.4,
                    color=GRADIENT_COLOURS[name], label={"dq": "dQ", "dk": "dK", "dv": "dV"}[name])
    for n in range(1, len(trace)):
        if trace.steps[n].key_block != trace.steps[n - 1].key_block:
            ex.axvline(n + 0.5, color="#bbbbbb", lw=0.8, ls="--", zorder=0)
    ex.axvline(step, color=TILE_COLOURS["current"], lw=2.0, zorder=0)
    ex.set_xlabel("step (dashed: a new key block)", fontsize=9.5)
    ex.set_ylabel("max |running − textbook|", fontsize=9.5)
    ex.set_title("running gradients vs the textbook backward", fontsize=10)
    ex.legend(fontsize=8.5, frameon=False, loc="lower left")
    ex.set_xlim(0.5, len(trace) + 0.5)
    tidy(ex)
    return fig


def backward_step_text(trace, step, exact) -> str:
    """The stepper's table as plain text: the running blocks' errors after ``step`` (1-based).

    Lines: a heading naming the key block and query block, then one line per key of the
    key block (``|dK_j - dK|``, ``|dV_j - dV|`` max over the row) and one per row of the
    query block (``|dQ_i - dQ|``), from :meth:`BackwardTrace.block_errors`.
    Raises TypeError/ValueError as :func:`backward_figure`.
    """
    trace = _check_trace(trace)
    step = _check_step(trace, step)
    s = trace.steps[step - 1]
    e = trace.block_errors(step - 1, exact)
    lines = [f"key block {s.key_block + 1} (keys {s.key_start}-{s.key_stop - 1}) x query block "
             f"{s.query_block + 1} (rows {s.row_start}-{s.row_stop - 1})",
             f"{'key':>4} {'|dK_j - dK|':>12} {'|dV_j - dV|':>12}"]
    for c in range(s.key_stop - s.key_start):
        lines.append(f"{s.key_start + c:>4} {format_value(float(e['dk'][c])):>12} {format_value(float(e['dv'][c])):>12}")
    lines.append(f"{'row':>4} {'|dQ_i - dQ|':>12}")
    for r in range(s.row_stop - s.row_start):
        lines.append(f"{s.row_start + r:>4} {format_value(float(e['dq'][r])):>12}")
    return "\n".join(lines)


class BackwardStepper:
    """Step through the FA-2 backward loop (ipywidgets): outer key blocks, inner query blocks.

    A view over ``trace`` (:func:`lessons.flash_attention_backward` with ``return_trace=True``)
    and ``exact`` (:func:`lessons.attention_backward` on the same input and options).

    Parameters: trace, exact, ``causal`` (as the trace was made), ``step`` (first step shown), ``interval`` (ms per
    step when Play runs).

    Attributes: ``slider`` (IntSlider over steps ``1..len(trace)``), ``play`` (Play), ``image`` (widgets.Image,
    PNG of :func:`backward_figure`), ``table`` (HTML: per key of the key block and per row of the query block,
    the running block's error), ``readouts`` (dict of widgets.HTML: ``step``, ``key_block``, ``query_block``,
    ``dq_error``, ``dk_error``, ``dv_error``, ``on_chip``), ``widget`` (the whole box).

    Raises TypeError for a trace that is not a BackwardTrace, ValueError for an ``exact`` of other shapes.
    """

    def __init__(self, trace, exact, *, causal=False, step=1, interval=900):
        self.trace = _check_trace(trace)
        self.errors = self.trace.errors(exact)
        self.exact = exact
        self.causal = bool(causal)
        n = len(self.trace)
        style = {"description_width": "initial"}
        self.slider = widgets.IntSlider(value=min(max(int(step), 1), n), min=1, max=n, description="steps",
                                        style=style, layout={"width": "480px"})
        self.play = widgets.Play(value=self.slider.value, min=1, max=n, interval=interval)
        widgets.jslink((self.play, "value"), (self.slider, "value"))
        self.image = widgets.Image(format="png")
        self.table = widgets.HTML(layout={"width": "330px"})
        self.readouts = {k: widgets.HTML(layout={"border": "1px solid #dddddd", "padding": "2px 10px", "margin": "2px"})
                         for k in ("step", "key_block", "query_block", "dq_error", "dk_error", "dv_error", "on_chip")}
        self._render()
        self.slider.observe(lambda change: self._render(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.play, self.slider]),
                                    widgets.HBox(list(self.readouts.values()), layout={"flex_flow": "row wrap"}),
                                    widgets.HBox([self.image, self.table],
                                                 layout={"flex_flow": "row wrap", "align_items": "flex-start"})])

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _render(self):
        step = self.slider.value
        t = self.trace
        s = t.steps[step - 1]
        err = self.errors[step - 1]
        r = self.readouts
        r["step"].value = f"step <b>{format_value(step)}</b> of {format_value(len(t))}"
        r["key_block"].value = f"key block <b>{format_value(s.key_block + 1)}</b> (keys {s.key_start}–{s.key_stop - 1})"
        r["query_block"].value = (f"query block <b>{format_value(s.query_block + 1)}</b> "
                                  f"(rows {s.row_start}–{s.row_stop - 1})")
        for col, name in enumerate(("dq", "dk", "dv")):
            r[f"{name}_error"].value = f"max |{name} − textbook|: <b>{format_value(float(err[col]))}</b>"
        rows, keys = s.row_stop - s.row_start, s.key_stop - s.key_start
        r["on_chip"].value = (f"P, dP, dS on chip: <b>{format_value(rows)} × {format_value(keys)}</b> "
                              f"(textbook: {format_value(t.nq)} × {format_value(t.nk)})")
        self.table.value = "<pre style='font-size:11.5px;margin:0'>" + backward_step_text(t, step, self.exact) + "</pre>"
        self.image.value = figure_png(backward_figure(t, step, self.exact, causal=self.causal))


def backward_cost_figure(peak, textbook_io, flash_io, *, figsize=(10.5, 4.0), dpi=90):
    """Measured peak memory against N, and counted HBM bytes and FLOPs, textbook vs flash backward.

    ``peak``: :class:`lessons.cost.traffic.PeakMemory` from
    :func:`lessons.cost.backward.measure_backward_peak_memory`; ``textbook_io``, ``flash_io``:
    :class:`lessons.cost.backward.BackwardIOCount` for one N (from ``textbook_backward_io`` and
    ``flash_backward_io``). Returns a Figure: left, peak bytes (log-log) with the fitted slopes
    in the legend; right, GiB moved and GFLOPs side by side. Raises TypeError for other inputs.
    """
    from lessons.cost.backward import BackwardIOCount
    from lessons.cost.traffic import PeakMemory
    if not isinstance(peak, PeakMemory):
        raise TypeError(f"peak must be a PeakMemory, got {type(peak).__name__}")
    for name, x in (("textbook_io", textbook_io), ("flash_io", flash_io)):
        if not isinstance(x, BackwardIOCount):
            raise TypeError(f"{name} must be a BackwardIOCount, got {type(x).__name__}")
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.08, 0.16, 0.38, 0.72])
    mib = 2 ** 20
    ax.loglog(peak.ns, np.array(peak.textbook_bytes) / mib, "o-", color="#d62728",
              label=f"textbook backward (slope {peak.textbook_slope:.2f})")
    ax.loglog(peak.ns, np.array(peak.flash_bytes) / mib, "o-", color="#1f77b4",
              label=f"flash backward (slope {peak.flash_slope:.2f})")
    ax.loglog(peak.ns, np.array(peak.score_bytes) / mib, ":", color="#888888", label="one N × N matrix")
    ax.set_xlabel("N (tokens)", fontsize=9.5)
    ax.set_ylabel(f"peak memory (MiB, {peak.dtype}, d = {peak.d})", fontsize=9.5)
    ax.set_title("measured peak memory (tracemalloc, this machine)", fontsize=10)
    ax.set_xticks(peak.ns, [str(n) for n in peak.ns])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=8.5, frameon=False)
    tidy(ax)
    bx = fig.add_axes([0.58, 0.16, 0.38, 0.72])
    labels = ["HBM GiB moved", "GFLOPs (matmuls)"]
    text = [textbook_io.hbm_bytes / 2 ** 30, textbook_io.flops / 1e9]
    flash = [flash_io.hbm_bytes / 2 ** 30, flash_io.flops / 1e9]
    x = np.arange(2)
    b1 = bx.bar(x - 0.2, text, 0.38, color="#d62728", label="textbook backward")
    b2 = bx.bar(x + 0.2, flash, 0.38, color="#1f77b4", label="flash backward (recomputes S)")
    for bars in (b1, b2):
        for b in bars:
            bx.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.3g}", ha="center",
                    va="bottom", fontsize=8.5)
    bx.set_xticks(x, labels)
    bx.set_yscale("log")
    bx.set_title(f"counted: N = {flash_io.n}, d = {flash_io.d}, {flash_io.element_size}-byte elements",
                 fontsize=10)
    bx.set_ylim(top=max(text + flash) * 20)
    bx.legend(fontsize=8.5, frameon=False, loc="upper left")
    tidy(bx)
    return fig

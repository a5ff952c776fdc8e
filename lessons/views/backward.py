"""Pictures and a stepper for the FlashAttention-2 backward pass (Dao 2023, Alg. 2).

:func:`backward_figure` draws one step of the loop: the (Nq, Nk) score grid cut
into ``block_q x block_k`` tiles with the current key block (``K_j, V_j`` and the
accumulating ``dK_j, dV_j`` held on chip) and the query block streaming past it
(``Q_i, dO_i, L_i, D_i`` read; ``dQ_i`` read, updated, written back), beside the
error of each running gradient against the textbook one. :class:`BackwardStepper`
replays a :class:`lessons.schedules.backward.BackwardTrace` over that picture: NumPy's,
or the CUDA kernels' own (:func:`lessons.gpu.backward.kernel_backward_trace`, the same
object), with a toggle between the two. :func:`backward_kernel_figure` sets the kernels'
trace beside NumPy's, step by step.
:func:`backward_cost_figure` draws the measured peak memory and the counted HBM
traffic and FLOPs; :func:`recorded_backward_figure` the backward kernels' times and extra device
memory on a real GPU (:mod:`lessons.gpu.recorded`: the recorded H200 run, or a live one). All of them only display what the trace and the cost
functions recorded; no gradient is computed here.
"""
from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import NullLocator

from lessons.core.checks import check_flag
from lessons.schedules.backward import BackwardTrace
from lessons.views.flash import TILE_COLOURS
from lessons.views.plot import new_figure, tidy
from lessons.views.softmax import figure_png
from lessons.views.stepper import StepperShell, format_value

__all__ = ["GRADIENT_COLOURS", "backward_figure", "backward_step_text", "BackwardStepper", "backward_cost_figure",
           "backward_kernel_figure", "NUMPY_SOURCE"]
__all__ += ["IMPL_COLOURS", "IMPL_MARKERS", "recorded_backward_figure"]

#: Line colour of each gradient in the error panel.
GRADIENT_COLOURS = {"dq": "#1f77b4", "dk": "#d62728", "dv": "#2ca02c"}
_FLOOR = 1e-17           # errors of exactly 0 are drawn here on the log axis
#: the label of NumPy's trace on the stepper's source toggle
NUMPY_SOURCE = "NumPy (lessons.flash_attention_backward)"


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


def backward_figure(trace, step, exact, *, causal=False, source=None, figsize=(10.5, 4.6), dpi=90):
    """One step of the FA-2 backward loop: the tile grid and the running gradients' errors.

    Parameters
    ----------
    trace : :class:`lessons.schedules.backward.BackwardTrace` (``return_trace=True``).
    step : int in ``1..len(trace)`` (1-based, as on the stepper's slider).
    exact : ``(dq, dk, dv)`` from :func:`lessons.attention_backward` on the same input.
    causal : bool, whether the trace was made with ``causal=True`` (skipped tiles drawn hatched).
    source : optional str, who computed the trace (e.g. ``"kernel, emulated on the CPU"``), named
        above the error panel; None: not named (NumPy's).

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
    causal = check_flag(causal, "causal")
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
    ex.set_title("running gradients vs the textbook backward" + (f"\n(trace: {source})" if source else ""),
                 fontsize=10)
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


class BackwardStepper(StepperShell):
    """Step through the FA-2 backward loop (ipywidgets): outer key blocks, inner query blocks.

    A view over ``trace`` (:func:`lessons.flash_attention_backward` with ``return_trace=True``)
    and ``exact`` (:func:`lessons.attention_backward` on the same input and options), and, with
    ``kernel``, over the CUDA kernels' own trace of the same run.

    Parameters: trace, exact, ``causal`` (as the trace was made), ``step`` (first step shown), ``interval`` (ms per
    step when Play runs), ``kernel``: optional ``(where, kernel_trace)`` as
    :func:`lessons.gpu.backward.kernel_backward_trace` returns it (``where``: ``"GPU (<name>)"`` or
    ``"emulated on the CPU"``), for the same inputs, options and block sizes as ``trace``.

    With ``kernel``, a toggle (``source``) chooses which trace drives the picture, the readouts and the
    table (the kernel's first); the same view code draws both. The ``source`` readout names it, and the
    ``kernel`` readout gives max |kernel − NumPy| of the running dQ_i, dK_j, dV_j at the current step and
    the first place the two traces part (:func:`lessons.gpu.backward.first_backward_divergence`,
    ``divergence``; None when they agree everywhere).

    Attributes: ``slider`` (IntSlider over steps ``1..len(trace)``), ``play`` (Play), ``image`` (widgets.Image,
    PNG of :func:`backward_figure`), ``table`` (HTML: per key of the key block and per row of the query block,
    the running block's error), ``readouts`` (dict of widgets.HTML: ``step``, ``key_block``, ``query_block``,
    ``dq_error``, ``dk_error``, ``dv_error``, ``on_chip``, and with ``kernel`` also ``source`` and ``kernel``),
    ``source`` (ToggleButtons ``"kernel"``/``"numpy"``, or None), ``trace`` and ``errors`` (of the trace shown),
    ``divergence``, ``differences`` ((steps, 3) max |kernel − NumPy| of dq, dk, dv, or None without ``kernel``
    or when the two visited different tiles), ``widget`` (the whole box).

    Raises TypeError for a trace that is not a BackwardTrace or a ``kernel`` that is not a (str, BackwardTrace)
    pair, ValueError for an ``exact`` of other shapes or a kernel trace of another problem.
    """

    def __init__(self, trace, exact, *, causal=False, step=1, interval=900, kernel=None):
        self.numpy_trace = _check_trace(trace)
        self.exact = exact
        self.causal = bool(causal)
        self._traces = {"numpy": self.numpy_trace}
        self._errors = {"numpy": self.numpy_trace.errors(exact)}
        self.where = None
        self.divergence = self.differences = None
        if kernel is not None:
            self._set_kernel(kernel, exact)
        self.source = None
        names = ["step", "key_block", "query_block", "dq_error", "dk_error", "dv_error", "on_chip"]
        if kernel is not None:              # the kernel's trace is shown first
            self.source = widgets.ToggleButtons(options=[(f"kernel ({self.where})", "kernel"), ("NumPy", "numpy")],
                                                value="kernel", description="trace from",
                                                style={"description_width": "initial"})
            names += ["source", "kernel"]
        key = "numpy" if kernel is None else "kernel"
        self.trace, self.errors = self._traces[key], self._errors[key]
        self._build_shell(len(self.trace), step=min(int(step), len(self.numpy_trace)), label="steps", readouts=names,
                          table_width="330px", interval=interval, controls=[self.source] if kernel is not None else [])
        if kernel is not None:
            self.source.observe(lambda change: self._switch(), names="value")

    def _set_kernel(self, kernel, exact):
        from lessons.gpu.backward import backward_trace_differences, first_backward_divergence
        if not (isinstance(kernel, tuple) and len(kernel) == 2 and isinstance(kernel[0], str)):
            raise TypeError(f"kernel must be a (where, kernel_trace) pair as lessons.gpu.backward.kernel_backward_trace "
                            f"returns it, got {type(kernel).__name__}")
        self.where, kernel_trace = kernel[0], _check_trace(kernel[1])
        self.divergence = first_backward_divergence(kernel_trace, self.numpy_trace)   # also checks the sizes
        try:
            self.differences = backward_trace_differences(kernel_trace, self.numpy_trace)
        except ValueError:                  # the kernel visited other tiles: the divergence says where
            self.differences = None
        self._traces["kernel"] = kernel_trace
        self._errors["kernel"] = kernel_trace.errors(exact)

    def _switch(self):
        key = self.source.value
        self.trace, self.errors = self._traces[key], self._errors[key]
        n = len(self.trace)
        self.slider.max = self.play.max = n
        if self.slider.value > n:
            self.slider.value = n               # observed: renders
        else:
            self._render()

    def _source_label(self):
        if self.source is None or self.source.value == "numpy":
            return None if self.source is None else NUMPY_SOURCE
        return f"the CUDA kernels, {self.where}"

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
        if "source" in r:
            r["source"].value = f"trace from: <b>{html.escape(self._source_label())}</b>"
            if self.differences is not None and step <= len(self.differences):
                dq, dk, dv = (format_value(float(x)) for x in self.differences[step - 1])
                at = f"kernel − NumPy at this step, max |Δ|: dQ_i {dq}, dK_j {dk}, dV_j {dv}"
            else:
                at = "kernel − NumPy: the two traces visited different tiles"
            found = "none (they agree within rounding)" if self.divergence is None else html.escape(str(self.divergence))
            r["kernel"].value = f"{at}; first divergence: <b>{found}</b>"
        self.table.value = "<pre style='font-size:11.5px;margin:0'>" + backward_step_text(t, step, self.exact) + "</pre>"
        self.image.value = figure_png(backward_figure(t, step, self.exact, causal=self.causal,
                                                      source=self._source_label()))


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


def backward_kernel_figure(kernel_trace, numpy_trace, exact, *, where, baseline=None, figsize=(10.5, 4.2), dpi=90):
    """The CUDA kernels' backward trace beside NumPy's, step by step (a static figure).

    Parameters
    ----------
    kernel_trace : :class:`lessons.schedules.backward.BackwardTrace` from
        :func:`lessons.gpu.backward.kernel_backward_trace`.
    numpy_trace : the trace of :func:`lessons.flash_attention_backward` on the same inputs and blocks.
    exact : ``(dq, dk, dv)`` from :func:`lessons.attention_backward` on the same inputs.
    where : str, where the kernels ran (``"GPU (<name>)"`` or ``"emulated on the CPU"``), named in the titles.
    baseline : optional BackwardTrace of the same schedule computed by NumPy in float32 (the kernels'
        precision): what float32 rounding alone does, drawn dotted beside the kernels' differences.

    Returns a Figure. Left: max |running − textbook| of dQ, dK, dV after each step, NumPy's as lines and
    the kernels' as open markers: the same path. Right: max |kernel − NumPy| of the blocks each step
    updated (:func:`lessons.gpu.backward.backward_trace_differences`), log scale, with the baseline's
    max |float32 NumPy − NumPy| dotted; the first divergence
    (:func:`lessons.gpu.backward.first_backward_divergence`, default tolerance) marked in red when there
    is one. Raises TypeError/ValueError as those functions and :meth:`BackwardTrace.errors` (also when
    the traces visited different tiles).
    """
    from lessons.gpu.backward import backward_trace_differences, first_backward_divergence
    kernel_trace, numpy_trace = _check_trace(kernel_trace), _check_trace(numpy_trace)
    if not isinstance(where, str):
        raise TypeError(f"where must be a str naming where the kernels ran, got {type(where).__name__}")
    diff = backward_trace_differences(kernel_trace, numpy_trace)
    base = None if baseline is None else backward_trace_differences(_check_trace(baseline), numpy_trace)
    found = first_backward_divergence(kernel_trace, numpy_trace)
    errors = {"NumPy": numpy_trace.errors(exact), "kernel": kernel_trace.errors(exact)}
    steps = np.arange(1, len(numpy_trace) + 1)
    labels = {"dq": "dQ", "dk": "dK", "dv": "dV"}
    fig = new_figure(figsize, dpi)
    ax = fig.add_axes([0.07, 0.2, 0.39, 0.64])
    bx = fig.add_axes([0.59, 0.2, 0.39, 0.64])
    for col, name in enumerate(("dq", "dk", "dv")):
        colour = GRADIENT_COLOURS[name]
        ax.semilogy(steps, np.maximum(errors["NumPy"][:, col], _FLOOR), lw=1.4, color=colour,
                    label=f"{labels[name]}, NumPy")
        ax.semilogy(steps, np.maximum(errors["kernel"][:, col], _FLOOR), ls="none", marker="o", ms=6, mfc="none",
                    mew=1.3, color=colour, label=f"{labels[name]}, kernel")
        bx.semilogy(steps, np.maximum(diff[:, col], _FLOOR), marker="o", ms=3.5, lw=1.4, color=colour,
                    label=f"{labels[name]}{'_i' if name == 'dq' else '_j'}, kernel")
        if base is not None:
            bx.semilogy(steps, np.maximum(base[:, col], _FLOOR), ls=":", lw=1.3, color=colour,
                        label=f"{labels[name]}{'_i' if name == 'dq' else '_j'}, NumPy in float32")
    for axis in (ax, bx):
        for n in range(1, len(numpy_trace)):
            if numpy_trace.steps[n].key_block != numpy_trace.steps[n - 1].key_block:
                axis.axvline(n + 0.5, color="#bbbbbb", lw=0.8, ls="--", zorder=0)
        axis.set_xlim(0.5, len(numpy_trace) + 0.5)
        axis.set_xlabel("step (dashed: a new key block)", fontsize=9.5)
        tidy(axis)
    if found is not None and found.step is not None:
        bx.axvline(found.step + 1, color="#d62728", lw=2.0, zorder=0)
        bx.text(found.step + 1, bx.get_ylim()[1], f" first divergence: step {found.step + 1}", color="#d62728",
                fontsize=8.5, va="top")
    ax.set_ylabel("max |running − textbook|", fontsize=9.5)
    ax.set_title("running gradients vs the textbook backward", fontsize=10)
    ax.legend(fontsize=7.5, frameon=False, loc="lower left", ncol=2)
    bx.set_ylabel("max |kernel − NumPy|", fontsize=9.5)
    bx.set_title("the kernels' running blocks vs NumPy's", fontsize=10)
    shown = diff if base is None else np.concatenate([diff, base])
    finite = shown[np.isfinite(shown) & (shown > 0)]
    if finite.size:
        bx.set_ylim(finite.min() / 10, finite.max() * 30)
    bx.legend(fontsize=7.5, frameon=False, loc="lower left", ncol=2)
    verdict = "no divergence" if found is None else (
        f"first divergence: {found.quantity}" + ("" if found.step is None else f" at step {found.step + 1}"))
    fig.text(0.02, 0.975, f"The backward kernels' own trace ({where}) beside NumPy's float64 one: "
                          f"{len(kernel_trace)} steps, {verdict}",
             fontsize=10.5, ha="left", va="top", color="#7a3b00", fontweight="bold")
    return fig


#: Line colour of each backward implementation in :func:`recorded_backward_figure` and benchmarks/gpu_backward.py's plot
IMPL_COLOURS = {"naive": "tab:red", "kernel": "tab:blue", "mma": "tab:purple", "torch": "tab:green"}
#: ... and its marker
IMPL_MARKERS = {"naive": "o", "kernel": "s", "mma": "D", "torch": "^"}


def _end_labels(ax, labels, *, gap=10):
    """Write each (x, y, text, colour) just right of its point, the labels spread apart vertically so that
    no two are closer than ``gap`` points: labels that would be closer form a group, centred on the mean
    height of its points (in display coordinates, so on log axes too). Call after the axes' scales and
    limits are set."""
    if not labels:
        return
    ax.get_xlim(), ax.get_ylim()                  # settle the autoscaled limits before reading transData
    to_points = 72.0 / ax.figure.dpi
    want = sorted((ax.transData.transform((x, y))[1] * to_points, (x, y, text, colour))
                  for x, y, text, colour in labels)
    groups = []                                   # [sum of wanted heights, labels]: centred at the mean
    for h, label in want:
        groups.append([h, [(h, label)]])
        while len(groups) > 1:
            (s0, g0), (s1, g1) = groups[-2], groups[-1]
            top0 = s0 / len(g0) + (len(g0) - 1) * gap / 2
            bottom1 = s1 / len(g1) - (len(g1) - 1) * gap / 2
            if bottom1 - top0 >= gap:
                break
            groups[-2:] = [[s0 + s1, g0 + g1]]
    for total, group in groups:
        first = total / len(group) - (len(group) - 1) * gap / 2
        for i, (h, (x, y, text, colour)) in enumerate(group):
            ax.annotate(text, (x, y), xytext=(5, first + i * gap - h), textcoords="offset points",
                        fontsize=8, va="center", color=colour)


def recorded_backward_figure(run, *, dtype="float16", figsize=(10.5, 7.2), dpi=90):
    """The backward implementations on a real GPU: time and extra device memory against N.

    ``run``: a :class:`lessons.gpu.recorded.BackwardRun` (recorded or live); ``dtype``: the storage dtype
    whose rows are drawn. Returns a Figure with one column per head dim: on top the median time of one
    backward (ms, log scale) against N (log scale), each line's last point labelled with its time; below,
    the peak extra device memory of one call (MiB, log scale). One line per implementation
    (:data:`lessons.gpu.recorded.IMPL_TITLES`, colours :data:`IMPL_COLOURS`); implementations that did not
    run are left out. The run's label (recorded: machine, date, commit; or live) is in the title. Only
    draws the rows: no timing or ratio is computed here.
    Raises TypeError for a run that is not a BackwardRun, ValueError when it has no rows in ``dtype``.
    """
    from lessons.gpu.recorded import IMPL_TITLES, IMPLS, BackwardRun
    if not isinstance(run, BackwardRun):
        raise TypeError(f"run must be a lessons.gpu.recorded.BackwardRun, got {type(run).__name__}")
    rows = [r for r in run.rows if r["dtype"] == dtype and not r["causal"] and r["seconds"] is not None]
    if not rows:
        raise ValueError(f"the run has no measured rows in dtype {dtype!r}; it has {sorted({r['dtype'] for r in run.rows})}")
    ds = sorted({r["d"] for r in rows})
    sizes = sorted({r["n"] for r in rows})
    fig = new_figure(figsize, dpi)
    width = 0.84 / len(ds)
    for col, d in enumerate(ds):
        left = 0.08 + col * (width + 0.04)
        top = fig.add_axes([left, 0.52, width - 0.04, 0.33])
        bottom = fig.add_axes([left, 0.13, width - 0.04, 0.33], sharex=top)
        ends = {top: [], bottom: []}
        for impl in IMPLS:
            pts = sorted((r["n"], r["seconds"] * 1e3, r["peak_bytes"] / 2**20) for r in rows
                         if r["impl"] == impl and r["d"] == d)
            if not pts:
                continue
            n, ms, mib = zip(*pts)
            style = dict(color=IMPL_COLOURS[impl], marker=IMPL_MARKERS[impl], lw=3.2 if impl == "kernel" else 1.6,
                         ms=6 if impl == "kernel" else 5, label=IMPL_TITLES[impl])     # kernel: wide, seen under mma
            top.plot(n, ms, **style)
            bottom.plot(n, mib, **style)
            ends[top].append((n[-1], ms[-1], f"{ms[-1]:.2f} ms", IMPL_COLOURS[impl]))
            ends[bottom].append((n[-1], mib[-1], f"{mib[-1]:,.0f} MiB", IMPL_COLOURS[impl]))
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(n) for n in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlim(sizes[0] / 1.3, sizes[-1] * 2.2)
            ax.grid(True, which="major", color="#eeeeee", lw=0.6)
            tidy(ax)
        top.set_title(f"d = {d}", fontsize=10)
        top.set_ylabel("time of one backward (ms)", fontsize=9.5)
        bottom.set_ylabel("peak extra device memory (MiB)", fontsize=9.5)
        bottom.set_xlabel("sequence length N", fontsize=9.5)
        top.tick_params(labelbottom=False)
        for ax, labels in ends.items():               # after the scales and limits: spaced in points
            _end_labels(ax, labels)
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8.5, frameon=False)
    heads = rows[0]["heads"]
    fig.suptitle(f"Attention backward, batch 1, {heads} heads, {dtype}\n{run.label}", fontsize=10.5, x=0.02,
                 y=0.97, ha="left", color="#7a3b00" if run.live else "#333333")
    return fig

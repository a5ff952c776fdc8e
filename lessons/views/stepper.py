"""A widget that replays a tiled attention trace one key tile at a time.

:class:`TileStepper` is a view: it asks a schedule (by default
:func:`lessons.flash_attention` with ``return_trace=True``) for a
:class:`lessons.core.trace.Trace` and the reference (:func:`lessons.attention`) for
the exact output, then only *displays* what the trace recorded. No attention
arithmetic happens in this module; every number shown is a trace value passed
through :func:`format_value`.

Later lessons reuse it with another data source, schedule or options: the paged
loop of lesson 5 (a schedule that reads the keys through a block table), or query
blocks of 16 rows under a causal mask (lesson 3). Row 93 of the real sample then
absorbs 8 pages of 16 keys, or only the 6 key tiles its query block can see:

>>> from lessons.schedules.paged import paged_schedule
>>> from lessons.schedules.causal import block_schedule
>>> TileStepper(schedule=paged_schedule).slider.max
8
>>> TileStepper(schedule=block_schedule(16), options={"causal": True}).slider.max
6

The loop being replayed: Dao et al. 2022, Alg. 1; Dao 2023 (FlashAttention-2), Alg. 1.
"""
from __future__ import annotations

import html
import numbers

import ipywidgets as widgets
import numpy as np

from lessons.views.flash import TILE_COLOURS, StepFigure
from lessons.schedules.flash import flash_attention
from lessons.core.reference import attention
from lessons.core.checks import check_int

__all__ = ["TileStepper", "StepperShell", "step_controls", "format_value", "DATA_CHOICES", "DEFAULT_ROWS",
           "READOUT_CARD"]

#: The data choices of :func:`lessons.course.data.make_case`, as (label, kind) pairs.
DATA_CHOICES = (("real text", "real"), ("random", "random"), ("late maximum", "late-max"))

#: The query row shown first for each data choice: in the real sample (layer 0, head 0)
#: row 93 (the token "and") moves its running max in 5 of its 8 tiles of 16 keys;
#: the late-maximum case is built around row 0.
DEFAULT_ROWS = {"real": 93, "random": 0, "late-max": 0}

_TABLE_ROWS = 12   # the table shows the latest tiles; older ones are summarised


def format_value(x) -> str:
    """The one way the stepper prints a number, so tests can compare text exactly.

    * ints (Python or NumPy): thousands separators, e.g. ``16384 -> '16,384'``;
    * floats: 6 significant digits (``'%.6g'``), e.g. ``0.0312456``, ``1.11022e-16``;
      ``-inf``/``inf``/``nan`` print as ``'-inf'``, ``'inf'``, ``'nan'``.

    Raises TypeError for anything that is not a real number (bools included).
    """
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"format_value takes a real number, got {type(x).__name__} {x!r}")
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}"
    return f"{float(x):.6g}"


def _default_make_case(kind, *, layer=0, head=0, tile=16, seed=0):
    from lessons.course import data
    return data.make_case(kind, layer=layer, head=head, tile=tile, seed=seed)


def _flash_schedule(q, k, v, tile, **options):
    """The default schedule: FlashAttention's loop, keeping its trace."""
    out, trace = flash_attention(q, k, v, tile, return_trace=True, **options)
    return trace


def _count(value, name, low=0):
    return check_int(value, name, min=low)


#: The layout of one readout card (a bordered widgets.HTML) on every stepper.
READOUT_CARD = {"border": "1px solid #dddddd", "padding": "2px 10px", "margin": "2px"}


def step_controls(n: int, value: int = 1, *, label: str, width: str = "480px", interval: int = 900, **play):
    """A step slider over ``1..n`` (an IntSlider named ``label``, starting at ``value`` clipped into
    range) and a Play button linked to it in the browser (``interval`` ms per step; ``play``: more
    Play options). Returns ``(slider, play)``."""
    value = min(max(int(value), 1), n)
    slider = widgets.IntSlider(value=value, min=1, max=n, description=label,
                               style={"description_width": "initial"}, layout={"width": width})
    button = widgets.Play(value=value, min=1, max=n, interval=interval, **play)
    widgets.jslink((button, "value"), (slider, "value"))
    return slider, button


class StepperShell:
    """The shell of a stepper widget: a Play button and a slider over steps ``1..n``, a row of readout
    cards, and a picture (PNG) beside a table; ``controls``: more widgets after the slider (e.g. a toggle
    that picks the trace shown). A subclass calls :meth:`_build_shell` and fills the
    readouts, ``image`` and ``table`` for ``slider.value`` in ``_render``: a view over a trace that
    it reads, never computes. The object displays as ``widget``.
    """

    def _build_shell(self, n: int, *, step: int, label: str, readouts, table_width: str,
                     interval: int, controls=()) -> None:
        self.slider, self.play = step_controls(n, step, label=label, interval=interval)
        self.image = widgets.Image(format="png")
        self.table = widgets.HTML(layout={"width": table_width})
        self.readouts = {k: widgets.HTML(layout=READOUT_CARD) for k in readouts}
        self._render()
        self.slider.observe(lambda change: self._render(), names="value")
        top = widgets.HBox([self.play, self.slider, *controls], layout={"flex_flow": "row wrap"})
        self.widget = widgets.VBox([top, widgets.HBox(list(self.readouts.values()), layout={"flex_flow": "row wrap"}),
                                    widgets.HBox([self.image, self.table],
                                                 layout={"flex_flow": "row wrap", "align_items": "flex-start"})])

    def _render(self) -> None:
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


class TileStepper(StepperShell):
    """Step one query row through a tiled attention loop, tile by tile (ipywidgets).

    Parameters
    ----------
    make_case : callable ``(kind, *, layer, head, tile, seed) -> (q (N, d), k (N, d), v (N, dv))``
        Where the data comes from; default :func:`lessons.course.data.make_case`.
    kind : str, the initial data choice (a value of ``choices``), default ``"real"``.
    choices : sequence of (label, kind) pairs for the data buttons, default :data:`DATA_CHOICES`.
        Layer and head are only enabled for ``kind == "real"``.
    tile : int >= 1, initial keys per tile (block_k); clipped to the number of keys.
        The late-maximum case is built for the tile size (at least two tiles of it,
        see :func:`lessons.course.data.make_case`), so it accepts any tile.
    row : int, initial query row (default: ``default_rows[kind]``, else 0).
    default_rows : mapping kind -> the row shown when that data is chosen, default
        :data:`DEFAULT_ROWS` (kinds not in it keep the current row).
    layer, head : ints >= 0, the initial layer and head of the real data.
    layers, heads : ints >= 1, the ranges of the layer and head controls (default:
        read from :func:`lessons.course.data.load_sample` when ``make_case`` is the default, else 1).
    seed : int, passed to ``make_case`` for the synthetic choices.
    schedule : callable ``(q, k, v, tile, **options) -> Trace``; default FlashAttention's
        loop (:func:`lessons.flash_attention` with ``return_trace=True``).
    reference : callable ``(q, k, v, **options) -> out (Nq, dv)``; default :func:`lessons.attention`.
    options : dict of keyword arguments for both (e.g. ``{"causal": True}``).
    interval : int, milliseconds per tile when Play runs.
    kernel : optional callable ``(q, k, v, tile, row, **options) -> (where, gpu_row)`` giving a
        CUDA kernel's own trace of the row (``where`` a label such as ``"GPU"``, ``gpu_row`` a
        :class:`lessons.gpu.GpuRowTrace`), e.g. :func:`lessons.gpu.kernel_row_trace`.
        The table then shows the kernel's m, α, l beside NumPy's, and the ``kernel`` readout
        names the first tile where they differ beyond rounding (:func:`lessons.gpu.first_divergence`,
        rtol 1e-4, atol 1e-6), or why the kernel could not run. With causal masking the kernel
        must use the schedule's query block size (see :func:`lessons.gpu.kernel_row_trace`).

    Attributes (stable names, for notebooks and tests)
    --------------------------------------------------
    slider : IntSlider over steps ``1..len(row_trace)`` (tiles absorbed by the row).
    play : Play button, linked to ``slider`` in the browser.
    tile_size, row, layer, head : IntSliders; data : ToggleButtons (value = kind).
    readouts : dict of widgets.HTML with keys ``tile, keys, m, alpha, l, max_error,
        scores_in_memory, naive_scores, rescales``; each ``.value`` holds the number
        formatted by :func:`format_value`. A paged schedule adds ``page`` and ``block_table``
        (shown beside the state) (a trace with a ``block_table``, e.g.
        :func:`lessons.schedules.paged.paged_schedule`): the logical block of the current step,
        the physical page it read, and the whole table with that entry highlighted.
    table : HTML table of the tiles absorbed so far (tile number from 1, keys, m, alpha, l).
    image : widgets.Image holding the PNG of the current step (see lessons.views.flash).
    caption : HTML line saying what happened at this step.
    kernel_row, divergence, kernel_where : with ``kernel``, the kernel's trace of the current row
        (None if it could not run), the first :class:`lessons.gpu.TraceDivergence` (None: none) and
        where it ran, in words (``"emulator"`` or ``"GPU (<name>)"``).
    trace, row_trace, exact : the current Trace, RowTrace and exact output row (dv,).
    widget : the whole VBox (the object itself displays as that box).

    Raises TypeError/ValueError for a bad ``tile``, ``row``, ``layer``, ``head`` or
    ``kind``, and whatever ``make_case``/``schedule`` raise for their inputs.
    """

    def __init__(self, make_case=None, *, kind="real", choices=DATA_CHOICES, tile=16, row=None, layer=0,
                 head=0, layers=None, heads=None, seed=0, schedule=None, reference=None, options=None,
                 default_rows=None, interval=700, kernel=None):
        self._make_case = _default_make_case if make_case is None else make_case
        self._schedule = _flash_schedule if schedule is None else schedule
        self._reference = attention if reference is None else reference
        self._options = dict(options or {})
        self._kernel = kernel
        if kernel is not None and not callable(kernel):
            raise TypeError(f"kernel must be a callable (q, k, v, tile, row, **options) -> (where, gpu_row), "
                            f"got {type(kernel).__name__}")
        self.kernel_row = self.divergence = self.kernel_where = None
        self._kernel_note = ""
        self._seed = seed
        self._default_rows = dict(DEFAULT_ROWS if default_rows is None else default_rows)
        choices = tuple(choices)
        kinds = [c[1] for c in choices]
        if kind not in kinds:
            raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
        _count(tile, "tile", 1)
        _count(layer, "layer")
        _count(head, "head")
        self._sample = None
        if make_case is None and (layers is None or heads is None) and "real" in kinds:
            from lessons.course import data
            self._sample = data.load_sample()
            layers = self._sample.q.shape[0] if layers is None else layers
            heads = self._sample.q.shape[1] if heads is None else heads
        layers = _count(1 if layers is None else layers, "layers", 1)
        heads = _count(1 if heads is None else heads, "heads", 1)
        if layer >= layers or head >= heads:
            raise ValueError(f"layer {layer} / head {head} out of range for {layers} layers, {heads} heads")

        style = {"description_width": "initial"}
        self.data = widgets.ToggleButtons(options=list(choices), value=kind, description="data",
                                          style={"button_width": "120px", **style})
        self.layer = widgets.IntSlider(value=layer, min=0, max=layers - 1, description="layer",
                                       continuous_update=False, style=style, layout={"width": "220px"})
        self.head = widgets.IntSlider(value=head, min=0, max=heads - 1, description="head",
                                      continuous_update=False, style=style, layout={"width": "220px"})
        self.row = widgets.IntSlider(value=0, min=0, max=0, description="query row", continuous_update=False,
                                     style=style, layout={"width": "340px"})
        self.tile_size = widgets.IntSlider(value=tile, min=1, max=max(tile, 1), description="keys per tile",
                                           continuous_update=False, style=style, layout={"width": "340px"})
        self.slider, self.play = step_controls(1, label="tiles absorbed", width="520px", interval=interval, step=1,
                                               description="play")
        self.caption = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.table = widgets.HTML(layout={"width": "300px"})
        names = ["tile", "keys", "m", "alpha", "l", "max_error", "scores_in_memory", "naive_scores", "rescales"]
        if kernel is not None:
            names.append("kernel")
        self.readouts = {n: widgets.HTML() for n in names}

        self._figure = None
        self._busy = False
        self._load(row=self._default_rows.get(kind, 0) if row is None else row)
        if self.paged:                                     # the table and the page beside the state
            self.readouts.update(page=widgets.HTML(), block_table=widgets.HTML())
        self.slider.value = 1
        self._render()

        self.slider.observe(self._on_step, names="value")
        self.row.observe(self._on_row, names="value")
        for w in (self.data, self.layer, self.head, self.tile_size):
            w.observe(self._on_data, names="value")
        self.widget = self._layout()

    # -- building the view ----------------------------------------------------------------
    #: Widths (px) of the table beside the picture; the picture takes the rest of the row (at
    #: most its own 720 px), so picture and table stay side by side in a 1400 x 900 window.
    TABLE_WIDTH = 300
    KERNEL_TABLE_WIDTH = 470

    def _layout(self):
        for r in self.readouts.values():
            r.layout = widgets.Layout(**READOUT_CARD)
        memory = widgets.HBox([self.readouts[k] for k in ("scores_in_memory", "naive_scores", "rescales",
                                                          "max_error")], layout={"flex_flow": "row wrap"})
        paged = ("page",) if self.paged else ()
        state = widgets.HBox([self.readouts[k] for k in ("tile", "keys", *paged, "m", "alpha", "l")],
                             layout={"flex_flow": "row wrap"})
        controls = widgets.VBox([
            self.data,
            widgets.HBox([self.layer, self.head, self.row, self.tile_size], layout={"flex_flow": "row wrap"}),
            widgets.HBox([self.play, self.slider]),
        ])
        width = self.KERNEL_TABLE_WIDTH if "kernel" in self.readouts else self.TABLE_WIDTH
        self.table.layout = widgets.Layout(width=f"{width}px", flex="0 0 auto", overflow="auto")
        self.image.layout = widgets.Layout(width="720px", max_width=f"calc(100% - {width + 12}px)",
                                           height="auto", flex="0 1 auto")
        body = widgets.HBox([self.image, self.table],
                            layout={"flex_flow": "row nowrap", "align_items": "flex-start", "width": "100%"})
        extra = [self.readouts["kernel"]] if "kernel" in self.readouts else []
        table = [self.readouts["block_table"]] if self.paged else []
        return widgets.VBox([controls, self.caption, state, *table, memory, *extra, body])

    @property
    def paged(self) -> bool:
        """True when the schedule reads its tiles through a block table (a paged trace)."""
        return getattr(self.trace, "block_table", None) is not None

    # -- data and trace (computed by the schedule and the reference, never here) --------------
    def _keys_seen(self):
        """Keys absorbed at the current step (to keep the place when the tiling changes)."""
        if self._figure is None or not len(self.row_trace):
            return None
        return int(self.row_trace.key_stop[min(self.slider.value, len(self.row_trace)) - 1])

    def _load(self, row=None, keep="step"):
        """Make the data, the trace and the exact output for the controls' values.

        ``keep``: after reloading show the same step number (``"step"``), the step
        that has absorbed the same keys (``"keys"``, for a new tile size), or step 1
        (``"start"``, for new data).
        """
        kind = self.data.value
        real = kind == "real"
        self.layer.disabled = self.head.disabled = not real
        tile = self.tile_size.value
        keys_seen = self._keys_seen() if keep == "keys" else None
        q, k, v = self._make_case(kind, layer=self.layer.value, head=self.head.value, tile=tile, seed=self._seed)
        nq, nk = q.shape[0], k.shape[0]
        if tile > nk:
            tile = nk
        self.q, self.k, self.v = q, k, v
        self.trace = self._schedule(q, k, v, tile, **self._options)
        self.exact_all = np.asarray(self._reference(q, k, v, **self._options))
        self._tokens = (list(self._sample.tokens) if (real and self._sample is not None
                                                      and len(self._sample.tokens) == nk) else None)
        self._busy = True
        try:
            self.tile_size.max = nk
            self.tile_size.value = tile
            self.row.max = nq - 1
            if row is not None:
                _count(row, "row")
                if row >= nq:
                    raise ValueError(f"row must be in 0..{nq - 1} (Nq = {nq}), got {row}")
                self.row.value = row
        finally:
            self._busy = False
        if keep == "start":
            self._busy = True
            try:
                self.slider.value = 1
            finally:
                self._busy = False
        self._select_row(keys_seen)

    def _select_row(self, keys_seen=None):
        """Take the current row's steps from the trace; keep the step, or the keys seen if given."""
        self.row_trace = self.trace.row(self.row.value)
        self.exact = self.exact_all[self.row.value]
        n = len(self.row_trace)
        if self._figure is None:
            self._figure = StepFigure(self.row_trace, self.exact, min(1, n), titles=False, figsize=(9.0, 5.4))
        else:
            self._figure.set_trace(self.row_trace, self.exact, min(1, n))
        self._errors = self.row_trace.errors(self.exact)
        self._rescales = np.cumsum(self.row_trace.rescaled)
        if self._kernel is not None:
            self._run_kernel()
        self._busy = True
        try:
            top = max(n, 1)
            step = min(self.slider.value, top)
            if keys_seen is not None and n:
                step = min(int(np.searchsorted(self.row_trace.key_stop, keys_seen)) + 1, n)
            self.slider.max = self.play.max = top
            self.slider.value = self.play.value = step
        finally:
            self._busy = False

    def _run_kernel(self):
        """The kernel's trace of the current row, and where it first parts from NumPy's."""
        from lessons.gpu.trace_compare import first_divergence

        self.kernel_row = self.divergence = self.kernel_where = None
        try:
            where, self.kernel_row = self._kernel(self.q, self.k, self.v, self.tile_size.value, self.row.value,
                                                  **self._options)
        except Exception as err:        # no compiler, a tile size the kernel cannot take, ...
            self._kernel_note = (f"kernel trace: not run ({html.escape(type(err).__name__)}: "
                                 f"{html.escape(str(err).splitlines()[0])})")
            return
        self.kernel_where = where
        self.divergence = first_divergence(self.kernel_row, self.row_trace, rtol=1e-4, atol=1e-6)
        found = ("none: every tile agrees with NumPy within rounding (rtol 1e-4, atol 1e-6)"
                 if self.divergence is None else html.escape(str(self.divergence)))
        self._kernel_note = f"<b>{html.escape(where)} trace</b> beside NumPy's; first divergence: {found}"

    # -- callbacks ------------------------------------------------------------------------
    def _on_step(self, change):
        if not self._busy:
            self._render()

    def _on_row(self, change):
        if not self._busy:
            self._select_row()
            self._render()

    def _on_data(self, change):
        if self._busy:
            return
        owner = change["owner"]
        row = self._default_rows.get(self.data.value) if owner is self.data else None
        keep = {id(self.data): "start", id(self.tile_size): "keys"}.get(id(owner), "step")
        try:
            self._load(row=row, keep=keep)
        except (ValueError, TypeError) as err:        # e.g. a tile size the data cannot use
            self._busy = True
            try:
                change["owner"].value = change["old"]
            finally:
                self._busy = False
            self._load()
            self._render()
            self.caption.value = (f"<span style='color:#b00'>Kept {change['owner'].description} = "
                                  f"{change['old']}: {html.escape(str(err))}</span><br>" + self.caption.value)
            return
        self._render()

    # -- drawing --------------------------------------------------------------------------
    def _token(self, j):
        return "" if self._tokens is None else html.escape(str(self._tokens[j]))

    def _render(self):
        rt = self.row_trace
        n = len(rt)
        step = min(self.slider.value, n)
        r = self.readouts
        naive = (self.trace.nq, self.trace.nk)
        if "kernel" in r:
            r["kernel"].value = self._kernel_note
        r["naive_scores"].value = (f"textbook S holds <b>{format_value(naive[0])} × {format_value(naive[1])}"
                                   f" = {format_value(naive[0] * naive[1])}</b> scores")
        if step == 0:   # a row that sees no key at all (fully masked)
            for key in ("tile", "keys", "m", "alpha", "l", "max_error", "scores_in_memory", "rescales",
                        *(("page",) if self.paged else ())):
                r[key].value = f"{key}: —"
            self.caption.value = f"<b>Query row {rt.row}</b> sees no key: nothing is absorbed, the output is 0."
            self.table.value = ""
            self.image.value = self._figure.show(0).png()
            return
        i = step - 1
        a, b = int(rt.key_start[i]), int(rt.key_stop[i])
        r["tile"].value = f"<b>tile</b> {format_value(step)} of {format_value(n)}"
        r["keys"].value = f"<b>keys</b> {format_value(a)}–{format_value(b - 1)}"
        r["m"].value = f"<b>m</b> (running max) = {format_value(rt.m[i])}"
        r["alpha"].value = f"<b>α</b> = exp(m<sub>old</sub> − m<sub>new</sub>) = {format_value(rt.alpha[i])}"
        r["l"].value = f"<b>l</b> (running sum) = {format_value(rt.l[i])}"
        if self.paged:
            table = np.asarray(self.trace.block_table)
            j = int(rt.tile[i])                          # logical block of this step (an index from 0)
            r["page"].value = (f"<b>logical block</b> {format_value(j)} → <b>physical page</b> "
                               f"{format_value(int(table[j]))}")
            cells = "".join(                             # one cell per entry: its index above its page
                f"<td style='padding:0 5px;text-align:center;{'background:#f39c3a;font-weight:bold;' if jj == j else ''}'>"
                f"<div style='color:#888;font-size:10px'>{jj}</div><div data-page='{int(page)}'>"
                f"{format_value(int(page))}</div></td>" for jj, page in enumerate(table))
            r["block_table"].value = (
                "<table style='border-collapse:collapse;font-family:monospace;font-size:12px'><tr>"
                "<td style='padding-right:8px;text-align:right'><div style='color:#888;font-size:10px'>"
                "logical block (index)</div><div><b>block_table</b> (page)</div></td>"
                f"{cells}</tr></table>")
        r["scores_in_memory"].value = f"scores in memory now: <b>{format_value(b - a)}</b>"
        r["rescales"].value = f"rescales so far: <b>{format_value(int(self._rescales[i]))}</b>"
        r["max_error"].value = f"max |o/l − exact| = <b>{format_value(self._errors[i])}</b>"

        token = f" ({self._token(rt.row)!r})" if self._tokens is not None else ""
        empty_after = rt.l[i] == 0                       # the trace's own state: still nothing visible
        empty_before = step == 1 or rt.l[i - 1] == 0
        if empty_after:
            what = ("every key of this tile is masked for this row: nothing visible yet, "
                    "so the state stays empty (m = -inf, l = 0, o = 0; α = 0, nothing to rescale)")
        elif rt.rescaled[i]:
            what = (f"a new max: m moved {format_value(rt.m_before[i])} → {format_value(rt.m[i])}, "
                    f"so l and o are multiplied by α = {format_value(rt.alpha[i])}")
        elif step == 1:
            what = "the first tile: m, l and o start from it"
        elif empty_before:
            what = ("the first visible keys: m, l and o start from this tile "
                    "(the state was empty, so α = 0 multiplies nothing)")
        else:
            what = "the max did not move: α = 1, nothing to rescale"
        if step < n:
            last = ""
        elif empty_after:
            last = " This was the last tile: the row saw no visible key, so its output is 0."
        else:
            last = " This was the last tile: o / l is now the exact output."
        self.caption.value = (f"<b>Query row {rt.row}{token}, tile {step} of {n}</b> "
                              f"(keys {a}–{b - 1}): {what}.{last}")
        self.table.value = self._table(step)
        self.image.value = self._figure.show(step).png()

    def _table(self, step):
        rt = self.row_trace
        kr = self.kernel_row
        first = max(0, step - _TABLE_ROWS)
        names = ["tile", "keys", "m", "α", "l"] + (["m kernel", "α kernel", "l kernel"] if kr is not None else [])
        head = "".join(f"<th style='padding:1px 6px'>{h}</th>" for h in names)
        rows = []
        if first:
            rows.append(f"<tr><td colspan='{len(names)}' style='color:#888'>… {first} earlier tiles</td></tr>")
        bad_step = None if self.divergence is None else self.divergence.step
        fields = ("m", "alpha", "l")
        quantity = None if self.divergence is None else self.divergence.quantity
        bad_fields = (quantity,) if quantity in fields else fields    # "tile"/"length": the whole record
        for i in range(first, step):
            a, b = int(rt.key_start[i]), int(rt.key_stop[i])
            bg = f"background:{TILE_COLOURS['current']}40;" if i == step - 1 else ""
            al = "color:#a34a00;font-weight:bold;" if rt.rescaled[i] else ""
            keys = f"{a}–{b - 1}" if b - a > 1 else f"{a}"
            if self._tokens is not None:
                words = " ".join(self._token(j) for j in range(a, min(b, a + 3))) + (" …" if b - a > 3 else "")
                keys = f"<span title='{words}'>{keys}</span>"
            cells = [format_value(i + 1), keys, format_value(rt.m[i]),
                     f"<span style='{al}'>{format_value(rt.alpha[i])}</span>", format_value(rt.l[i])]
            if kr is not None:
                mark = "color:#b00;font-weight:bold;" if i == bad_step else ""
                cells += [f"<span style='{mark if f in bad_fields else ''}'>{format_value(float(getattr(kr, f)[i]))}"
                          f"</span>" if i < len(kr) else "—" for f in fields]
            rows.append(f"<tr style='{bg}'>" + "".join(f"<td style='padding:1px 6px;text-align:right'>{c}</td>"
                                                          for c in cells) + "</tr>")
        note = "α in bold orange: the max moved and everything accumulated so far was rescaled."
        if kr is not None:
            note += " Bold red: the first kernel value that parts from NumPy's."
        size, pad = ("11px", "1px 4px") if kr is not None else ("12px", "1px 6px")   # eight columns must fit
        body = "".join(rows).replace("padding:1px 6px", f"padding:{pad}")
        head = head.replace("padding:1px 6px", f"padding:{pad}")
        return (f"<table style='border-collapse:collapse;font-size:{size};font-family:monospace'>"
                f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<div style='font-size:11px;color:#666;margin-top:4px'>{note}</div>")

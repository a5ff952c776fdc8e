"""Pictures of the Hopper rungs: their pipeline (who works on which tile when, one panel per schedule),
one consumer's products and softmax (plain or overlapped) and the 128-byte swizzle of their
shared-memory tiles.

The events come from :func:`lessons.gpu.hopper.pipeline_schedule` (the order the mbarriers impose) and
:func:`lessons.gpu.hopper.overlap_schedule` (the order of one consumer's steps), the layout from
:func:`lessons.gpu.source.wgmma_swizzle`; this module only draws them.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import numpy as np
from matplotlib.patches import Patch

from lessons.gpu.hopper import OVERLAP_UNITS, OverlapEvent, PipelineEvent

from lessons.views.plot import new_figure, tidy

__all__ = ["STAGE_COLOURS", "pipeline_figure", "prefetch_figure", "overlap_figure", "swizzle_figure"]

#: one colour per shared-memory stage (a tile's copy and its work share their stage's colour; after 10
#: stages the colours repeat, the tile numbers on the bars still tell them apart)
STAGE_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
                 "#ccb974", "#64b5cd")
_LANES = (("producer", "TMA copy of $K_j$, $V_j$\n(producer warpgroup)"),
          ("consumers", "$Q K_j^\\top$, softmax, $P V_j$\n(consumer warpgroups)"))


def pipeline_figure(schedules: dict, *, unit: str = "time", lanes=None, item: str = "tile",
                    stage_title: str = "colour: the shared-memory stage a tile occupies", stage_word: str = "stage"):
    """One panel per entry of ``schedules`` (title -> list of
    :class:`lessons.gpu.hopper.PipelineEvent`), top to bottom on a shared time axis: a lane for the
    producer's copies and one for the consumers' work, each bar labelled with its tile (counted from 1) and
    coloured by its stage; the panel's title gets the schedule's total time. ``unit`` labels the
    time axis; ``lanes`` (default the Hopper rung's) the two lanes, ``(producer label, consumers label)``;
    ``item`` what a bar is ("tile", or "step" for :func:`lessons.cost.latency.load_schedule`); ``stage_title``
    the legend's title and ``stage_word`` its entries' ("stage 0", "stage 1", ...). Returns a Figure. TypeError for ``schedules`` that is not a dict of lists of
    PipelineEvent; ValueError for an empty ``schedules`` or schedule, an event whose ``who`` is neither
    "producer" nor "consumers", or one that starts before 0 or ends before it starts."""
    if not isinstance(schedules, Mapping):
        raise TypeError(f"schedules must be a dict of title -> events, got {type(schedules).__name__}")
    if not schedules:
        raise ValueError("schedules must hold at least one schedule")
    if lanes is None:
        lane_rows = _LANES
    elif isinstance(lanes, (list, tuple)) and len(lanes) == 2 and all(isinstance(x, str) for x in lanes):
        lane_rows = (("producer", lanes[0]), ("consumers", lanes[1]))
    else:
        raise TypeError(f"lanes must be None or two strings (producer label, consumers label), got {lanes!r}")
    roles = [who for who, _ in lane_rows]
    for title, events in schedules.items():
        if not isinstance(events, (list, tuple)) or not all(isinstance(e, PipelineEvent) for e in events):
            raise TypeError(f"schedule {title!r} must be a list of PipelineEvent (pipeline_schedule)")
        if not events:
            raise ValueError(f"schedule {title!r} has no events")
        for e in events:
            if e.who not in roles:
                raise ValueError(f"schedule {title!r}: an event's who must be one of {roles}, got {e.who!r}")
            if not (0 <= e.start <= e.end) or e.stage < 0:
                raise ValueError(f"schedule {title!r}: an event must have 0 <= start <= end and stage >= 0, got {e}")
    end = max(e.end for events in schedules.values() for e in events)
    fig = new_figure((10.5, 1.9 * len(schedules) + 0.6))
    axes = fig.subplots(len(schedules), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, events) in zip(axes, schedules.items()):
        for row, (who, _) in enumerate(lane_rows):
            bars = [e for e in events if e.who == who]
            # bars of one lane that overlap in time (two steps' loads in flight at once) get a sub-row per stage
            overlapping = any(a.start < b.end and b.start < a.end for i, a in enumerate(bars) for b in bars[i + 1:])
            n_sub = max(e.stage for e in bars) + 1 if overlapping and bars else 1
            height = 0.62 / n_sub
            for e in bars:
                y = 1 - row + (0.31 - height * (e.stage % n_sub + 0.5) if n_sub > 1 else 0.0)
                ax.barh(y, e.end - e.start, left=e.start, height=height,
                        color=STAGE_COLOURS[e.stage % len(STAGE_COLOURS)], edgecolor="white")
                ax.text((e.start + e.end) / 2, y, f"{item} {e.tile + 1}", ha="center", va="center",   # from 1
                        fontsize=8 if n_sub == 1 else 7, color="white")
        total = max(e.end for e in events)
        ax.set_yticks([1, 0], [label for _, label in lane_rows])
        ax.set_title(f"{title}: all {item}s done at {total:g}", fontsize=10, loc="left")
        ax.set_xlim(0, end * 1.02)
        ax.set_ylim(-0.6, 1.6)
        tidy(ax)
    stages = max(e.stage for events in schedules.values() for e in events) + 1
    handles = [Patch(color=STAGE_COLOURS[s % len(STAGE_COLOURS)], label=f"{stage_word} {s}") for s in range(stages)]
    axes[0].legend(handles=handles, loc="upper right", fontsize=8, ncols=min(stages, 6), frameon=False,
                   bbox_to_anchor=(1.0, 1.35), title=stage_title,
                   title_fontsize=8)
    axes[-1].set_xlabel(unit)
    fig.subplots_adjust(left=0.22, right=0.98, top=0.88, bottom=0.12 + 0.05 / len(schedules), hspace=0.55)
    return fig


def prefetch_figure(n_steps: int = 4, *, latency: float = 3.0, compute: float = 1.5):
    """The decode split rung against its prefetch and cp.async builds, one lane group's steps in time: three
    panels of :func:`pipeline_figure` over :func:`lessons.cost.latency.load_schedule` (loads from issue to
    landing, one sub-row per register set or ring slot where several steps' loads are in flight at once;
    absorbs below). A model, labelled as one. Returns a Figure; TypeError/ValueError as load_schedule for bad
    arguments, and a ValueError naming ``n_steps`` for 0 steps (nothing to draw)."""
    from lessons.core.checks import check_int
    from lessons.cost.latency import load_schedule

    check_int(n_steps, "n_steps", min=1)
    schedules = {"split rung (load, wait, absorb)": load_schedule(n_steps, latency=latency, compute=compute),
                 "prefetch rung (the next step's loads issued before this step is absorbed)":
                     load_schedule(n_steps, latency=latency, compute=compute, prefetch=True),
                 "cp.async rung (a ring of 3 steps in shared memory: copies issued two steps ahead)":
                     load_schedule(n_steps, latency=latency, compute=compute, stages=3)}
    return pipeline_figure(schedules, unit=f"model time: absorbing a step takes {compute:g}, a load lands {latency:g} "
                                           f"after it is issued",
                           lanes=("a step's K/V rows in flight\n(issued \u2192 landed)",
                                  "absorb the step\n(dots, softmax, o += p v)"),
                           item="step", stage_title="colour: the register set, or ring slot, holding a step's rows",
                           stage_word="set / slot")


_UNIT_ROWS = (("tensor cores", "tensor cores\n($QK^\\top$ and $PV$)"), ("CUDA cores", "CUDA cores\n(softmax)"))
_STEP_TEXT = {"S": "$S_{%d}$", "softmax": "softmax$_{%d}$", "PV": "$P_{%d}V_{%d}$"}


def overlap_figure(schedules: dict, *, unit: str = "time"):
    """One panel per entry of ``schedules`` (title -> list of :class:`lessons.gpu.hopper.OverlapEvent`,
    e.g. the plain and the overlapped order of :func:`lessons.gpu.hopper.overlap_schedule`), top to
    bottom on a shared time axis: a row for the tensor cores (S_j = Q K_j^T and P_j V_j) and one for the
    CUDA cores (softmax_j), one box per event, labelled with its step and tile and coloured by its tile;
    a dashed line marks where the last event ends, and the panel's title says when; a note says the rows
    are one consumer warpgroup's and the colour is the tile (not the stage). ``unit`` labels the
    time axis. Returns a Figure. TypeError for ``schedules`` that is not a dict of lists of OverlapEvent;
    ValueError for an empty ``schedules`` or schedule, an event whose ``step`` is not one of "S",
    "softmax", "PV", or one that starts before 0, ends before it starts or never ends; TypeError for a
    tile that is not an int or times that are not numbers."""
    if not isinstance(schedules, Mapping):
        raise TypeError(f"schedules must be a dict of title -> events, got {type(schedules).__name__}")
    if not schedules:
        raise ValueError("schedules must hold at least one schedule")
    for title, events in schedules.items():
        if not isinstance(events, (list, tuple)) or not all(isinstance(e, OverlapEvent) for e in events):
            raise TypeError(f"schedule {title!r} must be a list of OverlapEvent (overlap_schedule)")
        if not events:
            raise ValueError(f"schedule {title!r} has no events")
        for e in events:
            if not isinstance(e.step, str) or e.step not in OVERLAP_UNITS:
                raise ValueError(f"schedule {title!r}: an event's step must be one of {list(OVERLAP_UNITS)}, "
                                 f"got {e.step!r}")
            if isinstance(e.tile, (bool, np.bool_)) or not isinstance(e.tile, numbers.Integral):
                raise TypeError(f"schedule {title!r}: an event's tile must be an int, got {e}")
            if any(isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) for x in (e.start, e.end)):
                raise TypeError(f"schedule {title!r}: an event's start and end must be numbers, got {e}")
            if not (0 <= e.start <= e.end and math.isfinite(e.end)) or e.tile < 0:
                raise ValueError(f"schedule {title!r}: an event must have 0 <= start <= end < inf and tile >= 0, "
                                 f"got {e}")
    end = max(e.end for events in schedules.values() for e in events)
    fig = new_figure((10.5, 1.7 * len(schedules) + 0.7))
    axes = fig.subplots(len(schedules), 1, sharex=True, squeeze=False)[:, 0]
    fig.subplots_adjust(left=0.17, right=0.98, top=1 - 0.42 / fig.get_figheight(),
                        bottom=0.5 / fig.get_figheight(), hspace=0.5)
    renderer = fig.canvas.get_renderer()
    for ax, (title, events) in zip(axes, schedules.items()):
        ax.set_xlim(0, end * 1.02)
        ax.set_ylim(-0.5, 1.5)
        for row, (name, _) in enumerate(_UNIT_ROWS):
            for e in (e for e in events if e.unit == name):
                ax.barh(1 - row, e.end - e.start, left=e.start, height=0.62,
                        color=STAGE_COLOURS[e.tile % len(STAGE_COLOURS)], edgecolor="white")
                _fit_label(ax, renderer, e, 1 - row)
        total = max(e.end for e in events)
        ax.axvline(total, color="#333333", lw=1, ls="--")
        ax.set_yticks([1, 0], [label for _, label in _UNIT_ROWS])
        ax.set_title(f"{title}: done at {total:g}", fontsize=10, loc="left")
        tidy(ax)
    axes[-1].set_xlabel(unit)
    fig.text(0.98, 1 - 0.12 / fig.get_figheight(), "one consumer warpgroup's steps; colour: the key tile j",
             ha="right", va="top", fontsize=8.5, color="#555555")
    return fig


def _fit_label(ax, renderer, e: OverlapEvent, y: float) -> None:
    """Write the event's name in its box (e.g. P_0V_0); where a box is too narrow for it, only its tile
    number; where even that does not fit, nothing (the colour still tells the tile)."""
    full = _STEP_TEXT[e.step] % ((e.tile, e.tile) if e.step == "PV" else e.tile)
    (x0, _), (x1, _) = ax.transData.transform([(e.start, y), (e.end, y)])
    for text in (full, str(e.tile)):
        t = ax.text((e.start + e.end) / 2, y, text, ha="center", va="center", fontsize=8, color="white")
        if t.get_window_extent(renderer).width <= (x1 - x0) - 4:
            return
        t.remove()


def swizzle_figure(rows: int = 8, *, read_chunk: int = 2):
    """Where the 16-byte chunks of an 8-row, 128-byte-row tile sit in shared memory, without and with
    the 128-byte swizzle (chunk ``c`` of row ``r`` stored at chunk ``c ^ (r % 8)``:
    :func:`lessons.gpu.source.wgmma_swizzle`). Each cell is a physical 16-byte slot (a column of slots is
    one group of 4 of the 32 banks), labelled with the logical chunk it holds; the slots of logical chunk
    ``read_chunk`` in every row, which wgmma or ldmatrix read at once, are outlined. Without the swizzle
    they share one column (an 8-way bank conflict); with it, they fall in 8 different columns.
    Returns a Figure. ValueError for ``rows`` not a positive multiple of 8 or ``read_chunk`` outside 0..7."""
    from matplotlib.patches import Rectangle

    from lessons.gpu.source import wgmma_swizzle

    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 8 or rows % 8:
        raise ValueError(f"rows must be a positive multiple of 8, got {rows!r}")
    if isinstance(read_chunk, bool) or not isinstance(read_chunk, int) or not 0 <= read_chunk < 8:
        raise ValueError(f"read_chunk must be in 0..7, got {read_chunk!r}")
    fig = new_figure((10.5, 0.42 * rows + 1.9))
    for i, (title, swizzled) in enumerate((("as written row by row (no swizzle)", False),
                                           ("128-byte swizzle: chunk c of row r at slot c XOR (r mod 8)", True))):
        def slot_of(r, c):                             # the 16-byte slot of a 128-byte row that holds chunk c
            return (wgmma_swizzle(r, 8 * c, rows, 64) % 128) // 16 if swizzled else c

        ax = fig.add_axes([0.05 + 0.49 * i, 0.15, 0.43, 0.68])
        for r in range(rows):
            for c in range(8):
                slot = slot_of(r, c)
                read = c == read_chunk
                ax.add_patch(Rectangle((slot, r), 1, 1, facecolor="#f6c85f" if read else "#e8e8e8",
                                       edgecolor="white"))
                ax.text(slot + 0.5, r + 0.5, str(c), ha="center", va="center", fontsize=8, color="#222222")
                if c == read_chunk:
                    ax.add_patch(Rectangle((slot + 0.04, r + 0.04), 0.92, 0.92, fill=False, edgecolor="black", lw=2))
        ax.set_xlim(0, 8)
        ax.set_ylim(rows, 0)
        ax.set_xticks([s + 0.5 for s in range(8)], [f"{16 * s}\n{4 * s}-{4 * s + 3}" for s in range(8)],
                      fontsize=7)
        ax.set_yticks([r + 0.5 for r in range(rows)], [str(r) for r in range(rows)], fontsize=8)
        ax.set_xlabel("byte offset in the 128-byte row (above) and the 4 of the 32 banks it uses (below)",
                      fontsize=8)
        ax.set_ylabel("row", fontsize=8)
        slots = {slot_of(r, read_chunk) for r in range(rows)}
        passes = 8 // len(slots)                  # 8 rows' chunks over that many columns of banks
        ax.set_title(f"{title}\nchunk {read_chunk} of rows 0-{rows - 1}: {len(slots)} column"
                     f"{'s' if len(slots) > 1 else ''} of banks, so {passes} pass{'es' if passes > 1 else ''} "
                     f"per 8 rows", fontsize=9, loc="left")
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    return fig

"""Pictures of a real ring run: what each MPI rank did, and when.

Nothing here computes attention: :func:`ring_timeline_figure` draws the timeline that
the ranks recorded (:class:`lessons.distributed.launch.RingRun`, or the same fields read
from ``timeline.json``), and :func:`ring_balance_figure` the work and idle time per rank
of one or more runs. Both return a ``matplotlib.figure.Figure`` (no pyplot state).
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from lessons.views.plot import new_figure
from lessons.views.split_kv import WORKER_COLOURS

__all__ = ["ring_timeline_figure", "ring_balance_figure"]

WAIT_COLOUR = "#4d4d4d"
COMM_COLOUR = "#000000"


def _fields(run):
    if isinstance(run, dict):
        return run["meta"], run["ranks"], run["steps"], bool(run.get("recorded", False))
    return run.meta, run.ranks, run.steps, bool(getattr(run, "recorded", False))


def ring_timeline_figure(run, *, figsize=(11.0, None), dpi=80) -> Figure:
    """One row per rank, time across: compute bars per ring step, waits, and transfers.

    Each compute bar is coloured by the block that travels (the KV block for schedule
    ``kv``, the query block for ``q``) and labelled with its ring step, counted from 1.
    Dark grey: time blocked waiting for a transfer. Black line under a bar: a transfer in
    flight (``kv``: from posting ``Isend``/``Irecv`` to its completion, overlapping the
    compute; ``q``: the ``Sendrecv`` of the query block and its state). The title says
    whether the run is recorded and where it ran. ``run``: a RingRun or a dict with
    ``meta``, ``ranks``, ``steps``. Returns the Figure.
    """
    meta, ranks, steps, recorded = _fields(run)
    ws = int(meta["world_size"])
    height = figsize[1] or 1.6 + 0.55 * ws
    fig = new_figure((figsize[0], height), dpi)
    ax = fig.add_axes([0.08, 0.2 if ws > 2 else 0.28, 0.9, 0.62 if ws > 2 else 0.5])
    moving = "kv_block" if meta["schedule"] == "kv" else "q_block"
    for ev in steps:
        r = ev["rank"]
        a, b = ev["compute"]
        colour = WORKER_COLOURS[ev[moving] % len(WORKER_COLOURS)]
        if ev["work"] > 0:
            ax.barh(r, b - a, left=a, height=0.55, color=colour, edgecolor="white", linewidth=0.5)
        else:
            ax.barh(r, max(b - a, 0), left=a, height=0.55, color="white", edgecolor=colour, hatch="///")
        if ws <= 8 and b - a > 0 and ev["work"] > 0:
            ax.text((a + b) / 2, r, str(ev["step"] + 1), ha="center", va="center", fontsize=7, color="white")
        wa, wb = ev["wait"]
        if wb > wa:
            ax.barh(r, wb - wa, left=wa, height=0.55, color=WAIT_COLOUR, alpha=0.55)
        if ev.get("comm"):
            ca, cb = ev["comm"]
            ax.plot([ca, cb], [r + 0.36, r + 0.36], color=COMM_COLOUR, linewidth=1.2, solid_capstyle="butt")
    ax.set_yticks(range(ws), [f"rank {r}" for r in range(ws)], fontsize=8)
    ax.set_ylim(ws - 0.4, -0.6)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the common start (after a barrier)", fontsize=9)
    ax.tick_params(labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kind = (f"recorded run, {meta['date']}, {meta['host']}" if recorded else f"this run, {meta['host']}")
    what = "KV blocks travel (Isend/Irecv overlap the fold)" if meta["schedule"] == "kv" else \
        "query block + state (m, l, o) travel (Sendrecv after each fold)"
    ax.set_title(f"ring timeline: {ws} ranks, N={meta['n']}, d={meta['d']}, causal={meta['causal']}, "
                 f"split {meta['split']}; {what}\n({kind}; numbers on bars: ring step, from 1)", fontsize=9)
    handles = [Patch(facecolor=WORKER_COLOURS[0], label=f"fold (colour = travelling {moving.replace('_', ' ')})"),
               Patch(facecolor="white", edgecolor="#666666", hatch="///", label="nothing visible (causal skip)"),
               Patch(facecolor=WAIT_COLOUR, alpha=0.55, label="blocked, waiting for the transfer"),
               Patch(facecolor=COMM_COLOUR, label="transfer in flight (line)")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2 if ws > 2 else -0.35), ncol=4,
              frameon=False, fontsize=8)
    return fig


def ring_balance_figure(runs, *, figsize=(11.0, 3.4), dpi=80) -> Figure:
    """Work (scores computed) and time per rank, one panel per run, side by side.

    Bars: each rank's compute seconds (coloured) stacked with its idle seconds (wall
    time of the ring minus compute, grey); the work, in millions of scores, is written
    above. The panel titles give the split and the ratio of the busiest rank's work to
    the least busy's. ``runs``: list of RingRun or dicts. Returns the Figure.
    """
    runs = list(runs)
    fig = new_figure(figsize, dpi)
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    for ax, run in zip(axes, runs):
        meta, ranks, _, recorded = _fields(run)
        r = np.arange(len(ranks))
        busy = np.array([x["compute_s"] for x in ranks])
        idle = np.array([x["idle_s"] for x in ranks])
        work = np.array([x["work"] for x in ranks], dtype=float)
        ax.bar(r, busy, color=[WORKER_COLOURS[i % len(WORKER_COLOURS)] for i in r], label="compute")
        ax.bar(r, idle, bottom=busy, color="#cccccc", label="idle (waiting, sending, skipped)")
        for i in r:
            ax.text(i, busy[i] + idle[i], f"{work[i] / 1e6:.3g}M", ha="center", va="bottom", fontsize=7)
        ratio = work.max() / work.min() if work.min() > 0 else float("inf")
        ax.set_title(f"{meta['split']} split ({'recorded' if recorded else 'this run'}): "
                     f"busiest / least work = {ratio:.2f}", fontsize=9)
        ax.set_xticks(r, [str(i) for i in r], fontsize=8)
        ax.set_xlabel("rank", fontsize=9)
        ax.set_ylabel("seconds", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.margins(y=0.15)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles[:1] + handles[-1:], ["compute (colour = rank)", labels[-1]], frameon=False, fontsize=8,
               loc="lower center", ncol=2)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.27, top=0.86, wspace=0.25)
    return fig

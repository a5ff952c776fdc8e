"""The wave model of the decode split count: modelled time against the split count, one panel per shape."""
from __future__ import annotations

from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullLocator

from lessons.core.checks import check_flag
from lessons.gpu.source import cheaper_than_pick, check_split_sweep, decode_split_terms
from lessons.views.plot import new_figure, tidy

__all__ = ["split_cost_figure"]

#: sweeps of more counts than this are drawn on a log x axis, as a line without a dot per count
_DOTS_UP_TO = 64


def _terms(s: dict, splits: int) -> tuple[int, int]:
    """(waves, pages per block) of ``splits`` splits of the sweep ``s``'s shape."""
    return decode_split_terms(splits, s["blocks_per_split"], s["pages"], s["wave"])


def _waves(s: dict, splits: int) -> int:
    return _terms(s, splits)[0]


def _zoom_panel(ax, s: dict) -> None:
    """The sweep near the least possible time, on a linear axis, one dot per count: the pick's level dashed, the
    counts the model finds cheaper than the pick (all of several waves) in green."""
    splits = sorted(s["costs"])
    ratio = {k: s["costs"][k] / s["bound"] for k in splits}
    level = ratio[s["pick"]]
    ax.plot(splits, [ratio[k] for k in splits], ".", color="#9ecae1", ms=2, zorder=1)
    ax.axhline(level, color="#1f4e99", lw=1, ls="--", zorder=2, label=f"the pick ({s['pick']}): {level:.3f}")
    ax.axhline(1, color="#555555", lw=0.8, ls=":", zorder=0)
    cheaper = cheaper_than_pick(s)
    if cheaper:
        ax.plot(cheaper, [ratio[k] for k in cheaper], "o", color="#2ca02c", ms=3, zorder=3,
                label=f"{len(cheaper)} counts cheaper, all of {min(_waves(s, k) for k in cheaper)}+ waves:\n"
                      f"at most {100 * (1 - s['costs'][s['best']] / s['costs'][s['pick']]):.1f}% under the pick")
    else:
        ax.plot([], [], " ", label="no count is cheaper than the pick")
    ax.plot([s["pick"]], [level], "o", color="#1f4e99", ms=7, zorder=4)
    ax.set_ylim(0.99, 1.12)
    if len(splits) > _DOTS_UP_TO:
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("splits per sequence" + (" (log)" if len(splits) > _DOTS_UP_TO else ""), fontsize=9)
    ax.legend(fontsize=7.5, loc="upper left", frameon=True, facecolor="white", edgecolor="none", framealpha=0.9)
    tidy(ax)


def split_cost_figure(sweeps: dict, *, zoom: bool = False):
    """One panel per decode shape: the modelled time ``waves x pages per block`` of every split count swept, as a
    multiple of the least any count could take (every slot of every wave busy to the end: ``blocks_per_split x
    pages / wave``, the dotted line at 1), on a log axis. Filled: the count the model picks (the most splits
    that fit in one wave); circled in red: one split more, where it spills blocks into a second wave; a green
    diamond: the cheapest count swept (``best``) where it is cheaper than the pick (several waves of few pages).
    A sweep of more than 64 counts (``decode_split_sweep(..., max_splits=pages)``: the full sweep) is drawn on a
    log x axis. ``zoom=True`` adds a row that zooms on the times within 12% of every slot busy (linear axis): the
    pick's level dashed, the counts cheaper than it in green. ``sweeps``: ``{title: the dict lessons.gpu.source.decode_split_sweep returns}`` (at least one).
    Returns a Figure. TypeError for a ``sweeps`` that is not such a dict (naming the key or the missing fields), or
    a ``zoom`` that is not a bool (Python's or NumPy's); ValueError for a sweep whose costs leave out its pick
    (:func:`lessons.gpu.source.check_split_sweep`)."""
    if not isinstance(sweeps, dict) or not sweeps:
        raise TypeError(f"sweeps must be a non-empty dict {{title: decode_split_sweep(...)}}, got {sweeps!r:.80}")
    for t, s in sweeps.items():
        if not isinstance(t, str):
            raise TypeError(f"sweeps must be keyed by titles (str), got the key {t!r}")
        check_split_sweep(s, f"sweeps[{t!r}]")
    zoom = check_flag(zoom, "zoom")
    n = len(sweeps)
    fig = new_figure((4.6 * n, 7.6 if zoom else 4.4))
    rows = 2 if zoom else 1
    axes = [fig.add_subplot(rows, n, 1)]
    axes += [fig.add_subplot(rows, n, i + 1, sharey=axes[0]) for i in range(1, n)]
    top = max(c / s["bound"] for s in sweeps.values() for c in s["costs"].values())
    if zoom:
        fig.subplots_adjust(left=0.08, right=0.98, top=0.87, bottom=0.08, wspace=0.25, hspace=0.45)
        lows = [fig.add_subplot(2, n, n + 1)]
        lows += [fig.add_subplot(2, n, n + i + 1, sharey=lows[0]) for i in range(1, n)]
        for low, s in zip(lows, sweeps.values()):
            _zoom_panel(low, s)
        lows[0].set_ylabel("zoomed: modelled time /\nevery slot busy (linear)", fontsize=9)
    else:
        fig.subplots_adjust(left=0.08, right=0.98, top=0.8, bottom=0.13, wspace=0.25)
    for ax, (title, s) in zip(axes, sweeps.items()):
        splits = sorted(s["costs"])
        ratio = [s["costs"][n] / s["bound"] for n in splits]
        wide = len(splits) > _DOTS_UP_TO
        ax.plot(splits, ratio, "-", color="#9ecae1" if not wide else "#6baed6", lw=1.2 if not wide else 0.7,
                zorder=1)
        if not wide:
            ax.plot(splits, ratio, "o", color="#3182bd", ms=3.5, zorder=2)
        ax.axhline(1, color="#555555", lw=0.8, ls=":", zorder=0)
        pick = s["pick"]
        ax.plot([pick], [s["costs"][pick] / s["bound"]], "o", color="#1f4e99", ms=9, zorder=3,
                label=f"picked: {pick} split{'s' if pick > 1 else ''}, {_waves(s, pick)} wave: "
                      f"{s['costs'][pick]} pages per block")
        more = pick + 1
        if more in s["costs"] and _waves(s, more) > 1:
            blocks = more * s["blocks_per_split"]
            waves = _waves(s, more)
            spill = blocks - (waves - 1) * s["wave"]
            ax.plot([more], [s["costs"][more] / s["bound"]], "o", mfc="none", mec="#d62728", mew=1.8, ms=11,
                    zorder=3, label=f"one more, {more}: {spill} blocks in wave {waves},\n{waves} x "
                    f"{_terms(s, more)[1]} = {s['costs'][more]}"
                    + (" (a tie: the fewer kept)" if s["costs"][more] == s["costs"][pick] else ""))
        best = s["best"]
        if s["costs"][best] < s["costs"][pick]:
            ax.plot([best], [s["costs"][best] / s["bound"]], "D", color="#2ca02c", ms=7, zorder=4,
                    label=f"cheapest: {best}, {_waves(s, best)} waves x {_terms(s, best)[1]} = "
                          f"{s['costs'][best]}\n({100 * (1 - s['costs'][best] / s['costs'][pick]):.1f}% under the pick)")
        ax.set_yscale("log")
        ax.set_ylim(0.9, top * 1.6)
        ax.yaxis.set_major_locator(FixedLocator([t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200) if t < top * 1.6]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        if wide:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("splits per sequence" + (" (log)" if wide else ""), fontsize=9)
        ax.set_title(f"{title}\n{s['blocks_per_split']} blocks per split, {s['pages']:,} pages, "
                     f"a wave of {s['wave']}", fontsize=9)
        ax.legend(fontsize=7.5, loc="upper right", frameon=False)
        tidy(ax)
    axes[0].set_ylabel("modelled time / every slot busy\n(waves x pages per block)", fontsize=9)
    fig.suptitle("Split count from the wave model (lessons.gpu.source.decode_splits): a model, not a measurement",
                 fontsize=10)
    return fig

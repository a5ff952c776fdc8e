"""The wave model of the decode split count: modelled time against the split count, one panel per shape."""
from __future__ import annotations

from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullLocator

from lessons.views.plot import new_figure, tidy

__all__ = ["split_cost_figure"]

_KEYS = ("blocks_per_split", "pages", "wave", "fit", "fill", "pick", "costs", "bound")


def split_cost_figure(sweeps: dict):
    """One panel per decode shape: the modelled time ``waves x pages per block`` of every split count, as a
    multiple of the least any count could take (every slot of every wave busy to the end: ``blocks_per_split x
    pages / wave``), on a log axis; the count the model picks filled, and the fewest splits that fill a wave
    circled in red where they spill into a second wave. ``sweeps``: ``{title: the dict
    lessons.gpu.source.decode_split_sweep returns}`` (at least one). Returns a Figure. TypeError for a
    ``sweeps`` that is not such a dict."""
    if not isinstance(sweeps, dict) or not sweeps or any(
            not isinstance(t, str) or not isinstance(s, dict) or any(k not in s for k in _KEYS)
            for t, s in sweeps.items()):
        raise TypeError(f"sweeps must be a non-empty dict {{title: decode_split_sweep(...)}}, got {sweeps!r}")
    fig = new_figure((4.3 * len(sweeps), 4.1))
    axes = [fig.add_subplot(1, len(sweeps), 1)]
    axes += [fig.add_subplot(1, len(sweeps), i + 1, sharey=axes[0]) for i in range(1, len(sweeps))]
    top = max(c / s["bound"] for s in sweeps.values() for c in s["costs"].values())
    fig.subplots_adjust(left=0.08, right=0.98, top=0.8, bottom=0.13, wspace=0.25)
    for ax, (title, s) in zip(axes, sweeps.items()):
        splits = sorted(s["costs"])
        ratio = [s["costs"][n] / s["bound"] for n in splits]
        ax.plot(splits, ratio, "-", color="#9ecae1", lw=1.2, zorder=1)
        ax.plot(splits, ratio, "o", color="#3182bd", ms=3.5, zorder=2)
        pick = s["pick"]
        ax.plot([pick], [s["costs"][pick] / s["bound"]], "o", color="#1f4e99", ms=9, zorder=3,
                label=f"picked: {pick} split{'s' if pick > 1 else ''}: {s['costs'][pick]} pages per block")
        fill = s["fill"]
        if fill != pick and fill in s["costs"]:
            blocks = fill * s["blocks_per_split"]
            waves = -(-blocks // s["wave"])
            spill = blocks - (waves - 1) * s["wave"]
            ax.plot([fill], [s["costs"][fill] / s["bound"]], "o", mfc="none", mec="#d62728", mew=1.8, ms=11,
                    zorder=3, label=f"{fill} splits: {spill} blocks in wave {waves},\n{waves} x {-(-s['pages'] // fill)} = {s['costs'][fill]}"
                    + (" (a tie: the fewer kept)" if s["costs"][fill] == s["costs"][pick] else ""))
        ax.set_yscale("log")
        ax.set_ylim(0.9, top * 1.6)
        ax.yaxis.set_major_locator(FixedLocator([t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200) if t < top * 1.6]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("splits per sequence", fontsize=9)
        ax.set_title(f"{title}\n{s['blocks_per_split']} blocks per split, {s['pages']:,} pages, "
                     f"a wave of {s['wave']}", fontsize=9)
        ax.legend(fontsize=7.5, loc="upper right", frameon=False)
        tidy(ax)
    axes[0].set_ylabel("modelled time / least possible\n(waves x pages per block)", fontsize=9)
    fig.suptitle("Split count from the wave model (lessons.gpu.source.decode_splits): a model, not a measurement",
                 fontsize=10)
    return fig

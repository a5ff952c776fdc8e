"""Little's law on the decode rungs: K/V read rate against the blocks that run at once (one figure)."""
from __future__ import annotations

from matplotlib.patches import Patch
from matplotlib.ticker import FixedLocator, ScalarFormatter

from lessons.views.plot import count_ranges, new_figure, tidy

__all__ = ["little_figure", "RUNG_STYLES", "decode_step_figure", "DECODE_CLASS_COLOURS"]

#: colour, marker and marker size per decode rung (the later rungs' markers drawn smaller, on top)
RUNG_STYLES = {"paged_decode": ("#bdbdbd", "o", 13), "flash_decoding": ("#6baed6", "s", 7),
               "paged_decode_split": ("#1f4e99", "D", 9), "paged_decode_prefetch": ("#e6550d", "^", 9)}
_LINE_COLOURS = ("#6baed6", "#1f4e99", "#e6550d", "#636363")
_ROOF_COLOURS = ("black", "#1f4e99", "#e6550d", "#636363")


def little_figure(plot: dict, *, label: str | None = None):
    """K/V bytes read per second (TB/s, log) against thread blocks running at once (log) for the decode rungs: a
    dashed Little's-law line per amount of bytes a block keeps in flight (``blocks x bytes / round trip``), the
    recorded rates as markers, and the roofs dotted (the copy rate, the issue ceilings). The line of the fewest
    bytes ends where every SM is full; its rate there is written just right of that end. ``plot``: the dict
    :func:`lessons.gpu.decode_loads.little_plot` returns; ``label``, if given, says where the markers were
    measured (e.g. :data:`lessons.gpu.ladder.RECORDED_LABEL`: machine, date, driver, commit) on a second title
    line. Returns a Figure. TypeError for a ``plot`` that is not such a dict, or a ``label`` that is not a
    non-empty string."""
    keys = ("round_trip", "points", "lines", "roofs")
    if not isinstance(plot, dict) or any(k not in plot for k in keys):
        raise TypeError(f"plot must be the dict little_plot returns (keys {list(keys)}), got {plot!r}")
    if label is not None and (not isinstance(label, str) or not label.strip()):
        raise TypeError(f"label must be a non-empty string saying where the markers were measured, got {label!r}")
    fig = new_figure((10.5, 5.4))
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.08, right=0.62, top=0.91, bottom=0.11)
    for line, colour in zip(plot["lines"], _LINE_COLOURS):
        size = f"{line['bytes'] / 1024:g} KiB" if line["bytes"] >= 1024 else f"{line['bytes']} B"
        ax.plot(line["blocks"], [r / 1e12 for r in line["rates"]], ls="--", lw=1.4, color=colour,
                label=f"Little's law, {size} in flight per block\n({', '.join(line['rungs'])})")
        if line is plot["lines"][0]:     # the fewest bytes: where every SM full still leaves it, at the line's end
            ax.annotate(f"every SM full\n({line['blocks'][-1]} blocks):\n{line['rates'][-1] / 1e12:.2f} TB/s",
                        (line["blocks"][-1], line["rates"][-1] / 1e12), xytext=(5, 0), textcoords="offset points",
                        ha="left", va="center", fontsize=8, color="#3182bd")
    for name, found in plot["points"].items():
        colour, marker, size = RUNG_STYLES.get(name, ("#636363", "o", 8))
        xs, ys = zip(*found)
        ax.plot(xs, [y / 1e12 for y in ys], ls="none", marker=marker, ms=size, color=colour,
                markeredgecolor="black", markeredgewidth=0.6, label=f"{name}, recorded on the H200")
    for (roof, rate), colour in zip(plot["roofs"].items(), _ROOF_COLOURS):
        ax.axhline(rate / 1e12, ls=":", lw=1.6, color=colour, label=f"{roof}: {rate / 1e12:.2f} TB/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    most = max(max(line["blocks"]) for line in plot["lines"])
    ax.set_xlim(0.7, most * 5)                    # room right of the lines' ends for the note on the first one
    lowest = min(min(line["rates"]) for line in plot["lines"])
    ax.set_ylim(lowest / 1e12 / 2, max(list(plot["roofs"].values()) + [lowest]) / 1e12 * 2.5)
    ticks = [1, 4, 16, 64, 256, 1024]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("thread blocks running at once (every block of the launch in one wave)", fontsize=10)
    ax.set_ylabel("K/V read (TB/s)", fontsize=10)
    ax.set_title(f"Little's law: rate = bytes in flight / round trip (at most {plot['round_trip'] * 1e6:.2f} \u00b5s, "
                 "from the page-staging points)" + ("" if label is None else f"\nmarkers: {label}"), fontsize=10,
                 loc="left")
    ax.grid(True, which="major", color="#eeeeee")
    tidy(ax)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, labelspacing=0.9)
    return fig


#: a colour per class of :data:`lessons.gpu.decode_loads.DECODE_CLASSES`
DECODE_CLASS_COLOURS = {"multiply-adds": "#1f4e99", "16-bit to float32": "#6baed6", "other float": "#fdae6b",
                        "exponentials": "#e6550d", "K/V loads, copies and table look-ups": "#31a354", "shuffles": "#9e9ac8",
                        "register moves": "#bdbdbd", "branches and convergence": "#d9d9d9",
                        "integer and address": "#737373"}


def decode_step_figure(table):
    """One horizontal bar per decode rung whose loop is a whole step (rows of
    :func:`lessons.gpu.decode_loads.decode_loop_table` with an issue ceiling): its instructions per step and warp,
    split by ``step_classes``, each part labelled with its count where it is wide enough, and the issue ceiling the
    total allows written at the bar's end. Each class's legend entry gives its count per step (the fewest-the most
    where the rungs differ; :func:`lessons.views.plot.count_ranges`), so a part too thin to see still reads.
    Returns a Figure. TypeError naming ``table`` for rows of another kind;
    ValueError when no row has an issue ceiling."""
    from lessons.gpu.sass import _check_table

    _check_table(table, "decode_loop_table", ("rung", "step_classes", "step_instructions", "issue_ceiling"),
                 "step_classes")
    rows = [r for r in table if r["issue_ceiling"] is not None]
    if not rows:
        raise ValueError("table must hold a rung whose loop is a whole step (an issue ceiling), got only page-staging rungs")
    fig = new_figure((10.5, 1.9 + 0.75 * len(rows)))
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.19, right=0.97, top=1 - 0.45 / fig.get_figheight(), bottom=1.35 / fig.get_figheight())
    names = [n for n in DECODE_CLASS_COLOURS if any(r["step_classes"].get(n) for r in rows)]
    names += [n for r in rows for n in r["step_classes"] if n not in names and r["step_classes"][n]]
    counts = count_ranges([r["step_classes"] for r in rows])     # in the legend: a class too thin to see still reads
    for y, r in enumerate(reversed(rows)):
        left = 0.0
        for n in names:
            width = r["step_classes"].get(n, 0)
            if not width:
                continue
            ax.barh(y, width, 0.6, left=left, color=DECODE_CLASS_COLOURS.get(n, "#ffffff"), edgecolor="white",
                    lw=0.5)
            if width >= 25:
                dark = n in ("multiply-adds", "integer and address")
                ax.text(left + width / 2, y, f"{width:.0f}", ha="center", va="center", fontsize=8,
                        color="white" if dark else "black")
            left += width
        ax.text(left + 8, y, f"{r['step_instructions']:.0f} per step: at most {r['issue_ceiling'] / 1e12:.2f} TB/s",
                va="center", fontsize=9)
    ax.set_yticks(range(len(rows)), [r["rung"] for r in reversed(rows)], fontsize=9)
    ax.set_xlim(0, max(r["step_instructions"] for r in rows) * 1.45)
    ax.set_xlabel("instructions one warp issues per step (4 keys: 4 KiB of K and V)", fontsize=10)
    ax.set_title("What a decode step issues, from its SASS", fontsize=11)
    tidy(ax)
    fig.legend(handles=[Patch(color=DECODE_CLASS_COLOURS.get(n, "#ffffff"), label=f"{n} ({counts[n]})") for n in names],
               fontsize=8, ncol=3, loc="lower center", bbox_to_anchor=(0.55, 0.0), frameon=False,
               title="instructions per step by class (where the rungs differ: the fewest-the most)", title_fontsize=8)
    return fig

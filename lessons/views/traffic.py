"""Pictures for the IO-awareness lesson: HBM traffic, measured peak memory, a roofline.

Every number drawn comes from :mod:`lessons.cost.traffic` (counts walked from the
schedules, memory measured with tracemalloc); these functions only draw.
Plain matplotlib Figures (no pyplot state).
"""
from __future__ import annotations

import numpy as np

from lessons.core.checks import check_int_sequence
from lessons.views.plot import new_figure, tidy
from lessons.cost.traffic import H200, PeakMemory, RooflinePoint, compare_traffic

__all__ = ["TEXTBOOK_COLOUR", "FLASH_COLOUR", "FA1_COLOUR", "traffic_figure", "peak_memory_figure", "roofline_figure"]

TEXTBOOK_COLOUR = "#c44e52"
FLASH_COLOUR = "#1f77b4"
FA1_COLOUR = "#8c6bb1"
_MIB = 2 ** 20


def traffic_figure(ns, d=64, *, m_bytes=H200.sram_bytes, element_size=2):
    """HBM bytes and FLOPs of textbook attention and both flash loop orders against N (log-log), two panels.

    ``ns``: increasing ints >= 1; ``d``, ``m_bytes``, ``element_size`` as in
    :func:`lessons.cost.traffic.compare_traffic` (FA-2 and FA-1 at the same block sizes).
    Left: bytes moved to and from HBM, textbook (Dao et al. 2022, Alg. 0), FA-2 (Dao 2023,
    Alg. 1, the order of this series' kernels; the headline) and FA-1 (Dao et al. 2022,
    Alg. 1, dashed); right: matmul FLOPs, the same for all three. Returns a Figure.
    Raises TypeError / ValueError naming ``ns`` unless it is a non-empty, increasing sequence
    of ints >= 1, and what :func:`lessons.cost.traffic.compare_traffic` raises.
    """
    ns = check_int_sequence(ns, "ns", min=1)
    if any(b <= a for a, b in zip(ns, ns[1:])):
        raise ValueError(f"ns must increase, got {ns}")
    rows = [compare_traffic(n, d, m_bytes=m_bytes, element_size=element_size) for n in ns]
    text, fa2, fa1 = ([getattr(r, a) for r in rows] for a in ("textbook", "fa2", "fa1"))
    fig = new_figure((10.0, 4.1))
    ax, axf = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.14, top=0.80, wspace=0.28)
    sizes = f"Br={fa2[-1].block_q}, Bc={fa2[-1].block_k}"
    series = ((text, TEXTBOOK_COLOUR, "-", 4, 0.5, "textbook (Alg. 0)"),
              (fa2, FLASH_COLOUR, "-", 1.8, 1.0, f"flash, FA-2 order ({sizes}): our kernels"),
              (fa1, FA1_COLOUR, "--", 1.5, 1.0, "flash, FA-1 order (same blocks)"))
    for counts, colour, ls, lw, alpha, name in series:
        ax.loglog(ns, [c.hbm_bytes for c in counts], marker="o", color=colour, ls=ls, label=name)
        axf.loglog(ns, [c.flops for c in counts], marker="o", color=colour, ls=ls, label=name, lw=lw, alpha=alpha)
    x = ns[-1] * 1.12
    ax.annotate("", (x, fa2[-1].hbm_bytes), xytext=(x, text[-1].hbm_bytes),
                arrowprops=dict(arrowstyle="<->", color="#555555", lw=1.0))
    ax.text(0.98, 0.04, f"at N = {ns[-1]}: FA-2 {rows[-1].fa2_saving:.1f}x fewer bytes (arrow),\n"
                        f"FA-1 {rows[-1].fa1_saving:.1f}x fewer", transform=ax.transAxes,
            ha="right", va="bottom", fontsize=9, color="#333333")
    ax.set_xlabel("sequence length N", fontsize=10)
    ax.set_ylabel("HBM bytes read + written", fontsize=10)
    ax.set_title("memory traffic", fontsize=10.5, loc="left")
    axf.set_xlabel("sequence length N", fontsize=10)
    axf.set_ylabel("FLOPs (QKᵀ and PV)", fontsize=10)
    axf.set_title("arithmetic: identical (4 N² d)", fontsize=10.5, loc="left")
    for a in (ax, axf):
        a.legend(fontsize=8.5, frameon=False, loc="upper left")
        tidy(a)
    fig.suptitle(f"One head, d = {d}, {element_size}-byte elements, on-chip memory M = {m_bytes // 1024} KiB",
                 fontsize=11, x=0.08, ha="left")
    return fig


def peak_memory_figure(result):
    """Measured peak memory against N on log axes, with the fitted log-log slopes.

    ``result``: a :class:`lessons.cost.traffic.PeakMemory` from :func:`lessons.cost.traffic.measure_peak_memory`.
    Also draws the size of one (N, N) score matrix for reference. Returns a Figure.
    """
    if not isinstance(result, PeakMemory):
        raise TypeError(f"result must be a PeakMemory, got {type(result).__name__}")
    ns = np.asarray(result.ns, dtype=float)
    fig = new_figure((8.2, 4.6))
    ax = fig.add_axes([0.1, 0.12, 0.57, 0.76])
    grid = np.geomspace(ns.min(), ns.max(), 50)
    for ys, colour, name, slope in ((result.textbook_bytes, TEXTBOOK_COLOUR, "textbook", result.textbook_slope),
                                    (result.flash_bytes, FLASH_COLOUR, "flash", result.flash_slope)):
        ys = np.asarray(ys, dtype=float) / _MIB
        ax.loglog(ns, ys, ls="none", marker="o", ms=7, color=colour, label=f"{name}: measured")
        c = np.exp(np.mean(np.log(ys) - slope * np.log(ns)))          # the fitted line through the points
        ax.loglog(grid, c * grid ** slope, color=colour, lw=1.3, label=f"{name}: fit, slope {slope:.2f}")
        for n, y in zip(ns, ys):
            ax.annotate(f"{y:.3g} MiB", (n, y), xytext=(6, -12 if name == "flash" else 6),
                        textcoords="offset points", fontsize=8.5, color=colour)
    a, b = result.flash_linear_fit
    ax.loglog(grid, (a + b * grid) / _MIB, color=FLASH_COLOUR, lw=1.0, ls=":",
              label=f"flash: {a / 1024:.0f} KiB + {b:.0f} B/token")
    ax.loglog(ns, np.asarray(result.score_bytes) / _MIB, ls="--", color="#888888", lw=1,
              label="one N×N score matrix")
    ax.set_xticks(ns, [str(int(n)) for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N", fontsize=10)
    ax.set_ylabel("peak memory during the call (MiB)", fontsize=10)
    ax.set_title(f"NumPy, d = {result.d}, {result.dtype}, flash tiles {result.block_q}×{result.tile}",
                 fontsize=10.5, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=9)
    tidy(ax)
    return fig


def roofline_figure(points, hardware=H200):
    """A roofline (attainable FLOP/s against arithmetic intensity, log-log) with the algorithms on it.

    Colours: textbook red, FA-2 loop order blue, FA-1 loop order purple.

    ``points``: :class:`lessons.cost.traffic.RooflinePoint` list from :func:`lessons.cost.traffic.roofline_points`;
    ``hardware``: the :class:`lessons.cost.traffic.Hardware` they were placed on. One roof per
    precision present; each point sits on its precision's roof. Returns a Figure.
    """
    points = list(points)
    if not points or not all(isinstance(p, RooflinePoint) for p in points):
        raise TypeError("points must be a non-empty list of RooflinePoint")
    precisions = list(dict.fromkeys(p.precision for p in points))
    fig = new_figure((10.4, 5.2))
    ax = fig.add_axes([0.08, 0.11, 0.55, 0.8])
    xs = np.geomspace(1, 2000, 200)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(2e12, 3e15)
    styles = {"bf16": "-", "fp32": "--", "fp16": "-."}
    for prec in precisions:
        roof = np.minimum(hardware.peak_flops[prec], hardware.hbm_bytes_per_s * xs)
        ax.loglog(xs, roof, color="#444444", ls=styles.get(prec, "-"), lw=1.4)
        ridge = hardware.ridge(prec)
        ax.annotate(f"{prec} peak {hardware.peak_flops[prec] / 1e12:.0f} TFLOP/s\n(ridge {ridge:.0f} FLOP/B)",
                    (xs[-1], hardware.peak_flops[prec]), xytext=(-4, 4), textcoords="offset points",
                    ha="right", va="bottom", fontsize=8.5, color="#444444")
    p0, p1 = ax.transData.transform([(2.0, hardware.hbm_bytes_per_s * 2.0), (20.0, hardware.hbm_bytes_per_s * 20.0)])
    angle = float(np.degrees(np.arctan2(p1[1] - p0[1], p1[0] - p0[0])))   # the roof's slope on screen
    ax.annotate(f"HBM {hardware.hbm_bytes_per_s / 1e12:.1f} TB/s", (3, hardware.hbm_bytes_per_s * 3),
                rotation=angle, rotation_mode="anchor", fontsize=8.5, color="#444444", xytext=(0, 6),
                textcoords="offset points")
    markers = {64: "o", 128: "s"}
    for p in points:
        colour = {"textbook": TEXTBOOK_COLOUR, "flash-fa1": FA1_COLOUR}.get(p.count.algorithm, FLASH_COLOUR)
        filled = p.precision == precisions[0]
        fa2 = p.count.algorithm == "flash-fa2"          # drawn smaller and on top: it can sit on another point
        ax.loglog([p.intensity], [p.attainable], ls="none", marker=markers.get(p.count.d, "D"), ms=7 if fa2 else 9,
                  mfc=colour if filled else "white", mec=colour, mew=1.8, zorder=4 if fa2 else 3,
                  label=f"{p.label}: {p.intensity:.0f} FLOP/B ({p.bound})")
    ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte)", fontsize=10)
    ax.set_ylabel("attainable FLOP/s", fontsize=10)
    n = points[0].count.n
    ax.set_title(f"{hardware.name}, attention forward at N = {n} (one head)", fontsize=10.5, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=8.5,
              title="red: textbook, blue: flash FA-2 order, purple: FA-1 order\ncircle: d=64, square: d=128\n"
                    f"filled: {precisions[0]}" + (f", open: {', '.join(precisions[1:])}" if len(precisions) > 1 else ""),
              title_fontsize=8.5)
    ax.grid(True, which="major", color="#eeeeee", lw=0.6)
    tidy(ax)
    return fig



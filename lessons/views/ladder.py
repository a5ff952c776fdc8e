"""Pictures for the kernel ladder: each rung on the H200 roofline, and its measured speed.

The numbers come from :mod:`lessons.gpu.ladder` (the IO model of :mod:`lessons.cost.traffic`
for the intensities, a recorded or live GPU run for the TFLOP/s); these functions only draw.
"""
from __future__ import annotations

import numpy as np

from lessons.cost.traffic import H200
from lessons.views.plot import new_figure, tidy

__all__ = ["RUNG_COLOURS", "ladder_figure"]

RUNG_COLOURS = {"naive": "#c44e52", "scalar": "#1f77b4", "regtile": "#17becf", "regtile_wide": "#9edae5",
                "mma": "#8c564b", "mma_async": "#9467bd", "mma_fa2": "#ff7f0e", "mma_fa2_lazy": "#bcbd22",
                "mma_fa2_wide": "#7f7f7f", "mma_fa2_lean": "#dbdb8d", "wgmma": "#e377c2", "sdpa": "#2ca02c"}


def _side_by_side(points, *, clash: float = 0.13, step: float = 0.1) -> list[float]:
    """The x at which to draw each of ``points`` (dicts with name, intensity and tflops, all measured) on the
    log-log roofline: its intensity, except where markers of different rungs at one intensity (within 1%) lie
    within ``clash`` decades of TFLOP/s of each other, so that one would hide the other: those rungs are set side
    by side, ``step`` decades of intensity apart in the order given and centred on their intensity. Only the
    drawing moves; the values stay what was measured."""
    shown = [p["intensity"] for p in points]
    groups: list[list[int]] = []                       # indices of the points at one intensity
    for i, p in enumerate(points):
        group = next((g for g in groups if abs(points[g[0]]["intensity"] / p["intensity"] - 1) < 0.01), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    for group in groups:
        names = list(dict.fromkeys(points[i]["name"] for i in group))
        apart = [n for n in names if any(points[i]["name"] == n != points[j]["name"]
                                         and abs(np.log10(points[i]["tflops"] / points[j]["tflops"])) < clash
                                         for i in group for j in group)]
        for k, name in enumerate(apart):
            factor = 10 ** (step * (k - (len(apart) - 1) / 2))
            for i in group:
                if points[i]["name"] == name:
                    shown[i] = points[i]["intensity"] * factor
    return shown


def ladder_figure(points, *, label: str, hardware=H200):
    """Two panels: left, each measured rung at (intensity, measured FLOP/s) under the roofs of
    ``hardware`` (filled circle d = 64, open square d = 128, so that a circle inside a square stays
    visible; a rung's dtype picks its roof; where markers of different rungs at one intensity would hide each
    other, those rungs are drawn side by side around it, a small step apart on the x axis, their TFLOP/s
    unchanged); right, measured
    TFLOP/s per rung and head dim (log scale), unmeasured rungs marked as such.

    ``points``: dicts from :func:`lessons.gpu.ladder.ladder_points`; ``label``: where the numbers
    come from (e.g. :data:`lessons.gpu.ladder.RECORDED_LABEL`), printed in the title.
    Returns a Figure. Raises ValueError for an empty ``points``.
    """
    points = list(points)
    if not points:
        raise ValueError("points must not be empty")
    fig = new_figure((12.5, 5.0))
    ax = fig.add_axes([0.06, 0.12, 0.37, 0.74])
    xs = np.geomspace(4, 400, 200)
    for prec, ls in (("bf16", "-"), ("fp32", "--")):
        roof = np.minimum(hardware.peak_flops[prec], hardware.hbm_bytes_per_s * xs) / 1e12
        ax.loglog(xs, roof, color="#444444", ls=ls, lw=1.3)
        name = "fp16/bf16 tensor cores" if prec == "bf16" else "fp32 CUDA cores"
        ax.annotate(f"{name} {hardware.peak_flops[prec] / 1e12:.0f} TFLOP/s", (xs[-1], hardware.peak_flops[prec] / 1e12),
                    xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom", fontsize=8, color="#444444")
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(3, 2000)
    (x0, y0), (x1, y1) = ax.transData.transform([(5.0, hardware.hbm_bytes_per_s * 5.0 / 1e12),
                                                 (10.0, hardware.hbm_bytes_per_s * 10.0 / 1e12)])
    ax.annotate(f"HBM {hardware.hbm_bytes_per_s / 1e12:.1f} TB/s", (5.0, hardware.hbm_bytes_per_s * 5.0 / 1e12),
                xytext=(0, 4), textcoords="offset points", ha="left", va="bottom", fontsize=8, color="#444444",
                rotation=np.degrees(np.arctan2(y1 - y0, x1 - x0)), rotation_mode="anchor")   # along the roof
    markers = {64: "o", 128: "s"}
    measured = [p for p in points if p["tflops"] is not None]
    for p, x in zip(measured, _side_by_side(measured)):
        colour = RUNG_COLOURS.get(p["name"], "k")
        ax.loglog([x], [p["tflops"]], ls="none", marker=markers.get(p["d"], "D"),
                  ms=7 if p["d"] == 64 else 11, color=colour, mew=2,
                  mfc=colour if p["d"] == 64 else "none", zorder=3 if p["d"] == 64 else 2)
    ax.set_xlim(xs[0], xs[-1])
    ax.set_ylim(3, 2000)
    ax.set_xlabel("arithmetic intensity (FLOPs per HBM byte, IO model)", fontsize=9.5)
    ax.set_ylabel("TFLOP/s", fontsize=9.5)
    ax.set_title("rungs under the roofs (dot d = 64, open square d = 128; colours as on the right;\n"
                 "rungs that would hide each other at one intensity set side by side around it)", fontsize=9.5,
                 loc="left")
    ax.grid(True, which="major", color="#eeeeee", lw=0.6)
    tidy(ax)

    bx = fig.add_axes([0.655, 0.12, 0.33, 0.74])
    names = list(dict.fromkeys(p["name"] for p in points))
    titles = {p["name"]: p["title"] for p in points}
    ds = sorted({p["d"] for p in points})
    height = 0.8 / len(ds)
    for i, d in enumerate(ds):
        for j, name in enumerate(names):
            p = next((q for q in points if q["name"] == name and q["d"] == d), None)
            y = j + (i - (len(ds) - 1) / 2) * height
            if p is None or p["tflops"] is None:
                bx.text(1.1, y, f"d={d}: not yet measured on a GPU", va="center", fontsize=7.5, color="#777777")
                continue
            bx.barh(y, p["tflops"], height=height * 0.9, color=RUNG_COLOURS.get(name, "k"),
                    alpha=1.0 if d == ds[0] else 0.55)
            bx.text(p["tflops"] * 1.08, y, f"d={d}: {p['tflops']:.1f}", va="center", fontsize=7.5)
    bx.set_xscale("log")
    bx.set_xlim(1, 3000)
    bx.set_yticks(range(len(names)), [titles[n] for n in names], fontsize=8)
    bx.invert_yaxis()
    bx.set_xlabel("TFLOP/s (4 N^2 d per head)", fontsize=9.5)
    bx.set_title("measured speed per rung", fontsize=9.5, loc="left")
    tidy(bx)
    fig.suptitle(f"The kernel ladder, attention forward, N = 8192, 8 heads: {label}", fontsize=10.5, x=0.02,
                 ha="left")
    return fig

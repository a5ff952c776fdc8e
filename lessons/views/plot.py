"""Small matplotlib helpers shared by the figure modules (no pyplot, so no global state)."""
from __future__ import annotations

import math
import numbers

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(figsize, dpi=100) -> Figure:
    """A Figure of ``figsize`` inches at ``dpi`` with an Agg canvas attached (renders to PNG without pyplot)."""
    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig


def tidy(ax) -> None:
    """Hide the top and right spines and use 9-point tick labels."""
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(labelsize=9)


def count_ranges(rows, *, unit: str = "", plural: str | None = None) -> dict[str, str]:
    """Each class's count over ``rows``, written for its legend entry, so that a class whose bar is too thin to see
    (or to hold its number) still says how much it takes. ``rows``: a sequence of dicts class name -> count (a
    non-negative real, e.g. clocks or instructions per step; 0 means the row has none of that class). Returns a dict
    class name -> text, for each class some row counts above 0, in the order the rows first name them: the count
    rounded to a whole number (``"12"``) where those rows agree, else the least and the most (``"72-121"``), then
    ``unit`` after a space where given: ``plural`` (default ``unit + "s"``) unless the one count rounds to 1
    (``"1 clock"``, ``"25-29 clocks"``). TypeError naming ``rows`` for rows that are not a sequence of dicts of
    real counts, or naming ``unit`` / ``plural`` for one that is not a string; ValueError naming the row and class
    for a count that is negative or not finite."""
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, dict) for r in rows):
        raise TypeError(f"rows must be a list of dicts class name -> count, got {rows!r}")
    for name, value in (("unit", unit), ("plural", "" if plural is None else plural)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string, got {value!r}")
    spans: dict[str, tuple[float, float]] = {}
    for i, row in enumerate(rows):
        for name, count in row.items():
            if isinstance(count, (bool, np.bool_)) or not isinstance(count, numbers.Real):
                raise TypeError(f"rows[{i}][{name!r}] must be a real count, got {count!r}")
            if not math.isfinite(count) or count < 0:
                raise ValueError(f"rows[{i}][{name!r}] must be a finite count of at least 0, got {count!r}")
            if count:
                lo, hi = spans.get(name, (count, count))
                spans[name] = (min(lo, count), max(hi, count))
    many = (unit + "s" if unit else "") if plural is None else plural
    out = {}
    for name, (lo, hi) in spans.items():
        if round(lo) == round(hi):
            text, word = f"{lo:.0f}", unit if round(lo) == 1 else many
        else:
            text, word = f"{lo:.0f}-{hi:.0f}", many
        out[name] = f"{text} {word}" if word else text
    return out

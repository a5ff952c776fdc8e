"""Small matplotlib helpers shared by the figure modules (no pyplot, so no global state)."""
from __future__ import annotations

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

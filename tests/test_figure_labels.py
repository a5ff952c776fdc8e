"""Figures of the recorded GPU runs stay readable: their text does not overlap once drawn."""
import matplotlib

matplotlib.use("Agg")

import itertools

import pytest


def _overlaps(texts, renderer):
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text()]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def test_backward_figure_end_labels_do_not_overlap():
    from lessons.gpu.recorded import recorded_backward
    from lessons.views.backward import recorded_backward_figure

    fig = recorded_backward_figure(recorded_backward())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.get_axes():
        # one label per implementation at N = 8192; the recorded run has 24 and 40 MiB side by side
        assert len(ax.texts) == 4
        assert _overlaps(ax.texts, renderer) == []


def test_end_labels_keep_far_apart_labels_at_their_points_and_spread_close_ones():
    import matplotlib.pyplot as plt

    from lessons.views.backward import _end_labels

    fig, ax = plt.subplots(figsize=(4, 4), dpi=72)
    ax.set_yscale("log")
    ax.set_ylim(1, 1e4)
    ax.set_xlim(0, 2)
    _end_labels(ax, [(1, 10.0, "a", "k"), (1, 10.0, "b", "k"), (1, 1000.0, "c", "k")], gap=10)
    offsets = {t.get_text(): t.xyann[1] for t in ax.texts}
    # a and b sit on the same point: spread 10 points apart, centred on it; c is far away and stays put
    assert offsets["a"] == pytest.approx(-5) and offsets["b"] == pytest.approx(5)
    assert offsets["c"] == pytest.approx(0)
    plt.close(fig)

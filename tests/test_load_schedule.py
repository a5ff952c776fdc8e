"""The decode loop's loads in flight, with and without prefetch (lessons.cost.latency), against hand-worked
timelines, and its picture (lessons.views.pipeline.prefetch_figure)."""
import pytest

from lessons.cost.latency import load_schedule


def _bars(events, who):
    return [(e.tile, e.stage, e.start, e.end) for e in events if e.who == who]


def test_without_prefetch_nothing_overlaps():
    # latency 3, compute 1: step j's loads from 4j to 4j + 3, its absorb from 4j + 3 to 4j + 4
    ev = load_schedule(3, latency=3, compute=1)
    assert _bars(ev, "producer") == [(0, 0, 0, 3), (1, 0, 4, 7), (2, 0, 8, 11)]
    assert _bars(ev, "consumers") == [(0, 0, 3, 4), (1, 0, 7, 8), (2, 0, 11, 12)]


def test_with_prefetch_two_steps_of_loads_are_in_flight():
    # worked by hand: steps 0 and 1 issued at 0 (prologue, top of iteration 0), land at 3; absorb 0 [3, 4],
    # then step 2 issued at 4 (top of iteration 1), absorb 1 [4, 5]; step 3 issued at 5, lands at 8;
    # step 2 lands at 7: absorb 2 [7, 8], absorb 3 [8, 9]. 9 in all against 16 without prefetch
    ev = load_schedule(4, latency=3, compute=1, prefetch=True)
    assert _bars(ev, "producer") == [(0, 0, 0, 3), (1, 1, 0, 3), (2, 0, 4, 7), (3, 1, 5, 8)]
    assert _bars(ev, "consumers") == [(0, 0, 3, 4), (1, 1, 4, 5), (2, 0, 7, 8), (3, 1, 8, 9)]
    assert max(e.end for e in load_schedule(4, latency=3, compute=1)) == 16


@pytest.mark.parametrize("latency, compute", [(3.0, 1.0), (5.0, 2.0), (1.0, 1.0), (1.0, 4.0), (2.5, 0.5)])
def test_totals_follow_the_closed_forms(latency, compute):
    for n in (1, 2, 5, 8):
        plain = max(e.end for e in load_schedule(n, latency=latency, compute=compute))
        assert plain == pytest.approx(n * (latency + compute))
        ahead = max(e.end for e in load_schedule(n, latency=latency, compute=compute, prefetch=True))
        if latency >= compute:           # pairs of steps every latency + compute, the last pair maybe alone
            assert ahead == pytest.approx(((n + 1) // 2) * (latency + compute) + (compute if n % 2 == 0 else 0))
        else:                            # compute-bound: the loads hide behind the absorbs after the first
            assert ahead == pytest.approx(latency + n * compute)
        # each absorb waits for its own loads and for the absorb before it
        ev = load_schedule(n, latency=latency, compute=compute, prefetch=True)
        loads, work = _bars(ev, "producer"), _bars(ev, "consumers")
        for j in range(n):
            assert work[j][2] >= loads[j][3]
            assert j == 0 or work[j][2] >= work[j - 1][3]
            assert j < 2 or loads[j][2] >= work[j - 2][3]        # a register set is reused once it was absorbed


def test_no_steps_and_bad_arguments():
    assert load_schedule(0) == [] and load_schedule(0, prefetch=True) == []
    with pytest.raises(ValueError, match="n_steps"):
        load_schedule(-1)
    with pytest.raises(TypeError, match="n_steps"):
        load_schedule(2.0)
    with pytest.raises(ValueError, match="latency"):
        load_schedule(2, latency=0)
    with pytest.raises(TypeError, match="compute"):
        load_schedule(2, compute="1")
    with pytest.raises(TypeError, match="prefetch"):
        load_schedule(2, prefetch=1)


def test_the_prefetch_picture_draws_each_step_once_per_lane():
    from lessons.views.pipeline import pipeline_figure, prefetch_figure

    fig = prefetch_figure(4, latency=3, compute=1)
    plain_ax, ahead_ax = fig.axes[:2]
    assert "all steps done at 16" in plain_ax.get_title(loc="left")
    assert "all steps done at 9" in ahead_ax.get_title(loc="left")
    for ax, prefetch in ((plain_ax, False), (ahead_ax, True)):
        events = load_schedule(4, latency=3, compute=1, prefetch=prefetch)
        bars = sorted((round(p.get_x(), 6), round(p.get_width(), 6)) for p in ax.patches)
        assert bars == sorted((e.start, e.end - e.start) for e in events)
    # the two sets of loads in flight at once sit on two sub-rows, not on top of each other
    loads = sorted((round(p.get_x(), 6), round(p.get_y(), 6)) for p in ahead_ax.patches if p.get_y() > 0.5)
    assert loads[0][0] == loads[1][0] == 0 and loads[0][1] != loads[1][1]
    with pytest.raises(TypeError, match="lanes"):
        pipeline_figure({"x": load_schedule(2)}, lanes=("only one",))


def test_the_prefetch_picture_needs_a_step_and_says_so():
    # load_schedule(0) is an empty schedule; the picture of it would have no bars, so prefetch_figure refuses
    # n_steps = 0 itself, naming the argument (not an internal schedule title)
    from lessons.views.pipeline import prefetch_figure

    with pytest.raises(ValueError, match="n_steps"):
        prefetch_figure(0)
    with pytest.raises(TypeError, match="n_steps"):
        prefetch_figure(2.0)
    fig = prefetch_figure(1, latency=3, compute=1)
    assert "all steps done at 4" in fig.axes[1].get_title(loc="left")


def test_a_ring_of_three_keeps_three_steps_of_loads_in_flight():
    # worked by hand, latency 3, compute 1: steps 0, 1, 2 issued at 0 (the prologue's two and the top of iteration
    # 0), land at 3; absorbs 0 [3, 4], 1 [4, 5], 2 [5, 6]; step 3 issued when absorb 0 ends (4), lands at 7:
    # absorb 3 [7, 8]. 8 in all (prefetch: 9, plain: 16)
    ev = load_schedule(4, latency=3, compute=1, stages=3)
    assert _bars(ev, "producer") == [(0, 0, 0, 3), (1, 1, 0, 3), (2, 2, 0, 3), (3, 0, 4, 7)]
    assert _bars(ev, "consumers") == [(0, 0, 3, 4), (1, 1, 4, 5), (2, 2, 5, 6), (3, 0, 7, 8)]
    # stages 1 and 2 are the plain loop and prefetch, bar for bar
    for n in (1, 3, 6):
        assert load_schedule(n, latency=2.5, compute=1, stages=1) == load_schedule(n, latency=2.5, compute=1)
        assert load_schedule(n, latency=2.5, compute=1, stages=2) == load_schedule(n, latency=2.5, compute=1,
                                                                                   prefetch=True)
    # a slot is reused only once the step before in it was absorbed
    ev = load_schedule(9, latency=5, compute=1, stages=3)
    loads, work = _bars(ev, "producer"), _bars(ev, "consumers")
    assert all(loads[j][2] >= work[j - 3][3] for j in range(3, 9))
    with pytest.raises(ValueError, match="not both"):
        load_schedule(2, prefetch=True, stages=3)
    with pytest.raises(ValueError, match="stages"):
        load_schedule(2, stages=0)
    with pytest.raises(TypeError, match="stages"):
        load_schedule(2, stages=True)


def test_the_picture_has_a_panel_for_the_ring():
    from lessons.views.pipeline import prefetch_figure

    fig = prefetch_figure(4, latency=3, compute=1)
    ring_ax = fig.axes[2]
    assert "cp.async" in ring_ax.get_title() + ring_ax.get_title(loc="left")
    assert "all steps done at 8" in ring_ax.get_title(loc="left")

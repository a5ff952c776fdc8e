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


# ---------------------------------------------------------------------------
# notebooks 06 and 10: the ladder figure's roofs, torch's backends, the decode table
# ---------------------------------------------------------------------------

def test_ladder_figure_names_every_roof():
    from lessons.cost.traffic import H200
    from lessons.gpu import ladder
    from lessons.views.ladder import ladder_figure

    fig = ladder_figure(ladder.ladder_points(8192, (64, 128)), label=ladder.RECORDED_LABEL)
    roofline = fig.get_axes()[0]
    texts = [t.get_text() for t in roofline.texts]
    assert f"HBM {H200.hbm_bytes_per_s / 1e12:.1f} TB/s" in texts
    assert sum("TFLOP/s" in t for t in texts) == 2                       # the two compute roofs
    fig.canvas.draw()
    assert _overlaps(roofline.texts, fig.canvas.get_renderer()) == []


def test_sdpa_backends_reads_the_recorded_file_line_by_line():
    from lessons.gpu import ladder

    lines = (ladder.PROFILED_DIR / "sdpa_backends.txt").read_text().splitlines()
    want = {}
    for line in lines[1:]:                                # header: torch version and device
        w = line.split()
        if w[0] == "N=8192" and w[2] == "causal=False":
            want.setdefault(w[3], {})[int(w[1][2:])] = float(w[7])
    got = ladder.sdpa_backends()
    assert got == want and set(got) == {"CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"}
    # the FLOP count agrees with the ladder's (4 N^2 d per head, 8 heads) given the recorded time
    fa2_64 = next(line for line in lines if line.startswith("N=8192 d=64 causal=False FLASH_ATTENTION"))
    ms = float(fa2_64.split()[5])
    assert got["FLASH_ATTENTION"][64] == pytest.approx(ladder.attention_flops(8192, 64, 8) / (ms * 1e-3) / 1e12,
                                                       rel=2e-3)
    assert set(ladder.sdpa_backends(causal=True)["CUDNN_ATTENTION"]) == {64}


def test_sdpa_backends_rejects_what_it_cannot_answer(tmp_path):
    from lessons.gpu import ladder

    with pytest.raises(ValueError, match="no row with N = 1000"):
        ladder.sdpa_backends(n=1000)
    with pytest.raises(TypeError, match="causal"):
        ladder.sdpa_backends(causal="no")
    with pytest.raises(TypeError, match="n must be an int"):
        ladder.sdpa_backends(n=8192.0)
    with pytest.raises(FileNotFoundError):
        ladder.sdpa_backends(path=tmp_path / "missing.txt")


def test_decode_table_keeps_a_share_under_one_percent_visible():
    from lessons.gpu import ladder

    rows = ladder.decode_recorded_rows()
    naive = next(r for r in rows if r["name"] == "paged_decode" and r["seq_len"] == 131072)
    assert naive["pct"] < 1                                              # 0.14% of the copy rate
    figure = next(e["figure"] for e in ladder.decode_table() if e["name"] == "paged_decode")
    assert f"1 x 131072: {naive['pct']:.1f}% (1 split)" in figure and ": 0% " not in figure


def _blocks_per_sm_by_registers(registers, warps, regs_per_sm=65536, unit=256):
    """Blocks one SM of sm_80 / sm_90 holds as far as registers go: each warp's registers are allocated
    in units of 256 (CUDA occupancy calculator)."""
    per_warp = -(-registers * 32 // unit) * unit
    return regs_per_sm // (per_warp * warps)


def test_blocks_per_sm_by_registers_by_hand():
    assert _blocks_per_sm_by_registers(168, 4) == 3            # 5376 per warp, 21504 per block
    assert _blocks_per_sm_by_registers(226, 4) == 2            # 7232 -> 7424 per warp, 29696 per block
    assert _blocks_per_sm_by_registers(128, 8) == 2            # the FA-2 rung at d = 64: 256 threads


def test_mma_rung_quotes_the_registers_and_blocks_per_sm_of_its_current_build():
    from lessons import gpu
    from lessons.gpu import ladder

    if not gpu.nvrtc_available():
        pytest.skip("CuPy/NVRTC not installed")
    text = ladder.rung("mma").predicted
    assert "167-168 registers per thread at d = 64 and 218-226 at d = 128" in text
    assert "allow 3 and 2 blocks of 4 warps per SM" in text
    for d, (low, high), blocks in ((64, (167, 168), 3), (128, (218, 226), 2)):
        for arch in ("sm_80", "sm_90"):
            e = next(e for e in ladder.rung_evidence(d, arch) if e["name"] == "mma")
            assert low <= e["registers"] <= high, (d, arch, e["registers"])
            assert _blocks_per_sm_by_registers(e["registers"], 4) == blocks


def test_ladder_figure_sets_markers_that_would_hide_each_other_side_by_side():
    import numpy as np

    from lessons.gpu import ladder
    from lessons.views.ladder import _side_by_side, ladder_figure

    points = ladder.ladder_points(8192, (64, 128))
    measured = [p for p in points if p["tflops"] is not None]
    fig = ladder_figure(points, label=ladder.RECORDED_LABEL)
    roofline = fig.get_axes()[0]
    marks = [line for line in roofline.get_lines() if line.get_marker() in ("o", "s")]
    assert len(marks) == len(measured)
    shown = [(float(m.get_xdata()[0]), float(m.get_ydata()[0])) for m in marks]
    # the TFLOP/s are the measured ones; an x moves at most one step from the intensity, for display only
    for p, (x, y) in zip(measured, shown):
        assert y == p["tflops"] and abs(np.log10(x / p["intensity"])) <= 0.1 + 1e-9
    # mma d = 128 (91.0) and mma_async d = 64 (94.0) share an intensity of 63.5: drawn apart, mma on the left
    where = {(p["name"], p["d"]): x for p, (x, _) in zip(measured, shown)}
    assert where[("mma", 64)] == pytest.approx(where[("mma", 128)], rel=1e-3)
    assert where[("mma_async", 64)] == pytest.approx(where[("mma_async", 128)], rel=1e-3)
    assert where[("mma", 64)] < 63.5 < where[("mma_async", 64)]
    # a rung no other hides keeps its intensity: sdpa, well above FA-2 at 126, stays on its roof
    assert where[("sdpa", 128)] == next(p["intensity"] for p in measured if (p["name"], p["d"]) == ("sdpa", 128))
    # once drawn, no marker's centre lies within another rung's marker
    xy = roofline.transData.transform(shown)
    px = fig.dpi / 72
    for (i, a), (j, b) in itertools.combinations(enumerate(xy), 2):
        if measured[i]["name"] != measured[j]["name"]:
            reach = max(marks[i].get_markersize(), marks[j].get_markersize()) / 2 * px
            assert np.max(np.abs(a - b)) > reach, (measured[i]["name"], measured[j]["name"])
    # by hand: two rungs at one intensity 5% apart in TFLOP/s go 0.1 decade apart; a third far above stays put
    hand = [dict(name="a", intensity=10.0, tflops=100.0), dict(name="b", intensity=10.05, tflops=105.0),
            dict(name="c", intensity=10.0, tflops=400.0), dict(name="a", intensity=40.0, tflops=100.0)]
    assert _side_by_side(hand) == pytest.approx([10 * 10 ** -0.05, 10.05 * 10 ** 0.05, 10.0, 40.0])


def test_count_ranges_gives_each_class_its_count_or_range_with_its_unit():
    from lessons.views.plot import count_ranges

    rows = [{"tensor": 12, "exponentials": 1, "other": 0}, {"tensor": 12.0, "exponentials": 0, "integer": 72},
            {"integer": 121, "tensor": 12}]
    assert count_ranges(rows, unit="clock") == {"tensor": "12 clocks", "exponentials": "1 clock",
                                                "integer": "72-121 clocks"}
    assert count_ranges(rows) == {"tensor": "12", "exponentials": "1", "integer": "72-121"}
    assert count_ranges(rows, unit="per step", plural="per step")["integer"] == "72-121 per step"
    assert count_ranges([{"a": 59}, {"a": 60.5}]) == {"a": "59-60"} and count_ranges([]) == {}
    for bad in ({"a": 1}, [1], "rows"):
        with pytest.raises(TypeError, match="rows must be a list of dicts"):
            count_ranges(bad)
    with pytest.raises(TypeError, match=r"rows\[1\]\['a'\] must be a real count"):
        count_ranges([{"a": 1}, {"a": "2"}])
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"rows\[0\]\['a'\] must be a finite count"):
            count_ranges([{"a": bad}])
    with pytest.raises(TypeError, match="unit must be a string"):
        count_ranges(rows, unit=3)

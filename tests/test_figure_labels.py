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

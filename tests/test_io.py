"""HBM traffic and FLOP counts against hand computations; measured peak memory against array sizes."""
import math

import numpy as np
import pytest

from lessons.cost.traffic import (ELEMENT_SIZES, H200, compare_traffic, flash_block_sizes, flash_io, loglog_slope,
                                  measure_peak_memory, roofline_points, textbook_io)


# --- hand-counted small case: N = 4, d = 2, fp32, M = 64 bytes = 16 elements -----------------------

def test_textbook_hand_count_n4_d2():
    c = textbook_io(4, 2, element_size=4)
    # step 1: read Q (8) and K (8), write S (16); step 2: read S (16), write P (16);
    # step 3: read P (16) and V (8), write O (8)
    assert c.read_elements == 8 + 8 + 16 + 16 + 8 == 56
    assert c.write_elements == 16 + 16 + 8 == 40
    assert (c.read_bytes, c.write_bytes, c.hbm_bytes) == (224, 160, 384)
    assert c.flops_qk == c.flops_pv == 2 * 4 * 4 * 2 == 64
    assert dict((w, (r, wr)) for w, r, wr in c.steps)["S"] == (16, 16)


def test_flash_block_sizes_hand():
    assert flash_block_sizes(2, 64, 4) == (2, 2)                 # M = 16: Bc = ceil(16/8) = 2, Br = min(2, 2)
    assert flash_block_sizes(64, 227 * 1024, 2) == (64, 454)     # M = 116224: Bc = ceil(116224/256) = 454
    assert flash_block_sizes(128, 227 * 1024, 4) == (114, 114)   # M = 58112: Bc = ceil(58112/512) = 114
    assert flash_block_sizes(4, 100, 4) == (2, 2)                # M = 25: Bc = ceil(25/16) = 2, Br = min(2, 4)
    assert flash_block_sizes(2, 400, 4) == (2, 13)               # M = 100: Bc = ceil(100/8) = 13, Br = min(13, 2)


def test_flash_fa1_hand_count_n4_d2():
    c = flash_io(4, 2, m_bytes=64, element_size=4, order="fa1")
    assert (c.block_q, c.block_k) == (2, 2)                      # Tr = Tc = 2
    # line 2: write O (8), l (4), m (4). Per key block j (2 of them): read K_j, V_j (4 + 4).
    # Per (i, j) pair (4 of them): read Q_i (4), O_i (4), l_i, m_i (2 + 2); write O_i (4), l_i, m_i (4).
    assert c.read_elements == 2 * (4 + 4) + 4 * (4 + 4 + 4) == 64
    assert c.write_elements == 16 + 4 * (4 + 4) == 48
    assert c.flops_qk == c.flops_pv == 4 * (2 * 2 * 2 * 2) == 64
    assert c.algorithm == "flash-fa1" and c.m_bytes == 64


def test_flash_fa2_hand_count_n4_d2():
    c = flash_io(4, 2, m_bytes=64, element_size=4, order="fa2")
    # per query block i (2): read Q_i (4), then per key block j (2): read K_j, V_j (4 + 4);
    # write O_i (4) and L_i (2)
    assert c.read_elements == 2 * (4 + 2 * 8) == 40
    assert c.write_elements == 2 * (4 + 2) == 12
    assert c.flops == 128


@pytest.mark.parametrize("n, d, m_bytes, es", [(4, 2, 64, 4), (100, 8, 1000, 2), (257, 16, 4096, 4),
                                              (1000, 64, 227 * 1024, 2), (33, 3, 50, 1)])
def test_flops_equal_and_fa1_closed_form(n, d, m_bytes, es):
    t = textbook_io(n, d, element_size=es)
    for order in ("fa1", "fa2"):
        f = flash_io(n, d, m_bytes=m_bytes, element_size=es, order=order)
        assert f.flops_qk == t.flops_qk == 2 * n * n * d          # flash does not reduce FLOPs
        assert f.flops_pv == t.flops_pv == 2 * n * n * d
    f = flash_io(n, d, m_bytes=m_bytes, element_size=es, order="fa1")
    tc = math.ceil(n / f.block_k)
    assert f.read_elements == 2 * n * d + tc * (2 * n * d + 2 * n)
    assert f.write_elements == (tc + 1) * (n * d + 2 * n)
    assert t.read_elements == 3 * n * d + 2 * n * n and t.write_elements == 2 * n * n + n * d
    g = flash_io(n, d, m_bytes=m_bytes, element_size=es, order="fa2")
    tr = math.ceil(n / g.block_q)
    assert g.read_elements == n * d + tr * 2 * n * d and g.write_elements == n * d + n


def test_theorem_2_scaling():
    # textbook: 4N^2 + 4Nd accesses; FA-1: about 12 N^2 d^2 / M (Tc = 4Nd/M, 3Nd per key block),
    # plus lower-order terms (l and m: 4N per key block, i.e. a factor 1 + 4/(3d))
    n, d, m_bytes, es = 32768, 128, 256 * 1024, 2
    M = m_bytes // es
    f, t = flash_io(n, d, m_bytes=m_bytes, element_size=es, order="fa1"), textbook_io(n, d, element_size=es)
    assert (f.read_elements + f.write_elements) / (n * n * d * d / M) == pytest.approx(12, rel=0.05)
    assert (t.read_elements + t.write_elements) == 4 * n * n + 4 * n * d
    # doubling N: textbook traffic x4 (N^2), flash traffic x4 too (N^2 d^2 / M) but 1/(d/M) smaller
    f2 = flash_io(2 * n, d, m_bytes=m_bytes, element_size=es, order="fa1")
    assert f2.hbm_bytes / f.hbm_bytes == pytest.approx(4, rel=0.01)
    # doubling M halves flash traffic (to first order), leaves textbook unchanged
    fm = flash_io(n, d, m_bytes=2 * m_bytes, element_size=es, order="fa1")
    assert f.hbm_bytes / fm.hbm_bytes == pytest.approx(2, rel=0.05)


@pytest.mark.parametrize("call, exc, word", [
    (lambda: textbook_io(0, 2), ValueError, "n"),
    (lambda: textbook_io(4, 2.0), TypeError, "d"),
    (lambda: textbook_io(4, 2, element_size=0), ValueError, "element_size"),
    (lambda: flash_io(4, 2, m_bytes=64, order="fa3"), ValueError, "order"),
    (lambda: flash_io(4, 2, m_bytes=0), ValueError, "m_bytes"),
    (lambda: flash_io(4, 8, m_bytes=60, element_size=2), ValueError, "4d"),
    (lambda: flash_io(4, 2, m_bytes=64, block_q=0), ValueError, "block_q"),
    (lambda: loglog_slope([1], [1]), ValueError, "length"),
    (lambda: loglog_slope([1, 2], [1, 0]), ValueError, "positive"),
    (lambda: roofline_points(precisions=("int8",)), ValueError, "precision"),
    (lambda: roofline_points(precisions="int8"), ValueError, "precision"),
    (lambda: roofline_points(precisions=16), TypeError, "precisions"),
    (lambda: roofline_points(precisions=[None]), TypeError, "precisions"),
    (lambda: roofline_points(orders=("fa3",)), ValueError, "orders"),
    (lambda: roofline_points(hardware="H200"), TypeError, "hardware must be a lessons.cost.traffic.Hardware"),
    (lambda: loglog_slope([1, 1, 1], [1, 2, 3]), ValueError, "xs must hold at least two distinct"),
    (lambda: loglog_slope([1, np.nan, 3], [1, 2, 3]), ValueError, r"xs must hold positive finite .* xs\[1\]"),
    (lambda: loglog_slope([1, 2, 3], [1, np.inf, 3]), ValueError, r"ys must hold positive finite .* ys\[1\]"),
    (lambda: loglog_slope([1, 2], [-1, 2]), ValueError, r"ys\[0\] = -1"),
    (lambda: loglog_slope(["a", "b"], [1, 2]), ValueError, "xs must be a sequence of numbers"),
    (lambda: flash_io(4, 8, m_bytes=60, block_q=2), ValueError, "4d"),      # block_k still comes from M
])
def test_bad_input_is_refused_by_name(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


def test_given_block_sizes_do_not_need_m_to_hold_4d():
    # M = 1 byte cannot hold 4d elements, but with Br = Bc = 2 given it is not used for them.
    # Hand count, N = 4, d = 2, FA-2: Q read once (8), K and V once per query block (2 * 2 * 8),
    # O written once (8) plus L (4).
    c = flash_io(4, 2, m_bytes=1, element_size=4, order="fa2", block_q=2, block_k=2)
    assert (c.block_q, c.block_k, c.m_bytes) == (2, 2, 1)
    assert (c.read_elements, c.write_elements) == (8 + 2 * 2 * 8, 8 + 4)
    same = flash_io(4, 2, m_bytes=64, element_size=4, order="fa2", block_q=2, block_k=2)
    assert (same.read_elements, same.write_elements, same.flops) == (c.read_elements, c.write_elements, c.flops)


def test_roofline_takes_one_precision_as_a_string():
    one = roofline_points(8192, (64,), precisions="fp32")
    assert [p.label for p in one] == ["textbook d=64 fp32", "FA-2 d=64 fp32"]
    both = {p.label: p.intensity for p in roofline_points(8192, (64,))}
    assert [p.intensity for p in one] == [both["textbook d=64 fp32"], both["FA-2 d=64 fp32"]]


# --- the headline: FA-2 (the order of the series' kernels) against FA-1, same block sizes ------------

def test_default_order_is_fa2_the_order_of_the_kernels():
    assert flash_io(100, 8, m_bytes=1000).algorithm == "flash-fa2"
    assert flash_io(100, 8, m_bytes=1000) == flash_io(100, 8, m_bytes=1000, order="fa2")


def test_headline_n8192_d64_bf16_h200_by_hand():
    n, d, es = 8192, 64, 2
    c = compare_traffic(n, d, m_bytes=227 * 1024, element_size=es)
    assert (c.fa2.block_q, c.fa2.block_k) == (c.fa1.block_q, c.fa1.block_k) == (64, 454)
    # textbook: 4 N^2 + 4 N d elements = (256 Mi + 2 Mi) elements of 2 bytes = 516 MiB exactly
    assert c.textbook.hbm_bytes == (4 * n * n + 4 * n * d) * es == 516 * 2**20
    # FA-2: Q once (Nd), K and V once per query block (128 blocks * 2Nd), O once (Nd), L once (N)
    nd = n * d                                                  # 0.5 Mi elements = 1 MiB in bf16
    assert c.fa2.hbm_bytes == (nd + 128 * 2 * nd + nd + n) * es == 258 * 2**20 + 16 * 1024
    assert round(c.fa2_saving, 1) == 2.0
    # FA-1: Tc = ceil(8192 / 454) = 19 key blocks; reads 2Nd + 19 (2Nd + 2N), writes 20 (Nd + 2N)
    assert c.fa1.hbm_bytes == (2 * nd + 19 * (2 * nd + 2 * n) + 20 * (nd + 2 * n)) * es
    assert round(c.fa1.hbm_bytes / 2**20, 1) == 61.2 and round(c.fa1_saving, 1) == 8.4


def test_at_n4_only_fa1_moves_more_than_textbook():
    c = compare_traffic(4, 2, m_bytes=64, element_size=4)
    # hand counts (elements): textbook 56 + 40 = 96, FA-2 40 + 12 = 52, FA-1 64 + 48 = 112
    assert (c.textbook.read_elements + c.textbook.write_elements,
            c.fa2.read_elements + c.fa2.write_elements,
            c.fa1.read_elements + c.fa1.write_elements) == (96, 52, 112)
    assert c.fa2_saving > 1 > c.fa1_saving


@pytest.mark.parametrize("n", [1024, 8192, 32768])
def test_fa2_with_br_equal_d_halves_the_textbook_traffic(n):
    # FA-2 ~ 2 N^2 d / Br + 2Nd + N; with Br = d that is 2 N^2 against the textbook's 4 N^2
    c = compare_traffic(n, 64, m_bytes=227 * 1024)
    assert c.fa2.block_q == 64
    assert c.fa2_saving == pytest.approx(2.0, rel=0.02)


def test_roofline_bound_is_about_2x_for_fa2_and_6_5x_for_fa1():
    pts = {p.label: p for p in roofline_points(8192, (64,), precisions="bf16", orders=("fa2", "fa1"))}
    text, fa2, fa1 = pts["textbook d=64 bf16"], pts["FA-2 d=64 bf16"], pts["FA-1 d=64 bf16"]
    # both memory-bound: the time bound is bytes / bandwidth, so the ratio is the traffic ratio
    assert text.bound == fa2.bound == "memory"
    assert text.seconds / fa2.seconds == pytest.approx(text.count.hbm_bytes / fa2.count.hbm_bytes)
    assert round(text.seconds / fa2.seconds, 1) == 2.0
    # FA-1 is compute-bound: flops / 989 TFLOP/s
    assert fa1.bound == "compute" and fa1.seconds == pytest.approx(4 * 8192**2 * 64 / 989e12)
    assert round(text.seconds / fa1.seconds, 1) == 6.5


# --- roofline -----------------------------------------------------------------------------------------

def test_h200_ridge_points():
    assert H200.ridge("bf16") == pytest.approx(989e12 / 4.8e12)     # about 206 FLOP/byte
    assert H200.ridge("fp32") == pytest.approx(67e12 / 4.8e12)      # about 14 FLOP/byte
    assert H200.attainable(1.0, "bf16") == 4.8e12
    assert H200.attainable(1e6, "bf16") == 989e12


def test_roofline_places_textbook_memory_bound_and_fa1_compute_bound_at_d64_bf16():
    pts = {p.label: p for p in roofline_points(8192, (64, 128), orders="fa1")}
    n, d = 8192, 64
    text = pts["textbook d=64 bf16"]
    # hand: 4 N^2 d FLOPs over (4 N^2 + 4 N d) * 2 bytes
    assert text.intensity == pytest.approx(4 * n * n * d / ((4 * n * n + 4 * n * d) * 2))
    assert text.bound == "memory" and text.attainable == pytest.approx(4.8e12 * text.intensity)
    flash = pts["FA-1 d=64 bf16"]
    assert flash.intensity > H200.ridge("bf16") and flash.bound == "compute" and flash.attainable == 989e12
    assert flash.count.flops == text.count.flops
    assert flash.seconds < text.seconds
    assert {p.precision for p in pts.values()} == {"bf16", "fp32"} and len(pts) == 8
    assert ELEMENT_SIZES["bf16"] == 2 and flash.count.element_size == 2


# --- log-log slope and measured peak memory ----------------------------------------------------------

def test_loglog_slope_of_power_laws():
    xs = [512, 2048, 8192]
    assert loglog_slope(xs, [3 * x ** 2 for x in xs]) == pytest.approx(2.0)
    assert loglog_slope(xs, [7 * x for x in xs]) == pytest.approx(1.0)
    assert loglog_slope([1, 10], [5, 5]) == pytest.approx(0.0, abs=1e-12)


def test_measured_peak_memory_quadratic_vs_linear():
    ns, d = (256, 512, 1024), 16
    r = measure_peak_memory(ns, d, tile=32, block_q=32)
    assert r.ns == list(ns) and r.score_bytes == [n * n * 4 for n in ns]
    # textbook materialises the (N, N) scores: at least one full matrix at its peak, at most a few
    for t, s in zip(r.textbook_bytes, r.score_bytes):
        assert s <= t <= 4 * s
    assert 1.9 < r.textbook_slope < 2.1
    # flash grows by one output row and its lse per token: (d + 1) * 4 bytes
    a, b = r.flash_linear_fit
    assert b == pytest.approx((d + 1) * 4, rel=0.1)
    assert 0 < a < 32 * 32 * 4 * 16                    # a handful of block_q x tile buffers, not N-sized
    assert r.flash_slope < 1.05
    assert r.flash_bytes[-1] < r.score_bytes[-1] / 4


# --- the pictures draw the counts and measurements ---------------------------------------------------

def test_traffic_figure_plots_the_counts():
    from lessons.views.traffic import traffic_figure
    ns = [256, 1024, 4096]
    ax, axf = traffic_figure(ns, 64, m_bytes=64 * 1024, element_size=2).axes
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), [textbook_io(n, 64).hbm_bytes for n in ns])
    np.testing.assert_array_equal(ax.lines[1].get_ydata(),
                                  [flash_io(n, 64, m_bytes=64 * 1024, order="fa2").hbm_bytes for n in ns])
    np.testing.assert_array_equal(ax.lines[2].get_ydata(),
                                  [flash_io(n, 64, m_bytes=64 * 1024, order="fa1").hbm_bytes for n in ns])
    assert "FA-2" in ax.lines[1].get_label() and "FA-1" in ax.lines[2].get_label()
    np.testing.assert_array_equal(axf.lines[0].get_ydata(), axf.lines[1].get_ydata())   # equal FLOPs
    np.testing.assert_array_equal(axf.lines[0].get_ydata(), axf.lines[2].get_ydata())


@pytest.mark.parametrize("ns, exc, match", [
    ([], ValueError, r"ns must hold at least one int, got \(\)"),             # was an IndexError
    ([512.7, 1024.0], TypeError, "ns must be an int, got float 512.7"),    # was drawn at N = 512
    ([8192, 512], ValueError, r"ns must increase, got \(8192, 512\)"),
    ("512", TypeError, "ns must be a sequence of ints"),
])
def test_traffic_figure_names_an_ns_it_cannot_plot(ns, exc, match):
    from lessons.views.traffic import traffic_figure
    with pytest.raises(exc, match=match):
        traffic_figure(ns)


@pytest.mark.parametrize("ns, match", [("512", r"ns must be a sequence of ints, got str '512'"),
                                       (512, "ns must be a sequence of ints, got int 512")])
def test_peak_memory_measurements_name_an_ns_that_is_not_a_sequence(ns, match):
    """A string was read digit by digit: "ns must be an int, got str '5'"."""
    from lessons.cost.backward import measure_backward_peak_memory
    for measure in (measure_peak_memory, measure_backward_peak_memory):
        with pytest.raises(TypeError, match=match):
            measure(ns)


def test_peak_memory_figure_labels_the_fitted_slopes():
    from lessons.views.traffic import peak_memory_figure
    from lessons.cost.traffic import PeakMemory
    ns = [512, 2048, 8192]
    r = PeakMemory(ns=ns, d=64, dtype="float32", tile=64, block_q=64, textbook_bytes=[3 * 4 * n * n for n in ns],
                   flash_bytes=[260 * n for n in ns], score_bytes=[4 * n * n for n in ns])
    labels = [line.get_label() for line in peak_memory_figure(r).axes[0].lines]
    assert "textbook: fit, slope 2.00" in labels and "flash: fit, slope 1.00" in labels
    assert r.flash_linear_fit == pytest.approx((0.0, 260.0), abs=1e-6)
    assert r.textbook_per_score_matrix == [3.0, 3.0, 3.0]


def test_roofline_figure_places_each_point_at_its_intensity():
    from lessons.views.traffic import roofline_figure
    pts = roofline_points(8192, (64,), precisions=("bf16",), orders=("fa2", "fa1"))
    ax = roofline_figure(pts).axes[0]
    marks = [line for line in ax.lines if line.get_label().startswith(("textbook", "FA-"))]
    assert len(marks) == 3
    assert [(m.get_xdata()[0], m.get_ydata()[0]) for m in marks] == [(p.intensity, p.attainable) for p in pts]

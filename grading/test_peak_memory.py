"""Grading: peak memory of textbook vs flash attention (notebook 05).

``measure`` is graded at N = 512, 1024, 2048 (the exercise's default sizes go up to
8192, which takes a gigabyte and several seconds; the growth law shows at these sizes).
"""
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

EXERCISE = "peak_memory"
SIZES = (512, 1024, 2048)
D = 64
MiB = 2**20


def allocate_and_free(nbytes):
    big = np.ones(nbytes // 8)
    total = float(big.sum())
    del big
    return total


@pytest.fixture(autouse=True)
def no_tracing_left_over():
    """Each check starts with tracemalloc off and leaves it off."""
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    yield
    if tracemalloc.is_tracing():
        tracemalloc.stop()


@pytest.fixture(scope="module")
def measured(answer):
    return answer.measure(SIZES, d=D)


@pytest.mark.hint("peak_bytes must count the arrays fn allocates: np.ones(10**6) is 8,000,000 bytes")
def test_peak_of_one_array(answer):
    peak = answer.peak_bytes(np.ones, 10**6)
    assert 8_000_000 <= peak <= 8_000_000 + MiB // 4, f"peak_bytes(np.ones, 10**6) = {peak}, expected about 8e6"


@pytest.mark.catches("current_not_peak")
def test_peak_of_memory_freed_before_returning(answer):
    peak = answer.peak_bytes(allocate_and_free, 16 * MiB)
    assert peak >= 16 * MiB, (f"a call that allocates 16 MiB and frees it before returning peaked at "
                              f"{16 * MiB} bytes; peak_bytes said {peak}")


@pytest.mark.hint("subtract the memory already in use when the call starts, and leave tracemalloc running "
                  "if it was running before")
def test_baseline_is_subtracted(answer):
    tracemalloc.start()
    held = np.ones(4 * MiB // 8)               # 4 MiB already traced before the call
    peak = answer.peak_bytes(np.ones, 10**5)
    assert tracemalloc.is_tracing(), "peak_bytes stopped tracemalloc although it did not start it"
    del held
    assert 800_000 <= peak <= 800_000 + MiB // 4, (f"with 4 MiB already allocated, peak_bytes(np.ones, 10**5) "
                                                   f"= {peak}, expected about 8e5")


@pytest.mark.hint("start tracemalloc if it is off, and stop it again afterwards")
def test_tracemalloc_is_left_as_found(answer):
    answer.peak_bytes(np.ones, 1000)
    assert not tracemalloc.is_tracing(), "peak_bytes left tracemalloc running"


@pytest.mark.hint("loglog_slope is the least-squares slope of log(values) against log(ns)")
@given(k=st.floats(0.25, 3.0), c=st.floats(1e-3, 1e6), ns=st.lists(st.integers(2, 10**5), min_size=2, max_size=6,
                                                                    unique=True))
def test_slope_of_a_power_law(answer, k, c, ns):
    values = [c * n**k for n in ns]
    assert abs(answer.loglog_slope(ns, values) - k) < 1e-6, f"values = {c:.3g} * n**{k:.4f}"


@pytest.mark.hint("least squares over all points, not the slope between the first and last point")
def test_slope_of_noisy_points(answer):
    ns = [1, 2, 4, 8]
    values = [1.0, 4.0, 16.0, 32.0]            # log2 values 0, 2, 4, 5: least-squares slope 1.7
    assert abs(answer.loglog_slope(ns, values) - 1.7) < 1e-9


@pytest.mark.hint("measure returns a dict with sizes, textbook, flash (bytes per N) and the two slopes")
def test_measure_returns_the_table(measured):
    assert set(measured) >= {"sizes", "textbook", "flash", "textbook_slope", "flash_slope"}, sorted(measured)
    assert list(measured["sizes"]) == list(SIZES)
    assert len(measured["textbook"]) == len(measured["flash"]) == len(SIZES)


@pytest.mark.catches("current_not_peak")
def test_textbook_peak_holds_the_score_matrix(measured):
    for n, peak in zip(SIZES, measured["textbook"]):
        assert peak >= 4 * n * n, (f"textbook attention at N = {n} builds an N x N float32 score matrix "
                                   f"({4 * n * n} bytes); the measured peak was {peak}")


@pytest.mark.hint("flash's peak is at least its (N, d) output and far below the N x N score matrix")
def test_flash_peak_is_small(measured):
    for n, peak in zip(SIZES, measured["flash"]):
        assert 4 * n * D <= peak < n * n, f"flash peak at N = {n} is {peak} bytes"


@pytest.mark.catches("current_not_peak")
def test_textbook_grows_quadratically(measured):
    assert 1.8 <= measured["textbook_slope"] <= 2.2, f"textbook slope {measured['textbook_slope']:.2f}, expected ~2"


@pytest.mark.hint("flash attention's peak grows about linearly: slope ~1 (a bit lower at small N)")
def test_flash_grows_linearly(measured):
    assert 0.5 <= measured["flash_slope"] <= 1.3, f"flash slope {measured['flash_slope']:.2f}, expected ~1"
    x = np.log(SIZES)
    for key in ("textbook", "flash"):
        fit = np.polyfit(x, np.log(measured[key]), 1)[0]
        assert abs(measured[f"{key}_slope"] - fit) < 1e-6, f"{key}_slope is not the fitted slope of the peaks"

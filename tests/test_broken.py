"""Every broken variant of the update really breaks where claimed; the harmless ones really are harmless."""
import math

import numpy as np
import pytest

from lessons import attention, flash_attention
from lessons.schedules.variants import (EXAMPLE_CASES, FINITE_NEG, VARIANT_NAMES, case_from_scores, example_case,
                            run_variant, run_variants)


def run(case, variant):
    return run_variant(variant, case.q, case.k, case.v, case.tile, scale=case.scale,
                       causal=case.causal, mask=case.mask)


def exact_final(case):
    return attention(case.q, case.k, case.v, scale=case.scale, causal=case.causal, mask=case.mask)


# --- the textbook variant is the fold of lessons.core.state --------------------------------------

@pytest.mark.parametrize("name", EXAMPLE_CASES)
def test_textbook_variant_is_the_flash_trace_and_never_diverges(name):
    case = example_case(name)
    t = run(case, "textbook")
    assert t.first_divergence is None and t.final_exact and t.harmless
    _, trace = flash_attention(case.q, case.k, case.v, case.tile, block_q=case.q.shape[0], scale=case.scale,
                               mask=case.mask, return_trace=True)
    for r in range(case.q.shape[0]):
        row = trace.row(r)
        np.testing.assert_array_equal(t.m[:, r], row.m)
        np.testing.assert_allclose(t.l[:, r], row.l, rtol=1e-15)
        np.testing.assert_allclose(t.output[:, r], row.output, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(t.output[-1], exact_final(case), rtol=1e-12, atol=1e-14)


def test_exact_column_is_the_reference_over_the_keys_seen_so_far():
    case = example_case("ordinary")
    t = run(case, "textbook")
    for i, c1 in enumerate(t.key_stop):
        np.testing.assert_allclose(t.exact[i], attention(case.q, case.k[:c1], case.v[:c1], scale=1.0),
                                   rtol=1e-14)
    assert list(t.key_start) == list(range(0, 12, 3))


# --- dropping alpha --------------------------------------------------------------------------

def first_rescale(case):
    """The first tile at which some row's max moved while its state held something (from the flash trace)."""
    _, trace = flash_attention(case.q, case.k, case.v, case.tile, block_q=case.q.shape[0], scale=case.scale,
                               mask=case.mask, return_trace=True)
    firsts = [int(np.flatnonzero(trace.row(r).rescaled)[0]) for r in range(case.q.shape[0])
              if trace.row(r).rescaled.any()]
    return min(firsts)


@pytest.mark.parametrize("variant", ["no_alpha_on_l", "no_alpha_on_o"])
@pytest.mark.parametrize("name", ["ordinary", "padded"])
def test_dropping_alpha_breaks_at_the_first_rescale(variant, name):
    case = example_case(name)
    t = run(case, variant)
    assert t.first_divergence == first_rescale(case)
    assert not t.final_exact and t.recovers_at is None
    final_gap = np.abs(t.output[-1] - exact_final(case)).max()
    assert final_gap > 1e-3
    assert "alpha" in t.verdict


def test_dropping_alpha_hand_computed_two_keys():
    # scores [0 | 1], v = [1, 3], one key per tile. Textbook: (1 + 3e) / (1 + e).
    case = case_from_scores([[0.0, 1.0]], [[1.0], [3.0]], 1)
    e = math.e
    assert run(case, "textbook").output[-1, 0, 0] == pytest.approx((1 + 3 * e) / (1 + e), rel=1e-15)
    # l not rescaled: o = e^-1 * 1 + 3, l = 1 + 1
    assert run(case, "no_alpha_on_l").output[-1, 0, 0] == pytest.approx((1 / e + 3) / 2, rel=1e-15)
    # o not rescaled: o = 1 + 3, l = e^-1 + 1
    assert run(case, "no_alpha_on_o").output[-1, 0, 0] == pytest.approx(4 / (1 / e + 1), rel=1e-15)


def test_dropping_alpha_is_harmless_only_when_the_max_never_moves():
    v = np.arange(6.0).reshape(6, 1)
    falling = case_from_scores([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]], v, 2)    # the max is in the first tile
    for variant in ("no_alpha_on_l", "no_alpha_on_o"):
        t = run(falling, variant)
        assert t.first_divergence is None and "luck" in t.verdict
        np.testing.assert_allclose(t.output[-1], exact_final(falling), rtol=1e-14)
    rising = case_from_scores([[5.0, 4.0, 3.0, 2.0, 1.0, 9.0]], v, 2)     # a larger score in the last tile
    for variant in ("no_alpha_on_l", "no_alpha_on_o"):
        assert run(rising, variant).first_divergence == 2


# --- a stale m ----------------------------------------------------------------------------------

def test_stale_m_is_exact_on_ordinary_scores():
    for name in ("ordinary", "padded"):
        case = example_case(name)
        t = run(case, "stale_m")
        assert t.first_divergence is None and "Harmless" in t.verdict
        np.testing.assert_allclose(t.output[-1], exact_final(case), rtol=1e-12, atol=1e-14)
        assert (t.alpha[1:][np.isfinite(t.m[:-1])] == 1.0).all()        # never rescaled once set


def test_stale_m_overflows_on_large_scores_where_textbook_does_not():
    case = example_case("large_scores")
    t = run(case, "stale_m")
    # the frozen max is the first tile's 0.5; the last tile holds 800 > 0.5 + log(float64 max) = 710.3
    assert float(np.log(np.finfo(np.float64).max)) + 0.5 < 800.0
    assert t.first_divergence == 2
    assert np.isinf(t.l[2, 0]) and not np.isfinite(t.output[2]).all()
    assert np.isfinite(exact_final(case)).all()
    assert run(case, "textbook").final_exact


def test_stale_m_overflow_threshold_depends_on_the_dtype():
    # a score 100 above the frozen max: exp(100) = 2.7e43 is fine in float64, inf in float32 (max 3.4e38)
    case = case_from_scores([[0.0, 0.1, 100.0, 99.0]], np.ones((4, 1)), 2)
    assert run(case, "stale_m").first_divergence is None
    q, k, v = (a.astype(np.float32) for a in (case.q, case.k, case.v))
    t32 = run_variant("stale_m", q, k, v, 2, scale=1.0)
    assert t32.first_divergence == 1 and "float32" in t32.verdict


# --- finite initial max --------------------------------------------------------------------------

def test_finite_init_is_harmless_without_fully_masked_tiles():
    for name in ("ordinary", "large_scores"):
        case = example_case(name)
        t = run(case, "finite_init")
        assert t.first_divergence is None
        np.testing.assert_allclose(t.output[-1], exact_final(case), rtol=1e-12)


def test_finite_init_turns_a_row_with_no_visible_key_into_the_mean_of_v():
    case = example_case("padded")                  # row 2 sees nothing, row 1's first two tiles are masked
    t = run(case, "finite_init")
    assert t.first_divergence == 0 and t.first_row == 1
    np.testing.assert_allclose(t.output[-1, 2], case.v.mean(axis=0), rtol=1e-14)
    assert (exact_final(case)[2] == 0).all()
    np.testing.assert_allclose(t.output[-1, :2], exact_final(case)[:2], rtol=1e-12)   # rows 0, 1 heal
    assert not t.final_exact and t.recovers_at is None
    assert (t.m[:, 2] == FINITE_NEG).all()


def test_finite_init_heals_a_row_once_it_sees_a_key():
    case = example_case("padded")
    mask = case.mask.copy()
    mask[2] = True                                 # now only row 1 has leading masked tiles
    t = run_variant("finite_init", case.q, case.k, case.v, case.tile, scale=1.0, mask=mask)
    # wrong while row 1 has seen only padding (tiles 0, 1), exact from its first real key (tile 2) on
    assert t.first_divergence == 0 and t.recovers_at == 2 and t.final_exact
    np.testing.assert_allclose(t.output[0, 1], case.v[:2].mean(axis=0), rtol=1e-14)
    assert t.alpha[2, 1] == 0.0                    # exp(-1e30 - m) wipes the garbage


# --- FA-1 per-tile normalisation ----------------------------------------------------------------

@pytest.mark.parametrize("name", EXAMPLE_CASES)
def test_fa1_normalises_every_tile_and_matches_fa2_at_every_tile(name):
    case = example_case(name)
    fa1, fa2 = run(case, "fa1_per_tile"), run(case, "textbook")
    assert fa1.first_divergence is None and "FA-1" in fa1.verdict
    np.testing.assert_allclose(fa1.output, fa2.output, rtol=1e-12, atol=1e-15)
    seen = fa2.l > 0
    np.testing.assert_allclose(fa1.o[seen], fa2.o[seen] / fa2.l[seen][:, None], rtol=1e-12, atol=1e-15)
    np.testing.assert_array_equal(fa1.l, fa2.l)


# --- no guard: the NaN trap -----------------------------------------------------------------------

def test_no_guard_gives_nan_after_a_fully_masked_first_tile():
    case = example_case("padded")
    t = run(case, "no_guard")
    assert t.first_divergence == 0 and t.first_row == 1
    assert np.isnan(t.output[-1, 1]).all() and np.isnan(t.output[-1, 2]).all()
    np.testing.assert_allclose(t.output[-1, 0], exact_final(case)[0], rtol=1e-12)
    assert np.isnan(t.alpha[0, 1])                 # exp(-inf - (-inf))
    assert "NaN" in t.verdict


def test_no_guard_is_harmless_without_masks():
    t = run(example_case("ordinary"), "no_guard")
    assert t.first_divergence is None and "Harmless" in t.verdict


# --- plumbing -------------------------------------------------------------------------------------

def test_run_variants_covers_every_variant_and_causal_is_applied():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 2))
    from lessons.schedules.variants import Case
    traces = run_variants(Case(q, k, v, tile=3, causal=True))
    assert tuple(traces) == VARIANT_NAMES
    np.testing.assert_allclose(traces["textbook"].output[-1], attention(q, k, v, causal=True), rtol=1e-12)
    assert all(len(t) == 3 for t in traces.values())


@pytest.mark.parametrize("call, exc, word", [
    (lambda: run_variant("no_alpha", np.eye(2), np.eye(2), np.eye(2), 1), ValueError, "variant"),
    (lambda: run_variant("textbook", np.eye(2), np.eye(2), np.eye(2), 0), ValueError, "tile"),
    (lambda: run_variant("textbook", np.eye(2, dtype=int), np.eye(2), np.eye(2), 1), TypeError, "q"),
    (lambda: case_from_scores(np.zeros(3), np.zeros((3, 1)), 1), ValueError, "scores"),
    (lambda: case_from_scores(np.zeros((1, 3)), np.zeros((2, 1)), 1), ValueError, "scores"),
    (lambda: example_case("nope"), ValueError, "name"),
])
def test_bad_input_is_refused_by_name(call, exc, word):
    with pytest.raises(exc, match=word):
        call()


# --- the explorer widget and the error figure only show the traces ----------------------------------

def test_variant_explorer_shows_the_trace_values():
    import html
    from lessons.views.softmax import VariantExplorer
    from lessons.views.stepper import format_value
    traces = {name: run_variants(example_case(name)) for name in ("ordinary", "padded")}
    ex = VariantExplorer(traces, case="padded", variant="finite_init")
    t = traces["padded"]["finite_init"]
    assert ex.current is t and ex.slider.max == len(t) and ex.row.max == 2
    assert html.escape(t.verdict) in ex.verdict.value
    ex.row.value = 2
    ex.slider.value = len(t)
    for i in range(len(t)):
        assert f">{format_value(float(t.l[i, 2]))}<" in ex.table.value
    assert ex.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    ex.variant.value = "no_guard"                         # NaN everywhere for row 2: still drawn
    assert ex.current is traces["padded"]["no_guard"] and ">nan<" in ex.table.value
    ex.case.value = "ordinary"
    assert ex.row.max == 1 and ex.current is traces["ordinary"]["no_guard"]
    with pytest.raises(ValueError, match="variant"):
        VariantExplorer(traces, variant="nope")


def test_variant_errors_figure_marks_non_finite_results():
    from lessons.views.softmax import variant_errors_figure
    traces = run_variants(example_case("padded"))
    ax = variant_errors_figure(traces).axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    no_guard = lines[traces["no_guard"].title].get_ydata()
    assert (no_guard == 1e6).all()                         # every tile non-finite: drawn at the top
    textbook = lines[traces["textbook"].title].get_ydata()
    assert (textbook < 1e-12).all()
    n = len(traces["textbook"])
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(i) for i in range(1, n + 1)]
    with pytest.raises(TypeError, match="VariantTrace"):
        variant_errors_figure({"x": 1})


def test_variant_errors_figure_of_one_row_circles_that_rows_first_divergence():
    """Padded case: no_guard is NaN in rows 1 and 2 from tile 1, row 0 stays exact. Drawn for row 0, the
    circle marked tile 1 (rows 1 and 2's divergence) on row 0's exact line."""
    from lessons.views.softmax import variant_errors_figure
    traces = run_variants(example_case("padded"), ["textbook", "no_guard"])
    assert traces["no_guard"].first_divergence == 0 and not traces["no_guard"].diverged[:, 0].any()

    def circles(fig):
        return [line for line in fig.axes[0].lines if line.get_marker() == "o" and line.get_markersize() == 13]
    assert len(circles(variant_errors_figure(traces))) == 1               # every row: no_guard at tile 1
    assert circles(variant_errors_figure(traces, row=0)) == []             # row 0 never leaves the exact result
    (circle,) = circles(variant_errors_figure(traces, row=1))
    assert circle.get_xdata()[0] == pytest.approx(0, abs=0.1) and circle.get_ydata()[0] == 1e6
    for row, exc, match in ((3, ValueError, r"row must be in -3..2 \(the case has 3 query rows\), got 3"),
                            (1.0, TypeError, "row must be an int, got float 1.0")):
        with pytest.raises(exc, match=match):
            variant_errors_figure(traces, row=row)

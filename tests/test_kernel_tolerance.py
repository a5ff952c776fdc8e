"""The tolerance rule of the kernel tests (tests/kernel_tolerance.py) is itself right."""
import numpy as np
import pytest

import lessons
from kernel_tolerance import assert_within_baseline, baseline_attention, floor_for, max_error, round_to


@pytest.mark.parametrize("dtype, eps", [("float32", 2.0**-24), ("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_baseline_errs_by_about_its_dtype_s_rounding(dtype, eps):
    rng = np.random.default_rng(1)
    q, k, v = (round_to(rng.standard_normal((n, 32)), dtype).astype(np.float64) for n in (20, 30, 30))
    for causal in (False, True):
        ref, ref_lse = lessons.attention(q, k, v, causal=causal, return_lse=True)
        out, lse = baseline_attention(q, k, v, dtype, causal=causal)
        # a few roundings of values below ~3 in size: within a handful of eps, never exact for 16 bits
        assert max_error(out, ref) < 20 * eps
        assert max_error(lse, ref_lse) < 20 * eps          # (its scores are rounded to dtype)
        if dtype != "float32":
            assert max_error(out, ref) > eps / 8


def test_baseline_follows_the_visibility_and_empty_rows():
    q = np.eye(2)
    k, v = np.eye(2), np.array([[1.0, 2], [3, 4]])
    out, lse = baseline_attention(q, k, v, "float32", scale=1 / np.sqrt(2), causal=True)
    e = np.exp(1 / np.sqrt(2))
    # row 0 sees key 0 only; row 1 sees keys 0, 1 with scores 0, 1/sqrt(2)
    np.testing.assert_allclose(out, [[1, 2], [(e * 3 + 1) / (1 + e), (e * 4 + 2) / (1 + e)]], rtol=1e-6)
    np.testing.assert_allclose(lse, [1 / np.sqrt(2), np.log1p(e)], rtol=1e-6)
    # Nq 3 > Nk 2, bottom-right: row 0 sees no key -> 0 and -inf
    out, lse = baseline_attention(np.ones((3, 2)), k, v, "float16", causal=True)
    assert np.all(out[0] == 0) and np.isneginf(lse[0]) and np.isfinite(lse[1:]).all()


def test_the_rule_passes_twice_the_baseline_error_and_fails_beyond():
    ref = np.linspace(-1, 1, 50)
    baseline = ref + 1e-3 * np.cos(np.arange(50))
    err = max_error(baseline, ref)
    assert_within_baseline(ref + 1.9 * err, ref, baseline)
    with pytest.raises(AssertionError, match="kernel error"):
        assert_within_baseline(ref + 2.1 * err, ref, baseline)
    # the floor is float32's rounding at the reference's size: a float32-exact baseline allows ~1 ulp
    assert floor_for(ref) == 2 * np.spacing(np.float32(1.0))
    assert_within_baseline(ref + 1e-7, ref, ref)
    with pytest.raises(AssertionError):
        assert_within_baseline(ref + 1e-6, ref, ref)


def test_the_rule_wants_the_reference_s_inf_and_nan_exactly():
    ref = np.array([1.0, np.nan, -np.inf, 2.0])
    assert_within_baseline(np.array([1.0, np.nan, -np.inf, 2.0]), ref, ref)
    for got in ([1.0, 0.0, -np.inf, 2.0], [1.0, np.nan, 0.0, 2.0], [1.0, np.nan, -np.inf, np.nan]):
        with pytest.raises(AssertionError):
            assert_within_baseline(np.array(got), ref, ref)
    with pytest.raises(AssertionError, match="shape"):
        assert_within_baseline(np.zeros(3), ref, ref)
    with pytest.raises(ValueError, match="dtype must be one of"):
        round_to(ref, "float64")

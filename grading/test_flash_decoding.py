"""Grading: flash-decoding, keys split over workers, (m, l, o) triples merged (notebook 08)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, direct_state, no_nan, normal, qkv, seeds
from lessons import attention

EXERCISE = "flash_decoding"


def chunks(nk, num_splits):
    c = max(1, -(-nk // num_splits))
    return [(min(i * c, nk), min((i + 1) * c, nk)) for i in range(num_splits)]


def triple(s, v):
    """The state (m, l, o) of one row of scores s (n,) over values v (n, dv)."""
    m, l, o = direct_state(s[None, :], v)
    return float(m[0]), float(l[0]), o[0]


def decode_case(seed, nk, d=8, dv=3):
    q, k, v = qkv(seed, 1, nk, d, dv)
    return q[0], k, v


EMPTY = (-np.inf, 0.0, np.zeros(3))


@pytest.mark.hint("compare with lessons.attention(q, k, v): out = o / l after merging all partials")
@given(seed=seeds, nk=st.integers(1, 50), num_splits=st.integers(1, 6), tile=st.integers(1, 8))
def test_output_matches_attention(answer, seed, nk, num_splits, tile):
    q, k, v = decode_case(seed, nk)
    out, partials = answer.flash_decoding(q, k, v, num_splits, tile)
    assert_close(out, attention(q, k, v), f"out (Nk = {nk}, num_splits = {num_splits}, tile = {tile})")


@pytest.mark.catches("scale_1_over_d", "alpha_missing_on_l", "alpha_missing_on_o")
@given(seed=seeds, nk=st.integers(1, 40), num_splits=st.integers(1, 6), tile=st.integers(1, 6))
def test_each_partial_is_its_workers_state(answer, seed, nk, num_splits, tile):
    q, k, v = decode_case(seed, nk)
    _, partials = answer.flash_decoding(q, k, v, num_splits, tile)
    assert len(partials) == num_splits, f"expected {num_splits} partial states, got {len(partials)}"
    s = (k @ q) / np.sqrt(q.shape[0])
    for i, ((a, b), part) in enumerate(zip(chunks(nk, num_splits), partials)):
        m, l, o = triple(s[a:b], v[a:b])
        assert_close(part[0], m, f"m of worker {i} (keys [{a}, {b}))")
        assert_close(part[1], l, f"l of worker {i} (keys [{a}, {b}))")
        assert_close(part[2], o, f"o of worker {i} (keys [{a}, {b}))")


@pytest.mark.catches("scale_1_over_d")
def test_scores_are_scaled_by_one_over_sqrt_d(answer):
    d = 16
    q, k = np.ones(d), np.zeros((2, d))
    k[1] = 1.0                               # q . k = 0 and 16: scaled by 1/4 -> 0 and 4
    v = np.array([[0.0], [1.0]])
    out, partials = answer.flash_decoding(q, k, v, 1, 2)
    assert_close(partials[0][0], 4.0, "m for scores q . k / sqrt(16) = [0, 4]")
    assert_close(out, [1.0 / (1.0 + np.exp(-4.0))], "out")


@pytest.mark.hint("the number of workers must not change the output")
@given(seed=seeds, nk=st.integers(1, 20))
def test_split_invariance(answer, seed, nk):
    q, k, v = decode_case(seed, nk)
    outs = [answer.flash_decoding(q, k, v, n, 3)[0] for n in (1, 2, 4, nk, nk + 3)]
    for n, out in zip((2, 4, nk, nk + 3), outs[1:]):
        assert_close(out, outs[0], f"out with {n} workers vs 1 worker")


@pytest.mark.catches("no_guard")
@pytest.mark.parametrize("nk, num_splits", [(3, 4), (1, 4), (5, 8), (9, 4)])
def test_empty_splits(answer, nk, num_splits):
    q, k, v = decode_case(nk, nk)
    out, partials = answer.flash_decoding(q, k, v, num_splits, 2)
    no_nan(out, f"out with Nk = {nk} over {num_splits} workers")
    one_worker = answer.flash_decoding(q, k, v, 1, 2)[0]
    assert_close(out, one_worker, f"out with Nk = {nk} over {num_splits} workers (some get no key) vs one worker")
    for i, (a, b) in enumerate(chunks(nk, num_splits)):
        if a == b:
            m, l, o = partials[i]
            assert m == -np.inf and l == 0 and not np.any(o), f"worker {i} has no keys: expected the empty state"


@pytest.mark.catches("alpha_missing_on_l", "alpha_missing_on_o")
@given(seed=seeds, na=st.integers(1, 10), nb=st.integers(1, 10))
def test_merge_is_the_state_of_the_union(answer, seed, na, nb):
    s, v = normal(seed, na + nb, scale=3.0), normal(seed + 1, na + nb, 3)
    merged = answer.merge(triple(s[:na], v[:na]), triple(s[na:], v[na:]))
    m, l, o = triple(s, v)
    assert_close(merged[0], m, "m of the merge")
    assert_close(merged[1], l, "l of the merge")
    assert_close(merged[2], o, "o of the merge")


@pytest.mark.hint("merging is order-free: merge(a, b) == merge(b, a) and "
                  "merge(merge(a, b), c) == merge(a, merge(b, c))")
@given(seed=seeds, sizes=st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)))
def test_merge_order_does_not_matter(answer, seed, sizes):
    s, v = normal(seed, sum(sizes), scale=3.0), normal(seed + 1, sum(sizes), 3)
    cuts = np.cumsum((0,) + sizes)
    a, b, c = (triple(s[x:y], v[x:y]) for x, y in zip(cuts, cuts[1:]))
    for x, y, what in [(answer.merge(a, b), answer.merge(b, a), "merge(a, b) vs merge(b, a)"),
                       (answer.merge(answer.merge(a, b), c), answer.merge(a, answer.merge(b, c)),
                        "merge(merge(a, b), c) vs merge(a, merge(b, c))")]:
        for i, part in enumerate("mlo"):
            assert_close(x[i], y[i], f"{part} of {what}")


@pytest.mark.catches("no_guard")
def test_merge_with_empty_states(answer):
    s, v = normal(2, 4), normal(3, 4, 3)
    a = triple(s, v)
    for x, what in [(answer.merge(a, EMPTY), "merge(a, empty)"), (answer.merge(EMPTY, a), "merge(empty, a)")]:
        for i, part in enumerate("mlo"):
            assert_close(x[i], a[i], f"{part} of {what}")
    m, l, o = answer.merge(EMPTY, EMPTY)
    no_nan([m, l], "m, l of merge(empty, empty)")
    no_nan(o, "o of merge(empty, empty)")
    assert m == -np.inf and l == 0 and not np.any(o), f"merge(empty, empty) = {(m, l, o)}, expected the empty state"

"""Lazy rescaling counted from the scores: hand cases, a brute-force recount, the i.i.d. expectation, bad input."""
import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons.cost.rescale import (RescaleCount, expected_rescale_share, expected_tile_share, random_rescale_share,
                                  rescale_multiplies_per_thread, rescale_share)


def brute_force(q, k, block_rows, block_k, scale, causal):
    """The whole score matrix at once, then every row's running max tile by tile in a Python loop."""
    nq, nk = len(q), len(k)
    s = scale * (q @ k.T)
    n_blocks, n_tiles = -(-nq // block_rows), -(-nk // block_k)
    moved = np.zeros((n_blocks, n_tiles), bool)
    visited = np.zeros((n_blocks, n_tiles), bool)
    for i in range(nq):
        m = -np.inf
        for t in range(n_tiles):
            keys = [j for j in range(t * block_k, min((t + 1) * block_k, nk)) if not causal or j <= i + nk - nq]
            if keys:
                visited[i // block_rows, t] = True
            new = max([m] + [s[i, j] for j in keys])
            if new > m:
                moved[i // block_rows, t] = True
            m = new
    return moved, visited


def increasing_case(nq, nk):
    """d = 1, q = 1, k = 0, 1, 2, ...: every score is larger than every score before it."""
    return np.ones((nq, 1)), np.arange(nk, dtype=np.float64)[:, None]


# ---------------------------------------------------------------------------
# hand cases
# ---------------------------------------------------------------------------

def test_scores_that_grow_tile_after_tile_rescale_at_every_tile():
    q, k = increasing_case(40, 100)
    c = rescale_share(q, k, block_rows=16, block_k=8, scale=1.0)
    assert c.moved.shape == c.visited.shape == (3, 13)                # 40 rows: 16 + 16 + 8; 100 keys: 12 x 8 + 4
    assert c.moved.all() and c.visited.all()
    assert c.share == 1.0 and c.skipped == 0 and c.rescaled == 3 * 13
    np.testing.assert_array_equal(c.tile_share, np.ones(13))


def test_the_largest_score_in_the_first_tile_means_only_tile_0_rescales():
    q, k = increasing_case(33, 130)
    c = rescale_share(q, -k, block_rows=16, block_k=64, scale=1.0)   # scores 0, -1, -2, ...: the max is key 0
    expected = np.zeros((3, 3), bool)
    expected[:, 0] = True
    np.testing.assert_array_equal(c.moved, expected)
    assert c.share == pytest.approx(1 / 3) and c.skipped == 6
    np.testing.assert_array_equal(c.tile_share, [1.0, 0.0, 0.0])


def test_a_score_equal_to_the_running_max_is_no_move():
    q = np.ones((2, 1))
    k = np.array([[3.0], [1.0], [3.0], [2.0], [3.0]])               # tiles of 2: [3, 1], [3, 2], [3]
    c = rescale_share(q, k, block_rows=2, block_k=2, scale=1.0)
    np.testing.assert_array_equal(c.moved, [[True, False, False]])


def test_one_query_vector_is_one_row_block():
    q, k = increasing_case(1, 10)
    c = rescale_share(q[0], k, block_rows=16, block_k=4, scale=1.0)
    assert c.moved.shape == (1, 3) and c.moved.all() and c.n_queries == 1


def test_causal_with_fewer_queries_than_keys():
    # Nq = 5, Nk = 12: row i sees keys j <= i + 7. Row block 0 (rows 0, 1) sees up to key 8, so it
    # visits tiles 0-2 of 4 keys; with scores falling key after key only its first tile moves.
    q, k = increasing_case(5, 12)
    c = rescale_share(q, -k, block_rows=2, block_k=4, scale=1.0, causal=True)
    assert c.visited.all()                                          # every block's last row reaches tile 2
    np.testing.assert_array_equal(c.moved, [[True, False, False]] * 3)
    # with scores rising key after key, row 0 (keys 0-7) never sees tile 2, row 1 does: block 0 moves there
    c = rescale_share(q, k, block_rows=2, block_k=4, scale=1.0, causal=True)
    assert c.moved.all() and c.share == 1.0
    moved, visited = brute_force(q, k, 2, 4, 1.0, True)
    np.testing.assert_array_equal(c.moved, moved)


def test_causal_with_more_queries_than_keys_and_rows_that_see_nothing():
    # Nq = 10, Nk = 4: row i sees keys j <= i - 6, so rows 0-5 see nothing. Row block 0 (rows 0-3)
    # visits no tile; row block 1 (rows 4-7) holds two empty rows (4, 5) and visits tile 0 only (row 7
    # sees keys 0, 1); row block 2 (rows 8, 9, a short block) visits both tiles.
    q, k = increasing_case(10, 4)
    c = rescale_share(q, k, block_rows=4, block_k=2, scale=1.0, causal=True)
    np.testing.assert_array_equal(c.visited, [[False, False], [True, False], [True, True]])
    np.testing.assert_array_equal(c.moved, [[False, False], [True, False], [True, True]])
    assert c.share == 1.0 and c.n_row_blocks == 3 and c.n_tiles == 2
    np.testing.assert_array_equal(c.tile_share, [1.0, 1.0])
    # a row block whose rows all see nothing never moves, even where other rows do
    c = rescale_share(q, -k, block_rows=4, block_k=2, scale=1.0, causal=True)
    np.testing.assert_array_equal(c.moved, [[False, False], [True, False], [True, False]])
    assert c.share == pytest.approx(2 / 3)


def test_a_row_block_with_an_empty_row_moves_with_its_other_rows():
    # rows 0 and 1 of one block of 4: row 0 sees no key (Nq = 4 > Nk = 3), the others do
    q, k = increasing_case(4, 3)
    c = rescale_share(q, k, block_rows=4, block_k=1, scale=1.0, causal=True)
    np.testing.assert_array_equal(c.moved, [[True, True, True]])
    moved, visited = brute_force(q, k, 4, 1, 1.0, True)
    np.testing.assert_array_equal(c.moved, moved)
    np.testing.assert_array_equal(c.visited, visited)


def test_the_result_is_read_only_and_shaped_by_the_blocks():
    c = random_rescale_share(100, 8, block_rows=16, block_k=32)
    assert isinstance(c, RescaleCount) and c.moved.dtype == bool and c.visited.dtype == bool
    assert c.moved.shape == (7, 4) and (c.n_queries, c.n_keys, c.block_rows, c.block_k) == (100, 100, 16, 32)
    with pytest.raises(ValueError):
        c.moved[0, 0] = False
    with pytest.raises(AttributeError):
        c.block_k = 8


def test_the_counting_chunks_do_not_change_the_count(monkeypatch):
    """Row and key chunks far smaller than the inputs give the count of one chunk."""
    import lessons.cost.rescale as rescale

    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((300, 16)), rng.standard_normal((500, 16))
    whole = rescale_share(q, k, block_rows=16, block_k=32, causal=True)
    monkeypatch.setattr(rescale, "_CHUNK_ELEMENTS", 16 * 32 * 2)
    small = rescale_share(q, k, block_rows=16, block_k=32, causal=True)
    np.testing.assert_array_equal(whole.moved, small.moved)
    np.testing.assert_array_equal(whole.visited, small.visited)


# ---------------------------------------------------------------------------
# the same count by brute force, on shapes and block sizes Hypothesis picks
# ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 4), block_rows=st.integers(1, 9),
       block_k=st.integers(1, 9), causal=st.booleans(), seed=st.integers(0, 2**16))
def test_the_count_is_the_brute_force_count(nq, nk, d, block_rows, block_k, causal, seed):
    # small integer q and k: the scores are exact, and ties (no move) are common
    rng = np.random.default_rng(seed)
    q, k = rng.integers(-3, 4, (nq, d)).astype(np.float64), rng.integers(-3, 4, (nk, d)).astype(np.float64)
    c = rescale_share(q, k, block_rows=block_rows, block_k=block_k, scale=1.0, causal=causal)
    moved, visited = brute_force(q, k, block_rows, block_k, 1.0, causal)
    np.testing.assert_array_equal(c.moved, moved)
    np.testing.assert_array_equal(c.visited, visited)
    # every row block that sees a key sees key 0, so it moves at tile 0 from -inf
    np.testing.assert_array_equal(c.moved[:, 0], c.visited[:, 0])
    assert 0 < c.share <= 1 and c.rescaled + c.skipped == c.visited.sum()


# ---------------------------------------------------------------------------
# the closed form for independent scores, and the count against it
# ---------------------------------------------------------------------------

def test_expected_tile_share_by_hand():
    # one row, tiles of 2 over 5 keys (2, 2, 1): the max of the first 2, 4, 5 keys lies in the last tile
    # with probability 2/2, 2/4, 1/5
    np.testing.assert_allclose(expected_tile_share(5, block_rows=1, block_k=2), [1.0, 0.5, 0.2])
    np.testing.assert_allclose(expected_tile_share(5, block_rows=2, block_k=2), [1.0, 0.75, 1 - 0.8**2])
    np.testing.assert_allclose(expected_tile_share(8192, block_rows=1, block_k=64), 1 / np.arange(1, 129))
    assert expected_rescale_share(5, block_rows=2, block_k=2) == pytest.approx((1 + 0.75 + 0.36) / 3)
    assert expected_rescale_share(8192) == pytest.approx(0.3205, abs=5e-5)


def test_one_row_blocks_match_the_expectation_exactly_on_average():
    """Given q, one row's scores are independent draws, so the chance of a move at tile j is 1/j exactly.

    Measured spread of the share over 8 seeds at N = 2048, d = 64, one row per block: 0.0014 (1.1% of
    0.127); the mean of 4 seeds has a standard error of about 0.0007, and 0.004 is over 5 of them."""
    shares = [random_rescale_share(2048, 64, seed=s, block_rows=1).share for s in range(4)]
    assert np.mean(shares) == pytest.approx(expected_rescale_share(2048, block_rows=1), abs=0.004)


def test_sixteen_row_blocks_come_close_to_the_expectation():
    """The rows of a block share their keys, so they are not quite independent, as the closed form assumes.

    Measured over 8 seeds at N = 2048, d = 64, 16 rows: mean 0.669 against 0.674, spread 0.010 per seed;
    the mean of 4 seeds has a standard error of about 0.005. Allowed: 0.025 (about 4% of the share).
    Loose: it tells 16 rows from one (0.13), not 1/j from 1/(j+1) (0.65); the one-row test above does."""
    shares = [random_rescale_share(2048, 64, seed=s).share for s in range(4)]
    assert np.mean(shares) == pytest.approx(expected_rescale_share(2048), abs=0.025)
    # the first tiles: almost every block moves
    tiles = np.mean([random_rescale_share(2048, 64, seed=s).tile_share for s in range(2)], axis=0)
    assert tiles[0] == 1.0 and tiles[1] > 0.99


def test_the_causal_mask_raises_the_share():
    # causal row blocks near the top see few tiles, and a block's first tiles almost always move
    plain, causal = (random_rescale_share(1024, 32, causal=c) for c in (False, True))
    assert causal.share > plain.share
    assert causal.visited.sum() < plain.visited.sum()


def test_multiplies_per_thread():
    assert rescale_multiplies_per_thread(128) == 64
    assert rescale_multiplies_per_thread(64) == 32
    assert rescale_multiplies_per_thread(64, block_rows=64, threads=128) == 32
    with pytest.raises(ValueError, match="threads"):
        rescale_multiplies_per_thread(3, block_rows=1, threads=2)


# ---------------------------------------------------------------------------
# bad input, refused by name
# ---------------------------------------------------------------------------

Q, K = np.ones((4, 8)), np.ones((6, 8))


@pytest.mark.parametrize("call, error, match", [
    (lambda: rescale_share(Q.astype(np.int32), K), TypeError, "q must have a float dtype"),
    (lambda: rescale_share(Q, "k"), TypeError, "k must be a float array"),
    (lambda: rescale_share(Q[None], K), ValueError, r"q must be 1-D or 2-D, got shape \(1, 4, 8\)"),
    (lambda: rescale_share(Q, K[0]), ValueError, "k must be 2-D"),
    (lambda: rescale_share(Q, np.ones((6, 4))), ValueError, r"q and k must share the head dim d"),
    (lambda: rescale_share(np.ones((0, 8)), K), ValueError, "q must hold at least one query row"),
    (lambda: rescale_share(Q, np.ones((0, 8))), ValueError, "k must hold at least one key"),
    (lambda: rescale_share(np.ones((4, 0)), np.ones((6, 0))), ValueError, "head dim d"),
    (lambda: rescale_share(np.where(np.eye(4, 8) > 0, np.nan, 1.0), K), ValueError, "q must be finite: it holds 4"),
    (lambda: rescale_share(Q, np.full((6, 8), np.inf)), ValueError, "k must be finite"),
    (lambda: rescale_share(Q, K, block_rows=0), ValueError, "block_rows must be at least 1"),
    (lambda: rescale_share(Q, K, block_rows=True), TypeError, "block_rows must be an int"),
    (lambda: rescale_share(Q, K, block_k=16.0), TypeError, "block_k must be an int"),
    (lambda: rescale_share(Q, K, scale="1"), TypeError, "scale"),
    (lambda: rescale_share(Q, K, scale=np.inf), ValueError, "scale must be finite"),
    (lambda: rescale_share(Q, K, causal=1), TypeError, "causal must be True or False"),
    (lambda: rescale_share(Q * 1e200, K * 1e200, scale=1.0), ValueError, "overflow float64"),
    (lambda: rescale_share((Q * 1e20).astype(np.float32), (K * 1e20).astype(np.float32), scale=1.0), ValueError,
     "overflow float32"),
    (lambda: random_rescale_share(0, 8), ValueError, "n must be at least 1"),
    (lambda: random_rescale_share(8, 8, seed=-1), ValueError, "seed must be at least 0"),
    (lambda: expected_tile_share(0), ValueError, "n_k must be at least 1"),
    (lambda: expected_rescale_share(64, block_rows=0), ValueError, "block_rows must be at least 1"),
    (lambda: expected_rescale_share(64, block_k=2.5), TypeError, "block_k must be an int"),
    (lambda: rescale_multiplies_per_thread(False), TypeError, "head_dim must be an int"),
])
def test_bad_input_is_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------
# the figure
# ---------------------------------------------------------------------------

def test_figure_draws_every_tile_of_every_count_and_the_curve():
    from lessons.views.rescale import rescale_figure

    counts = {f"d = {d}": random_rescale_share(512, d, block_k=32) for d in (16, 32)}
    fig = rescale_figure(counts)
    panels = fig.get_axes()
    assert len(panels) == 2 and panels[1].get_xscale() == "log"
    for ax in panels:
        lines = ax.get_lines()
        assert len(lines) == 3                                        # two counts, one curve
        for line, c in zip(lines, counts.values()):
            np.testing.assert_array_equal(line.get_ydata(), c.tile_share)
            np.testing.assert_array_equal(line.get_xdata(), np.arange(1, 17))
        np.testing.assert_allclose(lines[2].get_ydata(), expected_tile_share(512, block_k=32))
    legend = [t.get_text() for t in panels[0].get_legend().get_texts()]
    assert legend[0].startswith("d = 16: counted (") and "independent scores" in legend[2]
    assert "512 keys in tiles of 32" in fig._suptitle.get_text()
    # no curve for a causal count: it assumes no mask
    fig = rescale_figure({"causal": random_rescale_share(512, 16, block_k=32, causal=True)})
    assert len(fig.get_axes()[0].get_lines()) == 1 and "causal" in fig._suptitle.get_text()


def test_figure_refuses_bad_counts():
    from lessons.views.rescale import rescale_figure

    c = random_rescale_share(64, 8)
    with pytest.raises(TypeError, match="counts"):
        rescale_figure([c])
    with pytest.raises(ValueError, match="1 to 4"):
        rescale_figure({})
    with pytest.raises(ValueError, match="share n_keys"):
        rescale_figure({"a": c, "b": random_rescale_share(128, 8)})


# ---------------------------------------------------------------------------
# the fold itself: its trace moves where the count says, and alpha is exactly 1 where it does not
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_the_folds_trace_moves_where_the_count_says(causal):
    import lessons

    rng = np.random.default_rng(5)                  # causal with Nq > Nk: rows 0-29 see nothing
    q, k, v = rng.standard_normal((130, 32)), rng.standard_normal((100, 32)), rng.standard_normal((100, 32))
    _, trace = lessons.flash_attention(q, k, v, block_q=16, block_k=16, causal=causal, return_trace=True)
    c = rescale_share(q, k, block_rows=16, block_k=16, causal=causal)
    moved, visited = np.zeros(c.moved.shape, bool), np.zeros(c.moved.shape, bool)
    for step in trace.steps:
        block = step.row_start // 16
        visited[block, step.tile] = True
        moved[block, step.tile] = (step.m > step.m_before).any()
        # where a row's finite max stayed, the fold's alpha is exactly 1: skipping o *= alpha changes no bit
        # (a row that has seen nothing keeps m = -inf and gets alpha 0: its o and l are 0 either way)
        stayed = (step.m == step.m_before) & np.isfinite(step.m)
        assert (step.alpha[stayed] == 1.0).all()
    np.testing.assert_array_equal(c.moved, moved)
    np.testing.assert_array_equal(c.visited, visited)

"""Paged flash attention against the textbook reference on the contiguous keys.

Every slot the function must not read (the tail of the last page, pages outside the
block table, table entries past the blocks in use) is filled with garbage: if any of
it were read, the output would be NaN, inf, or wildly off.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, flash_attention, paged_flash_attention
from lessons.views.flash import TILE_COLOURS
from lessons.views.paged import page_states, paged_cache_figure
from lessons.schedules.paged import PagedTrace, paged_schedule, sequence_pages, write_paged_cache

ATOL = 1e-12
GARBAGE = [np.nan, np.inf, -np.inf, 1e30]


def paged_layout(k, v, block_size, *, extra_pages=3, garbage=np.nan, seed=0, table_pad=2, pad_value=-1):
    """Scatter contiguous k (N, d), v (N, dv) into a shuffled page pool full of garbage.

    Returns (block_table, k_cache, v_cache). The pool has extra pages nobody uses; the
    table has ``table_pad`` entries past the blocks in use, holding ``pad_value``.
    """
    rng = np.random.default_rng(seed)
    n, d = k.shape
    needed = -(-n // block_size)
    num_blocks = needed + extra_pages
    k_cache = np.full((num_blocks, block_size, d), garbage)
    v_cache = np.full((num_blocks, block_size, v.shape[1]), garbage)
    pages = rng.permutation(num_blocks)[:needed]
    for j, page in enumerate(pages):
        stop = min((j + 1) * block_size, n)
        k_cache[page, :stop - j * block_size] = k[j * block_size:stop]
        v_cache[page, :stop - j * block_size] = v[j * block_size:stop]
    table = np.concatenate([pages, np.full(table_pad, pad_value)]).astype(np.int64)
    return table, k_cache, v_cache


def qkv(n, d=8, dv=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(d), rng.standard_normal((n, d)), rng.standard_normal((n, dv))


def _sweep(block_sizes):
    """(block_size, seq_len): 1, bs-1, bs, bs+1, 2bs, 5bs+3, without repeats or zero."""
    cases = []
    for bs in block_sizes:
        for n in sorted({1, bs - 1, bs, bs + 1, 2 * bs, 5 * bs + 3} - {0}):
            cases.append((bs, n))
    return cases


@pytest.mark.parametrize("block_size, seq_len", _sweep([1, 4, 16]))
@pytest.mark.parametrize("garbage", GARBAGE)
def test_matches_textbook_and_never_reads_garbage(block_size, seq_len, garbage):
    q, k, v = qkv(seq_len, seed=seq_len)
    table, k_cache, v_cache = paged_layout(k, v, block_size, garbage=garbage, seed=block_size)
    out, lse = paged_flash_attention(q, table, k_cache, v_cache, seq_len, block_size, return_lse=True)
    ref_out, ref_lse = attention(q, k, v, return_lse=True)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=ATOL)
    assert lse == pytest.approx(ref_lse, abs=ATOL)


def test_same_numbers_as_contiguous_flash_with_tile_block_size():
    q, k, v = qkv(37, seed=3)
    table, k_cache, v_cache = paged_layout(k, v, 8, garbage=np.inf)
    out, lse = paged_flash_attention(q, table, k_cache, v_cache, 37, 8, scale=0.3, return_lse=True)
    ref, ref_lse = flash_attention(q, k, v, tile=8, scale=0.3, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-14)
    assert lse == pytest.approx(ref_lse, abs=1e-14)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_table_entries_past_the_sequence_are_never_read(garbage):
    # seq_len a multiple of block_size: the entry after the last full block must not be
    # touched, even if it names a page that does not exist or a page full of garbage.
    block_size, seq_len = 4, 12
    q, k, v = qkv(seq_len, seed=7)
    table, k_cache, v_cache = paged_layout(k, v, block_size, garbage=garbage, table_pad=0)
    ref = attention(q, k, v)
    garbage_page = next(p for p in range(k_cache.shape[0]) if p not in table)
    for pad in (-1, k_cache.shape[0] + 100, garbage_page):
        padded = np.append(table, pad)
        out, trace = paged_flash_attention(q, padded, k_cache, v_cache, seq_len, block_size, return_trace=True)
        np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
        assert trace.pages == list(table)                   # exactly 3 pages, no 4th
    # a table with exactly the blocks needed is enough
    np.testing.assert_allclose(paged_flash_attention(q, table, k_cache, v_cache, seq_len, block_size), ref,
                               rtol=0, atol=ATOL)


def test_shared_pages_and_a_garbage_filled_pool_of_nan():
    # Two logical blocks in the table point at pages in arbitrary order; the rest of the pool is NaN.
    block_size, d = 3, 4
    rng = np.random.default_rng(11)
    k_cache = np.full((6, block_size, d), np.nan)
    v_cache = np.full((6, block_size, 2), np.nan)
    k_cache[4] = rng.standard_normal((3, d)); v_cache[4] = rng.standard_normal((3, 2))
    k_cache[1, :2] = rng.standard_normal((2, d)); v_cache[1, :2] = rng.standard_normal((2, 2))
    q = rng.standard_normal(d)
    out = paged_flash_attention(q, [4, 1], k_cache, v_cache, 5, block_size)
    k = np.concatenate([k_cache[4], k_cache[1, :2]]); v = np.concatenate([v_cache[4], v_cache[1, :2]])
    np.testing.assert_allclose(out, attention(q, k, v), rtol=0, atol=ATOL)


def test_hand_computed_two_pages():
    # block_size 1, scale 1: keys e1 (score 1) in page 2, e2 (score 0) in page 0.
    k_cache = np.array([[[0.0, 1.0]], [[np.nan, np.nan]], [[1.0, 0.0]]])
    v_cache = np.array([[[4.0]], [[np.inf]], [[2.0]]])
    out, lse = paged_flash_attention(np.array([1.0, 0.0]), [2, 0], k_cache, v_cache, 2, 1, scale=1.0,
                                     return_lse=True)
    e = np.e
    assert out[0] == pytest.approx((2 * e + 4) / (e + 1), abs=1e-15)
    assert lse == pytest.approx(np.log(e + 1), abs=1e-15)


def test_trace_records_logical_block_page_and_state():
    block_size, seq_len = 4, 10
    q, k, v = qkv(seq_len, seed=5)
    table, k_cache, v_cache = paged_layout(k, v, block_size, garbage=np.nan)
    out, trace = paged_flash_attention(q, table, k_cache, v_cache, seq_len, block_size, return_trace=True)
    assert isinstance(trace, PagedTrace)
    assert len(trace) == 3
    assert trace.logical_blocks == [0, 1, 2]
    assert trace.pages == [int(p) for p in table[:3]]
    assert [(s.key_start, s.key_stop) for s in trace.steps] == [(0, 4), (4, 8), (8, 10)]
    s_all = (k @ q) / np.sqrt(q.shape[0])                  # the scores, computed contiguously
    for step in trace.steps:
        np.testing.assert_allclose(step.scores[0], s_all[step.key_start:step.key_stop], rtol=0, atol=ATOL)
        assert step.m[0] == pytest.approx(s_all[:step.key_stop].max(), abs=ATOL)
        assert step.l[0] == pytest.approx(np.exp(s_all[:step.key_stop] - step.m[0]).sum(), abs=ATOL)
        np.testing.assert_allclose(step.alpha, np.exp(step.m_before - step.m), rtol=0, atol=ATOL)
        assert np.all(np.isfinite(step.o))
    row = trace.row(0)
    for j, step in enumerate(trace.steps):                 # the running output is attention over the prefix
        np.testing.assert_allclose(row.output[j], attention(q, k[:step.key_stop], v[:step.key_stop]),
                                   rtol=0, atol=ATOL)
    np.testing.assert_allclose(row.output[-1], out, rtol=0, atol=ATOL)


def test_empty_sequence_gives_zeros_and_minus_inf():
    k_cache = np.full((2, 4, 3), np.nan)
    v_cache = np.full((2, 4, 5), np.nan)
    out, lse, trace = paged_flash_attention(np.ones(3), [], k_cache, v_cache, 0, 4,
                                            return_lse=True, return_trace=True)
    np.testing.assert_array_equal(out, np.zeros(5))
    assert lse == -np.inf
    assert len(trace) == 0


def test_float32_and_float16_inputs():
    q, k, v = qkv(21, seed=2)
    table, k_cache, v_cache = paged_layout(k, v, 8, garbage=np.inf)
    ref = attention(q, k, v)
    out32 = paged_flash_attention(q.astype(np.float32), table, k_cache.astype(np.float32),
                                  v_cache.astype(np.float32), 21, 8)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, ref, rtol=0, atol=1e-5)
    out16 = paged_flash_attention(q.astype(np.float16), table, k_cache.astype(np.float16),
                                  v_cache.astype(np.float16), 21, 8)
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float64), ref, rtol=0, atol=1e-2)


def test_several_query_rows_share_one_walk_over_the_pages():
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((6, 8)), rng.standard_normal((19, 8)), rng.standard_normal((19, 2))
    table, k_cache, v_cache = paged_layout(k, v, 4, garbage=np.nan)
    out, lse, trace = paged_flash_attention(q, table, k_cache, v_cache, 19, 4, return_lse=True, return_trace=True)
    ref, ref_lse = attention(q, k, v, return_lse=True)
    assert out.shape == (6, 2) and lse.shape == (6,)
    np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)
    assert len(trace) == 5                                  # one step per page, all rows together
    for i in range(6):
        np.testing.assert_allclose(trace.row(i).output[-1], ref[i], rtol=0, atol=ATOL)


def test_write_paged_cache_round_trip_and_unused_slots_hold_the_fill():
    q, k, v = qkv(11, seed=12)
    table, k_cache, v_cache = write_paged_cache(k, v, 4, num_blocks=7, seed=1)
    assert table.shape == (3,) and len(set(table.tolist())) == 3 and k_cache.shape == (7, 4, 8)
    np.testing.assert_array_equal(np.concatenate([k_cache[p] for p in table])[:11], k)
    np.testing.assert_array_equal(np.concatenate([v_cache[p] for p in table])[:11], v)
    assert np.isnan(k_cache[table[2], 3:]).all()            # the tail of the last page
    others = [p for p in range(7) if p not in table]
    assert np.isnan(k_cache[others]).all() and np.isnan(v_cache[others]).all()
    np.testing.assert_allclose(paged_flash_attention(q, table, k_cache, v_cache, 11, 4), attention(q, k, v),
                               rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="num_blocks = 2 is too small"):
        write_paged_cache(k, v, 4, num_blocks=2)
    with pytest.raises(ValueError, match="Nk"):
        write_paged_cache(k, v[:3], 4)


def test_paged_schedule_replays_every_row():
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((10, 4)), rng.standard_normal((10, 3))
    trace = paged_schedule(q, k, v, 3, num_blocks=9, seed=2)
    assert trace.tile == 3 and trace.num_blocks == 9 and trace.nq == 5 and trace.nk == 10
    assert trace.pages == list(trace.block_table) and len(trace.block_table) == 4
    ref = attention(q, k, v)
    for i in range(5):
        row = trace.row(i)
        assert list(row.key_stop) == [3, 6, 9, 10]
        np.testing.assert_allclose(row.output[-1], ref[i], rtol=0, atol=ATOL)


def test_page_states_and_the_paged_cache_picture():
    q, k, v = qkv(10, seed=14)
    table, k_cache, v_cache = write_paged_cache(k, v, 4, num_blocks=6, seed=3)
    _, trace = paged_flash_attention(q, table, k_cache, v_cache, 10, 4, return_trace=True)
    p0, p1, p2 = (int(p) for p in table)
    assert page_states(trace, 0) == {p0: "pending", p1: "pending", p2: "pending"}
    assert page_states(trace, 2) == {p0: "done", p1: "current", p2: "pending"}
    assert page_states(trace, 3) == {p0: "done", p1: "done", p2: "current"}
    with pytest.raises(ValueError, match="step"):
        page_states(trace, 4)
    fig = paged_cache_figure(trace, step=2)
    ax = fig.axes[0]
    # the slots of page p1 (block 1, being read) are orange; page p2's last two slots were never used
    def slot_colours(page):
        x0 = (page % 16) * 1.25
        return [p.get_facecolor() for p in ax.patches
                if type(p).__name__ == "Rectangle" and p.get_y() < 0 and x0 - 1e-9 <= p.get_x() < x0 + 1 - 1e-9
                and p.get_width() < 0.5]
    from matplotlib.colors import to_rgba
    assert slot_colours(p1) == [to_rgba(TILE_COLOURS["current"])] * 4
    assert slot_colours(p2)[:2] == [to_rgba(TILE_COLOURS["pending"])] * 2
    assert slot_colours(p2)[2:] == [to_rgba("#ffffff")] * 2
    with pytest.raises(TypeError):
        paged_cache_figure(trace.row(0))


@pytest.mark.parametrize("pages_per_row, exc, match", [(0, ValueError, "pages_per_row must be at least 1, got 0"),
                                                       (-2, ValueError, "pages_per_row must be at least 1"),
                                                       (2.5, TypeError, "pages_per_row must be an int, got float")])
def test_paged_cache_picture_names_a_bad_pages_per_row(pages_per_row, exc, match):
    q, k, v = qkv(10, seed=14)
    table, k_cache, v_cache = write_paged_cache(k, v, 4, num_blocks=6, seed=3)
    _, trace = paged_flash_attention(q, table, k_cache, v_cache, 10, 4, return_trace=True)
    with pytest.raises(exc, match=match):
        paged_cache_figure(trace, pages_per_row=pages_per_row)


def test_sequence_pages_lists_used_blocks():
    assert sequence_pages([5, 2, 7, -1], 9, 4, 8) == [(0, 5, 4), (1, 2, 4), (2, 7, 1)]
    assert sequence_pages([5, 2, 99], 8, 4, 8) == [(0, 5, 4), (1, 2, 4)]
    assert sequence_pages([], 0, 4, 8) == []
    assert sequence_pages([5, 2, 5], 8, 4, 8) == [(0, 5, 4), (1, 2, 4)]     # a repeat past the used blocks: padding
    for bad, error in ((-3, ValueError), (2.5, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="num_blocks"):
            sequence_pages([5, 2], 8, 4, bad)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seed=-1), ValueError, "seed must be at least 0, got -1"),
    (dict(seed="x"), TypeError, "seed must be an int"),
    (dict(fill="x"), TypeError, "fill must be a real number"),
    (dict(fill=True), TypeError, "fill must be a real number"),
    (dict(fill=[0.0]), TypeError, "fill must be a real number")])
def test_write_paged_cache_names_a_bad_seed_or_fill(kwargs, error, match):
    k = np.ones((5, 2))
    with pytest.raises(error, match=match):
        write_paged_cache(k, k, 4, **kwargs)
    _, k_cache, _ = write_paged_cache(k, k, 4, num_blocks=3, fill=np.float32(-1.0))
    assert (k_cache == -1.0).sum() == 3 * 4 * 2 - 5 * 2          # every slot the 5 keys do not use


# --- bad input -------------------------------------------------------------------------

def _good(seq_len=6, block_size=4):
    q, k, v = qkv(seq_len)
    table, k_cache, v_cache = paged_layout(k, v, block_size, table_pad=0)
    return dict(q=q, block_table=table, k_cache=k_cache, v_cache=v_cache, seq_len=seq_len, block_size=block_size)


@pytest.mark.parametrize("change, exc, words", [
    (dict(block_table=np.array([0])), ValueError, ["too short", "needs 2 blocks"]),
    (dict(block_table=np.array([0, 5])), ValueError, ["block_table[1] = 5", "outside the cache"]),
    (dict(block_table=np.array([-1, 0])), ValueError, ["block_table[0] = -1", "outside"]),
    (dict(block_table=np.array([1, 1])), ValueError, ["block_table names page 1 for logical blocks 0 and 1"]),
    (dict(block_table=np.array([0.0, 1.0])), TypeError, ["block_table", "integers"]),
    (dict(block_table=np.array([[0, 1]])), ValueError, ["block_table", "1-D"]),
    (dict(block_table=np.array([True, False])), TypeError, ["block_table"]),
    (dict(block_size=3), ValueError, ["block_size = 3", "k_cache"]),
    (dict(block_size=0), ValueError, ["block_size"]),
    (dict(seq_len=-1), ValueError, ["seq_len"]),
    (dict(seq_len=2.0), TypeError, ["seq_len"]),
    (dict(seq_len=True), TypeError, ["seq_len"]),
    (dict(q=np.ones((1, 1, 8))), ValueError, ["q", "1-D or 2-D"]),
    (dict(q=np.ones(7)), ValueError, ["head dim", "(7,)"]),
    (dict(q=np.ones(8, dtype=int)), TypeError, ["q", "float"]),
    (dict(k_cache=np.ones((5, 4))), ValueError, ["k_cache", "3-D"]),
    (dict(v_cache=np.ones((4, 4, 5))), ValueError, ["k_cache and v_cache"]),
    (dict(scale=np.inf), ValueError, ["scale"]),
])
def test_bad_input_is_a_clear_error(change, exc, words):
    args = _good()
    args.update(change)
    scale = args.pop("scale", None)
    with pytest.raises(exc) as err:
        paged_flash_attention(args["q"], args["block_table"], args["k_cache"], args["v_cache"],
                              args["seq_len"], args["block_size"], scale=scale)
    for w in words:
        assert w in str(err.value)


# --- property ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 9), seq_len=st.integers(0, 40), extra=st.integers(0, 4),
       garbage=st.sampled_from(GARBAGE), pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_property_any_layout_equals_textbook(block_size, seq_len, extra, garbage, pad, seed):
    q, k, v = qkv(seq_len, d=3, dv=2, seed=seed)
    table, k_cache, v_cache = paged_layout(k, v, block_size, extra_pages=extra, garbage=garbage, seed=seed,
                                           table_pad=pad, pad_value=10**6)
    out, lse = paged_flash_attention(q, table, k_cache, v_cache, seq_len, block_size, return_lse=True)
    ref, ref_lse = attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
    assert lse == pytest.approx(ref_lse, abs=ATOL) if seq_len else lse == -np.inf


def test_float_seq_lens_are_called_token_counts_not_page_indices():
    from lessons import paged_decode
    q = np.zeros((1, 2, 3))
    kc, vc = np.zeros((4, 2, 2, 3)), np.zeros((4, 2, 2, 2))
    with pytest.raises(TypeError, match=r"seq_lens must hold integers \(token counts\)"):
        paged_decode(q, kc, vc, np.arange(3)[None], np.array([5.0]))
    with pytest.raises(TypeError, match=r"block_tables must hold integers \(page indices\)"):
        paged_decode(q, kc, vc, np.arange(3.0)[None], np.array([5]))

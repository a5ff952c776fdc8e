"""The paged + GQA decode loop against the textbook reference, and KV-cache sizes by hand."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, kv_cache_bytes, paged_decode, paged_flash_attention
from lessons.schedules.gqa_decode import kv_head_of

ATOL = 1e-12
GARBAGE = [np.nan, np.inf, -np.inf, 1e30]


def batch(seq_lens, num_heads, num_kv_heads, block_size, *, d=4, dv=3, garbage=np.nan, extra_pages=2, seed=0,
          pad_value=-1):
    """A batch in a shuffled, garbage-filled page pool.

    Returns (q, k_cache, v_cache, block_tables, seq_lens, keys, values) where keys[b] and
    values[b] are sequence b's contiguous (seq_len, num_kv_heads, d/dv) arrays.
    """
    rng = np.random.default_rng(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + extra_pages
    k_cache = np.full((num_blocks, block_size, num_kv_heads, d), garbage)
    v_cache = np.full((num_blocks, block_size, num_kv_heads, dv), garbage)
    pool = list(rng.permutation(num_blocks))
    max_blocks = max(needed) + 1                            # at least one padding entry per row
    block_tables = np.full((len(seq_lens), max_blocks), pad_value, dtype=np.int64)
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        kb = rng.standard_normal((n, num_kv_heads, d))
        vb = rng.standard_normal((n, num_kv_heads, dv))
        keys.append(kb); values.append(vb)
        for j in range(needed[b]):
            page = pool.pop()
            block_tables[b, j] = page
            stop = min((j + 1) * block_size, n)
            k_cache[page, :stop - j * block_size] = kb[j * block_size:stop]
            v_cache[page, :stop - j * block_size] = vb[j * block_size:stop]
    q = rng.standard_normal((len(seq_lens), num_heads, d))
    return q, k_cache, v_cache, block_tables, np.array(seq_lens), keys, values


def textbook(q, keys, values, num_kv_heads, scale=None):
    """Each (sequence, query head) separately: head h reads KV head h // (H / H_kv)."""
    num_seqs, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    out = np.zeros((num_seqs, num_heads, values[0].shape[2]))
    lse = np.zeros((num_seqs, num_heads))
    for b in range(num_seqs):
        for h in range(num_heads):
            out[b, h], lse[b, h] = attention(q[b, h], keys[b][:, h // group], values[b][:, h // group],
                                             scale=scale, return_lse=True)
    return out, lse


HEADS = [(4, 4), (4, 2), (6, 2), (6, 1), (3, 1), (8, 2)]     # GQA ratios 1, 2, 3, all-to-one


@pytest.mark.parametrize("num_heads, num_kv_heads", HEADS)
@pytest.mark.parametrize("garbage", GARBAGE)
def test_batch_of_different_lengths_matches_textbook(num_heads, num_kv_heads, garbage):
    bs = 4
    seq_lens = [1, bs - 1, bs, bs + 1, 2 * bs, 3 * bs + 2]  # one batch, every edge of a page
    q, kc, vc, tables, lens, keys, values = batch(seq_lens, num_heads, num_kv_heads, bs, garbage=garbage,
                                                  seed=num_heads * 10 + num_kv_heads)
    out, lse = paged_decode(q, kc, vc, tables, lens, return_lse=True)
    ref, ref_lse = textbook(q, keys, values, num_kv_heads)
    assert out.shape == (6, num_heads, 3) and lse.shape == (6, num_heads)
    np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_block_sizes_and_padding_that_points_nowhere(block_size):
    seq_lens = sorted({1, max(block_size - 1, 1), block_size, block_size + 1, 2 * block_size})
    q, kc, vc, tables, lens, keys, values = batch(seq_lens, 4, 2, block_size, garbage=np.inf, seed=block_size,
                                                  pad_value=10**6)
    out = paged_decode(q, kc, vc, tables, lens, scale=0.5)
    np.testing.assert_allclose(out, textbook(q, keys, values, 2, scale=0.5)[0], rtol=0, atol=ATOL)


def test_each_head_equals_single_head_paged_attention():
    q, kc, vc, tables, lens, _, _ = batch([5, 9], 6, 3, 4, garbage=1e30, seed=2)
    out, lse = paged_decode(q, kc, vc, tables, lens, return_lse=True)
    for b in range(2):
        for h in range(6):
            g = h // 2
            o1, l1 = paged_flash_attention(q[b, h], tables[b], kc[:, :, g], vc[:, :, g], int(lens[b]), 4,
                                           return_lse=True)
            np.testing.assert_allclose(out[b, h], o1, rtol=0, atol=ATOL)
            assert lse[b, h] == pytest.approx(l1, abs=ATOL)


def test_head_to_kv_head_mapping_by_constant_values():
    # Every token of KV head g has value g: whatever the weights, head h must output h // group.
    num_heads, num_kv_heads, bs = 6, 3, 4
    q, kc, vc, tables, lens, _, _ = batch([7, 2], num_heads, num_kv_heads, bs, dv=1, garbage=np.nan, seed=3)
    for g in range(num_kv_heads):
        vc[:, :, g, :] = np.where(np.isnan(vc[:, :, g, :]), np.nan, float(g))
    out = paged_decode(q, kc, vc, tables, lens)
    np.testing.assert_allclose(out[..., 0], [[0, 0, 1, 1, 2, 2]] * 2, rtol=0, atol=1e-14)
    np.testing.assert_array_equal(kv_head_of(6, 3), [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(kv_head_of(8, 1), np.zeros(8))
    np.testing.assert_array_equal(kv_head_of(4, 4), np.arange(4))


def test_sequences_sharing_a_prefix_page():
    # Prefix sharing: both sequences start with the same physical page.
    q, kc, vc, tables, lens, keys, values = batch([4, 6], 2, 1, 4, garbage=np.nan, seed=4)
    tables[1, 0] = tables[0, 0]
    keys[1][:4] = keys[0][:4]; values[1][:4] = values[0][:4]
    out = paged_decode(q, kc, vc, tables, lens)
    np.testing.assert_allclose(out, textbook(q, keys, values, 1)[0], rtol=0, atol=ATOL)


def test_empty_sequence_in_a_batch():
    q, kc, vc, tables, lens, keys, values = batch([3, 1], 2, 2, 2, seed=5)
    lens = np.array([3, 0])
    out, lse = paged_decode(q, kc, vc, tables, lens, return_lse=True)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(lse[1], -np.inf)
    np.testing.assert_allclose(out[0], textbook(q[:1], keys[:1], values[:1], 2)[0][0], rtol=0, atol=ATOL)


def test_float16_cache_is_accumulated_in_float32():
    q, kc, vc, tables, lens, keys, values = batch([9, 4], 4, 2, 4, garbage=np.inf, seed=6)
    out = paged_decode(q.astype(np.float16), kc.astype(np.float16), vc.astype(np.float16), tables, lens)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(float), textbook(q, keys, values, 2)[0], rtol=0, atol=1e-2)


def _good():
    q, kc, vc, tables, lens, _, _ = batch([5, 3], 4, 2, 4)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, seq_lens=lens)


@pytest.mark.parametrize("change, exc, words", [
    (dict(q=np.zeros((2, 3, 4))), ValueError, ["num_heads (3", "multiple of num_kv_heads (2"]),
    (dict(q=np.zeros((2, 4, 5))), ValueError, ["head dim", "(2, 4, 5)"]),
    (dict(q=np.zeros((4, 4))), ValueError, ["q", "3-D"]),
    (dict(q=np.zeros((3, 4, 4))), ValueError, ["num_seqs"]),
    (dict(seq_lens=np.array([5])), ValueError, ["num_seqs"]),
    (dict(seq_lens=np.array([5, -1])), ValueError, ["seq_lens[1]", "at least 0", "-1"]),
    (dict(seq_lens=np.array([-3, 3])), ValueError, ["seq_lens[0]", "-3"]),
    (dict(seq_lens=np.array([5.0, 3.0])), TypeError, ["seq_lens", "integers"]),
    (dict(seq_lens=np.array([5, 13])), ValueError, ["block_tables[1]", "too short"]),
    (dict(block_tables=np.array([[0, 1, 2], [100, 0, 0]])), ValueError, ["block_tables[1][0] = 100", "outside"]),
    (dict(block_tables=np.array([[0, -2, 2], [3, 0, 0]])), ValueError, ["block_tables[0][1] = -2"]),
    (dict(block_tables=np.zeros(3, dtype=int)), ValueError, ["block_tables", "2-D"]),
    # one sequence's blocks each need a page of their own (sharing a page between sequences is fine)
    (dict(block_tables=np.array([[2, 2, 0], [3, 0, 0]])), ValueError,
     ["block_tables[0] names page 2 for logical blocks 0 and 1"]),
    (dict(v_cache=np.zeros((6, 4, 1, 3))), ValueError, ["k_cache and v_cache"]),
    (dict(k_cache=np.zeros((6, 4, 4))), ValueError, ["k_cache", "4-D"]),
])
def test_bad_input_is_a_clear_error(change, exc, words):
    args = _good()
    args.update(change)
    with pytest.raises(exc) as err:
        paged_decode(**args)
    for w in words:
        assert w in str(err.value)


def test_kv_head_of_errors():
    with pytest.raises(ValueError, match="multiple"):
        kv_head_of(6, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_head_of(4, 0)
    with pytest.raises(TypeError, match="num_heads"):
        kv_head_of(4.0, 2)


# --- KV-cache bytes ------------------------------------------------------------------------------

def test_llama2_7b_is_half_a_mebibyte_per_token():
    # 32 layers x 32 heads x 128 dims x 2 (K and V) x 2 bytes = 524,288 bytes per token.
    per_token = kv_cache_bytes(1, 32, 32, 128, np.float16)
    assert per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert kv_cache_bytes(4096, 32, 32, 128, "float16") == 2 * 1024**3           # 2 GiB at 4k context
    assert kv_cache_bytes(4096, 32, 8, 128, "float16") == 2 * 1024**3 // 4       # GQA-8: 4x less
    assert kv_cache_bytes(4096, 32, 1, 128, "float16") == 2 * 1024**3 // 32      # MQA: 32x less
    assert kv_cache_bytes(4096, 32, 8, 128, "bf16", batch_size=3) == 3 * 512 * 1024**2


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), (np.float64, 8), ("bfloat16", 2), ("fp8", 1),
                                             (np.dtype("float16"), 2), ("BF16", 2), (np.int8, 1)])
def test_kv_bytes_scale_with_every_factor(dtype, itemsize):
    assert kv_cache_bytes(5, 3, 2, 7, dtype, batch_size=2) == 2 * 5 * 3 * 2 * 7 * 2 * itemsize
    assert kv_cache_bytes(0, 3, 2, 7, dtype) == 0


@pytest.mark.parametrize("args, exc, word", [
    ((10, 0, 8, 128, "float16"), ValueError, "num_layers"),
    ((-1, 32, 8, 128, "float16"), ValueError, "seq_len"),
    ((10, 32, 8.0, 128, "float16"), TypeError, "num_kv_heads"),
    ((10, 32, 8, 128, "float17"), TypeError, "dtype"),
    ((10, 32, 8, 128, None), TypeError, "dtype"),
    ((10, 32, 8, 128, object), TypeError, "dtype"),
    ((10, 32, 8, 128, "V"), TypeError, "dtype"),
    ((10, 32, 8, 128, str), TypeError, "dtype"),
    ((10, 32, 8, 128, np.complex64), TypeError, "dtype"),
    ((10, 32, 8, 128, bool), TypeError, "dtype"),
])
def test_kv_bytes_bad_input(args, exc, word):
    with pytest.raises(exc, match=word):
        kv_cache_bytes(*args)


@settings(max_examples=40, deadline=None)
@given(seq_lens=st.lists(st.integers(0, 20), min_size=1, max_size=4), block_size=st.integers(1, 6),
       heads=st.sampled_from(HEADS), garbage=st.sampled_from(GARBAGE), seed=st.integers(0, 2**16))
def test_property_paged_decode_equals_textbook(seq_lens, block_size, heads, garbage, seed):
    num_heads, num_kv_heads = heads
    q, kc, vc, tables, lens, keys, values = batch(seq_lens, num_heads, num_kv_heads, block_size, garbage=garbage,
                                                  seed=seed)
    out, lse = paged_decode(q, kc, vc, tables, lens, return_lse=True)
    ref, ref_lse = textbook(q, keys, values, num_kv_heads)
    np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


def test_gqa_and_kv_bytes_figures_draw_the_library_numbers():
    from lessons.views.paged import gqa_groups_figure, kv_bytes_figure
    fig = gqa_groups_figure(8, (8, 2, 1))
    lines = [len(ax.lines) for ax in fig.axes]
    assert lines == [8, 8, 8]                               # one line per query head in every panel
    ends = sorted(round(line.get_xdata()[1], 6) for line in fig.axes[1].lines)
    assert ends == [1.5] * 4 + [5.5] * 4                   # GQA-2: heads 0-3 -> KV 0, heads 4-7 -> KV 1
    lens = [1024, 4096]
    fig = kv_bytes_figure(lens, num_layers=32, num_heads=32, head_dim=128, kv_heads=(32, 8, 1))
    ys = [list(line.get_ydata()) for line in fig.axes[0].lines]
    assert ys == [[kv_cache_bytes(n, 32, g, 128, "float16") / 2**30 for n in lens] for g in (32, 8, 1)]
    assert ys[0] == [0.5, 2.0]                              # Llama-2-7B: 0.5 GiB per 1K tokens


def test_write_paged_batch_round_trip():
    from lessons.schedules.gqa_decode import write_paged_batch
    rng = np.random.default_rng(30)
    lens = [5, 1, 8, 0]
    keys = [rng.standard_normal((n, 2, 3)) for n in lens]
    values = [rng.standard_normal((n, 2, 4)) for n in lens]
    kc, vc, tables, seq_lens = write_paged_batch(keys, values, 4, seed=1)
    np.testing.assert_array_equal(seq_lens, lens)
    assert tables.shape == (4, 2)
    used = [p for p in tables.ravel() if p >= 0]
    assert len(used) == len(set(used)) == 2 + 1 + 2 + 0     # no page is given out twice
    np.testing.assert_array_equal(tables[1, 1:], -1)
    for b, n in enumerate(lens):
        pages = [p for p in tables[b] if p >= 0]
        if n:
            np.testing.assert_array_equal(np.concatenate([kc[p] for p in pages])[:n], keys[b])
            np.testing.assert_array_equal(np.concatenate([vc[p] for p in pages])[:n], values[b])
    q = rng.standard_normal((4, 4, 3))
    np.testing.assert_allclose(paged_decode(q, kc, vc, tables, seq_lens), textbook(q, keys, values, 2)[0],
                               rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="num_blocks = 3 is too small"):
        write_paged_batch(keys, values, 4, num_blocks=3)
    with pytest.raises(ValueError, match="sequence 1"):
        write_paged_batch([keys[0], rng.standard_normal((2, 3, 3))], values[:2], 4)

"""Grading: GQA head mapping in a paged decode (notebook 09)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, seeds
from lessons import attention

EXERCISE = "gqa_decode"

RATIOS = [(4, 4), (8, 1), (6, 2), (12, 4), (8, 2), (32, 8), (12, 3), (6, 3)]


def gqa_case(seed, num_heads, num_kv_heads, seq_len, block_size, d=4, dv=3, stale=np.nan):
    g = np.random.default_rng(seed)
    used = -(-seq_len // block_size)
    num_blocks = used + 2
    pages = g.permutation(num_blocks)[:used]
    kc = np.full((num_blocks, block_size, num_kv_heads, d), stale)
    vc = np.full((num_blocks, block_size, num_kv_heads, dv), stale)
    keys = g.standard_normal((seq_len, num_kv_heads, d)) * 2.0
    values = g.standard_normal((seq_len, num_kv_heads, dv))
    for j, page in enumerate(pages):
        n = min(block_size, seq_len - j * block_size)
        kc[page, :n], vc[page, :n] = keys[j * block_size:j * block_size + n], values[j * block_size:j * block_size + n]
    q = g.standard_normal((num_heads, d)) * 2.0
    return q, pages.astype(np.int64), kc, vc, keys, values


def expected(q, keys, values, num_kv_heads):
    group = q.shape[0] // num_kv_heads
    return np.stack([attention(q[h], keys[:, h // group], values[:, h // group]) for h in range(q.shape[0])])


@pytest.mark.catches("head_modulo")
@pytest.mark.parametrize("num_heads, num_kv_heads", RATIOS)
def test_kv_head_mapping(answer, num_heads, num_kv_heads):
    got = [answer.kv_head(h, num_heads, num_kv_heads) for h in range(num_heads)]
    want = [h // (num_heads // num_kv_heads) for h in range(num_heads)]
    assert got == want, f"kv heads of query heads 0..{num_heads - 1} with {num_kv_heads} kv heads"


@pytest.mark.hint("kv_head raises ValueError when num_heads is not a multiple of num_kv_heads or h is out of range")
def test_kv_head_rejects_bad_input(answer):
    with pytest.raises(ValueError):
        answer.kv_head(0, 6, 4)
    with pytest.raises(ValueError):
        answer.kv_head(8, 8, 2)


@pytest.mark.catches("head_modulo")
@pytest.mark.parametrize("num_heads, num_kv_heads", RATIOS)
def test_decode_every_ratio(answer, num_heads, num_kv_heads):
    q, bt, kc, vc, keys, values = gqa_case(num_heads * 10 + num_kv_heads, num_heads, num_kv_heads, 12, 4)
    out = answer.paged_gqa_decode(q, bt, kc, vc, 12, 4)
    assert_close(out, expected(q, keys, values, num_kv_heads),
                 f"out for {num_heads} query heads over {num_kv_heads} kv heads")


@pytest.mark.hint("head h of the output is lessons.attention(q[h], keys of kv head h // group, values of it)")
@given(seed=seeds, num_kv_heads=st.integers(1, 3), group=st.integers(1, 4), seq_len=st.integers(1, 30),
       block_size=st.integers(1, 8))
def test_decode_matches_attention_per_head(answer, seed, num_kv_heads, group, seq_len, block_size):
    num_heads = num_kv_heads * group
    q, bt, kc, vc, keys, values = gqa_case(seed, num_heads, num_kv_heads, seq_len, block_size)
    out = answer.paged_gqa_decode(q, bt, kc, vc, seq_len, block_size)
    assert_close(out, expected(q, keys, values, num_kv_heads),
                 f"out ({num_heads} heads / {num_kv_heads} kv heads, seq_len {seq_len}, block_size {block_size})")


@pytest.mark.catches("last_partial_tile_dropped", "reads_past_seq_len")
@pytest.mark.parametrize("seq_len, block_size", [(3, 4), (10, 4), (7, 8)])
def test_partial_last_block_with_stale_nan(answer, seq_len, block_size):
    q, bt, kc, vc, keys, values = gqa_case(seq_len, 3, 3, seq_len, block_size)   # one head per kv head
    out = answer.paged_gqa_decode(q, bt, kc, vc, seq_len, block_size)
    assert_close(out, expected(q, keys, values, 3), f"out for seq_len {seq_len}, block_size {block_size}, "
                                                    f"NaN past seq_len")


@pytest.mark.hint("paged_gqa_decode raises ValueError when num_heads is not a multiple of num_kv_heads")
def test_decode_rejects_bad_ratio(answer):
    q, bt, kc, vc, keys, values = gqa_case(1, 4, 4, 5, 4)
    with pytest.raises(ValueError):
        answer.paged_gqa_decode(q[:3], bt, kc, vc, 5, 4)

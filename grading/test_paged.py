"""Grading: paged lookup through a block table, partial last block (notebook 07)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, no_nan, seeds
from lessons import attention

EXERCISE = "paged"


def paged_case(seed, seq_len, block_size, d=4, dv=3, *, stale=np.nan, spare_pages=3):
    """A scattered cache: the sequence's blocks in random pages, everything else ``stale``.

    Returns q, block_table (with -1 padding after the used entries), k_cache, v_cache and
    the sequence's keys and values laid out contiguously.
    """
    g = np.random.default_rng(seed)
    used = -(-seq_len // block_size)
    num_blocks = used + spare_pages
    pages = g.permutation(num_blocks)[:used]
    k_cache = np.full((num_blocks, block_size, d), stale, dtype=np.float64)
    v_cache = np.full((num_blocks, block_size, dv), stale, dtype=np.float64)
    keys, values = g.standard_normal((seq_len, d)) * 2.0, g.standard_normal((seq_len, dv))
    for j, page in enumerate(pages):
        n = min(block_size, seq_len - j * block_size)
        k_cache[page, :n] = keys[j * block_size: j * block_size + n]
        v_cache[page, :n] = values[j * block_size: j * block_size + n]
    block_table = np.concatenate([pages, np.full(2, -1)]).astype(np.int64)
    return g.standard_normal(d) * 2.0, block_table, k_cache, v_cache, keys, values


def expected(q, keys, values):
    return attention(q, keys, values)


@pytest.mark.hint("fold one logical block per tile, keys k_cache[block_table[j], :n]")
@given(seed=seeds, blocks=st.integers(1, 6), block_size=st.integers(1, 8))
def test_full_blocks(answer, seed, blocks, block_size):
    q, bt, kc, vc, keys, values = paged_case(seed, blocks * block_size, block_size)
    out = answer.paged_attention(q, bt, kc, vc, blocks * block_size, block_size)
    assert_close(out, expected(q, keys, values), f"out with {blocks} full blocks of {block_size}")


def repelling(q, kc, vc, bt, seq_len, block_size):
    """Fill the slots of the last page past seq_len with keys that score about -1000 against q.

    Reading them changes nothing (weight exp(-1000) = 0); zero-filling them does (a zero key
    scores 0)."""
    j = (seq_len - 1) // block_size                     # the last logical block
    n = seq_len - j * block_size
    kc[bt[j], n:] = -1000.0 * np.sqrt(q.shape[0]) * q / (q @ q)
    vc[bt[j], n:] = 7.0


@pytest.mark.hint("compare with lessons.attention on the sequence's keys laid out in order")
@given(seed=seeds, seq_len=st.integers(1, 40), block_size=st.integers(2, 8))
def test_any_length(answer, seed, seq_len, block_size):
    q, bt, kc, vc, keys, values = paged_case(seed, seq_len, block_size, stale=0.5)
    out = answer.paged_attention(q, bt, kc, vc, seq_len, block_size)
    assert_close(out, expected(q, keys, values), f"out for seq_len {seq_len}, block_size {block_size}")


@pytest.mark.catches("last_partial_tile_dropped")
@pytest.mark.parametrize("seq_len, block_size", [(3, 4), (9, 4), (1, 16), (13, 5)])
def test_the_partial_last_block_counts(answer, seq_len, block_size):
    """Changing the keys of the partial last block must change the output."""
    q, bt, kc, vc, keys, values = paged_case(seq_len * 7 + block_size, seq_len, block_size, stale=0.0)
    before = np.asarray(answer.paged_attention(q, bt, kc, vc, seq_len, block_size), float)
    j = (seq_len - 1) // block_size                     # the last logical block, partly filled
    n = seq_len - j * block_size
    kc[bt[j], :n] = 3.0 * q                             # its keys now score high
    vc[bt[j], :n] += 10.0
    after = np.asarray(answer.paged_attention(q, bt, kc, vc, seq_len, block_size), float)
    assert not np.allclose(before, after), (f"seq_len {seq_len}, block_size {block_size}: the output ignores "
                                            f"the last, partly filled block")


@pytest.mark.catches("zero_padding_as_mask", "last_partial_tile_dropped")
@pytest.mark.parametrize("seq_len, block_size", [(6, 4), (3, 4), (11, 5), (1, 8)])
def test_slots_past_seq_len_are_not_keys(answer, seq_len, block_size):
    q, bt, kc, vc, keys, values = paged_case(seq_len * 11 + block_size, seq_len, block_size, stale=0.0)
    repelling(q, kc, vc, bt, seq_len, block_size)
    out = answer.paged_attention(q, bt, kc, vc, seq_len, block_size)
    assert_close(out, expected(q, keys, values), f"out for seq_len {seq_len}, block_size {block_size}")


@pytest.mark.catches("reads_past_seq_len")
@given(seed=seeds, seq_len=st.integers(1, 30), block_size=st.integers(2, 8))
def test_stale_nan_past_seq_len(answer, seed, seq_len, block_size):
    # Compares the answer with itself, not with the reference: only reading the slots past
    # seq_len can make the two differ, so this check names that mistake and no other.
    q, bt, kc, vc, keys, values = paged_case(seed, seq_len, block_size, stale=np.nan)
    out = answer.paged_attention(q, bt, kc, vc, seq_len, block_size)
    q2, bt2, kc2, vc2, _, _ = paged_case(seed, seq_len, block_size, stale=7.0)
    same = answer.paged_attention(q2, bt2, kc2, vc2, seq_len, block_size)
    no_nan(out, f"out for seq_len {seq_len}, block_size {block_size}, with NaN in the slots past seq_len")
    assert_close(out, same, f"out for seq_len {seq_len}, block_size {block_size}: NaN vs 7.0 in the slots past "
                            f"seq_len changed it")


@pytest.mark.hint("seq_len = 0 (no tokens) returns zeros, never NaN")
def test_empty_sequence(answer):
    q, bt, kc, vc, keys, values = paged_case(1, 4, 4)
    out = answer.paged_attention(q, np.full(2, -1), kc, vc, 0, 4)
    assert_close(out, np.zeros(vc.shape[2]), "out for seq_len 0")


@pytest.mark.hint("the block table decides where each block lives: the same sequence in other pages gives the "
                  "same output")
@given(seed=seeds, seq_len=st.integers(1, 30), block_size=st.integers(1, 6))
def test_pages_can_be_anywhere(answer, seed, seq_len, block_size):
    q, bt, kc, vc, keys, values = paged_case(seed, seq_len, block_size, stale=0.0)
    g = np.random.default_rng(seed + 1)
    perm = g.permutation(kc.shape[0])                  # move every page somewhere else
    inverse = np.argsort(perm)
    moved = answer.paged_attention(q, np.where(bt >= 0, inverse[np.maximum(bt, 0)], -1),
                                   kc[perm], vc[perm], seq_len, block_size)
    assert_close(moved, expected(q, keys, values), "out after moving the pages")

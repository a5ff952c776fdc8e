"""Grading: the backward pass tile by tile, P recomputed from L (the backward-pass notebook).

Expected gradients come from the textbook backward :func:`lessons.attention_backward`
(P, dP, dS materialised whole), checked itself against finite differences in
``tests/test_backward.py``; ``o`` and ``lse`` from the textbook forward. Most checks look
at one gradient at a time, so that a wrong line shows up where it belongs.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, no_nan, qkv, rng, seeds
from lessons import attention, attention_backward

EXERCISE = "backward"


def case(seed, nq, nk, d=4, dv=3, causal=False):
    q, k, v = qkv(seed, nq, nk, d, dv=dv, spread=1.5)
    do = rng(seed + 1).standard_normal((nq, dv))
    o, lse = attention(q, k, v, causal=causal, return_lse=True)
    return q, k, v, o, lse, do


def run(answer, q, k, v, o, lse, do, **kw):
    out = answer.flash_backward(q, k, v, o, lse, do, **kw)
    assert isinstance(out, tuple) and len(out) == 3, "flash_backward must return a tuple (dq, dk, dv)"
    return out


# Square tiles (block_q == block_k, N a multiple of the block) unless a check is about other shapes.

@pytest.mark.catches("dv_uses_p_not_pt", "p_not_normalised_by_l")
@given(seed=seeds, blocks=st.integers(1, 4), block=st.integers(1, 5))
def test_dv_square_tiles(answer, seed, blocks, block):
    n = blocks * block
    q, k, v, o, lse, do = case(seed, n, n)
    _, _, dv = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block)
    assert_close(dv, attention_backward(q, k, v, do)[2], f"dv (N = {n}, blocks of {block})")


@pytest.mark.catches("dv_uses_p_not_pt")
@pytest.mark.parametrize("nq, nk, block_q, block_k", [(6, 8, 3, 4), (8, 6, 4, 2), (4, 12, 4, 6)])
def test_dv_rectangular_tiles(answer, nq, nk, block_q, block_k):
    q, k, v, o, lse, do = case(nq * 7 + nk, nq, nk)
    _, _, dv = run(answer, q, k, v, o, lse, do, block_q=block_q, block_k=block_k)
    assert_close(dv, attention_backward(q, k, v, do)[2], f"dv with {block_q} x {block_k} tiles, shape (Nk, dv)")


@pytest.mark.catches("p_not_normalised_by_l")
@pytest.mark.parametrize("n, block", [(4, 2), (6, 3), (8, 8)])
def test_uniform_attention_gives_each_key_the_mean_do(answer, n, block):
    # q = 0: every score is 0, every P_ij = 1/Nk, so dV_j = sum_i dO_i / Nk for every key j
    q, k, v, o, lse, do = case(n, n, n)
    q = np.zeros_like(q)
    o, lse = attention(q, k, v, return_lse=True)
    _, _, dv = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block)
    assert_close(dv, np.tile(do.sum(axis=0) / n, (n, 1)), "dv when every P_ij = 1/Nk (rows of P sum to 1)")


@pytest.mark.catches("d_left_out", "p_not_normalised_by_l", "scale_missing_on_dq")
@given(seed=seeds, blocks_q=st.integers(1, 4), blocks_k=st.integers(1, 4), block=st.integers(1, 4))
def test_dq(answer, seed, blocks_q, blocks_k, block):
    q, k, v, o, lse, do = case(seed, blocks_q * block, blocks_k * block)
    dq, _, _ = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block)
    assert_close(dq, attention_backward(q, k, v, do)[0], "dq")


@pytest.mark.catches("d_left_out", "p_not_normalised_by_l", "scale_missing_on_dk")
@given(seed=seeds, blocks_q=st.integers(1, 4), blocks_k=st.integers(1, 4), block=st.integers(1, 4))
def test_dk(answer, seed, blocks_q, blocks_k, block):
    q, k, v, o, lse, do = case(seed, blocks_q * block, blocks_k * block)
    _, dk, _ = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block)
    assert_close(dk, attention_backward(q, k, v, do)[1], "dk")


@pytest.mark.catches("d_left_out")
@pytest.mark.parametrize("n, block", [(4, 2), (6, 3)])
def test_identical_keys_give_zero_dq(answer, n, block):
    # every key the same: moving q_i changes no probability, so dq = 0 (the rows of dS sum to 0)
    q, k, v, o, lse, do = case(n + 1, n, n)
    k = np.tile(k[:1], (n, 1))
    o, lse = attention(q, k, v, return_lse=True)
    dq, _, _ = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block)
    assert_close(dq, np.zeros_like(q), "dq when all keys are equal")


@pytest.mark.catches("scale_missing_on_dq", "scale_missing_on_dk")
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_q_dq_balances_k_dk(answer, seed):
    # sum_i q_i . dq_i = scale * sum_ij dS_ij (q_i . k_j) = sum_j k_j . dk_j: both carry the same scale
    q, k, v, o, lse, do = case(seed, 8, 8, d=16)
    dq, dk, _ = run(answer, q, k, v, o, lse, do, block_q=4, block_k=4)
    lhs, rhs = float(np.sum(q * np.asarray(dq))), float(np.sum(k * np.asarray(dk)))
    assert lhs == pytest.approx(rhs, rel=1e-6, abs=1e-9), (
        f"sum(q * dq) = {lhs:.6g} but sum(k * dk) = {rhs:.6g}: dq and dk must carry the same scale")


@pytest.mark.catches("causal_dropped_in_backward")
@given(seed=seeds, blocks=st.integers(1, 4), block=st.integers(1, 4), extra=st.integers(0, 2))
def test_causal_dq_dk(answer, seed, blocks, block, extra):
    nk = blocks * block
    nq = nk + extra * block if extra else nk
    q, k, v, o, lse, do = case(seed, nq, nk, causal=True)
    dq, dk, _ = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block, causal=True)
    want = attention_backward(q, k, v, do, causal=True)
    assert_close(dq, want[0], f"dq, causal, Nq = {nq}, Nk = {nk}")
    assert_close(dk, want[1], f"dk, causal, Nq = {nq}, Nk = {nk}")


@pytest.mark.catches("causal_dropped_in_backward")
@given(seed=seeds, blocks=st.integers(2, 4), block=st.integers(1, 4))
def test_causal_dv(answer, seed, blocks, block):
    n = blocks * block
    q, k, v, o, lse, do = case(seed, n, n, causal=True)
    _, _, dv = run(answer, q, k, v, o, lse, do, block_q=block, block_k=block, causal=True)
    assert_close(dv, attention_backward(q, k, v, do, causal=True)[2], "dv, causal")


@pytest.mark.catches("causal_dropped_in_backward")
def test_rows_that_see_no_key_get_zero_dq(answer):
    # causal with Nq = 8 > Nk = 4: rows 0..3 see no key (lse = -inf)
    q, k, v, o, lse, do = case(5, 8, 4, causal=True)
    assert np.isneginf(lse[:4]).all()
    dq, dk, dv = run(answer, q, k, v, o, lse, do, block_q=4, block_k=4, causal=True)
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        no_nan(g, f"{name} with rows that see no key")
    assert_close(np.asarray(dq)[:4], np.zeros((4, 4)), "dq of the rows that see no key")


@pytest.mark.hint("the last block is partial when block_q or block_k does not divide Nq or Nk: "
                  "ceil(N / block) blocks, sliced with min(start + block, N)")
@given(seed=seeds, nq=st.integers(1, 11), nk=st.integers(1, 11), block_q=st.integers(1, 5),
       block_k=st.integers(1, 5), causal=st.booleans())
def test_any_block_sizes(answer, seed, nq, nk, block_q, block_k, causal):
    q, k, v, o, lse, do = case(seed, nq, nk, causal=causal)
    got = run(answer, q, k, v, o, lse, do, block_q=block_q, block_k=block_k, causal=causal)
    want = attention_backward(q, k, v, do, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, f"{name} (Nq = {nq}, Nk = {nk}, blocks {block_q} x {block_k}, causal = {causal})")

"""Grading: one ring-attention step, driven around a simulated ring (notebook 08)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from _support import assert_close, no_nan, qkv, seeds
from lessons import attention

EXERCISE = "ring_step"


def blocks(n, world_size):
    """Cut range(n) into world_size contiguous non-empty blocks, sizes as equal as possible."""
    assert 1 <= world_size <= n
    edges = np.linspace(0, n, world_size + 1).round().astype(int)
    return list(zip(edges[:-1], edges[1:]))


def run_ring(answer, q, k, v, world_size, causal, orders=None):
    """Device p holds query block p; at step t it holds KV block (p - t) mod P (or orders[p][t])."""
    parts = blocks(q.shape[0], world_size)
    dv = v.shape[1]
    out = np.zeros((q.shape[0], dv))
    for p, (a, b) in enumerate(parts):
        m, l, o = np.full(b - a, -np.inf), np.zeros(b - a), np.zeros((b - a, dv))
        for t in range(world_size):
            j = (p - t) % world_size if orders is None else orders[p][t]
            ka, kb = parts[j]
            m, l, o = answer.ring_step(m, l, o, q[a:b], k[ka:kb], v[ka:kb], q_start=int(a), k_start=int(ka),
                                       causal=causal)
        l = np.asarray(l, float)
        out[a:b] = np.where(l[:, None] > 0, np.asarray(o) / np.where(l > 0, l, 1.0)[:, None], 0.0)
    return out


@pytest.mark.hint("after every device has folded every KV block, o / l must equal lessons.attention")
@given(seed=seeds, n=st.integers(1, 24), world_size=st.integers(1, 5))
def test_ring_matches_attention(answer, seed, n, world_size):
    q, k, v = qkv(seed, n, n, 4, dv=3)
    world_size = min(world_size, n)
    assert_close(run_ring(answer, q, k, v, world_size, False), attention(q, k, v),
                 f"ring of {world_size} devices over N = {n}")


@pytest.mark.catches("causal_offset_ignored")
@given(seed=seeds, n=st.integers(2, 24), world_size=st.integers(2, 5))
def test_causal_ring_matches_attention(answer, seed, n, world_size):
    q, k, v = qkv(seed, n, n, 4, dv=3)
    world_size = min(world_size, n)
    assert_close(run_ring(answer, q, k, v, world_size, True), attention(q, k, v, causal=True),
                 f"causal ring of {world_size} devices over N = {n}")


@pytest.mark.hint("the order in which a device receives the blocks must not matter")
@given(seed=seeds, n=st.integers(2, 20), world_size=st.integers(2, 5), causal=st.booleans())
def test_block_order_does_not_matter(answer, seed, n, world_size, causal):
    q, k, v = qkv(seed, n, n, 4, dv=3)
    world_size = min(world_size, n)
    g = np.random.default_rng(seed)
    orders = [g.permutation(world_size) for _ in range(world_size)]
    assert_close(run_ring(answer, q, k, v, world_size, causal, orders), attention(q, k, v, causal=causal),
                 f"blocks received in a shuffled order (causal={causal})")


@pytest.mark.catches("no_guard", "causal_offset_ignored")
def test_future_block_leaves_the_state_alone(answer):
    q, k, v = qkv(4, 8, 8, 4, dv=3)
    # device holding queries 0..3 receives the KV block of positions 4..7: all in its future
    m0 = np.full(4, -np.inf)
    m, l, o = answer.ring_step(m0, np.zeros(4), np.zeros((4, 3)), q[:4], k[4:], v[4:], q_start=0, k_start=4,
                               causal=True)
    no_nan(l, "l after a block from the future")
    no_nan(o, "o after a block from the future")
    assert_close(m, m0, "m of an empty state after a future block")
    assert_close(l, np.zeros(4), "l of an empty state after a future block")
    # and a non-empty state is unchanged
    s = (q[:4] @ k[:4].T) / 2.0
    state = answer.ring_step(m0, np.zeros(4), np.zeros((4, 3)), q[:4], k[:4], v[:4], q_start=0, k_start=0,
                             causal=True)
    after = answer.ring_step(*state, q[:4], k[4:], v[4:], q_start=0, k_start=4, causal=True)
    for x, y, name in zip(after, state, "mlo"):
        assert_close(x, y, f"{name} after a block from the future")


@pytest.mark.catches("causal_offset_ignored")
def test_diagonal_of_a_later_device(answer):
    """Queries 4..7 with keys 2..5: key 5 is hidden from query 4 only."""
    q, k, v = qkv(9, 8, 8, 4, dv=3)
    m, l, o = answer.ring_step(np.full(4, -np.inf), np.zeros(4), np.zeros((4, 3)), q[4:], k[2:6], v[2:6],
                               q_start=4, k_start=2, causal=True)
    mask = np.arange(2, 6)[None, :] <= np.arange(4, 8)[:, None]
    assert_close(np.asarray(o) / np.asarray(l)[:, None], attention(q[4:], k[2:6], v[2:6], mask=mask),
                 "o / l of queries 4..7 against keys 2..5")

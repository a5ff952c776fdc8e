"""Ring attention (simulated devices) against the textbook reference."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lessons import attention, ring_attention
from lessons.schedules.ring import RingTrace

ATOL = 1e-12


def qkv(nq, nk, d=5, dv=3, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(d) if nq is None else rng.standard_normal((nq, d))
    return q, rng.standard_normal((nk, d)), rng.standard_normal((nk, dv))


@pytest.mark.parametrize("nq, nk", [(1, 1), (8, 8), (7, 7), (5, 12), (12, 5), (16, 16), (3, 20)])
@pytest.mark.parametrize("causal", [False, True])
def test_every_world_size_gives_the_textbook_answer(nq, nk, causal):
    q, k, v = qkv(nq, nk, seed=nq * 31 + nk)
    ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    for world_size in range(1, max(nq, nk) + 3):           # includes devices with empty blocks
        out, lse = ring_attention(q, k, v, world_size, causal=causal, return_lse=True)
        np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
        np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


def test_causal_rows_that_see_nothing_output_zero():
    # Nq > Nk bottom-right: query i sees keys j <= i - 4, so rows 0..3 see nothing.
    q, k, v = qkv(10, 6, seed=3)
    with np.errstate(all="raise"):
        out, lse = ring_attention(q, k, v, 3, causal=True, return_lse=True)
    np.testing.assert_array_equal(out[:4], 0.0)
    np.testing.assert_array_equal(lse[:4], -np.inf)
    assert np.all(np.isfinite(out))


def test_single_query_vector():
    q, k, v = qkv(None, 9, seed=4)
    out = ring_attention(q, k, v, 4)
    assert out.shape == (3,)
    np.testing.assert_allclose(out, attention(q, k, v), rtol=0, atol=ATOL)


def test_schedule_each_device_holds_each_block_once():
    q, k, v = qkv(8, 8, seed=5)
    out, trace = ring_attention(q, k, v, 4, return_trace=True)
    assert isinstance(trace, RingTrace)
    # at step t device r holds block (r - t) mod 4: written out by hand
    np.testing.assert_array_equal(trace.holds, [[0, 1, 2, 3],
                                                [3, 0, 1, 2],
                                                [2, 3, 0, 1],
                                                [1, 2, 3, 0]])
    assert trace.folded.all()
    assert len(trace) == 16
    assert trace.q_ranges == [(0, 2), (2, 4), (4, 6), (6, 8)] == trace.kv_ranges
    for step in trace.steps:                                # each absorb folds the block it holds
        assert trace.holds[step.ring_step, step.device] == step.tile
        assert (step.key_start, step.key_stop) == trace.kv_ranges[step.tile]
        assert (step.row_start, step.row_stop) == trace.q_ranges[step.device]


def test_causal_schedule_skips_blocks_above_the_diagonal():
    # Nq = Nk = 8, four devices: device r needs KV blocks 0..r only, 10 absorbs out of 16.
    q, k, v = qkv(8, 8, seed=6)
    out, trace = ring_attention(q, k, v, 4, causal=True, return_trace=True)
    expected = trace.holds <= np.arange(4)[None, :]         # block index <= device index
    np.testing.assert_array_equal(trace.folded, expected)
    assert trace.folded.sum() == 4 * 5 // 2
    np.testing.assert_allclose(out, attention(q, k, v, causal=True), rtol=0, atol=ATOL)


def test_row_trace_replays_the_ring_for_one_row():
    q, k, v = qkv(6, 9, seed=8)
    out, trace = ring_attention(q, k, v, 3, return_trace=True)
    row = trace.row(4)                                      # device 2 owns rows 4, 5
    assert list(row.tile) == [2, 1, 0]                      # it sees its own block first, then 1, then 0
    seen = np.concatenate([np.arange(*trace.kv_ranges[b]) for b in row.tile])
    s = (k @ q[4]) / np.sqrt(5)
    for j in range(len(row)):                              # m after each step: the max over blocks seen so far
        keys = np.concatenate([np.arange(*trace.kv_ranges[b]) for b in row.tile[:j + 1]])
        assert row.m[j] == pytest.approx(s[keys].max(), abs=ATOL)
        np.testing.assert_allclose(row.output[j], attention(q[4], k[keys], v[keys]), rtol=0, atol=ATOL)
    assert sorted(seen) == list(range(9))
    np.testing.assert_allclose(row.output[-1], out[4], rtol=0, atol=ATOL)


def test_float16_inputs_keep_their_dtype():
    q, k, v = qkv(6, 6, seed=1)
    out = ring_attention(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), 3, causal=True)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(float), attention(q, k, v, causal=True), rtol=0, atol=1e-2)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(world_size=0), ValueError, "world_size"),
    (dict(world_size=1.5), TypeError, "world_size"),
    (dict(world_size=2, causal="yes"), TypeError, "causal"),
    (dict(world_size=2, k=np.zeros((4, 6))), ValueError, "head dim"),
    (dict(world_size=2, v=np.zeros((3, 3))), ValueError, "Nk"),
    (dict(world_size=2, q=np.zeros((2, 5), dtype=int)), TypeError, "q"),
])
def test_bad_input(kwargs, exc, word):
    q, k, v = qkv(4, 4)
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    with pytest.raises(exc, match=word):
        ring_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@settings(max_examples=50, deadline=None)
@given(nq=st.integers(1, 24), nk=st.integers(0, 24), world_size=st.integers(1, 10), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_property_ring_equals_textbook(nq, nk, world_size, causal, seed):
    q, k, v = qkv(nq, nk, d=3, dv=2, seed=seed)
    out, lse = ring_attention(q, k, v, world_size, causal=causal, return_lse=True)
    ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


def test_ring_figure_shows_the_schedule_of_the_trace():
    from lessons.views.split_kv import ring_figure
    q, k, v = qkv(8, 8, seed=9)
    _, trace = ring_attention(q, k, v, 4, causal=True, return_trace=True)
    fig = ring_figure(trace, step=2)                        # ring steps count from 1: this is the second
    cells = [p for p in fig.axes[1].patches if p.get_width() == 1 and p.get_height() == 1]
    assert len(cells) == 16
    for p in cells:
        t, r = int(p.get_x()), int(p.get_y())
        assert (p.get_hatch() is None) == bool(trace.folded[t, r])   # hatched = nothing folded
    labels = [txt.get_text() for txt in fig.axes[1].texts]
    assert labels == [str(trace.holds[t, r]) for t in range(4) for r in range(4)]
    outlined = [p for p in fig.axes[1].patches if p.get_height() == 4 and not p.get_fill()]
    assert [p.get_x() for p in outlined] == [1]             # column index 1 = ring step 2
    assert "ring step 2 of 4" in fig.axes[0].get_title()
    for bad in (0, 5):
        with pytest.raises(ValueError, match="step"):
            ring_figure(trace, step=bad)
    assert "ring step 4 of 4" in ring_figure(trace).axes[0].get_title()   # default: the last step


# --- the second schedule (the query block and its state travel) and the zigzag split ---

from lessons.schedules.ring import fold_block, layout_index, ring_blocks, ring_layout, ring_message_bytes  # noqa: E402


@pytest.mark.parametrize("schedule", ["kv", "q"])
@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_both_schedules_and_splits_give_the_textbook_answer(schedule, split, causal):
    for nq, nk in ((13, 13), (10, 6), (6, 10)):
        q, k, v = qkv(nq, nk, seed=nq + 7 * nk)
        ref, ref_lse = attention(q, k, v, causal=causal, return_lse=True)
        for world_size in range(1, 8):
            for block_k in (None, 2):
                out, lse = ring_attention(q, k, v, world_size, causal=causal, schedule=schedule, split=split,
                                          block_k=block_k, return_lse=True)
                np.testing.assert_allclose(out, ref, rtol=0, atol=ATOL)
                np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=ATOL)


def test_q_schedule_moves_the_query_blocks_and_keeps_the_kv_blocks():
    q, k, v = qkv(8, 8, seed=5)
    out, trace = ring_attention(q, k, v, 4, schedule="q", return_trace=True)
    # at step t device r holds query block (r - t) mod 4 and always its own KV block r: by hand
    np.testing.assert_array_equal(trace.q_holds, [[0, 1, 2, 3],
                                                  [3, 0, 1, 2],
                                                  [2, 3, 0, 1],
                                                  [1, 2, 3, 0]])
    np.testing.assert_array_equal(trace.holds, np.tile(np.arange(4), (4, 1)))
    # query block 1 visits devices 1, 2, 3, 0 and so folds KV blocks 1, 2, 3, 0 in that order
    assert [rec.kv_block for rec in trace.records if rec.q_block == 1] == [1, 2, 3, 0]
    assert [rec.rank for rec in trace.records if rec.q_block == 1] == [1, 2, 3, 0]
    assert ring_blocks("q", 4, 1, 0) == (3, 0) and ring_blocks("kv", 4, 1, 0) == (0, 3)
    kv_out = ring_attention(q, k, v, 4, schedule="kv")
    np.testing.assert_allclose(out, kv_out, rtol=0, atol=ATOL)     # same output, other order of the sums


def test_records_hold_the_state_after_each_step():
    q, k, v = qkv(6, 6, d=4, dv=2, seed=11)
    _, trace = ring_attention(q, k, v, 3, schedule="q", return_trace=True)
    s = (q @ k.T) / 2.0                                            # scale 1/sqrt(4)
    for rec in trace.records:
        rows = layout_index(trace.q_chunks[rec.q_block])
        seen = [b for b in range(3) if any(x.q_block == rec.q_block and x.kv_block == b and x.step <= rec.step
                                           for x in trace.records)]
        keys = np.concatenate([np.arange(*trace.kv_ranges[b]) for b in seen])
        np.testing.assert_allclose(rec.m, s[np.ix_(rows, keys)].max(axis=1), rtol=0, atol=ATOL)
        np.testing.assert_allclose(rec.l, np.exp(s[np.ix_(rows, keys)] - rec.m[:, None]).sum(axis=1),
                                   rtol=0, atol=ATOL)


def test_zigzag_layout_by_hand():
    # 16 tokens, 4 ranks: 8 chunks of 2; rank r owns chunks r and 7 - r
    assert ring_layout(16, 4, "zigzag") == [[(0, 2), (14, 16)], [(2, 4), (12, 14)], [(4, 6), (10, 12)],
                                            [(6, 8), (8, 10)]]
    assert ring_layout(10, 3, "contiguous") == [[(0, 4)], [(4, 8)], [(8, 10)]]
    # 7 tokens, 2 ranks: chunks of 2 (the last short): rank 0 owns [0, 2) and [6, 7)
    assert ring_layout(7, 2, "zigzag") == [[(0, 2), (6, 7)], [(2, 4), (4, 6)]]
    np.testing.assert_array_equal(layout_index([(0, 2), (6, 7)]), [0, 1, 6])
    with pytest.raises(ValueError, match="split"):
        ring_layout(8, 2, "striped")


def test_zigzag_evens_out_causal_work():
    # 16 tokens, 4 ranks, tiles of 2 keys. Contiguous: rank r folds r + 1 blocks of 4 x 4 scores.
    # Zigzag: chunk r sees r + 1 tiles, chunk 7 - r sees 8 - r: 9 tiles of 2 x 2 on every rank.
    q, k, v = qkv(16, 16, seed=2)
    _, contiguous = ring_attention(q, k, v, 4, causal=True, return_trace=True)
    _, zigzag = ring_attention(q, k, v, 4, causal=True, split="zigzag", block_k=2, return_trace=True)
    np.testing.assert_array_equal(contiguous.work(), [16, 32, 48, 64])
    np.testing.assert_array_equal(zigzag.work(), [36, 36, 36, 36])


def test_message_bytes_by_hand():
    # 100 rows, d = dv = 64, float64: KV block 100 * 128 * 8; query block + m + l + o = 100 * 130 * 8
    assert ring_message_bytes("kv", 100, 64, 64) == {"per_step": 102400, "last_step": 0}
    assert ring_message_bytes("q", 100, 64, 64) == {"per_step": 104000, "last_step": 52800}
    with pytest.raises(ValueError, match="schedule"):
        ring_message_bytes("ring", 1, 1, 1)
    assert ring_message_bytes("q", np.int64(0), 64, 64, itemsize=2) == {"per_step": 0, "last_step": 0}


@pytest.mark.parametrize("args, exc, match", [
    (("kv", -5, 4, 4), ValueError, "rows must be at least 0, got -5"),      # was -320 bytes
    (("kv", 2.5, 4, 4), TypeError, "rows must be an int, got float 2.5"),  # was 160.0 bytes
    (("q", 2, 0, 4), ValueError, "d must be at least 1, got 0"),
    (("q", 2, 4, -1), ValueError, "dv must be at least 0, got -1"),
    (("q", 2, 4, 4, 0), ValueError, "itemsize must be at least 1, got 0"),
    (("q", 2, 4, 4, 4.0), TypeError, "itemsize must be an int"),
])
def test_ring_message_bytes_names_a_count_that_is_not_one(args, exc, match):
    with pytest.raises(exc, match=match):
        ring_message_bytes(*args)


@pytest.mark.parametrize("change, exc, match", [(dict(block_k=-1), ValueError, "block_k must be at least 1, got -1"),
                                               (dict(block_k=0), ValueError, "block_k must be at least 1, got 0"),
                                               (dict(block_k=2.0), TypeError, "block_k must be an int"),
                                               (dict(causal="no"), TypeError, "causal must be True or False")])
def test_fold_block_names_options_it_cannot_use(change, exc, match):
    """block_k = -1 absorbed nothing (an empty range), 0 meant a whole chunk, causal="no" a causal fold."""
    from lessons.core.state import State
    q, k, v = qkv(4, 4, d=2, dv=1, seed=1)
    with pytest.raises(exc, match=match):
        fold_block(State.empty(4, 1), q, [(0, 4)], k, v, [(0, 4)], nq=4, nk=4, scale=1.0, **change)


def test_fold_block_skips_tiles_in_the_future():
    q, k, v = qkv(4, 4, d=2, dv=1, seed=1)
    from lessons.core.state import State
    state, work = fold_block(State.empty(2, 1), q[:2], [(0, 2)], k[2:], v[2:], [(2, 4)], nq=4, nk=4,
                             scale=1.0, causal=True)
    assert work == 0 and np.all(np.isneginf(state.m))             # keys 2, 3 lie after queries 0, 1


@pytest.mark.parametrize("kwargs, word", [(dict(schedule="ring"), "schedule"), (dict(split="striped"), "split"),
                                          (dict(block_k=0), "block_k")])
def test_bad_schedule_split_block_k(kwargs, word):
    q, k, v = qkv(4, 4)
    with pytest.raises(ValueError, match=word):
        ring_attention(q, k, v, 2, **kwargs)


def test_ring_figure_of_the_q_schedule():
    from lessons.views.split_kv import ring_figure
    q, k, v = qkv(8, 8, seed=9)
    _, trace = ring_attention(q, k, v, 4, schedule="q", return_trace=True)
    fig = ring_figure(trace, step=1)
    labels = [txt.get_text() for txt in fig.axes[1].texts]
    assert labels == [str(trace.q_holds[t, r]) for t in range(4) for r in range(4)]   # the travelling query block
    assert "query block" in fig.axes[1].get_title()


@pytest.mark.parametrize("schedule", ["kv", "q"])
@pytest.mark.parametrize("split", ["contiguous", "zigzag"])
def test_hidden_keys_change_nothing_in_every_schedule(schedule, split):
    # key 8 is the last of 9: under the causal mask only row 8 sees it
    q, k, v = qkv(9, 9, seed=4)
    kwargs = dict(causal=True, schedule=schedule, split=split, block_k=2)
    ref = ring_attention(q, k, v, 3, **kwargs)
    k2, v2 = k.copy(), v.copy()
    k2[8], v2[8] = np.nan, np.inf
    with np.errstate(invalid="ignore"):
        out = ring_attention(q, k2, v2, 3, **kwargs)
    np.testing.assert_array_equal(out[:8], ref[:8])
    assert np.all(np.isnan(out[8]))

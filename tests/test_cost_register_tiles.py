"""lessons.cost.register_tiles: a thread's tile in the register-tiled rungs, counted by hand and held to the
kernel's tiles and to the loads in its PTX."""
import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.cost.register_tiles import register_tile
from lessons.gpu import source


def test_hand_counts_of_the_plain_and_the_wide_build():
    # plain, d = 64, 64 x 32: 16 row groups of 8 lanes -> 4 rows, 4 keys, 64 / 4 / 8 = 2 chunks per thread
    t = register_tile(64, 64, 32)
    assert (t.lanes, t.rows, t.keys, t.chunks, t.p_keys_per_load) == (8, 4, 4, 2, 1)
    assert t.s_loads_per_fma == 8 / 64             # per 4 columns: 4 q + 4 k loads, 4 x 4 x 4 FMAs
    assert t.pv_loads_per_fma == 6 / 32            # per key: 4 p + 2 v loads, 4 x 2 x 4 FMAs
    assert t.accumulators == 16 + 32
    # plain, d = 128, 32 x 32 (its default there): 2 rows, 4 keys, 4 chunks
    t = register_tile(128, 32, 32)
    assert (t.rows, t.keys, t.chunks) == (2, 4, 4)
    assert t.s_loads_per_fma == 6 / 32 and t.pv_loads_per_fma == 6 / 32
    # wide, d = 128, 64 x 64: 8 row groups of 16 lanes -> 8 rows, 4 keys, 128 / 4 / 16 = 2 chunks
    t = register_tile(128, 64, 64, wide=True)
    assert (t.lanes, t.rows, t.keys, t.chunks, t.p_keys_per_load) == (16, 8, 4, 2, 4)
    assert t.s_loads_per_fma == 12 / 128           # per 4 columns: 8 q + 4 k loads, 8 x 4 x 4 FMAs
    assert t.pv_loads_per_fma == 16 / 256          # per 4 keys: 8 p + 4 x 2 v loads, 8 x 2 x 4 x 4 FMAs
    assert t.accumulators == 32 + 64
    # a head dim whose chunks do not split evenly: d = 36 -> 9 chunks over 8 lanes, the busiest thread owns 2
    assert register_tile(36, 32, 16).chunks == 2 and register_tile(36, 32, 16, wide=True).chunks == 1


@pytest.mark.parametrize("d", [64, 128])
def test_the_wide_defaults_need_fewer_loads_per_fma_than_the_plain_ones(d):
    plain = register_tile(d, *source.flash_attention_regtile_config(d))
    wide = register_tile(d, *source.flash_attention_regtile_wide_config(d), wide=True)
    assert wide.s_loads_per_fma < plain.s_loads_per_fma and wide.pv_loads_per_fma < plain.pv_loads_per_fma
    assert wide.rows * wide.keys == 32 and wide.block_q * wide.block_k >= plain.block_q * plain.block_k


def test_every_tile_the_kernels_take_is_a_tile_here_and_no_other():
    for d in (4, 36, 64, 128, 256):
        for bq in (8, 16, 32, 64, 128):
            for bk in (8, 16, 32, 64, 128):
                for wide, config in ((False, source.flash_attention_regtile_config),
                                     (True, source.flash_attention_regtile_wide_config)):
                    try:
                        config(d, bq, bk)
                        takes = True
                    except ValueError as e:
                        takes = "shared memory" in str(e)        # legal tiles, only too big at this d
                    try:
                        register_tile(d, bq, bk, wide=wide)
                        counts = True
                    except ValueError:
                        counts = False
                    assert takes == counts, (d, bq, bk, wide)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="head_dim"):
        register_tile(18, 32, 32)
    with pytest.raises(ValueError, match="block_q"):
        register_tile(64, 128, 64, wide=True)
    with pytest.raises(ValueError, match="block_k"):
        register_tile(64, 64, 8, wide=True)
    with pytest.raises(TypeError, match="wide"):
        register_tile(64, 64, 32, wide="yes")
    with pytest.raises(TypeError, match="block_q"):
        register_tile(64, 64.0, 32)


@pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
@pytest.mark.parametrize("d", [64, 128])
def test_the_wide_builds_ptx_holds_the_loads_counted_here(d):
    # 16-byte shared loads in the wide build's PTX: the S loop's body (rows + keys) and the P V loop's body
    # (rows loads of p + 4 keys x chunks loads of v), the latter twice (the guarded and the plain P V loop),
    # each body written out twice (the loops run two passes per branch back, #pragma unroll 2).
    # (NVRTC 12.9 now and then adds a 4-byte load split off one of them; the 16-byte ones stay.)
    from lessons.gpu.compile import compile_ptx, nvrtc_version

    if nvrtc_version()[:2] != (12, 9):
        pytest.skip("the counts are those of NVRTC 12.9's unrolling")
    t = register_tile(d, *source.flash_attention_regtile_wide_config(d), wide=True)
    ptx = compile_ptx(source.flash_attention_regtile_wide_build(d), "sm_80")
    assert ptx.count("ld.shared.v4.f32") == 2 * ((t.rows + t.keys) + 2 * (t.rows + 4 * t.chunks))


@pytest.mark.parametrize("d, block_q, block_k, wide", [(128, 32, 32, False), (64, 64, 32, False), (36, 32, 16, False),
                                                        (128, 64, 64, True), (64, 32, 128, True), (36, 16, 32, True)])
def test_the_threads_own_every_cell_once(d, block_q, block_k, wide):
    # over the 128 threads, each score of the tile and each output element of the block has exactly one owner
    t = register_tile(d, block_q, block_k, wide=wide)
    s_owner, o_owner = np.zeros((block_q, block_k), int), np.zeros((block_q, d), int)
    for ty in range(t.groups):
        for tx in range(t.lanes):
            rows = t.thread_rows(ty)
            assert len(rows) == t.rows and len(t.thread_keys(tx)) == t.keys
            assert len(t.thread_columns(tx)) <= 4 * t.chunks
            s_owner[np.ix_(rows, t.thread_keys(tx))] += 1
            o_owner[np.ix_(rows, t.thread_columns(tx))] += 1
    assert (s_owner == 1).all() and (o_owner == 1).all()


def test_the_wide_builds_warp_owns_adjacent_rows():
    # the kernel's ROW rule: plain row groups own consecutive rows; wide ones interleave, so the two row groups
    # of a warp (ty = 0 and 1) own rows r and r + 1
    plain, wide = register_tile(128, 32, 32), register_tile(128, 64, 64, wide=True)
    assert plain.thread_rows(0) == (0, 1) and plain.thread_rows(1) == (2, 3)
    assert wide.thread_rows(0) == (0, 8, 16, 24, 32, 40, 48, 56) and wide.thread_rows(1) == (1, 9, 17, 25, 33, 41, 49, 57)
    assert wide.thread_keys(3) == (3, 19, 35, 51) and wide.thread_columns(1) == (4, 5, 6, 7, 68, 69, 70, 71)
    with pytest.raises(ValueError, match="ty"):
        wide.thread_rows(8)
    with pytest.raises(ValueError, match="tx"):
        wide.thread_keys(16)


def test_ownership_figure_marks_thread_0_and_its_warp():
    from lessons.views.register_tiles import _owners, ownership_figure

    wide = register_tile(128, 64, 64, wide=True)
    s, o = _owners(wide, "s"), _owners(wide, "o")
    assert (s == 2).sum() == 8 * 4 and (s >= 1).sum() == 32 * 8 * 4          # thread 0; its warp of 32
    assert (o == 2).sum() == 8 * 8 and (o >= 1).sum() == 2 * 8 * 128          # 2 row groups x 8 rows, whole rows
    fig = ownership_figure({"plain": register_tile(128, 32, 32), "wide": wide})
    assert len(fig.axes) == 4 and "thread 0 owns 8 rows x 4 keys" in fig.axes[2].get_title(loc="left")
    assert "16 lanes share a row" in fig.axes[3].get_title(loc="left")
    with pytest.raises(TypeError, match="RegisterTile"):
        ownership_figure({"x": 1})

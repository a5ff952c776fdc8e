"""lessons.cost.fragments: the shared-memory loads and tensor-core products per warp and key tile, against a hand
count and against the instructions in the compiled kernels' PTX."""
import pytest

import lessons.gpu as gpu
from lessons.cost.fragments import LDMATRIX_X4_BYTES, MMA_FLOPS, SMEM_BYTES_PER_CLOCK, fragment_traffic

needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")


def test_a_hand_count_at_d64_with_64_key_tiles():
    # d = 64, 64 keys: K 4 slices of d x 4 pairs of 8-key tiles = 16 loads; V 4 key slices x 4 pairs of 8 columns
    # = 16 loads; products 4 x 8 + 4 x 8 = 64 per m-tile; 512 bytes per load
    assert LDMATRIX_X4_BYTES == 512 and MMA_FLOPS == 4096 and SMEM_BYTES_PER_CLOCK == 128
    one = fragment_traffic(64, 64)
    assert (one.k_loads, one.v_loads, one.q_loads, one.mmas) == (16, 16, 0, 64)
    assert one.bytes == 32 * 512 and one.bytes_per_mma == 256 and one.mmas_per_kv_fragment == 2
    assert one.peak_share == 0.5                      # 128 bytes per clock feed half a product per clock
    two = fragment_traffic(64, 64, warp_rows=32)      # Q from shared memory: 2 m-tiles x 4 slices of d
    assert (two.k_loads, two.v_loads, two.q_loads, two.mmas) == (16, 16, 8, 128) and not two.q_in_registers
    assert two.bytes_per_mma == 40 * 512 / 128 == 160 and two.mmas_per_kv_fragment == 4
    assert two.peak_share == pytest.approx(128 / 160)
    # Q kept in registers with two m-tiles: the K and V bytes alone, halved per product
    assert fragment_traffic(64, 64, 32, q_in_registers=True).bytes_per_mma == 128
    assert fragment_traffic(64, 16, 32, q_in_registers=True).peak_share == 1.0       # capped at the peak


@pytest.mark.parametrize("d, block_k, warp_rows", [(64, 64, 16), (128, 32, 16), (64, 64, 32), (128, 32, 32),
                                                   (128, 64, 32), (64, 32, 32)])
@needs_nvrtc
def test_the_counts_are_the_compiled_kernels(d, block_k, warp_rows):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    if warp_rows == 16:
        build = gpu.flash_attention_mma_fa2_lazy_build(d, block_q=64, block_k=block_k)
    else:
        build = gpu.flash_attention_mma_fa2_wide_build(d, block_q=128, block_k=block_k)
    ptx = entry_ptx(compile_ptx(build, "sm_80"), build.entries[0])
    t = fragment_traffic(d, block_k, warp_rows)
    # the key-tile loop is unrolled in full: each instruction of a tile appears once (Q's loads before the loop
    # when Q stays in registers)
    assert ptx.count("mma.sync.aligned.m16n8k16") == t.mmas
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == t.v_loads
    q_before_loop = d // 16 if t.q_in_registers else 0
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == t.k_loads + t.q_loads + q_before_loop


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        fragment_traffic(72, 64)
    with pytest.raises(ValueError, match="block_k must be a multiple of 16"):
        fragment_traffic(64, 40)
    with pytest.raises(ValueError, match="warp_rows must be 16"):
        fragment_traffic(64, 64, warp_rows=64)
    with pytest.raises(TypeError, match="head_dim"):
        fragment_traffic(True, 64)
    with pytest.raises(TypeError, match="q_in_registers"):
        fragment_traffic(64, 64, 32, q_in_registers=1)
    with pytest.raises(ValueError, match="block_k"):
        fragment_traffic(64, 0)


def test_the_ladder_quotes_the_wide_rungs_bytes_per_product():
    # the wide rung's prediction in the ladder: its shared-memory bytes per product over those of 16-row warps with
    # the same key tiles, Q's loads included: 0.625x at 64-key tiles (the d = 64 default), 0.75x at 32-key tiles
    # (the d = 128 default)
    from lessons.gpu.ladder import rung
    from lessons.gpu.source import FA2_WIDE_CONFIGS

    predicted = rung("mma_fa2_wide").predicted
    quoted = {64: "0.625x the shared-memory bytes per mma of 16-row warps at 64-key tiles", 32: "0.75x at 32-key tiles"}
    for d in (64, 128):
        block_k = FA2_WIDE_CONFIGS[d][1]
        ratio = fragment_traffic(d, block_k, 32).bytes_per_mma / fragment_traffic(d, block_k).bytes_per_mma
        assert quoted[block_k].startswith(f"{ratio:g}x") and quoted[block_k] in predicted, (d, ratio)


def test_the_quiz_quotes_the_counts():
    from lessons.course.quiz import QUIZZES

    q = next(q for q in QUIZZES["06_kernel_ladder"] if "32 query rows" in q.question)
    one, two = fragment_traffic(64, 64), fragment_traffic(64, 64, warp_rows=32)
    assert f"{two.bytes_per_mma:.0f} bytes per product instead of {one.bytes_per_mma:.0f}" in q.explanation
    assert f"allow {two.peak_share:.0%} of the tensor-core peak instead of {one.peak_share:.0%}" in q.explanation
    assert "Each K and V fragment" in q.choices[q.answer]

"""The tensor-core rung along FlashAttention-2's recipe (flash_attention_mma_fa2.cu): against NumPy on
edge shapes (emulator, and the GPU where one is present), its NaN rule, its trace, bitwise repeatable
output, what its compiled code holds (ldmatrix.x4, cp.async, mma.sync, ex2; no spills; registers
that let 2 blocks share an SM), and the shared-memory swizzle it relies on."""
from functools import partial

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.gpu.source import (FA2_CONFIGS, KERNEL_DIR, fa2_swizzle, flash_attention_mma_fa2_config,
                                flash_attention_mma_fa2_smem_bytes)
from kernel_tolerance import assert_within_baseline, baseline_attention
from test_gpu_kernels import assert_trace_follows_numpy, stored, values  # (stored inputs; outputs as float64)

BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason="no CUDA device")),
]

needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def reference(q, k, v, causal):
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:-1])
    for idx in np.ndindex(*q.shape[:-2]):
        out[idx], lse[idx] = lessons.attention(q[idx], k[idx], v[idx], causal=causal, return_lse=True)
    return out, lse


CASES = [
    # d = 64: 128-row query blocks, 64-key tiles; d = 128: 64-row blocks, 32-key tiles
    pytest.param((), 150, 130, 64, False, "float16", id="d64-two-query-blocks-N-not-a-multiple"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((1, 2), 20, 90, 64, True, "float16", id="d64-causal-Nq<Nk"),
    pytest.param((), 33, 100, 128, True, "float16", id="d128-causal"),
    pytest.param((), 70, 50, 128, False, "bfloat16", id="d128-bf16-two-query-blocks"),
    pytest.param((), 5, 3, 64, False, "bfloat16", id="d64-bf16-below-one-tile"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", CASES)
def test_fa2_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=causal, bfloat16=dtype == "bfloat16", backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    ref, ref_lse = reference(q64, k64, v64, causal)
    base, base_lse = baseline_attention(q64, k64, v64, dtype, causal=causal)
    assert_within_baseline(values(out, dtype), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")
    # rows that see no key: exactly 0 and -inf, as in the NumPy core
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert not values(out, dtype)[empty].any()


def test_fa2_kernel_with_no_keys_gives_empty_rows(backend):
    q = np.ones((10, 64), np.float16)
    kv = np.ones((0, 64), np.float16)
    out, lse = gpu.flash_attention_mma_fa2_gpu(q, kv, kv, backend=backend)
    assert not out.any() and np.isneginf(lse).all()


def test_fa2_kernel_is_bitwise_repeatable(backend):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 140, 64)).astype(np.float16) for _ in range(3))
    a = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=True, backend=backend)
    b = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=True, backend=backend)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_fa2_kernel_keeps_hidden_nan_out_and_visible_nan_in(backend, bad):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((20, 64)).astype(np.float16) for _ in range(3))
    v[19, 3] = bad                  # causal, Nq = Nk: only row 19 sees key 19
    out, lse = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=True, backend=backend)
    out = out.astype(np.float64)
    assert np.isfinite(out[:19]).all() and np.isfinite(lse).all()
    assert out[19, 3] == bad if bad == np.inf else np.isnan(out[19, 3])
    assert np.isfinite(np.delete(out[19], 3)).all()


def test_fa2_trace_matches_the_numpy_trace(backend):
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((150 if i == 0 else 140, 64)).astype(np.float16) for i in range(3))
    block_q, block_k, _ = flash_attention_mma_fa2_config(64)
    rows = [0, 17, 127, 128, 149]
    _, _, trace = gpu.flash_attention_mma_fa2_gpu(q, k, v, trace_rows=rows, backend=backend)
    # m (kept in log2 units, reported times ln 2) and alpha (ex2) to float32; l after P rounded to 16 bits
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k, tiles=3)


def test_fa2_kernel_refuses_what_it_cannot_do():
    x = np.zeros((8, 64), np.float16)
    with pytest.raises(TypeError, match="float16"):
        gpu.flash_attention_mma_fa2_gpu(*[x.astype(np.float32)] * 3, backend="emulator")
    for d in (16, 80, 256):
        y = np.zeros((8, d), np.float16)
        with pytest.raises(ValueError, match="head_dim must be one of"):
            gpu.flash_attention_mma_fa2_gpu(y, y, y, backend="emulator")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_mma_fa2_build(64, "float32")
    with pytest.raises(TypeError, match="head_dim"):
        flash_attention_mma_fa2_config(64.0)


def test_fa2_shared_memory_by_hand():
    # two stages of a K and a V tile, 2 bytes a value, no padding; Q borrows the second stage
    assert flash_attention_mma_fa2_smem_bytes(64, 64) == 2 * 2 * 64 * 64 * 2 == 32768
    assert flash_attention_mma_fa2_smem_bytes(128, 32) == 2 * 2 * 32 * 128 * 2 == 32768
    for d, (bq, bk, _) in FA2_CONFIGS.items():
        assert bq * d <= 2 * bk * d      # the Q tile fits in one stage (the kernel's static_assert)
        assert gpu.flash_attention_mma_fa2_build(d).threads_per_block == 32 * bq // 16


# ---------------------------------------------------------------------------
# the swizzle
# ---------------------------------------------------------------------------

def banks_of_16_byte_reads(offsets):
    """The 4-byte banks (of 32) touched by 16-byte reads at these 16-bit-element offsets."""
    return [(2 * off // 4 + i) % 32 for off in offsets for i in range(4)]


@pytest.mark.parametrize("d", [64, 128])
def test_swizzle_is_a_bijection_and_conflict_free(d):
    chunks = d // 8
    rows = 64
    offsets = [fa2_swizzle(r, c, d) for r in range(rows) for c in range(chunks)]
    # a bijection onto the unpadded tile: every 16-byte slot used once, each row stays in its row
    assert sorted(offsets) == list(range(0, rows * d, 8))
    assert all(r * d <= fa2_swizzle(r, c, d) < (r + 1) * d for r in range(rows) for c in range(chunks))
    # ldmatrix: 8 lanes name 8 consecutive rows (starting at a multiple of 8) at one logical chunk;
    # the 8 16-byte reads must cover all 32 banks once
    for r0 in range(0, rows, 8):
        for c in range(chunks):
            banks = banks_of_16_byte_reads([fa2_swizzle(r0 + r, c, d) for r in range(8)])
            assert sorted(banks) == list(range(32)), (r0, c)
    # without the swizzle (and without padding) the same reads all hit the same 4 banks: 8-way conflicts
    plain = banks_of_16_byte_reads([r * d + 8 * 3 for r in range(8)])
    assert len(set(plain)) == 4


def test_swizzle_mirrors_the_kernel_source():
    src = (KERNEL_DIR / "flash_attention_mma_fa2.cu").read_text()
    assert "return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);" in src
    with pytest.raises(ValueError, match="multiple of 64"):
        fa2_swizzle(0, 0, 48)


# ---------------------------------------------------------------------------
# the compiled code
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fa2_kernel_compiles_without_spills_and_fits_two_blocks(arch, d, dtype):
    build = gpu.flash_attention_mma_fa2_build(d, dtype)
    res = gpu.compile_kernel(build, arch).resources["flash_attention_mma_fa2"]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0
    bq, bk, min_blocks = flash_attention_mma_fa2_config(d)
    assert res.smem_bytes == flash_attention_mma_fa2_smem_bytes(d, bk) == build.smem_bytes
    assert res.threads_per_block == 32 * bq // 16
    # the register file (65536 per SM) and shared memory (228 KiB per SM on sm_90, 164 KiB on
    # sm_80) hold min_blocks = 2 blocks of this size
    assert min_blocks == 2
    assert res.registers * res.threads_per_block * min_blocks <= 65536
    assert res.smem_bytes * min_blocks <= 164 * 1024


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_fa2_ptx_holds_the_instructions_of_the_recipe(d):
    from lessons.gpu.compile import compile_ptx

    ptx = compile_ptx(gpu.flash_attention_mma_fa2_build(d), "sm_80")
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx          # Q and K fragments
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx    # V fragments
    assert "ldmatrix.sync.aligned.m8n8.x2" not in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group 1" in ptx
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
    assert "ex2.approx.ftz.f32" in ptx                                # exp2, log2(e) in the scale
    assert "cvt.rn.f16x2.f32" in ptx                                  # P packed to 16 bits in registers
    assert "cvta.to.shared" in ptx and ptx.count("cvta.to.shared") <= 2   # shared addresses computed once
    # one mma per (16-wide d slice, 8-key tile) for S and per (16-key slice, 8-column tile) for P V
    _, bk, _ = flash_attention_mma_fa2_config(d)
    assert ptx.count("mma.sync.aligned") == (d // 16) * (bk // 8) + (bk // 16) * (d // 8)


# ---------------------------------------------------------------------------
# the NaN rule, as the other tensor-core rungs are held to it (tests/test_gpu_kernels.py)
# ---------------------------------------------------------------------------

from test_gpu_kernels import (POISONS, assert_attention_close, assert_nan_and_inf_reach_exactly_their_columns,  # noqa: E402
                              forward_poison_check, gpu_only, padded)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("nq, nk, d, dtype", [
    (130, 70, 64, "float16"),               # two 128-row query blocks, Nq > Nk, the diagonal inside 64-key tiles
    (20, 50, 128, "bfloat16"),              # one 64-row block, the diagonal across two 32-key tiles
])
def test_fa2_rows_never_see_poison_they_cannot_see(backend, poison, nq, nk, d, dtype):
    def launch(q, k, v):
        return gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=True, bfloat16=dtype == "bfloat16", backend=backend)
    cut_rows = sorted({nq - nk + 3 if nq > nk else 0, nq // 2 + 1, nq - 2})
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


def test_fa2_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend):
    # zero columns pad d to 64 (the kernel takes 64 and 128)
    assert_nan_and_inf_reach_exactly_their_columns(partial(gpu.flash_attention_mma_fa2_gpu, backend=backend), d=64)


def test_fa2_gives_the_hand_computed_causal_answer_with_an_unwritten_last_key(backend):
    # q = k = [[1,0],[0,1],[1,1]], v = [[1,2],[3,4],[5,6]], k[2] = v[2] = NaN, scale 1/sqrt(2), zero
    # columns up to d = 64: row 0 -> v[0]; row 1 -> (v0 + e^(1/sqrt 2) v1) / (1 + e^(1/sqrt 2))
    # = [2.339523, 3.339523], lse log(1 + e^(1/sqrt 2)) = 1.107940; row 2 sees the NaN key: NaN
    q = np.array([[1, 0], [0, 1], [1, 1]], np.float64)
    k, v = q.copy(), np.array([[1, 2], [3, 4], [5, 6]], np.float64)
    k[2] = v[2] = np.nan
    (qs, _), (ks, _), (vs, _) = (stored(padded(x, 64), "float16") for x in (q, k, v))
    out, lse = gpu.flash_attention_mma_fa2_gpu(qs, ks, vs, scale=1 / np.sqrt(2), causal=True, backend=backend)
    got = values(out, "float16")
    np.testing.assert_allclose(got[0, :2], [1, 2], atol=1e-3)
    np.testing.assert_allclose(got[1, :2], [2.339523, 3.339523], atol=2e-3)
    np.testing.assert_allclose(lse[:2], [1 / np.sqrt(2), 1.107940], atol=1e-5)
    assert np.isnan(got[2]).all() and np.isnan(lse[2])
    assert np.all(got[:2, 2:] == 0)


@gpu_only
@pytest.mark.parametrize("n, d", [(1000, 128), (2048, 64)])
def test_fa2_on_larger_and_misaligned_inputs_on_the_gpu(n, d):
    import cupy

    rng = np.random.default_rng(25)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, m, d)), "float16") for m in (n, n + 500, n + 500))
    for causal in (False, True):
        out, lse = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=causal)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)
    # a contiguous CuPy view that starts 2 bytes into its allocation: copied, not misread
    flat = cupy.zeros(q.size + 1, dtype=cupy.float16)
    flat[1:] = cupy.asarray(q).ravel()
    q_view = flat[1:].reshape(q.shape)
    assert q_view.data.ptr % 16
    out, lse = gpu.flash_attention_mma_fa2_gpu(q_view, cupy.asarray(k), cupy.asarray(v))
    assert isinstance(out, cupy.ndarray)
    assert_attention_close(out.get(), lse.get(), q64, k64, v64, "float16")

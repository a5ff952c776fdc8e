"""The FA-2 rung with FlashAttention-2's warp shape (flash_attention_mma_fa2.cu built with WARP_ROWS=32 on top of
the lazy rung's switches, entry point flash_attention_mma_fa2_wide): against NumPy on edge shapes and in every
legal tile configuration (emulator, and the GPU where one is present), bitwise the lazy rung with the same key
tiles (the same products in the same order, each K/V fragment now shared by two m-tiles), its trace, its NaN rule,
what the compiled code holds (twice the mmas per K/V fragment; no spills on sm_90) and the arguments it refuses."""
from functools import partial

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu.source import (FA2_WIDE_CONFIGS, FA2_WIDE_SWEEP, flash_attention_mma_fa2_lazy_config,
                                flash_attention_mma_fa2_wide_config, flash_attention_mma_fa2_wide_configs,
                                flash_attention_mma_fa2_wide_smem_bytes)
from test_gpu_kernels import (POISONS, assert_attention_close, assert_nan_and_inf_reach_exactly_their_columns,
                              assert_trace_follows_numpy, forward_poison_check, on_gpu, stored)
from test_gpu_mma_fa2_lazy import check_against_numpy

BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=on_gpu("mma_fa2_wide")),          # (not where gpu_check.sh left the rung out)
]
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
ENTRY = "flash_attention_mma_fa2_wide"
#: every legal (d, (block_q, block_k, min_blocks)) of the rung
LEGAL = [(d, c) for d in (64, 128) for c in FA2_WIDE_SWEEP[d]]
IDS = [f"d{d}-{c[0]}x{c[1]}-min{c[2]}" for d, c in LEGAL]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def wide(backend, **tiles):
    return partial(gpu.flash_attention_mma_fa2_wide_gpu, backend=backend, **tiles)


# ---------------------------------------------------------------------------
# against NumPy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", [
    # default tiles: 128 query rows over 4 warps of 32; 64-key tiles at d = 64, 32 at d = 128
    pytest.param((), 150, 130, 64, False, "float16", id="d64-two-query-blocks-N-not-a-multiple"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((), 40, 330, 64, False, "bfloat16", id="d64-bf16-six-key-tiles"),
    pytest.param((), 33, 100, 128, True, "float16", id="d128-causal-Nq<Nk"),
    pytest.param((), 90, 40, 128, True, "bfloat16", id="d128-bf16-causal-Nq>Nk-empty-rows"),
    pytest.param((), 5, 3, 64, False, "bfloat16", id="d64-bf16-below-one-tile"),
    pytest.param((), 20, 70, 128, False, "float16", id="d128-rows-only-in-the-first-warp"),
])
def test_wide_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d + 7)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = wide(backend)(q, k, v, causal=causal, bfloat16=dtype == "bfloat16")
    check_against_numpy(out, lse, q, q64, k64, v64, dtype, causal)


@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_matches_the_reference(backend, d, config):
    # N not a multiple of either tile, the causal diagonal across key tiles and across a warp's two m-tiles
    block_q, block_k, min_blocks = config
    rng = np.random.default_rng(d + block_q + block_k + min_blocks + 1)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, n, d)), "float16") for n in (70, 150, 150))
    for causal in (False, True):
        out, lse = wide(backend, block_q=block_q, block_k=block_k, min_blocks=min_blocks)(q, k, v, causal=causal)
        check_against_numpy(out, lse, q, q64, k64, v64, "float16", causal)


def test_wide_kernel_with_no_keys_gives_empty_rows(backend):
    q = np.ones((40, 128), np.float16)
    kv = np.ones((0, 128), np.float16)
    out, lse = wide(backend)(q, kv, kv)
    assert not out.any() and np.isneginf(lse).all()


# ---------------------------------------------------------------------------
# bitwise: the lazy rung with the same key tiles, and its trace
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d, config", [(64, (128, 64, 2)), (128, (128, 32, 2)), (128, (64, 32, 2))],
                         ids=["d64-default", "d128-default", "d128-64x32"])
def test_wide_kernel_is_bitwise_the_lazy_rung_with_the_same_key_tiles(backend, d, config):
    # each row's products and fold are the same instructions in the same order; only the warp that runs them
    # and the shared K/V fragment differ (rows of a longer causal block visit extra tiles that are wholly
    # masked for them: max, l and o unchanged, alpha exactly 1)
    block_q, block_k, min_blocks = config
    lazy_tiles = dict(block_q=64, block_k=block_k)
    assert flash_attention_mma_fa2_lazy_config(d, **lazy_tiles)[:2] == (64, block_k)
    rng = np.random.default_rng(d + block_k)
    for nq, nk, causal in ((150, 200, False), (90, 40, True), (40, 170, True)):
        q, k, v = (rng.standard_normal((2, n, d)).astype(np.float16) for n in (nq, nk, nk))
        rows = [0, 17, nq // 2, nq - 1]
        a = wide(backend, block_q=block_q, block_k=block_k, min_blocks=min_blocks)(q, k, v, causal=causal,
                                                                                   trace_rows=rows)
        b = gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v, causal=causal, trace_rows=rows, backend=backend,
                                                 **lazy_tiles)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes(), (nq, nk, causal)
        # the traces: equal on every tile the lazy rung's block visits; a tile only the longer block visits
        # (NaN in the lazy trace: not visited) is wholly masked for the row and leaves its m and l as they were
        ra, rb = a[2].records, b[2].records
        visited = ~np.isnan(rb[..., 0])
        assert np.array_equal(ra[visited], rb[visited]), (nq, nk, causal)
        for i, t in zip(*np.nonzero(~visited & ~np.isnan(ra[..., 0]))):
            before = ra[i, t - 1] if t else np.array([-np.inf, 0.0, 0.0], np.float32)
            assert ra[i, t, 0] == before[0] and ra[i, t, 2] == before[2], (nq, nk, causal, i, t)
        assert not (np.isnan(ra[..., 0]) & visited).any()


@pytest.mark.parametrize("d", [64, 128])
def test_wide_trace_follows_numpy_in_both_m_tiles_of_a_warp(backend, d):
    # rows 0-15 and 16-31 are the two m-tiles of warp 0, 32-63 warp 1, 100 and 129 the last warp and block
    block_q, block_k, _ = flash_attention_mma_fa2_wide_config(d)
    rng = np.random.default_rng(d + 3)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float16) for n in (130, 200, 200))
    rows = [0, 15, 16, 31, 32, 47, 100, 129]
    out, lse, trace = wide(backend)(q, k, v, trace_rows=rows)
    assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float16")
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k, tiles=-(-200 // block_k))


def test_wide_kernel_is_bitwise_repeatable(backend):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, 140, 64)).astype(np.float16) for _ in range(3))
    a = wide(backend)(q, k, v, causal=True)
    b = wide(backend)(q, k, v, causal=True)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


# ---------------------------------------------------------------------------
# the NaN rule, as the other tensor-core rungs are held to it (tests/test_gpu_kernels.py)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("nq, nk, d, dtype", [
    (130, 70, 64, "float16"),               # two 128-row blocks, Nq > Nk, the diagonal inside 64-key tiles
    (40, 150, 128, "bfloat16"),             # one block, the diagonal across 32-key tiles and both m-tiles of warp 0
])
def test_wide_rows_never_see_poison_they_cannot_see(backend, poison, nq, nk, d, dtype):
    def launch(q, k, v):
        return wide(backend)(q, k, v, causal=True, bfloat16=dtype == "bfloat16")
    cut_rows = sorted({nq - nk + 3 if nq > nk else 17, nq // 2 + 1, nq - 2})    # (17: the second m-tile of warp 0)
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


def test_wide_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend):
    assert_nan_and_inf_reach_exactly_their_columns(wide(backend), d=128)


# ---------------------------------------------------------------------------
# configurations and the arguments it refuses
# ---------------------------------------------------------------------------

def test_legal_configurations_and_defaults():
    assert FA2_WIDE_CONFIGS == {64: (128, 64, 2), 128: (128, 32, 2)}
    for d in (64, 128):
        configs = flash_attention_mma_fa2_wide_configs(d)
        assert configs[0] == FA2_WIDE_CONFIGS[d] and len(set(configs)) == len(configs)
        assert flash_attention_mma_fa2_wide_config(d) == FA2_WIDE_CONFIGS[d]
        for bq, bk, mb in configs:
            assert bq in (64, 128) and bk in (32, 64) and 1 <= mb <= 3
            build = gpu.flash_attention_mma_fa2_wide_build(d, "float16", False, bq, bk, mb)
            assert build.entries == (ENTRY,) and build.threads_per_block == bq        # one warp per 32 rows
            # two K/V stages (8 * block_k * d bytes) and the Q tile (2 * block_q * d bytes), all dynamic
            assert build.smem_bytes == 0 and build.dynamic_smem_bytes == 8 * bk * d + 2 * bq * d
            assert build.dynamic_smem_bytes == flash_attention_mma_fa2_wide_smem_bytes(d, bq, bk)
            assert dict(build.defines)["WARP_ROWS"] == 32 and dict(build.defines)["LAZY_RESCALE"] == 1
    # d = 128 with 128 x 64 tiles: 64 KiB of stages + 32 KiB of Q = 96 KiB, two blocks still fit an H200 SM
    assert flash_attention_mma_fa2_wide_smem_bytes(128, 128, 64) == 98304
    assert flash_attention_mma_fa2_wide_config(128, block_k=64) == (128, 64, 2)
    assert flash_attention_mma_fa2_wide_config(64, block_q=64) == (64, 64, 2)       # the default's 64 keys
    assert flash_attention_mma_fa2_wide_config(128, block_q=64) == (64, 32, 2)      # the legal pair with 64 rows
    assert flash_attention_mma_fa2_wide_config(64, block_k=32, min_blocks=3) == (128, 32, 3)


def test_wide_kernel_refuses_bad_tiles_by_name():
    x = np.zeros((8, 128), np.float16)
    run = partial(gpu.flash_attention_mma_fa2_wide_gpu, backend="emulator")
    with pytest.raises(ValueError, match=r"block_q must be one of \[64, 128\] \(query rows per block, 32 per warp\)"):
        run(x, x, x, block_q=32)
    with pytest.raises(ValueError, match=r"block_k must be one of \[32, 64\].*got 128"):
        run(x, x, x, block_k=128)
    with pytest.raises(ValueError, match=r"block_q=64, block_k=64 is not a legal pair at head_dim=128 \(the others "
                                         r"spill on sm_90\)"):
        run(x, x, x, block_q=64, block_k=64)
    with pytest.raises(ValueError, match=r"min_blocks must be one of \[2\]"):
        run(x, x, x, min_blocks=3)
    for name in ("block_q", "block_k", "min_blocks"):
        with pytest.raises(TypeError, match=name):
            run(x, x, x, **{name: True})
    with pytest.raises(TypeError, match="float16"):
        run(*[x.astype(np.float32)] * 3)
    y = np.zeros((8, 96), np.float16)
    with pytest.raises(ValueError, match="head_dim must be one of .* wide-warp"):
        run(y, y, y)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_mma_fa2_wide_build(64, "float32")


# ---------------------------------------------------------------------------
# the compiled code
# ---------------------------------------------------------------------------

#: the (d, block_q, block_k) that spill on sm_80 (NVRTC 12.9), as FA2_WIDE_SWEEP's comment says; none on sm_90
SPILL_ON_SM80 = {(128, 128, 64), (128, 64, 32)}


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_compiles_and_fits_two_blocks(arch, dtype, d, config):
    build = gpu.flash_attention_mma_fa2_wide_build(d, dtype, False, *config)
    res = gpu.compile_kernel(build, arch).resources[ENTRY]
    block_q, block_k, min_blocks = config
    if arch == "sm_90" or (d, block_q, block_k) not in SPILL_ON_SM80:
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0, res
    else:
        assert res.spill_store_bytes <= 160, res                # a few registers' worth, not the accumulators
    assert res.smem_bytes == 0 and res.dynamic_smem_bytes == flash_attention_mma_fa2_wide_smem_bytes(d, block_q, block_k)
    assert res.threads_per_block == block_q
    # min_blocks blocks fit one SM: registers (65536 per SM) and shared memory (228 KiB on sm_90, 164 on sm_80,
    # where the tiles that spill are not the ones to take anyway: 128 x 64 at d = 128 fits one block of 96 KiB)
    assert res.registers * res.threads_per_block * min_blocks <= 65536
    smem_per_sm = 228 * 1024 if arch == "sm_90" else 164 * 1024
    if arch == "sm_90" or (d, block_q, block_k) not in SPILL_ON_SM80:
        assert res.dynamic_smem_bytes * min_blocks <= smem_per_sm, res
    else:
        assert res.dynamic_smem_bytes <= smem_per_sm, res


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_each_k_and_v_fragment_feeds_twice_the_mmas_of_the_lazy_rung(d):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    block_k = 32
    lazy = entry_ptx(compile_ptx(gpu.flash_attention_mma_fa2_lazy_build(d, block_q=64, block_k=block_k), "sm_80"),
                     "flash_attention_mma_fa2_lazy")
    ptx = entry_ptx(compile_ptx(gpu.flash_attention_mma_fa2_wide_build(d, block_q=128, block_k=block_k), "sm_80"),
                    ENTRY)
    per_tile = (d // 16) * (block_k // 8) + (block_k // 16) * (d // 8)     # mma of S = Q K^T and of o += P V
    assert lazy.count("mma.sync.aligned") == per_tile and ptx.count("mma.sync.aligned") == 2 * per_tile
    kv_k = (d // 16) * (block_k // 16)                                   # ldmatrix.x4 of K per tile
    kv_v = (block_k // 16) * (d // 16)                                   # ldmatrix.x4.trans of V per tile
    x4 = "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
    x4t = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"
    assert lazy.count(x4t) == kv_v and ptx.count(x4t) == kv_v
    # K: the same loads; Q: the lazy rung's d / 16 before the loop, the wide one's 2 x d / 16 inside it
    assert lazy.count(x4) == kv_k + d // 16 and ptx.count(x4) == kv_k + 2 * (d // 16)
    # mma per K or V fragment: 2 for the lazy rung, 4 here
    assert lazy.count("mma.sync.aligned") / (kv_k + kv_v) == 2 and ptx.count("mma.sync.aligned") / (kv_k + kv_v) == 4
    assert ptx.count("vote.sync.any.pred") == 1                           # the lazy rung's warp vote, once per warp


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------

@on_gpu("mma_fa2_wide")
@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_on_larger_inputs_on_the_gpu(d, config):
    rng = np.random.default_rng(26)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, m, d)), "float16") for m in (1000, 1500, 1500))
    block_q, block_k, min_blocks = config
    for causal in (False, True):
        out, lse = gpu.flash_attention_mma_fa2_wide_gpu(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                                        min_blocks=min_blocks)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)


@needs_nvrtc
def test_the_pair_left_out_at_d128_spills_on_sm_90():
    # 64 x 64 tiles at d = 128 are refused ("the others spill on sm_90"): built by hand, they do spill
    from lessons.gpu.source import KernelBuild

    assert (64, 64) not in {(bq, bk) for bq, bk, _ in FA2_WIDE_SWEEP[128]}
    build = KernelBuild.make(ENTRY, "float16", False, HEAD_DIM=128, BLOCK_Q=64, BLOCK_K=64, MIN_BLOCKS=2,
                             LAZY_RESCALE=1, FA2_DYNAMIC_SMEM=1, WARP_ROWS=32)
    res = gpu.compile_kernel(build, "sm_90").resources[ENTRY]
    assert res.spill_store_bytes > 0, res


def test_a_trace_flag_that_is_not_a_bool_is_refused():
    # a string would be true, and switch the trace build on
    with pytest.raises(TypeError, match="trace must be True or False"):
        gpu.flash_attention_mma_fa2_wide_build(64, "float16", "no")
    with pytest.raises(TypeError, match="trace"):
        gpu.flash_attention_mma_fa2_lazy_build(64, "float16", 1)

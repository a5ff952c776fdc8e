"""The lean FA-2 rung (flash_attention_mma_fa2.cu built with FA2_LEAN=1 on top of the wide rung's switches, entry
points flash_attention_mma_fa2_lean and its pre-pass flash_attention_mma_fa2_lean_v_flags): bitwise the wide rung
with the same tiles (fp16 and bf16, causal and not, Nq != Nk, Nk not a multiple of block_k, rows that see nothing,
inf/NaN in V in the first, an interior and the last partial tile), its trace, against NumPy, the pre-pass's flags
against NumPy, what the compiled code holds (two key-tile loops at d = 64, one at 128; no block-wide vote; no spills) and that the PTX of
the three builds without the switch is what it was before the switch existed."""
import hashlib
from functools import partial

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu.source import (FA2_LEAN_CONFIGS, FA2_LEAN_SWEEP, FA2_LEAN_V_FLAGS, FA2_WIDE_SWEEP,
                                flash_attention_mma_fa2_lean_config, flash_attention_mma_fa2_lean_configs,
                                flash_attention_mma_fa2_wide_smem_bytes)
from test_gpu_kernels import (assert_attention_close, assert_nan_and_inf_reach_exactly_their_columns,
                              assert_trace_follows_numpy, on_gpu, stored)
from test_gpu_mma_fa2_lazy import check_against_numpy

BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=on_gpu("mma_fa2_lean")),
]
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
ENTRY = "flash_attention_mma_fa2_lean"
LEGAL = [(d, c) for d in (64, 128) for c in FA2_LEAN_SWEEP[d]]
IDS = [f"d{d}-{c[0]}x{c[1]}-min{c[2]}" for d, c in LEGAL]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def lean(backend, **tiles):
    return partial(gpu.flash_attention_mma_fa2_lean_gpu, backend=backend, **tiles)


def wide(backend, **tiles):
    return partial(gpu.flash_attention_mma_fa2_wide_gpu, backend=backend, **tiles)


def poison_v(v, block_k, where, value):
    """v with ``value`` written into one element of key tile(s) ``where`` ('first', 'interior', 'last': the
    last, partial, tile) of head 0 (and the first tile of the last head)."""
    v = v.copy()
    nk, d = v.shape[-2], v.shape[-1]
    n_tiles = -(-nk // block_k)
    tile = {"first": 0, "interior": n_tiles // 2, "last": n_tiles - 1}[where]
    key = min(tile * block_k + 3, nk - 1)
    flat = v.reshape(-1, nk, d)
    flat[0, key, d // 2 + 1] = value
    flat[-1, 1, 0] = value
    return v


# ---------------------------------------------------------------------------
# bitwise: the wide rung with the same tiles
# ---------------------------------------------------------------------------

SHAPES = [  # (lead, nq, nk, causal): Nq != Nk, Nk not a multiple of either key tile, rows that see nothing
    ((2,), 150, 200, False),
    ((), 90, 40, True),                     # Nq > Nk: the first 50 rows see nothing, the block's diagonal < 0
    ((2,), 40, 170, True),                  # Nq < Nk: most tiles whole for the one block, the last partial
    ((), 200, 130, True),                   # two query blocks, the second's whole tiles more than the first's
    ((), 33, 64, False),                    # Nk a multiple of the 64-key tile: every tile whole
]


@pytest.mark.parametrize("d, dtype", [(64, "float16"), (128, "bfloat16"), (128, "float16"), (64, "bfloat16")])
def test_lean_kernel_is_bitwise_the_wide_rung(backend, d, dtype):
    rng = np.random.default_rng(d + len(dtype))
    bf16 = dtype == "bfloat16"
    for lead, nq, nk, causal in SHAPES:
        q, k, v = (stored(rng.standard_normal((*lead, n, d)), dtype)[0] for n in (nq, nk, nk))
        a = lean(backend)(q, k, v, causal=causal, bfloat16=bf16)
        b = wide(backend)(q, k, v, causal=causal, bfloat16=bf16)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes(), (lead, nq, nk, causal)


@pytest.mark.parametrize("where", ["first", "interior", "last"])
@pytest.mark.parametrize("d, dtype, value", [(64, "float16", np.nan), (128, "bfloat16", np.inf),
                                             (128, "float16", -np.inf)])
def test_inf_and_nan_in_v_give_the_wide_rungs_bits(backend, where, d, dtype, value):
    # a flagged tile (the pre-pass saw inf or NaN in it) rewrites its V chunks and adds their terms back as the
    # wide rung does; in the first tile (unmasked loop), an interior one and the last partial one (masked loop)
    block_k = flash_attention_mma_fa2_lean_config(d)[1]
    rng = np.random.default_rng(d + 11)
    bf16 = dtype == "bfloat16"
    for nq, nk, causal in ((70, 5 * block_k + 7, True), (130, 3 * block_k + 1, False)):
        q, k, v = (stored(rng.standard_normal((2, n, d)), dtype)[0] for n in (nq, nk, nk))
        v = poison_v(v, block_k, where, gpu.to_bfloat16_bits(np.array([value]))[0] if bf16 else value)
        a = lean(backend)(q, k, v, causal=causal, bfloat16=bf16)
        b = wide(backend)(q, k, v, causal=causal, bfloat16=bf16)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes(), (where, nq, nk, causal)
        got = gpu.from_bfloat16_bits(a[0]) if bf16 else a[0].astype(np.float32)
        assert not np.isfinite(got).all(), "the poison reached no row"


@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_is_bitwise_the_wide_rung_and_its_trace(backend, d, config):
    block_q, block_k, min_blocks = config
    tiles = dict(block_q=block_q, block_k=block_k, min_blocks=min_blocks)
    rng = np.random.default_rng(d + block_q + block_k)
    for nq, nk, causal in ((150, 200, False), (90, 40, True), (40, 170, True)):
        q, k, v = (rng.standard_normal((2, n, d)).astype(np.float16) for n in (nq, nk, nk))
        rows = [0, 17, nq // 2, nq - 1]
        a = lean(backend, **tiles)(q, k, v, causal=causal, trace_rows=rows)
        b = wide(backend, **tiles)(q, k, v, causal=causal, trace_rows=rows)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes(), (nq, nk, causal)
        assert a[2].labels == b[2].labels
        assert a[2].records.tobytes() == b[2].records.tobytes(), (nq, nk, causal)


# ---------------------------------------------------------------------------
# against NumPy
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", [
    pytest.param((), 150, 130, 64, False, "float16", id="d64-two-query-blocks"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((), 33, 100, 128, True, "float16", id="d128-causal-Nq<Nk"),
    pytest.param((), 90, 40, 128, True, "bfloat16", id="d128-bf16-causal-Nq>Nk-empty-rows"),
    pytest.param((), 5, 3, 64, False, "bfloat16", id="d64-bf16-below-one-tile"),
])
def test_lean_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d + 9)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = lean(backend)(q, k, v, causal=causal, bfloat16=dtype == "bfloat16")
    check_against_numpy(out, lse, q, q64, k64, v64, dtype, causal)


def test_lean_kernel_with_no_keys_gives_empty_rows(backend):
    q = np.ones((40, 128), np.float16)
    kv = np.ones((0, 128), np.float16)
    out, lse = lean(backend)(q, kv, kv)
    assert not out.any() and np.isneginf(lse).all()


@pytest.mark.parametrize("d", [64, 128])
def test_lean_trace_follows_numpy(backend, d):
    block_q, block_k, _ = flash_attention_mma_fa2_lean_config(d)
    rng = np.random.default_rng(d + 5)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float16) for n in (130, 200, 200))
    rows = [0, 16, 31, 47, 100, 129]
    out, lse, trace = lean(backend)(q, k, v, trace_rows=rows)
    assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float16")
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k, tiles=-(-200 // block_k))


def test_lean_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend):
    assert_nan_and_inf_reach_exactly_their_columns(lean(backend), d=128)


# ---------------------------------------------------------------------------
# the pre-pass
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d, dtype", [(64, "float16"), (128, "bfloat16")])
def test_the_pre_pass_flags_exactly_the_tiles_of_v_with_inf_or_nan(backend, d, dtype):
    from lessons.gpu.launch import Runner

    build = gpu.flash_attention_mma_fa2_lean_build(d, dtype)
    block_k = dict(build.defines)["BLOCK_K"]
    heads, nk = 3, 5 * block_k + 9
    rng = np.random.default_rng(d)
    v = stored(rng.standard_normal((heads, nk, d)), dtype)[0]
    bad = gpu.to_bfloat16_bits(np.array([np.inf, np.nan, -np.inf])) if dtype == "bfloat16" else \
        np.array([np.inf, np.nan, -np.inf], np.float16)
    for h, key, col, x in ((0, 0, 0, bad[0]), (0, 2 * block_k + 5, d - 1, bad[1]), (1, nk - 1, 7, bad[2]),
                           (2, block_k, 3, bad[1]), (2, block_k - 1, 3, bad[0])):
        v[h, key, col] = x
    values = gpu.from_bfloat16_bits(v) if dtype == "bfloat16" else v.astype(np.float32)
    n_tiles = -(-nk // block_k)
    padded = np.zeros((heads, n_tiles * block_k, d), np.float32)
    padded[:, :nk] = values
    expected = (~np.isfinite(padded)).reshape(heads, n_tiles, block_k * d).any(-1).astype(np.int32)
    assert expected.sum() == 5
    run = Runner(backend, "numpy")
    v_dev = run.put(v)
    flags = run.xp.full(heads * n_tiles, -7, dtype=np.int32)
    run.launch(build, FA2_LEAN_V_FLAGS, (n_tiles, heads), [v_dev, nk, flags])
    assert np.array_equal(run.host(flags).reshape(heads, n_tiles), expected)


# ---------------------------------------------------------------------------
# configurations
# ---------------------------------------------------------------------------

def test_legal_configurations_and_builds():
    assert FA2_LEAN_CONFIGS == {64: (128, 64, 2), 128: (128, 32, 2)}
    for d in (64, 128):
        configs = flash_attention_mma_fa2_lean_configs(d)
        assert configs[0] == FA2_LEAN_CONFIGS[d] and set(configs) <= set(FA2_WIDE_SWEEP[d])
        for bq, bk, mb in configs:
            build = gpu.flash_attention_mma_fa2_lean_build(d, "float16", False, bq, bk, mb)
            assert build.entries == (ENTRY, FA2_LEAN_V_FLAGS) and build.threads_per_block == bq
            assert dict(build.defines)["FA2_LEAN"] == 1 and dict(build.defines)["WARP_ROWS"] == 32
            assert build.smem_bytes == 0 and build.dynamic_smem_bytes == flash_attention_mma_fa2_wide_smem_bytes(d, bq, bk)
            assert build.entry_dynamic_smem_bytes(ENTRY) == build.dynamic_smem_bytes
            assert build.entry_dynamic_smem_bytes(FA2_LEAN_V_FLAGS) == 0
    x = np.zeros((8, 128), np.float16)
    with pytest.raises(ValueError, match=r"block_k must be one of \[32\]"):
        gpu.flash_attention_mma_fa2_lean_gpu(x, x, x, block_k=64, backend="emulator")
    with pytest.raises(TypeError, match="float16"):
        gpu.flash_attention_mma_fa2_lean_gpu(*[x.astype(np.float32)] * 3, backend="emulator")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_mma_fa2_lean_build(64, "float32")


# ---------------------------------------------------------------------------
# the compiled code
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_compiles_and_fits_two_blocks(arch, dtype, d, config):
    build = gpu.flash_attention_mma_fa2_lean_build(d, dtype, False, *config)
    compiled = gpu.compile_kernel(build, arch)
    res = compiled.resources[ENTRY]
    print(f"\n{ENTRY} d={d} {config} {arch} {dtype}: {res.registers} registers, spills "
          f"{res.spill_store_bytes}/{res.spill_load_bytes}")
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0, res
    block_q, block_k, min_blocks = config
    assert res.dynamic_smem_bytes == flash_attention_mma_fa2_wide_smem_bytes(d, block_q, block_k)
    assert res.registers * res.threads_per_block * min_blocks <= 65536
    pre = compiled.resources[FA2_LEAN_V_FLAGS]
    assert pre.dynamic_smem_bytes == 0 and pre.spill_store_bytes == 0 and pre.registers <= 64, pre


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_two_key_tile_loops_and_no_block_wide_vote(d):
    # at d = 64 the unmasked loop and the masked one each hold a tile's mmas (at d = 128 one loop does:
    # FA2_SPLIT_MASKED); V's inf/NaN test left the loop, and with it the block-wide vote (__syncthreads_or:
    # bar.red.or), which is now the pre-pass's alone
    from lessons.gpu.compile import compile_ptx, entry_ptx

    ptx = compile_ptx(gpu.flash_attention_mma_fa2_lean_build(d), "sm_90")
    wide_ptx = entry_ptx(compile_ptx(gpu.flash_attention_mma_fa2_wide_build(d), "sm_90"), "flash_attention_mma_fa2_wide")
    main = entry_ptx(ptx, ENTRY)
    assert main.count("mma.sync.aligned") == (2 if d == 64 else 1) * wide_ptx.count("mma.sync.aligned")
    assert "bar.red.or" in wide_ptx and "bar.red.or" not in main
    assert "bar.red.or" in entry_ptx(ptx, FA2_LEAN_V_FLAGS)


def _sass_loops_with_hmma(build, entry, arch):
    from lessons.gpu import sass
    from test_gpu_sass import _successors

    instructions, labels = sass.parse_sass(sass.disassemble(build, arch, entry))
    n = len(instructions)
    loops = [(j, i) for i in range(n) for j in _successors(instructions, labels, i) if j <= i]
    return [(h, b) for h, b in loops if any(x.base == "HMMA" for x in instructions[h:b + 1])]


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [64, 128])
def test_the_sass_splits_the_key_tile_loop_at_d64_only(arch, d):
    from lessons.gpu import sass

    if not sass.nvdisasm_available():
        pytest.skip("nvdisasm not installed")
    assert len(_sass_loops_with_hmma(gpu.flash_attention_mma_fa2_wide_build(d), "flash_attention_mma_fa2_wide",
                                     arch)) == 1
    assert len(_sass_loops_with_hmma(gpu.flash_attention_mma_fa2_lean_build(d), ENTRY, arch)) == (2 if d == 64 else 1)


#: sha256 of the PTX (NVRTC 12.9) of the three builds without FA2_LEAN, as they were before the switch existed:
#: (rung, d, dtype, arch) -> hash. The switch must not change them by a byte.
PTX_BEFORE_LEAN = {
    ("fa2", 64, "float16", "sm_80"): "6f659e14d0c4b54fe7ddcdcd3d098d16d7576c6bbe64458de240c872f9c6a3dd",
    ("fa2", 64, "float16", "sm_90"): "c7db8e1924937b5b7fdb3537f9a5f36f145880076d8108288bf261191835af16",
    ("fa2", 64, "bfloat16", "sm_80"): "7f78073e5e5511bbbcab55591f0cbec0f28084a6e4db70f355f39672614779bb",
    ("fa2", 64, "bfloat16", "sm_90"): "03b3164f9eeee46d60d370304de922b6f5506e31b95c7c5362a6aa3dcd2f8b35",
    ("fa2", 128, "float16", "sm_80"): "58a5036deb89045be1b8069f811515cf86a9ee1f67f94e6e249725ca66e23221",
    ("fa2", 128, "float16", "sm_90"): "cf00794f9090373b5daf6a4b5a13292d2114bb68fbf7f60b2d90d604d968a581",
    ("fa2", 128, "bfloat16", "sm_80"): "3b1782a91fe36cb94329cbb9637c4fcc1eacad3db8298fa63a0787bd0acb8220",
    ("fa2", 128, "bfloat16", "sm_90"): "60b1121c9f9c2ec87a15a64c5e1fded14f15e7c9142fd893d7d3aae2d193dcbd",
    ("lazy", 64, "float16", "sm_80"): "74ee42f6ef56ae3bd5c4c1fc5b33230a7cdf1a3f3869aaaabf915df391bc8ad4",
    ("lazy", 64, "float16", "sm_90"): "654fb522e33387e92befeb7e30058cc416057a4cce420f795caf7db17ae6b620",
    ("lazy", 64, "bfloat16", "sm_80"): "7c83b9e78e61615f7c5c86ff3a5fa90479127357fad72917ffb0361039e63c8a",
    ("lazy", 64, "bfloat16", "sm_90"): "3d8d0b4f9d316083e622b8920c3f08eacd8f3763e94e27ff456b9fc0720ea86e",
    ("lazy", 128, "float16", "sm_80"): "4124898129c7e1aa3c62d883199704e0d821e5885ee4a641b55d99aeed71ccdb",
    ("lazy", 128, "float16", "sm_90"): "b5a80fe2696878e4cb421c41e01909549f93d55e98b07cea437a211941222b0c",
    ("lazy", 128, "bfloat16", "sm_80"): "4db72a595c07bfe0c20a442192a4ddfb0109aba297ef9873912c7c0f55a7a010",
    ("lazy", 128, "bfloat16", "sm_90"): "923ea2e3ca5965817d48145200df0cfe6d71f6a834d6fb0b432127dce22ae8f0",
    ("wide", 64, "float16", "sm_80"): "470aec3d21c28d6193ca65656557bd269dbdd8840d59f45e25b762bb426f7cf5",
    ("wide", 64, "float16", "sm_90"): "caff4a9bdd5af29233dcd55a00da9a80723c258c24fa46e6646557833f88dde1",
    ("wide", 64, "bfloat16", "sm_80"): "07a5078177b74a1b6ca3f4503c53b0ede8a417eb09b223c1471a451501cd09ca",
    ("wide", 64, "bfloat16", "sm_90"): "2dc1c8fe637f8b74e9bbd77cb1ba5ecb9056358bf4d52c3b1a5de8234f6d90fd",
    ("wide", 128, "float16", "sm_80"): "20fad9f47de97f385f8344ae36ee4cfaaa3ead3b202f1a5069bce6ddd130a5dd",
    ("wide", 128, "float16", "sm_90"): "e848ffa2a7f4ababf388aa710e6072b28fa1d9054de813d4f9ad670b48552d30",
    ("wide", 128, "bfloat16", "sm_80"): "3ebe73f5dd8fa4e611f533643c375f063061c99b6aa21e0b2155d6143ad93b5e",
    ("wide", 128, "bfloat16", "sm_90"): "ab932602e45da1f9c29741dc050984a6b5702dafd692288284a273d459fef631",
}


@needs_nvrtc
@pytest.mark.parametrize("key", sorted(PTX_BEFORE_LEAN), ids=lambda k: "-".join(map(str, k)))
def test_the_ptx_of_the_builds_without_the_switch_is_unchanged(key):
    from lessons.gpu.compile import compile_ptx, nvrtc_version

    if tuple(nvrtc_version()[:2]) != (12, 9):
        pytest.skip(f"the hashes are NVRTC 12.9's, this is {nvrtc_version()}")
    rung, d, dtype, arch = key
    make = {"fa2": lambda: gpu.flash_attention_mma_fa2_build(d, dtype),
            "lazy": lambda: gpu.flash_attention_mma_fa2_lazy_build(d, dtype),
            "wide": lambda: gpu.flash_attention_mma_fa2_wide_build(d, dtype)}[rung]
    assert hashlib.sha256(compile_ptx(make(), arch).encode()).hexdigest() == PTX_BEFORE_LEAN[key]


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------

@on_gpu("mma_fa2_lean")
@pytest.mark.parametrize("d, config", LEGAL, ids=IDS)
def test_every_legal_configuration_on_larger_inputs_on_the_gpu(d, config):
    rng = np.random.default_rng(27)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, m, d)), "float16") for m in (1000, 1500, 1500))
    block_q, block_k, min_blocks = config
    tiles = dict(block_q=block_q, block_k=block_k, min_blocks=min_blocks)
    for causal in (False, True):
        out, lse = gpu.flash_attention_mma_fa2_lean_gpu(q, k, v, causal=causal, **tiles)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)
        ref = gpu.flash_attention_mma_fa2_wide_gpu(q, k, v, causal=causal, **tiles)
        assert out.tobytes() == ref[0].tobytes() and lse.tobytes() == ref[1].tobytes()

"""The FA-2 rung with lazy rescaling and dynamic shared memory (flash_attention_mma_fa2.cu built with
LAZY_RESCALE and FA2_DYNAMIC_SMEM, entry point flash_attention_mma_fa2_lazy): against NumPy on edge shapes
and in every legal tile configuration (emulator, and the GPU where one is present), bitwise the FA-2 rung
where the tiles are the same, bitwise repeatable, its NaN rule, its trace (alpha exactly 1 where a row's
max did not move), a max that grows on every tile, what the compiled code holds (the warp vote and the
rescale behind it; no spills in any legal configuration) and the arguments it refuses."""
import re
from functools import partial

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu.source import (FA2_LAZY_CONFIGS, FA2_LAZY_SWEEP, flash_attention_mma_fa2_lazy_config,
                                flash_attention_mma_fa2_lazy_configs, flash_attention_mma_fa2_smem_bytes)
from test_gpu_kernels import (POISONS, assert_attention_close, assert_nan_and_inf_reach_exactly_their_columns,
                              assert_trace_follows_numpy, forward_poison_check, on_gpu, stored, values)

BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=on_gpu("mma_fa2_lazy")),          # (not where gpu_check.sh left the rung out)
]
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
needs_emulator = pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")
ENTRY = "flash_attention_mma_fa2_lazy"
#: every legal (d, (block_q, block_k, min_blocks)) of the rung
LEGAL = [(d, c) for d in (64, 128) for c in FA2_LAZY_SWEEP[d]]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def lazy(backend, **tiles):
    return partial(gpu.flash_attention_mma_fa2_lazy_gpu, backend=backend, **tiles)


# ---------------------------------------------------------------------------
# against NumPy
# ---------------------------------------------------------------------------

CASES = [
    # default tiles: d = 64: 128-row blocks, 64-key tiles; d = 128: 64-row blocks, 64-key tiles (dynamic smem)
    pytest.param((), 150, 130, 64, False, "float16", id="d64-two-query-blocks-N-not-a-multiple"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((1, 2), 20, 90, 64, True, "float16", id="d64-causal-Nq<Nk"),
    pytest.param((), 40, 330, 64, False, "bfloat16", id="d64-bf16-six-key-tiles"),
    pytest.param((), 33, 100, 128, True, "float16", id="d128-causal-Nq<Nk"),
    pytest.param((), 90, 40, 128, True, "bfloat16", id="d128-bf16-causal-Nq>Nk-empty-rows"),
    pytest.param((), 70, 290, 128, False, "float16", id="d128-two-query-blocks-five-key-tiles"),
    pytest.param((), 5, 3, 64, False, "bfloat16", id="d64-bf16-below-one-tile"),
]


def check_against_numpy(out, lse, q, q64, k64, v64, dtype, causal):
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=causal)
    # rows that see no key: exactly 0 and -inf (bottom-right causal with Nq > Nk: the first Nq - Nk rows)
    empty = np.zeros(q.shape[:-1], bool)
    if causal and q.shape[-2] > k64.shape[-2]:
        empty[..., :q.shape[-2] - k64.shape[-2]] = True
    assert np.array_equal(np.isneginf(lse), empty)
    assert not values(out, dtype)[empty].any()


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", CASES)
def test_lazy_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = lazy(backend)(q, k, v, causal=causal, bfloat16=dtype == "bfloat16")
    check_against_numpy(out, lse, q, q64, k64, v64, dtype, causal)


@pytest.mark.parametrize("d, config", LEGAL, ids=[f"d{d}-{c[0]}x{c[1]}-min{c[2]}" for d, c in LEGAL])
def test_every_legal_configuration_matches_the_reference(backend, d, config):
    # N not a multiple of either tile, the causal diagonal across key tiles, 3-5 key tiles, two heads
    block_q, block_k, min_blocks = config
    rng = np.random.default_rng(d + block_q + block_k + min_blocks)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, n, d)), "float16") for n in (70, 150, 150))
    for causal in (False, True):
        out, lse = lazy(backend, block_q=block_q, block_k=block_k, min_blocks=min_blocks)(q, k, v, causal=causal)
        check_against_numpy(out, lse, q, q64, k64, v64, "float16", causal)


def test_lazy_kernel_with_no_keys_gives_empty_rows(backend):
    q = np.ones((10, 128), np.float16)
    kv = np.ones((0, 128), np.float16)
    out, lse = lazy(backend)(q, kv, kv)
    assert not out.any() and np.isneginf(lse).all()


# ---------------------------------------------------------------------------
# bitwise: the FA-2 rung with the same tiles, and itself
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d, tiles", [(64, {}), (128, dict(block_k=32))], ids=["d64-default", "d128-block_k32"])
def test_lazy_kernel_is_bitwise_the_fa2_rung_with_the_same_tiles(backend, d, tiles):
    # the same operations on o in the same order: skipped multiplies are by exactly 1
    assert flash_attention_mma_fa2_lazy_config(d, **tiles) == gpu.flash_attention_mma_fa2_config(d)
    rng = np.random.default_rng(d)
    for nq, nk, causal in ((150, 200, False), (90, 40, True), (40, 170, True)):
        q, k, v = (rng.standard_normal((2, n, d)).astype(np.float16) for n in (nq, nk, nk))
        rows = [0, nq // 2, nq - 1]
        a = lazy(backend, **tiles)(q, k, v, causal=causal, trace_rows=rows)
        b = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=causal, trace_rows=rows, backend=backend)
        assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes(), (nq, nk, causal)
        # the traces too: m, alpha (1 where the max stayed, 0 while a row sees nothing) and l
        assert np.array_equal(a[2].records, b[2].records, equal_nan=True), (nq, nk, causal)


def test_lazy_kernel_is_bitwise_repeatable(backend):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 140, 128)).astype(np.float16) for _ in range(3))
    a = lazy(backend)(q, k, v, causal=True)
    b = lazy(backend)(q, k, v, causal=True)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


# ---------------------------------------------------------------------------
# the skip: alpha exactly 1 where no max moved; a max that moves on every tile
# ---------------------------------------------------------------------------

def positive_queries(rng, n, d):
    """Queries with positive entries, so that a key of all-equal entries t scores t * sum(q) * scale > 0
    times t for every row: the same order of keys for every row."""
    return np.abs(rng.standard_normal((n, d))).astype(np.float16) + np.float16(0.1)


def traced_run_that_matches_numpy(backend, d, q, k, v):
    """The lazy rung with the default tiles on (q, k, v) (one head, 130 rows), its output checked against NumPy and
    its trace against NumPy's fold; returns (trace, the traced rows)."""
    block_q, block_k, _ = flash_attention_mma_fa2_lazy_config(d)
    rows = [0, 15, 16, 77, 129]
    out, lse, trace = lazy(backend)(q, k, v, trace_rows=rows)
    assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float16")
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k,
                               tiles=-(-k.shape[0] // block_k))
    return trace, rows


@pytest.mark.parametrize("d", [64, 128])
def test_after_the_largest_score_every_tile_keeps_alpha_exactly_one(backend, d):
    # key 0 scores 3 or more above every other key for every row: tile 0 sets each row's max, no later
    # tile moves it, so every warp skips the rescale from tile 1 on; the trace says alpha = 1.0 exactly there
    rng = np.random.default_rng(d + 1)
    n = 300
    q = positive_queries(rng, 130, d)
    k = (0.1 * rng.standard_normal((n, d))).astype(np.float16)
    k[0] = 0.5                                             # scores about 0.45 sqrt(d) against |s| < 0.5
    v = rng.standard_normal((n, d)).astype(np.float16)
    trace, rows = traced_run_that_matches_numpy(backend, d, q, k, v)
    for row in rows:
        r = trace.row(row)
        assert r.alpha[0] == 0.0                           # from -inf: nothing to rescale
        assert np.all(r.alpha[1:] == 1.0) and np.all(r.m[1:] == r.m[0])
        assert np.all(np.diff(r.l) > 0)                    # l still grows by each tile's row sum


@pytest.mark.parametrize("d", [64, 128])
def test_a_max_that_grows_on_every_tile_still_matches_numpy(backend, d):
    # keys of all-equal entries t_j, t increasing with j: every tile raises every row's max, so every
    # warp rescales on every tile (alpha < 1 from tile 1 on), and the result is still NumPy's
    rng = np.random.default_rng(d + 2)
    n = 300
    q = positive_queries(rng, 130, d)
    k = np.repeat(np.linspace(-1.0, 1.0, n)[:, None], d, axis=1).astype(np.float16)
    v = rng.standard_normal((n, d)).astype(np.float16)
    trace, rows = traced_run_that_matches_numpy(backend, d, q, k, v)
    for row in rows:
        r = trace.row(row)
        assert np.all(np.diff(r.m) > 0) and np.all(r.alpha[1:] < 1.0), row


@needs_emulator
def test_a_kernel_that_never_rescales_fails_the_growing_max_case(monkeypatch):
    # the mutant skips every rescale: exact when no max moves, wrong as soon as one does, and the
    # growing case above catches it (the real kernel passes it)
    from lessons.gpu import emulator, source

    vote = "const bool rescale = __any_sync(0xffffffffu, moved);"
    text = source.kernel_source(ENTRY)
    assert text.count(vote) == 1
    monkeypatch.setattr(emulator, "kernel_source", lambda kernel: text.replace(vote, "const bool rescale = false;"))
    emulator._library.cache_clear()
    try:
        rng = np.random.default_rng(3)
        q = positive_queries(rng, 64, 64)
        k = np.repeat(np.linspace(-1.0, 1.0, 200)[:, None], 64, axis=1).astype(np.float16)
        v = rng.standard_normal((200, 64)).astype(np.float16)
        out, lse = gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v, backend="emulator")
        with pytest.raises(AssertionError):
            assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float16")
    finally:
        emulator._library.cache_clear()


# ---------------------------------------------------------------------------
# the NaN rule, as the other tensor-core rungs are held to it (tests/test_gpu_kernels.py)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("nq, nk, d, dtype", [
    (130, 70, 64, "float16"),               # two 128-row query blocks, Nq > Nk, the diagonal inside 64-key tiles
    (20, 150, 128, "bfloat16"),             # one 64-row block, the diagonal in the third 64-key tile
])
def test_lazy_rows_never_see_poison_they_cannot_see(backend, poison, nq, nk, d, dtype):
    def launch(q, k, v):
        return lazy(backend)(q, k, v, causal=True, bfloat16=dtype == "bfloat16")
    cut_rows = sorted({nq - nk + 3 if nq > nk else 0, nq // 2 + 1, nq - 2})
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


def test_lazy_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend):
    assert_nan_and_inf_reach_exactly_their_columns(lazy(backend), d=128)


# ---------------------------------------------------------------------------
# configurations and the arguments it refuses
# ---------------------------------------------------------------------------

def test_legal_configurations_and_defaults():
    for d in (64, 128):
        configs = flash_attention_mma_fa2_lazy_configs(d)
        assert FA2_LAZY_CONFIGS[d] in configs and len(set(configs)) == len(configs)
        assert flash_attention_mma_fa2_lazy_config(d) == FA2_LAZY_CONFIGS[d]
        for bq, bk, mb in configs:
            assert bq in (64, 128) and bk in (32, 64) and bq <= 2 * bk     # the Q tile fits in one K/V stage
            assert 1 <= mb <= 4
            # the build's launch: one warp per 16 rows, both stages in dynamic shared memory
            build = gpu.flash_attention_mma_fa2_lazy_build(d, "float16", False, bq, bk, mb)
            assert build.entries == (ENTRY,) and build.threads_per_block == 2 * bq
            assert build.smem_bytes == 0 and build.dynamic_smem_bytes == flash_attention_mma_fa2_smem_bytes(d, bk)
            assert dict(build.defines)["LAZY_RESCALE"] == 1 and dict(build.defines)["FA2_DYNAMIC_SMEM"] == 1
    assert FA2_LAZY_CONFIGS == {64: (128, 64, 2), 128: (64, 64, 2)}
    # d = 128's default needs 2 x (K + V) x 64 x 128 x 2 bytes = 64 KiB: more than a block may declare statically
    assert gpu.flash_attention_mma_fa2_lazy_build(128).dynamic_smem_bytes == 65536 > gpu.source.STATIC_SMEM_LIMIT
    # one of block_q / block_k given: the default's other value where legal, else the legal pair with it
    assert flash_attention_mma_fa2_lazy_config(128, block_k=32) == (64, 32, 2)
    assert flash_attention_mma_fa2_lazy_config(64, block_k=32) == (64, 32, 2)
    assert flash_attention_mma_fa2_lazy_config(128, block_q=128) == (128, 64, 1)
    assert flash_attention_mma_fa2_lazy_config(64, block_q=64) == (64, 64, 2)       # the default's 64 keys
    assert flash_attention_mma_fa2_lazy_config(128, block_q=64) == (64, 64, 2)
    assert flash_attention_mma_fa2_lazy_config(64, block_q=64, block_k=32, min_blocks=4) == (64, 32, 4)


def test_lazy_kernel_refuses_bad_tiles_by_name():
    x = np.zeros((8, 64), np.float16)
    run = partial(gpu.flash_attention_mma_fa2_lazy_gpu, backend="emulator")
    with pytest.raises(ValueError, match=r"block_q must be one of \[64, 128\].*got 96"):
        run(x, x, x, block_q=96)
    with pytest.raises(ValueError, match=r"block_k must be one of \[32, 64\].*got 16"):
        run(x, x, x, block_k=16)
    with pytest.raises(ValueError, match=r"block_q=128, block_k=32 is not a legal pair at head_dim=64 \(the Q tile "
                                         r"must fit in one K/V stage: block_q <= 2 \* block_k\).*\(64, 32\), "
                                         r"\(64, 64\), \(128, 64\)"):
        run(x, x, x, block_q=128, block_k=32)
    with pytest.raises(ValueError, match=r"min_blocks must be one of \[2, 4\]"):
        run(x, x, x, block_q=64, block_k=32, min_blocks=3)
    for name in ("block_q", "block_k", "min_blocks"):
        with pytest.raises(TypeError, match=name):
            run(x, x, x, **{name: True})
        with pytest.raises(TypeError, match=name):
            run(x, x, x, **{name: 64.0})
    with pytest.raises(TypeError, match="float16"):
        run(*[x.astype(np.float32)] * 3)
    for d in (16, 80, 256):
        y = np.zeros((8, d), np.float16)
        with pytest.raises(ValueError, match="head_dim must be one of"):
            run(y, y, y)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_mma_fa2_lazy_build(64, "float32")
    with pytest.raises(TypeError, match="head_dim"):
        flash_attention_mma_fa2_lazy_configs(True)


# ---------------------------------------------------------------------------
# the compiled code
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d, config", LEGAL, ids=[f"d{d}-{c[0]}x{c[1]}-min{c[2]}" for d, c in LEGAL])
def test_every_legal_configuration_compiles_without_spills(arch, dtype, d, config):
    build = gpu.flash_attention_mma_fa2_lazy_build(d, dtype, False, *config)
    res = gpu.compile_kernel(build, arch).resources[ENTRY]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0, res
    block_q, block_k, min_blocks = config
    assert res.smem_bytes == 0 and res.dynamic_smem_bytes == 8 * block_k * d
    assert res.threads_per_block == 2 * block_q
    # min_blocks blocks fit one SM: registers (65536 per SM) and shared memory (164 KiB on sm_80, 228 on sm_90)
    assert res.registers * res.threads_per_block * min_blocks <= 65536
    assert res.dynamic_smem_bytes * min_blocks <= 164 * 1024


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_the_lazy_entry_votes_and_the_plain_one_does_not(d):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    plain_module = compile_ptx(gpu.flash_attention_mma_fa2_build(d), "sm_80")
    module = compile_ptx(gpu.flash_attention_mma_fa2_lazy_build(d), "sm_80")
    plain, ptx = entry_ptx(plain_module, "flash_attention_mma_fa2"), entry_ptx(module, ENTRY)
    assert "vote.sync.any.pred" not in plain and ptx.count("vote.sync.any.pred") == 1     # __any_sync
    # the rescale sits behind the vote's branch: "@!vote bra L" over exactly the 4 x d / 8 multiplies of o
    # (a predicated or unconditional version would still spend the multiplies)
    m = re.search(r"vote\.sync\.any\.pred\s+(%p\d+),.*?\n(.*?)\n(\$L__BB\d+_\d+):", ptx, re.S)
    assert m is not None
    jump = re.match(r"\s*not\.pred\s+(%p\d+), " + re.escape(m.group(1)) + r";\s*@\1 bra\s+" + re.escape(m.group(3))
                    + r";(.*)", m.group(2), re.S)
    assert jump is not None, m.group(2)[:400]
    body = [line.strip() for line in jump.group(2).strip().splitlines() if line.strip()]
    assert len(body) == 4 * d // 8 and all(line.startswith("mul.ftz.f32") for line in body)
    # everything else is the FA-2 rung's: the same tensor-core instructions per tile
    _, block_k, _ = flash_attention_mma_fa2_lazy_config(d)
    assert ptx.count("mma.sync.aligned") == (d // 16) * (block_k // 8) + (block_k // 16) * (d // 8)
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "cp.async.wait_group 1" in ptx
    # the stages are a dynamic shared array (extern, no size), the plain rung's a static one of 32 KiB
    assert re.search(r"^\.extern \.shared \.align 128 \.b8 smem\[\];$", module, re.M) is not None
    assert ".extern .shared" not in plain_module and re.search(r"\.shared \.align 128 \.b8 \w+\[32768\];", plain)


# ---------------------------------------------------------------------------
# on a GPU
# ---------------------------------------------------------------------------

@on_gpu("mma_fa2_lazy")
@pytest.mark.parametrize("d, config", LEGAL, ids=[f"d{d}-{c[0]}x{c[1]}-min{c[2]}" for d, c in LEGAL])
def test_every_legal_configuration_on_larger_inputs_on_the_gpu(d, config):
    rng = np.random.default_rng(25)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, m, d)), "float16") for m in (1000, 1500, 1500))
    block_q, block_k, min_blocks = config
    for causal in (False, True):
        out, lse = gpu.flash_attention_mma_fa2_lazy_gpu(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                                        min_blocks=min_blocks)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)

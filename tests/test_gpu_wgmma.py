"""The Hopper rungs (flash_attention_wgmma.cu: TMA, mbarriers, wgmma, one producer and two consumer
warpgroups; flash_attention_wgmma_overlap.cu: the same steps with softmax overlapped with the
products): against NumPy on edge shapes (the emulator everywhere, an sm_90 GPU where one is
present), their NaN rule, their trace, bitwise repeatable output, the two rungs bitwise alike;
what the compiled code holds (wgmma, cp.async.bulk.tensor, mbarrier waits; no ldmatrix, mma.sync
or cp.async; no spills; no wgmma serialised by ptxas); the 128-byte swizzle that TMA writes and
wgmma reads; the emulator's tensor maps; and the models of the pipeline and of one consumer's
products and softmax (plain and overlapped), with their pictures."""
import re

from functools import partial

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu.hopper import emulated_tensor_map
from lessons.gpu.source import (WGMMA_CONFIGS, flash_attention_wgmma_config, flash_attention_wgmma_smem_bytes,
                                wgmma_swizzle)
from kernel_tolerance import assert_within_baseline, baseline_attention
from test_gpu_kernels import (POISONS, assert_attention_close, assert_nan_and_inf_reach_exactly_their_columns,
                              assert_trace_follows_numpy, flash_reference, forward_poison_check, stored, values)

from lessons.gpu.ladder import HOPPER_RUNGS, rungs_left_out  # noqa: E402

# (scripts/gpu_check.sh leaves out a rung whose first run failed: GPU_CHECK_LEFT_OUT names it)
LEFT_OUT = rungs_left_out()
on_hopper = gpu.device_available() and gpu.device_arch() == "sm_90" and "wgmma" not in LEFT_OUT
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=pytest.mark.skipif(not on_hopper, reason="no CUDA device of compute capability 9.0")),
]


def skip_left_out(backend, *rungs):
    """On a GPU, skip a test of a rung that scripts/gpu_check.sh left out after its first check."""
    if backend == "cupy" and LEFT_OUT & set(rungs):
        pytest.skip(f"left out after a failed first run: {sorted(LEFT_OUT & set(rungs))}")
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
needs_emulator = pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler for the emulator")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


#: the Hopper forwards: the plain order, softmax overlapped with the products, and that with the two
#: consumers taking turns
FORWARDS = [pytest.param(gpu.flash_attention_wgmma_gpu, id="plain"),
            pytest.param(gpu.flash_attention_wgmma_overlap_gpu, id="overlap"),
            pytest.param(gpu.flash_attention_wgmma_pingpong_gpu, id="pingpong")]
RUNG_OF = {gpu.flash_attention_wgmma_gpu: "wgmma", gpu.flash_attention_wgmma_overlap_gpu: "wgmma_overlap",
           gpu.flash_attention_wgmma_pingpong_gpu: "wgmma_pingpong"}
HOPPER_BUILDS = {"flash_attention_wgmma": gpu.flash_attention_wgmma_build,
                 "flash_attention_wgmma_overlap": gpu.flash_attention_wgmma_overlap_build}


@pytest.fixture(params=FORWARDS)
def forward(request):
    if "backend" in request.fixturenames:
        skip_left_out(request.getfixturevalue("backend"), RUNG_OF[request.param])
    return request.param


CASES = [
    # d = 64: 128-key tiles; d = 128: 64-key tiles; 128 query rows a block (2 consumers x 64)
    pytest.param((), 150, 130, 64, False, "float16", id="d64-two-query-blocks-N-not-a-multiple"),
    pytest.param((), 40, 300, 64, False, "float16", id="d64-three-key-tiles-a-stage-reused"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((1, 2), 20, 90, 64, True, "bfloat16", id="d64-bf16-causal-Nq<Nk"),
    pytest.param((), 33, 200, 128, True, "float16", id="d128-causal-four-key-tiles"),
    pytest.param((2,), 140, 50, 128, False, "bfloat16", id="d128-bf16-two-query-blocks"),
    pytest.param((), 5, 3, 64, False, "float16", id="d64-below-one-tile"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", CASES)
def test_wgmma_kernel_matches_the_reference(backend, forward, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = forward(q, k, v, causal=causal, bfloat16=dtype == "bfloat16", backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    ref, ref_lse = flash_reference(q64, k64, v64, causal)
    base, base_lse = baseline_attention(q64, k64, v64, dtype, causal=causal)
    assert_within_baseline(values(out, dtype), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")
    empty = np.isneginf(ref_lse)                     # rows that see no key: exactly 0 and -inf
    assert np.array_equal(np.isneginf(lse), empty)
    assert not values(out, dtype)[empty].any()


def test_wgmma_kernel_agrees_with_the_fa2_rung(backend):
    # the same fold in the same base-2 arithmetic: the two rungs agree far below fp16's rounding
    if backend == "cupy":
        pytest.skip("compared on the emulator; the GPU's products round differently per instruction")
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 96, 64)).astype(np.float16) for _ in range(3))
    a, la = gpu.flash_attention_wgmma_gpu(q, k, v, causal=True, backend=backend)
    b, lb = gpu.flash_attention_mma_fa2_gpu(q, k, v, causal=True, backend=backend)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), atol=2e-3)
    np.testing.assert_allclose(la, lb, atol=1e-5)


def test_wgmma_kernel_with_no_keys_gives_empty_rows(backend, forward):
    q = np.ones((10, 64), np.float16)
    kv = np.ones((0, 64), np.float16)
    out, lse = forward(q, kv, kv, backend=backend)
    assert out.shape == q.shape and not out.any() and np.isneginf(lse).all()
    empty = np.ones((0, 64), np.float16)
    out, lse = forward(empty, q, q, backend=backend)
    assert out.shape == (0, 64) and lse.shape == (0,)


def test_wgmma_kernel_is_bitwise_repeatable(backend, forward):
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 140, 64)).astype(np.float16) for _ in range(3))
    a = forward(q, k, v, causal=True, backend=backend)
    b = forward(q, k, v, causal=True, backend=backend)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


@pytest.mark.parametrize("nq, nk, d, causal, poison", [
    (150, 700, 64, True, None),          # 6 key tiles of 128: every stage of 3 used twice
    (33, 460, 128, False, None),         # 8 key tiles of 64
    (130, 300, 128, True, np.nan),       # a NaN in V: step 7 runs one iteration after its tile's softmax
])
def test_overlapped_rungs_are_bitwise_the_plain_rung(backend, nq, nk, d, causal, poison):
    skip_left_out(backend, *HOPPER_RUNGS)
    # the same arithmetic in the same order: O = alpha_j (O + P_{j-1} V_{j-1}) is what the plain rung does
    rng = np.random.default_rng(nq + nk + d)
    q, k, v = (rng.standard_normal((2, n, d)).astype(np.float16) for n in (nq, nk, nk))
    if poison is not None:
        v[1, nk // 2, 5] = poison
    a = gpu.flash_attention_wgmma_gpu(q, k, v, causal=causal, backend=backend)
    b = gpu.flash_attention_wgmma_overlap_gpu(q, k, v, causal=causal, backend=backend)
    c = gpu.flash_attention_wgmma_pingpong_gpu(q, k, v, causal=causal, backend=backend)
    for x in (b, c):
        if backend == "emulator":
            assert a[0].tobytes() == x[0].tobytes() and a[1].tobytes() == x[1].tobytes()
        else:                            # (on a GPU ptxas schedules the kernels' code differently)
            np.testing.assert_allclose(x[0].astype(np.float64), a[0].astype(np.float64), rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(x[1], a[1], rtol=1e-5, atol=1e-5)
        assert np.array_equal(np.isnan(a[0]), np.isnan(x[0]))
    # the turns change no instruction of the arithmetic: ping-pong is bitwise the overlapped rung, GPU too
    assert b[0].tobytes() == c[0].tobytes() and b[1].tobytes() == c[1].tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_wgmma_kernel_keeps_hidden_nan_out_and_visible_nan_in(backend, forward, bad):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((20, 64)).astype(np.float16) for _ in range(3))
    v[19, 3] = bad                  # causal, Nq = Nk: only row 19 sees key 19
    out, lse = forward(q, k, v, causal=True, backend=backend)
    out = out.astype(np.float64)
    assert np.isfinite(out[:19]).all() and np.isfinite(lse).all()
    assert out[19, 3] == bad if bad == np.inf else np.isnan(out[19, 3])
    assert np.isfinite(np.delete(out[19], 3)).all()


POISON_SHAPES = [
    (130, 150, 64, "float16"),              # two query blocks, the diagonal inside 128-key tiles
    (20, 90, 128, "bfloat16"),              # one block, the diagonal across two 64-key tiles
]
# every poison and shape for the plain rung; for the reordered rungs (whose step 7 runs an iteration
# later) each shape once, with NaN: they are bitwise the plain rung besides (test_overlapped_rungs_...)
POISON_CASES = ([pytest.param(FORWARDS[0].values[0], p.values[0], *shape, id=f"plain-{p.id}-{shape[0]}x{shape[1]}")
                 for p in POISONS for shape in POISON_SHAPES]
                + [pytest.param(f.values[0], np.nan, *shape, id=f"{f.id}-nan-{shape[0]}x{shape[1]}")
                   for f in FORWARDS[1:] for shape in POISON_SHAPES])


@pytest.mark.parametrize("forward, poison, nq, nk, d, dtype", POISON_CASES)
def test_wgmma_rows_never_see_poison_they_cannot_see(backend, forward, poison, nq, nk, d, dtype):
    skip_left_out(backend, RUNG_OF[forward])
    def launch(q, k, v):
        return forward(q, k, v, causal=True, bfloat16=dtype == "bfloat16", backend=backend)
    cut_rows = sorted({nq - nk + 3 if nq > nk else 0, nq // 2 + 1, nq - 2})
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


def test_wgmma_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend):
    # zero columns pad d to 64 (the kernel takes 64 and 128)
    assert_nan_and_inf_reach_exactly_their_columns(partial(gpu.flash_attention_wgmma_gpu, backend=backend), d=64)


def test_wgmma_trace_matches_the_numpy_trace(backend, forward):
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((150 if i == 0 else 300, 64)).astype(np.float16) for i in range(3))
    block_q, block_k = flash_attention_wgmma_config(64)
    rows = [0, 17, 63, 64, 127, 128, 149]          # both consumers, both query blocks
    _, _, trace = forward(q, k, v, trace_rows=rows, backend=backend)
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k, tiles=3)


def test_wgmma_kernel_refuses_what_it_cannot_do():
    x = np.zeros((8, 64), np.float16)
    with pytest.raises(TypeError, match="float16"):
        gpu.flash_attention_wgmma_gpu(*[x.astype(np.float32)] * 3, backend="emulator")
    for d in (16, 80, 256):
        y = np.zeros((8, d), np.float16)
        with pytest.raises(ValueError, match="head_dim must be one of"):
            gpu.flash_attention_wgmma_gpu(y, y, y, backend="emulator")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_wgmma_build(64, "float32")
    with pytest.raises(TypeError, match="head_dim"):
        flash_attention_wgmma_config(64.0)
    with pytest.raises(TypeError, match="causal"):
        gpu.flash_attention_wgmma_gpu(x, x, x, causal=1, backend="emulator")
    with pytest.raises(TypeError, match="causal"):
        gpu.flash_attention_wgmma_overlap_gpu(x, x, x, causal=1, backend="emulator")
    with pytest.raises(ValueError, match="head_dim must be one of"):
        gpu.flash_attention_wgmma_overlap_gpu(*[np.zeros((8, 32), np.float16)] * 3, backend="emulator")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gpu.flash_attention_wgmma_overlap_build(128, "float32")
    with pytest.raises(ValueError, match="stages"):
        flash_attention_wgmma_smem_bytes(64, 128, 5)


def test_wgmma_shared_memory_by_hand():
    # Q (128 rows), two stages of a K and a V tile, 2 bytes a value; 7 mbarriers and 2 flags; 1 KiB to align
    assert flash_attention_wgmma_smem_bytes(64, 128) == 128 * 64 * 2 + 2 * 2 * 128 * 64 * 2 + 56 + 8 + 1024 == 83008
    assert flash_attention_wgmma_smem_bytes(128, 64) == 128 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 56 + 8 + 1024 == 99392
    build = gpu.flash_attention_wgmma_build(128)
    assert build.dynamic_smem_bytes == 99392 and build.smem_bytes == 0 and build.threads_per_block == 384
    assert build.arch == "sm_90a" and gpu.flash_attention_mma_fa2_build(64).arch is None


# ---------------------------------------------------------------------------
# the 128-byte swizzle and the tensor maps
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows, d", [(128, 64), (64, 128)])
def test_swizzle_is_a_bijection_of_16_byte_chunks_and_conflict_free(rows, d):
    offsets = np.array([[wgmma_swizzle(r, c, rows, d) for c in range(d)] for r in range(rows)])
    assert sorted(offsets.ravel()) == list(range(0, 2 * rows * d, 2))      # every byte pair once
    assert (offsets[:, ::8] % 16 == 0).all() and (np.diff(offsets.reshape(rows, d // 8, 8), axis=2) == 2).all()
    # 8 consecutive rows at one logical chunk hit 8 different 16-byte bank groups (a wgmma row read)
    for r0 in range(0, rows, 8):
        for c in range(0, d, 8):
            assert len({(offsets[r, c] % 128) // 16 for r in range(r0, r0 + 8)}) == 8
    # by hand: row 1, column 8 (chunk 1) sits in chunk 1 ^ 1 = 0 of row 1; a second panel starts after `rows` rows
    assert wgmma_swizzle(1, 8, rows, d) == 128
    if d == 128:
        assert wgmma_swizzle(0, 64, rows, d) == rows * 128


def test_emulated_tensor_map_holds_the_tensor_it_names():
    x = np.zeros((3, 50, 128), np.float16)
    w = emulated_tensor_map(x, 64)
    assert w.dtype == np.uint64 and w.shape == (16,)
    assert int(w[0]) == x.ctypes.data and list(w[1:4]) == [128, 50, 3] and list(w[4:6]) == [256, 256 * 50]
    assert int(w[6]) == 64 | (64 << 16) | (1 << 32) and int(w[7]) == 2 and int(w[8]) == 128
    with pytest.raises(ValueError, match="multiple of 64"):
        emulated_tensor_map(np.zeros((1, 4, 48), np.float16), 64)
    with pytest.raises(TypeError, match="16-bit"):
        emulated_tensor_map(np.zeros((1, 4, 64), np.float32), 64)
    with pytest.raises(ValueError, match="box_rows"):
        emulated_tensor_map(x, 512)


# ---------------------------------------------------------------------------
# the compiled code (sm_90a: the only architecture with wgmma)
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kernel", sorted(HOPPER_BUILDS))
def test_wgmma_kernel_compiles_for_sm90a_without_spills(kernel, d, dtype):
    build = HOPPER_BUILDS[kernel](d, dtype)
    compiled = gpu.compile_kernel(build, "sm_90a")
    res = compiled.resources[kernel]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0
    assert res.threads_per_block == 384 and res.smem_bytes == 0          # all of it dynamic
    # one block of 384 threads per SM: 65536 registers / 384 threads = 170, in steps of 8: 168
    assert res.registers <= 168
    assert build.dynamic_smem_bytes <= 227 * 1024                          # what one block may have on sm_90
    # ptxas did not serialise the products (C7513/C7515: a register of a product in flight written by
    # ordinary code); the overlapped rung would lose its point
    assert "Potential Performance Loss" not in compiled.log, compiled.log


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_ptx_holds_the_instructions_of_the_rung(d):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    whole = compile_ptx(gpu.flash_attention_wgmma_build(d), "sm_90a")
    ptx = entry_ptx(whole, "flash_attention_wgmma")                       # (the file also holds the probe)
    assert ".entry wgmma_probe" in whole and ".entry wgmma_probe" not in ptx and ptx in whole
    _, bk = WGMMA_CONFIGS[d]
    # S = Q K^T: d / 16 products of 64 x block_k x 16; O += P V: block_k / 16 of 64 x d x 16
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{bk}k16.f32.f16.f16") == d // 16 + (bk // 16 if bk == d else 0)
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16") == bk // 16 + (d // 16 if bk == d else 0)
    assert "wgmma.fence.sync.aligned" in ptx and "wgmma.commit_group.sync.aligned" in ptx
    assert "wgmma.wait_group.sync.aligned 0" in ptx
    # TMA: one copy per 64-column panel (the loops unrolled) of Q, and of K and V in the copying thread's
    # loop; bytes completed on mbarriers
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes") == 3 * (d // 64)
    assert "mbarrier.arrive.expect_tx.shared::cta.b64" in ptx and "mbarrier.try_wait.parity.shared::cta.b64" in ptx
    assert "fence.proxy.async.shared::cta" in ptx and "vote.sync.any.pred" in ptx   # the producer warp checks V
    assert "bar.red" not in ptx                       # and the two consumers never wait for each other
    # what the rung removes: per-thread copies, ldmatrix and mma.sync
    assert "ldmatrix" not in ptx and "mma.sync" not in ptx and "cp.async.cg" not in ptx
    assert "ex2.approx.ftz.f32" in ptx and "cvt.rn.f16x2.f32" in ptx


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_overlapped_ptx_keeps_two_products_in_flight(d):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    ptx = entry_ptx(compile_ptx(gpu.flash_attention_wgmma_overlap_build(d)), "flash_attention_wgmma_overlap")
    _, bk = WGMMA_CONFIGS[d]
    # S = Q K^T before the loop (tile 0) and in it; P V in it and after it (the last tile)
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{bk}k16.f32.f16.f16") == 2 * (d // 16)
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{d}k16.f32.f16.f16") == 2 * (bk // 16)
    # in the loop: two commit groups, then a wait that leaves the newest (P V) running, then one for all
    assert ptx.count("wgmma.wait_group.sync.aligned 1") == 1
    loop = ptx[ptx.index("wgmma.wait_group.sync.aligned 1"):]
    assert "ex2.approx.ftz.f32" in loop.split("wgmma.wait_group.sync.aligned 0")[0]   # softmax between the waits
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes") == 3 * (d // 64)
    assert "ldmatrix" not in ptx and "mma.sync" not in ptx and "bar.red" not in ptx


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_pingpong_ptx_takes_turns_around_each_issue(d):
    from lessons.gpu.compile import compile_ptx, entry_ptx

    whole = compile_ptx(gpu.flash_attention_wgmma_overlap_build(d))
    ptx = entry_ptx(whole, "flash_attention_wgmma_pingpong")
    plain = entry_ptx(whole, "flash_attention_wgmma_overlap")
    # three places issue products (tile 0's S, the loop, the last P V): a wait for the turn before each and
    # a hand-over after each, one instruction per warpgroup (barrier ids are immediates), but none after
    # warpgroup 1's last P V; warpgroup 1's first hand-over at the start; __syncthreads (bar.sync 0)
    assert ptx.count("bar.sync") == 2 * 3 + 1 and ptx.count("bar.arrive") == 2 * 3 - 1 + 1
    assert {int(i) for i in re.findall(r"bar\.(?:sync|arrive) (\d+), 256;", ptx)} == {1, 2}
    assert plain.count("bar.sync") == 1 and "bar.arrive" not in plain
    # the products and waits are the overlapped rung's
    for instr in ("wgmma.mma_async", "wgmma.wait_group.sync.aligned 1", "wgmma.wait_group.sync.aligned 0"):
        assert ptx.count(instr) == plain.count(instr) > 0, instr
    res = gpu.compile_kernel(gpu.flash_attention_wgmma_overlap_build(d), "sm_90a").resources
    assert res["flash_attention_wgmma_pingpong"].spill_store_bytes == 0 and res["flash_attention_wgmma_pingpong"].registers <= 168


@needs_emulator
def test_builds_of_two_head_dims_in_one_process_keep_their_own_shared_memory():
    # the emulator's __shared__ arrays are statics; one inside a template function would be a single object
    # for the d = 64 and the d = 128 library (the larger overran the smaller: a crash, or worse, a wrong answer)
    rng = np.random.default_rng(40)
    for d in (64, 128, 64):
        q, k, v = (rng.standard_normal((n, d)).astype(np.float16) for n in (33, 200, 200))
        ref, _ = flash_reference(*(x.astype(np.float64) for x in (q, k, v)), True)
        for forward in (gpu.flash_attention_wgmma_overlap_gpu, gpu.flash_attention_wgmma_pingpong_gpu):
            out, _ = forward(q, k, v, causal=True, backend="emulator")
            np.testing.assert_allclose(out.astype(np.float64), ref, atol=5e-3)


@needs_emulator
def test_a_stage_released_before_its_product_is_done_is_caught_by_the_emulator(monkeypatch):
    # the emulator checks, at each wgmma wait, that the shared memory the product read has not changed; here
    # each consumer releases tile j - 1's stage before the wait that covers P_{j-1} V_{j-1}, so the producer
    # refills it (tile j + 2) under the product: the launch must fail, not give a plausible answer
    from lessons.gpu import emulator, source

    right = """        wgmma_wait<0>();
        fence_o(o);
        fence_p(p16);
        if (prev_bad) add_back_non_finite_v(o, p_zero_bits, v_bh, (tile - 1) * BLOCK_K, n_k, g, t);
        mbar_arrive(bar_empty(base, prev_s));"""
    early = """        mbar_arrive(bar_empty(base, prev_s));
        wgmma_wait<0>();
        fence_o(o);
        fence_p(p16);
        if (prev_bad) add_back_non_finite_v(o, p_zero_bits, v_bh, (tile - 1) * BLOCK_K, n_k, g, t);"""
    text = source.kernel_source("flash_attention_wgmma_overlap")
    assert text.count(right) == 1
    monkeypatch.setattr(emulator, "kernel_source", lambda kernel: text.replace(right, early))
    emulator._library.cache_clear()
    try:
        rng = np.random.default_rng(41)
        q, k, v = (rng.standard_normal((n, 64)).astype(np.float16) for n in (128, 700, 700))   # 6 key tiles
        with pytest.raises(gpu.EmulatorError, match="changed before the wait_group"):
            gpu.flash_attention_wgmma_overlap_gpu(q, k, v, backend="emulator")
    finally:
        emulator._library.cache_clear()


@needs_emulator
def test_pingpong_turns_that_do_not_balance_are_a_deadlock_the_emulator_reports(monkeypatch):
    # the emulator runs named barriers: leave out warpgroup 1's first hand-over and warpgroup 0 waits
    # for a turn never given to it (on a GPU: a hang); the real kernel finishes (the other tests)
    from lessons.gpu import emulator, source

    first = "if (PINGPONG && wg == 1 && n_tiles > 0) named_barrier_arrive<1, TURN_THREADS>();"
    text = source.kernel_source("flash_attention_wgmma_overlap")
    assert text.count(first) == 1
    monkeypatch.setattr(emulator, "kernel_source", lambda kernel: text.replace(first, ""))
    emulator._library.cache_clear()                    # (a library built from the patched text)
    try:
        q = np.zeros((130, 64), np.float16)
        with pytest.raises(gpu.EmulatorError, match="named bar.sync"):
            gpu.flash_attention_wgmma_pingpong_gpu(q, q, q, backend="emulator")
    finally:
        emulator._library.cache_clear()


@needs_nvrtc
def test_the_overlapped_rungs_text_quotes_the_compiler():
    from lessons.gpu import ladder
    from lessons.gpu.compile import nvrtc_version

    text = ladder.rung("wgmma_overlap").predicted
    res = {d: gpu.compile_kernel(gpu.flash_attention_wgmma_overlap_build(d), "sm_90a").resources for d in (64, 128)}
    smem = {d: flash_attention_wgmma_smem_bytes(d, WGMMA_CONFIGS[d][1], 3) for d in (64, 128)}
    assert f"{smem[64]:,} / {smem[128]:,} bytes of dynamic shared memory".replace(",", " ") in text
    assert gpu.flash_attention_wgmma_overlap_build(128).dynamic_smem_bytes == smem[128] == 132188   # the docstring's
    if nvrtc_version()[:2] == (12, 9):                # the version the texts name
        for rung, entry in (("wgmma_overlap", "flash_attention_wgmma_overlap"),
                            ("wgmma_pingpong", "flash_attention_wgmma_pingpong")):
            regs = {d: res[d][entry].registers for d in (64, 128)}
            assert f"{regs[64]} registers at d = 64, {regs[128]} at d = 128" in ladder.rung(rung).predicted


@needs_nvrtc
def test_wgmma_kernel_does_not_compile_for_sm_90_without_a():
    # wgmma exists only on sm_90a: the plain sm_90 target refuses it (why the build names its arch)
    with pytest.raises(gpu.KernelCompileError):
        gpu.compile_kernel(gpu.flash_attention_wgmma_build(64), "sm_90")


# ---------------------------------------------------------------------------
# on an H100/H200
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not on_hopper, reason="no CUDA device of compute capability 9.0")
@pytest.mark.parametrize("n, d", [(1000, 128), (2048, 64)])
def test_wgmma_on_larger_and_misaligned_inputs_on_the_gpu(n, d):
    import cupy

    rng = np.random.default_rng(25)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, m, d)), "float16") for m in (n, n + 500, n + 500))
    for causal in (False, True):
        out, lse = gpu.flash_attention_wgmma_gpu(q, k, v, causal=causal)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)
    flat = cupy.zeros(q.size + 1, dtype=cupy.float16)        # a view 2 bytes into its allocation: copied
    flat[1:] = cupy.asarray(q).ravel()
    q_view = flat[1:].reshape(q.shape)
    out, lse = gpu.flash_attention_wgmma_gpu(q_view, cupy.asarray(k), cupy.asarray(v))
    assert isinstance(out, cupy.ndarray)
    assert_attention_close(out.get(), lse.get(), q64, k64, v64, "float16")


# ---------------------------------------------------------------------------
# the pipeline the mbarriers order (notebook 11's picture)
# ---------------------------------------------------------------------------

def test_pipeline_schedule_by_hand():
    from lessons.gpu.hopper import pipeline_schedule

    # one stage: copy, work, copy, work ... 6 tiles x (1 + 1)
    one = pipeline_schedule(6, stages=1)
    assert max(e.end for e in one) == 12.0
    # two stages, equal times: every copy after the first hides under the previous tile's work: 1 + 6
    two = pipeline_schedule(6, stages=2)
    assert max(e.end for e in two) == 7.0 and max(e.end for e in pipeline_schedule(6, stages=3)) == 7.0
    # work twice as long as a copy: 1 + 6 x 2; copies twice as long: 6 x 2 + 1
    assert max(e.end for e in pipeline_schedule(6, 2, 1.0, 2.0)) == 13.0
    assert max(e.end for e in pipeline_schedule(6, 2, 2.0, 1.0)) == 13.0
    # the barriers' rules hold in every schedule: a copy into a stage waits for the work on the tile
    # that stage held, and work on a tile waits for its copy and for the tile before
    for stages in (1, 2, 3):
        ev = pipeline_schedule(7, stages, 1.5, 1.0)
        copy = {e.tile: e for e in ev if e.who == "producer"}
        work = {e.tile: e for e in ev if e.who == "consumers"}
        for j in range(7):
            assert copy[j].stage == work[j].stage == j % stages
            assert work[j].start >= copy[j].end
            if j >= stages:
                assert copy[j].start >= work[j - stages].end
            if j:
                assert work[j].start >= work[j - 1].end and copy[j].start >= copy[j - 1].end
    assert pipeline_schedule(0) == []


@pytest.mark.parametrize("call, error, match", [
    (lambda s: s(-1), ValueError, "n_tiles"),
    (lambda s: s(3, stages=0), ValueError, "stages"),
    (lambda s: s(3, 2.5), TypeError, "stages"),
    (lambda s: s(3, 2, load_time=0), ValueError, "load_time"),
    (lambda s: s(3, 2, compute_time=float("nan")), ValueError, "compute_time"),
    (lambda s: s(3, 2, compute_time=True), TypeError, "compute_time"),
])
def test_pipeline_schedule_rejects_bad_arguments_by_name(call, error, match):
    from lessons.gpu.hopper import pipeline_schedule

    with pytest.raises(error, match=match):
        call(pipeline_schedule)


def test_pipeline_figure_draws_every_event():
    from lessons.gpu.hopper import pipeline_schedule
    from lessons.views.pipeline import pipeline_figure

    schedules = {"one stage": pipeline_schedule(5, 1), "two stages": pipeline_schedule(5, 2)}
    fig = pipeline_figure(schedules, unit="time")
    for ax, (title, events) in zip(fig.axes, schedules.items()):
        bars = sorted((round(p.get_x(), 6), round(p.get_width(), 6)) for p in ax.patches)
        assert bars == sorted((e.start, e.end - e.start) for e in events)
        assert f"all tiles done at {max(e.end for e in events):g}" in ax.get_title(loc="left")
    with pytest.raises(ValueError):
        pipeline_figure({})
    with pytest.raises(ValueError, match="no events"):
        pipeline_figure({"empty": []})


@needs_nvrtc
def test_the_compile_report_gives_the_hopper_rung_its_own_architecture():
    rows = gpu.compile_report(("sm_80", "sm_90"), builds=[gpu.flash_attention_wgmma_build(64)], use_device=False)
    assert [(r.entry, r.arch) for r in rows] == [("flash_attention_wgmma", "sm_90a"), ("wgmma_probe", "sm_90a")]
    assert all(r.spill_bytes == 0 and r.threads_per_block == 384 for r in rows)


# ---------------------------------------------------------------------------
# the two products alone (the probe a GPU run reads first when the kernel disagrees)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_wgmma_probe_multiplies_by_the_documented_layouts(backend, d):
    _, bk = WGMMA_CONFIGS[d]
    rng = np.random.default_rng(d)
    a, b, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((64, d), (bk, d), (bk, d)))
    s, o = gpu.wgmma_probe_gpu(a, b, v, backend=backend)
    assert s.shape == (64, bk) and o.shape == (64, d) and s.dtype == o.dtype == np.float32
    s_ref = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(s, s_ref, atol=1e-3 * np.sqrt(d))
    # o = (s rounded to 16 bits) @ v, float32 accumulation
    o_ref = s.astype(np.float16).astype(np.float64) @ v.astype(np.float64)
    np.testing.assert_allclose(o, o_ref, atol=1e-3 * np.sqrt(bk))


def test_wgmma_probe_by_hand(backend):
    # a picks one column of b per row: a[i, i % 64] = 1, so s[i, j] = b[j, i % 64]; b[j, c] = j + c / 64
    # (exact in fp16: multiples of 1/64 below 256); v = identity on its first 64 columns, so o[:, :bk] = s16
    _, bk = WGMMA_CONFIGS[64]
    a = np.zeros((64, 64), np.float16)
    a[np.arange(64), np.arange(64)] = 1
    b = (np.arange(bk)[:, None] + np.arange(64)[None, :] / 64).astype(np.float16)
    v = np.zeros((bk, 64), np.float16)
    v[np.arange(64), np.arange(64)] = 1
    s, o = gpu.wgmma_probe_gpu(a, b, v, backend=backend)
    np.testing.assert_array_equal(s, b.T.astype(np.float32))
    np.testing.assert_array_equal(o, s[:, :64])


def test_wgmma_probe_refuses_other_shapes():
    x = np.zeros((64, 64), np.float16)
    with pytest.raises(ValueError, match="b must be"):
        gpu.wgmma_probe_gpu(x, x, np.zeros((128, 64), np.float16), backend="emulator")
    with pytest.raises(ValueError, match="a must be"):
        gpu.wgmma_probe_gpu(np.zeros((32, 64), np.float16), x, x, backend="emulator")
    with pytest.raises(TypeError):
        gpu.wgmma_probe_gpu(x.astype(np.float32), x, x, backend="emulator")


@needs_nvrtc
def test_entry_ptx_cuts_one_entry_out():
    from lessons.gpu.compile import compile_ptx, entry_ptx

    whole = compile_ptx(gpu.flash_attention_wgmma_build(64), "sm_90a")
    kernel, probe = entry_ptx(whole, "flash_attention_wgmma"), entry_ptx(whole, "wgmma_probe")
    assert kernel.count("wgmma.mma_async") == probe.count("wgmma.mma_async") == 12 == whole.count("wgmma.mma_async") / 2
    with pytest.raises(ValueError, match="entry must be one of"):
        entry_ptx(whole, "nope")


@needs_emulator
def test_a_view_off_a_128_byte_boundary_is_copied_not_misread():
    from lessons.gpu.launch import Runner, _aligned

    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal((70, 64)).astype(np.float16) for _ in range(3))
    flat = np.zeros(q.size + 8, np.float16)
    flat[8:] = q.ravel()
    view = flat[8:].reshape(q.shape)                 # 16 bytes into its buffer: aligned to 16, maybe not 128
    moved = _aligned(Runner("emulator"), np.ascontiguousarray(view), 128)
    assert moved.ctypes.data % 128 == 0 and np.array_equal(moved, q)
    a = gpu.flash_attention_wgmma_gpu(view, k, v, backend="emulator")
    b = gpu.flash_attention_wgmma_gpu(q, k, v, backend="emulator")
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()


@needs_nvrtc
def test_the_rungs_predicted_text_quotes_the_compiler():
    from lessons.gpu import ladder
    from lessons.gpu.compile import nvrtc_version

    text = ladder.rung("wgmma").predicted
    regs = {d: gpu.compile_kernel(gpu.flash_attention_wgmma_build(d), "sm_90a").resources["flash_attention_wgmma"]
            .registers for d in (64, 128)}
    smem = {d: flash_attention_wgmma_smem_bytes(d, WGMMA_CONFIGS[d][1]) for d in (64, 128)}
    assert f"{smem[64]:,} / {smem[128]:,} bytes of dynamic shared memory".replace(",", " ") in text
    if nvrtc_version()[:2] == (12, 9):                # the version the text names
        assert f"{regs[64]} registers at d = 64, {regs[128]} at d = 128" in text


# ---------------------------------------------------------------------------
# what a tester tried: empty leading dims, odd arguments, read-only inputs
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 20, 64), (2, 0, 20, 64), (3, 0, 64)])
def test_wgmma_kernel_with_empty_leading_dims_or_rows_gives_empty_results(shape):
    q = np.zeros(shape, np.float16)
    out, lse = gpu.flash_attention_wgmma_gpu(q, q, q, backend="emulator")
    assert out.shape == q.shape and lse.shape == q.shape[:-1]


def test_tensor_maps_name_what_is_wrong():
    x = np.zeros((1, 4, 64), np.float16)
    for box, error in ((64.0, TypeError), (True, TypeError), (None, TypeError), (0, ValueError), (257, ValueError)):
        with pytest.raises(error, match="box_rows"):
            emulated_tensor_map(x, box)
    with pytest.raises(ValueError, match="positive multiple of 64"):
        emulated_tensor_map(np.zeros((1, 4, 0), np.float16), 4)
    with pytest.raises(ValueError, match="C-contiguous"):
        emulated_tensor_map(np.zeros((1, 4, 128), np.float16)[:, :, ::2], 4)
    with pytest.raises(TypeError, match="NumPy array"):
        emulated_tensor_map([[[0.0] * 64]], 4)


def test_pipeline_schedule_takes_numpy_numbers_and_refuses_overflow():
    from lessons.gpu.hopper import pipeline_schedule

    ev = pipeline_schedule(np.int64(3), np.int64(2), np.float32(1.0), np.int64(2))
    assert max(e.end for e in ev) == 1 + 3 * 2 and all(isinstance(e.end, float) for e in ev)
    with pytest.raises(TypeError, match="load_time"):
        pipeline_schedule(3, 2, "1")
    with pytest.raises(ValueError, match="must be finite"):
        pipeline_schedule(3, 2, 1e308, 1e308)


def test_pipeline_figure_refuses_what_it_cannot_draw():
    from lessons.gpu.hopper import PipelineEvent, pipeline_schedule
    from lessons.views.pipeline import pipeline_figure

    with pytest.raises(TypeError, match="dict"):
        pipeline_figure([pipeline_schedule(2)])
    with pytest.raises(TypeError, match="PipelineEvent"):
        pipeline_figure({"x": [("producer", 0, 0, 0.0, 1.0)]})
    with pytest.raises(ValueError, match="who must be one of"):
        pipeline_figure({"x": [PipelineEvent("copier", 0, 0, 0.0, 1.0)]})
    with pytest.raises(ValueError, match="start <= end"):
        pipeline_figure({"x": [PipelineEvent("producer", 0, 0, 2.0, 1.0)]})
    # twelve stages: every bar still drawn, the legend names every stage
    fig = pipeline_figure({"many": pipeline_schedule(12, 12)})
    assert len(fig.axes[0].patches) == 24 and len(fig.axes[0].get_legend().get_texts()) == 12


@needs_nvrtc
def test_ptx_and_the_compile_report_use_the_builds_own_architecture():
    from lessons.gpu.compile import compile_ptx, compile_report_table

    build = gpu.flash_attention_wgmma_build(64)
    assert ".target sm_90a" in compile_ptx(build)
    with pytest.raises(ValueError, match="compiles for sm_90a only"):
        compile_ptx(build, "sm_90")
    rows = gpu.compile_report(builds=[build], use_device=False)
    assert all(r.smem_bytes == 0 and r.dynamic_smem_bytes == build.dynamic_smem_bytes for r in rows)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(compile_report_table(rows))
    assert f"0 + {build.dynamic_smem_bytes:,} dynamic" in console.export_text()


@needs_emulator
def test_read_only_inputs_run_on_the_emulator():
    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal((30, 64)).astype(np.float16) for _ in range(3))
    want = gpu.flash_attention_wgmma_gpu(q, k, v, backend="emulator")
    for x in (q, k, v):
        x.flags.writeable = False
    got = gpu.flash_attention_wgmma_gpu(q, k, v, backend="emulator")
    assert got[0].tobytes() == want[0].tobytes()
    assert gpu.flash_attention_mma_fa2_gpu(q, k, v, backend="emulator")[0].shape == q.shape


def test_swizzle_figure_outlines_one_column_without_and_eight_with_the_swizzle():
    from matplotlib.patches import Rectangle

    from lessons.views.pipeline import swizzle_figure

    fig = swizzle_figure(8, read_chunk=2)
    plain, swizzled = fig.axes
    for ax, slots in ((plain, [2] * 8), (swizzled, [2 ^ r for r in range(8)])):
        outlined = sorted((int(p.get_y()), int(p.get_x())) for p in ax.patches
                          if isinstance(p, Rectangle) and not p.get_fill())
        assert outlined == [(r, s) for r, s in enumerate(slots)]
    assert "1 column of banks" in plain.get_title(loc="left")
    assert "8 columns of banks" in swizzled.get_title(loc="left")
    for bad in (dict(rows=12), dict(rows=True), dict(read_chunk=8)):
        with pytest.raises(ValueError):
            swizzle_figure(**bad)


# ---------------------------------------------------------------------------
# one consumer's products and softmax, plain and overlapped (notebook 11's picture)
# ---------------------------------------------------------------------------

def test_overlap_schedule_by_hand():
    from lessons.gpu.hopper import overlap_schedule

    def makespan(events):
        return max(e.end for e in events)

    # plain, 4 tiles, every step 1: S_j, softmax_j, P_j V_j one after another, 4 x 3 = 12
    plain = overlap_schedule(4, overlap=False)
    assert [(e.label, e.start, e.end) for e in plain[:6]] == [
        ("S0", 0, 1), ("softmax0", 1, 2), ("P0V0", 2, 3), ("S1", 3, 4), ("softmax1", 4, 5), ("P1V1", 5, 6)]
    assert makespan(plain) == 12.0
    # overlapped, the same times: S0 [0, 1], softmax0 [1, 2]; then per j = 1, 2, 3 S_j [2j, 2j + 1] and
    # P_{j-1}V_{j-1} [2j + 1, 2j + 2] on the tensor cores, softmax_j [2j + 1, 2j + 2] beside it; P3V3 [8, 9]:
    # 2 + 3 x 2 + 1 = 9
    over = {e.label: (e.start, e.end) for e in overlap_schedule(4, overlap=True)}
    assert over == {"S0": (0, 1), "softmax0": (1, 2),
                    "S1": (2, 3), "P0V0": (3, 4), "softmax1": (3, 4),
                    "S2": (4, 5), "P1V1": (5, 6), "softmax2": (5, 6),
                    "S3": (6, 7), "P2V2": (7, 8), "softmax3": (7, 8), "P3V3": (8, 9)}
    # softmax twice a product: each later tile costs qk + softmax = 3, so 3 + 3 x 3 + 1 = 13 (plain 4 x 4 = 16);
    # softmax half of one: qk + pv = 2 per tile, 1.5 + 3 x 2 + 1 = 8.5 (plain 4 x 2.5 = 10)
    assert makespan(overlap_schedule(4, softmax=2, overlap=True)) == 13.0
    assert makespan(overlap_schedule(4, softmax=2, overlap=False)) == 16.0
    assert makespan(overlap_schedule(4, softmax=0.5, overlap=True)) == 8.5
    assert makespan(overlap_schedule(4, softmax=0.5, overlap=False)) == 10.0
    # one tile: nothing to overlap, both orders take qk + softmax + pv
    assert makespan(overlap_schedule(1, qk=1, softmax=2, pv=3, overlap=True)) == 6.0
    assert overlap_schedule(0, overlap=True) == overlap_schedule(0, overlap=False) == []


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_schedule_keeps_the_kernels_rules(overlap):
    from lessons.gpu.hopper import overlap_schedule

    ev = overlap_schedule(6, qk=0.7, softmax=1.3, pv=0.9, overlap=overlap)
    assert len(ev) == 18 and [(e.tile, e.step) for e in ev[:3]] == [(0, "S"), (0, "softmax"), (0, "PV")]
    at = {(e.step, e.tile): e for e in ev}
    for unit in ("tensor cores", "CUDA cores"):      # one thing at a time on each unit
        busy = sorted((e.start, e.end) for e in ev if e.unit == unit)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(busy, busy[1:]))
    # the tensor cores take the products in issue order: plain S0 P0V0 S1 P1V1 ...; overlapped S0 S1 P0V0 S2 P1V1 ...
    order = [e.label for e in sorted(ev, key=lambda e: e.start) if e.unit == "tensor cores"]
    if overlap:
        assert order == ["S0"] + [x for j in range(1, 6) for x in (f"S{j}", f"P{j - 1}V{j - 1}")] + ["P5V5"]
    else:
        assert order == [x for j in range(6) for x in (f"S{j}", f"P{j}V{j}")]
    for j in range(6):
        assert at["softmax", j].start >= at["S", j].end and at["PV", j].start >= at["softmax", j].end
        if j and overlap:                            # softmax_j runs beside P_{j-1} V_{j-1}
            assert at["softmax", j].start == at["PV", j - 1].start
        if j and not overlap:                        # nothing of tile j before P_{j-1} V_{j-1} is done
            assert at["S", j].start >= at["PV", j - 1].end


@pytest.mark.parametrize("call, error, match", [
    (lambda s: s(-1, overlap=True), ValueError, "n_tiles"),
    (lambda s: s(2.0, overlap=True), TypeError, "n_tiles"),
    (lambda s: s(3, qk=0, overlap=True), ValueError, "qk"),
    (lambda s: s(3, softmax=float("inf"), overlap=True), ValueError, "softmax"),
    (lambda s: s(3, pv="1", overlap=True), TypeError, "pv"),
    (lambda s: s(3, pv=True, overlap=True), TypeError, "pv"),
    (lambda s: s(3, overlap=1), TypeError, "overlap"),
    (lambda s: s(3, overlap=None), TypeError, "overlap"),
    (lambda s: s(3), TypeError, "overlap"),
    (lambda s: s(3, 1.0, overlap=True), TypeError, "positional"),
    (lambda s: s(3, qk=1e308, softmax=1e308, overlap=False), ValueError, "must be finite"),
    (lambda s: s(10**12, overlap=True), ValueError, "n_tiles must be at most"),
    (lambda s: s(10**400, overlap=True), ValueError, "n_tiles must be at most"),
])
def test_overlap_schedule_rejects_bad_arguments_by_name(call, error, match):
    from lessons.gpu.hopper import overlap_schedule

    with pytest.raises(error, match=match):
        call(overlap_schedule)


def test_overlap_schedule_takes_numpy_numbers():
    from lessons.gpu.hopper import overlap_schedule

    ev = overlap_schedule(np.int64(4), qk=np.float32(1.0), softmax=np.int64(1), pv=np.float64(1.0),
                          overlap=np.bool_(True))
    assert max(e.end for e in ev) == 9.0 and all(isinstance(e.start, float) and isinstance(e.end, float) for e in ev)


def test_overlap_figure_draws_every_event_where_it_runs():
    from lessons.gpu.hopper import overlap_schedule
    from lessons.views.pipeline import overlap_figure

    schedules = {"plain": overlap_schedule(4, overlap=False), "overlapped": overlap_schedule(4, overlap=True)}
    fig = overlap_figure(schedules, unit="time")
    for ax, (title, events) in zip(fig.axes, schedules.items()):
        # the tensor cores' row at y = 1, the CUDA cores' at y = 0
        bars = sorted((round(p.get_x(), 6), round(p.get_width(), 6), round(p.get_y() + p.get_height() / 2, 6))
                      for p in ax.patches)
        assert bars == sorted((e.start, e.end - e.start, 1.0 if e.unit == "tensor cores" else 0.0) for e in events)
        total = max(e.end for e in events)
        assert f"{title}: done at {total:g}" == ax.get_title(loc="left")
        assert [line.get_xdata()[0] for line in ax.get_lines()] == [total]          # the makespan marked
        texts = {t.get_text() for t in ax.texts}
        assert {"$S_{0}$", "$P_{3}V_{3}$", "softmax$_{2}$"} <= texts and len(ax.texts) == len(events)
    assert fig.axes[-1].get_xlabel() == "time"
    # a box too narrow for its name keeps its tile number, or nothing
    fig = overlap_figure({"narrow": overlap_schedule(8, softmax=0.3, overlap=True)})
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "$S_{0}$" in texts and "softmax$_{0}$" not in texts and len(texts) <= 24


def test_overlap_figure_refuses_what_it_cannot_draw():
    from lessons.gpu.hopper import OverlapEvent, PipelineEvent, overlap_schedule
    from lessons.views.pipeline import overlap_figure

    with pytest.raises(TypeError, match="dict"):
        overlap_figure([overlap_schedule(2, overlap=True)])
    with pytest.raises(TypeError, match="OverlapEvent"):
        overlap_figure({"x": [PipelineEvent("producer", 0, 0, 0.0, 1.0)]})
    with pytest.raises(ValueError, match="at least one"):
        overlap_figure({})
    with pytest.raises(ValueError, match="no events"):
        overlap_figure({"x": []})
    with pytest.raises(ValueError, match="step must be one of"):
        overlap_figure({"x": [OverlapEvent("exp", 0, 0.0, 1.0)]})
    with pytest.raises(ValueError, match="start <= end"):
        overlap_figure({"x": [OverlapEvent("S", 0, 2.0, 1.0)]})
    with pytest.raises(ValueError, match="< inf"):
        overlap_figure({"x": [OverlapEvent("S", 0, 0.0, float("inf"))]})
    for bad in (0.5, "0", None, True):
        with pytest.raises(TypeError, match="tile must be an int"):
            overlap_figure({"x": [OverlapEvent("S", bad, 0.0, 1.0)]})
    with pytest.raises(TypeError, match="must be numbers"):
        overlap_figure({"x": [OverlapEvent("S", 0, "0", 1.0)]})
    with pytest.raises(ValueError, match="step must be one of"):
        overlap_figure({"x": [OverlapEvent(["S"], 0, 0.0, 1.0)]})


@pytest.mark.parametrize("call, error, match", [
    (lambda f: f(-64, 64), ValueError, "head_dim"),
    (lambda f: f(True, 64), TypeError, "head_dim"),
    (lambda f: f(64.0, 64), TypeError, "head_dim"),
    (lambda f: f(64, None), TypeError, "block_k"),
    (lambda f: f(64, 0), ValueError, "block_k"),
    (lambda f: f(64, 64, 1), ValueError, "stages"),
])
def test_shared_memory_of_the_hopper_rungs_refuses_bad_sizes_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call(flash_attention_wgmma_smem_bytes)
    # numpy ints are taken as Python ints (no overflow in int16 arithmetic)
    assert flash_attention_wgmma_smem_bytes(np.int16(128), np.int16(64), np.int16(3)) == 132188


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_overlap_evidence_reads_the_compiler(d):
    from lessons.gpu import ladder

    ev = ladder.overlap_evidence(d)
    _, bk = WGMMA_CONFIGS[d]
    assert ev["stages"] == {"wgmma": 2, "wgmma_overlap": 3}
    assert ev["smem_bytes"] == {name: flash_attention_wgmma_smem_bytes(d, bk, ev["stages"][name])
                                for name in ("wgmma", "wgmma_overlap")}
    for name, build in HOPPER_BUILDS.items():
        short = name.replace("flash_attention_", "")
        assert ev["registers"][short] == gpu.compile_kernel(build(d), "sm_90a").resources[name].registers
    assert ev["registers"]["wgmma_overlap"] > ev["registers"]["wgmma"]        # S, P and O live at once
    # one wait that leaves P V running, and the softmax of tile j after it: one ex2 per value of S_j a thread
    # holds (64 rows x block_k over 128 threads); alpha's two ex2 follow the wait_group 0, in the lazy rescale's
    # branch with o's multiplies
    assert ev["wait_group_1"] == 1 and ev["s_per_thread"] == bk // 2
    assert ev["ex2_between_waits"] == ev["s_per_thread"]
    assert ev["serialised"] == {"wgmma": False, "wgmma_overlap": False} and ev["log_warnings"] == []


def test_overlap_evidence_names_a_bad_head_dim():
    from lessons.gpu import ladder

    with pytest.raises(ValueError, match="d must be one of"):
        ladder.overlap_evidence(96)
    with pytest.raises(TypeError, match="d must be an int"):
        ladder.overlap_evidence(64.0)

"""The tensor-core backward (lessons/gpu/kernels/flash_attention_backward_mma.cu) against NumPy.

Each numerical test runs on the CPU emulator (the same CUDA C on the CPU, mma.sync rebuilt
from its fragment layout) and, where there is one, on a CUDA device. The rule is
FlashAttention's own (tests/kernel_tolerance.py): the kernel's largest error against the float64
textbook gradient (:func:`lessons.attention_backward` on the very values the kernel stores) must
be at most twice that of the same backward computed as a framework computes it in the 16-bit
dtype (:func:`baseline_backward`: every matrix product summed in float32 and rounded to the
dtype, P and dS rounded too, as PyTorch's reference in FlashAttention's tests does). The
tensor-core kernel rounds P and dS to 16 bits before their products, so the CUDA-core backward's
bar (NumPy in float32, rounded once at the end) would not be the right one.

NVRTC compiles every build for sm_80 and sm_90 without a GPU; the report must show no spills and
the shared memory the tile formula gives, and the PTX must hold the tensor-core instruction.
"""
import re

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from kernel_tolerance import assert_within_baseline, round_to
from lessons.gpu import source
from lessons.gpu.backward import flash_attention_backward_gpu, flash_attention_backward_mma_gpu
from test_gpu_backward import _benchmark_module, assert_agrees_with_torch

NO_DEVICE = "no CUDA device: the same cases run on the CPU under the 'emulator' backend"
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(),
                                                      reason="no C++ compiler (g++) for the CPU emulation")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)),
]
gpu_only = pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)
ENTRIES = source.KERNELS["flash_attention_backward_mma"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def stored(x, dtype):
    """(array as the kernel stores it, its exact values as float64)."""
    if dtype == "bfloat16":
        bits = gpu.to_bfloat16_bits(x)
        return bits, gpu.from_bfloat16_bits(bits).astype(np.float64)
    arr = np.ascontiguousarray(x, dtype=dtype)
    return arr, arr.astype(np.float64)


def values(x, dtype):
    x = x.get() if hasattr(x, "get") else x
    return (gpu.from_bfloat16_bits(x) if dtype == "bfloat16" else x).astype(np.float64)


def problem(lead, nq, nk, d, causal, dtype, seed):
    """Stored inputs (q, k, v, o, lse, do) and the float64 values of q, k, v, do.

    o and lse come from the float64 forward on the stored q, k, v; o is stored in ``dtype`` and
    lse in float32, as a forward kernel hands them over."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (stored(rng.standard_normal((*lead, n, d)), dtype)
                                                for n in (nq, nk, nk, nq))
    o64, lse64 = np.zeros((*lead, nq, d)), np.zeros((*lead, nq))
    for idx in np.ndindex(*lead):
        o64[idx], lse64[idx] = lessons.attention(q64[idx], k64[idx], v64[idx], causal=causal, return_lse=True)
    o, _ = stored(o64, dtype)
    return (q, k, v, o, lse64.astype(np.float32), do), (q64, k64, v64, do64)


def textbook64(q64, k64, v64, do64, causal):
    """lessons.attention_backward in float64 for every leading index: [dq, dk, dv]."""
    outs = [np.zeros_like(q64), np.zeros_like(k64), np.zeros_like(v64)]
    for idx in np.ndindex(*q64.shape[:-2]):
        for out, g in zip(outs, lessons.attention_backward(q64[idx], k64[idx], v64[idx], do64[idx], causal=causal)):
            out[idx] = g
    return outs


def baseline_backward(q, k, v, do, dtype, causal=False):
    """The attention backward as an eager framework computes it in ``dtype``: [dq, dk, dv] float64.

    q, k, v, do: the exact (float64) values of the stored inputs, (..., N, d). As the forward's
    baseline (:func:`kernel_tolerance.baseline_attention`) and PyTorch's autograd of it: q * scale,
    S = (q * scale) k^T and the softmax P are rounded to ``dtype``; then dV = P^T dO, dP = dO V^T,
    dS = P * (dP - rowsum(P * dP)), dQ = (dS K) * scale and dK = dS^T (q * scale), every product
    summed in float32 and rounded to ``dtype``. A row that sees no key has P = 0.
    """
    q, k, v, do = (np.asarray(x, dtype=np.float32) for x in (q, k, v, do))
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = np.float32(1.0 / np.sqrt(d))
    visible = np.ones((nq, nk), bool)
    if causal:
        visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
    qs = round_to(q * scale, dtype)
    s = np.where(visible, round_to(qs @ np.swapaxes(k, -1, -2), dtype), -np.inf).astype(np.float32)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    seen = m > -np.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(s - np.where(seen, m, 0))
        p = round_to(np.where(seen, e / np.where(seen, e.sum(axis=-1, keepdims=True), 1), 0), dtype)
    dv = round_to(np.swapaxes(p, -1, -2) @ do, dtype)
    dp = round_to(do @ np.swapaxes(v, -1, -2), dtype)
    ds = round_to(p * (dp - (p * dp).sum(axis=-1, keepdims=True)), dtype)
    dq = round_to(round_to(ds @ k, dtype) * scale, dtype)
    dk = round_to(np.swapaxes(ds, -1, -2) @ qs, dtype)
    return [x.astype(np.float64) for x in (dq, dk, dv)]


def assert_like_a_framework(got, exact, dtype, causal):
    """FlashAttention's rule for each gradient; the floor grows with the number of terms the
    kernel sums into it one after another (dq: Nk keys, dk and dv: Nq rows)."""
    ref = textbook64(*exact, causal)
    base = baseline_backward(*exact, dtype, causal)
    nq, nk = exact[0].shape[-2], exact[1].shape[-2]
    for name, g, r, b, terms in zip(("dq", "dk", "dv"), got, ref, base, (nk, nq, nq)):
        assert_within_baseline(values(g, dtype), r, b, what=name, terms=terms)


CASES = [
    # lead, Nq, Nk, d, causal, dtype                                    what it covers
    pytest.param((), 70, 90, 64, False, "float16", id="d64-ragged-N"),
    pytest.param((), 100, 37, 64, True, "float16", id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((1, 2), 65, 65, 64, True, "float16", id="d64-causal-batch-heads"),
    pytest.param((), 33, 70, 128, False, "float16", id="d128-Nq<Nk"),
    pytest.param((2,), 45, 130, 128, True, "bfloat16", id="bf16-d128-causal-two-heads"),
    pytest.param((), 64, 64, 64, False, "bfloat16", id="bf16-d64-whole-blocks"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", CASES)
def test_within_twice_the_error_of_a_framework_backward(backend, lead, nq, nk, d, causal, dtype):
    inputs, exact = problem(lead, nq, nk, d, causal, dtype, seed=nq * 1000 + nk + d)
    got = flash_attention_backward_mma_gpu(*inputs, causal=causal, bfloat16=dtype == "bfloat16", backend=backend)
    for g, x in zip(got, inputs[:3]):
        assert g.shape == x.shape and g.dtype == x.dtype
    assert_like_a_framework(got, exact, dtype, causal)


def test_close_to_the_cuda_core_backward(backend):
    # the two kernels compute the same gradients; they differ by the 16-bit rounding of P and dS
    inputs, exact = problem((), 70, 90, 64, True, "float16", seed=1)
    mma = [values(g, "float16") for g in flash_attention_backward_mma_gpu(*inputs, causal=True, backend=backend)]
    cuda_core = [values(g, "float16") for g in flash_attention_backward_gpu(*inputs, causal=True, backend=backend)]
    for name, a, b, r in zip(("dq", "dk", "dv"), mma, cuda_core, textbook64(*exact, True)):
        assert np.abs(a - b).max() <= 4e-3 * np.abs(r).max(), name


def test_the_baseline_is_the_textbook_gradient_in_float64():
    # baseline_backward with no rounding at all (float32 "dtype") is lessons.attention_backward
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((n, 16)) for n in (9, 12, 12, 9))
    for causal in (False, True):
        for b, r in zip(baseline_backward(q, k, v, do, "float32", causal), textbook64(q, k, v, do, causal)):
            np.testing.assert_allclose(b, r, rtol=1e-4, atol=1e-5)


def test_rows_that_see_no_key_get_zero_gradient_and_add_nothing(backend):
    # causal with Nq > Nk: rows 0 .. Nq - Nk - 1 see no key (lse = -inf)
    nq, nk, d = 80, 20, 64
    inputs, _ = problem((), nq, nk, d, True, "float16", seed=3)
    assert np.isneginf(inputs[4][:nq - nk]).all()
    dq, dk, dv = flash_attention_backward_mma_gpu(*inputs, causal=True, backend=backend)
    assert not any(np.isnan(g.astype(np.float32)).any() for g in (dq, dk, dv))
    assert (dq[:nq - nk] == 0).all() and (dq[nq - nk:] != 0).any()
    # the same gradients with those rows removed altogether: they added nothing to dk, dv
    q, k, v, o, lse, do = inputs
    rest = [x[nq - nk:].copy() for x in (q, o, lse, do)]
    _, dk_rest, dv_rest = flash_attention_backward_mma_gpu(rest[0], k, v, rest[1], rest[2], rest[3], causal=True,
                                                           backend=backend)
    np.testing.assert_array_equal(dk, dk_rest)         # the same sums in the same order: bitwise
    np.testing.assert_array_equal(dv, dv_rest)


def test_keys_hidden_from_every_row_with_a_gradient_get_exactly_zero(backend):
    # Nq = 10, Nk = 100, causal (bottom-right): query 0 sees keys 0..90. With dO nonzero in row 0
    # only, every other row has dP = 0 and D = 0, so dS = 0: keys 91..99 receive nothing, and the
    # kernel must give them exactly 0 in dk and dv (P = 0 above the diagonal, never exp of a score)
    inputs, _ = problem((), 10, 100, 64, True, "float16", seed=4)
    q, k, v, o, lse, do = inputs
    do_first = np.zeros_like(do)
    do_first[0] = do[0]
    _, dk, dv = flash_attention_backward_mma_gpu(q, k, v, o, lse, do_first, causal=True, backend=backend)
    assert (dv[91:] == 0).all() and (dk[91:] == 0).all()
    assert (dv[:91] != 0).all(axis=1).any() and (dk[:91] != 0).any()


def test_no_queries_or_no_keys_give_zero_gradients(backend):
    rng = np.random.default_rng(5)
    k, v = (rng.standard_normal((9, 64)).astype(np.float16) for _ in range(2))
    empty_q = np.zeros((0, 64), np.float16)
    dq, dk, dv = flash_attention_backward_mma_gpu(empty_q, k, v, empty_q, np.zeros(0, np.float32), empty_q,
                                                  backend=backend)
    assert dq.shape == (0, 64) and dk.shape == (9, 64) and (dk == 0).all() and (dv == 0).all()
    q = rng.standard_normal((7, 64)).astype(np.float16)
    empty_k = np.zeros((0, 64), np.float16)
    dq, dk, dv = flash_attention_backward_mma_gpu(q, empty_k, empty_k, np.zeros_like(q),
                                                  np.full(7, -np.inf, np.float32), q, backend=backend)
    assert dq.shape == (7, 64) and (dq == 0).all() and dk.shape == (0, 64)


def test_gradients_are_bitwise_repeatable(backend):
    # dQ has its own pass (no atomics): every run sums in the same order
    inputs, _ = problem((2,), 70, 81, 64, True, "float16", seed=6)
    first = flash_attention_backward_mma_gpu(*inputs, causal=True, backend=backend)
    for _ in range(2):
        again = flash_attention_backward_mma_gpu(*inputs, causal=True, backend=backend)
        for a, b in zip(first, again):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_with_the_tensor_core_forward_output(backend):
    # the chain as it runs on a device: the tensor-core forward's o and lse feed the backward
    rng = np.random.default_rng(7)
    (q, q64), (k, k64), (v, v64), (do, do64) = (stored(rng.standard_normal((n, 64)), "float16")
                                                for n in (40, 70, 70, 40))
    o, lse = gpu.flash_attention_mma_gpu(q, k, v, causal=True, backend=backend)
    got = flash_attention_backward_mma_gpu(q, k, v, o, lse, do, causal=True, backend=backend)
    for name, g, r in zip(("dq", "dk", "dv"), got, textbook64(q64, k64, v64, do64, True)):
        assert np.abs(values(g, "float16") - r).max() <= 5e-3 * np.abs(r).max(), name


# ---------------------------------------------------------------------------
# input checks and tile sizes (no device, no compiler needed)
# ---------------------------------------------------------------------------

def _good(nq=8, nk=8, d=64, dtype=np.float16):
    rng = np.random.default_rng(0)
    q, o, do = (rng.standard_normal((nq, d)).astype(dtype) for _ in range(3))
    k, v = (rng.standard_normal((nk, d)).astype(dtype) for _ in range(2))
    return dict(q=q, k=k, v=v, o=o, lse=np.zeros(nq, np.float32), do=do)


@pytest.mark.parametrize("change, error, words", [
    (dict(lse=np.zeros(8, np.float64)), TypeError, "lse must be float32"),
    (dict(lse=np.zeros(7, np.float32)), ValueError, "lse must have shape"),
    (dict(o=np.zeros((8, 48), np.float16)), ValueError, "o must have the shape of q"),
    (dict(do=np.zeros((8, 64), np.float32)), TypeError, "do"),
    (dict(do=[[0.0] * 64] * 8), TypeError, "do must be a NumPy or CuPy array"),
    (dict(o=np.zeros((64, 8), np.float16).T), ValueError, "o must be C-contiguous"),
    (dict(k=np.zeros((8, 32), np.float16)), ValueError, "q and k must share the head dim"),
])
def test_bad_arrays_are_refused_by_name(change, error, words):
    args = {**_good(), **change}
    with pytest.raises(error, match=words):
        flash_attention_backward_mma_gpu(*args.values(), backend="emulator")


def test_float32_is_refused_with_the_alternative():
    with pytest.raises(TypeError, match="takes float16 .* use flash_attention_backward_gpu"):
        flash_attention_backward_mma_gpu(*_good(dtype=np.float32).values(), backend="emulator")


@pytest.mark.parametrize("d", [16, 32, 80, 96, 256])
def test_head_dims_other_than_64_and_128_are_refused(d):
    with pytest.raises(ValueError, match=f"head_dim must be 64 or 128 for the tensor-core backward, got {d}"):
        flash_attention_backward_mma_gpu(*_good(d=d).values(), backend="emulator")


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
    (dict(scale="0.1"), TypeError, "scale"),
])
def test_bad_options_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        flash_attention_backward_mma_gpu(*_good().values(), **{"backend": "emulator", **kwargs})


def test_tile_sizes_and_their_shared_memory():
    # by hand, d = 64: K, V 2 * 64 * 72 halves, Q, dO 2 * 64 * 72 halves, L and D 2 * 64 floats
    #   -> 2 * (9216 + 9216) + 512 = 37376 bytes; the dQ kernel: K, V 2 * 64 * 72 halves = 18432
    assert source.flash_attention_backward_mma_smem_bytes(64, 64, 64) == {
        "flash_attention_backward_mma_dkdv": 37376, "flash_attention_backward_mma_dq": 18432}
    # d = 128: 32 query rows would need 2 * 2 * 96 * 136 + 256 = 52480 > 49152 bytes
    assert source.flash_attention_backward_mma_config(64) == (64, 64)
    assert source.flash_attention_backward_mma_config(128) == (16, 64)
    with pytest.raises(ValueError, match="needs 52480 bytes of shared memory"):
        source.flash_attention_backward_mma_config(128, 32, 32)
    with pytest.raises(ValueError, match="dq_block_k must be a multiple of 16"):
        source.flash_attention_backward_mma_config(64, 64, 24)
    with pytest.raises(ValueError, match="takes dtype float16 or bfloat16"):
        source.flash_attention_backward_mma_build(64, "float32")
    build = source.flash_attention_backward_mma_build(128, "bfloat16")
    assert build.describe() == "flash_attention_backward_mma bfloat16 DKDV_BLOCK_Q=16 DQ_BLOCK_K=64 HEAD_DIM=128"
    assert build.entry_smem_bytes("flash_attention_backward_mma_dkdv") == 2 * 2 * 80 * 136 + 2 * 4 * 16
    assert build.smem_bytes == build.entry_smem_bytes("flash_attention_backward_mma_dkdv")


# ---------------------------------------------------------------------------
# NVRTC: every build compiles for sm_80 and sm_90, without spills, with mma.sync in its PTX
# ---------------------------------------------------------------------------

COMPILE_BUILDS = [source.flash_attention_backward_mma_build(d, dtype)
                  for d in (64, 128) for dtype in ("float16", "bfloat16")]


@pytest.mark.parametrize("build", COMPILE_BUILDS, ids=lambda b: b.describe())
def test_nvrtc_compiles_for_sm80_and_sm90_without_spills(build):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy/NVRTC not installed")
    rows = gpu.compile_report(("sm_80", "sm_90"), builds=[build])
    assert sorted((r.entry, r.arch) for r in rows) == sorted((e, a) for e in ENTRIES for a in ("sm_80", "sm_90"))
    for r in rows:
        assert 1 <= r.registers <= 255, r
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, r
        assert r.smem_bytes == build.entry_smem_bytes(r.entry), r


@pytest.mark.parametrize("dtype, suffix", [("float16", "f32.f16.f16.f32"), ("bfloat16", "f32.bf16.bf16.f32")])
def test_ptx_holds_the_tensor_core_instruction(dtype, suffix):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy/NVRTC not installed")
    from lessons.gpu.compile import compile_ptx

    ptx = compile_ptx(source.flash_attention_backward_mma_build(64, dtype), "sm_90")
    bodies = {e: ptx.split(f".entry {e}(")[1].split(".entry")[0] for e in ENTRIES}
    # d = 64, one 16-query slice of the dK/dV kernel (its loop is not unrolled): S^T, dP^T
    # (4 d-slices x 2 tiles each), dV, dK (8 tiles each) -> 32;
    # dQ, one 16-key slice (likewise): S, dP (4 d-slices x 2 tiles each), dQ (8 tiles) -> 24
    assert bodies["flash_attention_backward_mma_dkdv"].count(f"mma.sync.aligned.m16n8k16.row.col.{suffix}") == 32
    assert bodies["flash_attention_backward_mma_dq"].count(f"mma.sync.aligned.m16n8k16.row.col.{suffix}") == 24
    # B fragments by ldmatrix: K^T-like operands as stored, dO, Q and K as B = M by .trans
    for body in bodies.values():
        assert "ldmatrix.sync.aligned.m8n8.x2.shared.b16" in body
        assert "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" in body
    assert not re.search(r"^\s*(atom|red)\.", ptx, re.MULTILINE)     # no atomics: bitwise repeatable


# ---------------------------------------------------------------------------
# on a device only
# ---------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("n, d, dtype", [(1000, 64, "float16"), (777, 128, "bfloat16"), (1024, 128, "float16")])
def test_larger_problems_on_the_gpu(n, d, dtype):
    for causal in (False, True):
        inputs, exact = problem((2,), n, n + 13, d, causal, dtype, seed=n + d)
        got = flash_attention_backward_mma_gpu(*inputs, causal=causal, bfloat16=dtype == "bfloat16")
        assert_like_a_framework(got, exact, dtype, causal)


@gpu_only
def test_cupy_inputs_give_cupy_outputs():
    import cupy

    inputs, exact = problem((2,), 130, 130, 64, True, "float16", seed=10)
    got = flash_attention_backward_mma_gpu(*(cupy.asarray(x) for x in inputs), causal=True)
    assert all(isinstance(g, cupy.ndarray) for g in got)
    assert_like_a_framework(got, exact, "float16", True)


@gpu_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_agrees_with_torch_scaled_dot_product_attention_backward(causal, d):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA")
    import cupy

    rng = np.random.default_rng(11)
    heads, n = 4, 512
    q, k, v, do = (rng.standard_normal((heads, n, d)).astype(np.float16) for _ in range(4))
    tq, tk, tv = (torch.tensor(x, device="cuda", requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    out.backward(torch.tensor(do, device="cuda"))
    q_d, k_d, v_d, do_d = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = gpu.flash_attention_mma_gpu(q_d, k_d, v_d, causal=causal)
    dq, dk, dv = flash_attention_backward_mma_gpu(q_d, k_d, v_d, o, lse, do_d, causal=causal)
    exact = textbook64(*(x.astype(np.float64) for x in (q, k, v, do)), causal)
    assert_agrees_with_torch((dq, dk, dv), (tq.grad, tk.grad, tv.grad), exact)


# ---------------------------------------------------------------------------
# benchmarks/gpu_backward.py, impl "mma": what runs without a GPU
# ---------------------------------------------------------------------------

def test_benchmark_times_the_tensor_core_backward_and_notes_its_difference():
    bench = _benchmark_module()
    assert "mma" in bench.IMPLS
    # by hand: dq differs by 0.01 where max |dq| is 2, dk not at all, dv by 0.5 of 4
    kernel = [np.array([[2.0, -1.0]]), np.array([[1.0, 1.0]]), np.array([[4.0, 0.0]])]
    mma = [np.array([[2.01, -1.0]]), np.array([[1.0, 1.0]]), np.array([[4.0, 0.5]])]
    assert bench.mma_difference(np, mma, kernel) == "vs kernel: dq 5.0e-03, dk 0.0e+00, dv 1.2e-01"

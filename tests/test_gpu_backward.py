"""The backward kernels (lessons/gpu/kernels/flash_attention_backward.cu) against NumPy.

Each numerical test runs on the CPU emulator (the same CUDA C on the CPU, with guard
zones around every buffer) and, where there is one, on a CUDA device. References:

* :func:`lessons.attention_backward` in float64 on the very values the kernel stores (the
  textbook gradient, P materialised) is the truth;
* the same NumPy code in the kernel's precision (float32 arithmetic, the result rounded to the
  storage dtype, as the kernel does) sets the bar: the kernel's largest error against float64
  must be at most twice NumPy's, plus a floor of 1e-8 of the gradient's size (NumPy's error
  includes the rounding of the o and lse both receive);
* :func:`lessons.flash_attention_backward` with ``return_trace=True`` gives the running
  ``dK_j``, ``dV_j`` after each query block, which the kernel's trace build must reproduce.

NVRTC compiles every build for sm_80 and sm_90 without a GPU; the compile report must show no
spills and the shared memory the tile formula gives.
"""
import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.gpu import source
from lessons.gpu.backward import GpuBackwardTrace, flash_attention_backward_gpu

NO_DEVICE = "no CUDA device: the same cases run on the CPU under the 'emulator' backend"
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(),
                                                      reason="no C++ compiler (g++) for the CPU emulation")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)),
]
gpu_only = pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)
EPS32 = float(np.finfo(np.float32).eps)
FLOOR = 1e-8          # relative to max |gradient|, below float32 rounding: only matters where NumPy is exact


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


def problem(lead, nq, nk, d, causal, dtype, seed, scale=None):
    """Stored inputs (q, k, v, o, lse, do) for the kernel, and the float64 values of q, k, v, do.

    o and lse come from the float64 forward on the stored q, k, v; o is then stored in ``dtype``
    and lse in float32, as a forward kernel hands them over."""
    rng = np.random.default_rng(seed)
    (q, q64), (k, k64), (v, v64), (do, do64) = (stored(rng.standard_normal((*lead, n, d)), dtype)
                                                for n in (nq, nk, nk, nq))
    o64, lse64 = np.zeros((*lead, nq, d)), np.zeros((*lead, nq))
    for idx in np.ndindex(*lead):
        o64[idx], lse64[idx] = lessons.attention(q64[idx], k64[idx], v64[idx], scale=scale, causal=causal,
                                                 return_lse=True)
    o, _ = stored(o64, dtype)
    return (q, k, v, o, lse64.astype(np.float32), do), (q64, k64, v64, do64)


def per_head(fn, lead, *arrays):
    """fn(*arrays[idx]) for every leading index, stacked into three arrays."""
    outs = None
    for idx in np.ndindex(*lead):
        res = fn(*(a[idx] for a in arrays))
        if outs is None:
            outs = [np.zeros((*lead, *r.shape)) for r in res]
        for o, r in zip(outs, res):
            o[idx] = r
    return outs


def textbook64(lead, q64, k64, v64, do64, causal, scale=None):
    return per_head(lambda q, k, v, do: lessons.attention_backward(q, k, v, do, scale=scale, causal=causal),
                    lead, q64, k64, v64, do64)


def numpy_in_precision(lead, inputs, dtype, causal, scale=None):
    """NumPy's gradients as the kernel computes them: float32 arithmetic on the stored inputs
    (o and lse included), rounded to the storage dtype at the end."""
    q, k, v, o, lse, do = inputs
    q, k, v, o, do = (values(x, dtype).astype(np.float32) for x in (q, k, v, o, do))

    def one(q, k, v, o, lse, do):
        return lessons.flash_attention_backward(q, k, v, o, lse, do, scale=scale, causal=causal)

    grads = per_head(one, lead, q, k, v, o, lse, do)
    rounded = []
    for g in grads:
        if dtype == "bfloat16":
            rounded.append(gpu.from_bfloat16_bits(gpu.to_bfloat16_bits(g.astype(np.float32))).astype(np.float64))
        else:
            rounded.append(g.astype(dtype).astype(np.float64))
    return rounded


def assert_within_twice_numpy(got, ref64, numpy_grads, names=("dq", "dk", "dv"), *, terms=1, cancel=0.0):
    """Each gradient's error <= 2 x NumPy's same-precision error + a floor of float32's resolution:
    ``FLOOR`` relative, grown by sqrt(terms) for a gradient the kernel sums over ``terms`` rows or
    keys one after another (tests/kernel_tolerance.py says why a real GPU needs it), and at least
    ``cancel``, the rounding of the terms themselves where they cancel to a gradient far smaller
    than they are."""
    for name, g, r, n in zip(names, got, ref64, numpy_grads):
        assert not np.isnan(g).any(), name
        size = np.abs(r).max() if r.size else 0.0
        kernel_err = np.abs(g - r).max() if r.size else 0.0
        numpy_err = np.abs(n - r).max() if r.size else 0.0
        floor = max(size * (FLOOR + 2 * EPS32 * np.sqrt(terms) * (terms > 1)), cancel)
        assert kernel_err <= 2 * numpy_err + floor, (
            f"{name}: kernel error {kernel_err:.3g} > 2 x NumPy's {numpy_err:.3g} + floor {floor:.3g} "
            f"(max |{name}| {size:.3g})")


BACKWARD_CASES = [
    # lead, Nq, Nk, d, causal, dtype, block_q, block_k                  what it covers
    pytest.param((), 37, 50, 16, False, "float32", None, None, id="d16-N-not-a-multiple-of-the-blocks"),
    pytest.param((), 50, 37, 64, True, "float32", None, None, id="d64-causal-Nq>Nk-empty-rows"),
    pytest.param((2,), 33, 70, 128, True, "float32", None, None, id="d128-causal-Nq<Nk-two-heads"),
    pytest.param((), 45, 45, 64, False, "float16", None, None, id="fp16-d64"),
    pytest.param((1, 2), 17, 40, 16, True, "float16", None, None, id="fp16-d16-causal-batch-heads"),
    pytest.param((), 20, 53, 128, True, "bfloat16", None, None, id="bf16-d128-causal"),
    pytest.param((), 40, 29, 64, True, "float32", 8, 16, id="small-blocks-causal"),
    pytest.param((), 29, 40, 16, False, "float32", 128, 4, id="tall-blocks"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype, block_q, block_k", BACKWARD_CASES)
def test_backward_within_twice_numpy_error_of_float64(backend, lead, nq, nk, d, causal, dtype, block_q, block_k):
    inputs, exact = problem(lead, nq, nk, d, causal, dtype, seed=nq * 1000 + nk + d)
    got = flash_attention_backward_gpu(*inputs, causal=causal, block_q=block_q, block_k=block_k,
                                       bfloat16=dtype == "bfloat16", backend=backend)
    for g, x in zip(got, inputs[:3]):
        assert g.shape == x.shape and g.dtype == x.dtype
    ref64 = textbook64(lead, *exact, causal)
    assert_within_twice_numpy([values(g, dtype) for g in got], ref64, numpy_in_precision(lead, inputs, dtype, causal))


def test_rows_that_see_no_key_get_zero_gradient_and_add_nothing(backend):
    # causal with Nq > Nk: rows 0 .. Nq - Nk - 1 see no key (lse = -inf)
    nq, nk, d = 40, 12, 16
    inputs, exact = problem((), nq, nk, d, True, "float32", seed=3)
    assert np.isneginf(inputs[4][:nq - nk]).all()
    dq, dk, dv = flash_attention_backward_gpu(*inputs, causal=True, backend=backend)
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    assert (dq[:nq - nk] == 0).all() and (dq[nq - nk:] != 0).any()
    # the same gradients with those rows removed altogether: they added nothing to dk, dv
    q, k, v, o, lse, do = inputs
    _, dk_rest, dv_rest = flash_attention_backward_gpu(q[nq - nk:].copy(), k, v, o[nq - nk:].copy(),
                                                       lse[nq - nk:].copy(), do[nq - nk:].copy(), causal=True,
                                                       backend=backend)
    np.testing.assert_allclose(dk, dk_rest, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dv, dv_rest, rtol=1e-6, atol=1e-7)


def test_no_queries_or_no_keys_give_zero_gradients(backend):
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((9, 16)).astype(np.float32) for _ in range(2))
    empty_q = np.zeros((0, 16), np.float32)
    dq, dk, dv = flash_attention_backward_gpu(empty_q, k, v, empty_q, np.zeros(0, np.float32), empty_q,
                                              backend=backend)
    assert dq.shape == (0, 16) and (dk == 0).all() and (dv == 0).all() and dk.shape == (9, 16)
    q = rng.standard_normal((7, 16)).astype(np.float32)
    empty_k = np.zeros((0, 16), np.float32)
    dq, dk, dv = flash_attention_backward_gpu(q, empty_k, empty_k, np.zeros_like(q),
                                              np.full(7, -np.inf, np.float32), q, backend=backend)
    assert (dq == 0).all() and dq.shape == (7, 16) and dk.shape == (0, 16)


def test_large_scores_stay_finite_and_correct(backend):
    # |s| up to ~1e3: exp(S - L) must be taken against the stored L, never exp(S) alone (it would
    # overflow). Integer q, k and a power-of-two scale make every score exact in float32, so the
    # comparison sees how P is recomputed, not in which order a dot product was summed.
    rng = np.random.default_rng(5)
    n, d, scale = 30, 64, 8.0
    q, k = (rng.integers(-3, 4, (n, d)).astype(np.float32) for _ in range(2))
    v, do = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(2))
    o64, lse64 = lessons.attention(*(x.astype(np.float64) for x in (q, k, v)), scale=scale, causal=True,
                                   return_lse=True)
    inputs = (q, k, v, o64.astype(np.float32), lse64.astype(np.float32), do)
    assert np.abs(scale * q @ k.T).max() > 500
    got = flash_attention_backward_gpu(*inputs, causal=True, scale=scale, backend=backend)
    ref64 = textbook64((), *(x.astype(np.float64) for x in (q, k, v, do)), True, scale=scale)
    # P is nearly one-hot here, so dS = P (dP - D) is a difference of two numbers of size |dO||V|
    # that almost cancel: dq and dk are tiny, and their error is the rounding of those dot
    # products (about eps |dO| |V|), times scale and |K| or |Q|
    terms = np.linalg.norm(do, axis=1).max() * np.linalg.norm(v, axis=1).max()
    cancel = 2 * EPS32 * terms * scale * max(np.abs(q).max(), np.abs(k).max())
    assert_within_twice_numpy(got, ref64, numpy_in_precision((), inputs, "float32", True, scale=scale),
                              cancel=cancel)


@pytest.mark.parametrize("causal", [False, True])
def test_trace_replays_the_numpy_schedule_key_block_by_key_block(backend, causal):
    nq, nk, d, bq, bk = 45, 40, 16, 16, 16        # 3 query blocks, 3 key blocks (the last one short)
    inputs, _ = problem((), nq, nk, d, causal, "float32", seed=6)
    q, k, v, o, lse, do = inputs
    *_, ref_trace = lessons.flash_attention_backward(q.astype(np.float64), k.astype(np.float64),
                                                     v.astype(np.float64), o.astype(np.float64),
                                                     lse.astype(np.float64), do.astype(np.float64),
                                                     block_q=bq, block_k=bk, causal=causal, return_trace=True)
    for j in range(3):
        dq, dk, dv, trace = flash_attention_backward_gpu(*inputs, causal=causal, block_q=bq, block_k=bk,
                                                         trace_block=j, backend=backend)
        assert isinstance(trace, GpuBackwardTrace) and trace.key_block == j
        np.testing.assert_array_equal(trace.keys, np.arange(j * bk, min((j + 1) * bk, nk)))
        steps = {s.query_block: s for s in ref_trace.steps if s.key_block == j}
        np.testing.assert_array_equal(np.flatnonzero(trace.visited), sorted(steps))
        if causal and j == 2:
            assert not trace.visited[0]                      # a skipped tile: wholly above the diagonal
        for i, step in steps.items():
            np.testing.assert_allclose(trace.dk[i], step.dk, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(trace.dv[i], step.dv, rtol=1e-5, atol=1e-6)
        last = max(steps)
        np.testing.assert_array_equal(trace.dk[last], dk[trace.keys])      # the last step is the output
        np.testing.assert_array_equal(trace.dv[last], dv[trace.keys])
        errors = trace.errors(ref_trace)                                    # the same, as the lesson reads it
        np.testing.assert_array_equal(errors[:, 0], sorted(steps))
        assert errors[:, 1:].max() < 1e-5 * max(np.abs(dk).max(), np.abs(dv).max())


def test_trace_comparison_names_a_wrong_schedule():
    # hand-made: key block 0 of 2 query blocks, the kernel "absorbed" only the second
    dk = np.full((2, 3, 4), np.nan, np.float32)
    dk[1] = 1.0
    trace = GpuBackwardTrace(0, 4, 4, np.arange(3), dk, dk.copy())
    q, k, v, do = (np.ones((8, 4)) for _ in range(4))
    o, lse = lessons.attention(q, k[:3], v[:3], return_lse=True)
    *_, ref = lessons.flash_attention_backward(q, k[:3], v[:3], o, lse, do, block_q=4, block_k=4, return_trace=True)
    with pytest.raises(ValueError, match=r"absorbed query blocks \[1\], NumPy \[0, 1\]"):
        trace.errors(ref)
    *_, other = lessons.flash_attention_backward(q, k[:3], v[:3], o, lse, do, block_q=8, block_k=4, return_trace=True)
    with pytest.raises(ValueError, match="block_q, block_k = 8, 4"):
        trace.errors(other)


def test_trace_covers_every_head(backend):
    inputs, _ = problem((2,), 20, 20, 16, False, "float32", seed=7)
    dq, dk, dv, trace = flash_attention_backward_gpu(*inputs, trace_block=0, block_q=8, block_k=16, backend=backend)
    assert trace.dk.shape == (2, 3, 16, 16) and trace.visited.all()
    for h in range(2):
        np.testing.assert_array_equal(trace.dk[h, -1], dk[h, :16])
        np.testing.assert_array_equal(trace.dv[h, -1], dv[h, :16])
        assert not np.array_equal(trace.dv[h, 0], trace.dv[h, 1])    # it does accumulate
    with pytest.raises(ValueError, match="head must index all 1 leading dims"):
        trace.errors(lessons.flash_attention_backward(*(x[0].astype(np.float64) for x in inputs), block_q=8,
                                                      block_k=16, return_trace=True)[-1])


def test_gradients_are_bitwise_repeatable(backend):
    # dQ has its own pass (no atomics): every run sums in the same order
    inputs, _ = problem((2,), 50, 61, 64, True, "float16", seed=8)
    first = flash_attention_backward_gpu(*inputs, causal=True, backend=backend)
    for _ in range(2):
        again = flash_attention_backward_gpu(*inputs, causal=True, backend=backend)
        for a, b in zip(first, again):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_with_the_forward_kernel_output(backend):
    # the chain as it runs on a device: the forward kernel's o and lse feed the backward kernels
    rng = np.random.default_rng(9)
    (q, q64), (k, k64), (v, v64), (do, do64) = (stored(rng.standard_normal((n, 64)), "float32")
                                                for n in (33, 47, 47, 33))
    o, lse = gpu.flash_attention_gpu(q, k, v, causal=True, backend=backend)
    dq, dk, dv = flash_attention_backward_gpu(q, k, v, o, lse, do, causal=True, backend=backend)
    for got, ref in zip((dq, dk, dv), lessons.attention_backward(q64, k64, v64, do64, causal=True)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------
# input checks (no device, no compiler needed)
# ---------------------------------------------------------------------------

def _good(nq=8, nk=8, d=16, dtype=np.float32):
    rng = np.random.default_rng(0)
    q, o, do = (rng.standard_normal((nq, d)).astype(dtype) for _ in range(3))
    k, v = (rng.standard_normal((nk, d)).astype(dtype) for _ in range(2))
    return dict(q=q, k=k, v=v, o=o, lse=np.zeros(nq, np.float32), do=do)


@pytest.mark.parametrize("change, error, words", [
    (dict(lse=np.zeros(8, np.float64)), TypeError, "lse must be float32"),
    (dict(lse=np.zeros(7, np.float32)), ValueError, "lse must have shape"),
    (dict(o=np.zeros((8, 15), np.float32)), ValueError, "o must have the shape of q"),
    (dict(do=np.zeros((8, 16), np.float16)), TypeError, "do"),
    (dict(do=[[0.0] * 16] * 8), TypeError, "do must be a NumPy or CuPy array"),
    (dict(o=np.zeros((16, 8), np.float32).T), ValueError, "o must be C-contiguous"),
])
def test_bad_arrays_are_refused_by_name(change, error, words):
    args = {**_good(), **change}
    with pytest.raises(error, match=words):
        flash_attention_backward_gpu(args["q"], args["k"], args["v"], args["o"], args["lse"], args["do"],
                                     backend="emulator")


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(block_q=3), ValueError, "block_q must be one of"),
    (dict(block_q=4, block_k=4), ValueError, "block_q \\* block_k must be in"),
    (dict(block_q=128, block_k=128), ValueError, "block_q \\* block_k must be in"),
    (dict(trace_block=1), ValueError, "trace_block must be in \\[0, 1\\)"),
    (dict(trace_block=True), TypeError, "trace_block must be an int"),
    (dict(causal=1), TypeError, "causal must be True or False"),
    (dict(backend="gpu"), ValueError, "backend must be one of"),
])
def test_bad_options_are_refused_by_name(kwargs, error, words):
    args = _good()
    with pytest.raises(error, match=words):
        flash_attention_backward_gpu(*args.values(), **{"backend": "emulator", **kwargs})


def test_head_dims_above_128_are_refused_with_the_reason():
    args = _good(d=160)
    with pytest.raises(ValueError, match="head_dim must be in 1..128 for the backward"):
        flash_attention_backward_gpu(*args.values(), backend="emulator")


@pytest.mark.parametrize("d, block_q, block_k", [(128, 32, 16), (64, 64, 32), (100, 32, 32)])
def test_tiles_that_overflow_shared_memory_are_refused(d, block_q, block_k):
    smem = max(source.flash_attention_backward_smem_bytes(d, block_q, block_k).values())
    assert smem > source.STATIC_SMEM_LIMIT
    with pytest.raises(ValueError, match=f"need {smem} bytes of shared memory"):
        source.flash_attention_backward_config(d, block_q, block_k)


def test_default_tiles_are_the_largest_preferred_that_fit():
    # by hand: d = 64, block_q = block_k = 32: K, V, Q, dO tiles 4 * 32 * 65 floats, P and dS
    # 2 * 32 * 33, L and D 2 * 32  ->  4 * (8320 + 2112 + 64) = 41984 bytes (<= 49152);
    # (32, 64) would need 4 * (96 * 2 * 65 + 2 * 64 * 33 + 64) = 67072
    assert source.flash_attention_backward_smem_bytes(64, 32, 32)["flash_attention_backward_dkdv"] == 41984
    assert source.flash_attention_backward_smem_bytes(64, 32, 64)["flash_attention_backward_dkdv"] == 67072
    assert [source.flash_attention_backward_config(d) for d in (16, 40, 41, 64, 78, 79, 112, 113, 128)] == [
        (32, 64), (32, 64), (32, 32), (32, 32), (32, 32), (16, 32), (16, 32), (16, 16), (16, 16)]
    prefs = source.BACKWARD_TILE_PREFERENCE
    for d in range(1, 129):
        chosen = source.flash_attention_backward_config(d)
        assert max(source.flash_attention_backward_smem_bytes(d, *chosen).values()) <= source.STATIC_SMEM_LIMIT
        for earlier in prefs[:prefs.index(chosen)]:          # every larger preference does not fit
            with pytest.raises(ValueError, match="bytes of shared memory|accumulators"):
                source.flash_attention_backward_config(d, *earlier)
    assert source.flash_attention_backward_config(32, block_k=64) == (16, 64)
    # d = 113 with block_k = 32: 4 lanes per key, 29 columns each of dK and dV -> 58 > 56
    with pytest.raises(ValueError, match="58 dK/dV accumulators"):
        source.flash_attention_backward_config(113, 16, 32)


# ---------------------------------------------------------------------------
# NVRTC: every build compiles for sm_80 and sm_90, without spills
# ---------------------------------------------------------------------------

COMPILE_BUILDS = [source.flash_attention_backward_build(d, dtype, trace)
                  for d in (16, 64, 128) for dtype in ("float32", "float16", "bfloat16")
                  for trace in ((False, True) if dtype == "float32" else (False,))] + [
    source.flash_attention_backward_build(1, "float32"), source.flash_attention_backward_build(40, "float16"),
    source.flash_attention_backward_build(78, "float16"), source.flash_attention_backward_build(112, "float16"),
    source.flash_attention_backward_build(64, "float32", block_q=8, block_k=16),
    source.flash_attention_backward_build(16, "float32", block_q=128, block_k=4)]


@pytest.mark.parametrize("build", COMPILE_BUILDS, ids=lambda b: b.describe())
def test_nvrtc_compiles_for_sm80_and_sm90_without_spills(build):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="CuPy/NVRTC not installed")
    rows = gpu.compile_report(("sm_80", "sm_90"), builds=[build])
    assert sorted((r.entry, r.arch) for r in rows) == sorted(
        (e, a) for e in source.KERNELS["flash_attention_backward"] for a in ("sm_80", "sm_90"))
    for r in rows:
        assert 1 <= r.registers <= 255, r
        assert r.spill_store_bytes == 0 and r.spill_load_bytes == 0, r
        assert r.smem_bytes == build.entry_smem_bytes(r.entry), r


# ---------------------------------------------------------------------------
# on a device only
# ---------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("n, d, dtype", [(1000, 64, "float16"), (777, 128, "bfloat16"), (1024, 16, "float32")])
def test_larger_problems_on_the_gpu(n, d, dtype):
    for causal in (False, True):
        inputs, exact = problem((2,), n, n + 13, d, causal, dtype, seed=n + d)
        got = flash_attention_backward_gpu(*inputs, causal=causal, bfloat16=dtype == "bfloat16")
        assert_within_twice_numpy([values(g, dtype) for g in got], textbook64((2,), *exact, causal),
                                  numpy_in_precision((2,), inputs, dtype, causal), terms=n + 13)


@gpu_only
def test_cupy_inputs_give_cupy_outputs():
    import cupy

    inputs, exact = problem((2,), 130, 130, 64, True, "float16", seed=10)
    got = flash_attention_backward_gpu(*(cupy.asarray(x) for x in inputs), causal=True)
    assert all(isinstance(g, cupy.ndarray) for g in got)
    assert_within_twice_numpy([values(g, "float16") for g in got], textbook64((2,), *exact, True),
                              numpy_in_precision((2,), inputs, "float16", True))


def assert_agrees_with_torch(grads, torch_grads, exact):
    """The kernel's fp16 (dq, dk, dv) (CuPy) against torch SDPA's (CUDA tensors) and the float64
    gradients ``exact``: both are fp16 gradients of the same function, each within a few fp16
    ulps of float64, so within that of each other; ours at most 2x torch's error (+ a floor)."""
    for name, ours, theirs, ref in zip(("dq", "dk", "dv"), grads, torch_grads, exact):
        ours = ours.get().astype(np.float64)
        theirs = theirs.detach().cpu().numpy().astype(np.float64)
        size = np.abs(ref).max()
        assert np.abs(ours - theirs).max() <= 1e-2 * size, name
        assert np.abs(ours - ref).max() <= 2 * np.abs(theirs - ref).max() + 1e-3 * size, name


@gpu_only
@pytest.mark.parametrize("causal", [False, True])
def test_agrees_with_torch_scaled_dot_product_attention_backward(causal):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch was built without CUDA")
    import cupy

    rng = np.random.default_rng(11)
    heads, n, d = 4, 512, 64
    q, k, v, do = (rng.standard_normal((heads, n, d)).astype(np.float16) for _ in range(4))
    tq, tk, tv = (torch.tensor(x, device="cuda", requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    out.backward(torch.tensor(do, device="cuda"))
    o, lse = gpu.flash_attention_gpu(*(cupy.asarray(x) for x in (q, k, v)), causal=causal)
    dq, dk, dv = flash_attention_backward_gpu(*(cupy.asarray(x) for x in (q, k, v)), o, lse, cupy.asarray(do),
                                              causal=causal)
    exact = textbook64((heads,), *(x.astype(np.float64) for x in (q, k, v, do)), causal)
    assert_agrees_with_torch((dq, dk, dv), (tq.grad, tk.grad, tv.grad), exact)


# ---------------------------------------------------------------------------
# benchmarks/gpu_backward.py: what runs without a GPU
# ---------------------------------------------------------------------------

def _benchmark_module():
    """``benchmarks/gpu_backward.py`` loaded as a module (it is a script, not part of a package);
    tests/test_gpu_backward_mma.py imports this helper too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_backward.py"
    spec = importlib.util.spec_from_file_location("gpu_backward_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize("causal", [False, True])
def test_benchmark_naive_backward_is_the_textbook_gradient(causal):
    # the naive baseline, run with NumPy as its array module, against lessons.attention_backward
    bench = _benchmark_module()
    rng = np.random.default_rng(12)
    q, do = (rng.standard_normal((2, 20, 16)) for _ in range(2))
    k, v = (rng.standard_normal((2, 28, 16)) for _ in range(2))
    got = bench.naive_backward(np, q, k, v, do, causal)
    ref = textbook64((2,), q, k, v, do, causal)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)     # float32 arithmetic inside


def test_benchmark_writes_its_table_and_plot_from_rows(tmp_path):
    """The writer on hand-made rows (the timings themselves need a GPU)."""
    bench = _benchmark_module()
    rows = []
    for impl in bench.IMPLS:
        for n in (1024, 2048):
            seconds = None if impl == "torch" else 1e-3 * (n / 1024) ** 2 / (1 + bench.IMPLS.index(impl))
            rows.append(dict(impl=impl, n=n, d=64, heads=8, causal=False, dtype="float16", seconds=seconds,
                             tflops=None if seconds is None else bench.backward_flops(n, 64, 8, False) / seconds / 1e12,
                             peak_bytes=None if seconds is None else (n * n * 4 * 8 * 3 if impl == "naive" else n * 1024),
                             note="skipped: torch is not installed" if seconds is None else ""))
    bench.write_results(rows, tmp_path, dict(device="test device", heads=8, causal=False))
    table = (tmp_path / "results.md").read_text()
    assert "attention backward, test device" in table and "skipped: torch is not installed" in table
    assert (tmp_path / "gpu_backward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list(csv_rows(tmp_path / "results.csv"))) == len(rows)
    # 10 N^2 d flops per head: N = 1024, d = 64, 8 heads in 1 ms is 5.37 TFLOP/s
    assert rows[0]["tflops"] == pytest.approx(10 * 1024**2 * 64 * 8 / 1e-3 / 1e12)
    assert bench.backward_flops(1024, 64, 8, True) == 5 * 1024**2 * 64 * 8
    line = bench.format_row(rows[0])
    assert line.split()[:2] == ["naive", "float16"] and "5.37 TFLOP/s" in line and "96.0 MiB" in line


def csv_rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.skipif(gpu.device_available(), reason="checks what the benchmark says without a device")
def test_benchmark_without_a_device_says_so(capsys, tmp_path):
    assert _benchmark_module().main(["--out", str(tmp_path / "out")]) == 0
    assert "GPU benchmark not run: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()

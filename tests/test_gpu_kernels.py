"""Every CUDA kernel against the NumPy reference.

Each test runs on two backends:

* ``cupy`` - the kernel on a CUDA device. Without one these cases are skipped, and the
  skip says so; ``scripts/gpu_check.sh`` runs them on a GPU machine.
* ``emulator`` - the very same CUDA C on the CPU (:mod:`lessons.gpu.emulator`), with
  guard zones around every buffer and blocks run last-first. It checks the kernels'
  indexing, bounds, barriers and -inf handling on any machine with g++.

References: :func:`lessons.attention` (textbook softmax attention) per head or per
sequence and head, :func:`lessons.flash_attention` for traces, :func:`lessons.merge`
for the flash-decoding reduction.

Tolerances are not picked by hand: a kernel's error against the float64 reference may be
at most twice that of the same formula computed in the kernel's own dtype
(FlashAttention's test rule, ``tests/kernel_tolerance.py``).
"""
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.gpu import ladder
from lessons.core.state import State, correction_factor, merge
from kernel_tolerance import assert_within_baseline, baseline_attention, round_to

NO_DEVICE = ("no CUDA device: the kernels are compiled by tests/test_gpu_compile.py but cannot run here; "
             "the same cases run on the CPU under the 'emulator' backend")
BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(),
                                                      reason="no C++ compiler (g++) for the CPU emulation")),
    pytest.param("cupy", marks=pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)),
]
gpu_only = pytest.mark.skipif(not gpu.device_available(), reason=NO_DEVICE)
#: the rungs scripts/gpu_check.sh left out after their first run on this machine (scripts/first_run.py failed,
#: hung or could not run them): their GPU cases are skipped, their emulator cases run
LEFT_OUT = ladder.rungs_left_out()


def on_gpu(rung: str):
    """A mark for a GPU case of ``rung``: skipped without a device, and where gpu_check.sh left the rung out
    (it is in GPU_CHECK_LEFT_OUT)."""
    if rung in LEFT_OUT:
        return pytest.mark.skip(reason=f"the {rung} rung {ladder.LEFT_OUT_REASON} (GPU_CHECK_LEFT_OUT)")
    return gpu_only


def skip_left_out(backend: str, *rungs: str) -> None:
    """On a GPU (``backend`` "cupy"), skip a test of rungs that gpu_check.sh left out after their first run."""
    out = sorted(LEFT_OUT & set(rungs))
    if backend == "cupy" and out:
        pytest.skip(f"{', '.join(out)}: {ladder.LEFT_OUT_REASON} (GPU_CHECK_LEFT_OUT)")

TRACE_TOL = dict(rtol=2e-5, atol=1e-6)


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


def values(out, dtype):
    """Kernel output as float64 (decoding bfloat16 bits)."""
    out = out.get() if hasattr(out, "get") else out
    return (gpu.from_bfloat16_bits(out) if dtype == "bfloat16" else out).astype(np.float64)


def assert_attention_close(out, lse, q64, k64, v64, dtype, *, causal=False, scale=None):
    """out and lse of a kernel against float64 attention, within FlashAttention's rule:
    at most twice the error of the same attention computed in ``dtype`` (kernel_tolerance)."""
    ref, ref_lse = flash_reference(q64, k64, v64, causal, scale)
    base, base_lse = baseline_attention(q64, k64, v64, dtype, causal=causal, scale=scale)
    assert_within_baseline(values(out, dtype), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


# ---------------------------------------------------------------------------
# flash attention forward
# ---------------------------------------------------------------------------

def assert_same_nan_rows(out, lse, ref, ref_lse, base, base_lse):
    """The kernel's NaN rows are the reference's, and the other rows agree with it within
    twice the error of the same-dtype baseline (``base``, ``base_lse``)."""
    out = np.asarray(out, dtype=np.float64)
    bad = np.isnan(ref_lse)
    assert bad.any() and not bad.all()
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), bad)
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), bad)
    assert_within_baseline(out, ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


def flash_reference(q, k, v, causal, scale=None):
    lead = q.shape[:-2]
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:-1])
    for idx in np.ndindex(*lead):
        out[idx], lse[idx] = lessons.attention(q[idx], k[idx], v[idx], scale=scale, causal=causal,
                                               return_lse=True)
    return out, lse


FLASH_CASES = [
    # lead dims, Nq, Nk, d, causal, dtype                          what it covers
    pytest.param((), 100, 100, 64, False, "float32", id="N-not-a-multiple-of-the-tile"),
    pytest.param((), 5, 7, 64, False, "float32", id="N-below-one-tile"),
    pytest.param((2,), 37, 53, 1, False, "float32", id="d1"),
    pytest.param((2,), 37, 53, 3, True, "float32", id="d3-causal-Nq<Nk"),
    pytest.param((1, 2), 70, 45, 80, True, "float32", id="d80-causal-Nq>Nk-masked-rows"),
    pytest.param((), 33, 90, 128, True, "float32", id="d128-causal"),
    pytest.param((2,), 65, 65, 64, True, "float16", id="fp16-causal"),
    pytest.param((), 40, 50, 64, False, "bfloat16", id="bf16"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", FLASH_CASES)
def test_flash_attention_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = gpu.flash_attention_gpu(q, k, v, causal=causal, bfloat16=dtype == "bfloat16", backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert not np.isnan(values(out, dtype)).any()
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=causal)


def test_rows_that_see_no_key_give_zero_and_minus_infinity(backend):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((20, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 5, 8)).astype(np.float32)
    out, lse = gpu.flash_attention_gpu(q, k, v, causal=True, backend=backend)
    # bottom-right causal, Nq 20 > Nk 5: row i sees keys j <= i - 15, so rows 0..14 see nothing
    assert np.all(out[:15] == 0) and np.all(np.isneginf(lse[:15]))
    assert np.isfinite(lse[15:]).all() and not np.isnan(out).any()
    assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float32", causal=True)
    # no keys at all: every row is empty
    out, lse = gpu.flash_attention_gpu(q, k[:0], v[:0], backend=backend)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_fp16_with_large_scores_stays_finite(backend):
    rng = np.random.default_rng(4)
    # entries up to ~30: raw scores in the hundreds, exp() overflows unless the max is subtracted
    q, q64 = stored(6 * rng.standard_normal((70, 64)), "float16")
    k, k64 = stored(6 * rng.standard_normal((70, 64)), "float16")
    v, v64 = stored(rng.standard_normal((70, 64)), "float16")
    out, lse = gpu.flash_attention_gpu(q, k, v, backend=backend)
    assert np.abs(q64 @ k64.T / 8).max() > 100
    assert np.isfinite(values(out, "float16")).all()
    assert_attention_close(out, lse, q64, k64, v64, "float16")


def test_the_last_query_block_writes_nothing_into_the_next_head(backend):
    # Nq = 70 is one full block of 64 rows and 6 rows in a second block whose 58 other
    # rows do not exist; each head's values are far apart, so a stray write shows.
    rng = np.random.default_rng(5)
    heads = 3
    q = rng.standard_normal((heads, 70, 64)).astype(np.float32)
    k = rng.standard_normal((heads, 40, 64)).astype(np.float32)
    v = (rng.standard_normal((heads, 40, 64)) + 100 * np.arange(heads)[:, None, None]).astype(np.float32)
    out, lse = gpu.flash_attention_gpu(q, k, v, backend=backend)
    assert_attention_close(out, lse, *(x.astype(np.float64) for x in (q, k, v)), "float32")


def test_flash_attention_is_bitwise_reproducible(backend):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 50, 64)).astype(np.float32) for _ in range(3))
    runs = [gpu.flash_attention_gpu(q, k, v, causal=True, backend=backend) for _ in range(3)]
    for out, lse in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and lse.tobytes() == runs[0][1].tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_flash_trace_matches_the_numpy_trace_tile_by_tile(backend, causal):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 70, 64)).astype(np.float32)
    k = (2 * rng.standard_normal((2, 100, 64))).astype(np.float32)
    v = rng.standard_normal((2, 100, 64)).astype(np.float32)
    block_q, block_k = gpu.flash_attention_config(64)
    rows = [0, 5, 63, 64, 69]
    _, _, trace = gpu.flash_attention_gpu(q, k, v, causal=causal, trace_rows=rows, backend=backend)
    for h in range(2):
        _, ref = lessons.flash_attention(q[h].astype(np.float64), k[h].astype(np.float64), v[h].astype(np.float64),
                                         tile=block_k, block_q=block_q, causal=causal, return_trace=True)
        for row in rows:
            mine, theirs = trace.row(h, row), ref.row(row)
            assert len(mine) == len(theirs) > 0
            assert gpu.first_divergence(mine, theirs, **TRACE_TOL) is None, (h, row)


# ---------------------------------------------------------------------------
# flash attention forward on tensor cores (mma.sync.m16n8k16)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_one_tensor_core_instruction_multiplies_by_the_documented_layout(backend, dtype):
    # each lane loads its elements of A and B by the PTX ISA fragment layout and writes its
    # four results back by it; any slip in the layout scrambles rows or columns of A @ B
    rng = np.random.default_rng(20)
    (a, a64), (b, b64) = stored(rng.standard_normal((16, 16)), dtype), stored(rng.standard_normal((16, 8)), dtype)
    d = gpu.mma_probe_gpu(a, b, bfloat16=dtype == "bfloat16", backend=backend)
    assert d.shape == (16, 8) and d.dtype == np.float32
    # tensor cores truncate their float32 sums (about 1e-6 here); a slip in the layout is O(1)
    np.testing.assert_allclose(np.asarray(d, dtype=np.float64), a64 @ b64, rtol=1e-4, atol=1e-4)


MMA_CASES = [
    # lead dims, Nq, Nk, d, causal, dtype                          what it covers
    pytest.param((), 100, 100, 64, False, "float16", id="N-not-a-multiple-of-the-tile"),
    pytest.param((), 5, 7, 16, False, "float16", id="N-below-one-tile-d16"),
    pytest.param((2,), 70, 45, 80, True, "float16", id="d80-causal-Nq>Nk-masked-rows"),
    pytest.param((1, 2), 33, 90, 128, True, "float16", id="d128-causal-Nq<Nk"),
    pytest.param((), 20, 70, 256, False, "float16", id="d256-Q-re-read"),
    pytest.param((), 40, 50, 64, False, "bfloat16", id="bf16"),
    pytest.param((2,), 65, 65, 64, True, "bfloat16", id="bf16-causal"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", MMA_CASES)
def test_tensor_core_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d + 1)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = gpu.flash_attention_mma_gpu(q, k, v, causal=causal, bfloat16=dtype == "bfloat16", backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    assert not np.isnan(values(out, dtype)).any()
    # P is rounded to the 16-bit dtype before o += P V (as in FlashAttention-2), as the baseline's P is
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=causal)


def test_tensor_core_kernel_edge_rows_large_scores_and_reproducibility(backend):
    rng = np.random.default_rng(21)
    # bottom-right causal, Nq 20 > Nk 5: rows 0..14 see nothing -> 0 and -inf, never NaN
    q, k, v = (rng.standard_normal((n, 32)).astype(np.float16) for n in (20, 5, 5))
    out, lse = gpu.flash_attention_mma_gpu(q, k, v, causal=True, backend=backend)
    assert np.all(out[:15] == 0) and np.all(np.isneginf(lse[:15])) and np.isfinite(lse[15:]).all()
    out, lse = gpu.flash_attention_mma_gpu(q, k[:0], v[:0], backend=backend)     # no keys at all
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    # raw scores in the hundreds: exp() overflows unless the running max is subtracted
    (q, q64), (k, k64) = (stored(6 * rng.standard_normal((70, 64)), "float16") for _ in range(2))
    v, v64 = stored(rng.standard_normal((70, 64)), "float16")
    runs = [gpu.flash_attention_mma_gpu(q, k, v, backend=backend) for _ in range(2)]
    assert np.abs(q64 @ k64.T / 8).max() > 100
    assert_attention_close(*runs[0], q64, k64, v64, "float16")
    assert runs[1][0].tobytes() == runs[0][0].tobytes() and runs[1][1].tobytes() == runs[0][1].tobytes()


def test_tensor_core_kernel_writes_nothing_into_the_next_head(backend):
    rng = np.random.default_rng(22)
    heads = 3
    q, k = rng.standard_normal((heads, 70, 32)), rng.standard_normal((heads, 40, 32))
    v = rng.standard_normal((heads, 40, 32)) + 100 * np.arange(heads)[:, None, None]
    (q, q64), (k, k64), (v, v64) = (stored(x, "float16") for x in (q, k, v))
    out, lse = gpu.flash_attention_mma_gpu(q, k, v, backend=backend)
    assert_attention_close(out, lse, q64, k64, v64, "float16")       # |v| up to ~200: the baseline errs more too


@pytest.mark.parametrize("causal", [False, True])
def test_tensor_core_trace_matches_the_numpy_trace(backend, causal):
    rng = np.random.default_rng(23)
    (q, q64), (k, k64), (v, v64) = (stored(s * rng.standard_normal((n, 64)), "float16")
                                    for s, n in ((1, 70), (2, 100), (1, 100)))
    rows = [0, 9, 63, 64, 69]                 # rows g and g + 8 of a warp, both blocks
    block_k = gpu.flash_attention_mma_config(64)
    _, _, trace = gpu.flash_attention_mma_gpu(q, k, v, causal=causal, trace_rows=rows, backend=backend)
    _, ref = lessons.flash_attention(q64, k64, v64, tile=block_k, block_q=64, causal=causal, return_trace=True)
    for row in rows:
        assert len(trace.row(row)) == len(ref.row(row)) > 0
        assert gpu.first_divergence(trace.row(row), ref.row(row), rtol=1e-4, atol=1e-5) is None, row


def test_tensor_core_kernel_keeps_nan_input_nan(backend):
    rng = np.random.default_rng(24)
    q, k, v = (rng.standard_normal((2, 40, 16)).astype(np.float16) for _ in range(3))
    k[0, 7, 3] = np.nan
    q[1, 30, 0] = np.nan
    out, lse = gpu.flash_attention_mma_gpu(q, k, v, causal=True, backend=backend)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert_same_nan_rows(out, lse, *flash_reference(q64, k64, v64, True),
                         *baseline_attention(q64, k64, v64, "float16", causal=True))


def test_tensor_core_kernel_refuses_what_it_cannot_do():
    f16 = np.zeros((8, 64), np.float16)
    with pytest.raises(TypeError, match="float16 q, k, v"):
        gpu.flash_attention_mma_gpu(f16.astype(np.float32), f16.astype(np.float32), f16.astype(np.float32),
                                    backend="emulator")
    odd = np.zeros((8, 72), np.float16)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16"):
        gpu.flash_attention_mma_gpu(odd, odd, odd, backend="emulator")
    with pytest.raises(ValueError, match="block_k must be a multiple of 16"):
        gpu.flash_attention_mma_gpu(f16, f16, f16, block_k=24, backend="emulator")
    with pytest.raises(ValueError, match="a must be"):
        gpu.mma_probe_gpu(np.zeros((16, 8), np.float16), np.zeros((16, 8), np.float16), backend="emulator")
    with pytest.raises(TypeError, match="takes float16 q, k, v .* got float64"):       # not "float32 or float16"
        gpu.flash_attention_mma_gpu(*[f16.astype(np.float64)] * 3, backend="emulator")
    # bfloat16 bits (uint16) without the flag: every tensor-core launcher asks for bfloat16=True
    bits = f16.view(np.uint16)
    for launcher in (gpu.flash_attention_mma_gpu, gpu.flash_attention_mma_async_gpu, gpu.flash_attention_mma_fa2_gpu,
                     gpu.flash_attention_mma_fa2_lean_gpu, gpu.flash_attention_wgmma_gpu,
                     gpu.flash_attention_wgmma_pingpong_gpu):
        with pytest.raises(TypeError, match="got uint16 q, k, v: pass bfloat16=True if they hold bfloat16 bits"):
            launcher(bits, bits, bits, backend="emulator")
    with pytest.raises(TypeError, match="tensor-core backward got uint16 q, k, v, o, do: pass bfloat16=True"):
        gpu.flash_attention_backward_mma_gpu(bits, bits, bits, bits, np.zeros(8, np.float32), bits, backend="emulator")
    wide = np.zeros((8, 272), np.float16)
    with pytest.raises(ValueError, match=r"head_dim must be in 16\.\.256"):
        gpu.flash_attention_mma_gpu(wide, wide, wide, backend="emulator")
    # a scale that float32 cannot hold would turn every score into inf and every output into NaN
    for launcher in (gpu.flash_attention_mma_gpu, gpu.flash_attention_gpu):
        with pytest.raises(ValueError, match="scale must fit in float32"):
            launcher(f16, f16, f16, scale=1e39, backend="emulator")
    # nor one that float32 holds but not once log2(e) is folded in (3e38 * 1.4427 > 3.4028e38)
    x64 = np.zeros((8, 64), np.float16)
    for launcher in (gpu.flash_attention_mma_fa2_gpu, gpu.flash_attention_wgmma_gpu):
        with pytest.raises(ValueError, match=r"scale must fit in float32 times log2\(e\)"):
            launcher(x64, x64, x64, scale=-3e38, backend="emulator")


# ---------------------------------------------------------------------------
# online softmax
# ---------------------------------------------------------------------------

def softmax_reference(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    seen = ~np.isneginf(m)                 # NaN input: not empty, stays NaN
    p = np.exp(x - np.where(seen, m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)[..., 0]
    return np.where(seen, p / np.where(seen, l, 1.0), 0.0), lse


def softmax_baseline(x, dtype):
    """Softmax as a framework computes it in ``dtype``: float32 inside, the result rounded."""
    y, lse = softmax_reference(np.asarray(x, dtype=np.float32))
    return round_to(y, dtype).astype(np.float64), lse.astype(np.float32).astype(np.float64)


def assert_softmax_close(y, lse, x64, dtype):
    ref, ref_lse = softmax_reference(x64)
    base, base_lse = softmax_baseline(x64, dtype)
    assert_within_baseline(values(y, dtype), ref, base, what="y")
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_online_softmax_matches_the_reference(backend, dtype):
    rng = np.random.default_rng(8)
    x = 3 * rng.standard_normal((4, 700))               # 700 columns: two full tiles of 256 and a partial one
    x[1] = -np.inf                                      # a row with nothing visible
    x[2, 300:] = -np.inf                                # a row whose last tiles are all masked
    xs, x64 = stored(x, dtype)
    y, lse = gpu.online_softmax_gpu(xs, backend=backend)
    assert_softmax_close(y, lse, x64, dtype)
    # one short row, fewer columns than threads
    y, lse = gpu.online_softmax_gpu(xs[0, :10], backend=backend)
    assert lse.shape == ()
    assert_softmax_close(y, lse, x64[0, :10], dtype)


def test_online_softmax_trace_matches_numpy(backend):
    rng = np.random.default_rng(9)
    x = (3 * rng.standard_normal((3, 600))).astype(np.float32)
    x[2, 256:512] = -np.inf                             # a fully masked middle tile
    _, _, trace = gpu.online_softmax_gpu(x, tile=256, trace_rows=[0, 2], backend=backend)
    for row in (0, 2):
        # softmax of a row is attention of one query q = 1 over keys k_j = x_j with scale 1
        _, ref = lessons.flash_attention(np.ones((1, 1)), x[row].astype(np.float64)[:, None], np.zeros((600, 1)),
                                         tile=256, block_q=1, scale=1.0, return_trace=True)
        assert len(trace.row(row)) == 3
        assert gpu.first_divergence(trace.row(row), ref.row(0), **TRACE_TOL) is None


# ---------------------------------------------------------------------------
# paged decode with GQA, flash-decoding
# ---------------------------------------------------------------------------

def paged_case(seed, num_heads, num_kv_heads, d, block_size, seq_lens, dtype="float32", num_blocks=None):
    """A paged cache whose unused slots (past each seq_len, and unused pages) hold NaN."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = num_blocks or sum(pages) + 3
    max_blocks = max(pages + [1]) + 1
    k64 = np.full((num_blocks, block_size, num_kv_heads, d), np.nan)
    v64 = np.full_like(k64, np.nan)
    tables = np.full((len(seq_lens), max_blocks), -1, np.int32)      # unused entries: invalid pages
    free = iter(rng.permutation(num_blocks))
    for s, n in enumerate(seq_lens):
        for b in range(pages[s]):
            page = next(free)
            tables[s, b] = page
            used = min(block_size, n - b * block_size)
            k64[page, :used] = rng.standard_normal((used, num_kv_heads, d))
            v64[page, :used] = rng.standard_normal((used, num_kv_heads, d))
    q, q64 = stored(rng.standard_normal((len(seq_lens), num_heads, d)), dtype)
    k, k64 = stored(k64, dtype)
    v, v64 = stored(v64, dtype)
    return SimpleNamespace(q=q, k=k, v=v, q64=q64, k64=k64, v64=v64, tables=tables,
                           seq_lens=np.array(seq_lens, np.int32), dtype=dtype)


def sequence_kv(c, s, kv_head):
    """Keys and values of sequence s for one kv head, gathered through the block table: (n, d)."""
    block_size = c.k64.shape[1]
    t = np.arange(c.seq_lens[s])
    pages, slots = c.tables[s, t // block_size], t % block_size
    return c.k64[pages, slots, kv_head], c.v64[pages, slots, kv_head]


def decode_reference(c, dtype=None):
    """(out, lse) per sequence and query head: float64 attention, or with ``dtype`` the
    same-precision baseline (kernel_tolerance.baseline_attention)."""
    num_seqs, num_heads, d = c.q64.shape
    group = num_heads // c.k64.shape[2]
    out, lse = np.zeros((num_seqs, num_heads, d)), np.zeros((num_seqs, num_heads))
    for s in range(num_seqs):
        for h in range(num_heads):
            k, v = sequence_kv(c, s, h // group)            # query head h reads kv head h // group
            if dtype is None:
                out[s, h], lse[s, h] = lessons.attention(c.q64[s, h], k, v, return_lse=True)
            else:
                o, l = baseline_attention(c.q64[s, h][None], k, v, dtype)
                out[s, h], lse[s, h] = o[0], l[0]
    return out, lse


def assert_decode_close(out, lse, c):
    """A decode kernel's (out, lse) against float64 attention, within FlashAttention's rule."""
    (ref, ref_lse), (base, base_lse) = decode_reference(c), decode_reference(c, c.dtype)
    assert_within_baseline(values(out, c.dtype), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


def decode_args(c):
    return (c.q, c.k, c.v, c.tables, c.seq_lens)


SEQ_LENS = [37, 0, 16, 1]       # several pages with a partial last one, empty, exactly one page, one token


@pytest.mark.parametrize("num_heads, num_kv_heads", [(8, 8), (8, 4), (8, 2), (8, 1), (6, 2)],
                         ids=["MHA", "group2", "group4", "MQA-group8", "group3"])
def test_paged_decode_every_gqa_ratio(backend, num_heads, num_kv_heads):
    c = paged_case(10, num_heads, num_kv_heads, 64, 16, SEQ_LENS)
    out, lse = gpu.paged_decode_gpu(*decode_args(c), backend=backend)
    assert not np.isnan(out).any()                      # nothing stale (NaN) past seq_len was read
    assert_decode_close(out, lse, c)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))    # the empty sequence


@pytest.mark.parametrize("d, block_size, dtype, seq_lens", [
    (3, 8, "float16", SEQ_LENS), (80, 32, "bfloat16", SEQ_LENS), (128, 16, "float32", SEQ_LENS),
    (1, 1, "float32", [5, 0, 2, 1]),                    # one token per page
])
def test_paged_decode_head_dims_page_sizes_and_dtypes(backend, d, block_size, dtype, seq_lens):
    c = paged_case(11, 8, 2, d, block_size, seq_lens, dtype)
    out, lse = gpu.paged_decode_gpu(*decode_args(c), bfloat16=dtype == "bfloat16", backend=backend)
    assert not np.isnan(values(out, dtype)).any()
    assert_decode_close(out, lse, c)


def test_paged_decode_trace_matches_numpy(backend):
    c = paged_case(12, 4, 2, 64, 16, SEQ_LENS)
    _, _, trace = gpu.paged_decode_gpu(*decode_args(c), trace_rows=[(0, 3), (3, 0), (1, 1)], backend=backend)
    for s, h in [(0, 3), (3, 0)]:
        k, v = sequence_kv(c, s, h // 2)
        # one tile per page, in logical order
        _, ref = lessons.flash_attention(c.q64[s, h][None], k, v, tile=16, block_q=1, return_trace=True)
        assert len(trace.row(s, h)) == -(-c.seq_lens[s] // 16)
        assert gpu.first_divergence(trace.row(s, h), ref.row(0), **TRACE_TOL) is None
    assert len(trace.row(1, 1)) == 0                     # seq_len 0: no page absorbed


def split_state_float32(q, k, v, scale, block_size):
    """The unnormalised state (m, l, o) of one split folded page by page in float32: the
    same-precision baseline for the kernel's partial states."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    m, l, o = np.float32(-np.inf), np.float32(0), np.zeros(v.shape[1], np.float32)
    for lo in range(0, len(k), block_size):
        s = (k[lo:lo + block_size] @ q) * np.float32(scale)
        m_new = max(m, s.max())
        alpha, p = np.exp(m - m_new), np.exp(s - m_new)
        l, o, m = alpha * l + p.sum(), alpha * o + p @ v[lo:lo + block_size], m_new
    return m, l, o


@pytest.mark.parametrize("num_splits", [1, 2, 3, 16])    # 16 splits > 3 pages: most splits are empty
def test_flash_decoding_matches_reference_and_partial_states(backend, num_splits):
    c = paged_case(13, 8, 2, 64, 16, SEQ_LENS)
    out, lse, parts = gpu.flash_decoding_gpu(*decode_args(c), num_splits, return_partials=True, backend=backend)
    assert not np.isnan(out).any()
    assert_decode_close(out, lse, c)
    # each split's unnormalised state (m, l, o) over its own pages, computed by hand in float64;
    # the baseline of the tolerance rule folds the same pages in float32; the rule is applied
    # to all non-empty splits together (a max over many states, as over an output tensor)
    block_size, scale = 16, 1 / 8
    got, ref, base = ([], [], []), ([], [], []), ([], [], [])
    longest = 1                                          # the most keys one split sums over
    for s in range(len(SEQ_LENS)):
        n_pages = -(-int(c.seq_lens[s]) // block_size)
        per = -(-n_pages // num_splits)
        for h in range(8):
            k, v = sequence_kv(c, s, h // 4)
            for split in range(num_splits):
                lo, hi = split * per * block_size, min((split + 1) * per * block_size, int(c.seq_lens[s]))
                state = tuple(parts[key][s, h, split] for key in ("m", "l", "o"))
                if lo >= hi:                             # an empty split is the empty state
                    assert np.isneginf(state[0]) and state[1] == 0 and np.all(state[2] == 0)
                    continue
                longest = max(longest, hi - lo)
                scores = k[lo:hi] @ c.q64[s, h] * scale
                p = np.exp(scores - scores.max())
                for i, (g, r, b) in enumerate(zip(state, (scores.max(), p.sum(), p @ v[lo:hi]),
                                                  split_state_float32(c.q64[s, h], k[lo:hi], v[lo:hi], scale,
                                                                      block_size))):
                    got[i].append(g), ref[i].append(r), base[i].append(b)
    for i, what in enumerate("mlo"):
        assert_within_baseline(np.array(got[i]), np.array(ref[i]), np.array(base[i]), what=what, terms=longest)


def test_flash_decoding_traces_match_numpy(backend):
    c = paged_case(14, 4, 4, 64, 8, [45, 9], num_blocks=12)
    num_splits, block_size = 3, 8
    out, lse, parts, traces = gpu.flash_decoding_gpu(*decode_args(c), num_splits, return_partials=True,
                                                     trace_rows=[(0, 2), (1, 0)], backend=backend)
    for s, h in [(0, 2), (1, 0)]:
        k, v = sequence_kv(c, s, h)
        n_pages = -(-int(c.seq_lens[s]) // block_size)
        per = -(-n_pages // num_splits)
        row = traces.tiles.row(s, h)
        assert list(row.tile) == list(range(n_pages))
        # within split sp, the pages fold into a fresh state: NumPy's trace over that split's keys
        for split in range(num_splits):
            first, last = split * per, min((split + 1) * per, n_pages)
            if first >= last:
                continue
            lo, hi = first * block_size, min(last * block_size, int(c.seq_lens[s]))
            _, ref = lessons.flash_attention(c.q64[s, h][None], k[lo:hi], v[lo:hi], tile=block_size, block_q=1,
                                             return_trace=True)
            mine = row.tile >= first
            mine &= row.tile < last
            part = SimpleNamespace(tile=row.tile[mine] - first, m=row.m[mine], alpha=row.alpha[mine], l=row.l[mine])
            assert gpu.first_divergence(part, ref.row(0), **TRACE_TOL) is None, (s, h, split)
        # the merge kernel folds the partial states in split order, as lessons.merge does
        state = State.empty(1, 64)
        m_ref, alpha_ref, l_ref = [], [], []
        for split in range(num_splits):
            incoming = State(m=parts["m"][s, h, split][None].astype(np.float64),
                             l=parts["l"][s, h, split][None].astype(np.float64),
                             o=parts["o"][s, h, split][None].astype(np.float64))
            new = merge(state, incoming)
            m_ref.append(new.m[0]), alpha_ref.append(correction_factor(state.m, new.m)[0]), l_ref.append(new.l[0])
            state = new
        ref_merge = SimpleNamespace(m=np.array(m_ref), alpha=np.array(alpha_ref), l=np.array(l_ref))
        assert len(traces.merge.row(s, h)) == num_splits
        assert gpu.first_divergence(traces.merge.row(s, h), ref_merge, **TRACE_TOL) is None


def test_decode_kernels_are_bitwise_reproducible(backend):
    c = paged_case(15, 8, 2, 64, 16, SEQ_LENS)
    first = gpu.paged_decode_gpu(*decode_args(c), backend=backend)
    again = gpu.paged_decode_gpu(*decode_args(c), backend=backend)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
    first = gpu.flash_decoding_gpu(*decode_args(c), 3, backend=backend)
    again = gpu.flash_decoding_gpu(*decode_args(c), 3, backend=backend)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


# ---------------------------------------------------------------------------
# the emulator's own safety net, and GPU-only checks
# ---------------------------------------------------------------------------
# NaN input is bad data, not an empty row: it must come out as NaN, as in the NumPy core
# ---------------------------------------------------------------------------

def test_flash_attention_keeps_nan_input_nan(backend):
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((2, 40, 16)).astype(np.float32) for _ in range(3))
    k[0, 7, 3] = np.nan                        # head 0: one bad key poisons every row that sees it
    q[1, 30, 0] = np.nan                       # head 1: one bad query row
    out, lse = gpu.flash_attention_gpu(q, k, v, causal=True, backend=backend)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, ref_lse = flash_reference(q64, k64, v64, True)
    assert_same_nan_rows(out, lse, ref, ref_lse, *baseline_attention(q64, k64, v64, "float32", causal=True))
    assert np.isnan(ref_lse[0, 7:]).all() and not np.isnan(ref_lse[0, :7]).any()   # causal: rows >= 7 see key 7


def test_online_softmax_keeps_nan_input_nan(backend):
    x = np.random.default_rng(13).standard_normal((3, 300)).astype(np.float32)
    x[1, 290] = np.nan
    y, lse = gpu.online_softmax_gpu(x, backend=backend)
    assert_same_nan_rows(y, lse, *softmax_reference(x.astype(np.float64)), *softmax_baseline(x, "float32"))


def test_decode_kernels_keep_nan_input_nan(backend):
    c = paged_case(14, 4, 2, 16, 8, [20, 9])
    page, slot = c.tables[0, 1], 3             # token 11 of sequence 0, kv head 1 (query heads 2, 3)
    c.k[page, slot, 1, 5] = np.nan
    c.k64[page, slot, 1, 5] = np.nan
    ref, ref_lse = decode_reference(c)
    for out, lse in (gpu.paged_decode_gpu(*decode_args(c), backend=backend),
                     gpu.flash_decoding_gpu(*decode_args(c), 2, backend=backend)):
        assert_same_nan_rows(out, lse, ref, ref_lse, *decode_reference(c, "float32"))
    assert np.isnan(ref_lse[0, 2:]).all() and np.isfinite(ref_lse[0, :2]).all() and np.isfinite(ref_lse[1]).all()


# ---------------------------------------------------------------------------
# A row's output never depends on what it cannot see: poison it, nothing changes
# ---------------------------------------------------------------------------
# NaN, inf and a huge finite value in every key/value slot a row cannot see: keys above
# the causal diagonal (inside the diagonal tile too), keys past Nk (the next head's keys
# follow in memory; past the last head the emulator's guard zone reads as NaN), slots
# past seq_len in a page, pages no sequence uses. The rows that cannot see the poison
# must come out bitwise as in the clean run; NaN in a key a row does see makes it NaN.

POISONS = [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf"), pytest.param(1e30, id="1e30")]


def forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows, *, scale=None):
    """Two heads of random q, k, v (exact values of ``dtype``). For each row r in
    ``cut_rows``: poison head 0's keys r can not see under causal masking (j > r + nk - nq)
    and every key of head 1 (memory past head 0's last key), k and v alike. Head 0's rows
    <= r must be bitwise those of the clean run; with NaN poison its rows > r are NaN.
    Returns the clean (out, lse, q64, k64, v64) for a check against the reference."""
    rng = np.random.default_rng(nq * 100 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, n, d)), dtype) for n in (nq, nk, nk))
    with np.errstate(over="ignore"):
        bad, _ = stored(np.full((1,), poison), dtype)      # (1e30 is inf in float16)
    clean_out, clean_lse = launch(q, k, v)
    for r in cut_rows:
        kp, vp = k.copy(), v.copy()
        hidden = r + nk - nq + 1                       # first key row r cannot see
        for x in (kp, vp):
            x[0, max(hidden, 0):] = bad[0]
            x[1] = bad[0]
        out, lse = launch(q, kp, vp)
        rows = slice(0, r + 1)
        assert out[0, rows].tobytes() == clean_out[0, rows].tobytes(), (r, poison)
        assert lse[0, rows].tobytes() == clean_lse[0, rows].tobytes(), (r, poison)
        if np.isnan(poison) and hidden < nk:           # the rows that do see a NaN key
            assert np.isnan(values(out, dtype)[0, r + 1:]).all() and np.isnan(lse[0, r + 1:]).all()
    return clean_out, clean_lse, q64, k64, v64


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("nq, nk, d, block_q, block_k, dtype", [
    (21, 29, 8, 8, 16, "float32"),          # the diagonal crosses the middle of a key tile, Nk partial
    (37, 37, 3, None, None, "float16"),     # default tiles, Nq = Nk
    (12, 20, 16, 4, 32, "bfloat16"),        # block_q 4: 32 lanes per row
])
def test_flash_attention_rows_never_see_poison_they_cannot_see(backend, poison, nq, nk, d, block_q, block_k,
                                                               dtype):
    def launch(q, k, v):
        return gpu.flash_attention_gpu(q, k, v, causal=True, block_q=block_q, block_k=block_k,
                                       bfloat16=dtype == "bfloat16", backend=backend)
    cut_rows = sorted({0, nq // 3, nq - 2})
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("nq, nk, d, block_k, dtype", [
    (70, 45, 16, 16, "float16"),            # two query blocks, Nq > Nk, the diagonal inside 16-key tiles
    (20, 50, 32, None, "bfloat16"),         # one 64-key tile holding the whole diagonal
])
def test_tensor_core_rows_never_see_poison_they_cannot_see(backend, poison, nq, nk, d, block_k, dtype):
    def launch(q, k, v):
        return gpu.flash_attention_mma_gpu(q, k, v, causal=True, block_k=block_k, bfloat16=dtype == "bfloat16",
                                           backend=backend)
    cut_rows = sorted({nq - nk + 3 if nq > nk else 0, nq // 2 + 1, nq - 2})
    out, lse, q64, k64, v64 = forward_poison_check(launch, nq, nk, d, dtype, poison, cut_rows)
    assert_attention_close(out, lse, q64, k64, v64, dtype, causal=True)


def assert_nan_and_inf_reach_exactly_their_columns(run, d=16):
    """RUN(q, k, v, causal=True) on 40 x 16 fp16 inputs (zero columns up to D): keys 5 and 9 are seen by
    rows >= 5 and >= 9 (causal, Nq = Nk); v[5, 3] = NaN makes column 3 of those rows NaN, v[9, 7] = inf
    makes column 7 of rows >= 9 inf (p > 0), as P V does; every other entry, and lse, are the clean run's."""
    rng = np.random.default_rng(26)
    q, k, v = (padded(rng.standard_normal((40, 16)), d).astype(np.float16) for _ in range(3))
    clean_out, clean_lse = run(q, k, v, causal=True)
    v[5, 3], v[9, 7] = np.nan, np.inf
    out, lse = run(q, k, v, causal=True)
    nan, inf = np.zeros(out.shape, bool), np.zeros(out.shape, bool)
    nan[5:, 3] = True
    inf[9:, 7] = True
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(np.isposinf(out), inf)
    assert out[~(nan | inf)].tobytes() == clean_out[~(nan | inf)].tobytes()
    assert lse.tobytes() == clean_lse.tobytes()


def assert_trace_follows_numpy(trace, q, k, v, rows, *, block_q, block_k, tiles=None):
    """Each of ROWS of a single-head kernel TRACE against NumPy's trace of lessons.flash_attention (float64,
    the kernel's block_q and block_k): the same number of tiles (TILES when given, else at least one), and
    no divergence beyond m and alpha in float32 and l after P rounded to 16 bits (rtol 2e-3, atol 1e-3)."""
    _, ref = lessons.flash_attention(*(x.astype(np.float64) for x in (q, k, v)), tile=block_k, block_q=block_q,
                                     return_trace=True)
    for row in rows:
        mine, theirs = trace.row(row), ref.row(row)
        assert len(mine) == len(theirs) > 0
        if tiles is not None:
            assert len(mine) == tiles
        assert gpu.first_divergence(mine, theirs, rtol=2e-3, atol=1e-3) is None, row


@pytest.mark.parametrize("launcher", ["scalar", "tensor-core"])
def test_forward_kernels_nan_and_inf_in_a_visible_value_reach_exactly_its_column(backend, launcher):
    run = {"scalar": gpu.flash_attention_gpu, "tensor-core": gpu.flash_attention_mma_gpu}[launcher]
    assert_nan_and_inf_reach_exactly_their_columns(partial(run, backend=backend))


def padded(x, d):
    """x (n, d0) with zero columns up to d: the same scores, and the same outputs in x's columns."""
    out = np.zeros((x.shape[0], d), x.dtype)
    out[:, :x.shape[1]] = x
    return out


@pytest.mark.parametrize("launcher, dtype, tiles", [
    ("scalar", "float32", dict(block_q=4, block_k=32)), ("scalar", "float32", dict(block_q=64, block_k=64)),
    ("scalar", "float16", {}), ("tensor-core", "float16", dict(block_k=16)), ("tensor-core", "bfloat16", {})])
def test_forward_kernels_give_the_hand_computed_causal_answer_with_an_unwritten_last_key(backend, launcher,
                                                                                         dtype, tiles):
    # q = k = [[1,0],[0,1],[1,1]], v = [[1,2],[3,4],[5,6]], then k[2] = v[2] = NaN (not yet written):
    # row 0 sees key 0 only -> v[0]; row 1 sees keys 0, 1 with scores 0, 1/sqrt(2) ->
    # (v0 + e^(1/sqrt 2) v1) / (1 + e^(1/sqrt 2)) = [2.339523, 3.339523], lse log(1 + e^(1/sqrt 2));
    # row 2 sees the NaN key and is NaN. The tensor-core kernel needs d a multiple of 16: zero
    # columns leave every score and the first two output columns as they are.
    q = np.array([[1, 0], [0, 1], [1, 1]], np.float64)
    k, v = q.copy(), np.array([[1, 2], [3, 4], [5, 6]], np.float64)
    k[2] = v[2] = np.nan
    d = 2 if launcher == "scalar" else 16
    (qs, _), (ks, _), (vs, _) = (stored(padded(x, d), dtype) for x in (q, k, v))
    run = gpu.flash_attention_gpu if launcher == "scalar" else gpu.flash_attention_mma_gpu
    out, lse = run(qs, ks, vs, scale=1 / np.sqrt(2), causal=True, bfloat16=dtype == "bfloat16", backend=backend,
                   **tiles)
    got = values(out, dtype)[:, :2]
    e = np.exp(1 / np.sqrt(2))
    want = np.array([[1, 2], [(1 + 3 * e) / (1 + e), (2 + 4 * e) / (1 + e)]])
    np.testing.assert_allclose(want[1], [2.339523, 3.339523], atol=5e-7)
    want_lse = np.array([1 / np.sqrt(2), np.log1p(np.exp(1 / np.sqrt(2)))])       # 0.707107, 1.107940
    base, base_lse = baseline_attention(q[:2, :2], k[:2], v[:2], dtype, scale=1 / np.sqrt(2), causal=True)
    assert_within_baseline(got[:2], want, base)
    assert_within_baseline(lse[:2], want_lse, base_lse, what="lse")
    assert np.isnan(got[2]).all() and np.isnan(lse[2])
    assert np.all(values(out, dtype)[:2, 2:] == 0)


@pytest.mark.parametrize("launcher", ["scalar", "tensor-core"])
def test_forward_kernels_give_the_hand_computed_answer_with_a_nan_key_past_the_end(backend, launcher):
    # q = [[1,0],[0,1]], k = [[1,0],[0,1]], v = [[1,2],[3,4]], and the NaN key/value [nan, nan]
    # right after them in memory (the next head's first key): both rows see keys 0 and 1 only,
    # out = [[1.660477, 2.660477], [2.339523, 3.339523]], lse = log(1 + e^(1/sqrt 2)) = 1.107940 for both
    d = 2 if launcher == "scalar" else 16
    dtype = "float32" if launcher == "scalar" else "float16"
    q = np.stack([padded(np.eye(2), d), np.full((2, d), np.nan)])
    k = np.stack([padded(np.eye(2), d), np.full((2, d), np.nan)])
    v = np.stack([padded(np.array([[1.0, 2], [3, 4]]), d), np.full((2, d), np.nan)])
    (qs, _), (ks, _), (vs, _) = (stored(x, dtype) for x in (q, k, v))
    run = gpu.flash_attention_gpu if launcher == "scalar" else gpu.flash_attention_mma_gpu
    out, lse = run(qs, ks, vs, scale=1 / np.sqrt(2), backend=backend)
    e = np.exp(1 / np.sqrt(2))                         # each row: its own key e^(1/sqrt 2), the other 1
    want = np.array([[(e * 1 + 3) / (e + 1), (e * 2 + 4) / (e + 1)], [(1 + e * 3) / (e + 1), (2 + e * 4) / (e + 1)]])
    np.testing.assert_allclose(want, [[1.660477, 2.660477], [2.339523, 3.339523]], atol=5e-7)
    base, base_lse = baseline_attention(np.eye(2), np.eye(2), np.array([[1.0, 2], [3, 4]]), dtype,
                                        scale=1 / np.sqrt(2))
    assert_within_baseline(values(out, dtype)[0, :, :2], want, base)
    assert_within_baseline(lse[0], np.full(2, np.log1p(np.exp(1 / np.sqrt(2)))), base_lse, what="lse")
    assert np.isnan(values(out, dtype)[1]).all()


@pytest.mark.parametrize("poison", POISONS)
def test_decode_kernels_never_see_slots_past_seq_len_or_unused_pages(backend, poison):
    # unused slots hold `poison` (and the block table's unused entries point at a poisoned
    # page, not -1): out and lse are bitwise those of a cache whose unused slots hold 0
    c = paged_case(16, 4, 2, 16, 8, [20, 0, 8, 3])      # partial last pages, an empty sequence, one full page
    unused = np.isnan(c.k64)
    spare = sorted(set(range(c.k.shape[0])) - set(c.tables[c.tables >= 0].tolist()))
    assert spare and unused.any()
    zero, _ = stored(np.zeros(1), "float32")
    bad, _ = stored(np.full(1, poison), "float32")
    clean = SimpleNamespace(**{**vars(c), "k": np.where(unused, zero[0], c.k), "v": np.where(unused, zero[0], c.v)})
    dirty = SimpleNamespace(**{**vars(c), "k": np.where(unused, bad[0], c.k), "v": np.where(unused, bad[0], c.v),
                               "tables": np.where(c.tables < 0, spare[0], c.tables).astype(np.int32)})
    dirty.k[spare[0]] = dirty.v[spare[0]] = bad[0]
    for run in (lambda x: gpu.paged_decode_gpu(*decode_args(x), backend=backend),
                lambda x: gpu.flash_decoding_gpu(*decode_args(x), 1, backend=backend),
                lambda x: gpu.flash_decoding_gpu(*decode_args(x), 3, backend=backend)):
        (out, lse), (out_p, lse_p) = run(clean), run(dirty)
        assert out_p.tobytes() == out.tobytes() and lse_p.tobytes() == lse.tobytes()
        assert_decode_close(out, lse, c)


# ---------------------------------------------------------------------------

@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_the_emulator_catches_a_write_past_a_buffer():
    from lessons.gpu.emulator import EmulatedModule

    module = EmulatedModule(gpu.online_softmax_build(256, "float32"))
    x = np.zeros((2, 300), np.float32)
    y_too_small = np.zeros((1, 300), np.float32)     # the kernel writes two rows
    with pytest.raises(gpu.EmulatorMemoryError, match="outside argument y"):
        module.launch("online_softmax", (2,), (256,),
                      [x, y_too_small, np.zeros(2, np.float32), 2, 300, np.zeros(1, np.int32), 0,
                       np.zeros(1, np.float32)])


@gpu_only
def test_cupy_inputs_give_cupy_outputs():
    import cupy

    rng = np.random.default_rng(16)
    q, k, v = (cupy.asarray(rng.standard_normal((2, 130, 128)).astype(np.float16)) for _ in range(3))
    out, lse = gpu.flash_attention_gpu(q, k, v, causal=True)
    assert isinstance(out, cupy.ndarray) and isinstance(lse, cupy.ndarray)
    assert_attention_close(out.get(), lse.get(), *(x.get().astype(np.float64) for x in (q, k, v)), "float16",
                           causal=True)


@gpu_only
@pytest.mark.parametrize("n, d", [(1000, 128), (2048, 64)])
def test_larger_problems_on_the_gpu(n, d):
    rng = np.random.default_rng(17)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, n, d)), "float16") for _ in range(3))
    for causal in (False, True):
        out, lse = gpu.flash_attention_gpu(q, k, v, causal=causal)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)


@gpu_only
def test_tensor_core_kernel_on_larger_and_misaligned_inputs():
    import cupy

    rng = np.random.default_rng(25)
    (q, q64), (k, k64), (v, v64) = (stored(rng.standard_normal((2, n, 128)), "float16") for n in (1000, 1500, 1500))
    for causal in (False, True):
        out, lse = gpu.flash_attention_mma_gpu(q, k, v, causal=causal)
        assert_attention_close(out, lse, q64, k64, v64, "float16", causal=causal)
    # a contiguous CuPy view that starts 2 bytes into its allocation: copied, not misread
    flat = cupy.zeros(q.size + 1, dtype=cupy.float16)
    flat[1:] = cupy.asarray(q).ravel()
    q_view = flat[1:].reshape(q.shape)
    assert q_view.data.ptr % 16
    out, lse = gpu.flash_attention_mma_gpu(q_view, cupy.asarray(k), cupy.asarray(v))
    assert_attention_close(out, lse, q64, k64, v64, "float16")


def test_tensor_core_kernel_refuses_a_gpu_without_mma_m16n8k16(monkeypatch):
    from lessons.gpu import launch

    class OldDevice:                          # a Turing card: compute capability 7.5
        compute_capability = "75"

    fake = type("cupy", (), {"cuda": type("cuda", (), {"Device": OldDevice})})
    run = type("Run", (), {"backend": "cupy", "xp": fake})()
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer .* this one is 7.5"):
        launch._require_tensor_cores(run)
    run.backend = "emulator"
    launch._require_tensor_cores(run)         # the emulator needs no tensor cores

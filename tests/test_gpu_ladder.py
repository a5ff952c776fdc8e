"""The kernel ladder: the register-tiled rung against NumPy (emulator, and the GPU where one
is present), every rung's PTX holding the instruction it is about, no spills, and the registry's
recorded figures read back from the shipped H200 results."""
import csv

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.gpu import ladder
from kernel_tolerance import assert_within_baseline, baseline_attention

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


def assert_close(out, lse, q, k, v, causal):
    """FlashAttention's rule (tests/kernel_tolerance.py): at most twice the error of the same
    attention computed in float32, against float64."""
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, ref_lse = reference(q64, k64, v64, causal)
    base, base_lse = baseline_attention(q64, k64, v64, "float32", causal=causal)
    assert_within_baseline(np.asarray(out, np.float64), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


CASES = [
    pytest.param((), 100, 100, 64, False, id="N-not-a-multiple-of-the-tiles"),
    pytest.param((), 5, 7, 64, False, id="below-one-tile"),
    pytest.param((2,), 37, 53, 4, True, id="d4-causal-Nq<Nk"),
    pytest.param((1, 2), 70, 45, 80, True, id="d80-causal-Nq>Nk-empty-rows"),
    pytest.param((), 33, 90, 128, True, id="d128-causal"),
    pytest.param((2,), 40, 70, 36, False, id="d36-chunks-not-a-multiple-of-8"),
    pytest.param((), 20, 20, 256, False, id="d256"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal", CASES)
def test_register_tiled_kernel_matches_the_reference(backend, lead, nq, nk, d, causal):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    q, k, v = (rng.standard_normal((*lead, n, d)).astype(np.float32) for n in (nq, nk, nk))
    out, lse = gpu.flash_attention_regtile_gpu(q, k, v, causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == np.float32 and lse.shape == q.shape[:-1]
    assert not np.isnan(out).any()
    assert_close(out, lse, q, k, v, causal)


def test_register_tiled_rows_that_see_no_key_and_hidden_nan(backend):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((20, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 5, 8)).astype(np.float32)
    v[4] = np.nan                  # key 4 is seen only by row 19 (bottom-right causal, 20 rows, 5 keys)
    out, lse = gpu.flash_attention_regtile_gpu(q, k, v, causal=True, backend=backend)
    assert np.all(out[:15] == 0) and np.all(np.isneginf(lse[:15]))       # rows 0..14 see nothing
    assert not np.isnan(out[:19]).any() and np.isnan(out[19]).all()      # NaN reaches only the row that sees it
    v[4] = 0
    out2, lse2 = gpu.flash_attention_regtile_gpu(q, k, v, causal=True, backend=backend)
    np.testing.assert_array_equal(out2[:19], out[:19])
    assert_close(out2, lse2, q, k, v, True)
    out, lse = gpu.flash_attention_regtile_gpu(q, k[:0], v[:0], backend=backend)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_register_tiled_kernel_writes_nothing_into_the_next_head(backend):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((3, 70, 64)).astype(np.float32)
    k = rng.standard_normal((3, 40, 64)).astype(np.float32)
    v = (rng.standard_normal((3, 40, 64)) + 100 * np.arange(3)[:, None, None]).astype(np.float32)
    out, lse = gpu.flash_attention_regtile_gpu(q, k, v, backend=backend)
    assert_close(out, lse, q, k, v, False)


def test_register_tiled_kernel_is_bitwise_reproducible(backend):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 50, 64)).astype(np.float32) for _ in range(3))
    runs = [gpu.flash_attention_regtile_gpu(q, k, v, causal=True, backend=backend) for _ in range(3)]
    for out, lse in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and lse.tobytes() == runs[0][1].tobytes()


@pytest.mark.parametrize("causal", [False, True])
def test_register_tiled_trace_matches_the_numpy_trace(backend, causal):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 70, 64)).astype(np.float32)
    k = (2 * rng.standard_normal((2, 100, 64))).astype(np.float32)
    v = rng.standard_normal((2, 100, 64)).astype(np.float32)
    block_q, block_k = gpu.flash_attention_regtile_config(64)
    rows = [0, 3, 5, 63, 64, 69]
    _, _, trace = gpu.flash_attention_regtile_gpu(q, k, v, causal=causal, trace_rows=rows, backend=backend)
    for h in range(2):
        _, ref = lessons.flash_attention(*(x[h].astype(np.float64) for x in (q, k, v)), tile=block_k,
                                         block_q=block_q, causal=causal, return_trace=True)
        for row in rows:
            mine, theirs = trace.row(h, row), ref.row(row)
            assert len(mine) == len(theirs) > 0
            assert gpu.first_divergence(mine, theirs, rtol=2e-5, atol=1e-6) is None, (h, row)


def test_register_tiled_kernel_refuses_what_it_cannot_do():
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(TypeError, match="float32"):
        gpu.flash_attention_regtile_gpu(x.astype(np.float16), x.astype(np.float16), x.astype(np.float16),
                                        backend="emulator")
    odd = np.zeros((8, 18), np.float32)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4"):
        gpu.flash_attention_regtile_gpu(odd, odd, odd, backend="emulator")
    with pytest.raises(ValueError, match="block_q"):
        gpu.flash_attention_regtile_gpu(x, x, x, block_q=48, backend="emulator")
    with pytest.raises(ValueError, match="shared memory"):
        gpu.flash_attention_regtile_config(256, 64, 64)


def test_regtile_config_takes_the_largest_tiles_that_fit():
    for d in range(4, 257, 4):
        bq, bk = gpu.flash_attention_regtile_config(d)
        smem = gpu.source.flash_attention_regtile_smem_bytes
        assert smem(d, bq, bk) <= 48 * 1024
        larger = gpu.source.REGTILE_TILES[:gpu.source.REGTILE_TILES.index((bq, bk))]
        assert all(smem(d, *t) > 48 * 1024 for t in larger)
    # by hand: d = 64, (64, 32): 4 * (64*68 + 32*68 + 64*36) = 35328 bytes
    assert gpu.flash_attention_regtile_config(64) == (64, 32)
    assert gpu.source.flash_attention_regtile_smem_bytes(64, 64, 32) == 35328


# ---------------------------------------------------------------------------
# what each rung claims, checked in its compiled code
# ---------------------------------------------------------------------------

KERNEL_RUNGS = [r.name for r in ladder.RUNGS if r.kernel]


@needs_nvrtc
@pytest.mark.parametrize("name", KERNEL_RUNGS)
@pytest.mark.parametrize("d", [64, 128])
def test_each_rung_holds_the_instruction_it_is_about(name, d):
    from lessons.gpu.compile import compile_ptx

    r = ladder.rung(name)
    ptx = compile_ptx(ladder.rung_build(r, d), "sm_80")
    assert r.ptx_grep in ptx
    if name == "regtile":             # the point of the rung: vector shared loads feed the S loop
        assert ptx.count("ld.shared.v4.f32") >= 6
        assert "ld.global.nc.v4.f32" in ptx   # and 16-byte loads from HBM
    if name == "scalar":
        assert "ld.shared.v4.f32" not in ptx
    if name == "mma_async":           # ldmatrix for K and V, cp.async into two stages, waiting for one tile
        assert "ldmatrix.sync.aligned.m8n8.x2.shared.b16" in ptx and "cp.async.cg.shared.global" in ptx
        assert "cp.async.wait_group 1" in ptx and "cp.async.commit_group" in ptx
    if name == "mma":
        assert "ldmatrix" not in ptx and "cp.async" not in ptx
    if name == "mma_fa2":             # ldmatrix.x4 (.trans for V), cp.async stages, exp2 (tests/test_gpu_fa2.py has more)
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "cp.async.wait_group 1" in ptx


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [4, 36, 64, 128, 256])
def test_register_tiled_kernel_compiles_without_spills(arch, d):
    res = gpu.compile_kernel(gpu.flash_attention_regtile_build(d), arch).resources["flash_attention_regtile"]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0
    assert res.smem_bytes == gpu.source.flash_attention_regtile_smem_bytes(d, *gpu.flash_attention_regtile_config(d))
    if d in (64, 128):                # what the rung's prediction states: at most 128 registers, 4 blocks per SM
        assert res.registers <= 128


# ---------------------------------------------------------------------------
# the registry and the recorded figures
# ---------------------------------------------------------------------------

def test_recorded_figures_are_the_shipped_csv():
    with open(ladder.RECORDED_DIR / "results.csv", newline="") as f:
        raw = [r for r in csv.DictReader(f) if r["n"] == "8192" and r["d"] == "64" and r["seconds"]]
    by = {(r["impl"], r["dtype"]): float(r["seconds"]) for r in raw}
    table = {e["name"]: e for e in ladder.ladder_table(8192, 64)}
    assert table["scalar"]["ms"] == pytest.approx(by["kernel", "float32"] * 1e3)
    assert table["scalar"]["x_naive"] == pytest.approx(by["naive", "float32"] / by["kernel", "float32"])
    assert table["mma"]["x_sdpa"] == pytest.approx(by["torch", "float16"] / by["mma", "float16"])
    # the register-tiled rung was added after the H200 run: it shows no number
    assert table["regtile"]["ms"] is None and table["regtile"]["figure"] == ladder.NOT_MEASURED
    # the README's headline: 13.6 TFLOP/s, 1.47x naive at d = 64; slower than naive at d = 128
    assert table["scalar"]["tflops"] == pytest.approx(13.6, abs=0.05)
    assert {e["name"]: e for e in ladder.ladder_table(8192, 128)}["scalar"]["x_naive"] < 1


def test_ladder_table_takes_live_rows_by_rung_name():
    rows = [dict(impl=name, n=1024, d=64, heads=8, causal=False, dtype=dt, seconds=s, tflops=1.0, note="")
            for name, dt, s in [("naive", "float32", 4.0), ("scalar", "float32", 2.0), ("regtile", "float32", 1.0),
                                ("naive", "float16", 4.0), ("mma", "float16", 0.5), ("sdpa", "float16", 0.25)]]
    t = {e["name"]: e for e in ladder.ladder_table(1024, 64, rows=rows)}
    assert t["regtile"]["x_naive"] == 4.0 and t["regtile"]["x_previous"] == 2.0
    assert t["mma"]["x_naive"] == 8.0 and t["mma"]["x_previous"] == 2.0 and t["sdpa"]["x_previous"] == 2.0


def test_rung_intensity_follows_the_io_model():
    from lessons.cost.traffic import flash_io, textbook_io

    # by hand for the naive rung: 4 N^2 d FLOPs over the textbook's HBM bytes (float32)
    c = textbook_io(8192, 64, element_size=4)
    assert ladder.rung_intensity("naive", 8192, 64) == pytest.approx(c.flops / c.hbm_bytes)
    # larger query blocks re-read K and V fewer times: the mma rung (64 rows, fp16) beats the scalar one
    assert ladder.rung_intensity("mma", 8192, 64) > ladder.rung_intensity("scalar", 8192, 64)
    with pytest.raises(ValueError, match="rung must be one of"):
        ladder.rung("warp-specialised")
    with pytest.raises(ValueError, match="no kernel"):
        ladder.rung_build("sdpa")


def test_ladder_figure_draws_every_measured_rung_and_labels_the_rest():
    from lessons.views.ladder import ladder_figure

    points = ladder.ladder_points(8192, (64, 128))
    fig = ladder_figure(points, label=ladder.RECORDED_LABEL)
    roof, bars = fig.axes
    measured = [p for p in points if p["tflops"] is not None]
    # one marker per measured (rung, d) on the roofline, at its measured TFLOP/s
    dots = sorted(float(line.get_ydata()[0]) for line in roof.get_lines() if line.get_marker() in ("o", "s"))
    assert dots == pytest.approx(sorted(p["tflops"] for p in measured))
    assert sorted(b.get_width() for b in bars.patches) == pytest.approx(sorted(p["tflops"] for p in measured))
    texts = [t.get_text() for t in bars.texts]
    assert sum(ladder.NOT_MEASURED in t for t in texts) == 6          # regtile, mma_async, mma_fa2; d = 64 and 128
    assert "recorded on one NVIDIA H200, 2026-11-30" in fig._suptitle.get_text()
    with pytest.raises(ValueError):
        ladder_figure([], label="x")


def test_speedup_claim_reads_the_recorded_ratios():
    rows = ladder.recorded_rows()
    claim = ladder.speedup_claim(8192)
    for d in (64, 128):
        naive16 = ladder.recorded("naive", 8192, d, "float16", rows)["seconds"]
        assert claim[d]["ours"][0] == "mma"
        assert claim[d]["ours"][1] == pytest.approx(naive16 / ladder.recorded("mma", 8192, d, rows=rows)["seconds"])
        assert claim[d]["sdpa"] == pytest.approx(naive16 / ladder.recorded("sdpa", 8192, d, rows=rows)["seconds"])


@needs_nvrtc
def test_rung_evidence_is_the_compiler_report():
    ev = {e["name"]: e for e in ladder.rung_evidence(64, "sm_80")}
    assert set(ev) == {"scalar", "regtile", "mma", "mma_async", "mma_fa2"}
    res = gpu.compile_kernel(gpu.flash_attention_regtile_build(64), "sm_80").resources["flash_attention_regtile"]
    assert ev["regtile"]["registers"] == res.registers and ev["regtile"]["spill_bytes"] == 0
    assert all(e["count"] > 0 for e in ev.values())


# ---------------------------------------------------------------------------
# the cp.async + ldmatrix tensor-core rung
# ---------------------------------------------------------------------------

def stored16(x, dtype):
    if dtype == "bfloat16":
        bits = gpu.to_bfloat16_bits(x)
        return bits, gpu.from_bfloat16_bits(bits).astype(np.float64)
    arr = np.ascontiguousarray(x, dtype=dtype)
    return arr, arr.astype(np.float64)


def values16(out, dtype):
    return (gpu.from_bfloat16_bits(out) if dtype == "bfloat16" else out).astype(np.float64)


ASYNC_CASES = [
    pytest.param((), 100, 150, 64, False, "float16", id="three-tiles-N-not-a-multiple"),
    pytest.param((2,), 70, 45, 64, True, "float16", id="causal-Nq>Nk-empty-rows"),
    pytest.param((), 33, 100, 128, True, "float16", id="d128-causal"),
    pytest.param((), 40, 70, 16, False, "bfloat16", id="bf16-d16"),
    pytest.param((), 20, 40, 256, False, "float16", id="d256"),
]


@pytest.mark.parametrize("lead, nq, nk, d, causal, dtype", ASYNC_CASES)
def test_async_tensor_core_kernel_matches_the_reference(backend, lead, nq, nk, d, causal, dtype):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    (q, q64), (k, k64), (v, v64) = (stored16(rng.standard_normal((*lead, n, d)), dtype) for n in (nq, nk, nk))
    out, lse = gpu.flash_attention_mma_async_gpu(q, k, v, causal=causal, bfloat16=dtype == "bfloat16",
                                                 backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref, ref_lse = reference(q64, k64, v64, causal)
    base, base_lse = baseline_attention(q64, k64, v64, dtype, causal=causal)
    assert_within_baseline(values16(out, dtype), ref, base)
    assert_within_baseline(lse, ref_lse, base_lse, what="lse")


def test_async_kernel_equals_the_synchronous_one_bit_for_bit(backend):
    # the same products in the same order: only how the bytes reach shared memory and registers changed
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 90, 64)).astype(np.float16) for _ in range(3))
    a = gpu.flash_attention_mma_async_gpu(q, k, v, causal=True, block_k=64, backend=backend)
    b = gpu.flash_attention_mma_gpu(q, k, v, causal=True, block_k=64, backend=backend)
    assert a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()
    again = gpu.flash_attention_mma_async_gpu(q, k, v, causal=True, block_k=64, backend=backend)
    assert again[0].tobytes() == a[0].tobytes()


def test_async_kernel_keeps_hidden_nan_out_and_visible_nan_in(backend):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((20, 16)).astype(np.float16) for _ in range(3))
    v[19, 3] = np.nan               # causal, Nq = Nk: only row 19 sees key 19
    out, lse = gpu.flash_attention_mma_async_gpu(q, k, v, causal=True, block_k=16, backend=backend)
    out = out.astype(np.float64)
    assert not np.isnan(out[:19]).any() and np.isnan(out[19, 3]) and not np.isnan(np.delete(out[19], 3)).any()


def test_async_trace_matches_the_numpy_trace(backend):
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((70 if i == 0 else 100, 64)).astype(np.float16) for i in range(3))
    block_k = gpu.flash_attention_mma_async_config(64)
    rows = [0, 17, 63, 64, 69]
    _, _, trace = gpu.flash_attention_mma_async_gpu(q, k, v, trace_rows=rows, backend=backend)
    _, ref = lessons.flash_attention(*(x.astype(np.float64) for x in (q, k, v)), tile=block_k, block_q=64,
                                     return_trace=True)
    for row in rows:
        mine, theirs = trace.row(row), ref.row(row)
        assert len(mine) == len(theirs) > 0
        # m and alpha exactly as NumPy's up to float32; l after P rounded to float16 for the mma: 1e-3
        assert gpu.first_divergence(mine, theirs, rtol=2e-3, atol=1e-3) is None, row


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_async_kernel_compiles_without_spills(arch, d):
    build = gpu.flash_attention_mma_async_build(d)
    res = gpu.compile_kernel(build, arch).resources["flash_attention_mma_async"]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0
    assert res.smem_bytes == 2 * gpu.source.flash_attention_mma_smem_bytes(d, gpu.flash_attention_mma_async_config(d))
    assert res.smem_bytes <= 48 * 1024


def test_async_kernel_refuses_what_it_cannot_do():
    x = np.zeros((8, 16), np.float16)
    with pytest.raises(TypeError, match="float16"):
        gpu.flash_attention_mma_async_gpu(*[x.astype(np.float32)] * 3, backend="emulator")
    with pytest.raises(ValueError, match="block_k must be 16, 32 or 64"):
        gpu.flash_attention_mma_async_gpu(x, x, x, block_k=48, backend="emulator")
    with pytest.raises(ValueError, match="two stages"):
        gpu.flash_attention_mma_async_config(256, 64)
    # by hand: two stages of K and V, 2 bytes each: 8 * block_k * (d + 8) <= 49152
    assert [gpu.flash_attention_mma_async_config(d) for d in (64, 80, 96, 176, 192)] == [64, 64, 32, 32, 16]

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
from test_gpu_kernels import POISONS, assert_trace_follows_numpy, forward_poison_check

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


@pytest.mark.parametrize("poison", POISONS)
def test_register_tiled_rows_never_see_poison_they_cannot_see(backend, poison):
    # five 32-key tiles: the poisoned ones take the guarded P V loop, the clean ones the plain FMAs, and the rows
    # that cannot see the poison stay bitwise the clean run's (p = 0 adds nothing, whatever v holds)
    def launch(q, k, v):
        return gpu.flash_attention_regtile_gpu(q, k, v, causal=True, backend=backend)
    out, lse, q64, k64, v64 = forward_poison_check(launch, 70, 130, 64, "float32", poison, [5, 40, 68])
    assert_close(out, lse, q64.astype(np.float32), k64.astype(np.float32), v64.astype(np.float32), True)


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
    from lessons.gpu.compile import compile_ptx, entry_ptx

    r = ladder.rung(name)
    build = ladder.rung_build(r, d)
    ptx = compile_ptx(build, build.arch or "sm_80")      # (the Hopper rungs compile for sm_90a only)
    if r.kernel in build.entries:                        # the rung's own entry point (one file holds two rungs)
        ptx = entry_ptx(ptx, r.kernel)
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
    if name.startswith("mma_fa2"):    # ldmatrix.x4 (.trans for V), cp.async stages, exp2 (tests/test_gpu_fa2.py has more)
        assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "cp.async.wait_group 1" in ptx
        assert ("vote.sync.any.pred" in ptx) == (name != "mma_fa2")   # the lazy rungs' vote (and those built on it)
        # the lean rung: the read of V's tile flags (which only its PTX holds) instead of the block-wide vote
        assert ("ld.global.nc.u32" in ptx) == (name == "mma_fa2_lean")
        assert ("bar.red.or" in ptx) == (name in ("mma_fa2", "mma_fa2_lazy", "mma_fa2_wide"))
    if name.startswith("wgmma"):      # TMA and mbarriers instead of cp.async and ldmatrix (test_gpu_wgmma.py has more)
        assert "cp.async.bulk.tensor.3d" in ptx and "mbarrier.try_wait.parity" in ptx
        assert "ldmatrix" not in ptx and "mma.sync" not in ptx and "cp.async.cg" not in ptx
        assert ("wgmma.wait_group.sync.aligned 1" in ptx) == (name != "wgmma")
        assert ("bar.arrive" in ptx) == (name == "wgmma_pingpong")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [4, 36, 64, 128, 256])
def test_register_tiled_kernel_compiles_without_spills(arch, d):
    res = gpu.compile_kernel(gpu.flash_attention_regtile_build(d), arch).resources["flash_attention_regtile"]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0
    assert res.smem_bytes == gpu.source.flash_attention_regtile_smem_bytes(d, *gpu.flash_attention_regtile_config(d))
    if d in (64, 128):                # what the rung's prediction states: at most 128 registers, 4 blocks per SM
        assert res.registers <= 128


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [64, 128])
def test_register_tiled_sweep_tiles_compile_without_spills_and_say_where_their_memory_is(arch, d):
    """The tuning sweep's tiles (scripts/tune_tiles.py --rung regtile): those over 48 KiB are built with their
    shared memory dynamic, the rest exactly as the rung's default build (no define added)."""
    smem = gpu.source.flash_attention_regtile_smem_bytes
    for bq, bk in gpu.source.REGTILE_SWEEP[d]:
        build = gpu.flash_attention_regtile_build(d, "float32", False, bq, bk)
        res = gpu.compile_kernel(build, arch).resources["flash_attention_regtile"]
        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0, (bq, bk)
        dynamic = smem(d, bq, bk) > 48 * 1024
        assert ("REGTILE_DYNAMIC_SMEM", 1) in build.defines if dynamic else len(build.defines) == 3
        assert (res.smem_bytes, build.dynamic_smem_bytes) == ((0, smem(d, bq, bk)) if dynamic else (smem(d, bq, bk), 0))


@pytest.mark.parametrize("d, block_q, block_k", [(64, 64, 64), (128, 64, 32), (128, 64, 64)])
def test_register_tiled_kernel_with_dynamic_shared_memory_matches_the_reference(backend, d, block_q, block_k):
    assert gpu.source.flash_attention_regtile_smem_bytes(d, block_q, block_k) > 48 * 1024     # (what is tested)
    rng = np.random.default_rng(d + block_k)
    q = rng.standard_normal((1, 2, 100, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 150, d)).astype(np.float32) for _ in range(2))
    for causal in (False, True):
        out, lse = gpu.flash_attention_regtile_gpu(q, k, v, causal=causal, block_q=block_q, block_k=block_k,
                                                   backend=backend)
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        assert_close(out, lse, q, k, v, causal)
        # the same tiles in static shared memory where they fit: the same arithmetic, the same bits
        if gpu.source.flash_attention_regtile_smem_bytes(d, 32, block_k) <= 48 * 1024:
            small = gpu.flash_attention_regtile_gpu(q, k, v, causal=causal, block_q=32, block_k=block_k,
                                                    backend=backend)
            assert small[0].tobytes() == out.tobytes() and small[1].tobytes() == lse.tobytes()


def test_register_tiled_tiles_past_99_kib_are_refused_by_name():
    with pytest.raises(ValueError, match=r"block_q=64, block_k=64 with head_dim=256 need \d+ bytes of shared memory, "
                                         r"more than the 101376"):
        gpu.flash_attention_regtile_config(256, 64, 64)
    assert gpu.flash_attention_regtile_config(128, 64, 64) == (64, 64)          # 85 KiB: taken, dynamic


# ---------------------------------------------------------------------------
# the registry and the recorded figures
# ---------------------------------------------------------------------------

def _csv_seconds(path=None):
    """{(impl, n, d, dtype): seconds} of the recorded forward CSV, read with the csv module alone."""
    with open(path or ladder.RECORDED_CSV, newline="") as f:
        return {(r["impl"], int(r["n"]), int(r["d"]), r["dtype"]): float(r["seconds"])
                for r in csv.DictReader(f) if r["seconds"] and r["causal"] == "False"}


# the rung names of the registry against the impl column of benchmarks/gpu_attention.py
CSV_IMPL = {"naive": "naive", "scalar": "kernel", "regtile": "regtile", "mma": "mma", "mma_async": "mma_async",
            "mma_fa2": "mma_fa2", "mma_fa2_lazy": "mma_fa2_lazy", "mma_fa2_wide": "mma_fa2_wide",
            "mma_fa2_lean": "mma_fa2_lean", "wgmma": "wgmma", "wgmma_overlap": "wgmma_overlap",
            "wgmma_pingpong": "wgmma_pingpong", "sdpa": "torch"}
#: the rungs the recorded run measured (the lazy, wide and lean FA-2 rungs and the Hopper rungs came after it)
MEASURED = [r for r in ladder.RUNGS if r.impl is not None]


def test_recorded_run_is_the_2026_12_01_one_and_its_label_says_so():
    assert ladder.RECORDED_CSV.parent.parent.name == "gpu_h200_2026-12-01"
    readme = (ladder.RECORDED_DIR / "README.md").read_text()
    env = (ladder.RECORDED_DIR / "env.txt").read_text()
    assert "commit 5ea12bd" in readme and ladder.RECORDED_LABEL.endswith("commit 5ea12bd)")
    assert "580.159.04" in env and "driver 580.159.04" in ladder.RECORDED_LABEL
    assert "CUDA 13.0" in readme and "CUDA 13.0" in ladder.RECORDED_LABEL
    assert "NVIDIA H200" in env and ladder.RECORDED_LABEL.startswith("recorded on one NVIDIA H200, 2026-12-01")
    # the short label (for legends) is the long one's machine and date
    assert ladder.RECORDED_ON == "recorded on one NVIDIA H200, 2026-12-01"
    assert ladder.RECORDED_LABEL.startswith(ladder.RECORDED_ON + " (")
    # the run before it stays in the repository: its Nsight Compute notes and the SDPA backends
    assert (ladder.PROFILED_DIR / "sdpa_backends.txt").is_file() and "2026-11-30" in ladder.PROFILED_LABEL
    assert all("2026-11-30" in r.limit for r in ladder.RUNGS if "ncu" in r.limit)


@pytest.mark.parametrize("d", [64, 128])
def test_recorded_figures_are_the_shipped_csv(d):
    by = _csv_seconds()
    table = {e["name"]: e for e in ladder.ladder_table(8192, d)}
    naive16 = by["naive", 8192, d, "float16"]
    for later in ("mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean", "wgmma", "wgmma_overlap", "wgmma_pingpong"):
        assert table[later]["figure"] == ladder.NOT_MEASURED and table[later]["ms"] is None
        assert (later, 8192, d, "float16") not in by
    for r in MEASURED:
        e, seconds = table[r.name], by[CSV_IMPL[r.name], 8192, d, r.dtype]
        assert r.impl == CSV_IMPL[r.name] and e["figure"] != ladder.NOT_MEASURED
        assert e["ms"] == pytest.approx(seconds * 1e3)
        assert e["tflops"] == pytest.approx(4 * 8192**2 * d * 8 / seconds / 1e12)
        assert e["x_naive"] == pytest.approx(by["naive", 8192, d, r.dtype] / seconds)
        assert e["x_sdpa"] == pytest.approx(by["torch", 8192, d, "float16"] / seconds)
    # the previous rung of the FA-2 rung is the cp.async one, both fp16
    assert table["mma_fa2"]["x_previous"] == pytest.approx(by["mma_async", 8192, d, "float16"]
                                                           / by["mma_fa2", 8192, d, "float16"])
    assert table["sdpa"]["x_naive"] == pytest.approx(naive16 / by["torch", 8192, d, "float16"])


def test_recorded_headline_numbers_of_the_readme():
    # the README of the run: register tiling 2.7x / 1.4x naive, the FA-2 rung 0.43x / 0.30x SDPA,
    # 187.3 / 185.8 TFLOP/s; the scalar rung slower than naive at d = 128
    t64 = {e["name"]: e for e in ladder.ladder_table(8192, 64)}
    t128 = {e["name"]: e for e in ladder.ladder_table(8192, 128)}
    assert round(t64["regtile"]["x_naive"], 1) == 2.7 and round(t128["regtile"]["x_naive"], 1) == 1.4
    assert round(t64["mma_fa2"]["x_sdpa"], 2) == 0.43 and round(t128["mma_fa2"]["x_sdpa"], 2) == 0.30
    assert round(t64["mma_fa2"]["tflops"], 1) == 187.3 and round(t128["mma_fa2"]["tflops"], 1) == 185.8
    assert t128["scalar"]["x_naive"] < 1


def test_rung_texts_agree_with_the_recorded_run():
    """The measured outcomes quoted in the rungs' texts, computed from the CSV."""
    by = _csv_seconds()

    def x(a, b, d, dt):                     # how many times faster rung a is than rung b
        return by[CSV_IMPL[b], 8192, d, dt] / by[CSV_IMPL[a], 8192, d, dt]

    reg, fa2, asy = ladder.rung("regtile").predicted, ladder.rung("mma_fa2").predicted, ladder.rung("mma_async").predicted
    assert f"{x('regtile', 'scalar', 64, 'float32'):.1f}x the scalar rung" in reg
    assert f"{x('regtile', 'scalar', 128, 'float32'):.1f}" == f"{x('regtile', 'scalar', 64, 'float32'):.1f}"
    assert (f"{x('regtile', 'naive', 64, 'float32'):.1f}x naive at d = 64 and "
            f"{x('regtile', 'naive', 128, 'float32'):.1f}x at d = 128") in reg and "not met" in reg
    assert f"{x('mma_fa2', 'mma', 64, 'float16'):.1f}x / {x('mma_fa2', 'mma', 128, 'float16'):.1f}x the mma rung" in fa2
    assert f"{x('mma_fa2', 'sdpa', 64, 'float16'):.2f}x / {x('mma_fa2', 'sdpa', 128, 'float16'):.2f}x SDPA" in fa2
    assert f"{x('mma_async', 'mma', 128, 'float16'):.2f}x the mma rung" in asy
    assert f"at d = 64 it is {x('mma_async', 'mma', 64, 'float16'):.2f}x, no gain" in asy
    assert x("mma_async", "mma", 64, "float16") < 1 < x("mma_async", "mma", 128, "float16")
    split = ladder.decode_rung("paged_decode_split").predicted
    pct = ladder.decode_recorded("paged_decode_split")
    assert (f"{pct[64, 4096]:.0f}% at 64 x 4096, {pct[8, 32768]:.0f}% at 8 x 32768, "
            f"{pct[1, 131072]:.0f}% at 1 x 131072") in split


def test_a_rung_without_rows_shows_not_measured():
    # the mechanism for a rung added after a run: the 2026-11-30 run has no register-tiled,
    # cp.async or FA-2 rows, so those rungs get no number from it
    old = ladder.recorded_rows(ladder.PROFILED_DIR / "results.csv")
    table = {e["name"]: e for e in ladder.ladder_table(8192, 64, rows=old)}
    for name in ("regtile", "mma_async", "mma_fa2"):
        assert table[name]["ms"] is None and table[name]["figure"] == ladder.NOT_MEASURED
    assert table["mma"]["figure"] != ladder.NOT_MEASURED
    # and the previous measured rung of the mma rung is then the scalar one
    assert table["mma"]["x_previous"] == pytest.approx(table["scalar"]["ms"] / table["mma"]["ms"])
    assert ladder.NOT_MEASURED in ladder.ladder_markdown(8192, 64, rows=old)


def test_the_compact_table_and_the_notes_hold_each_rungs_text_once():
    # the table without prose: 6 columns, one row per rung with the same figures and ratios as the full one
    full, compact = ladder.ladder_markdown(8192, 128), ladder.ladder_markdown(8192, 128, notes=False)
    full_rows, compact_rows = full.splitlines(), compact.splitlines()
    assert len(full_rows) == len(compact_rows) == 2 + len(ladder.RUNGS)
    assert compact_rows[0] == "| rung | PTX holds | time, TFLOP/s | x naive | x previous | of SDPA |"
    for r, f, c in zip(ladder.RUNGS, full_rows[2:], compact_rows[2:]):
        cells_full, cells_compact = f.split(" | "), c.split(" | ")
        assert len(cells_compact) == len(cells_full) - 2 == 6
        assert cells_full[0] == cells_compact[0] and cells_full[3:] == cells_compact[1:]
        assert r.changed not in c and r.predicted not in c
    # the notes: every rung's prose, each once, in ladder order
    notes = ladder.rung_notes_markdown()
    at = [notes.index(f"**{r.title}** ({r.dtype}, `{r.name}`)") for r in ladder.RUNGS]
    assert at == sorted(at)
    for r in ladder.RUNGS:
        assert notes.count(f"* *what changed:* {r.changed}\n") == 1 and f"* *predicted effect:* {r.predicted}\n" in notes
        assert f"* *what bounds it:* {r.limit}" in notes
    assert "`paged_decode_cp_async`" in ladder.rung_notes_markdown(ladder.DECODE_RUNGS)
    with pytest.raises(TypeError, match="notes"):
        ladder.ladder_markdown(8192, 64, notes="no")
    with pytest.raises(TypeError, match="rungs must be"):
        ladder.rung_notes_markdown(["naive"])


def test_ladder_table_takes_live_rows_by_rung_name():
    rows = [dict(impl=name, n=1024, d=64, heads=8, causal=False, dtype=dt, seconds=s, tflops=1.0, note="")
            for name, dt, s in [("naive", "float32", 4.0), ("scalar", "float32", 2.0), ("regtile", "float32", 1.0),
                                ("naive", "float16", 4.0), ("mma", "float16", 0.5), ("sdpa", "float16", 0.25)]]
    t = {e["name"]: e for e in ladder.ladder_table(1024, 64, rows=rows)}
    assert t["regtile"]["x_naive"] == 4.0 and t["regtile"]["x_previous"] == 2.0
    assert t["mma"]["x_naive"] == 8.0 and t["mma"]["x_previous"] == 2.0 and t["sdpa"]["x_previous"] == 2.0


def test_rung_intensity_follows_the_io_model():
    from lessons.cost.traffic import textbook_io

    # by hand for the naive rung: 4 N^2 d FLOPs over the textbook's HBM bytes (float32)
    c = textbook_io(8192, 64, element_size=4)
    assert ladder.rung_intensity("naive", 8192, 64) == pytest.approx(c.flops / c.hbm_bytes)
    # larger query blocks re-read K and V fewer times: the mma rung (64 rows, fp16) beats the scalar one
    assert ladder.rung_intensity("mma", 8192, 64) > ladder.rung_intensity("scalar", 8192, 64)
    with pytest.raises(ValueError, match="rung must be one of"):
        ladder.rung("warp-specialised")
    with pytest.raises(TypeError, match="rung must be a rung's name"):
        ladder.rung(None)
    with pytest.raises(ValueError, match="no kernel"):
        ladder.rung_build("sdpa")


def test_ladder_figure_draws_every_measured_rung_and_labels_the_rest():
    from lessons.views.ladder import ladder_figure

    points = ladder.ladder_points(8192, (64, 128))
    fig = ladder_figure(points, label=ladder.RECORDED_LABEL)
    roof, bars = fig.axes
    measured = [p for p in points if p["tflops"] is not None]
    assert len(measured) == 2 * len(MEASURED) and len(points) == 2 * len(ladder.RUNGS)  # all but the later rungs
    # one marker per measured (rung, d) on the roofline, at its measured TFLOP/s
    dots = sorted(float(line.get_ydata()[0]) for line in roof.get_lines() if line.get_marker() in ("o", "s"))
    assert dots == pytest.approx(sorted(p["tflops"] for p in measured))
    assert sorted(b.get_width() for b in bars.patches) == pytest.approx(sorted(p["tflops"] for p in measured))
    unmeasured = [r.name for r in ladder.RUNGS if r.impl is None]
    assert unmeasured == ["regtile_wide", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean", "wgmma", "wgmma_overlap",
                          "wgmma_pingpong"]
    assert sum(ladder.NOT_MEASURED in t.get_text() for t in bars.texts) == 2 * len(unmeasured)    # d = 64, 128
    assert ladder.RECORDED_LABEL in fig._suptitle.get_text()
    # a run without some rungs: each of them is labelled, never drawn
    old = ladder.ladder_points(8192, (64, 128), rows=ladder.recorded_rows(ladder.PROFILED_DIR / "results.csv"))
    fig = ladder_figure(old, label="x")
    assert sum(ladder.NOT_MEASURED in t.get_text() for t in fig.axes[1].texts) == 20  # 10 rungs x 2 head dims
    with pytest.raises(ValueError):
        ladder_figure([], label="x")


def test_speedup_claim_reads_the_recorded_ratios():
    by = _csv_seconds()
    claim = ladder.speedup_claim(8192)
    for d in (64, 128):
        naive16 = by["naive", 8192, d, "float16"]
        # our fastest rung is the FA-2 one: naive fp16 time over its time
        assert claim[d]["ours"][0] == "mma_fa2"
        assert claim[d]["ours"][1] == pytest.approx(naive16 / by["mma_fa2", 8192, d, "float16"])
        assert claim[d]["sdpa"] == pytest.approx(naive16 / by["torch", 8192, d, "float16"])
        assert claim[d]["holds"] is True
    # 14.72 ms / 0.73 ms and 17.28 ms / 1.48 ms (the run's README)
    assert round(claim[64]["ours"][1]) == 20 and round(claim[128]["ours"][1], 1) == 11.7
    # on hand-made rows where our best rung is only 1.5x naive, the claim does not hold
    rows = [dict(impl=i, n=64, d=d, heads=1, causal=False, dtype="float16", seconds=s, tflops=1.0, note="")
            for d in (64, 128) for i, s in (("naive", 3.0), ("mma", 2.0), ("sdpa", 1.0))]
    assert ladder.speedup_claim(64, rows)[64] == {"ours": ("mma", 1.5), "sdpa": 3.0, "holds": False}


def test_target_outcomes_from_the_csv():
    by = _csv_seconds()
    out = {o["what"].split(":")[0]: o for o in ladder.target_outcomes()}
    assert len(out) == len(ladder.TARGETS) == 4
    reg = out["fp32 CUDA-core forward"]
    assert reg["measured"] == pytest.approx({d: by["naive", 8192, d, "float32"] / by["regtile", 8192, d, "float32"]
                                             for d in (64, 128)})
    assert reg["met"] is False and reg["outcome"] == "not met"
    fa2 = out["fp16 tensor-core forward (mma.sync)"]
    assert fa2["measured"] == pytest.approx({d: by["torch", 8192, d, "float16"] / by["mma_fa2", 8192, d, "float16"]
                                             for d in (64, 128)})
    assert fa2["met"] is False
    hopper = out["Hopper rung (wgmma + TMA, sm_90a)"]
    assert hopper["rung"] == "wgmma_pingpong" and hopper["outcome"] == ladder.NOT_MEASURED and hopper["met"] is None
    assert hopper["measured"] == {64: None, 128: None}
    with open(ladder.DECODE_RECORDED, newline="") as f:
        split = {(int(r["num_seqs"]), int(r["seq_len"])): float(r["pct_of_copy"]) for r in csv.DictReader(f)
                 if r["kernel"].startswith("paged_decode_split")}
    dec = out["decode"]
    assert dec["measured"] == split and dec["met"] is False and max(split.values()) < 70
    assert dec["pending"] == ["paged_decode_prefetch", "paged_decode_cp_async"]      # built after the run
    md = ladder.targets_markdown()
    assert md.count("**not met**") == 3 and f"**{ladder.NOT_MEASURED}**" in md and "d = 64: 2.68x" in md
    # a run that reaches every goal meets them; a rung missing at one shape is not measured
    rows = [dict(impl=i, n=8192, d=d, heads=8, causal=False, dtype=dt, seconds=s, tflops=t, note="")
            for d in (64, 128) for i, dt, s, t in (("naive", "float32", 4.0, 1.0), ("regtile", "float32", 1.0, 4.0),
                                                    ("mma_fa2", "float16", 1.0, 60.0), ("torch", "float16", 1.0, 100.0))]
    done = {o["rung"]: o for o in ladder.target_outcomes(rows=rows, decode_rows=[])}
    assert done["regtile"]["met"] is True and done["mma_fa2"]["met"] is True
    assert done["paged_decode_split"]["outcome"] == ladder.NOT_MEASURED
    assert done["mma_fa2"]["pending"] == ["mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean"]


def test_a_target_counts_the_best_of_its_rungs_and_names_it():
    # the FA-2 target counts the lazy and the wide rung too: here the wide one reaches 0.6x at d = 64 and the lazy
    # one 0.55x at d = 128 while the FA-2 rung stays at 0.4x; the Hopper target counts its three rungs
    def row(impl, d, seconds):
        return dict(impl=impl, n=8192, d=d, heads=8, causal=False, dtype="float16", seconds=seconds,
                    tflops=100.0 / seconds, note="")
    rows = [row("torch", d, 1.0) for d in (64, 128)] + [row("mma_fa2", d, 2.5) for d in (64, 128)]
    rows += [row("mma_fa2_wide", 64, 1 / 0.6), row("mma_fa2_wide", 128, 2.0), row("mma_fa2_lazy", 128, 1 / 0.55)]
    rows += [row("mma_fa2_lean", d, 2.0) for d in (64, 128)]            # measured, never the best
    rows += [row("naive", d, 9.0) for d in (64, 128)] + [row("wgmma", 64, 1 / 0.8)]
    out = {o["rung"]: o for o in ladder.target_outcomes(rows=rows, decode_rows=[])}
    fa2 = out["mma_fa2"]
    assert fa2["measured"] == pytest.approx({64: 0.6, 128: 0.55}) and fa2["met"] is True and fa2["pending"] == []
    assert fa2["by"] == {64: "mma_fa2_wide", 128: "mma_fa2_lazy"}
    hopper = out["wgmma_pingpong"]           # one shape measured (by the plain Hopper rung): not measured as a whole
    assert hopper["measured"] == pytest.approx({64: 0.8, 128: None}) and hopper["by"] == {64: "wgmma", 128: None}
    assert hopper["met"] is None and hopper["outcome"] == ladder.NOT_MEASURED and hopper["pending"] == ["wgmma_overlap"]
    md = ladder.targets_markdown(rows=rows, decode_rows=[])
    assert "| d = 64: 0.60x (mma_fa2_wide), d = 128: 0.55x (mma_fa2_lazy) | **met** |" in md
    assert "| d = 64: 0.80x (wgmma), d = 128: - | **not yet measured on a GPU** |" in md
    assert "| `wgmma`, `wgmma_overlap`, `wgmma_pingpong` | d = 64: 75 TFLOP/s (8% of the tensor-core peak), " in md
    assert "(not yet measured: `wgmma_overlap`)" not in md        # (said once: the outcome is "not yet measured")


@needs_nvrtc
def test_the_lean_rungs_text_quotes_the_compiler_and_the_sass():
    # every number the lean rung's prediction types, against what NVRTC 12.9 and lessons.gpu.sass give now
    import re

    from lessons.gpu import sass
    from lessons.gpu.compile import nvrtc_version

    if nvrtc_version()[:2] != (12, 9):                  # the version the text names
        pytest.skip("the rung's text quotes NVRTC 12.9")
    text = ladder.rung("mma_fa2_lean").predicted
    assert ladder.rung("mma_fa2_lean").ptx_grep == "ld.global.nc.u32" and "ld.global.nc.u32" in ladder.rung("mma_fa2_lean").changed
    registers = {}
    for rung, entry in (("mma_fa2_lean", "flash_attention_mma_fa2_lean"), ("mma_fa2_wide", "flash_attention_mma_fa2_wide")):
        for d in (64, 128):
            for dtype in ("float16", "bfloat16"):
                build = (gpu.flash_attention_mma_fa2_lean_build if rung == "mma_fa2_lean" else
                         gpu.flash_attention_mma_fa2_wide_build)(d, dtype)
                for arch in ("sm_80", "sm_90"):
                    res = gpu.compile_kernel(build, arch).resources[entry]
                    registers.setdefault((rung, d), []).append(res.registers)
                    if rung == "mma_fa2_lean":
                        assert res.threads_per_block == 128 and 2 * 128 * res.registers <= 65536   # 2 blocks per SM
                        assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0, (d, dtype, arch, res)
            if rung == "mma_fa2_lean":
                kib = ladder.rung_build(rung, d).dynamic_smem_bytes // 1024
                tiles = " x ".join(map(str, ladder.rung_tiles(rung, d)))
                assert f"d = {d}, {tiles} tiles" in text or f"d = {d}, {tiles}: " in text
                assert f"{kib} KiB" in text
    def span(values):
        return f"{min(values)}-{max(values)}" if min(values) != max(values) else f"{min(values)}"
    assert f"{span(registers['mma_fa2_lean', 64])} registers (the wide rung: {span(registers['mma_fa2_wide', 64])})" in text
    assert f"{span(registers['mma_fa2_lean', 128])} registers (the wide rung: {span(registers['mma_fa2_wide', 128])})" in text
    assert "no spills" in text and "spilled" not in text
    if not sass.nvdisasm_available():
        return
    tiles = {(r, d): sass.tensor_tile(r, d, "sm_90") for r in ("mma_fa2_wide", "mma_fa2_lean") for d in (64, 128)}
    for d in (64, 128):
        lean, wide = tiles["mma_fa2_lean", d], tiles["mma_fa2_wide", d]
        assert (f"{lean.instructions} at d = {d}" in text or f"{lean.instructions} instructions at d = {d}" in text)
        assert f"{lean.per_hmma:.2f} per HMMA (the wide rung: {wide.instructions}, {wide.per_hmma:.2f})" in text
        assert f"from {wide.peak_share:.0%} to {lean.peak_share:.0%} of the tensor peak at d = {d}" in text \
            or f"from {wide.peak_share:.0%} to {lean.peak_share:.0%} at d = {d}" in text
    assert len(re.findall(r"\d+%", text)) == 4


@needs_nvrtc
def test_rung_evidence_is_the_compiler_report():
    ev = {e["name"]: e for e in ladder.rung_evidence(64, "sm_80")}
    assert set(ev) == {"scalar", "regtile", "regtile_wide", "mma", "mma_async", "mma_fa2", "mma_fa2_lazy",
                       "mma_fa2_wide", "mma_fa2_lean", "wgmma", "wgmma_overlap", "wgmma_pingpong"}
    assert ev["mma_fa2_lean"]["count"] == 3    # ld.global.nc.u32: V's first tile flag, then one a tile ahead per loop
    assert ev["wgmma_pingpong"]["count"] == 6          # bar.arrive: 5 hand-overs (2 per warpgroup, 1 at the end) + the first
    assert ev["wgmma_overlap"]["arch"] == "sm_90a" and ev["wgmma_overlap"]["spill_bytes"] == 0
    assert ev["wgmma"]["arch"] == "sm_90a" and ev["regtile"]["arch"] == "sm_80" and ev["wgmma"]["spill_bytes"] == 0
    res = gpu.compile_kernel(gpu.flash_attention_regtile_build(64), "sm_80").resources["flash_attention_regtile"]
    assert ev["regtile"]["registers"] == res.registers and ev["regtile"]["spill_bytes"] == 0
    wide = gpu.compile_kernel(gpu.flash_attention_regtile_wide_build(64), "sm_80").resources["flash_attention_regtile_wide"]
    assert ev["regtile_wide"]["registers"] == wide.registers and ev["regtile_wide"]["spill_bytes"] == 0
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
    # m and alpha exactly as NumPy's up to float32; l after P rounded to float16 for the mma: 1e-3
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=64, block_k=block_k)


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


def test_the_notebooks_sentences_hold_for_the_recorded_run():
    """What notebooks 06 (forward) and 10 (decode) say in words about the recorded run, checked against the numbers."""
    t = {d: {e["name"]: e for e in ladder.ladder_table(8192, d)} for d in (64, 128)}
    for d in (64, 128):
        assert t[d]["mma_fa2"]["x_naive"] >= 10                                   # an order of magnitude
        assert max(t[d], key=lambda n: (t[d][n]["x_naive"] or 0) if n != "sdpa" else 0) == "mma_fa2"   # fastest of ours
        assert 1.5 < t[d]["scalar"]["ms"] / t[d]["regtile"]["ms"] < 2.5           # nearly doubles
        assert 1.5 < t[d]["mma"]["ms"] / t[d]["mma_fa2"]["ms"] < 2.5              # roughly doubled
    assert t[64]["scalar"]["x_naive"] < 1.5 and t[128]["scalar"]["x_naive"] < 1   # little gain; slower
    assert t[128]["regtile"]["x_naive"] < t[64]["regtile"]["x_naive"] < 3         # short of 3x, most at 128
    assert t[64]["mma_async"]["x_previous"] < 1 < t[128]["mma_async"]["x_previous"]  # paid off at 128 only
    dec = {e["name"]: e["pct"] for e in ladder.decode_table()}
    for shape, pct in dec["paged_decode_split"].items():                           # several times either
        assert pct > 3 * max(dec["flash_decoding"][shape], dec["paged_decode"][shape]) and pct < 70
    assert min(dec["paged_decode_split"], key=dec["paged_decode_split"].get) == (8, 32768)   # furthest there


def test_the_quiz_quotes_the_recorded_run():
    from lessons.course.quiz import QUIZZES

    q = next(q for q in QUIZZES["06_kernel_ladder"] if "targets" in q.question)
    claim = ladder.speedup_claim()
    right = q.choices[q.answer]
    assert f"about {claim[64]['ours'][1]:.0f}x and {claim[128]['ours'][1]:.0f}x" in right
    assert all(claim[d]["holds"] for d in (64, 128))
    out = {o["rung"]: o for o in ladder.target_outcomes()}
    assert all(out[r]["met"] is False for r in ("regtile", "mma_fa2", "paged_decode_split"))
    reg, fa2 = out["regtile"]["measured"], out["mma_fa2"]["measured"]
    assert f"{reg[64]:.1f}x / {reg[128]:.1f}x (aim 3x)" in q.explanation
    assert f"{fa2[64]:.2f}x / {fa2[128]:.2f}x SDPA (aim 0.5x)" in q.explanation
    pct = out["paged_decode_split"]["measured"].values()
    assert f"{min(pct):.0f}-{max(pct):.0f}% of the copy rate" in q.explanation


def test_targets_markdown_keeps_the_hopper_target():
    """Notebook 11 shows the Hopper target alone: the row of the target whose rung is a Hopper rung."""
    every = ladder.targets_markdown().splitlines()
    hopper = ladder.targets_markdown(kind="hopper").splitlines()
    assert hopper[:2] == every[:2] and len(hopper) == 3
    assert hopper[2:] == [line for line in every[2:] if line.startswith("| Hopper rung")]
    assert all(f"`{r}`" in hopper[2] for r in ladder.HOPPER_RUNGS)
    assert "hopper" in ladder.TARGET_KINDS and hopper[2] in ladder.targets_markdown(kind="forward").splitlines()


def test_our_rungs_sit_below_their_roofs():
    """Notebook 06: our rungs all sit below their modelled roofs, most at a third of it or less."""
    from lessons.cost.traffic import H200

    share = [p["tflops"] * 1e12 / min(H200.peak_flops[p["precision"]], H200.hbm_bytes_per_s * p["intensity"])
             for p in ladder.ladder_points(8192, (64, 128)) if p["name"] != "sdpa" and p["tflops"] is not None]
    assert max(share) < 1
    assert sum(s <= 0.37 for s in share) > len(share) / 2


# ---------------------------------------------------------------------------
# bad arguments and malformed files: a clear error, never a silent "not measured"
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda: ladder.ladder_table(1000, 64), ValueError, r"no rows at n = 1000, d = 64; it has \(n, d\) \[\(1024, 64\)"),
    (lambda: ladder.ladder_table(8192, 96), ValueError, r"no rows at n = 8192, d = 96"),
    (lambda: ladder.ladder_markdown(2048, 64), ValueError, r"no rows at n = 2048"),
    (lambda: ladder.ladder_points(1000, (64, 128)), ValueError, r"no rows at n = 1000"),
    (lambda: ladder.speedup_claim(1000), ValueError, r"no rows at n = 1000, d = \[64, 128\]"),
    (lambda: ladder.target_outcomes(1000), ValueError, r"no rows at n = 1000"),
    (lambda: ladder.ladder_table(True, 64), TypeError, "n must be an int, got bool"),
    (lambda: ladder.ladder_table(8192, np.True_), TypeError, "d must be an int, got bool"),
    (lambda: ladder.ladder_table("8192", 64), TypeError, "n must be an int, got str"),
    (lambda: ladder.recorded("mma", 8192.0), TypeError, "n must be an int, got float"),
    (lambda: ladder.recorded(5), TypeError, "rung must be a Rung or a rung's name, got int"),
    (lambda: ladder.speedup_claim(True), TypeError, "n must be an int, got bool"),
    (lambda: ladder.ladder_points(8192, 64), TypeError, "ds must be a sequence of ints, got int"),
    (lambda: ladder.ladder_table(rows=5), TypeError, "rows must be a list of row dicts"),
    (lambda: ladder.attention_flops(-8192, 64), ValueError, "n must be at least 1"),
    (lambda: ladder.attention_flops(8192, 64, causal="no"), TypeError, "causal must be True or False"),
    (lambda: ladder.measure_ladder(0), ValueError, "n must be at least 1"),
    (lambda: ladder.measure_ladder(8192, True), TypeError, "d must be an int, got bool"),
    (lambda: ladder.measure_ladder(seed=-1), ValueError, "seed must be at least 0"),
])
def test_ladder_rejects_bad_arguments_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_head_dim_the_live_run_lacks_is_not_measured_not_an_error():
    rows = [dict(impl=i, n=64, d=64, heads=1, causal=False, dtype="float16", seconds=s, tflops=1.0, note="")
            for i, s in (("naive", 3.0), ("mma", 2.0), ("sdpa", 1.0))]
    claim = ladder.speedup_claim(64, rows)
    assert claim[64] == {"ours": ("mma", 1.5), "sdpa": 3.0, "holds": False}
    assert claim[128] == {"ours": None, "sdpa": None, "holds": None}
    points = ladder.ladder_points(64, (64, 128), rows=rows)
    assert {p["figure"] for p in points if p["d"] == 128} == {ladder.NOT_MEASURED}


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("change, match", [
    (lambda head, row: [head, row, "naive,1024"], r"line 3: 2 fields, the header has 10"),
    (lambda head, row: [head.replace("seconds", "secs"), row], r"missing \['seconds'\]"),
    (lambda head, row: [head, row.replace(",8,", ",x,", 1)], r"line 2: column 'heads' must be int, got 'x'"),
    (lambda head, row: [head, row.replace(",8,", ",,", 1)], r"line 2: column 'heads' must be a positive int"),
    (lambda head, row: [head, row.replace(",False,", ",no,", 1)], r"column 'causal' must be True or False"),
    (lambda head, row: [head, ",".join(row.split(",")[:6] + ["0"] + row.split(",")[7:])], r"'seconds' must be above 0"),
    (lambda head, row: [head, ",".join(row.split(",")[:7] + ["inf"] + row.split(",")[8:])], r"'tflops' must be a finite"),
])
def test_recorded_rows_reject_malformed_lines_naming_them(tmp_path, change, match):
    head, row = ladder.RECORDED_CSV.read_text().splitlines()[:2]
    with pytest.raises(ValueError, match=match):
        ladder.recorded_rows(_write(tmp_path / "results.csv", change(head, row)))


def test_decode_rows_reject_malformed_lines_naming_them(tmp_path):
    head, row = ladder.DECODE_RECORDED.read_text().splitlines()[:2]
    with pytest.raises(ValueError, match=r"line 3: 2 fields, the header has 9"):
        ladder.decode_recorded_rows(_write(tmp_path / "a.csv", [head, row, "x,1"]))
    with pytest.raises(ValueError, match=r"missing \['pct_of_copy'\]"):
        ladder.decode_recorded_rows(_write(tmp_path / "b.csv", [head.replace("pct_of_copy", "pct"), row]))
    fields = row.split(",")
    with pytest.raises(ValueError, match=r"line 2: columns \['pct_of_copy'\] must not be empty"):
        ladder.decode_recorded_rows(_write(tmp_path / "c.csv", [head, ",".join(fields[:7] + [""] + fields[8:])]))
    # the good line reads as the raw CSV says
    (got,) = ladder.decode_recorded_rows(_write(tmp_path / "d.csv", [head, row]))
    assert got["pct"] == float(fields[7]) and got["ms"] == pytest.approx(float(fields[4]) * 1e3)


def test_sdpa_backends_names_a_line_it_cannot_read(tmp_path):
    good = (ladder.PROFILED_DIR / "sdpa_backends.txt").read_text().splitlines()
    bad = tmp_path / "sdpa_backends.txt"
    bad.write_text("\n".join(good[:2] + ["N=8192 d=128 causal=False MATH fwd 2.1 ms"]) + "\n")
    with pytest.raises(ValueError, match=r"line 3: expected 'N=.. d=.. causal=.. <backend> fwd"):
        ladder.sdpa_backends(path=bad)
    bad.write_text("\n".join(good[:2] + ["N=8192 d=128 causal=False MATH fwd 2.1 ms fast TF/s"]) + "\n")
    with pytest.raises(ValueError, match="line 3"):
        ladder.sdpa_backends(path=bad)


def test_sdpa_kernels_says_what_it_needs_or_names_the_kernels():
    try:
        import torch
        usable = torch.cuda.is_available()
    except ImportError:
        torch, usable = None, False
    with pytest.raises(ValueError, match="heads"):
        ladder.sdpa_kernels(1024, 64, 0)
    if not usable:
        with pytest.raises(RuntimeError, match="torch" if torch is None else "CUDA device"):
            ladder.sdpa_kernels(1024, 64)
        return
    names = ladder.sdpa_kernels(1024, 64, 2)
    assert names and all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
    # an attention kernel among them (FlashAttention, cuDNN's fused SDPA or the memory-efficient one)
    assert any(word in n.lower() for n in names for word in ("flash", "sdpa", "fmha", "attention"))


def test_decode_tables_name_a_row_they_cannot_read():
    with pytest.raises(ValueError, match=r"rows\[0\] lacks \['name', 'num_seqs'"):
        ladder.decode_markdown(rows=[{}])
    with pytest.raises(TypeError, match="decode row dicts"):
        ladder.decode_table(rows=[1, 2])
    with pytest.raises(ValueError, match=r"rows\[1\] lacks \['pct'\]"):
        good = ladder.decode_recorded_rows()[0]
        ladder.decode_recorded("paged_decode", rows=[good, {k: v for k, v in good.items() if k != "pct"}])
    assert ladder.decode_table(rows=[])[0]["figure"] == ladder.NOT_MEASURED


def test_sdpa_backends_reads_forward_plus_backward_and_refuses_another_part():
    text = (ladder.PROFILED_DIR / "sdpa_backends.txt").read_text()
    both = ladder.sdpa_backends(8192, part="fwd+bwd")
    for backend, by_d in both.items():
        for d, tflops in by_d.items():
            line = next(l for l in text.splitlines() if l.startswith(f"N=8192 d={d} causal=False {backend} "))
            assert line.split("|")[1].split()[:1] == ["fwd+bwd"] and line.split("|")[1].split()[3] == f"{tflops}"
    assert both["FLASH_ATTENTION"] == {64: 266.0, 128: 300.0}
    assert ladder.sdpa_backends(8192)["FLASH_ATTENTION"] == {64: 281.4, 128: 335.8}
    with pytest.raises(ValueError, match="part must be 'fwd' or 'fwd\\+bwd', got 'bwd'"):
        ladder.sdpa_backends(8192, part="bwd")


# ---------------------------------------------------------------------------
# the tuning sweeps of a recorded run
# ---------------------------------------------------------------------------

def _write_sweep(folder, rung, timings):
    """A sweep CSV as scripts/tune_tiles.py writes it: ``timings`` {(d, block_q, block_k, min_blocks): seconds},
    the first per head dim the default, plus the FA-2 rung's reference row per head dim (twice as slow)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_tiles", ladder.ROOT / "scripts" / "tune_tiles.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    rows, seen = [], set()
    for (d, bq, bk, mb), seconds in timings.items():
        rows.append(dict(impl=rung, d=d, block_q=bq, block_k=bk, min_blocks=mb, default=d not in seen, n=8192,
                         heads=8, dtype="float16", seconds=seconds, tflops=4 * 8192**2 * d * 8 / seconds / 1e12,
                         registers=None, max_abs_diff=0.0, note=""))
        seen.add(d)
    for d in sorted(seen):
        slowest = 2 * max(s for (dd, *_), s in timings.items() if dd == d)
        rows.append(dict(impl="mma_fa2", d=d, block_q=128, block_k=64, min_blocks=2, default=False, n=8192, heads=8,
                         dtype="float16", seconds=slowest, tflops=1.0, registers=None, max_abs_diff=0.0, note=""))
    tune.add_ratios(rows)
    path = folder / ladder.SWEEP_FILES[rung]
    tune.write_results(rows, path.parent, "a sweep", path.stem)
    return rows


def test_best_tiles_and_the_sweep_table_from_a_recorded_sweep(tmp_path):
    _write_sweep(tmp_path, "mma_fa2_wide", {(64, 128, 64, 2): 1.0e-3, (64, 128, 32, 2): 0.8e-3,
                                            (128, 128, 32, 2): 2.0e-3, (128, 128, 64, 2): 2.5e-3})
    rows = ladder.recorded_sweep("mma_fa2_wide", tmp_path)
    assert len(rows) == 6 and rows[0]["default"] == "True" and rows[0]["seconds"] == 1.0e-3
    best = ladder.best_tiles("mma_fa2_wide", tmp_path)
    assert (best[64]["block_q"], best[64]["block_k"]) == (128, 32) and best[64]["x_best_default"] == pytest.approx(1.25)
    assert (best[128]["block_k"], best[128]["x_best_default"]) == (32, 1.0)        # the default is the fastest
    md = ladder.sweep_markdown("mma_fa2_wide", tmp_path)
    assert "| **64** | **mma_fa2_wide** | **128 x 32** | **2** | **0.800** |" in md
    assert "| 64 | mma_fa2_wide (default) | 128 x 64 | 2 | 1.000 |" in md and md.count("**128 x") == 2
    # x reference: the FA-2 rung's row (twice the slowest) over each row's
    assert "| 64 | mma_fa2_wide (default) | 128 x 64 | 2 | 1.000 | 137.4 | 1.00 | 2.00 |" in md      # 4 N^2 d x 8 heads in 1 ms
    # a run without a sweep of the rung, or a rung without a sweep
    assert ladder.recorded_sweep("mma_fa2_lazy", tmp_path) is None and ladder.best_tiles("regtile", tmp_path) is None
    assert "have not been timed on a GPU yet" in ladder.sweep_markdown("mma_fa2_lazy", tmp_path)
    with pytest.raises(ValueError, match="rung must be one of"):
        ladder.recorded_sweep("mma_fa2", tmp_path)
    with pytest.raises(TypeError, match="rung"):
        ladder.best_tiles(None, tmp_path)


@pytest.mark.parametrize("rung", sorted(ladder.SWEEP_FILES))
def test_each_rungs_default_tiles_are_the_fastest_its_recorded_sweep_found(rung):
    """Once a recorded run holds a timed sweep of a rung, the rung's default tiles must be the fastest it found
    (within 3%, the noise of one run): the ladder times the defaults."""
    best = ladder.best_tiles(rung)
    if best is None:
        pytest.skip(f"the recorded run ({ladder.RECORDED_DIR.name}) holds no timed sweep of {rung}")
    for d, row in best.items():
        assert row["x_best_default"] is not None and row["x_best_default"] <= 1.03, (rung, d, row)


def test_what_each_forward_goal_asks_for_in_tflops():
    # the goal times the recorded reference: naive CuPy in float32 for register tiling, SDPA for the tensor cores
    out = {o["rung"]: o for o in ladder.target_outcomes()}
    by = _csv_seconds()
    for d in (64, 128):
        naive32 = 4 * 8192**2 * d * 8 / by["naive", 8192, d, "float32"] / 1e12
        sdpa = 4 * 8192**2 * d * 8 / by["torch", 8192, d, "float16"] / 1e12
        assert out["regtile"]["needs"][d] == pytest.approx(3 * naive32, rel=1e-3)
        assert out["regtile"]["needs_peak"][d] == pytest.approx(3 * naive32 / 67, rel=1e-3)        # 67 TFLOP/s fp32
        assert out["mma_fa2"]["needs"][d] == pytest.approx(0.5 * sdpa, rel=1e-3)
        assert out["wgmma_pingpong"]["needs_peak"][d] == pytest.approx(0.75 * sdpa / 989, rel=1e-3)   # dense 16-bit
    # decode: the goal times the recorded copy rate (each row's TB/s over its share of it)
    with open(ladder.DECODE_RECORDED, newline="") as f:
        copy = [float(r["tb_per_s"]) * 100 / float(r["pct_of_copy"]) for r in csv.DictReader(f)]
    assert max(copy) - min(copy) < 1e-9 * max(copy)                    # one device copy rate for the whole run
    dec = out["paged_decode_split"]
    assert set(dec["needs"]) == {(64, 4096), (8, 32768), (1, 131072)}
    assert all(v == pytest.approx(0.7 * copy[0]) for v in dec["needs"].values())
    assert all(v == pytest.approx(0.7 * copy[0] / 4.8) for v in dec["needs_peak"].values())    # 4.8 TB/s HBM3e
    md = ladder.targets_markdown()
    assert "d = 128: 48 TFLOP/s (72% of the FP32 peak)" in md and "d = 64: 219 TFLOP/s (22% of the tensor-core peak)" in md
    assert f"| {0.7 * copy[0]:.1f} TB/s of K/V read ({0.7 * copy[0] / 4.8:.0%} of the HBM peak) |" in md

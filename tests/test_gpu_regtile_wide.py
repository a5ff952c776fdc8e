"""The wide register-tiled rung (flash_attention_regtile.cu with REGTILE_WIDE=1): against NumPy on the emulator
(and the GPU where one is present), with every tile pair its sweep times; its traces, empty rows and poison;
its tile rules; and what its text claims of the compiler (registers, no spills, no 4-byte shared loads)."""
import re

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu import ladder, source
from test_gpu_kernels import POISONS, assert_trace_follows_numpy, forward_poison_check, on_gpu
from test_gpu_ladder import CASES, assert_close

BACKENDS = [
    pytest.param("emulator", marks=pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler")),
    pytest.param("cupy", marks=on_gpu("regtile_wide")),          # (not where gpu_check.sh left the rung out)
]
needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available(), reason="CuPy/NVRTC not installed")
wide = gpu.flash_attention_regtile_wide_gpu


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.mark.parametrize("lead, nq, nk, d, causal", CASES)
def test_wide_kernel_matches_the_reference(backend, lead, nq, nk, d, causal):
    rng = np.random.default_rng(nq * 1000 + nk + d)
    q, k, v = (rng.standard_normal((*lead, n, d)).astype(np.float32) for n in (nq, nk, nk))
    out, lse = wide(q, k, v, causal=causal, backend=backend)
    assert out.shape == q.shape and out.dtype == np.float32 and lse.shape == q.shape[:-1]
    assert not np.isnan(out).any()
    assert_close(out, lse, q, k, v, causal)


SWEPT = [pytest.param(d, bq, bk, id=f"d{d}-{bq}x{bk}") for d in (64, 128) for bq, bk in source.REGTILE_WIDE_SWEEP[d]]


@pytest.mark.parametrize("d, block_q, block_k", SWEPT)
def test_every_tile_pair_the_sweep_times_matches_the_reference(backend, d, block_q, block_k):
    # more than one query block and key tile, a last tile cut short, causal rows that see nothing at first
    rng = np.random.default_rng(d + block_q + block_k)
    q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for n in (150, 200, 200))
    for causal in (False, True):
        out, lse = wide(q, k, v, causal=causal, block_q=block_q, block_k=block_k, backend=backend)
        assert_close(out, lse, q, k, v, causal)


def test_wide_rows_that_see_no_key_and_hidden_nan(backend):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((20, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 5, 8)).astype(np.float32)
    v[4] = np.nan                  # key 4 is seen only by row 19 (bottom-right causal, 20 rows, 5 keys)
    out, lse = wide(q, k, v, causal=True, backend=backend)
    assert np.all(out[:15] == 0) and np.all(np.isneginf(lse[:15]))       # rows 0..14 see nothing
    assert not np.isnan(out[:19]).any() and np.isnan(out[19]).all()      # NaN reaches only the row that sees it
    v[4] = 0
    out2, lse2 = wide(q, k, v, causal=True, backend=backend)
    np.testing.assert_array_equal(out2[:19], out[:19])
    assert_close(out2, lse2, q, k, v, True)
    out, lse = wide(q, k[:0], v[:0], backend=backend)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


@pytest.mark.parametrize("poison", POISONS)
def test_wide_rows_never_see_poison_they_cannot_see(backend, poison):
    # three 64-key tiles at d = 64: the poisoned ones take the guarded P V loop (4 keys of P per load there
    # too), the clean ones the plain FMAs; rows that cannot see the poison stay bitwise the clean run's
    def launch(q, k, v):
        return wide(q, k, v, causal=True, backend=backend)
    out, lse, q64, k64, v64 = forward_poison_check(launch, 70, 130, 64, "float32", poison, [5, 40, 68])
    assert_close(out, lse, q64.astype(np.float32), k64.astype(np.float32), v64.astype(np.float32), True)


def test_wide_kernel_is_bitwise_reproducible_and_writes_nothing_into_the_next_head(backend):
    rng = np.random.default_rng(6)
    q = rng.standard_normal((3, 70, 64)).astype(np.float32)
    k = rng.standard_normal((3, 40, 64)).astype(np.float32)
    v = (rng.standard_normal((3, 40, 64)) + 100 * np.arange(3)[:, None, None]).astype(np.float32)
    runs = [wide(q, k, v, causal=True, backend=backend) for _ in range(3)]
    for out, lse in runs[1:]:
        assert out.tobytes() == runs[0][0].tobytes() and lse.tobytes() == runs[0][1].tobytes()
    assert_close(*runs[0], q, k, v, True)


@pytest.mark.parametrize("d", [64, 128])
def test_wide_trace_follows_numpy(backend, d):
    rng = np.random.default_rng(7 + d)
    q = rng.standard_normal((150, d)).astype(np.float32)
    k = (2 * rng.standard_normal((200, d))).astype(np.float32)
    v = rng.standard_normal((200, d)).astype(np.float32)
    block_q, block_k = gpu.flash_attention_regtile_wide_config(d)
    rows = [0, 7, 8, 63, 64, 127, 149]             # first and last rows of a thread's 8 and of a block
    _, _, trace = wide(q, k, v, trace_rows=rows, backend=backend)
    assert_trace_follows_numpy(trace, q, k, v, rows, block_q=block_q, block_k=block_k, tiles=-(-200 // block_k))


def test_wide_tile_rules():
    cfg, smem = gpu.flash_attention_regtile_wide_config, source.flash_attention_regtile_smem_bytes
    assert cfg(64) == cfg(128) == cfg(160) == (64, 64)
    assert cfg(164) == (64, 32) and cfg(236) == (64, 32) and cfg(240) == (32, 32) and cfg(256) == (32, 32)
    assert smem(160, 64, 64) == source.REGTILE_DYNAMIC_LIMIT < smem(164, 64, 64)       # the edges of the rule
    assert smem(236, 64, 32) <= source.REGTILE_DYNAMIC_LIMIT < smem(240, 64, 32)
    assert cfg(128, block_q=32) == (32, 64) and cfg(64, block_k=128) == (64, 128)
    for d, tiles in source.REGTILE_WIDE_SWEEP.items():
        assert tiles[0] == cfg(d) and len(set(tiles)) == len(tiles)
        assert all(cfg(d, bq, bk) == (bq, bk) for bq, bk in tiles)
    # the build: dynamic shared memory past 48 KiB, static below; its own entry point
    big, small = source.flash_attention_regtile_wide_build(128), source.flash_attention_regtile_wide_build(64, "float32",
                                                                                                          False, 32, 64)
    assert big.entries == ("flash_attention_regtile_wide",) and dict(big.defines)["REGTILE_WIDE"] == 1
    assert big.smem_bytes == 0 and big.dynamic_smem_bytes == smem(128, 64, 64) == 84992
    assert small.smem_bytes == smem(64, 32, 64) == 34816 and small.dynamic_smem_bytes == 0


def test_wide_kernel_refuses_what_it_cannot_do():
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(TypeError, match="float32"):
        wide(x.astype(np.float16), x.astype(np.float16), x.astype(np.float16), backend="emulator")
    odd = np.zeros((8, 18), np.float32)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 4"):
        wide(odd, odd, odd, backend="emulator")
    with pytest.raises(ValueError, match="block_q must be 8, 16, 32 or 64"):
        wide(x, x, x, block_q=128, backend="emulator")       # (the plain build's 128 is 16 rows a thread here)
    with pytest.raises(ValueError, match="block_k must be 16, 32, 64 or 128"):
        wide(x, x, x, block_k=8, backend="emulator")
    with pytest.raises(ValueError, match="shared memory"):
        gpu.flash_attention_regtile_wide_config(256, 64, 64)
    with pytest.raises(TypeError, match="block_q"):
        gpu.flash_attention_regtile_wide_config(64, True, 64)
    with pytest.raises(ValueError, match="float32"):
        source.flash_attention_regtile_wide_build(64, "float16")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [4, 36, 64, 128, 200, 256])
def test_wide_kernel_compiles_without_spills(arch, d):
    build = source.flash_attention_regtile_wide_build(d)
    res = gpu.compile_kernel(build, arch).resources["flash_attention_regtile_wide"]
    assert res.spill_store_bytes == 0 and res.spill_load_bytes == 0 and res.stack_bytes == 0
    assert res.smem_bytes + res.dynamic_smem_bytes == source.flash_attention_regtile_smem_bytes(
        d, *gpu.flash_attention_regtile_wide_config(d))


@needs_nvrtc
@pytest.mark.parametrize("d, block_q, block_k", SWEPT)
def test_every_swept_tile_pair_compiles_without_spills(d, block_q, block_k):
    build = source.flash_attention_regtile_wide_build(d, "float32", False, block_q, block_k)
    for arch in ("sm_80", "sm_90"):
        res = gpu.compile_kernel(build, arch).resources["flash_attention_regtile_wide"]
        assert res.spill_bytes == 0 and res.registers <= 255, (arch, res)


@needs_nvrtc
@pytest.mark.parametrize("d", [64, 128])
def test_wide_build_reads_p_four_keys_at_a_time(d):
    # The plain build reads P one key per load: 4-byte shared loads, one per row of a thread. The wide build
    # reads it 16 bytes at a time; were it to read P one key at a time, its P V loop would hold at least one
    # 4-byte load per row of a thread (8). NVRTC 12.9 does not always emit the same PTX for the same source:
    # now and then it splits one 4-byte piece off a 16-byte load it marks with a used_bytes_mask pragma, so
    # the test allows fewer than a thread's rows, not none.
    from lessons.cost.register_tiles import register_tile
    from lessons.gpu.compile import compile_ptx

    plain = compile_ptx(source.flash_attention_regtile_build(d), "sm_80")
    mine = compile_ptx(source.flash_attention_regtile_wide_build(d), "sm_80")
    rows = register_tile(d, *gpu.flash_attention_regtile_wide_config(d), wide=True).rows
    assert len(re.findall(r"ld\.shared\.f32\b", plain)) >= 1
    assert len(re.findall(r"ld\.shared\.f32\b", mine)) < rows
    assert mine.count("ld.shared.v4.f32") > plain.count("ld.shared.v4.f32")
    assert ".entry flash_attention_regtile_wide(" in mine and ".entry flash_attention_regtile(" not in mine


@needs_nvrtc
def test_the_rungs_text_quotes_the_compiler():
    from lessons.gpu.compile import nvrtc_version

    # The text gives a range where NVRTC 12.9 is not repeatable (the same source compiled twice may take 164
    # or 166 registers at d = 64); every count the compiler reports must lie in the range the text quotes.
    text = ladder.rung("regtile_wide").predicted
    if nvrtc_version()[:2] != (12, 9):                  # the version the text names
        pytest.skip("the rung's text quotes NVRTC 12.9")
    for d in (64, 128):
        build = ladder.rung_build("regtile_wide", d)
        quoted = re.search(rf"d = {d}: (\d+)(?:-(\d+))? registers", text)
        low, high = int(quoted[1]), int(quoted[2] or quoted[1])
        for arch in ("sm_80", "sm_90"):
            res = gpu.compile_kernel(build, arch).resources["flash_attention_regtile_wide"]
            assert low <= res.registers <= high and res.spill_bytes == 0, (d, arch, res.registers)
        assert f"{build.dynamic_smem_bytes:,} bytes".replace(",", " ") in text


def test_a_wrong_dtype_gets_a_hint_that_fits_it():
    x = np.zeros((8, 16), np.float32)
    with pytest.raises(TypeError, match="flash_attention_mma_gpu for 16-bit"):
        wide(x.astype(np.float16), x.astype(np.float16), x.astype(np.float16), backend="emulator")
    for other in (np.float64, np.dtype(">f4")):
        with pytest.raises(TypeError, match=r"astype\(np.float32\)"):
            wide(x.astype(other), x.astype(other), x.astype(other), backend="emulator")
        with pytest.raises(TypeError, match=r"astype\(np.float32\)"):
            gpu.flash_attention_regtile_gpu(x.astype(other), x.astype(other), x.astype(other), backend="emulator")

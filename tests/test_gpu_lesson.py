"""The "On the GPU" section of every notebook (lessons.gpu.lesson), checked on CPU.

Without a CUDA device each section must say that its kernel was compiled but not run,
report registers and shared memory for sm_80 and sm_90, and run the same CUDA C on the
CPU emulator. Here the emulator's numbers are checked against values computed another
way: the textbook reference (lessons.attention) on the notebook's data, hand-computed
split ranges, and the shared-memory formulas of the kernels' tiles.

The GPU branch is exercised too, with a stand-in device that runs the launchers on the
emulator backend (every check it makes is labelled "GPU"), so its bookkeeping is
tested on every machine; with a real device the last test runs every section on it.
"""
import os
import time
from pathlib import Path

import numpy as np
import pytest

import lessons
import lessons.gpu as gpu
from lessons.course.data import decode_query_case, softmax_demo_rows
from lessons.schedules.causal import causal_mask
from lessons.gpu import harness, launch, lesson, source
from lessons.gpu.compile import resources_text
from lessons.gpu.launch import Runner
from lessons.gpu.trace_compare import GpuRowTrace, comparison_lines, compare_rows, relative_difference, trace_table

needs_nvrtc = pytest.mark.skipif(not gpu.nvrtc_available() and not os.environ.get("CI"),
                                 reason="CuPy/NVRTC not installed: pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12")
needs_emulator = pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the emulator")
TOL = dict(atol=2e-5, rtol=2e-5)


def run(fn, **kwargs):
    return fn(use_device=False, **kwargs)


@pytest.fixture(scope="module")
def results():
    """Every notebook's section, run once without a device (use_device=False, so also on a GPU machine)."""
    return {
        "01": run(lesson.online_softmax_on_gpu),
        "02": run(lesson.flash_attention_on_gpu),
        "03": run(lesson.causal_on_gpu),
        "04": run(lesson.io_on_gpu),
        "04 tensor cores": run(lesson.tensor_cores_on_gpu),
        "05": run(lesson.paged_decode_on_gpu),
        "06": run(lesson.flash_decoding_on_gpu),
        "07": run(lesson.paged_gqa_on_gpu),
    }


NOTEBOOKS = ["01", "02", "03", "04", "04 tensor cores", "05", "06", "07"]


def text(result) -> str:
    """The summary with its wrapping undone (prose is wrapped at 100 columns)."""
    return " ".join(result.summary.split())


def emulator_check(result, index=0):
    checks = result.checks_on("emulator")
    assert checks, result.summary
    return checks[index]


# ---------------------------------------------------------------------------
# without a device: compiled, not run, resources
# ---------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_without_a_device_the_kernel_is_compiled_but_not_run(results, nb):
    r = results[nb]
    assert r.compiled
    assert "compiled for sm_80 and sm_90 with NVRTC" in r.status and "but not run" in r.status
    assert text(r).startswith(f"On the GPU: {r.title} {r.status}")
    assert not r.ran_on_device and not r.checks_on("GPU")
    assert "Nothing was timed" in text(r)
    archs = {}
    for res in r.resources:
        archs.setdefault(res.entry, set()).add(res.arch)
        assert res.reported and res.source != "device", res     # use_device=False: ptxas's numbers, on any machine
    assert archs and all(a == {"sm_80", "sm_90"} for a in archs.values())
    for res in r.resources:                       # every row of the table is printed
        assert f"{res.registers}" in text(r) and f"{res.smem_bytes:,}" in text(r)


@needs_nvrtc
@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_reported_shared_memory_is_what_the_tiles_need(results, nb):
    for res in results[nb].resources:
        d = dict(kv.split("=") for kv in res.config.replace(" FA_TRACE", "").split())
        d = {k: int(v) for k, v in d.items()}
        if res.entry == "online_softmax":
            expected = 4 * (d["TILE"] // 32)                                   # one float per warp
        elif res.entry == "flash_attention_forward":
            hd, bq, bk = d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"]
            expected = 4 * (bq * (hd + 1) + 2 * bk * (hd + 1) + bq * (bk + 1))  # q, k, v, p tiles
        elif res.entry == "flash_attention_mma":
            expected = 2 * 2 * d["BLOCK_K"] * (d["HEAD_DIM"] + 8)                # float16 k, v tiles, +8 padding
        elif res.entry == "flash_attention_mma_async":
            expected = 2 * 2 * 2 * d["BLOCK_K"] * (d["HEAD_DIM"] + 8)            # the same tiles, twice (two stages)
        elif res.entry in ("flash_attention_regtile", "flash_attention_regtile_wide"):
            hd, bq, bk = d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"]
            tiles = 4 * (bq * (hd + 4) + bk * (hd + 4) + bq * (bk + 4))          # q, k-then-v, p tiles, +4 padding
            dynamic = d.get("REGTILE_DYNAMIC_SMEM", 0) == 1                    # (over 48 KiB: asked for at launch)
            expected = 0 if dynamic else tiles
            assert res.dynamic_smem_bytes == (tiles if dynamic else 0), res
        elif res.entry == "flash_attention_mma_fa2":
            expected = 2 * 2 * 2 * d["BLOCK_K"] * d["HEAD_DIM"]                 # K, V tiles, two stages, swizzled
        elif res.entry == "flash_attention_mma_fa2_lazy":                      # the same stages, dynamic
            expected = 0
            assert res.dynamic_smem_bytes == 2 * 2 * 2 * d["BLOCK_K"] * d["HEAD_DIM"], res
        elif res.entry in ("flash_attention_mma_fa2_wide", "flash_attention_mma_fa2_lean"):  # stages and Q, dynamic
            expected = 0
            assert res.dynamic_smem_bytes == 2 * (4 * d["BLOCK_K"] + d["BLOCK_Q"]) * d["HEAD_DIM"], res
        elif res.entry == "flash_attention_mma_fa2_lean_v_flags":              # the lean rung's pre-pass: none
            expected = 0
            assert res.dynamic_smem_bytes == 0, res
        elif res.entry == "paged_decode_gqa_split":
            expected = source.paged_decode_split_smem_bytes(d["HEAD_DIM"], d["HEADS_PER_BLOCK"], res.dtype)
        elif res.entry == "merge_split_states":
            expected = 4 * (2 * 4 + 4 * d["HEAD_DIM"])                           # max, l, o of 4 warps
        elif res.entry in ("merge_splits", "mma_probe", "flash_attention_backward_preprocess"):
            expected = 0
        elif res.entry.startswith("flash_attention_backward_mma"):
            hd, bq, bk = d["HEAD_DIM"], d["DKDV_BLOCK_Q"], d["DQ_BLOCK_K"]   # 16-bit tiles, +8 padding
            expected = (2 * 2 * (64 + bq) * (hd + 8) + 2 * 4 * bq if res.entry.endswith("dkdv")
                        else 2 * 2 * bk * (hd + 8))
        elif res.entry.startswith("flash_attention_backward"):
            hd, bq, bk = d["HEAD_DIM"], d["BLOCK_Q"], d["BLOCK_K"]
            tiles = 2 * (bq + bk) * (hd + 1)                                   # q, dO, k, v tiles
            expected = 4 * (tiles + (2 * bk * (bq + 1) + 2 * bq if res.entry.endswith("dkdv") else bq * (bk + 1)))
        else:
            hd, bs, h = d["HEAD_DIM"], d["BLOCK_SIZE"], d["HEADS_PER_BLOCK"]
            expected = 4 * (h * (hd + 1) + 2 * bs * (hd + 1) + h * (bs + 1) + 3 * h)
        assert res.smem_bytes == expected, res
        assert 1 <= res.registers <= 255


def test_each_section_reports_only_the_entry_points_it_runs(results):
    if not results["05"].resources:
        pytest.skip("CuPy/NVRTC not installed")
    assert {r.entry for r in results["05"].resources} == {"paged_decode"}
    assert {r.entry for r in results["06"].resources} == {"paged_decode_split", "merge_splits"}
    assert {r.entry for r in results["07"].resources} == {"paged_decode"}
    assert {r.entry for r in results["04"].resources} == {"online_softmax", "flash_attention_forward", "paged_decode",
                                                          "paged_decode_split", "merge_splits", "flash_attention_mma",
                                                          "mma_probe", "flash_attention_backward_preprocess",
                                                          "flash_attention_backward_dkdv", "flash_attention_backward_dq",
                                                          "flash_attention_regtile", "flash_attention_regtile_wide",
                                                          "flash_attention_mma_async",
                                                          "paged_decode_gqa_split", "merge_split_states",
                                                          "flash_attention_mma_fa2", "flash_attention_mma_fa2_lazy",
                                                          "flash_attention_mma_fa2_wide", "flash_attention_mma_fa2_lean",
                                                          "flash_attention_mma_fa2_lean_v_flags",
                                                          "flash_attention_backward_mma_dkdv",
                                                          "flash_attention_backward_mma_dq"}
    assert {r.entry for r in results["04 tensor cores"].resources} == {"flash_attention_mma", "mma_probe"}


def test_resources_text_has_one_line_per_row():
    if not gpu.nvrtc_available():
        pytest.skip("CuPy/NVRTC not installed")
    rows = gpu.compile_report(("sm_90",), builds=[source.online_softmax_build(128, "float32")])
    text = resources_text(rows)
    lines = text.splitlines()
    assert len(lines) == 2 and lines[0].split()[:4] == ["kernel", "arch", "dtype", "config"]
    assert lines[1].split() == ["online_softmax", "sm_90", "float32", "TILE=128", "128", str(rows[0].registers),
                                "16", str(rows[0].spill_store_bytes + rows[0].spill_load_bytes)]
    assert resources_text([]) == ""


# ---------------------------------------------------------------------------
# how the report reads: wrapped prose, tables kept whole and folded away in HTML
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_the_summary_wraps_prose_at_100_columns_between_words(results, nb):
    r = results[nb]
    words, wrapped_something = [], False
    for block in r.blocks:
        if isinstance(block, harness.Table):
            words += block.title.split() + block.split()
            assert str(block) in r.summary                         # a table is printed as it is
            continue
        words += block.split()
        for line in harness._text(block).splitlines():
            assert len(line) <= 100 or " " not in line.strip(), line
        wrapped_something |= any(len(line) > 100 for line in block.splitlines())
    assert r.summary.split() == words                              # no word broken, lost or added
    assert wrapped_something or nb == "04"                         # every other section has long lines


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_html_folds_the_tables_and_keeps_the_status_plain(results, nb):
    import html as html_module

    r = results[nb]
    page = r._repr_html_()
    tables = [b for b in r.blocks if isinstance(b, harness.Table)]
    assert page.count("<details>") == len(tables) >= (1 if r.resources else 0)
    for table in tables:
        assert f"<summary>{html_module.escape(table.title)}</summary>" in page
    status = html_module.escape(r.status)
    assert status in page and page.index(status) < page.index("<details>")
    assert "but not run: the GPU was not used (use_device=False)." in r.status      # plain, not folded
    pretty = pytest.importorskip("IPython.lib.pretty", reason="IPython is not installed").pretty
    assert pretty(r) == r.summary                                  # IPython's plain-text view is the summary


@pytest.fixture
def no_resource_report(monkeypatch):
    """NVRTC's log without the ptxas report and no standalone ptxas: nobody reports the resources."""
    from lessons.gpu import compile as compile_mod

    real = compile_mod._nvrtc()

    class Quiet:
        def __getattr__(self, name):
            return getattr(real, name)

        def getProgramLog(self, prog):
            return ""

    monkeypatch.setenv("LESSONS_NVRTC_CACHE", "off")      # a made-up log must neither come from nor go to disk
    monkeypatch.setattr(compile_mod, "_nvrtc", lambda: Quiet())
    monkeypatch.setattr(compile_mod, "find_ptxas", lambda: None)
    for cached in (compile_mod.compile_kernel, compile_mod._standalone_report):
        cached.cache_clear()
    yield
    for cached in (compile_mod.compile_kernel, compile_mod._standalone_report):
        cached.cache_clear()


@needs_nvrtc
def test_a_missing_resource_report_reads_not_reported_never_a_failed_compile(no_resource_report):
    r = lesson.paged_gqa_on_gpu(use_device=False, emulate=False)
    assert r.compiled and "was compiled for sm_80 and sm_90 with NVRTC" in r.status
    assert "fail" not in r.summary
    assert [res.registers for res in r.resources] == [None, None] and not any(res.reported for res in r.resources)
    table = next(b for b in r.blocks if isinstance(b, harness.Table))
    for line in table.splitlines()[1:]:
        assert line.count("not reported") == 3                    # registers, shared memory, spills
    assert "Resources of paged_decode (sm_90) not reported: NVRTC's log held no ptxas report" in text(r)


# ---------------------------------------------------------------------------
# the emulator's numbers, against references computed another way
# ---------------------------------------------------------------------------

@needs_emulator
def test_online_softmax_emulator_equals_the_textbook_softmax(results):
    r = results["01"]
    c = emulator_check(r)
    x = softmax_demo_rows().astype(np.float64)
    np.testing.assert_allclose(c.output, lessons.safe_softmax(x), **TOL)
    for i in (0, 1):                              # lse by hand: m + log(sum exp(x - m)) over the visible entries
        row = x[i][np.isfinite(x[i])]
        m = row.max()
        assert c.lse[i] == pytest.approx(m + np.log(np.exp(row - m).sum()), rel=2e-6)
    assert (c.output[2] == 0).all() and np.isneginf(c.lse[2])     # a row that sees nothing
    assert (c.output[1, :300] == 0).all() and np.isfinite(c.output).all()
    assert c.agrees and r.ok and "emulator (the same CUDA C on the CPU, not the GPU)" in text(r)


@needs_emulator
@needs_nvrtc
def test_online_softmax_reports_the_demo_rows_only_for_the_demo_rows(results):
    assert "row 2 sees nothing: y = [0.0], lse = -inf" in text(results["01"])
    x = np.random.default_rng(3).standard_normal((4, 64))
    r = lesson.online_softmax_on_gpu(x, tile=32, use_device=False)
    np.testing.assert_allclose(emulator_check(r).output, lessons.safe_softmax(x.astype(np.float32).astype(float)),
                               **TOL)
    assert r.ok and "sees nothing" not in text(r) and "masked first tile" not in text(r)


@needs_emulator
@needs_nvrtc
def test_a_run_that_raises_is_a_failure_not_a_pass():
    def run(place):
        raise ZeroDivisionError("division by zero")

    r = harness.run_section(harness.Section("01_online_softmax", "t", [source.online_softmax_build(256, "float32")],
                                            run=run), use_device=False)
    assert r.failed == ("emulator",) and not r.checks and not r.ok
    assert "The emulator run failed: ZeroDivisionError: division by zero" in text(r)
    quiet = harness.run_section(harness.Section("01_online_softmax", "t", [source.online_softmax_build(256, "float32")],
                                                run=run), use_device=False, emulate=False)
    assert quiet.failed == () and quiet.ok          # nothing ran: nothing failed


@needs_emulator
def test_flash_attention_emulator_equals_attention_on_the_real_sample(results):
    c = emulator_check(results["02"])
    q, k, v = lessons.load_sample().qkv(0, 0)
    out, lse = lessons.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(c.output, out, **TOL)
    np.testing.assert_allclose(c.lse, lse, **TOL)
    assert c.agrees


@needs_emulator
def test_flash_attention_trace_matches_numpy_tile_by_tile(results):
    r = results["02"]
    det = r.details
    assert det["block_q"] == 64 and det["block_k"] == 16 and det["row"] == 93 and det["token"] == "and"
    q, k, v = lessons.load_sample().qkv(0, 0)
    _, trace = lessons.flash_attention(q, k, v, tile=16, block_q=64, return_trace=True)
    rt = trace.row(93)
    g = det["gpu_row"]
    np.testing.assert_array_equal(g.tile, np.arange(8))
    np.testing.assert_allclose(g.m, rt.m, rtol=1e-5)
    np.testing.assert_allclose(g.alpha, rt.alpha, rtol=1e-5)
    np.testing.assert_allclose(g.l, rt.l, rtol=1e-5)
    assert det["divergence"] is None and det["max_relative_difference"] < 1e-4
    # forgetting alpha on l first shows where the max moves while l > 0
    first_rescale = int(np.flatnonzero(rt.rescaled)[0])
    assert det["broken_divergence"].tile == first_rescale and det["broken_divergence"].quantity == "l"
    table = trace_table(g, rt, "emulator").splitlines()
    assert len(table) == 1 + len(rt) and table[1].split()[:2] == ["1", "0-15"]
    rel = relative_difference(g, rt)             # by hand, per tile: the worst of m, alpha, l
    for i, line in enumerate(table[1:]):
        worst = max(abs(getattr(g, f)[i] - getattr(rt, f)[i]) / max(abs(getattr(rt, f)[i]), 1e-30)
                    if getattr(g, f)[i] != getattr(rt, f)[i] else 0.0 for f in ("m", "alpha", "l"))
        assert rel[i] == pytest.approx(worst) and line.split()[-1] == f"{worst:.1e}"
    assert det["max_relative_difference"] == pytest.approx(max(rel))
    assert "first_divergence: none" in text(r) and f"names tile {first_rescale + 1}" in text(r)



def test_comparison_lines_name_the_first_tile_that_differs_by_hand():
    m, alpha, l = np.array([1.0, 2.0, 2.0]), np.array([1.0, np.exp(-1.0), 1.0]), np.array([1.0, 1.5, 2.5])
    kernel = GpuRowTrace((0,), np.arange(3), m, alpha, l)
    same = compare_rows(kernel, GpuRowTrace((0,), np.arange(3), m, alpha, l * (1 + 1e-7)),
                        GpuRowTrace((0,), np.arange(3), m, alpha, np.array([1.0, 1.5, 3.0])), "emulator")
    assert same["divergence"] is None and same["max_relative_difference"] == pytest.approx(1e-7, rel=1e-3)
    assert (same["broken_divergence"].tile, same["broken_divergence"].quantity) == (2, "l")
    lines = comparison_lines(same, "a made-up fold")
    assert lines == ["  first_divergence: none - every tile agrees within rounding (rtol 1e-4, atol 1e-6); "
                     "largest relative difference 1.0e-07.",
                     "  What a real difference looks like: against a made-up fold, first_divergence names tile 3: "
                     "l = 2.5 in the emulator's trace, 3 in the broken fold."]
    off = compare_rows(kernel, GpuRowTrace((0,), np.arange(3), m + [0, 0, 1], alpha, l), kernel, "GPU")
    assert off["broken_divergence"] is None and off["divergence"].tile == 2 and off["divergence"].quantity == "m"
    assert comparison_lines(off, "x") == [f"  first_divergence: {off['divergence']}"]

@needs_emulator
def test_causal_emulator_equals_attention_and_empty_rows_are_zero(results):
    r = results["03"]
    q, k, v = lessons.load_sample().qkv(0, 0)
    checks = r.checks_on("emulator")
    assert [c.case.split(", causal")[0] for c in checks] == ["Nq=40, Nk=128", "Nq=128, Nk=96"]
    for c, (nq, nk) in zip(checks, lesson.CAUSAL_CASES):
        out, lse = lessons.attention(q[-nq:], k[:nk], v[:nk], causal=True, return_lse=True)
        np.testing.assert_allclose(c.output, out, **TOL)
        empty = (causal_mask(nq, nk).sum(axis=1) == 0)
        assert r.details["empty_rows"][(nq, nk)] == int(empty.sum())
        assert (c.output[empty] == 0).all() and np.isneginf(c.lse[empty]).all()
        np.testing.assert_allclose(c.lse[~empty], lse[~empty], **TOL)
        assert not np.isnan(c.output).any()
    assert r.details["empty_rows"][(128, 96)] == 32
    assert "rows that see no key: 32 - the kernel wrote out = 0 there: True, lse = -inf: True" in text(r)


@needs_emulator
def test_tensor_core_emulator_equals_attention_and_its_trace_matches_numpy(results):
    r = results["04 tensor cores"]
    probe, kernel = r.checks_on("emulator")
    assert probe.case.startswith("one mma.sync") and probe.agrees and probe.max_error < 1e-4
    sample = lessons.load_sample()
    q, k, v = (x.astype(np.float64) for x in sample.qkv(0, 0))
    np.testing.assert_allclose(kernel.output, lessons.attention(q, k, v), atol=3e-3, rtol=5e-3)
    assert kernel.agrees and r.ok
    assert r.details["divergence"] is None and r.details["broken_divergence"] is not None
    assert len(r.details["gpu_row"]) == 2                       # 128 keys in tiles of 64
    assert r.details["timings"] == ()


@needs_nvrtc
def test_io_report_checks_the_shared_memory_formula(results):
    r = results["04"]
    assert not r.checks and r.details["timings"] == ()
    formula = r.details["smem_formula"]
    assert len(formula) == 2                     # the series' d = 128 build and the d = 64 one that is timed
    for name, (bytes_, reported) in formula.items():
        assert reported == [bytes_, bytes_], name
    assert 4 * (64 * 65 + 2 * 32 * 65 + 64 * 33) in [b for b, _ in formula.values()]   # d=64, 64 x 32 tiles


@needs_emulator
def test_paged_decode_emulator_equals_attention_on_contiguous_keys(results):
    r = results["05"]
    c = emulator_check(r)
    q_all, k_all, v_all = lessons.load_sample().qkv(0, 0)
    out, lse = lessons.attention(q_all[99], k_all[:100], v_all[:100], return_lse=True)
    np.testing.assert_allclose(c.output, out, **TOL)
    assert c.lse == pytest.approx(lse, rel=2e-5)
    assert r.details["garbage_identical"] is True and r.details["used_slots"] == 100


def test_paged_decode_needs_all_or_none_of_its_arguments():
    with pytest.raises(ValueError, match="all of q, block_table"):
        lesson.paged_decode_on_gpu(np.zeros(4), use_device=False, emulate=False)
    with pytest.raises(ValueError, match="all of q, k, v"):
        lesson.flash_decoding_on_gpu(np.zeros(4), use_device=False, emulate=False)
    with pytest.raises(ValueError, match="all of q, k_cache"):
        lesson.paged_gqa_on_gpu(np.zeros((1, 1, 4)), use_device=False, emulate=False)
    with pytest.raises(ValueError, match="cases must hold"):
        lesson.causal_on_gpu(cases=((0, 8),), use_device=False, emulate=False)


def test_flash_decoding_splits_its_pages_by_hand(results):
    # 128 keys in pages of 16: 8 pages; 6 splits of ceil(8 / 6) = 2 pages, the last two empty
    assert results["06"].details["split_pages"] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 8), (8, 8)]
    with pytest.raises(ValueError, match="num_splits must be at least 1"):
        lesson.flash_decoding_on_gpu(num_splits=0, use_device=False, emulate=False)


@needs_emulator
def test_flash_decoding_emulator_partials_and_merge(results):
    r = results["06"]
    c = emulator_check(r)
    q_all, k, v = lessons.load_sample().qkv(0, 0)
    q = q_all[-1]
    out, lse = lessons.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(c.output, out, **TOL)
    assert c.lse == pytest.approx(lse, rel=2e-5)
    splits = r.details["splits"]
    assert [s["keys"] for s in splits] == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 128), (128, 128)]
    for s in splits[:4]:
        a, b = s["keys"]
        assert s["lse"] == pytest.approx(float(lessons.attention(q, k[a:b], v[a:b], return_lse=True)[1]), rel=2e-5)
    assert all(np.isneginf(s["lse"]) for s in splits[4:]) and all(s["agrees"] for s in splits)
    assert r.details["numpy_flash_decoding_difference"] < 2e-5


@needs_emulator
def test_gqa_emulator_equals_attention_head_by_head(results):
    r = results["07"]
    c = emulator_check(r)
    rng = np.random.default_rng(0)                 # notebook 09's data, drawn in the notebook's order
    lengths, num_heads, num_kv_heads, d = [1, 15, 16, 37], 8, 2, 64
    keys = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    values = [rng.standard_normal((n, num_kv_heads, d)) for n in lengths]
    q = rng.standard_normal((len(lengths), num_heads, d))
    group = num_heads // num_kv_heads
    for b in range(len(lengths)):
        for h in range(num_heads):
            ref, ref_lse = lessons.attention(q[b, h], keys[b][:, h // group], values[b][:, h // group],
                                             return_lse=True)
            np.testing.assert_allclose(c.output[b, h], ref, **TOL)
            assert c.lse[b, h] == pytest.approx(ref_lse, rel=2e-5)
    assert r.details["heads_per_block"] == 4 and r.details["group"] == 4


def test_emulate_false_runs_nothing_and_says_so():
    r = lesson.paged_gqa_on_gpu(use_device=False, emulate=False)
    assert r.checks == () and r.ok and "Nothing was timed" in text(r)


# ---------------------------------------------------------------------------
# the GPU branch, with a stand-in device (the emulator backend, NumPy arrays)
# ---------------------------------------------------------------------------

class StandInDevice(Runner):
    """The launchers' runner on the emulator backend, standing in for a CUDA device: every check
    it makes is labelled "GPU", and it is timed with a wall clock."""

    def __init__(self):
        super().__init__("emulator")
        self.name = "a stand-in device (the CPU emulator)"

    def median_seconds(self, fn, *, warmup=0, repeats=1):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def use_device_runner(monkeypatch, runner):
    for module in (harness, launch):     # the sections, and kernel_row_trace
        monkeypatch.setattr(module, "open_device", lambda use_device: (runner, None))


@pytest.fixture
def stand_in(monkeypatch):
    use_device_runner(monkeypatch, StandInDevice())


@needs_emulator
@needs_nvrtc
@pytest.mark.parametrize("fn, kwargs", [
    (lesson.online_softmax_on_gpu, dict(timing_shape=(2, 300))),
    (lesson.flash_attention_on_gpu, dict(all_heads=False)),
    (lesson.causal_on_gpu, dict(all_heads=False)),
    (lesson.paged_decode_on_gpu, {}),
    (lesson.flash_decoding_on_gpu, {}),
    (lesson.paged_gqa_on_gpu, {}),
], ids=lambda x: getattr(x, "__name__", "-"))
def test_gpu_branch_checks_times_and_labels(stand_in, fn, kwargs):
    r = fn(**kwargs)
    assert r.ran_on_device and r.ok, r.summary
    assert "and run on a stand-in device" in r.status and "On the GPU (a stand-in device" in text(r)
    assert not r.checks_on("emulator")            # the emulator runs only where the GPU did not
    timed = [c.median_seconds for c in r.checks_on("GPU") if c.median_seconds is not None]
    assert timed and all(t > 0 for t in timed)
    assert "Nothing was timed" not in text(r) and "median time" in text(r)


@needs_emulator
@needs_nvrtc
def test_gpu_branch_of_the_io_section_times_naive_and_kernel(stand_in):
    r = lesson.io_on_gpu(ns=(32, 64), d=16, heads=2, repeats=1)
    rows = r.details["timings"]
    assert [t["n"] for t in rows] == [32, 64] and r.ran_on_device
    assert all(t["max_difference"] < 2e-3 for t in rows)          # float16 outputs of the same attention
    assert "naive CuPy" in text(r)


@needs_emulator
@needs_nvrtc
def test_gpu_branch_of_the_tensor_core_section_checks_and_times_three_kernels(stand_in):
    r = lesson.tensor_cores_on_gpu(n=64, d=16, heads=2, repeats=1)
    assert r.ran_on_device and r.ok, r.summary
    assert [c.where for c in r.checks] == ["GPU", "GPU"] and r.details["divergence"] is None
    assert [t["kernel"] for t in r.details["timings"]] == ["naive CuPy", "CUDA cores", "tensor cores"]
    t = r.details["timings"][0]
    assert t["tflops"] == pytest.approx(4 * 64 * 64 * 16 * 2 / t["seconds"] / 1e12)


def test_the_naive_baseline_is_textbook_attention_and_shared_with_the_benchmark():
    from lessons.gpu import measure
    bench_source = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_attention.py").read_text()
    assert "from lessons.gpu.measure import naive_attention" in bench_source
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    got = measure.naive_attention(np, q, k, v, False)
    for h in range(2):
        np.testing.assert_allclose(got[h], lessons.attention(q[h], k[h], v[h]), atol=1e-6)
    causal = measure.naive_attention(np, q[:, :5], k, v, True)
    for h in range(2):
        np.testing.assert_allclose(causal[h], lessons.attention(q[h, :5], k[h], v[h], causal=True), atol=1e-6)


@needs_nvrtc
def test_a_failing_gpu_run_is_reported_not_raised(monkeypatch):
    class FailingDevice(StandInDevice):
        def kernel(self, launcher):
            def launch(*args, **kwargs):
                raise RuntimeError("launch failed")
            return launch

    use_device_runner(monkeypatch, FailingDevice())
    r = lesson.paged_gqa_on_gpu(emulate=False)
    assert not r.ran_on_device and r.checks == ()
    assert "but the run on a stand-in device (the CPU emulator) failed" in r.status
    assert "The GPU run failed: RuntimeError: launch failed" in text(r)


# ---------------------------------------------------------------------------
# a real device
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not gpu.device_available(), reason="no CUDA device: the sections run on the emulator above")
@pytest.mark.parametrize("fn", [lesson.online_softmax_on_gpu, lesson.flash_attention_on_gpu, lesson.causal_on_gpu,
                                lesson.io_on_gpu, lesson.tensor_cores_on_gpu, lesson.paged_decode_on_gpu, lesson.flash_decoding_on_gpu,
                                lesson.paged_gqa_on_gpu], ids=lambda f: f.__name__)
def test_every_section_on_the_device(fn):
    r = fn()
    assert "and run on" in r.status and r.ok and r.ran_on_device, r.summary
    if fn in (lesson.io_on_gpu, lesson.tensor_cores_on_gpu):
        assert len(r.details["timings"]) == 3
    else:
        assert any(c.median_seconds for c in r.checks_on("GPU"))



@pytest.mark.parametrize("call, error, match", [
    (lambda: lesson.tensor_cores_on_gpu(row=200, use_device=False), ValueError, "row must be at most 127, got 200"),
    (lambda: lesson.tensor_cores_on_gpu(row=1.0, use_device=False), TypeError, "row must be an int"),
    (lambda: lesson.tensor_cores_on_gpu(heads=0, use_device=False), ValueError, "heads must be at least 1"),
    (lambda: lesson.tensor_cores_on_gpu(d=72, use_device=False), ValueError, "multiple of 16"),
    (lambda: lesson.kernel_row_trace(*[np.zeros((1, 8, 16))] * 3, 16, 0), ValueError, "q must be 2-D"),
    (lambda: lesson.kernel_row_trace(*[np.zeros((8, 16))] * 3, 16, 8), ValueError, "row must be at most 7, got 8"),
    (lambda: lesson.kernel_row_trace(*[np.zeros((8, 16))] * 3, 16, -1), ValueError, "row must be at least 0"),
    (lambda: lesson.kernel_row_trace(*[np.zeros((8, 16))] * 3, True, 0), TypeError, "tile must be an int"),
])
def test_the_tensor_core_section_and_kernel_row_trace_check_their_arguments_first(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _flash_decoding_data():
    return decode_query_case()


@pytest.mark.parametrize("call, error, match", [
    (lambda: lesson.online_softmax_on_gpu(np.array([["1.5", "2"]])), TypeError, "x must have a float dtype"),
    (lambda: lesson.online_softmax_on_gpu(np.ones((2, 64), bool)), TypeError, "x must have a float dtype.*bool"),
    (lambda: lesson.online_softmax_on_gpu(np.ones((2, 64)) + 1j), TypeError, "x must have a float dtype.*complex"),
    (lambda: lesson.online_softmax_on_gpu(np.ones((2, 2, 64))), ValueError, r"x must be 1-D or 2-D, got shape \(2, 2, 64\)"),
    (lambda: lesson.online_softmax_on_gpu(1.0), ValueError, r"x must be 1-D or 2-D, got shape \(\)"),
    (lambda: lesson.online_softmax_on_gpu(np.ones((2, 0))), ValueError, "x must hold at least one score"),
    (lambda: lesson.online_softmax_on_gpu(timing_shape=(True, 64)), TypeError, "timing_shape must be an int, got bool"),
    (lambda: lesson.online_softmax_on_gpu(timing_shape=(64,)), ValueError, "timing_shape must hold 2 ints"),
    (lambda: lesson.flash_attention_on_gpu(row=500), ValueError, "row must be at most 127, got 500"),
    (lambda: lesson.flash_attention_on_gpu(row=-1), ValueError, "row must be at least 0"),
    (lambda: lesson.flash_attention_on_gpu(row=True), TypeError, "row must be an int, got bool"),
    (lambda: lesson.flash_attention_on_gpu(all_heads="no"), TypeError, "all_heads must be True or False"),
    (lambda: lesson.causal_on_gpu(cases=((40.7, 128),)), TypeError, r"cases \(Nq\) must be an int, got float"),
    (lambda: lesson.causal_on_gpu(cases=((True, 128),)), TypeError, r"cases \(Nq\) must be an int, got bool"),
    (lambda: lesson.causal_on_gpu(cases=(("40", 128),)), TypeError, r"cases \(Nq\) must be an int, got str"),
    (lambda: lesson.causal_on_gpu(cases=((40, 128, 1),)), TypeError, r"cases must hold \(Nq, Nk\) pairs, got \(40, 128, 1\)"),
    (lambda: lesson.causal_on_gpu(cases=(40, 128)), TypeError, r"cases must hold \(Nq, Nk\) pairs, got 40"),
    (lambda: lesson.causal_on_gpu(cases=()), ValueError, "cases must hold at least one"),
    (lambda: lesson.causal_on_gpu(all_heads=1), TypeError, "all_heads must be True or False"),
    (lambda: lesson.io_on_gpu(ns=(True,)), TypeError, "ns must be an int, got bool"),
    (lambda: lesson.io_on_gpu(ns=1024), TypeError, "ns must be a sequence of ints"),
    (lambda: lesson.io_on_gpu(ns=(-5,)), ValueError, "ns must be at least 1"),
    (lambda: lesson.io_on_gpu(heads=0), ValueError, "heads must be at least 1"),
    (lambda: lesson.io_on_gpu(repeats=True), TypeError, "repeats must be an int, got bool"),
    (lambda: lesson.paged_decode_on_gpu(*(lambda c: (c[0][None],) + c[1:])(lesson.paged_case())), ValueError,
     r"q must be 1-D, got shape \(1, 32\)"),
    (lambda: lesson.flash_decoding_on_gpu(*(lambda q, k, v: (np.stack([q, q]), k, v))(*_flash_decoding_data())),
     ValueError, r"q must be 1-D, got shape \(2, 32\)"),
    (lambda: lesson.flash_decoding_on_gpu(*(lambda q, k, v: (q, k[0], v))(*_flash_decoding_data())),
     ValueError, r"k must be 2-D, got shape \(32,\)"),
    (lambda: lesson.flash_decoding_on_gpu(*(lambda q, k, v: (q, k, v[:5]))(*_flash_decoding_data())),
     ValueError, r"must agree, got shapes \(32,\), \(128, 32\), \(5, 32\)"),
    (lambda: lesson.flash_decoding_on_gpu(*(lambda q, k, v: (q[:5], k, v))(*_flash_decoding_data())),
     ValueError, r"must agree, got shapes \(5,\)"),
    (lambda: lesson.flash_decoding_on_gpu(*(lambda q, k, v: (q.astype(int), k, v))(*_flash_decoding_data())),
     TypeError, "q must have a float dtype"),
])
def test_sections_reject_bad_arguments_before_compiling(monkeypatch, call, error, match):
    """Every check comes first: a bad argument is an error naming it, never a note in a report after compiling."""
    def compiled(*args, **kwargs):
        raise AssertionError("the section compiled and ran with a bad argument")

    monkeypatch.setattr(lesson, "_run", compiled)
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_device=0), "use_device must be None, True or False, got int 0"),
    (dict(use_device="no"), "use_device must be None, True or False, got str"),
    (dict(use_device=False, emulate="no"), "emulate must be None, True or False, got str 'no'"),
    (dict(use_device=False, emulate=0), "emulate must be None, True or False, got int 0"),
])
def test_use_device_and_emulate_are_none_true_or_false(kwargs, match):
    with pytest.raises(TypeError, match=match):
        lesson.online_softmax_on_gpu(**kwargs)
    with pytest.raises(TypeError, match=match.split(",")[0]):
        harness.run_section(harness.Section("01_online_softmax", "t", [source.online_softmax_build(256, "float32")]),
                            **kwargs)

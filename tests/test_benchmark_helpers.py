"""The measurement helpers behind benchmarks/memory_time.py (memory only: no timing asserts)."""
import csv
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lessons.cost.memory import CaseResult, measure_case, peak_bytes, time_call
from lessons.gpu import emulator_available

ROOT = Path(__file__).resolve().parent.parent


def test_peak_bytes_sees_a_known_allocation():
    n = 1_000_000
    peak = peak_bytes(lambda: np.ones(n))                    # 8 MB of float64, freed on return
    assert 8 * n <= peak < 8 * n + 64 * 1024


def test_peak_bytes_counts_temporaries_not_inputs():
    a = np.ones(500_000)                                     # 4 MB made before: not counted
    peak = peak_bytes(lambda: float((a * 2.0).sum()))        # one 4 MB temporary
    assert 4_000_000 <= peak < 4_000_000 + 64 * 1024


def test_time_call_returns_one_positive_time_per_repeat():
    times = time_call(lambda: None, repeats=3)
    assert len(times) == 3 and all(isinstance(t, float) and t >= 0 for t in times)
    with pytest.raises(ValueError, match="repeats"):
        time_call(lambda: None, repeats=0)
    with pytest.raises(TypeError, match="fn"):
        time_call(3)


def test_measure_case_structure_and_memory_at_512():
    steps = []
    r = measure_case(512, 64, dtype="float64", tile=128, block_q=128, repeats=2, on_step=steps.append)
    assert isinstance(r, CaseResult)
    assert (r.n, r.d, r.dtype, r.tile, r.block_q) == (512, 64, "float64", 128, 128)
    assert len(r.times_textbook) == len(r.times_flash) == 2
    assert len(steps) == 2 * (1 + 2)
    assert r.max_abs_diff < 1e-12                             # both are exact attention
    # textbook must hold at least the (N, N) score matrix: 512 * 512 * 8 bytes = 2 MiB
    assert r.peak_textbook >= r.score_bytes == 512 * 512 * 8
    # flash holds the (N, d) output plus a few (block_q, tile) tiles, far less than one S
    assert r.peak_flash < r.peak_textbook
    assert r.peak_flash < 512 * 64 * 8 + 8 * 128 * 128 * 8
    assert r.memory_ratio == pytest.approx(r.peak_textbook / r.peak_flash)


def test_measure_case_float32_halves_the_score_matrix():
    r64 = measure_case(256, 16, dtype="float64", tile=64, block_q=64, repeats=1)
    r32 = measure_case(256, 16, dtype="float32", tile=64, block_q=64, repeats=1)
    assert r32.score_bytes * 2 == r64.score_bytes
    assert r32.peak_textbook == pytest.approx(r64.peak_textbook / 2, rel=0.1)


def test_measure_case_rejects_bad_input():
    with pytest.raises(ValueError, match="n"):
        measure_case(0)
    with pytest.raises(TypeError, match="dtype"):
        measure_case(16, dtype="int32")


def test_benchmark_script_quick(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory_time.py"), "--quick",
                           "--ns", "64", "256", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "memory_time.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["n"], r["dtype"]) for r in rows] == [
        ("64", "float64"), ("64", "float32"), ("256", "float64"), ("256", "float32")]
    for r in rows:
        assert int(r["peak_bytes_textbook"]) >= int(r["n"]) ** 2 * np.dtype(r["dtype"]).itemsize
    md = (tmp_path / "memory_time.md").read_text()
    assert "| N | dtype | peak MiB textbook | peak MiB flash |" in md and "Machine:" in md
    assert (tmp_path / "memory_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_benchmark_writes_its_table_and_plot_from_rows(tmp_path):
    """The GPU benchmark's writer on hand-made rows (the timings themselves need a GPU)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_attention", ROOT / "benchmarks" / "gpu_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = []
    for dtype in bench.DTYPES:
        for impl in bench.IMPLS:
            for n in (1024, 2048):
                seconds = None if impl == "mma" and dtype == "float32" else 1e-3 * n / 1024 / (1 + bench.IMPLS.index(impl))
                rows.append(dict(impl=impl, n=n, d=64, heads=8, causal=False, dtype=dtype, seconds=seconds,
                                 tflops=None if seconds is None else bench.attention_flops(n, 64, 8, False) / seconds / 1e12,
                                 peak_bytes=None if seconds is None else n * 1024,
                                 note="skipped: tensor cores take float16/bfloat16" if seconds is None else ""))
    bench.write_results(rows, tmp_path, dict(device="test device", heads=8, causal=False))
    table = (tmp_path / "results.md").read_text()
    assert "tensor cores take float16" in table and "float32" in table
    assert (tmp_path / "gpu_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 4 N^2 d flops per head: N = 1024, d = 64, 8 heads in 1 ms is 2.15 TFLOP/s
    assert rows[0]["tflops"] == pytest.approx(4 * 1024**2 * 64 * 8 / 1e-3 / 1e12)
    line = bench.format_row(rows[0])
    assert line.split()[:2] == ["naive", "float16"] and "N=  1024" in line and "2.15 TFLOP/s" in line


def _gpu_attention():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_attention", ROOT / "benchmarks" / "gpu_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_forward_benchmark_draws_the_wide_register_tiled_rung_in_its_own_style(tmp_path, monkeypatch):
    bench = _gpu_attention()
    assert bench.IMPLS.index("regtile_wide") == bench.IMPLS.index("regtile") + 1
    seen = {}
    monkeypatch.setattr(bench._common, "plot_results", lambda rows, path, **kw: seen.update(kw))
    bench.plot_results([], tmp_path / "x.png", dict(device="test device", heads=8, causal=False))
    style = seen["style"]
    assert style["regtile_wide"] == ("#9edae5", ">", "RawKernel, CUDA cores, register-tiled, 16-lane row groups")
    assert set(bench.IMPLS) <= set(style)
    markers = [marker for _, marker, _ in style.values()]
    assert len(set(markers)) == len(markers)                                  # one marker per line


@pytest.mark.skipif(not emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_the_forward_benchmark_runs_the_wide_register_tiled_rung_in_float32_only(monkeypatch):
    """run_size's call and skip rule for regtile_wide: the rung's own launcher (here on the emulator, NumPy for
    CuPy), causal as asked; float16 skipped with the register-tiled rung's reason."""
    import types

    import lessons.gpu as gpu
    from lessons import attention

    bench = _gpu_attention()
    seen = {}
    monkeypatch.setattr(bench, "timed_rows", lambda args, cupy, torch, impls, calls, *, dtype, skip, **kw:
                        seen.update({dtype: (impls, calls, skip)}) or [])
    args = types.SimpleNamespace(heads=2, causal=True)
    for dtype in ("float16", "float32"):
        bench.run_size(args, np, None, "no torch", np.random.default_rng(0), dtype, 64, 40, 0.0)
    assert seen["float16"][2]("regtile_wide") == "the register-tiled kernel takes float32"
    assert seen["float32"][2]("regtile_wide") is None and "regtile_wide" in seen["float32"][0]
    launched = []
    wide = gpu.flash_attention_regtile_wide_gpu
    monkeypatch.setattr(gpu, "flash_attention_regtile_wide_gpu",
                        lambda q, k, v, **kw: launched.append((q, k, v, kw)) or wide(q, k, v, backend="emulator", **kw))
    out, lse = seen["float32"][1]["regtile_wide"]()
    (q, k, v, kw), = launched
    assert kw == {"causal": True} and q.shape == (2, 40, 64) and q.dtype == np.float32
    ref = np.stack([attention(*(x[h].astype(np.float64) for x in (q, k, v)), causal=True) for h in range(2)])
    assert np.abs(out - ref).max() < 1e-5


def test_the_forward_benchmark_leaves_out_the_rungs_whose_first_run_failed(monkeypatch):
    """A rung in GPU_CHECK_LEFT_OUT (scripts/gpu_check.sh's first runs) is skipped with the reason, so a kernel
    that faults cannot take the CUDA context, and every later row's timing, with it; the others still run."""
    import types

    bench = _gpu_attention()
    seen = {}
    monkeypatch.setattr(bench, "timed_rows", lambda args, cupy, torch, impls, calls, *, dtype, skip, **kw:
                        seen.update({dtype: skip}) or [])
    monkeypatch.delenv("GPU_CHECK_LEFT_OUT", raising=False)
    args = types.SimpleNamespace(heads=1, causal=False)
    for dtype in ("float16", "float32"):
        bench.run_size(args, np, None, "no torch", np.random.default_rng(0), dtype, 64, 8, 0.0)
    assert seen["float32"]("regtile_wide") is None and seen["float16"]("mma_fa2_lazy") is None
    monkeypatch.setenv("GPU_CHECK_LEFT_OUT", "regtile_wide mma_fa2_lazy scalar")
    why = "failed its first run on this machine (scripts/first_run.py)"
    assert seen["float32"]("regtile_wide") == why and seen["float16"]("mma_fa2_lazy") == why
    assert seen["float32"]("kernel") == why                          # the scalar rung, timed as "kernel"
    assert seen["float32"]("regtile") is None and seen["float16"]("mma_fa2_wide") is None
    assert seen["float16"]("mma_fa2_lean") is None and seen["float32"]("mma_fa2_lean") == "tensor cores take float16/bfloat16"
    assert seen["float16"]("mma_fa2") is None and seen["float16"]("naive") is None
    # a rung that cannot run in a dtype keeps that reason, the more telling one
    assert seen["float16"]("regtile_wide") == "the register-tiled kernel takes float32"
    assert seen["float32"]("mma_fa2_lazy") == "tensor cores take float16/bfloat16"


def test_the_gpu_benchmarks_run_loop_times_skips_and_notes_failures(monkeypatch, capsys):
    """benchmarks/_common.timed_rows, shared by both GPU benchmarks, with stand-ins for CuPy's timing."""
    import types

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import _common
    import lessons.gpu.measure as measure

    monkeypatch.setattr(measure, "median_cuda_seconds", lambda cupy, fn, warmup, repeats: fn())
    monkeypatch.setattr(_common, "peak_cupy", lambda cupy, fn: 3 * 2**20)
    freed = []
    cupy = types.SimpleNamespace(get_default_memory_pool=lambda: types.SimpleNamespace(
        free_all_blocks=lambda: freed.append(1)))
    args = types.SimpleNamespace(heads=8, causal=False, warmup=0, repeats=1, time_budget=60.0)

    def fail():
        raise MemoryError("out of memory\nmore")

    calls = {"fast": lambda: 1e-3, "bad": fail, "torch": lambda: (2e-3, 5)}
    rows = _common.timed_rows(args, cupy, None, ("fast", "bad", "off", "torch"), calls, dtype="float16", d=64,
                              n=1024, flops=4e9, t0=time.perf_counter(),
                              skip=lambda impl: "not for float16" if impl == "off" else None)
    assert [r["impl"] for r in rows] == ["fast", "bad", "off", "torch"]
    assert rows[0]["seconds"] == 1e-3 and rows[0]["tflops"] == pytest.approx(4e9 / 1e-3 / 1e12)
    assert rows[0]["peak_bytes"] == 3 * 2**20
    assert rows[1]["seconds"] is None and rows[1]["note"] == "failed: MemoryError: out of memory"
    assert rows[2]["note"] == "skipped: not for float16" and rows[3]["peak_bytes"] == 5
    assert len(freed) == 3                          # the pool is emptied after each run, not after a skip
    assert capsys.readouterr().out.splitlines()[2].endswith("skipped: not for float16")
    late = _common.timed_rows(args, cupy, None, ("fast",), calls, dtype="float16", d=64, n=1024, flops=4e9,
                              t0=time.perf_counter() - 61)
    assert late[0]["note"] == "skipped: time budget spent"


def test_a_benchmark_cut_short_leaves_the_groups_it_finished_on_disk(monkeypatch, tmp_path):
    """benchmarks/_common.benchmark writes after each (dtype, d, N): a kernel that never returns in the third
    group (here: an exception standing in for the time limit that would kill it) leaves the first two groups'
    rows in results.csv."""
    import types

    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks import _common

    monkeypatch.setattr(_common, "load_torch", lambda: (None, "no torch here"))
    cupy = types.SimpleNamespace(get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    args = types.SimpleNamespace(dtypes=["float16", "float32"], head_dims=[64, 128], sizes=[1024], heads=8,
                                 causal=False, out=tmp_path)

    def run_size(args, cupy, torch, torch_reason, rng, dtype, d, n, t0):
        if (dtype, d) == ("float32", 64):
            raise TimeoutError("the step's time limit")
        return [dict(impl="k", n=n, d=d, heads=8, causal=False, dtype=dtype, seconds=1e-3, tflops=1.0,
                     peak_bytes=0, note="")]

    def write(rows, out, meta):
        _common.write_results(rows, out, meta, what="a test")

    meta = dict(device="none", heads=8, causal=False)
    with pytest.raises(TimeoutError):
        _common.benchmark(args, cupy, run_size, on_group=lambda rows: write(rows, args.out, meta))
    with open(tmp_path / "results.csv", newline="") as f:
        got = [(r["dtype"], int(r["d"])) for r in csv.DictReader(f)]
    assert got == [("float16", 64), ("float16", 128)]


def test_the_sweeps_progress_bar_takes_a_count_of_runs():
    from lessons.gpu.measure import progress_steps

    labels = []
    with progress_steps(2, "runs") as step:
        for label in ("first", "second"):
            step(label)
            labels.append(label)
    assert labels == ["first", "second"]
    with pytest.raises(ValueError, match="total"):
        with progress_steps(-1, "runs"):
            pass
    with pytest.raises(TypeError, match="total"):
        with progress_steps(2.0, "runs"):
            pass

"""The recorded H200 backward run as notebook 04 shows it (lessons.gpu.recorded, recorded_backward_figure).

Every figure is checked against the committed CSV read another way (the csv module's plain reader, by
column position), against the run's README (which quotes the headline by hand), or against hand-made
rows; bad input must raise a clear error. Live measurement needs a CUDA device.
"""
from __future__ import annotations

import csv
import re

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu.recorded import (BACKWARD_CSV, IMPL_TITLES, IMPLS, RECORDED_DIR, TORCH_GOAL, BackwardRun,
                                  backward_findings, backward_results, backward_row, backward_summary,
                                  backward_table, flash_backend_comparison, measure_backward, read_backward_csv,
                                  recorded_backward, recorded_label)

LABEL = "recorded on one NVIDIA H200, 2026-12-01 (driver 580.159.04, CUDA 13.0, commit 5ea12bd)"


def raw_rows(path=BACKWARD_CSV):
    """The CSV as lists of strings, by position: header first."""
    with open(path, newline="") as f:
        return list(csv.reader(f))


def raw(impl, n, d):
    """seconds, peak_bytes of one recorded row, found by position in the raw CSV."""
    header, *body = raw_rows()
    col = {name: i for i, name in enumerate(header)}
    (line,) = [r for r in body if (r[col["impl"]], r[col["n"]], r[col["d"]]) == (impl, str(n), str(d))]
    return float(line[col["seconds"]]), int(line[col["peak_bytes"]])


# ---------------------------------------------------------------------------
# the reader
# ---------------------------------------------------------------------------

def test_reader_gives_every_csv_line_typed():
    header, *body = raw_rows()
    rows = read_backward_csv()
    assert len(rows) == len(body) == 24
    for r, line in zip(rows, body):
        assert list(r) == header
        text = dict(zip(header, line))
        assert (r["impl"], r["n"], r["d"], r["heads"], r["dtype"]) == (
            text["impl"], int(text["n"]), int(text["d"]), int(text["heads"]), text["dtype"])
        assert r["causal"] is (text["causal"] == "True")
        assert r["seconds"] == float(text["seconds"]) and r["tflops"] == float(text["tflops"])
        assert r["peak_bytes"] == int(text["peak_bytes"]) and isinstance(r["peak_bytes"], int)
        assert r["note"] == text["note"]
    assert {r["impl"] for r in rows} == set(IMPLS)


def test_recorded_run_is_labelled_with_machine_date_driver_and_commit():
    run = recorded_backward()
    assert run.label == recorded_label() == LABEL and run.live is False
    # the same facts as the run's env.txt, written by the machine itself
    env = (RECORDED_DIR / "env.txt").read_text()
    assert "date: 2026-12-01" in env and "NVIDIA H200, 580.159.04" in env and "device: NVIDIA H200" in env


@pytest.mark.skipif(gpu.device_available(), reason="without a device the notebook shows the recorded run")
def test_without_a_device_the_results_are_the_recorded_ones():
    run = backward_results()
    assert run == recorded_backward()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        backward_results(live=True)


def test_label_comes_from_the_readme(tmp_path):
    (tmp_path / "README.md").write_text("# The kernels on one NVIDIA A100, 2025-01-02 (commit abcdef1)\n\n"
                                        "Machine: driver 550.1, CUDA 12.4, Python 3.11\n")
    assert recorded_label(tmp_path) == "recorded on one NVIDIA A100, 2025-01-02 (driver 550.1, CUDA 12.4, commit abcdef1)"
    (tmp_path / "README.md").write_text("# Some results\n")
    with pytest.raises(ValueError, match="commit"):
        recorded_label(tmp_path)
    with pytest.raises(FileNotFoundError):
        recorded_label(tmp_path / "missing")


# ---------------------------------------------------------------------------
# the figures: ratios recomputed from the raw CSV, and the README's hand-written headline
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 128])
def test_summary_ratios_recomputed_from_the_csv(d):
    s = backward_summary(recorded_backward(), d=d)
    assert s.n == 8192 and s.label == LABEL
    (naive, naive_peak), (kernel, _), (mma, mma_peak), (torch, _) = (raw(i, 8192, d) for i in IMPLS)
    assert s.seconds == {"naive": naive, "kernel": kernel, "mma": mma, "torch": torch}
    assert s.x_naive["mma"] == pytest.approx(naive / mma) and s.x_naive["kernel"] == pytest.approx(naive / kernel)
    assert s.of_torch["mma"] == pytest.approx(torch / mma)
    assert s.memory_ratio == pytest.approx(mma_peak / naive_peak)
    assert s.goal_met is (torch / mma >= TORCH_GOAL)
    assert s.tflops["mma"] == pytest.approx(10 * 8192**2 * d * 8 / mma / 1e12)   # 10 N^2 d FLOPs per head


def test_headline_at_d64_is_the_readmes():
    """The README of the run quotes the d = 64 headline by hand; the findings compute it from the CSV."""
    readme = (RECORDED_DIR / "README.md").read_text()
    quoted = re.search(r"tensor-core ([\d.]+) ms \((\d+) TFLOP/s\) against naive CuPy ([\d.]+) ms \(([\d.]+)x\) and\s+"
                       r"torch ([\d.]+) ms \(([\d.]+)x\); (\d+) MiB extra memory against ([\d,]+) MiB", readme)
    mma_ms, mma_tflops, naive_ms, x_naive, torch_ms, of_torch, mma_mib, naive_mib = quoted.groups()
    s = backward_summary(recorded_backward(), 8192, 64)
    assert f"{s.seconds['mma'] * 1e3:.2f}" == mma_ms and f"{s.tflops['mma']:.0f}" == mma_tflops
    assert f"{s.seconds['naive'] * 1e3:.1f}" == naive_ms and f"{s.x_naive['mma']:.1f}" == x_naive
    assert f"{s.seconds['torch'] * 1e3:.2f}" == torch_ms and f"{s.of_torch['mma']:.2f}" == of_torch
    assert f"{s.peak_bytes['mma'] / 2**20:.0f}" == mma_mib and f"{s.peak_bytes['naive'] / 2**20:,.0f}" == naive_mib
    text = "\n".join(backward_findings(recorded_backward()))
    for figure in (f"{mma_ms} ms", f"{x_naive}x faster", f"{of_torch}x its speed", f"{mma_mib} MiB against {naive_mib} MiB"):
        assert figure in text
    assert "0.3x of it: not reached" in text and "NOT faster" in text     # the README: "not faster than naive CuPy"
    assert "The CUDA-core\n  backward (37.7 ms) is not faster than naive CuPy" in readme


def test_findings_follow_the_rows_not_the_recording():
    """Hand-made rows where everything goes the other way: the sentences must say so."""
    rows = [dict(impl=i, n=1024, d=64, heads=2, causal=False, dtype="float16", seconds=s, tflops=1.0, peak_bytes=b,
                 note="") for i, s, b in (("naive", 4e-3, 2**30), ("kernel", 2e-3, 2**20), ("mma", 1e-3, 2**20),
                                          ("torch", 2e-3, 2**21))]
    text = "\n".join(backward_findings(BackwardRun(tuple(rows), "made by hand", live=False)))
    assert "4.0x faster" in text and "2.00x its speed" in text and "reached." in text and "not reached" not in text
    assert "2.00x the naive backward's speed, faster than it" in text and "NOT" not in text


def test_table_has_one_line_per_implementation_and_head_dim():
    table = backward_table(recorded_backward())
    assert table.splitlines()[0].endswith(f"{LABEL}:") and "N = 8192" in table.splitlines()[0]
    body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(body) == 8
    for line in body:
        title, d, ms, *_ = (c.strip() for c in line.strip("|").split("|"))
        impl = next(i for i in IMPLS if IMPL_TITLES[i] == title)
        seconds, _ = raw(impl, 8192, int(d))
        assert ms == f"{seconds * 1e3:.2f}"
    mma64 = next(line for line in body if IMPL_TITLES["mma"] in line and "| 64 |" in line)
    naive, _ = raw("naive", 8192, 64)
    mma, _ = raw("mma", 8192, 64)
    assert f"{naive / mma:.2f}x" in mma64


def write_csv(path, rows, header=("impl", "n", "d", "heads", "causal", "dtype", "seconds", "tflops", "peak_bytes",
                                  "note")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_a_skipped_implementation_shows_its_reason(tmp_path):
    path = write_csv(tmp_path / "results.csv", [
        ["naive", 512, 64, 2, False, "float16", 2e-3, 1.0, 1000000, ""],
        ["kernel", 512, 64, 2, False, "float16", 1e-3, 2.0, 1000, ""],
        ["mma", 512, 64, 2, False, "float16", 5e-4, 4.0, 1000, ""],
        ["torch", 512, 64, 2, False, "float16", "", "", "", "skipped: torch is not installed"]])
    run = BackwardRun(tuple(read_backward_csv(path)), "made by hand", live=False)
    assert backward_row(run, "torch", 512, 64) is None and run.rows[3]["seconds"] is None
    table = backward_table(run)
    assert "| - | - | - | - | skipped: torch is not installed |" in table
    s = backward_summary(run)
    assert s.of_torch == {} and s.goal_met is None and s.memory_ratio == pytest.approx(1e-3)
    assert not any("torch" in line for line in backward_findings(run))


# ---------------------------------------------------------------------------
# the figure
# ---------------------------------------------------------------------------

def test_figure_draws_each_implementation_from_the_rows():
    from lessons.views.backward import IMPL_COLOURS, recorded_backward_figure

    run = recorded_backward()
    fig = recorded_backward_figure(run)
    assert LABEL in fig._suptitle.get_text()
    axes = fig.get_axes()
    assert len(axes) == 4
    for top, bottom, d in ((axes[0], axes[1], 64), (axes[2], axes[3], 128)):
        assert top.get_title() == f"d = {d}" and top.get_yscale() == "log" and top.get_xscale() == "log"
        assert "ms" in top.get_ylabel() and "MiB" in bottom.get_ylabel() and bottom.get_yscale() == "log"
        assert [line.get_label() for line in top.get_lines()] == [IMPL_TITLES[i] for i in IMPLS]
        for impl, t, b in zip(IMPLS, top.get_lines(), bottom.get_lines()):
            assert t.get_color() == IMPL_COLOURS[impl]
            assert list(t.get_xdata()) == [1024, 4096, 8192]
            want = [raw(impl, n, d) for n in (1024, 4096, 8192)]
            np.testing.assert_allclose(t.get_ydata(), [s * 1e3 for s, _ in want])
            np.testing.assert_allclose(b.get_ydata(), [p / 2**20 for _, p in want])
        texts = [t.get_text() for t in top.texts]
        assert f"{raw('mma', 8192, d)[0] * 1e3:.2f} ms" in texts
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [IMPL_TITLES[i] for i in IMPLS]


def test_figure_leaves_out_what_did_not_run(tmp_path):
    from lessons.views.backward import recorded_backward_figure

    path = write_csv(tmp_path / "results.csv", [
        ["naive", n, 64, 2, False, "float16", 1e-3 * n, 1.0, 1000 * n, ""] for n in (256, 512)] + [
        ["torch", n, 64, 2, False, "float16", "", "", "", "skipped: torch is not installed"] for n in (256, 512)])
    fig = recorded_backward_figure(BackwardRun(tuple(read_backward_csv(path)), "measured live on a test", live=True))
    top, bottom = fig.get_axes()
    assert [line.get_label() for line in top.get_lines()] == [IMPL_TITLES["naive"]]
    np.testing.assert_allclose(top.get_lines()[0].get_ydata(), [256e-3 * 1e3, 512e-3 * 1e3])
    assert "measured live on a test" in fig._suptitle.get_text()


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------

def test_reader_rejects_bad_files(tmp_path):
    good = ["naive", 512, 64, 2, False, "float16", 2e-3, 1.0, 1000, ""]
    with pytest.raises(FileNotFoundError):
        read_backward_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match=r"missing \['peak_bytes'\]"):
        read_backward_csv(write_csv(tmp_path / "a.csv", [good[:8] + good[9:]],
                                    header=("impl", "n", "d", "heads", "causal", "dtype", "seconds", "tflops", "note")))
    with pytest.raises(ValueError, match=r"line 2: column 'seconds' must be float"):
        read_backward_csv(write_csv(tmp_path / "b.csv", [good[:6] + ["fast"] + good[7:]]))
    with pytest.raises(ValueError, match=r"line 3: column 'n' must be a positive int"):
        read_backward_csv(write_csv(tmp_path / "c.csv", [good, good[:1] + [0] + good[2:]]))
    with pytest.raises(ValueError, match=r"column 'causal' must be True or False"):
        read_backward_csv(write_csv(tmp_path / "d.csv", [good[:4] + ["yes"] + good[5:]]))
    with pytest.raises(ValueError, match="non-negative"):
        read_backward_csv(write_csv(tmp_path / "e.csv", [good[:6] + [-1.0] + good[7:]]))
    with pytest.raises(ValueError, match="no rows"):
        read_backward_csv(write_csv(tmp_path / "f.csv", []))


def test_summary_table_and_figure_reject_what_the_run_lacks():
    from lessons.views.backward import recorded_backward_figure

    run = recorded_backward()
    with pytest.raises(ValueError, match=r"sequence lengths \[1024, 4096, 8192\].*got 2048"):
        backward_summary(run, 2048)
    with pytest.raises(ValueError, match="no rows with d = 96"):
        backward_summary(run, d=96)
    with pytest.raises(ValueError, match="no rows with d = 64 and dtype 'float32'"):
        backward_summary(run, dtype="float32")
    with pytest.raises(TypeError, match="run must be a BackwardRun"):
        backward_summary(list(run.rows))
    with pytest.raises(ValueError, match="head_dims"):
        backward_table(run, head_dims=(32,))
    with pytest.raises(TypeError, match="BackwardRun"):
        recorded_backward_figure(run.rows)
    with pytest.raises(ValueError, match="no measured rows in dtype 'float32'"):
        recorded_backward_figure(run, dtype="float32")
    with pytest.raises(TypeError, match="live must be"):
        backward_results(live="yes")


@pytest.mark.parametrize("kwargs, match", [(dict(sizes=(0,)), "sizes"), (dict(head_dims=(64.5,)), "head_dims"),
                                           (dict(heads=0), "heads"), (dict(repeats=0), "repeats"),
                                           (dict(sizes=()), "sizes must hold at least one int")])
def test_measure_rejects_bad_sizes_before_looking_for_a_device(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        measure_backward(**kwargs)


# ---------------------------------------------------------------------------
# live, on a CUDA device
# ---------------------------------------------------------------------------

@pytest.mark.skipif(not gpu.device_available(), reason="needs a CUDA device")
def test_live_measurement_gives_rows_the_views_take():
    from lessons.views.backward import recorded_backward_figure

    run = measure_backward(sizes=(256, 512), head_dims=(64,), heads=2, warmup=1, repeats=2)
    assert run.live and run.label.startswith(f"measured live on {gpu.device_name()}")
    assert [(r["impl"], r["n"]) for r in run.rows] == [(i, n) for n in (256, 512) for i in IMPLS]
    for r in run.rows:
        if r["impl"] != "torch" or r["seconds"] is not None:
            assert r["seconds"] > 0 and r["peak_bytes"] >= 0
            assert r["tflops"] == pytest.approx(10 * r["n"] ** 2 * 64 * 2 / r["seconds"] / 1e12)
        else:
            assert r["note"].startswith("skipped: torch")
    # the naive backward holds P, dP and dS: at least 3 x (heads, N, N) float32 beyond its inputs
    assert backward_row(run, "naive", 512, 64)["peak_bytes"] >= 3 * 2 * 512 * 512 * 4
    assert backward_summary(run).n == 512 and "N = 512" in backward_table(run)
    assert len(recorded_backward_figure(run).get_axes()) == 2


def test_live_measurement_loop_on_a_stand_in_device(monkeypatch):
    """measure_backward's loop without a GPU: CuPy replaced by NumPy with events that say 2 ms, the
    launchers by stand-ins (the tensor-core one failing as on a GPU older than sm_80), torch absent.
    What is checked is what the loop makes of them: one row per (d, N, impl), FLOP/s from the time,
    skips and failures as notes, the live label."""
    import sys
    import types

    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    class MemoryHook:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)          # arrays and maths: NumPy's
    fake.cuda = types.SimpleNamespace(Event=Event, get_elapsed_time=lambda start, end: 2.0, MemoryHook=MemoryHook,
                                      Device=lambda: types.SimpleNamespace(synchronize=lambda: None))
    fake.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "torch", None)              # import torch -> ImportError
    monkeypatch.setattr(gpu, "device_available", lambda: True)
    monkeypatch.setattr(gpu, "device_name", lambda: "Stand-in GPU (sm_75)")
    monkeypatch.setattr(gpu, "flash_attention_gpu", lambda q, k, v: (q, np.zeros(q.shape[:-1], np.float32)))
    calls = []
    monkeypatch.setattr(gpu, "flash_attention_backward_gpu", lambda *a: calls.append(a[0].shape) or (a[0],) * 3)

    def old_gpu(*a):
        raise RuntimeError("the tensor-core backward needs compute capability 8.0 or newer\nmore")
    monkeypatch.setattr(gpu, "flash_attention_backward_mma_gpu", old_gpu)

    run = measure_backward(sizes=(16, 32), head_dims=(64, 96), heads=2, warmup=1, repeats=3)
    assert run.live and run.label.startswith("measured live on Stand-in GPU (sm_75), ")
    assert [(r["d"], r["n"], r["impl"]) for r in run.rows] == [(d, n, i) for d in (64, 96) for n in (16, 32) for i in IMPLS]
    assert calls[0] == (2, 16, 64) and len(calls) == 4 * (1 + 3 + 1)      # per (d, N): warmup, repeats, peak
    for r in run.rows:
        assert (r["heads"], r["causal"], r["dtype"]) == (2, False, "float16")
        if r["impl"] in ("naive", "kernel"):
            assert r["seconds"] == 2e-3 and r["peak_bytes"] == 0 and r["note"] == ""
            assert r["tflops"] == pytest.approx(10 * r["n"] ** 2 * r["d"] * 2 / 2e-3 / 1e12)
        else:
            assert r["seconds"] is r["tflops"] is r["peak_bytes"] is None
    notes = {(r["impl"], r["d"]): r["note"] for r in run.rows}
    assert notes["mma", 64] == "failed: RuntimeError: the tensor-core backward needs compute capability 8.0 or newer"
    assert notes["mma", 96] == "skipped: the tensor-core backward takes d = 64 or 128"
    assert notes["torch", 64] == "skipped: torch is not installed"
    assert "| skipped: torch is not installed |" in backward_table(run, head_dims=(64,))


GOOD = ["naive", 512, 64, 2, False, "float16", 2e-3, 1.0, 1000, ""]


@pytest.mark.parametrize("rows, match", [
    ([GOOD, GOOD[:2]], r"line 3: 2 fields, the header has 10"),
    ([GOOD + ["extra"]], r"line 2: 11 fields, the header has 10"),
    ([["flash"] + GOOD[1:]], r"line 2: column 'impl' must be one of \['naive', 'kernel', 'mma', 'torch'\], got 'flash'"),
    ([GOOD[:6] + [0.0] + GOOD[7:]], r"line 2: column 'seconds' must be above 0"),
    ([GOOD[:6] + ["inf"] + GOOD[7:]], r"line 2: column 'seconds' must be a finite"),
    ([GOOD[:7] + ["nan"] + GOOD[8:]], r"line 2: column 'tflops' must be a finite"),
    ([GOOD[:8] + [""] + GOOD[9:]], r"line 2: columns \['seconds', 'tflops', 'peak_bytes'\] are all given .* "
                                   r"got only \['seconds', 'tflops'\]"),
    ([GOOD[:6] + ["", "", 1000, "skipped"]], r"got only \['peak_bytes'\]"),
    ([GOOD, GOOD[:6] + [3e-3] + GOOD[7:]], r"line 3: the same \(impl, n, d, heads, causal, dtype\) .* as line 2"),
], ids=["short-line", "long-line", "unknown-impl", "zero-seconds", "infinite-seconds", "nan-tflops",
        "peak-missing", "only-peak", "duplicate"])
def test_reader_rejects_rows_the_figures_cannot_use(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        read_backward_csv(write_csv(tmp_path / "results.csv", rows))


def test_reader_rejects_a_file_that_is_not_text_and_a_path_that_is_not_one(tmp_path):
    path = tmp_path / "results.csv"
    path.write_bytes(b"\xff\xfe\x00 not a csv")
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        read_backward_csv(path)
    with pytest.raises(TypeError, match="path must be a str or path, got int 5"):
        read_backward_csv(5)
    with pytest.raises(TypeError, match="directory must be a str or path, got bool True"):
        recorded_label(True)


def test_speed_ups_and_memory_ratio_from_hand_made_rows(tmp_path):
    """The speed-ups are naive seconds over each implementation's seconds (why the reader refuses 0 s)."""
    path = write_csv(tmp_path / "results.csv", [GOOD, ["mma"] + GOOD[1:6] + [1e-3, 4.0, 10, ""]])
    s = backward_summary(BackwardRun(tuple(read_backward_csv(path)), "made by hand", live=False))
    assert s.x_naive == {"naive": 1.0, "mma": pytest.approx(2e-3 / 1e-3)}
    assert s.memory_ratio == pytest.approx(10 / 1000)


@pytest.mark.parametrize("call, error, match", [
    (lambda run: backward_row(run, "mmaa", 8192, 64), ValueError, r"impl must be one of .*got 'mmaa'"),
    (lambda run: backward_row(run, "mma", True, 64), TypeError, "n must be an int, got bool"),
    (lambda run: backward_row(run, "mma", 8192, 64.0), TypeError, "d must be an int, got float"),
    (lambda run: backward_summary(run, d=True), TypeError, "d must be an int, got bool"),
    (lambda run: backward_summary(run, n=np.True_), TypeError, "n must be an int, got bool"),
    (lambda run: backward_table(run, head_dims=64), TypeError, "head_dims must be a sequence of ints, got int 64"),
    (lambda run: backward_table(run, head_dims=(True,)), TypeError, "head_dims must be an int, got bool"),
    (lambda run: backward_table(run, head_dims=(64.0,)), TypeError, "head_dims must be an int, got float"),
    (lambda run: backward_table(run, n=True), TypeError, "n must be an int, got bool"),
])
def test_readers_reject_bad_arguments_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call(recorded_backward())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sizes=1024), TypeError, "sizes must be a sequence of ints, got int"),
    (dict(head_dims="64"), TypeError, "head_dims must be a sequence of ints, got str"),
    (dict(sizes=(True,)), TypeError, "sizes must be an int, got bool"),
    (dict(seed=True), TypeError, "seed must be an int, got bool"),
    (dict(seed=-1), ValueError, "seed must be at least 0"),
    (dict(warmup=1.5), TypeError, "warmup must be an int"),
])
def test_measure_rejects_bad_arguments_before_looking_for_a_device(kwargs, error, match):
    with pytest.raises(error, match=match):
        measure_backward(**kwargs)


@pytest.mark.parametrize("live", [False, None])
def test_results_check_the_measure_arguments_even_when_the_recorded_run_is_shown(live):
    with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
        backward_results(live=live, size=(1024,))
    with pytest.raises(ValueError, match="sizes must be at least 1"):
        backward_results(live=live, sizes=(-1,))
    if live is False or not gpu.device_available():
        assert backward_results(live=live, sizes=(512,)) == recorded_backward()


def test_an_installed_package_without_the_recorded_run_says_where_it_comes_from(tmp_path, monkeypatch):
    """``pip install .`` installs lessons/ but not benchmarks/: the readers say so, by name."""
    from lessons.gpu import ladder, recorded

    monkeypatch.setattr(recorded, "RECORDED_DIR", tmp_path / "gone")
    monkeypatch.setattr(recorded, "BACKWARD_CSV", tmp_path / "gone" / "backward" / "results.csv")
    monkeypatch.setattr(ladder, "RECORDED_CSV", tmp_path / "gone" / "forward" / "results.csv")
    monkeypatch.setattr(ladder, "DECODE_RECORDED", tmp_path / "gone" / "decode" / "results.csv")
    monkeypatch.setattr(ladder, "PROFILED_DIR", tmp_path / "gone-too")
    for call in (recorded.recorded_label, recorded.read_backward_csv, recorded.recorded_backward,
                 lambda: recorded.backward_results(live=False), ladder.recorded_rows, ladder.ladder_table,
                 ladder.speedup_claim, ladder.decode_recorded_rows, ladder.decode_table, ladder.sdpa_backends):
        with pytest.raises(FileNotFoundError, match="ships with the repository .*not with an installed package"):
            call()


# ---------------------------------------------------------------------------
# the goal as it was stated: against torch's FlashAttention-2 backend, forward + backward
# ---------------------------------------------------------------------------

def raw_forward(impl, n, d, column):
    """One column of a non-causal float16 row of the forward run's raw CSV, by position, as a float."""
    with open(RECORDED_DIR / "forward" / "results.csv", newline="") as f:
        header, *body = list(csv.reader(f))
    col = {name: i for i, name in enumerate(header)}
    (row,) = [r for r in body if r[col["impl"]] == impl and int(r[col["n"]]) == n and int(r[col["d"]]) == d
              and r[col["dtype"]] == "float16" and r[col["causal"]] == "False"]
    return float(row[col[column]])


def sdpa_backend(n, d, backend, part):
    """(seconds, TF/s) of one backend's ``part`` ("fwd" or "fwd+bwd") in sdpa_backends.txt, read with a
    regular expression."""
    text = (RECORDED_DIR.parent / "gpu_h200_2026-11-30" / "sdpa_backends.txt").read_text()
    m = re.search(rf"N={n} d={d} causal=False {backend}\s.*?{re.escape(part)}\s+([\d.]+) ms\s+([\d.]+) TF/s", text)
    return float(m.group(1)) * 1e-3, float(m.group(2))


@pytest.mark.parametrize("d", [64, 128])
def test_flash_backend_comparison_is_recomputed_from_the_raw_files(d):
    c = flash_backend_comparison(d=d)
    fwd, (bwd, _) = raw_forward("mma_fa2", 8192, d, "seconds"), raw("mma", 8192, d)
    torch_seconds, torch_tflops = sdpa_backend(8192, d, "FLASH_ATTENTION", "fwd+bwd")
    assert (c.n, c.d) == (8192, d)
    assert c.forward_seconds == fwd and c.backward_seconds == bwd and c.ours_seconds == fwd + bwd
    flops = (4 + 10) * 8192**2 * d * 8                           # forward 4 N^2 d, backward 2.5 times that, 8 heads
    assert c.ours_tflops == pytest.approx(flops / (fwd + bwd) / 1e12)
    assert c.torch_tflops == torch_tflops
    assert torch_tflops == pytest.approx(flops / torch_seconds / 1e12, rel=2e-3)   # torch's row used the same count
    assert c.fraction == pytest.approx(c.ours_tflops / torch_tflops) and c.goal_met is (c.fraction >= TORCH_GOAL)
    assert "2026-12-01" in c.label and "2026-11-30" in c.label
    # the backward alone: the backend's recorded milliseconds, forward + backward minus forward, over ours
    torch_fwd_seconds, _ = sdpa_backend(8192, d, "FLASH_ATTENTION", "fwd")
    assert c.backward_fraction == pytest.approx((torch_seconds - torch_fwd_seconds) / bwd, rel=5e-3)
    # the two days: SDPA's default forward, its TFLOP/s in our run's CSV over the earlier run's cuDNN row
    today = raw_forward("torch", 8192, d, "tflops")
    assert c.day_to_day == pytest.approx(today / sdpa_backend(8192, d, "CUDNN_ATTENTION", "fwd")[1] - 1)


def test_flash_backend_goal_met_at_d64_and_not_at_d128():
    """What notebook 04 claims of the recorded runs: 0.38 at d = 64, 0.28 at d = 128, against the goal of 0.3."""
    assert flash_backend_comparison(d=64).fraction == pytest.approx(0.383, abs=5e-4)
    assert flash_backend_comparison(d=128).fraction == pytest.approx(0.284, abs=5e-4)
    assert flash_backend_comparison(d=64).goal_met and not flash_backend_comparison(d=128).goal_met
    assert flash_backend_comparison(d=64).backward_fraction == pytest.approx(0.331, abs=5e-4)
    assert flash_backend_comparison(d=128).backward_fraction == pytest.approx(0.243, abs=5e-4)
    readme = " ".join((RECORDED_DIR.parents[2] / "README.md").read_text().split())       # the repository's README
    assert f"{flash_backend_comparison(d=64).fraction:.2f}x the forward + backward speed of torch's own " \
           "FlashAttention-2 backend" in readme


def test_flash_backend_comparison_follows_the_rows_and_names_what_is_missing(tmp_path):
    rows = [dict(impl=i, n=1024, d=64, heads=2, causal=False, dtype="float16", seconds=s, tflops=1.0, peak_bytes=2**20,
                 note="") for i, s in (("naive", 4e-3), ("mma", 1e-3), ("torch", 2e-3))]
    run = BackwardRun(tuple(rows), "made by hand", live=False)
    forward = [dict(impl="mma_fa2", n=1024, d=64, dtype="float16", causal=False, seconds=1e-3)]
    backends = tmp_path / "sdpa_backends.txt"
    backends.write_text("torch, a GPU\nN=1024 d=64 causal=False FLASH_ATTENTION      fwd   0.1 ms  1.0 TF/s | "
                        "fwd+bwd   0.5 ms  2.0 TF/s\n")
    c = flash_backend_comparison(1024, 64, run=run, forward_rows=forward, backends_path=backends)
    flops = 1024**2 * 64 * 2
    assert c.ours_seconds == pytest.approx(2e-3) and c.ours_tflops == pytest.approx(14 * flops / 2e-3 / 1e12)
    assert c.fraction == pytest.approx(c.ours_tflops / 2.0) and "made by hand" in c.label
    assert c.backward_fraction == pytest.approx((14 * flops / 2e12 - 4 * flops / 1e12) / 1e-3)
    assert np.isnan(c.day_to_day)                   # no SDPA forward row in our run, no cuDNN row in theirs
    with pytest.raises(ValueError, match="the forward row has 8 heads and the backward run 2"):
        flash_backend_comparison(1024, 64, run=run, forward_rows=[dict(forward[0], heads=8)], backends_path=backends)
    with pytest.raises(ValueError, match="no FA-2 rung row at N = 1024, d = 64"):
        flash_backend_comparison(1024, 64, run=run, forward_rows=[dict(forward[0], d=128)], backends_path=backends)
    backends.write_text("N=1024 d=64 causal=False CUDNN_ATTENTION fwd 0.1 ms 1.0 TF/s | fwd+bwd 0.5 ms 2.0 TF/s\n")
    with pytest.raises(ValueError, match="no FLASH_ATTENTION row at N = 1024, d = 64"):
        flash_backend_comparison(1024, 64, run=run, forward_rows=forward, backends_path=backends)
    with pytest.raises(ValueError, match="no tensor-core row"):
        flash_backend_comparison(1024, 64, run=BackwardRun(tuple(r for r in rows if r["impl"] != "mma"), "x", False),
                                 forward_rows=forward, backends_path=backends)

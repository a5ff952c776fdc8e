"""scripts/tune_decode.py, the decode split sweep: its split counts per shape, its refusals, its run on the CPU
emulator against NumPy, and its GPU path's plumbing with a stand-in for CuPy (NumPy arrays, the emulator's
launches, the CPU clock), so that the short GPU session that runs it spends no time on a broken script."""
import csv
import importlib.util
import re
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu import ladder
from lessons.gpu.source import decode_splits

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("tune_decode", ROOT / "scripts" / "tune_decode.py")
tune = importlib.util.module_from_spec(_spec)          # a developer tool, not part of the package
_spec.loader.exec_module(tune)

needs_emulator = pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the emulator")


def model_faster(auto: int, pages: int, blocks_per_split: int, wave: int) -> list[int]:
    """The counts up to 16 auto that beat auto in the wave model, counted with loops: per count, the waves its
    blocks take (blocks handed out wave by wave) times the pages of its longest split; the fewest and the fastest."""
    def time(splits):
        blocks, waves = splits * blocks_per_split, 0
        while blocks > 0:
            blocks -= wave
            waves += 1
        longest = max(len(range(pages)[i::splits]) for i in range(splits))     # pages dealt out round robin
        return waves * longest
    base = time(auto)
    faster = [s for s in range(1, min(pages, 16 * auto) + 1) if time(s) < base]
    if not faster:
        return []
    return sorted({faster[0], min(faster, key=lambda s: (time(s), s))})


def documented_counts(auto: int, pages: int, model=()) -> list[int]:
    """split_counts' docstring, read literally: auto, auto -+ 1, auto // 4, auto // 2, 2 auto, 4 auto, the
    absolute counts within a factor 16 of auto and the model's counts, kept in 1..pages."""
    near = [auto, auto - 1, auto + 1, auto // 4, auto // 2, 2 * auto, 4 * auto]
    wide = [s for s in (1, 2, 4, 8, 16, 32, 64, 132, 264) if auto / 16 <= s <= auto * 16]
    return sorted({s for s in near + wide + list(model) if 1 <= s <= pages})


def test_each_shape_sweeps_the_counts_its_docstring_names():
    doc = " ".join(tune.split_counts.__doc__.split())
    shown = re.findall(r"(\d+) x (\d+) \(auto (\d+)\) -> ([\d ]+?)[;.]", doc)
    assert [(int(n), int(length)) for n, length, _, _ in shown] == list(tune.GPU_SHAPES)
    for (num_seqs, seq_len, auto, counts), (_, _, doc_auto, doc_counts) in zip(
            tune.plan(tune.GPU_SHAPES, tune.GPU_GEOMETRY, 132), shown):
        pages = seq_len // 16
        want_auto = decode_splits(num_seqs, 8, seq_len)               # 32 heads on 8: one block per group
        assert auto == want_auto == int(doc_auto)
        model = model_faster(want_auto, pages, num_seqs * 8, 132 * 4)
        assert counts == documented_counts(want_auto, pages, model) == [int(s) for s in doc_counts.split()]
    # the model adds counts at one shape only: 8 x 32768, where 4 waves of 33 splits beat one wave of 8
    assert "(At 8 x 32768, 33 and 41 come from the model.)" in doc
    assert [model_faster(a, n // 16, s * 8, 528) for s, n, a, _ in tune.plan(tune.GPU_SHAPES, tune.GPU_GEOMETRY, 132)] \
        == [[], [33, 41], []]
    # a GPU of fewer SMs picks fewer splits, and the counts follow the pick
    (_, _, auto, counts), = tune.plan([(1, 131072)], tune.GPU_GEOMETRY, 108)
    assert auto == decode_splits(1, 8, 131072, num_sms=108)
    assert counts == documented_counts(auto, 8192, model_faster(auto, 8192, 8, 108 * 4))
    # never more splits than pages, never fewer than 1
    assert tune.split_counts(3, 3) == [1, 2, 3] and tune.split_counts(1, 1) == [1]


@pytest.mark.parametrize("bad", ["64", "64x", "x64", "0x64", "64x0", "ax64", "64x4096x2", "64*4096"])
def test_a_bad_shape_is_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit):
        tune.parse_args(["--shapes", "64x4096", bad])
    assert f"{bad!r} is not SEQSxTOKENS" in capsys.readouterr().err
    assert tune.parse_args(["--shapes", "2X64", "2x64", "1x48"]).shapes == [(2, 64), (1, 48)]   # each once


def test_a_shape_too_large_for_any_gpu_is_refused_by_name(capsys):
    # K and V, 8 KV heads x d = 128 x 2 bytes each per token: 4 KiB a token on the GPU, 1 KiB on the emulator (2 heads)
    per_token = 2 * 8 * 128 * 2
    assert tune.parse_args(["--shapes", "1024x65536"]).shapes == [(1024, 65536)]      # 256 GiB: the most allowed
    assert 1024 * 65536 * per_token == 256 * 2**30
    for bad, gib in (("1024x65537", 1024 * 65537 * per_token / 2**30), ("1x1099511627777", 4 * 2**20)):
        with pytest.raises(SystemExit):
            tune.parse_args(["--shapes", bad])
        assert f"--shapes {bad}: its K/V cache is {gib:,.0f} GiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.parse_args(["--emulator", "--shapes", f"{1 << 15}x{1 << 14}"])
    assert f"its K/V cache is {(1 << 29) * 1024 // 2**30:,} GiB (2 KV heads" in capsys.readouterr().err


def test_more_sequences_than_a_grid_holds_are_refused_by_name(capsys):
    assert tune.parse_args(["--emulator", "--shapes", "65535x1"]).shapes == [(65535, 1)]
    with pytest.raises(SystemExit):
        tune.parse_args(["--emulator", "--shapes", "65536x1"])
    assert "--shapes 65536x1: at most 65535 sequences" in capsys.readouterr().err


def test_ratios_and_the_fastest_count_by_hand():
    rows = [dict(shape="8x32768", num_splits=4, auto=False, seconds=2.0, x_auto=None),
            dict(shape="8x32768", num_splits=8, auto=True, seconds=1.0, x_auto=None),
            dict(shape="8x32768", num_splits=16, auto=False, seconds=0.5, x_auto=None),
            dict(shape="1x131072", num_splits=66, auto=True, seconds=1.0, x_auto=None),
            dict(shape="1x131072", num_splits=132, auto=False, seconds=None, x_auto=None)]
    tune.add_ratios(rows)
    assert [r["x_auto"] for r in rows] == [0.5, 1.0, 2.0, 1.0, None]
    assert tune.best_line(rows) == "fastest: 8x32768 s=16 (2.00x auto), 1x131072 s=66 (auto)"
    tie = tune.add_ratios(rows[3:4] + [dict(rows[0], shape="1x131072", num_splits=8, seconds=1.0)])
    assert tune.best_line(tie) == "fastest: 1x131072 s=8 (1.00x auto)"        # a tie: the fewer splits


@pytest.mark.skipif(gpu.device_available(), reason="checks what happens without a device")
def test_without_a_device_it_says_so_and_writes_nothing(tmp_path, capsys):
    assert tune.main(["--out", str(tmp_path / "o")]) == 0
    assert "decode split sweep not run: no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "o").exists()


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@needs_emulator
def test_the_emulator_sweep_agrees_with_numpy_and_writes_both_files(tmp_path, capsys):
    assert tune.main(["--emulator", "--out", str(tmp_path), "--shapes", "2x64", "1x48"]) == 0
    rows = read_csv(tmp_path / "decode_splits.csv")
    assert list(rows[0]) == list(tune.COLUMNS)
    for num_seqs, seq_len, auto, counts in tune.plan([(2, 64), (1, 48)], tune.EMULATOR_GEOMETRY, 132):
        mine = [r for r in rows if r["shape"] == f"{num_seqs}x{seq_len}"]
        assert [int(r["num_splits"]) for r in mine] == counts and len(counts) >= 3
        assert [int(r["num_splits"]) for r in mine if r["auto"] == "True"] == [auto]
    for r in rows:
        err = float(re.search(r"max abs diff from NumPy (\S+)", r["note"])[1])
        assert err <= tune.EMULATOR_TOLERANCE and float(r["max_abs_diff"]) <= tune.EMULATOR_TOLERANCE
        assert r["seconds"] == "" and r["note"].startswith("emulator: not timed")
    md = (tmp_path / "decode_splits.md").read_text()
    assert "| shape | splits | auto |" in md and md.splitlines()[-1] == "fastest: nothing was timed"
    assert capsys.readouterr().out.splitlines()[-1] == f"7 split counts: all match NumPy; results in {tmp_path}"


def test_the_prefetch_sweep_picks_from_a_wave_of_three_blocks_per_sm():
    # 1 x 131072 on an H200: 8 blocks per split, 396 / 8 -> 49 splits with prefetch (528 / 8 -> 66 without)
    (_, _, auto, counts), = tune.plan([(1, 131072)], tune.GPU_GEOMETRY, 132, "paged_decode_prefetch")
    assert auto == decode_splits(1, 8, 131072, blocks_per_sm=3) == 49
    # (a wave of 396: 99 splits, 792 blocks in 2 full waves x 83 pages, beat 49's 1 x 168 in the model)
    assert model_faster(49, 8192, 8, 396) == [99] and counts == documented_counts(49, 8192, [99])
    assert tune.auto_splits(1, 131072, tune.GPU_GEOMETRY, 132) == 66
    assert (tune.stem(), tune.stem("paged_decode_prefetch")) == ("decode_splits", "decode_splits_prefetch")


def test_the_cp_async_sweep_picks_from_a_wave_of_four_blocks_per_sm_as_the_plain_build():
    # 4 blocks per SM as the plain build: at each GPU shape the same pick and counts, 1 x 131072 -> 528 / 8 -> 66
    cp_async = tune.plan(tune.GPU_SHAPES, tune.GPU_GEOMETRY, 132, "paged_decode_cp_async")
    assert cp_async == tune.plan(tune.GPU_SHAPES, tune.GPU_GEOMETRY, 132)
    assert [auto for _, _, auto, _ in cp_async] == [decode_splits(n, 8, length) for n, length in tune.GPU_SHAPES]
    assert cp_async[-1][2] == 66 and cp_async[-1][3] == documented_counts(66, 8192)
    assert tune.stem("paged_decode_cp_async") == "decode_splits_cp_async"
    # each build's launcher keywords are the ladder's, the rung names the ladder's decode rungs
    assert [tune.launch_options(r) for r in tune.BUILDS] == [{}, {"prefetch": True}, {"cp_async": True}]
    assert set(tune.BUILDS) <= {r.name for r in ladder.DECODE_RUNGS}
    assert "cp.async build" in tune.build_name("paged_decode_cp_async")
    with pytest.raises(ValueError, match="rung must be one of .*got 'paged_decode'"):
        tune.stem("paged_decode")


@pytest.mark.parametrize("flags, rung", [([], "paged_decode_split"), (["--prefetch"], "paged_decode_prefetch"),
                                         (["--cp-async"], "paged_decode_cp_async")])
def test_each_build_flag_picks_its_rung(flags, rung):
    assert tune.parse_args(flags).rung == rung


@pytest.mark.parametrize("flags", [["--prefetch", "--cp-async"], ["--cp-async", "--prefetch"]])
def test_the_prefetch_and_cp_async_flags_are_refused_together(flags, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        tune.main(flags + ["--emulator", "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[1]}: not allowed with argument {flags[0]}" in err
    assert not (tmp_path / "o").exists()


@needs_emulator
def test_the_emulator_prefetch_sweep_agrees_with_numpy_in_its_own_files(tmp_path, capsys):
    assert tune.main(["--emulator", "--prefetch", "--out", str(tmp_path), "--shapes", "1x48"]) == 0
    rows = read_csv(tmp_path / "decode_splits_prefetch.csv")
    (_, _, auto, counts), = tune.plan([(1, 48)], tune.EMULATOR_GEOMETRY, 132, "paged_decode_prefetch")
    assert [int(r["num_splits"]) for r in rows] == counts
    assert all(float(r["max_abs_diff"]) <= tune.EMULATOR_TOLERANCE for r in rows)
    assert not (tmp_path / "decode_splits.csv").exists()
    assert "prefetch build" in (tmp_path / "decode_splits_prefetch.md").read_text().splitlines()[0]


@needs_emulator
def test_the_emulator_cp_async_sweep_agrees_with_numpy_in_its_own_files(tmp_path, capsys):
    assert tune.main(["--emulator", "--cp-async", "--out", str(tmp_path), "--shapes", "1x48"]) == 0
    rows = read_csv(tmp_path / "decode_splits_cp_async.csv")
    (_, _, auto, counts), = tune.plan([(1, 48)], tune.EMULATOR_GEOMETRY, 132, "paged_decode_cp_async")
    assert [int(r["num_splits"]) for r in rows] == counts
    assert [int(r["num_splits"]) for r in rows if r["auto"] == "True"] == [auto]
    inputs = tune.host_inputs(1, 48, tune.EMULATOR_GEOMETRY)                  # the sweep's inputs, seed 0
    reference = tune.lessons.paged_decode(*(x.astype(np.float64) for x in inputs[:3]), *inputs[3:])
    for r in rows:                    # each note gives that count's own distance from NumPy, within the tolerance
        out = gpu.paged_decode_split_gpu(*inputs, int(r["num_splits"]), cp_async=True, backend="emulator")[0]
        err = float(np.abs(np.asarray(out, np.float64) - reference).max())
        assert f"max abs diff from NumPy {err:.1e}" in r["note"] and err <= tune.EMULATOR_TOLERANCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode_splits_cp_async.csv", "decode_splits_cp_async.md"]
    assert "cp.async build" in (tmp_path / "decode_splits_cp_async.md").read_text().splitlines()[0]


@needs_emulator
def test_the_emulator_sweep_fails_when_an_output_differs_from_numpy(tmp_path, monkeypatch, capsys):
    real = tune.lessons.paged_decode
    monkeypatch.setattr(tune.lessons, "paged_decode", lambda *a: real(*a) + 0.01)
    assert tune.main(["--emulator", "--out", str(tmp_path), "--shapes", "1x48"]) == 1
    assert "NOT ALL MATCH NumPy" in capsys.readouterr().out


@needs_emulator
def test_the_sweep_fails_when_the_launcher_picks_another_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tune, "auto_splits", lambda *a: 2)            # the launcher picks 3 splits at 1 x 48
    assert tune.main(["--emulator", "--out", str(tmp_path), "--shapes", "1x48"]) == 1
    auto, = [r for r in read_csv(tmp_path / "decode_splits.csv") if r["auto"] == "True"]
    assert auto["num_splits"] == "3" and "the launcher picked 3 splits, auto_splits 2" in auto["note"]


def stand_in_cupy():
    """Just enough of CuPy for run_gpu: NumPy arrays, events on the CPU clock, 132 SMs."""
    class Event:
        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

    rng = []
    cuda = types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        runtime=types.SimpleNamespace(getDeviceProperties=lambda i: {"multiProcessorCount": 132}),
        Device=lambda: types.SimpleNamespace(id=0))
    random = types.SimpleNamespace(seed=lambda s: rng.append(np.random.default_rng(s)),
                                   standard_normal=lambda shape, dtype: rng[-1].standard_normal(shape).astype(dtype))
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    return types.SimpleNamespace(cuda=cuda, random=random, asarray=np.asarray, full=np.full,
                                 get_default_memory_pool=lambda: pool)


@needs_emulator
def test_the_gpu_path_times_each_count_and_names_the_fastest(tmp_path, monkeypatch, capsys):
    launch = tune._launch
    monkeypatch.setitem(sys.modules, "cupy", stand_in_cupy())
    monkeypatch.setattr(tune, "_launch", lambda inputs, s, backend, **kw: launch(inputs, s, "emulator", **kw))
    monkeypatch.setattr(tune.gpu_decode, "device_copy_rate", lambda cupy, mib, repeats: 4e12)
    monkeypatch.setattr(tune.gpu, "device_available", lambda: True)
    monkeypatch.setattr(tune.gpu, "device_name", lambda: "STAND-IN GPU")
    args = ["--out", str(tmp_path), "--shapes", "1x48", "--repeats", "1", "--target-seconds", "1e-6"]
    assert tune.main(args) == 0
    rows = read_csv(tmp_path / "decode_splits.csv")
    (_, _, auto, counts), = tune.plan([(1, 48)], tune.GPU_GEOMETRY, 132)
    assert [int(r["num_splits"]) for r in rows] == counts
    for r in rows:
        seconds = float(r["seconds"])
        assert seconds > 0 and float(r["tb_per_s"]) == pytest.approx(2 * 48 * 8 * 128 * 2 / seconds / 1e12)
        assert float(r["pct_of_copy"]) == pytest.approx(100 * 2 * 48 * 8 * 128 * 2 / seconds / 4e12)
        assert float(r["max_abs_diff"]) < 1e-3 and r["note"] == ""
    assert [float(r["x_auto"]) for r in rows if r["auto"] == "True"] == [1.0]
    md = (tmp_path / "decode_splits.md").read_text()
    assert "STAND-IN GPU (132 SMs)" in md and "4.00 TB/s" in md
    assert md.splitlines()[-1] == tune.best_line(tune.add_ratios(
        [dict(r, num_splits=int(r["num_splits"]), auto=r["auto"] == "True", seconds=float(r["seconds"]))
         for r in rows]))
    assert capsys.readouterr().out.splitlines()[-1].startswith("fastest: 1x48 s=")
    # a spent time budget: every count is named as skipped, and the tables are still written
    assert tune.main(args + ["--out", str(tmp_path / "late"), "--time-budget", "0"]) == 0
    rows = read_csv(tmp_path / "late" / "decode_splits.csv")
    assert len(rows) == len(counts) and all(r["note"] == "skipped: time budget spent" for r in rows)
    assert (tmp_path / "late" / "decode_splits.md").read_text().splitlines()[-1] == "fastest: nothing was timed"


@needs_emulator
def test_the_gpu_path_of_the_cp_async_build_launches_it_and_writes_its_own_files(tmp_path, monkeypatch, capsys):
    launch, calls = tune._launch, []

    def emulated(inputs, s, backend, **kw):
        calls.append(tune.launch_options(kw.get("rung", tune.DEFAULT_RUNG)))
        return launch(inputs, s, "emulator", **kw)

    monkeypatch.setitem(sys.modules, "cupy", stand_in_cupy())
    monkeypatch.setattr(tune, "_launch", emulated)
    monkeypatch.setattr(tune.gpu_decode, "device_copy_rate", lambda cupy, mib, repeats: 4e12)
    monkeypatch.setattr(tune.gpu, "device_available", lambda: True)
    monkeypatch.setattr(tune.gpu, "device_name", lambda: "STAND-IN GPU")
    assert tune.main(["--cp-async", "--out", str(tmp_path), "--shapes", "1x48", "--repeats", "1",
                      "--target-seconds", "1e-6"]) == 0
    assert calls and all(c == {"cp_async": True} for c in calls)       # every launch, timed or not, of that build
    rows = read_csv(tmp_path / "decode_splits_cp_async.csv")
    (_, _, auto, counts), = tune.plan([(1, 48)], tune.GPU_GEOMETRY, 132, "paged_decode_cp_async")
    assert [int(r["num_splits"]) for r in rows] == counts and all(float(r["seconds"]) > 0 for r in rows)
    assert [int(r["num_splits"]) for r in rows if r["auto"] == "True"] == [auto]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode_splits_cp_async.csv", "decode_splits_cp_async.md"]
    title = (tmp_path / "decode_splits_cp_async.md").read_text().splitlines()[0]
    assert title.startswith("# The split decode kernel's cp.async build at split counts") and "STAND-IN GPU" in title


def test_split_counts_refuse_a_count_that_is_not_a_positive_int():
    # the counts of an 8 x 32768 sweep, by hand: auto 8 and its neighbours, halves and doubles, the absolute
    # counts within the span, and the model's 33 and 41
    assert tune.split_counts(np.int64(8), 2048, (33, 41)) == tune.split_counts(8, 2048, [33, 41])
    for args, error, name in (((0, 10), ValueError, "auto must be at least 1, got 0"),
                              ((-1, 10), ValueError, "auto must be at least 1"),
                              ((True, 5), TypeError, "auto must be an int, got bool"),
                              ((8, 0), ValueError, "pages must be at least 1, got 0"),
                              ((8, 2048, (33, 9.5)), TypeError, r"model\[1\] must be an int, got float 9.5"),
                              ((8, 2048, (0,)), ValueError, r"model\[0\] must be at least 1"),
                              ((8, 2048, 33), TypeError, "model must be a tuple of split counts")):
        with pytest.raises(error, match=name):
            tune.split_counts(*args)

"""scripts/gpu_check.sh, checked on the CPU before any GPU time is spent on it.

``--dry-run`` runs every step of the script with the kernels on the CPU emulator: the
environment report, the compile report, a few kernel tests, each kernel's sanitizer
driver (without compute-sanitizer), the benchmark (which says there is no device), the
tuning sweeps of the wide-warp and lazy FA-2 rungs and of the register-tiled rung and its wide build (each
configuration once on the emulator)
and the decode split sweep (each split count of a tiny shape once on the emulator, against NumPy).
What it cannot check is the GPU itself; the plumbing (steps, files, summary, exit
status, the list of kernels against the drivers) it can.
"""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lessons.gpu as gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

_spec = importlib.util.spec_from_file_location("sanitize", ROOT / "scripts" / "sanitize.py")
sanitize = importlib.util.module_from_spec(_spec)     # a developer tool, not part of the package
_spec.loader.exec_module(sanitize)
_spec = importlib.util.spec_from_file_location("tune_tiles", ROOT / "scripts" / "tune_tiles.py")
tune = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune)
_spec = importlib.util.spec_from_file_location("tune_decode", ROOT / "scripts" / "tune_decode.py")
tune_decode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tune_decode)

pytestmark = pytest.mark.skipif(
    not gpu.emulator_available() or (not gpu.nvrtc_available() and not os.environ.get("CI")),
    reason="the dry run needs g++ (emulator) and CuPy/NVRTC (compile report)")


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_a_dry_run_goes_through_every_step_and_writes_every_file(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    steps = {line[:52].strip(): line[52:].split()[0] for line in summary.splitlines()}
    assert steps.pop("device") == "skip"
    assert steps.pop("ring on the GPU (MPI)") == "skip"              # needs a device
    decode = steps.pop("benchmark decode")                              # present once its script is in the tree
    assert decode == ("ok" if (ROOT / "benchmarks" / "gpu_decode.py").exists() else "skip")
    expected = {"compile report", "pytest pass 1 (-n 2)", "benchmark forward", "benchmark backward", "total",
                "tune mma_fa2_lazy tiles", "tune mma_fa2_wide tiles", "tune regtile tiles", "tune regtile_wide tiles",
                "decode split sweep", "decode split sweep (prefetch)"}
    expected |= {f"hopper smoke {rung}" for rung in ("wgmma", "wgmma_overlap", "wgmma_pingpong")}
    expected |= {f"ncu {rung}" for rung in ("mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "wgmma", "wgmma_overlap", "wgmma_pingpong",
                                           "paged_decode_split", "paged_decode_prefetch", "regtile_wide")}
    expected |= {f"drivers (emulator) {k}" for k in sanitize.KERNELS}      # the script runs every driver
    assert set(steps) == expected and set(steps.values()) == {"ok"}, summary
    assert "passed" in summary and "failed" not in summary
    for rung in ("wgmma", "wgmma_overlap", "wgmma_pingpong"):                             # (on the emulator)
        assert f"works here: {rung}" in (tmp_path / f"hopper_smoke_{rung}.txt").read_text()
    for name in ("env.txt", "compile_report.txt", "pytest_1_n2.txt", "pytest_1_n2.xml", "benchmark/log.txt",
                 "backward/log.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = (tmp_path / "compile_report.txt").read_text()
    assert "flash_attention_mma" in report and report.count("flash_attention_mma_fa2_lazy") >= 2 * 8
    assert report.count("flash_attention_mma_fa2_wide") >= len(tune.SWEEPS[tune.WIDE].configs(64)) + \
        len(tune.SWEEPS[tune.WIDE].configs(128))
    assert "REGTILE_WIDE=1" in report          # the wide register-tiled rung's default build (its name cut short there)
    # the tuning sweep ran every legal configuration of the lazy rung (and the FA-2 rung per head dim)
    with open(tmp_path / "fa2_configs" / "fa2_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], int(r["d"]), int(r["block_q"]), int(r["block_k"]), int(r["min_blocks"])) for r in rows] == \
        [(impl, d, *c) for impl, d, c in tune.runs([64, 128])]
    assert all(r["note"] == "emulator: not timed" for r in rows) and (tmp_path / "fa2_configs" / "fa2_configs.md").is_file()
    # and the wide-warp rung's, beside the same FA-2 rung
    with open(tmp_path / "fa2_wide_configs" / "fa2_wide_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], int(r["d"]), int(r["block_q"]), int(r["block_k"]), int(r["min_blocks"])) for r in rows] == \
        [(impl, d, *c) for impl, d, c in tune.runs([64, 128], tune.WIDE)]
    assert rows[0]["impl"] == "mma_fa2_wide" and {r["impl"] for r in rows} == {"mma_fa2_wide", "mma_fa2"}
    with open(tmp_path / "regtile_configs" / "regtile_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], int(r["d"])) for r in rows] == [(impl, d) for impl, d, _ in tune.runs([64, 128], "regtile")]
    # and the wide register-tiled rung's tiles (the default first, then REGTILE_WIDE_SWEEP), beside naive CuPy
    with open(tmp_path / "regtile_wide_configs" / "regtile_wide_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], int(r["d"]), r["block_q"], r["block_k"]) for r in rows] == \
        [(impl, d, str(bq or ""), str(bk or "")) for impl, d, (bq, bk, _) in tune.runs([64, 128], "regtile_wide")]
    assert [r["impl"] for r in rows].count("naive") == 2 and rows[0]["impl"] == "regtile_wide"
    assert all(r["note"] == "emulator: not timed" for r in rows)
    assert "wide register-tiled CUDA-core rung" in \
        (tmp_path / "regtile_wide_configs" / "regtile_wide_configs.md").read_text()
    for folder in ("benchmark", "backward"):
        assert "GPU benchmark not run" in (tmp_path / folder / "log.txt").read_text()
    # the decode split sweep ran each split count of its tiny shape on the emulator, each matching NumPy
    with open(tmp_path / "decode_splits" / "decode_splits.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    (_, _, _, counts), = tune_decode.plan(tune_decode.EMULATOR_SHAPES, tune_decode.EMULATOR_GEOMETRY, 132)
    assert [int(r["num_splits"]) for r in rows] == counts
    assert (tmp_path / "decode_splits" / "decode_splits.md").is_file()
    assert "split counts: all match NumPy" in (tmp_path / "decode_splits" / "log.txt").read_text()
    # and the prefetch build's, into its own folder and file stem
    with open(tmp_path / "decode_splits_prefetch" / "decode_splits_prefetch.csv", newline="") as f:
        assert [int(r["num_splits"]) for r in csv.DictReader(f)] == counts        # (2 x 64: 4 pages, the same counts)
    assert "split counts: all match NumPy" in (tmp_path / "decode_splits_prefetch" / "log.txt").read_text()
    for kernel in sanitize.KERNELS:
        assert "all results match NumPy" in (tmp_path / "sanitizer" / f"emulator_{kernel}.txt").read_text()
    # the profiling driver ran each rung twice on the emulator (on a GPU: under ncu)
    for rung in ("paged_decode_split", "paged_decode_prefetch"):
        assert f"ran {rung} (paged_decode_gqa_split) twice on emulator; output finite: True" in \
            (tmp_path / "ncu" / f"ncu_{rung}.txt").read_text()
    assert "ran regtile_wide (flash_attention_regtile_wide) twice on emulator; output finite: True" in \
        (tmp_path / "ncu" / "ncu_regtile_wide.txt").read_text()


def test_a_folder_that_holds_a_run_is_never_written_over(tmp_path):
    (tmp_path / "summary.txt").write_text("an earlier run\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (tmp_path / "summary.txt").read_text() == "an earlier run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]


def test_the_pytest_step_runs_in_eight_processes_by_default():
    text = SCRIPT.read_text()
    assert 'PASSES="${GPU_CHECK_PASSES:-8}"' in text and 'xdist=(-n "$workers")' in text and "no:cacheprovider" in text


def test_every_kernel_with_a_driver_is_listed():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "sanitize.py"), "--list"], capture_output=True,
                          text=True, check=True)
    assert tuple(proc.stdout.split()) == sanitize.KERNELS
    for kernel in sanitize.KERNELS:                     # each name has its driver
        assert callable(getattr(sanitize, f"run_{kernel}"))


@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler (g++) for the CPU emulation")
def test_the_sanitizer_drivers_check_their_results(capsys):
    assert sanitize.main(["paged_decode", "--emulator"]) == 0
    assert "paged_decode: ok" in capsys.readouterr().out


def test_the_hopper_smoke_check_takes_one_rung_at_a_time(capsys):
    _spec = importlib.util.spec_from_file_location("hopper_smoke", ROOT / "scripts" / "hopper_smoke.py")
    smoke = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(smoke)
    if not gpu.emulator_available():
        pytest.skip("no C++ compiler for the emulator")
    assert smoke.main(["--emulator", "--rung", "wgmma_pingpong"]) == 0
    out = capsys.readouterr().out
    assert "works here: wgmma_pingpong" in out and "probe" not in out and "wgmma_overlap" not in out
    with pytest.raises(SystemExit):
        smoke.main(["--emulator", "--rung", "nope"])


@pytest.mark.parametrize("value, left_out", [
    ("", set()), ("   ", set()), ("wgmma_pingpong", {"wgmma_pingpong"}),
    ("wgmma  wgmma_overlap", {"wgmma", "wgmma_overlap"}), ("all", {"wgmma", "wgmma_overlap", "wgmma_pingpong"}),
])
def test_the_hopper_rungs_left_out_are_read_from_the_variable_gpu_check_sets(value, left_out):
    from lessons.gpu.ladder import hopper_rungs_left_out

    assert hopper_rungs_left_out({"GPU_CHECK_SKIP_WGMMA": value}) == left_out
    assert hopper_rungs_left_out({}) == set()
    with pytest.raises(ValueError, match="GPU_CHECK_SKIP_WGMMA"):
        hopper_rungs_left_out({"GPU_CHECK_SKIP_WGMMA": "wgmma 1"})


def test_the_profiling_driver_names_the_kernel_to_filter_on(capsys):
    _spec = importlib.util.spec_from_file_location("profile_rung", ROOT / "scripts" / "profile_rung.py")
    prof = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(prof)
    want = {"scalar": "flash_attention_forward", "regtile": "flash_attention_regtile",
            "regtile_wide": "flash_attention_regtile_wide", "mma_fa2": "flash_attention_mma_fa2",
            "mma_fa2_lazy": "flash_attention_mma_fa2_lazy", "mma_fa2_wide": "flash_attention_mma_fa2_wide",
            "wgmma": "flash_attention_wgmma", "wgmma_pingpong": "flash_attention_wgmma_pingpong",
            "paged_decode_split": "paged_decode_gqa_split", "paged_decode_prefetch": "paged_decode_gqa_split"}
    for rung, name in want.items():
        assert prof.main([rung, "--entry"]) == 0 and capsys.readouterr().out.strip() == name
    assert set(prof.FORWARD_RUNGS) == {r.name for r in prof.ladder.RUNGS if r.kernel}
    with pytest.raises(SystemExit):
        prof.main(["naive", "--entry"])                # no kernel of ours to profile


def test_the_tuning_sweep_takes_every_legal_configuration_and_the_fa2_rung():
    from lessons.gpu.source import FA2_LAZY_CONFIGS, FA2_LAZY_SWEEP

    order = tune.runs([64, 128])
    for d in (64, 128):
        mine = [c for impl, dd, c in order if dd == d and impl == tune.LAZY]
        assert mine[0] == FA2_LAZY_CONFIGS[d] and sorted(mine) == sorted(FA2_LAZY_SWEEP[d])   # the default first
        assert (tune.PLAIN, d, gpu.flash_attention_mma_fa2_config(d)) in order
    # the ratio to the default: its seconds over the row's, per head dim; None where either was not timed
    rows = [dict(impl=tune.LAZY, d=64, default=True, seconds=2.0), dict(impl=tune.LAZY, d=64, default=False, seconds=1.0),
            dict(impl=tune.PLAIN, d=64, default=False, seconds=4.0),
            dict(impl=tune.LAZY, d=128, default=False, seconds=1.0)]
    tune.add_ratios(rows)
    assert [r["x_default"] for r in rows] == [1.0, 2.0, 0.5, None]
    assert [r["x_reference"] for r in rows] == [2.0, 4.0, 1.0, None]          # the FA-2 rung's seconds over the row's


@pytest.mark.parametrize("rung, sweep_name, config_name", [
    ("regtile", "REGTILE_SWEEP", "flash_attention_regtile_config"),
    ("regtile_wide", "REGTILE_WIDE_SWEEP", "flash_attention_regtile_wide_config"),
])
def test_the_regtile_sweep_takes_its_default_first_then_the_others_then_naive(rung, sweep_name, config_name):
    from lessons.gpu import source

    sweep, config = getattr(source, sweep_name), getattr(source, config_name)
    order = tune.runs([64, 128], rung)
    assert {impl for impl, _, _ in order} == {rung, tune.NAIVE}
    for d in (64, 128):
        mine = [c for impl, dd, c in order if dd == d and impl == rung]
        assert mine[0] == (*config(d), None)                                            # the default first
        assert {c[:2] for c in mine} == set(sweep[d]) | {config(d)}
        assert len(mine) == len(set(mine))
        assert order[[i for i, (_, dd, _) in enumerate(order) if dd == d][-1]] == (tune.NAIVE, d, (None, None, None))
    # naive CuPy as the reference: the rung's target is a multiple of its speed
    rows = [dict(impl=tune.REGTILE, d=64, default=True, seconds=5.0), dict(impl=tune.NAIVE, d=64, default=False,
                                                                           seconds=15.0)]
    assert [r["x_reference"] for r in tune.add_ratios(rows)] == [3.0, 1.0]


def test_the_wide_regtile_sweep_times_its_64_by_64_default_then_its_sweep_in_order():
    from lessons.gpu.source import REGTILE_WIDE_SWEEP

    order = tune.runs([64, 128], tune.REGTILE_WIDE)
    assert tune.SWEEPS[tune.REGTILE_WIDE].stem == "regtile_wide_configs"
    assert tune.SWEEPS[tune.REGTILE_WIDE].dtype == "float32"
    for d in (64, 128):
        mine = [(impl, c) for impl, dd, c in order if dd == d]
        assert mine[0] == ("regtile_wide", (64, 64, None))            # 8 rows x 4 keys per thread at both head dims
        assert mine[1:-1] == [("regtile_wide", (bq, bk, None)) for bq, bk in REGTILE_WIDE_SWEEP[d][1:]]
        assert mine[-1] == ("naive", (None, None, None)) and len(mine) == 6
    assert ("regtile_wide", 64, (32, 128, None)) in order and ("regtile_wide", 128, (64, 16, None)) in order


@pytest.mark.skipif(gpu.device_available(), reason="checks what happens without a device")
def test_the_tuning_sweep_without_a_device_says_so(capsys, tmp_path):
    assert tune.main(["--out", str(tmp_path)]) == 0
    assert "GPU tuning not run: no CUDA device" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_the_tuning_sweep_runs_on_the_emulator(tmp_path):
    assert tune.main(["--emulator", "--out", str(tmp_path), "--n", "40", "--head-dims", "128"]) == 0
    with open(tmp_path / "fa2_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(tune.COLUMNS) and len(rows) == len(tune.runs([128]))
    assert rows[0]["default"] == "True" and float(rows[0]["max_abs_diff"]) == 0.0
    # the same key tiles as the default: the same arithmetic per row, the same output
    same_bk = [r for r in rows if r["impl"] == tune.LAZY and r["block_k"] == "64"]
    assert len(same_bk) == 2 and all(float(r["max_abs_diff"]) == 0.0 for r in same_bk)
    assert "lazy-rescaling FA-2 rung" in (tmp_path / "fa2_configs.md").read_text()


def test_the_regtile_sweep_runs_on_the_emulator_with_tiles_over_48_kib(tmp_path):
    assert tune.main(["--rung", "regtile", "--emulator", "--out", str(tmp_path), "--n", "70", "--head-dims", "128"]) == 0
    with open(tmp_path / "regtile_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(tune.COLUMNS) and len(rows) == len(tune.runs([128], "regtile"))
    assert rows[0]["default"] == "True" and float(rows[0]["max_abs_diff"]) == 0.0 and rows[-1]["impl"] == "naive"
    assert all(r["note"] == "emulator: not timed" for r in rows)       # (and each matched NumPy, else exit 1)
    big = [r for r in rows if r["block_q"] == "64" and r["block_k"] == "64"]       # 85 KiB: dynamic shared memory
    assert len(big) == 1 and float(big[0]["max_abs_diff"]) < 1e-5
    assert "register-tiled CUDA-core rung" in (tmp_path / "regtile_configs.md").read_text()


def test_the_wide_regtile_sweep_runs_on_the_emulator(tmp_path):
    assert tune.main(["--rung", "regtile_wide", "--emulator", "--out", str(tmp_path), "--n", "70",
                      "--head-dims", "128"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regtile_wide_configs.csv", "regtile_wide_configs.md"]
    with open(tmp_path / "regtile_wide_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(tune.COLUMNS)
    assert [(r["impl"], r["d"], r["block_q"], r["block_k"], r["default"]) for r in rows] == [
        ("regtile_wide", "128", "64", "64", "True"), ("regtile_wide", "128", "32", "128", "False"),
        ("regtile_wide", "128", "32", "64", "False"), ("regtile_wide", "128", "64", "32", "False"),
        ("regtile_wide", "128", "64", "16", "False"), ("naive", "128", "", "", "False")]
    assert all(r["note"] == "emulator: not timed" and r["dtype"] == "float32" for r in rows)   # (each matched NumPy)
    assert float(rows[0]["max_abs_diff"]) == 0.0
    assert all(float(r["max_abs_diff"]) < 1e-5 for r in rows[1:])       # other tiles: other sums, the same output
    text = (tmp_path / "regtile_wide_configs.md").read_text()
    assert "wide register-tiled CUDA-core rung, every configuration swept, on the CPU emulator" in text


def test_a_run_past_its_deadline_skips_the_rest_names_them_and_fails(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env["GPU_CHECK_DEADLINE"] = "03"                 # (leading zero: still decimal)
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 1, summary
    steps = {line[:52].strip(): line[52:].split(None, 1) for line in summary.splitlines()}
    late = [name for name, (status, detail) in steps.items()
            if status == "skip" and detail.strip() == "past the deadline (GPU_CHECK_DEADLINE=3 s)"]
    # the compile report's 180 s were cut to 3: everything after it found the deadline passed
    assert {"benchmark forward", "decode split sweep", "tune mma_fa2_lazy tiles", "tune mma_fa2_wide tiles",
            "tune regtile tiles", "tune regtile_wide tiles", "pytest pass 1 (-n 2)",
            "compute-sanitizer", "ncu mma_fa2"} <= set(late), summary
    assert steps["total"][0] == "FAIL" and int(steps["total"][1].split()[0]) < 120


def test_steps_left_out_of_gpu_check_steps_are_named_and_do_not_fail_the_run(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    # the second half of a split run: the Hopper rung the first half's smoke step left out stays left out
    env.update(GPU_CHECK_STEPS="ncu ring backward", GPU_CHECK_SKIP_WGMMA="wgmma", GPU_CHECK_NCU_RUNGS="wgmma",
               GPU_CHECK_SIZES="64")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary
    steps = {line[:52].strip(): line[52:].split(None, 1) for line in summary.splitlines()}
    off = {name for name, (status, detail) in steps.items()
           if status == "skip" and detail.strip() == "not in GPU_CHECK_STEPS"}
    assert off == {"compile report", "hopper smoke", "benchmark forward", "benchmark decode",
                   "decode split sweep", "decode split sweep (prefetch)", "tune mma_fa2_wide tiles",
                   "tune mma_fa2_lazy tiles", "tune regtile tiles", "tune regtile_wide tiles",
                   "pytest (GPU cases)", "compute-sanitizer"}, summary
    assert steps["ncu wgmma"] == ["skip", "left out after its first check"]
    assert steps["ring on the GPU (MPI)"][0] == "skip" and steps["total"][0] == "ok"
    assert steps["benchmark backward"][0] == "ok"                    # (no device: it says so and exits 0)
    assert not (tmp_path / "compile_report.txt").exists() and not (tmp_path / "benchmark" / "log.txt").exists()


def test_a_step_group_that_does_not_exist_is_refused(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env["GPU_CHECK_STEPS"] = "forward benchmarks"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "GPU_CHECK_STEPS may name only these groups: compile smoke forward backward " \
                                   "decode sweeps pytest sanitizer ncu ring; got 'benchmarks'" in proc.stderr


@pytest.mark.parametrize("deadline", ["0", "soon", "-5", "1.5", "000", "1234567", "99999999999999999999"])
def test_a_deadline_that_is_not_whole_seconds_is_refused(tmp_path, deadline):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env["GPU_CHECK_DEADLINE"] = deadline
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "GPU_CHECK_DEADLINE must be a whole number of seconds, at least 1 and at most " \
                                   f"999999; got '{deadline}'" in proc.stderr


def test_the_tuning_sweep_refuses_a_file_for_out_and_runs_each_head_dim_once(tmp_path, capsys):
    existing = tmp_path / "results.csv"
    existing.write_text("not a folder\n")
    with pytest.raises(SystemExit):
        tune.parse_args(["--out", str(existing)])
    assert f"--out must be a folder (it is made if missing), but {existing} is a file" in capsys.readouterr().err
    assert tune.parse_args(["--head-dims", "128", "64", "128"]).head_dims == [128, 64]

"""scripts/gpu_check.sh, checked on the CPU before any GPU time is spent on it.

``--dry-run`` runs every step of the script with the kernels on the CPU emulator: the
environment report, the compile report, a few kernel tests, each kernel's sanitizer
driver (without compute-sanitizer), the benchmark (which says there is no device), the
tuning sweeps of the wide-warp and lazy FA-2 rungs and of the register-tiled rung and its wide build (each
configuration once on the emulator)
and the decode split sweep (each split count of a tiny shape once on the emulator, against NumPy), after the first
run of each rung that has never run on a GPU (scripts/first_run.py, on the emulator). A rung left out after its
first run (GPU_CHECK_LEFT_OUT) is left out by every later step: that is checked here step by step.
What it cannot check is the GPU itself; the plumbing (steps, files, summary, exit
status, the list of kernels against the drivers) it can.
"""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lessons.gpu as gpu
from lessons.gpu import ladder

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
_spec = importlib.util.spec_from_file_location("first_run", ROOT / "scripts" / "first_run.py")
first_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(first_run)

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
                "tune mma_fa2_lean tiles", "tune mma_fa2_lazy tiles", "tune mma_fa2_wide tiles", "tune regtile tiles",
                "tune regtile_wide tiles", "decode split sweep", "decode split sweep (prefetch)",
                "decode split sweep (cp.async)"}
    expected |= {f"first run {rung}" for rung in ladder.first_run_rungs()}      # (nine today)
    assert "mma_fa2_lean" in ladder.first_run_rungs()
    expected |= {f"ncu {rung}" for rung in ("mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean", "wgmma",
                                           "wgmma_overlap", "wgmma_pingpong", "paged_decode_split",
                                           "paged_decode_prefetch", "paged_decode_cp_async", "regtile_wide")}
    expected |= {f"ncu mix {rung}" for rung in ("scalar", "regtile", "regtile_wide")}    # the CUDA-core rungs' mix
    expected |= {f"drivers (emulator) {k}" for k in sanitize.KERNELS}      # the script runs every driver
    assert set(steps) == expected and set(steps.values()) == {"ok"}, summary
    assert "passed" in summary and "failed" not in summary
    for rung in ladder.first_run_rungs():                         # each in its own process, on the emulator
        log = (tmp_path / f"smoke_{rung}.txt").read_text().splitlines()
        assert log[-1] == f"works here: {rung}" and len(log) >= 5, log
        assert all(line.endswith(": ok") for line in log[:-1]), log
        assert steps[f"first run {rung}"] == "ok"
    assert "d=128 256 x 256, 1 head, float32 out" in (tmp_path / "smoke_regtile_wide.txt").read_text()
    assert "auto splits lse" in (tmp_path / "smoke_paged_decode_prefetch.txt").read_text()
    assert not (tmp_path / "smoke.txt").exists() and not list(tmp_path.glob("hopper_smoke_*"))
    assert (tmp_path / "left_out.txt").read_text() == "\n"             # every first run passed: none left out
    for name in ("env.txt", "compile_report.txt", "pytest_1_n2.txt", "pytest_1_n2.xml", "benchmark/log.txt",
                 "backward/log.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    report = (tmp_path / "compile_report.txt").read_text()
    assert "flash_attention_mma" in report and report.count("flash_attention_mma_fa2_lazy") >= 2 * 8
    assert report.count("flash_attention_mma_fa2_wide") >= len(tune.SWEEPS[tune.WIDE].configs(64)) + \
        len(tune.SWEEPS[tune.WIDE].configs(128))
    # the lean rung's: each legal configuration's main kernel and its pre-pass, for sm_80 and sm_90
    lean = report.split("flash_attention_mma_fa2_lean, every legal")[1]
    assert lean.count("flash_attention_mma_fa2_lean_v_flags") == 2 * (len(tune.SWEEPS[tune.LEAN].configs(64)) +
                                                                      len(tune.SWEEPS[tune.LEAN].configs(128)))
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
    # and the lean rung's (FA2_LEAN_SWEEP), beside the same FA-2 rung
    with open(tmp_path / "fa2_lean_configs" / "fa2_lean_configs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], int(r["d"]), int(r["block_q"]), int(r["block_k"]), int(r["min_blocks"])) for r in rows] == \
        [(impl, d, *c) for impl, d, c in tune.runs([64, 128], tune.LEAN)]
    assert rows[0]["impl"] == "mma_fa2_lean" and {r["impl"] for r in rows} == {"mma_fa2_lean", "mma_fa2"}
    assert all(r["note"] == "emulator: not timed" for r in rows)
    # the FA-2 sweeps in their order: the lean rung's first (its folder's log is written before the others')
    order = [steps_line.split()[1] for steps_line in summary.splitlines() if steps_line.startswith("tune mma_fa2")]
    assert order == ["mma_fa2_lean", "mma_fa2_wide", "mma_fa2_lazy"], order
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
    # and the cp.async build's (4 blocks per SM: the plain build's pick), into its own folder and file stem
    assert tune_decode.plan(tune_decode.EMULATOR_SHAPES, tune_decode.EMULATOR_GEOMETRY, 132,
                            "paged_decode_cp_async")[0][3] == counts
    assert sorted(p.name for p in (tmp_path / "decode_splits_cp_async").iterdir()) == \
        ["decode_splits_cp_async.csv", "decode_splits_cp_async.md", "log.txt"]
    with open(tmp_path / "decode_splits_cp_async" / "decode_splits_cp_async.csv", newline="") as f:
        assert [int(r["num_splits"]) for r in csv.DictReader(f)] == counts
    assert "cp.async build" in (tmp_path / "decode_splits_cp_async" / "decode_splits_cp_async.md").read_text()
    assert "split counts: all match NumPy" in (tmp_path / "decode_splits_cp_async" / "log.txt").read_text()
    # the three decode sweeps in their order: plain, prefetch, cp.async
    order = [line[:52].strip() for line in summary.splitlines() if line.startswith("decode split sweep")]
    assert order == ["decode split sweep", "decode split sweep (prefetch)", "decode split sweep (cp.async)"], order
    for kernel in sanitize.KERNELS:
        assert "all results match NumPy" in (tmp_path / "sanitizer" / f"emulator_{kernel}.txt").read_text()
    # the profiling driver ran each rung twice on the emulator (on a GPU: under ncu)
    for rung in ("paged_decode_split", "paged_decode_prefetch", "paged_decode_cp_async"):
        assert f"ran {rung} (paged_decode_gqa_split) twice on emulator; output finite: True" in \
            (tmp_path / "ncu" / f"ncu_{rung}.txt").read_text()
    assert "ran regtile_wide (flash_attention_regtile_wide) twice on emulator; output finite: True" in \
        (tmp_path / "ncu" / "ncu_regtile_wide.txt").read_text()
    for rung in ("scalar", "regtile", "regtile_wide"):                # the kernel name ncu would filter on
        assert (tmp_path / "ncu" / f"mix_{rung}.txt").read_text() == \
            f"dry run: ncu would filter on {ladder.rung_entry(rung, 128)}\n"


def test_a_folder_that_holds_a_run_is_never_written_over(tmp_path):
    (tmp_path / "summary.txt").write_text("an earlier run\n")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (tmp_path / "summary.txt").read_text() == "an earlier run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.txt"]


def test_an_unknown_option_or_a_second_folder_is_refused_before_anything_is_written(tmp_path):
    # a mistyped --dry-run was taken for the results folder: mkdir and cd failed on a name that starts with "-",
    # the folder became "", and the run (a full GPU check) wrote summary.txt and the rest into /
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_") and name != "OUT"}
    for args, message in ((["--dryrun"], "unknown option '--dryrun'"), (["-n", "out"], "unknown option '-n'"),
                          (["out", "--dry_run"], "unknown option '--dry_run'"),
                          (["--dry-run", "out", "more"], "one results folder at most, got 'out' and 'more'")):
        proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env,
                              cwd=tmp_path)
        assert proc.returncode == 2 and message in proc.stderr and "usage: scripts/gpu_check.sh" in proc.stderr, \
            (args, proc.returncode, proc.stderr[-1000:])
        assert not any(tmp_path.iterdir()), (args, sorted(tmp_path.iterdir()))
    # --dry-run after the folder is the dry run, not a full GPU check with the flag left over
    env["GPU_CHECK_STEPS"] = "ring"
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "run"), "--dry-run"], capture_output=True, text=True,
                          timeout=120, env=env)
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert proc.returncode == 0 and "dry run: the kernels run on the CPU emulator" in summary, summary


def test_a_results_folder_that_cannot_be_made_is_refused(tmp_path):
    # a file where the folder should be: mkdir fails, and the results must not go to / instead
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    (tmp_path / "taken").write_text("a file\n")
    for folder in (tmp_path / "taken", tmp_path / "taken" / "run"):
        proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(folder)], capture_output=True, text=True,
                              timeout=60, env=env)
        assert proc.returncode == 2 and f"cannot make the results folder {folder}" in proc.stderr, proc.stderr
        assert (tmp_path / "taken").read_text() == "a file\n" and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_pytest_step_runs_in_eight_processes_by_default():
    text = SCRIPT.read_text()
    assert 'PASSES="${GPU_CHECK_PASSES:-8}"' in text and 'xdist=(-n "$workers")' in text and "no:cacheprovider" in text
    # a hanging test ends on its own (pytest-timeout's thread method: it needs no signal the stuck call would block)
    assert '--timeout "$TEST_TIMEOUT" --timeout-method thread' in text and '"${HANG[@]}"' in text
    assert 'whole_seconds TEST_TIMEOUT "${GPU_CHECK_TEST_TIMEOUT:-120}" 99999' in text


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


def test_the_rungs_that_never_ran_on_a_gpu_come_from_the_registry_and_the_recorded_runs():
    # forward: a kernel of ours and no recorded row (impl None); decode: no row of its impl in the recorded decode run
    recorded_decode = {row["name"] for row in ladder.decode_recorded_rows()}
    want = [r.name for r in ladder.RUNGS if r.kernel is not None and r.impl is None] + \
        [r.name for r in ladder.DECODE_RUNGS if r.impl not in recorded_decode]
    assert list(ladder.first_run_rungs()) == want
    assert set(ladder.HOPPER_RUNGS) <= set(want) and "paged_decode_prefetch" in want and len(want) == 9
    assert "paged_decode_cp_async" in want
    assert "mma_fa2_lean" in want
    # none of them has a GPU figure: their texts say so, and the ladder's table has no number for them
    for name in want:
        r = ladder.decode_rung(name) if name.startswith("paged_decode_") else ladder.rung(name)
        assert r.limit.startswith("not yet") and "on a GPU" in r.limit, (name, r.limit)
    table = {e["name"]: e for e in ladder.ladder_table()}
    assert all(table[name]["ms"] is None for name in want if name in table)
    # the measured ones are not among them
    assert not {"scalar", "regtile", "mma", "mma_async", "mma_fa2", "paged_decode_split"} & set(want)
    # the script checks exactly these, in this order
    assert first_run.RUNGS == ladder.first_run_rungs()


@pytest.mark.skipif(not gpu.emulator_available(), reason="no C++ compiler for the emulator")
@pytest.mark.parametrize("rung, expect", [
    ("wgmma_pingpong", ["wgmma_pingpong d=64 200 x 300", "wgmma_pingpong d=128 200 x 300"]),
    ("regtile_wide", ["regtile_wide d=64 200 x 300, causal, 2 heads, float32 out",
                      "regtile_wide d=128 200 x 300, causal, 2 heads, float32 lse",
                      "regtile_wide d=128 256 x 256, 1 head, float32 out"]),
    ("paged_decode_prefetch", ["paged_decode_prefetch 5 seqs, 32/8 heads, d=128, fp16, auto splits out",
                               "paged_decode_prefetch 5 seqs, 32/8 heads, d=128, fp16, 3 splits lse"]),
])
def test_the_first_run_checks_one_rung_at_a_time_on_the_emulator(capsys, rung, expect):
    assert first_run.main(["--emulator", "--rung", rung]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"works here: {rung}"
    assert all(line.startswith(rung) and line.endswith(": ok") for line in lines[:-1]), lines
    for want in expect:
        assert any(line.startswith(want) for line in lines), (want, lines)
    assert not any("probe" in line for line in lines)          # (the probe goes with wgmma only)
    errors = [float(line.split("max |diff| ")[1].split()[0]) for line in lines[:-1]]
    assert 0 < max(errors) < 5e-3


def test_the_first_run_refuses_a_rung_it_does_not_know():
    for bad in ("nope", "mma_fa2", "paged_decode_split"):          # measured rungs need no first run
        with pytest.raises(SystemExit):
            first_run.main(["--emulator", "--rung", bad])


def test_the_first_run_says_wrong_when_a_result_is_off(capsys, monkeypatch):
    # a launcher that answers with the wrong rows, then one that raises as a faulting kernel would
    monkeypatch.setattr(first_run, "launcher", lambda name: (lambda q, k, v, **kw: (v[..., ::-1, :], None), {}))
    assert first_run.main(["--emulator", "--rung", "mma_fa2_lazy"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "WRONG HERE: mma_fa2_lazy" and "WRONG" in lines[0]

    def fault(name):
        def run(*args, **kwargs):
            raise RuntimeError("an illegal memory access was encountered")
        return run, {}
    monkeypatch.setattr(first_run, "launcher", fault)
    assert first_run.main(["--emulator", "--rung", "paged_decode_prefetch", "--rung", "regtile_wide"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["regtile_wide: raised RuntimeError: an illegal memory access was encountered",
                     "paged_decode_prefetch: raised RuntimeError: an illegal memory access was encountered",
                     "WRONG HERE: regtile_wide, paged_decode_prefetch"]


def test_the_first_run_ends_itself_when_a_launch_hangs(tmp_path, capsys):
    # a launcher that never returns (as a kernel deadlocked on an mbarrier would keep its copy-back waiting): with
    # --hang-seconds 1 the process dumps its stack and exits with status 1 after about a second, not at the caller's
    # time limit; the stack names the check whose launch hung
    driver = tmp_path / "hang.py"
    driver.write_text(
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('first_run', {str(ROOT / 'scripts' / 'first_run.py')!r})\n"
        "first_run = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(first_run)\n"
        "first_run.launcher = lambda name: ((lambda *a, **kw: time.sleep(120)), {})\n"
        "sys.exit(first_run.main(['--emulator', '--rung', 'mma_fa2_lazy', '--hang-seconds', '1']))\n")
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("Timeout (0:00:01)!"), proc.stderr[-2000:]
    assert "in check_forward" in proc.stderr
    assert "works here" not in proc.stdout and "WRONG" not in proc.stdout      # it ended mid-check
    # a bound that is not a number of seconds from 0 to a day is refused, naming the option (1e12 s would overflow
    # faulthandler's timer at the first launch, and every rung would be reported wrong)
    for bad in ("-1", "nan", "inf", "1e12", str(first_run.MAX_HANG_SECONDS + 1)):
        with pytest.raises(SystemExit):
            first_run.main(["--emulator", "--rung", "mma_fa2_lazy", "--hang-seconds", bad])
        assert "--hang-seconds must be a number of seconds from 0 to 86400 (a day)" in capsys.readouterr().err


def test_the_first_run_needs_compute_capability_9_for_hopper_and_8_for_the_rest(capsys):
    assert first_run.why_not_here("wgmma", 90) is None and first_run.why_not_here("regtile_wide", 90) is None
    assert first_run.why_not_here("regtile_wide", 80) is None
    assert first_run.why_not_here("paged_decode_prefetch", 86) is None
    assert first_run.why_not_here("wgmma", 80) == "needs a CUDA device of compute capability 9.0; this one is 8.0"
    assert first_run.why_not_here("wgmma_overlap", 100) == \
        "needs a CUDA device of compute capability 9.0; this one is 10.0"
    assert first_run.why_not_here("mma_fa2_wide", 75) == \
        "needs a CUDA device of compute capability 8.0 or newer; this one is 7.5"
    assert first_run.why_not_here("mma_fa2_lazy", None) == \
        "needs a CUDA device of compute capability 8.0 or newer; CuPy sees none"
    if not gpu.device_available():                        # exit 2: nothing to check here
        assert first_run.main(["--rung", "wgmma", "--rung", "regtile_wide"]) == 2
        lines = capsys.readouterr().out.splitlines()
        assert lines[-1] == ("cannot run here: regtile_wide (needs a CUDA device of compute capability 8.0 or newer; "
                             "CuPy sees none); wgmma (needs a CUDA device of compute capability 9.0; CuPy sees none)")


@pytest.mark.parametrize("value, left_out", [
    ("", set()), ("   ", set()), ("wgmma_pingpong", {"wgmma_pingpong"}),
    ("wgmma  wgmma_overlap", {"wgmma", "wgmma_overlap"}),
    ("regtile_wide paged_decode_prefetch", {"regtile_wide", "paged_decode_prefetch"}),
    ("mma_fa2 paged_decode", {"mma_fa2", "paged_decode"}),          # any rung with a kernel of ours
    ("all", set(ladder.first_run_rungs())), ("all scalar", set(ladder.first_run_rungs()) | {"scalar"}),
])
def test_the_rungs_left_out_are_read_from_the_variable_gpu_check_sets(value, left_out):
    assert ladder.LEFT_OUT_VARIABLE == "GPU_CHECK_LEFT_OUT"
    assert ladder.rungs_left_out({"GPU_CHECK_LEFT_OUT": value}) == left_out
    assert ladder.rungs_left_out({}) == set()
    assert ladder.rungs_left_out({"GPU_CHECK_SKIP_WGMMA": "wgmma"}) == set()        # (the old name is not read)


@pytest.mark.parametrize("value, bad", [("wgmma 1", "['1']"), ("naive", "['naive']"), ("sdpa ALL", "['ALL', 'sdpa']"),
                                        ("regtile_wide,mma_fa2_lazy", "['regtile_wide,mma_fa2_lazy']")])
def test_a_left_out_value_that_names_no_rung_of_ours_is_refused_with_the_valid_names(value, bad):
    with pytest.raises(ValueError) as err:
        ladder.rungs_left_out({"GPU_CHECK_LEFT_OUT": value})
    message = str(err.value)
    assert message.startswith("GPU_CHECK_LEFT_OUT must hold names of rungs with a kernel of ours")
    assert message.endswith(f"got {bad}") and "'all'" in message
    assert str(list(ladder.kernel_rungs())) in message
    assert ladder.kernel_rungs()[:3] == ("scalar", "regtile", "regtile_wide") and \
        ladder.kernel_rungs()[-1] == "paged_decode_cp_async" and "naive" not in ladder.kernel_rungs()


def test_a_left_out_rung_is_skipped_by_the_sweeps_and_the_sanitizer_drivers(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GPU_CHECK_LEFT_OUT", "regtile_wide paged_decode_prefetch")
    why = "failed its first run on this machine (scripts/first_run.py)"
    assert ladder.LEFT_OUT_REASON == why
    # the tile sweep: says why, writes nothing, exit 0 (before it would look for a device)
    out = tmp_path / "sweep"
    assert tune.main(["--rung", "regtile_wide", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"GPU tuning not run: the regtile_wide rung {why} (it is in "
                                               "GPU_CHECK_LEFT_OUT); nothing written")
    assert not out.exists()
    # the decode split sweep of the prefetch build, likewise; the plain build's is not left out
    assert tune_decode.main(["--prefetch", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"decode split sweep not run: the paged_decode_prefetch rung {why} (it "
                                               "is in GPU_CHECK_LEFT_OUT); nothing written")
    assert not out.exists()
    # and of the cp.async build, when its rung is left out
    monkeypatch.setenv("GPU_CHECK_LEFT_OUT", "regtile_wide paged_decode_cp_async")
    assert tune_decode.main(["--cp-async", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == (f"decode split sweep not run: the paged_decode_cp_async rung {why} (it "
                                               "is in GPU_CHECK_LEFT_OUT); nothing written")
    assert not out.exists()
    monkeypatch.setenv("GPU_CHECK_LEFT_OUT", "regtile_wide paged_decode_prefetch")
    # on the emulator nothing is left out: the variable speaks of this machine's GPU
    assert tune.main(["--rung", "regtile_wide", "--emulator", "--out", str(out), "--n", "40", "--head-dims", "64"]) == 0
    assert (out / "regtile_wide_configs.csv").is_file()
    capsys.readouterr()
    # the sanitizer: a driver of a left-out rung, on a GPU, launches nothing, says why and passes
    assert sanitize.run_flash_attention_regtile_wide(None, "cupy") is True
    assert capsys.readouterr().out == f"  skipped: the regtile_wide rung {why}\n"
    # the split decode driver leaves out its prefetch build only (here the plain build runs on the emulator)
    assert sanitize.left_out("cupy", "paged_decode_prefetch") and not sanitize.left_out("cupy", "paged_decode_split")
    assert not sanitize.left_out("emulator", "regtile_wide")
    capsys.readouterr()
    if gpu.emulator_available():
        monkeypatch.setattr(sanitize, "left_out", lambda backend, rung: rung == "paged_decode_prefetch")
        assert sanitize.run_paged_decode_split(np, "emulator") is True
        printed = capsys.readouterr().out
        assert printed.count("paged_decode_split num_splits=") == 4 and "paged_decode_prefetch" not in printed
        assert printed.count("paged_decode_cp_async num_splits=") == 4


def test_the_gpu_cases_of_a_left_out_rung_are_skipped_with_the_reason(monkeypatch):
    import test_gpu_kernels as kernels

    why = "failed its first run on this machine (scripts/first_run.py) (GPU_CHECK_LEFT_OUT)"
    monkeypatch.setattr(kernels, "LEFT_OUT", frozenset({"regtile_wide", "paged_decode_prefetch"}))
    mark = kernels.on_gpu("regtile_wide")
    assert mark.name == "skip" and mark.kwargs == {"reason": f"the regtile_wide rung {why}"}
    assert kernels.on_gpu("mma_fa2_lazy") is kernels.gpu_only             # (skipped only without a device)
    with pytest.raises(pytest.skip.Exception, match="paged_decode_prefetch: failed its first run"):
        kernels.skip_left_out("cupy", "paged_decode_split", "paged_decode_prefetch")
    kernels.skip_left_out("emulator", "paged_decode_prefetch")             # the emulator's cases still run
    kernels.skip_left_out("cupy", "paged_decode_split")
    # the rungs' own test files, run as gpu_check.sh runs them: their GPU cases skipped with the reason
    files = [str(ROOT / "tests" / f"test_gpu_{name}.py") for name in ("regtile_wide", "mma_fa2_lazy", "mma_fa2_wide")]
    env = dict(os.environ, GPU_CHECK_LEFT_OUT="regtile_wide mma_fa2_lazy mma_fa2_wide")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-n", "0",
                           "-o", "addopts=", "-k", "cupy or on_the_gpu", *files], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0 and " passed" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED")]
    for rung in ("regtile_wide", "mma_fa2_lazy", "mma_fa2_wide"):
        assert any(f"the {rung} rung {why}" in line for line in skipped), (rung, skipped)
    assert all("first run" in line for line in skipped), skipped


def test_each_sanitizer_driver_of_a_rung_names_it():
    drivers = {k: getattr(sanitize, f"run_{k}") for k in sanitize.KERNELS}
    rung_of = {k: driver.rung for k, driver in drivers.items() if hasattr(driver, "rung")}
    # every forward rung with a kernel of ours has its driver, named after the rung's kernel
    assert {k: r for k, r in rung_of.items() if r in {x.name for x in ladder.RUNGS}} == \
        {r.kernel: r.name for r in ladder.RUNGS if r.kernel is not None}
    assert rung_of["paged_decode"] == "paged_decode" and rung_of["flash_decoding"] == "flash_decoding"
    assert set(rung_of.values()) <= set(ladder.kernel_rungs())
    assert "paged_decode_split" not in rung_of                     # (both its builds: left out one by one)


def test_the_profiling_driver_names_the_kernel_to_filter_on(capsys):
    _spec = importlib.util.spec_from_file_location("profile_rung", ROOT / "scripts" / "profile_rung.py")
    prof = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(prof)
    want = {"scalar": "flash_attention_forward", "regtile": "flash_attention_regtile",
            "regtile_wide": "flash_attention_regtile_wide", "mma_fa2": "flash_attention_mma_fa2",
            "mma_fa2_lazy": "flash_attention_mma_fa2_lazy", "mma_fa2_wide": "flash_attention_mma_fa2_wide",
            "mma_fa2_lean": "flash_attention_mma_fa2_lean",
            "wgmma": "flash_attention_wgmma", "wgmma_pingpong": "flash_attention_wgmma_pingpong",
            "paged_decode_split": "paged_decode_gqa_split", "paged_decode_prefetch": "paged_decode_gqa_split",
            "paged_decode_cp_async": "paged_decode_gqa_split"}
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
            "tune mma_fa2_lean tiles", "tune regtile tiles", "tune regtile_wide tiles", "pytest pass 1 (-n 2)",
            "compute-sanitizer", "ncu mma_fa2", "decode split sweep (prefetch)", "decode split sweep (cp.async)"} <= \
        set(late), summary
    assert steps["total"][0] == "FAIL" and int(steps["total"][1].split()[0]) < 120


def test_steps_left_out_of_gpu_check_steps_are_named_and_do_not_fail_the_run(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    # the second half of a split run: the Hopper rung the first half's smoke step left out stays left out
    env.update(GPU_CHECK_STEPS="ncu ring backward", GPU_CHECK_LEFT_OUT="wgmma regtile_wide",
               GPU_CHECK_NCU_RUNGS="wgmma regtile_wide", GPU_CHECK_SIZES="64")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary
    steps = {line[:52].strip(): line[52:].split(None, 1) for line in summary.splitlines()}
    off = {name for name, (status, detail) in steps.items()
           if status == "skip" and detail.strip() == "not in GPU_CHECK_STEPS"}
    assert off == {"compile report", "first run", "benchmark forward", "benchmark decode",
                   "decode split sweep", "decode split sweep (prefetch)", "decode split sweep (cp.async)",
                   "tune mma_fa2_lean tiles", "tune mma_fa2_wide tiles", "tune mma_fa2_lazy tiles",
                   "tune regtile tiles", "tune regtile_wide tiles", "pytest (GPU cases)", "compute-sanitizer"}, summary
    why = "in GPU_CHECK_LEFT_OUT: failed its first run on this machine (scripts/first_run.py)"
    assert steps["ncu wgmma"] == ["skip", why] and steps["ncu regtile_wide"] == ["skip", why]
    assert steps["ncu mix regtile_wide"] == ["skip", why] and steps["ncu mix regtile"][0] == "ok"
    assert steps["ring on the GPU (MPI)"][0] == "skip" and steps["total"][0] == "ok"
    assert steps["benchmark backward"][0] == "ok"                    # (no device: it says so and exits 0)
    assert not (tmp_path / "compile_report.txt").exists() and not (tmp_path / "benchmark" / "log.txt").exists()


def test_a_serial_pytest_pass_runs(tmp_path):
    # GPU_CHECK_PASSES "0" is one process: pytest must still parse the project's addopts (--dist=loadfile), which
    # need pytest-xdist loaded, so the pass runs with -n 0, not with xdist switched off
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env.update(GPU_CHECK_STEPS="pytest", GPU_CHECK_PASSES="0")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary
    line = next(x for x in summary.splitlines() if x.startswith("pytest pass 1 (-n 0)"))
    assert line[52:].split()[0] == "ok" and " passed" in line, summary
    assert "unrecognized arguments" not in (tmp_path / "pytest_1_n0.txt").read_text()


def test_a_left_out_given_for_a_second_run_is_checked_spelled_out_and_honoured(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    # "all" and two measured rungs: every sweep and every ncu launch left out, each with its reason
    env.update(GPU_CHECK_STEPS="sweeps ncu", GPU_CHECK_LEFT_OUT="all regtile paged_decode_split",
               GPU_CHECK_NCU_RUNGS="mma_fa2_wide paged_decode_prefetch mma_fa2")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env=env)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    steps = {line[:52].strip(): line[52:].split(None, 1) for line in summary.splitlines()}
    why = "in GPU_CHECK_LEFT_OUT: failed its first run on this machine (scripts/first_run.py)"
    left = {name for name, (status, detail) in steps.items() if status == "skip" and detail.strip() == why}
    assert left == {"decode split sweep", "decode split sweep (prefetch)", "decode split sweep (cp.async)",
                    "tune mma_fa2_lean tiles", "tune mma_fa2_wide tiles", "tune mma_fa2_lazy tiles",
                    "tune regtile tiles", "tune regtile_wide tiles",
                    "ncu mma_fa2_wide", "ncu paged_decode_prefetch", "ncu mix regtile", "ncu mix regtile_wide"}, summary
    assert steps["ncu mix scalar"][0] == "ok"
    assert steps["ncu mma_fa2"][0] == "ok" and steps["first run"] == ["skip", "not in GPU_CHECK_STEPS"]
    assert not (tmp_path / "regtile_configs").exists() and not (tmp_path / "ncu" / "ncu_mma_fa2_wide.txt").exists()
    # a name that is no rung of ours is refused before anything runs
    env.update(GPU_CHECK_STEPS="ring", GPU_CHECK_LEFT_OUT="wgmma wgmma_pingpong_fast")
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "bad")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("gpu_check.sh: GPU_CHECK_LEFT_OUT must hold names of rungs")
    assert proc.stderr.rstrip().endswith("got ['wgmma_pingpong_fast']") and not (tmp_path / "bad" / "env.txt").exists()
    assert not (tmp_path / "bad" / "summary.txt").exists()      # the corrected rerun may name the same folder


def test_a_step_group_that_does_not_exist_is_refused(tmp_path):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env["GPU_CHECK_STEPS"] = "forward benchmarks"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "results")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and "GPU_CHECK_STEPS may name only these groups: compile smoke forward backward " \
                                   "decode sweeps pytest sanitizer ncu ring; got 'benchmarks'" in proc.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("variable, most, value", [
    *[("GPU_CHECK_DEADLINE", 999999, v) for v in ("0", "soon", "-5", "1.5", "000", "1234567", "99999999999999999999")],
    *[("GPU_CHECK_TEST_TIMEOUT", 99999, v) for v in ("0", "forever", "-5", "2.5", "123456")]])
def test_a_time_limit_that_is_not_whole_seconds_is_refused(tmp_path, variable, most, value):
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPU_CHECK_")}
    env[variable] = value
    results = tmp_path / "results"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(results)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 2 and f"{variable} must be a whole number of seconds, at least 1 and at most " \
                                   f"{most}; got '{value}'" in proc.stderr
    assert not results.exists()      # nothing written: the corrected rerun may name the same folder


def test_the_tuning_sweep_refuses_a_file_for_out_and_runs_each_head_dim_once(tmp_path, capsys):
    existing = tmp_path / "results.csv"
    existing.write_text("not a folder\n")
    with pytest.raises(SystemExit):
        tune.parse_args(["--out", str(existing)])
    assert f"--out must be a folder (it is made if missing), but {existing} is a file" in capsys.readouterr().err
    assert tune.parse_args(["--head-dims", "128", "64", "128"]).head_dims == [128, 64]

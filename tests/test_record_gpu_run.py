"""scripts/record_gpu_run.py: a gpu_check.sh results folder becomes a recorded run the course reads.

The input is rebuilt from the shipped 2026-12-01 run (its env.txt, summary and benchmark tables, laid out as
gpu_check.sh writes them, plus the files that must stay behind); the output must give the same label and the same
rows through :mod:`lessons.gpu.recorded` and :mod:`lessons.gpu.ladder` as the shipped folder does.
"""
import csv
import importlib.util
import shutil
from pathlib import Path

import pytest

from lessons.gpu import ladder
from lessons.gpu.recorded import RECORDED_DIR, read_backward_csv, recorded_label

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("record_gpu_run", ROOT / "scripts" / "record_gpu_run.py")
record = importlib.util.module_from_spec(_spec)       # a developer tool, not part of the package
_spec.loader.exec_module(record)


@pytest.fixture
def gpu_check_folder(tmp_path):
    """What gpu_check.sh leaves on the GPU machine, rebuilt from the shipped run."""
    src = tmp_path / "gc"
    for name in ("env.txt", "summary.txt", "compile_report.txt"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RECORDED_DIR / name, src / name)
    shutil.copytree(RECORDED_DIR / "forward", src / "benchmark")
    shutil.copytree(RECORDED_DIR / "backward", src / "backward")
    shutil.copytree(RECORDED_DIR / "decode", src / "decode")
    (src / "benchmark" / "log.txt").write_text("progress bars\n")          # stays behind
    (src / "pytest_1_n8.txt").write_text("545 passed\n")
    (src / "pytest_1_n8.xml").write_text("<testsuites/>\n")               # stays behind
    (src / "hopper_smoke_wgmma.txt").write_text("works here: wgmma\n")              # (an older run's name)
    (src / "smoke_regtile_wide.txt").write_text("works here: regtile_wide\n")
    (src / "smoke_paged_decode_prefetch.txt").write_text("WRONG HERE: paged_decode_prefetch\n")
    (src / "decode_splits").mkdir()
    for name in ("decode_splits.csv", "decode_splits.md", "log.txt"):                  # (the log stays behind)
        (src / "decode_splits" / name).write_text(f"{name}\n")
    for build in ("prefetch", "cp_async"):                   # the other builds' sweeps, each in its own folder
        (src / f"decode_splits_{build}").mkdir()
        for name in (f"decode_splits_{build}.csv", f"decode_splits_{build}.md", "log.txt"):
            (src / f"decode_splits_{build}" / name).write_text(f"decode_splits_{build}/{name}\n")
    for sweep in ("regtile_configs", "regtile_wide_configs"):                           # the register-tiled sweeps
        (src / sweep).mkdir()
        for name in (f"{sweep}.csv", f"{sweep}.md", "log.txt"):                       # (the log stays behind)
            (src / sweep / name).write_text(f"{sweep}/{name}\n")
    (src / "ncu").mkdir()
    (src / "ncu" / "ncu_mma_fa2.txt").write_text("Duration 1 ms\n")
    return src


def test_a_run_is_laid_out_as_the_course_reads_it(gpu_check_folder, tmp_path):
    into = tmp_path / "results"
    assert record.main([str(gpu_check_folder), "--commit", "abcdef1", "--into", str(into)]) == 0
    dest = into / "gpu_h200_2026-12-01"                                   # machine and date from env.txt
    assert sorted(p.name for p in into.iterdir()) == [dest.name]         # (no staging folder left behind)
    assert recorded_label(dest) == ("recorded on one NVIDIA H200, 2026-12-01 (driver 580.159.04, CUDA 13.0, "
                                    "commit abcdef1)")
    assert read_backward_csv(dest / "backward" / "results.csv") == read_backward_csv(RECORDED_DIR / "backward" /
                                                                                      "results.csv")
    assert ladder.recorded_rows(dest / "forward" / "results.csv") == ladder.recorded_rows()
    with open(dest / "decode" / "results.csv", newline="") as f, \
            open(RECORDED_DIR / "decode" / "results.csv", newline="") as g:
        assert list(csv.reader(f)) == list(csv.reader(g))
    for kept in ("env.txt", "summary.txt", "compile_report.txt", "pytest_1_n8.txt", "hopper_smoke_wgmma.txt",
                 "smoke_regtile_wide.txt", "smoke_paged_decode_prefetch.txt",
                 "ncu/ncu_mma_fa2.txt", "forward/gpu_attention.png", "decode_splits/decode_splits.csv",
                 "decode_splits/decode_splits.md"):
        assert (dest / kept).is_file(), kept
    assert (dest / "smoke_paged_decode_prefetch.txt").read_text() == "WRONG HERE: paged_decode_prefetch\n"
    assert not (dest / "pytest_1_n8.xml").exists() and not (dest / "forward" / "log.txt").exists()
    assert not (dest / "decode_splits" / "log.txt").exists()
    # the three builds' tables side by side in decode_splits/, each as it was (their logs stay behind)
    assert sorted(p.name for p in (dest / "decode_splits").iterdir()) == sorted(
        f"decode_splits{suffix}.{ext}" for suffix in ("", "_prefetch", "_cp_async") for ext in ("csv", "md"))
    for build in ("prefetch", "cp_async"):
        for ext in ("csv", "md"):
            assert (dest / "decode_splits" / f"decode_splits_{build}.{ext}").read_text() == \
                f"decode_splits_{build}/decode_splits_{build}.{ext}\n"
    assert not (dest / "decode_splits_prefetch").exists() and not (dest / "decode_splits_cp_async").exists()
    for sweep in ("regtile_configs", "regtile_wide_configs"):                   # each in its own folder, as it was
        assert sorted(p.name for p in (dest / sweep).iterdir()) == [f"{sweep}.csv", f"{sweep}.md"]
        assert (dest / sweep / f"{sweep}.csv").read_text() == f"{sweep}/{sweep}.csv\n"
    text = (dest / "README.md").read_text()
    assert "| `forward/` |" in text and "| `ncu/` |" in text and "| `fa2_configs/` |" not in text   # what is there
    assert "| `decode_splits/` | the split decode kernel at split counts around its automatic pick" in text
    assert "its prefetch build in `decode_splits_prefetch.*`, `--prefetch`; its cp.async build in " \
           "`decode_splits_cp_async.*`, `--cp-async`)" in text
    assert "| `decode_splits_prefetch/` |" not in text and "| `decode_splits_cp_async/` |" not in text
    assert "| `regtile_configs/` | the register-tiled rung's tiles against naive CuPy" in text
    assert "| `regtile_wide_configs/` | the wide register-tiled rung's tiles, 16 lanes per row group, against naive " \
           "CuPy (`scripts/tune_tiles.py --rung regtile_wide`) |" in text


def test_a_recorded_run_is_never_written_into(gpu_check_folder, tmp_path, capsys):
    into = tmp_path / "results"
    (into / "gpu_h200_2026-12-01").mkdir(parents=True)
    (into / "gpu_h200_2026-12-01" / "README.md").write_text("an earlier run\n")
    assert record.main([str(gpu_check_folder), "--commit", "abcdef1", "--into", str(into)]) == 2
    assert "exists already; a recorded run is never written into" in capsys.readouterr().err
    assert (into / "gpu_h200_2026-12-01" / "README.md").read_text() == "an earlier run\n"


def test_what_is_not_a_gpu_run_is_refused_by_name(tmp_path, capsys):
    assert record.main([str(tmp_path), "--commit", "abcdef1", "--into", str(tmp_path / "out")]) == 2
    assert "env.txt is missing" in capsys.readouterr().err
    (tmp_path / "env.txt").write_text("date: 2026-12-01T00:00:00Z\nnvidia-smi: not found\n")   # the dry run's
    assert record.main([str(tmp_path), "--commit", "abcdef1", "--into", str(tmp_path / "out")]) == 2
    assert "env.txt has no nvidia-smi line (name, driver): is this a folder written by scripts/gpu_check.sh on a " \
           "GPU?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        record.main([str(tmp_path), "--commit", "not-a-hash"])
    assert "--commit must be a git hash" in capsys.readouterr().err


def test_folder_names():
    assert record.run_folder_name("NVIDIA H200", "2026-12-02") == "gpu_h200_2026-12-02"
    assert record.run_folder_name("NVIDIA A100-SXM4-80GB", "2027-01-05") == "gpu_a100_sxm4_80gb_2027-01-05"


def test_the_parts_of_a_split_run_are_recorded_as_one(gpu_check_folder, tmp_path, capsys):
    # part 1: the benchmarks (the fixture's folder without its test log); part 2: the tests, on the same GPU
    part2 = tmp_path / "gc2"
    part2.mkdir()
    shutil.copy(gpu_check_folder / "env.txt", part2 / "env.txt")
    (gpu_check_folder / "pytest_1_n8.txt").rename(part2 / "pytest_1_n8.txt")
    (part2 / "summary.txt").write_text("pytest pass 1 (-n 8)   ok    600 passed\ntotal   ok   90 s\n")
    into = tmp_path / "results"
    assert record.main([str(gpu_check_folder), str(part2), "--commit", "abcdef1", "--into", str(into)]) == 0
    dest = into / "gpu_h200_2026-12-01"
    summary = (dest / "summary.txt").read_text()
    first = (gpu_check_folder / "summary.txt").read_text()
    assert summary == first.rstrip("\n") + "\n" + "pytest pass 1 (-n 8)   ok    600 passed\ntotal   ok   90 s\n"
    assert (dest / "pytest_1_n8.txt").read_text() == "545 passed\n"
    assert (dest / "env.txt").read_text() == (gpu_check_folder / "env.txt").read_text()
    assert "came from 2 runs of `scripts/gpu_check.sh DIR`" in (dest / "README.md").read_text()
    assert recorded_label(dest).startswith("recorded on one NVIDIA H200, 2026-12-01")
    # a file both parts hold is refused by name, and nothing is recorded
    (part2 / "compile_report.txt").write_text("again\n")
    again = tmp_path / "again"
    assert record.main([str(gpu_check_folder), str(part2), "--commit", "abcdef1", "--into", str(again)]) == 2
    assert "would both be compile_report.txt" in capsys.readouterr().err and not list(again.glob("gpu_*"))
    # parts from two GPUs are refused
    (part2 / "compile_report.txt").unlink()
    env = (part2 / "env.txt").read_text().replace("NVIDIA H200", "NVIDIA A100-SXM4-80GB")
    (part2 / "env.txt").write_text(env)
    assert record.main([str(gpu_check_folder), str(part2), "--commit", "abcdef1", "--into", str(again)]) == 2
    assert "must come from one GPU" in capsys.readouterr().err

"""Turn the folder of one ``scripts/gpu_check.sh`` run into a recorded run the course can ship and read.

    python scripts/record_gpu_run.py RESULTS_DIR [RESULTS_DIR ...] [--commit HASH] [--into benchmarks/results]

``RESULTS_DIR`` is what gpu_check.sh wrote on the GPU machine (``env.txt``, ``summary.txt``, ``benchmark/``,
``backward/``, ...). The recorded run goes to a new folder ``<into>/gpu_<gpu>_<date>/`` (for example
``benchmarks/results/gpu_h200_2026-12-02/``), laid out as :mod:`lessons.gpu.recorded` and :mod:`lessons.gpu.ladder`
read it: ``forward/`` (from ``benchmark/``), ``backward/``, ``decode/``, the sweeps (``decode_splits/``, which also
takes ``decode_splits_prefetch/``'s and ``decode_splits_cp_async/``'s tables, ``fa2_configs/``,
``fa2_wide_configs/``, ``fa2_lean_configs/``, ``regtile_configs/``, ``regtile_wide_configs/``), the Nsight Compute
reports, the first-run logs of the rungs that had never run on a GPU (``smoke_<rung>.txt``;
``hopper_smoke_<rung>.txt`` in older runs, whose first runs were of the Hopper rungs only), the compile report, the
test and environment logs, and a ``README.md`` whose title and driver line give every figure its label
(:func:`lessons.gpu.recorded.recorded_label`: machine, date, driver, CUDA, commit).
Result files only: the JUnit XML and the benchmarks' logs stay behind. ``--commit`` is the commit the GPU machine
ran (default: this checkout's HEAD); the date and the machine come from ``env.txt``.

Several RESULTS_DIRs are the parts of one run split with ``GPU_CHECK_STEPS`` (for example the benchmarks and sweeps,
then the tests): they must come from the same GPU; the first part's ``env.txt`` is kept, the parts' ``summary.txt``
are joined in order, and any other file that two parts both hold is refused by name (nothing is recorded).
A folder that already exists is never written into (exit status 2): each recorded run is kept as it was.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (folder or file pattern in RESULTS_DIR, where it goes in the recorded run, the file patterns taken from it)
LAYOUT = (
    ("benchmark", "forward", ("results.csv", "results.md", "*.png")),
    ("backward", "backward", ("results.csv", "results.md", "*.png")),
    ("decode", "decode", ("results.csv", "results.md")),
    ("decode_splits", "decode_splits", ("*.csv", "*.md")),
    ("decode_splits_prefetch", "decode_splits", ("*.csv", "*.md")),
    ("decode_splits_cp_async", "decode_splits", ("*.csv", "*.md")),
    ("fa2_configs", "fa2_configs", ("*.csv", "*.md")),
    ("fa2_wide_configs", "fa2_wide_configs", ("*.csv", "*.md")),
    ("fa2_lean_configs", "fa2_lean_configs", ("*.csv", "*.md")),
    ("regtile_configs", "regtile_configs", ("*.csv", "*.md")),
    ("regtile_wide_configs", "regtile_wide_configs", ("*.csv", "*.md")),
    ("ncu", "ncu", ("*.txt",)),
    (".", ".", ("env.txt", "summary.txt", "compile_report.txt", "smoke_*.txt", "hopper_smoke_*.txt", "pytest_*.txt",
                "ring.txt")),
)
#: what each folder of the recorded run holds, for its README
WHAT = {
    "forward": "every forward rung against naive CuPy and torch SDPA (`benchmarks/gpu_attention.py`)",
    "backward": "the backward kernels against naive CuPy and torch SDPA (`benchmarks/gpu_backward.py`)",
    "decode": "the decode kernels' K/V read rate against the device copy rate (`benchmarks/gpu_decode.py`)",
    "decode_splits": "the split decode kernel at split counts around its automatic pick, per decode shape "
                     "(`scripts/tune_decode.py`; its prefetch build in `decode_splits_prefetch.*`, `--prefetch`; "
                     "its cp.async build in `decode_splits_cp_async.*`, `--cp-async`)",
    "fa2_configs": "every tile configuration of the lazy-rescaling FA-2 rung (`scripts/tune_tiles.py`)",
    "fa2_wide_configs": "every tile configuration of the wide-warp FA-2 rung, 32 rows per warp "
                        "(`scripts/tune_tiles.py --rung mma_fa2_wide`)",
    "fa2_lean_configs": "every tile configuration of the lean FA-2 rung, the wide-warp rung with unmasked interior "
                        "tiles and V's inf/NaN test in a pre-pass (`scripts/tune_tiles.py --rung mma_fa2_lean`)",
    "regtile_configs": "the register-tiled rung's tiles against naive CuPy (`scripts/tune_tiles.py --rung regtile`)",
    "regtile_wide_configs": "the wide register-tiled rung's tiles, 16 lanes per row group, against naive CuPy "
                            "(`scripts/tune_tiles.py --rung regtile_wide`)",
    "ncu": "Nsight Compute, one launch per rung (`scripts/profile_rung.py`); `mix_<rung>.txt`: the warp "
           "instructions and FFMA of one launch of each CUDA-core rung",
}


def read_env(env_text: str) -> dict:
    """The date (YYYY-MM-DD), GPU name, driver, NVRTC (CUDA) version, device line and the versions line of an
    ``env.txt`` written by gpu_check.sh. ValueError naming what is missing."""
    found = {}
    date = re.search(r"^date: (\d{4}-\d{2}-\d{2})T", env_text, re.M)
    gpu = re.search(r"^(NVIDIA [^,\n]+), ([\d.]+), ", env_text, re.M)        # nvidia-smi's CSV line
    nvrtc = re.search(r"^nvrtc ([\d.]+)", env_text, re.M)
    device = re.search(r"^device: (.+)$", env_text, re.M)
    for name, match in (("'date: ...' line", date), ("nvidia-smi line (name, driver)", gpu),
                        ("'nvrtc ...' line", nvrtc), ("'device: ...' line", device)):
        if match is None:
            raise ValueError(f"env.txt has no {name}: is this a folder written by scripts/gpu_check.sh on a GPU?")
    found.update(date=date[1], gpu=gpu[1].strip(), driver=gpu[2], cuda=nvrtc[1], device=device[1].strip())
    versions = [line for line in env_text.splitlines() if line.startswith(("python:", "cupy ", "torch"))]
    found["versions"] = "; ".join(versions)
    return found


def run_folder_name(gpu: str, date: str) -> str:
    """``gpu_<model>_<date>``: the GPU's name without the vendor, lower case, words joined by ``_``."""
    model = re.sub(r"[^a-z0-9]+", "_", gpu.lower().removeprefix("nvidia").strip()).strip("_")
    return f"gpu_{model or 'unknown'}_{date}"


def readme(env: dict, commit: str, present: list[str], parts: int = 1) -> str:
    """The recorded run's README.md: the title and driver line :func:`lessons.gpu.recorded.recorded_label`
    reads, the command, and a table of what is there."""
    lines = [f"# The kernels on one {env['gpu']}, {env['date']} (commit {commit})", "",
             f"Machine: {env['device']}, driver {env['driver']}, CUDA {env['cuda']} (NVRTC); {env['versions']}",
             "(`env.txt`). " + ("Everything here came from one command, `scripts/gpu_check.sh DIR` (`summary.txt`: one"
                                if parts == 1 else
                                f"Everything here came from {parts} runs of `scripts/gpu_check.sh DIR`, each with its "
                                f"own GPU_CHECK_STEPS (`summary.txt`: their summaries in order, one"),
             "line per step), and was laid out by `scripts/record_gpu_run.py DIR`. Batch 1, 8 heads, median of",
             "CUDA-event timings.", "", "| folder | what |", "| --- | --- |"]
    lines += [f"| `{name}/` | {WHAT[name]} |" for name in present if name in WHAT]
    lines += ["", "Read `summary.txt` first: a step that failed or ran out of time says so there."]
    return "\n".join(lines) + "\n"


def record(sources, into: Path, commit: str) -> Path:
    """Copy the run in ``sources`` (one results folder, or the parts of a split run in order) into a new folder
    under ``into``; returns that folder. FileNotFoundError without a part's ``env.txt``; FileExistsError when the
    folder exists; ValueError for an env.txt that is not a GPU run's, parts from different GPUs, or a file two
    parts both hold (other than env.txt and summary.txt)."""
    sources = [Path(sources)] if isinstance(sources, (str, Path)) else [Path(s) for s in sources]
    envs = []
    for source in sources:
        env_file = source / "env.txt"
        if not env_file.is_file():
            raise FileNotFoundError(f"{env_file} is missing: RESULTS_DIR must be a folder written by "
                                    f"scripts/gpu_check.sh")
        envs.append(read_env(env_file.read_text()))
    env = envs[0]
    others = {e["gpu"] for e in envs} - {env["gpu"]}
    if others:
        raise ValueError(f"the parts of one run must come from one GPU: {env['gpu']} and {sorted(others)}")
    dest = into / run_folder_name(env["gpu"], env["date"])
    if dest.exists():
        raise FileExistsError(f"{dest} exists already; a recorded run is never written into (move it away first)")
    copies = {}                                        # where a file goes -> the files it comes from, in part order
    for source in sources:
        for src_dir, dst_dir, patterns in LAYOUT:
            for f in sorted({f for pattern in patterns for f in (source / src_dir).glob(pattern) if f.is_file()}):
                target = Path(dst_dir) / f.name
                if target in copies and f.name not in ("env.txt", "summary.txt"):
                    raise ValueError(f"{copies[target][0]} and {f} would both be {target}: give each file to one "
                                     f"part only")
                copies.setdefault(target, []).append(f)
    staging = into / f".{dest.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    for target, files in copies.items():
        (staging / target.parent).mkdir(parents=True, exist_ok=True)
        if target.name == "summary.txt" and len(files) > 1:        # each part's summary, in order
            (staging / target).write_text("\n".join(f.read_text().rstrip("\n") for f in files) + "\n")
        else:
            shutil.copy2(files[0], staging / target)              # (env.txt: the first part's)
    present = list(dict.fromkeys(str(t.parent) for t in copies))
    (staging / "README.md").write_text(readme(env, commit, present, len(sources)))
    staging.rename(dest)                              # all or nothing: no half-written recorded run
    return dest


def head_commit() -> str | None:
    """This checkout's HEAD as a short hash, or None where git cannot say."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, nargs="+", metavar="RESULTS_DIR",
                   help="the folder scripts/gpu_check.sh wrote (or, in order, the folders of a run split in parts)")
    p.add_argument("--commit", default=None, help="the commit the GPU machine ran (default: this checkout's HEAD)")
    p.add_argument("--into", type=Path, default=ROOT / "benchmarks" / "results",
                   help="where the recorded run's folder is made (default benchmarks/results)")
    args = p.parse_args(argv)
    commit = args.commit or head_commit()
    if commit is None:
        p.error("git cannot name this checkout's HEAD: give --commit, the commit the GPU machine ran")
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        p.error(f"--commit must be a git hash (7 to 40 hex digits, lower case), got {commit!r}")
    try:
        dest = record(args.results, args.into, commit)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"record_gpu_run.py: {err}", file=sys.stderr)
        return 2
    print(f"recorded in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

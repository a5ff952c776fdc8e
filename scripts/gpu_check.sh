#!/usr/bin/env bash
# Everything the CUDA kernels need checked on a machine with a GPU, in one command:
#
#   scripts/gpu_check.sh [RESULTS_DIR]        (default: $OUT, else a new gpu_results/<UTC time>-<pid>/;
#                                             a folder that already holds a run's summary.txt is refused)
#   scripts/gpu_check.sh --dry-run DIR        the same steps on the CPU, to check this script
#                                             itself: a few emulator tests, the sanitizer
#                                             drivers on the emulator without compute-sanitizer,
#                                             the benchmark saying there is no device
#
#   1. environment: nvidia-smi, Python, CuPy, NVRTC versions         -> env.txt
#   2. compile report: registers and shared memory per kernel/arch   -> compile_report.txt
#   3. the kernel tests on the device (tests/test_gpu_kernels.py, GPU cases,
#      tests/test_gpu_compile.py, tests/test_gpu_lesson.py, tests/test_gpu_backward.py), in 8 processes at once
#      (pytest-xdist; GPU_CHECK_WORKERS=N to change, 2 in a dry run)    -> pytest.txt, pytest.xml
#   4. compute-sanitizer memcheck and racecheck on each kernel, initcheck on the
#      paged kernels (small drivers: python scripts/sanitize.py)  -> sanitizer/*.txt
#   5. the benchmark (naive CuPy vs the RawKernel vs torch SDPA)      -> benchmark/
#   and a one-line-per-step summary                                   -> summary.txt
#
# Sized to finish in well under 8 minutes on one H200; each step has its own time limit.
# Exit status: 0 if every step that could run passed, 1 otherwise.
set -uo pipefail

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# a run never writes over another's files: the default folder is new for each run
RESULTS="${1:-${OUT:-$ROOT/gpu_results/$(date -u +%Y%m%dT%H%M%SZ)-$$}}"
if [ -e "$RESULTS/summary.txt" ]; then
    echo "gpu_check.sh: $RESULTS already holds a run (summary.txt); give an empty folder" >&2
    exit 2
fi
mkdir -p "$RESULTS/sanitizer" "$RESULTS/benchmark"
RESULTS="$(cd "$RESULTS" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the lessons package from this tree
export MPLBACKEND=Agg

SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)

step() {  # step NAME STATUS DETAIL
    printf '%-40s %-5s %s\n' "$1" "$2" "$3" | tee -a "$SUMMARY"
    if [ "$2" = "FAIL" ]; then FAILED=1; fi
}

# ---- Python with CuPy -------------------------------------------------------------
PY=""
for candidate in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import cupy, numpy" >/dev/null 2>&1; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ]; then
    step "python with cupy" FAIL "no Python here can import cupy (pip install -e '.[test]')"
    exit 1
fi

{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "python: $PY ($("$PY" --version 2>&1))"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1 || echo "nvidia-smi: not found"
    "$PY" - <<'EOF'
import cupy, numpy
import lessons.gpu as gpu
print("cupy", cupy.__version__, "numpy", numpy.__version__)
print("nvrtc", ".".join(map(str, gpu.compile.nvrtc_version())))
print("device:", gpu.device_name())
try:
    import torch
    print("torch", torch.__version__, "cuda available:", torch.cuda.is_available())
except ImportError:
    print("torch: not installed")
EOF
} > "$RESULTS/env.txt" 2>&1
if [ $DRY -eq 1 ]; then
    step "device" skip "dry run: the kernels run on the CPU emulator"
elif "$PY" -c "import sys, lessons.gpu as g; sys.exit(0 if g.device_available() else 1)"; then
    step "device" ok "$(grep '^device:' "$RESULTS/env.txt" | cut -d' ' -f2-)"
else
    step "device" FAIL "CuPy sees no CUDA device (see env.txt)"
    exit 1
fi

# ---- compile report ---------------------------------------------------------------
if timeout 180 "$PY" - > "$RESULTS/compile_report.txt" 2>&1 <<'EOF'
from rich.console import Console
import lessons.gpu as gpu
console = Console(width=160)
console.print(gpu.gpu_status())
for dtype in ("float16", "float32"):
    console.print(gpu.compile_report_table(gpu.compile_report(dtype=dtype)))
EOF
then step "compile report" ok "compile_report.txt"; else step "compile report" FAIL "compile_report.txt"; fi

# ---- tests on the device ----------------------------------------------------------
# several processes at once, as a busy machine compiles: NVRTC's compile cache, the emulator's
# library cache and every temporary file must hold up under it (no pytest cache is written)
SELECT="not emulator"
WORKERS="${GPU_CHECK_WORKERS:-8}"
if [ $DRY -eq 1 ]; then SELECT="emulator and (instruction or keeps_nan)"; WORKERS="${GPU_CHECK_WORKERS:-2}"; fi
if ! "$PY" -c "import xdist" >/dev/null 2>&1; then
    step "pytest (GPU cases)" FAIL "pytest-xdist is not installed (pip install -e '.[test]')"
elif timeout 300 "$PY" -m pytest -p no:nbval -p no:cacheprovider -o addopts="" -q -rs -n "$WORKERS" \
        tests/test_gpu_kernels.py tests/test_gpu_compile.py tests/test_gpu_lesson.py tests/test_gpu_backward.py \
        tests/test_gpu_backward_mma.py -k "$SELECT" \
        --junitxml="$RESULTS/pytest.xml" > "$RESULTS/pytest.txt" 2>&1; then
    step "pytest (GPU cases)" ok "-n $WORKERS: $(tail -n 1 "$RESULTS/pytest.txt")"
else
    step "pytest (GPU cases)" FAIL "-n $WORKERS: $(tail -n 1 "$RESULTS/pytest.txt")"
fi

# ---- compute-sanitizer --------------------------------------------------------------
SAN=""
for candidate in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
                 /opt/nvidia/*/compute-sanitizer; do
    if command -v "$candidate" >/dev/null 2>&1; then SAN="$(command -v "$candidate")"; break; fi
done
if [ -z "$SAN" ]; then
    SAN="$("$PY" - 2>/dev/null <<'EOF'
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
for base in (spec.submodule_search_locations if spec else []):
    for path in glob.glob(os.path.join(base, "cuda_sanitizer_api", "**", "compute-sanitizer"), recursive=True):
        if os.access(path, os.X_OK):
            print(path)
            raise SystemExit
EOF
)"
fi
KERNELS="online_softmax flash_attention flash_attention_mma paged_decode flash_decoding flash_backward flash_backward_mma"
if [ $DRY -eq 1 ]; then
    for kernel in $KERNELS; do
        log="$RESULTS/sanitizer/emulator_${kernel}.txt"
        if timeout 240 "$PY" scripts/sanitize.py "$kernel" --emulator > "$log" 2>&1; then
            step "drivers (emulator) $kernel" ok "$(tail -n 1 "$log")"
        else
            step "drivers (emulator) $kernel" FAIL "exit $? (${log#"$RESULTS"/})"
        fi
    done
elif [ -z "$SAN" ]; then
    step "compute-sanitizer" FAIL "not found (CUDA toolkit or pip nvidia-cuda-sanitizer-api-cu12)"
else
    "$SAN" --version > "$RESULTS/sanitizer/version.txt" 2>&1
    for kernel in $KERNELS; do
        tools="memcheck racecheck"
        case "$kernel" in paged_decode|flash_decoding) tools="$tools initcheck" ;; esac
        for tool in $tools; do
            log="$RESULTS/sanitizer/${tool}_${kernel}.txt"
            timeout 120 "$SAN" --tool "$tool" --error-exitcode 3 "$PY" scripts/sanitize.py "$kernel" > "$log" 2>&1
            rc=$?
            summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
            if [ $rc -eq 0 ]; then
                step "sanitizer $tool $kernel" ok "${summary:-clean}"
            else
                step "sanitizer $tool $kernel" FAIL "exit $rc ${summary} (${log#"$RESULTS"/})"
            fi
        done
    done
fi

# ---- benchmark ------------------------------------------------------------------------
if timeout 240 "$PY" benchmarks/gpu_attention.py --out "$RESULTS/benchmark" --time-budget 150 \
        > "$RESULTS/benchmark/log.txt" 2>&1; then
    if [ $DRY -eq 1 ]; then
        step "benchmark" ok "$(tail -n 1 "$RESULTS/benchmark/log.txt" | cut -c1-60)"
    else
        step "benchmark" ok "benchmark/results.md, benchmark/gpu_attention.png"
    fi
else
    step "benchmark" FAIL "exit $? (benchmark/log.txt)"
fi

step "total" "$([ $FAILED -eq 0 ] && echo ok || echo FAIL)" "$(( $(date +%s) - START )) s, results in $RESULTS"
exit $FAILED

#!/usr/bin/env bash
# Everything the CUDA kernels need checked on a machine with a GPU, in one command:
#
#   scripts/gpu_check.sh [RESULTS_DIR]        (default: $OUT, else a new gpu_results/<UTC time>-<pid>/;
#                                             a folder that already holds a run's summary.txt is refused)
#   scripts/gpu_check.sh --dry-run DIR        the same steps on the CPU, to check this script
#                                             itself: a few emulator tests, the sanitizer
#                                             drivers on the emulator without compute-sanitizer,
#                                             the benchmark saying there is no device, the tile
#                                             tuning sweeps at a tiny N on the emulator, the decode
#                                             split sweep at a tiny shape on the emulator
#   (--dry-run before or after the folder; any other option, or a second folder, is refused: exit 2, nothing written)
#
#   1. environment: nvidia-smi, Python, CuPy, NVRTC versions         -> env.txt
#   2. compile report: registers and shared memory per kernel/arch, and of every legal tile
#      configuration of the lazy-rescaling, the wide-warp and the lean FA-2 rung (the lean one's main
#      kernel and its pre-pass)                                       -> compile_report.txt
#      then the first contact of each rung that has never run on a GPU (lessons.gpu.ladder.first_run_rungs():
#      the forward rungs without a recorded row, the Hopper ones among them, and the decode rungs the recorded
#      run lacks; scripts/first_run.py --rung NAME, 75 s at most each, each in its own process, which ends itself
#      when one launch runs past 30 s, so a deadlocked kernel costs about that): a rung that
#      fails, hangs or cannot run on this device is named in GPU_CHECK_LEFT_OUT and every later step leaves
#      it out (lessons.gpu.ladder.rungs_left_out), so that one wrong layout, barrier or address cannot spend
#      the time, or lose the results, of every other check                  -> smoke_<rung>.txt
#   3. the benchmarks first, alone on the device, at N in GPU_CHECK_SIZES (default "4096 8192"):
#      the forward (naive CuPy vs every rung vs torch SDPA), the backward, the decode kernels'
#      K/V read rate                                                  -> benchmark/, backward/, decode/
#      then the split decode kernel at split counts around its automatic pick, per decode shape
#      (scripts/tune_decode.py, 60 s at most)                          -> decode_splits/
#      and its prefetch build's (--prefetch, 45 s at most)             -> decode_splits_prefetch/
#      and its cp.async build's (--cp-async, 45 s at most)             -> decode_splits_cp_async/
#      then every legal tile configuration of the lean FA-2 rung (the wide-warp rung whose interior key tiles
#      run without mask code, V's inf/NaN test in a pre-pass; first: the most promising FA-2 rung) at N = 8192,
#      d = 64 and 128 (scripts/tune_tiles.py, 60 s at most), beside the FA-2 rung -> fa2_lean_configs/
#      the same for the wide-warp FA-2 rung (32 rows per warp) (75 s)   -> fa2_wide_configs/
#      the same for the lazy-rescaling FA-2 rung (60 s)                  -> fa2_configs/
#      the register-tiled rung's tiles beside naive CuPy (75 s)          -> regtile_configs/
#      and the wide register-tiled rung's (16 lanes per row group) (75 s) -> regtile_wide_configs/
#      (a rung in GPU_CHECK_LEFT_OUT: its benchmark rows say why it was not timed, its sweeps are skipped; the
#      tests' GPU cases, the sanitizer drivers and ncu leave it out as well)
#   4. the GPU cases of every kernel test (tests/test_gpu_*.py), once per entry of
#      GPU_CHECK_PASSES (worker counts, 0 = one process; default "8": 8 processes at once with
#      pytest-xdist; "0 8 0 8" runs serially and with -n 8, twice each) -> pytest_<i>_n<W>.txt/.xml
#      (a test that hangs ends after GPU_CHECK_TEST_TIMEOUT seconds, default 120, where pytest-timeout is installed)
#   5. compute-sanitizer memcheck and racecheck on each kernel that has a driver
#      (python scripts/sanitize.py --list), initcheck on the decode kernels, the runs
#      GPU_CHECK_SANITIZER_JOBS (default 8) at a time                  -> sanitizer/*.txt
#   6. Nsight Compute (ncu --clock-control none, 7 sections) of one launch of each rung in
#      GPU_CHECK_NCU_RUNGS (default: mma_fa2, mma_fa2_lazy, mma_fa2_wide, mma_fa2_lean, the three Hopper rungs, the two
#      fast decode rungs and the cp.async one,
#      then the wide register-tiled rung; d = 128,
#      N = 8192, 8 heads; a rung in GPU_CHECK_LEFT_OUT is skipped), where ncu is installed; "none" skips it
#                                                                     -> ncu/ncu_<rung>.txt
#      then, per rung in GPU_CHECK_MIX_RUNGS (default: scalar, regtile, regtile_wide; "none" skips them), the warp
#      instructions issued and the FFMA executed in one launch (two ncu metrics), the measured counterpart of
#      lessons.gpu.sass.key_tile's count from SASS                      -> ncu/mix_<rung>.txt
#   7. the MPI ring on the GPU (4 ranks), where mpi4py and mpiexec are installed -> ring.txt
#   and a one-line-per-step summary                                   -> summary.txt
#   (the rungs left out, after the first runs or as given, on one line  -> left_out.txt)
#
# GPU_CHECK_STEPS names the groups of steps to run (default all, always in this order): compile (2), smoke (the
# first runs, end of 2), forward, backward and decode (3, the benchmarks), sweeps (3, the decode and tile sweeps),
# pytest (4), sanitizer (5), ncu (6), ring (7); the environment (1) is always written. A group left out is named in
# the summary and does not fail the run, so a short GPU session can split the work over two runs, e.g.
#   GPU_CHECK_STEPS="smoke forward decode sweeps" and then GPU_CHECK_STEPS="compile pytest sanitizer ncu"
# (the second with GPU_CHECK_LEFT_OUT set to the rungs the first one's smoke steps left out: the names after "first
# run" in its summary.txt that did not say ok; "all" leaves out every rung of first_run_rungs()). A GPU_CHECK_LEFT_OUT
# given is honoured only when the smoke group is left out; with it, the first runs decide.
#
# Sized to finish in under 8 minutes on one H200; each step has its own time limit, cut to what is left
# of GPU_CHECK_DEADLINE (seconds from the start; default 480, 1800 on the dry run): a step that would
# start after it is skipped and named in the summary, so the summary is written before a caller's own
# time limit ends the run.
# Exit status: 0 if every step that could run passed and none was left out for time, 1 otherwise.
set -uo pipefail

USAGE="usage: scripts/gpu_check.sh [--dry-run] [RESULTS_DIR]"
DRY=0
FOLDER=""
FOLDER_GIVEN=0
for arg in "$@"; do     # --dry-run before or after the folder; anything else that starts with "-" is a mistake, not
    case "$arg" in      # a folder (a folder of that name: ./-name)
        --dry-run) DRY=1 ;;
        -h|--help) echo "$USAGE"; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option '$arg'; $USAGE" >&2; exit 2 ;;
        *) if [ $FOLDER_GIVEN -eq 1 ]; then
               echo "gpu_check.sh: one results folder at most, got '$FOLDER' and '$arg'; $USAGE" >&2
               exit 2
           fi
           FOLDER="$arg"; FOLDER_GIVEN=1 ;;
    esac
done
# the settings are read before the results folder is made: a mistyped one leaves nothing behind to refuse the rerun
whole_seconds() {  # whole_seconds VAR VALUE MOST: VAR = VALUE, a whole number of seconds from 1 to MOST (all nines),
                   # in decimal even with leading zeros ("08" is 8, not octal); otherwise exit 2 naming GPU_CHECK_VAR
    if ! [[ "$2" =~ ^[0-9]{1,${#3}}$ ]] || [ $((10#$2)) -lt 1 ]; then
        echo "gpu_check.sh: GPU_CHECK_$1 must be a whole number of seconds, at least 1 and at most $3;" \
             "got '$2'" >&2
        exit 2
    fi
    printf -v "$1" '%d' "$((10#$2))"
}
whole_seconds DEADLINE "${GPU_CHECK_DEADLINE:-$([ $DRY -eq 1 ] && echo 1800 || echo 480)}" 999999
whole_seconds TEST_TIMEOUT "${GPU_CHECK_TEST_TIMEOUT:-120}" 99999
rest() {  # seconds left before the deadline (0 once it has passed)
    local r=$(( DEADLINE - ($(date +%s) - START) ))
    echo $(( r > 0 ? r : 0 ))
}
left() {  # left WANT: a step's time limit, WANT seconds (three times that on the dry run, whose compiles and
          # emulated launches share a few CPU cores with whatever else runs) or what is left when that is less
          # (at least 1: "timeout 0" would mean no limit at all)
    local r want=$(( DRY == 1 ? 3 * $1 : $1 ))
    r="$(rest)"
    r=$(( want < r ? want : r ))
    echo $(( r > 0 ? r : 1 ))
}
STEP_GROUPS="compile smoke forward backward decode sweeps pytest sanitizer ncu ring"
WANTED="${GPU_CHECK_STEPS:-$STEP_GROUPS}"
for group in $WANTED; do
    case " $STEP_GROUPS " in
        *" $group "*) ;;
        *) echo "gpu_check.sh: GPU_CHECK_STEPS may name only these groups: $STEP_GROUPS; got '$group'" >&2; exit 2 ;;
    esac
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# a run never writes over another's files: the default folder is new for each run
RESULTS="${FOLDER:-${OUT:-$ROOT/gpu_results/$(date -u +%Y%m%dT%H%M%SZ)-$$}}"
if [ -e "$RESULTS/summary.txt" ]; then
    echo "gpu_check.sh: $RESULTS already holds a run (summary.txt); give an empty folder" >&2
    exit 2
fi
# (a folder that cannot be made, a file in its place say, ends the run here: its files must not go elsewhere)
if ! mkdir -p -- "$RESULTS/sanitizer" "$RESULTS/benchmark" || ! FOLDER="$(cd -- "$RESULTS" && pwd)"; then
    echo "gpu_check.sh: cannot make the results folder $RESULTS (a file in the way, or no permission)" >&2
    exit 2
fi
RESULTS="$FOLDER"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"   # the lessons package from this tree
export MPLBACKEND=Agg

SUMMARY="$RESULTS/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)

step() {  # step NAME STATUS DETAIL
    printf '%-52s %-5s %s\n' "$1" "$2" "$3" | tee -a "$SUMMARY"
    if [ "$2" = "FAIL" ]; then FAILED=1; fi
}

wanted() {  # wanted GROUP: true when GROUP is in GPU_CHECK_STEPS
    case " $WANTED " in *" $1 "*) return 0 ;; esac
    return 1
}
off() {  # off GROUP NAME: true, and NAME skipped in the summary, when GROUP is not in GPU_CHECK_STEPS
    if wanted "$1"; then return 1; fi
    step "$2" skip "not in GPU_CHECK_STEPS"
    return 0
}
late() {  # late NAME: true, and NAME skipped in the summary, when the deadline has passed
    if [ "$(rest)" -gt 0 ]; then return 1; fi
    step "$1" skip "past the deadline (GPU_CHECK_DEADLINE=$DEADLINE s)"
    FAILED=1
    return 0
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
# the rungs to leave out when the smoke group is not run (the second half of a split run): the names given in
# GPU_CHECK_LEFT_OUT, checked by the ladder, "all" spelled out, in ladder order
GIVEN_LEFT_OUT=""
if ! wanted smoke; then
    if ! GIVEN_LEFT_OUT="$("$PY" - <<'EOF'
import sys
from lessons.gpu.ladder import kernel_rungs, rungs_left_out
try:
    left = rungs_left_out()
except ValueError as err:
    print(err)
    sys.exit(1)
print(" ".join(name for name in kernel_rungs() if name in left))
EOF
)"; then
        echo "gpu_check.sh: $GIVEN_LEFT_OUT" >&2
        rm -f -- "$SUMMARY"            # still empty: the corrected rerun may name the same folder
        exit 2
    fi
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
if off compile "compile report"; then
    :
elif timeout "$(left 180)" "$PY" - > "$RESULTS/compile_report.txt" 2>&1 <<'EOF'
from rich.console import Console
import lessons.gpu as gpu
console = Console(width=160)
console.print(gpu.gpu_status())
for dtype in ("float16", "float32"):
    console.print(gpu.compile_report_table(gpu.compile_report(dtype=dtype)))
console.print(gpu.compile_report_table(gpu.compile_report(builds=[make(d) for make in (gpu.flash_attention_wgmma_build,
    gpu.flash_attention_wgmma_overlap_build) for d in (64, 128)])))
# every legal tile configuration of the lazy FA-2 rung, one line each (resources_text cuts no name short)
from lessons.gpu.compile import resources_text
print("\nflash_attention_mma_fa2_lazy, every legal (block_q, block_k, min_blocks), float16:")
print(resources_text(gpu.compile_report(builds=[gpu.flash_attention_mma_fa2_lazy_build(d, "float16", False, *config)
                                               for d in (64, 128) for config in gpu.flash_attention_mma_fa2_lazy_configs(d)])))
print("\nflash_attention_mma_fa2_wide, every legal (block_q, block_k, min_blocks), float16:")
print(resources_text(gpu.compile_report(builds=[gpu.flash_attention_mma_fa2_wide_build(d, "float16", False, *config)
                                               for d in (64, 128) for config in gpu.flash_attention_mma_fa2_wide_configs(d)])))
# the lean rung: its main kernel and the pre-pass that flags V's tiles, per configuration
print("\nflash_attention_mma_fa2_lean, every legal (block_q, block_k, min_blocks), float16:")
print(resources_text(gpu.compile_report(builds=[gpu.flash_attention_mma_fa2_lean_build(d, "float16", False, *config)
                                               for d in (64, 128) for config in gpu.flash_attention_mma_fa2_lean_configs(d)])))
EOF
then step "compile report" ok "compile_report.txt"; else step "compile report" FAIL "compile_report.txt"; fi

# ---- the first contact of each rung that has never run on a GPU, one process and one time limit per rung ----------
# (75 s on a GPU: a few compiles and a few small launches; on the emulator the compiles alone take longer)
if [ $DRY -eq 1 ]; then SMOKE=(--emulator); SMOKE_LIMIT=300; else SMOKE=(); SMOKE_LIMIT=75; fi
if off smoke "first run"; then
    LEFT_OUT="$GIVEN_LEFT_OUT"                    # not run here: the rungs left out are those given
elif ! FIRST_RUN="$("$PY" -c 'from lessons.gpu.ladder import first_run_rungs; print(" ".join(first_run_rungs()))' \
                     2> "$RESULTS/smoke.txt")"; then
    step "first run" FAIL "could not list the rungs (lessons.gpu.ladder.first_run_rungs; smoke.txt)"
    LEFT_OUT=""
else
    rm -f "$RESULTS/smoke.txt"
    LEFT_OUT=""
    for rung in $FIRST_RUN; do
        log="$RESULTS/smoke_$rung.txt"
        if late "first run $rung"; then LEFT_OUT="$LEFT_OUT $rung"; continue; fi
        # (first_run.py ends itself when one launch runs past --hang-seconds, 30 s on a GPU: a deadlocked kernel
        # costs that, not the whole limit; -k: SIGKILL 10 s after the limit's SIGTERM, should that not end it)
        timeout -k 10 "$(left "$SMOKE_LIMIT")" "$PY" scripts/first_run.py --rung "$rung" "${SMOKE[@]}" > "$log" 2>&1
        rc=$?
        hung=""
        if grep -q '^Timeout (' "$log"; then hung=", hung: a launch did not finish"; fi
        case $rc in
            0) step "first run $rung" ok "$(tail -n 1 "$log")" ;;
            2) step "first run $rung" skip "$(tail -n 1 "$log" | cut -c1-100); later steps leave it out"
               LEFT_OUT="$LEFT_OUT $rung" ;;
            *) step "first run $rung" FAIL \
                   "exit $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ', timed out')$hung ($(basename "$log")); later steps leave it out"
               LEFT_OUT="$LEFT_OUT $rung" ;;
        esac
    done
fi
export GPU_CHECK_LEFT_OUT="${LEFT_OUT# }"       # read by lessons.gpu.ladder.rungs_left_out
# the rungs every later step leaves out, one line, so that a second run in the same session can be given them:
#   GPU_CHECK_LEFT_OUT="$(cat DIR/left_out.txt)" GPU_CHECK_STEPS="pytest sanitizer ncu" scripts/gpu_check.sh DIR2
printf '%s\n' "$GPU_CHECK_LEFT_OUT" > "$RESULTS/left_out.txt"
left_out() {  # left_out RUNG: true when the first runs (or the caller) left RUNG out
    case " $GPU_CHECK_LEFT_OUT " in *" $1 "*) return 0 ;; esac
    return 1
}
LEFT_OUT_WHY="in GPU_CHECK_LEFT_OUT: failed its first run on this machine (scripts/first_run.py)"
skip_left_out() {  # skip_left_out GROUP NAME RUNG: true, and NAME skipped in the summary with the reason, when RUNG
                   # is left out (unless GROUP is not run or the deadline has passed: the step itself says so then)
    if wanted "$1" && [ "$(rest)" -gt 0 ] && left_out "$3"; then step "$2" skip "$LEFT_OUT_WHY"; return 0; fi
    return 1
}

# ---- benchmarks, each alone on the device ------------------------------------------------
read -r -a SIZES <<< "${GPU_CHECK_SIZES:-4096 8192}"
bench() {  # bench GROUP NAME SCRIPT DIR ARGS...
    local group="$1" name="$2" script="$3" dir="$4"
    shift 4
    if [ ! -f "$script" ]; then step "$name" skip "$script is not in this tree"; return; fi
    if off "$group" "$name" || late "$name"; then return; fi
    mkdir -p "$RESULTS/$dir"
    if timeout "$(left 240)" "$PY" "$script" --out "$RESULTS/$dir" "$@" > "$RESULTS/$dir/log.txt" 2>&1; then
        step "$name" ok "$dir/ ($(tail -n 1 "$RESULTS/$dir/log.txt" | cut -c1-60))"
    else
        step "$name" FAIL "exit $? ($dir/log.txt)"
    fi
}
bench forward "benchmark forward" benchmarks/gpu_attention.py benchmark --sizes "${SIZES[@]}" --time-budget 150
bench backward "benchmark backward" benchmarks/gpu_backward.py backward --sizes "${SIZES[@]}" --time-budget 90
bench decode "benchmark decode" benchmarks/gpu_decode.py decode

# ---- the sweeps, timed one after another (on the dry run: each choice once at a tiny size on the emulator, against
# NumPy, with four times the time: the emulator is slower, above all on a busy machine)
if [ $DRY -eq 1 ]; then ON_CPU=(--emulator); else ON_CPU=(); fi
sweep() {  # sweep NAME DIR SECONDS BUDGET SCRIPT ARGS...: BUDGET "budget" passes --time-budget (20 s short of the
           # step's limit, so that the script writes its tables before the limit), "-" passes nothing
    local name="$1" dir="$2" limit="$3" budget="$4" script="$5"
    shift 5
    if off sweeps "$name" || late "$name"; then return; fi
    mkdir -p "$RESULTS/$dir"
    if [ $DRY -eq 1 ]; then limit=$(( limit * 4 )); fi
    limit="$(left "$limit")"
    local extra=()
    if [ "$budget" = "budget" ]; then extra=(--time-budget $(( limit > 30 ? limit - 20 : limit / 2 ))); fi
    timeout "$limit" "$PY" "$script" --out "$RESULTS/$dir" "${ON_CPU[@]}" "$@" "${extra[@]}" > "$RESULTS/$dir/log.txt" 2>&1
    local rc=$?
    if [ $rc -eq 0 ]; then
        step "$name" ok "$dir/"
    else
        if [ $rc -eq 124 ]; then echo "gpu_check.sh: timed out after $limit s" >> "$RESULTS/$dir/log.txt"; fi
        step "$name" FAIL "exit $rc$([ $rc -eq 124 ] && echo ", timed out after $limit s") ($dir/log.txt)"
    fi
}
# the split decode kernel at split counts around its automatic pick; the tiles of the lean, the wide-warp and the
# lazy FA-2 rung (the lean one first: the most promising) and of the register-tiled rung and its wide build
# (a sweep of a rung left out after its first run is skipped here, and by the script itself)
if ! skip_left_out sweeps "decode split sweep" paged_decode_split; then
    sweep "decode split sweep" decode_splits 60 budget scripts/tune_decode.py
fi
if ! skip_left_out sweeps "decode split sweep (prefetch)" paged_decode_prefetch; then
    sweep "decode split sweep (prefetch)" decode_splits_prefetch 45 budget scripts/tune_decode.py --prefetch
fi
if ! skip_left_out sweeps "decode split sweep (cp.async)" paged_decode_cp_async; then
    sweep "decode split sweep (cp.async)" decode_splits_cp_async 45 budget scripts/tune_decode.py --cp-async
fi
for args in "mma_fa2_lean fa2_lean_configs 60" "mma_fa2_wide fa2_wide_configs 75" "mma_fa2_lazy fa2_configs 60" \
            "regtile regtile_configs 75" "regtile_wide regtile_wide_configs 75"; do
    read -r rung dir seconds <<< "$args"
    if skip_left_out sweeps "tune $rung tiles" "$rung"; then continue; fi
    sweep "tune $rung tiles" "$dir" "$seconds" - scripts/tune_tiles.py --rung "$rung"
done

# ---- tests on the device ----------------------------------------------------------
# several processes at once, as a busy machine compiles: NVRTC's compile cache, the emulator's
# library cache and every temporary file must hold up under it (no pytest cache is written)
SELECT="not emulator"
PASSES="${GPU_CHECK_PASSES:-8}"
if [ $DRY -eq 1 ]; then SELECT="emulator and (instruction or keeps_nan)"; PASSES="${GPU_CHECK_PASSES:-2}"; fi
# (a rung left out is skipped inside the tests; all three Hopper rungs left out: their tests are not even selected)
if left_out wgmma && left_out wgmma_overlap && left_out wgmma_pingpong; then SELECT="$SELECT and not wgmma"; fi
TESTS=(tests/test_gpu_*.py)
if off pytest "pytest (GPU cases)"; then
    :
elif ! "$PY" -c "import xdist" >/dev/null 2>&1; then
    step "pytest (GPU cases)" FAIL "pytest-xdist is not installed (pip install -e '.[test]')"
else
    # a test that hangs (a kernel waiting forever on a barrier) ends after GPU_CHECK_TEST_TIMEOUT seconds with every
    # thread's stack in the log, instead of holding the whole pass until its time limit (pytest-timeout, where installed)
    HANG=()
    if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
        HANG=(--timeout "$TEST_TIMEOUT" --timeout-method thread)
    fi
    i=0
    for workers in $PASSES; do
        i=$((i + 1))
        name="pytest_${i}_n${workers}"
        if late "pytest pass $i (-n $workers)"; then continue; fi
        xdist=(-n "$workers")              # (-n 0: one process; the project's addopts need xdist loaded)
        if timeout "$(left 300)" "$PY" -m pytest -p no:nbval -p no:cacheprovider -o addopts="" -q -rs "${xdist[@]}" "${HANG[@]}" \
                "${TESTS[@]}" -k "$SELECT" --junitxml="$RESULTS/$name.xml" > "$RESULTS/$name.txt" 2>&1; then
            step "pytest pass $i (-n $workers)" ok "$(tail -n 1 "$RESULTS/$name.txt")"
        else
            step "pytest pass $i (-n $workers)" FAIL "$(tail -n 1 "$RESULTS/$name.txt") ($name.txt)"
        fi
    done
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
JOBS=()
for kernel in $("$PY" scripts/sanitize.py --list); do
    if [ $DRY -eq 1 ]; then JOBS+=("emulator $kernel"); continue; fi
    tools="memcheck racecheck"
    case "$kernel" in *decod*) tools="$tools initcheck" ;; esac
    for tool in $tools; do JOBS+=("$tool $kernel"); done
done
if off sanitizer "compute-sanitizer" || late "compute-sanitizer"; then
    :
elif [ $DRY -eq 0 ] && [ -z "$SAN" ]; then
    step "compute-sanitizer" FAIL "not found (CUDA toolkit or pip nvidia-cuda-sanitizer-api-cu12)"
else
    if [ -n "$SAN" ]; then "$SAN" --version > "$RESULTS/sanitizer/version.txt" 2>&1; fi
    SAN_LIMIT="$(left 150)"
    export SAN PY RESULTS SAN_LIMIT
    sanitize_one() {  # sanitize_one TOOL KERNEL: writes sanitizer/TOOL_KERNEL.txt and its exit status
        local log="$RESULTS/sanitizer/$1_$2.txt"
        if [ "$1" = "emulator" ]; then
            timeout "$SAN_LIMIT" "$PY" scripts/sanitize.py "$2" --emulator > "$log" 2>&1
        else
            timeout "$SAN_LIMIT" "$SAN" --tool "$1" --error-exitcode 3 "$PY" scripts/sanitize.py "$2" > "$log" 2>&1
        fi
        echo $? > "$log.rc"
    }
    export -f sanitize_one
    # the runs overlap (GPU_CHECK_SANITIZER_JOBS at a time): a kernel must also stay clean on a busy device
    # (all of them within what is left of the deadline: a run cut short leaves no exit status, and fails)
    printf '%s\n' "${JOBS[@]}" | timeout "$(left 600)" xargs -P "${GPU_CHECK_SANITIZER_JOBS:-8}" -L 1 \
        bash -c 'sanitize_one "$0" "$1"'
    for job in "${JOBS[@]}"; do
        read -r tool kernel <<< "$job"
        log="$RESULTS/sanitizer/${tool}_${kernel}.txt"
        rc="$(cat "$log.rc" 2>/dev/null || echo missing)"
        rm -f "$log.rc"
        summary="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" 2>/dev/null | tail -n 1)"
        label="sanitizer $tool $kernel"
        if [ "$tool" = "emulator" ]; then label="drivers (emulator) $kernel"; fi
        if [ "$rc" = "0" ]; then
            step "$label" ok "${summary:-$(tail -n 1 "$log")}"
        else
            step "$label" FAIL "exit $rc ${summary} (sanitizer/${tool}_${kernel}.txt)"
        fi
    done
fi

# ---- Nsight Compute, one launch per rung --------------------------------------------------
ended() {  # ended NAME RC DETAIL FILE: NAME ok with DETAIL when RC is 0, else FAIL with the exit status and FILE
    if [ "$2" -eq 0 ]; then step "$1" ok "$3"
    else step "$1" FAIL "exit $2$([ "$2" -eq 124 ] && echo ', timed out') ($4)"; fi
}
read -r -a NCU_RUNGS <<< "${GPU_CHECK_NCU_RUNGS:-mma_fa2 mma_fa2_lazy mma_fa2_wide mma_fa2_lean wgmma wgmma_overlap wgmma_pingpong paged_decode_split paged_decode_prefetch paged_decode_cp_async regtile_wide}"
NCU=""
for candidate in ncu /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    if command -v "$candidate" >/dev/null 2>&1; then NCU="$(command -v "$candidate")"; break; fi
done
if off ncu "ncu"; then
    :
elif [ "${NCU_RUNGS[*]}" = "none" ]; then
    step "ncu" skip "GPU_CHECK_NCU_RUNGS=none"
elif [ $DRY -eq 0 ] && [ -z "$NCU" ]; then
    step "ncu" skip "Nsight Compute (ncu) is not installed"
else
    mkdir -p "$RESULTS/ncu"
    for rung in "${NCU_RUNGS[@]}"; do
        log="$RESULTS/ncu/ncu_$rung.txt"
        if late "ncu $rung" || skip_left_out ncu "ncu $rung" "$rung"; then continue; fi
        if [ $DRY -eq 1 ]; then         # the driver alone, on the emulator
            timeout "$(left 240)" "$PY" scripts/profile_rung.py "$rung" --emulator > "$log" 2>&1
        else
            entry="$("$PY" scripts/profile_rung.py "$rung" --entry 2>> "$log")"
            timeout "$(left 150)" "$NCU" --clock-control none -k "$entry" --launch-skip 1 --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
                "$PY" scripts/profile_rung.py "$rung" >> "$log" 2>&1
        fi
        rc=$?
        detail="$(grep -E '^ +Duration ' "$log" | head -n 1 | tr -s ' ')"
        ended "ncu $rung" $rc "${detail:-$(tail -n 1 "$log" | cut -c1-70)}" "ncu/ncu_$rung.txt"
    done
    # the instruction mix of the CUDA-core rungs: warp instructions issued and FFMA executed in one launch, to set
    # beside what lessons.gpu.sass.launch_at_least counts from SASS (a launch issues at least that many); a run
    # of its own per rung, so that a metric this ncu lacks costs only this line
    read -r -a MIX_RUNGS <<< "${GPU_CHECK_MIX_RUNGS:-scalar regtile regtile_wide}"
    for rung in "${MIX_RUNGS[@]}"; do
        [ "$rung" = "none" ] && break
        log="$RESULTS/ncu/mix_$rung.txt"
        if late "ncu mix $rung" || skip_left_out ncu "ncu mix $rung" "$rung"; then continue; fi
        entry="$("$PY" scripts/profile_rung.py "$rung" --entry 2> "$log")"
        rc=$?
        if [ $rc -eq 0 ] && [ $DRY -eq 1 ]; then
            echo "dry run: ncu would filter on $entry" >> "$log"
        elif [ $rc -eq 0 ]; then
            timeout "$(left 90)" "$NCU" --clock-control none -k "$entry" --launch-skip 1 --launch-count 1 \
                --print-units base --metrics smsp__inst_executed.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum \
                "$PY" scripts/profile_rung.py "$rung" >> "$log" 2>&1
            rc=$?
        fi
        detail="$(grep -E 'inst_executed' "$log" | tr -s ' ' | paste -sd ';' | cut -c1-70)"
        ended "ncu mix $rung" $rc "${detail:-$(tail -n 1 "$log" | cut -c1-70)}" "ncu/mix_$rung.txt"
    done
fi

# ---- the MPI ring on the GPU -------------------------------------------------------------
if off ring "ring on the GPU (MPI)"; then
    :
elif [ $DRY -eq 1 ]; then
    step "ring on the GPU (MPI)" skip "dry run"
elif late "ring on the GPU (MPI)"; then
    :
elif ! "$PY" -c "import sys; from lessons.distributed.launch import mpi_status; ok, why = mpi_status(); print(why); sys.exit(0 if ok else 1)" \
        > "$RESULTS/ring.txt" 2>&1; then
    step "ring on the GPU (MPI)" skip "$(tail -n 1 "$RESULTS/ring.txt" | cut -c1-70)"
else
    # OpenMPI refuses to start as root without these (containers run as root)
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    if timeout "$(left 150)" "$PY" - >> "$RESULTS/ring.txt" 2>&1 <<'EOF'
import tempfile
import numpy as np
from lessons import attention
from lessons.distributed.launch import run_ring
for causal, schedule, split in ((False, "kv", "contiguous"), (True, "q", "zigzag")):
    run = run_ring(4, tempfile.mkdtemp() + "/ring", n=4096, d=64, causal=causal, schedule=schedule, split=split,
                   device="gpu", timeout=60)
    q, k, v = run.inputs()
    err = float(np.abs(run.out - attention(q, k, v, causal=causal)).max())
    print(run.label(), f"max |out - attention| = {err:.2e}")
    assert run.meta.get("device") == "gpu" and err < 1e-4, err
EOF
    then step "ring on the GPU (MPI)" ok "$(tail -n 1 "$RESULTS/ring.txt" | cut -c1-70)"
    else step "ring on the GPU (MPI)" FAIL "ring.txt"; fi
fi

step "total" "$([ $FAILED -eq 0 ] && echo ok || echo FAIL)" "$(( $(date +%s) - START )) s, results in $RESULTS"
exit $FAILED

"""Start the MPI ring from Python, with a time limit, and read its results back.

:func:`run_ring` runs ``mpiexec -n W python -m lessons.distributed.ring ...`` in its
own process group and kills the whole group when the time limit passes, so a rank
that hangs can never hang the caller and no process is left behind. :func:`load_run`
reads a results folder (one written by a run now, or a recorded one shipped with the
course); :func:`compare_with_simulation` checks it against the one-process simulation
:func:`lessons.ring_attention` step by step: the same query block, folding the same KV
block, at the same step, on the same rank, leaving the same state ``(m, l)``. A run on a
device (``device="gpu"`` or ``"emulator"``: the CUDA kernel, float32) keeps its state in
the merged form (``m = lse`` of each partial, ``l`` the merged weights), so there the
comparison is of what both forms agree on: ``m + log l`` (the lse so far) after every
step, and the finished output.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lessons.schedules.ring import SCHEDULES, SPLITS, layout_index, ring_attention, ring_layout

#: ``--device`` values of the ring program (:data:`lessons.distributed.ring.DEVICES`; not imported from
#: there, so that this module imports without mpi4py).
DEVICES = ("cpu", "gpu", "emulator")

__all__ = ["RingRun", "RingRunError", "find_mpiexec", "mpi_status", "run_ring", "load_run",
           "compare_with_simulation", "lesson_run", "RECORDED_RUN", "RECORDED_DIR", "LESSON_RUNS", "INSTALL_HINT"]

#: The runs the ring lesson makes: 4 ranks, N = 2048, d = 64, causal, tiles of 256 keys.
LESSON_RUNS = {
    "kv_zigzag": dict(schedule="kv", split="zigzag"),
    "kv_contiguous": dict(schedule="kv", split="contiguous"),
    "q_zigzag": dict(schedule="q", split="zigzag"),
}
LESSON_SETTINGS = dict(world_size=4, n=2048, d=64, causal=True, block_k=256)
#: Runs recorded on the course's CPU machine (folders named as LESSON_RUNS), shipped for readers without MPI.
RECORDED_DIR = Path(__file__).resolve().parent / "recorded"
RECORDED_RUN = RECORDED_DIR / "kv_zigzag"
#: What to type to get MPI from PyPI alone.
INSTALL_HINT = 'pip install -e ".[distributed]"   (or: pip install mpi4py mpich)'


class RingRunError(RuntimeError):
    """The MPI job failed, timed out, or was refused its arguments; ``.output`` holds what it printed."""

    def __init__(self, message: str, output: str = "", returncode: int | None = None):
        super().__init__(message + (f"\n--- output ---\n{output.strip()}" if output.strip() else ""))
        self.output = output
        self.returncode = returncode


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (a venv with the ``mpich`` wheel) or on PATH; None if absent."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def mpi_status() -> tuple[bool, str]:
    """``(True, "mpiexec PATH")`` when mpi4py imports and mpiexec exists, else ``(False, reason + how to install)``."""
    if importlib.util.find_spec("mpi4py") is None:
        return False, f"mpi4py is not installed; install it with: {INSTALL_HINT}"
    exe = find_mpiexec()
    if exe is None:
        return False, f"no mpiexec found beside {sys.executable} or on PATH; install one with: {INSTALL_HINT}"
    return True, f"mpiexec {exe}"


@dataclass
class RingRun:
    """A results folder read back: ``out`` (N, d), ``lse`` (N,), ``meta`` (the run's settings and
    machine), ``ranks`` (per rank: rows, work, compute/wait/idle seconds, peak memory),
    ``steps`` (per rank and step: blocks held, work, and the compute/comm/wait intervals in
    seconds from the common start), ``states`` (``states[(step, rank)] = (m, l)`` after the
    step), ``recorded`` (True for a run shipped with the course), ``path``."""

    out: np.ndarray
    lse: np.ndarray
    meta: dict
    ranks: list
    steps: list
    states: dict
    path: Path
    recorded: bool = False

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    def inputs(self):
        """The run's ``q, k, v`` (N, d), regenerated from its seed (:func:`lessons.distributed.ring.make_inputs`)."""
        from lessons.distributed.ring import make_inputs
        return make_inputs(self.meta["n"], self.meta["d"], seed=self.meta["seed"])

    def label(self) -> str:
        """One line saying what ran where, and whether it is a recorded run."""
        m = self.meta
        kind = f"RECORDED run ({m['date']}, host {m['host']}, {' '.join(m['mpi'].split())})" if self.recorded else f"run on {m['host']}"
        return (f"{kind}: {m['world_size']} ranks, schedule {m['schedule']}, split {m['split']}, N={m['n']}, "
                f"d={m['d']}, causal={m['causal']}, wall {m['wall_s']:.3f} s")


def load_run(path, *, recorded: bool = False) -> RingRun:
    """Read a results folder written by ``python -m lessons.distributed.ring --out PATH``.

    Raises FileNotFoundError naming the missing file.
    """
    path = Path(path)
    for name in ("result.npz", "timeline.json"):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name} is missing: not a ring results folder")
    timeline = json.loads((path / "timeline.json").read_text())
    with np.load(path / "result.npz") as z:
        out, lse = z["out"], z["lse"]
        states = {}
        for ev in timeline["steps"]:
            t, r = ev["step"], ev["rank"]
            states[(t, r)] = (z[f"m_step{t}_rank{r}"], z[f"l_step{t}_rank{r}"])
    return RingRun(out=out, lse=lse, meta=timeline["meta"], ranks=timeline["ranks"], steps=timeline["steps"],
                   states=states, path=path, recorded=recorded)


def run_ring(world_size: int, out_dir, *, n: int = 4096, d: int = 64, causal: bool = False, schedule: str = "kv",
             split: str = "contiguous", block_k: int = 512, seed: int = 0, timeout: float = 120.0,
             extra_args=(), threads_per_rank: int = 1, device: str = "cpu") -> RingRun:
    """Run the ring on ``world_size`` MPI ranks and return its results (:class:`RingRun`).

    ``out_dir`` must not exist yet or be empty (nothing is written over). ``timeout``
    (seconds) bounds the whole job: past it the job's process group is killed
    (SIGKILL) and :class:`RingRunError` is raised. ``threads_per_rank`` caps each
    rank's BLAS threads (ranks share the cores). ``extra_args``: more command-line
    words for the program. ``device``: ``"cpu"`` (the NumPy fold, float64), ``"gpu"``
    (the CUDA kernel, float32) or ``"emulator"`` (the same kernel on the CPU emulator).
    Raises RuntimeError (with :data:`INSTALL_HINT`) when MPI is missing, ValueError for a
    bad ``world_size``/``schedule``/``split``/``device`` before starting, and RingRunError
    when the job exits non-zero (its output attached).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__} {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    world_size = int(world_size)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    ok, why = mpi_status()
    if not ok:
        raise RuntimeError(why)
    out_dir = Path(out_dir)
    cmd = [find_mpiexec(), "-n", str(world_size), sys.executable, "-m", "lessons.distributed.ring",
           "--n", str(n), "--d", str(d), "--schedule", schedule, "--split", split, "--block-k", str(block_k),
           "--seed", str(seed), "--device", device, "--out", str(out_dir)] + (["--causal"] if causal else []) \
        + list(extra_args)
    returncode, output = run_with_timeout(cmd, timeout, threads_per_rank)
    if returncode is None:
        raise RingRunError(f"the MPI job did not finish within {timeout} s; its process group was killed", output)
    if returncode != 0:
        raise RingRunError(f"the MPI job exited with status {returncode}", output, returncode)
    return load_run(out_dir)


def run_with_timeout(cmd, timeout: float, threads_per_rank: int = 1) -> tuple[int | None, str]:
    """Run ``cmd`` (an ``mpiexec`` line) with a time limit; leave none of its processes behind.

    Returns ``(returncode, stdout + stderr)``, returncode None after a timeout. The job
    runs in a new session, and every process it starts carries a unique
    ``LESSONS_RING_JOB`` token in its environment (MPICH's launcher puts each rank in a
    session of its own, so a process group does not reach them). When the job ends, or
    the time limit passes, every process still holding the token is killed (SIGKILL)
    and waited for.
    """
    import uuid
    token = uuid.uuid4().hex
    env = dict(os.environ, LESSONS_RING_JOB=token)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads_per_rank)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        _end_job(proc, token)
        output, _ = proc.communicate()
        return None, output
    finally:
        # mpiexec may return (after MPI_Abort, say) while ranks are still being torn down:
        # end whatever is left, so that no rank outlives the call.
        _end_job(proc, token)
        if proc.poll() is None:
            proc.communicate()


def _job_pids(token: str) -> list[int]:
    """Live processes whose environment holds ``LESSONS_RING_JOB=token`` (Linux /proc; [] elsewhere)."""
    mark = f"LESSONS_RING_JOB={token}".encode()
    pids = []
    proc_dir = Path("/proc")
    if not proc_dir.is_dir():
        return pids
    for p in proc_dir.iterdir():
        if p.name.isdigit():
            try:
                if mark in (p / "environ").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                continue
    return pids


def _end_job(proc, token: str, wait: float = 10.0) -> None:
    """SIGKILL mpiexec's process group and every process of the job; wait (up to ``wait`` s) until gone."""
    import time
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    end = time.monotonic() + wait
    while True:
        pids = _job_pids(token)
        proc.poll()                                  # reap mpiexec itself once it has ended
        if not pids or time.monotonic() > end:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def compare_with_simulation(run: RingRun, q=None, k=None, v=None) -> dict:
    """Check a real run against :func:`lessons.ring_attention` with the same settings, step by step.

    For every (step, rank) the real rank must have held the same query block and KV
    block as the simulated device, and left the same state: ``m`` and ``l`` of that
    query block after the step. A run on a device (``meta["device"]`` ``"gpu"`` or
    ``"emulator"``) kept its state in the merged form (:mod:`lessons.distributed.ring`:
    ``m`` is the largest partial lse, not the largest score), whose ``m`` and ``l`` differ
    from the NumPy fold's; there the state compared is ``m + log l``, the lse of the keys
    folded so far, which both forms share (``state_form`` says which was compared). The
    simulation runs in float64; a device run is float32, so expect float32-sized differences.
    ``q, k, v`` default to the run's inputs regenerated from its seed. Returns a dict:
    ``same_blocks`` (bool), ``state_form`` (``"m, l"`` or ``"lse"``), ``worst_state`` (max
    difference in m and l, or in the lse, over every step and rank, relative to
    ``max(1, |value|)``; -inf must match exactly, else ``same_blocks`` is False),
    ``worst_output`` (max |out - simulation|), ``worst_lse`` (max |lse - simulation| over
    finite entries), ``steps_compared`` (int), ``trace`` (the simulation's RingTrace).
    """
    meta = run.meta
    if q is None:
        q, k, v = run.inputs()
    sim_out, sim_lse, trace = ring_attention(q, k, v, meta["world_size"], causal=meta["causal"],
                                             schedule=meta["schedule"], split=meta["split"], block_k=meta["block_k"],
                                             return_lse=True, return_trace=True)
    merged = meta.get("device", "cpu") != "cpu"          # a device run's state is in the merged form

    def lse_of(m, l):
        with np.errstate(divide="ignore"):
            return np.asarray(m, np.float64) + np.log(np.asarray(l, np.float64))

    def rel(a, b):
        return float((np.abs(a - b) / np.maximum(1, np.abs(b))).max(initial=0.0))

    same, worst, compared = True, 0.0, 0
    by_key = {(ev["step"], ev["rank"]): ev for ev in run.steps}
    for rec in trace.records:
        ev = by_key[(rec.step, rec.rank)]
        same &= (ev["q_block"], ev["kv_block"]) == (rec.q_block, rec.kv_block)
        m, l = run.states[(rec.step, rec.rank)]
        if m.shape != rec.m.shape or not np.array_equal(np.isneginf(m), np.isneginf(rec.m)):
            same = False
            continue
        fin = np.isfinite(rec.m)
        if merged:
            worst = max(worst, rel(lse_of(m, l)[fin], lse_of(rec.m, rec.l)[fin]))
        elif fin.any():
            worst = max(worst, rel(m[fin], rec.m[fin]), rel(l, rec.l))
        compared += 1
    fin = np.isfinite(sim_lse)
    same &= bool(np.array_equal(np.isneginf(run.lse), np.isneginf(sim_lse)))
    return dict(same_blocks=bool(same), state_form="lse" if merged else "m, l", worst_state=worst,
                worst_output=float(np.abs(run.out - sim_out).max()),
                worst_lse=float(np.abs(run.lse[fin] - sim_lse[fin]).max(initial=0.0)),
                steps_compared=compared, trace=trace)


#: why MPI was not available, for each reason lesson_run already printed
_TOLD: set = set()


def lesson_run(name: str, workdir=None, *, timeout: float = 180.0) -> RingRun:
    """One of the lesson's runs (:data:`LESSON_RUNS`): live when MPI is installed, else the recorded one.

    Live: runs :func:`run_ring` with :data:`LESSON_SETTINGS` into a new folder inside
    ``workdir`` (default: a fresh temporary folder; an existing folder is never written
    over) with the time limit ``timeout`` seconds. Without MPI: prints why and how to
    install it (once per session), and returns the run recorded on the course's machine
    (``recorded=True``, labelled as such by :meth:`RingRun.label` and the figures).
    Raises ValueError for an unknown name, RingRunError when the live job fails.
    """
    import tempfile
    if name not in LESSON_RUNS:
        raise ValueError(f"name must be one of {', '.join(LESSON_RUNS)}, got {name!r}")
    ok, why = mpi_status()
    if not ok:
        if why not in _TOLD:                         # once per session, not once per run
            _TOLD.add(why)
            print(f"MPI is not available here ({why}).\nShowing the runs recorded on the course's machine instead.")
        return load_run(RECORDED_DIR / name, recorded=True)
    base = Path(tempfile.mkdtemp(prefix="ring_", dir=workdir))
    settings = dict(LESSON_SETTINGS)
    world_size = settings.pop("world_size")
    return run_ring(world_size, base / name, timeout=timeout, **settings, **LESSON_RUNS[name])


def rank_rows(run: RingRun, rank: int) -> np.ndarray:
    """The sequence positions (int array) whose output ``rank`` owned in ``run``."""
    return layout_index(ring_layout(run.meta["n"], run.world_size, run.meta["split"])[rank])

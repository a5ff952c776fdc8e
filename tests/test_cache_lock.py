"""lessons.gpu.cache_lock: one process at a time per cache entry, so a build needed by several
processes at once is compiled once."""
from __future__ import annotations

import multiprocessing
import time

import pytest

from lessons.gpu import cache_lock
from lessons.gpu.cache_lock import one_at_a_time

pytestmark = pytest.mark.skipif(cache_lock.fcntl is None, reason="no fcntl (not POSIX): the caches do not lock")


def _hold(entry, log, seconds):
    with one_at_a_time(entry):
        with open(log, "a") as f:
            f.write(f"in {time.monotonic()}\n")
        time.sleep(seconds)
        with open(log, "a") as f:
            f.write(f"out {time.monotonic()}\n")


def test_two_processes_never_hold_one_entry_at_once(tmp_path):
    log = tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_hold, args=(tmp_path / "entry", log, 0.3)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert [e[0] for e in events] == ["in", "out"] * 3                   # strictly one after another
    times = [float(e[1]) for e in events]
    assert times == sorted(times)


def test_other_entries_do_not_wait(tmp_path):
    with one_at_a_time(tmp_path / "a"):
        done = []
        with one_at_a_time(tmp_path / "b"):                                # would block forever if shared
            done.append(True)
    assert done == [True]


def test_a_lock_that_cannot_be_made_runs_unlocked(tmp_path):
    ran = []
    with one_at_a_time(tmp_path / "no-such-folder" / "entry"):
        ran.append(True)
    assert ran == [True]


def test_a_kernel_needed_by_two_threads_at_once_is_compiled_once(tmp_path, monkeypatch):
    import threading

    import lessons.gpu as gpu
    from lessons.gpu import compile as compile_mod
    from lessons.gpu import source
    if not gpu.nvrtc_available():
        pytest.skip("CuPy/NVRTC not installed")
    real = compile_mod._nvrtc()
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def compileProgram(self, prog, options):
            calls.append(1)
            time.sleep(0.5)                                                # long enough for the other to arrive
            return real.compileProgram(prog, options)

    monkeypatch.setattr(compile_mod, "_nvrtc", lambda: Counting())
    monkeypatch.setenv("LESSONS_NVRTC_CACHE", str(tmp_path / "kept"))
    build = source.online_softmax_build(64, "float32")
    out = []
    threads = [threading.Thread(target=lambda: out.append(compile_mod._compile(build, "-arch=sm_80", (), "ptx")[1]))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 2 and out[0] == out[1] and out[0]
    assert len(calls) == 1

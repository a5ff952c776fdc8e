"""One process at a time per cache entry: the kernel caches' lock (NVRTC results, emulator libraries).

Test workers and notebook kernels often need the same build at the same moment; without a lock
each would compile it. :func:`one_at_a_time` holds an exclusive ``flock`` on ``<entry>.lock`` beside
the entry, so the second process waits and then reads what the first one kept. Where ``fcntl`` is
missing (Windows) or the lock file cannot be made, it does not lock: both compile, as before, and
the atomic renames of the caches keep that safe.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:                       # not POSIX
    fcntl = None

__all__ = ["one_at_a_time"]


@contextmanager
def one_at_a_time(entry: Path):
    """Hold the lock of cache entry ``entry`` (a path) for the ``with`` block; blocks while another
    process or thread holds it. Never raises for a lock it cannot take: then it runs unlocked."""
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(f"{entry}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

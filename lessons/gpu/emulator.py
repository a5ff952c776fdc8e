"""Run the CUDA kernels on the CPU: a test harness for machines without a GPU.

The same ``.cu`` source is compiled by the host C++ compiler with
``kernels/cpu_emulation.h`` forced in front of it: every CUDA thread becomes a fiber (its own
stack, switched by ``swapcontext`` on the calling CPU thread), ``__syncthreads()`` a barrier over
the block at which each fiber hands over to the next, ``__shfl_xor_sync`` an exchange between two
warp barriers, ``__shared__`` one copy per running block. Blocks run one after another (the last
first), and a launch uses one core. It is slow, and it is not a GPU (no warps in lock-step, no
memory coalescing, different ``expf`` rounding), but it executes exactly the kernels'
index arithmetic, bounds checks, barriers and -inf handling, so the tests can check
them against NumPy on every machine. A barrier that some thread of the block never reaches
fails the launch at once (:class:`EmulatorError`).

Every pointer argument is copied into a buffer with guard zones of 0xFF bytes on
both sides, each as large as the buffer itself and at least 256 KiB (NaN as
float32/float16/bfloat16, -1 as int32). A read past the end of an
input returns NaN (and shows up in the output); a write past the end of an output
changes the guard and raises :class:`EmulatorMemoryError` naming the argument.

A ``cp.async`` copy (``kernels/async_copy.cuh``) lands at the ``cp.async.wait_group`` that covers its group,
the latest a GPU may land it, so a read of its slot before that wait sees the old bytes. With
``LESSONS_EMULATOR_CP_ASYNC=issue`` in the environment each copy lands as it is issued instead, the earliest,
so a slot refilled before its old bytes were read shows too; ``wait`` (or unset) is the default.

Safe to use from several processes and threads at once: each library is built in its own
temporary folder and moved into the cache (``$LESSONS_EMULATOR_CACHE``, default a per-user
folder under the system temp dir) under a name that hashes its source, compiler and flags,
with one atomic rename, so a process never loads half a file; and since a loaded library
holds one block's shared memory and ``blockDim``/``gridDim`` as globals, launches from
several threads of one process take turns (one lock).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from lessons.gpu.cache_lock import one_at_a_time
from lessons.gpu.source import KERNEL_DIR, KernelBuild, kernel_signature, kernel_source

__all__ = ["EmulatorError", "EmulatorMemoryError", "emulator_available", "EmulatedModule", "GUARD_BYTES"]

#: least bytes of 0xFF guard (more than a block of 64 rows x 256 floats can overrun) before and after every buffer passed to an emulated kernel
GUARD_BYTES = 256 * 1024


class EmulatorError(RuntimeError):
    """The emulated kernel could not be built, or a launch failed (e.g. a barrier that
    not every thread reached)."""


class EmulatorMemoryError(EmulatorError):
    """An emulated kernel wrote outside one of its buffers."""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def emulator_available() -> bool:
    """True when a C++20 compiler (``$CXX``, g++ or clang++) is on this machine."""
    return _compiler() is not None


def _cache_dir() -> Path:
    """The folder of built libraries: ``$LESSONS_EMULATOR_CACHE``, else one per user in the temp dir."""
    path = os.environ.get("LESSONS_EMULATOR_CACHE")
    if not path:
        path = Path(tempfile.gettempdir()) / f"lessons-gpu-emulator-{os.getuid() if hasattr(os, 'getuid') else 0}"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wrapper(build: KernelBuild) -> str:
    """C wrappers ``emulate_<entry>(gx, gy, gz, bx, params...)`` around each entry point."""
    c_type = {"pointer": "void*", "int": "int", "float": "float", "tensormap": "const void*"}
    lines = []
    for entry in build.entries:
        params = kernel_signature(build.kernel, entry)
        decl = ", ".join(f"{c_type[k]} {n}" for k, n in params)
        # pass each void* to the kernel's own pointer type through the function pointer's type
        # (a tensor map arrives as the address of its 128 bytes and is passed on by value)
        args = ", ".join(f"*(const TmaDescriptor*){n}" if k == "tensormap" else n for k, n in params)
        lines.append(
            f'extern "C" int emulate_{entry}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, {decl}) {{\n'
            f"    return emulate_launch_void(({entry}), dim3{{gx, gy, gz}}, dim3{{bx, 1, 1}}, {args});\n"
            f"}}")
    helper = (
        "template <typename... P, typename... A>\n"
        "int emulate_launch_void(void (*k)(P...), dim3 g, dim3 b, A... a) {\n"
        "    return emulate_launch(k, g, b, ((P)a)...);\n"
        "}\n")
    return helper + "\n".join(lines) + "\n"


#: one emulated launch at a time per process: a library's shared memory and launch geometry are
#: globals, and g++ makes inline variables (blockDim, gridDim) unique across every library loaded
_LAUNCH_LOCK = threading.Lock()


@lru_cache(maxsize=64)
def _library(build: KernelBuild) -> ctypes.CDLL:
    cxx = _compiler()
    if cxx is None:
        raise EmulatorError("no C++ compiler found for the CPU emulation (install g++)")
    source = kernel_source(build.kernel) + "\n" + _wrapper(build)
    flags = ["-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w",
             "-include", str(KERNEL_DIR / "cpu_emulation.h"), *build.options]
    header = (KERNEL_DIR / "cpu_emulation.h").read_text()
    key = hashlib.sha256("\0".join([cxx, source, header, *flags]).encode()).hexdigest()[:20]
    lib = _cache_dir() / f"{build.kernel}-{key}.so"
    with one_at_a_time(lib):            # a process building the same library now: wait for it
        if not lib.exists():
            with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
                src = Path(tmp) / f"{build.kernel}.cpp"
                src.write_text(source)
                out = Path(tmp) / "kernel.so"
                proc = subprocess.run([cxx, *flags, str(src), "-o", str(out)], capture_output=True, text=True,
                                      timeout=600)
                if proc.returncode:
                    raise EmulatorError(f"{cxx} could not compile {build.describe()} for the CPU emulation:\n"
                                        f"{proc.stderr[-4000:]}")
                os.replace(out, lib)        # atomic: a process that does not lock never sees half a file
    return ctypes.CDLL(str(lib))


class EmulatedModule:
    """The entry points of one :class:`KernelBuild`, compiled for the CPU emulation.

    ``launch(entry, grid, block, args)`` runs ``entry<<<grid, block>>>(*args)``: ``grid`` a
    1-3 tuple, ``block`` a 1-tuple (a multiple of 32 threads), ``args`` NumPy arrays for
    pointers (C-contiguous; outputs are written in place), Python numbers for scalars, and for
    a tensor map the 16 uint64 words of :func:`lessons.gpu.hopper.emulated_tensor_map`.
    """

    def __init__(self, build: KernelBuild):
        self.build = build
        self.lib = _library(build)

    def launch(self, entry: str, grid, block, args) -> None:
        """Run one launch. Raises EmulatorError on a failed launch, EmulatorMemoryError when a
        buffer's guard zone was overwritten, TypeError/ValueError for mismatched arguments, ValueError naming
        ``LESSONS_EMULATOR_CP_ASYNC`` for a value other than ``wait`` or ``issue``."""
        when = os.environ.get("LESSONS_EMULATOR_CP_ASYNC", "wait")
        if when not in ("wait", "issue", ""):
            raise ValueError(f"LESSONS_EMULATOR_CP_ASYNC must be 'wait' (a cp.async copy lands at the wait that "
                             f"covers it, the default) or 'issue' (it lands as it is issued), got {when!r}")
        params = kernel_signature(self.build.kernel, entry)
        if len(args) != len(params):
            raise ValueError(f"{entry} takes {len(params)} arguments, got {len(args)}")
        grid = tuple(grid) + (1,) * (3 - len(grid))
        fn = getattr(self.lib, f"emulate_{entry}")
        c_args, guarded = [], []
        for (kind, name), value in zip(params, args):
            if kind == "pointer":
                if not isinstance(value, np.ndarray):
                    raise TypeError(f"{entry}: argument {name} must be a NumPy array, got {type(value).__name__}")
                if not value.flags.c_contiguous:
                    raise ValueError(f"{entry}: argument {name} must be C-contiguous")
                guard = -(-max(GUARD_BYTES, value.nbytes) // 64) * 64   # keeps 16-byte vector loads aligned
                raw = np.full(value.nbytes + 2 * guard, 0xFF, dtype=np.uint8)
                raw[guard:guard + value.nbytes] = value.reshape(-1).view(np.uint8)
                guarded.append((name, value, raw, guard))
                c_args.append(ctypes.c_void_p(raw.ctypes.data + guard))
            elif kind == "tensormap":
                if not (isinstance(value, np.ndarray) and value.dtype == np.uint64 and value.shape == (16,)):
                    raise TypeError(f"{entry}: argument {name} must be an emulated tensor map (16 uint64 words)")
                c_args.append(ctypes.c_void_p(value.ctypes.data))
            elif kind == "int":
                c_args.append(ctypes.c_int(int(value)))
            else:
                c_args.append(ctypes.c_float(float(value)))
        fn.restype = ctypes.c_int
        with _LAUNCH_LOCK:
            status = fn(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), ctypes.c_uint(grid[2]),
                        ctypes.c_uint(block[0]), *c_args)
        if status:
            reason = {1: "a barrier (__syncthreads/__syncwarp/shuffle/a named bar.sync) was not reached by every thread, "
                         "or threads waited on mbarriers that could never complete",
                      3: f"block {block} is not a multiple of 32 threads up to 1024",
                      5: "a wgmma read shared memory that changed before the wait_group covering it "
                         "(a stage released or refilled while a product still read it)"}.get(status, "an exception")
            raise EmulatorError(f"emulated launch of {entry} failed: {reason}")
        for name, value, raw, guard in guarded:
            if not (np.all(raw[:guard] == 0xFF) and np.all(raw[guard + value.nbytes:] == 0xFF)):
                raise EmulatorMemoryError(f"{entry} wrote outside argument {name} (shape {value.shape})")
            inside = raw[guard:guard + value.nbytes]
            if not value.flags.writeable:            # an input the caller cannot write: it must be unchanged
                if not np.array_equal(inside, value.reshape(-1).view(np.uint8)):
                    raise EmulatorMemoryError(f"{entry} wrote into argument {name}, a read-only array")
                continue
            value.reshape(-1).view(np.uint8)[:] = inside

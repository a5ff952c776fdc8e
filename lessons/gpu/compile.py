"""Compile the kernels with NVRTC, with or without a GPU, and read their resource use.

NVRTC (the CUDA runtime compiler, pip package ``nvidia-cuda-nvrtc-cu12``, driven
through CuPy's ``cupy_backends.cuda.libs.nvrtc``) needs no GPU: it turns CUDA C into
PTX and, for a real architecture such as ``sm_90``, runs the PTX assembler (ptxas)
into a cubin. With ``--ptxas-options=-v`` the assembler reports, per kernel, the
registers per thread, the static shared memory per block, the stack frame and any
register spills: the numbers that decide how many blocks fit on a streaming
multiprocessor (occupancy). :func:`compile_report` collects them for every kernel.

If a standalone ``ptxas`` is at hand (pip ``nvidia-cuda-nvcc-cu12`` ships one, and a
CUDA toolkit has one), :func:`ptxas_resources` assembles NVRTC's PTX with it, a second
opinion on the same numbers.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from lessons.gpu.source import KernelBuild, default_builds, kernel_source

__all__ = [
    "ARCHS", "KernelCompileError", "KernelResources", "CompiledKernel", "nvrtc_available",
    "nvrtc_version", "compile_kernel", "compile_report", "compile_report_table", "device_available",
    "device_name", "gpu_status", "find_ptxas", "ptxas_resources", "parse_ptxas_log",
]

#: architectures compiled and reported without a GPU: A100 (sm_80) and H100/H200 (sm_90)
ARCHS = ("sm_80", "sm_90")


class KernelCompileError(RuntimeError):
    """NVRTC refused a kernel; the message holds the compiler log."""


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one kernel entry point compiled for one architecture.

    registers: registers per thread; smem_bytes: static shared memory per block (bytes);
    stack_bytes: local stack frame per thread (bytes); spill_store_bytes /
    spill_load_bytes: registers spilled to local memory (bytes, 0 is what we want);
    threads_per_block: the launch's block size; device_present: whether a CUDA device
    was visible when the report was made (the kernel was compiled, not necessarily run).
    """

    kernel: str
    entry: str
    arch: str
    dtype: str
    config: str
    registers: int
    smem_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    threads_per_block: int
    device_present: bool


@dataclass(frozen=True)
class CompiledKernel:
    """The result of :func:`compile_kernel`: the cubin (bytes), the NVRTC log (str), the options
    used, and :class:`KernelResources` per entry point (a dict entry name -> resources)."""

    build: KernelBuild
    arch: str
    options: tuple
    cubin: bytes
    log: str
    resources: dict = field(default_factory=dict)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as err:  # cupy not installed
        raise ImportError(
            "compiling the CUDA kernels needs CuPy and NVRTC: pip install cupy-cuda12x "
            "nvidia-cuda-nvrtc-cu12 (both are in this project's [test] extra)") from err
    return nvrtc


def nvrtc_available() -> bool:
    """True when CuPy and the NVRTC library can be loaded (no GPU needed)."""
    try:
        _nvrtc().getVersion()
        return True
    except Exception:
        return False


def nvrtc_version() -> tuple:
    """NVRTC's (major, minor) version. Raises ImportError without CuPy/NVRTC."""
    return tuple(_nvrtc().getVersion())


def _check_arch(arch: str) -> str:
    if not isinstance(arch, str) or not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise ValueError(f"arch must look like 'sm_80' or 'sm_90', got {arch!r}")
    return arch


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")


def parse_ptxas_log(log: str) -> dict:
    """Parse ``ptxas -v`` output into ``{entry: dict(registers, smem_bytes, stack_bytes,
    spill_store_bytes, spill_load_bytes)}``; values are ints (0 when ptxas omits them).
    Raises ValueError if the log names an entry without a "Used N registers" line."""
    out = {}
    chunks = _ENTRY.split(log)
    # chunks = [preamble, name1, arch1, text1, name2, arch2, text2, ...]
    for i in range(1, len(chunks) - 2, 3):
        name, text = chunks[i], chunks[i + 2]

        def grab(pattern):
            m = re.search(pattern, text)
            return int(m.group(1)) if m else 0

        if not re.search(r"Used (\d+) registers", text):
            raise ValueError(f"ptxas log has no register count for {name!r}:\n{text}")
        out[name] = dict(
            registers=grab(r"Used (\d+) registers"),
            smem_bytes=grab(r"(\d+) bytes smem"),
            stack_bytes=grab(r"(\d+) bytes stack frame"),
            spill_store_bytes=grab(r"(\d+) bytes spill stores"),
            spill_load_bytes=grab(r"(\d+) bytes spill loads"),
        )
    return out


def _compile(build: KernelBuild, arch_option: str, extra: tuple) -> tuple:
    nvrtc = _nvrtc()
    options = (arch_option, "--std=c++17", "-ftz=true") + build.options + extra   # -ftz: as CuPy compiles
    prog = nvrtc.createProgram(kernel_source(build.kernel), f"{build.kernel}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise KernelCompileError(
                f"NVRTC could not compile {build.describe()} ({arch_option}): {err}\n{log}") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        return prog, options, log
    except Exception:
        nvrtc.destroyProgram(prog)
        raise


@lru_cache(maxsize=256)
def compile_kernel(build: KernelBuild, arch: str = "sm_90") -> CompiledKernel:
    """Compile one :class:`KernelBuild` to a cubin for ``arch`` with NVRTC; no GPU needed.

    Returns a :class:`CompiledKernel` whose ``resources`` maps each entry point to its
    :class:`KernelResources` (registers/thread, static shared memory bytes/block, ...).
    Raises KernelCompileError with the compiler log if the source does not compile,
    ImportError without CuPy/NVRTC, ValueError for a malformed ``arch``.
    Results are cached per (build, arch).
    """
    arch = _check_arch(arch)
    nvrtc = _nvrtc()
    prog, options, log = _compile(build, f"-arch={arch}", ("--ptxas-options=-v",))
    try:
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    present = device_available()
    parsed = parse_ptxas_log(log)
    resources = {}
    for entry in build.entries:
        if entry not in parsed:
            raise KernelCompileError(f"{entry} missing from the ptxas report of {build.describe()}:\n{log}")
        resources[entry] = KernelResources(
            kernel=build.kernel, entry=entry, arch=arch, dtype=build.dtype,
            config=" ".join(f"{k}={v}" for k, v in build.defines) + (" FA_TRACE" if build.trace else ""),
            threads_per_block=build.threads_per_block, device_present=present, **parsed[entry])
    return CompiledKernel(build=build, arch=arch, options=options, cubin=bytes(cubin), log=log,
                          resources=resources)


def compile_ptx(build: KernelBuild, arch: str = "sm_90") -> str:
    """PTX text of ``build`` for the virtual architecture of ``arch`` (``compute_90`` for ``sm_90``)."""
    arch = _check_arch(arch)
    nvrtc = _nvrtc()
    prog, _, _ = _compile(build, "-arch=" + arch.replace("sm_", "compute_"), ())
    try:
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def compile_report(archs=ARCHS, *, head_dim: int = 128, dtype: str = "float16",
                   trace: bool = False, builds=None) -> list:
    """Compile every kernel for every architecture and report its resources.

    Parameters
    ----------
    archs : architectures, default ``("sm_80", "sm_90")``.
    head_dim, dtype, trace : the configuration of the default builds
        (:func:`lessons.gpu.source.default_builds`); ignored when ``builds`` is given.
    builds : optional list of :class:`KernelBuild` to report instead.

    Returns a list of :class:`KernelResources`, one per (entry point, arch), with
    registers/thread, static shared memory bytes/block, spills, and whether a device exists.
    Raises KernelCompileError on any compile error, ImportError without CuPy/NVRTC.
    """
    builds = default_builds(head_dim, dtype, trace) if builds is None else list(builds)
    rows = []
    for build in builds:
        for arch in archs:
            compiled = compile_kernel(build, arch)
            rows.extend(compiled.resources[e] for e in build.entries)
    return rows


def compile_report_table(rows=None):
    """A :class:`rich.table.Table` of a :func:`compile_report` (made if ``rows`` is None)."""
    from rich.table import Table

    rows = compile_report() if rows is None else rows
    table = Table(title="CUDA kernels compiled with NVRTC (ptxas -v)")
    for col in ("kernel", "arch", "dtype", "config", "registers/thread", "smem bytes/block",
                "spills (bytes)", "device"):
        table.add_column(col, justify="right" if col[0] in "rs" else "left")
    for r in rows:
        table.add_row(r.entry, r.arch, r.dtype, r.config, str(r.registers), str(r.smem_bytes),
                      str(r.spill_store_bytes + r.spill_load_bytes), "yes" if r.device_present else "no")
    return table


@lru_cache(maxsize=1)
def device_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def device_name() -> str | None:
    """Name and architecture of CUDA device 0, e.g. ``'NVIDIA H200 (sm_90)'``; None without one."""
    if not device_available():
        return None
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} (sm_{props['major']}{props['minor']})"


@lru_cache(maxsize=1)
def gpu_status() -> str:
    """One plain sentence on what happened to the CUDA kernels on this machine.

    For example ``"CUDA kernels compiled for sm_80/sm_90 with NVRTC, but not run: no CUDA
    device"``, or ``"... compiled with NVRTC and run on NVIDIA H200 (sm_90)"``, or why
    they could not be compiled. Compiles the default builds once (a few seconds), then caches.
    """
    try:
        version = ".".join(map(str, nvrtc_version()))
    except ImportError:
        return ("CUDA kernels not compiled: CuPy/NVRTC are not installed "
                "(pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12); the NumPy reference still runs")
    except Exception as err:
        return f"CUDA kernels not compiled: NVRTC could not be loaded ({type(err).__name__}: {err})"
    try:
        compile_report(ARCHS)
    except KernelCompileError as err:
        return f"CUDA kernels failed to compile with NVRTC {version}: {str(err).splitlines()[0]}"
    archs = "/".join(ARCHS)
    if device_available():
        return f"CUDA kernels compiled for {archs} with NVRTC {version} and run on {device_name()}"
    return f"CUDA kernels compiled for {archs} with NVRTC {version}, but not run: no CUDA device"


def find_ptxas() -> str | None:
    """Path of a standalone ``ptxas``: pip ``nvidia-cuda-nvcc-cu12`` first, then PATH,
    then ``$CUDA_HOME/bin``; None if there is none."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except (ImportError, ValueError):
        spec = None
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "bin" / "ptxas" for p in spec.submodule_search_locations]
    which = shutil.which("ptxas")
    if which:
        candidates.append(Path(which))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / "ptxas")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def ptxas_resources(build: KernelBuild, arch: str = "sm_90", ptxas: str | None = None) -> dict:
    """Assemble the NVRTC PTX of ``build`` with a standalone ``ptxas -v`` and parse its report.

    Returns ``{entry: dict(registers, smem_bytes, ...)}`` like :func:`parse_ptxas_log`.
    Raises FileNotFoundError when no ptxas is found, RuntimeError when ptxas fails.
    """
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        raise FileNotFoundError("no ptxas found (pip install nvidia-cuda-nvcc-cu12, or a CUDA toolkit)")
    ptx = compile_ptx(build, arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"-arch={arch}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                              capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed on {build.describe()} ({arch}):\n{proc.stderr}")
    return parse_ptxas_log(proc.stdout + proc.stderr)

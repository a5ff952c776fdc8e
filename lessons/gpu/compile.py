"""Compile the kernels with NVRTC, with or without a GPU, and read their resource use.

NVRTC (the CUDA runtime compiler, pip package ``nvidia-cuda-nvrtc-cu12``, driven
through CuPy's ``cupy_backends.cuda.libs.nvrtc``) needs no GPU: it turns CUDA C into
PTX and, for a real architecture such as ``sm_90``, runs the PTX assembler (ptxas)
into a cubin. Per kernel, three numbers decide how many blocks fit on a streaming
multiprocessor (occupancy): registers per thread, static shared memory per block, and
local memory per thread (the stack frame, where spilled registers go). They are read,
in this order of preference:

1. with a CUDA device, for the device's own architecture: from the kernel loaded on it
   (CuPy ``RawKernel.attributes``, i.e. ``cuFuncGetAttribute``: ``num_regs``,
   ``shared_size_bytes``, ``local_size_bytes``);
2. from the report ptxas writes into NVRTC's log (``--ptxas-options=-v``);
3. from a standalone ``ptxas -v`` on NVRTC's PTX (pip ``nvidia-cuda-nvcc-cu12`` ships one,
   and a CUDA toolkit has one);
4. otherwise the numbers are ``None`` with a sentence saying why ("not reported" in tables).

A missing report never means a failed compile: :class:`KernelCompileError` is raised only
when NVRTC refuses the source. NVRTC 12.9 and later keep a compile cache shared with the
driver's, and a cache hit returns the cubin without running ptxas, so without a report:
this module passes ``--no-cache`` to those versions (several processes compiling the same
kernels at once hit that cache), and falls back as above if a report is still missing.
Whether a device is present is a fact about the run, not about a compiled kernel: it is
never stored in the cached :class:`CompiledKernel`.

NVRTC takes seconds per kernel (a minute for the whole report), so what it produced (the cubin or
PTX, and its log with the ptxas report) is also kept on disk, in ``$LESSONS_NVRTC_CACHE`` (default
a per-user folder under the system temp dir; ``off`` keeps nothing), under a name that hashes the
source with its headers inlined, every option and the NVRTC that compiled it (version, and the wheel's
version or the library file): another process, or the same notebook run again, gets the same bytes
without compiling. Files are written whole in a temporary
file and renamed, so processes compiling at once never read half a file, and each carries a SHA-256
of its contents: a file cut short or altered is compiled again, never loaded. Errors are never kept,
nor a cubin whose log lacks ptxas's report for any of its entry points. The default folder is used
only when this user owns it and nobody else can write to it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import stat
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from lessons.gpu.cache_lock import one_at_a_time
from lessons.gpu.source import KernelBuild, default_builds, kernel_file, kernel_source

__all__ = [
    "ARCHS", "KernelCompileError", "KernelResources", "CompiledKernel", "nvrtc_available",
    "nvrtc_version", "compile_kernel", "compile_report", "compile_report_table", "device_available",
    "device_name", "device_arch", "device_module", "device_resources", "kernel_resources", "gpu_status",
    "find_ptxas", "find_cuda_tool", "package_folders", "ptxas_resources", "parse_ptxas_log", "NOT_REPORTED",
    "FROM_DEVICE", "FROM_NVRTC", "FROM_PTXAS",
]

#: architectures compiled and reported without a GPU: A100 (sm_80) and H100/H200 (sm_90)
ARCHS = ("sm_80", "sm_90")
#: where a :class:`KernelResources` row's numbers came from
FROM_DEVICE = "device"          # the loaded kernel: cuFuncGetAttribute (CuPy RawKernel.attributes)
FROM_NVRTC = "ptxas -v"         # ptxas's report in NVRTC's program log
FROM_PTXAS = "standalone ptxas"  # a standalone ptxas -v on NVRTC's PTX
#: how a missing number is shown in tables
NOT_REPORTED = "not reported"


class KernelCompileError(RuntimeError):
    """NVRTC refused a kernel; the message holds the compiler log."""


@dataclass(frozen=True)
class KernelResources:
    """Resource use of one kernel entry point compiled for one architecture.

    registers: registers per thread; smem_bytes: static shared memory per block (bytes);
    dynamic_smem_bytes: the dynamic shared memory a launch asks for on top (bytes; only the Hopper
    rungs and the lazy-rescaling FA-2 rung have any: :attr:`lessons.gpu.source.KernelBuild.dynamic_smem_bytes`);
    stack_bytes: local memory per thread (bytes; the stack frame, which holds any spills);
    spill_store_bytes / spill_load_bytes: registers spilled to local memory (bytes, 0 is
    what we want); threads_per_block: the launch's block size. ``source`` says where the
    numbers came from (:data:`FROM_DEVICE`, :data:`FROM_NVRTC`, :data:`FROM_PTXAS`).
    A number nobody reported is None, and ``reason`` says why (e.g. the device reports
    local memory but not how much of it is spills, so with ``stack_bytes > 0`` the spill
    fields from the device are None; with 0 local bytes there are no spills).
    """

    kernel: str
    entry: str
    arch: str
    dtype: str
    config: str
    registers: int | None
    smem_bytes: int | None
    stack_bytes: int | None
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    threads_per_block: int
    source: str | None = None
    reason: str | None = None
    dynamic_smem_bytes: int = 0

    @property
    def reported(self) -> bool:
        """True when registers and shared memory were reported (by ptxas or the device)."""
        return self.registers is not None and self.smem_bytes is not None

    @property
    def spill_bytes(self) -> int | None:
        """Spilled bytes per thread, stores + loads; None when not reported."""
        if self.spill_store_bytes is None or self.spill_load_bytes is None:
            return None
        return self.spill_store_bytes + self.spill_load_bytes


@dataclass(frozen=True)
class CompiledKernel:
    """The result of :func:`compile_kernel`: the cubin (bytes), the NVRTC log (str), the options
    used, and :class:`KernelResources` per entry point (a dict entry name -> resources) as ptxas
    reported them (NVRTC's log, else a standalone ptxas; fields None with a reason if neither).
    Nothing in it depends on whether a device is present: :func:`kernel_resources` adds that."""

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


@lru_cache(maxsize=1)
def _cache_options() -> tuple:
    """``--no-cache`` for NVRTC 12.9 and later: a hit in their compile cache skips ptxas, and its report."""
    return ("--no-cache",) if nvrtc_version() >= (12, 9) else ()


#: first bytes of a kept result; a file from another layout, or none of ours, is compiled again
_KEPT_MAGIC = b"LSNVRTC2"


@lru_cache(maxsize=1)
def _nvrtc_identity() -> str:
    """Which NVRTC compiles, for the disk cache's key: its (major, minor) version, the versions of the
    installed ``nvidia-cuda-nvrtc*`` wheels (12.9.41 and 12.9.86 both say (12, 9), and their ptxas
    may allocate registers differently) or, without such a wheel (a CUDA toolkit's NVRTC), the loaded
    library's path, size and modification time, where the process map shows it."""
    import importlib.metadata

    parts = [".".join(map(str, nvrtc_version()))]
    try:
        parts += sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                        if (d.metadata["Name"] or "").lower().startswith("nvidia-cuda-nvrtc"))
    except Exception:      # a broken installation's metadata only costs the key its detail
        pass
    if len(parts) > 1:
        return "|".join(parts)
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "libnvrtc" in line.split()[-1]})
        for lib in libs:
            info = os.stat(lib)
            parts.append(f"{lib}:{info.st_size}:{info.st_mtime_ns}")
    except OSError:
        pass
    return "|".join(parts)


def _disk_cache() -> Path | None:
    """The folder of NVRTC's kept results (``$LESSONS_NVRTC_CACHE``, else per user under the temp
    dir), or None when it is ``off`` or cannot be made. The per-user default lives in a shared temp
    dir, so it is used only when it is a folder this user owns and nobody else can write to (made
    with mode 0700): a folder another user made first is not trusted."""
    path = os.environ.get("LESSONS_NVRTC_CACHE", "").strip()
    if path.lower() == "off":          # "OFF" or "Off" too: never a folder of that name in the notebook's folder
        return None
    default = not path
    if default:
        uid = os.getuid() if hasattr(os, "getuid") else None
        path = Path(tempfile.gettempdir()) / f"lessons-gpu-nvrtc-{uid if uid is not None else 'user'}"
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat() if default else path.stat()
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return None
    if default and hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & 0o022):
        return None
    return path


def _read_kept(path: Path) -> tuple | None:
    """(output bytes, log) from a kept result; None when absent, cut short, altered or empty.

    A kept file is ``_KEPT_MAGIC``, the SHA-256 of its own name and the rest, the log's length (8 bytes,
    little endian), the log (UTF-8) and the output; any byte changed or missing fails the digest, and
    so does a whole file copied or renamed to another key's name."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_KEPT_MAGIC) + 32
    if len(data) < head + 8 or not data.startswith(_KEPT_MAGIC):
        return None
    body = data[head:]
    if hashlib.sha256(path.name.encode() + body).digest() != data[len(_KEPT_MAGIC):head]:
        return None
    (n,) = struct.unpack_from("<Q", body)
    if len(body) <= 8 + n:                # no output at all is never a result NVRTC gave
        return None
    try:
        log = body[8:8 + n].decode()
    except UnicodeDecodeError:
        return None
    return body[8 + n:], log


def _keep(path: Path, output: bytes, log: str) -> None:
    """Write (output, log) whole: a temporary file in the same folder, then one atomic rename.
    A failed write (full or read-only disk) leaves nothing behind and costs the next process a
    compile, never a wrong result."""
    raw = log.encode()
    body = struct.pack("<Q", len(raw)) + raw + output
    part = None
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".part") as f:
            part = f.name
            f.write(_KEPT_MAGIC + hashlib.sha256(path.name.encode() + body).digest() + body)
        os.replace(part, path)
    except OSError:
        if part is not None:
            try:
                os.unlink(part)
            except OSError:
                pass


def _reports_every_entry(build: KernelBuild, log: str) -> bool:
    """True when ptxas's report in ``log`` names every entry point of ``build`` with its registers."""
    try:
        parsed = parse_ptxas_log(log)
    except ValueError:
        return False
    return all(entry in parsed for entry in build.entries)


def _compile(build: KernelBuild, arch_option: str, extra: tuple, what: str) -> tuple:
    """(options, output bytes, log): ``what`` is ``"cubin"`` or ``"ptx"``; from the disk cache
    when this source was compiled so before, else by NVRTC. Raises KernelCompileError."""
    nvrtc = _nvrtc()
    # -ftz: as CuPy compiles
    options = (arch_option, "--std=c++17", "-ftz=true") + build.options + _cache_options() + extra
    source = kernel_source(build.kernel)
    folder = _disk_cache()
    if folder is None:
        return _nvrtc_compile(nvrtc, build, arch_option, options, source, what, None)
    key = hashlib.sha256("\0".join([what, _nvrtc_identity(), source, *options]).encode())
    kept = folder / f"{build.kernel}-{what}-{key.hexdigest()[:24]}"
    with one_at_a_time(kept):          # a process compiling the same source now: wait, then read its result
        hit = _read_kept(kept)
        if hit is not None:
            return options, hit[0], hit[1]
        return _nvrtc_compile(nvrtc, build, arch_option, options, source, what, kept)


def _nvrtc_compile(nvrtc, build, arch_option, options, source, what, kept) -> tuple:
    prog = nvrtc.createProgram(source, kernel_file(build.kernel), [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as err:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise KernelCompileError(
                f"NVRTC could not compile {build.describe()} ({arch_option}): {err}\n{log}") from None
        log = nvrtc.getProgramLog(prog).rstrip("\x00")
        output = nvrtc.getCUBIN(prog) if what == "cubin" else nvrtc.getPTX(prog)
        output = output.encode() if isinstance(output, str) else bytes(output)
    finally:
        nvrtc.destroyProgram(prog)
    # a cubin is kept only with ptxas's full report: a log without it (a compile-cache hit, or
    # processes compiling at once) would make every later run read "not reported"
    if kept is not None and output and (what == "ptx" or _reports_every_entry(build, log)):
        _keep(kept, output, log)
    return options, output, log


def _config(build: KernelBuild) -> str:
    return " ".join(f"{k}={v}" for k, v in build.defines) + (" FA_TRACE" if build.trace else "")


def _row(build: KernelBuild, entry: str, arch: str, numbers: dict | None, source: str | None,
         reason: str | None = None) -> KernelResources:
    numbers = numbers or {}
    return KernelResources(
        kernel=build.kernel, entry=entry, arch=arch, dtype=build.dtype, config=_config(build),
        registers=numbers.get("registers"), smem_bytes=numbers.get("smem_bytes"),
        stack_bytes=numbers.get("stack_bytes"), spill_store_bytes=numbers.get("spill_store_bytes"),
        spill_load_bytes=numbers.get("spill_load_bytes"), threads_per_block=build.threads_per_block,
        source=source if numbers else None, reason=None if numbers else reason,
        dynamic_smem_bytes=build.entry_dynamic_smem_bytes(entry))


@lru_cache(maxsize=64)
def _standalone_report(build: KernelBuild, arch: str) -> tuple:
    """(parsed report or None, reason) from a standalone ptxas; never raises."""
    ptxas = find_ptxas()
    if ptxas is None:
        return None, "no standalone ptxas was found (pip install nvidia-cuda-nvcc-cu12, or a CUDA toolkit)"
    try:
        return ptxas_resources(build, arch, ptxas), None
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError, KernelCompileError) as err:
        return None, f"the standalone ptxas failed ({type(err).__name__}: {str(err).splitlines()[0]})"


@lru_cache(maxsize=256)
def compile_kernel(build: KernelBuild, arch: str = "sm_90") -> CompiledKernel:
    """Compile one :class:`KernelBuild` to a cubin for ``arch`` with NVRTC; no GPU needed.

    Returns a :class:`CompiledKernel` whose ``resources`` maps each entry point to its
    :class:`KernelResources` as ptxas reported them (registers/thread, static shared memory
    bytes/block, ...): from NVRTC's log, else from a standalone ptxas, else None with a reason.
    Raises KernelCompileError with the compiler log only if NVRTC refuses the source (a
    missing resource report is not an error), ImportError without CuPy/NVRTC, ValueError for
    a malformed ``arch``. Results are cached per (build, arch); nothing in them depends on
    whether a CUDA device is present.
    """
    arch = _check_arch(arch)
    options, cubin, log = _compile(build, f"-arch={arch}", ("--ptxas-options=-v",), "cubin")
    try:
        parsed, why = parse_ptxas_log(log), None
    except ValueError as err:
        parsed, why = {}, str(err).splitlines()[0]
    resources = {}
    for entry in build.entries:
        if entry in parsed:
            resources[entry] = _row(build, entry, arch, parsed[entry], FROM_NVRTC)
            continue
        standalone, reason = _standalone_report(build, arch)
        if standalone is not None and entry in standalone:
            resources[entry] = _row(build, entry, arch, standalone[entry], FROM_PTXAS)
            continue
        reason = reason or f"the standalone ptxas did not report {entry}"
        missing = why or f"NVRTC's log held no ptxas report for {entry}"
        resources[entry] = _row(build, entry, arch, None, None, f"{missing}, and {reason}")
    return CompiledKernel(build=build, arch=arch, options=options, cubin=bytes(cubin), log=log,
                          resources=resources)


def compile_ptx(build: KernelBuild, arch: str | None = None) -> str:
    """PTX text of ``build`` for the virtual architecture of ``arch`` (``compute_90`` for ``sm_90``).
    ``arch`` None: the build's own (``build.arch``, e.g. ``sm_90a`` for the Hopper rung), else sm_90.
    ValueError for a malformed ``arch``, or one other than the build's own for a build made for one."""
    if arch is None:
        arch = build.arch or "sm_90"
    arch = _check_arch(arch)
    if build.arch is not None and arch != build.arch:
        raise ValueError(f"arch: {build.kernel} compiles for {build.arch} only, got {arch!r}")
    _, ptx, _ = _compile(build, "-arch=" + arch.replace("sm_", "compute_"), (), "ptx")
    return ptx.decode()


def entry_ptx(ptx: str, entry: str) -> str:
    """The part of PTX text ``ptx`` (:func:`compile_ptx`) that is entry point ``entry``: from its
    ``.entry`` line to the next entry's (or the end), so that instructions can be counted per
    kernel in a file with several. ValueError naming the entry when the PTX has no such entry."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^\.(?:visible\s+)?\.entry\s+(\w+)", ptx, re.M)]
    for i, (start, name) in enumerate(starts):
        if name == entry:
            return ptx[start:starts[i + 1][0] if i + 1 < len(starts) else len(ptx)]
    raise ValueError(f"entry must be one of {[n for _, n in starts]}, got {entry!r}")


# ---------------------------------------------------------------------------
# the device, when there is one
# ---------------------------------------------------------------------------

@lru_cache(maxsize=1)
def device_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device (never raises)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _device_properties() -> dict:
    import cupy

    return _properties_of(cupy.cuda.Device().id)


@lru_cache(maxsize=None)
def _properties_of(device_id: int) -> dict:
    # cudaGetDeviceProperties fills every field and can take a millisecond: a launcher that
    # asked on every call would add that to every kernel's time. A device's properties never
    # change while a process runs, so each device is asked once.
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)


def device_name() -> str | None:
    """Name and architecture of the current CUDA device, e.g. ``'NVIDIA H200 (sm_90)'``; None without one."""
    if not device_available():
        return None
    props = _device_properties()
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return f"{name} (sm_{props['major']}{props['minor']})"


def device_arch() -> str | None:
    """Architecture of the current CUDA device, e.g. ``'sm_90'``; None without one."""
    if not device_available():
        return None
    props = _device_properties()
    return f"sm_{props['major']}{props['minor']}"


@lru_cache(maxsize=64)
def device_module(build: KernelBuild):
    """``build`` as a ``cupy.RawModule``, compiled by CuPy for the current device and cached
    (CuPy keeps its own cache of cubins per device). A build for one architecture only
    (``build.arch``, e.g. the Hopper rung's ``sm_90a``, which CuPy cannot ask NVRTC for) is
    compiled by :func:`compile_kernel` and its cubin loaded. Raises ImportError without CuPy;
    CuPy's errors without a device."""
    import cupy

    if build.arch is not None:
        return _arch_module(build)
    return cupy.RawModule(code=kernel_source(build.kernel), options=("--std=c++17", "-lineinfo") + build.options)


def elf_whole(image: bytes) -> bytes:
    """A 64-bit ELF image (a cubin) padded with zero bytes to the end of its section and program header
    tables, where shorter. CuPy's ``nvrtc.getCUBIN`` returns NVRTC's cubin without its last byte (it
    strips a string's NUL): here a zero, the high byte of the last section header's 8-byte entry size.
    Other bytes are returned as they are. TypeError for anything but bytes/bytearray; ValueError for bytes
    that are not a 64-bit little-endian ELF, or whose headers say the file ends more than 8 bytes past
    what it holds (not a cubin CuPy shortened: a damaged one)."""
    if not isinstance(image, (bytes, bytearray)):
        raise TypeError(f"image must be bytes (a cubin), got {type(image).__name__}")
    image = bytes(image)
    if image[:4] != b"\x7fELF" or image[4:6] != b"\x02\x01" or len(image) < 64:
        raise ValueError("image must be a 64-bit little-endian ELF file (a cubin)")
    phoff, shoff = int.from_bytes(image[0x20:0x28], "little"), int.from_bytes(image[0x28:0x30], "little")
    phentsize, phnum = int.from_bytes(image[0x36:0x38], "little"), int.from_bytes(image[0x38:0x3A], "little")
    shentsize, shnum = int.from_bytes(image[0x3A:0x3C], "little"), int.from_bytes(image[0x3C:0x3E], "little")
    end = max(phoff + phentsize * phnum if phnum else 0, shoff + shentsize * shnum if shnum else 0)
    if end > len(image) + 8:
        raise ValueError(f"image's headers say it ends at byte {end}, {end - len(image)} past the {len(image)} "
                         f"it holds: a damaged cubin, not one shortened by CuPy")
    return image + b"\0" * (end - len(image)) if end > len(image) else image


@lru_cache(maxsize=32)
def _arch_module(build: KernelBuild):
    import cupy

    cubin = elf_whole(compile_kernel(build, build.arch).cubin)
    folder = Path(tempfile.gettempdir()) / f"lessons-cubins-{os.getuid() if hasattr(os, 'getuid') else 0}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{build.kernel}-{hashlib.sha256(cubin).hexdigest()[:20]}.cubin"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)                         # atomic: another process never reads half a file
    return cupy.RawModule(path=str(path))


def device_resources(build: KernelBuild, entry: str) -> dict:
    """Resource use of ``entry`` as loaded on the current device: CuPy ``RawKernel.attributes``
    (``cuFuncGetAttribute``): ``num_regs`` -> registers, ``shared_size_bytes`` -> smem_bytes,
    ``local_size_bytes`` -> stack_bytes (local memory per thread). The device does not say
    how much of local memory is spills: the spill fields are 0 when there is no local memory,
    else None; an attribute the CUDA version lacks (CuPy: -1) is None. Returns a dict of
    ints/None. Raises whatever CuPy raises without a device."""
    attributes = device_module(build).get_function(entry).attributes

    def known(key):                      # CuPy gives -1 for an attribute this CUDA version lacks
        value = int(attributes.get(key, -1))
        return value if value >= 0 else None

    local = known("local_size_bytes")
    spills = 0 if local == 0 else None
    return dict(registers=known("num_regs"), smem_bytes=known("shared_size_bytes"),
                stack_bytes=local, spill_store_bytes=spills, spill_load_bytes=spills)


def kernel_resources(build: KernelBuild, arch: str, use_device: bool | None = None) -> dict:
    """Resource use of each entry point of ``build`` compiled for ``arch``: entry -> :class:`KernelResources`.

    With a device (``use_device`` None: if there is one; False: never) whose architecture is
    ``arch``, the numbers are read from the kernel loaded on it (:func:`device_resources`);
    otherwise, or if that fails, they are ptxas's (:func:`compile_kernel`), or None with a reason.
    Raises KernelCompileError if NVRTC refuses the source, ImportError without CuPy/NVRTC.
    """
    compiled = compile_kernel(build, arch)
    rows = dict(compiled.resources)
    if use_device is False or not device_available() or device_arch() != arch:
        return rows
    for entry in build.entries:
        try:
            numbers = device_resources(build, entry)
        except Exception as err:  # a broken driver: keep ptxas's numbers, say why in the row
            numbers, why = None, f"{type(err).__name__}: {err}"
        else:
            why = "it lacks num_regs or shared_size_bytes"
        if numbers is None or numbers["registers"] is None or numbers["smem_bytes"] is None:
            if not rows[entry].reported:
                rows[entry] = replace(rows[entry], reason=f"{rows[entry].reason}; the device could not report "
                                                          f"either ({why})")
            continue
        rows[entry] = _row(build, entry, arch, numbers, FROM_DEVICE)
        if numbers["spill_store_bytes"] is None:
            rows[entry] = replace(rows[entry], reason="the device reports local memory per thread, not how much "
                                                      "of it is spills")
    return rows


def compile_report(archs=ARCHS, *, head_dim: int = 128, dtype: str = "float16",
                   trace: bool = False, builds=None, use_device: bool | None = None) -> list:
    """Compile every kernel for every architecture and report its resources.

    Parameters
    ----------
    archs : architectures, default ``("sm_80", "sm_90")``.
    head_dim, dtype, trace : the configuration of the default builds
        (:func:`lessons.gpu.source.default_builds`); ignored when ``builds`` is given.
    builds : optional list of :class:`KernelBuild` to report instead. A build made for one
        architecture only (``build.arch``: the Hopper rung, ``sm_90a``) is reported for that one.
    use_device : None = read the device's own architecture from the loaded kernel when there
        is a device; False = ptxas only (see :func:`kernel_resources`).

    Returns a list of :class:`KernelResources`, one per (entry point, arch), with
    registers/thread, static shared memory bytes/block, local memory and spills, and where
    the numbers came from (``source``; None and a ``reason`` when nobody reported them).
    Raises KernelCompileError on a compile error (never for a missing report), ImportError
    without CuPy/NVRTC.
    """
    builds = default_builds(head_dim, dtype, trace) if builds is None else list(builds)
    rows = []
    for build in builds:
        for arch in ([build.arch] if build.arch else archs):   # (a build for one architecture: that one only)
            resources = kernel_resources(build, arch, use_device)
            rows.extend(resources[e] for e in build.entries)
    return rows


def _number(value, fmt: str = "{}") -> str:
    return NOT_REPORTED if value is None else fmt.format(value)


def _smem(r) -> str:
    """Static shared memory, and the dynamic a launch adds where there is any: ``'0 + 83,008 dynamic'``."""
    static = _number(r.smem_bytes, "{:,}")
    return f"{static} + {r.dynamic_smem_bytes:,} dynamic" if r.dynamic_smem_bytes else static


def compile_report_table(rows=None):
    """A :class:`rich.table.Table` of a :func:`compile_report` (made if ``rows`` is None).

    Numbers nobody reported read "not reported"; the caption gives the reasons."""
    from rich.table import Table

    rows = compile_report() if rows is None else rows
    table = Table(title="CUDA kernels compiled with NVRTC: resources per kernel")
    for col in ("kernel", "arch", "dtype", "config", "registers/thread", "smem bytes/block",
                "local bytes/thread", "spills (bytes)", "from"):
        table.add_column(col, justify="right" if col[0] in "rsl" else "left")
    for r in rows:
        table.add_row(r.entry, r.arch, r.dtype, r.config, _number(r.registers), _smem(r),
                      _number(r.stack_bytes), _number(r.spill_bytes), r.source or NOT_REPORTED)
    reasons = sorted({f"{r.entry} ({r.arch}): {r.reason}" for r in rows if r.reason})
    if reasons:
        table.caption = "\n".join(reasons)
    return table


def resources_text(resources) -> str:
    """A text table of :class:`~lessons.gpu.compile.KernelResources` (``""`` for none): entry point, arch,
    dtype, constants, threads per block, registers per thread, static shared memory per block (bytes),
    spilled bytes per thread; "not reported" where neither the device nor ptxas gave the number."""
    head = ("kernel", "arch", "dtype", "config", "threads", "registers", "smem bytes", "spills")
    body = [(r.entry, r.arch, r.dtype, r.config, str(r.threads_per_block), _number(r.registers),
             _smem(r), _number(r.spill_bytes)) for r in resources]
    if not body:
        return ""
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
                     .rstrip() for cells in [head, *body])


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
        compile_report(ARCHS, use_device=False)
    except KernelCompileError as err:
        return f"CUDA kernels failed to compile with NVRTC {version}: {str(err).splitlines()[0]}"
    archs = "/".join(ARCHS)
    if device_available():
        return f"CUDA kernels compiled for {archs} with NVRTC {version} and run on {device_name()}"
    return f"CUDA kernels compiled for {archs} with NVRTC {version}, but not run: no CUDA device"


def package_folders(name: str) -> list:
    """The folders of an installed (namespace) package such as ``"nvidia.cuda_nvcc"`` as Paths; [] when it
    is not installed."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_cuda_tool(name: str, wheel_bins=()) -> str | None:
    """Path of the executable CUDA tool ``name`` (``"ptxas"``, ``"nvdisasm"``): in the folders ``wheel_bins``
    first (where pip's NVIDIA wheels put it), then on PATH, then in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``
    and ``/usr/local/cuda/bin``; None if there is none."""
    candidates = [Path(folder) / name for folder in wheel_bins]
    which = shutil.which(name)
    if which:
        candidates.append(Path(which))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / name)
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def find_ptxas() -> str | None:
    """Path of a standalone ``ptxas``: pip ``nvidia-cuda-nvcc-cu12`` first, then PATH,
    then ``$CUDA_HOME/bin``; None if there is none."""
    return find_cuda_tool("ptxas", [folder / "bin" for folder in package_folders("nvidia.cuda_nvcc")])


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

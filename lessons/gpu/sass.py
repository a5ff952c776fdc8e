"""SASS: the instructions an SM really issues, read from a rung's cubin without a GPU.

PTX is what NVRTC writes; ptxas turns it into SASS, the GPU's own instruction set, and only SASS says
what each warp issues. ptxas may merge loads the PTX issued apart (two 4-byte loads of neighbouring
keys become one 8-byte ``LDS.64``), or unroll a loop further. ``nvdisasm`` (pip
``nvidia-cuda-nvdisasm``) prints a cubin's SASS; this module reads it.

**The issue-slot ceiling.** Each of an SM's four sub-partitions has one warp scheduler, which issues
one warp instruction per clock, and 32 FP32 lanes, which finish one warp ``FFMA`` per clock (NVIDIA
H100 white paper, "H100 SM architecture"). So a loop whose instructions are a fraction ``s`` FFMA keeps
the FP32 lanes busy at most ``s`` of the time: it runs at most at ``s`` times the peak FP32 rate, however
well everything else goes. A key tile of a CUDA-core rung does the same number of FMAs in S = Q K^T as in
P V (``block_q x block_k x d`` each), so the tile's ceiling uses the two loops' shares combined as
``2 / (1 / s_S + 1 / s_PV)``. The softmax between the products, the copies into shared memory and the
barriers are not in these loops: they only lower the rate further. The ceiling says what a rung *cannot*
reach, not what it will.

The SASS here is what the installed NVRTC's ptxas makes for ``sm_90`` (12.9 in the course's
environment); another CUDA version may schedule the same PTX differently.
"""
from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from lessons.core.checks import check_int, check_int_sequence
from lessons.cost.traffic import H200

__all__ = ["NVDISASM_HINT", "CUDA_CORE_RUNGS", "find_nvdisasm", "nvdisasm_available", "tools_missing",
           "disassemble",
           "Instruction", "Loop", "parse_sass", "inner_loops", "fma_loops", "product_loops", "tile_share",
           "fma_loop_table", "fma_loop_markdown", "RUNG_OPCODES", "rung_opcodes"]

#: how to get nvdisasm, for the errors that need it
NVDISASM_HINT = "pip install nvidia-cuda-nvdisasm (or put a CUDA toolkit's nvdisasm on PATH)"
#: the rungs whose products run as FFMA on CUDA cores, in ladder order
CUDA_CORE_RUNGS = ("scalar", "regtile", "regtile_wide")


def find_nvdisasm() -> str | None:
    """Path of an executable ``nvdisasm``: a pip ``nvidia-cuda-nvdisasm`` wheel (``nvidia/*/bin``) first,
    then PATH, then ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``; None if there is none."""
    candidates = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidates += sorted(Path(folder).glob("*/bin/nvdisasm"))
    which = shutil.which("nvdisasm")
    if which:
        candidates.append(Path(which))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / "nvdisasm")
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def nvdisasm_available() -> bool:
    """True when :func:`find_nvdisasm` finds one."""
    return find_nvdisasm() is not None


def tools_missing() -> str | None:
    """None when SASS can be read here (CuPy/NVRTC to compile, nvdisasm to print), else a sentence saying
    what is missing and how to install it (what a notebook prints instead of a table)."""
    from lessons.gpu.compile import nvrtc_available

    missing = [what for what, here in (("CuPy/NVRTC (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12)",
                                        nvrtc_available()), (f"nvdisasm ({NVDISASM_HINT})", nvdisasm_available()))
               if not here]
    if not missing:
        return None
    return "the machine code is not read here: " + " and ".join(missing) + " not installed (make lab installs both)"


@lru_cache(maxsize=64)
def _disassemble_cubin(cubin: bytes, nvdisasm: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([nvdisasm, "--print-code", str(path)], capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"nvdisasm failed ({proc.returncode}):\n{proc.stderr.strip()}")
    return proc.stdout


def disassemble(build, arch: str = "sm_90", entry: str | None = None) -> str:
    """The SASS of one entry point of ``build`` (a :class:`lessons.gpu.source.KernelBuild`) compiled
    for ``arch`` by NVRTC, as ``nvdisasm --print-code`` prints it. ``entry``: default the build's first.
    Raises FileNotFoundError (saying how to install it) without nvdisasm, ImportError without CuPy/NVRTC,
    ValueError for an ``entry`` the build lacks (the message lists its entries), RuntimeError if
    nvdisasm fails."""
    from lessons.gpu.compile import compile_kernel, elf_whole

    entry = build.entries[0] if entry is None else entry
    if entry not in build.entries:
        raise ValueError(f"entry must be one of {list(build.entries)}, got {entry!r}")
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise FileNotFoundError(f"no nvdisasm found: {NVDISASM_HINT}")
    text = _disassemble_cubin(elf_whole(compile_kernel(build, arch).cubin), nvdisasm)
    parts = re.split(r"^//-+ \.text\.(\S+)\s+-+$", text, flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    if entry not in sections:
        raise RuntimeError(f"nvdisasm printed no code for {entry!r}; it printed {sorted(sections)}")
    return sections[entry]


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: offset (bytes from the entry point), opcode with its modifiers
    (``"LDS.128"``, ``"FFMA"``), predicate (``"@P0"``, ``"@!P1"`` or None) and the whole text."""

    offset: int
    opcode: str
    predicate: str | None
    text: str

    @property
    def base(self) -> str:
        """The opcode without modifiers: ``"LDS"`` for ``"LDS.128"``."""
        return self.opcode.split(".")[0]


_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(text: str) -> tuple[tuple[Instruction, ...], dict]:
    """``(instructions, labels)`` of one entry's SASS as :func:`disassemble` returns it: the instructions
    in address order and ``{label: index of the instruction it marks}``. TypeError for a ``text`` that is
    not a str; ValueError when it holds no instruction."""
    if not isinstance(text, str):
        raise TypeError(f"text must be SASS text (a str), got {type(text).__name__}")
    instructions, labels = [], {}
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        body, predicate = m.group(2), None
        if body.startswith("@"):
            predicate, body = body.split(None, 1)
        instructions.append(Instruction(int(m.group(1), 16), body.split()[0], predicate, body))
    if not instructions:
        raise ValueError("text holds no SASS instruction (lines like '/*0040*/  FFMA R1, R2, R3, R4 ;')")
    return tuple(instructions), labels


@dataclass(frozen=True)
class Loop:
    """An innermost loop of SASS: the instructions from a label to the branch that jumps back to it.

    ``instructions``: the body, in order, the branch last. ``counts``: how many of each base opcode;
    ``loads``: the shared-memory loads by width (``{"LDS.128": 8, "LDS": 2}``); ``ffma_share``: FFMA
    per issued instruction (the share of issue slots that do FP32 multiply-adds)."""

    instructions: tuple

    @property
    def size(self) -> int:
        return len(self.instructions)

    @property
    def counts(self) -> Counter:
        return Counter(i.base for i in self.instructions)

    @property
    def loads(self) -> dict:
        return dict(Counter(i.opcode for i in self.instructions if i.base == "LDS"))

    @property
    def ffma(self) -> int:
        return self.counts["FFMA"]

    @property
    def ffma_share(self) -> float:
        return self.ffma / self.size

    @property
    def shared_loads(self) -> int:
        return self.counts["LDS"]


def inner_loops(text: str) -> list[Loop]:
    """The innermost loops of one entry's SASS (:func:`parse_sass`), in address order: each backward
    branch (a ``BRA`` to a label at or before it) whose body holds no other backward branch. Errors as
    :func:`parse_sass`."""
    instructions, labels = parse_sass(text)
    spans = []
    for index, instruction in enumerate(instructions):
        target = _TARGET.search(instruction.text)
        if instruction.base == "BRA" and target and labels.get(target.group(1), index + 1) <= index:
            spans.append((labels[target.group(1)], index))
    inner = [(s, e) for s, e in spans if not any(s <= s2 and e2 < e for s2, e2 in spans)]
    return [Loop(instructions[s:e + 1]) for s, e in inner]


def fma_loops(rung, d: int = 64, arch: str = "sm_90") -> list[Loop]:
    """The innermost loops that hold FFMA in the forward entry of CUDA-core rung ``rung``
    (:data:`CUDA_CORE_RUNGS`, a name or a :class:`lessons.gpu.ladder.Rung`) at head dim ``d``, in
    address order. Where ptxas keeps both products as loops, the first is S = Q K^T and the last the
    P V of a tile whose V is finite; the register-tiled rungs have one more between them, the P V that
    guards 0 x inf for a tile whose V holds inf or NaN (:func:`product_loops` checks this). At a small
    ``d`` ptxas unrolls S = Q K^T (a loop over the head dim) whole, and the list starts with a P V.
    ValueError for a rung off that list or a ``d`` its kernel cannot take; the errors of
    :func:`disassemble` otherwise."""
    from lessons.gpu import ladder

    r = ladder._rung(rung)
    if r.name not in CUDA_CORE_RUNGS:
        raise ValueError(f"rung must be a CUDA-core rung, one of {list(CUDA_CORE_RUNGS)}, got {r.name!r}")
    d = check_int(d, "d", min=1)
    text = disassemble(ladder.rung_build(r, d), arch, ladder.rung_entry(r, d))
    return [loop for loop in inner_loops(text) if loop.ffma]


def product_loops(rung, d: int = 64, arch: str = "sm_90") -> tuple[Loop, Loop]:
    """``(s_loop, pv_loop)``: the S = Q K^T loop and the P V loop (finite V) of :func:`fma_loops`, told apart
    by what each product compares. S compares nothing; the scalar rung's P V skips a key whose p is 0 (an
    ``FSETP`` per key), so it has 2 FFMA loops, S then P V; the register-tiled rungs' guarded P V compares
    each p (``FSETP``) and the finite one does not, so they have 3, S, guarded P V, P V. ValueError (naming
    rung, ``d`` and arch, with each loop's FFMA and FSETP counts) when the loops are not so, e.g. at a
    small ``d`` where ptxas unrolls the S loop whole; the errors of :func:`fma_loops` otherwise."""
    from lessons.gpu import ladder

    name = ladder._rung(rung).name
    loops = fma_loops(rung, d, arch)
    compares = [loop.counts["FSETP"] > 0 for loop in loops]
    expected = [False, True] if name == "scalar" else [False, True, False]
    if compares != expected:
        found = ", ".join(f"{loop.ffma} FFMA / {loop.counts['FSETP']} FSETP" for loop in loops) or "none"
        which = "P V" if name == "scalar" else "guarded P V"
        raise ValueError(f"the FFMA loops of {name} at d={d} ({arch}) are not S = Q K^T then P V ({len(expected)} "
                         f"loops, FSETP only in the {which}); found {len(loops)}: {found}. ptxas unrolls a loop "
                         f"with few iterations whole (S runs over the head dim): take a larger d")
    return loops[0], loops[-1]


def tile_share(s_loop: Loop, pv_loop: Loop) -> float:
    """FFMA per issued instruction over a key tile's two products, when S = Q K^T runs ``s_loop`` and
    P V runs ``pv_loop`` for the same number of FMAs (``block_q x block_k x d`` each):
    ``2 / (1 / s_S + 1 / s_PV)``. TypeError for arguments that are not :class:`Loop`; ValueError for a
    loop without FFMA."""
    for name, loop in (("s_loop", s_loop), ("pv_loop", pv_loop)):
        if not isinstance(loop, Loop):
            raise TypeError(f"{name} must be a Loop, got {type(loop).__name__}")
        if not loop.ffma:
            raise ValueError(f"{name} holds no FFMA, so it is not a product loop")
    return 2 / (1 / s_loop.ffma_share + 1 / pv_loop.ffma_share)


def _check_peak_flops(peak_flops) -> float:
    """``peak_flops`` (FLOP/s) as a float: a positive finite real number (NumPy numbers too); ValueError
    naming it otherwise (bools and NaN included)."""
    if (isinstance(peak_flops, (bool, np.bool_)) or not isinstance(peak_flops, numbers.Real)
            or not (math.isfinite(peak_flops) and peak_flops > 0)):
        raise ValueError(f"peak_flops must be a positive finite number of FLOP/s, got {peak_flops!r}")
    return float(peak_flops)


def fma_loop_table(rungs=CUDA_CORE_RUNGS, ds=(64, 128), arch: str = "sm_90", peak_flops: float | None = None) -> list[dict]:
    """One dict per (rung, d): rung, d, and for the S loop and the P V loop (finite V) of
    :func:`product_loops`: ``s_instructions``, ``s_ffma``, ``s_loads`` (shared loads by width),
    ``pv_instructions``, ``pv_ffma``, ``pv_loads``; then ``share`` (:func:`tile_share`) and ``ceiling``
    (FLOP/s: ``share x peak_flops``; default the H200's FP32 peak, ``lessons.cost.traffic.H200``,
    67e12). ``rungs``: one rung (a name or a :class:`lessons.gpu.ladder.Rung`) or a sequence of them;
    ``ds``: a sequence of head dims. TypeError for ``rungs`` or ``ds`` of another kind; ValueError for
    none of them, a rung off :data:`CUDA_CORE_RUNGS`, a bad ``d`` (one where the loops cannot be told
    apart: :func:`product_loops`) or a ``peak_flops`` that is not a positive finite number; the errors
    of :func:`disassemble` otherwise."""
    from lessons.gpu import ladder

    peak = _check_peak_flops(H200.peak_flops["fp32"] if peak_flops is None else peak_flops)
    if isinstance(rungs, (str, ladder.Rung)):
        rungs = (rungs,)
    if isinstance(rungs, (bytes, dict, set, frozenset)) or not hasattr(rungs, "__iter__"):
        raise TypeError(f"rungs must be a rung, its name or a sequence of them, got {type(rungs).__name__} {rungs!r}")
    rungs = tuple(rungs)
    if not rungs:
        raise ValueError("rungs must hold at least one rung, got none")
    ds = check_int_sequence(ds, "ds", min=1)
    out = []
    for name in rungs:
        for d in ds:
            s_loop, pv_loop = product_loops(name, d, arch)
            share = tile_share(s_loop, pv_loop)
            out.append(dict(rung=ladder._rung(name).name, d=d,
                            s_instructions=s_loop.size, s_ffma=s_loop.ffma, s_loads=s_loop.loads,
                            pv_instructions=pv_loop.size, pv_ffma=pv_loop.ffma, pv_loads=pv_loop.loads,
                            share=share, ceiling=share * peak))
    return out


def _loads(loads: dict) -> str:
    """``{"LDS.128": 8, "LDS.64": 4}`` as ``"8 x 16 B + 4 x 8 B"`` (plain ``LDS`` reads 4 bytes)."""
    width = {"LDS": 4, "LDS.64": 8, "LDS.128": 16, "LDS.U8": 1, "LDS.U16": 2}
    parts = sorted(loads.items(), key=lambda kv: -width.get(kv[0], 0))
    return " + ".join(f"{count} x {width[op]} B" if op in width else f"{count} {op}" for op, count in parts)


def fma_loop_markdown(table=None) -> str:
    """A Markdown table of :func:`fma_loop_table` rows (default: the CUDA-core rungs at d = 64 and 128): per rung
    and head dim, each product loop's FFMA, instructions and shared loads (count x bytes), the share of issue
    slots that are FFMA over a tile, and the ceiling that puts on the rate (TFLOP/s). The errors of
    :func:`fma_loop_table`."""
    table = fma_loop_table() if table is None else table
    lines = ["| rung | d | S = Q K^T loop: FFMA / instructions | its shared loads | P V loop: FFMA / instructions | "
             "its shared loads | FFMA share of a tile's product slots | ceiling, TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        lines.append(f"| {row['rung']} | {row['d']} | {row['s_ffma']} / {row['s_instructions']} | {_loads(row['s_loads'])} | "
                     f"{row['pv_ffma']} / {row['pv_instructions']} | {_loads(row['pv_loads'])} | {row['share']:.0%} | "
                     f"{row['ceiling'] / 1e12:.1f} |")
    return "\n".join(lines)


#: the SASS instruction each rung's change becomes (an opcode, or the start of one: ``"HGMMA"`` matches
#: ``HGMMA.64x64x16.F32``), beside the PTX instruction :attr:`lessons.gpu.ladder.Rung.ptx_grep` names
RUNG_OPCODES = {
    "scalar": "FFMA.FTZ",                  # fma.rn.ftz.f32
    "regtile": "LDS.128",                  # ld.shared.v4.f32
    "regtile_wide": "LDS.128",
    "mma": "HMMA.16816.F32",               # mma.sync.aligned.m16n8k16 ... f32
    "mma_async": "LDSM.16.MT88.2",         # ldmatrix.sync.aligned.m8n8.x2.trans
    "mma_fa2": "LDSM.16.MT88.4",           # ldmatrix ... .x4.trans: V's fragments, 4 per instruction
    "mma_fa2_lazy": "VOTE.ANY",            # vote.sync.any.pred
    "mma_fa2_wide": "HMMA.16816.F32",
    "wgmma": "HGMMA",                      # wgmma.mma_async.sync.aligned
    "wgmma_overlap": "WARPGROUP.DEPBAR.LE",  # wgmma.wait_group.sync.aligned N
    "wgmma_pingpong": "BAR.ARV",           # bar.arrive
}


def rung_opcodes(d: int = 64, arch: str = "sm_90") -> list[dict]:
    """For each rung with a kernel of ours (ladder order), how often its forward entry at head dim ``d`` holds
    the SASS instruction of :data:`RUNG_OPCODES`: name, arch (the build's own where it has one: ``sm_90a`` for
    the Hopper rungs; else ``arch``), opcode, count (instructions whose opcode starts with it) and
    instructions (the entry's total). ValueError for a ``d`` some rung's kernel cannot take; the errors of
    :func:`disassemble` otherwise."""
    from lessons.gpu import ladder

    d = check_int(d, "d", min=1)
    out = []
    for r in ladder.RUNGS:
        if r.kernel is None:
            continue
        build = ladder.rung_build(r, d)
        rung_arch = build.arch or arch
        instructions, _ = parse_sass(disassemble(build, rung_arch, ladder.rung_entry(r, d)))
        opcode = RUNG_OPCODES[r.name]
        count = sum(1 for i in instructions if i.opcode == opcode or i.opcode.startswith(opcode + "."))
        out.append(dict(name=r.name, arch=rung_arch, opcode=opcode, count=count, instructions=len(instructions)))
    return out

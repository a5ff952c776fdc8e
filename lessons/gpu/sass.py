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
barriers are not in these loops and lower the rate further: :func:`key_tile` counts the part of them that
runs on every key tile (the basic blocks that dominate the key-tile loop's branch back), which gives the
tighter *tile ceiling*. A ceiling says what a rung *cannot* reach, not what it will.

**The tensor-core rungs** (:data:`TENSOR_CORE_RUNGS`, ``mma.sync``) meet the same limit in another form: an H100/H200
SM does 4096 dense 16-bit tensor FLOPs per clock, one ``HMMA.16816.F32`` (4096 FLOPs) per clock, so each
sub-partition must issue one ``HMMA`` every 4 clocks to reach the tensor peak, and every other instruction of the
key-tile loop (``ldmatrix``, exponentials, row max and sum, rescaling, conversions, addresses, copies, barriers)
takes an issue slot as well. With ``I`` instructions per ``HMMA`` on a key tile, a rung runs at most at
``min(1, 4 / I)`` of the tensor peak. :func:`tensor_tile` counts ``I`` on the cheapest *interior* tile: the shortest
pass through the key-tile loop that issues all of the tile's copies of the next K/V tile (:func:`interior_pass`).

The SASS here is what the installed NVRTC's ptxas makes for ``sm_90`` (12.9 in the course's
environment); another CUDA version may schedule the same PTX differently.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from lessons.core.checks import check_int, check_int_sequence, check_positive_real
from lessons.cost.traffic import H200

__all__ = ["NVDISASM_HINT", "CUDA_CORE_RUNGS", "find_nvdisasm", "nvdisasm_available", "tools_missing",
           "disassemble",
           "Instruction", "Loop", "parse_sass", "inner_loops", "fma_loops", "product_loops", "tile_share",
           "fma_loop_table", "fma_loop_markdown", "RUNG_OPCODES", "rung_opcodes", "every_pass", "KeyTile", "key_tile",
           "MIX_METRICS", "parse_ncu_metrics", "measured_mix", "launch_at_least",
           "TENSOR_CORE_RUNGS", "HMMA_CLOCKS", "HMMA_FLOPS", "ISSUE_CLASSES", "issue_class", "classes_of", "interior_pass",
           "TensorTile", "tensor_tile", "tensor_tile_table", "tensor_tile_markdown"]

#: how to get nvdisasm, for the errors that need it
NVDISASM_HINT = "pip install nvidia-cuda-nvdisasm (or put a CUDA toolkit's nvdisasm on PATH)"
#: the rungs whose products run as FFMA on CUDA cores, in ladder order
CUDA_CORE_RUNGS = ("scalar", "regtile", "regtile_wide")


def find_nvdisasm() -> str | None:
    """Path of an executable ``nvdisasm``: a pip ``nvidia-cuda-nvdisasm`` wheel (``nvidia/*/bin``) first,
    then PATH, then ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin``; None if there is none."""
    from lessons.gpu.compile import find_cuda_tool, package_folders

    wheel_bins = [b for folder in package_folders("nvidia") for b in sorted(folder.glob("*/bin"))]
    return find_cuda_tool("nvdisasm", wheel_bins)


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


def _backward_spans(instructions, labels) -> list[tuple[int, int]]:
    """(first, last) index of each backward branch's body: from the label it jumps to, to the branch."""
    spans = []
    for index, instruction in enumerate(instructions):
        target = _TARGET.search(instruction.text)
        if instruction.base == "BRA" and target and labels.get(target.group(1), index + 1) <= index:
            spans.append((labels[target.group(1)], index))
    return spans


def _inner_spans(spans) -> list[tuple[int, int]]:
    """The spans of ``spans`` that hold no other one."""
    return [(s, e) for s, e in spans if not any(s <= s2 and e2 < e for s2, e2 in spans)]


def inner_loops(text: str) -> list[Loop]:
    """The innermost loops of one entry's SASS (:func:`parse_sass`), in address order: each backward
    branch (a ``BRA`` to a label at or before it) whose body holds no other backward branch. Errors as
    :func:`parse_sass`."""
    instructions, labels = parse_sass(text)
    return [Loop(instructions[s:e + 1]) for s, e in _inner_spans(_backward_spans(instructions, labels))]


def _ends_block(instruction: Instruction) -> bool:
    """Whether control may leave ``instruction`` for somewhere else than the next one. ``CALL`` too: for sm_80
    ptxas leaves a loop by a predicated ``CALL.REL.NOINC `(label)`` just before its unconditional branch back."""
    return instruction.base in ("BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "CALL")


def _successors(instructions, labels, i: int) -> set:
    """Where control may go after ``instructions[i]``: the label of a ``BRA`` / ``JMP`` / ``CALL``, and the next
    instruction unless ``instructions[i]`` is an unconditional ``BRA `(label)``, ``EXIT`` or ``RET`` (no predicate
    other than ``@PT``, no predicate operand, no ``.DIV``). ValueError for an indirect branch (``BRX``, ``JMX``):
    where it goes is not in the text."""
    x = instructions[i]
    if x.base in ("BRX", "JMX"):
        raise ValueError(f"an indirect branch at {x.offset:#x} ({x.text}): its targets are not in the SASS text")
    out = set()
    target = _TARGET.search(x.text)
    if x.base in ("BRA", "JMP", "CALL") and target and target.group(1) in labels:
        out.add(labels[target.group(1)])
    unconditional = x.predicate in (None, "@PT")
    operands = x.text.split(None, 1)[1] if " " in x.text else ""
    if x.base in ("BRA", "JMP"):
        ends = unconditional and ".DIV" not in x.opcode and operands.startswith("`")
    else:
        ends = x.base in ("EXIT", "RET") and unconditional
    if not ends and i + 1 < len(instructions):
        out.add(i + 1)
    return out


def every_pass(instructions, labels, first: int, last: int) -> list[int]:
    """Indices of the instructions that run on every pass of the loop whose body is ``instructions[first:last
    + 1]`` (``last`` the branch back to ``first``): the basic blocks that dominate the branch back, i.e. lie
    on every path from the loop's first instruction to it. Predicated instructions count: they take an issue
    slot whether or not their predicate holds. An inner loop's body is counted once. Arguments as
    :func:`parse_sass` returns them; ValueError for a span that is not a loop body."""
    if not (0 <= first <= last < len(instructions)):
        raise ValueError(f"first, last must index instructions with first <= last, got {first}, {last}")
    starts = {first} | {i for i in labels.values() if first <= i <= last}
    starts |= {i + 1 for i in range(first, last) if _ends_block(instructions[i])}
    starts = sorted(starts)
    ends = [b - 1 for b in starts[1:]] + [last]
    block_of = {b: k for k, b in enumerate(starts)}
    successors = [{block_of[j] for j in _successors(instructions, labels, end) if j in block_of} for end in ends]
    predecessors = [set() for _ in starts]
    for k, here in enumerate(successors):
        for j in here:
            predecessors[j].add(k)
    everything = set(range(len(starts)))
    dominators = [{0}] + [set(everything) for _ in starts[1:]]
    changed = True
    while changed:                                    # the textbook iteration: dom(b) = {b} + the meet of its predecessors
        changed = False
        for k in range(1, len(starts)):
            meet = set.intersection(*(dominators[j] for j in predecessors[k])) if predecessors[k] else set()
            if meet | {k} != dominators[k]:
                dominators[k], changed = meet | {k}, True
    return [i for k in sorted(dominators[-1]) for i in range(starts[k], ends[k] + 1)]


def _rung_among(rung, names: tuple, kind: str):
    """The :class:`lessons.gpu.ladder.Rung` named by ``rung``, which must be one of ``names`` (ValueError naming
    ``kind`` otherwise; the errors of ``ladder.rung`` for what is no rung)."""
    from lessons.gpu import ladder

    r = ladder._rung(rung)
    if r.name not in names:
        raise ValueError(f"rung must be a {kind} rung, one of {list(names)}, got {r.name!r}")
    return r


def _cuda_core_rung(rung):
    """:func:`_rung_among` the :data:`CUDA_CORE_RUNGS`."""
    return _rung_among(rung, CUDA_CORE_RUNGS, "CUDA-core")


def _product_spans(r, d: int, arch: str) -> tuple:
    """``(instructions, labels, spans, products)`` of rung ``r``'s forward entry at head dim ``d``: its parsed
    SASS, every backward span and the innermost spans that hold FFMA, in address order."""
    from lessons.gpu import ladder

    d = check_int(d, "d", min=1)
    instructions, labels = parse_sass(disassemble(ladder.rung_build(r, d), arch, ladder.rung_entry(r, d)))
    spans = _backward_spans(instructions, labels)
    products = [(a, z) for a, z in _inner_spans(spans) if any(i.base == "FFMA" for i in instructions[a:z + 1])]
    return instructions, labels, spans, products


def fma_loops(rung, d: int = 64, arch: str = "sm_90") -> list[Loop]:
    """The innermost loops that hold FFMA in the forward entry of CUDA-core rung ``rung``
    (:data:`CUDA_CORE_RUNGS`, a name or a :class:`lessons.gpu.ladder.Rung`) at head dim ``d``, in
    address order. Where ptxas keeps both products as loops, the first is S = Q K^T and the last the
    P V of a tile whose V is finite; the register-tiled rungs have one more between them, the P V that
    guards 0 x inf for a tile whose V holds inf or NaN (:func:`product_loops` checks this). At a small
    ``d`` ptxas unrolls S = Q K^T (a loop over the head dim) whole, and the list starts with a P V.
    ValueError for a rung off that list or a ``d`` its kernel cannot take; the errors of
    :func:`disassemble` otherwise."""
    instructions, _, _, products = _product_spans(_cuda_core_rung(rung), d, arch)
    return [Loop(instructions[a:z + 1]) for a, z in products]


def product_loops(rung, d: int = 64, arch: str = "sm_90") -> tuple[Loop, Loop]:
    """``(s_loop, pv_loop)``: the S = Q K^T loop and the P V loop (finite V) of :func:`fma_loops`, told apart
    by what each product compares. S compares nothing; the scalar rung's P V skips a key whose p is 0 (an
    ``FSETP`` per key), so it has 2 FFMA loops, S then P V; the register-tiled rungs' guarded P V compares
    each p (``FSETP``) and the finite one does not, so they have 3, S, guarded P V, P V. ValueError (naming
    rung, ``d`` and arch, with each loop's FFMA and FSETP counts) when the loops are not so, e.g. at a
    small ``d`` where ptxas unrolls the S loop whole; the errors of :func:`fma_loops` otherwise."""
    return _told_apart(_cuda_core_rung(rung).name, fma_loops(rung, d, arch), d, arch)


def _told_apart(name: str, loops: list, d: int, arch: str) -> tuple[Loop, Loop]:
    """The first and last of rung ``name``'s FFMA ``loops`` after checking their pattern (:func:`product_loops`)."""
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


@dataclass(frozen=True)
class KeyTile:
    """What one warp of a CUDA-core rung issues for one key tile, counted from SASS (:func:`key_tile`).

    ``block_q``, ``block_k``: the rung's default tiles (:func:`lessons.gpu.ladder.rung_tiles`); ``threads``:
    per block; ``s_loop``, ``pv_loop``: the product loops (:func:`product_loops`); ``s_trips``, ``pv_trips``: how many
    passes of each one key tile takes (the tile's ``block_q x block_k x d`` FMAs of each product over the
    block's threads, divided by the loop's FFMA per pass); ``overhead``: the instructions outside those loops
    that run on every pass of the key-tile loop (:func:`every_pass`: softmax, copies, barriers, loop
    control), a lower bound, since code on only some paths is left out. ``instructions``: the sum, so a tile
    issues at least this many; ``share``: the products' FFMA over that, so at most the share of issue slots
    that multiply. Each pass of a product loop counts all of it: the scalar rung's P V loop skips the FMAs of a
    key whose p is 0 (a masked key, or one whose exponential underflows), so for that rung the count holds for a
    tile whose p are all nonzero (every key visible, none underflowing to 0)."""

    block_q: int
    block_k: int
    threads: int
    s_loop: Loop
    pv_loop: Loop
    s_trips: int
    pv_trips: int
    overhead: int

    @property
    def instructions(self) -> int:
        return self.overhead + self.s_trips * self.s_loop.size + self.pv_trips * self.pv_loop.size

    @property
    def product_ffma(self) -> int:
        return self.s_trips * self.s_loop.ffma + self.pv_trips * self.pv_loop.ffma

    @property
    def share(self) -> float:
        return self.product_ffma / self.instructions


def key_tile(rung, d: int = 64, arch: str = "sm_90") -> KeyTile:
    """The :class:`KeyTile` of CUDA-core rung ``rung`` (:data:`CUDA_CORE_RUNGS`, a name or a
    :class:`lessons.gpu.ladder.Rung`) at head dim ``d`` with its default tiles: the key-tile loop is the
    innermost loop of the SASS that holds both product loops. ValueError when the loops are not as
    :func:`product_loops` expects, when no loop holds them, or when a tile's FMAs per thread are not a whole
    number of passes of a product loop; the errors of :func:`disassemble` otherwise."""
    from lessons.gpu import ladder
    from lessons.gpu.compile import compile_kernel

    r = _cuda_core_rung(rung)
    instructions, labels, spans, products = _product_spans(r, d, arch)
    s_loop, pv_loop = _told_apart(r.name, [Loop(instructions[a:z + 1]) for a, z in products], d, arch)
    lo, hi = products[0][0], products[-1][1]
    around = [sp for sp in spans if sp[0] <= lo and sp[1] >= hi and sp not in products]
    if not around:
        raise ValueError(f"no loop of {r.name} at d={d} ({arch}) holds both product loops")
    first, last = min(around, key=lambda sp: sp[1] - sp[0])
    inside = {i for a, z in products for i in range(a, z + 1)}
    overhead = sum(1 for i in every_pass(instructions, labels, first, last) if i not in inside)
    block_q, block_k = ladder.rung_tiles(r, d)
    threads = compile_kernel(ladder.rung_build(r, d), arch).resources[ladder.rung_entry(r, d)].threads_per_block
    fmas, spare = divmod(block_q * block_k * d, threads)
    for name, loop in (("S = Q K^T", s_loop), ("P V", pv_loop)):
        if spare or fmas % loop.ffma:
            raise ValueError(f"{r.name} at d={d} ({arch}): a tile's {block_q * block_k * d} FMAs of {name} over "
                             f"{threads} threads are not a whole number of passes of {loop.ffma} FFMA")
    return KeyTile(block_q, block_k, threads, s_loop, pv_loop, fmas // s_loop.ffma, fmas // pv_loop.ffma, overhead)


def _rungs_and_ds(rungs, ds) -> tuple[tuple, list]:
    """The ``rungs`` and ``ds`` arguments of the table functions checked: one rung (a name or a
    :class:`lessons.gpu.ladder.Rung`) or a non-empty sequence of them, as a tuple; ``ds``, a sequence of positive
    ints. TypeError for arguments of another kind, ValueError for no rung or a ``d`` below 1."""
    from lessons.gpu import ladder

    if isinstance(rungs, (str, ladder.Rung)):
        rungs = (rungs,)
    if isinstance(rungs, (bytes, dict, set, frozenset)) or not hasattr(rungs, "__iter__"):
        raise TypeError(f"rungs must be a rung, its name or a sequence of them, got {type(rungs).__name__} {rungs!r}")
    rungs = tuple(rungs)
    if not rungs:
        raise ValueError("rungs must hold at least one rung, got none")
    return rungs, check_int_sequence(ds, "ds", min=1)


def fma_loop_table(rungs=CUDA_CORE_RUNGS, ds=(64, 128), arch: str = "sm_90", peak_flops: float | None = None) -> list[dict]:
    """One dict per (rung, d): rung, d, and for the S loop and the P V loop (finite V) of
    :func:`product_loops`: ``s_instructions``, ``s_ffma``, ``s_loads`` (shared loads by width),
    ``pv_instructions``, ``pv_ffma``, ``pv_loads``; then ``share`` (:func:`tile_share`) and ``ceiling``
    (FLOP/s: ``share x peak_flops``; default the H200's FP32 peak, ``lessons.cost.traffic.H200``,
    67e12): what the product loops alone allow; and over a whole key tile (:func:`key_tile`):
    ``tile_overhead`` (instructions outside the product loops on every tile, at least), ``tile_instructions``,
    ``tile_share`` and ``tile_ceiling`` (FLOP/s), what the tile allows, never above ``ceiling``. ``rungs``: one rung (a name or a :class:`lessons.gpu.ladder.Rung`) or a sequence of them;
    ``ds``: a sequence of head dims. TypeError for ``rungs`` or ``ds`` of another kind; ValueError for
    none of them, a rung off :data:`CUDA_CORE_RUNGS`, a bad ``d`` (one where the loops cannot be told
    apart: :func:`product_loops`) or a ``peak_flops`` that is not a positive finite number; the errors
    of :func:`disassemble` otherwise."""
    from lessons.gpu import ladder

    peak = check_positive_real(H200.peak_flops["fp32"] if peak_flops is None else peak_flops, "peak_flops",
                               "number of FLOP/s")
    rungs, ds = _rungs_and_ds(rungs, ds)
    out = []
    for name in rungs:
        for d in ds:
            tile = key_tile(name, d, arch)
            s_loop, pv_loop = tile.s_loop, tile.pv_loop
            share = tile_share(s_loop, pv_loop)
            out.append(dict(rung=ladder._rung(name).name, d=d,
                            s_instructions=s_loop.size, s_ffma=s_loop.ffma, s_loads=s_loop.loads,
                            pv_instructions=pv_loop.size, pv_ffma=pv_loop.ffma, pv_loads=pv_loop.loads,
                            share=share, ceiling=share * peak, tile_overhead=tile.overhead,
                            tile_instructions=tile.instructions, tile_share=tile.share,
                            tile_ceiling=tile.share * peak))
    return out


def _loads(loads: dict) -> str:
    """``{"LDS.128": 8, "LDS.64": 4}`` as ``"8 x 16 B + 4 x 8 B"`` (plain ``LDS`` reads 4 bytes)."""
    width = {"LDS": 4, "LDS.64": 8, "LDS.128": 16, "LDS.U8": 1, "LDS.U16": 2}
    parts = sorted(loads.items(), key=lambda kv: -width.get(kv[0], 0))
    return " + ".join(f"{count} x {width[op]} B" if op in width else f"{count} {op}" for op, count in parts)


def _check_table(table, source: str, keys: tuple, *dicts: str) -> None:
    """TypeError naming ``table`` unless it is a non-empty list (or tuple) of dicts that each hold ``keys``, with a
    dict under each key of ``dicts``: the rows :func:`fma_loop_table` or :func:`tensor_tile_table` (``source``)
    returns."""
    if not isinstance(table, (list, tuple)) or not table or not all(
            isinstance(row, dict) and all(k in row for k in keys) and all(isinstance(row[k], dict) for k in dicts)
            for row in table):
        raise TypeError(f"table must be a non-empty list of rows from {source}() (each with {', '.join(keys)}"
                        + (f"; {', '.join(dicts)} dicts" if dicts else "") + f"), got {type(table).__name__}")


def fma_loop_markdown(table=None) -> str:
    """A Markdown table of :func:`fma_loop_table` rows (default: the CUDA-core rungs at d = 64 and 128): per rung
    and head dim, each product loop's FFMA, instructions and shared loads (count x bytes), the share of issue
    slots that are FFMA in the two loops and the ceiling that puts on the rate (TFLOP/s), then the instructions
    outside them on every key tile and the share and ceiling over the whole tile. TypeError for a ``table`` that is
    not a non-empty list of such rows; the errors of :func:`fma_loop_table` otherwise."""
    table = fma_loop_table() if table is None else table
    _check_table(table, "fma_loop_table", ("rung", "d", "s_ffma", "s_instructions", "s_loads", "pv_ffma",
                                           "pv_instructions", "pv_loads", "share", "ceiling", "tile_overhead",
                                           "tile_instructions", "tile_share", "tile_ceiling"), "s_loads", "pv_loads")
    lines = ["| rung | d | S = Q K^T loop: FFMA / instructions | its shared loads | P V loop: FFMA / instructions | "
             "its shared loads | FFMA share, the two loops | their ceiling, TFLOP/s | other instructions every tile "
             "(at least) | FFMA share, whole tile | tile ceiling, TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        lines.append(f"| {row['rung']} | {row['d']} | {row['s_ffma']} / {row['s_instructions']} | {_loads(row['s_loads'])} | "
                     f"{row['pv_ffma']} / {row['pv_instructions']} | {_loads(row['pv_loads'])} | {row['share']:.0%} | "
                     f"{row['ceiling'] / 1e12:.1f} | {row['tile_overhead']} of {row['tile_instructions']} | "
                     f"{row['tile_share']:.0%} | {row['tile_ceiling'] / 1e12:.1f} |")
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
    "mma_fa2_lean": "LDG.E.CONSTANT",      # ld.global.nc.u32: V's tile flags, which the pre-pass wrote
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


#: the two Nsight Compute metrics ``scripts/gpu_check.sh`` collects per CUDA-core rung (``ncu/mix_<rung>.txt``):
#: warp instructions issued, and FFMA executed by threads with their predicate on
MIX_METRICS = ("smsp__inst_executed.sum", "smsp__sass_thread_inst_executed_op_ffma_pred_on.sum")


def parse_ncu_metrics(text: str) -> dict:
    """``{metric name: value}`` from Nsight Compute's text report of ``--metrics`` (lines of name, unit and a
    value with thousands separators, e.g. ``smsp__inst_executed.sum   inst   12,345,678``; a unit scaled by
    K, M, G or T, such as ``Minst``, is scaled back); where a metric is
    reported twice (two launches profiled), the last value is kept. Values are floats; a value ncu could not
    collect (``n/a``) is left out. TypeError for a ``text`` that is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"text must be Nsight Compute's report (a str), got {type(text).__name__}")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 3 and "__" in words[0] and re.fullmatch(r"[0-9][0-9,]*(\.[0-9]+)?", words[-1]):
            unit = words[-2]                          # "inst", or scaled where ncu scales units: "Minst"
            factor = scale[unit[0]] if unit[0] in scale and unit[1:2].islower() else 1.0
            out[words[0]] = float(words[-1].replace(",", "")) * factor
    return out


def measured_mix(rung, folder: Path | None = None) -> dict | None:
    """What one launch of CUDA-core rung ``rung`` issued on a GPU, from ``folder / f"mix_{name}.txt"``
    (default: the recorded run's ``ncu`` folder, :data:`lessons.gpu.recorded.RECORDED_DIR`): instructions
    (warp instructions issued), ffma (warp FFMA: the thread count over 32, all lanes of these kernels being
    active) and share (ffma / instructions), the measured counterpart of :attr:`KeyTile.share`, which bounds it
    from above. None when the run holds no such file (the recorded run may predate it). ValueError naming the
    file when it lacks one of :data:`MIX_METRICS`; the errors of :func:`fma_loops` for a rung off
    :data:`CUDA_CORE_RUNGS`."""
    from lessons.gpu.recorded import RECORDED_DIR

    r = _cuda_core_rung(rung)
    path = Path(RECORDED_DIR / "ncu" if folder is None else folder) / f"mix_{r.name}.txt"
    if not path.is_file():
        return None
    metrics = parse_ncu_metrics(path.read_text(errors="replace"))
    missing = [m for m in MIX_METRICS if m not in metrics]
    if missing or not metrics[MIX_METRICS[0]]:
        raise ValueError(f"{path} holds no value for {missing or [MIX_METRICS[0] + ' above 0']}: not an ncu report of "
                         f"the metrics gpu_check.sh asks for")
    instructions, ffma = metrics[MIX_METRICS[0]], metrics[MIX_METRICS[1]] / 32
    return dict(instructions=instructions, ffma=ffma, share=ffma / instructions)


def launch_at_least(rung, n: int = 8192, heads: int = 8, d: int = 128, arch: str = "sm_90") -> dict:
    """What one non-causal forward launch of CUDA-core rung ``rung`` issues at least, by :func:`key_tile`:
    ``n`` queries and keys, ``heads`` heads, head dim ``d``, default tiles (as ``scripts/profile_rung.py``
    launches it under ncu). Returns instructions (warp instructions: blocks x warps x key tiles x
    :attr:`KeyTile.instructions`) and product_ffma (warp FFMA of the two products), to set beside
    :func:`measured_mix`. ValueError for an ``n`` that is not a multiple of the rung's ``block_k`` (a cut tile
    runs other code), and the errors of :func:`key_tile`."""
    n, heads = check_int(n, "n", min=1), check_int(heads, "heads", min=1)
    tile = key_tile(rung, d, arch)
    if n % tile.block_k:
        raise ValueError(f"n must be a multiple of {_cuda_core_rung(rung).name}'s block_k = {tile.block_k} at d = {d}, "
                         f"got {n}")
    tiles = -(-n // tile.block_q) * heads * (tile.threads // 32) * (n // tile.block_k)   # (block, warp, key tile)
    return dict(instructions=tiles * tile.instructions, product_ffma=tiles * tile.product_ffma)


# ---- the tensor-core rungs: HMMA per issue slot ------------------------------------------------------------------

#: the rungs whose products run as ``mma.sync`` (SASS ``HMMA``) on tensor cores, in ladder order. A rung joins by its
#: name alone when its forward entry has one key-tile loop that holds all its ``HMMA`` (or, as the lean rung, two
#: loops one after the other, the interior tiles' first) and copies K and V into shared memory by 16-byte reads of
#: global memory (:func:`tensor_tile` says what it found otherwise)
TENSOR_CORE_RUNGS = ("mma", "mma_async", "mma_fa2", "mma_fa2_lazy", "mma_fa2_wide", "mma_fa2_lean")

#: clocks between two ``HMMA.16816.F32`` of one sub-partition at the tensor peak. sm_90 (H100/H200): an SM does 4096
#: dense 16-bit tensor FLOPs per clock (989 TFLOP/s over 132 SMs at 1.83 GHz, NVIDIA H100 white paper), one
#: ``m16n8k16`` (16 x 8 x 16 multiply-adds, 4096 FLOPs) per clock, so each of its 4 sub-partitions one per 4 clocks;
#: sm_80 (A100): 2048 per clock (312 TFLOP/s over 108 SMs at 1.41 GHz, NVIDIA A100 white paper), one per 8 clocks
HMMA_CLOCKS = {"sm_80": 8, "sm_90": 4}

#: FLOPs of one ``HMMA.16816`` (``mma.sync.m16n8k16``): 2 x 16 x 8 x 16
HMMA_FLOPS = 4096

#: the classes a key tile's instructions are grouped into (ladder figures and tables), each with the base opcodes
#: it holds; an opcode on none of these lists is in ``"other"`` (:func:`issue_class`)
ISSUE_CLASSES = (
    ("tensor", ("HMMA", "HGMMA")),
    ("shared loads", ("LDSM", "LDS")),
    ("copies", ("LDGSTS", "LDG", "STS", "LDGDEPBAR")),
    ("exponentials", ("MUFU",)),
    ("other float", ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "F2FP", "F2F", "HADD2", "HMUL2",
                     "HFMA2", "HSETP2", "HMNMX2", "FCHK", "I2F", "F2I", "FRND")),
    ("integer and address", ("IMAD", "LEA", "LOP3", "ISETP", "VIADD", "VIADDMNMX", "IADD3", "SHF", "PRMT", "SEL",
                             "MOV", "IMNMX", "IABS", "S2R", "S2UR", "CS2R", "R2UR", "ULDC", "UMOV", "UIADD3",
                             "UIMAD", "ULEA", "ULOP3", "USHF", "USEL", "UISETP", "UPRMT", "IMUL", "LOP", "SHL",
                             "SHR", "POPC", "FLO", "BREV", "P2R", "R2P", "PLOP3", "I2IP", "IDP", "LDC", "VIMNMX")),
    ("control and sync", ("BRA", "BSSY", "BSYNC", "BAR", "DEPBAR", "WARPSYNC", "VOTE", "VOTEU", "SHFL", "NOP",
                          "CALL", "RET", "EXIT", "BMOV", "YIELD", "MEMBAR", "ERRBAR", "CCTL", "MATCH", "REDUX",
                          "ELECT", "ACQBULK", "B2R", "WARPGROUP", "SYNCS")),
)
_CLASS_OF = {op: name for name, ops in ISSUE_CLASSES for op in ops}


def issue_class(opcode: str) -> str:
    """The class of :data:`ISSUE_CLASSES` an opcode falls in, by its base (``"LDSM.16.MT88.4"`` -> ``"shared
    loads"``), or ``"other"``. TypeError for an ``opcode`` that is not a str."""
    if not isinstance(opcode, str):
        raise TypeError(f"opcode must be a str such as 'HMMA.16816.F32', got {type(opcode).__name__}")
    return _CLASS_OF.get(opcode.split(".")[0], "other")


def classes_of(counts: dict) -> dict:
    """Instruction counts by base opcode (``{"HMMA": 128, ...}``) summed per class of :data:`ISSUE_CLASSES`, every
    class present (0 where none), ``"other"`` last. The errors of :func:`issue_class` for a key that is not a
    str."""
    out = {name: 0 for name, _ in ISSUE_CLASSES} | {"other": 0}
    for opcode, count in counts.items():
        out[issue_class(opcode)] += count
    return out


def _back_edges(instructions, labels) -> list[tuple[int, int]]:
    """Every loop of the control-flow graph as ``(head, branch back)``: each edge of :func:`_successors` from an
    instruction to itself or one before it, in address order of the branch."""
    return [(j, i) for i in range(len(instructions)) for j in _successors(instructions, labels, i) if j <= i]


def _key_tile_loop(instructions, labels) -> tuple[int, int]:
    """``(head, branch back)`` of the key-tile loop: the shortest loop (a backward edge of the control-flow graph)
    whose span holds every ``HMMA``. Where no loop holds them all but they lie in loops one after another (the lean
    rung at d = 64: first a loop over the key tiles that need no mask, compiled without mask code, then a loop over
    the rest with the masked step), the first of them, the outermost loop that holds the first ``HMMA``: the interior tiles'
    loop (:func:`tensor_tile` checks that a pass through it issues a whole tile's ``HMMA``). ValueError when there
    is no ``HMMA`` or no loop holds the first one."""
    hmma = [i for i, x in enumerate(instructions) if x.base == "HMMA"]
    if not hmma:
        raise ValueError("the SASS holds no HMMA")
    loops = _back_edges(instructions, labels)
    around = [(h, b) for h, b in loops if h <= hmma[0] and b >= hmma[-1]]
    if around:
        return min(around, key=lambda hb: hb[1] - hb[0])
    first = [(h, b) for h, b in loops if h <= hmma[0] <= b]
    if not first:
        raise ValueError("no loop of the SASS holds every HMMA, nor the first of them")
    return max(first, key=lambda hb: hb[1] - hb[0])


def _is_copy(instruction: Instruction) -> bool:
    """A 16-byte read of global memory that copies K or V: ``LDGSTS`` (cp.async) or ``LDG....128``."""
    return instruction.base == "LDGSTS" or (instruction.base == "LDG" and "128" in instruction.opcode.split("."))


def interior_pass(instructions, labels, first: int, last: int, copies: int, is_copy=_is_copy) -> list[int]:
    """The indices, in order, of the fewest instructions on a path from ``first`` (a loop's head) to ``last`` (its
    branch back) that runs at least ``copies`` instructions for which ``is_copy`` holds, each visit counted: a
    Dijkstra over (instruction, copies run so far, capped at ``copies``), every instruction costing one issue slot
    (a predicated one too: it takes its slot whether or not its predicate holds). No edge leads back to ``first``
    (that is the next pass); an inner loop may be run more than once where the copies need it. Arguments as
    :func:`parse_sass` returns them. TypeError for a non-integer ``first``, ``last`` or ``copies`` (bools
    included); ValueError for a span that is not in ``instructions``, one that is not a loop (``last`` does not
    branch back to ``first``), a negative ``copies``, or when no such path exists."""
    import heapq

    first, last = check_int(first, "first"), check_int(last, "last")
    if not (0 <= first <= last < len(instructions)):
        raise ValueError(f"first, last must index instructions with first <= last, got {first}, {last}")
    if first not in _successors(instructions, labels, last):
        raise ValueError(f"first, last must be a loop's head and its branch back: instruction {last} "
                         f"({instructions[last].text}) does not branch back to {first}")
    copies = check_int(copies, "copies", min=0)
    start = (first, min(copies, int(is_copy(instructions[first]))))
    best, previous = {start: 1}, {}
    heap = [(1, start)]
    while heap:
        dist, state = heapq.heappop(heap)
        if state == (last, copies):
            path = [state]
            while path[-1] != start:
                path.append(previous[path[-1]])
            return [i for i, _ in reversed(path)]
        if dist > best[state]:
            continue
        i, done = state
        for j in _successors(instructions, labels, i):
            if j == first:
                continue
            nxt = (j, min(copies, done + int(is_copy(instructions[j]))))
            if dist + 1 < best.get(nxt, dist + 2):
                best[nxt], previous[nxt] = dist + 1, state
                heapq.heappush(heap, (dist + 1, nxt))
    raise ValueError(f"no path from instruction {first} to {last} runs {copies} copies")


def _tensor_core_rung(rung):
    """:func:`_rung_among` the :data:`TENSOR_CORE_RUNGS`."""
    return _rung_among(rung, TENSOR_CORE_RUNGS, "tensor-core (mma.sync)")


def _check_hmma_arch(arch) -> str:
    if not isinstance(arch, str) or arch not in HMMA_CLOCKS:
        raise ValueError(f"arch must be one of {list(HMMA_CLOCKS)} (an HMMA rate is known for these), got {arch!r}")
    return arch


@dataclass(frozen=True)
class TensorTile:
    """What one warp of a tensor-core rung issues for one interior key tile, counted from SASS (:func:`tensor_tile`).

    ``block_q``, ``block_k``: the rung's default tiles (:func:`lessons.gpu.ladder.rung_tiles`); ``warps``: per block;
    ``hmma``: ``HMMA.16816`` per warp and tile by hand, ``rows_per_warp x block_k x d / 1024`` (S = Q K^T and P V
    each do ``rows_per_warp x block_k x d`` multiply-adds, 2048 per HMMA); ``copies``: 16-byte reads of K and V
    from global memory per thread and tile by hand, ``2 x block_k x d x element bytes / 16 / threads``;
    ``instructions``: the fewest instructions (warp instructions, one issue slot each) on a pass through the
    key-tile loop that issues those copies (:func:`interior_pass`); ``counts``: that pass's instructions by base
    opcode; ``body``: the loop's size (its instructions from head to branch back, each once); ``clocks``:
    :data:`HMMA_CLOCKS` of ``arch``. ``per_hmma``: instructions per HMMA; ``peak_share``: ``min(1, clocks x hmma /
    instructions)``, the most of the tensor peak one sub-partition's scheduler can feed at one instruction per
    clock, however well latency is hidden; ``classes``: the counts by :data:`ISSUE_CLASSES`."""

    rung: str
    d: int
    arch: str
    block_q: int
    block_k: int
    warps: int
    hmma: int
    copies: int
    instructions: int
    counts: dict
    body: int
    clocks: int

    @property
    def rows_per_warp(self) -> int:
        return self.block_q // self.warps

    @property
    def per_hmma(self) -> float:
        return self.instructions / self.hmma

    @property
    def peak_share(self) -> float:
        return min(1.0, self.clocks * self.hmma / self.instructions)

    @property
    def classes(self) -> dict:
        return classes_of(self.counts)


def tensor_tile(rung, d: int = 64, arch: str = "sm_90") -> TensorTile:
    """The :class:`TensorTile` of tensor-core rung ``rung`` (:data:`TENSOR_CORE_RUNGS`, a name or a
    :class:`lessons.gpu.ladder.Rung`) at head dim ``d`` with its default tiles, from the SASS NVRTC makes for
    ``arch`` (a key of :data:`HMMA_CLOCKS`). The key-tile loop is the shortest loop that holds every ``HMMA``. The
    lean rung (``mma_fa2_lean``) at d = 64 has two loops that hold them, one after the other: first the key tiles
    that need no mask, compiled without mask code, then the rest with the masked step; there the first is counted (the
    interior tiles' loop, which a long row spends nearly all its tiles in), and the masked loop is not. An
    *interior* tile copies all of the next K/V tile (the last tile copies none, a tile past ``n_k`` fills zeros
    instead), so the pass counted is the shortest that issues the hand count of copies (:func:`interior_pass`).
    Being the shortest, it takes no mask, no inf/NaN fix-up of V, no rescale a lazy rung may skip: the cheapest
    tile the kernel can run, so a tile issues at least this many instructions. ValueError for a rung off the list,
    a ``d`` its kernel cannot take, an ``arch`` off :data:`HMMA_CLOCKS`, a block whose rows do not split evenly
    over its warps, or SASS that does not match the hand counts (an ``HMMA`` of another shape, a pass with another
    number of ``HMMA``); the errors of :func:`disassemble` otherwise."""
    from lessons.gpu import ladder
    from lessons.gpu.compile import compile_kernel

    r = _tensor_core_rung(rung)
    arch = _check_hmma_arch(arch)
    d = check_int(d, "d", min=1)
    build, entry = ladder.rung_build(r, d), ladder.rung_entry(r, d)
    block_q, block_k = ladder.rung_tiles(r, d)
    threads = compile_kernel(build, arch).resources[entry].threads_per_block
    warps = threads // 32
    if threads % 32 or block_q % warps:
        raise ValueError(f"{r.name} at d={d}: {block_q} query rows do not split evenly over {threads} threads' warps")
    hmma = block_q // warps * block_k * d // 1024
    element = {"float16": 2, "bfloat16": 2}[r.dtype]
    copies, spare = divmod(2 * block_k * d * element // 16, threads)
    if spare:
        raise ValueError(f"{r.name} at d={d}: a tile's {2 * block_k * d * element // 16} 16-byte copies do not split "
                         f"evenly over {threads} threads")
    instructions, labels = parse_sass(disassemble(build, arch, entry))
    odd = sorted({x.opcode for x in instructions if x.base == "HMMA" and not x.opcode.startswith("HMMA.16816.")})
    if odd:
        raise ValueError(f"{r.name} at d={d} ({arch}) issues HMMA of another shape than m16n8k16: {odd}")
    first, last = _key_tile_loop(instructions, labels)
    path = interior_pass(instructions, labels, first, last, copies)
    counts = Counter(instructions[i].base for i in path)
    if counts["HMMA"] != hmma:
        raise ValueError(f"{r.name} at d={d} ({arch}): the shortest interior pass issues {counts['HMMA']} HMMA, not the "
                         f"{hmma} a {block_q} x {block_k} tile over {warps} warps needs")
    return TensorTile(r.name, d, arch, block_q, block_k, warps, hmma, copies, len(path), dict(counts),
                      last - first + 1, HMMA_CLOCKS[arch])


def tensor_tile_table(rungs=TENSOR_CORE_RUNGS, ds=(64, 128), arch: str = "sm_90",
                      peak_flops: float | None = None) -> list[dict]:
    """One dict per (rung, d) of :func:`tensor_tile`: rung, d, block_q, block_k, warps, hmma (per warp and tile),
    copies (16-byte copies per thread and tile), instructions (on the interior pass), per_hmma, classes (instructions
    by :data:`ISSUE_CLASSES`, ``"other"`` last), peak_share and ceiling (FLOP/s: ``peak_share x peak_flops``; default
    the H200's dense 16-bit tensor peak, ``lessons.cost.traffic.H200.peak_flops["bf16"]``, 989e12, the same for
    float16): at most what the rung can reach at one instruction per clock per scheduler. ``rungs``: one rung (a
    name or a :class:`lessons.gpu.ladder.Rung`) or a sequence of them; ``ds``: a sequence of head dims. TypeError
    for ``rungs`` or ``ds`` of another kind; ValueError for none of them, a rung off :data:`TENSOR_CORE_RUNGS`, an
    ``arch`` off :data:`HMMA_CLOCKS`, no ``peak_flops`` for another arch than sm_90 (the default is an sm_90 GPU's),
    a ``peak_flops`` that is not a positive finite number; the errors of :func:`tensor_tile` otherwise."""
    arch = _check_hmma_arch(arch)
    if peak_flops is None and arch != "sm_90":
        raise ValueError(f"peak_flops must be given for arch {arch!r}: the default is the H200's (sm_90)")
    peak = check_positive_real(H200.peak_flops["bf16"] if peak_flops is None else peak_flops, "peak_flops",
                               "number of FLOP/s")
    rungs, ds = _rungs_and_ds(rungs, ds)
    out = []
    for name in rungs:
        for d in ds:
            t = tensor_tile(name, d, arch)
            out.append(dict(rung=t.rung, d=d, block_q=t.block_q, block_k=t.block_k, warps=t.warps, hmma=t.hmma,
                            copies=t.copies, instructions=t.instructions, per_hmma=t.per_hmma, classes=t.classes,
                            clocks=t.clocks, peak_share=t.peak_share, ceiling=t.peak_share * peak))
    return out


def tensor_tile_markdown(table=None) -> str:
    """A Markdown table of :func:`tensor_tile_table` rows (default: the tensor-core rungs at d = 64 and 128): per
    rung and head dim, the tiles and warps, HMMA per warp and tile, the instructions of the interior pass, those per
    HMMA, the share of them in each class of :data:`ISSUE_CLASSES` (per HMMA), and the ceiling (share of the tensor
    peak and TFLOP/s, "at most"). TypeError for a ``table`` that is not a non-empty list of such rows; the errors
    of :func:`tensor_tile_table` otherwise."""
    table = tensor_tile_table() if table is None else table
    _check_table(table, "tensor_tile_table", ("rung", "d", "block_q", "block_k", "warps", "hmma", "instructions",
                                              "per_hmma", "classes", "peak_share", "ceiling"), "classes")
    names = [name for name, _ in ISSUE_CLASSES if name != "tensor"]
    extra = any(row["classes"].get("other") for row in table)
    names += ["other"] if extra else []
    lines = ["| rung | d | tiles (warps) | HMMA per warp | instructions per tile | per HMMA | "
             + " | ".join(f"{name} per HMMA" for name in names) + " | at most, share of the tensor peak | "
             "at most, TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |"]
    for row in table:
        cells = " | ".join(f"{row['classes'][name] / row['hmma']:.2f}" for name in names)
        lines.append(f"| {row['rung']} | {row['d']} | {row['block_q']} x {row['block_k']} ({row['warps']}) | "
                     f"{row['hmma']} | {row['instructions']} | {row['per_hmma']:.2f} | {cells} | "
                     f"{row['peak_share']:.0%} | {row['ceiling'] / 1e12:.0f} |")
    return "\n".join(lines)

"""Bytes in flight: the decode rungs' key loops read from SASS, and Little's law on their recorded rates.

Decoding reads each K/V byte once and does a few FLOPs with it (4 at 4 query heads per KV head in fp16: one
multiply-add per query head for each 2-byte value), so a decode kernel is fast only if bytes arrive fast. A load
takes a round trip (the latency ``L``, from the load's issue until its data can be used), and
*Little's law* says how much must be asked for meanwhile: a GPU that has ``B`` bytes in flight on average
reads at ``B / L`` bytes per second. To read at the copy rate ``R`` it needs ``R x L`` bytes in flight (Little
1961; for GPUs: Volkov 2016, "Understanding latency hiding on GPUs", PhD thesis, UC Berkeley).

How many bytes a warp keeps in flight is in its machine code: a load's bytes are in flight from the ``LDG``
that asks for them until the first instruction that reads its register, where the warp waits for it. This
module walks one pass of a decode rung's key loop (:func:`decode_loop`) and records, at every such wait, the
bytes per thread still asked for and not yet used, and how many instructions the warp issued meanwhile; a pass
is walked twice, so a load issued in one pass and used in the next counts (the prefetch rung: its pass is two
steps, one per register set, and the rows its second step asks for are used in the next pass's first). It assumes
loads land in the order they were issued: a wait for one load also sees the ones issued before it land.

The same pass gives a second limit, as for the forward rungs (:mod:`lessons.gpu.sass`): an SM's 4 schedulers
issue one warp instruction per clock each, so a loop that issues ``I`` instructions per ``b`` bytes of K/V a
warp reads cannot read faster than ``4 x clock x SMs x b / I`` bytes per second (:attr:`DecodeLoop.issue_ceiling`).

:func:`round_trips` then reads the recorded decode runs of the rungs that stage one page at a time: one block's
time per page over the round trips its loads make per page is the time of one round trip, or less.
The counts are what the installed NVRTC's ptxas makes; the rates are the recorded H200 run's.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lessons.core.checks import check_int, check_positive_real
from lessons.cost.traffic import H200
from lessons.gpu.sass import _back_edges, _check_table, classes_of, disassemble, interior_pass, parse_sass
from lessons.gpu.source import H200_NUM_SMS
from lessons.gpu.warpgroup_pipes import SM_TENSOR_FLOPS_PER_CLOCK, SUB_PARTITIONS

__all__ = ["DECODE_LOOP_RUNGS", "DECODE_CLASSES", "THREADS", "STEP_LOADS", "PAGE_TOKENS", "SM_CLOCK_HZ", "load_bytes", "Wait", "DecodeLoop",
           "decode_loop", "decode_loop_table", "decode_loop_markdown", "blocks_per_sm", "round_trips", "round_trips_markdown",
           "little_rate", "little_plot", "PROFILE_METRICS", "parse_ncu_sections", "top_stall", "measured_profile",
           "PROFILED_KV_BYTES", "profile_markdown"]

#: the decode rungs, in ladder order (:data:`lessons.gpu.ladder.DECODE_RUNGS`)
DECODE_LOOP_RUNGS = ("paged_decode", "flash_decoding", "paged_decode_split", "paged_decode_prefetch",
                     "paged_decode_cp_async")

#: threads per block of both decode kernels (``NUM_THREADS`` in ``paged_decode.cu`` and ``paged_decode_split.cu``)
THREADS = 128

#: K/V loads per thread in one step of the split rungs at d = 128 in fp16 (``paged_decode_split.cu``): the K and V rows
#: of UNROLL = 4 keys, one 16-byte load each (``CHUNKS`` = 1)
STEP_LOADS = 8

#: tokens per page of the decode rungs' paged cache (``BLOCK_SIZE``: :func:`lessons.gpu.ladder.decode_rung_build`)
PAGE_TOKENS = 16

#: the SM clock the H200's tensor peak implies: 989e12 FLOP/s over 132 SMs x 4096 FLOPs per clock, 1.83 GHz
#: (NVIDIA H100 white paper)
SM_CLOCK_HZ = H200.peak_flops["bf16"] / (H200_NUM_SMS * SM_TENSOR_FLOPS_PER_CLOCK)

#: what a decode step's instructions do, by base opcode, finer than :data:`lessons.gpu.sass.ISSUE_CLASSES` where the
#: decode loop spends its slots (the last class takes every opcode not named)
DECODE_CLASSES = (
    ("multiply-adds", ("FFMA",)),
    ("16-bit to float32", ("HADD2",)),
    ("other float", ("FADD", "FMUL", "FMNMX", "FSEL", "FSETP", "FSET", "HFMA2", "F2F", "F2FP")),
    ("exponentials", ("MUFU",)),
    ("K/V loads, copies and table look-ups", ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "LDS")),
    ("shuffles", ("SHFL",)),
    ("register moves", ("MOV", "CS2R", "UMOV")),
    ("branches and convergence", ("BRA", "BSSY", "BSYNC", "WARPSYNC", "VOTE", "VOTEU")),
    ("integer and address", ()),
)

_WIDTHS = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
_REGISTER = re.compile(r"(?<![\w.])R(\d+)(\.64)?\b")


def load_bytes(opcode: str) -> int:
    """Bytes one thread reads with the global load ``opcode``: ``LDG.E.128...`` 16, ``.64`` 8, ``.U16`` / ``.S16``
    2, ``.U8`` / ``.S8`` 1, a plain ``LDG.E`` 4 (one 32-bit word); the same widths for a copy from global to shared
    memory (``LDGSTS.E.BYPASS.128``: cp.async, 16). TypeError for a non-str; ValueError for an opcode that is not
    an ``LDG`` or ``LDGSTS``."""
    if not isinstance(opcode, str):
        raise TypeError(f"opcode must be a str such as 'LDG.E.128.CONSTANT', got {type(opcode).__name__}")
    parts = opcode.split(".")
    if parts[0] not in ("LDG", "LDGSTS"):
        raise ValueError(f"opcode must be a global load (LDG...) or copy (LDGSTS...), got {opcode!r}")
    return next((_WIDTHS[p] for p in parts[1:] if p in _WIDTHS), 4)


def _registers(operand: str) -> set:
    """The registers an operand names: ``R24`` one, ``R4.64`` two (R4, R5); RZ none."""
    out = set()
    for m in _REGISTER.finditer(operand):
        out |= {int(m.group(1)) + k for k in range(2 if m.group(2) else 1)}
    return out


#: memory instructions whose data operand is as wide as the access: ``.64`` two registers, ``.128`` four (nvdisasm
#: prints only the first: ``LDG.E.128 R8, ...`` fills R8..R11, ``STS.128 [R2], R8`` stores them)
_LOADS = frozenset({"LD", "LDG", "LDL", "LDS", "LDC"})
_STORES = frozenset({"ST", "STG", "STL", "STS"})
_WIDE = {"64": 2, "128": 4}


def _widened(registers: set, instruction) -> set:
    """``registers`` (one data operand's) with the rest of a vector access's: R8 of an ``LDG.E.128`` -> R8..R11."""
    n = next((_WIDE[p] for p in instruction.opcode.split(".")[1:] if p in _WIDE), 1)
    return {r + k for r in registers for k in range(n)} if n > 1 and len(registers) == 1 else registers


def _reads_and_writes(instruction) -> tuple[set, set]:
    """``(registers read, registers written)`` of one SASS instruction: the first operand is written when it is
    a plain register (``R12``, ``R4.64``), and every other register operand is read; a store's or a compare's
    first operand (an address, a predicate) is not a register written. A vector load writes, and a vector store
    reads, all the registers of its data (``LDG.E.128 R8`` writes R8..R11): a later read of R9 waits for it too."""
    operands = instruction.text.split(None, 1)[1] if " " in instruction.text else ""
    parts = [p.strip() for p in operands.split(",")]
    if parts and re.fullmatch(r"R\d+(\.64)?", parts[0]):
        written = _registers(parts[0])
        if instruction.base in _LOADS:
            written = _widened(written, instruction)
        return set().union(*(_registers(p) for p in parts[1:])), written
    reads = set().union(*(_registers(p) for p in parts)) if parts else set()
    if instruction.base in _STORES and len(parts) > 1:
        reads |= _widened(_registers(parts[-1]), instruction)
    return reads, set()


def _is_kv_load(instruction) -> bool:
    """A load of K or V: an ``LDG`` with a width (``.128`` or ``.U16``), or a copy of K or V to shared memory
    (``LDGSTS``, cp.async); the 32-bit ``LDG.E`` of a block-table entry or a sequence length is not one (the decode
    rungs' caches are 16-bit)."""
    return instruction.base in ("LDG", "LDGSTS") and load_bytes(instruction.opcode) != 4


def _depbar_groups(instruction) -> int | None:
    """N of ``DEPBAR.LE SB0, N`` (cp.async.wait_group N: wait until at most N of the thread's copy groups are in
    flight), else None."""
    if instruction.base != "DEPBAR" or "SB0" not in instruction.text:
        return None
    return int(instruction.text.rsplit(",", 1)[1].strip(), 0)


@dataclass(frozen=True)
class Wait:
    """One place on a pass where a warp waits for a K/V load: ``index`` (position on the pass, 0 first), ``bytes``
    (per thread: the K/V bytes asked for and not yet used when it waits, the awaited load's included) and
    ``distance`` (instructions the warp issued since it issued the awaited load: its own work that hid the round
    trip) and ``trip`` (whether the warp stalls on a new round trip here: the load was issued after its last stall;
    otherwise the load was already in flight while the warp last stalled, so it landed then too)."""

    index: int
    bytes: int
    distance: int
    trip: bool


@dataclass(frozen=True)
class DecodeLoop:
    """One pass of a decode rung's key loop, counted from SASS (:func:`decode_loop`).

    ``instructions``: the fewest on a pass that issues all the loop's K/V loads (one issue slot each);
    ``counts``: that pass by opcode; ``kv_loads`` and ``kv_bytes``: its K/V loads per thread and their bytes;
    ``waits``: the :class:`Wait` of the pass, in order; ``steps``: the steps a pass holds (1; 2 where two register
    sets take turns, the prefetch rung; 1 page for a staging loop); ``stages``: whether the loop stages each page in shared
    memory through an inner loop of loads (the one-page-per-barrier rungs: a pass is one page, 32 loads per thread
    at d = 128 in fp16) or loads and absorbs one step's keys itself (a pass is one step)."""

    rung: str
    arch: str
    registers: int
    shared_bytes: int
    instructions: int
    counts: dict
    kv_loads: int
    kv_bytes: int
    waits: tuple
    stages: bool
    steps: int = 1

    def __post_init__(self):
        if self.rung not in DECODE_LOOP_RUNGS:
            raise ValueError(f"rung must be one of {list(DECODE_LOOP_RUNGS)}, got {self.rung!r}")
        for name in ("registers", "instructions", "kv_loads", "kv_bytes", "steps"):
            check_int(getattr(self, name), name, min=1)
        check_int(self.shared_bytes, "shared_bytes", min=0)
        if not self.waits or not all(isinstance(w, Wait) for w in self.waits):
            raise ValueError(f"waits must be a non-empty tuple of Wait, got {self.waits!r}")

    @property
    def in_flight(self) -> int:
        """Bytes per thread in flight when the warp waits, the most over the pass's waits."""
        return max(w.bytes for w in self.waits)

    @property
    def block_in_flight(self) -> int:
        """Bytes per block in flight when its warps wait: :attr:`in_flight` x :data:`THREADS`."""
        return self.in_flight * THREADS

    @property
    def step_instructions(self) -> float:
        """Instructions per step (or page): :attr:`instructions` over :attr:`steps`."""
        return self.instructions / self.steps

    @property
    def trips(self) -> int:
        """Round trips per pass: the waits at which the warp stalls on a load it issued since its last stall."""
        return sum(w.trip for w in self.waits)

    @property
    def load_to_use(self) -> int:
        """Fewest instructions a warp issues between a K/V load and its first use, over the pass's waits."""
        return min(w.distance for w in self.waits)

    @property
    def blocks_per_sm(self) -> int:
        """Blocks of the kernel an H200 SM holds at once (:func:`blocks_per_sm` of its registers and shared memory)."""
        return blocks_per_sm(self.registers, self.shared_bytes)

    @property
    def issue_ceiling(self) -> float | None:
        """The most bytes per second of K/V the whole GPU can read when every SM issues this loop's instructions
        every clock on all 4 schedulers: ``4 x SM_CLOCK_HZ x 132 x 32 x kv_bytes / instructions``. None for a loop
        that stages pages: its pass runs inner loops (the dot products over d) whose trip counts the SASS does not
        give, so its instruction count is not a page's."""
        if self.stages:
            return None
        return SUB_PARTITIONS * SM_CLOCK_HZ * H200_NUM_SMS * 32 * self.kv_bytes / self.instructions

    @property
    def classes(self) -> dict:
        return classes_of(self.counts)

    @property
    def step_classes(self) -> dict:
        """Instructions per step by :data:`DECODE_CLASSES` (in its order; a class with none is 0): the pass's
        :attr:`counts` over :attr:`steps`."""
        named = {op: name for name, ops in DECODE_CLASSES for op in ops}
        out = {name: 0.0 for name, _ in DECODE_CLASSES}
        for op, n in self.counts.items():
            out[named.get(op, DECODE_CLASSES[-1][0])] += n / self.steps
        return out


def _walk(instructions, path: list, passes: int = 2) -> tuple:
    """The :class:`Wait` of the last of ``passes`` passes along ``path`` (indices into ``instructions``; the passes
    before it only issue): loads land in issue order, so a wait for one retires it and every load issued before it,
    and a wait starts a new round trip when its load was issued after the warp last stalled. A copy to shared
    memory (``LDGSTS``, cp.async) fills no register: it joins the thread's open group, ``LDGDEPBAR`` (commit_group)
    closes the group, and ``DEPBAR.LE SB0, N`` (wait_group N) is the wait for every group but the N newest."""
    pending, waits = [], []                            # pending: [step issued, registers, bytes], oldest first
    groups, open_group = [], []                        # cp.async: closed groups (oldest first), the open one
    step, stalled = 0, -1
    for walk in range(passes):
        for position, i in enumerate(path):
            x = instructions[i]
            reads, writes = _reads_and_writes(x)
            hit = [k for k, (_, regs, _) in enumerate(pending) if regs & reads]
            keep = _depbar_groups(x)
            retired = groups[:max(0, len(groups) - keep)] if keep is not None else []
            if hit or any(retired):
                issued = max(([pending[hit[-1]][0]] if hit else []) + [s for g in retired for s, _ in g])
                trip = issued > stalled
                if walk == passes - 1:
                    flying = sum(b for _, _, b in pending) + sum(b for g in groups + [open_group] for _, b in g)
                    waits.append(Wait(position, flying, step - issued, trip))
                if trip:
                    stalled = step
            if hit:
                del pending[:hit[-1] + 1]
            del groups[:len(retired)]                  # (retired empty groups held nothing to wait for)
            if x.base == "LDGSTS" and _is_kv_load(x):
                open_group.append((step, load_bytes(x.opcode)))
            elif _is_kv_load(x):
                pending.append((step, writes, load_bytes(x.opcode)))
            elif x.base == "LDGDEPBAR":
                groups.append(open_group)
                open_group = []
            step += 1
    return tuple(waits)


def _load_loop(instructions, labels) -> tuple[int, int, bool]:
    """``(head, branch back, stages)`` of the key loop: the outermost loop that holds the most K/V loads; ``stages``
    when a loop inside it holds K/V loads too (the loop over a page's values that stages it in shared memory).
    ValueError when no loop holds one."""
    loops = [(h, b, sum(_is_kv_load(x) for x in instructions[h:b + 1])) for h, b in _back_edges(instructions, labels)]
    loops = [(h, b, n) for h, b, n in loops if n]
    if not loops:
        raise ValueError("no loop of the SASS holds a K/V load (an LDG.E.128 or LDG.E.U16)")
    most = max(n for _, _, n in loops)
    h, b, _ = max((s for s in loops if s[2] == most), key=lambda s: (s[1] - s[0], -s[0]))
    return h, b, any(h <= h2 and b2 <= b and (h2, b2) != (h, b) for h2, b2, _ in loops)


def decode_loop(rung, arch: str = "sm_90") -> DecodeLoop:
    """The :class:`DecodeLoop` of decode rung ``rung`` (a name in :data:`DECODE_LOOP_RUNGS` or its
    :class:`lessons.gpu.ladder.Rung`; fp16, d = 128, 32 query heads on 8 KV heads, pages of 16) compiled by NVRTC
    for ``arch`` (``"sm_80"`` or ``"sm_90"``). The loop is the outermost one holding the most K/V loads of the
    rung's entry point (:func:`lessons.gpu.ladder.decode_rung_entry`); the pass counted is the shortest through it
    that issues all of them (:func:`lessons.gpu.sass.interior_pass`). TypeError for a rung of another type;
    ValueError for a rung off the list, another arch, or SASS without such a loop or without a wait on the pass;
    the errors of :func:`lessons.gpu.sass.disassemble` otherwise."""
    from lessons.gpu import ladder
    from lessons.gpu.compile import compile_kernel

    name = rung.name if isinstance(rung, ladder.Rung) else rung
    if not isinstance(name, str):
        raise TypeError(f"rung must be a decode rung's name or its Rung, got {type(rung).__name__}")
    if name not in DECODE_LOOP_RUNGS:
        raise ValueError(f"rung must be one of {list(DECODE_LOOP_RUNGS)}, got {name!r}")
    if not isinstance(arch, str) or arch not in ("sm_80", "sm_90"):
        raise ValueError(f"arch must be 'sm_80' or 'sm_90', got {arch!r}")
    build, entry = ladder.decode_rung_build(name), ladder.decode_rung_entry(name)
    resources = compile_kernel(build, arch).resources[entry]
    instructions, labels = parse_sass(disassemble(build, arch, entry))
    first, last, stages = _load_loop(instructions, labels)
    loads = sum(_is_kv_load(x) for x in instructions[first:last + 1])
    if stages:                                         # one page: 2 x 16 x 128 values over the block's threads
        widths = {load_bytes(x.opcode) for x in instructions[first:last + 1] if _is_kv_load(x)}
        if len(widths) != 1:
            raise ValueError(f"{name} ({arch}): the page loop's K/V loads have several widths {sorted(widths)}")
        loads = 2 * PAGE_TOKENS * 128 * 2 // THREADS // widths.pop()
    path = interior_pass(instructions, labels, first, last, loads, is_copy=_is_kv_load)
    if any(instructions[i].base == "LDGSTS" for i in path):
        # a ring of ASYNC_STAGES steps in shared memory: a step's copies are waited for ASYNC_STAGES - 1 steps after
        # they were issued, so a pass is ASYNC_STAGES steps (one through each slot of the ring), and its waits are
        # read once every step has been through each slot
        path = path * dict(build.defines)["ASYNC_STAGES"]
    waits = _walk(instructions, path)
    if not waits:
        raise ValueError(f"{name} ({arch}): no instruction on the pass reads a K/V load's register")
    on_path = [instructions[i] for i in path]
    kv_loads = sum(_is_kv_load(x) for x in on_path)
    steps = 1
    if not stages:                                     # a step: UNROLL = 4 keys' K and V, one 16-byte load each
        if loads % STEP_LOADS:
            raise ValueError(f"{name} ({arch}): the key loop holds {loads} K/V loads, not whole steps of {STEP_LOADS}")
        steps = kv_loads // STEP_LOADS
    return DecodeLoop(name, arch, resources.registers, resources.smem_bytes + resources.dynamic_smem_bytes, len(path),
                      dict(Counter(x.base for x in on_path)), kv_loads,
                      sum(load_bytes(x.opcode) for x in on_path if _is_kv_load(x)), waits, stages, steps)


#: per SM of compute capability 8.0 and 9.0: registers, the unit a warp's registers are allocated in, threads,
#: blocks, and the shared memory a block may use (sm_90: 228 KiB per SM, 1 KiB of it reserved per block)
_SM_LIMITS = dict(registers=65536, register_unit=256, threads=2048, blocks=32, shared=228 * 1024, reserved=1024)


def blocks_per_sm(registers: int, shared_bytes: int, threads: int = THREADS) -> int:
    """Blocks of ``threads`` threads (a multiple of 32) using ``registers`` per thread and ``shared_bytes`` of shared
    memory that one H200 (sm_90) SM holds at once: the least of what its 65,536 registers (allocated per warp in
    units of 256), 2,048 threads, 32 blocks and 228 KiB of shared memory (1 KiB reserved per block) allow (CUDA C++
    Programming Guide, technical specifications per compute capability; the occupancy calculator's rules).
    TypeError / ValueError naming the argument for a non-integer, a negative or zero count, or ``threads`` that is not
    a multiple of 32 up to 1024."""
    registers = check_int(registers, "registers", min=1, max=255)
    shared_bytes = check_int(shared_bytes, "shared_bytes", min=0, max=227 * 1024)
    threads = check_int(threads, "threads", min=32, max=1024)
    if threads % 32:
        raise ValueError(f"threads must be a multiple of 32 (whole warps), got {threads}")
    s = _SM_LIMITS
    warps = threads // 32
    per_warp = -(-registers * 32 // s["register_unit"]) * s["register_unit"]
    limits = [s["registers"] // (per_warp * warps), s["threads"] // threads, s["blocks"]]
    if shared_bytes:
        limits.append(s["shared"] // (shared_bytes + s["reserved"]))
    return min(limits)


def decode_loop_table(rungs=DECODE_LOOP_RUNGS, arch: str = "sm_90", copy_rate: float | None = None) -> list[dict]:
    """One dict per rung of :func:`decode_loop`: rung, arch, registers, blocks_per_sm, instructions (per pass), steps
    (per pass), step_instructions, kv_bytes (per thread and pass), waits and trips (how many per pass), in_flight (bytes per thread at a wait), block_in_flight and
    sm_in_flight (bytes, x 128 threads, x blocks per SM), load_to_use (instructions), classes (the pass by
    :data:`lessons.gpu.sass.ISSUE_CLASSES`), step_classes (a step by :data:`DECODE_CLASSES`), issue_ceiling (bytes/s or None) and, with ``copy_rate`` (bytes/s),
    ceiling_x_copy (the ceiling over it, or None). ``rungs``: one name or a sequence of names or of :class:`DecodeLoop`
    (read on ``arch`` already; ``arch`` is then not used). TypeError / ValueError naming the argument otherwise; the
    errors of :func:`decode_loop`."""
    rungs = (rungs,) if isinstance(rungs, (str, DecodeLoop)) else rungs
    if not isinstance(rungs, (tuple, list)) or not rungs:
        raise TypeError(f"rungs must be a decode rung's name or a non-empty sequence of them, got {rungs!r}")
    copy = None if copy_rate is None else check_positive_real(copy_rate, "copy_rate", "number of bytes/s")
    out = []
    for name in rungs:
        t = name if isinstance(name, DecodeLoop) else decode_loop(name, arch)
        ceiling = t.issue_ceiling
        out.append(dict(rung=t.rung, arch=t.arch, registers=t.registers, blocks_per_sm=t.blocks_per_sm,
                        instructions=t.instructions, steps=t.steps, step_instructions=t.step_instructions,
                        kv_bytes=t.kv_bytes, waits=len(t.waits), trips=t.trips,
                        in_flight=t.in_flight,
                        block_in_flight=t.block_in_flight, sm_in_flight=t.block_in_flight * t.blocks_per_sm,
                        load_to_use=t.load_to_use, classes=t.classes, step_classes=t.step_classes,
                        issue_ceiling=ceiling,
                        ceiling_x_copy=None if copy is None or ceiling is None else ceiling / copy))
    return out


_TABLE_KEYS = ("rung", "registers", "blocks_per_sm", "instructions", "steps", "kv_bytes", "trips", "in_flight",
               "block_in_flight", "sm_in_flight", "load_to_use", "issue_ceiling")


def decode_loop_markdown(table=None) -> str:
    """A markdown table of :func:`decode_loop_table` rows (default: every decode rung on sm_90): per rung its
    registers and blocks per SM, the pass's instructions and K/V bytes per thread, its waits, the bytes in flight
    at a wait (per thread, block and SM), the instructions between a load and its use, and the issue ceiling in
    TB/s. TypeError naming ``table`` for rows of another kind."""
    table = decode_loop_table() if table is None else table
    _check_table(table, "decode_loop_table", _TABLE_KEYS)
    lines = ["| rung | registers | blocks / SM | a pass is | K/V bytes per thread and pass | round trips per pass "
             "| in flight at a wait: per thread / block / SM | instructions from load to use | instructions per pass "
             "| issue ceiling |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in table:
        staged = r["issue_ceiling"] is None
        ceiling = "none counted" if staged else f"{r['issue_ceiling'] / 1e12:.2f} TB/s"
        what = "one page" if staged else "one step" if r["steps"] == 1 else f"{r['steps']} steps"
        lines.append(f"| `{r['rung']}` | {r['registers']} | {r['blocks_per_sm']} | {what} "
                     f"| {r['kv_bytes']} | {r['trips']} | {r['in_flight']} B / {r['block_in_flight']:,} B / "
                     f"{r['sm_in_flight'] / 1024:.1f} KiB | {r['load_to_use']} | "
                     f"{'not counted (inner loops over d)' if staged else r['instructions']} | {ceiling} |")
    return "\n".join(lines)


def round_trips(loops: dict, rows=None, *, num_heads: int = 32, heads_per_block: int = 4) -> list[dict]:
    """Little's law on the recorded decode rows (default :func:`lessons.gpu.ladder.decode_recorded_rows`) of the
    rungs that stage a page at a time: ``loops`` maps rung names to their :class:`DecodeLoop`, and rows of the rungs
    whose loop stages pages (``paged_decode``, ``flash_decoding``) are read. A row is kept when all its blocks
    (``num_heads / heads_per_block x num_seqs x num_splits``) run at once (one wave: at most ``132 x
    blocks_per_sm``); then each block's time is the kernel's, and per block

    * ``page_seconds`` = the row's seconds over the pages a block reads (``ceil(ceil(seq_len / 16) / splits)``);
    * ``round_trip_seconds`` = page_seconds over the round trips of a page (:attr:`DecodeLoop.trips`): one round
      trip takes at most this long (the page's other work shares the time).

    Each dict: rung, variant, num_seqs, seq_len, num_splits, blocks, block_rate (K/V bytes per second per block),
    trips_per_page, page_seconds, round_trip_seconds. Rows of a rung that ``loops`` lacks or whose loop does not
    stage pages are left out. TypeError for ``loops`` of another kind; ValueError naming the argument for a
    non-positive count or ``heads_per_block`` that does not divide ``num_heads``."""
    from lessons.gpu.ladder import decode_recorded_rows

    if not isinstance(loops, dict) or not all(isinstance(v, DecodeLoop) for v in loops.values()):
        raise TypeError(f"loops must be a dict of rung name -> DecodeLoop, got {loops!r}")
    num_heads = check_int(num_heads, "num_heads", min=1)
    heads_per_block = check_int(heads_per_block, "heads_per_block", min=1)
    if num_heads % heads_per_block:
        raise ValueError(f"heads_per_block must divide num_heads ({num_heads}), got {heads_per_block}")
    rows = decode_recorded_rows() if rows is None else rows
    out = []
    for r in rows:
        loop = loops.get(r["name"])
        if loop is None or not loop.stages:
            continue
        splits = r["num_splits"]
        blocks = _one_wave(loop, r, num_heads, heads_per_block)
        if blocks is None:
            continue
        pages = math.ceil(math.ceil(r["seq_len"] / PAGE_TOKENS) / splits)
        seconds = r["ms"] / 1e3
        out.append(dict(rung=r["name"], variant=r["variant"], num_seqs=r["num_seqs"], seq_len=r["seq_len"],
                        num_splits=splits, blocks=blocks, block_rate=r["kv_bytes"] / seconds / blocks,
                        trips_per_page=loop.trips, page_seconds=seconds / pages,
                        round_trip_seconds=seconds / pages / loop.trips))
    return out


_TRIP_KEYS = ("rung", "variant", "num_seqs", "seq_len", "num_splits", "blocks", "block_rate", "trips_per_page",
              "page_seconds", "round_trip_seconds")


def round_trips_markdown(table) -> str:
    """A markdown table of :func:`round_trips` rows: rung (and its split count), shape, blocks, K/V read per block
    (GB/s), time per page (µs) and per round trip (µs). TypeError naming ``table`` for rows of another kind."""
    _check_table(table, "round_trips", _TRIP_KEYS)
    lines = ["| rung | sequences x tokens | splits | blocks (all at once) | K/V read per block | a page takes "
             "| round trips per page | a round trip takes at most |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in table:
        lines.append(f"| `{r['rung']}` | {r['num_seqs']} x {r['seq_len']} | {r['num_splits']} | {r['blocks']} | "
                     f"{r['block_rate'] / 1e9:.2f} GB/s | {r['page_seconds'] * 1e6:.2f} \u00b5s | {r['trips_per_page']} | "
                     f"{r['round_trip_seconds'] * 1e6:.3f} \u00b5s |")
    return "\n".join(lines)


def little_rate(bytes_in_flight: float, round_trip_seconds: float) -> float:
    """Little's law: bytes per second read with ``bytes_in_flight`` bytes always asked for and each round trip
    taking ``round_trip_seconds``: their quotient (Little 1961). ValueError naming the argument for a value that is
    not a positive finite number."""
    return (check_positive_real(bytes_in_flight, "bytes_in_flight", "number of bytes")
            / check_positive_real(round_trip_seconds, "round_trip_seconds", "number of seconds"))


def _one_wave(loop: DecodeLoop, row: dict, num_heads: int, heads_per_block: int) -> int | None:
    """The blocks of a recorded row when they all run at once on 132 SMs, else None."""
    blocks = num_heads // heads_per_block * row["num_seqs"] * row["num_splits"]
    return blocks if blocks <= H200_NUM_SMS * loop.blocks_per_sm else None


def little_plot(loops: dict, rows=None, round_trip_seconds: float | None = None) -> dict:
    """What :func:`lessons.views.decode_loads.little_figure` draws, for the rungs of ``loops`` (rung name ->
    :class:`DecodeLoop`) and the recorded rows (default :func:`lessons.gpu.ladder.decode_recorded_rows`):

    * ``round_trip``: ``round_trip_seconds``, default the median of :func:`round_trips` over the rows;
    * ``points``: rung -> list of (blocks, K/V bytes per second) of its rows whose blocks all run at once;
    * ``lines``: one dict per distinct :attr:`DecodeLoop.block_in_flight`: bytes (per block), rungs (those with
      it), blocks and rates (bytes per second): Little's law, ``blocks x bytes / round_trip``, from 1 block to
      all the GPU holds of the rung that fits most (132 x blocks per SM);
    * ``roofs``: label -> bytes per second: the recorded copy rate, and each loop's issue ceiling (one of two within
      2% of each other: the first).

    TypeError for ``loops`` of another kind; ValueError when no row gives a round trip and none is given."""
    from lessons.gpu.ladder import decode_recorded_rows, recorded_copy_rate

    if not isinstance(loops, dict) or not loops or not all(isinstance(v, DecodeLoop) for v in loops.values()):
        raise TypeError(f"loops must be a non-empty dict of rung name -> DecodeLoop, got {loops!r}")
    rows = decode_recorded_rows() if rows is None else rows
    if round_trip_seconds is None:
        trips = [r["round_trip_seconds"] for r in round_trips(loops, rows)]
        if not trips:
            raise ValueError("no recorded row of a page-staging rung runs in one wave: give round_trip_seconds")
        round_trip_seconds = statistics.median(trips)
    round_trip = check_positive_real(round_trip_seconds, "round_trip_seconds", "number of seconds")
    points, by_bytes = {}, {}
    for name, loop in loops.items():
        found = [(b, r["kv_bytes"] / (r["ms"] / 1e3)) for r in rows if r["name"] == name
                 for b in [_one_wave(loop, r, 32, 4)] if b is not None]
        if found:
            points[name] = sorted(found)
        by_bytes.setdefault(loop.block_in_flight, []).append(name)
    lines = []
    for nbytes, names in sorted(by_bytes.items()):
        most = max(H200_NUM_SMS * loops[n].blocks_per_sm for n in names)
        blocks = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b < most] + [most]
        lines.append(dict(bytes=nbytes, rungs=tuple(names), blocks=blocks,
                          rates=[b * nbytes / round_trip for b in blocks]))
    copy = recorded_copy_rate(rows)
    roofs = {} if copy is None else {"device copy rate (recorded)": copy}
    for name, loop in loops.items():
        near = [r for r in roofs.values() if abs(r / loop.issue_ceiling - 1) < 0.02] if loop.issue_ceiling else True
        if not near:                                   # a ceiling within 2% of one drawn already would hide behind it
            roofs[f"issue ceiling of {name}"] = loop.issue_ceiling
    return dict(round_trip=round_trip, points=points, lines=lines, roofs=roofs)


#: what :func:`measured_profile` reads from an Nsight Compute report: its name -> the metric's name in the report
PROFILE_METRICS = {"issued_per_scheduler": "Issued Warp Per Scheduler", "active_warps": "Active Warps Per Scheduler",
                   "dram_pct": "DRAM Throughput", "sm_ghz": "SM Frequency", "duration_ms": "Duration",
                   "cycles_per_issue": "Warp Cycles Per Issued Instruction"}
_STALL = re.compile(r"each warp of this (?:workload|kernel) spends ([0-9.]+) cycles being stalled (.+?)\. .*?"
                    r"This stall type represents about ([0-9.]+)% of the total average of ([0-9.]+) cycles", re.S)


def top_stall(text: str) -> dict | None:
    """The stall an Nsight Compute report's Warp State Statistics rule names as the largest (its advice text: "each
    warp of this workload spends X cycles being stalled <why>. ... This stall type represents about Y% of the total
    average of Z cycles between issuing two instructions"): dict why (str), cycles, share (Y / 100) and
    cycles_per_issue (Z); None when the report holds no such text (the rule names a stall only where it matters).
    TypeError for a ``text`` that is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"text must be Nsight Compute's report (a str), got {type(text).__name__}")
    flat = " ".join(line.strip() for line in text.splitlines())
    m = _STALL.search(flat)
    if m is None:
        return None
    return dict(why=m.group(2), cycles=float(m.group(1)), share=float(m.group(3)) / 100,
                cycles_per_issue=float(m.group(4)))
_SECTION_LINE = re.compile(r"^\s+(\S.*?)\s{2,}(?:(\S+)\s+)?(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")
_TO_UNIT = {("Duration", "us"): 1e-3, ("Duration", "ns"): 1e-6, ("Duration", "s"): 1e3, ("SM Frequency", "Mhz"): 1e-3}


def parse_ncu_sections(text: str) -> dict:
    """``{metric name: (unit, value)}`` from the section tables of an Nsight Compute text report (lines such as
    ``    Issued Warp Per Scheduler                        0.42`` or ``    Duration   ms   1.48``: a name, a unit where
    there is one ("" otherwise), a value with thousands separators); where a name occurs twice the first is kept.
    TypeError for a ``text`` that is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"text must be Nsight Compute's report (a str), got {type(text).__name__}")
    out = {}
    for line in text.splitlines():
        m = _SECTION_LINE.match(line)
        if m and not m.group(1).startswith(("-", "==")):
            out.setdefault(m.group(1), (m.group(2) or "", float(m.group(3).replace(",", ""))))
    return out


def measured_profile(rung, folder: Path | None = None) -> dict | None:
    """What Nsight Compute measured on one launch of decode rung ``rung`` (a name in :data:`DECODE_LOOP_RUNGS`), from
    ``folder / f"ncu_{rung}.txt"`` (default: the recorded run's ``ncu`` folder, as ``scripts/gpu_check.sh`` writes
    it): the values of :data:`PROFILE_METRICS` (``sm_ghz`` in GHz, ``duration_ms`` in ms, ``dram_pct`` in % of the
    peak, ``issued_per_scheduler`` the share of clocks a scheduler issued an instruction, ``active_warps`` per
    scheduler, ``cycles_per_issue`` a warp's cycles between two of its instructions) and ``top_stall`` (:func:`top_stall`,
    or None). None when the run holds no such file (the recorded run may predate it). ValueError naming the file when
    it lacks one of them or for a rung off the list."""
    from lessons.gpu.recorded import RECORDED_DIR

    if not isinstance(rung, str) or rung not in DECODE_LOOP_RUNGS:
        raise ValueError(f"rung must be one of {list(DECODE_LOOP_RUNGS)}, got {rung!r}")
    path = Path(RECORDED_DIR / "ncu" if folder is None else folder) / f"ncu_{rung}.txt"
    if not path.is_file():
        return None
    text = path.read_text(errors="replace")
    found = parse_ncu_sections(text)
    missing = [name for name in PROFILE_METRICS.values() if name not in found]
    if missing:
        raise ValueError(f"{path} holds no value for {missing}: not an ncu report of the sections gpu_check.sh asks for")
    out = {}
    for key, name in PROFILE_METRICS.items():
        unit, value = found[name]
        out[key] = value * _TO_UNIT.get((name, unit), 1.0)
    out["top_stall"] = top_stall(text)
    return out


#: K/V bytes of the launch ``scripts/profile_rung.py`` profiles for a decode rung: 64 sequences of 4096 tokens, 8 KV
#: heads, d = 128, fp16, K and V
PROFILED_KV_BYTES = 64 * 4096 * 8 * 128 * 2 * 2


def profile_markdown(loops: dict, profiles: dict) -> str:
    """A markdown table setting each profiled decode rung's Nsight Compute figures (``profiles``: rung name -> the dict
    of :func:`measured_profile`, or None where not profiled) beside its SASS counts (``loops``: rung name ->
    :class:`DecodeLoop` whose loop is a whole step): the K/V read rate of the launch (:data:`PROFILED_KV_BYTES` over
    its duration), the share of clocks a scheduler issued, the rate the interior pass would read at that issue rate
    and the measured clock (``issued x 4 x clock x 132 x 32 x kv_bytes / instructions``; near the measured rate when
    the launch issues about the interior pass per step), DRAM throughput, active warps per scheduler, a warp's cycles
    between two issues and the largest stall the report names (:func:`top_stall`).
    TypeError for arguments of another kind; ValueError naming a rung with no loop or a staging loop."""
    if not isinstance(loops, dict) or not isinstance(profiles, dict):
        raise TypeError(f"loops and profiles must be dicts keyed by rung name, got {type(loops).__name__} and "
                        f"{type(profiles).__name__}")
    lines = ["| rung | K/V read (launch) | issued per scheduler and clock | the interior pass at that rate "
             "| DRAM throughput | active warps per scheduler | a warp's cycles between issues | the largest stall |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, prof in profiles.items():
        loop = loops.get(name)
        if not isinstance(loop, DecodeLoop) or loop.stages:
            raise ValueError(f"loops[{name!r}] must be the DecodeLoop of a rung whose loop is a whole step")
        if prof is None:
            lines.append(f"| `{name}` | not profiled | | | | | | |")
            continue
        rate = PROFILED_KV_BYTES / (prof["duration_ms"] / 1e3)
        at_issue = prof["issued_per_scheduler"] * loop.issue_ceiling * prof["sm_ghz"] * 1e9 / SM_CLOCK_HZ
        stall = prof.get("top_stall")
        said = "none named" if not stall else f"{stall['share']:.0%}: stalled {stall['why']}"
        lines.append(f"| `{name}` | {rate / 1e12:.2f} TB/s | {prof['issued_per_scheduler']:.2f} | {at_issue / 1e12:.2f} TB/s "
                     f"| {prof['dram_pct']:.0f}% | {prof['active_warps']:.1f} | {prof['cycles_per_issue']:.1f} | {said} |")
    return "\n".join(lines)

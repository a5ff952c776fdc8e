"""The Hopper rungs' key tile, read from SASS: three pipes a consumer warp must keep busy.

A Hopper rung's products are ``wgmma`` (SASS ``HGMMA``): one instruction of a warpgroup (4 warps, one on each
of the SM's 4 sub-partitions) multiplies a 64 x N x 16 block on all 4 tensor cores at once, so a tile's
products take few issue slots. What is left for the consumer warps is the softmax between the two products,
and that runs on two other pipes of the same sub-partition:

* the **tensor cores**: an H100/H200 SM does 4096 dense 16-bit FLOPs per clock, so a warpgroup's two products of
  a key tile (S = Q K_j^T and O += P_j V_j, each ``64 x block_k x d`` multiply-adds) take
  ``4 x 64 x block_k x d / 4096`` clocks, on every sub-partition at once (NVIDIA H100 white paper);
* the **MUFU** (special function unit) that computes ``exp2``: 16 results per clock per SM, 4 per sub-partition,
  so one warp instruction holds it for :data:`MUFU_CLOCKS` = 8 clocks (CUDA C++ Programming Guide, arithmetic
  instruction throughput, compute capability 9.0; Shah et al. 2024 (FlashAttention-3), Sec. 3.1: 3.9 TFLOP/s of
  special functions against 989 of matrix products);
* the **issue slot**: the sub-partition's scheduler issues one instruction per clock, every ``FMNMX``, ``FADD``,
  ``FMUL``, conversion, address and branch of the tile as well as the ``MUFU`` and ``HGMMA`` themselves.

Per key tile and consumer warp this gives three times in clocks: ``tensor_clocks`` (T), ``mufu_clocks`` (M) and
``issue_clocks`` (I, the instructions of the cheapest interior pass through the key-tile loop: with the lazy
rescale, a tile on which no row of the warp moves its max, so no ``exp2`` for alpha and no multiplies of ``l`` and
``o``; a tile where one moves adds 2 ``MUFU`` and the ``d / 2`` multiplies of ``o``). The softmax part of a tile takes at least
``S = max(M, I)``. How much of T the tile's time is depends on the order of the steps:

* **plain order** (``wgmma``): S_j, wait, softmax, P_j V_j, wait: nothing of one warpgroup overlaps, ``T + S`` per
  tile; the same when the two consumer warpgroups run in step, since they share the tensor cores and the issue
  slots: at most ``T / (T + S)`` of the tensor peak;
* **softmax overlapped with P V** (``wgmma_overlap``, FlashAttention-3 Alg. 2): ``T/2 + max(S, T/2)`` per tile
  (:func:`lessons.gpu.hopper.overlap_schedule` with these times), with the two warpgroups in step;
* **consumers taking turns** (``wgmma_pingpong``): one warpgroup's softmax runs while the other's products do, so
  nothing stops all three pipes being busy at once: ``max(T, S)``, the bound of any order.

These are ceilings, not predictions: latency, the barriers that hand K/V tiles from the producer warpgroup, the
first and last tiles and the epilogue all come on top. The counts are what the installed NVRTC's ptxas makes for
``sm_90a``.
"""
from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from dataclasses import dataclass

from lessons.core.checks import check_int, check_positive_real
from lessons.cost.traffic import H200
from lessons.gpu.ladder import HOPPER_RUNGS
from lessons.gpu.sass import _back_edges, _rung_among, _rungs_and_ds, classes_of, disassemble, interior_pass, \
    parse_sass

__all__ = ["HOPPER_RUNGS", "SM_TENSOR_FLOPS_PER_CLOCK", "MUFU_CLOCKS", "SUB_PARTITIONS", "ORDERS", "WarpgroupTile",
           "hgmma_flops", "warpgroup_tile", "warpgroup_table", "warpgroup_markdown", "overlap_times"]


#: dense 16-bit tensor FLOPs per clock of one sm_90 SM: 989 TFLOP/s over 132 SMs at 1.83 GHz (H100 white paper)
SM_TENSOR_FLOPS_PER_CLOCK = 4096

#: sub-partitions (warp schedulers) per SM; a warpgroup's 4 warps sit one on each
SUB_PARTITIONS = 4

#: clocks one warp's ``MUFU`` holds its sub-partition's special function unit: 32 lanes at 4 results per clock
#: (16 per SM per clock on compute capability 8.0-9.0)
MUFU_CLOCKS = 8

#: the order of a rung's steps, and how a key tile's time follows from T (tensor clocks) and S (softmax clocks)
ORDERS = {"wgmma": "plain: T + S", "wgmma_overlap": "softmax overlapped with P V: T/2 + max(S, T/2)",
          "wgmma_pingpong": "consumers taking turns: max(T, S)"}

_HGMMA = re.compile(r"^HGMMA\.([1-9]\d*)x([1-9]\d*)x([1-9]\d*)\.")


def hgmma_flops(opcode: str) -> int:
    """FLOPs of one ``HGMMA`` of a warpgroup, ``2 x M x N x K`` read from its SASS opcode
    (``"HGMMA.64x128x16.F32"`` -> 262144). TypeError for a non-str ``opcode``; ValueError for an opcode that is not
    an ``HGMMA`` with its shape. Source: PTX ISA 8.x, ``wgmma.mma_async`` (shapes m64nNk16 for 16-bit inputs)."""
    if not isinstance(opcode, str):
        raise TypeError(f"opcode must be a str such as 'HGMMA.64x128x16.F32', got {type(opcode).__name__}")
    m = _HGMMA.match(opcode)
    if not m:
        raise ValueError(f"opcode must be an HGMMA with its M x N x K shape, such as 'HGMMA.64x128x16.F32', "
                         f"got {opcode!r}")
    a, b, c = (int(x) for x in m.groups())
    return 2 * a * b * c


@dataclass(frozen=True)
class WarpgroupTile:
    """What one consumer warp of a Hopper rung issues for one interior key tile, counted from SASS
    (:func:`warpgroup_tile`).

    ``block_q``, ``block_k``: the rung's tiles; ``consumers``: consumer warpgroups per block (64 query rows each);
    ``hgmma``: ``HGMMA`` on the pass (each a warpgroup's instruction); ``flops``: their FLOPs per warpgroup, from
    their shapes (:func:`hgmma_flops`), equal to the hand count ``4 x 64 x block_k x d``; ``instructions``: the
    fewest instructions on a pass through the key-tile loop that issues all of them (:func:`interior_pass`), one
    issue slot each; ``counts``: that pass by base opcode."""

    rung: str
    d: int
    block_q: int
    block_k: int
    consumers: int
    hgmma: int
    flops: int
    instructions: int
    counts: dict

    def __post_init__(self):
        if self.rung not in ORDERS:
            raise ValueError(f"rung must be one of {list(ORDERS)} (the Hopper rungs), got {self.rung!r}")
        for name in ("d", "block_q", "block_k", "consumers", "flops"):
            check_int(getattr(self, name), name, min=1)
        for name in ("hgmma", "instructions"):
            check_int(getattr(self, name), name, min=0)
        if not isinstance(self.counts, dict):
            raise TypeError(f"counts must be a dict of base opcode -> count, got {type(self.counts).__name__}")

    @property
    def exps(self) -> int:
        """``exp2`` of P per thread and tile by hand: ``64 x block_k`` scores over a warpgroup's 128 threads."""
        return 64 * self.block_k // 128

    @property
    def mufu(self) -> int:
        return self.counts.get("MUFU", 0)

    @property
    def tensor_clocks(self) -> float:
        """T: clocks of the warpgroup's two products on its sub-partition's tensor core (``flops / 4096``)."""
        return self.flops / SUB_PARTITIONS / (SM_TENSOR_FLOPS_PER_CLOCK / SUB_PARTITIONS)

    @property
    def mufu_clocks(self) -> int:
        """M: clocks the warp's ``MUFU`` hold the special function unit (:data:`MUFU_CLOCKS` each)."""
        return MUFU_CLOCKS * self.mufu

    @property
    def issue_clocks(self) -> int:
        """I: the pass's instructions, one issue slot each."""
        return self.instructions

    @property
    def softmax_clocks(self) -> int:
        """S = max(M, I): the least time the CUDA-core part of a tile takes on its sub-partition."""
        return max(self.mufu_clocks, self.issue_clocks)

    @property
    def shares(self) -> dict:
        """The most of the tensor peak each order allows (see the module's text): ``plain`` ``T / (T + S)``,
        ``overlap`` ``T / (T/2 + max(S, T/2))``, ``turns`` ``T / max(T, S)``."""
        t, s = self.tensor_clocks, self.softmax_clocks
        return dict(plain=t / (t + s), overlap=t / (t / 2 + max(s, t / 2)), turns=t / max(t, s))

    @property
    def share(self) -> float:
        """The share of :attr:`shares` of this rung's own order (:data:`ORDERS`)."""
        return self.shares[{"wgmma": "plain", "wgmma_overlap": "overlap", "wgmma_pingpong": "turns"}[self.rung]]

    @property
    def bound(self) -> str:
        """The longest of the three pipes: ``"tensor"`` when T >= S (the softmax can hide beside the products), else
        the one that sets S, ``"MUFU"`` or ``"issue"``."""
        if self.tensor_clocks >= self.softmax_clocks:
            return "tensor"
        return "MUFU" if self.mufu_clocks > self.issue_clocks else "issue"

    @property
    def classes(self) -> dict:
        return classes_of(self.counts)


def _key_tile_loop(instructions, labels, flops: int) -> tuple[int, int]:
    """``(head, branch back)`` of the smallest loop whose ``HGMMA`` add up to ``flops`` (one key tile's products).
    The loops that wait on an mbarrier branch back from far below and span many tiles' products; they are larger
    or hold other sums. ValueError when no loop does."""
    fits = [(h, b) for h, b in _back_edges(instructions, labels)
            if sum(hgmma_flops(x.opcode) for x in instructions[h:b + 1] if x.base == "HGMMA") == flops]
    if not fits:
        raise ValueError(f"no loop of the SASS holds HGMMA of {flops} FLOPs (one key tile's two products)")
    return min(fits, key=lambda hb: (hb[1] - hb[0], hb[0]))


def warpgroup_tile(rung, d: int = 64) -> WarpgroupTile:
    """The :class:`WarpgroupTile` of Hopper rung ``rung`` (:data:`HOPPER_RUNGS`, a name or a
    :class:`lessons.gpu.ladder.Rung`) at head dim ``d`` (a key of :data:`lessons.gpu.source.WGMMA_CONFIGS`: 64 or
    128), from the SASS NVRTC makes for ``sm_90a``. The key-tile loop is the smallest loop whose ``HGMMA`` add up to
    one tile's two products (``4 x 64 x block_k x d`` FLOPs per warpgroup); the pass counted is the shortest through
    it that issues every one of them (:func:`interior_pass`): an interior tile, with no mask, no retried mbarrier
    wait. ValueError for a rung off the list, another ``d``, or SASS that does not match the hand counts (no such
    loop, fewer ``MUFU`` on the pass than the tile's exponentials); the errors of :func:`disassemble` otherwise.
    Source: Shah et al. 2024 (FlashAttention-3), Sec. 3.1-3.2."""
    from lessons.gpu import ladder, source

    r = _rung_among(rung, HOPPER_RUNGS, "Hopper (wgmma)")
    d = check_int(d, "d")
    if d not in source.WGMMA_CONFIGS:
        raise ValueError(f"d must be one of {sorted(source.WGMMA_CONFIGS)} (the Hopper rungs' head dims), got {d}")
    block_q, block_k = source.WGMMA_CONFIGS[d]
    build, entry = ladder.rung_build(r, d), ladder.rung_entry(r, d)
    instructions, labels = parse_sass(disassemble(build, build.arch, entry))
    flops = 4 * 64 * block_k * d
    first, last = _key_tile_loop(instructions, labels, flops)
    products = sum(x.base == "HGMMA" for x in instructions[first:last + 1])
    path = interior_pass(instructions, labels, first, last, products, is_copy=lambda x: x.base == "HGMMA")
    counts = Counter(instructions[i].base for i in path)
    tile = WarpgroupTile(r.name, d, block_q, block_k, block_q // 64, counts["HGMMA"],
                         sum(hgmma_flops(instructions[i].opcode) for i in path if instructions[i].base == "HGMMA"),
                         len(path), dict(counts))
    if tile.flops != flops:
        raise ValueError(f"{r.name} at d={d}: the interior pass's HGMMA do {tile.flops} FLOPs, not the {flops} of a "
                         f"64 x {block_k} tile")
    if tile.mufu < tile.exps:
        raise ValueError(f"{r.name} at d={d}: the interior pass issues {tile.mufu} MUFU, fewer than the {tile.exps} "
                         f"exponentials of P a thread computes per tile")
    return tile


def warpgroup_table(rungs=HOPPER_RUNGS, ds=(64, 128), peak_flops: float | None = None) -> list[dict]:
    """One dict per (rung, d) of :func:`warpgroup_tile`: rung, d, block_q, block_k, hgmma, instructions, mufu,
    classes (instructions by :data:`lessons.gpu.sass.ISSUE_CLASSES`), tensor_clocks, mufu_clocks, issue_clocks,
    softmax_clocks (clocks per consumer warp and key tile), bound (the longest pipe), order (:data:`ORDERS`),
    shares (each order's share of the tensor peak), share (the rung's own order's, its two consumers in step),
    ceiling (FLOP/s: ``share x peak_flops``; default the H200's dense 16-bit peak, 989e12) and any_order (FLOP/s:
    ``shares["turns"] x peak_flops``, the bound of every order, consumers in step or not). ``rungs``: one rung or a sequence;
    ``ds``: a sequence of head dims. TypeError for ``rungs`` or ``ds`` of another kind; ValueError for a
    ``peak_flops`` that is not a positive finite number; the errors of :func:`warpgroup_tile` otherwise."""
    peak = check_positive_real(H200.peak_flops["bf16"] if peak_flops is None else peak_flops, "peak_flops",
                               "number of FLOP/s")
    rungs, ds = _rungs_and_ds(rungs, ds)
    out = []
    for name in rungs:
        for d in ds:
            t = warpgroup_tile(name, d)
            out.append(dict(rung=t.rung, d=d, block_q=t.block_q, block_k=t.block_k, hgmma=t.hgmma,
                            instructions=t.instructions, mufu=t.mufu, classes=t.classes,
                            tensor_clocks=t.tensor_clocks, mufu_clocks=t.mufu_clocks, issue_clocks=t.issue_clocks,
                            softmax_clocks=t.softmax_clocks, bound=t.bound, order=ORDERS[t.rung], shares=t.shares,
                            share=t.share, ceiling=t.share * peak, any_order=t.shares["turns"] * peak))
    return out


def _check_rows(table, keys: tuple) -> None:
    """The rows of :func:`warpgroup_table` that :func:`warpgroup_markdown` or
    :func:`lessons.views.register_tiles.warpgroup_pipes_figure` reads, checked: TypeError naming ``table`` unless
    it is a non-empty list of dicts that each hold ``keys``; then each value under ``keys`` named as
    ``table[i]['key']``: ``rung``, ``bound`` and ``order`` a str, ``d``, ``block_q`` and ``block_k`` an int >= 1,
    ``classes`` a dict of counts, every other a real number (TypeError otherwise, bools too) that is finite and
    not negative, ``tensor_clocks`` above 0 (ValueError otherwise)."""
    from lessons.gpu.sass import _check_table

    _check_table(table, "warpgroup_table", keys)
    for n, row in enumerate(table):
        for key in keys:
            name, value = f"table[{n}][{key!r}]", row[key]
            if key in ("rung", "bound", "order"):
                if not isinstance(value, str):
                    raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r}")
            elif key in ("d", "block_q", "block_k"):
                check_int(value, name, min=1)
            elif key == "classes":
                if not isinstance(value, dict):
                    raise TypeError(f"{name} must be a dict of instruction class -> count, got "
                                    f"{type(value).__name__} {value!r}")
                for cls, count in value.items():
                    _check_count(count, f"{name}[{cls!r}]")
            else:
                _check_count(value, name, positive=key == "tensor_clocks")


def _check_count(value, name: str, positive: bool = False) -> None:
    """TypeError naming ``name`` unless ``value`` is a real number (not a bool); ValueError unless it is finite and
    at least 0 (above 0 with ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'above' if positive else 'of at least'} 0, got {value!r}")


def warpgroup_markdown(table=None) -> str:
    """A Markdown table of :func:`warpgroup_table` rows (default: the Hopper rungs at d = 64 and 128): per rung and
    head dim the tiles, the three times per consumer warp and key tile (tensor T, MUFU M, issue I, in clocks), the
    longest of them, the rung's order, the most of the tensor peak it allows with its two consumers in
    step (share and TFLOP/s) and the most any order allows (TFLOP/s).
    TypeError for a ``table`` that is not a non-empty list of such rows; TypeError or ValueError naming
    ``table[i]['key']`` for a value of the wrong kind, a negative one or one that is not finite."""
    table = warpgroup_table() if table is None else table
    _check_rows(table, ("rung", "d", "block_q", "block_k", "tensor_clocks", "mufu_clocks", "issue_clocks", "bound",
                        "order", "share", "ceiling", "any_order"))
    lines = ["| rung | d | tiles | T: tensor clocks | M: MUFU clocks | I: instructions | longest pipe | order: "
             "time per tile | in this order, at most: share of the tensor peak | TFLOP/s | in any order, at most: "
             "TFLOP/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in table:
        lines.append(f"| {row['rung']} | {row['d']} | {row['block_q']} x {row['block_k']} | "
                     f"{row['tensor_clocks']:.0f} | {row['mufu_clocks']} | {row['issue_clocks']} | {row['bound']} | "
                     f"{row['order']} | {row['share']:.0%} | {row['ceiling'] / 1e12:.0f} | "
                     f"{row['any_order'] / 1e12:.0f} |")
    return "\n".join(lines)


def overlap_times(tile: WarpgroupTile) -> dict:
    """The times (clocks) to give :func:`lessons.gpu.hopper.overlap_schedule` for ``tile``: ``qk`` and ``pv`` each
    half of T (the two products do the same multiply-adds), ``softmax`` S. TypeError for another kind of ``tile``."""
    if not isinstance(tile, WarpgroupTile):
        raise TypeError(f"tile must be a WarpgroupTile (warpgroup_tile), got {type(tile).__name__}")
    return dict(qk=tile.tensor_clocks / 2, softmax=float(tile.softmax_clocks), pv=tile.tensor_clocks / 2)

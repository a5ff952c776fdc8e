"""IO-awareness: count the HBM traffic and the FLOPs of textbook and flash attention.

FlashAttention does exactly the same matrix arithmetic as the textbook algorithm;
what it removes is memory traffic. This module counts both by walking each
algorithm's schedule, block by block, for self-attention over ``N`` tokens with
head dimension ``d`` (Q, K, V, O all ``(N, d)``), an on-chip memory (SRAM) of
``M`` bytes and elements of ``element_size`` bytes.

* Textbook - Dao et al. 2022, Alg. 0: write S, read S for the softmax, write P,
  read P for P V. ``Theta(N d + N^2)`` HBM accesses (Theorem 2).
* Flash, ``order="fa2"`` (the default) - Dao 2023, Alg. 1, the loop order of every
  schedule and kernel in this series: the outer loop walks query blocks, Q_i is read
  once and O_i, L_i written once, and K and V are read once per query block:
  ``Nd + Tr * 2Nd`` elements read and ``Nd + N`` written, ``Tr = ceil(N / Br)``.
  Block sizes as for FA-1 unless given.
* Flash, ``order="fa1"`` - Dao et al. 2022, Alg. 1 as written: block sizes
  ``Bc = ceil(M / 4d)``, ``Br = min(Bc, d)`` (M in elements); the *outer* loop walks
  key blocks, so K and V are read once, while Q_i, O_i, l_i, m_i are read and
  written back once per key block. ``Theta(N^2 d^2 / M)`` accesses (Theorem 2).

With the same block sizes the two orders differ a lot: FA-1 moves about
``12 N^2 d^2 / M`` elements, FA-2 about ``2 N^2 d / Br``. At N = 8192, d = 64, bf16
and the H200's 227 KiB (Br = 64, Bc = 454) FA-2 moves 258 MiB against the
textbook's 516 MiB (2.0x fewer) and FA-1 61 MiB (8.4x fewer): FA-2 re-reads K and V
once per query block and buys its parallelism (one thread block per query block,
no O, l, m round trips) with that traffic. :func:`compare_traffic` gives all three.

It also measures peak memory of the NumPy implementations with ``tracemalloc``
and places both algorithms on a roofline.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.checks import check_int_sequence, check_positive_int
from lessons.schedules.flash import flash_attention
from lessons.cost.memory import peak_bytes
from lessons.core.reference import attention

__all__ = ["IOCount", "textbook_io", "flash_io", "flash_block_sizes", "TrafficComparison", "compare_traffic", "Hardware", "H200",
           "RooflinePoint", "roofline_points", "PeakMemory", "measure_peak_memory", "loglog_slope",
           "ELEMENT_SIZES"]

#: Bytes per element of the precisions used here.
ELEMENT_SIZES = {"fp32": 4, "bf16": 2, "fp16": 2}


class ByteCounts:
    """Bytes from element counts: ``read_elements``, ``write_elements`` and ``element_size``
    (bytes per element) of the dataclass that inherits this."""

    @property
    def read_bytes(self) -> int:
        return self.read_elements * self.element_size

    @property
    def write_bytes(self) -> int:
        return self.write_elements * self.element_size

    @property
    def hbm_bytes(self) -> int:
        """Bytes read plus bytes written."""
        return self.read_bytes + self.write_bytes


@dataclass(frozen=True)
class IOCount(ByteCounts):
    """HBM traffic and FLOPs of one attention forward pass.

    ``read_elements``/``write_elements``: elements moved between HBM and the chip;
    ``*_bytes`` the same times ``element_size``. ``flops_qk`` and ``flops_pv``:
    multiply-adds counted as 2 FLOPs, for ``S = Q K^T`` and ``O = P V``.
    ``steps``: ``(what, reads, writes)`` in elements, one line per kind of access,
    summed over the schedule. ``block_q``/``block_k`` (Br/Bc) are None for textbook.
    """

    algorithm: str
    n: int
    d: int
    element_size: int
    m_bytes: int | None
    block_q: int | None
    block_k: int | None
    read_elements: int
    write_elements: int
    flops_qk: int
    flops_pv: int
    steps: tuple

    @property
    def flops(self) -> int:
        """Matmul FLOPs, ``2 N^2 d`` for ``Q K^T`` plus ``2 N^2 d`` for ``P V``."""
        return self.flops_qk + self.flops_pv

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes


def _check_element_size(element_size) -> int:
    return check_positive_int(element_size, "element_size")


class _Ledger:
    """Adds up HBM reads and writes (elements) under a label per kind of access."""

    def __init__(self):
        self.lines: dict[str, list[int]] = {}

    def read(self, what: str, count: int) -> None:
        self.lines.setdefault(what, [0, 0])[0] += count

    def write(self, what: str, count: int) -> None:
        self.lines.setdefault(what, [0, 0])[1] += count

    def totals(self) -> tuple[int, int, tuple]:
        steps = tuple((what, r, w) for what, (r, w) in self.lines.items())
        return sum(r for _, r, _ in steps), sum(w for _, _, w in steps), steps


def textbook_io(n, d, *, element_size=2):
    """HBM traffic and FLOPs of standard attention (Dao et al. 2022, Alg. 0).

    1. read Q, K; compute ``S = Q K^T``; write S (N x N).
    2. read S; compute ``P = softmax(S)``; write P (N x N).
    3. read P and V; compute ``O = P V``; write O (N x d).

    Each operand of a matmul is counted once (an ideal blocked matmul), as in the
    paper. Reads ``3Nd + 2N^2``, writes ``2N^2 + Nd`` elements.

    Parameters: ``n``, ``d`` ints >= 1; ``element_size`` bytes per element (int >= 1).
    Returns an :class:`IOCount`. Raises TypeError/ValueError for other values.
    """
    n, d, es = check_positive_int(n, "n"), check_positive_int(d, "d"), _check_element_size(element_size)
    ledger = _Ledger()
    ledger.read("Q", n * d); ledger.read("K", n * d); ledger.write("S", n * n)      # step 1
    ledger.read("S", n * n); ledger.write("P", n * n)                              # step 2
    ledger.read("P", n * n); ledger.read("V", n * d); ledger.write("O", n * d)     # step 3
    reads, writes, steps = ledger.totals()
    return IOCount(algorithm="textbook", n=n, d=d, element_size=es, m_bytes=None, block_q=None, block_k=None,
                   read_elements=reads, write_elements=writes, flops_qk=2 * n * n * d, flops_pv=2 * n * n * d,
                   steps=steps)


def flash_block_sizes(d, m_bytes, element_size=2):
    """FA-1 block sizes ``(Br, Bc)``: ``Bc = ceil(M / 4d)``, ``Br = min(Bc, d)`` (Dao et al. 2022, Alg. 1, line 1).

    ``M = m_bytes // element_size`` is the on-chip memory in elements; it must hold
    at least ``4d`` elements (a row each of Q, K, V and O). Returns two ints.
    Raises TypeError for non-ints, ValueError for values < 1 or ``M < 4d``.
    """
    d, m_bytes, es = check_positive_int(d, "d"), check_positive_int(m_bytes, "m_bytes"), _check_element_size(element_size)
    m = m_bytes // es
    if m < 4 * d:
        raise ValueError(f"m_bytes = {m_bytes} holds {m} elements of {es} bytes; FA-1 needs at least 4d = {4 * d}")
    block_k = -(-m // (4 * d))
    return min(block_k, d), block_k


def flash_io(n, d, *, m_bytes, element_size=2, order="fa2", block_q=None, block_k=None):
    """HBM traffic and FLOPs of FlashAttention, counted by walking its loops.

    Parameters
    ----------
    n, d : int >= 1, tokens and head dimension.
    m_bytes : int >= 1, on-chip memory M in bytes (e.g. 227 KiB of shared memory
        per thread block on Hopper).
    element_size : int >= 1, bytes per element.
    order : ``"fa2"`` (default; Dao 2023, Alg. 1, the order of this series' code and
        kernels: outer loop over query blocks; K_j, V_j read once per query block;
        Q_i read and O_i, L_i written once) or ``"fa1"`` (Dao et al. 2022, Alg. 1:
        outer loop over key blocks; K, V read once; Q_i, O_i, l_i, m_i read and
        written per key block; O, l, m initialised in HBM).
    block_q, block_k : int >= 1, override Br and Bc; default :func:`flash_block_sizes`.
        When both are given, M is only recorded (it need not hold ``4d`` elements).

    Returns an :class:`IOCount`; its ``block_q``/``block_k`` are the sizes used.
    With ``Tr = ceil(N/Br)`` the FA-2 count is ``reads = Nd + Tr 2Nd``,
    ``writes = Nd + N``, i.e. about ``2 N^2 d / Br``. With ``Tc = ceil(N/Bc)`` the
    FA-1 count is ``reads = 2Nd + Tc(2Nd + 2N)``, ``writes = (Tc + 1)(Nd + 2N)``,
    i.e. about ``12 N^2 d^2 / M`` (Theorem 2).
    FLOPs equal the textbook's: ``2 N^2 d`` each for ``Q K^T`` and ``P V``.

    Raises TypeError/ValueError for bad sizes or an unknown order, and ValueError
    when a block size must be derived from an M below ``4d`` elements.
    """
    n, d = check_positive_int(n, "n"), check_positive_int(d, "d")
    es = _check_element_size(element_size)
    if not isinstance(order, str) or order not in ("fa1", "fa2"):
        raise ValueError(f"order must be 'fa1' or 'fa2', got {order!r}")
    m_bytes = check_positive_int(m_bytes, "m_bytes")
    br = None if block_q is None else check_positive_int(block_q, "block_q")
    bc = None if block_k is None else check_positive_int(block_k, "block_k")
    if br is None or bc is None:                        # only sizes derived from M need M >= 4d
        br_m, bc_m = flash_block_sizes(d, m_bytes, es)
        br = br_m if br is None else br
        bc = bc_m if bc is None else bc
    q_blocks = [(r0, min(r0 + br, n)) for r0 in range(0, n, br)]
    k_blocks = [(c0, min(c0 + bc, n)) for c0 in range(0, n, bc)]
    ledger, flops = _Ledger(), 0
    if order == "fa1":
        ledger.write("O, l, m (initialise)", n * d + 2 * n)            # line 2
        for c0, c1 in k_blocks:                                         # line 5: outer loop over K_j, V_j
            ledger.read("K", (c1 - c0) * d); ledger.read("V", (c1 - c0) * d)
            for r0, r1 in q_blocks:                                     # line 7: inner loop over Q_i
                rows = r1 - r0
                ledger.read("Q", rows * d); ledger.read("O", rows * d); ledger.read("l, m", 2 * rows)
                flops += 2 * rows * (c1 - c0) * d
                ledger.write("O", rows * d); ledger.write("l, m", 2 * rows)   # lines 12-13
    else:
        for r0, r1 in q_blocks:                                         # outer loop over Q_i
            rows = r1 - r0
            ledger.read("Q", rows * d)
            for c0, c1 in k_blocks:                                     # inner loop over K_j, V_j
                ledger.read("K", (c1 - c0) * d); ledger.read("V", (c1 - c0) * d)
                flops += 2 * rows * (c1 - c0) * d
            ledger.write("O", rows * d); ledger.write("L (logsumexp)", rows)
    reads, writes, steps = ledger.totals()
    return IOCount(algorithm=f"flash-{order}", n=n, d=d, element_size=es, m_bytes=int(m_bytes),
                   block_q=br, block_k=bc, read_elements=reads, write_elements=writes,
                   flops_qk=flops, flops_pv=flops, steps=steps)


@dataclass(frozen=True)
class TrafficComparison:
    """Textbook, FA-2 and FA-1 traffic for one ``(n, d)``, with the same block sizes for both flash orders.

    ``textbook``, ``fa2``, ``fa1``: :class:`IOCount`. ``fa2_saving`` and ``fa1_saving``:
    textbook bytes divided by that order's bytes (how many times fewer bytes it moves;
    below 1 when it moves more).
    """

    textbook: IOCount
    fa2: IOCount
    fa1: IOCount

    @property
    def fa2_saving(self) -> float:
        return self.textbook.hbm_bytes / self.fa2.hbm_bytes

    @property
    def fa1_saving(self) -> float:
        return self.textbook.hbm_bytes / self.fa1.hbm_bytes


def compare_traffic(n, d, *, m_bytes, element_size=2, block_q=None, block_k=None):
    """Count textbook attention and both flash loop orders at the same block sizes.

    ``n``, ``d``, ``m_bytes``, ``element_size``, ``block_q``, ``block_k`` as in
    :func:`flash_io` (block sizes default to FA-1's rule, Dao et al. 2022, Alg. 1,
    for both orders, so that only the loop order differs). Returns a
    :class:`TrafficComparison`. Raises what :func:`flash_io` raises.

    Example: ``compare_traffic(8192, 64, m_bytes=227 * 1024)`` gives textbook
    516 MiB, FA-2 258 MiB (2.0x fewer), FA-1 61 MiB (8.4x fewer) in bf16.
    """
    text = textbook_io(n, d, element_size=element_size)
    fa2 = flash_io(n, d, m_bytes=m_bytes, element_size=element_size, order="fa2", block_q=block_q, block_k=block_k)
    fa1 = flash_io(n, d, m_bytes=m_bytes, element_size=element_size, order="fa1",
                   block_q=fa2.block_q, block_k=fa2.block_k)
    return TrafficComparison(textbook=text, fa2=fa2, fa1=fa1)


# --------------------------------------------------------------------------- roofline

@dataclass(frozen=True)
class Hardware:
    """A machine for the roofline: HBM bandwidth (bytes/s), peak FLOP/s per precision, on-chip memory (bytes)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: dict
    sram_bytes: int

    def ridge(self, precision: str) -> float:
        """Intensity (FLOPs/byte) where the roof turns from memory- to compute-bound."""
        return self.peak_flops[precision] / self.hbm_bytes_per_s

    def attainable(self, intensity: float, precision: str) -> float:
        """Roofline: ``min(peak FLOP/s, bandwidth * intensity)`` in FLOP/s."""
        return min(self.peak_flops[precision], self.hbm_bytes_per_s * intensity)


#: NVIDIA H200 SXM (datasheet: 4.8 TB/s HBM3e, 67 TFLOP/s FP32, 989 TFLOP/s dense BF16
#: tensor core) with 227 KiB of shared memory per thread block (Hopper tuning guide).
H200 = Hardware(name="NVIDIA H200", hbm_bytes_per_s=4.8e12,
                peak_flops={"fp32": 67e12, "bf16": 989e12}, sram_bytes=227 * 1024)


@dataclass(frozen=True)
class RooflinePoint:
    """One algorithm on the roofline: its :class:`IOCount`, precision, attainable FLOP/s and the bound."""

    label: str
    count: IOCount
    precision: str
    attainable: float
    bound: str          # "memory" or "compute"

    @property
    def intensity(self) -> float:
        return self.count.intensity

    @property
    def seconds(self) -> float:
        """Roofline time ``flops / attainable`` (s): a lower bound, not a measurement."""
        return self.count.flops / self.attainable


def roofline_points(n=8192, ds=(64, 128), *, hardware=H200, precisions=("bf16", "fp32"), orders=("fa2",)):
    """Textbook and flash attention at sequence length ``n`` placed on ``hardware``'s roofline.

    For each precision in ``precisions`` (keys of :data:`ELEMENT_SIZES` and of
    ``hardware.peak_flops``) and each head dim in ``ds``, counts textbook attention
    (:func:`textbook_io`) and flash attention in each loop order of ``orders``
    (``"fa2"``, ``"fa1"``; :func:`flash_io` with ``m_bytes = hardware.sram_bytes``)
    and returns a list of :class:`RooflinePoint` labelled ``"textbook d=64 bf16"``,
    ``"FA-2 d=64 bf16"``, ``"FA-1 d=64 bf16"``. A single string (``precisions="fp32"``,
    ``orders="fa1"``) is one value. Raises ValueError for an unknown precision or order,
    TypeError naming ``precisions`` when it is neither a string nor an iterable of strings,
    TypeError naming ``hardware`` unless it is a :class:`Hardware` (such as :data:`H200`),
    and TypeError / ValueError naming ``ds`` unless it is a sequence of ints >= 1.
    """
    if not isinstance(hardware, Hardware):
        raise TypeError(f"hardware must be a lessons.cost.traffic.Hardware such as H200, "
                        f"got {type(hardware).__name__} {hardware!r}")
    orders = (orders,) if isinstance(orders, str) else tuple(orders)
    for order in orders:
        if order not in ("fa1", "fa2"):
            raise ValueError(f"orders must hold 'fa1' or 'fa2', got {order!r}")
    if isinstance(precisions, str):
        precisions = (precisions,)
    try:
        precisions = tuple(precisions)
    except TypeError:
        raise TypeError(f"precisions must be a string or a sequence of strings, "
                        f"got {type(precisions).__name__} {precisions!r}") from None
    for precision in precisions:
        if not isinstance(precision, str):
            raise TypeError(f"precisions must hold strings, got {type(precision).__name__} {precision!r}")
    ds = check_int_sequence(ds, "ds", min=1)
    points = []
    for precision in precisions:
        if precision not in ELEMENT_SIZES or precision not in hardware.peak_flops:
            raise ValueError(f"precision must be one of {sorted(set(ELEMENT_SIZES) & set(hardware.peak_flops))}, "
                             f"got {precision!r}")
        es = ELEMENT_SIZES[precision]
        for d in ds:
            counts = [textbook_io(n, d, element_size=es)]
            counts += [flash_io(n, d, m_bytes=hardware.sram_bytes, element_size=es, order=o) for o in orders]
            for count in counts:
                perf = hardware.attainable(count.intensity, precision)
                bound = "memory" if count.intensity < hardware.ridge(precision) else "compute"
                name = "textbook" if count.algorithm == "textbook" else count.algorithm[-3:].upper().replace("FA", "FA-")
                points.append(RooflinePoint(label=f"{name} d={d} {precision}", count=count, precision=precision,
                                            attainable=perf, bound=bound))
    return points


# --------------------------------------------------------------------------- measured peak memory

def loglog_slope(xs, ys):
    """Least-squares slope of ``log(ys)`` against ``log(xs)`` (the exponent k in ``y ~ x^k``).

    ``xs``, ``ys``: 1-D sequences of equal length >= 2 of positive finite numbers;
    ``xs`` must hold at least two distinct values (else there is no slope). Returns a float.
    Raises ValueError naming the argument for mismatched shapes, fewer than 2 points,
    non-numeric, non-positive or non-finite values, or ``xs`` all equal.
    """
    arrays = []
    for name, a in (("xs", xs), ("ys", ys)):
        try:
            arrays.append(np.asarray(a, dtype=float))
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a sequence of numbers, got {a!r}") from None
    xs, ys = arrays
    if xs.ndim != 1 or xs.shape != ys.shape or xs.size < 2:
        raise ValueError(f"xs and ys must be 1-D of equal length >= 2, got shapes {xs.shape} and {ys.shape}")
    for name, a in (("xs", xs), ("ys", ys)):
        bad = ~np.isfinite(a) | (a <= 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"{name} must hold positive finite values for a log-log fit, "
                             f"got {name}[{i}] = {a[i]}")
    if np.unique(xs).size < 2:
        raise ValueError(f"xs must hold at least two distinct values for a slope, got {xs.tolist()}")
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


@dataclass(frozen=True)
class PeakMemory:
    """Peak bytes allocated during one call of each algorithm, per sequence length.

    ``ns`` (list of int), ``textbook_bytes`` and ``flash_bytes`` (lists of int,
    bytes, measured with ``tracemalloc``; the inputs are allocated before and not
    counted), ``score_bytes`` the size of one (N, N) score matrix, and the
    fitted log-log slopes.
    """

    ns: list
    d: int
    dtype: str
    tile: int
    block_q: int
    textbook_bytes: list
    flash_bytes: list
    score_bytes: list

    @property
    def textbook_slope(self) -> float:
        return loglog_slope(self.ns, self.textbook_bytes)

    @property
    def flash_slope(self) -> float:
        return loglog_slope(self.ns, self.flash_bytes)

    @property
    def textbook_per_score_matrix(self) -> list:
        """Textbook peak divided by the size of one (N, N) score matrix, per N (how many it held at once)."""
        return [t / s for t, s in zip(self.textbook_bytes, self.score_bytes)]

    @property
    def flash_linear_fit(self) -> tuple:
        """Least-squares ``peak = a + b N`` for flash: ``(a, b)`` in bytes and bytes per token.

        ``b`` should be one output row plus its lse, ``(d + 1) * itemsize``; ``a`` is
        the working set of one ``block_q x tile`` step, independent of N.
        """
        b, a = np.polyfit(np.asarray(self.ns, float), np.asarray(self.flash_bytes, float), 1)
        return float(a), float(b)


def measure_peak_memory(ns=(512, 2048, 8192), d=64, *, dtype="float32", tile=64, block_q=64, seed=0):
    """Measure the peak memory of :func:`lessons.attention` and :func:`lessons.flash_attention`.

    For each N in ``ns`` draws ``q, k, v`` of shape (N, d), then runs each algorithm
    once under ``tracemalloc`` (NumPy reports its buffers to it;
    :func:`lessons.cost.memory.peak_bytes`) and records the peak bytes allocated
    during the call. Textbook holds (N, N) score and
    probability matrices, so it grows like N^2 (slope about 2); flash holds the
    (N, d) output plus the working set of one ``block_q x tile`` step, so it grows
    like ``a + (d + 1) * itemsize * N``: slope about 1 once the output dominates
    the constant ``a`` (below 1 at small N).

    Parameters: ``ns`` ints >= 1 (at least 2 for the slopes); ``d`` int >= 1;
    ``dtype`` a float dtype name; ``tile``, ``block_q`` as in :func:`lessons.flash_attention`.
    At N = 8192 in float32 one score matrix is 256 MiB and textbook holds 3 of
    them at its peak (S, ``S - m`` and ``exp(S - m)``); this takes 10-20 s on 2 cores.

    Returns a :class:`PeakMemory`. Raises TypeError/ValueError for bad sizes or dtype.
    """
    ns = list(check_int_sequence(ns, "ns", min=1))
    d = check_positive_int(d, "d")
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"dtype must be a float dtype, got {dt}")
    rng = np.random.default_rng(seed)
    text, flash, score = [], [], []
    for n in ns:
        q, k, v = (rng.standard_normal((n, d)).astype(dt) for _ in range(3))
        text.append(peak_bytes(attention, q, k, v))
        flash.append(peak_bytes(flash_attention, q, k, v, tile, block_q=block_q))
        score.append(n * n * dt.itemsize)
        del q, k, v
    return PeakMemory(ns=ns, d=d, dtype=dt.name, tile=tile, block_q=block_q,
                      textbook_bytes=text, flash_bytes=flash, score_bytes=score)



"""What the backward pass costs: HBM traffic and FLOPs from its schedule, and measured peak memory.

* Textbook - Dao et al. 2022, Alg. 3: P is read from HBM (stored by the forward),
  dP and dS are written there and read back: ``Theta(N d + N^2)`` accesses.
* Flash - Dao 2023, Alg. 2: one pass for ``D = rowsum(dO * O)``, then the outer loop
  over key blocks (K_j, V_j read once, dK_j, dV_j written once) and the inner loop
  over query blocks (Q_i, dO_i, L_i, D_i read, dQ_i read and written back). S is
  recomputed, so it does five ``N x N x d`` matmuls where the textbook backward does
  four and the forward two: 2.5x the forward's FLOPs, and still far less traffic.

Self-attention over ``n`` tokens, head dimension ``d`` (Q, K, V, O, dO all (N, d)).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.checks import check_int_sequence, check_positive_int
from lessons.cost.memory import peak_bytes
from lessons.cost.traffic import ByteCounts, PeakMemory, _Ledger, flash_block_sizes
from lessons.core.reference import attention
from lessons.schedules.backward import attention_backward, flash_attention_backward

__all__ = ["BackwardIOCount", "textbook_backward_io", "flash_backward_io", "measure_backward_peak_memory"]


@dataclass(frozen=True)
class BackwardIOCount(ByteCounts):
    """HBM traffic and FLOPs of one attention backward pass.

    ``read_elements``/``write_elements``: elements moved between HBM and the chip
    (``*_bytes``: times ``element_size``). ``matmul_flops``: a dict from each matmul
    (``"S = Q K^T"``, ``"dV = P^T dO"``, ``"dP = dO V^T"``, ``"dQ = dS K"``, ``"dK = dS^T Q"``)
    to its FLOPs (a multiply-add counts 2). ``steps``: ``(what, reads, writes)`` in
    elements. ``block_q``/``block_k`` are None for the textbook backward.
    """

    algorithm: str
    n: int
    d: int
    element_size: int
    block_q: int | None
    block_k: int | None
    read_elements: int
    write_elements: int
    matmul_flops: dict
    steps: tuple

    @property
    def flops(self) -> int:
        """All matmul FLOPs (the elementwise work, O(N^2) without a factor d, is left out)."""
        return sum(self.matmul_flops.values())

    @property
    def intensity(self) -> float:
        """FLOPs per HBM byte."""
        return self.flops / self.hbm_bytes


def textbook_backward_io(n, d, *, element_size=2):
    """HBM traffic and FLOPs of the standard backward (Dao et al. 2022, Alg. 3).

    1. read P, dO; ``dV = P^T dO``; write dV.
    2. read dO, V; ``dP = dO V^T``; write dP (N x N).
    3. read P, dP; ``dS = P * (dP - rowsum(P * dP))``; write dS (N x N).
    4. read dS, K; ``dQ = dS K``; write dQ.   5. read dS, Q; ``dK = dS^T Q``; write dK.

    Each matmul operand counted once (an ideal blocked matmul), as in the paper:
    reads ``5N^2 + 5Nd``, writes ``2N^2 + 3Nd``; FLOPs ``4 x 2N^2 d`` (S is not recomputed:
    P was stored by the forward).

    Parameters: ``n``, ``d``, ``element_size`` ints >= 1. Returns a :class:`BackwardIOCount`.
    Raises TypeError/ValueError for other values.
    """
    n, d, es = check_positive_int(n, "n"), check_positive_int(d, "d"), check_positive_int(element_size, "element_size")
    ledger = _Ledger()
    ledger.read("P", n * n); ledger.read("dO", n * d); ledger.write("dV", n * d)        # step 1
    ledger.read("dO", n * d); ledger.read("V", n * d); ledger.write("dP", n * n)        # step 2
    ledger.read("P", n * n); ledger.read("dP", n * n); ledger.write("dS", n * n)        # step 3
    ledger.read("dS", n * n); ledger.read("K", n * d); ledger.write("dQ", n * d)        # step 4
    ledger.read("dS", n * n); ledger.read("Q", n * d); ledger.write("dK", n * d)        # step 5
    reads, writes, steps = ledger.totals()
    mm = 2 * n * n * d
    return BackwardIOCount(algorithm="textbook", n=n, d=d, element_size=es, block_q=None, block_k=None,
                           read_elements=reads, write_elements=writes,
                           matmul_flops={"dV = P^T dO": mm, "dP = dO V^T": mm, "dQ = dS K": mm, "dK = dS^T Q": mm},
                           steps=steps)


def flash_backward_io(n, d, *, m_bytes=None, element_size=2, block_q=None, block_k=None):
    """HBM traffic and FLOPs of the FlashAttention-2 backward, counted by walking its loops (Dao 2023, Alg. 2).

    Parameters
    ----------
    n, d : int >= 1, tokens and head dimension.
    m_bytes : int >= 1, on-chip memory M in bytes; used for the default block sizes
        (:func:`lessons.flash_block_sizes`, as the forward). Needed unless both block sizes are given.
    element_size : int >= 1, bytes per element.
    block_q, block_k : int >= 1, query rows (Br) and keys (Bc) per block.

    Returns a :class:`BackwardIOCount`. With ``Tc = ceil(N / Bc)`` key blocks:
    reads ``2Nd`` (O, dO for D) ``+ 2Nd`` (K, V) ``+ Tc (3Nd + 2N)`` (Q_i, dO_i, dQ_i,
    L_i, D_i per key block); writes ``N`` (D) ``+ 2Nd`` (dK, dV) ``+ Tc Nd`` (dQ_i).
    FLOPs ``5 x 2N^2 d``: S recomputed, then dV, dP, dQ, dK.

    Raises TypeError/ValueError for bad sizes, and ValueError when a block size must be
    derived but ``m_bytes`` is missing or below ``4d`` elements.
    """
    n, d = check_positive_int(n, "n"), check_positive_int(d, "d")
    es = check_positive_int(element_size, "element_size")
    br = None if block_q is None else check_positive_int(block_q, "block_q")
    bc = None if block_k is None else check_positive_int(block_k, "block_k")
    if br is None or bc is None:
        if m_bytes is None:
            raise ValueError("m_bytes is needed to derive block_q/block_k; give m_bytes or both block sizes")
        br_m, bc_m = flash_block_sizes(d, check_positive_int(m_bytes, "m_bytes"), es)
        br = br_m if br is None else br
        bc = bc_m if bc is None else bc
    ledger, flops = _Ledger(), 0
    ledger.read("O, dO (for D)", 2 * n * d); ledger.write("D", n)          # preprocess: D = rowsum(dO * O)
    for c0 in range(0, n, bc):                                              # outer loop: key blocks
        cols = min(c0 + bc, n) - c0
        ledger.read("K, V", 2 * cols * d)
        for r0 in range(0, n, br):                                          # inner loop: query blocks
            rows = min(r0 + br, n) - r0
            ledger.read("Q, dO", 2 * rows * d); ledger.read("L, D", 2 * rows)
            ledger.read("dQ", rows * d); ledger.write("dQ", rows * d)       # read, add, write back
            flops += 2 * rows * cols * d
        ledger.write("dK, dV", 2 * cols * d)
    reads, writes, steps = ledger.totals()
    return BackwardIOCount(algorithm="flash-fa2", n=n, d=d, element_size=es, block_q=br, block_k=bc,
                           read_elements=reads, write_elements=writes,
                           matmul_flops={"S = Q K^T (recomputed)": flops, "dV = P^T dO": flops,
                                         "dP = dO V^T": flops, "dQ = dS K": flops, "dK = dS^T Q": flops},
                           steps=steps)


def measure_backward_peak_memory(ns=(512, 2048, 8192), d=64, *, dtype="float32", block_q=64, block_k=64, seed=0):
    """Peak memory of :func:`lessons.attention_backward` and :func:`lessons.flash_attention_backward`.

    For each N in ``ns``: draws q, k, v, dO (N, d), runs the forward once (O and lse,
    made before and not counted), then each backward once under ``tracemalloc``
    (:func:`lessons.cost.memory.peak_bytes`). The textbook backward holds P, dP and
    dS (N, N) (slope about 2); the flash one holds dQ, dK, dV, D and the working set
    of one ``block_q x block_k`` step (slope about 1 once the (N, d) outputs dominate).
    In float32 at N = 8192 one (N, N) matrix is 256 MiB and the textbook backward
    peaks at a few of them; about a minute on 2 cores.

    Returns a :class:`lessons.cost.traffic.PeakMemory` (``textbook_bytes``, ``flash_bytes``,
    ``score_bytes``, slopes), its ``tile`` being ``block_k``.
    Raises TypeError/ValueError for bad sizes or a non-float dtype.
    """
    ns = list(check_int_sequence(ns, "ns", min=1))
    d = check_positive_int(d, "d")
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.floating):
        raise TypeError(f"dtype must be a float dtype, got {dt}")
    rng = np.random.default_rng(seed)
    text, flash, score = [], [], []
    for n in ns:
        q, k, v, do = (rng.standard_normal((n, d)).astype(dt) for _ in range(4))
        o, lse = attention(q, k, v, return_lse=True)
        text.append(peak_bytes(attention_backward, q, k, v, do))
        flash.append(peak_bytes(flash_attention_backward, q, k, v, o, lse, do, block_q=block_q, block_k=block_k))
        score.append(n * n * dt.itemsize)
        del q, k, v, do, o, lse
    return PeakMemory(ns=ns, d=d, dtype=dt.name, tile=block_k, block_q=block_q,
                      textbook_bytes=text, flash_bytes=flash, score_bytes=score)

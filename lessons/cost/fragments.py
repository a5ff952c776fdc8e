"""Shared-memory bytes a warp reads per tensor-core product: why FlashAttention-2 gives a warp 32 query rows.

In the ``mma.sync`` rungs a warp owns ``warp_rows`` query rows: one 16-row *m-tile*, or two. Per key tile it
loads the B fragments of K (for ``S = Q K^T``) and of V (for ``o += P V``) from shared memory with
``ldmatrix.x4``, which reads four 8 x 8 matrices of 16-bit values, 512 bytes per warp, and feeds each fragment to
one ``mma.m16n8k16`` per m-tile. With two m-tiles every fragment feeds two products, so the bytes per product
fall; the price is registers (``o`` and ``s`` double), which is why the wide rung reads Q's A fragments from
shared memory at each tile instead of keeping them in registers (FlashAttention-2 does the same).

An SM reads at most 128 bytes of shared memory per clock (32 banks of 4 bytes: CUDA C++ Programming Guide,
"Shared Memory") and an H100/H200 SM does 4096 dense 16-bit tensor-core FLOPs per clock, one ``m16n8k16``
product's worth (989 TFLOP/s over 132 SMs at 1.83 GHz: NVIDIA H100 whitepaper). So a kernel that reads B bytes
of shared memory per product can use at most 128 / B of the tensor-core peak, whatever else it does:
:attr:`FragmentTraffic.peak_share`. Nothing here runs a kernel; the counts are those of
``kernels/flash_attention_mma_fa2.cu`` (a test compares them with the instructions in its PTX).
"""
from __future__ import annotations

from dataclasses import dataclass

from lessons.core.checks import check_flag, check_int

__all__ = ["FragmentTraffic", "fragment_traffic", "LDMATRIX_X4_BYTES", "SMEM_BYTES_PER_CLOCK",
           "MMA_FLOPS"]

#: bytes one warp reads with one ``ldmatrix.x4``: four 8 x 8 matrices of 16-bit values
LDMATRIX_X4_BYTES = 4 * 8 * 8 * 2
#: FLOPs of one ``mma.sync.m16n8k16`` (2 per multiply-add)
MMA_FLOPS = 2 * 16 * 8 * 16
#: shared-memory bytes an SM reads per clock at most: 32 banks x 4 bytes
SMEM_BYTES_PER_CLOCK = 32 * 4


@dataclass(frozen=True)
class FragmentTraffic:
    """One warp's shared-memory reads and tensor-core products per key tile.

    ``k_loads``, ``v_loads``, ``q_loads``: ``ldmatrix.x4`` instructions for K's, V's and Q's fragments
    (``q_loads`` is 0 when Q stays in registers: it was loaded once, before the first tile); ``mmas``:
    ``mma.m16n8k16`` products (both of them: ``Q K^T`` and ``P V``).
    """

    head_dim: int
    block_k: int
    warp_rows: int
    q_in_registers: bool
    k_loads: int
    v_loads: int
    q_loads: int
    mmas: int

    @property
    def bytes(self) -> int:
        """Shared-memory bytes the warp reads per key tile."""
        return LDMATRIX_X4_BYTES * (self.k_loads + self.v_loads + self.q_loads)

    @property
    def bytes_per_mma(self) -> float:
        """Shared-memory bytes read per tensor-core product."""
        return self.bytes / self.mmas

    @property
    def mmas_per_kv_fragment(self) -> float:
        """Products per K or V fragment loaded: 2 with one m-tile per warp, 4 with two."""
        return self.mmas / (self.k_loads + self.v_loads)

    @property
    def peak_share(self) -> float:
        """The largest share of the SM's dense tensor-core FLOPs that these reads allow (at most 1): one
        product's worth of FLOPs per clock needs ``bytes_per_mma`` bytes per clock, and 128 come."""
        return min(1.0, SMEM_BYTES_PER_CLOCK / self.bytes_per_mma)


def fragment_traffic(head_dim: int, block_k: int, warp_rows: int = 16, q_in_registers: bool | None = None
                     ) -> FragmentTraffic:
    """Per warp and key tile: the ``ldmatrix.x4`` loads and ``mma.m16n8k16`` products of the FA-2 rungs.

    ``head_dim`` d and ``block_k`` (keys per tile) multiples of 16; ``warp_rows`` 16 (the FA-2 and lazy rungs)
    or 32 (the wide rung); ``q_in_registers`` None: True for 16 rows, False for 32, as the kernel does.
    Per 16-wide slice of d and pair of 8-key score tiles one K load; per 16-key slice and pair of 8-column
    output tiles one V load; per m-tile and slice of d one Q load when Q is not in registers; each load feeds one
    product per m-tile and 8-wide tile it holds. Raises TypeError for a non-integer (bools included) or a
    non-bool flag, ValueError naming the argument otherwise. Source: Dao 2023 (FlashAttention-2), Sec. 3.3;
    PTX ISA, ``ldmatrix`` and ``mma.m16n8k16``.
    """
    d = check_int(head_dim, "head_dim", min=16)
    bk = check_int(block_k, "block_k", min=16)
    rows = check_int(warp_rows, "warp_rows")
    if d % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (16-wide slices of d), got {d}")
    if bk % 16:
        raise ValueError(f"block_k must be a multiple of 16 (16-key slices), got {bk}")
    if rows not in (16, 32):
        raise ValueError(f"warp_rows must be 16 (one m-tile per warp) or 32 (two), got {rows}")
    q_regs = rows == 16 if q_in_registers is None else check_flag(q_in_registers, "q_in_registers")
    m_tiles = rows // 16
    k_loads = (d // 16) * (bk // 16)                # x4 = the B fragments of two 8-key score tiles
    v_loads = (bk // 16) * (d // 16)                # x4.trans = those of two 8-column output tiles
    q_loads = 0 if q_regs else m_tiles * (d // 16)
    mmas = m_tiles * ((d // 16) * (bk // 8) + (bk // 16) * (d // 8))
    return FragmentTraffic(d, bk, rows, q_regs, k_loads, v_loads, q_loads, mmas)

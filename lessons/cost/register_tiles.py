"""Shared-memory loads per FMA in the register-tiled CUDA-core rungs: why a thread's tile should be larger.

In ``kernels/flash_attention_regtile.cu`` 128 threads split a block of ``block_q`` query rows and ``block_k`` keys
into row groups of ``lanes`` threads. A thread owns ``rows`` = block_q / (128 / lanes) query rows, ``keys`` =
block_k / lanes keys of the score tile, and ``chunks`` = ceil(d / (4 lanes)) 4-column chunks of each output row.
Every load is one instruction per thread:

* ``S = Q K^T``, per 4 columns of the head dim: one 16-byte load per row of q and per key of k, then
  ``rows x keys x 4`` FMAs;
* ``o += P V``, per key: one load of p per row (the plain build: 4 bytes, one key; the wide build reads 4 keys
  in one 16-byte load, so a quarter of a load per key) and one 16-byte load of v per chunk, then
  ``rows x chunks x 4`` FMAs.

An SM's four schedulers each issue one instruction per clock, and a load takes an issue slot that an FMA then
cannot have; the shared-memory pipe, not the FMA units, was what bounded the scalar rung (Nsight Compute, H200).
So the fewer loads per FMA, the more of the FP32 peak is left for arithmetic (Volkov & Demmel 2008, register
blocking). Nothing here runs a kernel: the counts follow the kernel's loops, and a test holds them to the
kernel's tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from lessons.core.checks import check_flag, check_int
from lessons.gpu.source import NUM_THREADS, REGTILE_LANES, regtile_legal_tiles

__all__ = ["RegisterTile", "register_tile"]


@dataclass(frozen=True)
class RegisterTile:
    """One thread's share of the work per key tile in a register-tiled build: the build (``wide``) and its tiles
    fix everything else.

    ``lanes``: threads per row group; ``rows``, ``keys``: the rows and keys of S a thread owns; ``chunks``: its
    4-column chunks of an output row (some threads own one fewer where d / 4 is not a multiple of ``lanes``: the
    counts are the busiest thread's); ``p_keys_per_load``: keys of P one load of p gives (1 plain, 4 wide).
    """

    head_dim: int
    block_q: int
    block_k: int
    wide: bool

    @property
    def lanes(self) -> int:
        """Threads per row group: 8 in the plain build, 16 in the wide one."""
        return REGTILE_LANES[self.wide]

    @property
    def groups(self) -> int:
        """Row groups of the block: ``128 / lanes``."""
        return NUM_THREADS // self.lanes

    @property
    def rows(self) -> int:
        return self.block_q // self.groups

    @property
    def keys(self) -> int:
        return self.block_k // self.lanes

    @property
    def chunks(self) -> int:
        return -(-(self.head_dim // 4) // self.lanes)

    @property
    def p_keys_per_load(self) -> int:
        return 4 if self.wide else 1

    @property
    def s_loads_per_fma(self) -> float:
        """Shared loads per FMA of ``S = Q K^T``: ``(rows + keys) / (4 rows keys)``."""
        return (self.rows + self.keys) / (4 * self.rows * self.keys)

    @property
    def pv_loads_per_fma(self) -> float:
        """Shared loads per FMA of ``o += P V``: ``(rows / p_keys_per_load + chunks) / (4 rows chunks)``."""
        return (self.rows / self.p_keys_per_load + self.chunks) / (4 * self.rows * self.chunks)

    def thread_rows(self, ty: int) -> tuple:
        """The block rows row group ``ty`` owns: consecutive in the plain build (``ty * rows + i``), interleaved in
        the wide one (``ty + groups * i``, so the two row groups of a warp own adjacent rows)."""
        ty = check_int(ty, "ty", min=0, max=self.groups - 1)
        if self.wide:
            return tuple(ty + self.groups * i for i in range(self.rows))
        return tuple(ty * self.rows + i for i in range(self.rows))

    def thread_keys(self, tx: int) -> tuple:
        """The tile keys lane ``tx`` owns: ``tx, tx + lanes, ...``."""
        tx = check_int(tx, "tx", min=0, max=self.lanes - 1)
        return tuple(tx + self.lanes * j for j in range(self.keys))

    def thread_columns(self, tx: int) -> tuple:
        """The output columns lane ``tx`` owns: the 4-column chunks ``tx, tx + lanes, ...`` below ``d / 4``."""
        tx = check_int(tx, "tx", min=0, max=self.lanes - 1)
        chunks = [tx + self.lanes * c for c in range(self.chunks) if tx + self.lanes * c < self.head_dim // 4]
        return tuple(4 * c + e for c in chunks for e in range(4))

    @property
    def accumulators(self) -> int:
        """Floats of S and o the thread keeps in registers: ``rows x keys + rows x 4 chunks``."""
        return self.rows * self.keys + 4 * self.rows * self.chunks


def register_tile(head_dim: int, block_q: int, block_k: int, wide: bool = False) -> RegisterTile:
    """A thread's tile in ``flash_attention_regtile`` (``wide`` False) or ``flash_attention_regtile_wide`` (True).

    ``head_dim`` d a multiple of 4 in 4..256; ``block_q`` and ``block_k`` as the kernel takes them (plain: 16,
    32, 64, 128 and 8, 16, 32, 64; wide: 8, 16, 32, 64 and 16, 32, 64, 128). Plain: row groups of 8 lanes, p read
    one key per load; wide: 16 lanes, 4 keys per load. Raises TypeError for a non-integer (bools included) or a
    non-bool ``wide``, ValueError naming the argument otherwise. Source: Volkov & Demmel 2008 (register blocking);
    Dao 2023 (FlashAttention-2), Alg. 1.
    """
    d = check_int(head_dim, "head_dim", min=4, max=256)
    bq, bk = check_int(block_q, "block_q", min=1), check_int(block_k, "block_k", min=1)
    wide = check_flag(wide, "wide")
    if d % 4:
        raise ValueError(f"head_dim must be a multiple of 4 (16-byte rows), got {d}")
    legal_q, legal_k = regtile_legal_tiles(wide)
    if bq not in legal_q:
        raise ValueError(f"block_q must be one of {legal_q} for the {'wide' if wide else 'plain'} build, got {bq}")
    if bk not in legal_k:
        raise ValueError(f"block_k must be one of {legal_k} for the {'wide' if wide else 'plain'} build, got {bk}")
    return RegisterTile(d, bq, bk, wide)

"""swizzle_128b (notebook 11): where the 128-byte swizzle puts each 16-byte chunk, and the bank conflicts it removes.

TMA writes each K and V tile of the Hopper rungs into shared memory in rows of 128 bytes (64 16-bit values), 8
*chunks* of 16 bytes per row. Shared memory is 32 banks of 4 bytes, so a 128-byte row spans every bank once, a row
starts at bank 0, and the 16-byte *slot* s of a row (bytes 16 s .. 16 s + 15) is always banks 4 s .. 4 s + 3.
ldmatrix and wgmma read the same chunk of 8 consecutive rows at once. Stored row after row, those 8 chunks share one
slot, the same 4 banks at 8 addresses, and shared memory serves them in 8 passes (an 8-way bank conflict). The
128-byte swizzle stores chunk ``c`` of row ``r`` at slot ``c XOR (r mod 8)`` instead, so the 8 chunks land in 8
different slots and the read takes one pass; the wgmma descriptor names the swizzle, and the tensor cores undo it.

Source: NVIDIA, CUDA C++ Programming Guide, "Tensor Memory Access" (the 128-byte swizzle pattern) and PTX ISA,
"Shared memory matrix layout" (wgmma descriptors); Shah et al. 2024, FlashAttention-3, Sec. 3.1. The library's own
layout is ``lessons.gpu.source.wgmma_swizzle`` (byte offset of any element of a tile, 64-column panels).

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("swizzle_128b")``. A reference answer is in ``solutions/swizzle_128b.py``.
"""


def swizzle_128b(row, chunk):
    """The 16-byte slot of its 128-byte row where the swizzled tile stores chunk ``chunk`` of row ``row``.

    Parameters
    ----------
    row : int >= 0
        The row of the tile (any row: a K tile has 64 or 128).
    chunk : int, 0 <= chunk < 8
        The logical 16-byte chunk of the row: its 16-bit values 8 chunk .. 8 chunk + 7.

    Returns
    -------
    slot : int, 0 <= slot < 8
        ``chunk XOR (row mod 8)``: rows 8 apart share a layout.

    What must hold: row 0 keeps every chunk in place; chunk 2 of rows 0 .. 7 sits in slots 2, 3, 0, 1, 6, 7, 4, 5;
    chunk 2 of row 9 in slot 3, as in row 1; chunk 5 of row 3 and of row 11 in slot 6.
    """
    raise NotImplementedError


def swizzled_offset(row, col):
    """The byte offset of 16-bit element ``(row, col)`` in a tile of 128-byte rows stored with the swizzle.

    Parameters
    ----------
    row : int >= 0
        The element's row.
    col : int, 0 <= col < 64
        Its column: chunk ``col // 8``, place ``col % 8`` inside the chunk.

    Returns
    -------
    offset : int, bytes from the start of the tile
        128 bytes per row before it, then 16 bytes per slot before its chunk's slot, then 2 bytes per value before
        it in the chunk. The swizzle moves whole chunks; the 8 values of a chunk keep their order. This is
        ``lessons.gpu.source.wgmma_swizzle(row, col, rows, 64)`` for a tile of ``rows`` > ``row`` rows.

    What must hold: (0, 0) -> 0; (0, 63) -> 126; (1, 0) -> 128 + 16 = 144; (3, 20) -> 384 + 16 + 8 = 408
    (chunk 2 of row 3 in slot 1, fifth value of the chunk); (9, 20) -> 1152 + 48 + 8 = 1208.
    """
    raise NotImplementedError


def read_passes(rows, chunk):
    """How many passes shared memory needs for one instruction that reads chunk ``chunk`` of each of ``rows``.

    Parameters
    ----------
    rows : sequence of distinct ints >= 0, at least one
        The rows read at once (ldmatrix and wgmma read 8 consecutive ones).
    chunk : int, 0 <= chunk < 8
        The logical chunk read in every row.

    Returns
    -------
    passes : int >= 1
        The most of those chunks that sit in one 16-byte slot of the swizzled tile: chunks of different rows in the
        same slot are the same 4 banks at different addresses, served one pass after another.

    What must hold: chunk 2 of rows 0 .. 7 -> 1 (unswizzled it would be 8); rows 8 .. 15 -> 1; rows 0 and 8 -> 2
    (both in slot 2); rows 0 .. 15 -> 2; rows 0, 8, 16, 24 -> 4; a single row -> 1.
    """
    raise NotImplementedError

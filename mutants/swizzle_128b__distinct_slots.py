"""Known-wrong answer to the exercise ``swizzle_128b`` (mistake ``distinct_slots``).

The mistake: read_passes counts the different slots the chunks use instead of the chunks in the
fullest slot (rows 0 .. 7: 8 instead of 1 pass).
Everything else is the reference answer (solutions/swizzle_128b.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "swizzle_128b"
MISTAKE = "distinct_slots"


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
    return chunk ^ (row % 8)


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
    return 128 * row + 16 * swizzle_128b(row, col // 8) + 2 * (col % 8)


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
    return len({swizzle_128b(r, chunk) for r in rows})   # slots used, not the fullest

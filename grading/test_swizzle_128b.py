"""Grading: the 128-byte swizzle of the Hopper rungs' tiles and the bank conflicts it removes (notebook 11).

Expected values come from :func:`lessons.gpu.source.wgmma_swizzle` (the byte offset of an element of a tile as TMA
writes it and wgmma reads it, the layout the emulator checks the kernels with), from the cases worked by hand in the
stub's docstring, and for the passes from the banks themselves: each chunk's four 4-byte banks counted from its byte
offset, the passes being the most different chunks that ask one bank for a word.
"""
import numbers
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from lessons.gpu.source import wgmma_swizzle

EXERCISE = "swizzle_128b"
MISTAKES = ("no_swizzle", "row_not_mod_8", "xor_on_bytes")
BANKS, BANK_BYTES = 32, 4


def an_int(got, what):
    """``got`` as an int; a bool or a non-integer fails naming ``what``."""
    assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
        f"{what}: expected an int, got {type(got).__name__} {got!r}")
    return int(got)


def library_slot(row, chunk):
    """The slot of chunk ``chunk`` of row ``row``, read off the library's byte offset of its first value."""
    return (wgmma_swizzle(row, 8 * chunk, row + 1, 64) % 128) // 16


def bank_passes(rows, chunk):
    """Passes for chunk ``chunk`` of each of ``rows`` read at once, counted on the banks: every chunk asks the four
    banks its 16 bytes lie in (byte offset from the library) for one word each; chunks of different rows are
    different addresses, so a bank asked by k of them serves them in k passes."""
    asked = Counter()
    for r in rows:
        start = wgmma_swizzle(r, 8 * chunk, max(rows) + 1, 64)
        asked.update({(start + BANK_BYTES * i) // BANK_BYTES % BANKS for i in range(4)})
    return max(asked.values())


def slot(answer, row, chunk):
    got = an_int(answer.swizzle_128b(row, chunk), f"swizzle_128b({row}, {chunk})")
    assert 0 <= got < 8, (f"swizzle_128b({row}, {chunk}) = {got}: a 128-byte row has 8 slots of 16 bytes, "
                          f"0 to 7")
    return got


def offset(answer, row, col):
    return an_int(answer.swizzled_offset(row, col), f"swizzled_offset({row}, {col})")


def passes(answer, rows, chunk):
    return an_int(answer.read_passes(list(rows), chunk), f"read_passes({list(rows)}, {chunk})")


@pytest.mark.catches("row_not_mod_8")
@pytest.mark.hint("swizzle_128b returns an int from 0 to 7: the slot of the row, whatever the row")
def test_a_slot_is_an_int_from_0_to_7(answer):
    for row in range(40):
        for chunk in range(8):
            slot(answer, row, chunk)


@pytest.mark.catches("no_swizzle")
def test_slots_of_rows_0_to_7_by_hand(answer):
    assert [slot(answer, 0, c) for c in range(8)] == list(range(8)), "row 0 keeps every chunk in place"
    got = [slot(answer, r, 2) for r in range(8)]
    assert got == [2, 3, 0, 1, 6, 7, 4, 5], (f"chunk 2 of rows 0 .. 7: slots {got}, expected [2, 3, 0, 1, 6, 7, 4, 5] "
                                             f"(2 XOR 0, 2 XOR 1, ...)")
    assert sorted(slot(answer, r, 5) for r in range(8)) == list(range(8)), "chunk 5 of rows 0 .. 7: 8 different slots"


@pytest.mark.catches("row_not_mod_8")
def test_rows_8_apart_share_a_layout(answer):
    for row in range(32):
        for chunk in range(8):
            assert slot(answer, row + 8, chunk) == slot(answer, row, chunk), (
                f"chunk {chunk} of rows {row} and {row + 8}: slots {slot(answer, row, chunk)} and "
                f"{slot(answer, row + 8, chunk)}; the swizzle XORs with row mod 8, so rows 8 apart share a layout")


@pytest.mark.catches("no_swizzle", "row_not_mod_8")
def test_slots_match_the_library(answer):
    for row, chunk, expected in ((9, 2, 3), (3, 5, 6), (11, 5, 6), (127, 0, 7)):
        assert slot(answer, row, chunk) == expected, (f"swizzle_128b({row}, {chunk}) = {slot(answer, row, chunk)}, "
                                                      f"expected {expected} ({chunk} XOR {row % 8})")
    for row in range(256):
        for chunk in range(8):
            assert slot(answer, row, chunk) == library_slot(row, chunk), (
                f"swizzle_128b({row}, {chunk}) = {slot(answer, row, chunk)}, expected {library_slot(row, chunk)} "
                f"(lessons.gpu.source.wgmma_swizzle)")


@pytest.mark.catches(*MISTAKES)
def test_offsets_by_hand(answer):
    for (row, col), expected, why in (((0, 0), 0, "the first value"), ((0, 63), 126, "row 0 is not moved"),
                                      ((1, 0), 144, "chunk 0 of row 1 in slot 1: 128 + 16"),
                                      ((3, 20), 408, "chunk 2 of row 3 in slot 1, 5th value: 384 + 16 + 8"),
                                      ((9, 20), 1208, "chunk 2 of row 9 in slot 3: 1152 + 48 + 8")):
        got = offset(answer, row, col)
        assert got == expected, f"swizzled_offset({row}, {col}) = {got}, expected {expected} ({why})"


@pytest.mark.catches("xor_on_bytes")
@pytest.mark.hint("the swizzle moves whole 16-byte chunks: 128 x row + 16 x swizzle_128b(row, col // 8) + 2 x (col % 8)")
def test_a_chunk_keeps_its_values_in_order(answer):
    for row in range(8):                     # rows whose slots every swizzle of row mod 8 or of row agrees on
        for col in range(64):
            got, expected = offset(answer, row, col), 128 * row + 16 * slot(answer, row, col // 8) + 2 * (col % 8)
            assert got == expected, (
                f"swizzled_offset({row}, {col}) = {got}, expected {expected}: the row's 128 bytes, then the slot your "
                f"swizzle_128b gives chunk {col // 8} ({slot(answer, row, col // 8)}), then value {col % 8} of it")


@pytest.mark.catches(*MISTAKES)
@given(rows=st.integers(1, 512), data=st.data())
def test_offsets_match_the_library(answer, rows, data):
    for _ in range(8):
        row, col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, 63))
        expected = wgmma_swizzle(row, col, rows, 64)
        assert offset(answer, row, col) == expected, (
            f"swizzled_offset({row}, {col}) = {offset(answer, row, col)}, expected {expected} "
            f"(lessons.gpu.source.wgmma_swizzle)")


@pytest.mark.catches("no_swizzle", "row_not_mod_8")
def test_passes_by_hand(answer):
    for rows, expected, why in ((range(8), 1, "8 rows, 8 different slots"), (range(8, 16), 1, "rows 8 .. 15 too"),
                                ((0, 8), 2, "both in slot 2"), (range(16), 2, "each slot holds 2 of the 16"),
                                ((0, 8, 16, 24), 4, "all four in slot 2"), ((5,), 1, "one chunk")):
        got = passes(answer, rows, 2)
        assert got == expected, f"read_passes({list(rows)}, 2) = {got}, expected {expected} ({why})"


@pytest.mark.catches("no_swizzle")
def test_eight_consecutive_rows_read_in_one_pass(answer):
    for first in range(0, 40, 3):
        for chunk in range(8):
            got = passes(answer, range(first, first + 8), chunk)
            assert got == 1, (f"chunk {chunk} of rows {first} .. {first + 7}: {got} passes, expected 1 (8 rows, one "
                              f"each of row mod 8: 8 different slots, the 32 banks once)")


@pytest.mark.catches("no_swizzle", "row_not_mod_8")
@given(rows=st.sets(st.integers(0, 63), min_size=1, max_size=24), chunk=st.integers(0, 7))
def test_passes_match_the_banks(answer, rows, chunk):
    rows = sorted(rows)
    expected = bank_passes(rows, chunk)
    assert passes(answer, rows, chunk) == expected, (
        f"read_passes({rows}, {chunk}) = {passes(answer, rows, chunk)}, expected {expected} (the most chunks "
        f"asking one of the 32 banks for a word, offsets from lessons.gpu.source.wgmma_swizzle)")

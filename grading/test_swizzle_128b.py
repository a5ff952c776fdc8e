"""Grading: the 128-byte swizzle of the Hopper rungs' tiles and the bank conflicts it removes (notebook 11).

Expected values come from :func:`lessons.gpu.source.wgmma_swizzle` (the byte offset of an element of a tile as TMA
writes it and wgmma reads it, the layout the emulator checks the kernels with), from the cases worked by hand in the
stub's docstring, and for the passes from the banks themselves: each chunk's four 4-byte banks counted from its byte
offset, the passes being the most different chunks that ask one bank for a word.

A float that equals the right int fails only the checks of the types, so its hint is about the type. The checks
that catch a single mistake look for that mistake's signature in the answer (every slot of rows 0 .. 15 left in
place, say) and pass any other answer, wrong or right, so that a hint is shown only to an answer that makes its
mistake; an answer wrong in another way gets the advice of the checks it fails and what they asserted.
"""
import numbers
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from lessons.gpu.source import wgmma_swizzle

EXERCISE = "swizzle_128b"
SLOT_MISTAKES = ("no_swizzle", "row_not_mod_8", "rotation_not_xor", "row_div_8")
OFFSET_MISTAKES = ("xor_on_bytes", "four_byte_values")
PASS_MISTAKES = ("distinct_slots",)
BANKS, BANK_BYTES = 32, 4
SLOT_HINT = "swizzle_128b(row, chunk) is chunk XOR (row % 8), a slot from 0 to 7"
OFFSET_HINT = ("the swizzle moves whole 16-byte chunks: 128 x row + 16 x swizzle_128b(row, col // 8) + "
               "2 x (col % 8)")
PASS_HINT = ("read_passes is the most of the rows' chunks that share one slot: count swizzle_128b(r, chunk) over "
             "the rows and take the largest count")


def a_number(got, what):
    """``got``, checked to be a number (that it is an int has checks of its own, so that 3.0 is not taken for a
    mistake in the rule); a bool or a non-number fails naming ``what``."""
    assert isinstance(got, numbers.Real) and not isinstance(got, bool), (
        f"{what}: expected an int, got {type(got).__name__} {got!r}")
    return got


def assert_an_int(call, what):
    """What ``call()`` returns is an int (not a bool); an answer that raises is left to the other checks, so that
    this check's hint is shown only for a value of the wrong type."""
    try:
        got = call()
    except Exception:
        return
    assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
        f"{what}: expected an int, got {type(got).__name__} {got!r}")


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


def shows(signature):
    """Whether an answer shows a mistake's signature: ``signature()`` is true. An answer that raises or returns
    something other than a number there does not show it (the other checks report what it did)."""
    try:
        return bool(signature())
    except Exception:
        return False


def raw_slot(answer, row, chunk):
    return a_number(answer.swizzle_128b(row, chunk), f"swizzle_128b({row}, {chunk})")


def slot(answer, row, chunk):
    got = raw_slot(answer, row, chunk)
    assert 0 <= got < 8, (f"swizzle_128b({row}, {chunk}) = {got}: a 128-byte row has 8 slots of 16 bytes, "
                          f"0 to 7")
    return got


def offset(answer, row, col):
    return a_number(answer.swizzled_offset(row, col), f"swizzled_offset({row}, {col})")


def passes(answer, rows, chunk):
    return a_number(answer.read_passes(list(rows), chunk), f"read_passes({list(rows)}, {chunk})")


# --- the types: an int each (a float has only this hint, not one about the rule) ------------------------------

@pytest.mark.hint("swizzle_128b returns an int: a slot from 0 to 7")
def test_swizzle_128b_returns_an_int(answer):
    for row, chunk in ((0, 0), (3, 5), (9, 2)):
        assert_an_int(lambda: answer.swizzle_128b(row, chunk), f"swizzle_128b({row}, {chunk})")


@pytest.mark.hint("swizzled_offset returns an int: a count of bytes")
def test_swizzled_offset_returns_an_int(answer):
    for row, col in ((0, 0), (3, 20), (9, 20)):
        assert_an_int(lambda: answer.swizzled_offset(row, col), f"swizzled_offset({row}, {col})")


@pytest.mark.hint("read_passes returns an int: a count of passes")
def test_read_passes_returns_an_int(answer):
    for rows, chunk in ((range(8), 2), ((0, 8), 2), ((5,), 0)):
        assert_an_int(lambda: answer.read_passes(list(rows), chunk), f"read_passes({list(rows)}, {chunk})")


# --- swizzle_128b -----------------------------------------------------------------------------------------------

@pytest.mark.hint("swizzle_128b returns a slot from 0 to 7 whatever the row: a 128-byte row has 8 slots of 16 bytes")
def test_a_slot_is_from_0_to_7(answer):
    for row in range(40):
        for chunk in range(8):
            slot(answer, row, chunk)


@pytest.mark.catches(*SLOT_MISTAKES)
@pytest.mark.hint(SLOT_HINT)
def test_slots_of_rows_0_to_7_by_hand(answer):
    assert [slot(answer, 0, c) for c in range(8)] == list(range(8)), "row 0 keeps every chunk in place"
    got = [slot(answer, r, 2) for r in range(8)]
    assert got == [2, 3, 0, 1, 6, 7, 4, 5], (f"chunk 2 of rows 0 .. 7: slots {got}, expected [2, 3, 0, 1, 6, 7, 4, 5] "
                                             f"(2 XOR 0, 2 XOR 1, ...)")
    assert sorted(slot(answer, r, 5) for r in range(8)) == list(range(8)), "chunk 5 of rows 0 .. 7: 8 different slots"


@pytest.mark.catches(*SLOT_MISTAKES)
@pytest.mark.hint(SLOT_HINT)
def test_rows_8_apart_share_a_layout(answer):
    for row in range(32):
        for chunk in range(8):
            assert slot(answer, row + 8, chunk) == slot(answer, row, chunk), (
                f"chunk {chunk} of rows {row} and {row + 8}: slots {slot(answer, row, chunk)} and "
                f"{slot(answer, row + 8, chunk)}; the swizzle XORs with row mod 8, so rows 8 apart share a layout")


@pytest.mark.catches(*SLOT_MISTAKES)
@pytest.mark.hint(SLOT_HINT)
def test_slots_match_the_library(answer):
    for row, chunk, expected in ((9, 2, 3), (3, 5, 6), (11, 5, 6), (127, 0, 7)):
        assert slot(answer, row, chunk) == expected, (f"swizzle_128b({row}, {chunk}) = {slot(answer, row, chunk)}, "
                                                      f"expected {expected} ({chunk} XOR {row % 8})")
    for row in range(256):
        for chunk in range(8):
            assert slot(answer, row, chunk) == library_slot(row, chunk), (
                f"swizzle_128b({row}, {chunk}) = {slot(answer, row, chunk)}, expected {library_slot(row, chunk)} "
                f"(lessons.gpu.source.wgmma_swizzle)")


# Each of these fails only for the one mistake it names (the answer's slots show its signature), so that its hint
# is shown only to answers that make it; a slot wrong in another way fails only the checks above.

@pytest.mark.catches("no_swizzle")
def test_the_swizzle_moves_some_chunk(answer):
    unmoved = shows(lambda: all(raw_slot(answer, r, c) == c for r in range(16) for c in range(8)))
    assert not unmoved, "every chunk of rows 0 .. 15 stays in slot = chunk: the tile is stored unswizzled"


@pytest.mark.catches("row_not_mod_8")
def test_the_slot_is_not_chunk_xor_row(answer):
    whole_row = shows(lambda: all(raw_slot(answer, r, c) == c ^ r for r in range(64) for c in range(8)))
    assert not whole_row, (f"every chunk c of rows r = 0 .. 63 sits in slot c XOR r: swizzle_128b(9, 2) = "
                           f"{raw_slot(answer, 9, 2)}, past the 8 slots of a row; XOR with row % 8 gives slot 3")


@pytest.mark.catches("rotation_not_xor")
def test_the_slot_is_not_a_rotation(answer):
    rotated = shows(lambda: all(raw_slot(answer, r, c) % 8 == (c + r) % 8 for r in range(8) for c in range(8)))
    assert not rotated, ("every chunk c of rows r = 0 .. 7 sits in slot (c + r) % 8, a rotation: chunk 2 of rows "
                         "0 .. 7 in slots 2, 3, 4, 5, 6, 7, 0, 1, not 2 XOR r: 2, 3, 0, 1, 6, 7, 4, 5")


@pytest.mark.catches("row_div_8")
def test_the_slot_is_not_chunk_xor_row_div_8(answer):
    by_group = shows(lambda: all(raw_slot(answer, r, c) == c ^ (r // 8) for r in range(64) for c in range(8)))
    assert not by_group, ("every chunk c of rows r = 0 .. 63 sits in slot c XOR (r // 8): rows 0 .. 7 keep every "
                          "chunk in place, so the 8 rows read at once share a slot")


# --- swizzled_offset --------------------------------------------------------------------------------------------

@pytest.mark.hint(OFFSET_HINT)
def test_a_chunk_keeps_its_values_in_order(answer):
    # on the answer's own slots, right or not, so that a wrong swizzle_128b is not taken for a wrong offset
    for row in range(8):                     # rows whose slots every swizzle of row mod 8 or of row agrees on
        for col in range(64):
            got, expected = offset(answer, row, col), 128 * row + 16 * slot(answer, row, col // 8) + 2 * (col % 8)
            assert got == expected, (
                f"swizzled_offset({row}, {col}) = {got}, expected {expected}: the row's 128 bytes, then the slot your "
                f"swizzle_128b gives chunk {col // 8} ({slot(answer, row, col // 8)}), then value {col % 8} of it")


@pytest.mark.catches(*SLOT_MISTAKES, *OFFSET_MISTAKES)
def test_offsets_by_hand(answer):
    for (row, col), expected, why in (((0, 0), 0, "the first value"), ((0, 63), 126, "row 0 is not moved"),
                                      ((1, 0), 144, "chunk 0 of row 1 in slot 1: 128 + 16"),
                                      ((3, 20), 408, "chunk 2 of row 3 in slot 1, 5th value: 384 + 16 + 8"),
                                      ((9, 20), 1208, "chunk 2 of row 9 in slot 3: 1152 + 48 + 8")):
        got = offset(answer, row, col)
        assert got == expected, f"swizzled_offset({row}, {col}) = {got}, expected {expected} ({why})"


@pytest.mark.catches(*SLOT_MISTAKES, *OFFSET_MISTAKES)
@given(rows=st.integers(1, 512), data=st.data())
def test_offsets_match_the_library(answer, rows, data):
    for _ in range(8):
        row, col = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, 63))
        expected = wgmma_swizzle(row, col, rows, 64)
        assert offset(answer, row, col) == expected, (
            f"swizzled_offset({row}, {col}) = {offset(answer, row, col)}, expected {expected} "
            f"(lessons.gpu.source.wgmma_swizzle)")


@pytest.mark.catches("xor_on_bytes")
def test_the_xor_does_not_move_values_inside_their_chunk(answer):
    # the signature: every chunk of rows 0 .. 7 stays in its unswizzled 16 bytes, but some values change places
    def signature():
        inside, moved = True, False
        for row in range(8):
            for col in range(64):
                byte = offset(answer, row, col) - 128 * row
                inside = inside and byte // 16 == col // 8
                moved = moved or byte % 16 != 2 * (col % 8)
        return inside and moved
    assert not shows(signature), ("every chunk of rows 0 .. 7 stays in its unswizzled 16 bytes and some of its "
                                    "values change places: the XOR acts on the byte offset, not on the chunk index")


@pytest.mark.catches("four_byte_values")
def test_values_are_2_bytes_apart(answer):
    apart = shows(lambda: {offset(answer, 0, col + 1) - offset(answer, 0, col)
                           for col in range(63) if col % 8 != 7} == {4})
    assert not apart, ("consecutive values of a chunk of row 0 lie 4 bytes apart: a 16-bit value is 2 bytes "
                          "(swizzled_offset(0, 1) = 4, expected 2)")


# --- read_passes ------------------------------------------------------------------------------------------------

@pytest.mark.hint(PASS_HINT)
def test_passes_count_the_fullest_of_your_slots(answer):
    # on the answer's own slots, right or not, so that a wrong swizzle_128b is not taken for a wrong read_passes
    for rows, chunk in ((range(8), 2), ((0, 8), 2), (range(16), 5), ((0, 8, 16, 24), 2), ((5,), 0), ((1, 2, 9), 2)):
        own = Counter(raw_slot(answer, r, chunk) for r in rows)
        got = passes(answer, rows, chunk)
        assert got == max(own.values()), (
            f"read_passes({list(rows)}, {chunk}) = {got}, expected {max(own.values())}: your swizzle_128b puts the "
            f"chunks in slots {[raw_slot(answer, r, chunk) for r in rows]}, the fullest holds {max(own.values())}")


@pytest.mark.catches(*SLOT_MISTAKES, *PASS_MISTAKES)
def test_passes_by_hand(answer):
    for rows, expected, why in ((range(8), 1, "8 rows, 8 different slots"), (range(8, 16), 1, "rows 8 .. 15 too"),
                                ((0, 8), 2, "both in slot 2"), (range(16), 2, "each slot holds 2 of the 16"),
                                ((0, 8, 16, 24), 4, "all four in slot 2"), ((5,), 1, "one chunk")):
        got = passes(answer, rows, 2)
        assert got == expected, f"read_passes({list(rows)}, 2) = {got}, expected {expected} ({why})"


@pytest.mark.catches(*SLOT_MISTAKES, *PASS_MISTAKES)
def test_eight_consecutive_rows_read_in_one_pass(answer):
    for first in range(0, 40, 3):
        for chunk in range(8):
            got = passes(answer, range(first, first + 8), chunk)
            assert got == 1, (f"chunk {chunk} of rows {first} .. {first + 7}: {got} passes, expected 1 (8 rows, one "
                              f"each of row mod 8: 8 different slots, the 32 banks once)")


@pytest.mark.catches(*SLOT_MISTAKES, *PASS_MISTAKES)
@given(rows=st.sets(st.integers(0, 63), min_size=1, max_size=24), chunk=st.integers(0, 7))
def test_passes_match_the_banks(answer, rows, chunk):
    rows = sorted(rows)
    expected = bank_passes(rows, chunk)
    assert passes(answer, rows, chunk) == expected, (
        f"read_passes({rows}, {chunk}) = {passes(answer, rows, chunk)}, expected {expected} (the most chunks "
        f"asking one of the 32 banks for a word, offsets from lessons.gpu.source.wgmma_swizzle)")


@pytest.mark.catches("distinct_slots")
def test_passes_are_not_the_count_of_slots_used(answer):
    # the signature, on the answer's own slots (right or not): read_passes is the number of different slots
    # wherever that differs from the count in the fullest slot
    def signature():
        differ = 0
        for rows in (range(8), (0, 8), range(16), (0, 8, 16, 24), (1, 2, 9)):
            own = Counter(raw_slot(answer, r, 2) for r in rows)
            if len(own) != max(own.values()):
                differ += 1
                if passes(answer, rows, 2) != len(own):
                    return False
        return differ > 0
    assert not shows(signature), ("read_passes gives the number of different slots the rows' chunks use "
                                  "(rows 0 .. 7: 8), not the most chunks in one slot (rows 0 .. 7: 1)")

"""Grading: the wave model of a decode launch and the split count it picks (notebook 10).

Expected values come from :func:`lessons.gpu.source.decode_split_cost` and
:func:`lessons.gpu.source.decode_splits` (the functions the split decode kernel's launcher asks, the latter
called with one block per SM so that its wave is the ``wave`` given here), from the shapes worked by hand in
the stub's docstrings (waves and pages per block counted in each message), and from properties: the pick never
spills blocks into a second wave unless it is a single split, and one split more never takes less time.
"""
import numbers

import pytest
from hypothesis import given, strategies as st

from lessons.gpu.source import decode_split_cost
from lessons.gpu.source import decode_splits as library_decode_splits

EXERCISE = "decode_splits"
TIME_MISTAKES = ("fractional_waves", "waves_floor_plus_one", "floor_pages_per_block")
SPLIT_MISTAKES = ("fewest_splits_filling_the_wave", "splits_not_capped_at_pages", "zero_splits")


def reference(blocks_per_split, pages, wave):
    """The library's pick for ``blocks_per_split`` blocks per split, ``pages`` pages, a wave of ``wave`` blocks
    (one KV head, pages of one token, ``wave`` SMs of one block each, no cap but the pages)."""
    return library_decode_splits(blocks_per_split, 1, pages, block_size=1, num_sms=wave, blocks_per_sm=1,
                                 max_splits=1 << 31)


# --- wave_time ----------------------------------------------------------------------------------------------

def assert_time(answer, num_splits, bps, pages, wave, expected, why):
    got = answer.wave_time(num_splits, bps, pages, wave)
    assert isinstance(got, numbers.Real) and got == expected, (
        f"wave_time({num_splits} splits, {bps} blocks per split, {pages} pages, a wave of {wave}) = {got!r}, "
        f"expected {expected} ({why})")


@pytest.mark.hint("wave_time returns an int: whole waves times whole pages")
def test_wave_time_is_an_int(answer):
    for args in ((8, 64, 2048, 528), (9, 64, 2048, 528), (3, 1, 7, 1)):
        got = answer.wave_time(*args)
        assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
            f"wave_time{args}: expected an int, got {type(got).__name__} {got!r}")


@pytest.mark.catches(*TIME_MISTAKES)
def test_wave_time_worked_by_hand(answer):
    assert_time(answer, 8, 64, 2048, 528, 1 * 256, "512 blocks: one wave; 2048 / 8 = 256 pages per block")
    assert_time(answer, 9, 64, 2048, 528, 2 * 228, "576 blocks: 528, then 48 in a second wave; ceil(2048 / 9)")
    assert_time(answer, 66, 8, 8192, 528, 1 * 125, "528 blocks: one wave; ceil(8192 / 66) = 125")
    assert_time(answer, 3, 1, 7, 1, 3 * 3, "a wave of one block: 3 waves; ceil(7 / 3) = 3")


@pytest.mark.catches("fractional_waves")
def test_a_wave_of_a_few_blocks_lasts_a_whole_wave(answer):
    # the pages divide evenly here: only the waves are counted
    assert_time(answer, 8, 64, 2048, 528, 1 * 256, "512 of 528 slots busy is still one whole wave")
    assert_time(answer, 2, 416, 256, 528, 2 * 128, "832 blocks: a full wave and one of 304, two waves")
    assert_time(answer, 4, 3, 60, 10, 2 * 15, "12 blocks in waves of 10: two waves, the second of 2 blocks")


@pytest.mark.catches("waves_floor_plus_one")
def test_blocks_that_fill_whole_waves_take_those_waves(answer):
    # the blocks fill whole waves exactly and the pages divide evenly: only the count of whole waves is checked
    assert_time(answer, 66, 8, 8250, 528, 1 * 125, "528 blocks fill one wave of 528 exactly: 1 wave, not 2")
    assert_time(answer, 8, 132, 800, 528, 2 * 100, "1056 blocks are two full waves of 528: 2 waves, not 3")
    assert_time(answer, 4, 3, 60, 12, 1 * 15, "12 blocks in a wave of 12: 1 wave")


@pytest.mark.catches("floor_pages_per_block")
def test_the_fullest_split_sets_the_time(answer):
    # the waves cancel out: the time at one page per split is the answer's own count of waves, and the time at
    # `pages` must be that count times the pages of the fullest split, however the waves are counted
    for splits, bps, pages, wave, fullest, why in (
            (9, 64, 2048, 528, 228, "2048 pages in 9 splits: some hold 228"),
            (3, 1, 7, 3, 3, "7 pages in 3 splits: 3, 2 and 2"),
            (7, 1, 8, 7, 2, "8 pages in 7 splits: one split holds 2")):
        waves = answer.wave_time(splits, bps, splits, wave)
        assert_time(answer, splits, bps, pages, wave, waves * fullest,
                    f"{why}: your time at one page per split, {waves!r} (the waves), x {fullest}")


@pytest.mark.catches(*TIME_MISTAKES)
@given(splits=st.integers(1, 3000), bps=st.integers(1, 2000), pages=st.integers(1, 20000),
       wave=st.integers(1, 2000))
def test_wave_time_random_shapes_match_the_library(answer, splits, bps, pages, wave):
    assert_time(answer, splits, bps, pages, wave, decode_split_cost(splits, bps, pages, wave),
                "lessons.gpu.source.decode_split_cost")


# --- decode_splits ------------------------------------------------------------------------------------------

def split_count(answer, blocks_per_split, pages, wave):
    """The answer's count, checked to be one number in 1..pages (that it is an int has a check of its own,
    :func:`test_decode_splits_is_an_int`, so that 8.0 is not taken for a mistake in the rule)."""
    got = answer.decode_splits(blocks_per_split, pages, wave)
    what = f"{blocks_per_split} blocks per split, {pages} pages, a wave of {wave}"
    assert isinstance(got, numbers.Real), f"{what}: expected an int, got {type(got).__name__} {got!r}"
    assert 1 <= got <= pages, f"{what}: {got} splits; a launch has at least 1 split and at most one per page"
    return got


@pytest.mark.hint("decode_splits returns an int: a count of splits (wave // blocks_per_split, not wave / "
                  "blocks_per_split)")
def test_decode_splits_is_an_int(answer):
    for args in ((64, 2048, 528), (8, 7, 528), (1024, 256, 528), (100, 1000, 528)):
        got = answer.decode_splits(*args)
        assert isinstance(got, numbers.Integral) and not isinstance(got, bool), (
            f"decode_splits{args}: expected an int, got {type(got).__name__} {got!r}")


def assert_splits(answer, blocks_per_split, pages, wave, expected, why):
    got = split_count(answer, blocks_per_split, pages, wave)
    assert got == expected, (f"{blocks_per_split} blocks per split, {pages} pages, a wave of {wave}: {got} splits, "
                             f"expected {expected} ({why})")


@pytest.mark.catches("splits_not_capped_at_pages", "zero_splits")
@pytest.mark.hint("return one split count between 1 and pages")
def test_one_number_between_one_and_the_pages(answer):
    for bps, pages, wave in ((64, 2048, 528), (8, 7, 528), (1024, 256, 528), (1, 1, 1), (3, 40, 10)):
        split_count(answer, bps, pages, wave)


@pytest.mark.catches(*SPLIT_MISTAKES)
def test_the_shapes_worked_by_hand(answer):
    # 32 query heads on 8 KV heads, one block per KV head, pages of 16 tokens, 132 SMs x 4 blocks
    assert_splits(answer, 64, 2048, 528, 8, "8 x 32768 tokens: 8 splits are 512 blocks, one wave of 256 pages "
                                            "per block; 9 are 576, two waves of 228")
    assert_splits(answer, 8, 8192, 528, 66, "1 x 131072 tokens: 66 x 8 = 528 blocks fill the wave exactly")
    assert_splits(answer, 512, 256, 528, 1, "64 x 4096 tokens: a second split would not fit: 1024 blocks")
    assert_splits(answer, 8, 7, 528, 7, "1 x 100 tokens: 7 pages, so at most 7 splits")
    assert_splits(answer, 1024, 256, 528, 1, "128 x 4096 tokens: one split is already 1024 blocks")


@pytest.mark.catches("fewest_splits_filling_the_wave")
def test_no_split_spills_a_few_blocks_into_a_second_wave(answer):
    # few pages: here the pick is also the cheapest count of the wave model, so only the spill is checked
    assert_splits(answer, 64, 16, 528, 8, "9 splits: 576 blocks, 48 of them in a second wave: 2 x 2 pages; 8: 1 x 2")
    assert_splits(answer, 100, 10, 528, 5, "6 splits: 600 blocks, 72 in a second wave: 2 x 2 pages; 5: 1 x 2")
    assert_splits(answer, 3, 6, 10, 3, "4 splits: 12 blocks in a wave of 10, two waves of 2 pages; 3: one of 2")
    assert_splits(answer, 200, 4, 528, 2, "3 splits: 600 blocks, 72 in a second wave: 2 x 2 pages; 2: 1 x 2")


@pytest.mark.hint("decode_splits is the most splits whose blocks fit in one wave, not the count of least wave_time: "
                  "over several waves the model can find a count a little cheaper (8 x 32768 tokens: 683 splits, "
                  "83 waves x 3 = 249 pages against 8 splits' 1 x 256), but such counts write many more partial "
                  "states to merge and assume blocks that finish in step; the kernel stays in one wave")
def test_the_pick_stays_in_one_wave_where_more_waves_cost_a_little_less(answer):
    assert_splits(answer, 64, 2048, 528, 8, "the most that fit in one wave: 8 x 64 = 512 blocks")
    assert_splits(answer, 100, 1000, 528, 5, "the most that fit in one wave: 5 x 100 = 500 blocks")


@pytest.mark.catches("splits_not_capped_at_pages")
def test_never_more_splits_than_pages(answer):
    assert_splits(answer, 8, 7, 528, 7, "7 pages: an 8th split would read no page")
    assert_splits(answer, 64, 5, 528, 5, "5 pages, though 8 splits fit in the wave")
    assert_splits(answer, 2, 1, 528, 1, "a sequence of one page is one split")


@pytest.mark.catches("zero_splits")
def test_a_grid_larger_than_a_wave_is_one_split(answer):
    assert_splits(answer, 1000, 4, 528, 1, "1000 blocks per split, a wave of 528")
    assert_splits(answer, 1024, 2, 528, 1, "1024 blocks per split, a wave of 528")
    assert_splits(answer, 4000, 1, 7, 1, "4000 blocks per split, a wave of 7")


@pytest.mark.catches(*SPLIT_MISTAKES)
@given(bps=st.integers(1, 2000), pages=st.integers(1, 20000), wave=st.integers(1, 2000))
def test_random_shapes_match_the_library(answer, bps, pages, wave):
    assert_splits(answer, bps, pages, wave, reference(bps, pages, wave), "lessons.gpu.source.decode_splits")


@pytest.mark.catches(*SPLIT_MISTAKES)
@given(bps=st.integers(1, 600), pages=st.integers(1, 3000), wave=st.integers(1, 600))
def test_random_shapes_fit_in_one_wave_and_one_more_costs_no_less(answer, bps, pages, wave):
    """The pick never spills into a second wave (its blocks fit in one, or it is a single split), and one split
    more, where there is a page for it and one split fits in a wave, costs at least as much in the wave model
    (decode_split_cost)."""
    got = split_count(answer, bps, pages, wave)
    assert got == 1 or got * bps <= wave, (
        f"{bps} blocks per split, {pages} pages, a wave of {wave}: {got} splits are {got * bps} blocks, "
        f"{-(-got * bps // wave)} waves; the last holds only {got * bps - (-(-got * bps // wave) - 1) * wave}")
    if got < pages and bps <= wave:
        assert got == int(got), f"{bps} blocks per split, {pages} pages, a wave of {wave}: {got!r} splits"
        got = int(got)                               # (8.0 has its own check: test_decode_splits_is_an_int)
        assert decode_split_cost(got + 1, bps, pages, wave) >= decode_split_cost(got, bps, pages, wave), (
            f"{bps} blocks per split, {pages} pages, a wave of {wave}: {got + 1} splits cost less than {got}")

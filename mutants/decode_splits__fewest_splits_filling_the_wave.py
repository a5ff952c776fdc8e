"""Known-wrong answer to the exercise ``decode_splits`` (mistake ``fewest_splits_filling_the_wave``).

The mistake: the fewest splits that fill a wave, ceil(wave / blocks_per_split), without weighing
them against the most that fit in one: 8 x 32768 tokens get 9 splits, 48 blocks of them in a second wave.
Everything else is the reference answer (solutions/decode_splits.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "decode_splits"
MISTAKE = "fewest_splits_filling_the_wave"


def decode_splits(blocks_per_split, pages, wave):
    """The split count the wave model picks for one decode launch.

    Parameters
    ----------
    blocks_per_split : int >= 1
        Blocks the grid has for each split: sequences x KV heads (x blocks per group of query heads).
    pages : int >= 1
        Pages of K/V of the longest sequence. A split of no page does nothing.
    wave : int >= 1
        Blocks the GPU runs at once: SMs x blocks per SM.

    Returns
    -------
    num_splits : int, 1 <= num_splits <= pages
        1 when one split already gives at least 80% of a wave (more splits would only add partial
        states to merge). Otherwise one of the two counts around ``wave / blocks_per_split`` (the
        most splits whose blocks fit in one wave, and the fewest that fill it), each kept within
        ``1 .. pages``: the one with the lower modelled time ``waves x pages per block`` (whole
        waves, whole pages: a wave of a few blocks lasts as long as a full one), the fewer splits
        on a tie.

    What must hold (32 query heads on 8 KV heads served by one block per KV head, pages of 16
    tokens, a wave of 528): 8 sequences x 32768 tokens (64 blocks per split, 2048 pages) -> 8, not
    9, whose 576 blocks spill 48 into a second wave; 1 x 131072 (8 blocks, 8192 pages) -> 66;
    64 x 4096 (512 blocks, 256 pages) -> 1; 1 x 100 tokens (8 blocks, 7 pages) -> 7; 128 x 4096
    (1024 blocks, more than a wave) -> 1.
    """
    if blocks_per_split * 5 >= wave * 4:                      # one split already gives 80% of a wave
        return 1
    fit = max(1, min(wave // blocks_per_split, pages))         # the most splits whose blocks fit in one wave
    fill = max(1, min(-(-wave // blocks_per_split), pages))    # the fewest splits that fill it

    def time(splits):                                          # waves x pages per block
        return -(-splits * blocks_per_split // wave) * -(-pages // splits)

    return fill                                                # the fewest splits that fill the wave

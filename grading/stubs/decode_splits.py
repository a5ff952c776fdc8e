"""decode_splits (notebook 10): how many splits a decode kernel cuts each sequence into.

A flash-decoding kernel launches one block per sequence and group of query heads *per split*:
cutting the keys into more splits gives the GPU more blocks to run side by side, each reading
fewer pages. The GPU holds a *wave* of blocks at once (SMs x blocks per SM: 132 x 4 = 528 for
the split kernel on an H200); a block that does not fit waits for a whole block of the first
wave to finish, so a launch whose blocks all read about as many pages takes
``waves x pages per block``. The split count is picked from the shape with that model.

Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference" (splitting
the keys); FlashAttention-2's ``num_splits_heuristic`` (splits from the wave efficiency);
here reduced to one wave of resident blocks, as ``lessons.gpu.source.decode_splits`` does.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("decode_splits")``. A reference answer is in ``solutions/decode_splits.py``.
"""


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
    raise NotImplementedError

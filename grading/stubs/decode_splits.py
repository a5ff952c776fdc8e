"""decode_splits (notebook 10): how many splits a decode kernel cuts each sequence into.

A flash-decoding kernel launches one block per sequence and group of query heads *per split*:
cutting the keys into more splits gives the GPU more blocks to run side by side, each reading
fewer pages. The GPU holds a *wave* of blocks at once (SMs x blocks per SM: 132 x 4 = 528 for
the split kernel on an H200); a block that does not fit waits for a block of the first wave to
finish, and decode blocks, bound by memory, all take about as long as their pages. So the model
of notebook 10 counts a launch's time in pages read by one block: whole waves x the pages of
the fullest split. The split count is picked from the shape with that model.

Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference" (splitting
the keys); FlashAttention-2's ``num_splits_heuristic`` (splits from the wave efficiency);
here reduced to one wave of resident blocks, as ``lessons.gpu.source.decode_splits`` does.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("decode_splits")``. A reference answer is in ``solutions/decode_splits.py``.
"""


def wave_time(num_splits, blocks_per_split, pages, wave):
    """The wave model's time of one decode launch, in pages read by one block.

    Parameters
    ----------
    num_splits : int >= 1
        Splits each sequence is cut into (split ``s`` reads its share of the pages).
    blocks_per_split : int >= 1
        Blocks the grid has for each split: sequences x KV heads (x blocks per group of query heads).
    pages : int >= 1
        Pages of K/V of the longest sequence.
    wave : int >= 1
        Blocks the GPU runs at once: SMs x blocks per SM.

    Returns
    -------
    time : int
        The waves the launch's ``num_splits x blocks_per_split`` blocks take (a wave of a few blocks
        lasts as long as a full one) times the pages of the split that holds the most (it sets how
        long a block reads).

    What must hold: 64 blocks per split, 2048 pages, a wave of 528 (8 sequences x 32768 tokens on an
    H200): 8 splits -> 256 (512 blocks: one wave; 256 pages each); 9 splits -> 456 (576 blocks: 528
    and then 48, two waves; some splits hold 228 pages). The same as
    ``lessons.gpu.source.decode_split_cost``.
    """
    raise NotImplementedError


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
        The most splits whose blocks all fit in one wave, never more than the pages and never
        fewer than 1. (Why not one more, to fill the wave? Ask ``wave_time``.)

    What must hold (32 query heads on 8 KV heads served by one block per KV head, pages of 16
    tokens, a wave of 528): 8 sequences x 32768 tokens (64 blocks per split, 2048 pages) -> 8, not
    9, whose 576 blocks spill 48 into a second wave; 1 x 131072 (8 blocks, 8192 pages) -> 66;
    64 x 4096 (512 blocks, 256 pages) -> 1; 1 x 100 tokens (8 blocks, 7 pages) -> 7; 128 x 4096
    (1024 blocks, more than a wave) -> 1. ``lessons.gpu.source.decode_splits`` picks the same count from the shape
    instead: its arguments are ``(num_seqs, num_kv_heads, seq_len)``, with pages of 16 tokens and a wave of 132 x 4
    blocks unless told otherwise, so ``lessons.gpu.source.decode_splits(8, 8, 32768)`` there is
    ``decode_splits(64, 2048, 528)`` here.
    """
    raise NotImplementedError

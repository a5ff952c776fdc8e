"""rescale_tiles (notebook 06): the key tiles where a block of query rows must rescale.

In the FA-2 loop every query row multiplies its running output by ``alpha`` at every key
tile, the correction for a running max that grew. A warp of the tensor-core kernels owns
16 query rows and does that multiply for all of them at once. Where no row of the block
raised its running max at a tile, ``alpha`` is exactly 1 in every row and the multiply
changes nothing, so the warp may skip it: the result stays bitwise the same. Which tiles
still need it depends only on the scores.

Source: Dao 2023, FlashAttention-2, Alg. 1 (the rescale by alpha); FlashAttention-4
(2025), conditional rescaling (here with threshold 0, so nothing is approximated).

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("rescale_tiles")``. A reference answer is in ``solutions/rescale_tiles.py``.
"""
import numpy as np


def rescale_tiles(scores, block_k):
    """Which key tiles a block of query rows must rescale at: one bool per tile.

    Parameters
    ----------
    scores : float array, shape (R, Nk)
        The scores of one block of R query rows against Nk keys, already scaled; ``-inf``
        marks a masked key (a row may see no key at all).
    block_k : int >= 1
        Keys per tile: tile 0 holds keys ``0 .. block_k - 1``, tile 1 the next ``block_k``, and so on; the last tile
        holds what is left and may be shorter.

    Returns
    -------
    moved : bool array, shape (ceil(Nk / block_k),)
        True at a tile where at least one row's running max (the max over its keys so
        far, ``-inf`` before any) strictly grew, so that row's ``alpha`` is not 1 there.

    What must hold: the first tile where a row sees a finite score is a move (from
    ``-inf``); a row that stays at ``-inf`` never moves; a score equal to the running max
    is no move; a row whose own max grows moves the block, even when another row's max
    is larger; the last, short tile counts.
    """
    raise NotImplementedError

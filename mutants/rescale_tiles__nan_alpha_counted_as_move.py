"""Known-wrong answer to the exercise ``rescale_tiles`` (mistake ``nan_alpha_counted_as_move``).

The mistake: alpha = exp(m_old - m_new) tested against 1 with no guard: a row still at
-inf gives exp(-inf - -inf) = NaN, and NaN != 1 counts as a move.
Everything else is the reference answer (solutions/rescale_tiles.py). The grader must fail
this file and its hint must name the mistake (tests/test_grader.py checks both).
"""
EXERCISE = "rescale_tiles"
MISTAKE = "nan_alpha_counted_as_move"

import numpy as np


def rescale_tiles(scores, block_k):
    """Which key tiles a block of query rows must rescale at: one bool per tile.

    Parameters
    ----------
    scores : float array, shape (R, Nk)
        The scores of one block of R query rows against Nk keys, already scaled; ``-inf``
        marks a masked key (a row may see no key at all).
    block_k : int >= 1
        Keys per tile: tile 1 holds keys ``0 .. block_k - 1``, and so on; the last tile
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
    s = np.asarray(scores, dtype=np.float64)
    n_tiles = -(-s.shape[1] // block_k)
    moved = np.zeros(n_tiles, dtype=bool)
    m = np.full(s.shape[0], -np.inf)                       # each row's running max
    for t in range(n_tiles):
        m_new = np.maximum(m, s[:, t * block_k:(t + 1) * block_k].max(axis=1))
        with np.errstate(invalid="ignore"):
            alpha = np.exp(m - m_new)                      # NaN where both are -inf
        moved[t] = bool((alpha != 1).any())
        m = m_new
    return moved

"""The absorb step (notebook 02): fold one tile of scores into the running state.

Each query row keeps three things while the key tiles stream past: ``m`` the running
max of its scores, ``l`` the running sum of ``exp(s - m)``, and ``o`` the running sum
of ``exp(s - m) * v`` (not yet divided by ``l``). One tile updates them in five lines;
the whole of FlashAttention is this update in a loop, and ``o / l`` at the end.

Source: Dao 2023, FlashAttention-2, Alg. 1, lines 8-10; Dao et al. 2022, Alg. 1.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("absorb")``. A reference answer is in ``solutions/absorb.py``.
"""
import numpy as np


def absorb(m, l, o, s, v):
    """Fold one tile of scores into the state ``(m, l, o)`` of R query rows.

    Parameters
    ----------
    m : float array, shape (R,)       running max (``-inf`` for a row that saw nothing)
    l : float array, shape (R,)       running sum of ``exp(s - m)``
    o : float array, shape (R, dv)    running sum of ``exp(s - m) * v``, unnormalised
    s : float array, shape (R, T)     this tile's scaled scores, ``-inf`` where masked
    v : float array, shape (T, dv)    this tile's values

    Returns
    -------
    (m, l, o) : new arrays of the same shapes. Do not modify the inputs in place.

    What must hold after every tile (the grader checks each): ``m`` is the max of all
    scores absorbed so far, ``l`` and ``o`` are exactly the sums over all keys absorbed
    so far measured against that ``m``, and after the last tile ``o / l`` is the
    attention output, whatever the tile size. A row that has seen only ``-inf`` scores
    stays empty, ``(-inf, 0, 0)``, never NaN. Notebook 02, section 2, derives the update.
    """
    raise NotImplementedError

"""Flash-decoding (notebook 08): split the keys over workers, merge their states.

At decode time there is one query, so there are no query rows to hand out to the
GPU's thread blocks. Hand out the keys instead: each of ``num_splits`` workers runs
the usual recurrence over its own contiguous chunk of keys, producing a partial state
``(m, l, o)``, and a final step merges the partials. The merge is the same rescaling
the recurrence already does, applied to two states instead of a state and a tile.

Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference";
Dao 2023, FA-2 Alg. 1.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("flash_decoding")``. A reference answer is in ``solutions/flash_decoding.py``.
"""
import numpy as np


def merge(a, b):
    """Merge two partial states over disjoint sets of keys.

    Parameters
    ----------
    a, b : tuples ``(m, l, o)`` with ``m`` a float (max score), ``l`` a float (sum of
        ``exp(s - m)``), ``o`` a float array (dv,) (sum of ``exp(s - m) * v``).
        The empty state (a worker with no keys) is ``(-inf, 0.0, zeros(dv))``.

    Returns
    -------
    ``(m, l, o)`` for the union of the two key sets, as if one worker had folded
    them all. ``merge(a, b) == merge(b, a)``, merging with an empty state changes
    nothing, and two empty states merge to an empty state, never NaN.

    Notebook 08, section 1, derives the merge from the absorb step.
    """
    raise NotImplementedError


def flash_decoding(q, k, v, num_splits=4, tile=16):
    """Attention for one query with the keys split over ``num_splits`` workers.

    Parameters
    ----------
    q : float array, shape (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    num_splits : int >= 1, workers
    tile : int >= 1, keys per tile inside a worker

    Returns
    -------
    (out, partials) : ``out`` shape (dv,), equal to ``softmax(q . k / sqrt(d)) @ v``;
    ``partials`` a list of ``num_splits`` states ``(m, l, o)`` as in :func:`merge`, one
    per worker, in worker order.

    How the keys are split: with ``c = ceil(Nk / num_splits)``, worker i takes keys
    ``[i*c, min((i+1)*c, Nk))`` (trailing workers may get none: their state is empty).
    Each partial must be exactly its worker's state over its own keys, and ``out`` must
    not depend on ``num_splits`` or ``tile`` beyond rounding.
    """
    raise NotImplementedError

"""merge_states (notebook 08): merge two partial attention results, normalised form.

Kernels that split the keys (flash-decoding, ring attention, cascade/prefix caching)
write each partial result normalised: ``o`` already divided by its ``l``, plus
``lse = m + log(l)``, the log of the sum of ``exp(score)`` over that part's keys. Two
such partials combine exactly. A part with no keys is ``o = 0, lse = -inf``: it adds
nothing, so it must be the identity of the merge.

Source: Ye et al. 2025, FlashInfer, Sec. 3.1 (attention states and their merge);
vLLM ``merge_attn_states``.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("merge_states")``. A reference answer is in ``solutions/merge_states.py``.
"""
import numpy as np


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two normalised partial states over disjoint key sets.

    Parameters
    ----------
    o_a, o_b : float arrays, shape (R, dv), normalised outputs of the two parts
    lse_a, lse_b : float arrays, shape (R,), log-sum-exp of the scores of each part;
        ``-inf`` for an empty part (whose ``o`` is 0)

    Returns
    -------
    (o, lse) : shapes (R, dv) and (R,), the state over both key sets.

    What must hold: the result is the state of attention over the union of the two key
    sets (notebook 08, section 1, writes it in this form); the merge is commutative;
    ``lse`` values in the hundreds must not overflow; two empty parts give ``o = 0,
    lse = -inf``, never NaN and never ``lse = +inf``.
    """
    raise NotImplementedError

"""merge_states (notebook 08): merge two partial attention results, normalised form.

Kernels that split the keys (flash-decoding, ring attention, cascade/prefix caching)
write each partial result normalised: ``o`` already divided by its ``l``, plus
``lse = m + log(l)``, the log of the sum of ``exp(score)`` over that part's keys. Two
such partials combine exactly. A part with no keys is ``o = 0, lse = -inf``: it adds
nothing, so it must be the identity of the merge.

Source: Ye et al. 2025, FlashInfer, Sec. 3.1 (attention states and their merge);
vLLM ``merge_attn_states``.
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
    o_a, lse_a, o_b, lse_b = (np.asarray(x, dtype=np.float64) for x in (o_a, lse_a, o_b, lse_b))
    m = np.maximum(lse_a, lse_b)
    shift = np.where(np.isneginf(m), 0.0, m)              # both empty: subtract 0, not -inf
    w_a, w_b = np.exp(lse_a - shift), np.exp(lse_b - shift)
    total = w_a + w_b
    seen = total > 0
    safe = np.where(seen, total, 1.0)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, shift + np.log(safe), -np.inf)
    o = np.where(seen[:, None], (w_a[:, None] * o_a + w_b[:, None] * o_b) / safe[:, None], 0.0)
    return o, lse

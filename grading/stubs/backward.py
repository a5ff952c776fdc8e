"""The backward pass of attention, tile by tile (FlashAttention-2, Algorithm 2).

The forward kept only the output ``O`` and one number per query row, the
log-sum-exp ``L = m + log(l)``. From these alone the backward recomputes every
probability it needs, one ``block_q x block_k`` tile at a time, and never holds
the (Nq, Nk) matrices P, dP or dS.

The gradients, for ``O = softmax(scale * Q K^T) V`` and an upstream ``dO``:
``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)`` with ``D_i = sum_j P_ij dP_ij``,
``dQ = scale * dS K``, ``dK = scale * dS^T Q``. Two facts make them tileable:
``P_ij = exp(S_ij - L_i)`` needs no max and no sum, and ``D_i`` equals the dot
product of row i of ``dO`` with row i of ``O``.

Predict before you write it: with the outer loop over key blocks, how many times is
each ``K_j`` read, and how many times is each ``dQ_i`` read and written back? Which of
the three gradients does ``D`` not touch at all? If you drop the scale on ``dQ``, by
what factor is it wrong for ``d = 16``?

Source: Dao 2023, FlashAttention-2, Alg. 2; Dao et al. 2022, Sec. 3.1 and App. B.

Your answer: replace each ``raise NotImplementedError`` below, keeping the names
and signatures. Check it with ``make grade`` (all exercises) or, in the notebook,
``lessons.course.grade.check("backward")``. A reference answer is in ``solutions/backward.py``.
"""
import numpy as np


def flash_backward(q, k, v, o, lse, do, *, block_q=4, block_k=4, causal=False):
    """Gradients ``(dq, dk, dv)`` of attention, tile by tile, from the forward's ``o`` and ``lse``.

    Parameters
    ----------
    q : float64 array, shape (Nq, d)
    k : float64 array, shape (Nk, d)
    v : float64 array, shape (Nk, dv)
    o : float64 array, shape (Nq, dv), the forward's output
    lse : float64 array, shape (Nq,), the forward's log-sum-exp (``-inf`` for a row
        that sees no key)
    do : float64 array, shape (Nq, dv), the gradient of the loss with respect to o
    block_q, block_k : int >= 1, query rows and keys per block; need not divide Nq, Nk.
    causal : bool, bottom-right aligned: query i sees key j iff ``j <= i + Nk - Nq``
        (the forward was run with the same mask).

    Returns
    -------
    (dq, dk, dv) : shapes (Nq, d), (Nk, d), (Nk, dv). Scale the scores by ``1/sqrt(d)``.

    Rule: compute ``D`` once, then loop over key blocks ``j`` (outer) and query blocks
    ``i`` (inner). For each tile recompute the scores and ``P = exp(S - L_i)`` (0 where
    causal hides a key), add this tile's share to ``dV_j``, ``dK_j`` and ``dQ_i`` with the
    formulas above, and write ``dK_j``, ``dV_j`` once the inner loop is done. Never build a
    (Nq, Nk) array. A row with ``lse = -inf`` sees no key: its ``dq`` is 0 and it adds
    nothing to ``dk``, ``dv``; nothing may be NaN.
    """
    raise NotImplementedError

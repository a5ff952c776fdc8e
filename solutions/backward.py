"""The backward pass of attention, tile by tile (FlashAttention-2, Algorithm 2).

The forward kept only the output ``O`` and one number per query row, the
log-sum-exp ``L = m + log(l)``. From these alone the backward recomputes every
probability it needs, one ``block_q x block_k`` tile at a time, and never holds
the (Nq, Nk) matrices P, dP or dS.

The notebook derives the gradients of ``O = softmax(scale * Q K^T) V`` for an
upstream ``dO`` and the two facts that make them tileable; this file only asks for
them, tile by tile.

Predict before you write it: with the outer loop over key blocks, how many times is
each ``K_j`` read, and how many times is each ``dQ_i`` read and written back? Which of
the three gradients does ``D`` not touch at all? If you drop the scale on ``dQ``, by
what factor is it wrong for ``d = 16``?

Source: Dao 2023, FlashAttention-2, Alg. 2; Dao et al. 2022, Sec. 3.1 and App. B.

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

    What must hold: the gradients of attention for any block sizes, computed from ``o``
    and ``lse`` in the loop of the backward notebook (key blocks outside, query blocks
    inside) without ever building a (Nq, Nk) array. A row with ``lse = -inf`` sees no
    key: its ``dq`` is 0 and it adds nothing to ``dk``, ``dv``; nothing may be NaN.
    """
    q, k, v, o, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, o, do))
    lse = np.asarray(lse, dtype=np.float64)
    nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
    scale = 1.0 / np.sqrt(d)
    D = (do * o).sum(axis=1)                              # D_i = dO_i . O_i
    L = np.where(np.isneginf(lse), 0.0, lse)              # a row that sees nothing: every P_ij is exp(-inf) = 0
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for c0 in range(0, nk, block_k):                      # outer loop: key blocks
        c1 = min(c0 + block_k, nk)
        dk_j, dv_j = np.zeros((c1 - c0, d)), np.zeros((c1 - c0, v.shape[1]))
        for r0 in range(0, nq, block_q):                  # inner loop: query blocks
            r1 = min(r0 + block_q, nq)
            s = scale * (q[r0:r1] @ k[c0:c1].T)
            if causal:
                seen = np.arange(c0, c1)[None, :] <= np.arange(r0, r1)[:, None] + (nk - nq)
                s = np.where(seen, s, -np.inf)
            p = np.exp(s - L[r0:r1, None])
            dv_j += p.T @ do[r0:r1]
            dp = do[r0:r1] @ v[c0:c1].T
            ds = p * (dp - D[r0:r1, None])
            dq[r0:r1] += scale * (ds @ k[c0:c1])
            dk_j += scale * (ds.T @ q[r0:r1])
        dk[c0:c1], dv[c0:c1] = dk_j, dv_j
    return dq, dk, dv

"""The backward pass of attention: the textbook one, and FlashAttention's that recomputes P.

Given the upstream gradient ``dO = dLoss/dO`` of ``O = softmax(scale * Q K^T) V``:

    P  = softmax(S),  S = scale * Q K^T      dV = P^T dO
    dP = dO V^T                              dS = P * (dP - D),  D_i = sum_j P_ij dP_ij
    dQ = scale * dS K                        dK = scale * dS^T Q

:func:`attention_backward` builds P and dP whole, (Nq, Nk) each: the oracle.

:func:`flash_attention_backward` keeps from the forward only ``O`` and the row
log-sum-exp ``L = lse`` (one number per row). Since ``P_ij = exp(S_ij - L_i)``, a
tile of P is recomputed from a tile of S in one pass, with no max and no sum. And
``D_i = sum_j P_ij dP_ij = sum_j P_ij (dO_i . V_j) = dO_i . O_i`` is one dot product
per row, computed before the loop. The loops are FlashAttention-2's (Dao 2023,
Alg. 2): outer over key blocks ``j`` (``dK_j``, ``dV_j`` stay on chip), inner over
query blocks ``i`` (``dQ_i`` is read, updated and written back).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lessons.core.causal_rule import SKIPPED, causal_visible, tile_kind
from lessons.core.checks import as_float_array, check_flag, check_mask, check_positive_int, check_qkv, check_scale
from lessons.core.result import output_dtype

__all__ = ["attention_backward", "flash_attention_backward", "BackwardStep", "BackwardTrace",
           "recomputed_probabilities"]


def _check_like(x, name, shape, single, dtype):
    """``x`` as a 2-D (or, for one query, 1-D) float array of exactly ``shape``; never broadcast."""
    want = shape[1:] if single else shape
    arr = as_float_array(x, name, (len(want),))
    if arr.shape != want:
        raise ValueError(f"{name} must have shape {want}, got shape {arr.shape}")
    arr = arr.astype(dtype, copy=False)
    return arr[None] if single else arr


def _check_lse(lse, nq, single, dtype):
    arr = np.asarray(lse) if not isinstance(lse, (str, bytes)) and lse is not None else None
    if arr is None or not np.issubdtype(arr.dtype, np.floating):
        got = type(lse).__name__ if arr is None else f"dtype {arr.dtype}"
        raise TypeError(f"lse must be a float array (the forward's log-sum-exp per row), got {got}")
    want = () if single else (nq,)
    if arr.shape != want:
        raise ValueError(f"lse must have shape {want} (one value per query row), got shape {arr.shape}")
    return arr.astype(dtype, copy=False).reshape(nq)


def _visible(nq, nk, mask, causal, single):
    visible = check_mask(mask, nq, nk, single)
    if causal:
        c = causal_visible(np.arange(nq), np.arange(nk), nq, nk)
        visible = c if visible is None else (visible & c)
    return visible


def _cast_back(dq, dk, dv, single, out_dtype):
    dq, dk, dv = (x.astype(out_dtype, copy=False) for x in (dq, dk, dv))
    return (dq[0] if single else dq), dk, dv


# --------------------------------------------------------------------------- the oracle

def attention_backward(q, k, v, do, *, scale=None, causal=False, mask=None):
    """Gradients of textbook attention, with P and dP materialised (the oracle).

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    do : float array, shape (Nq, dv) (or (dv,) for one query): dLoss/dO.
    scale : float, default ``1/sqrt(d)``
    causal : bool, bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``).
    mask : bool array broadcastable to (Nq, Nk), True = may attend, optional.

    Returns
    -------
    (dq, dk, dv): shapes of q, k, v, in the inputs' dtype (float16 computed in
    float32). A query row with no visible key has ``dq = 0`` and contributes nothing
    to dk, dv; a key no row can see gets ``dk = dv = 0``; never NaN from masking.
    A gradient never depends on what cannot be seen: NaN or inf in a key or value a row
    cannot see (or in the q, dO of a row a key is hidden from) changes nothing, bitwise;
    a row that sees one gets a NaN ``dq`` (and the keys it sees NaN ``dk``, ``dv``).
    Memory: P, dP and dS are (Nq, Nk) each.

    Raises TypeError / ValueError naming the argument for non-float dtypes, wrong
    ranks or shapes (``do`` must be exactly (Nq, dv)), or a mask that does not fit.

    Source: the chain rule through ``O = softmax(scale Q K^T) V`` (Vaswani et al.
    2017, Eq. 1); the softmax Jacobian ``dS_i = P_i * (dP_i - P_i . dP_i)`` as in
    Dao et al. 2022, App. B.2.
    """
    out_dtype = output_dtype(q, k, v, do)
    q2, k, v, single, dtype = check_qkv(q, k, v)
    causal = check_flag(causal, "causal")
    nq, nk = q2.shape[0], k.shape[0]
    do = _check_like(do, "do", (nq, v.shape[1]), single, dtype)
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    visible = _visible(nq, nk, mask, causal, single)

    s = (q2 @ k.T) * scale                                   # (Nq, Nk)
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=1, keepdims=True) if nk else np.full((nq, 1), -np.inf, dtype=dtype)
    m = np.where(np.isneginf(m), 0.0, m)                     # a row that sees nothing: exp(-inf) = 0 below
    e = np.exp(s - m)
    total = e.sum(axis=1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)                  # (Nq, Nk), stored: the cost FlashAttention avoids
    dp = do @ v.T                                            # (Nq, Nk), stored as well
    if visible is not None:
        p = np.where(visible, p, 0.0)                        # exactly 0 where hidden, even in a NaN row
        dp = np.where(visible, dp, 0.0)                      # a value a row cannot see is no part of its dP
    ds = p * (dp - (p * dp).sum(axis=1, keepdims=True))      # softmax's Jacobian-vector product
    if visible is not None:
        ds = np.where(visible, ds, 0.0)                      # 0, not 0 * NaN, where the row's D is NaN or inf
    # dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO, with each operand's NaN/inf rows zeroed: a zero of
    # dS or P times NaN would be NaN. They come back as NaN only in the rows that see them.
    seen = np.ones((nq, nk)) if visible is None else visible.astype(dtype)

    def product(a, b, sees):
        bad = ~np.isfinite(b).all(axis=1)
        out = a @ np.where(bad[:, None], 0.0, b)
        return np.where((sees @ bad.astype(dtype) > 0)[:, None], np.nan, out)

    dv = product(p.T, do, seen.T)
    dq = scale * product(ds, k, seen)
    dk = scale * product(ds.T, q2, seen.T)
    return _cast_back(dq, dk, dv, single, out_dtype)


# --------------------------------------------------------------------------- the flash backward

@dataclass(frozen=True)
class BackwardStep:
    """One (key block j, query block i) step of :func:`flash_attention_backward`.

    ``key_block``/``query_block``: block indices; ``row_start``/``row_stop`` and
    ``key_start``/``key_stop``: half-open ranges; ``kind``: ``"full"`` or ``"diagonal"``
    (causal tiles that straddle the diagonal). ``p`` (R, C): the recomputed
    probabilities ``exp(S - L_i)``, 0 where masked; ``ds`` (R, C). After the step:
    ``dk`` (C, d) and ``dv`` (C, dv) the running ``dK_j``, ``dV_j``; ``dq`` (R, d)
    the running ``dQ_i`` (the rows of dQ this step updated).
    """

    key_block: int
    query_block: int
    row_start: int
    row_stop: int
    key_start: int
    key_stop: int
    kind: str
    p: np.ndarray
    ds: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    dq: np.ndarray


@dataclass
class BackwardTrace:
    """Every step :func:`flash_attention_backward` took, in order (outer key blocks, inner query blocks).

    ``nq``, ``nk``, ``d``, ``dv``: sizes; ``block_q``, ``block_k``: rows and keys per
    block; ``D`` (Nq,): ``rowsum(dO * O)``, computed before the loop; ``steps``: list
    of :class:`BackwardStep` (skipped causal tiles have none).
    """

    nq: int
    nk: int
    d: int
    dv: int
    block_q: int
    block_k: int
    D: np.ndarray
    steps: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    def _check_step(self, t):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"step t must be an int, got {type(t).__name__} {t!r}")
        if not -1 <= t < len(self.steps):
            raise IndexError(f"step t must be in [-1, {len(self.steps)}) (-1: before the first step), got {t}")
        return int(t)

    def gradients_after(self, t):
        """Running ``(dq, dk, dv)`` after step ``t`` (``-1``: before any step), shapes (Nq, d), (Nk, d), (Nk, dv).

        Only copies what the steps recorded: row blocks of dQ not yet visited and key
        blocks not yet reached are 0. After the last step they equal the result.
        Raises TypeError for a non-int ``t``, IndexError outside ``[-1, len)``.
        """
        t = self._check_step(t)
        dtype = self.D.dtype
        dq = np.zeros((self.nq, self.d), dtype=dtype)
        dk = np.zeros((self.nk, self.d), dtype=dtype)
        dv = np.zeros((self.nk, self.dv), dtype=dtype)
        for s in self.steps[:t + 1]:
            dq[s.row_start:s.row_stop] = s.dq
            dk[s.key_start:s.key_stop] = s.dk
            dv[s.key_start:s.key_stop] = s.dv
        return dq, dk, dv

    def block_errors(self, t, exact):
        """Per-row max abs error of step ``t``'s running blocks against ``exact = (dq, dk, dv)``.

        Returns a dict: ``"dk"`` and ``"dv"`` (C,) for the keys of the current key block,
        ``"dq"`` (R,) for the rows of the current query block. Raises as :meth:`gradients_after`
        and :meth:`errors`; ``t`` must be a real step (>= 0).
        """
        t = self._check_step(t)
        if t < 0:
            raise IndexError("step t must be >= 0 for block_errors")
        dq, dk, dv = self._check_exact(exact)
        s = self.steps[t]
        rows, keys = slice(s.row_start, s.row_stop), slice(s.key_start, s.key_stop)

        def rowmax(a):
            return np.abs(a).max(axis=1) if a.shape[1] else np.zeros(a.shape[0])
        return {"dk": rowmax(s.dk - dk[keys]), "dv": rowmax(s.dv - dv[keys]), "dq": rowmax(s.dq - dq[rows])}

    def _check_exact(self, exact):
        exact = tuple(np.asarray(x) for x in exact)
        shapes = ((self.nq, self.d), (self.nk, self.d), (self.nk, self.dv))
        if len(exact) != 3 or any(x.shape != s for x, s in zip(exact, shapes)):
            raise ValueError(f"exact must be (dq, dk, dv) of shapes {shapes}, got {[x.shape for x in exact]}")
        return exact

    def errors(self, exact):
        """Max abs error of the running dq, dk, dv after each step against ``exact = (dq, dk, dv)``.

        Returns a float array (len, 3). Exact only at the end: before it, blocks not
        yet reached are still partial sums. Raises ValueError for shapes that differ
        from the trace's.
        """
        exact = self._check_exact(exact)
        dq, dk, dv = (np.zeros(x.shape) for x in exact)
        out = np.zeros((len(self.steps), 3))
        for n, s in enumerate(self.steps):
            dq[s.row_start:s.row_stop] = s.dq
            dk[s.key_start:s.key_stop] = s.dk
            dv[s.key_start:s.key_stop] = s.dv
            out[n] = [np.abs(a - b).max() if a.size else 0.0 for a, b in zip((dq, dk, dv), exact)]
        return out


def _seen_product(a, b, seen):
    """``a @ b`` (a (R, T), b (T, n)) in which a pair hidden by ``seen`` (R, T) adds exactly nothing.

    ``a`` is 0 wherever ``seen`` is False, but ``0 * NaN`` is NaN: a NaN or inf in a row of
    ``b`` that belongs to a hidden key (or row) would still leak in. The product runs on
    ``b`` with its non-finite entries zeroed; a row of the result that *sees* a non-finite
    entry is NaN (its scores or probabilities are NaN already). Bitwise ``a @ b`` when ``b``
    is finite or nothing is hidden.
    """
    finite = np.isfinite(b)
    if seen is None or finite.all():
        return a @ b
    out = a @ np.where(finite, b, 0.0)
    poisoned = seen.astype(a.dtype) @ (~finite).astype(a.dtype) > 0
    return np.where(poisoned, np.nan, out).astype(out.dtype, copy=False)


def flash_attention_backward(q, k, v, o, lse, do, *, block_q=64, block_k=64, scale=None, causal=False,
                             mask=None, return_trace=False):
    """Gradients of attention tile by tile, recomputing P from the stored row log-sum-exp.

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    o : float array, shape (Nq, dv) (or (dv,)): the forward's output.
    lse : float array, shape (Nq,) (or a scalar for one query): the forward's
        ``L = m + log(l)``, ``-inf`` for a row that sees no key (as
        ``lessons.flash_attention(..., return_lse=True)`` returns it).
    do : float array, shape (Nq, dv) (or (dv,)): dLoss/dO.
    block_q, block_k : int >= 1, query rows (Br) and keys (Bc) per block; any sizes.
    scale : float, default ``1/sqrt(d)``; causal, mask: as in the forward (they must be
        the forward's, or lse does not describe these scores).
    return_trace : bool, also return a :class:`BackwardTrace`.

    Returns
    -------
    ``(dq, dk, dv)`` or ``(dq, dk, dv, trace)``: shapes of q, k, v, in the inputs'
    dtype (float16 computed in float32). Equal to :func:`attention_backward` up to
    rounding for every block size. A row with ``lse = -inf`` gets ``dq = 0``; a key
    no row sees gets ``dk = dv = 0``; never NaN from masking, and NaN or inf where a row
    (or key) cannot see changes nothing, as in :func:`attention_backward`. Extra memory:
    O(block_q * block_k) for S, P, dP, dS and O(Nq) for D, never (Nq, Nk).

    Raises TypeError / ValueError naming the argument for non-float dtypes, wrong
    ranks or shapes (o, do exactly (Nq, dv), lse exactly (Nq,)), block sizes < 1, or a bad mask.

    Source: Dao 2023 (FlashAttention-2), Alg. 2; Dao et al. 2022, Alg. 4 and App. B.
    """
    out_dtype = output_dtype(q, k, v, do)
    q2, k, v, single, dtype = check_qkv(q, k, v)
    causal, return_trace = check_flag(causal, "causal"), check_flag(return_trace, "return_trace")
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    nq, nk, d, d_v = q2.shape[0], k.shape[0], q2.shape[1], v.shape[1]
    o = _check_like(o, "o", (nq, d_v), single, dtype)
    do = _check_like(do, "do", (nq, d_v), single, dtype)
    lse = _check_lse(lse, nq, single, dtype)
    scale = dtype.type(check_scale(scale, d))
    visible = check_mask(mask, nq, nk, single)

    D = (do * o).sum(axis=1)                                 # D_i = rowsum(dO_i * O_i): one number per row
    L = np.where(np.isneginf(lse), 0.0, lse)                 # a row that sees nothing: its scores are all -inf
    dq = np.zeros((nq, d), dtype=dtype)                      # lives in HBM, updated block by block
    dk = np.zeros((nk, d), dtype=dtype)
    dv = np.zeros((nk, d_v), dtype=dtype)
    trace = BackwardTrace(nq=nq, nk=nk, d=d, dv=d_v, block_q=block_q, block_k=block_k, D=D) \
        if return_trace else None

    for j, c0 in enumerate(range(0, nk, block_k)):           # outer loop: key blocks
        c1 = min(c0 + block_k, nk)
        k_j, v_j = k[c0:c1], v[c0:c1]
        dk_j = np.zeros((c1 - c0, d), dtype=dtype)           # on chip for the whole inner loop
        dv_j = np.zeros((c1 - c0, d_v), dtype=dtype)
        for i, r0 in enumerate(range(0, nq, block_q)):       # inner loop: query blocks stream past
            r1 = min(r0 + block_q, nq)
            kind = tile_kind(r0, r1, c0, c1, nq, nk, causal)
            if kind == SKIPPED:                              # wholly above the diagonal
                continue
            s = (q2[r0:r1] @ k_j.T) * scale                  # S_ij, recomputed
            keep = None if visible is None else visible[r0:r1, c0:c1]
            if causal:
                c = causal_visible(np.arange(r0, r1), np.arange(c0, c1), nq, nk)
                keep = c if keep is None else (keep & c)
            if keep is not None:
                s = np.where(keep, s, -np.inf)
            p = np.exp(s - L[r0:r1, None])                   # P_ij = exp(S_ij - L_i): already normalised
            if keep is not None:
                p = np.where(keep, p, 0.0)                   # exactly 0 where hidden, even where L_i is NaN
            dp = do[r0:r1] @ v_j.T
            ds = p * (dp - D[r0:r1, None])
            if keep is not None:
                ds = np.where(keep, ds, 0.0)                 # 0, not 0 * NaN, where a key is hidden
            keep_t = None if keep is None else keep.T
            dv_j += _seen_product(p.T, do[r0:r1], keep_t)
            dq[r0:r1] += scale * _seen_product(ds, k_j, keep)    # read dQ_i, add, write back
            dk_j += scale * _seen_product(ds.T, q2[r0:r1], keep_t)
            if trace is not None:
                trace.steps.append(BackwardStep(
                    key_block=j, query_block=i, row_start=r0, row_stop=r1, key_start=c0, key_stop=c1,
                    kind=kind, p=p, ds=ds, dk=dk_j.copy(), dv=dv_j.copy(), dq=dq[r0:r1].copy()))
        dk[c0:c1], dv[c0:c1] = dk_j, dv_j                    # written once per key block

    result = _cast_back(dq, dk, dv, single, out_dtype)
    return (*result, trace) if return_trace else result


def recomputed_probabilities(q, k, lse, *, scale=None, causal=False, mask=None):
    """P rebuilt in one pass from the row log-sum-exp: ``P_ij = exp(scale q_i . k_j - L_i)``.

    ``q (Nq, d)``, ``k (Nk, d)``, ``lse (Nq,)`` (``-inf`` rows give zeros); returns
    float (Nq, Nk), 0 where masked. No row max and no row sum are taken: L already
    holds both (``L = m + log l``), which is why the forward stores it.
    Raises TypeError / ValueError as :func:`flash_attention_backward`.
    Source: Dao et al. 2022, Sec. 3.1 ("Recomputation").
    """
    if isinstance(q, (str, bytes)) or q is None:
        raise TypeError(f"q must be a float array, got {type(q).__name__}")
    q_arr = np.asarray(q)
    q2, k2, _, single, dtype = check_qkv(q, k, np.zeros((np.shape(k)[0] if np.ndim(k) else 0, 1)))
    causal = check_flag(causal, "causal")
    nq, nk = q2.shape[0], k2.shape[0]
    lse = _check_lse(lse, nq, single, dtype)
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    visible = _visible(nq, nk, mask, causal, single)
    s = (q2 @ k2.T) * scale
    if visible is not None:
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - np.where(np.isneginf(lse), 0.0, lse)[:, None])
    if visible is not None:
        p = np.where(visible, p, 0.0)                        # 0 where masked, even where lse is NaN
    return p[0] if q_arr.ndim == 1 else p

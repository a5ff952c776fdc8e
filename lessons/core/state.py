"""The running softmax state ``(m, l, o)`` and its two operations.

Everything in this series is a schedule of these few lines. For each query row
we keep

* ``m`` - the running maximum of the scores seen so far (``-inf`` while empty),
* ``l`` - the running sum of ``exp(s - m)``,
* ``o`` - the running sum of ``exp(s - m) * v`` (unnormalised output).

``absorb`` folds one tile of scores into the state, ``merge`` combines two
partial states (flash-decoding, ring attention), ``finalize`` divides once at
the end. Source: Milakov & Gimelshein 2018 (online softmax), Dao et al. 2022
(FlashAttention, Alg. 1), Dao 2023 (FlashAttention-2, Alg. 1).

A row's output never depends on a key it cannot see: a masked score is ``-inf``, its
``p`` is exactly 0, and :func:`weighted_sum` makes that key add exactly nothing to
``o`` whatever its value holds (NaN, inf), so every schedule of the fold inherits it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["State", "safe_max", "correction_factor", "absorb", "merge", "finalize", "weighted_sum"]


@dataclass(frozen=True)
class State:
    """Running softmax state for ``R`` query rows.

    Attributes
    ----------
    m : ndarray, shape (R,)
        Running maximum of the scores; ``-inf`` for a row that has seen no key.
    l : ndarray, shape (R,)
        Running sum of ``exp(s - m)``.
    o : ndarray, shape (R, dv)
        Running sum of ``exp(s - m) * v`` (not yet divided by ``l``).
    """

    m: np.ndarray
    l: np.ndarray
    o: np.ndarray

    @classmethod
    def empty(cls, rows: int, dv: int, dtype=np.float64) -> "State":
        """The state before any key: ``m = -inf``, ``l = 0``, ``o = 0``.

        ``rows`` and ``dv`` are non-negative ints; ``dtype`` a NumPy float dtype.
        Raises TypeError for a count that is not an int or a dtype that is not a float
        dtype, ValueError for a negative count.
        """
        from lessons.core.checks import check_int

        rows, dv = check_int(rows, "rows", min=0), check_int(dv, "dv", min=0)
        try:
            kind = np.dtype(dtype)
        except TypeError:
            kind = None
        if kind is None or not np.issubdtype(kind, np.floating):
            raise TypeError(f"dtype must be a NumPy float dtype (the state's m, l, o are floats), got {dtype!r}")
        return cls(
            m=np.full(rows, -np.inf, dtype=dtype),
            l=np.zeros(rows, dtype=dtype),
            o=np.zeros((rows, dv), dtype=dtype),
        )

    @property
    def rows(self) -> int:
        return self.m.shape[0]


def safe_max(m: np.ndarray) -> np.ndarray:
    """``m`` with ``-inf`` replaced by 0, so that ``x - m`` never computes ``-inf - -inf``.

    The one guard of the fold (the CUDA kernels' ``safe_max`` in ``common.cuh``): a row
    whose max is still ``-inf`` has seen nothing, and ``exp(-inf - 0) = 0`` is right
    for it. Any shape; returns the same shape and dtype.
    """
    m = np.asarray(m)
    return np.where(np.isneginf(m), 0.0, m).astype(m.dtype, copy=False)


def _check_state(state, name: str) -> None:
    if not isinstance(state, State):
        raise TypeError(f"{name} must be a lessons.State, got {type(state).__name__}")
    for field in ("m", "l", "o"):
        x = getattr(state, field)
        if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.floating):
            got = f"dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
            raise TypeError(f"{name}.{field} must be a float NumPy array (State.empty(rows, dv) makes one), got {got}")
    m, l, o = state.m, state.l, state.o
    if m.ndim != 1 or l.shape != m.shape or o.ndim != 2 or o.shape[0] != m.shape[0]:
        raise ValueError(f"{name} must hold m (R,), l (R,), o (R, dv); got m {m.shape}, l {l.shape}, o {o.shape}")


def _check_tile(state: State, s, v):
    """``s`` (R, T) and ``v`` (T, dv) as float arrays that fit ``state``; no broadcasting."""
    _check_state(state, "state")
    s, v = np.asarray(s), np.asarray(v)
    for name, x in (("s", s), ("v", v)):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must have a float dtype, got {x.dtype}")
    rows, dv = state.o.shape
    if s.ndim != 2 or s.shape[0] != rows:
        raise ValueError(f"s must have shape (R, T) with R = {rows} rows of the state, got {s.shape}")
    if v.shape != (s.shape[1], dv):
        raise ValueError(f"v must have shape (T, dv) = ({s.shape[1]}, {dv}) to match s {s.shape} "
                         f"and the state's o {state.o.shape}, got {v.shape}")
    return s, v


def correction_factor(m_old: np.ndarray, m_new: np.ndarray) -> np.ndarray:
    """The rescale ``alpha = exp(m_old - m_new)`` applied to what was accumulated so far.

    ``m_old``, ``m_new``: float arrays of the same shape with ``m_new >= m_old``.
    Returns an array of that shape with ``0 <= alpha <= 1``. Where both maxima are
    ``-inf`` (nothing visible yet) it returns 0, not ``exp(nan)``: the state is empty,
    so there is nothing to rescale (the NaN trap of a fully masked tile).

    Raises TypeError for non-float input and ValueError for shapes that differ (one
    max per row on both sides; nothing is broadcast).
    """
    from lessons.core.checks import as_float_array

    m_old, m_new = as_float_array(m_old, "m_old"), as_float_array(m_new, "m_new")
    if m_old.shape != m_new.shape:
        raise ValueError(f"m_old and m_new must have the same shape (one max per row), got {m_old.shape} "
                         f"and {m_new.shape}")
    return np.exp(m_old - safe_max(m_new))


def weighted_sum(p: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``p @ v`` in which a key with weight 0 contributes exactly nothing.

    ``p`` (R, T) holds non-negative weights, ``v`` (T, dv) the values. Plain ``p @ v``
    turns ``0 * NaN`` into NaN, so a NaN or inf value at a key that a row cannot see
    (masked, causal-hidden, padding past ``seq_len``) would poison that row. Here such a
    value reaches only the rows that give its key a weight > 0, as IEEE arithmetic would
    there: NaN, or +/-inf (NaN where both infinities meet). Finite values go through one
    matrix product; returns an array of shape (R, dv), bitwise equal to ``p @ v`` wherever
    ``v`` is finite.
    """
    finite = np.isfinite(v)
    if finite.all():
        return p @ v
    sees = (p > 0).astype(p.dtype)                                   # (R, T): which keys each row sees
    out = p @ np.where(finite, v, 0.0)
    nan = sees @ np.isnan(v).astype(p.dtype) > 0
    pos = sees @ np.isposinf(v).astype(p.dtype) > 0
    neg = sees @ np.isneginf(v).astype(p.dtype) > 0
    out = np.where(pos, np.inf, out)
    out = np.where(neg, -np.inf, out)
    return np.where(nan | (pos & neg), np.nan, out).astype(out.dtype, copy=False)


def absorb(state: State, s: np.ndarray, v: np.ndarray) -> State:
    """Fold one tile of scores into the state (Dao 2023, FA-2 Alg. 1, lines 8-10).

    Parameters
    ----------
    state : State for R rows, o of shape (R, dv).
    s : ndarray, shape (R, T)
        Scaled scores of the R rows against the T keys of this tile; masked
        entries are ``-inf``.
    v : ndarray, shape (T, dv)
        The tile's values.

    Returns the new State. A tile whose scores are all ``-inf`` for a row leaves
    that row's state unchanged (and empty rows stay empty, never NaN); a tile of
    T = 0 keys changes nothing. A key a row cannot see (score ``-inf``) adds exactly
    nothing to it, even if its value is NaN or inf (:func:`weighted_sum`). Raises TypeError / ValueError naming ``s``, ``v`` or
    ``state`` when the shapes do not fit (nothing is broadcast).
    """
    s, v = _check_tile(state, s, v)
    if s.shape[1] == 0:
        return state
    m_new = np.maximum(state.m, s.max(axis=1))
    alpha = correction_factor(state.m, m_new)
    p = np.exp(s - safe_max(m_new)[:, None])
    l = alpha * state.l + p.sum(axis=1)
    o = alpha[:, None] * state.o + weighted_sum(p, v)
    return State(m=m_new, l=l, o=o)


def merge(a: State, b: State) -> State:
    """Combine two partial states over disjoint key sets (flash-decoding's reduction).

    ``a`` and ``b`` hold the same R rows and dv. The result equals absorbing both
    key sets into one state, in either order. Merging two empty states gives an
    empty state (``m = -inf``, ``l = 0``, ``o = 0``), never NaN.
    Raises ValueError if the shapes differ.
    """
    _check_state(a, "a")
    _check_state(b, "b")
    if a.o.shape != b.o.shape:
        raise ValueError(f"merge: states have different shapes, a.o {a.o.shape} vs b.o {b.o.shape}")
    m = np.maximum(a.m, b.m)
    alpha_a = correction_factor(a.m, m)
    alpha_b = correction_factor(b.m, m)
    return State(
        m=m,
        l=alpha_a * a.l + alpha_b * b.l,
        o=alpha_a[:, None] * a.o + alpha_b[:, None] * b.o,
    )


def finalize(state: State) -> tuple[np.ndarray, np.ndarray]:
    """Normalise once at the end: ``out = o / l`` and ``lse = m + log(l)``.

    Returns ``(out, lse)`` with shapes (R, dv) and (R,). A row that saw no
    visible key (``l == 0``) gives ``out = 0`` and ``lse = -inf``; NaN in the
    state stays NaN (bad data is never reported as an empty row).
    """
    _check_state(state, "state")
    seen = state.l != 0
    safe_l = np.where(seen, state.l, 1.0)
    out = np.where(seen[:, None], state.o / safe_l[:, None], 0.0).astype(state.o.dtype, copy=False)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, state.m + np.log(safe_l), -np.inf).astype(state.m.dtype, copy=False)
    return out, lse

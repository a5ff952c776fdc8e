"""Flash-decoding: split the keys over workers, then merge their partial states.

At decode time there is one query per sequence, so the FA-2 loop has almost no
query rows to hand out to thread blocks. Flash-decoding parallelises over the keys
instead: ``num_splits`` workers each fold a contiguous chunk of keys into their own
state, write the normalised partial result ``(o, lse)``, and a small reduction merges
the partials. The merge is the same rescaling the fold already does.

Partials use the normalised form of FlashInfer and vLLM: ``o`` is already divided
by ``l`` and ``lse = m + log(l)``. An empty partial (a worker with no keys) is
``o = 0``, ``lse = -inf``.

Source: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"
(split-KV + reduction); Ye et al. 2025, FlashInfer (attention states and their merge
operator); Dao 2023, FA-2 Alg. 1 (the fold).
"""
from __future__ import annotations

import numpy as np

from lessons.core.checks import (as_float_array, check_block_k, check_flag, check_int, check_positive_int, check_qkv,
                                 check_scale)
from lessons.core.result import output_dtype, pack_result, shape_result
from lessons.schedules.flash import flash_attention
from lessons.core.state import State, finalize, merge, safe_max

__all__ = ["merge_states", "reduce_states", "merge_weights", "split_ranges", "flash_decoding"]

REDUCE_ORDERS = ("left", "tree")


def split_ranges(n: int, num_splits: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` chunks of ``range(n)`` for ``num_splits`` workers.

    Every chunk has ``ceil(n / num_splits)`` items except the last non-empty one,
    as in FlashAttention's split-KV; when ``num_splits`` exceeds what is needed the
    trailing chunks are empty (``start == stop == n``). ``n`` >= 0 and
    ``num_splits`` >= 1 are ints; returns a list of ``num_splits`` pairs.
    Raises TypeError / ValueError for a non-int or a value out of range.
    """
    n = check_int(n, "n", min=0)
    num_splits = check_positive_int(num_splits, "num_splits")
    chunk = max(1, -(-int(n) // num_splits))
    return [(min(i * chunk, n), min((i + 1) * chunk, n)) for i in range(num_splits)]


def _as_state(o: np.ndarray, lse: np.ndarray) -> State:
    """A normalised partial ``(o, lse)`` as the fold's state: ``m = lse``, ``l = 1``.

    ``o`` (R, dv), ``lse`` (R,). An empty partial (``lse = -inf``) becomes the empty
    state ``m = -inf, l = 0, o = 0`` whatever its ``o`` holds.
    """
    seen = ~np.isneginf(lse)
    return State(m=lse, l=seen.astype(lse.dtype), o=np.where(seen[:, None], o, 0.0).astype(o.dtype, copy=False))


def _check_partial(o, lse, name_o: str, name_lse: str):
    o = as_float_array(o, name_o, tuple(range(1, 33)))
    lse = as_float_array(lse, name_lse, tuple(range(0, 32)))
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"{name_lse} must have shape {o.shape[:-1]} ({name_o}.shape[:-1]); "
                         f"got {name_o} {o.shape} and {name_lse} {lse.shape}")
    return o, lse


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two normalised partial attention states over disjoint key sets.

    ``(o, lse)`` is the state of attention over a set of keys: ``o`` the normalised
    output and ``lse = log(sum exp(s))`` over those keys. The merge is

        lse = log(exp(lse_a) + exp(lse_b))
        o   = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

    computed through :func:`lessons.core.state.merge` (the fold's own rescaling), so it
    never overflows and never forms ``-inf - -inf``.

    Parameters
    ----------
    o_a, o_b : float arrays, shape (..., dv), the same shape.
    lse_a, lse_b : float arrays, shape (...) = ``o.shape[:-1]``; finite, or ``-inf``
        for an empty state.

    Returns ``(o, lse)`` of the same shapes, float dtype of the inputs (at least
    float32); ``dv = 0`` works too (``o`` is then empty, ``lse`` still merged). The
    empty state is ``o = 0``, ``lse = -inf``: it is the identity of the merge, and
    merging two empties gives an empty state (no NaN).

    Each row is merged on its own: NaN in a row's ``lse`` or ``o`` (bad data that row
    saw; a ``+inf`` lse counts as NaN) stays in that row's result and leaves every other
    row exactly as it would be without it; the batch is never refused for it.

    Raises TypeError for non-float input; ValueError if the shapes differ or ``lse``
    does not match ``o.shape[:-1]``.

    ``lse`` is a natural logarithm, as FlashAttention returns it (some kernels keep it
    in base 2 internally).

    Source: Ye et al. 2025 (FlashInfer), the merge operator of attention states
    (FlashInfer ``merge_state``, vLLM ``merge_attn_states``); Dao et al. 2023 (Flash-Decoding).
    """
    o_a, lse_a = _check_partial(o_a, lse_a, "o_a", "lse_a")
    o_b, lse_b = _check_partial(o_b, lse_b, "o_b", "lse_b")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {o_a.shape} and {o_b.shape}")
    dtype = np.result_type(o_a.dtype, lse_a.dtype, o_b.dtype, lse_b.dtype, np.float32)
    lead, dv = o_a.shape[:-1], o_a.shape[-1]
    rows = int(np.prod(lead, dtype=np.int64))            # explicit: reshape(-1, 0) cannot infer it

    def flat(o, lse):
        return _as_state(o.astype(dtype).reshape(rows, dv), lse.astype(dtype).reshape(rows))

    o, lse = finalize(merge(flat(o_a, lse_a), flat(o_b, lse_b)))
    return o.reshape(*lead, dv), lse.reshape(lead)


def reduce_states(o, lse, *, order="left"):
    """Merge ``num_states`` partial states into one.

    Parameters
    ----------
    o : float array, shape (num_states, ..., dv), one normalised partial per state.
    lse : float array, shape (num_states, ...).
    order : ``"left"`` merges one by one, ``((s0 + s1) + s2) + ...`` (a single
        reduction loop); ``"tree"`` merges neighbours pairwise in ``ceil(log2(num_states))``
        rounds, as a parallel reduction does. Both give the same answer up to rounding:
        the merge is associative and commutative.

    Returns ``(o, lse)`` with the leading axis removed. ``num_states = 0`` gives the
    empty state (zeros, ``-inf``).

    Raises ValueError for an unknown ``order`` or mismatched shapes (see
    :func:`merge_states`).
    """
    if not isinstance(order, str) or order not in REDUCE_ORDERS:
        raise ValueError(f"order must be one of {REDUCE_ORDERS}, got {order!r}")
    o = as_float_array(o, "o", tuple(range(2, 34)))
    lse = as_float_array(lse, "lse", tuple(range(1, 33)))
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"lse must have shape {o.shape[:-1]} (o.shape[:-1]); got o {o.shape} and lse {lse.shape}")
    dtype = np.result_type(o.dtype, lse.dtype, np.float32)
    empty = (np.zeros(o.shape[1:], dtype), np.full(lse.shape[1:], -np.inf, dtype))   # the merge's identity
    parts = [(o[i], lse[i]) for i in range(o.shape[0])]
    if order == "left":                                     # one loop, one state at a time
        acc = empty
        for part in parts:
            acc = merge_states(*acc, *part)
        return acc
    parts = parts or [empty]
    while len(parts) > 1:                                   # tree: each round merges neighbours
        nxt = [merge_states(*parts[i], *parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return merge_states(*parts[0], *empty)                  # a lone state still gets checked


def merge_weights(lse_parts, axis=0):
    """The weight of each partial in the merged output: ``exp(lse_i - lse)``.

    The merged output is ``sum_i w_i * o_i`` with these weights; ``w_i`` is the share
    of the softmax mass that worker ``i``'s keys carry. ``lse_parts`` is a float array
    (finite or ``-inf``) with the partials along ``axis``; returns an array of the
    same shape whose entries along ``axis`` sum to 1, or are all 0 where every
    partial is empty. Raises TypeError for non-float input or a non-int ``axis``, ValueError
    for NaN/+inf or an ``axis`` outside ``-ndim .. ndim - 1``.
    """
    lse_parts = as_float_array(lse_parts, "lse_parts", tuple(range(1, 33)))
    axis = check_int(axis, "axis", min=-lse_parts.ndim, max=lse_parts.ndim - 1)
    if np.isnan(lse_parts).any() or np.isposinf(lse_parts).any():
        raise ValueError("lse_parts must be finite or -inf (an empty state), got NaN or +inf")
    m = lse_parts.max(axis=axis, keepdims=True)
    p = np.exp(lse_parts - safe_max(m))                        # all empty: no -inf - -inf
    total = p.sum(axis=axis, keepdims=True)
    return np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)


def flash_decoding(q, k, v, num_splits, *, block_k=None, scale=None, order="left", return_lse=False,
                   return_partials=False, tile=None):
    """Attention with the keys split over ``num_splits`` workers, partial states merged.

    Worker ``i`` takes the contiguous keys ``split_ranges(Nk, num_splits)[i]``, folds
    them tile by tile (:func:`lessons.flash_attention`), and writes its normalised
    partial ``(o_i, lse_i)``; :func:`reduce_states` then merges the partials. A worker
    with no keys writes the empty state. Every ``num_splits`` from 1 to beyond Nk
    gives the same output.

    Parameters
    ----------
    q : float array, shape (d,) (one decode query) or (Nq, d)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv)
    num_splits : int >= 1, the number of workers.
    block_k : int >= 1, default 64, keys per tile inside a worker (Bc); ``tile`` is
        its alias (the name the notebooks and exercises use).
    scale : float, default ``1/sqrt(d)``
    order : ``"left"`` or ``"tree"``, how the partials are reduced (same result).
    return_lse : bool, also return ``lse`` per query row.
    return_partials : bool, also return the workers' partials
        ``(o_parts (num_splits, Nq, dv), lse_parts (num_splits, Nq))``, kept in the
        compute dtype (float32 for float16 input, as kernels keep them); for a single
        query the Nq axis is dropped.

    Returns
    -------
    out, or ``(out[, lse][, (o_parts, lse_parts)])``; ``out`` has shape (Nq, dv),
    or (dv,) for a single query, in the inputs' dtype.

    NaN in one query row (or in a key it sees) makes that row's output and lse NaN
    and leaves every other row exactly as it would be: the merge keeps each row's
    NaN in that row (:func:`merge_states`).

    Raises TypeError / ValueError naming the argument for non-float input, wrong
    ranks, mismatched d or Nk, ``num_splits`` or ``block_k`` (``tile``) < 1, an
    unknown ``order``, or a ``return_lse``/``return_partials`` that is not True/False.

    Source: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding); Dao 2023, Alg. 1.
    """
    out_dtype = output_dtype(q, k, v)                    # before q, k, v are cast for the work
    q2, k, v, single, dtype = check_qkv(q, k, v)
    num_splits = check_positive_int(num_splits, "num_splits")
    block_k = check_block_k(block_k, tile)
    return_lse, return_partials = check_flag(return_lse, "return_lse"), check_flag(return_partials, "return_partials")
    if not isinstance(order, str) or order not in REDUCE_ORDERS:
        raise ValueError(f"order must be one of {REDUCE_ORDERS}, got {order!r}")
    nq = q2.shape[0]
    scale = check_scale(scale, q2.shape[1])

    o_parts = np.zeros((num_splits, nq, v.shape[1]), dtype)
    lse_parts = np.full((num_splits, nq), -np.inf, dtype)
    for i, (start, stop) in enumerate(split_ranges(k.shape[0], num_splits)):   # each worker, independently
        o_parts[i], lse_parts[i] = flash_attention(q2, k[start:stop], v[start:stop], block_k,
                                                   block_q=max(nq, 1), scale=scale, return_lse=True)
    out, lse = reduce_states(o_parts, lse_parts, order=order)   # the reduction step

    out, lse = shape_result(out, lse, single, out_dtype)
    partials = (o_parts[:, 0], lse_parts[:, 0]) if single else (o_parts, lse_parts)
    return pack_result(out, (return_lse, lse), (return_partials, partials))

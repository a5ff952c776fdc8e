"""Ring attention: the key/value blocks travel around a ring of devices.

A sequence too long for one device is cut into ``world_size`` blocks. Device ``r``
keeps query block ``r`` and its running state ``(m, l, o)``, and starts with KV block
``r``. At each of ``world_size`` ring steps every device folds the KV block it holds
into its state, then passes that block to device ``r + 1`` and receives one from
device ``r - 1``. After the last step each device has seen every KV block once and
finalises its rows. No device ever holds more than one query block, one KV block
and one state: the fold does not care where its tiles come from.

This module simulates the devices in one process (a loop over ``r``), in the order a
real ring would run them, and can record which block each device holds at each step.

Source: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", Sec. 3 and Alg. 1; Dao 2023, FA-2 Alg. 1 (the fold).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.causal_rule import DIAGONAL, SKIPPED, causal_visible, tile_kind
from lessons.core.checks import check_flag, check_positive_int, check_qkv, check_scale
from lessons.core.result import output_dtype, pack_result, shape_result
from lessons.core.state import State, absorb, finalize
from lessons.core.trace import TileStep, Trace, record_step
from lessons.schedules.split_kv import split_ranges

__all__ = ["ring_attention", "RingStep", "RingTrace"]


@dataclass(frozen=True)
class RingStep(TileStep):
    """One absorb on one device: a :class:`lessons.core.trace.TileStep` plus where and when.

    ``tile`` is the KV block index, ``row_start``/``row_stop`` the device's query rows,
    ``key_start``/``key_stop`` the keys of the KV block; ``ring_step`` (0-based) and
    ``device`` say when and on which device the block was folded in.
    """

    ring_step: int
    device: int


@dataclass
class RingTrace(Trace):
    """What each device held and did at each ring step.

    ``steps`` holds one :class:`RingStep` per absorb (``trace.row(i)`` replays query
    row i as for any trace). ``tile`` is the KV block size and ``block_q`` the query
    block size (the last blocks may be shorter or empty).

    ``holds`` : int array (world_size, world_size); ``holds[t, r]`` is the KV block
    device r holds at ring step t, ``(r - t) mod world_size``.
    ``folded`` : bool array (world_size, world_size); True where device r absorbed
    its block at step t, False where it had nothing to do (the whole block is above
    the causal diagonal for its rows, or its query or KV block is empty).
    ``q_ranges`` / ``kv_ranges`` : the ``[start, stop)`` rows / keys of each block.
    """

    world_size: int = 1
    holds: np.ndarray = None
    folded: np.ndarray = None
    q_ranges: list = None
    kv_ranges: list = None


def ring_attention(q, k, v, world_size, *, causal=False, scale=None, return_lse=False, return_trace=False):
    """Exact attention computed by ``world_size`` simulated devices passing KV blocks around a ring.

    The queries and the keys are each cut into ``world_size`` contiguous blocks of
    ``ceil(N / world_size)`` (trailing blocks may be shorter or empty). Device ``r``
    owns query block ``r``; at ring step ``t`` it holds KV block ``(r - t) mod
    world_size``, absorbs it into its state, and passes it on to device ``r + 1``.

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv); Nq and Nk may differ.
    world_size : int >= 1, the number of devices in the ring.
    causal : bool
        Bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``), as in
        :func:`lessons.attention`. A device skips a KV block that lies wholly above
        the diagonal for its rows; a row that sees no key outputs 0 (lse ``-inf``).
    scale : float, default ``1/sqrt(d)``
    return_lse : bool, also return ``lse`` per query row.
    return_trace : bool, also return a :class:`RingTrace`.

    Returns
    -------
    out, or ``(out[, lse][, trace])``; ``out`` has shape (Nq, dv), or (dv,) for a
    single query, in the inputs' dtype (float16 is accumulated in float32).

    A row's output never depends on a key it cannot see (causal-hidden): NaN, inf or
    any value in that key's k or v leaves the row bitwise unchanged, for every
    ``world_size``. NaN in a key or value the row sees, or in its own query, makes
    that row (and only that row) NaN.

    Raises TypeError / ValueError naming the argument for non-float input, wrong
    ranks, mismatched d or Nk, or ``world_size`` < 1.

    Source: Liu et al. 2023 (Ring Attention), Alg. 1; Dao 2023, Alg. 1.
    """
    out_dtype = output_dtype(q, k, v)                    # before q, k, v are cast for the work
    q2, k, v, single, dtype = check_qkv(q, k, v)
    world_size = check_positive_int(world_size, "world_size")
    causal = check_flag(causal, "causal")
    return_lse, return_trace = check_flag(return_lse, "return_lse"), check_flag(return_trace, "return_trace")
    nq, nk, dv = q2.shape[0], k.shape[0], v.shape[1]
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    q_ranges = split_ranges(nq, world_size)
    kv_ranges = split_ranges(nk, world_size)

    states = [State.empty(r1 - r0, dv, dtype) for r0, r1 in q_ranges]   # one state per device
    holds = np.empty((world_size, world_size), dtype=int)
    folded = np.zeros((world_size, world_size), dtype=bool)
    trace = RingTrace(nq=nq, nk=nk, tile=kv_ranges[0][1] - kv_ranges[0][0],
                      block_q=q_ranges[0][1] - q_ranges[0][0], world_size=world_size, holds=holds,
                      folded=folded, q_ranges=q_ranges, kv_ranges=kv_ranges) if return_trace else None

    for t in range(world_size):                          # ring steps
        for r in range(world_size):                      # every device, in parallel on real hardware
            b = (r - t) % world_size                     # the KV block device r holds now
            holds[t, r] = b
            (r0, r1), (c0, c1) = q_ranges[r], kv_ranges[b]
            if r1 == r0 or c1 == c0:
                continue                                 # nothing to fold
            kind = tile_kind(r0, r1, c0, c1, nq, nk, causal)
            if kind == SKIPPED:                          # block wholly above the diagonal
                continue
            s = (q2[r0:r1] @ k[c0:c1].T) * scale
            if kind == DIAGONAL:
                s = np.where(causal_visible(np.arange(r0, r1), np.arange(c0, c1), nq, nk), s, -np.inf)
            new = absorb(states[r], s, v[c0:c1])
            folded[t, r] = True
            record_step(trace, states[r], new, s, RingStep, tile=b, row_start=r0, row_stop=r1,
                        key_start=c0, key_stop=c1, ring_step=t, device=r)
            states[r] = new
        # (here every device sends its KV block to device r + 1)

    out = np.zeros((nq, dv), dtype)
    lse = np.full(nq, -np.inf, dtype)
    for (r0, r1), state in zip(q_ranges, states):
        out[r0:r1], lse[r0:r1] = finalize(state)

    out, lse = shape_result(out, lse, single, out_dtype)
    return pack_result(out, (return_lse, lse), (return_trace, trace))

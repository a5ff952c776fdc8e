"""Ring attention: blocks travel around a ring of devices, each folding what it holds.

A sequence too long for one device is cut into ``world_size`` blocks. Device ``r``
keeps query block ``r`` and its running state ``(m, l, o)``, and starts with KV block
``r``. At each of ``world_size`` ring steps every device folds the KV block it holds
into its state, then passes that block to device ``r + 1`` and receives one from
device ``r - 1``. After the last step each device has seen every KV block once and
finalises its rows. No device ever holds more than one query block, one KV block
and one state: the fold does not care where its tiles come from.

That is the ``"kv"`` schedule (Liu et al.). The other schedule of the same fold, ``"q"``,
keeps every KV block in place and moves the *query* block together with its running
state ``(m, l, o)``: at step ``t`` device ``r`` holds query block ``(r - t) mod W``,
folds its own KV block into that state and passes query block and state on; after
the last step one more send returns each finished state to its owner. Both give the
same output (up to the order of the sums); they differ in what crosses the link
(:func:`ring_message_bytes`).

With ``split="zigzag"`` each device owns two chunks of the sequence, ``r`` and
``2W - 1 - r`` of ``2W`` (as in ring-flash-attention; Striped Attention, Brandon et al.
2023, stripes tokens for the same reason), so that under a causal mask every device
has the same work instead of the last doing ``W`` times the first's.

This module simulates the devices in one process (a loop over ``r``), in the order a
real ring would run them, and can record which block each device holds at each step
and the state it leaves behind (:class:`RingRecord`), so that a real multi-process run
(:mod:`lessons.distributed.ring`) can be checked against it step by step. The real run
calls the same :func:`fold_block`.

Source: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context", Sec. 3 and Alg. 1; Dao 2023, FA-2 Alg. 1 (the fold).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.causal_rule import DIAGONAL, SKIPPED, causal_visible, tile_kind
from lessons.core.checks import check_flag, check_int, check_positive_int, check_qkv, check_scale
from lessons.core.result import output_dtype, pack_result, shape_result
from lessons.core.state import State, absorb, finalize
from lessons.core.trace import TileStep, Trace, record_step
from lessons.schedules.split_kv import split_ranges

__all__ = ["ring_attention", "RingStep", "RingTrace", "RingRecord", "ring_layout", "layout_index", "fold_block",
           "ring_blocks", "ring_message_bytes", "SCHEDULES", "SPLITS"]

#: The two schedules: ``"kv"`` (KV blocks travel) and ``"q"`` (query block and its state travel).
SCHEDULES = ("kv", "q")
#: How the sequence is cut over the ranks.
SPLITS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class RingStep(TileStep):
    """One absorb on one device: a :class:`lessons.core.trace.TileStep` plus where and when.

    ``tile`` is the KV block index, ``row_start``/``row_stop`` the device's query rows,
    ``key_start``/``key_stop`` the keys of the KV block; ``ring_step`` (0-based) and
    ``device`` say when and on which device the block was folded in.
    """

    ring_step: int
    device: int


@dataclass(frozen=True)
class RingRecord:
    """What one device did at one ring step, and the state it left behind.

    ``step`` is the 0-based array index of the ring step (ring step ``step + 1`` in
    the text), ``rank`` the device. ``q_block`` / ``kv_block``: the query block whose
    state was folded and the KV block folded into it (both 0-based block indices).
    ``folded``: False when nothing was visible (causal) or a block was empty.
    ``work``: scores computed (rows x keys of every absorbed tile). ``m``, ``l``: the
    state of ``q_block`` after this step, float arrays (rows of the block,), rows in
    the block's order (:func:`layout_index`).
    """

    step: int
    rank: int
    q_block: int
    kv_block: int
    folded: bool
    work: int
    m: np.ndarray
    l: np.ndarray


@dataclass
class RingTrace(Trace):
    """What each device held and did at each ring step.

    ``steps`` holds one :class:`RingStep` per absorb (``trace.row(i)`` replays query
    row i as for any trace). ``tile`` is the KV block size and ``block_q`` the query
    block size (the last blocks may be shorter or empty).

    ``holds`` : int array (world_size, world_size); ``holds[t, r]`` is the KV block
    device r holds at ring step t (0-based index), ``(r - t) mod world_size`` for the
    ``"kv"`` schedule and ``r`` for ``"q"``.
    ``q_holds`` : int array (world_size, world_size), the query block (and its state)
    device r holds at step t: ``r`` for ``"kv"``, ``(r - t) mod world_size`` for ``"q"``.
    ``folded`` : bool array (world_size, world_size); True where device r absorbed
    its block at step t, False where it had nothing to do (the whole block is above
    the causal diagonal for its rows, or its query or KV block is empty).
    ``q_ranges`` / ``kv_ranges`` : the ``[start, stop)`` rows / keys of each block
    (contiguous split); ``q_chunks`` / ``kv_chunks`` the list of chunks of each block
    (one chunk each when contiguous, two when zigzag).
    ``records`` : one :class:`RingRecord` per (step, device), in step then device order.
    ``schedule``, ``split`` : as passed to :func:`ring_attention`.
    """

    world_size: int = 1
    holds: np.ndarray = None
    folded: np.ndarray = None
    q_ranges: list = None
    kv_ranges: list = None
    q_holds: np.ndarray = None
    q_chunks: list = None
    kv_chunks: list = None
    records: list = None
    schedule: str = "kv"
    split: str = "contiguous"

    def work(self) -> np.ndarray:
        """Int array (world_size,): scores each device computed over the whole run."""
        out = np.zeros(self.world_size, dtype=np.int64)
        for rec in self.records or ():
            out[rec.rank] += rec.work
        return out


def _check_choice(value, name: str, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def ring_layout(n: int, world_size: int, split: str = "contiguous") -> list[list[tuple[int, int]]]:
    """The chunks of ``range(n)`` that each of ``world_size`` ranks owns.

    ``"contiguous"``: rank r owns ``split_ranges(n, world_size)[r]`` (one chunk; trailing
    ranks may be short or empty when n is not a multiple of world_size).
    ``"zigzag"``: the sequence is cut into ``2 * world_size`` chunks
    (``split_ranges(n, 2 * world_size)``) and rank r owns chunks ``r`` and
    ``2 * world_size - 1 - r``: an early and a late piece, so that causal work is even
    (exactly so when ``n`` is a multiple of ``2 * world_size``; the chunks are cut by
    :func:`split_ranges`, so otherwise the last chunks are shorter or empty).

    Returns a list (one per rank) of lists of ``[start, stop)`` pairs, empty chunks
    dropped. Raises TypeError / ValueError naming ``n``, ``world_size`` or ``split``.
    Source: Liu et al. 2023 (contiguous blocks); zhuzilin/ring-flash-attention
    (zigzag); Brandon et al. 2023, Striped Attention, Sec. 3 (why: causal load balance).
    """
    _check_choice(split, "split", SPLITS)
    world_size = check_positive_int(world_size, "world_size")
    if split == "contiguous":
        chunks = [[c] for c in split_ranges(n, world_size)]
    else:
        parts = split_ranges(n, 2 * world_size)
        chunks = [[parts[r], parts[2 * world_size - 1 - r]] for r in range(world_size)]
    return [[(a, b) for a, b in rank if b > a] for rank in chunks]


def layout_index(chunks) -> np.ndarray:
    """The row indices of a block made of ``chunks`` (list of ``[start, stop)``), in block order; int64 (rows,)."""
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in chunks])


def ring_message_bytes(schedule: str, rows: int, d: int, dv: int, itemsize: int = 8) -> dict:
    """Bytes one device sends to the next per ring step, for a block of ``rows`` rows.

    ``"kv"``: the KV block, ``rows * (d + dv)`` numbers, sent after each of the first
    ``W - 1`` steps (the last block is not passed on).
    ``"q"``: the query block and its state ``(m, l, o)``, ``rows * (d + 2 + dv)`` numbers,
    sent after every step; the last send (``rows * (2 + dv)``, no queries) returns the
    finished state to its owner.

    Returns ``{"per_step": bytes, "last_step": bytes}`` (ints); ``itemsize`` is bytes per
    number (8 for float64). ``rows`` >= 0, ``d`` >= 1, ``dv`` >= 0 and ``itemsize`` >= 1 are
    ints. Raises ValueError for an unknown schedule or a count out of range, TypeError for a
    count that is not an int.
    """
    _check_choice(schedule, "schedule", SCHEDULES)
    rows, dv = check_int(rows, "rows", min=0), check_int(dv, "dv", min=0)
    d, itemsize = check_int(d, "d", min=1), check_int(itemsize, "itemsize", min=1)
    if schedule == "kv":
        return {"per_step": rows * (d + dv) * itemsize, "last_step": 0}
    return {"per_step": rows * (d + 2 + dv) * itemsize, "last_step": rows * (2 + dv) * itemsize}


def ring_blocks(schedule: str, world_size: int, step: int, rank: int) -> tuple[int, int]:
    """``(q_block, kv_block)`` that ``rank`` folds at 0-based ring step ``step``.

    ``"kv"``: ``(rank, (rank - step) mod W)``; ``"q"``: ``((rank - step) mod W, rank)``.
    """
    moving = (rank - step) % world_size
    return (rank, moving) if schedule == "kv" else (moving, rank)


def _sub(state: State, a: int, b: int) -> State:
    return State(m=state.m[a:b], l=state.l[a:b], o=state.o[a:b])


def fold_block(state: State, q_blk, q_chunks, k_blk, v_blk, kv_chunks, *, nq: int, nk: int, scale,
               causal: bool = False, block_k: int | None = None, on_absorb=None) -> tuple[State, int]:
    """Fold one KV block into the state of one query block, tile by tile (Dao 2023, Alg. 1, inner loop).

    Parameters
    ----------
    state : State of the query block, rows in the order of ``layout_index(q_chunks)``.
    q_blk : float array (rows, d), the block's queries in that order.
    q_chunks, kv_chunks : lists of ``[start, stop)`` global positions of the query rows
        and of the keys (so that the causal mask uses true positions).
    k_blk, v_blk : float arrays (keys, d) and (keys, dv) in ``layout_index(kv_chunks)`` order.
    nq, nk : the full sequence lengths (for the bottom-right causal alignment).
    scale : the score scale, in the state's dtype.
    causal : bool; a key tile wholly in the future of a query chunk is skipped.
    block_k : keys per absorbed tile (default: a whole chunk at once).
    on_absorb : optional callback ``(r0, r1, c0, c1, before, after, s)`` after each absorb.

    Returns ``(new_state, work)``, ``work`` the number of scores computed. The state is
    not modified in place. Raises TypeError / ValueError naming ``block_k`` (not an int >= 1)
    or ``causal`` (not True/False).
    """
    causal = check_flag(causal, "causal")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    m, l, o = state.m.copy(), state.l.copy(), state.o.copy()
    work = 0
    q_off = 0
    for r0, r1 in q_chunks:
        nr = r1 - r0
        sub = _sub(State(m, l, o), q_off, q_off + nr)
        k_off = 0
        for c0, c1 in kv_chunks:
            step = block_k or max(c1 - c0, 1)
            for t0 in range(c0, c1, step):
                t1 = min(c1, t0 + step)
                kind = tile_kind(r0, r1, t0, t1, nq, nk, causal) if nr else SKIPPED
                if kind == SKIPPED:
                    continue                                 # tile wholly above the diagonal
                s = (q_blk[q_off:q_off + nr] @ k_blk[k_off + t0 - c0:k_off + t1 - c0].T) * scale
                if kind == DIAGONAL:
                    s = np.where(causal_visible(np.arange(r0, r1), np.arange(t0, t1), nq, nk), s, -np.inf)
                new = absorb(sub, s, v_blk[k_off + t0 - c0:k_off + t1 - c0])
                work += s.size
                if on_absorb is not None:
                    on_absorb(r0, r1, t0, t1, sub, new, s)
                sub = new
            k_off += c1 - c0
        m[q_off:q_off + nr], l[q_off:q_off + nr], o[q_off:q_off + nr] = sub.m, sub.l, sub.o
        q_off += nr
    return State(m=m, l=l, o=o), work


def ring_attention(q, k, v, world_size, *, causal=False, scale=None, return_lse=False, return_trace=False,
                   schedule="kv", split="contiguous", block_k=None):
    """Exact attention computed by ``world_size`` simulated devices passing blocks around a ring.

    The queries and the keys are each cut into ``world_size`` blocks (``split``, see
    :func:`ring_layout`; contiguous blocks of ``ceil(N / world_size)`` by default,
    trailing blocks may be shorter or empty). Device ``r`` owns query block ``r`` and
    KV block ``r``. With ``schedule="kv"`` (Liu et al.) at ring step ``t`` it holds KV
    block ``(r - t) mod world_size``, absorbs it into its state, and passes it on to
    device ``r + 1``. With ``schedule="q"`` it holds query block ``(r - t) mod
    world_size`` with that block's state, folds its own KV block into it and passes
    block and state on; the finished states end back at their owners.

    Parameters
    ----------
    q : float array, shape (Nq, d) or (d,)
    k : float array, shape (Nk, d)
    v : float array, shape (Nk, dv); Nq and Nk may differ.
    world_size : int >= 1, the number of devices in the ring.
    causal : bool
        Bottom-right aligned (query i sees key j iff ``j <= i + Nk - Nq``), as in
        :func:`lessons.attention`. A device skips a key tile that lies wholly above
        the diagonal for its rows; a row that sees no key outputs 0 (lse ``-inf``).
    scale : float, default ``1/sqrt(d)``
    return_lse : bool, also return ``lse`` per query row.
    return_trace : bool, also return a :class:`RingTrace`.
    schedule : ``"kv"`` (KV blocks travel) or ``"q"`` (query block and state travel).
    split : ``"contiguous"`` or ``"zigzag"`` (:func:`ring_layout`).
    block_k : int >= 1, keys per absorbed tile inside a block (default: a whole chunk).

    Returns
    -------
    out, or ``(out[, lse][, trace])``; ``out`` has shape (Nq, dv), or (dv,) for a
    single query, in the inputs' dtype (float16 is accumulated in float32).

    A row's output never depends on a key it cannot see (causal-hidden): NaN, inf or
    any value in that key's k or v leaves the row bitwise unchanged, for every
    ``world_size``. NaN in a key or value the row sees, or in its own query, makes
    that row (and only that row) NaN.

    Raises TypeError / ValueError naming the argument for non-float input, wrong
    ranks, mismatched d or Nk, ``world_size`` < 1, an unknown ``schedule`` or ``split``.

    Source: Liu et al. 2023 (Ring Attention), Alg. 1; Dao 2023, Alg. 1.
    """
    out_dtype = output_dtype(q, k, v)                    # before q, k, v are cast for the work
    q2, k, v, single, dtype = check_qkv(q, k, v)
    world_size = check_positive_int(world_size, "world_size")
    causal = check_flag(causal, "causal")
    return_lse, return_trace = check_flag(return_lse, "return_lse"), check_flag(return_trace, "return_trace")
    _check_choice(schedule, "schedule", SCHEDULES)
    _check_choice(split, "split", SPLITS)
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    nq, nk, dv = q2.shape[0], k.shape[0], v.shape[1]
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    q_chunks, kv_chunks = ring_layout(nq, world_size, split), ring_layout(nk, world_size, split)
    q_index, kv_index = [layout_index(c) for c in q_chunks], [layout_index(c) for c in kv_chunks]
    q_ranges, kv_ranges = split_ranges(nq, world_size), split_ranges(nk, world_size)

    states = [State.empty(len(ix), dv, dtype) for ix in q_index]   # one state per query block
    holds = np.empty((world_size, world_size), dtype=int)
    q_holds = np.empty((world_size, world_size), dtype=int)
    folded = np.zeros((world_size, world_size), dtype=bool)
    trace = RingTrace(nq=nq, nk=nk, tile=kv_ranges[0][1] - kv_ranges[0][0],
                      block_q=q_ranges[0][1] - q_ranges[0][0], world_size=world_size, holds=holds,
                      folded=folded, q_ranges=q_ranges, kv_ranges=kv_ranges, q_holds=q_holds,
                      q_chunks=q_chunks, kv_chunks=kv_chunks, records=[], schedule=schedule,
                      split=split) if return_trace else None

    for t in range(world_size):                          # ring steps
        for r in range(world_size):                      # every device, in parallel on real hardware
            qb, b = ring_blocks(schedule, world_size, t, r)   # the blocks device r holds now
            holds[t, r], q_holds[t, r] = b, qb

            def record(r0, r1, c0, c1, before, after, s, t=t, r=r, b=b):
                record_step(trace, before, after, s, RingStep, tile=b, row_start=r0, row_stop=r1,
                            key_start=c0, key_stop=c1, ring_step=t, device=r)

            states[qb], work = fold_block(
                states[qb], q2[q_index[qb]], q_chunks[qb], k[kv_index[b]], v[kv_index[b]], kv_chunks[b],
                nq=nq, nk=nk, scale=scale, causal=bool(causal), block_k=block_k,
                on_absorb=record if trace is not None else None)
            folded[t, r] = work > 0
            if trace is not None:
                trace.records.append(RingRecord(step=t, rank=r, q_block=qb, kv_block=b, folded=work > 0,
                                                work=work, m=states[qb].m.copy(), l=states[qb].l.copy()))
        # (here every device sends the block it holds to device r + 1)

    out = np.zeros((nq, dv), dtype)
    lse = np.full(nq, -np.inf, dtype)
    for ix, state in zip(q_index, states):
        out[ix], lse[ix] = finalize(state)

    out, lse = shape_result(out, lse, single, out_dtype)
    return pack_result(out, (return_lse, lse), (return_trace, trace))

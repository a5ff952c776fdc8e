"""Query blocks over the score matrix, causal skipping, and the NaN trap.

FlashAttention-2 (Dao 2023, Alg. 1 and Sec. 3.1) walks the (Nq, Nk) score
matrix in ``block_q x block_k`` tiles: the outer loop over query blocks, the
inner loop over key tiles. With a causal mask, aligned bottom-right (query i
sees key j iff ``j <= i + Nk - Nq``), a tile is one of

* ``"full"`` - every score visible, computed without a mask;
* ``"diagonal"`` - straddles the diagonal, computed and masked inside;
* ``"skipped"`` - wholly above the diagonal: never loaded, never computed.

:func:`tile_schedule` lists the tiles in visit order with that label;
:func:`lessons.flash_attention` follows exactly this schedule (its trace has
one step per computed tile, in the same order).

The second half is the NaN trap of a literal port of the recurrence: a row whose
first tiles are fully masked computes ``exp(-inf - (-inf)) = NaN``. Two fixes are
in use: the special case of :mod:`lessons.core.state` (treat an empty row's max as 0)
and a finite initial max (``-1e30``); :func:`masked_rows_report` runs all of
them side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lessons.core.causal_rule import DIAGONAL, FULL, SKIPPED, TILE_KINDS, causal_visible, tile_kind
from lessons.core.checks import check_flag, check_mask, check_positive_int, check_qkv
from lessons.schedules.variants import run_variant
from lessons.schedules.flash import flash_attention
from lessons.core.reference import attention

__all__ = ["FULL", "DIAGONAL", "SKIPPED", "TILE_KINDS", "TileVisit", "TileCounts", "tile_kind",
           "tile_schedule", "count_tiles", "causal_mask", "MaskedRowsReport", "masked_rows_report",
           "padded_causal_case", "block_schedule"]



def causal_mask(nq, nk):
    """The bottom-right aligned causal mask, bool (Nq, Nk): True where query i may see key j.

    Query i sees key j iff ``j <= i + Nk - Nq`` (FlashAttention-2's convention;
    for Nq == Nk it is the usual lower triangle). Raises TypeError/ValueError for
    counts that are not ints >= 1.
    """
    nq, nk = check_positive_int(nq, "nq"), check_positive_int(nk, "nk")
    return causal_visible(np.arange(nq), np.arange(nk), nq, nk)


@dataclass(frozen=True)
class TileVisit:
    """One tile of the FA-2 loop.

    ``order``: position in the loop (skipped tiles included); ``step``: index among
    the computed tiles (the :class:`lessons.core.trace.Trace` step), None if skipped;
    ``q_block``, ``k_block``: block indices; ``row_start/row_stop``,
    ``key_start/key_stop``: half-open index ranges; ``kind``: one of :data:`TILE_KINDS`.
    """

    order: int
    step: int | None
    q_block: int
    k_block: int
    row_start: int
    row_stop: int
    key_start: int
    key_stop: int
    kind: str

    @property
    def computed(self) -> bool:
        return self.kind != SKIPPED


def tile_schedule(nq, nk, block_q, block_k, causal=True):
    """Every tile of the FA-2 loop over the (Nq, Nk) score matrix, in visit order.

    Parameters
    ----------
    nq, nk : int >= 1, query rows and keys.
    block_q, block_k : int >= 1, rows per query block (Br) and keys per tile (Bc).
    causal : bool, bottom-right aligned causal mask.

    Returns a list of :class:`TileVisit`, outer loop over query blocks, inner over
    key tiles (Dao 2023, Alg. 1), ``ceil(Nq/block_q) * ceil(Nk/block_k)`` entries.
    The computed ones (``step`` 0, 1, ...) are the tiles :func:`lessons.flash_attention`
    absorbs, in its order.

    Raises TypeError for non-int sizes or non-bool causal, ValueError for sizes < 1.
    """
    nq, nk = check_positive_int(nq, "nq"), check_positive_int(nk, "nk")
    block_q, block_k = check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")
    causal = check_flag(causal, "causal")
    visits, step = [], 0
    for qb, r0 in enumerate(range(0, nq, block_q)):
        r1 = min(r0 + block_q, nq)
        for kb, c0 in enumerate(range(0, nk, block_k)):
            c1 = min(c0 + block_k, nk)
            kind = tile_kind(r0, r1, c0, c1, nq, nk, causal)
            visits.append(TileVisit(order=len(visits), step=None if kind == SKIPPED else step,
                                    q_block=qb, k_block=kb, row_start=r0, row_stop=r1,
                                    key_start=c0, key_stop=c1, kind=kind))
            step += kind != SKIPPED
    return visits


@dataclass(frozen=True)
class TileCounts:
    """How many tiles of each kind a schedule has, and the scores they hold.

    ``full``, ``diagonal``, ``skipped``, ``total`` count tiles; ``computed_scores``
    is the number of score entries in computed tiles, ``visible_scores`` those the
    mask lets through, ``nq * nk`` the whole matrix.
    """

    full: int
    diagonal: int
    skipped: int
    total: int
    computed_scores: int
    visible_scores: int
    nq: int
    nk: int

    @property
    def computed(self) -> int:
        return self.full + self.diagonal

    @property
    def skipped_fraction(self) -> float:
        """Share of tiles never materialised (0 for non-causal)."""
        return self.skipped / self.total


def count_tiles(nq, nk, block_q, block_k, causal=True):
    """Count the tiles of :func:`tile_schedule` by kind; returns a :class:`TileCounts`.

    For Nq == Nk == N with square blocks B dividing N, ``skipped = T(T-1)/2`` and
    ``diagonal = T`` with ``T = N/B``. Same arguments and errors as :func:`tile_schedule`.
    """
    visits = tile_schedule(nq, nk, block_q, block_k, causal)
    size = [(t.row_stop - t.row_start) * (t.key_stop - t.key_start) for t in visits]
    visible = _causal_visible_count(nq, nk) if causal else nq * nk
    return TileCounts(
        full=sum(t.kind == FULL for t in visits), diagonal=sum(t.kind == DIAGONAL for t in visits),
        skipped=sum(t.kind == SKIPPED for t in visits), total=len(visits),
        computed_scores=sum(s for s, t in zip(size, visits) if t.computed), visible_scores=visible,
        nq=nq, nk=nk)


def _causal_visible_count(nq: int, nk: int) -> int:
    """Scores the causal rule lets through, ``causal_mask(nq, nk).sum()``, without the (Nq, Nk) mask.

    Row i sees keys ``0 .. i + Nk - Nq`` (never more than Nk, since i <= Nq - 1), so
    ``max(i + c, 0)`` keys with ``c = Nk - Nq + 1``: an arithmetic series over the rows that see one.
    """
    c = nk - nq + 1
    first = max(0, 1 - c)                                 # the first row that sees a key
    rows = nq - first
    return 0 if rows <= 0 else (first + c + nq - 1 + c) * rows // 2


def block_schedule(block_q):
    """A schedule for :class:`lessons.views.stepper.TileStepper` with query blocks of ``block_q`` rows.

    Returns a callable ``(q, k, v, tile, **options) -> Trace`` that runs
    :func:`lessons.flash_attention` with this ``block_q`` and keeps its trace. With
    ``causal=True`` in the options, a row then shows the key tiles its whole block
    skipped. Raises TypeError/ValueError for a ``block_q`` that is not an int >= 1.
    """
    block_q = check_positive_int(block_q, "block_q")

    def run(q, k, v, tile, **options):
        return flash_attention(q, k, v, tile, block_q=block_q, return_trace=True, **options)[1]

    run.__name__ = f"flash_attention_block_q_{block_q}"
    return run


# --------------------------------------------------------------------------- the NaN trap

@dataclass(frozen=True)
class MaskedRowsReport:
    """The same problem through four implementations, row by row.

    ``visible_keys`` (Nq,) ints; ``reference`` (textbook, :func:`lessons.attention`),
    ``no_guard`` (the literal port), ``guarded`` (:func:`lessons.flash_attention`,
    the special case of :mod:`lessons.core.state`), ``finite`` (``-1e30`` for the initial
    max and the masked scores): outputs (Nq, dv). ``lse`` (Nq,) from the guarded
    version; ``mean_v`` (dv,) the plain mean of the value rows.
    """

    visible_keys: np.ndarray
    reference: np.ndarray
    no_guard: np.ndarray
    guarded: np.ndarray
    finite: np.ndarray
    lse: np.ndarray
    mean_v: np.ndarray

    def rows(self):
        """One dict per query row: visible keys, which outputs are NaN, match the reference, or equal mean(V)."""
        for i in range(len(self.visible_keys)):
            yield dict(row=i, visible_keys=int(self.visible_keys[i]),
                       no_guard_nan=bool(np.isnan(self.no_guard[i]).any()),
                       guarded_ok=bool(np.allclose(self.guarded[i], self.reference[i], rtol=1e-9, atol=1e-12)),
                       finite_ok=bool(np.allclose(self.finite[i], self.reference[i], rtol=1e-9, atol=1e-12)),
                       finite_is_mean_v=bool(np.allclose(self.finite[i], self.mean_v, rtol=1e-9, atol=1e-12)),
                       lse=float(self.lse[i]))


def masked_rows_report(q, k, v, tile, *, scale=None, causal=False, mask=None):
    """Run the textbook reference, the unguarded port, the guarded fold and the finite fix.

    Parameters as :func:`lessons.flash_attention` (``q`` 2-D here); ``tile`` keys
    per tile. The unguarded and finite versions absorb every tile in order (no
    skipping), as :func:`lessons.schedules.variants.run_variant` does; the guarded one is
    :func:`lessons.flash_attention` with one query block.

    Returns a :class:`MaskedRowsReport`. Expected: rows whose first tiles are
    fully masked are NaN without the guard; the guard gives the reference, and
    0 with ``lse = -inf`` for a row with no visible key; the finite fix gives the
    reference for every row that sees a key and the uniform mean of V (every
    score equal to -1e30) for a row that sees none.

    Raises the errors of :func:`lessons.flash_attention` for bad input, and
    ValueError for a 1-D ``q`` or one without rows.
    """
    q2, k2, v2, single, _ = check_qkv(q, k, v)
    tile = check_positive_int(tile, "tile")
    if single or q2.shape[0] == 0:
        raise ValueError(f"q must be 2-D (Nq, d) with Nq >= 1 here, got shape {np.shape(q)}")
    kwargs = dict(scale=scale, causal=causal, mask=mask)
    ref = attention(q2, k2, v2, **kwargs)
    guarded, lse = flash_attention(q2, k2, v2, tile, block_q=q2.shape[0], return_lse=True, **kwargs)
    no_guard = run_variant("no_guard", q2, k2, v2, tile, **kwargs)
    finite = run_variant("finite_init", q2, k2, v2, tile, **kwargs)
    nq, nk = q2.shape[0], k2.shape[0]
    vis = check_mask(mask, nq, nk, False)
    vis = np.ones((nq, nk), dtype=bool) if vis is None else vis
    if causal:
        vis = vis & causal_mask(nq, nk)
    return MaskedRowsReport(visible_keys=vis.sum(axis=1), reference=ref, no_guard=no_guard.output[-1],
                            guarded=guarded, finite=finite.output[-1], lse=lse, mean_v=v2.mean(axis=0))


def padded_causal_case(n=8, pad=3, d=4, dv=2, seed=0):
    """A left-padded causal sequence, as in a ragged batch: ``(q, k, v, mask)``.

    ``n`` tokens of which the first ``pad`` are padding: no query may see a padding
    key. With ``causal=True`` the padding queries (rows ``< pad``) see nothing at
    all, and the first ``pad`` keys of every row are masked. Float64 arrays
    ``q (n, d)``, ``k (n, d)``, ``v (n, dv)`` from a seeded generator; ``mask`` bool (n, n).
    Raises ValueError unless ``0 <= pad < n``.
    """
    n, d, dv = check_positive_int(n, "n"), check_positive_int(d, "d"), check_positive_int(dv, "dv")
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or not 0 <= pad < n:
        raise ValueError(f"pad must be an int with 0 <= pad < n = {n}, got {pad!r}")
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((n, d)), rng.standard_normal((n, d)), rng.standard_normal((n, dv))
    mask = np.ones((n, n), dtype=bool)
    mask[:, :pad] = False
    return q, k, v, mask


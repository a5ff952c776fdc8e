"""A record of what a tiled schedule did, one entry per absorbed tile.

Widgets, the command line and the tests all read the same ``Trace``; nothing
here computes attention, it only stores and slices what the schedule saw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lessons.core.state import correction_factor
from lessons.core.checks import check_int

__all__ = ["TileStep", "Trace", "RowTrace", "record_step"]


@dataclass(frozen=True)
class TileStep:
    """One ``absorb`` call: a block of query rows took in one key tile.

    Attributes
    ----------
    tile : index of the key tile (key_start // tile size).
    row_start, row_stop : the query rows of this block, ``[row_start, row_stop)``.
    key_start, key_stop : the keys of this tile, ``[key_start, key_stop)``.
    scores : (R, T) scaled scores of the block against the tile, ``-inf`` where masked.
    m_before, m : (R,) running max before and after the tile.
    alpha : (R,) the correction ``exp(m_before - m)`` applied to l and o.
    l : (R,) running sum after the tile.
    o : (R, dv) unnormalised running output after the tile.
    """

    tile: int
    row_start: int
    row_stop: int
    key_start: int
    key_stop: int
    scores: np.ndarray
    m_before: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray
    o: np.ndarray


@dataclass(frozen=True)
class RowTrace:
    """The steps one query row went through, as arrays of length ``n`` (one per absorbed tile).

    ``key_start``/``key_stop``/``tile`` are int arrays (n,); ``m_before``, ``m``,
    ``alpha``, ``l`` are float arrays (n,); ``o`` is (n, dv); ``scores`` is a list
    of n arrays (the tile's scores for this row). ``nk`` is the number of keys.
    """

    row: int
    nk: int
    tile_size: int
    tile: np.ndarray
    key_start: np.ndarray
    key_stop: np.ndarray
    scores: list
    m_before: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray
    o: np.ndarray

    def __len__(self) -> int:
        return len(self.tile)

    @property
    def block_k(self) -> int:
        """Keys per tile (Bc); ``tile_size`` is the same number under its older name."""
        return self.tile_size

    @property
    def output(self) -> np.ndarray:
        """Running normalised output ``o / l`` after each step, (n, dv); 0 while ``l == 0``."""
        seen = self.l > 0
        return np.where(seen[:, None], self.o / np.where(seen, self.l, 1.0)[:, None], 0.0)

    @property
    def rescaled(self) -> np.ndarray:
        """Bool (n,): the max moved while something was already accumulated (alpha < 1 on a non-empty state)."""
        return (self.l_before > 0) & (self.m > self.m_before)

    @property
    def l_before(self) -> np.ndarray:
        return np.concatenate([[0.0], self.l[:-1]]) if len(self) else self.l

    def errors(self, exact: np.ndarray) -> np.ndarray:
        """Max |o/l - exact| after each step, (n,); ``exact`` has shape (dv,)."""
        exact = np.asarray(exact)
        if exact.shape != self.o.shape[1:]:
            raise ValueError(f"exact must have shape {self.o.shape[1:]} (dv,), got {exact.shape}")
        return np.abs(self.output - exact).max(axis=1) if self.o.shape[1] else np.zeros(len(self))


@dataclass
class Trace:
    """Every absorb a tiled schedule made, in order.

    ``steps`` is a list of TileStep; ``nq``, ``nk`` the problem size; ``tile``
    the keys per tile (read it as :attr:`block_k`, Bc); ``block_q`` the query rows per
    block (Br). A step's ``tile`` is the index of its key tile, not a size.
    """

    nq: int
    nk: int
    tile: int
    block_q: int
    steps: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def block_k(self) -> int:
        """Keys per tile (Bc in the papers); the field ``tile`` holds it."""
        return self.tile

    def row(self, i: int) -> RowTrace:
        """The steps of query row ``i`` (0 <= i < Nq); raises IndexError outside, TypeError for a non-int."""
        i = check_int(i, "row index i")
        if not -self.nq <= i < self.nq:
            raise IndexError(f"row {i} out of range for Nq = {self.nq}")
        i %= self.nq
        mine = [(s, i - s.row_start) for s in self.steps if s.row_start <= i < s.row_stop]
        dv = self.steps[0].o.shape[1] if self.steps else 0
        return RowTrace(
            row=i,
            nk=self.nk,
            tile_size=self.tile,
            tile=np.array([s.tile for s, _ in mine], dtype=int),
            key_start=np.array([s.key_start for s, _ in mine], dtype=int),
            key_stop=np.array([s.key_stop for s, _ in mine], dtype=int),
            scores=[s.scores[r] for s, r in mine],
            m_before=np.array([s.m_before[r] for s, r in mine], dtype=float),
            m=np.array([s.m[r] for s, r in mine], dtype=float),
            alpha=np.array([s.alpha[r] for s, r in mine], dtype=float),
            l=np.array([s.l[r] for s, r in mine], dtype=float),
            o=np.array([s.o[r] for s, r in mine], dtype=float).reshape(len(mine), dv),
        )

    def records(self):
        """Yield one dict per (absorbed tile, query row): tile, row, key range, scores, m_before, m, alpha, l, o."""
        for s in self.steps:
            for r in range(s.row_stop - s.row_start):
                yield dict(tile=s.tile, row=s.row_start + r, key_start=s.key_start, key_stop=s.key_stop,
                           scores=s.scores[r], m_before=s.m_before[r], m=s.m[r], alpha=s.alpha[r],
                           l=s.l[r], o=s.o[r])


def record_step(trace, before, after, scores, step_type=TileStep, **where) -> None:
    """Append one absorb to ``trace`` (nothing when ``trace`` is None).

    ``before``/``after``: the :class:`lessons.core.state.State` of the block's rows
    around the absorb; ``scores`` (R, T) the tile's scores; ``step_type`` the record
    class (:class:`TileStep` or a schedule's subclass); ``where``: its remaining fields
    (``tile``, ``row_start``, ``row_stop``, ``key_start``, ``key_stop``, ...).
    ``alpha`` is recomputed from the two maxima with the fold's own
    :func:`lessons.core.state.correction_factor`.
    """
    if trace is not None:
        trace.steps.append(step_type(scores=scores, m_before=before.m, m=after.m,
                                     alpha=correction_factor(before.m, after.m), l=after.l, o=after.o,
                                     **where))

"""GPU traces, and where they part from NumPy's.

A trace build of a kernel (``-DFA_TRACE``) writes ``(m, alpha, l)`` after every
absorbed tile for a few chosen rows into a float32 buffer of shape
``(rows, tiles, 3)``, NaN where a tile was not absorbed. :class:`GpuTrace` wraps that
buffer; :func:`first_divergence` walks one GPU row beside a NumPy
:class:`lessons.core.trace.RowTrace` and names the first tile where they disagree beyond a
tolerance. Pure NumPy: it runs and is tested without a GPU.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["GpuTrace", "GpuRowTrace", "TraceDivergence", "first_divergence", "relative_difference", "trace_table",
           "compare_rows", "comparison_lines", "FIELDS"]

#: the quantities a trace record holds, in buffer order
FIELDS = ("m", "alpha", "l")


@dataclass(frozen=True)
class GpuRowTrace:
    """The tiles one traced row absorbed on the GPU, as arrays of length n.

    ``label`` names the row (e.g. ``(row,)``, ``(head, row)``, ``(seq, head)``);
    ``tile`` (n,) int: the tile index of each record (for a merge trace, the split);
    ``m``, ``alpha``, ``l`` (n,) float64: the state after each tile.
    """

    label: tuple
    tile: np.ndarray
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray

    def __len__(self) -> int:
        return len(self.tile)


@dataclass(frozen=True)
class GpuTrace:
    """The trace buffer of one launch.

    ``labels``: one tuple of ints per traced row (what :meth:`row` accepts);
    ``records``: float array (rows, tiles, 3) of ``(m, alpha, l)``, NaN for tiles not absorbed;
    ``unit``: what a record is per, ``"tile"`` (key tile or page) or ``"split"`` (merge step).
    Raises ValueError if the shapes disagree.
    """

    labels: tuple
    records: np.ndarray
    unit: str = "tile"

    def __post_init__(self):
        rec = np.asarray(self.records)
        if rec.ndim != 3 or rec.shape[2] != len(FIELDS):
            raise ValueError(f"records must have shape (rows, tiles, 3), got {rec.shape}")
        if rec.shape[0] != len(self.labels):
            raise ValueError(f"{len(self.labels)} labels for {rec.shape[0]} traced rows")

    def row(self, *label) -> GpuRowTrace:
        """The records of one traced row, e.g. ``trace.row(5)`` or ``trace.row(0, 2, 5)``.

        Raises KeyError (listing the traced labels) for a row that was not traced.
        """
        key = tuple(int(x) for x in label)
        try:
            i = self.labels.index(key)
        except ValueError:
            raise KeyError(f"row {key} was not traced; traced rows: {list(self.labels)}") from None
        rec = np.asarray(self.records[i], dtype=np.float64)
        absorbed = ~np.isnan(rec[:, 0])               # m is -inf or finite once a tile was absorbed
        tiles = np.flatnonzero(absorbed)
        return GpuRowTrace(label=key, tile=tiles, m=rec[tiles, 0], alpha=rec[tiles, 1], l=rec[tiles, 2])


@dataclass(frozen=True)
class TraceDivergence:
    """Where a GPU trace first parts from the NumPy trace.

    ``step``: index of the absorbed tile in the row's sequence (0 = first);
    ``tile``: the tile index there (None when one trace has already ended);
    ``quantity``: ``"tile"`` (different tiles absorbed), ``"length"``, ``"m"``, ``"alpha"`` or ``"l"``;
    ``gpu``, ``numpy``: the two values; ``message``: one readable sentence (it counts steps and
    tiles from 1, as the steppers do; the fields are 0-based indices).
    """

    step: int
    tile: int | None
    quantity: str
    gpu: float
    numpy: float
    message: str

    def __str__(self) -> str:
        return self.message


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if np.isnan(a) or np.isnan(b):
        return False
    if np.isinf(a) or np.isinf(b):
        return a == b                                # -inf matches only -inf
    return abs(a - b) <= atol + rtol * abs(b)


def first_divergence(gpu_row, numpy_row, *, rtol: float = 1e-4, atol: float = 1e-6):
    """The first absorbed tile where ``gpu_row`` and ``numpy_row`` differ beyond tolerance.

    Parameters
    ----------
    gpu_row : :class:`GpuRowTrace` (or anything with arrays ``m``, ``alpha``, ``l`` and ``tile``).
    numpy_row : :class:`lessons.core.trace.RowTrace` (``flash_attention(..., return_trace=True).row(i)``),
        or anything with arrays ``m``, ``alpha``, ``l`` (and optionally ``tile``).
    rtol, atol : non-negative floats; ``|gpu - numpy| <= atol + rtol * |numpy|`` is a match,
        ``-inf`` matches only ``-inf``, NaN never matches.

    Returns None when every step matches and both absorbed the same number of tiles,
    else a :class:`TraceDivergence` naming the step, tile, quantity and both values.
    Checked in order per step: tile index, m, alpha, l. Raises ValueError for a negative
    tolerance or arrays of mismatched lengths within one trace, TypeError for a row without
    ``m``, ``alpha`` and ``l``.
    """
    for label, row in (("gpu_row", gpu_row), ("numpy_row", numpy_row)):
        if not all(hasattr(row, f) for f in FIELDS):
            raise TypeError(f"{label} must be a trace row with arrays m, alpha and l, got {type(row).__name__}")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
            raise ValueError(f"{name} must be a non-negative number, got {tol!r}")
    g = {f: np.asarray(getattr(gpu_row, f), dtype=np.float64).reshape(-1) for f in FIELDS}
    n = {f: np.asarray(getattr(numpy_row, f), dtype=np.float64).reshape(-1) for f in FIELDS}
    for label, arrays in (("gpu_row", g), ("numpy_row", n)):
        lengths = {f: len(a) for f, a in arrays.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{label} has arrays of different lengths: {lengths}")
    g_tile = np.asarray(getattr(gpu_row, "tile", np.arange(len(g["m"]))), dtype=int)
    n_tile = np.asarray(getattr(numpy_row, "tile", np.arange(len(n["m"]))), dtype=int)

    steps = min(len(g["m"]), len(n["m"]))
    for step in range(steps):
        if g_tile[step] != n_tile[step]:
            return TraceDivergence(step, int(n_tile[step]), "tile", float(g_tile[step]), float(n_tile[step]),
                                   f"step {step + 1}: the GPU absorbed tile {g_tile[step] + 1}, "
                                   f"NumPy tile {n_tile[step] + 1}")
        for f in FIELDS:
            a, b = g[f][step], n[f][step]
            if not _close(a, b, rtol, atol):
                return TraceDivergence(
                    step, int(n_tile[step]), f, float(a), float(b),
                    f"tile {n_tile[step] + 1} (step {step + 1}): {f} differs: GPU {a:.9g} vs NumPy {b:.9g} "
                    f"(|diff| {abs(a - b):.3g} > atol {atol:g} + rtol {rtol:g} * |NumPy|)")
    if len(g["m"]) != len(n["m"]):
        tile = int(n_tile[steps]) if len(n["m"]) > steps else int(g_tile[steps])
        return TraceDivergence(steps, tile, "length", float(len(g["m"])), float(len(n["m"])),
                               f"the GPU absorbed {len(g['m'])} tiles, NumPy {len(n['m'])}: "
                               f"they part at step {steps + 1} (tile {tile + 1})")
    return None


def relative_difference(gpu_row, numpy_row) -> np.ndarray:
    """Per tile, the largest relative difference of ``(m, alpha, l)``: float64 (n,) over the
    ``n`` tiles both rows absorbed, ``|gpu - numpy| / max(|numpy|, 1e-30)``, 0 where the two
    are equal (also both -inf), inf where their difference is not finite. The rows as in
    :func:`first_divergence`."""
    n = min(len(gpu_row.m), len(numpy_row.m))
    a, b = (np.stack([np.asarray(getattr(r, f), dtype=np.float64)[:n] for f in FIELDS]) for r in (gpu_row, numpy_row))
    with np.errstate(invalid="ignore", over="ignore"):
        rel = np.where(np.isfinite(a - b), np.abs(a - b) / np.maximum(np.abs(b), 1e-30), np.inf)
    return np.where(a == b, 0.0, rel).max(axis=0, initial=0.0)


def trace_table(gpu_row, numpy_row, where: str) -> str:
    """Text table of one row's trace: the kernel's (m, alpha, l) per tile beside NumPy's.

    ``gpu_row``: :class:`GpuRowTrace`; ``numpy_row``: :class:`lessons.core.trace.RowTrace` (same
    tiles); ``where``: the kernel's column label ("GPU" or "emulator"). The last column is
    :func:`relative_difference`. Tiles are counted from 1, as on the stepper (``gpu_row.tile``
    holds 0-based indices).
    """
    head = ["tile", "keys", *(f"{f} {w}" for f in FIELDS for w in (where, "NumPy")), "max rel diff"]
    body = [[str(int(gpu_row.tile[i]) + 1), f"{numpy_row.key_start[i]}-{numpy_row.key_stop[i] - 1}",
             *(f"{float(getattr(r, f)[i]):.6g}" for f in FIELDS for r in (gpu_row, numpy_row)), f"{rel:.1e}"]
            for i, rel in enumerate(relative_difference(gpu_row, numpy_row))]
    widths = [max(len(r[j]) for r in [head, *body]) for j in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *body])


def compare_rows(gpu_row, numpy_row, broken_row, where: str) -> dict:
    """One row's kernel trace beside NumPy's and beside a fold known to be wrong, as a dict: ``gpu_row``,
    ``numpy_row``, ``divergence`` and ``broken_divergence`` (:func:`first_divergence`, rtol 1e-4, atol
    1e-6; None where every tile agrees), ``max_relative_difference`` (:func:`relative_difference`) and
    ``trace_from`` = ``where`` ("GPU" or "emulator"). Rows and errors as in :func:`first_divergence`."""
    return {"gpu_row": gpu_row, "numpy_row": numpy_row,
            "divergence": first_divergence(gpu_row, numpy_row, rtol=1e-4, atol=1e-6),
            "broken_divergence": first_divergence(gpu_row, broken_row, rtol=1e-4, atol=1e-6),
            "max_relative_difference": float(relative_difference(gpu_row, numpy_row).max(initial=0.0)),
            "trace_from": where}


def comparison_lines(found: dict, broken: str) -> list:
    """The sentences under a row's :func:`trace_table`, from a :func:`compare_rows` dict ``found``: where the
    kernel's trace first parts from NumPy's (or that it never does) and from the fold ``broken`` (in words)."""
    where, first, b = found["trace_from"], found["divergence"], found["broken_divergence"]
    lines = [f"  first_divergence: {first}" if first is not None else
             f"  first_divergence: none - every tile agrees within rounding (rtol 1e-4, atol 1e-6); "
             f"largest relative difference {found['max_relative_difference']:.1e}."]
    if b is not None:
        lines.append(f"  What a real difference looks like: against {broken}, first_divergence names tile "
                     f"{b.tile + 1}: {b.quantity} = {b.gpu:.6g} in the {where}'s trace, {b.numpy:.6g} in the "
                     f"broken fold.")
    return lines

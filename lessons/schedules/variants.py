"""An invariant debugger: the online-softmax update with one piece changed.

The textbook update (Dao 2023, FA-2 Alg. 1; :func:`lessons.core.state.absorb`) keeps
three numbers per query row and one invariant: after every tile, ``o / l`` is
the exact softmax-weighted mean of the values seen so far. Each variant here
changes one thing, and :func:`run_variant` finds the first tile where the
running result leaves the exact one - or explains why the change is harmless.

=================  ==============================================================
variant            what changed
=================  ==============================================================
``textbook``       nothing (the reference update)
``no_alpha_on_l``  ``l = l + sum(p)``: the running sum is not rescaled when m moves
``no_alpha_on_o``  ``o = o + p @ v``: the accumulator is not rescaled when m moves
``stale_m``        m is taken from the row's first visible tile and never updated
``finite_init``    ``-1e30`` instead of ``-inf``, for the initial max and for masked scores
``fa1_per_tile``   FA-1: keep ``o`` normalised, rescale by ``l_old*alpha/l_new`` every tile
``no_guard``       a literal port: ``exp(m - m_new)`` with no special case for ``-inf``
=================  ==============================================================

Nothing here is used by the real schedules; it exists to be broken on purpose.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from lessons.core.checks import causal_visible, check_flag, check_mask, check_positive_int, check_qkv, check_scale
from lessons.core.reference import attention
from lessons.core.state import State, absorb, correction_factor, safe_max

__all__ = ["VARIANTS", "VARIANT_NAMES", "FINITE_NEG", "Variant", "VariantTrace", "Case",
           "run_variant", "run_variants", "example_case", "case_from_scores", "EXAMPLE_CASES"]

FINITE_NEG = -1e30
"""The finite stand-in for ``-inf`` used by the ``finite_init`` variant."""


@dataclass(frozen=True)
class Variant:
    """A named change to the update: ``name``, a one-line ``title``, and what it changes."""

    name: str
    title: str
    change: str


VARIANTS = {
    v.name: v for v in (
        Variant("textbook", "textbook (FA-2)",
                "m = max(m, max(s)); alpha = exp(m_old - m); l = alpha*l + sum(p); o = alpha*o + p@v"),
        Variant("no_alpha_on_l", "drop alpha on l", "l = l + sum(p)  (o still rescaled)"),
        Variant("no_alpha_on_o", "drop alpha on o", "o = o + p@v  (l still rescaled)"),
        Variant("stale_m", "stale m", "m is set from the first visible tile and never updated (alpha = 1)"),
        Variant("finite_init", "finite -1e30 instead of -inf",
                "m starts at -1e30 and masked scores are -1e30, so no infinity ever enters"),
        Variant("fa1_per_tile", "normalise every tile (FA-1)",
                "o kept normalised: o = (l_old*alpha*o + p@v) / l_new each tile"),
        Variant("no_guard", "no -inf guard", "alpha = exp(m_old - m_new), p = exp(s - m_new), taken literally"),
    )
}
VARIANT_NAMES = tuple(VARIANTS)


def _initial_m(variant, rows, dtype):
    return np.full(rows, FINITE_NEG if variant == "finite_init" else -np.inf, dtype=dtype)


def _update(variant, m, l, o, s, v):
    """One tile of ``variant``: returns ``(m, l, o, alpha, s_used)`` for R rows.

    ``s`` is (R, T) with ``-inf`` where masked, ``v`` is (T, dv).
    """
    if variant == "textbook":
        new = absorb(State(m, l, o), s, v)
        return new.m, new.l, new.o, correction_factor(m, new.m), s
    if variant in ("no_alpha_on_l", "no_alpha_on_o"):
        m_new = np.maximum(m, s.max(axis=1))
        alpha = correction_factor(m, m_new)
        p = np.exp(s - safe_max(m_new)[:, None])
        l_new = (l if variant == "no_alpha_on_l" else alpha * l) + p.sum(axis=1)
        o_new = (o if variant == "no_alpha_on_o" else alpha[:, None] * o) + p @ v
        return m_new, l_new, o_new, alpha, s
    if variant == "stale_m":
        m_new = np.where(np.isneginf(m), s.max(axis=1), m)   # set once, then frozen
        alpha = correction_factor(m, m_new)                   # 0 on the first visible tile, then 1
        p = np.exp(s - safe_max(m_new)[:, None])
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v, alpha, s
    if variant == "finite_init":
        s = np.where(np.isneginf(s), FINITE_NEG, s)          # masked scores: the same finite number
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)                             # never -inf - -inf: no guard needed
        p = np.exp(s - m_new[:, None])
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v, alpha, s
    if variant == "fa1_per_tile":
        # Dao et al. 2022, Alg. 1, lines 9-12, with exp(m~ - m_new) * P~ folded into p = exp(s - m_new).
        m_new = np.maximum(m, s.max(axis=1))
        alpha = correction_factor(m, m_new)
        p = np.exp(s - safe_max(m_new)[:, None])
        l_new = alpha * l + p.sum(axis=1)
        seen = l_new > 0
        o_new = np.where(seen[:, None],
                         ((l * alpha)[:, None] * o + p @ v) / np.where(seen, l_new, 1.0)[:, None], 0.0)
        return m_new, l_new, o_new, alpha, s
    if variant == "no_guard":
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)                             # exp(-inf - -inf) = exp(nan) = nan
        p = np.exp(s - m_new[:, None])
        return m_new, alpha * l + p.sum(axis=1), alpha[:, None] * o + p @ v, alpha, s
    raise ValueError(f"variant must be one of {VARIANT_NAMES}, got {variant!r}")


def _running_output(variant, l, o):
    """What the variant would return if stopped now: ``o / l`` (``o`` itself for FA-1).

    A row with ``l == 0`` has seen nothing and shows 0; NaN and inf are kept, not hidden.
    """
    if variant == "fa1_per_tile":
        return o.copy()
    empty = l == 0
    return np.where(empty[:, None], 0.0, o / np.where(empty, 1.0, l)[:, None])


@dataclass(frozen=True)
class VariantTrace:
    """A variant's run over one (q, k, v) case, one entry per key tile.

    Arrays are indexed ``[tile, row]``: ``key_start``/``key_stop`` (n,) ints;
    ``scores`` a tuple of n (R, T) arrays, the scores the variant used (masked
    entries ``-inf``, or ``-1e30`` for ``finite_init``); ``m``, ``alpha``, ``l``
    (n, R); ``o``, ``output`` (the running result the
    variant would return now) and ``exact`` (the textbook softmax over the keys
    seen so far) (n, R, dv); ``error`` (n, R), ``max |output - exact|`` (inf
    where not finite); ``diverged`` (n, R) bool, outside the tolerance.

    ``first_divergence`` is the first tile where any row left the exact result
    (``None`` if none did), ``first_row`` that row, ``recovers_at`` the tile from
    which every later result is exact again (``None`` if it never recovers),
    ``final_exact`` whether the returned output is right, and ``verdict`` says
    why (or why the change is harmless on this case).
    """

    variant: str
    title: str
    tile: int
    key_start: np.ndarray
    key_stop: np.ndarray
    scores: tuple
    m: np.ndarray
    alpha: np.ndarray
    l: np.ndarray
    o: np.ndarray
    output: np.ndarray
    exact: np.ndarray
    error: np.ndarray
    diverged: np.ndarray
    first_divergence: int | None
    first_row: int | None
    recovers_at: int | None
    final_exact: bool
    verdict: str

    def __len__(self) -> int:
        return len(self.key_start)

    @property
    def harmless(self) -> bool:
        """True when the running result never left the exact one on this case."""
        return self.first_divergence is None


def _visible(q2, k, mask, causal, single):
    nq, nk = q2.shape[0], k.shape[0]
    vis = check_mask(mask, nq, nk, single)
    vis = np.ones((nq, nk), dtype=bool) if vis is None else np.array(vis)
    if causal:
        vis &= causal_visible(np.arange(nq), np.arange(nk), nq, nk)
    return vis


def run_variant(variant, q, k, v, tile, *, scale=None, causal=False, mask=None, rtol=None, atol=None):
    """Run one variant of the update over every key tile and compare it with the exact result.

    All query rows form one block; key tiles are visited in order and none is
    skipped (a tile wholly masked for a row is still absorbed, which is what the
    NaN trap needs).

    Parameters
    ----------
    variant : one of :data:`VARIANT_NAMES`.
    q : float array (Nq, d) or (d,); k : (Nk, d); v : (Nk, dv).
    tile : int >= 1, keys per tile.
    scale : float, default ``1/sqrt(d)``.
    causal : bool, bottom-right aligned as in :func:`lessons.attention`.
    mask : bool array broadcastable to (Nq, Nk), True = may attend.
    rtol, atol : tolerances of the comparison; default 1e-9 / 1e-12 for
        float64 and 1e-4 / 1e-6 for float32 inputs.

    Returns a :class:`VariantTrace`. The exact running result after tile t is
    :func:`lessons.attention` over keys ``[0, key_stop[t])`` with the same mask
    (0 for a row that has seen no visible key).

    Raises ValueError for an unknown variant or a tolerance that is not a finite number
    >= 0, TypeError for a ``causal`` that is not True/False, and the errors of
    :func:`lessons.attention` for bad q, k, v, scale, mask or tile.
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANT_NAMES}, got {variant!r}")
    q2, k, v, single, dtype = check_qkv(q, k, v)
    tile = check_positive_int(tile, "tile")
    causal = check_flag(causal, "causal")
    for name, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and (isinstance(tol, (bool, np.bool_)) or not isinstance(tol, numbers.Real)
                                or not (math.isfinite(tol) and tol >= 0)):
            raise ValueError(f"{name} must be a finite number >= 0, got {tol!r}")
    scale = dtype.type(check_scale(scale, q2.shape[1]))
    vis = _visible(q2, k, mask, causal, single)
    if rtol is None:
        rtol = 1e-9 if dtype == np.float64 else 1e-4
    if atol is None:
        atol = 1e-12 if dtype == np.float64 else 1e-6
    rows, nk, dv = q2.shape[0], k.shape[0], v.shape[1]

    m, l, o = _initial_m(variant, rows, dtype), np.zeros(rows, dtype), np.zeros((rows, dv), dtype)
    rec = {key: [] for key in ("c0", "c1", "s", "m", "alpha", "l", "o", "out", "exact")}
    with np.errstate(all="ignore"):                      # the broken variants overflow on purpose
        for c0 in range(0, nk, tile):
            c1 = min(c0 + tile, nk)
            s = np.where(vis[:, c0:c1], (q2 @ k[c0:c1].T) * scale, -np.inf)
            m, l, o, alpha, s_used = _update(variant, m, l, o, s, v[c0:c1])
            exact = attention(q2, k[:c1], v[:c1], scale=float(scale), mask=vis[:, :c1])
            for key, val in (("c0", c0), ("c1", c1), ("s", s_used), ("m", m), ("alpha", alpha),
                             ("l", l), ("o", o), ("out", _running_output(variant, l, o)), ("exact", exact)):
                rec[key].append(np.array(val, copy=True))
    n = len(rec["c0"])
    out = np.array(rec["out"]).reshape(n, rows, dv)
    exact = np.array(rec["exact"]).reshape(n, rows, dv)
    finite = np.isfinite(out).all(axis=2)
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(out - exact).max(axis=2, initial=0.0), np.inf)
        diverged = ~finite | ~np.isclose(out, exact, rtol=rtol, atol=atol).all(axis=2)
    bad_tiles = np.flatnonzero(diverged.any(axis=1))
    first = int(bad_tiles[0]) if bad_tiles.size else None
    first_row = int(np.flatnonzero(diverged[first])[0]) if first is not None else None
    final_exact = not bool(diverged[-1].any()) if n else True
    recovers_at = int(bad_tiles[-1]) + 1 if (first is not None and final_exact) else None

    trace = dict(variant=variant, title=VARIANTS[variant].title, tile=tile,
                 key_start=np.array(rec["c0"], dtype=int), key_stop=np.array(rec["c1"], dtype=int),
                 scores=tuple(rec["s"]),
                 m=np.array(rec["m"]).reshape(n, rows), alpha=np.array(rec["alpha"]).reshape(n, rows),
                 l=np.array(rec["l"]).reshape(n, rows), o=np.array(rec["o"]).reshape(n, rows, dv),
                 output=out, exact=exact, error=err, diverged=diverged, first_divergence=first,
                 first_row=first_row, recovers_at=recovers_at, final_exact=final_exact)
    trace["verdict"] = _verdict(trace, vis, dtype)
    return VariantTrace(**trace)


def _verdict(t, vis, dtype) -> str:
    """Why the variant left the exact result where it did, or why it never did on this case."""
    name, first, r = t["variant"], t["first_divergence"], t["first_row"]
    m, alpha, l = t["m"], t["alpha"], t["l"]
    overflow = float(np.log(np.finfo(dtype).max))
    if first is not None:
        c0, c1 = int(t["key_start"][first]), int(t["key_stop"][first])
        where = f"row {r} leaves the exact result at tile {first + 1} (keys {c0}..{c1 - 1})"   # tiles counted from 1
        m_before = m[first - 1, r] if first else _initial_m(name, 1, np.float64)[0]
        if name == "no_alpha_on_l":
            why = (f"the running max moved from {m_before:.4g} to {m[first, r]:.4g}; l should have been "
                   f"multiplied by alpha = {alpha[first, r]:.4g} but kept its old scale")
        elif name == "no_alpha_on_o":
            why = (f"the running max moved from {m_before:.4g} to {m[first, r]:.4g}; o should have been "
                   f"multiplied by alpha = {alpha[first, r]:.4g} but kept its old scale")
        elif name == "stale_m":
            top = float(np.max(t["scores"][first][r]))
            why = (f"a score {top - m[first, r]:.4g} above the frozen max {m[first, r]:.4g} makes exp overflow "
                   f"(anything above {overflow:.1f} does in {np.dtype(dtype).name}): l = {l[first, r]:.4g}")
        elif name == "finite_init":
            why = ("the row has seen no visible key yet: every score is -1e30, so m = -1e30, exp(s - m) = 1 "
                   "for each masked key and the result is their uniform mean instead of 0")
        elif name == "no_guard":
            why = ("the row's tiles so far were fully masked while m was still -inf: "
                   "alpha = exp(-inf - (-inf)) = NaN, and NaN never leaves the state")
        else:
            why = "the update is not the textbook one"
        wrong = np.flatnonzero(t["diverged"][-1]).tolist()
        healed = np.flatnonzero(t["diverged"].any(axis=0) & ~t["diverged"][-1]).tolist()
        tail = (f"; it is exact again from tile {t['recovers_at'] + 1} on" if t["recovers_at"] is not None
                else f"; the returned output is wrong for row(s) {wrong}")
        if healed and t["recovers_at"] is None:
            tail += f" (row(s) {healed} are exact again by the end)"

        return f"{where}: {why}{tail}."

    if name == "textbook":
        return "The textbook update: exact after every tile by construction."
    if name in ("no_alpha_on_l", "no_alpha_on_o"):
        moved = (m[1:] > m[:-1]) & (l[:-1] > 0) if len(m) > 1 else np.zeros((0,) + m.shape[1:], bool)
        if not moved.any():
            return ("Harmless here only by luck: no row's max moved after its first visible tile, so alpha was 1 "
                    "(or the state was empty) at every step. A later tile with a larger score breaks it.")
        return "No divergence within the tolerance on this case."
    if name == "stale_m":
        gap = max((float(np.max(s[i] - m[j, i])) for j, s in enumerate(t["scores"])
                   for i in range(m.shape[1]) if np.isfinite(m[j, i]) and np.isfinite(s[i]).any()), default=0.0)
        return (f"Harmless here: softmax does not care which m is subtracted (exp(s - m) / sum exp(s - m) is the "
                f"same for every m), and no score was more than {gap:.4g} above the frozen max, far from the "
                f"{overflow:.1f} at which exp overflows in {np.dtype(dtype).name}. Larger scores make it inf/NaN.")
    if name == "finite_init":
        return ("Harmless here: every row saw a visible key in its first tile, and exp(-1e30 - m) is exactly 0, "
                "the same as exp(-inf - m). It only matters for a row whose tiles are all masked: that row "
                "comes out as the uniform mean of V instead of 0.")
    if name == "fa1_per_tile":
        return ("Harmless: dividing by l every tile (FA-1) or once at the end (FA-2) is the same algebra, "
                "o_FA1 = o_FA2 / l after every tile. FA-2 moved the division out of the loop to save "
                "non-matmul work, not to fix an error.")
    if name == "no_guard":
        return ("Harmless here: no row met a fully masked tile while its max was still -inf, so "
                "exp(-inf - (-inf)) never happened. Mask a row's first tile and it gives NaN.")
    return "No divergence on this case."


def run_variants(case, variants=VARIANT_NAMES):
    """:func:`run_variant` for each name in ``variants`` on a :class:`Case`; returns ``{name: VariantTrace}``.

    ``variants``: names of :data:`VARIANTS` (a single name is one variant). Raises TypeError for a
    ``case`` that is not a :class:`Case` (:func:`example_case` or :func:`case_from_scores` make one),
    ValueError for an unknown variant, before any variant runs.
    """
    if not isinstance(case, Case):
        raise TypeError(f"case must be a Case (from example_case or case_from_scores), got {type(case).__name__}")
    variants = (variants,) if isinstance(variants, str) else tuple(variants)
    for name in variants:
        if not isinstance(name, str) or name not in VARIANTS:
            raise ValueError(f"variants must hold names from {VARIANT_NAMES}, got {name!r}")
    return {name: run_variant(name, case.q, case.k, case.v, case.tile, scale=case.scale,
                              causal=case.causal, mask=case.mask) for name in variants}


@dataclass(frozen=True)
class Case:
    """A (q, k, v) problem for the debugger: arrays, ``tile``, ``scale``, ``causal``, ``mask``, and a ``description``."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    tile: int
    scale: float | None = None
    causal: bool = False
    mask: np.ndarray | None = None
    description: str = ""


def case_from_scores(scores, v, tile, *, mask=None, description=""):
    """A case whose scaled scores are exactly ``scores``: ``q = I``, ``k = scores.T``, ``scale = 1``.

    ``scores`` is a float array (R, N), ``v`` (N, dv), ``mask`` bool (R, N) or None.
    Raises ValueError if the shapes disagree.
    """
    scores = np.asarray(scores, dtype=float)
    v = np.asarray(v, dtype=float)
    if scores.ndim != 2 or v.ndim != 2 or v.shape[0] != scores.shape[1]:
        raise ValueError(f"scores must be (R, N) and v (N, dv): got scores {scores.shape}, v {v.shape}")
    return Case(q=np.eye(scores.shape[0]), k=scores.T.copy(), v=v, tile=check_positive_int(tile, "tile"),
                scale=1.0, mask=mask, description=description)


EXAMPLE_CASES = ("ordinary", "large_scores", "padded")


def example_case(name="ordinary"):
    """One of the debugger's example cases (float64, fixed numbers, no randomness left to chance).

    * ``"ordinary"`` - 2 rows, 12 keys, tile 3; scores drift upwards so the max
      moves at later tiles (alpha < 1 happens).
    * ``"large_scores"`` - 1 row, 9 keys, tile 3; the last tile holds scores near
      800, more than exp can take above the first tile's max (overflow above 709.8).
    * ``"padded"`` - 3 rows, 8 keys, tile 2: row 0 sees every key, row 1's first
      four keys are padding (its first two tiles are fully masked), row 2 sees none.

    Raises ValueError for another name.
    """
    rng = np.random.default_rng(12)
    if name == "ordinary":
        scores = rng.standard_normal((2, 12)) + np.linspace(0.0, 3.0, 12)
        v = rng.standard_normal((12, 3))
        return case_from_scores(scores, v, 3, description="two rows whose max keeps moving to later tiles")
    if name == "large_scores":
        scores = np.array([[0.5, -1.0, 0.2, 1.0, 2.0, 0.3, 800.0, 799.0, 3.0]])
        v = rng.standard_normal((9, 2))
        return case_from_scores(scores, v, 3, description="scores near 800 in the last tile (float64)")
    if name == "padded":
        scores = rng.standard_normal((3, 8)) * 2.0
        v = rng.standard_normal((8, 2))
        mask = np.ones((3, 8), dtype=bool)
        mask[1, :4] = False
        mask[2, :] = False
        return case_from_scores(scores, v, 2, mask=mask,
                                description="row 1: first 4 keys masked (padding); row 2: every key masked")
    raise ValueError(f"name must be one of {EXAMPLE_CASES}, got {name!r}")

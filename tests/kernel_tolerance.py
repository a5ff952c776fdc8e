"""How close a kernel must be: FlashAttention's own rule, not a hand-picked atol.

FlashAttention's test suite (Dao-AILab/flash-attention, tests/test_flash_attn.py) checks
that "FlashAttention's numerical error is at most twice the numerical error of a Pytorch
implementation": with ``out_ref`` the attention computed in higher precision and ``out_pt``
a plain implementation run in the kernel's own dtype on the same inputs,

    max |out - out_ref|  <=  2 * max |out_pt - out_ref|  +  1e-5

Here ``out_ref`` is float64 NumPy (:func:`lessons.attention`) and ``out_pt`` is
:func:`baseline_attention`: the textbook formula in NumPy, every intermediate rounded to
the kernel's dtype the way an eager framework rounds them (float32 sums, one rounding per
operation). The floor is float32's own resolution at the size of the output (tiny), so a
float32 kernel is held to float32 rounding, not to 1e-5.

On a real GPU two things differ from the NumPy baseline that FlashAttention's suite does not
meet (its baseline runs on the same GPU): the device's ``expf`` may be off by 2 ulp (CUDA C++
Programming Guide, Table "single-precision mathematical functions") where NumPy's is
correctly rounded, and a kernel adds its n terms one after another (with FMA) where NumPy
sums pairwise. A sum of n such terms drifts like sqrt(n) roundings, so a check of a
quantity summed over n terms passes ``terms=n`` and its floor grows by sqrt(n): still
float32's resolution, never a hand-picked atol.

The tolerance then follows the dtype and the inputs by itself: a bfloat16 case with large
outputs allows more than a float32 case with small ones, and a kernel that drops a key or
mixes up two heads fails whatever the dtype.
"""
from __future__ import annotations

import numpy as np

import lessons.gpu as gpu

#: the kernel may be this many times worse than the same-precision baseline
ERROR_FACTOR = 2.0
DTYPES = ("float32", "float16", "bfloat16")


def round_to(x, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (nearest even), returned as float32 values."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return gpu.from_bfloat16_bits(gpu.to_bfloat16_bits(x))
    raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def baseline_attention(q, k, v, dtype: str, *, scale=None, causal=False, visible=None):
    """Softmax attention as a framework computes it in ``dtype``: ``(out, lse)`` as float64.

    q (..., Nq, d), k (..., Nk, d), v (..., Nk, dv): exact values of the kernel's inputs.
    ``visible`` (..., Nq, Nk) bool, or ``causal`` (bottom-right aligned) selects the keys each
    row sees. Like PyTorch's reference in the FlashAttention tests: q * scale, q k^T, the
    softmax (in float32) and P V are each rounded to ``dtype``; sums run in float32. A row
    that sees no key gives 0 and lse -inf. lse is float32 (the kernels' lse dtype).
    """
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    if visible is None:
        visible = np.ones((nq, nk), bool)
        if causal:
            visible = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
    s = round_to(round_to(q * np.float32(scale), dtype) @ np.swapaxes(k, -1, -2), dtype)
    s = np.where(visible, s, -np.inf).astype(np.float32)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    seen = m > -np.inf
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(s - np.where(seen, m, 0))
        l = e.sum(axis=-1, keepdims=True)
        p = round_to(np.where(seen, e / np.where(seen, l, 1), 0), dtype)
        out = round_to(p @ v, dtype)
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return out.astype(np.float64), lse.astype(np.float64)


def host(x) -> np.ndarray:
    """``x`` as a NumPy float64 array (CuPy arrays are copied from the device)."""
    return np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64)


def max_error(got, ref) -> float:
    """Largest |got - ref| over the entries where ref is finite (0.0 when there are none)."""
    got, ref = host(got), host(ref)
    finite = np.isfinite(ref)
    return float(np.abs(got[finite] - ref[finite]).max(initial=0.0))


def floor_for(ref, terms: int = 1) -> float:
    """The tiny floor: twice float32's rounding error at the reference's magnitude
    (as FlashAttention-3's tests take ``2 * (out_ref + 0.3 - 0.3 - out_ref)``), times
    sqrt(terms) for a quantity the kernel sums over ``terms`` terms one after another."""
    ref = host(ref)
    big = float(np.abs(ref[np.isfinite(ref)]).max(initial=1.0))
    return 2.0 * float(np.spacing(np.float32(max(big, 1.0)))) * float(np.sqrt(max(terms, 1)))


def assert_within_baseline(got, ref, baseline, *, what: str = "out", terms: int = 1) -> None:
    """FlashAttention's rule: ``max|got - ref| <= 2 * max|baseline - ref| + floor``.

    ``ref`` is the float64 reference, ``baseline`` the same computation in the kernel's
    dtype (:func:`baseline_attention`). Entries where ``ref`` is inf, -inf or NaN must be
    the very same in ``got`` (an empty row's lse is -inf, bad data stays NaN); the rest are
    compared; ``terms``: how many terms the kernel sums into each entry (see :func:`floor_for`).
    Raises AssertionError with the three numbers.
    """
    got, ref = host(got), host(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, reference {ref.shape}"
    special = ~np.isfinite(ref)
    np.testing.assert_array_equal(got[special], ref[special], err_msg=f"{what}: inf/NaN entries differ")
    assert np.isfinite(got[~special]).all(), f"{what}: inf or NaN where the reference is finite"
    err, base = max_error(got, ref), max_error(baseline, ref)
    floor = floor_for(ref, terms)
    assert err <= ERROR_FACTOR * base + floor, (f"{what}: kernel error {err:.3g} > {ERROR_FACTOR:g} x baseline "
                                                f"error {base:.3g} + floor {floor:.3g}")

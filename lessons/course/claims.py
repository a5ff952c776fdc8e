"""Readable checks for the notebooks: a stated claim, printed with a tick when it holds."""
from __future__ import annotations

import numpy as np


def claim(holds, text: str) -> None:
    """Check one stated claim and say so.

    Parameters
    ----------
    holds : bool or numpy.bool_
        The condition being checked, already evaluated.
    text : str
        The claim in plain English, e.g. ``"the naive softmax overflows to NaN"``.

    Prints ``"✓ <text>"`` when ``holds`` is true and returns None.

    Raises
    ------
    TypeError
        If ``holds`` is not a bool or a NumPy bool (an array, a number or None would
        hide what was meant; reduce it with ``.all()``, ``.any()`` or a comparison first).
    AssertionError
        ``"claim failed: <text>"`` when ``holds`` is false.
    """
    if not isinstance(holds, (bool, np.bool_)):
        raise TypeError(f"claim: holds must be a bool or a NumPy bool, got {type(holds).__name__} "
                        f"for {text!r}")
    if not holds:
        raise AssertionError(f"claim failed: {text}")
    print(f"✓ {text}")

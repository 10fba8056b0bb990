"""Small jobs every layer repeats: a host copy of a numpy-or-CuPy array, a sequence-index check.

Kept in one place so that each has one behaviour and one error message.
"""

from __future__ import annotations

import numpy as np


def to_host(a, *, copy: bool = True) -> np.ndarray:
    """A numpy array holding ``a``'s values, whether ``a`` lives on the host or on a CUDA device.

    Parameters
    ----------
    a : numpy array, CuPy array, or anything ``np.asarray`` accepts
    copy : bool
        For host input: return a fresh copy (True) or ``a`` itself when it is already an ndarray (False).
        A device array is always copied to the host.

    Returns
    -------
    numpy.ndarray, same shape and dtype as ``a``
    """
    if hasattr(a, "get") and hasattr(a, "shape"):  # CuPy (and the tests' stand-ins): .get() copies to host
        return a.get()
    return np.array(a) if copy else np.asarray(a)


def check_sequence_index(name: str, value, batch: int) -> int:
    """``value`` as an int if it indexes a sequence of a batch of ``batch``; else ValueError naming ``name``.

    Booleans and floats are refused (``True`` is not sequence 1).
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < batch:
        raise ValueError(f"{name} must be a sequence index in 0..{batch - 1} (got {value!r})")
    return int(value)

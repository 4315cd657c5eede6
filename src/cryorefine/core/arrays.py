"""Arrays that may live on the host (numpy) or on a GPU (cupy): which module, and a host copy.

CuPy is imported only when a CuPy array is met, so CPU-only runs never import it.
"""

from __future__ import annotations

import numpy as np


def array_module(array):
    """numpy, or cupy for a CuPy array."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def to_host(array):
    """A numpy array of `array` (copied from the device when it is a CuPy array)."""
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)

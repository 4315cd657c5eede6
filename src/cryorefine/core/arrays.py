"""Arrays that may live on the host (numpy) or on a GPU (cupy): which module, and a host copy.

CuPy is imported only when a CuPy array is met, so CPU-only runs never import it.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

#: An array that is a numpy ndarray or a CuPy ndarray (CuPy is not imported to name its type).
Array: TypeAlias = Any
#: The array module an array is made with: numpy, or cupy for the GPU engine (the `xp` parameters).
ArrayModule: TypeAlias = Any


def array_module(array: Array) -> ArrayModule:
    """numpy, or cupy for a CuPy array."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def to_host(array: Array | npt.ArrayLike) -> np.ndarray:
    """A numpy array of `array` (copied from the device when it is a CuPy array)."""
    return array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else np.asarray(array)


def host_flat(array: Array | npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """`array` (numpy, CuPy or a sequence) as a flat host array of `dtype`: indices and angles the host works on."""
    return np.asarray(to_host(array), dtype=dtype).reshape(-1)


def add_rows_at(total: np.ndarray, index: npt.ArrayLike, rows: npt.ArrayLike) -> None:
    """total[index[i]] += rows[i] for every i, in place, rows of a repeated index adding up (what np.add.at does), as
    one matrix product over the distinct indices: np.add.at takes about 4 ms for a batch's 1,024 rows of 181 shells,
    the product a fortieth of that."""
    index = np.asarray(index).reshape(-1)
    if index.size == 0:
        return
    rows = np.asarray(rows).reshape(index.size, -1)
    groups, inverse = np.unique(index, return_inverse=True)
    one_hot = np.zeros((groups.size, index.size), dtype=rows.dtype)
    one_hot[inverse.reshape(-1), np.arange(index.size)] = 1
    total[groups] += (one_hot @ rows).reshape((groups.size,) + total.shape[1:])


def host_buffer(shape: int | tuple[int, ...], dtype: npt.DTypeLike, xp: ArrayModule = np) -> np.ndarray:
    """An empty host array for data bound for `xp`'s device: page-locked (pinned) for CuPy, where uploads
    then run at the bus's full speed without a staging copy; plain numpy otherwise."""
    if xp is np:
        return np.empty(shape, dtype)
    import cupyx

    return cupyx.empty_pinned(shape, dtype)


def to_host_pinned(array: Array) -> np.ndarray:
    """A host copy of a CuPy array in page-locked memory (the copy, and later uploads of it, run at the bus's
    speed; the memory returns to CuPy's pinned pool when the copy is let go); a numpy array as it is."""
    if isinstance(array, np.ndarray):
        return array
    import cupy

    out = host_buffer(array.shape, array.dtype, cupy)
    array.get(out=out)
    return out


def to_device(array: Array, xp: ArrayModule = np) -> Array:
    """`array` (host) on `xp`'s device; the copy is finished on return, so the host buffer may be reused. An array
    already on the device is returned as it is."""
    if xp is np:
        return np.asarray(array)
    if isinstance(array, xp.ndarray):
        return array
    out = xp.empty(array.shape, array.dtype)
    out.set(np.ascontiguousarray(array))
    xp.cuda.get_current_stream().synchronize()
    return out


def available_memory_bytes() -> int | None:
    """The host memory this machine can give without swapping (Linux's MemAvailable), or None where it does not
    say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

"""Sums of complex values and their weights into bins by index, on the device without the host waiting
(`core.reconstruct.downsampled_average_planes` for CuPy arrays, where each bin takes the pf³ padded points
around one point of the unpadded grid).

`bincount` would do it in three calls, each of which makes the host wait for the device twice (for its checks
that no index is negative and of their maximum). Here one elementwise kernel adds each value's real and imaginary
parts and its weight to its bin with float64 atomics; the bins are many and each takes a handful of values, so
the atomics hardly ever meet. The numpy twin is the three `bincount`s of the numpy path
(tests/gpu/test_bin_sums.py compares them); the order of the additions follows the scheduling, so results agree
to rounding.
"""

from __future__ import annotations

import functools

from cryorefine.gpu import DeviceArray


@functools.cache
def _kernel(cp):
    return cp.ElementwiseKernel(
        "int64 idx, T value, W weight", "raw float64 re, raw float64 im, raw float64 den",
        """
        atomicAdd(&re[idx], (double)value.real());
        atomicAdd(&im[idx], (double)value.imag());
        atomicAdd(&den[idx], (double)weight);
        """, "cryorefine_bin_sums")


def bin_sums(idx: DeviceArray, values: DeviceArray, weights: DeviceArray | float,
             size: int) -> tuple[DeviceArray, DeviceArray, DeviceArray]:
    """(Σ Re values, Σ Im values, Σ weights) per bin, each (size,) float64, of CuPy arrays `idx` (int64, every
    index in [0, size)), complex `values` and real `weights` of the same shape (or a scalar weight, e.g. 1.0 to
    count the values)."""
    import cupy

    if not isinstance(weights, cupy.ndarray):  # a 0-d device array (filled there: no copy from the host)
        weights = cupy.full((), weights, dtype=cupy.float64)
    re, im, den = (cupy.zeros(size, dtype=cupy.float64) for _ in range(3))
    _kernel(cupy)(idx, values, weights, re, im, den)
    return re, im, den

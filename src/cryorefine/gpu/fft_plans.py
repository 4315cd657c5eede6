"""cuFFT plans kept across batches and iterations: the images' 2D transforms, and the slabs of a map's 3D transforms
(its (y, x) planes, and its lines along z) that `core.padded_transforms` runs each iteration for every reference.

While the arena serves CuPy, CuPy's own plan cache is off (a cached plan's work area would
outlive the scope it came from), so every transform would make its plan anew, batch after
batch, and a 2D classification's M-step twice for each of its classes every iteration. The
plans here are kept by `gpu.kept.KeptObjects`, their work areas outside the arena, per device,
kind of transform, shape and dtype, a few at a time. Where that memory is short, the transform
runs unplanned, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cryorefine.gpu import DeviceArray
from cryorefine.gpu.kept import KeptObjects

#: the kept plans, the 16 last used
PLANS = KeptObjects(16)


def rfft2(x: DeviceArray, norm: str) -> DeviceArray:
    """cupy.fft.rfft2(x, norm=norm) over the last two axes of a C-contiguous real CuPy array, with a kept plan."""
    import cupy
    from cupyx.scipy import fft as cupyx_fft

    return _planned(("R2C", x.shape, x.dtype.str),
                    lambda: cupyx_fft.get_fft_plan(x, axes=(-2, -1), value_type="R2C"),
                    lambda: cupy.fft.rfft2(x, norm=norm))


def irfft2(ft: DeviceArray, shape: tuple[int, int], norm: str) -> DeviceArray:
    """cupy.fft.irfft2(ft, s=shape, norm=norm) over the last two axes of a C-contiguous complex CuPy array, with a
    kept plan."""
    import cupy
    from cupyx.scipy import fft as cupyx_fft

    shape = (int(shape[0]), int(shape[1]))
    return _planned(("C2R", ft.shape, ft.dtype.str, shape),
                    lambda: cupyx_fft.get_fft_plan(ft, shape=shape, axes=(-2, -1), value_type="C2R"),
                    lambda: cupy.fft.irfft2(ft, s=shape, norm=norm))


def fft_first_axis(x: DeviceArray, norm: str, inverse: bool = False) -> DeviceArray:
    """cupy.fft.fft(x, axis=0, norm=norm) (`inverse`: ifft) of a complex CuPy array, contiguous or not, with a kept
    plan (CuPy transforms the first axis as the last of a contiguous copy: one 1D plan of its length and batch)."""
    import cupy
    from cupy.cuda import cufft

    n, batch = int(x.shape[0]), int(x.size // max(int(x.shape[0]), 1))
    fft_type = cufft.CUFFT_C2C if x.dtype == cupy.complex64 else cufft.CUFFT_Z2Z
    transform = cupy.fft.ifft if inverse else cupy.fft.fft
    return _planned(("C2C first axis", n, batch, x.dtype.str), lambda: cufft.Plan1d(n, fft_type, batch),
                    lambda: transform(x, axis=0, norm=norm))


def _planned(key: tuple, make_plan: Callable[[], Any], transform: Callable[[], DeviceArray]) -> DeviceArray:
    """`transform()` under the kept plan of `key` on this device (made now by `make_plan`, its work area outside the
    arena, if there is none yet), or unplanned where no room is left for one."""
    from cupy.cuda import cufft

    plan = PLANS.get(key, make_plan, no_room=(cufft.CuFFTError,))
    if plan is None:
        return transform()
    with plan:
        return transform()

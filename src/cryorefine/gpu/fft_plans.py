"""cuFFT plans for 2D transforms, kept across batches and iterations.

While the arena serves CuPy, CuPy's own plan cache is off (a cached plan's work area would
outlive the scope it came from), so every transform would make its plan anew, batch after
batch, and a 2D classification's M-step twice for each of its classes every iteration. The
plans here take their work area from CuPy's default pool instead, which draws on the memory
outside the arena (what --free_gpu_memory leaves), and are kept per device, kind of transform,
shape and dtype, a few at a time. Where that memory is short, the transform runs unplanned, as
before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from cryorefine.gpu import DeviceArray

MAX_PLANS = 8
_plans: OrderedDict = OrderedDict()


def rfft2(x: DeviceArray, norm: str) -> DeviceArray:
    """cupy.fft.rfft2(x, norm=norm) over the last two axes of a C-contiguous real CuPy array, with a kept plan."""
    import cupy

    return _planned(("R2C", x.shape, x.dtype.str), x, None, "R2C", lambda: cupy.fft.rfft2(x, norm=norm))


def irfft2(ft: DeviceArray, shape: tuple[int, int], norm: str) -> DeviceArray:
    """cupy.fft.irfft2(ft, s=shape, norm=norm) over the last two axes of a C-contiguous complex CuPy array, with a
    kept plan."""
    import cupy

    shape = (int(shape[0]), int(shape[1]))
    return _planned(("C2R", ft.shape, ft.dtype.str, shape), ft, shape, "C2R",
                    lambda: cupy.fft.irfft2(ft, s=shape, norm=norm))


def _planned(key: tuple, x: DeviceArray, shape: tuple[int, int] | None, value_type: str,
             transform: Callable[[], DeviceArray]) -> DeviceArray:
    """`transform()` under the kept plan of `key` on this device (made now, its work area outside the arena, if
    there is none yet), or unplanned where no room is left for one."""
    import cupy
    from cupy.cuda import cufft
    from cupyx.scipy import fft as cupyx_fft

    key = (cupy.cuda.runtime.getDevice(), *key)
    plan = _plans.get(key)
    if plan is None:
        try:
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                plan = cupyx_fft.get_fft_plan(x, shape=shape, axes=(-2, -1), value_type=value_type)
        except (cupy.cuda.memory.OutOfMemoryError, cufft.CuFFTError):  # no room outside the arena
            return transform()
        _plans[key] = plan
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    with plan:
        return transform()


def clear() -> None:
    """Drop the kept plans (their work areas go back to CuPy's pool)."""
    _plans.clear()

"""cuFFT plans for batches of 2D image transforms, kept across batches.

While the arena serves CuPy, CuPy's own plan cache is off (a cached plan's work area would
outlive the scope it came from), so every transform would make its plan anew, batch after
batch. The plans here take their work area from CuPy's default pool instead, which draws on
the memory outside the arena (what --free_gpu_memory leaves), and are kept per device, batch
shape and dtype, a few at a time. Where that memory is short, the transform runs unplanned,
as before.
"""

from __future__ import annotations

from collections import OrderedDict

from cryorefine.gpu import DeviceArray

MAX_PLANS = 4
_plans: OrderedDict = OrderedDict()


def rfft2_forward(x: DeviceArray) -> DeviceArray:
    """cupy.fft.rfft2(x, norm="forward") over the last two axes of a C-contiguous real CuPy array."""
    import cupy
    from cupy.cuda import cufft
    from cupyx.scipy import fft as cupyx_fft

    key = (cupy.cuda.runtime.getDevice(), x.shape, x.dtype.str)
    plan = _plans.get(key)
    if plan is None:
        try:
            with cupy.cuda.using_allocator(cupy.get_default_memory_pool().malloc):
                plan = cupyx_fft.get_fft_plan(x, axes=(-2, -1), value_type="R2C")
        except (cupy.cuda.memory.OutOfMemoryError, cufft.CuFFTError):  # no room outside the arena
            return cupy.fft.rfft2(x, norm="forward")
        _plans[key] = plan
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    with plan:
        return cupy.fft.rfft2(x, norm="forward")


def clear() -> None:
    """Drop the kept plans (their work areas go back to CuPy's pool)."""
    _plans.clear()

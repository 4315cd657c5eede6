"""The 3D transforms between a map (N, N, N) and its padded half transform (box Np = pf·N), taken one
slab at a time so that nothing of the padded box's size exists but the one complex half transform the
inverse needs (RELION's projector set-up and reconstruction do the same transforms on whole boxes).

A map is centred at N//2 and sits in the middle of the Np box (offset Np/2 − N/2), the rest zero; its
padded transform is `fourier.rfft3_centered` of that box. Both directions split the 3D transform into
2D transforms of (y, x) planes and 1D transforms along z, and touch only what is non-zero: the N map
planes of the padded box, and the frequencies |k| ≤ R of the compact layout (`core.grid.PaddedGrid`).
Every function takes an array module `xp` (numpy or cupy); the map's real dtype sets the transforms'
precision (float32 → complex64).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.grid import SLAB_ELEMENTS, PaddedGrid, complex_dtype_for

__all__ = ["window_indices", "compact_rows", "slab_elements", "padded_forward", "padded_inverse_window",
           "padded_forward_2d", "padded_inverse_window_2d"]


def window_indices(size_px: int, padded_size_px: int) -> np.ndarray:
    """Indices (N,) of the map's planes (rows, columns) in the uncentred Np box: the map's voxel j sits at
    index (j + Np/2 − N/2 + Np/2) mod Np once the box is ifftshifted (Np is even)."""
    start = padded_size_px // 2 - size_px // 2
    return (np.arange(start, start + size_px) + padded_size_px // 2) % padded_size_px


def compact_rows(grid: PaddedGrid, unique: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(compact indices, FFT-layout indices) of the z (or y) frequencies |k| ≤ R of a compact array, a contiguous
    run, and where they sit in the padded box's transform. Where R reaches Np/2, −Np/2 and +Np/2 are one element
    of the transform: `unique` leaves −Np/2 out (a reconstruction writes +Np/2's, as RELION does); otherwise both
    read it (a projector)."""
    d = grid.shape[0]
    npad = grid.padded_size_px
    k = np.arange(d) - grid.origin
    keep = np.abs(k) <= grid.r_max_padded
    if unique and grid.r_max_padded >= npad // 2:
        keep &= k != -(npad // 2)
    rows = np.flatnonzero(keep)
    return rows, k[rows] % npad


def slab_elements(real_dtype: npt.DTypeLike, elements: int | None = None) -> int:
    """Elements per slab of these transforms: `elements` when given; else SLAB_ELEMENTS scaled to the transforms'
    precision. The slab's bytes are budgeted for float64 temporaries (`em.memory.SLAB_BYTES_PER_ELEMENT`), and in
    float32 the same bytes hold twice the elements (half the slabs, half the calls)."""
    if elements is not None:
        return int(elements)
    return SLAB_ELEMENTS * 8 // np.dtype(real_dtype).itemsize


def _blocks(n, per_block):
    step = max(1, int(per_block))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def padded_forward(volume: Array, grid: PaddedGrid, xp: ArrayModule = np, elements: int | None = None,
                   out: Array | None = None) -> Array:
    """The compact padded transform (grid.shape) of a real (N, N, N) map: DFT3 of the map zero-padded to Np,
    divided by N² (the projector's normalisation, `core.projector`), zero beyond |k| = R; the dtype is the
    complex of the map's. (y, x) planes first, one slab of map planes at a time, then z, a slab of compact
    rows at a time. Written into `out` (grid.shape, complex) when given, e.g. one class's place in a stack of
    references, so that no second copy is made."""
    volume = xp.asarray(volume)
    n = volume.shape[0]
    npad = grid.padded_size_px
    real = volume.dtype.type
    cdtype = complex_dtype_for(real)
    elements = slab_elements(real, elements)
    d, _, w = grid.shape
    u = xp.asarray(window_indices(n, npad))
    rows, rows_fft = compact_rows(grid, unique=False)
    wx = min(w, npad // 2 + 1)
    rows_fft_d = xp.asarray(rows_fft)
    # (y, x) transforms of the map's planes, cut to the compact rows and columns: (N, D, W)
    planes = xp.zeros((n, d, w), dtype=cdtype)
    for a, b in _blocks(n, elements // (npad * npad)):
        box = xp.zeros((b - a, npad, npad), dtype=real)
        box[:, u[:, None], u[None, :]] = volume[a:b]
        ft = _rfft2(box, "backward", xp)
        planes[a:b, rows[0]:rows[-1] + 1, :wx] = ft[:, rows_fft_d, :wx].astype(cdtype)
        del box, ft
    if out is None:
        out = xp.zeros(grid.shape, dtype=cdtype)
    else:
        out[...] = 0
    scale = real(1.0 / (float(n) ** 2))
    for a, b in _blocks(rows.size, elements // (npad * w)):
        y = slice(int(rows[a]), int(rows[b - 1]) + 1)
        column = xp.zeros((npad, y.stop - y.start, w), dtype=cdtype)
        column[u] = planes[:, y, :]
        ft = _fft_first_axis(column, "backward", False, xp)[rows_fft_d]  # (rows, y rows, W)
        r2 = grid.radius2(xp, slice(int(rows[0]), int(rows[-1]) + 1), y)
        out[rows[0]:rows[-1] + 1, y, :] = xp.where(r2 <= grid.r_max_padded ** 2, ft * scale, 0).astype(out.dtype)
        del column, ft, r2
    return out


def padded_inverse_window(ft: Array, size_px: int, xp: ArrayModule = np, r_max_padded: int | None = None,
                          elements: int | None = None) -> Array:
    """The real (N, N, N) map in the middle of the Np box whose uncentred half transform is `ft`
    (Np, Np, Np/2+1), unnormalised (a plain sum over frequencies), as `fourier.irfft3_centered` windowed to N
    without the normalisation. `ft` is overwritten (its z transform is done in place, a slab of y rows at a
    time). With `r_max_padded` only the rows and columns |k| ≤ R are transformed along z (the rest are zero)."""
    npad = ft.shape[0]
    n = int(size_px)
    wf = ft.shape[2]
    elements = slab_elements(np.empty(0, dtype=ft.dtype).real.dtype, elements)
    r = npad // 2 if r_max_padded is None else min(int(r_max_padded), npad // 2)
    wx = min(wf, r + 1)
    y_ranges = [(0, r + 1), (max(npad - r, r + 1), npad)]  # ky = 0 … R, then −R … −1
    per_block = elements // (npad * wx)
    for lo, hi in y_ranges:
        for a, b in _blocks(hi - lo, per_block):
            block = ft[:, lo + a:lo + b, :wx]
            ft[:, lo + a:lo + b, :wx] = _fft_first_axis(block, "forward", True, xp)
    u = xp.asarray(window_indices(n, npad))
    out = xp.empty((n, n, n), dtype=np.empty(0, dtype=ft.dtype).real.dtype)
    for a, b in _blocks(n, elements // (npad * wf)):
        images = _irfft2(ft[u[a:b]], (npad, npad), "forward", xp)
        out[a:b] = images[:, u[:, None], u[None, :]]
        del images
    return out


def padded_forward_2d(image: Array, grid: PaddedGrid, xp: ArrayModule = np, out: Array | None = None) -> Array:
    """The compact padded transform (grid.shape, 2D: (2R+3, R+2)) of a real (N, N) 2D reference, or those
    (K, …) of a stack (K, N, N) of them in one batched transform: DFT2 of the image zero-padded to Np, divided by
    N² (so that the unrotated "projection" of a 2D reference is the `fourier.rfft2_centered` of the image, as a 3D
    map's central slice is normalised), zero beyond |k| = R."""
    image = xp.asarray(image)
    n = image.shape[-1]
    lead = image.shape[:-2]
    npad = grid.padded_size_px
    real = image.dtype.type
    cdtype = complex_dtype_for(real)
    w = grid.shape[-1]
    u = xp.asarray(window_indices(n, npad))
    rows, rows_fft = compact_rows(grid, unique=False)
    wx = min(w, npad // 2 + 1)
    box = xp.zeros(lead + (npad, npad), dtype=real)
    box[..., u[:, None], u[None, :]] = image
    ft = _rfft2(box, "backward", xp)
    del box
    if out is None:
        out = xp.zeros(lead + grid.shape, dtype=cdtype)
    else:
        out[...] = 0
    out[..., rows[0]:rows[-1] + 1, :wx] = ft[..., xp.asarray(rows_fft), :wx] * real(1.0 / (float(n) ** 2))
    out[...] = xp.where(grid.radius2(xp) > grid.r_max_padded ** 2, out.dtype.type(0), out)
    return out


def padded_inverse_window_2d(ft: Array, size_px: int, xp: ArrayModule = np) -> Array:
    """The real (N, N) image in the middle of the Np box whose uncentred half transform is `ft` (Np, Np/2+1),
    unnormalised (a plain sum over frequencies): `padded_inverse_window` of a 2D reference; of each of a stack
    (…, Np, Np/2+1) -> (…, N, N)."""
    npad = ft.shape[-2]
    u = xp.asarray(window_indices(int(size_px), npad))
    image = _irfft2(xp.ascontiguousarray(ft), (npad, npad), "forward", xp)
    return image[..., u[:, None], u[None, :]]


def _rfft2(x: Array, norm: str, xp: ArrayModule) -> Array:
    """xp.fft.rfft2 of a real 2D box (or a stack of them, over the last two axes); on the GPU under a kept cuFFT
    plan (`gpu.fft_plans`)."""
    if xp is np:
        return np.fft.rfft2(x, norm=norm)
    from cryorefine.gpu import fft_plans

    return fft_plans.rfft2(x, norm)


def _irfft2(ft: Array, shape: tuple[int, int], norm: str, xp: ArrayModule) -> Array:
    """xp.fft.irfft2 of a half transform to a real box of `shape`; on the GPU under a kept cuFFT plan."""
    if xp is np:
        return np.fft.irfft2(ft, s=shape, norm=norm)
    from cryorefine.gpu import fft_plans

    return fft_plans.irfft2(ft, shape, norm)


def _fft_first_axis(x: Array, norm: str, inverse: bool, xp: ArrayModule) -> Array:
    """xp.fft.fft (`inverse`: ifft) of a complex array along its first axis; on the GPU under a kept cuFFT plan."""
    if xp is np:
        return (np.fft.ifft if inverse else np.fft.fft)(x, axis=0, norm=norm)
    from cryorefine.gpu import fft_plans

    return fft_plans.fft_first_axis(x, norm, inverse)

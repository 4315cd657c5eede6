"""Fourier-space conventions shared by every module (RELION's, FFTW layout).

Images are real (…, N, N) arrays whose origin (the particle centre, rotation axis) is the
pixel (N//2, N//2); volumes likewise at (N//2, N//2, N//2). Their transforms are half
transforms in FFTW/rfft layout, (…, N, N//2+1) with the zero frequency at index 0 and the
negative ky (kz) frequencies in the upper half, normalised like RELION's FourierTransformer
(the forward transform divides by the number of pixels). Frequencies are integers in units
of 1/(N·pixel size); as in RELION's FFTW loops, row N/2 of an even box is +N/2 (numpy's
fftfreq would call it −N/2). Every function takes an array module `xp` (numpy or cupy).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.grid import map_slabs


def rfft2_centered(images: Array, xp: ArrayModule = np) -> Array:
    """Forward 2D half transform of real images centred at N//2 (normalised by 1/N²)."""
    return rfft2_of_shifted(xp.fft.ifftshift(images, axes=(-2, -1)), xp)


def rfft2_of_shifted(shifted: Array, xp: ArrayModule = np, normalised: bool = True) -> Array:
    """rfft2_centered of images given already moved by ifftshift (their centre N//2 at index 0); `normalised`
    False leaves out the 1/N² (for images multiplied by it beforehand, which saves a pass over the transforms)."""
    norm = "forward" if normalised else "backward"
    if xp is np:
        return np.fft.rfft2(shifted, norm=norm)
    from cryorefine.gpu.fft_plans import rfft2  # plans kept across batches (see there)

    return rfft2(xp.ascontiguousarray(shifted), norm)


def irfft2_centered(ft: Array, size_px: int, xp: ArrayModule = np) -> Array:
    """Inverse of rfft2_centered: real images (…, N, N) centred at N//2."""
    img = xp.fft.irfft2(ft, s=(size_px, size_px), norm="forward")
    return xp.fft.fftshift(img, axes=(-2, -1))


def rfft3_centered(volume: Array, xp: ArrayModule = np) -> Array:
    """Forward 3D half transform of a real volume centred at N//2 (normalised by 1/N³)."""
    return xp.fft.rfftn(xp.fft.ifftshift(volume, axes=(-3, -2, -1)), axes=(-3, -2, -1), norm="forward")


def irfft3_centered(ft: Array, size_px: int, xp: ArrayModule = np) -> Array:
    """Inverse of rfft3_centered: a real volume (N, N, N) centred at N//2."""
    vol = xp.fft.irfftn(ft, s=(size_px,) * 3, axes=(-3, -2, -1), norm="forward")
    return xp.fft.fftshift(vol, axes=(-3, -2, -1))


#: A band of at most 1/DFT_BAND_FRACTION of the box is low-passed on the host with its Fourier sums as matrix products
#: (`lowpass_band_limited`): a 360 px box's --ini_high band (9 shells) in a quarter of the band-limited FFTs' time.
DFT_BAND_FRACTION = 16


def lowpass_band_limited(volume: Array, gain_of_radius: Callable[[Array], Array], r_max_px: float,
                         xp: ArrayModule = np) -> Array:
    """irfft3_centered(rfft3_centered(volume) · gain_of_radius(|k|)) for a gain that is 0 beyond `r_max_px`, the
    transforms made one axis at a time over the band alone: after the x axis only kx ≤ r_max is kept, after y only
    |ky| ≤ r_max, so the y and z passes, and the inverse's, work on a few columns of the volume. The same sums as
    the whole transforms (the coefficients dropped are those the gain zeroes), in a third of their time or less for
    a band of a twentieth of the box (360 px, 9 shells); the whole transforms where the band reaches Nyquist. A
    numpy volume's band of at most 1/DFT_BAND_FRACTION of the box goes by matrix products instead
    (`_lowpass_band_by_matrices`), which skip even the first and last passes over the whole volume."""
    n = volume.shape[-1]
    band = int(np.floor(r_max_px))
    if band >= n // 2 - 1:
        ft = rfft3_centered(volume, xp)
        return irfft3_centered(ft * gain_of_radius(radius_3d(n, xp)), n, xp)
    if xp is np and volume.ndim == 3 and (band + 1) * DFT_BAND_FRACTION <= n:
        return _lowpass_band_by_matrices(volume, gain_of_radius, band)
    kept = xp.concatenate([xp.arange(band + 1), xp.arange(n - band, n)])  # |k| ≤ band along a full axis
    ft = xp.fft.rfft(xp.fft.ifftshift(volume, axes=(-3, -2, -1)), axis=-1, norm="forward")[..., :band + 1]
    ft = xp.fft.fft(ft, axis=-2, norm="forward")[..., kept, :]
    ft = xp.fft.fft(ft, axis=-3, norm="forward")[..., kept, :, :]
    k = signed_frequencies(n, xp)[kept]
    kx = xp.arange(band + 1, dtype=xp.float64)
    ft *= gain_of_radius(xp.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + kx[None, None, :] ** 2))
    full = xp.zeros(volume.shape[:-3] + (n, kept.size, band + 1), dtype=ft.dtype)
    full[..., kept, :, :] = ft
    ft = xp.fft.ifft(full, axis=-3, norm="forward")
    full = xp.zeros(volume.shape[:-3] + (n, n, band + 1), dtype=ft.dtype)
    full[..., kept, :] = ft
    ft = xp.fft.ifft(full, axis=-2, norm="forward")
    full = xp.zeros(volume.shape[:-3] + (n, n, n // 2 + 1), dtype=ft.dtype)
    full[..., :band + 1] = ft
    del ft
    return xp.fft.fftshift(xp.fft.irfft(full, n=n, axis=-1, norm="forward"), axes=(-3, -2, -1))


def _lowpass_band_by_matrices(volume, gain_of_radius, band):
    """lowpass_band_limited of a numpy volume (N, N, N) whose band |k| ≤ `band` is narrow: the transforms' sums over
    the band's frequencies alone as products with their (N × band) Fourier matrices, the centring shifts taken into
    the matrices' phases (index − N//2), the inverse along x a real sum over the half spectrum (no Nyquist column
    in the band)."""
    n = volume.shape[-1]
    k = signed_frequencies(n)
    k_full = np.concatenate([k[:band + 1], k[n - band:]])  # |k| ≤ band along a full axis
    kx = np.arange(band + 1, dtype=np.float64)
    position = np.arange(n, dtype=np.float64) - n // 2
    forward_x = np.exp(-2j * np.pi * np.outer(position, kx) / n) / n  # (N, band + 1)
    forward = np.exp(-2j * np.pi * np.outer(k_full, position) / n) / n  # (2·band + 1, N)
    rows = np.ascontiguousarray(volume, dtype=np.float64).reshape(-1, n)
    ft = (rows @ forward_x.real + 1j * (rows @ forward_x.imag)).reshape(n, n, band + 1)  # (z, y, kx)
    ft = np.matmul(forward, ft)  # (z, ky, kx)
    m = k_full.size
    ft = (forward @ ft.reshape(n, -1)).reshape(m, m, band + 1)  # (kz, ky, kx)
    ft *= gain_of_radius(np.sqrt(k_full[:, None, None] ** 2 + k_full[None, :, None] ** 2 + kx[None, None, :] ** 2))
    inverse = np.exp(2j * np.pi * np.outer(position, k_full) / n)  # (N, 2·band + 1)
    ft = np.matmul(inverse, (inverse @ ft.reshape(m, -1)).reshape(n, m, band + 1)).reshape(-1, band + 1)  # (z·y, kx)
    inverse_x = np.exp(2j * np.pi * np.outer(kx, position) / n) * np.where(kx > 0, 2.0, 1.0)[:, None]
    out = (ft.real @ inverse_x.real - ft.imag @ inverse_x.imag).reshape(n, n, n)
    return out.astype(np.result_type(volume.dtype, np.float32), copy=False)  # the FFTs' precision


def signed_frequencies(size_px: int, xp: ArrayModule = np) -> Array:
    """Integer frequency of each index along a full axis: 0, 1, …, N//2, then −(N−N//2−1), …, −1."""
    k = xp.arange(size_px, dtype=xp.float64)
    return xp.where(k <= size_px // 2, k, k - size_px)


def frequencies_2d(size_px: int, xp: ArrayModule = np) -> tuple[Array, Array]:
    """Integer frequencies (ky, kx), each (N, N//2+1), of the half-transform layout."""
    ky = signed_frequencies(size_px, xp)
    kx = xp.arange(size_px // 2 + 1, dtype=xp.float64)
    return xp.broadcast_to(ky[:, None], (size_px, kx.size)), xp.broadcast_to(kx[None, :], (size_px, kx.size))


def frequencies_3d(size_px: int, xp: ArrayModule = np) -> tuple[Array, Array, Array]:
    """Integer frequencies (kz, ky, kx), each (N, N, N//2+1), of the half-transform layout."""
    k = signed_frequencies(size_px, xp)
    kx = xp.arange(size_px // 2 + 1, dtype=xp.float64)
    shape = (size_px, size_px, kx.size)
    return (xp.broadcast_to(k[:, None, None], shape), xp.broadcast_to(k[None, :, None], shape),
            xp.broadcast_to(kx[None, None, :], shape))


def radius_2d(size_px: int, xp: ArrayModule = np) -> Array:
    """|k| in Fourier pixels for each coefficient of a 2D half transform."""
    ky, kx = frequencies_2d(size_px, xp)
    return xp.sqrt(ky * ky + kx * kx)


def radius_3d(size_px: int, xp: ArrayModule = np) -> Array:
    """|k| in Fourier pixels for each coefficient of a 3D half transform."""
    kz, ky, kx = frequencies_3d(size_px, xp)
    return xp.sqrt(kz * kz + ky * ky + kx * kx)


def shell_index_2d(size_px: int, xp: ArrayModule = np) -> Array:
    """Resolution shell (round(|k|)) of each coefficient of a 2D half transform, as int."""
    return xp.rint(radius_2d(size_px, xp)).astype(xp.int64)


def shell_index_3d(size_px: int, xp: ArrayModule = np) -> Array:
    """Resolution shell (round(|k|)) of each coefficient of a 3D half transform, as int."""
    return xp.rint(radius_3d(size_px, xp)).astype(xp.int64)


def shell_sum(values: Array, shells: Array, n_shells: int, xp: ArrayModule = np) -> Array:
    """Sum `values` (…, *shells.shape) into `n_shells` shells per leading index -> (…, n_shells).

    Coefficients in shells ≥ n_shells are dropped. Half transforms hold the x = 0 (and x = N/2)
    column once and every other column for itself and its Friedel mate: weight by
    `hermitian_weights_2d` for sums over the full transform. CuPy arrays are summed by one kernel
    (`gpu.shell_sums`) that leaves the host free, where its histogram fits the device's shared memory.
    """
    if xp is not np:
        from cryorefine.gpu import shell_sums

        if shell_sums.fits(n_shells, xp.iscomplexobj(values)):
            return shell_sums.shell_sum(values, shells, n_shells)
    return shell_sum_by_bincount(values, shells, n_shells, xp)


def shell_sum_by_bincount(values: Array, shells: Array, n_shells: int, xp: ArrayModule = np) -> Array:
    """`shell_sum` in array operations of any array module: a mask drops the shells ≥ n_shells, `bincount` sums.
    The numpy path, and CuPy's where a shell histogram does not fit the device's shared memory (on a device the
    mask and `bincount`'s checks make the host wait for it)."""
    lead = values.shape[: values.ndim - shells.ndim]
    rows = int(np.prod(lead)) if lead else 1
    flat_shells = shells.reshape(-1)
    keep = flat_shells < n_shells
    idx = flat_shells[keep]
    flat = values.reshape(rows, -1)[:, keep]
    full_idx = (xp.arange(rows)[:, None] * n_shells + idx[None, :]).reshape(-1)

    def _sum(v):
        return xp.bincount(full_idx, weights=v.reshape(-1), minlength=rows * n_shells)

    if xp.iscomplexobj(flat):
        out = _sum(flat.real) + 1j * _sum(flat.imag)
    else:
        out = _sum(flat)
    return out.reshape(lead + (n_shells,))


def hermitian_weights_2d(size_px: int, xp: ArrayModule = np) -> Array:
    """Multiplicity of each half-transform coefficient in the full transform (1 or 2)."""
    w = xp.full((size_px, size_px // 2 + 1), 2.0)
    w[:, 0] = 1.0
    if size_px % 2 == 0:
        w[:, -1] = 1.0
    return w


def phase_shift_2d(ft: Array, shift_x_px: npt.ArrayLike, shift_y_px: npt.ArrayLike, size_px: int,
                   xp: ArrayModule = np) -> Array:
    """Translate images by (shift_x, shift_y) pixels through a phase ramp on their transforms.

    A positive shift moves the image content towards +x / +y (RELION's shiftImageInFourierTransform
    with the same sign). Shifts broadcast against the leading axes of `ft`.
    """
    ky, kx = frequencies_2d(size_px, xp)
    sx = xp.asarray(shift_x_px, dtype=xp.float64)[..., None, None]
    sy = xp.asarray(shift_y_px, dtype=xp.float64)[..., None, None]
    phase = xp.exp((-2j * np.pi / size_px) * (kx * sx + ky * sy))
    return ft * phase.astype(ft.dtype if xp.iscomplexobj(ft) else xp.complex128)


def window_ft_2d(ft: Array, new_size_px: int, xp: ArrayModule = np) -> Array:
    """Crop (or zero-pad) a 2D half transform to the layout of a `new_size_px` image.

    Row i of the result holds frequency signed_frequencies(new)[i], taken from the same
    frequency of the input (RELION's windowFourierTransform); kx ≤ new/2.
    """
    old = ft.shape[-2]
    new_half = new_size_px // 2 + 1
    out = xp.zeros(ft.shape[:-2] + (new_size_px, new_half), dtype=ft.dtype)
    n = min(old, new_size_px)
    pos = n // 2 + 1  # ky = 0 .. n//2 (row n/2 of an even box is +n/2)
    neg = n - pos  # ky = -neg .. -1
    x = min(new_half, ft.shape[-1])
    out[..., :pos, :x] = ft[..., :pos, :x]
    if neg:
        out[..., new_size_px - neg:, :x] = ft[..., old - neg:, :x]
    return out


def raised_cosine(r: Array, radius: float, edge_width: float, xp: ArrayModule = np) -> Array:
    """1 inside `radius`, 0 beyond `radius + edge_width`, a half cosine between."""
    if edge_width <= 0:
        return (r <= radius).astype(xp.float64)
    t = xp.clip((r - radius) / edge_width, 0.0, 1.0)
    return 0.5 + 0.5 * xp.cos(np.pi * t)


def soft_circular_mask(size_px: int, radius_px: float, edge_px: float = 5.0, xp: ArrayModule = np) -> Array:
    """A 2D real-space mask (N, N) centred at N//2 with a cosine edge (RELION's softMaskOutsideMap)."""
    c = size_px // 2
    y, x = xp.mgrid[:size_px, :size_px]
    r = xp.sqrt((x - c) ** 2.0 + (y - c) ** 2.0)
    return raised_cosine(r, radius_px, edge_px, xp)


def soft_spherical_mask(size_px: int, radius_px: float, edge_px: float = 5.0, xp: ArrayModule = np,
                        dtype: npt.DTypeLike = np.float64) -> Array:
    """A 3D real-space mask (N, N, N) of `dtype` centred at N//2 with a cosine edge (made a slab of z at a time:
    float64 only in one slab's temporaries)."""
    k = xp.arange(size_px, dtype=xp.float64) - size_px // 2
    out = xp.empty((size_px,) * 3, dtype=dtype)
    for planes in map_slabs(size_px):
        r = xp.sqrt(k[planes, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :] ** 2)
        out[planes] = raised_cosine(r, radius_px, edge_px, xp)
    return out


def lowpass_filter_3d(ft: Array, size_px: int, resolution_angstrom: float, pixel_size_angstrom: float,
                      edge_shells: float = 2.0, xp: ArrayModule = np) -> Array:
    """Low-pass a 3D half transform to `resolution_angstrom` with a cosine edge in shells."""
    radius = size_px * pixel_size_angstrom / resolution_angstrom
    return ft * raised_cosine(radius_3d(size_px, xp), radius, edge_shells, xp)


def lowpass_filter_2d(ft: Array, size_px: int, resolution_angstrom: float, pixel_size_angstrom: float,
                      edge_shells: float = 2.0, xp: ArrayModule = np) -> Array:
    """Low-pass 2D half transforms to `resolution_angstrom` with a cosine edge in shells."""
    radius = size_px * pixel_size_angstrom / resolution_angstrom
    return ft * raised_cosine(radius_2d(size_px, xp), radius, edge_shells, xp)


def shell_resolution_angstrom(shell: npt.ArrayLike, size_px: int, pixel_size_angstrom: float) -> np.ndarray:
    """Resolution in Å of Fourier shell `shell` (inf for shell 0)."""
    shell = np.asarray(shell, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.where(shell > 0, size_px * pixel_size_angstrom / np.maximum(shell, 1e-300), np.inf)


def power_spectrum_2d(ft: Array, xp: ArrayModule = np) -> Array:
    """Mean |F|² per shell of 2D half transforms (…, N, N//2+1) -> (…, N//2+1), full-transform weighted."""
    size = ft.shape[-2]
    n_shells = size // 2 + 1
    shells = shell_index_2d(size, xp)
    mult = hermitian_weights_2d(size, xp)
    power = shell_sum((ft.real ** 2 + ft.imag ** 2) * mult, shells, n_shells, xp)
    counts = shell_sum(mult, shells, n_shells, xp)
    return power / xp.maximum(counts, 1.0)


def power_spectrum_3d(ft: Array, xp: ArrayModule = np) -> Array:
    """Mean |F|² per shell of a 3D half transform (N, N, N//2+1) -> (N//2+1,)."""
    size = ft.shape[-3]
    n_shells = size // 2 + 1
    shells = shell_index_3d(size, xp)
    power = shell_sum(ft.real ** 2 + ft.imag ** 2, shells, n_shells, xp)
    counts = shell_sum(xp.ones(shells.shape), shells, n_shells, xp)
    return power / xp.maximum(counts, 1.0)


def downsample_volume(volume: Array, new_size_px: int, xp: ArrayModule = np) -> Array:
    """A cubic map Fourier-cropped to `new_size_px` voxels (pixel size × N/new), same density scale."""
    n = volume.shape[0]
    ft = rfft3_centered(xp.asarray(volume, dtype=xp.float64), xp)
    rows = signed_frequencies(new_size_px, xp).astype(xp.int64) % n
    small = ft[rows][:, rows][:, :, : new_size_px // 2 + 1]
    return irfft3_centered(small, new_size_px, xp)


def resample_volume(volume: Array, new_size_px: int, xp: ArrayModule = np) -> Array:
    """A cubic map Fourier-cropped or zero-padded to `new_size_px` voxels (pixel size × N/new), same density scale
    (RELION's resizeMap: the transform windowed to the new size)."""
    n = volume.shape[0]
    if new_size_px <= n:
        return downsample_volume(volume, new_size_px, xp)
    ft = rfft3_centered(xp.asarray(volume, dtype=xp.float64), xp)
    rows = signed_frequencies(n, xp).astype(xp.int64) % new_size_px
    big = xp.zeros((new_size_px, new_size_px, new_size_px // 2 + 1), dtype=ft.dtype)
    big[rows[:, None, None], rows[None, :, None], xp.arange(n // 2 + 1)[None, None, :]] = ft
    return irfft3_centered(big, new_size_px, xp)


def window_volume(volume: Array, box_px: int, xp: ArrayModule = np) -> Array:
    """A cubic map cropped or zero-padded in real space to `box_px` voxels about its centre (voxel N//2 goes to
    box//2, as RELION's window about the Xmipp origin)."""
    n = volume.shape[0]
    src, dst = max(0, n // 2 - box_px // 2), max(0, box_px // 2 - n // 2)
    m = min(n - src, box_px - dst)
    out = xp.zeros((box_px,) * 3, dtype=volume.dtype)
    out[dst:dst + m, dst:dst + m, dst:dst + m] = volume[src:src + m, src:src + m, src:src + m]
    return out

"""Reconstruction from back-projected Fourier sums (RELION's BackProjector::reconstruct).

The sums live in the compact padded layout of `cryorefine.core.projector` (`PaddedGrid`):
`data` complex and `weight` real arrays of shape (2R+3, 2R+3, R+2). The functions here are
pure (they return new arrays) so that the M-step can call them on sums reduced over MPI ranks.

Units. A slice back-projected with unit weight carries DFT2(image)/N² (the image transforms'
normalisation); `data / weight` then estimates DFT3(map)/N² at padded grid points, and the
inverse transform below scales by N²/Np³ so that the map comes back in the units it was
projected from. tau2 and sigma2 are per-shell powers in the same units as |data/weight|²
(RELION's model tau2 and the reconstruction noise power); shells index the unpadded grid.

RELION's defaults are followed: no Pipe–Menon gridding iterations (skip_gridding), a weight
floor of 1/1000 of the radial average, soft masking of the corners beyond radius N/2 (cosine
edge of 3 pixels, filled with the average outside), division by sinc²(r/Np).

Memory. The sums may be large (189 M elements per class at 360 px with --pad 2; 2 G at 800 px), so
every function here loops over slabs of z (`PaddedGrid.slabs`) and makes nothing of the grid's size:
float64 only in a slab's temporaries and in per-shell sums, the one padded-box array a reconstruction
needs in the sums' own precision (complex64 for float32 sums), its transform taken in place
(`core.padded_transforms`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule, to_host
from cryorefine.core.fsc import correlation_from_sums, shell_correlation_sums
from cryorefine.core.grid import SLAB_ELEMENTS, PaddedGrid, map_slabs, relion_round, trilinear_gridding_kernel
from cryorefine.core.padded_transforms import compact_rows, padded_inverse_window, padded_inverse_window_2d

__all__ = [
    "enforce_hermitian_symmetry",
    "hermitian_plane",
    "reconstruction_noise_sigma2",
    "CroppedAverage",
    "downsampled_average",
    "downsampled_average_planes",
    "half_sets_fsc",
    "reconstruct_volume",
    "reconstruct_image",
    "soft_mask_outside_map",
    "gridding_correct",
]


def _round_half_up(x, xp):
    """RELION's ROUND (floor(x + 0.5)) on arrays, as int64."""
    return xp.floor(x + 0.5).astype(xp.int64)


def hermitian_plane(data: Array, weight: Array, xp: ArrayModule = np) -> tuple[Array, Array]:
    """The x = 0 planes (D, D) of (data, weight) made Hermitian, as new arrays (the sums are not changed).

    Every point (z, y, 0) and its mate (−z, −y, 0) both become data(z, y, 0) + conj(data(−z, −y, 0))
    (and the conjugate), weights the plain sum; the origin is left as it is (RELION's
    BackProjector::enforceHermitianSymmetry). Needed because back-projection only splats into
    the stored x ≥ 0 half, so a splat that touches x = 0 misses its Friedel mate there.
    """
    plane = data[:, :, 0]
    wplane = weight[:, :, 0]
    o = (data.shape[0] - 1) // 2
    new = plane + xp.conj(plane[::-1, ::-1])
    wnew = wplane + wplane[::-1, ::-1]
    new[o, o] = plane[o, o]
    wnew[o, o] = wplane[o, o]
    return new, wnew


def enforce_hermitian_symmetry(data: Array, weight: Array, xp: ArrayModule = np) -> tuple[Array, Array]:
    """Copies of (data, weight) with the x = 0 plane made Hermitian (`hermitian_plane`)."""
    plane, wplane = hermitian_plane(data, weight, xp)
    data = data.copy()
    weight = weight.copy()
    data[:, :, 0] = plane
    weight[:, :, 0] = wplane
    return data, weight


def _slab(array, planes, plane0):
    """array[planes], with its x = 0 column replaced by `plane0`'s rows (a Hermitian plane) when given."""
    if plane0 is None:
        return array[planes]
    out = array[planes].copy()
    out[:, :, 0] = plane0[planes]
    return out


def reconstruction_noise_sigma2(weight: Array, grid: PaddedGrid, xp: ArrayModule = np) -> Array:
    """RELION's sigma2 of the reconstruction per shell, (N//2+1,) float64; of each of a stack of weights
    (…, *grid.shape) -> (…, N//2+1).

    sigma2[s] = count / Σ (pf³ · weight) over padded points with |k| < R in shell
    s = round(|k|/pf) (BackProjector::updateSSNRarrays; pf² on a 2D grid); 0 where the weights sum to zero.
    With weights Σ CTF²/σ²_noise this is the noise power of the reconstructed coefficients.
    """
    pf = grid.padding_factor
    correction = pf ** grid.ndim
    n_shells = grid.size_px // 2 + 1
    total = xp.zeros(weight.shape[: weight.ndim - grid.ndim] + (n_shells,))
    count = xp.zeros(n_shells)
    for planes in grid.slabs():
        r2 = grid.radius2(xp, planes)
        shells = xp.where(r2 < grid.r_max_padded ** 2, _round_half_up(xp.sqrt(r2) / pf, xp), n_shells)
        slab = weight[(..., planes) + (slice(None),) * (grid.ndim - 1)]
        total += fourier.shell_sum(slab.astype(xp.float64) * correction, shells, n_shells, xp)
        count += fourier.shell_sum(xp.ones(shells.shape), shells, n_shells, xp)
    return xp.where(total > 1e-20, count / xp.where(total > 1e-20, total, 1.0), 0.0)


def _downsampling_blocks(grid: PaddedGrid, elements):
    """Groups of compact z planes whose downsampled planes round(kz/pf) form one run, about `elements` compact
    elements each: (planes (slice), first downsampled index, number of downsampled planes), indices from
    −(r_max+1) as 0 (the layout of `downsampled_average`)."""
    d, h, w = grid.shape
    r_max = grid.r_max_px
    kz = np.arange(d, dtype=np.float64) - grid.origin
    zd = np.clip(np.floor(kz / grid.padding_factor + 0.5).astype(np.int64) + r_max + 1, 0, 2 * (r_max + 1))
    per_block = max(1, elements // (h * w))
    blocks, start = [], 0
    while start < d:
        stop = min(d, start + per_block)
        while stop < d and zd[stop] == zd[stop - 1]:  # a downsampled plane's padded planes stay together
            stop += 1
        blocks.append((slice(start, stop), int(zd[start]), int(zd[stop - 1] - zd[start] + 1)))
        start = stop
    return blocks


def _bin_sums(idx, values, weights, size, xp):
    """(Σ Re values, Σ Im values, Σ weights) per bin `idx` < size, float64 (`weights` an array or a scalar)."""
    if xp is not np:
        from cryorefine.gpu.bin_sums import bin_sums

        return bin_sums(idx, values, weights, size)
    if np.ndim(weights) == 0:
        den = np.bincount(idx, minlength=size) * float(weights)
    else:
        den = np.bincount(idx, weights=weights.astype(np.float64), minlength=size)
    return (np.bincount(idx, weights=values.real.astype(np.float64), minlength=size),
            np.bincount(idx, weights=values.imag.astype(np.float64), minlength=size), den)


def downsampled_average_planes(data: Array, weight: Array, grid: PaddedGrid, divide: bool = True, xp: ArrayModule = np,
                               elements: int | None = None) -> Iterator[tuple[np.ndarray, Array]]:
    """`downsampled_average` one run of planes at a time: yields (frequencies kz (m,), planes (m, N, N//2+1)) of
    the downsampled half transform, each kz at most once, zero planes left out."""
    n = grid.size_px
    r_max = grid.r_max_px
    pf = grid.padding_factor
    dd = 2 * (r_max + 1) + 1
    wd = r_max + 2
    _, ky, kx = grid.frequencies(xp)
    yd = xp.clip(_round_half_up(ky / pf, xp) + r_max + 1, 0, dd - 1)
    xd = xp.clip(_round_half_up(kx / pf, xp), 0, wd - 1)
    k = xp.arange(dd) - (r_max + 1)
    ry, rx = k[None, :, None], xp.arange(wd)[None, None, :]
    for planes, z0, m in _downsampling_blocks(grid, elements or SLAB_ELEMENTS):
        kz, _, _ = grid.frequencies(xp, planes)
        zd = xp.clip(_round_half_up(kz / pf, xp) + r_max + 1, 0, dd - 1) - z0
        idx = ((zd * dd + yd) * wd + xd).reshape(-1)
        size = m * dd * wd
        re, im, den = _bin_sums(idx, data[planes].reshape(-1), weight[planes].reshape(-1) if divide else 1.0,
                                size, xp)
        avg = xp.where(den > 0, (re + 1j * im) / xp.where(den > 0, den, 1.0), 0).reshape(m, dd, wd)
        rz = k[z0:z0 + m][:, None, None]
        keep = (rz * rz + ry * ry + rx * rx) <= r_max * r_max
        if n % 2 == 0:
            keep = keep & (rz != -(n // 2)) & (ry != -(n // 2))
        keep = keep & (rx <= n // 2)
        kz_run = np.arange(z0, z0 + m) - (r_max + 1)
        rows = np.flatnonzero((np.abs(kz_run) <= r_max) & ((n % 2 == 1) | (kz_run != -(n // 2))))
        if rows.size == 0:
            continue
        # the kept points to their places, the others to one spare element past the end: indices, not a mask
        # (a mask's count would make the host wait for the device)
        take = slice(int(rows[0]), int(rows[-1]) + 1) if rows[-1] - rows[0] + 1 == rows.size else xp.asarray(rows)
        plane_size = n * (n // 2 + 1)
        target = (xp.arange(rows.size)[:, None, None] * n + ry % n) * (n // 2 + 1) + rx
        out = xp.zeros(rows.size * plane_size + 1, dtype=data.dtype)
        out[xp.where(keep[take], target, out.size - 1).reshape(-1)] = avg[take].astype(data.dtype).reshape(-1)
        yield kz_run[rows], out[:-1].reshape(rows.size, n, n // 2 + 1)


def downsampled_average(data: Array, weight: Array, grid: PaddedGrid, divide: bool = True,
                        xp: ArrayModule = np) -> Array:
    """Σ data / Σ weight binned to the unpadded grid, as an (N, N, N//2+1) half transform.

    Padded point k goes to round(k/pf) (RELION's getDownsampledAverage); with divide=False the
    binned data is divided by the number of padded points instead. Only |k| ≤ r_max is kept;
    for an even N at r_max = N/2 the ky or kz = −N/2 points (same FFTW element as +N/2) are
    dropped. The FSC between the two half sets in the M-step is computed from these, one run of
    planes at a time (`downsampled_average_planes`, `half_sets_fsc`).
    """
    n = grid.size_px
    out = xp.zeros((n, n, n // 2 + 1), dtype=data.dtype)
    for kz, planes in downsampled_average_planes(data, weight, grid, divide, xp):
        out[xp.asarray(kz % n)] = planes
    return out


class CroppedAverage:
    """`downsampled_average` kept on the host only inside the cube |kz|, |ky|, kx ≤ r_max, outside which it is zero
    (at a current size of 0.6 of the box, a fifth of the whole): how the FSC's part of a half waits on the host, or
    crosses to another MPI worker. Indexed as the whole array is, by planes (`average[kz % n]`), it gives them
    whole, value for value."""

    def __init__(self, data: Array, weight: Array, grid: PaddedGrid, xp: ArrayModule = np) -> None:
        n, r = grid.size_px, grid.r_max_px
        self.size_px, self.r_max_px = n, r
        self.rows = np.arange(-r, r + 1) % n  # the cube's ky rows (and kz planes), from −r_max on
        self.cube = None
        rows = xp.asarray(self.rows)
        for kz, planes in downsampled_average_planes(data, weight, grid, xp=xp):
            block = planes[:, rows, : r + 1]
            if self.cube is None:
                self.cube = np.zeros((2 * r + 1, 2 * r + 1, r + 1), dtype=block.dtype)
            self.cube[kz + r] = to_host(block)

    def __getitem__(self, planes: npt.ArrayLike) -> np.ndarray:
        planes = np.atleast_1d(np.asarray(planes))
        n, r = self.size_px, self.r_max_px
        signed = np.where(planes > n // 2, planes - n, planes)
        out = np.zeros((planes.size, n, n // 2 + 1), dtype=self.cube.dtype)
        inside = np.flatnonzero(np.abs(signed) <= r)
        out[np.ix_(inside, self.rows, np.arange(r + 1))] = self.cube[signed[inside] + r]
        return out


def half_sets_fsc(sums1: tuple[Array, Array] | Array | CroppedAverage,
                  sums2: tuple[Array, Array] | Array | CroppedAverage, grid: PaddedGrid, xp: ArrayModule = np) -> Array:
    """The FSC per shell (N//2+1,) between the downsampled averages of two half sets' sums, each (data, weight):
    `fsc.fourier_shell_correlation` of their `downsampled_average`s with shell 0 set to 1, summed one run of
    planes at a time so that neither average is ever whole. One of the two may instead be its
    `downsampled_average` already made, whole or as a `CroppedAverage` (of a half that has left the device since,
    or was made elsewhere); the sums are the same whichever it is."""
    n = grid.size_px
    n_shells = n // 2 + 1
    num, den1, den2 = xp.zeros(n_shells), xp.zeros(n_shells), xp.zeros(n_shells)
    ky = fourier.signed_frequencies(n, xp)[None, :, None]
    kx = xp.arange(n // 2 + 1, dtype=xp.float64)[None, None, :]

    def planes(sums: tuple[Array, Array]) -> Iterator[tuple[np.ndarray, Array]]:
        return downsampled_average_planes(*sums, grid, xp=xp)

    if isinstance(sums1, tuple) and isinstance(sums2, tuple):
        pairs = ((kz, a, b) for (kz, a), (_, b) in zip(planes(sums1), planes(sums2)))
    elif isinstance(sums2, tuple):  # the first half's average is made already
        pairs = ((kz, xp.asarray(sums1[kz % n]), b) for kz, b in planes(sums2))
    else:  # the second half's
        pairs = ((kz, a, xp.asarray(sums2[kz % n])) for kz, a in planes(sums1))
    for kz, a, b in pairs:
        kzf = xp.asarray(kz, dtype=xp.float64)[:, None, None]
        shells = xp.rint(xp.sqrt(kzf * kzf + ky * ky + kx * kx)).astype(xp.int64)
        sums = shell_correlation_sums(a, b, shells, n_shells, xp)
        num, den1, den2 = num + sums[0], den1 + sums[1], den2 + sums[2]
    fsc = correlation_from_sums(num, den1, den2, xp)
    fsc[0] = 1.0
    return fsc


def soft_mask_outside_map(volume: Array, radius_px: float | None = None, cosine_width_px: float = 3.0,
                          xp: ArrayModule = np) -> Array:
    """RELION's softMaskOutsideMap on a 2D or 3D map: beyond `radius_px` (default N/2) fade to
    the outside average.

    Voxels with r > radius + width become the (cosine-weighted) average of the region outside
    the radius; between radius and radius + width a raised cosine blends the two. Returns a copy,
    of the map's dtype (float64 only in one slab of z at a time).
    """
    n = volume.shape[0]
    radius = n / 2.0 if radius_px is None else float(radius_px)
    k = xp.arange(n, dtype=xp.float64) - n // 2
    rest2 = sum(a * a for a in xp.meshgrid(*(k,) * (volume.ndim - 1), indexing="ij"))
    slabs = map_slabs(n, volume.ndim)

    def blend(planes: slice) -> Array:
        if volume.ndim == 2 and xp is np:
            return _host_blend_2d(n, radius, float(cosine_width_px))[planes]
        r = xp.sqrt(k[planes].reshape((-1,) + (1,) * (volume.ndim - 1)) ** 2 + rest2[None])
        return _blend(r, radius, cosine_width_px, xp)

    total = 0.0
    weighted = 0.0
    for planes in slabs:
        b = blend(planes)
        total += float(b.sum())
        weighted += float((b * volume[planes]).sum())
    if total <= 0:
        return volume.copy()
    background = weighted / total
    out = xp.empty_like(volume)
    for planes in slabs:
        b = blend(planes)
        out[planes] = ((1.0 - b) * volume[planes] + b * background).astype(volume.dtype)
    return out


def _blend(r: Array, radius: float, cosine_width_px: float, xp: ArrayModule) -> Array:
    """`soft_mask_outside_map`'s share of the outside average at radius `r`: 0 inside `radius`, 1 beyond it plus
    the width, a raised cosine between."""
    radius_p = radius + cosine_width_px
    raised = 0.5 + 0.5 * xp.cos(np.pi * (radius_p - r) / cosine_width_px)
    return xp.where(r < radius, 0.0, xp.where(r > radius_p, 1.0, raised))


@functools.lru_cache(maxsize=8)
def _host_blend_2d(size_px: int, radius: float, cosine_width_px: float) -> np.ndarray:
    """`_blend` on the (N, N) grid on the host, made once per size and radius (a 2D job masks each class image with
    it every iteration), read-only."""
    k = np.arange(size_px, dtype=np.float64) - size_px // 2
    blend = _blend(np.sqrt(k[:, None] ** 2 + k[None, :] ** 2), radius, cosine_width_px, np)
    blend.flags.writeable = False
    return blend


def gridding_correct(volume: Array, padded_size_px: int, xp: ArrayModule = np) -> Array:
    """Divide a (N, N, N) map (or an (N, N) image) by sinc²(r/Np) (RELION's griddingCorrect for trilinear, or
    bilinear, interpolation), in place, one slab at a time; returns the map."""
    n = volume.shape[0]
    for planes in map_slabs(n, volume.ndim):
        kernel = trilinear_gridding_kernel(n, padded_size_px, xp, planes, ndim=volume.ndim)
        volume[planes] = (volume[planes] / kernel).astype(volume.dtype)
    return volume


def reconstruct_volume(data: Array, weight: Array, grid: PaddedGrid, tau2: Array | npt.ArrayLike | None = None,
                       tau2_fudge: float = 1.0, minres_map_px: int = 0, mask_corners: bool = True,
                       enforce_hermitian: bool = False, xp: ArrayModule = np) -> Array:
    """Real-space map (N, N, N), centred at N//2, from padded sums (RELION's reconstruct).

    data, weight: compact arrays; with `enforce_hermitian` their x = 0 plane is made Hermitian first
                  (`hermitian_plane`, on a copy of that plane: the sums are not changed).
    tau2:         None, or per-shell signal power (≥ r_max+1 values, shells of the unpadded
                  grid): for padded |k| < R in shell s = round(|k|/pf) ≥ minres_map_px the
                  weight becomes weight + 1/(pf³·tau2_fudge·tau2[s]) (RELION's do_map; a zero
                  tau2 adds 1/(0.001·weight), which is what RELION does).
    Then, always: weight = max(weight, 1/1000 of the mean weight in shell floor(|k|/pf)
    (shell r_max−1 beyond r_max)); data/weight inside |k| ≤ R; inverse FFT of the Np box,
    scaled so that the map has the units it was projected from; window to N; with
    mask_corners RELION's soft mask beyond radius N/2; divide by sinc²(r/Np).
    Returns the real dtype of `weight`; the padded box's transform is held in the precision of `data`.
    """
    n = grid.size_px
    npad = grid.padded_size_px
    pf = grid.padding_factor
    r_pad = grid.r_max_padded
    r_max = grid.r_max_px
    plane0, wplane0 = hermitian_plane(data, weight, xp) if enforce_hermitian else (None, None)
    inv_tau2_of_shell = None
    if tau2 is not None:
        t = xp.asarray(tau2, dtype=xp.float64).reshape(-1)
        needed = int(relion_round(r_pad / pf)) + 1
        if t.size < min(needed, n // 2 + 1):
            raise ValueError(f"tau2 has {t.size} shells; reconstruction to r_max={r_max} needs {needed}")
        positive = t > 0
        inv_tau2_of_shell = xp.where(positive, 1.0 / (pf ** 3 * tau2_fudge * xp.where(positive, t, 1.0)), 0.0)

    def effective(planes: slice) -> tuple[Array, Array]:
        """(|k|², the weight with τ² added) of a slab, float64."""
        r2 = grid.radius2(xp, planes)
        fweight = _slab(weight, planes, wplane0).astype(xp.float64)
        if inv_tau2_of_shell is None:
            return r2, fweight
        ires = _round_half_up(xp.sqrt(r2) / pf, xp)
        shell = xp.clip(ires, 0, t.size - 1)
        tiny = fweight > 1e-20
        inv = xp.where(positive[shell], inv_tau2_of_shell[shell],
                       xp.where(tiny, 1.0 / (0.001 * xp.where(tiny, fweight, 1.0)), 0.0))
        apply = (r2 < r_pad * r_pad) & (ires >= minres_map_px)
        return r2, xp.where(apply, fweight + inv, fweight)

    # Weight floor: 1/1000 of the radially averaged weight (shells floor(|k|/pf) < r_max).
    round_max_r2 = relion_round(r_max * pf * r_max * pf)
    totals, counts = xp.zeros(r_max), xp.zeros(r_max)
    for planes in grid.slabs():
        r2, fweight = effective(planes)
        shells = xp.where(r2 < round_max_r2, xp.floor(xp.sqrt(r2) / pf).astype(xp.int64), r_max)
        totals += fourier.shell_sum(fweight, shells, r_max, xp)
        counts += fourier.shell_sum(xp.ones(shells.shape), shells, r_max, xp)
    radavg = xp.where(counts > 0, totals / (1000.0 * xp.maximum(counts, 1.0)), 0.0)

    # data / weight into the uncentred transform of the padded box (|k| ≤ R; +Np/2 kept where it meets −Np/2)
    rows, rows_fft = compact_rows(grid)
    wx = min(grid.shape[2], r_pad + 1, npad // 2 + 1)
    rows_fft_d = xp.asarray(rows_fft)
    ft = xp.zeros((npad, npad, npad // 2 + 1), dtype=data.dtype)
    for planes in grid.slabs():
        lo, hi = max(planes.start, int(rows[0])), min(planes.stop, int(rows[-1]) + 1)
        if lo >= hi:
            continue
        planes = slice(lo, hi)
        r2, fweight = effective(planes)
        floor_w = radavg[xp.minimum(xp.floor(xp.sqrt(r2) / pf).astype(xp.int64), r_max - 1)]
        w_eff = xp.maximum(fweight, floor_w)
        del fweight, floor_w
        values = _slab(data, planes, plane0)
        quotient = xp.where(w_eff != 0, values / xp.where(w_eff != 0, w_eff, 1.0), values)
        quotient = xp.where(r2 <= r_pad * r_pad, quotient, 0)
        z_fft = xp.asarray(rows_fft[lo - int(rows[0]):hi - int(rows[0])])
        ft[z_fft[:, None], rows_fft_d[None, :], :wx] = quotient[:, rows[0]:rows[-1] + 1, :wx].astype(data.dtype)
        del r2, w_eff, values, quotient

    # data/weight ≈ DFT3(map)/N² on the padded grid: inverse DFT (sum) × N²/Np³, the middle N³ of the box.
    vol = padded_inverse_window(ft, n, xp, r_max_padded=r_pad)
    del ft
    vol *= vol.dtype.type(float(n) ** 2 / float(npad) ** 3)
    if mask_corners:
        vol = soft_mask_outside_map(vol, xp=xp)
    return gridding_correct(vol, npad, xp).astype(weight.dtype)


def reconstruct_image(data: Array, weight: Array, grid: PaddedGrid, tau2: Array | npt.ArrayLike | None = None,
                      tau2_fudge: float = 1.0, minres_map_px: int = 0, mask_corners: bool = True,
                      xp: ArrayModule = np) -> Array:
    """A 2D reference (N, N) from the padded 2D sums of its back-projected images: `reconstruct_volume`'s
    arithmetic on a 2D grid (RELION's BackProjector::reconstruct with ref_dim 2). The x = 0 column is made
    Hermitian; τ² adds 1/(pf²·tau2_fudge·τ²) to the weights (pf² in 2D, pf³ in 3D); the weight floor is 1/1000
    of each shell's mean; the inverse transform of the Np box scaled by N²/Np², windowed to N, its corners
    softly masked beyond N/2 with `mask_corners`, divided by sinc²(r/Np)."""
    n = grid.size_px
    npad = grid.padded_size_px
    pf = grid.padding_factor
    r_pad = grid.r_max_padded
    r_max = grid.r_max_px
    o = grid.origin
    data = data.copy()
    weight = weight.astype(xp.float64)
    # the x = 0 column: a point and its mate (−ky) hold each other's conjugate (back-projection splats one side)
    column, wcolumn = data[:, 0].copy(), weight[:, 0].copy()
    data[:, 0] = column + xp.conj(column[::-1])
    weight[:, 0] = wcolumn + wcolumn[::-1]
    data[o, 0], weight[o, 0] = column[o], wcolumn[o]
    r2 = grid.radius2(xp)
    radius = xp.sqrt(r2)
    if tau2 is not None:
        t = xp.asarray(tau2, dtype=xp.float64).reshape(-1)
        shell = xp.clip(_round_half_up(radius / pf, xp), 0, t.size - 1)
        positive = t[shell] > 0
        tiny = weight > 1e-20
        inv = xp.where(positive, 1.0 / (pf ** 2 * tau2_fudge * xp.where(positive, t[shell], 1.0)),
                       xp.where(tiny, 1.0 / (0.001 * xp.where(tiny, weight, 1.0)), 0.0))
        apply = (r2 < r_pad * r_pad) & (_round_half_up(radius / pf, xp) >= minres_map_px)
        weight = xp.where(apply, weight + inv, weight)
    round_max_r2 = relion_round(r_max * pf * r_max * pf)
    shells = xp.where(r2 < round_max_r2, xp.floor(radius / pf).astype(xp.int64), r_max)
    totals = fourier.shell_sum(weight, shells, r_max, xp)
    counts = fourier.shell_sum(xp.ones(shells.shape), shells, r_max, xp)
    radavg = xp.where(counts > 0, totals / (1000.0 * xp.maximum(counts, 1.0)), 0.0)
    w_eff = xp.maximum(weight, radavg[xp.minimum(xp.floor(radius / pf).astype(xp.int64), r_max - 1)])
    quotient = xp.where(w_eff != 0, data / xp.where(w_eff != 0, w_eff, 1.0), data)
    quotient = xp.where(r2 <= r_pad * r_pad, quotient, 0)
    rows, rows_fft = compact_rows(grid)
    wx = min(grid.shape[-1], r_pad + 1, npad // 2 + 1)
    ft = xp.zeros((npad, npad // 2 + 1), dtype=data.dtype)
    ft[xp.asarray(rows_fft), :wx] = quotient[rows[0]:rows[-1] + 1, :wx]
    image = padded_inverse_window_2d(ft, n, xp)
    image = image * (float(n) ** 2 / float(npad) ** 2)
    if mask_corners:
        image = soft_mask_outside_map(image, xp=xp)
    return gridding_correct(image.astype(xp.float64), npad, xp).astype(data.real.dtype)

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
"""

from __future__ import annotations

import numpy as np

from cryorefine.core import fourier
from cryorefine.core.grid import PaddedGrid, relion_round, trilinear_gridding_kernel

__all__ = [
    "enforce_hermitian_symmetry",
    "reconstruction_noise_sigma2",
    "downsampled_average",
    "reconstruct_volume",
    "soft_mask_outside_map",
    "gridding_correct",
]


def _round_half_up(x, xp):
    """RELION's ROUND (floor(x + 0.5)) on arrays, as int64."""
    return xp.floor(x + 0.5).astype(xp.int64)


def enforce_hermitian_symmetry(data, weight, xp=np):
    """Copies of (data, weight) with the x = 0 plane made Hermitian.

    Every point (z, y, 0) and its mate (−z, −y, 0) both become data(z, y, 0) + conj(data(−z, −y, 0))
    (and the conjugate), weights the plain sum; the origin is left as it is (RELION's
    BackProjector::enforceHermitianSymmetry). Needed because back-projection only splats into
    the stored x ≥ 0 half, so a splat that touches x = 0 misses its Friedel mate there.
    """
    data = data.copy()
    weight = weight.copy()
    d = data.shape[0]
    o = (d - 1) // 2
    plane = data[:, :, 0]
    wplane = weight[:, :, 0]
    new = plane + xp.conj(plane[::-1, ::-1])
    wnew = wplane + wplane[::-1, ::-1]
    centre = plane[o, o].copy()  # a copy: on cupy an indexed element is a view
    wcentre = wplane[o, o].copy()
    data[:, :, 0] = new
    weight[:, :, 0] = wnew
    data[o, o, 0] = centre
    weight[o, o, 0] = wcentre
    return data, weight


def reconstruction_noise_sigma2(weight, grid: PaddedGrid, xp=np):
    """RELION's sigma2 of the reconstruction per shell, (N//2+1,) float64.

    sigma2[s] = count / Σ (pf³ · weight) over padded points with |k| < R in shell
    s = round(|k|/pf) (BackProjector::updateSSNRarrays); 0 where the weights sum to zero.
    With weights Σ CTF²/σ²_noise this is the noise power of the reconstructed coefficients.
    """
    pf = grid.padding_factor
    r2 = grid.radius2(xp)
    n_shells = grid.size_px // 2 + 1
    keep = r2 < grid.r_max_padded ** 2
    shells = _round_half_up(xp.sqrt(r2) / pf, xp)
    shells = xp.where(keep, shells, n_shells)
    total = fourier.shell_sum(weight.astype(xp.float64) * pf ** 3, shells, n_shells, xp)
    count = fourier.shell_sum(xp.ones(shells.shape), shells, n_shells, xp)
    return xp.where(total > 1e-20, count / xp.where(total > 1e-20, total, 1.0), 0.0)


def downsampled_average(data, weight, grid: PaddedGrid, divide=True, xp=np):
    """Σ data / Σ weight binned to the unpadded grid, as an (N, N, N//2+1) half transform.

    Padded point k goes to round(k/pf) (RELION's getDownsampledAverage); with divide=False the
    binned data is divided by the number of padded points instead. Only |k| ≤ r_max is kept;
    for an even N at r_max = N/2 the ky or kz = −N/2 points (same FFTW element as +N/2) are
    dropped. The FSC between the two half sets in the M-step is computed on these.
    """
    n = grid.size_px
    r_max = grid.r_max_px
    pf = grid.padding_factor
    dd = 2 * (r_max + 1) + 1
    wd = r_max + 2
    kz, ky, kx = grid.frequencies(xp)
    shape = grid.shape
    zd = xp.clip(_round_half_up(xp.broadcast_to(kz, shape) / pf, xp) + r_max + 1, 0, dd - 1)
    yd = xp.clip(_round_half_up(xp.broadcast_to(ky, shape) / pf, xp) + r_max + 1, 0, dd - 1)
    xd = xp.clip(_round_half_up(xp.broadcast_to(kx, shape) / pf, xp), 0, wd - 1)
    idx = ((zd * dd + yd) * wd + xd).reshape(-1)
    size = dd * dd * wd
    flat = data.reshape(-1)
    re = xp.bincount(idx, weights=flat.real.astype(xp.float64), minlength=size)
    im = xp.bincount(idx, weights=flat.imag.astype(xp.float64), minlength=size)
    if divide:
        den = xp.bincount(idx, weights=weight.reshape(-1).astype(xp.float64), minlength=size)
    else:
        den = xp.bincount(idx, minlength=size).astype(xp.float64)
    avg = xp.where(den > 0, (re + 1j * im) / xp.where(den > 0, den, 1.0), 0)
    avg = avg.reshape(dd, dd, wd)
    k = xp.arange(dd) - (r_max + 1)
    kxd = xp.arange(wd)
    rz, ry, rx = k[:, None, None], k[None, :, None], kxd[None, None, :]
    keep = (rz * rz + ry * ry + rx * rx) <= r_max * r_max
    if n % 2 == 0:
        keep = keep & (rz != -(n // 2)) & (ry != -(n // 2))
    keep = keep & (rx <= n // 2)
    zi = xp.broadcast_to(rz % n, keep.shape)[keep]
    yi = xp.broadcast_to(ry % n, keep.shape)[keep]
    xi = xp.broadcast_to(rx, keep.shape)[keep]
    out = xp.zeros((n, n, n // 2 + 1), dtype=data.dtype)
    out[zi, yi, xi] = avg[keep].astype(data.dtype)
    return out


def soft_mask_outside_map(volume, radius_px=None, cosine_width_px=3.0, xp=np):
    """RELION's softMaskOutsideMap on a 2D or 3D map: beyond `radius_px` (default N/2) fade to
    the outside average.

    Voxels with r > radius + width become the (cosine-weighted) average of the region outside
    the radius; between radius and radius + width a raised cosine blends the two. Returns a copy.
    """
    n = volume.shape[0]
    radius = n / 2.0 if radius_px is None else float(radius_px)
    radius_p = radius + cosine_width_px
    c = n // 2
    axes = xp.meshgrid(*(xp.arange(n, dtype=xp.float64) - c,) * volume.ndim, indexing="ij")
    r = xp.sqrt(sum(a * a for a in axes))
    raised = 0.5 + 0.5 * xp.cos(np.pi * (radius_p - r) / cosine_width_px)
    blend = xp.where(r < radius, 0.0, xp.where(r > radius_p, 1.0, raised))
    total = blend.sum()
    if float(total) <= 0:
        return volume.copy()
    background = (blend * volume).sum() / total
    return ((1.0 - blend) * volume + blend * background).astype(volume.dtype)


def gridding_correct(volume, padded_size_px, xp=np):
    """Divide a (N, N, N) map by sinc²(r/Np) (RELION's griddingCorrect for trilinear)."""
    n = volume.shape[0]
    return (volume / trilinear_gridding_kernel(n, padded_size_px, xp)).astype(volume.dtype)


def reconstruct_volume(data, weight, grid: PaddedGrid, tau2=None, tau2_fudge=1.0, minres_map_px=0,
                       mask_corners=True, xp=np):
    """Real-space map (N, N, N), centred at N//2, from padded sums (RELION's reconstruct).

    data, weight: compact arrays (after `enforce_hermitian_symmetry`).
    tau2:         None, or per-shell signal power (≥ r_max+1 values, shells of the unpadded
                  grid): for padded |k| < R in shell s = round(|k|/pf) ≥ minres_map_px the
                  weight becomes weight + 1/(pf³·tau2_fudge·tau2[s]) (RELION's do_map; a zero
                  tau2 adds 1/(0.001·weight), which is what RELION does).
    Then, always: weight = max(weight, 1/1000 of the mean weight in shell floor(|k|/pf)
    (shell r_max−1 beyond r_max)); data/weight inside |k| ≤ R; inverse FFT of the Np box,
    scaled so that the map has the units it was projected from; window to N; with
    mask_corners RELION's soft mask beyond radius N/2; divide by sinc²(r/Np).
    Returns the real dtype of `weight`.
    """
    n = grid.size_px
    npad = grid.padded_size_px
    pf = grid.padding_factor
    r_pad = grid.r_max_padded
    r_max = grid.r_max_px
    r2 = grid.radius2(xp)
    r = xp.sqrt(r2)
    fweight = weight.astype(xp.float64)

    if tau2 is not None:
        t = xp.asarray(tau2, dtype=xp.float64).reshape(-1)
        in_map = r2 < r_pad * r_pad
        ires = _round_half_up(r / pf, xp)
        needed = int(relion_round(r_pad / pf)) + 1
        if t.size < min(needed, n // 2 + 1):
            raise ValueError(f"tau2 has {t.size} shells; reconstruction to r_max={r_max} needs {needed}")
        t_at = t[xp.clip(ires, 0, t.size - 1)]
        positive = t_at > 0
        inv_tau2 = xp.where(positive, 1.0 / (pf ** 3 * tau2_fudge * xp.where(positive, t_at, 1.0)), 0.0)
        tiny = fweight > 1e-20
        inv_zero = xp.where(tiny, 1.0 / (0.001 * xp.where(tiny, fweight, 1.0)), 0.0)
        inv_tau2 = xp.where(positive, inv_tau2, inv_zero)
        apply = in_map & (ires >= minres_map_px)
        fweight = xp.where(apply, fweight + inv_tau2, fweight)
        del t_at, positive, inv_tau2, tiny, inv_zero, apply, in_map, ires  # large on a GPU: free early

    # Weight floor: 1/1000 of the radially averaged weight (shells floor(|k|/pf) < r_max).
    round_max_r2 = relion_round(r_max * pf * r_max * pf)
    sel = r2 < round_max_r2
    ifloor = xp.floor(r / pf).astype(xp.int64)
    shells = xp.where(sel, ifloor, r_max)
    totals = fourier.shell_sum(fweight, shells, r_max, xp)
    counts = fourier.shell_sum(xp.ones(shells.shape), shells, r_max, xp)
    radavg = xp.where(counts > 0, totals / (1000.0 * xp.maximum(counts, 1.0)), 0.0)
    floor_w = radavg[xp.minimum(ifloor, r_max - 1)]
    w_eff = xp.maximum(fweight, floor_w)
    del fweight, floor_w, shells, sel, ifloor
    quotient = xp.where(w_eff != 0, data / xp.where(w_eff != 0, w_eff, 1.0), data)
    del w_eff

    # Decenter into the FFTW layout of the padded box (|k| ≤ R).
    kz, ky, kx = grid.frequencies(xp)
    keep = r2 <= r_pad * r_pad
    if r_pad >= npad // 2:
        # +Np/2 and −Np/2 share one FFTW element: keep +Np/2 (RELION's convention).
        keep = keep & (kz != -(npad // 2)) & (ky != -(npad // 2))
    shape = grid.shape
    zi = (xp.broadcast_to(kz, shape)[keep].astype(xp.int64)) % npad
    yi = (xp.broadcast_to(ky, shape)[keep].astype(xp.int64)) % npad
    xi = xp.broadcast_to(kx, shape)[keep].astype(xp.int64)
    ft = xp.zeros((npad, npad, npad // 2 + 1), dtype=data.dtype)
    ft[zi, yi, xi] = quotient[keep].astype(data.dtype)

    # data/weight ≈ DFT3(map)/N² on the padded grid: inverse DFT (sum) × N²/Np³.
    padded = fourier.irfft3_centered(ft, npad, xp) * (float(n) ** 2 / float(npad) ** 3)
    s = npad // 2 - n // 2
    vol = padded[s:s + n, s:s + n, s:s + n]
    if mask_corners:
        vol = soft_mask_outside_map(vol, xp=xp)
    vol = vol / trilinear_gridding_kernel(n, npad, xp)
    return vol.astype(weight.dtype)

"""RELION's Fourier projector and back-projector (trilinear interpolation, padded transforms).

A `Projector` holds the padded 3D half transform of a reference map; `project` cuts central
slices out of it by trilinear interpolation (RELION's Projector::computeFourierTransformMap
and Projector::project). A `BackProjector` holds the padded data (complex) and weight (real)
volumes that slices are splatted into, the adjoint of `project` (RELION's
BackProjector::backrotate2D), and `reconstruct` turns the sums into a real-space map (see
`cryorefine.core.reconstruct`, which holds the reconstruction arithmetic).

Normalisation. For a real map V (N, N, N) centred at N//2 with unit voxel spacing, and a pose
matrix A (`cryorefine.core.euler`), `Projector(V).project(A, N)` equals, to interpolation
error, `fourier.rfft2_centered(P)` with P(x, y) = Σ_z V(Aᵀ(x, y, z)) the line integral of the
map (for the identity pose, `V.sum(axis=0)`). Equivalently, the projector stores
DFT3(V)(k) / N² — RELION's convention, in which a 3D map's central slice is normalised like
the 2D transforms of the images (forward transform divided by the number of pixels, N²). A
smaller output size n < N gives the same coefficients cropped to |k| ≤ n/2 (the layout of
`fourier.window_ft_2d`), frequencies staying integers in units of 1/(N·pixel size).

Compact layout (both classes, RELION's): with padded box size Np = round(pf·N) made even,
effective padding factor pf = Np/N and R = round(r_max·pf), the arrays have shape
(2R+3, 2R+3, R+2) and index [z + R+1, y + R+1, x] for padded frequencies (x ≥ 0; the x < 0
half is the complex conjugate of the point mirrored through the origin). Only |(x, y, z)| ≤ R
is non-zero in a projector. A slice coefficient at integer image frequency (kx, ky) is read
at pf·Aᵀ(kx, ky, 0). Image rows follow `fourier.signed_frequencies` (row n/2 of an even
size is +n/2, as in RELION).

2D references (RELION's ref_dim 2, 2D classification): a `Projector` of an (N, N) image holds its
padded 2D half transform, shape (2R+3, R+2) indexed [y + R+1, x]; its "projection" at pose A is
the transform rotated in plane, the coefficient at (kx, ky) read at pf·A₂ᵀ(kx, ky) (A₂ the upper
left 2 × 2 block of A: for rot = tilt = 0 a rotation by psi, so that a 2D class and a 3D map agree on
what rlnAnglePsi means) by bilinear interpolation; `BackProjector(N, ndim=2)` is its adjoint. The
unrotated projection of an image equals `fourier.rfft2_centered` of it.

Everything takes an array module `xp` (numpy or cupy) and a real dtype (float32 or float64;
complex arrays follow as complex64 or complex128). Nothing here imports cupy.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt

from cryorefine.core import fourier, reconstruct
from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.grid import PaddedGrid, complex_dtype_for, map_slabs, trilinear_gridding_kernel
from cryorefine.core.padded_transforms import padded_forward, padded_forward_2d
from cryorefine.core.symmetry import SymmetryGroup, symmetrise_padded_sums


@lru_cache(maxsize=64)
def _slice_points(size_px, r_max_sq, skip_redundant):
    """Coefficients of an (n, n//2+1) half transform with kx² + ky² ≤ r_max² (host numpy).

    Returns (flat positions, kx, ky). With `skip_redundant`, the kx = 0, ky < 0 half column
    (the Friedel mates of kx = 0, ky > 0) is left out, as RELION's back-projection does.
    """
    ky = fourier.signed_frequencies(size_px, np).astype(np.int64)[:, None]
    kx = np.arange(size_px // 2 + 1)[None, :]
    keep = kx * kx + ky * ky <= r_max_sq
    if skip_redundant:
        keep &= ~((kx == 0) & (ky < 0))
    keep = np.broadcast_to(keep, (size_px, size_px // 2 + 1))
    pos = np.flatnonzero(keep)
    kyf = np.broadcast_to(ky, keep.shape).reshape(-1)[pos].astype(np.float64)
    kxf = np.broadcast_to(kx, keep.shape).reshape(-1)[pos].astype(np.float64)
    return pos, kxf, kyf


_CORNERS = ((0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1))


def _effective_r_max(grid, size_px, r_max_px):
    r = min(float(grid.r_max_px), float(size_px // 2))
    if r_max_px is not None:
        r = min(r, float(r_max_px))
    return r


def _slice_geometry(grid, matrices, kx, ky, real_dtype, xp):
    """Trilinear sampling geometry of slice points pf·Aᵀ(kx, ky, 0) in the compact layout.

    matrices (B, 3, 3); kx, ky (M,). Returns base flat index (B, M) int64 of the (z0, y0, x0)
    corner, fractions fx, fy, fz (B, M), `neg` (B, M) bool where the point was mirrored to
    x ≥ 0 (take the complex conjugate), and `inside` (B, M) bool (|q| ≤ R).
    """
    a = xp.asarray(matrices, dtype=real_dtype)
    pf = real_dtype(grid.padding_factor)
    kx = xp.asarray(kx, dtype=real_dtype)[None, :]
    ky = xp.asarray(ky, dtype=real_dtype)[None, :]
    # Aᵀ (kx, ky, 0) = kx·A[0, :] + ky·A[1, :]
    qx = pf * (kx * a[:, 0, 0, None] + ky * a[:, 1, 0, None])
    qy = pf * (kx * a[:, 0, 1, None] + ky * a[:, 1, 1, None])
    qz = pf * (kx * a[:, 0, 2, None] + ky * a[:, 1, 2, None])
    r_pad = grid.r_max_padded
    # |q| = pf·|k| exactly; the relative slack keeps points with |k| = r_max that rounding
    # would push just past R (RELION checks against R, which matters for non-integer pf).
    inside = qx * qx + qy * qy + qz * qz <= real_dtype(r_pad * r_pad * (1.0 + 1e-5))
    neg = qx < 0
    sign = xp.where(neg, real_dtype(-1), real_dtype(1))
    qx, qy, qz = qx * sign, qy * sign, qz * sign
    x0, y0, z0 = xp.floor(qx), xp.floor(qy), xp.floor(qz)
    fx, fy, fz = qx - x0, qy - y0, qz - z0
    d, _, w = grid.shape
    o = grid.origin
    # |q| ≤ R + 1/2 keeps every corner inside the (2R+3)² × (R+2) box; clip for safety only.
    ix = xp.clip(x0.astype(xp.int64), 0, w - 2)
    iy = xp.clip(y0.astype(xp.int64) + o, 0, d - 2)
    iz = xp.clip(z0.astype(xp.int64) + o, 0, d - 2)
    base = (iz * d + iy) * w + ix
    return base, fx, fy, fz, neg, inside


def _corner_offsets(grid):
    d, _, w = grid.shape
    return [dz * d * w + dy * w + dx for dz, dy, dx in _CORNERS]


def _corner_weights(fx, fy, fz):
    gx, gy, gz = 1 - fx, 1 - fy, 1 - fz
    out = []
    for dz, dy, dx in _CORNERS:
        out.append((fz if dz else gz) * (fy if dy else gy) * (fx if dx else gx))
    return out


def _slice_geometry_2d(grid, matrices, kx, ky, real_dtype, xp):
    """Bilinear sampling geometry of the points pf·A₂ᵀ(kx, ky) of a 2D grid (in-plane rotations): base flat index
    (B, M) of the (y0, x0) corner, fractions fx, fy, `neg` (mirrored to x ≥ 0: conjugate) and `inside`."""
    a = xp.asarray(matrices, dtype=real_dtype)
    pf = real_dtype(grid.padding_factor)
    kx = xp.asarray(kx, dtype=real_dtype)[None, :]
    ky = xp.asarray(ky, dtype=real_dtype)[None, :]
    qx = pf * (kx * a[:, 0, 0, None] + ky * a[:, 1, 0, None])
    qy = pf * (kx * a[:, 0, 1, None] + ky * a[:, 1, 1, None])
    r_pad = grid.r_max_padded
    inside = qx * qx + qy * qy <= real_dtype(r_pad * r_pad * (1.0 + 1e-5))
    neg = qx < 0
    sign = xp.where(neg, real_dtype(-1), real_dtype(1))
    qx, qy = qx * sign, qy * sign
    x0, y0 = xp.floor(qx), xp.floor(qy)
    fx, fy = qx - x0, qy - y0
    d, w = grid.shape
    ix = xp.clip(x0.astype(xp.int64), 0, w - 2)
    iy = xp.clip(y0.astype(xp.int64) + grid.origin, 0, d - 2)
    return iy * w + ix, fx, fy, neg, inside


def _corners_2d(grid, fx, fy):
    """The four corners of bilinear interpolation: (flat offset, weight) each, x inner."""
    w = grid.shape[-1]
    gx, gy = 1 - fx, 1 - fy
    return [(0, gy * gx), (1, gy * fx), (w, fy * gx), (w + 1, fy * fx)]


class _OnPaddedGrid:
    """The box, padding factor and radius of the PaddedGrid `self.grid` a projector or back-projector works on."""

    grid: PaddedGrid

    @property
    def size_px(self) -> int:
        return self.grid.size_px

    @property
    def padding_factor(self) -> float:
        return self.grid.padding_factor

    @property
    def r_max_px(self) -> int:
        return self.grid.r_max_px


def padded_references_2d(images: Array, grid: PaddedGrid, dtype: npt.DTypeLike, xp: ArrayModule = np,
                         out: Array | None = None, do_gridding: bool = True) -> Array:
    """`Projector.data` of each real (N, N) 2D reference of a stack (K, N, N), (K, …) on `grid`, in one batched
    transform of the precision of `dtype` (a single (N, N) image gives one): each divided by the bilinear gridding
    kernel (`do_gridding`), then `padded_forward_2d`."""
    image = xp.asarray(images).astype(xp.float64)
    if do_gridding:
        image = image / trilinear_gridding_kernel(grid.size_px, grid.padded_size_px, xp, ndim=2)
    return padded_forward_2d(image.astype(np.dtype(dtype).type), grid, xp, out=out)


class Projector(_OnPaddedGrid):
    """Padded 3D Fourier transform of a map, for central slices by trilinear interpolation.

    Projector(volume, padding_factor=2, r_max_px=None, do_gridding=True, dtype=np.float64, xp=np)

    volume:         real (N, N, N) map (z, y, x), centred at N//2, unit voxel spacing; or a real (N, N)
                    2D reference (RELION's ref_dim 2: the projector is 2D, see the module docstring).
    padding_factor: real-space zero padding (RELION --pad; the box becomes round(pf·N), even).
    r_max_px:       keep frequencies |k| ≤ r_max (Fourier pixels of the unpadded map; default
                    and maximum N//2). RELION sets it to current_size/2.
    do_gridding:    divide the map by sinc²(r/Np) before the transform (RELION's gridding
                    pre-correction for trilinear interpolation). Without it the slices equal
                    the exact DFT wherever they hit grid points (useful for tests only).

    out:            where to write `data` (the grid's shape, complex), e.g. one class of a stack of references.

    Attributes: `grid` (PaddedGrid), `data` (compact complex array, see module docstring),
    `power_spectrum` ((N//2+1,) RELION's radial power of `data`: mean |F|²/2 per shell
    round(|k_padded|/pf), as computeFourierTransformMap returns it for tau² initialisation).
    """

    def __init__(self, volume: Array, padding_factor: float = 2.0, r_max_px: float | None = None,
                 do_gridding: bool = True, dtype: npt.DTypeLike = np.float64, xp: ArrayModule = np,
                 out: Array | None = None) -> None:
        self.xp = xp
        self.real_dtype = np.dtype(dtype).type
        self.complex_dtype = complex_dtype_for(dtype).type
        vol = xp.asarray(volume)
        if vol.ndim not in (2, 3) or len(set(vol.shape)) != 1:
            raise ValueError(f"Projector needs a cubic (N, N, N) volume or a square (N, N) image, got shape "
                             f"{vol.shape}")
        n = vol.shape[0]
        self.grid = grid = PaddedGrid.create(n, padding_factor, r_max_px, ndim=vol.ndim)
        npad = grid.padded_size_px
        if vol.ndim == 2:  # a 2D reference: one small transform
            self.data = padded_references_2d(vol, grid, self.real_dtype, xp, out=out, do_gridding=do_gridding)
            return
        corrected = xp.empty(vol.shape, dtype=self.real_dtype)
        for planes in map_slabs(n):  # in float64, a slab at a time
            v = vol[planes].astype(xp.float64)
            if do_gridding:
                v = v / trilinear_gridding_kernel(n, npad, xp, planes)
            corrected[planes] = v
        del vol
        # DFT3(V)(k) / N² of the zero-padded box, |k| ≤ R, one slab at a time (core.padded_transforms)
        self.data = padded_forward(corrected, grid, xp, out=out)

    @classmethod
    def from_transform(cls, data: Array, grid: PaddedGrid, xp: ArrayModule = np) -> Projector:
        """The projector of a padded transform made before (`data`, complex, in `grid`'s compact layout): e.g. one
        another MPI worker made and shared."""
        projector = cls.__new__(cls)
        projector.xp, projector.grid, projector.data = xp, grid, data
        projector.complex_dtype = np.dtype(data.dtype).type
        projector.real_dtype = np.dtype(data.dtype).type(0).real.dtype.type
        return projector

    @cached_property
    def power_spectrum(self) -> Array:
        """RELION's radial power of `data` (computed on first use: the E-step never needs it)."""
        return relion_power_spectrum(self.data, self.grid, self.xp)

    def project(self, matrices: Array, image_size_px: int | None = None, r_max_px: float | None = None) -> Array:
        """Central slices (…, n, n//2+1), complex, at poses `matrices` (…, 3, 3).

        Coefficient (ky, kx) is the trilinear interpolation of `data` at pf·Aᵀ(kx, ky, 0)
        (complex conjugate of the mirrored point where its x < 0), normalised so that it
        equals `fourier.rfft2_centered` of the line integral Σ_z V(Aᵀ(x, y, z)) of the N-sized
        map; zero outside |k| ≤ min(r_max, n//2, projector r_max). n = image_size_px ≤ N
        (default N) crops the frequencies, as for coarse-pass images.
        """
        xp = self.xp
        n = self.grid.size_px if image_size_px is None else int(image_size_px)
        if n > self.grid.size_px:
            raise ValueError(f"image size {n} is larger than the projector's box {self.grid.size_px}")
        mats = xp.asarray(matrices)
        lead = mats.shape[:-2]
        mats = mats.reshape(-1, 3, 3)
        r = _effective_r_max(self.grid, n, r_max_px)
        pos, kx, ky = _slice_points(n, r * r, False)
        flat = self.data.reshape(-1)
        if self.grid.ndim == 2:
            base, fx, fy, neg, inside = _slice_geometry_2d(self.grid, mats, kx, ky, self.real_dtype, xp)
            w = self.grid.shape[-1]
            row0 = xp.take(flat, base) + (xp.take(flat, base + 1) - xp.take(flat, base)) * fx
            row1 = xp.take(flat, base + w) + (xp.take(flat, base + w + 1) - xp.take(flat, base + w)) * fx
            vals = row0 + (row1 - row0) * fy  # x first, then y
            return self._slices_out(vals, neg, inside, pos, mats.shape[0], n, lead)
        base, fx, fy, fz, neg, inside = _slice_geometry(self.grid, mats, kx, ky, self.real_dtype, xp)
        offs = _corner_offsets(self.grid)

        def at(i: int) -> Array:
            return xp.take(flat, base + offs[i])

        def lerp(f: Array, lo: Array, hi: Array) -> Array:
            return lo + (hi - lo) * f

        # x first, then y, then z, as RELION does.
        c00 = lerp(fx, at(0), at(1))
        c01 = lerp(fx, at(2), at(3))
        c10 = lerp(fx, at(4), at(5))
        c11 = lerp(fx, at(6), at(7))
        c0 = lerp(fy, c00, c01)
        c1 = lerp(fy, c10, c11)
        vals = lerp(fz, c0, c1)
        return self._slices_out(vals, neg, inside, pos, mats.shape[0], n, lead)

    def _slices_out(self, vals, neg, inside, pos, b, n, lead):
        """The interpolated values (b, M) as half transforms (…, n, n//2+1): conjugated where mirrored, zero
        outside the sphere and at the coefficients not computed."""
        xp = self.xp
        vals = xp.where(neg, xp.conj(vals), vals)
        vals = xp.where(inside, vals, 0).astype(self.complex_dtype)
        out = xp.zeros((b, n * (n // 2 + 1)), dtype=self.complex_dtype)
        out[:, xp.asarray(pos)] = vals
        return out.reshape(lead + (n, n // 2 + 1))


def relion_power_spectrum(data: Array, grid: PaddedGrid, xp: ArrayModule = np) -> Array:
    """RELION's radial power (`Projector.power_spectrum`) of a compact padded transform `data` on `grid`, or of each
    of a stack of them (…, *grid.shape) -> (…, N//2+1)."""
    n_shells = grid.size_px // 2 + 1
    lead = data.shape[: data.ndim - grid.ndim]
    power, count = xp.zeros(lead + (n_shells,)), xp.zeros(n_shells)
    for planes in grid.slabs():
        r2 = grid.radius2(xp, planes)
        shells = xp.where(r2 <= grid.r_max_padded ** 2, xp.rint(xp.sqrt(r2) / grid.padding_factor).astype(xp.int64),
                          n_shells)  # beyond R: dropped by shell_sum
        slab = data[(..., planes) + (slice(None),) * (grid.ndim - 1)]
        power += fourier.shell_sum((slab.real ** 2 + slab.imag ** 2).astype(xp.float64) / 2.0, shells, n_shells, xp)
        count += fourier.shell_sum(xp.ones(shells.shape), shells, n_shells, xp)
    return xp.where(count >= 1.0, power / xp.maximum(count, 1.0), 0.0)


class BackProjector(_OnPaddedGrid):
    """Padded Fourier sums of back-projected slices: `data` (complex) and `weight` (real).

    BackProjector(size_px, padding_factor=2, r_max_px=None, dtype=np.float64, xp=np, ndim=3)

    size_px is N of the map to reconstruct (with `ndim` 2: of a 2D reference, (N, N)); the compact
    arrays follow `PaddedGrid` (module docstring). Sums from several workers are combined by adding `data` and `weight`.
    `hermitian_enforced` is True once the sums' x = 0 plane has been made Hermitian (`symmetrise`
    does it, as RELION's does); `reconstruct` then does not do it again.
    """

    hermitian_enforced = False

    def __init__(self, size_px: int, padding_factor: float = 2.0, r_max_px: float | None = None,
                 dtype: npt.DTypeLike = np.float64, xp: ArrayModule = np, ndim: int = 3) -> None:
        self.xp = xp
        self.real_dtype = np.dtype(dtype).type
        self.complex_dtype = complex_dtype_for(dtype).type
        self.grid = PaddedGrid.create(size_px, padding_factor, r_max_px, ndim=ndim)
        self.data = xp.zeros(self.grid.shape, dtype=self.complex_dtype)
        self.weight = xp.zeros(self.grid.shape, dtype=self.real_dtype)

    @classmethod
    def from_arrays(cls, data: Array, weight: Array, size_px: int, padding_factor: float = 2.0,
                    r_max_px: float | None = None, xp: ArrayModule = np,
                    hermitian_enforced: bool = False) -> BackProjector:
        """A back-projector holding existing sums (`data`, `weight` of the grid's shape, 2D or 3D), not copied;
        `hermitian_enforced`: their x = 0 plane is already Hermitian (sums of symmetrised back-projectors)."""
        bp = cls.__new__(cls)
        bp.xp = xp
        bp.real_dtype = np.dtype(weight.dtype).type
        bp.complex_dtype = complex_dtype_for(weight.dtype).type
        bp.grid = PaddedGrid.create(size_px, padding_factor, r_max_px, ndim=data.ndim)
        if tuple(data.shape) != bp.grid.shape or tuple(weight.shape) != bp.grid.shape:
            raise ValueError(f"sums of shape {data.shape}/{weight.shape} do not match the grid {bp.grid.shape}")
        bp.data, bp.weight = data, weight
        bp.hermitian_enforced = bool(hermitian_enforced)
        return bp

    def zero(self) -> None:
        """Reset both sums to zero."""
        self.data[...] = 0
        self.weight[...] = 0

    def backproject(self, slices: Array, weights: Array | None, matrices: Array, r_max_px: float | None = None) -> None:
        """Splat slices (…, n, n//2+1) and their real weights into the padded sums.

        Each coefficient at image frequency (kx, ky), |k| ≤ min(r_max, n//2, back-projector
        r_max), is added at pf·Aᵀ(kx, ky, 0) with trilinear weights (complex conjugate at the
        mirrored point where x < 0), its weight likewise into `weight`. This is the adjoint of
        `Projector.project` on the data part. As in RELION, the kx = 0, ky < 0 half column
        (Friedel mates of kx = 0, ky > 0) is skipped, and coefficients with weight ≤ 0 are
        skipped in both sums. `weights` None means unit weights; it broadcasts against
        `slices` (e.g. CTF² of shape (n, n//2+1) or (…, n, n//2+1)).
        """
        xp = self.xp
        slices = xp.asarray(slices)
        n = slices.shape[-2]
        if slices.shape[-1] != n // 2 + 1:
            raise ValueError(f"slices must be half transforms (…, n, n//2+1), got {slices.shape}")
        if n > self.grid.size_px:
            raise ValueError(f"image size {n} is larger than the back-projector's box {self.grid.size_px}")
        mats = xp.asarray(matrices).reshape(-1, 3, 3)
        b = mats.shape[0]
        s = slices.reshape(b, n * (n // 2 + 1))
        if weights is None:
            wts = None
        else:
            wts = xp.broadcast_to(xp.asarray(weights), slices.shape).reshape(b, n * (n // 2 + 1))
        r = _effective_r_max(self.grid, n, r_max_px)
        pos, kx, ky = _slice_points(n, r * r, True)
        pos = xp.asarray(pos)
        if self.grid.ndim == 2:
            base, fx, fy, neg, inside = _slice_geometry_2d(self.grid, mats, kx, ky, self.real_dtype, xp)
            corners = _corners_2d(self.grid, fx.astype(xp.float64), fy.astype(xp.float64))
        else:
            base, fx, fy, fz, neg, inside = _slice_geometry(self.grid, mats, kx, ky, self.real_dtype, xp)
            corners = list(zip(_corner_offsets(self.grid),
                               _corner_weights(fx.astype(xp.float64), fy.astype(xp.float64), fz.astype(xp.float64))))
        vals = s[:, pos]
        vals = xp.where(neg, xp.conj(vals), vals)
        if wts is None:
            w = inside.astype(xp.float64)
        else:
            w = wts[:, pos].astype(xp.float64)
            inside = inside & (w > 0)
            w = xp.where(inside, w, 0.0)
        vals = xp.where(inside, vals, 0).astype(xp.complex128)
        idx = xp.concatenate([(base + o).reshape(-1) for o, _ in corners])
        cw = xp.concatenate([c.reshape(-1) for _, c in corners])
        vals8 = xp.tile(vals.reshape(-1), len(corners))
        w8 = xp.tile(w.reshape(-1), len(corners))
        size = int(np.prod(self.grid.shape))
        re = xp.bincount(idx, weights=cw * vals8.real, minlength=size)
        im = xp.bincount(idx, weights=cw * vals8.imag, minlength=size)
        ww = xp.bincount(idx, weights=cw * w8, minlength=size)
        self.data += (re + 1j * im).reshape(self.grid.shape).astype(self.complex_dtype)
        self.weight += ww.reshape(self.grid.shape).astype(self.real_dtype)

    def symmetrise(self, group: SymmetryGroup) -> None:
        """RELION's BackProjector::symmetrise for a point group, in place: the x = 0 plane made Hermitian
        (enforceHermitianSymmetry), then `data` and `weight` each replaced by the sum over the group's
        operators R of the sums at R k (applyPointGroupSymmetry, within the back-projector's r_max;
        `symmetry.symmetrise_padded_sums`). A group of order 1 changes nothing."""
        if group.order == 1:
            return
        if self.grid.ndim == 2:
            raise ValueError(f"a 2D reference has no point-group symmetry ({group.name} asked)")
        self.data[:, :, 0], self.weight[:, :, 0] = reconstruct.hermitian_plane(self.data, self.weight, self.xp)
        data, weight = symmetrise_padded_sums(self.data, self.weight, group, self.grid.r_max_padded, self.xp)
        self.data[...] = data
        self.weight[...] = weight
        self.hermitian_enforced = True

    def downsampled_average(self, divide: bool = True) -> Array:
        """RELION's getDownsampledAverage as an (N, N, N//2+1) half transform (FFTW layout).

        Padded sums are binned to the unpadded grid by rounding k/pf; with `divide` the binned
        data is divided by the binned weight (else by the count). Frequencies beyond r_max are
        zero. Use for the FSC between half sets (`fsc.fourier_shell_correlation`).
        """
        return reconstruct.downsampled_average(self.data, self.weight, self.grid, divide, self.xp)

    def noise_sigma2(self) -> Array:
        """Per-shell noise power of the reconstruction (N//2+1,), RELION's sigma2 (see reconstruct)."""
        return reconstruct.reconstruction_noise_sigma2(self.weight, self.grid, self.xp)

    def reconstruct(self, tau2: Array | None = None, tau2_fudge: float = 1.0, minres_map_px: int = 0,
                    enforce_hermitian: bool | None = None, mask_corners: bool = True) -> Array:
        """Real-space map (N, N, N) from the sums: see `reconstruct.reconstruct_volume`.

        data / (weight + 1/(pf³·tau2_fudge·tau2)) with tau2 per shell, or RELION's default
        data / max(weight, 1/1000 of the shell's mean weight) when tau2 is None; inverse FFT,
        window to N, soft mask outside radius N/2, divide by sinc². With unit weights and
        slices that are projections (normalised as `Projector.project`) of a map over
        many uniformly distributed poses, the result is that map. `enforce_hermitian` (default: unless
        `hermitian_enforced`) makes the x = 0 plane Hermitian first, on a copy of that plane.
        """
        if enforce_hermitian is None:
            enforce_hermitian = not self.hermitian_enforced
        if self.grid.ndim == 2:
            return reconstruct.reconstruct_image(self.data, self.weight, self.grid, tau2=tau2, tau2_fudge=tau2_fudge,
                                                 minres_map_px=minres_map_px, mask_corners=mask_corners, xp=self.xp)
        return reconstruct.reconstruct_volume(self.data, self.weight, self.grid, tau2=tau2, tau2_fudge=tau2_fudge,
                                              minres_map_px=minres_map_px, mask_corners=mask_corners,
                                              enforce_hermitian=enforce_hermitian, xp=self.xp)

"""The compact padded layout of 3D (or, for 2D references, 2D) half transforms that projectors and
back-projectors share (`PaddedGrid`), RELION's rounding and padded sizes, and the gridding kernel of
trilinear (bilinear in 2D) interpolation. See `cryorefine.core.projector` for the layout's conventions."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule


def relion_round(value: float) -> int:
    """RELION's ROUND: floor(x + 0.5) as a Python int (Python's round is banker's rounding)."""
    return int(np.floor(float(value) + 0.5))


def padded_size_px(size_px: int, padding_factor: float) -> int:
    """Size of the padded real-space box: round(padding_factor·N), made even (RELION)."""
    padded = relion_round(padding_factor * size_px)
    return padded + padded % 2


def map_slabs(size_px: int, ndim: int = 3) -> list[slice]:
    """Slices of the first axis of an N-sized 2D or 3D map covering it in slabs of about `SLAB_ELEMENTS` voxels,
    for loops whose float64 temporaries must stay bounded at any box size."""
    step = max(1, SLAB_ELEMENTS // (size_px ** (ndim - 1)))
    return [slice(z, min(size_px, z + step)) for z in range(0, size_px, step)]


def complex_dtype_for(real_dtype: npt.DTypeLike) -> np.dtype:
    """complex64 for float32, complex128 for float64."""
    return np.result_type(np.dtype(real_dtype), np.complex64)


#: compact elements per slab of the loops over a padded grid (`PaddedGrid.slabs`): with ~100 bytes of float64
#: temporaries per element, ~0.4 GB whatever the box
SLAB_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class PaddedGrid:
    """Geometry of a padded Fourier volume in RELION's compact layout.

    size_px:        N, the box size of the (unpadded) map in pixels.
    padded_size_px: Np = round(pf·N) made even; the padding factor in use is Np / N.
    r_max_px:       largest frequency kept, in Fourier pixels of the unpadded map (≤ N/2).
    ndim:           3 for a map (z, y, x), 2 for a 2D reference (y, x) (RELION's ref_dim): the arrays then
                    drop the z axis.
    """

    size_px: int
    padded_size_px: int
    r_max_px: int
    ndim: int = 3

    @classmethod
    def create(cls, size_px: int, padding_factor: float = 2.0, r_max_px: int | None = None,
               ndim: int = 3) -> PaddedGrid:
        size_px = int(size_px)
        r_max = size_px // 2 if r_max_px is None else int(r_max_px)
        r_max = max(1, min(r_max, size_px // 2))
        if ndim not in (2, 3):
            raise ValueError(f"a padded grid is 2D or 3D, not {ndim}D")
        return cls(size_px, padded_size_px(size_px, padding_factor), r_max, int(ndim))

    @property
    def padding_factor(self) -> float:
        return self.padded_size_px / self.size_px

    @property
    def r_max_padded(self) -> int:
        """R = round(r_max · pf): the radius of the stored sphere in padded Fourier pixels."""
        return relion_round(self.r_max_px * self.padding_factor)

    @property
    def origin(self) -> int:
        """Index of frequency 0 along the z and y axes of the compact arrays (R + 1)."""
        return self.r_max_padded + 1

    @property
    def shape(self) -> tuple[int, ...]:
        """(2R+3, 2R+3, R+2): RELION's pad_size = 2·(R+1)+1 on the z and y axes; (2R+3, R+2) in 2D."""
        d = 2 * self.r_max_padded + 3
        return (d,) * (self.ndim - 1) + (self.r_max_padded + 2,)

    def frequencies(self, xp: ArrayModule = np, planes: slice = slice(None),
                    rows: slice = slice(None)) -> tuple[Array, ...]:
        """Padded integer frequencies (z, y, x), each broadcastable to `shape` (to the z `planes` and y `rows`
        given, slices of the first two axes), as float64. In 2D (y, x), `planes` then slicing the y axis."""
        d, w = self.shape[0], self.shape[-1]
        k = xp.arange(d, dtype=xp.float64) - self.origin
        kx = xp.arange(w, dtype=xp.float64)
        if self.ndim == 2:
            return k[planes][:, None], kx[None, :]
        return k[planes][:, None, None], k[rows][None, :, None], kx[None, None, :]

    def radius2(self, xp: ArrayModule = np, planes: slice = slice(None), rows: slice = slice(None)) -> Array:
        """|k|² in padded Fourier pixels for every compact element (of the z `planes` and y `rows` given),
        float64."""
        return sum(k * k for k in self.frequencies(xp, planes, rows))

    def slabs(self, elements: int | None = None) -> list[slice]:
        """Slices of the first axis covering it in slabs of about `elements` compact elements (default
        `SLAB_ELEMENTS`), so that loops over the grid keep their temporaries bounded at any box size."""
        d = self.shape[0]
        per_plane = int(np.prod(self.shape[1:]))
        step = max(1, (elements or SLAB_ELEMENTS) // per_plane)
        return [slice(z, min(d, z + step)) for z in range(0, d, step)]


def trilinear_gridding_kernel(size_px: int, padded_size_px: int, xp: ArrayModule = np,
                              planes: slice = slice(None), ndim: int = 3) -> Array:
    """sinc²(r / Np) on the (N, N, N) map grid (r from N//2, 1 at r = 0), float64; only the z `planes`
    given (a slice of the first axis), for loops over slabs of a large map. With `ndim` 2, on the (N, N)
    grid of a 2D reference (bilinear interpolation), `planes` slicing its rows.

    Trilinear interpolation in the padded Fourier grid multiplies the map by (approximately)
    this function; RELION divides by it before the transform of a projector and after the
    inverse transform of a reconstruction (Projector::griddingCorrect).
    """
    if ndim == 2 and xp is np:
        return _host_gridding_kernel_2d(size_px, padded_size_px)[planes]
    k = xp.arange(size_px, dtype=xp.float64) - size_px // 2
    if ndim == 2:
        t = xp.sqrt(k[planes][:, None] ** 2 + k[None, :] ** 2) / float(padded_size_px)
        return xp.sinc(t) ** 2
    z = k[planes][:, None, None]
    t = xp.sqrt(z * z + k[None, :, None] ** 2 + k[None, None, :] ** 2) / float(padded_size_px)
    return xp.sinc(t) ** 2


@functools.lru_cache(maxsize=8)
def _host_gridding_kernel_2d(size_px: int, padded_size_px: int) -> np.ndarray:
    """`trilinear_gridding_kernel`'s (N, N) 2D kernel on the host, made once per size (a 2D job divides each class
    image by it every iteration), read-only."""
    k = np.arange(size_px, dtype=np.float64) - size_px // 2
    kernel = np.sinc(np.sqrt(k[:, None] ** 2 + k[None, :] ** 2) / float(padded_size_px)) ** 2
    kernel.flags.writeable = False
    return kernel

"""Real-space masks of references (RELION's solventFlatten and softMaskOutsideMap with a mask).

Masks are real maps (N, N, N) with values in [0, 1], centred at N//2 like the references: 1 on
the particle, 0 in the solvent, soft values between. Every function takes an array module `xp`
(numpy or cupy) and returns a new map.
"""

from __future__ import annotations

import numpy as np

from cryorefine.core.arrays import Array, ArrayModule

__all__ = ["flatten_to_mask_average", "solvent_flatten", "mask_from_map"]


def flatten_to_mask_average(volume: Array, mask: Array, xp: ArrayModule = np) -> Array:
    """The map with the region of `mask` replaced by its own mask-weighted average density (RELION's
    softMaskOutsideMap(vol, mask, invert_mask=true), as --solvent_mask2 uses it):
    (1 − m)·v + m·avg, avg = Σ m·v / Σ m. An all-zero mask leaves the map as it is."""
    volume = xp.asarray(volume, dtype=xp.float64)
    mask = xp.asarray(mask, dtype=xp.float64)
    total = float(mask.sum())
    if total <= 0:
        return volume
    average = float((mask * volume).sum()) / total
    return (1.0 - mask) * volume + mask * average


def solvent_flatten(volume: Array, mask: Array, mask2: Array | None = None, xp: ArrayModule = np) -> Array:
    """RELION's solventFlatten of one reference: the map times `mask` (the solvent mask, or the soft sphere
    of the particle diameter), then, with `mask2`, the region of mask2 set to its own average density. In the
    map's precision (a float32 map stays float32: the maps of a large box are gigabytes)."""
    volume = xp.asarray(volume)
    out = volume * xp.asarray(mask, dtype=volume.dtype)
    if mask2 is not None:
        out = flatten_to_mask_average(out, mask2, xp)
    return out


def mask_from_map(volume: Array, threshold: float, extend_px: float = 0.0, soft_edge_px: float = 0.0,
                  step_px: float = 0.5, xp: ArrayModule = np) -> Array:
    """A soft mask from a map, as relion_mask_create makes one: 1 on the voxels at or above `threshold` and
    within `extend_px` of them, then a raised-cosine fall to 0 over `soft_edge_px`.

    Distances to the thresholded region are found in steps of `step_px` by growing it with balls (each a
    convolution, done with FFTs), so a voxel's distance is known to within a step.
    """
    volume = xp.asarray(volume, dtype=xp.float64)
    n = volume.shape[-1]
    region = (volume >= threshold).astype(xp.float64)
    out = region.copy()
    reach = float(extend_px) + float(soft_edge_px)
    if reach <= 0:
        return out
    ft_region = xp.fft.rfftn(xp.fft.ifftshift(region))
    c = n // 2
    z, y, x = xp.mgrid[:n, :n, :n]
    r = xp.sqrt((x - c) ** 2.0 + (y - c) ** 2.0 + (z - c) ** 2.0)
    distance = xp.where(region > 0, 0.0, xp.inf)
    for d in np.arange(step_px, reach + step_px / 2, step_px):
        ball = xp.fft.rfftn(xp.fft.ifftshift((r <= d).astype(xp.float64)))
        reached = xp.fft.fftshift(xp.fft.irfftn(ft_region * ball, s=volume.shape, axes=(0, 1, 2))) > 0.5
        distance = xp.where(reached & ~xp.isfinite(distance), float(d), distance)
    if soft_edge_px > 0:
        t = xp.clip((distance - extend_px) / soft_edge_px, 0.0, 1.0)
        out = xp.where(xp.isfinite(distance), 0.5 + 0.5 * xp.cos(np.pi * t), 0.0)
    else:
        out = (distance <= extend_px).astype(xp.float64)
    return out

"""RELION's solvent flattening of references: the mask product and the second mask's region at its average."""

import numpy as np

from cryorefine.core import fourier
from cryorefine.core.masks import flatten_to_mask_average, solvent_flatten

N = 24


def test_the_region_of_a_binary_second_mask_becomes_its_mean_and_the_rest_is_untouched():
    rng = np.random.default_rng(0)
    vol = rng.standard_normal((N,) * 3) + 2.0
    region = fourier.soft_spherical_mask(N, 5.0, 0.0) > 0.5
    out = flatten_to_mask_average(vol, region.astype(float))
    assert np.allclose(out[region], vol[region].mean())
    assert np.array_equal(out[~region], vol[~region])


def test_a_soft_second_mask_blends_towards_the_weighted_mean():
    rng = np.random.default_rng(1)
    vol = rng.standard_normal((N,) * 3)
    soft = fourier.soft_spherical_mask(N, 4.0, 4.0)
    out = flatten_to_mask_average(vol, soft)
    mean = np.sum(soft * vol) / np.sum(soft)
    edge = (soft > 0.2) & (soft < 0.8)
    # halfway up the edge, the value lies between the voxel's own and the weighted mean
    lo, hi = np.minimum(vol[edge], mean), np.maximum(vol[edge], mean)
    assert np.all((out[edge] >= lo - 1e-12) & (out[edge] <= hi + 1e-12))
    assert np.allclose(out[soft == 0], vol[soft == 0])
    assert np.allclose(out[soft == 1], mean)


def test_solvent_flatten_multiplies_then_flattens():
    rng = np.random.default_rng(2)
    vol = rng.standard_normal((N,) * 3)
    mask = fourier.soft_spherical_mask(N, 8.0, 3.0)
    assert np.allclose(solvent_flatten(vol, mask), vol * mask)
    inner = (fourier.soft_spherical_mask(N, 3.0, 0.0) > 0.5).astype(float)
    out = solvent_flatten(vol, mask, inner)
    assert np.allclose(out[inner == 1], (vol * mask)[inner == 1].mean())
    assert np.allclose(flatten_to_mask_average(vol, np.zeros_like(vol)), vol)  # an empty region changes nothing


def test_a_mask_from_a_map_covers_it_grows_by_the_extension_and_falls_off_softly():
    from cryorefine.core.masks import mask_from_map

    n = 32
    c = n // 2
    z, y, x = np.mgrid[:n, :n, :n] - c
    r = np.sqrt(x ** 2 + y ** 2 + z ** 2)
    blob = np.exp(-(r / 5.0) ** 2)  # ≥ 0.5 up to r = 5·sqrt(ln 2) ≈ 4.16
    mask = mask_from_map(blob, 0.5, extend_px=2.0, soft_edge_px=3.0)
    assert mask.min() >= 0.0 and mask.max() <= 1.0
    assert np.all(mask[r <= 4.16 + 2.0 - 0.6] == 1.0)  # the region and its extension (to within a step)
    assert np.all(mask[r >= 4.16 + 2.0 + 3.0 + 0.6] == 0.0)  # nothing beyond extension + edge
    edge = (r > 4.16 + 2.0 + 0.6) & (r < 4.16 + 5.0 - 1.5)  # the voxelised region is a little rough
    assert edge.sum() > 100 and np.all((mask[edge] > 0.0) & (mask[edge] < 1.0))
    # along a radius the edge falls monotonically
    line = mask[c, c, c:]
    assert np.all(np.diff(line) <= 1e-12)
    assert np.array_equal(mask_from_map(blob, 0.5), (blob >= 0.5).astype(float))

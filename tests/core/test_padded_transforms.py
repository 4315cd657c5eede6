"""The M-step's slab-wise transforms and reconstruction against whole-box computations written out here."""

import numpy as np
import pytest

import cryorefine.core.grid as grid_module
from cryorefine.core import fourier, reconstruct
from cryorefine.core.fsc import fourier_shell_correlation
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.padded_transforms import padded_forward, padded_inverse_window
from cryorefine.core.projector import BackProjector
from cryorefine.em import mstep
from cryorefine.em.state import ModelState

GRIDS = [(16, 2.0, None), (15, 2.0, None), (16, 2.0, 5), (17, 1.0, None), (16, 1.0, None), (20, 3.0, 7)]


def _padded_box(volume, npad):
    n = volume.shape[0]
    box = np.zeros((npad,) * 3)
    s = npad // 2 - n // 2
    box[s:s + n, s:s + n, s:s + n] = volume
    return box, s


@pytest.mark.parametrize("n,pf,r_max", GRIDS)
def test_padded_forward_is_the_transform_of_the_zero_padded_box(n, pf, r_max):
    volume = np.random.default_rng(n).normal(size=(n, n, n))
    grid = PaddedGrid.create(n, pf, r_max)
    npad = grid.padded_size_px
    ft = np.fft.rfftn(np.fft.ifftshift(_padded_box(volume, npad)[0])) / n ** 2
    d, _, w = grid.shape
    k = np.arange(d) - grid.origin
    want = ft[(k % npad)[:, None, None], (k % npad)[None, :, None], np.minimum(np.arange(w), npad // 2)[None, None, :]]
    want[grid.radius2() > grid.r_max_padded ** 2] = 0
    got = padded_forward(volume, grid, elements=97)  # many slabs of both stages
    np.testing.assert_allclose(got, want, atol=1e-12 * np.abs(want).max())
    single = padded_forward(volume.astype(np.float32), grid)
    assert single.dtype == np.complex64
    np.testing.assert_allclose(single, want, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("n,pf,r_max", GRIDS)
def test_padded_inverse_window_is_the_middle_of_the_inverse_transform(n, pf, r_max):
    grid = PaddedGrid.create(n, pf, r_max)
    npad = grid.padded_size_px
    box = np.random.default_rng(n + 1).normal(size=(npad,) * 3)
    ft = np.fft.rfftn(box)
    if r_max is not None:  # only |k| ≤ R non-zero: the transform skips the other rows and columns
        kz, ky, kx = fourier.frequencies_3d(npad)
        ft[np.maximum(np.abs(kz), np.abs(ky)) > grid.r_max_padded] = 0
        ft[kx > grid.r_max_padded] = 0
    want_box = np.fft.fftshift(np.fft.irfftn(ft, s=(npad,) * 3, axes=(0, 1, 2))) * npad ** 3
    s = npad // 2 - n // 2
    got = padded_inverse_window(ft.copy(), n, r_max_padded=grid.r_max_padded if r_max else None, elements=97)
    np.testing.assert_allclose(got, want_box[s:s + n, s:s + n, s:s + n], atol=1e-9 * np.abs(want_box).max())


def _sums(grid, seed):
    rng = np.random.default_rng(seed)
    data = rng.normal(size=grid.shape) + 1j * rng.normal(size=grid.shape)
    weight = rng.uniform(0.0, 2.0, size=grid.shape)
    weight[rng.uniform(size=grid.shape) < 0.1] = 0.0
    return data, weight


@pytest.mark.parametrize("n,pf,r_max", GRIDS)
def test_reconstruction_in_slabs_matches_one_slab(monkeypatch, n, pf, r_max):
    grid = PaddedGrid.create(n, pf, r_max)
    data, weight = _sums(grid, n)
    tau2 = np.random.default_rng(2).uniform(0.1, 3.0, n // 2 + 1)
    tau2[3] = 0.0  # RELION's 1/(0.001·weight) branch
    whole = {t: reconstruct.reconstruct_volume(data, weight, grid, tau2=None if t else tau2, tau2_fudge=1.5,
                                               minres_map_px=2) for t in (True, False)}
    sigma2 = reconstruct.reconstruction_noise_sigma2(weight, grid)
    monkeypatch.setattr(grid_module, "SLAB_ELEMENTS", 150)
    assert len(grid.slabs()) > 3
    for plain, want in whole.items():
        got = reconstruct.reconstruct_volume(data, weight, grid, tau2=None if plain else tau2, tau2_fudge=1.5,
                                             minres_map_px=2)
        np.testing.assert_allclose(got, want, atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(reconstruct.reconstruction_noise_sigma2(weight, grid), sigma2, rtol=1e-12)


def test_hermitian_plane_on_the_fly_is_the_hermitian_copy():
    grid = PaddedGrid.create(16, 2.0)
    data, weight = _sums(grid, 3)
    want = reconstruct.reconstruct_volume(*reconstruct.enforce_hermitian_symmetry(data, weight), grid)
    before = data.copy()
    got = reconstruct.reconstruct_volume(data, weight, grid, enforce_hermitian=True)
    np.testing.assert_allclose(got, want, atol=1e-12 * np.abs(want).max())
    assert np.array_equal(data, before)  # the sums are not changed
    assert not np.allclose(reconstruct.reconstruct_volume(data, weight, grid), want, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("n,pf,r_max", GRIDS)
def test_half_sets_fsc_is_the_fsc_of_the_downsampled_averages(n, pf, r_max):
    grid = PaddedGrid.create(n, pf, r_max)
    data, weight = _sums(grid, n)
    data2 = data + _sums(grid, n + 7)[0]
    whole = [reconstruct.downsampled_average(d, weight, grid) for d in (data, data2)]
    want = fourier_shell_correlation(*whole)
    np.testing.assert_allclose(reconstruct.half_sets_fsc((data, weight), (data2, weight), grid), want, atol=1e-12)
    # a half that has left the device gives its average made whole before: the same FSC
    np.testing.assert_array_equal(reconstruct.half_sets_fsc(whole[0], (data2, weight), grid),
                                  reconstruct.half_sets_fsc((data, weight), (data2, weight), grid))
    # and so does the second half's average, made by another process
    np.testing.assert_array_equal(reconstruct.half_sets_fsc((data, weight), whole[1], grid),
                                  reconstruct.half_sets_fsc((data, weight), (data2, weight), grid))
    # cropped to where it can be non-zero, it gives every plane of the whole, and the same FSC
    cropped = reconstruct.CroppedAverage(data2, weight, grid)
    np.testing.assert_array_equal(cropped[np.arange(n)], whole[1])
    if 2 * grid.r_max_px + 1 < n:  # below the box's Nyquist: smaller than the whole
        assert cropped.cube.size < whole[1].size
    np.testing.assert_array_equal(reconstruct.half_sets_fsc((data, weight), cropped, grid),
                                  reconstruct.half_sets_fsc((data, weight), (data2, weight), grid))
    # the same planes, in small runs
    planes = np.zeros_like(whole[0])
    for kz, block in reconstruct.downsampled_average_planes(data, weight, grid, elements=100):
        assert not planes[kz % n].any()  # each plane once
        planes[kz % n] = block
    np.testing.assert_array_equal(planes, whole[0])


@pytest.mark.parametrize("current_resolution, radius_padded", [
    (np.inf, 8),  # RELION: ceil(16 px · 2 Å / 10 Å) = ceil(3.2) = 4 shells, padded round(2 · 4) = 8
    (5.0, 8),  # a finer current resolution leaves --low_resol_join_halves's 10 Å
    (12.5, 6),  # a coarser one limits the join: ceil(32 / 12.5) = ceil(2.56) = 3 shells, padded 6
])
def test_join_halves_averages_the_low_frequencies_as_relion(current_resolution, radius_padded):
    """RELION's joinTwoHalvesAtLowResolution: lowres_r_max = CEIL(N·pixel / max(join, current resolution)), the
    padded frequencies with |k|² ≤ ROUND(pf · lowres_r_max)² set to the average of the two halves."""
    n = 16
    model = ModelState(ori_size_px=n, pixel_size_angstrom=2.0, current_resolution_angstrom=current_resolution)
    grid = PaddedGrid.create(n, 2.0)
    bps = [BackProjector.from_arrays(*_sums(grid, seed), n, 2.0) for seed in (1, 2)]
    before = [(bp.data.copy(), bp.weight.copy()) for bp in bps]
    low_sums = [mstep.low_resolution_sums(bp, 10.0, model) for bp in bps]
    for bp in bps:
        mstep.join_at_low_resolution(bp, mstep.averaged_low_resolution_sums(*low_sums), 10.0, model)
    low = grid.radius2() <= radius_padded ** 2
    assert 50 < low.sum() < low.size // 10
    for bp, (d, w) in zip(bps, before):
        np.testing.assert_array_equal(bp.data[~low], d[~low])
        np.testing.assert_array_equal(bp.weight[~low], w[~low])
        np.testing.assert_allclose(bp.data[low], 0.5 * (before[0][0][low] + before[1][0][low]))
        np.testing.assert_allclose(bp.weight[low], 0.5 * (before[0][1][low] + before[1][1][low]))


@pytest.mark.gpu
def test_device_transforms_in_float32_match_the_host():
    from conftest import cupy_or_skip

    cp = cupy_or_skip()
    for n, pf, r_max in GRIDS:
        grid = PaddedGrid.create(n, pf, r_max)
        volume = np.random.default_rng(n).normal(size=(n, n, n))
        want = padded_forward(volume, grid)
        got = padded_forward(cp.asarray(volume, dtype=cp.float32), grid, cp, elements=97)
        assert got.dtype == cp.complex64
        np.testing.assert_allclose(cp.asnumpy(got), want, atol=1e-5 * np.abs(want).max())
        data, weight = _sums(grid, n)
        want = reconstruct.reconstruct_volume(data, weight, grid, tau2=np.ones(n // 2 + 1), minres_map_px=2)
        got = reconstruct.reconstruct_volume(cp.asarray(data, dtype=cp.complex64), cp.asarray(weight, cp.float32),
                                             grid, tau2=np.ones(n // 2 + 1), minres_map_px=2, xp=cp)
        assert got.dtype == cp.float32
        np.testing.assert_allclose(cp.asnumpy(got), want, atol=1e-5 * np.abs(want).max())

"""The shared conventions: half transforms, shifts, windows, shells, Euler angles."""

import numpy as np
import pytest

from cryorefine.core import euler, fourier


def test_round_trip_and_normalisation():
    rng = np.random.default_rng(0)
    img = rng.normal(size=(3, 10, 10))
    ft = fourier.rfft2_centered(img)
    np.testing.assert_allclose(ft[:, 0, 0], img.mean(axis=(-2, -1)))  # forward divides by N²
    np.testing.assert_allclose(fourier.irfft2_centered(ft, 10), img, atol=1e-12)
    vol = rng.normal(size=(8, 8, 8))
    np.testing.assert_allclose(fourier.irfft3_centered(fourier.rfft3_centered(vol), 8), vol, atol=1e-12)


def test_centre_is_the_phase_origin():
    img = np.zeros((9, 9))
    img[4, 4] = 1.0  # a delta at N//2 has a real, flat transform
    ft = fourier.rfft2_centered(img)
    np.testing.assert_allclose(ft, np.full(ft.shape, 1 / 81), atol=1e-15)


@pytest.mark.parametrize("n", [8, 9])
def test_shift_moves_content_towards_positive(n):
    img = np.zeros((n, n))
    img[n // 2, n // 2] = 1.0
    moved = fourier.irfft2_centered(fourier.phase_shift_2d(fourier.rfft2_centered(img), 2, -1, n), n)
    y, x = np.unravel_index(moved.argmax(), moved.shape)
    assert (x - n // 2, y - n // 2) == (2, -1)


def test_nyquist_row_is_positive_like_relion():
    assert list(fourier.signed_frequencies(6)) == [0, 1, 2, 3, -2, -1]
    assert list(fourier.signed_frequencies(5)) == [0, 1, 2, -2, -1]
    ky, kx = fourier.frequencies_2d(6)
    assert ky[3, 0] == 3 and kx[0, -1] == 3


def test_window_keeps_matching_frequencies_and_round_trips():
    rng = np.random.default_rng(1)
    img = rng.normal(size=(16, 16))
    ft = fourier.rfft2_centered(img)
    small = fourier.window_ft_2d(ft, 8)
    ky_big, ky_small = list(fourier.signed_frequencies(16)), fourier.signed_frequencies(8)
    for row, k in enumerate(ky_small):
        np.testing.assert_array_equal(small[row], ft[ky_big.index(k), :5])
    back = fourier.window_ft_2d(small, 16)
    np.testing.assert_array_equal(fourier.window_ft_2d(back, 8), small)


def test_power_spectrum_obeys_parseval():
    rng = np.random.default_rng(2)
    img = rng.normal(size=(32, 32))
    ft = fourier.rfft2_centered(img)
    mult = fourier.hermitian_weights_2d(32)
    total = (np.abs(ft) ** 2 * mult).sum()
    assert total == pytest.approx((img ** 2).mean(), rel=1e-10)  # Parseval with 1/N² normalisation
    spectrum = fourier.power_spectrum_2d(ft)
    assert spectrum.shape == (17,)
    # white noise: flat spectrum at σ²/N² away from the lowest shells
    assert np.median(spectrum[4:]) == pytest.approx(1 / 32 ** 2, rel=0.25)


def test_shell_sum_counts_coefficients():
    shells = fourier.shell_index_2d(16)
    counts = fourier.shell_sum(np.ones((2,) + shells.shape), shells, 9)
    assert counts.shape == (2, 9)
    radius = fourier.radius_2d(16)
    for s in range(9):
        assert counts[0, s] == (np.rint(radius) == s).sum()


def test_soft_mask_edges():
    mask = fourier.soft_circular_mask(32, radius_px=10, edge_px=4)
    assert mask[16, 16] == 1.0 and mask[16, 16 + 10] == 1.0
    assert mask[16, 16 + 12] == pytest.approx(0.5)
    assert mask[16, 16 + 15] == 0.0 and mask[0, 0] == 0.0


def test_euler_matrices_are_rotations_and_round_trip():
    rng = np.random.default_rng(3)
    rot, tilt, psi = rng.uniform(-180, 180, 500), rng.uniform(0.5, 179.5, 500), rng.uniform(-180, 180, 500)
    m = euler.euler_to_matrix(rot, tilt, psi)
    np.testing.assert_allclose(m @ np.swapaxes(m, -1, -2), np.broadcast_to(np.eye(3), m.shape), atol=1e-12)
    np.testing.assert_allclose(np.linalg.det(m), 1.0, atol=1e-12)
    r2, t2, p2 = euler.matrix_to_euler(m)
    np.testing.assert_allclose(t2, tilt, atol=1e-9)
    np.testing.assert_allclose(np.cos(np.deg2rad(r2 - rot)), 1.0, atol=1e-9)
    np.testing.assert_allclose(np.cos(np.deg2rad(p2 - psi)), 1.0, atol=1e-9)


def test_euler_degenerate_tilts():
    for tilt in (0.0, 180.0):
        m = euler.euler_to_matrix(30.0, tilt, 50.0)
        np.testing.assert_allclose(euler.euler_to_matrix(*euler.matrix_to_euler(m)), m, atol=1e-12)


def test_euler_matches_relion_zyz_composition():
    """A = Rz(psi)·Ry(tilt)·Rz(rot) with RELION's passive-rotation signs."""

    def rz(a):
        c, s = np.cos(np.deg2rad(a)), np.sin(np.deg2rad(a))
        return np.array([[c, s, 0], [-s, c, 0], [0, 0, 1]])

    def ry(a):
        c, s = np.cos(np.deg2rad(a)), np.sin(np.deg2rad(a))
        return np.array([[c, 0, -s], [0, 1, 0], [s, 0, c]])

    rot, tilt, psi = 23.0, 61.0, -117.0
    np.testing.assert_allclose(euler.euler_to_matrix(rot, tilt, psi), rz(psi) @ ry(tilt) @ rz(rot), atol=1e-12)
    # the projection direction (third row) points along (rot, tilt) on the sphere
    d = euler.euler_to_matrix(rot, tilt, psi)[2]
    t, r = np.deg2rad(tilt), np.deg2rad(rot)
    np.testing.assert_allclose(d, [np.sin(t) * np.cos(r), np.sin(t) * np.sin(r), np.cos(t)], atol=1e-12)


def test_downsample_volume_keeps_the_low_frequencies():
    rng = np.random.default_rng(5)
    vol = rng.normal(size=(16, 16, 16))
    small = fourier.downsample_volume(vol, 8)
    assert small.shape == (8, 8, 8)
    assert small.mean() == pytest.approx(vol.mean())
    big_ft, small_ft = fourier.rfft3_centered(vol), fourier.rfft3_centered(small)
    k16, k8 = list(fourier.signed_frequencies(16)), fourier.signed_frequencies(8)
    for i, kz in enumerate(k8[:3]):  # rows away from the Nyquist planes match exactly
        for j, ky in enumerate(k8[:3]):
            np.testing.assert_allclose(small_ft[i, j, :3], big_ft[k16.index(kz), k16.index(ky), :3], atol=1e-12)


def test_resample_volume_pads_the_transform_and_crops_it_back():
    """RELION's resizeMap both ways: zero-padding the transform interpolates (the density scale kept, every
    frequency of the small map where it was), and cropping it back gives the map again."""
    rng = np.random.default_rng(6)
    vol = fourier.lowpass_band_limited(rng.normal(size=(16, 16, 16)), lambda r: (r < 6).astype(float), 6.0)
    big = fourier.resample_volume(vol, 24)
    assert big.shape == (24, 24, 24)
    assert big.mean() == pytest.approx(vol.mean())
    np.testing.assert_allclose(big[::3, ::3, ::3], vol[::2, ::2, ::2], atol=1e-12)  # the same points in space
    np.testing.assert_allclose(fourier.resample_volume(big, 16), vol, atol=1e-12)
    np.testing.assert_allclose(fourier.resample_volume(np.ones((10,) * 3), 14), np.ones((14,) * 3), atol=1e-12)


def test_window_volume_crops_and_pads_about_the_centre():
    vol = np.random.default_rng(7).normal(size=(10, 10, 10))
    padded = fourier.window_volume(vol, 16)
    assert padded[8, 8, 8] == vol[5, 5, 5]  # centre N//2 to box//2
    np.testing.assert_array_equal(padded[3:13, 3:13, 3:13], vol)
    assert padded.sum() == pytest.approx(vol.sum())
    np.testing.assert_array_equal(fourier.window_volume(padded, 10), vol)
    np.testing.assert_array_equal(fourier.window_volume(vol, 6), vol[2:8, 2:8, 2:8])


@pytest.mark.parametrize("size", [32, 33, 48, 97])
@pytest.mark.parametrize("r_max", [1.0, 3.5, 5.9, 9.0, 15.2, 24.0])
def test_the_band_limited_lowpass_is_the_whole_transforms_filter(size, r_max):
    """lowpass_band_limited transforms over the band alone; it gives what filtering the whole transform gives, for
    even and odd boxes, bands of a shell up to ones that reach Nyquist (the whole transforms then), by matrix
    products where the band is narrow (1/DFT_BAND_FRACTION of the box or less) and by FFTs beyond."""
    volume = np.random.default_rng(size).standard_normal((size,) * 3)
    gain = lambda r: fourier.raised_cosine(r, r_max - 1.0, 1.0)  # noqa: E731 — 0 beyond r_max
    want = fourier.irfft3_centered(fourier.rfft3_centered(volume) * gain(fourier.radius_3d(size)), size)
    got = fourier.lowpass_band_limited(volume, gain, r_max)
    assert got.shape == volume.shape and got.dtype == want.dtype
    if int(r_max) < size // 2 - 1:  # a float32 volume stays float32 over a band, by products as by FFTs
        assert fourier.lowpass_band_limited(volume.astype(np.float32), gain, r_max).dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())

"""FSC, resolution at a threshold and tau² from the FSC, against closed-form expectations."""

import numpy as np
import pytest

from cryorefine.core import fourier
from cryorefine.core.fsc import (
    fourier_shell_correlation,
    fsc_volumes,
    resolution_at_threshold,
    ssnr_from_fsc,
    tau2_from_fsc,
)

N = 40
N_SHELLS = N // 2 + 1


def shell_counts(size_px):
    return fourier.shell_sum(np.ones((size_px, size_px, size_px // 2 + 1)), fourier.shell_index_3d(size_px),
                             size_px // 2 + 1)


def test_fsc_of_a_map_with_itself_is_one():
    rng = np.random.default_rng(0)
    vol = rng.standard_normal((N,) * 3) + 0.3
    curve = fsc_volumes(vol, vol)
    assert curve.shape == (N_SHELLS,)
    assert np.allclose(curve, 1.0, atol=1e-12)
    # Scaling one map does not change the FSC; shell 0 is a real correlation when asked for.
    raw = fsc_volumes(vol, 3.0 * vol, set_shell0_to_one=False)
    assert np.allclose(raw, 1.0, atol=1e-12)
    assert fsc_volumes(vol, -vol, set_shell0_to_one=False)[0] == pytest.approx(-1.0)


def test_fsc_of_independent_noise_is_near_zero():
    rng = np.random.default_rng(1)
    curve = fsc_volumes(rng.standard_normal((N,) * 3), rng.standard_normal((N,) * 3))
    counts = shell_counts(N)
    # Standard deviation of a shell's FSC for independent maps ≈ 1/sqrt(coefficients).
    assert np.all(np.abs(curve[2:]) < 5.0 / np.sqrt(counts[2:]))
    assert abs(curve[2:].mean()) < 0.02
    assert curve[0] == 1.0


def test_fsc_matches_snr_theory():
    """Two maps = common signal + independent noise with SNR(k) per shell: FSC ≈ SNR/(1+SNR).

    SNR(k) = 10·exp(−k/3), from 10 to 0.01. Per shell within 5 standard errors
    ((1−ρ²)/sqrt(n)), and the mean deviation over shells 2…20 within 0.01.
    """
    rng = np.random.default_rng(2)
    k = fourier.radius_3d(N)
    shells = np.arange(N_SHELLS)
    snr = 10.0 * np.exp(-shells / 3.0)
    snr_at = 10.0 * np.exp(-k / 3.0)
    signal = fourier.rfft3_centered(rng.standard_normal((N,) * 3)) * np.sqrt(snr_at)
    halves = []
    for _ in range(2):
        noise = fourier.rfft3_centered(rng.standard_normal((N,) * 3))
        halves.append(fourier.irfft3_centered(signal + noise, N))
    curve = fsc_volumes(*halves)
    theory = snr / (1.0 + snr)
    se = (1.0 - theory ** 2) / np.sqrt(shell_counts(N))
    dev = curve - theory
    assert np.all(np.abs(dev[2:]) < 5.0 * se[2:] + 0.005), np.round(dev, 3)
    assert abs(dev[2:].mean()) < 0.01
    # The same on the transforms directly.
    direct = fourier_shell_correlation(fourier.rfft3_centered(halves[0]), fourier.rfft3_centered(halves[1]))
    assert np.allclose(direct, curve)


def test_frc_for_2d_half_transforms():
    rng = np.random.default_rng(3)
    img = rng.standard_normal((32, 32))
    ft = fourier.rfft2_centered(img)
    assert np.allclose(fourier_shell_correlation(ft, 2 * ft), 1.0)
    other = fourier.rfft2_centered(rng.standard_normal((32, 32)))
    frc = fourier_shell_correlation(ft, other)
    assert frc.shape == (17,) and np.abs(frc[3:]).max() < 0.5
    with pytest.raises(ValueError):
        fourier_shell_correlation(ft, ft[:, :-1])


CURVE = np.array([1.0, 0.99, 0.95, 0.9, 0.8, 0.6, 0.4, 0.2, 0.15, 0.1, 0.2, 0.05, 0.0, -0.02, 0.01, 0.0, 0.0])


def test_resolution_first_crossing():
    # 64 px, 1.5 Å/px: first value below 0.143 at shell 9 (the rise at 10 is ignored),
    # so the last shell above is 8: 64·1.5/8 = 12 Å.
    assert resolution_at_threshold(CURVE, 64, 1.5) == pytest.approx(12.0)
    # FSC 0.5: first below at shell 6 -> shell 5 -> 19.2 Å.
    assert resolution_at_threshold(CURVE, 64, 1.5, threshold=0.5) == pytest.approx(19.2)
    # Linear crossing between shell 8 (0.15) and 9 (0.10): 8 + 0.007/0.05 = 8.14.
    assert resolution_at_threshold(CURVE, 64, 1.5, interpolate=True) == pytest.approx(96.0 / 8.14)


def test_resolution_edge_cases():
    # Never below: the last shell (Nyquist, 2 pixels) is reported.
    assert resolution_at_threshold(np.full(33, 0.9), 64, 1.5) == pytest.approx(3.0)
    # Below from shell 1 on: no resolution.
    assert resolution_at_threshold([1.0, 0.1, 0.5], 64, 1.5) == float("inf")


def test_tau2_from_fsc():
    fsc = np.array([1.0, 0.5, 0.8, 0.0, -0.3])
    sigma2 = np.full(5, 2.0)
    tau2 = tau2_from_fsc(fsc, sigma2, tau2_fudge=2.0)
    # ssnr = fsc/(1−fsc)·fudge with fsc clipped to [0.001, 0.999]; tau2 = ssnr·σ².
    expected = np.array([0.999 / 0.001, 1.0, 4.0, 0.001 / 0.999, 0.001 / 0.999]) * 2.0 * 2.0
    assert np.allclose(tau2, expected)
    # Halves joined: fsc -> sqrt(2·fsc/(fsc+1)); 1/3 -> sqrt(1/2).
    r = np.sqrt(0.5)
    assert ssnr_from_fsc(np.array([1.0 / 3.0]), whole_instead_of_half=True)[0] == pytest.approx(r / (1 - r))

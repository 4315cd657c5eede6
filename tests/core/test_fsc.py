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


# ------------------------------------------------------------------ solvent-corrected FSC (phase randomisation)

from cryorefine.core.fsc import (  # noqa: E402
    correct_for_mask,
    first_shell_below,
    randomise_phases_beyond,
    solvent_corrected_fsc,
)


def ball(size_px, radius_px, edge_px=0.0):
    return fourier.soft_spherical_mask(size_px, radius_px, edge_px)


def lowpass(volume, shells):
    ft = fourier.rfft3_centered(volume)
    return fourier.irfft3_centered(ft * (fourier.radius_3d(volume.shape[0]) < shells), volume.shape[0])


def test_randomised_phases_keep_amplitudes_and_the_low_shells():
    rng = np.random.default_rng(4)
    vol = rng.standard_normal((N,) * 3)
    out = randomise_phases_beyond(vol, 6, np.random.default_rng(0))
    ft, ft_out = fourier.rfft3_centered(vol), fourier.rfft3_centered(out)
    r = fourier.radius_3d(N)
    low, high = r < 6, r >= 6
    assert np.allclose(ft_out[low], ft[low])
    # Amplitudes beyond: kept, except on the x = 0 and Nyquist planes, which the real transform makes Hermitian
    inner = high.copy()
    inner[..., 0] = inner[..., -1] = False
    assert np.allclose(np.abs(ft_out[inner]), np.abs(ft[inner]))
    # ... and the phases are new: no correlation with the original beyond the shell
    assert np.all(np.abs(fsc_volumes(vol, out)[8:]) < 5.0 / np.sqrt(shell_counts(N)[8:]))
    # the same generator state gives the same map
    assert np.array_equal(out, randomise_phases_beyond(vol, 6, np.random.default_rng(0)))


def test_first_shell_below_a_threshold():
    assert first_shell_below(CURVE, 0.8) == 5  # 0.8 at shell 4 is not below
    assert first_shell_below(CURVE, 0.143) == 9
    assert first_shell_below(np.ones(10), 0.8) == -1
    assert first_shell_below([0.5, 0.9, 0.85], 0.8) == -1  # shell 0 does not count


def test_correction_formula_by_hand():
    masked = np.array([1.0, 0.95, 0.9, 0.7, 0.5, 0.4, 0.3, 0.2])
    random = np.array([1.0, 0.9, 0.8, 0.6, 0.2, 0.5, 0.1, 0.2])
    out = correct_for_mask(masked, random, 2)
    # shells 0 … 3 (< 2 + 2): the masked FSC itself
    assert np.array_equal(out[:4], masked[:4])
    # (0.5 − 0.2)/(1 − 0.2) = 0.375; random above masked -> 0; (0.3 − 0.1)/0.9; equal -> 0
    assert out[4:] == pytest.approx([0.375, 0.0, 0.2 / 0.9, 0.0])


def test_a_sharp_mask_inflates_the_fsc_and_the_correction_removes_it():
    """Halves = common signal below shell 6 + independent noise; a hard-edged mask spreads the common signal
    into high shells, so the masked FSC there is far above 0; the corrected FSC is near 0 again."""
    rng = np.random.default_rng(5)
    signal = 20.0 * lowpass(rng.standard_normal((N,) * 3), 6)
    halves = [signal + rng.standard_normal((N,) * 3) for _ in range(2)]
    mask = ball(N, 8.0)  # binary sphere: the sharpest edge
    curves = solvent_corrected_fsc(halves[0], halves[1], mask, np.random.default_rng(1))
    assert curves.randomise_from_shell == first_shell_below(curves.unmasked, 0.8)
    assert 4 <= curves.randomise_from_shell <= 8
    beyond = slice(curves.randomise_from_shell + 4, N // 2 + 1)
    assert curves.masked[beyond].mean() > 0.1  # the mask's artefact this test is about
    assert abs(curves.corrected[beyond].mean()) < 0.03
    assert np.all(curves.corrected[beyond] < 0.15)
    # below the randomisation shell the masked curve is kept
    assert np.array_equal(curves.corrected[1:curves.randomise_from_shell + 2],
                          curves.masked[1:curves.randomise_from_shell + 2])


def test_a_soft_mask_around_a_small_particle_raises_the_fsc_towards_the_truth():
    """A particle filling a small ball of a big box, with noise in the whole box: the noise outside the
    particle lowers the unmasked FSC; masked to the particle (soft edge), the corrected FSC is close to the
    FSC that the particle region itself has, and well above the unmasked one."""
    n = 48
    rng = np.random.default_rng(6)
    particle = ball(n, 9.0, 3.0)
    signal = 0.9 * rng.standard_normal((n,) * 3) * particle
    halves = [signal + rng.standard_normal((n,) * 3) for _ in range(2)]
    curves = solvent_corrected_fsc(halves[0], halves[1], particle, np.random.default_rng(2))
    # the truth inside the particle: FSC of the halves with the noise restricted to the particle's region
    inside = [signal + rng.standard_normal((n,) * 3) * particle for _ in range(2)]
    truth = fsc_volumes(*inside)
    shells = slice(8, n // 2 - 2)  # enough coefficients per shell for the curves to be steady
    assert curves.unmasked[shells].mean() < 0.1  # the box's noise hides the particle ...
    assert curves.corrected[shells].mean() > curves.unmasked[shells].mean() + 0.3  # ... the mask finds it again
    assert abs(curves.corrected[shells].mean() - truth[shells].mean()) < 0.05


def test_without_a_drop_below_08_the_unmasked_fsc_is_used():
    rng = np.random.default_rng(7)
    vol = rng.standard_normal((24,) * 3)
    curves = solvent_corrected_fsc(vol, vol + 1e-3 * rng.standard_normal((24,) * 3), ball(24, 8.0, 2.0),
                                   np.random.default_rng(0))
    assert curves.randomise_from_shell == -1
    assert np.array_equal(curves.corrected, curves.unmasked)

"""Fourier shell correlation, resolution at a threshold, and RELION's tau² from the FSC.

Shells are round(|k|) in Fourier pixels of the box (k integer, in units of 1/(N·pixel size)).
Sums run over the coefficients of the half transforms as stored, without Hermitian weighting,
as RELION's getFSC does. Every function takes an array module `xp` (numpy or cupy).
"""

from __future__ import annotations

import numpy as np

from cryorefine.core import fourier

__all__ = [
    "shell_correlation",
    "fourier_shell_correlation",
    "fsc_volumes",
    "resolution_at_threshold",
    "ssnr_from_fsc",
    "tau2_from_fsc",
]


def shell_correlation(ft1, ft2, shells, n_shells, xp=np):
    """Re Σ F1·conj(F2) / sqrt(Σ|F1|² Σ|F2|²) per shell -> (n_shells,) float64.

    `shells` gives the integer shell of every coefficient (same shape as ft1, ft2);
    coefficients in shells ≥ n_shells are ignored; empty or all-zero shells give 0.
    """
    num = fourier.shell_sum((ft1 * xp.conj(ft2)).real.astype(xp.float64), shells, n_shells, xp)
    den1 = fourier.shell_sum((ft1.real ** 2 + ft1.imag ** 2).astype(xp.float64), shells, n_shells, xp)
    den2 = fourier.shell_sum((ft2.real ** 2 + ft2.imag ** 2).astype(xp.float64), shells, n_shells, xp)
    den = xp.sqrt(den1 * den2)
    return xp.where(den > 0, num / xp.where(den > 0, den, 1.0), 0.0)


def fourier_shell_correlation(ft1, ft2, xp=np, set_shell0_to_one=True):
    """FSC per shell between two half transforms (N, N, N//2+1) (or 2D (N, N//2+1): FRC).

    Shells round(|k|) = 0 … N//2 -> (N//2+1,). With `set_shell0_to_one` shell 0 is set to 1
    as RELION does for the half-map FSC (a lone coefficient's correlation is meaningless).
    Works on `BackProjector.downsampled_average()` of two half sets and on map transforms.
    """
    if ft1.shape != ft2.shape:
        raise ValueError(f"FSC needs equal shapes, got {ft1.shape} and {ft2.shape}")
    size = ft1.shape[-2]
    if ft1.ndim == 3:
        shells = fourier.shell_index_3d(size, xp)
    elif ft1.ndim == 2:
        shells = fourier.shell_index_2d(size, xp)
    else:
        raise ValueError(f"expected a 2D or 3D half transform, got shape {ft1.shape}")
    fsc = shell_correlation(ft1, ft2, shells, size // 2 + 1, xp)
    if set_shell0_to_one:
        fsc[0] = 1.0
    return fsc


def fsc_volumes(volume1, volume2, xp=np, set_shell0_to_one=True):
    """FSC per shell between two real maps (N, N, N) centred at N//2 -> (N//2+1,)."""
    return fourier_shell_correlation(fourier.rfft3_centered(volume1, xp), fourier.rfft3_centered(volume2, xp),
                                     xp, set_shell0_to_one)


def resolution_at_threshold(fsc, size_px, pixel_size_angstrom, threshold=0.143, interpolate=False):
    """Resolution in Å where the FSC first drops below `threshold`, RELION style.

    Walking out from shell 1, the last shell i before the first value < threshold gives
    N·pixel_size / i (relion_postprocess). If shell 1 already falls below, the answer is inf;
    if the curve never falls below, the last shell's resolution. With `interpolate`, the
    crossing is placed linearly between shells i and i+1 (RELION's fractional resolution).
    """
    if hasattr(fsc, "get"):  # a device array: this is a host-side scalar answer
        fsc = fsc.get()
    fsc = np.asarray(fsc, dtype=np.float64).reshape(-1)
    last = 0
    for i in range(1, fsc.size):
        if fsc[i] < threshold:
            break
        last = i
    if last == 0:
        return float("inf")
    shell = float(last)
    if interpolate and last < fsc.size - 1:
        v0 = fsc[last] - threshold
        v1 = fsc[last + 1] - threshold
        if v0 != v1:
            shell = last + v0 / (v0 - v1)
    return float(size_px * pixel_size_angstrom / shell)


def ssnr_from_fsc(fsc, tau2_fudge=1.0, whole_instead_of_half=False, xp=np):
    """RELION's spectral SNR from a half-map FSC: fsc/(1−fsc)·tau2_fudge (dimensionless).

    The FSC is clipped to ≥ 0.001; with `whole_instead_of_half` (halves joined, twice the
    particles) it is first turned into sqrt(2·fsc/(fsc+1)); then clipped to ≤ 0.999
    (BackProjector::updateSSNRarrays). This is RELION's data_vs_prior when tau² comes from
    the FSC.
    """
    f = xp.maximum(xp.asarray(fsc, dtype=xp.float64), 0.001)
    if whole_instead_of_half:
        f = xp.sqrt(2.0 * f / (f + 1.0))
    f = xp.minimum(f, 0.999)
    return f / (1.0 - f) * tau2_fudge


def tau2_from_fsc(fsc, sigma2, tau2_fudge=1.0, whole_instead_of_half=False, xp=np):
    """RELION's tau² per shell: FSC/(1−FSC) · tau2_fudge · σ².

    fsc:    half-map FSC per shell (dimensionless).
    sigma2: per-shell noise power of the reconstruction, `BackProjector.noise_sigma2()`
            (1/(pf³·mean weight), in units of |F|² of the 2D-normalised map transform).
    Returns tau² in the units of sigma2: the signal power per shell that
    `BackProjector.reconstruct(tau2=...)` regularises with. Clipping as in `ssnr_from_fsc`.
    """
    return ssnr_from_fsc(fsc, tau2_fudge, whole_instead_of_half, xp) * xp.asarray(sigma2, dtype=xp.float64)

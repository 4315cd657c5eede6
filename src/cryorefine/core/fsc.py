"""Fourier shell correlation, resolution at a threshold, RELION's tau² from the FSC, and the FSC
between masked half maps corrected for the mask by phase randomisation.

Shells are round(|k|) in Fourier pixels of the box (k integer, in units of 1/(N·pixel size)).
Sums run over the coefficients of the half transforms as stored, without Hermitian weighting,
as RELION's getFSC does. Every function takes an array module `xp` (numpy or cupy).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, ArrayModule

__all__ = [
    "shell_correlation",
    "shell_correlation_sums",
    "correlation_from_sums",
    "fourier_shell_correlation",
    "fsc_volumes",
    "resolution_at_threshold",
    "ssnr_from_fsc",
    "tau2_from_fsc",
    "RANDOMISE_BELOW_UNMASKED_FSC",
    "SolventCorrectedFsc",
    "randomise_phases_beyond",
    "first_shell_below",
    "correct_for_mask",
    "solvent_corrected_fsc",
]

#: RELION (postprocessing and --solvent_correct_fsc): phases are randomised from the first shell whose FSC
#: between the unmasked half maps is below this.
RANDOMISE_BELOW_UNMASKED_FSC = 0.8
#: ... and the masked FSC is used as it is up to that shell + this many (RELION: artefacts near the shell
#: where randomisation starts).
SHELLS_KEPT_AFTER_RANDOMISATION = 2


def shell_correlation(ft1: Array, ft2: Array, shells: Array, n_shells: int, xp: ArrayModule = np) -> Array:
    """Re Σ F1·conj(F2) / sqrt(Σ|F1|² Σ|F2|²) per shell -> (n_shells,) float64.

    `shells` gives the integer shell of every coefficient (same shape as ft1, ft2);
    coefficients in shells ≥ n_shells are ignored; empty or all-zero shells give 0.
    """
    return correlation_from_sums(*shell_correlation_sums(ft1, ft2, shells, n_shells, xp), xp)


def shell_correlation_sums(ft1: Array, ft2: Array, shells: Array, n_shells: int,
                           xp: ArrayModule = np) -> tuple[Array, Array, Array]:
    """(Re Σ F1·conj(F2), Σ|F1|², Σ|F2|²) per shell, float64: what `shell_correlation` divides, to be summed over
    parts of the transforms first."""
    num = fourier.shell_sum((ft1 * xp.conj(ft2)).real.astype(xp.float64), shells, n_shells, xp)
    den1 = fourier.shell_sum((ft1.real ** 2 + ft1.imag ** 2).astype(xp.float64), shells, n_shells, xp)
    den2 = fourier.shell_sum((ft2.real ** 2 + ft2.imag ** 2).astype(xp.float64), shells, n_shells, xp)
    return num, den1, den2


def correlation_from_sums(num: Array, den1: Array, den2: Array, xp: ArrayModule = np) -> Array:
    """num / sqrt(den1·den2), 0 where the denominator is 0."""
    den = xp.sqrt(den1 * den2)
    return xp.where(den > 0, num / xp.where(den > 0, den, 1.0), 0.0)


def fourier_shell_correlation(ft1: Array, ft2: Array, xp: ArrayModule = np, set_shell0_to_one: bool = True) -> Array:
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


def fsc_volumes(volume1: Array, volume2: Array, xp: ArrayModule = np, set_shell0_to_one: bool = True) -> Array:
    """FSC per shell between two real maps (N, N, N) centred at N//2 -> (N//2+1,)."""
    return fourier_shell_correlation(fourier.rfft3_centered(volume1, xp), fourier.rfft3_centered(volume2, xp),
                                     xp, set_shell0_to_one)


def resolution_at_threshold(fsc: Array | npt.ArrayLike, size_px: int, pixel_size_angstrom: float,
                            threshold: float = 0.143, interpolate: bool = False) -> float:
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


def ssnr_from_fsc(fsc: Array | npt.ArrayLike, tau2_fudge: float = 1.0, whole_instead_of_half: bool = False,
                  xp: ArrayModule = np) -> Array:
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


def tau2_from_fsc(fsc: Array | npt.ArrayLike, sigma2: Array | npt.ArrayLike, tau2_fudge: float = 1.0,
                  whole_instead_of_half: bool = False, xp: ArrayModule = np) -> Array:
    """RELION's tau² per shell: FSC/(1−FSC) · tau2_fudge · σ².

    fsc:    half-map FSC per shell (dimensionless).
    sigma2: per-shell noise power of the reconstruction, `BackProjector.noise_sigma2()`
            (1/(pf³·mean weight), in units of |F|² of the 2D-normalised map transform).
    Returns tau² in the units of sigma2: the signal power per shell that
    `BackProjector.reconstruct(tau2=...)` regularises with. Clipping as in `ssnr_from_fsc`.
    """
    return ssnr_from_fsc(fsc, tau2_fudge, whole_instead_of_half, xp) * xp.asarray(sigma2, dtype=xp.float64)


@dataclass(frozen=True)
class SolventCorrectedFsc:
    """The FSC curves of two half maps and a solvent mask (RELION's postprocessing, and relion_refine's
    --solvent_correct_fsc), each (N//2+1,) with shell 0 set to 1.

    unmasked: FSC of the maps as they are; masked: of the maps times the mask; random_masked: of the maps
    with their phases randomised from `randomise_from_shell` on, times the mask (zeros when there was no
    randomisation); corrected: FSC_true, the masked FSC with the mask's contribution removed.
    randomise_from_shell is −1 when the unmasked FSC never drops below 0.8: then `corrected` is the
    unmasked FSC, as RELION does (with a warning).
    """

    unmasked: np.ndarray
    masked: np.ndarray
    random_masked: np.ndarray
    corrected: np.ndarray
    randomise_from_shell: int


def randomise_phases_beyond(volume: Array, shell: float, rng: np.random.Generator, xp: ArrayModule = np) -> Array:
    """A real map (N, N, N) whose Fourier coefficients at |k| ≥ `shell` keep their amplitude and get a phase
    drawn uniformly from [0, 2π) (RELION's randomizePhasesBeyond); lower frequencies are unchanged.

    The phases come from `rng` (a numpy Generator) on the host, so numpy and cupy give the same map.
    """
    size = volume.shape[-1]
    ft = fourier.rfft3_centered(xp.asarray(volume, dtype=xp.float64), xp)
    kz, ky, kx = fourier.frequencies_3d(size, xp)
    beyond = (kz * kz + ky * ky + kx * kx) >= float(shell) ** 2
    phases = xp.asarray(rng.uniform(0.0, 2.0 * np.pi, size=ft.shape))
    ft = xp.where(beyond, xp.abs(ft) * xp.exp(1j * phases), ft)
    return fourier.irfft3_centered(ft, size, xp)


def first_shell_below(fsc: Array | npt.ArrayLike, threshold: float) -> int:
    """The first shell i > 0 whose FSC is below `threshold`, or −1 if there is none (host int)."""
    fsc = np.asarray(fsc.get() if hasattr(fsc, "get") else fsc, dtype=np.float64).reshape(-1)
    below = np.flatnonzero(fsc[1:] < threshold)
    return int(below[0]) + 1 if below.size else -1


def correct_for_mask(fsc_masked: npt.ArrayLike, fsc_random_masked: npt.ArrayLike,
                     randomise_from_shell: int) -> np.ndarray:
    """FSC_true = (FSC_masked − FSC_random) / (1 − FSC_random) per shell (Chen et al. 2013, as RELION applies
    it): the masked FSC as it is below `randomise_from_shell` + 2, 0 where the randomised curve is above the
    masked one. Host float64 arrays."""
    t = np.asarray(fsc_masked, dtype=np.float64).reshape(-1)
    n = np.asarray(fsc_random_masked, dtype=np.float64).reshape(-1)
    shells = np.arange(t.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        corrected = np.where(n > t, 0.0, (t - n) / (1.0 - n))
    return np.where(shells < randomise_from_shell + SHELLS_KEPT_AFTER_RANDOMISATION, t, corrected)


def solvent_corrected_fsc(half1: Array, half2: Array, mask: Array, rng: np.random.Generator, xp: ArrayModule = np,
                          threshold: float = RANDOMISE_BELOW_UNMASKED_FSC) -> SolventCorrectedFsc:
    """RELION's solvent-corrected FSC of two (unregularised) half maps (N, N, N) and a mask in [0, 1]:
    the unmasked and masked FSCs, the FSC of the masked maps with phases randomised (each half with its own
    phases from `rng`) from the first shell where the unmasked FSC is below `threshold`, and their
    combination `correct_for_mask`. Returns a SolventCorrectedFsc of host arrays."""

    def host(curve: Array) -> np.ndarray:
        return np.asarray(curve.get() if hasattr(curve, "get") else curve, dtype=np.float64)

    half1 = xp.asarray(half1, dtype=xp.float64)
    half2 = xp.asarray(half2, dtype=xp.float64)
    mask = xp.asarray(mask, dtype=xp.float64)
    unmasked = host(fsc_volumes(half1, half2, xp))
    masked = host(fsc_volumes(half1 * mask, half2 * mask, xp))
    shell = first_shell_below(unmasked, threshold)
    if shell < 0:
        return SolventCorrectedFsc(unmasked, masked, np.zeros_like(masked), unmasked.copy(), -1)
    random1 = randomise_phases_beyond(half1, shell, rng, xp) * mask
    random2 = randomise_phases_beyond(half2, shell, rng, xp) * mask
    random_masked = host(fsc_volumes(random1, random2, xp))
    corrected = correct_for_mask(masked, random_masked, shell)
    corrected[0] = 1.0
    return SolventCorrectedFsc(unmasked, masked, random_masked, corrected, shell)

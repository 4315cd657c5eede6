"""The starting references of a run: a map read and checked against the particles (with --trust_ref_size
re-scaled and re-boxed to theirs, as a mask always is: `fit_to_particles`), the --ini_high low-pass that
refine and classify apply to it (classify also to its class-1 map after a cross-correlation iteration), the
spectra the iteration-0 model.star holds (`initial_data_versus_prior`), and RELION 4/5's random Gaussian blobs that
replace the averages a run without --ref starts from (`blobs`: class2d, initial_model)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cryorefine.core import fourier
from cryorefine.core.arrays import Array, array_module
from cryorefine.errors import InputError
from cryorefine.io import mrc

if TYPE_CHECKING:  # for annotations only
    from collections.abc import Sequence

    import numpy.typing as npt

    from cryorefine.config import RefineConfig

log = logging.getLogger("cryorefine")

#: RELION 4/5's blobs (MlOptimiser::initialiseReferences, SomGraph::make_blobs_2d/3d): their number in each of the
#: two draws and their width (the Gaussian's exp(−r²/width²)) as a share of the particle's diameter
N_BLOBS = 40
BLOB_WIDTH_OF_DIAMETER = 1.0 / 10.0

#: what a size refusal says to do: RELION's own remedy
ADD_TRUST_REF_SIZE = ("add --trust_ref_size to re-scale and re-box it to the particles' (RELION's GUI: 'Resize "
                      "reference if needed?' Yes)")


def read_reference(path: Path | str, box: int, pixel: float, trust_ref_size: bool = False) -> np.ndarray:
    """A reference map for particles of `box` px at `pixel` Å/px. Of another box or pixel size (its header's; none
    given: the particles'), it is refused in one line (RELION's MlModel::initialiseFromImages), or, with
    `trust_ref_size` (--trust_ref_size), re-scaled and re-boxed to the particles' as RELION does it
    (`fit_to_particles`), with a log line that says so."""
    reference, ref_pixel = mrc.read_volume(path)
    ref_box = reference.shape[0]
    pixel_differs = ref_pixel is not None and abs(ref_pixel - pixel) > 0.01 * pixel
    if trust_ref_size:
        fitted, said = fit_to_particles(reference, ref_pixel, box, pixel, even_down=True)
        if said:
            log.warning("--trust_ref_size: the reference %s %s", path, said)
        return fitted
    if pixel_differs:
        raise InputError(f"{path}: conflicting pixel sizes, the reference is {ref_pixel:g} Å/px but the particles "
                         f"are {pixel:g} Å/px; {ADD_TRUST_REF_SIZE}")
    if ref_box != box:
        raise InputError(f"{path}: the reference is {ref_box} px but the particles are {box} px; "
                         f"{ADD_TRUST_REF_SIZE}")
    return reference


def fit_to_particles(volume: np.ndarray, volume_pixel: float | None, box: int, pixel: float,
                     even_down: bool) -> tuple[np.ndarray, str]:
    """`volume` (at `volume_pixel` Å/px; None: the particles') re-scaled to about `pixel` Å/px by windowing its
    transform to the nearest even box (`core.fourier.resample_volume`, RELION's resizeMap), then cropped or
    zero-padded about its centre to `box` px (`core.fourier.window_volume`), and what was done, to be said ("" where
    nothing was). The even box is RELION's: round(N·volume_pixel/pixel) made even downwards for a reference
    (`even_down`, MlModel::initialiseFromImages), upwards for a mask (MlOptimiser::checkMask)."""
    n = volume.shape[0]
    size = n if volume_pixel is None else int(round(n * volume_pixel / pixel))
    size = size - size % 2 if even_down else size + size % 2
    said = []
    if size != n:
        volume = fourier.resample_volume(volume, size)
        actual = n * volume_pixel / size
        said.append(f"is {n} px at {volume_pixel:g} Å/px: re-scaled to {size} px ({actual:.4g} Å/px"
                    + (f"; the nearest even box, not the particles' {pixel:g} Å/px, as in RELION)"
                       if abs(actual - pixel) > 0.001 else ")"))
    if volume.shape[0] != box:
        said.append(f"{'is' if not said else 'and'} re-boxed from {volume.shape[0]} to {box} px, the particles' box")
        volume = fourier.window_volume(volume, box)
    return volume, " ".join(said)


#: Width in Fourier shells of the --ini_high low-pass's raised-cosine edge (RELION's WIDTH_FMASK_EDGE).
INI_HIGH_EDGE_SHELLS = 2.0


def lowpass_to_ini_high(volume: Array, config: RefineConfig, box: int, pixel: float) -> Array:
    """The volume low-passed to --ini_high (unchanged without it), with numpy or cupy as the volume is.

    As RELION's initialLowPassFilterReferences: a raised cosine INI_HIGH_EDGE_SHELLS wide that goes
    through 0.5 at the --ini_high shell (box·pixel/ini_high), 1 one shell below it and 0 one shell
    above it."""
    if not config.ini_high_angstrom:
        return volume
    xp = array_module(volume)
    start = box * pixel / config.ini_high_angstrom - INI_HIGH_EDGE_SHELLS / 2
    return fourier.lowpass_band_limited(volume, lambda r: fourier.raised_cosine(r, start, INI_HIGH_EDGE_SHELLS, xp),
                                        start + INI_HIGH_EDGE_SHELLS, xp)


def initial_tau2(maps: Sequence[np.ndarray], tau2_fudge: float) -> np.ndarray:
    """RELION's starting τ² (K, N//2+1) of K maps or K 2D class averages (`initial_data_versus_prior`), the
    transform of each distinct map taken once (a classification's K starting maps are often one reference: six
    transforms of 360³ took 15 s)."""
    size = int(np.shape(maps[0])[0])
    out: list[np.ndarray] = []
    for k, m in enumerate(maps):
        same = next((j for j in range(k) if maps[j] is m or np.array_equal(maps[j], m)), None)
        out.append(out[same] if same is not None else tau2_fudge * _starting_power(np.asarray(m, dtype=np.float64),
                                                                                   size))
    return np.stack(out)


def _starting_power(reference: np.ndarray, size: int) -> np.ndarray:
    """RELION's power spectrum of a starting reference, halved (the complex plane's two dimensions), a map's scaled
    by N² to the 2D images' transforms (MlModel::initialiseDataVersusPrior's normfft; 1 for 2D references)."""
    if reference.ndim == 2:  # the mean over the half transform's coefficients, as RELION's getSpectrum takes it
        ft, shells = fourier.rfft2_centered(reference), fourier.shell_index_2d(size)
        power = fourier.shell_sum(ft.real ** 2 + ft.imag ** 2, shells, size // 2 + 1)
        return power / np.maximum(fourier.shell_sum(np.ones(shells.shape), shells, size // 2 + 1), 1.0) / 2.0
    return fourier.power_spectrum_3d(fourier.rfft3_centered(reference)) * size * size / 2.0


def initial_data_versus_prior(maps: Sequence[np.ndarray], sigma2_noise: npt.ArrayLike, n_particles: int,
                              pdf_class: npt.ArrayLike, tau2_fudge: float,
                              tau2: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(τ², data versus prior), each (K, N//2+1), of K starting maps (N px), as RELION's
    MlModel::initialiseDataVersusPrior makes them for the iteration-0 model.star (rlnReferenceTau2, rlnSsnrMap).

    τ²(i) = tau2_fudge · P(i) · N²/2, P the map's power spectrum (the mean |F|² of its half transform, normalised by
    1/N³, over the coefficients of round(|k|) = i: RELION's getSpectrum); the data versus prior of class k is
    n_particles · pdf_class[k] / σ²(i) · τ²(i), divided by 2i for i > 0 (RELION's allowance for the ratio of a 3D
    shell's voxels to a 2D shell's pixels), σ² the noise spectra (n_groups, N//2+1) averaged over the groups with
    any power. A shell without noise power gives inf, as RELION's division does. `tau2`: `initial_tau2` of the maps
    where it is known already. Of 2D class averages (N, N) (RELION's ref_dim 2): τ²(i) = tau2_fudge · P(i)/2, P of
    the transform normalised by 1/N², and no division by 2i."""
    noise = np.atleast_2d(np.asarray(sigma2_noise, dtype=np.float64))
    used = noise[noise.sum(axis=1) > 0]
    average = used.mean(axis=0) if len(used) else np.zeros(noise.shape[1])
    size = int(np.shape(maps[0])[0])
    shells = np.arange(size // 2 + 1)
    if tau2 is None:
        tau2 = initial_tau2(maps, tau2_fudge)
    per_shell = np.where(shells > 0, 2.0 * shells, 1.0) if np.ndim(maps[0]) == 3 else np.ones(shells.size)
    with np.errstate(divide="ignore", invalid="ignore"):
        evidence = n_particles * np.asarray(pdf_class, dtype=np.float64)[:, None] / average[None, :] / per_shell
        data_vs_prior = evidence / (1.0 / tau2)
    return tau2, data_vs_prior


def blobs(average: np.ndarray, diameter_px: float, place_sigma_of_diameter: float,
          rng: np.random.Generator) -> np.ndarray:
    """RELION 4/5's blobs in place of a starting average without --ref (2D image or 3D map, float64): N_BLOBS
    Gaussians exp(−|x − c|²/w²), w = diameter·BLOB_WIDTH_OF_DIAMETER, at places c drawn about the centre N/2 (normal,
    σ `place_sigma_of_diameter`·diameter; RELION's 1/7 in 2D, 1/6 in 3D), each as high as |average| at the place's
    pixel (its coordinates truncated; nothing for a place outside the box), minus half of another N_BLOBS so drawn;
    scaled to the standard deviation of `average` (a flat average gives zeros)."""
    average = np.asarray(average, dtype=np.float64)
    n, ndim = average.shape[0], average.ndim
    coordinate = np.arange(n, dtype=np.float64)
    width = diameter_px * BLOB_WIDTH_OF_DIAMETER

    def draw() -> np.ndarray:
        places = rng.normal(0.0, diameter_px * place_sigma_of_diameter, (N_BLOBS, ndim)) + n / 2.0
        pixel = places.astype(np.int64)  # the place's pixel: its coordinates truncated (towards 0)
        inside = np.all((pixel >= 0) & (pixel < n), axis=1)
        places = places[inside]
        amplitude = np.abs(average[tuple(pixel[inside].T)])
        # each Gaussian is the product of one per axis: (blobs, n) factors, summed over the blobs
        factors = [np.exp(-((coordinate[None, :] - places[:, a, None]) ** 2) / (width * width)) for a in range(ndim)]
        if ndim == 2:
            return (amplitude[:, None] * factors[0]).T @ factors[1]
        return np.tensordot(amplitude[:, None] * factors[0], factors[1][:, :, None] * factors[2][:, None, :],
                            axes=(0, 0))

    image = draw() - draw() / 2.0
    spread = float(image.std())
    return image * (float(average.std()) / spread) if spread > 0 else image

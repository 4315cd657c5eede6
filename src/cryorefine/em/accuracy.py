"""RELION's own estimate of the angular and translational accuracy (MlOptimiser::calculateExpectedAngularErrors in
src/ml_optimiser.cpp), from projections of the references at particles' poses.

For each class with at least 1 % of the particles, and each of up to 100 particles (RELION takes the first 100 of
its randomly ordered particles): project the reference at the particle's pose, then at the pose with rot, tilt or
psi (one of them, at random, the same for every trial of that particle) moved by a growing error δ
(`em.schedule.rotation_trials_deg`), and find the first δ at which

    Σ_k CTF(k)²·|F₁(k) − F₂(k)|² / (2·sigma2_fudge·σ²(shell k))

over the image at the current size (every coefficient of its half transform with shell 1 … current/2) exceeds
ln 100 (the two poses' likelihoods differ 100-fold); 30.1° where none up to 30° does. The same for a shift of x or
y (at random) by a growing s px (`em.schedule.translation_trials_px`), F₂ = F₁ shifted: 10.1 px at most. The
class's accuracy is the mean over the particles (the shift times the pixel size, in Å), and the run's the best
class's.

`em.schedule.estimated_accuracy` is a spectral model of the same sum that needs no projections; at low resolution,
where a reference is close to a round blob, it is far more optimistic than this (about 5° where this gives 30°), and
after a refinement's low-resolution join of the halves, whose FSC of 1 there inflates τ², more so (0.2° where this
gives 2-3°). refine and initial_model estimate with this function, as RELION does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from cryorefine.core import euler, fourier
from cryorefine.core.ctf import ctf_2d
from cryorefine.core.projector import Projector
from cryorefine.data import ParticleSet
from cryorefine.em import schedule

#: RELION's number of particles for the estimate of a 3D refinement (10 for 2D ones)
N_TRIAL_PARTICLES = 100
#: rotation trials projected at a time (of `em.schedule.rotation_trials_deg`' 36)
ROTATION_TRIALS_PER_BLOCK = 6


def projected_accuracy(maps: Sequence[npt.ArrayLike], pdf_class: npt.ArrayLike, sigma2_noise: npt.ArrayLike,
                       particles: ParticleSet, indices: npt.ArrayLike, angles_deg: npt.ArrayLike, *,
                       current_size_px: int,
                       padding_factor: float, do_ctf: bool, ctf_intact_first_peak: bool = False,
                       sigma2_fudge: float = 1.0, seed: int = 0) -> schedule.Accuracy:
    """The accuracy (module docstring) of the references `maps` (K host volumes) with class shares `pdf_class`,
    noise `sigma2_noise` ((optics groups, shells) or (shells,)), from the particles `indices` of `particles` at
    their poses (`angles_deg`: rot, tilt and psi of each, (len(indices), 3)). `seed` draws which angle and which
    shift axis each particle's trials move. (999, 999) where no class has 1 % of the particles."""
    indices = np.asarray(indices, dtype=np.int64)
    poses = np.asarray(angles_deg, dtype=np.float64).reshape(len(indices), 3)
    sigma2 = np.atleast_2d(np.asarray(sigma2_noise, dtype=np.float64))
    pdf = np.asarray(pdf_class, dtype=np.float64).reshape(-1)
    n = int(current_size_px)
    ori = int(np.shape(maps[0])[0])
    shell = fourier.shell_index_2d(n)
    ky, kx = fourier.frequencies_2d(n)
    ky, kx = np.broadcast_to(ky, shell.shape), np.broadcast_to(kx, shell.shape)
    inside = (shell >= 1) & (shell <= n // 2) & (shell < sigma2.shape[1])
    shell, ky, kx = shell[inside], ky[inside], kx[inside]
    pixels = np.asarray(particles.pixel_size_per_particle_angstrom, dtype=np.float64)[indices]
    if do_ctf and len(indices):  # the CTF at the current size: the same integer frequencies of the original box
        ctf = ctf_2d(n, particles.ctf_parameters(indices, pixels * ori / n),
                     intact_until_first_peak=ctf_intact_first_peak, dtype=np.float64)
        ctf2 = (np.asarray(ctf) ** 2).reshape(len(indices), -1)[:, inside.reshape(-1)]
    else:
        ctf2 = np.ones((len(indices), shell.size))
    optics = np.asarray(particles.optics_index)[indices]
    with np.errstate(divide="ignore"):
        inv = np.where(sigma2 > 0, 1.0 / (2.0 * sigma2_fudge * np.where(sigma2 > 0, sigma2, 1.0)), 0.0)
    rng = np.random.default_rng(seed)
    moved_angle = rng.integers(0, 3, size=len(indices))  # rot, tilt or psi
    moved_axis = rng.integers(0, 2, size=len(indices))  # x or y
    shifts = np.asarray(schedule.translation_trials_px())
    best_rot, best_trans = schedule.UNKNOWN_ACCURACY, schedule.UNKNOWN_ACCURACY
    for k, volume in enumerate(maps):
        if k < pdf.size and pdf[k] < schedule.MIN_CLASS_FRACTION_FOR_ACCURACY:
            continue
        # the map Fourier-cropped to the smallest even box that holds the current size: the same coefficients at
        # the same integer frequencies, its projections smaller by crop/ori (the projector's 1/N² of a box N), which
        # the weights make up for; a 360 px map's padded transform at the current size instead of the whole box's
        crop = min(ori, n + n % 2)
        small = np.asarray(volume) if crop == ori else fourier.downsample_volume(np.asarray(volume), crop)
        projector = Projector(small, padding_factor, n // 2)
        scale2 = (ori / crop) ** 2
        acc_rot, acc_trans = [], []
        for i in range(len(indices)):
            weight = ctf2[i] * inv[min(int(optics[i]), inv.shape[0] - 1)][shell] * scale2
            angles = poses[i]
            f1 = projector.project(euler.euler_to_matrix(*angles), image_size_px=n)[inside]
            acc_rot.append(_rotation_error(projector, f1, angles, int(moved_angle[i]), weight, inside))
            k_axis = kx if moved_axis[i] == 0 else ky
            # |F₁ − F₁·e^{−2πi·k·s/N}|² = |F₁|²·4·sin²(π·k·s/N), N the original box
            phase = np.sin(np.pi * np.outer(shifts, k_axis) / ori) ** 2
            snr = (4.0 * phase * (np.abs(f1) ** 2 * weight)[None]).sum(axis=1)
            acc_trans.append(_first_beyond(shifts, snr) * pixels[i])
        if acc_rot:
            best_rot = min(best_rot, float(np.mean(acc_rot)))
            best_trans = min(best_trans, float(np.mean(acc_trans)))
    return schedule.Accuracy(best_rot, best_trans)


def _rotation_error(projector: Projector, f1: np.ndarray, angles: np.ndarray, moved_angle: int, weight: np.ndarray,
                    inside: np.ndarray) -> float:
    """One particle's angular error: the first rotation trial whose projection (`inside` coefficients, weighted by
    `weight`) differs from `f1` by an SNR beyond ln 100, else the last. The trials are projected a block at a time
    and the search stops at the first block that holds the answer, as RELION's stops at the first trial."""
    rotations = np.asarray(schedule.rotation_trials_deg())
    n = inside.shape[0]
    for start in range(0, rotations.size, ROTATION_TRIALS_PER_BLOCK):
        trials = rotations[start:start + ROTATION_TRIALS_PER_BLOCK]
        moved = np.repeat(angles[None], trials.size, axis=0)
        moved[:, moved_angle] += trials
        f2 = projector.project(euler.euler_to_matrix(moved[:, 0], moved[:, 1], moved[:, 2]),
                               image_size_px=n)[:, inside]
        above = np.flatnonzero((np.abs(f1[None] - f2) ** 2 * weight).sum(axis=1) > schedule.ACCURACY_NEG_LOG_P)
        if above.size:
            return float(trials[above[0]])
    return float(rotations[-1])


def _first_beyond(trials: np.ndarray, snr: np.ndarray) -> float:
    """The first trial whose SNR exceeds ln 100, else the last (RELION's cap)."""
    above = np.flatnonzero(snr > schedule.ACCURACY_NEG_LOG_P)
    return float(trials[above[0]] if above.size else trials[-1])

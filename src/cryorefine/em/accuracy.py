"""RELION's own estimate of the angular and translational accuracy (MlOptimiser::calculateExpectedAngularErrors in
src/ml_optimiser.cpp), from projections of the references at particles' poses.

For each class with at least 1 % of the particles, and each of up to 100 particles (RELION takes the first 100 of
its randomly ordered particles): project the reference at the particle's pose, then at the pose with rot, tilt or
psi (one of them, at random, the same for every trial of that particle) moved by a growing error δ
(`em.schedule.rotation_trials_deg`), and find the first δ at which

    Σ_k CTF(k)²·|F₁(k) − F₂(k)|² / (2·σ²(shell k))

(RELION's σ² is times its sigma2_fudge, 1 unless its unlisted option --sigma2_fudge says otherwise; cryorefine takes
no such option) over the image at the current size (every coefficient of its half transform with shell 1 …
current/2) exceeds ln 100 (the two poses' likelihoods differ 100-fold); 30.1° where none up to 30° does. The same
for a shift of x or y (at random) by a growing s px (`em.schedule.translation_trials_px`), F₂ = F₁ shifted: 10.1 px
at most. The class's accuracy is the mean over the particles (the shift times the pixel size, in Å), and the run's
the best class's. The projections are made in single precision, as the E-step's are (half the time of double on the
host; the sums are double).

`em.schedule.estimated_accuracy` is a spectral model of the same sum that needs no projections; at low resolution,
where a reference is close to a round blob, it is far more optimistic than this (about 5° where this gives 30°), and
after a refinement's low-resolution join of the halves, whose FSC of 1 there inflates τ², more so (0.2° where this
gives 2-3°). refine and initial_model estimate with this function, as RELION does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cryorefine.core import euler, fourier
from cryorefine.core.arrays import Array, ArrayModule, to_host
from cryorefine.core.ctf import ctf_2d
from cryorefine.core.projector import Projector
from cryorefine.data import ParticleSet
from cryorefine.em import schedule

#: RELION's number of particles for the estimate of a 3D refinement (10 for 2D ones)
N_TRIAL_PARTICLES = 100
#: rotation trials projected at a time (of `em.schedule.rotation_trials_deg`' 36)
ROTATION_TRIALS_PER_BLOCK = 6
#: particles whose trials are projected together
PARTICLES_PER_BLOCK = 25


@dataclass(frozen=True)
class AccuracyRequest:
    """What a plan asks for an estimate: `projected_accuracy`'s arguments but the particle set, which every process
    of a run holds (the runner says where it is made: one process's device, an MPI run's first worker)."""

    maps: list
    pdf_class: np.ndarray
    sigma2_noise: np.ndarray
    indices: np.ndarray
    angles_deg: np.ndarray
    current_size_px: int
    padding_factor: float
    do_ctf: bool
    ctf_intact_first_peak: bool = False
    seed: int = 0

    def estimate(self, particles: ParticleSet, xp: ArrayModule = np) -> schedule.Accuracy:
        """The estimate from `particles` (the run's set), made with `xp`."""
        return projected_accuracy(self.maps, self.pdf_class, self.sigma2_noise, particles, self.indices,
                                  self.angles_deg, current_size_px=self.current_size_px,
                                  padding_factor=self.padding_factor, do_ctf=self.do_ctf,
                                  ctf_intact_first_peak=self.ctf_intact_first_peak, seed=self.seed, xp=xp)


#: how a plan has a request estimated (the runner's `estimate_accuracy`): (request, the run's particles) -> accuracy
Estimator = Callable[[AccuracyRequest, ParticleSet], schedule.Accuracy]


def estimate_on_host(request: AccuracyRequest, particles: ParticleSet) -> schedule.Accuracy:
    """The estimate made here with numpy (a plan given no other `Estimator`)."""
    return request.estimate(particles)


def projected_accuracy(maps: Sequence[npt.ArrayLike], pdf_class: npt.ArrayLike, sigma2_noise: npt.ArrayLike,
                       particles: ParticleSet, indices: npt.ArrayLike, angles_deg: npt.ArrayLike, *,
                       current_size_px: int,
                       padding_factor: float, do_ctf: bool, ctf_intact_first_peak: bool = False,
                       seed: int = 0, xp: ArrayModule = np) -> schedule.Accuracy:
    """The accuracy (module docstring) of the references `maps` (K host volumes) with class shares `pdf_class`,
    noise `sigma2_noise` ((optics groups, shells) or (shells,)), from the particles `indices` of `particles` at
    their poses (`angles_deg`: rot, tilt and psi of each, (len(indices), 3)). `seed` draws which angle and which
    shift axis each particle's trials move. (999, 999) where no class has 1 % of the particles. The projections
    and their sums are made with `xp` (cupy: on the current device; the trials' bookkeeping stays on the host)."""
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
    coefficients = xp.asarray(np.flatnonzero(inside.reshape(-1)))  # of a projection's flat half transform
    pixels = np.asarray(particles.pixel_size_per_particle_angstrom, dtype=np.float64)[indices]
    if do_ctf and len(indices):  # the CTF at the current size: the same integer frequencies of the original box
        ctf = ctf_2d(n, particles.ctf_parameters(indices, pixels * ori / n),
                     intact_until_first_peak=ctf_intact_first_peak, dtype=np.float64)
        ctf2 = (np.asarray(ctf) ** 2).reshape(len(indices), -1)[:, inside.reshape(-1)]
    else:
        ctf2 = np.ones((len(indices), shell.size))
    optics = np.asarray(particles.optics_index)[indices]
    with np.errstate(divide="ignore"):
        inv = np.where(sigma2 > 0, 1.0 / (2.0 * np.where(sigma2 > 0, sigma2, 1.0)), 0.0)
    rng = np.random.default_rng(seed)
    moved_angle = rng.integers(0, 3, size=len(indices))  # rot, tilt or psi
    moved_axis = rng.integers(0, 2, size=len(indices))  # x or y
    shifts = np.asarray(schedule.translation_trials_px())
    # |F₁ − F₁·e^{−2πi·k·s/N}|² = |F₁|²·4·sin²(π·k·s/N), N the original box, k along x or y: (trials, coefficients)
    phases = [xp.asarray(4.0 * np.sin(np.pi * np.outer(shifts, k_axis) / ori) ** 2) for k_axis in (kx, ky)]
    best_rot, best_trans = schedule.UNKNOWN_ACCURACY, schedule.UNKNOWN_ACCURACY
    for k, volume in enumerate(maps):
        if k < pdf.size and pdf[k] < schedule.MIN_CLASS_FRACTION_FOR_ACCURACY:
            continue
        # the map Fourier-cropped to the smallest even box that holds the current size: the same coefficients at
        # the same integer frequencies, its projections smaller by crop/ori (the projector's 1/N² of a box N), which
        # the weights make up for; a 360 px map's padded transform at the current size instead of the whole box's
        crop = min(ori, n + n % 2)
        whole = xp.asarray(volume)
        small = whole if crop == ori else fourier.downsample_volume(whole, crop, xp)
        del whole
        projector = Projector(small, padding_factor, n // 2, dtype=np.float32, xp=xp)
        del small
        scale2 = (ori / crop) ** 2
        # (particles, coefficients)
        weights = xp.asarray(ctf2 * inv[np.minimum(optics, inv.shape[0] - 1)][:, shell] * scale2)
        acc_rot, acc_trans = [], []
        for chunk in range(0, len(indices), PARTICLES_PER_BLOCK):
            rows = np.arange(chunk, min(chunk + PARTICLES_PER_BLOCK, len(indices)))
            f1 = _projections(projector, poses[rows], n, coefficients)
            block_weights = weights[rows[0]:rows[-1] + 1]  # the block's rows (a view)
            acc_rot += _rotation_errors(projector, f1, poses[rows], moved_angle[rows], block_weights, n, coefficients)
            power = xp.abs(f1) ** 2 * block_weights
            for axis, phase in enumerate(phases):
                on_axis = np.flatnonzero(moved_axis[rows] == axis)
                snr = to_host(power[xp.asarray(on_axis)] @ phase.T)  # (particles, trials)
                acc_trans += [_first_beyond(shifts, row) * pixel for row, pixel in zip(snr, pixels[rows][on_axis])]
        del projector
        if acc_rot:
            best_rot = min(best_rot, float(np.mean(acc_rot)))
            best_trans = min(best_trans, float(np.mean(acc_trans)))
    return schedule.Accuracy(best_rot, best_trans)


def _projections(projector: Projector, angles_deg: np.ndarray, n: int, coefficients: Array) -> Array:
    """The `coefficients` of the n px projections at the poses `angles_deg` (rot, tilt, psi): (poses, coefficients)."""
    xp = projector.xp
    matrices = euler.euler_to_matrix(angles_deg[:, 0], angles_deg[:, 1], angles_deg[:, 2], xp=xp)
    return projector.project(matrices, image_size_px=n).reshape(len(angles_deg), -1)[:, coefficients]


def _rotation_errors(projector: Projector, f1: Array, angles: np.ndarray, moved_angle: np.ndarray,
                     weights: Array, n: int, coefficients: Array) -> list[float]:
    """Each particle's angular error: the first rotation trial of its angle `moved_angle` (0 rot, 1 tilt, 2 psi)
    whose projection (its `coefficients`, weighted by its row of `weights`) differs from its row of `f1` by an SNR
    beyond ln 100, else the last. The trials are projected a block at a time for the particles still searching, and
    a particle's search stops at the first block that holds its answer, as RELION's stops at the first trial."""
    xp = projector.xp
    rotations = np.asarray(schedule.rotation_trials_deg())
    errors = np.full(len(angles), rotations[-1])
    searching = np.arange(len(angles))
    for start in range(0, rotations.size, ROTATION_TRIALS_PER_BLOCK):
        if searching.size == 0:
            break
        trials = rotations[start:start + ROTATION_TRIALS_PER_BLOCK]
        moved = np.repeat(angles[searching, None], trials.size, axis=1)  # (searching, trials, 3)
        moved[np.arange(searching.size), :, moved_angle[searching]] += trials
        f2 = _projections(projector, moved.reshape(-1, 3), n, coefficients).reshape(searching.size, trials.size, -1)
        rows = xp.asarray(searching)
        snr = to_host((xp.abs(f1[rows][:, None] - f2) ** 2 * weights[rows][:, None]).sum(axis=2))
        above = snr > schedule.ACCURACY_NEG_LOG_P
        found = above.any(axis=1)
        errors[searching[found]] = trials[np.argmax(above[found], axis=1)]
        searching = searching[~found]
    return errors.tolist()


def _first_beyond(trials: np.ndarray, snr: np.ndarray) -> float:
    """The first trial whose SNR exceeds ln 100, else the last (RELION's cap)."""
    above = np.flatnonzero(snr > schedule.ACCURACY_NEG_LOG_P)
    return float(trials[above[0]] if above.size else trials[-1])

"""RELION's auto-refine schedule (MlOptimiser, src/ml_optimiser.cpp), as small pure functions.

Everything here works on scalars and per-shell spectra: it decides, between iterations, the
resolution, the image sizes, the angular and translational sampling, local searches and
convergence. Lengths are in Å unless a name says px; angles in degrees; resolutions in Å
(``*_angstrom``) or in 1/Å (``*_inv_angstrom``); Fourier shells are integer radii in pixels of
the original box (``ori_size_px``), shell i at resolution ori_size_px·pixel_size_angstrom / i.

One iteration of a gold-standard refinement calls them in RELION's order
(MlOptimiserMpi::iterate, expectation, maximization)::

    optimiser, state = initial_schedule(config, rng)                  # before iteration 1
    state = state.counted_from(optimiser)                             # MPI's leader: changes vs the first steps
    res = current_resolution(model.ori_size_px, model.pixel_size_angstrom,
                             iteration=0, ini_high_angstrom=config.ini_high_angstrom)
    model.current_resolution_angstrom = res.resolution_angstrom
    for it in 1, 2, ...:
        optimiser = replace(optimiser, iteration=it)
        optimiser = check_convergence(optimiser, state)                 # may start the final iteration
        sizes = image_sizes(model.current_resolution_angstrom, optimiser.healpix_order, diameter,
                            model.ori_size_px, model.pixel_size_angstrom, state.incr_size_px,
                            optimiser.has_high_fsc_at_resol_limit, ave_pmax=model.ave_pmax,
                            final_iteration=optimiser.do_join_halves)
        if not (it == 1 and config.firstiter_cc):
            acc = em.accuracy.projected_accuracy(half 1's map, ..., current_size_px=sizes.current_size_px, ...)
            optimiser = replace(optimiser, acc_rot_deg=acc.rotations_deg,
                                acc_trans_angstrom=acc.translations_angstrom)
        if it > 1:
            optimiser, state = update_sampling(optimiser, model, config, state)
        ... E-step with sampling_from_optimiser(optimiser, config) (local priors with
            optimiser.sigma_rot_deg / sigma_psi_deg when optimiser.local_searches) ...
        ... half-map FSC ...
        optimiser, state = update_size_flags_from_fsc(optimiser, state, fsc, sizes.current_size_px)
        ... M-step (halves joined when optimiser.do_join_halves) ...
        changes = hidden_variable_changes_from_sums(...)               # from the E-step's poses
        res = current_resolution(..., fsc_halves=fsc, tau2_fudge=config.tau2_fudge,
                                 halves_joined=optimiser.do_join_halves, iteration=it, ...)
        optimiser = update_change_counters(optimiser, changes..., resolution_angstrom=res.resolution_angstrom,
                                           previous_resolution_angstrom=model.current_resolution_angstrom,
                                           counted=state, ...)
        model.current_resolution_angstrom = res.resolution_angstrom
        ... write outputs ...
        if optimiser.has_converged: break                               # that was the final iteration

RELION's has_large_incr_size_iter_ago (OptimiserState.has_large_size_increase_iterations_ago) is
only read and written by RELION (3.0 to 5.0), never used, so nothing here changes it.

RELION's values of every threshold are the named constants below. Options of relion_refine that
RefineConfig does not carry (--auto_ignore_angles, --auto_resol_angles, --minres_map,
--coarse_size, --strict_highres_exp, --minimum/maximum_angular_sampling) are keyword
arguments with RELION's defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = [
    "MAX_NR_ITER_WO_RESOL_GAIN",
    "MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES",
    "ScheduleState",
    "ResolutionEstimate",
    "ImageSizes",
    "Accuracy",
    "HiddenVariableChanges",
    "angular_step_deg",
    "local_search_sigma_deg",
    "default_particle_diameter_angstrom",
    "initial_schedule",
    "sampling_from_optimiser",
    "current_resolution",
    "image_sizes",
    "update_size_flags_from_fsc",
    "hidden_variable_changes_from_sums",
    "angular_distance_deg",
    "update_hidden_variable_counters",
    "update_resolution_counter",
    "update_change_counters",
    "update_sampling",
    "fast_subset_size",
    "coarser_sampling",
    "check_convergence",
    "rotation_trials_deg",
    "translation_trials_px",
    "rotation_error_deg_from_snr",
    "shift_error_px_from_snr",
    "estimated_accuracy",
    "estimated_accuracy_from_model",
]

# ---------------------------------------------------------------- RELION's constants

#: ml_optimiser.h: iterations without resolution gain before the sampling may get finer / converge.
MAX_NR_ITER_WO_RESOL_GAIN = 1
#: ml_optimiser.h: iterations without large hidden-variable changes before the same.
MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES = 1
#: updateCurrentResolution: the resolution is where the spectral SNR (data_vs_prior) drops below this.
SSNR_RESOLUTION_THRESHOLD = 1.0
#: updateCurrentResolution: a new resolution (1/Å) counts as a gain only above old + this (rounding guard).
RESOLUTION_GAIN_TOLERANCE_INV_ANGSTROM = 1e-4
#: updateCurrentResolution: the high-resolution side wins if its crossing is more than this many shells out.
HIGH_RES_SIDE_MIN_EXTRA_SHELLS = 3
#: --minres_map: the resolution shell never goes below this (shells).
MINRES_MAP_SHELL = 5
#: updateImageSizeAndResolutionPointers: with a high FSC at the size limit, grow by this fraction of ori_size/2.
LARGE_SIZE_STEP_FRACTION_OF_HALF_BOX = 0.25
#: ... but only when the average maximum probability exceeds this.
LARGE_SIZE_STEP_MIN_AVE_PMAX = 0.1
#: ml_optimiser_mpi.cpp maximization: the FSC at shell current_size/2 − 1 above this marks a high FSC at the limit.
HIGH_FSC_AT_LIMIT_THRESHOLD = 0.2
#: ... and incr_size grows to at least (shell of FSC 0.143) − (shell of FSC 0.5) + this.
INCR_SIZE_EXTRA_SHELLS = 5
#: the two FSC thresholds of that rule.
FSC_HALF_THRESHOLD = 0.5
FSC_GOLD_THRESHOLD = 0.143
#: updateImageSizeAndResolutionPointers: coarse resolution = rotated distance / this (3D references).
COARSE_SIZE_KEEPSAFE_FACTOR_3D = 1.2
COARSE_SIZE_KEEPSAFE_FACTOR_2D = 1.5  # RELION's keepsafe_factor with ref_dim 2
#: updateOverallChangesInHiddenVariables: "no large change" = within 3 % of the smallest change so far ...
SIMILAR_CHANGES_FACTOR = 1.03
#: ... or a change below this fraction of the current sampling step.
SMALL_CHANGES_FRACTION_OF_STEP = 0.40
#: updateAngularSampling: sampling is fine enough once the step is below this fraction of acc_rot.
FINE_ENOUGH_FRACTION_OF_ACCURACY = 0.75
#: updateAngularSampling: new offset step = min(this, 0.75·acc_trans)·2^oversampling. RELION ≥ 3.1
#: keeps offsets in Å, so this cap is 1.5 Å (it was 1.5 px in RELION 3.0).
MAX_OFFSET_STEP_ANGSTROM = 1.5
OFFSET_STEP_FRACTION_OF_ACCURACY = 0.75
#: updateAngularSampling: new offset range = this × the RMS offset change (2D images; 3 for subtomograms).
OFFSET_RANGE_IN_CHANGES = 5.0
#: ... at most this × the previous range,
MAX_OFFSET_RANGE_GROWTH = 1.3
#: ... at least this many steps,
MIN_OFFSET_RANGE_IN_STEPS = 1.5
#: ... and halved (then the step widened) while above this many steps.
MAX_OFFSET_RANGE_IN_STEPS = 4.0
#: Local searches: σ of the rot/tilt/psi priors = this × the (oversampled) angular step (σ² = 2·2·step²).
LOCAL_SEARCH_SIGMA_IN_STEPS = 2.0
#: Values the smallest-change trackers are reset to when the sampling changes.
RESET_SMALLEST_CHANGES_CLASSES = 9999999.0
RESET_SMALLEST_CHANGES = 999.0
#: calculateExpectedAngularErrors: an error is resolved once −ln P = Σ|ΔF|²/(2σ²) exceeds ln(100).
ACCURACY_NEG_LOG_P = 4.60517
#: ... the search stops beyond these errors (degrees, pixels).
MAX_ACCURACY_SEARCH_ROT_DEG = 30.0
MAX_ACCURACY_SEARCH_TRANS_PX = 10.0
#: ... classes holding less than this fraction of the particles get no estimate.
MIN_CLASS_FRACTION_FOR_ACCURACY = 0.01
#: RELION's "unknown accuracy".
UNKNOWN_ACCURACY = 999.0
#: Mean CTF² used by `estimated_accuracy_from_model` with CTFs but no CTF² spectrum (mean of sin²).
MEAN_CTF2_WITHOUT_SPECTRUM = 0.5

# Quadrature of the rotation-error model (see `estimated_accuracy`).
_N_PHI = 32
_N_COS_THETA = 8


# ---------------------------------------------------------------- small types


@dataclass(frozen=True)
class ScheduleState:
    """Auto-refine bookkeeping of RELION's MlOptimiser that OptimiserState has no field for.

    incr_size_px: RELION's incr_size, shells added beyond the resolution for the image size; it
        only grows (update_size_flags_from_fsc).
    has_fine_enough_angular_sampling: set by update_sampling, read by check_convergence.
    counted_healpix_order, counted_offset_step_px: the sampling whose steps an iteration's changes of
        the poses are measured against (`update_hidden_variable_counters`); None: the current one.
        relion_refine_mpi counts the changes on its leader, whose sampling stays the one the run
        started (or was continued) with: updateAngularSampling runs on the followers only
        (MlOptimiserMpi::expectationSetup), and no follower sends the new order or offset step back
        but in a helical refinement. An auto-refine, which RELION runs under MPI only, counts so too.
    """

    incr_size_px: int = 10
    has_fine_enough_angular_sampling: bool = False
    counted_healpix_order: int | None = None
    counted_offset_step_px: float | None = None

    def counted_from(self, optimiser) -> ScheduleState:
        """This state counting the changes against `optimiser`'s sampling (a run's start or its --continue)."""
        return dataclasses.replace(self, counted_healpix_order=int(optimiser.healpix_order),
                                   counted_offset_step_px=float(optimiser.offset_step_px))


class ResolutionEstimate(NamedTuple):
    shell: int  # Fourier shell (px of the original box)
    resolution_angstrom: float  # ori_size·pixel_size / shell; inf for shell 0
    resolution_inv_angstrom: float  # shell / (ori_size·pixel_size)


class ImageSizes(NamedTuple):
    current_size_px: int  # fine pass, M-step
    coarse_size_px: int  # coarse pass


class Accuracy(NamedTuple):
    rotations_deg: float
    translations_angstrom: float


class HiddenVariableChanges(NamedTuple):
    orientations_deg: float  # mean angular distance between old and new best orientations
    offsets_angstrom: float  # RMS change of the offset per dimension
    classes: float  # fraction of particles that changed class


# ---------------------------------------------------------------- helpers


def _relion_round(x: float) -> int:
    """RELION's ROUND: halves away from zero (Python's round() rounds halves to even)."""
    return int(x + 0.5) if x > 0 else int(x - 0.5)


def angular_step_deg(healpix_order: int, oversampling: int = 0) -> float:
    """RELION's getAngularSampling(k) for 3D: 360 / (6·2^(order + k)) degrees."""
    return 360.0 / (6 * 2 ** (int(healpix_order) + int(oversampling)))


def local_search_sigma_deg(healpix_order: int, oversampling: int) -> float:
    """σ (degrees) of the rot, tilt and psi priors of RELION's local searches: σ² = 2·2·step²,
    step the oversampled angular step of the order, so σ = 2·step (order 4, oversampling 1: 3.75°)."""
    return LOCAL_SEARCH_SIGMA_IN_STEPS * angular_step_deg(healpix_order, oversampling)


def default_particle_diameter_angstrom(config, ori_size_px: int, pixel_size_angstrom: float) -> float:
    """--particle_diameter, or RELION's default (ori_size − width_mask_edge)·pixel_size in Å; a diameter larger
    than that is clipped to it (the mask stays inside the box, with background around it)."""
    largest = (ori_size_px - config.width_mask_edge_px) * pixel_size_angstrom
    if config.particle_diameter_angstrom is not None and config.particle_diameter_angstrom > 0:
        return min(float(config.particle_diameter_angstrom), largest)
    return largest


def warn_if_diameter_clipped(config, ori_size_px: int, pixel_size_angstrom: float, log) -> None:
    """A warning on `log` when --particle_diameter does not fit the box and the mask is clipped."""
    used = default_particle_diameter_angstrom(config, ori_size_px, pixel_size_angstrom)
    if config.particle_diameter_angstrom is not None and config.particle_diameter_angstrom > used:
        log.warning("--particle_diameter %g Å is larger than the box allows (%d px × %g Å/px less the %g px mask "
                    "edge); the mask is clipped to %.1f Å", config.particle_diameter_angstrom, ori_size_px,
                    pixel_size_angstrom, config.width_mask_edge_px, used)


def initial_schedule(config, rng: np.random.Generator):
    """The optimiser and schedule state before iteration 1 (RELION's initialiseGeneral).

    HEALPix order and offset disc from the options; when the starting order is already at or
    beyond --auto_local_healpix_order, local searches start at once with σ = 2·step (the
    oversampled step), as RELION does at iteration 0. The sampling's random perturbation takes its first step
    now, drawn from `rng` (RELION's HealpixSampling::initialise), and one more before each iteration's search,
    so that iteration 1 searches at the second step of the walk as RELION's does (in [-0.5, 0] of a step, where
    the first step alone gives [0.25, 0.5]); not with --skip_align, whose kept poses RELION does not perturb.
    """
    from cryorefine.em.state import OptimiserState

    local = config.auto_refine and config.healpix_order >= config.auto_local_healpix_order
    sigma = local_search_sigma_deg(config.healpix_order, config.oversampling) if local else 0.0
    optimiser = OptimiserState(
        healpix_order=config.healpix_order,
        offset_range_px=config.offset_range_px,
        offset_step_px=config.offset_step_px,
        local_searches=local,
        sigma_rot_deg=sigma,
        sigma_tilt_deg=sigma,
        sigma_psi_deg=sigma,
        smallest_changes_classes=RESET_SMALLEST_CHANGES_CLASSES,
        smallest_changes_offsets_angstrom=RESET_SMALLEST_CHANGES,
        smallest_changes_orientations_deg=RESET_SMALLEST_CHANGES,
    )
    if not config.skip_align:
        optimiser = perturbed(optimiser, rng)
    return optimiser, ScheduleState(incr_size_px=int(config.incr_size_px))


def perturbed(optimiser, rng: np.random.Generator):
    """`optimiser` with the sampling's random perturbation one step further along its walk, drawn from `rng`
    (RELION's resetRandomlyPerturbedSampling: once as the sampling is set up, `initial_schedule`, and before each
    iteration's search, the jobs' plans)."""
    from cryorefine.core.sampling import PERTURBATION_FACTOR, next_perturbation

    return dataclasses.replace(optimiser, perturbation=next_perturbation(optimiser.perturbation, PERTURBATION_FACTOR,
                                                                          rng))


def sampling_from_optimiser(optimiser, config):
    """The core.sampling.Sampling of the optimiser's current order, offsets and perturbation."""
    from cryorefine.core.sampling import Sampling

    return Sampling(optimiser.healpix_order, optimiser.offset_range_px, optimiser.offset_step_px,
                    symmetry=config.symmetry, oversampling=config.oversampling,
                    perturbation=optimiser.perturbation)


# ---------------------------------------------------------------- resolution


DEFAULT_START_RESOLUTION_ANGSTROM = 60.0  # without --ini_high: RELION's GUI default, for the first image size


def starting_resolution_angstrom(config) -> float:
    """The resolution the first iteration's image size comes from: --ini_high, else 60 Å."""
    return config.ini_high_angstrom if config.ini_high_angstrom else DEFAULT_START_RESOLUTION_ANGSTROM


def current_resolution(ori_size_px: int, pixel_size_angstrom: float, *, fsc_halves=None, data_vs_prior=None,
                       tau2_fudge: float = 1.0, halves_joined: bool = False, iteration: int = 1,
                       ini_high_angstrom: float | None = None, firstiter_cc: bool = False,
                       check_high_res_side: bool = True,
                       minres_map_shell: int = MINRES_MAP_SHELL) -> ResolutionEstimate:
    """RELION's updateCurrentResolution for a gold-standard auto-refine.

    Rule: at iteration 0 (and at iteration 1 with --firstiter_cc) with --ini_high the shell is
    round(ori_size·pixel_size / ini_high). Otherwise, walking out from shell 1, take the first
    shell whose spectral SNR (RELION's data_vs_prior) is below 1 and step back one shell; if,
    walking in from shell ori_size/2 − 1, the SNR is above 1 more than 3 shells further out, use
    that shell instead (FSC curves that dip and rise again); never below --minres_map (5 shells);
    over classes the highest shell wins.

    The SNR is `data_vs_prior` when given (dimensionless, per shell, (n,) or (K, n)), else
    ssnr_from_fsc(fsc_halves, tau2_fudge, halves_joined): fsc/(1−fsc)·tau2_fudge, so SNR < 1 is
    FSC < 0.5 between the halves (tau2_fudge 1), and, once the halves are joined
    (fsc → sqrt(2·fsc/(fsc+1))), FSC < 1/7 ≈ 0.143.

    RELION stores the new resolution even when it is worse than the previous one; the gain
    bookkeeping is `update_resolution_counter`.
    """
    n_angstrom = ori_size_px * pixel_size_angstrom
    use_ini_high = (ini_high_angstrom is not None and ini_high_angstrom > 0
                    and (iteration == 0 or (iteration == 1 and firstiter_cc)))
    if use_ini_high:
        shell = _relion_round(n_angstrom / ini_high_angstrom)
    else:
        if data_vs_prior is None:
            if fsc_halves is None:
                raise ValueError("current_resolution needs fsc_halves or data_vs_prior after iteration 0")
            from cryorefine.core.fsc import ssnr_from_fsc

            ssnr = ssnr_from_fsc(np.asarray(fsc_halves, dtype=np.float64), tau2_fudge, halves_joined)
        else:
            ssnr = np.asarray(data_vs_prior, dtype=np.float64)
        ssnr = np.atleast_2d(ssnr)
        half = ori_size_px // 2
        if ssnr.shape[-1] < half:
            raise ValueError(f"SNR spectrum has {ssnr.shape[-1]} shells, a {ori_size_px}-px box needs {half + 1}")
        shell = 0
        for row in ssnr:
            ires = 1
            while ires < half and not row[ires] < SSNR_RESOLUTION_THRESHOLD:
                ires += 1
            ires -= 1  # one shell back, on the safe side
            if check_high_res_side:
                ires2 = half - 1
                while ires2 >= ires and not row[ires2] > SSNR_RESOLUTION_THRESHOLD:
                    ires2 -= 1
                if ires2 > ires + HIGH_RES_SIDE_MIN_EXTRA_SHELLS:
                    ires = ires2
            shell = max(shell, ires)
        shell = max(shell, int(minres_map_shell))
    res_inv = shell / n_angstrom
    res = n_angstrom / shell if shell > 0 else math.inf
    return ResolutionEstimate(int(shell), float(res), float(res_inv))


# ---------------------------------------------------------------- image sizes


def image_sizes(resolution_angstrom: float, healpix_order: int, particle_diameter_angstrom: float,
                ori_size_px: int, pixel_size_angstrom: float, incr_size_px: int,
                has_high_fsc_at_resol_limit: bool, final_iteration: bool, *, ave_pmax: float,
                oversampling: int = 1, max_coarse_size_px: int = -1,
                strict_highres_exp_angstrom: float = -1.0) -> ImageSizes:
    """RELION's updateImageSizeAndResolutionPointers (one optics group at the model's pixel size).

    current: shell = round(ori_size·pixel_size / resolution); add round(0.25·ori_size/2) shells
    when the FSC was high at the size limit and ave_pmax > 0.1, else incr_size shells; size =
    2·shell (even); ori_size on the final iteration (RELION's do_use_all_data); at most ori_size.

    coarse: with --strict_highres_exp, 2·round(ori_size·pixel_size / strict_highres_exp); else,
    with oversampling > 0, the resolution at which the coarse angular step moves the particle's
    edge by a keep-safe fraction of a pixel: rotated distance = step/360·π·diameter (Å, the coarse
    step 360/(6·2^order) without oversampling), coarse resolution = that / 1.2, size =
    2·ceil(ori_size·pixel_size / coarse resolution), at most --coarse_size; without
    oversampling the current size. Never above the current size.
    """
    n_angstrom = ori_size_px * pixel_size_angstrom
    maxres = _relion_round(n_angstrom / resolution_angstrom) if math.isfinite(resolution_angstrom) else 0
    if ave_pmax > LARGE_SIZE_STEP_MIN_AVE_PMAX and has_high_fsc_at_resol_limit:
        maxres += _relion_round(LARGE_SIZE_STEP_FRACTION_OF_HALF_BOX * ori_size_px / 2)
    else:
        maxres += int(incr_size_px)
    current = 2 * maxres
    if final_iteration:
        current = ori_size_px
    current = min(current, ori_size_px)

    if strict_highres_exp_angstrom > 0:
        coarse = likelihood_size_px(strict_highres_exp_angstrom, ori_size_px, pixel_size_angstrom, ori_size_px)
    elif oversampling > 0:
        coarse_resolution_angstrom = keep_safe_resolution_angstrom(angular_step_deg(healpix_order),
                                                                   particle_diameter_angstrom)
        coarse = 2 * math.ceil(n_angstrom / coarse_resolution_angstrom)
        max_coarse = max_coarse_size_px if max_coarse_size_px > 0 else ori_size_px
        coarse = min(max_coarse, coarse)
    else:
        coarse = current
    coarse = min(current, coarse)
    return ImageSizes(int(current), int(coarse))


def coarse_size_2d_px(psi_step_deg: float, particle_diameter_angstrom: float, ori_size_px: int,
                      pixel_size_angstrom: float, current_size_px: int, max_coarse_size_px: int = -1) -> int:
    """The coarse pass's image size of a 2D classification with oversampling (RELION's
    updateImageSizeAndResolutionPointers with ref_dim 2): the coarse psi step moves the particle's edge by
    step/360·π·diameter; detail finer than that / COARSE_SIZE_KEEPSAFE_FACTOR_2D is not resolved;
    2·ceil(N·pixel / that), at most --coarse_size and the current size."""
    resolution = psi_step_deg / 360.0 * math.pi * particle_diameter_angstrom / COARSE_SIZE_KEEPSAFE_FACTOR_2D
    coarse = 2 * math.ceil(ori_size_px * pixel_size_angstrom / resolution)
    if max_coarse_size_px > 0:
        coarse = min(coarse, int(max_coarse_size_px))
    return int(min(coarse, current_size_px))


def keep_safe_resolution_angstrom(step_deg: float, particle_diameter_angstrom: float) -> float:
    """The finest detail an angular step resolves by RELION's keep-safe rule (the coarse size's): the step moves
    the particle's edge by its rotated distance step/360·π·diameter, and detail finer than that / 1.2 is not
    resolved."""
    return step_deg / 360.0 * math.pi * particle_diameter_angstrom / COARSE_SIZE_KEEPSAFE_FACTOR_3D


def likelihood_size_px(strict_highres_exp_angstrom: float, ori_size_px: int, pixel_size_angstrom: float,
                       current_size_px: int) -> int | None:
    """--strict_highres_exp: the image size both E-step passes compare, 2·round(ori_size·pixel_size / limit), at
    most the current size (RELION's coarse size then, used by its fine pass too; the sums keep the current size);
    None without the limit (≤ 0)."""
    if strict_highres_exp_angstrom <= 0:
        return None
    size = 2 * _relion_round(ori_size_px * pixel_size_angstrom / strict_highres_exp_angstrom)
    return min(int(current_size_px), size)


class FineStep(NamedTuple):
    step_deg: float  # the fine (oversampled) angular step
    resolves_angstrom: float  # the finest detail that step supports at the particle's edge
    compared_angstrom: float  # the finest detail the E-step compares (Nyquist of the current size)

    @property
    def too_coarse(self) -> bool:
        return self.resolves_angstrom > self.compared_angstrom


def fine_step(healpix_order: int, oversampling: int, particle_diameter_angstrom: float, current_size_px: int,
              ori_size_px: int, pixel_size_angstrom: float) -> FineStep:
    """The keep-safe rule RELION uses to size the coarse pass (`keep_safe_resolution_angstrom`), applied to the
    fine pass and the size the E-step compares. Not a RELION rule: classification keeps its sampling, and where
    the fine step resolves less than the E-step compares, the best class of a particle can follow the grid's luck
    (its pose's error), not its state (benchmarks/README.md, classification accuracy)."""
    step = angular_step_deg(healpix_order, oversampling)
    compared = ori_size_px * pixel_size_angstrom / (current_size_px / 2)
    return FineStep(step, keep_safe_resolution_angstrom(step, particle_diameter_angstrom), compared)


#: classification_sampling_raised: the fewest average pmax at which the fine pass is sampled finer
RAISED_SAMPLING_MIN_AVE_PMAX = 0.5


#: classification_sampling_raised's reasons
RAISED_WHILE_RESOLUTION_GROWS = "resolution can still grow"
RAISED_AT_STALL = "classes stalled"


def classification_sampling_raised(changes_classes, ave_pmax: float | None, step: FineStep, box_step: FineStep):
    """Whether a classification samples one order of oversampling finer from this iteration on, and why (None:
    not). `step` is RELION's fine step (at --oversampling) against the size the E-step compares now, `box_step`
    the same step against the most it may compare (the whole box, or --strict_highres_exp's size);
    `changes_classes` holds the share of particles changing class, one value per iteration so far (the first,
    against the starting classes). Either way the average pmax of the last
    iteration (None: not a likelihood's, after --firstiter_cc) must be at least RAISED_SAMPLING_MIN_AVE_PMAX (the
    finer pass costs up to 32× its children per significant coarse sample; at low pmax there are many), and:

    - RAISED_WHILE_RESOLUTION_GROWS: the E-step compares less than it may and the step is too coarse for that
      most, so finer poses can still raise the resolution; or
    - RAISED_AT_STALL: the step is too coarse for what the E-step compares, and the share of particles changing
      class has stopped falling (the last no smaller than every one before it, the first left out).

    Not a RELION rule (RELION keeps --oversampling). On a two-state 64 px set at RELION's sampling the share of
    particles in their true class fell once the resolution passed what the step resolves; one order finer from
    iteration 2 kept it near its best, where one order finer from the stall (iteration 4) ended 4–8 points lower in
    two seeds of three. Where the E-step already compares the whole box (the CI mixture, 32 px at Nyquist from the
    first iteration) finer poses cannot raise the resolution, and sampled finer from the start they froze the
    random starting split (one class's own noise pulls its particles): there the rule waits for the stall
    (benchmarks/README.md, classification accuracy)."""
    if ave_pmax is None or ave_pmax < RAISED_SAMPLING_MIN_AVE_PMAX or len(changes_classes) < 1:
        return None
    if box_step.too_coarse and step.compared_angstrom > box_step.compared_angstrom * (1.0 + 1e-9):
        return RAISED_WHILE_RESOLUTION_GROWS
    changes = np.asarray(changes_classes, dtype=np.float64)[1:]
    if step.too_coarse and changes.size >= 2 and changes[-1] >= changes[:-1].min():
        return RAISED_AT_STALL
    return None


#: --fast_subsets (MlOptimiser::updateSubsetSize, 3D): particles per class in iterations 1–5 (3× that in 6–10)
FAST_SUBSET_PARTICLES_PER_CLASS = 1500
FAST_SUBSET_PARTICLES_PER_CLASS_2D = 100  # RELION's min_parts_per_class with ref_dim 2
#: ... and the share of the data set that iterations 11–15 take at least
FAST_SUBSET_LATE_FRACTION = 0.3
#: --allow_coarser_sampling (MlOptimiser::updateAngularSampling): the steps stay this fraction of the accuracy
COARSER_SAMPLING_FRACTION_OF_ACCURACY = 0.8
#: ... and the offset step below this fraction of the offset range
COARSER_SAMPLING_MAX_OFFSET_STEP_IN_RANGES = 0.95


def fast_subset_size(iteration: int, n_classes: int, n_particles: int,
                     per_class_min: int | None = None) -> int | None:
    """The particles a 3D classification with --fast_subsets takes in `iteration` (RELION's updateSubsetSize):
    1500·K in iterations 1–5, 4500·K in 6–10, the larger of 4500·K and 30 % of the data in 11–15; None (all of
    them) after, or where the subset would not be smaller than the data set. A 2D classification's subsets start
    from `per_class_min` = FAST_SUBSET_PARTICLES_PER_CLASS_2D (100) particles per class instead (None:
    FAST_SUBSET_PARTICLES_PER_CLASS, read when called)."""
    per_class = int(FAST_SUBSET_PARTICLES_PER_CLASS if per_class_min is None else per_class_min) * int(n_classes)
    if iteration <= 5:
        size = per_class
    elif iteration <= 10:
        size = 3 * per_class
    elif iteration <= 15:
        size = int(max(3 * per_class, FAST_SUBSET_LATE_FRACTION * n_particles))
    else:
        return None
    return size if size < n_particles else None


def coarser_sampling(optimiser, config, *, particle_diameter_angstrom: float, resolution_angstrom: float,
                     pixel_size_angstrom: float, cc_iteration: bool):
    """The optimiser with RELION's --allow_coarser_sampling steps for a 3D classification of more than one class
    (MlOptimiser::updateAngularSampling): from --healpix_order, the coarsest order whose oversampled step stays
    finer than 0.8 × the rotational accuracy (in a --firstiter_cc iteration the step of the resolution at the
    particle's edge, 360 / ⌈π·diameter / resolution⌉), never finer than --healpix_order; the offset step 0.8 × the
    translational accuracy × 2^oversampling, between --offset_step and 0.95 × the offset range. An accuracy
    RELION has not estimated (999) leaves the order at --healpix_order, and gives the widest offset step, as in
    RELION."""
    if cc_iteration:
        limit_deg = 360.0 / math.ceil(math.pi * particle_diameter_angstrom / resolution_angstrom)
    else:
        limit_deg = optimiser.acc_rot_deg
    order = int(config.healpix_order)
    if limit_deg < UNKNOWN_ACCURACY:
        while order > 0 and angular_step_deg(order, config.oversampling) < (
                COARSER_SAMPLING_FRACTION_OF_ACCURACY * limit_deg):
            order -= 1
        if order < config.healpix_order and angular_step_deg(order, config.oversampling) >= (
                COARSER_SAMPLING_FRACTION_OF_ACCURACY * limit_deg):
            order += 1  # the finest order coarser than --healpix_order that still resolves the accuracy
    step_px = (COARSER_SAMPLING_FRACTION_OF_ACCURACY * optimiser.acc_trans_angstrom / pixel_size_angstrom
               * 2 ** int(config.oversampling))
    step_px = min(step_px, COARSER_SAMPLING_MAX_OFFSET_STEP_IN_RANGES * optimiser.offset_range_px)
    step_px = max(step_px, float(config.offset_step_px))
    return dataclasses.replace(optimiser, healpix_order=order, offset_step_px=step_px)


def update_size_flags_from_fsc(optimiser, state: ScheduleState, fsc_halves, current_size_px: int):
    """RELION's check after the half-map FSC (MlOptimiserMpi::maximization, before the M-step).

    incr_size grows to at least (first shell with FSC < 0.143) − (first shell with FSC < 0.5)
    + 5 (a shell index of −1 when the FSC never drops); has_high_fsc_at_resol_limit becomes
    true, and stays true, once the FSC at shell current_size/2 − 1 exceeds 0.2.
    `fsc_halves` is (n,) or (K, n) (the first row is used, as RELION uses body 0).
    Returns (optimiser, state).
    """
    fsc = np.atleast_2d(np.asarray(fsc_halves, dtype=np.float64))[0]
    below05 = np.flatnonzero(fsc < FSC_HALF_THRESHOLD)
    below0143 = np.flatnonzero(fsc < FSC_GOLD_THRESHOLD)
    fsc05 = int(below05[0]) if below05.size else -1
    fsc0143 = int(below0143[0]) if below0143.size else -1
    incr = max(int(state.incr_size_px), fsc0143 - fsc05 + INCR_SIZE_EXTRA_SHELLS)
    high = bool(optimiser.has_high_fsc_at_resol_limit)
    if not high:
        i = min(max(current_size_px // 2 - 1, 0), fsc.size - 1)
        high = bool(fsc[i] > HIGH_FSC_AT_LIMIT_THRESHOLD)
    return (dataclasses.replace(optimiser, has_high_fsc_at_resol_limit=high),
            dataclasses.replace(state, incr_size_px=incr))


# ---------------------------------------------------------------- changes in hidden variables


def hidden_variable_changes_from_sums(sum_orientation_changes_deg: float, sum_offset_changes2_angstrom2: float,
                                      n_class_changes: float, count: float) -> HiddenVariableChanges:
    """RELION's updateOverallChangesInHiddenVariables averages of per-particle sums.

    Per particle the caller adds: the angular distance (degrees, `angular_distance_deg`) between
    the previous and the new best orientation; the squared distance |Δoffset|² in Å² (x, y);
    1 if the best class changed. Orientations: mean; offsets: sqrt(sum / (2·count)), the RMS
    change per dimension in Å; classes: fraction. All 0 when count is 0.
    """
    if count <= 0:
        return HiddenVariableChanges(0.0, 0.0, 0.0)
    return HiddenVariableChanges(float(sum_orientation_changes_deg / count),
                                 float(math.sqrt(sum_offset_changes2_angstrom2 / (2.0 * count))),
                                 float(n_class_changes / count))


def angular_distance_deg(rot1_deg, tilt1_deg, psi1_deg, rot2_deg, tilt2_deg, psi2_deg, symmetry_matrices=None,
                         xp=np):
    """RELION's HealpixSampling::calculateAngularDistance (3D), per particle.

    The mean over the three rows of the Euler matrices of the angle (degrees) between
    corresponding rows of E1 and E2·R, minimised over the symmetry operators R (identity included;
    None: identity only). Shapes broadcast; this is the per-particle orientation change that
    `hidden_variable_changes_from_sums` sums.
    """
    from cryorefine.core.euler import euler_to_matrix

    e1 = euler_to_matrix(rot1_deg, tilt1_deg, psi1_deg, xp=xp)
    e2 = euler_to_matrix(rot2_deg, tilt2_deg, psi2_deg, xp=xp)
    ops = [None] if symmetry_matrices is None else xp.asarray(symmetry_matrices, dtype=xp.float64)
    best = None
    for r in ops:
        e2r = e2 if r is None else e2 @ r
        dots = xp.clip(xp.sum(e1 * e2r, axis=-1), -1.0, 1.0)  # rows i of E1 and E2·R
        dist = xp.mean(xp.rad2deg(xp.arccos(dots)), axis=-1)
        best = dist if best is None else xp.minimum(best, dist)
    return best


def hidden_variable_changes(old, new, pixel_size_angstrom: float, symmetry: str) -> HiddenVariableChanges:
    """The changes from ParticleState `old` to `new`: mean orientation change (degrees, modulo the
    point group), RMS offset change per dimension (Å) and the fraction of particles that changed class. The angular
    distances are computed for the particles whose angles changed alone, the others' being 0: a gradient run's
    iteration moves only its mini-batch (on the CPU machine with nothing else running, 0.08 s an iteration for all of
    105,247 particles, 3 ms for 1 % of them)."""
    from cryorefine.core.symmetry import symmetry_group

    mats = symmetry_group(symmetry).rotations if symmetry.upper() != "C1" else None
    moved = np.flatnonzero((old.rot_deg != new.rot_deg) | (old.tilt_deg != new.tilt_deg)
                           | (old.psi_deg != new.psi_deg))
    angles = angular_distance_deg(old.rot_deg[moved], old.tilt_deg[moved], old.psi_deg[moved], new.rot_deg[moved],
                                  new.tilt_deg[moved], new.psi_deg[moved], symmetry_matrices=mats)
    d2 = (((new.origin_x_px - old.origin_x_px) ** 2 + (new.origin_y_px - old.origin_y_px) ** 2)
          * pixel_size_angstrom ** 2)
    return hidden_variable_changes_from_sums(float(np.sum(angles)), float(np.sum(d2)),
                                             float(np.sum(new.class_index != old.class_index)), float(new.rot_deg.size))


def update_hidden_variable_counters(optimiser, changes_orientations_deg: float, changes_offsets_angstrom: float,
                                    changes_classes: float, *, pixel_size_angstrom: float, oversampling: int,
                                    step_healpix_order: int | None = None, step_offset_px: float | None = None):
    """RELION's updateOverallChangesInHiddenVariables (the counter part).

    nr_iter_wo_large_hidden_variable_changes goes up by one when all three changes are "not
    large": 1.03·classes ≥ smallest so far, and for offsets and orientations either a change below
    40 % of the (oversampled) step or 1.03·change ≥ smallest so far; otherwise it is reset to 0.
    Then the smallest changes so far are updated (the class change rounded to an integer, as RELION
    does). Offsets in Å; the offset step is offset_step_px·pixel_size / 2^oversampling. The steps
    are those of HEALPix order `step_healpix_order` and offset step `step_offset_px` where given
    (`ScheduleState.counted_healpix_order`), else the optimiser's current ones.
    """
    order = optimiser.healpix_order if step_healpix_order is None else step_healpix_order
    offset_step_px = optimiser.offset_step_px if step_offset_px is None else step_offset_px
    ang_step = angular_step_deg(order, oversampling)
    off_step_angstrom = offset_step_px * pixel_size_angstrom / 2 ** int(oversampling)
    ratio_orient = changes_orientations_deg / ang_step
    ratio_trans = changes_offsets_angstrom / off_step_angstrom
    f = SIMILAR_CHANGES_FACTOR
    not_large = (f * changes_classes >= optimiser.smallest_changes_classes
                 and (ratio_trans < SMALL_CHANGES_FRACTION_OF_STEP
                      or f * changes_offsets_angstrom >= optimiser.smallest_changes_offsets_angstrom)
                 and (ratio_orient < SMALL_CHANGES_FRACTION_OF_STEP
                      or f * changes_orientations_deg >= optimiser.smallest_changes_orientations_deg))
    counter = optimiser.nr_iter_wo_large_hidden_variable_changes + 1 if not_large else 0
    smallest_cls = optimiser.smallest_changes_classes
    if changes_classes < smallest_cls:
        smallest_cls = float(_relion_round(changes_classes))
    return dataclasses.replace(
        optimiser,
        changes_optimal_orientations_deg=float(changes_orientations_deg),
        changes_optimal_offsets_angstrom=float(changes_offsets_angstrom),
        changes_optimal_classes=float(changes_classes),
        nr_iter_wo_large_hidden_variable_changes=int(counter),
        smallest_changes_classes=smallest_cls,
        smallest_changes_offsets_angstrom=min(optimiser.smallest_changes_offsets_angstrom,
                                              float(changes_offsets_angstrom)),
        smallest_changes_orientations_deg=min(optimiser.smallest_changes_orientations_deg,
                                              float(changes_orientations_deg)),
    )


def update_resolution_counter(optimiser, resolution_angstrom: float, previous_resolution_angstrom: float):
    """RELION's resolution-gain bookkeeping in updateCurrentResolution.

    With resolutions in 1/Å (inf Å = 0): no gain when new ≤ previous + 0.0001, then
    nr_iter_wo_resol_gain goes up by one; a gain resets it to 0. The best resolution so far is
    kept (RELION no longer uses it).
    """
    new_inv = 1.0 / resolution_angstrom if resolution_angstrom > 0 else 0.0
    old_inv = 1.0 / previous_resolution_angstrom if previous_resolution_angstrom > 0 else 0.0
    if new_inv <= old_inv + RESOLUTION_GAIN_TOLERANCE_INV_ANGSTROM:
        counter = optimiser.nr_iter_wo_resol_gain + 1
    else:
        counter = 0
    return dataclasses.replace(optimiser, nr_iter_wo_resol_gain=int(counter),
                               best_resolution_so_far_inv_angstrom=max(optimiser.best_resolution_so_far_inv_angstrom,
                                                                       new_inv))


def update_change_counters(optimiser, changes_orientations_deg: float, changes_offsets_angstrom: float,
                           changes_classes: float, resolution_angstrom: float, *,
                           previous_resolution_angstrom: float, pixel_size_angstrom: float, oversampling: int,
                           counted: ScheduleState | None = None):
    """After the M-step: `update_hidden_variable_counters` then `update_resolution_counter`.

    changes_*: the E-step's averages (`hidden_variable_changes_from_sums`); resolution_angstrom:
    the new `current_resolution`; previous_resolution_angstrom: the one before it
    (model.current_resolution_angstrom before it is overwritten); `counted`: the schedule whose
    counted_* sampling the changes are measured against (None: the current sampling).
    """
    optimiser = update_hidden_variable_counters(
        optimiser, changes_orientations_deg, changes_offsets_angstrom, changes_classes,
        pixel_size_angstrom=pixel_size_angstrom, oversampling=oversampling,
        step_healpix_order=None if counted is None else counted.counted_healpix_order,
        step_offset_px=None if counted is None else counted.counted_offset_step_px)
    return update_resolution_counter(optimiser, resolution_angstrom, previous_resolution_angstrom)


# ---------------------------------------------------------------- sampling and convergence


def update_sampling(optimiser, model, config, state: ScheduleState, *, auto_ignore_angle_changes: bool = False,
                    auto_resolution_based_angles: bool = False, minimum_angular_sampling_deg: float = 0.0,
                    maximum_angular_sampling_deg: float = 0.0, local_searches_allowed: bool = True):
    """RELION's updateAngularSampling for a 3D gold-standard auto-refine (iterations > 1).

    Proceed only when the resolution has not improved for MAX_NR_ITER_WO_RESOL_GAIN iterations
    (or, with --auto_resol_angles, the step 360/ceil(π·diameter/resolution) is finer than the
    current one and the next order is not the local-search order) and the hidden variables have
    not changed much for MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES iterations (or
    --auto_ignore_angles). Then:

    - if the current (oversampled) angular step is below 0.75·acc_rot (or below
      --maximum_angular_sampling), the sampling is fine enough: nothing changes and
      state.has_fine_enough_angular_sampling becomes true;
    - otherwise: offsets in Å, step = min(1.5 Å, 0.75·acc_trans)·2^oversampling, range =
      5 × the last RMS offset change, at most 1.3 × the old range, at least 1.5 steps; halved if
      above 4 steps, and if still above 4 steps the step becomes range/4; a step coarser than the
      current one keeps the old step and range. HEALPix order + 1. Both counters reset to 0 and
      the smallest changes to 9999999 / 999 / 999. At order ≥ --auto_local_healpix_order local
      searches switch on with σ_rot = σ_tilt = σ_psi = 2 × the new oversampled step. Without
      `local_searches_allowed` (RELION's rule for a gradient run that is not an auto-refine, --grad
      --auto_sampling) the order is raised only while it stays below --auto_local_healpix_order, and
      local searches never start; the offsets change all the same.

    Offsets in OptimiserState are in px: converted with model.pixel_size_angstrom.
    Returns (optimiser, state).
    """
    os_ = int(config.oversampling)
    pixel = float(model.pixel_size_angstrom)
    old_step_deg = angular_step_deg(optimiser.healpix_order, os_)

    proceed_res = False
    if auto_resolution_based_angles and math.isfinite(model.current_resolution_angstrom):
        diameter = default_particle_diameter_angstrom(config, model.ori_size_px, pixel)
        n_steps = math.ceil(math.pi * diameter / model.current_resolution_angstrom)
        proceed_res = (n_steps > 0 and 360.0 / n_steps < old_step_deg
                       and optimiser.healpix_order + 1 != config.auto_local_healpix_order)
    proceed_res = proceed_res or optimiser.nr_iter_wo_resol_gain >= MAX_NR_ITER_WO_RESOL_GAIN
    proceed_hidden = (auto_ignore_angle_changes or optimiser.nr_iter_wo_large_hidden_variable_changes
                      >= MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES)
    if not (proceed_res and proceed_hidden):
        return optimiser, state

    if ((maximum_angular_sampling_deg > 0 and old_step_deg < maximum_angular_sampling_deg)
            or (old_step_deg < FINE_ENOUGH_FRACTION_OF_ACCURACY * optimiser.acc_rot_deg
                and not (minimum_angular_sampling_deg > 0 and old_step_deg > minimum_angular_sampling_deg))):
        return optimiser, dataclasses.replace(state, has_fine_enough_angular_sampling=True)

    # A. translations, in Å
    old_offset_step = optimiser.offset_step_px * pixel
    old_offset_range = optimiser.offset_range_px * pixel
    new_step = min(MAX_OFFSET_STEP_ANGSTROM, OFFSET_STEP_FRACTION_OF_ACCURACY * optimiser.acc_trans_angstrom) * 2 ** os_
    new_range = OFFSET_RANGE_IN_CHANGES * optimiser.changes_optimal_offsets_angstrom
    new_range = min(MAX_OFFSET_RANGE_GROWTH * old_offset_range, new_range)
    new_range = max(new_range, MIN_OFFSET_RANGE_IN_STEPS * new_step)
    if new_range > MAX_OFFSET_RANGE_IN_STEPS * new_step:
        new_range /= 2.0
    if new_range > MAX_OFFSET_RANGE_IN_STEPS * new_step:
        new_step = new_range / MAX_OFFSET_RANGE_IN_STEPS
    if new_step > old_offset_step:
        new_step, new_range = old_offset_step, old_offset_range

    # B. twice as fine angular sampling (a gradient run: only up to the order before local searches)
    new_order = optimiser.healpix_order + 1
    if not local_searches_allowed and new_order >= config.auto_local_healpix_order:
        new_order = optimiser.healpix_order
    updates = dict(
        healpix_order=new_order,
        offset_step_px=new_step / pixel,
        offset_range_px=new_range / pixel,
        nr_iter_wo_resol_gain=0,
        nr_iter_wo_large_hidden_variable_changes=0,
        smallest_changes_classes=RESET_SMALLEST_CHANGES_CLASSES,
        smallest_changes_offsets_angstrom=RESET_SMALLEST_CHANGES,
        smallest_changes_orientations_deg=RESET_SMALLEST_CHANGES,
    )
    if local_searches_allowed and new_order >= config.auto_local_healpix_order:
        sigma = local_search_sigma_deg(new_order, os_)
        updates.update(local_searches=True, sigma_rot_deg=sigma, sigma_tilt_deg=sigma, sigma_psi_deg=sigma)
    return (dataclasses.replace(optimiser, **updates),
            dataclasses.replace(state, has_fine_enough_angular_sampling=False))


def check_convergence(optimiser, state: ScheduleState, *, auto_ignore_angle_changes: bool = False):
    """RELION's checkConvergence (called at the start of each iteration).

    Converged when the sampling is fine enough (state.has_fine_enough_angular_sampling, set by
    update_sampling when the step fell below 0.75·acc_rot), the resolution has not improved for
    MAX_NR_ITER_WO_RESOL_GAIN iterations and the hidden variables have not changed much for
    MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES iterations (or --auto_ignore_angles). Then this
    iteration is the final one: has_converged and do_join_halves are set, which makes
    `image_sizes` use the whole box and `current_resolution` (halves_joined) report FSC 0.143.
    """
    if optimiser.has_converged:
        return optimiser
    converged = (state.has_fine_enough_angular_sampling
                 and optimiser.nr_iter_wo_resol_gain >= MAX_NR_ITER_WO_RESOL_GAIN
                 and (auto_ignore_angle_changes or optimiser.nr_iter_wo_large_hidden_variable_changes
                      >= MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES))
    if not converged:
        return optimiser
    return dataclasses.replace(optimiser, has_converged=True, do_join_halves=True)


# ---------------------------------------------------------------- estimated accuracies


@functools.cache
def rotation_trials_deg() -> tuple:
    """RELION's trial angular errors: steps 0.05/0.1/0.2/0.5/1/2/5° below 0.2/1/2/5/10/20/∞°,
    accumulated in double precision, up to the first value beyond 30°."""
    out, e = [], 0.0
    while True:
        step = (0.05 if e < 0.2 else 0.1 if e < 1.0 else 0.2 if e < 2.0 else 0.5 if e < 5.0
                else 1.0 if e < 10.0 else 2.0 if e < 20.0 else 5.0)
        e += step
        out.append(e)
        if e > MAX_ACCURACY_SEARCH_ROT_DEG:
            return tuple(out)


@functools.cache
def translation_trials_px() -> tuple:
    """RELION's trial shifts: steps 0.1/0.2/0.5/1/2 px below 1/2/5/10/∞ px, up to the first beyond 10 px."""
    out, e = [], 0.0
    while True:
        step = 0.1 if e < 1.0 else 0.2 if e < 2.0 else 0.5 if e < 5.0 else 1.0 if e < 10.0 else 2.0
        e += step
        out.append(e)
        if e > MAX_ACCURACY_SEARCH_TRANS_PX:
            return tuple(out)


@functools.cache
def _rotation_axis_factors() -> tuple:
    """Nodes g and weights w (sum 1) of the distance-to-axis factor of a rotation error.

    A point at radius r on the central slice moves by 2·sin(δ/2)·r·g, g = sqrt(1 − sin²θ·cos²φ),
    θ the angle between the rotation axis and the viewing direction, φ the in-plane angle to the
    axis. RELION perturbs rot, tilt or psi with probability 1/3 each: psi turns about the viewing
    direction (θ = 0, g = 1), tilt about an in-plane axis (θ = 90°), rot about the particle's z
    axis, at θ = the particle's tilt, taken uniform on the sphere (cosθ uniform).
    """
    phi = (np.arange(_N_PHI) + 0.5) * np.pi / _N_PHI
    c, wc = np.polynomial.legendre.leggauss(_N_COS_THETA)  # cosθ on [−1, 1], weights sum 2
    g_psi = np.ones(1)
    w_psi = np.full(1, 1.0 / 3.0)
    g_tilt = np.abs(np.sin(phi))
    w_tilt = np.full(_N_PHI, 1.0 / (3.0 * _N_PHI))
    sin2 = 1.0 - c * c
    g_rot = np.sqrt(1.0 - sin2[:, None] * np.cos(phi)[None, :] ** 2).ravel()
    w_rot = (wc[:, None] / 2.0 / _N_PHI / 3.0 * np.ones(_N_PHI)[None, :]).ravel()
    g = np.concatenate([g_psi, g_tilt, g_rot])
    w = np.concatenate([w_psi, w_tilt, w_rot])
    return g, w


def _half_plane_grid(size_px: int):
    """(kx, ky, shell) of the coefficients RELION sums over in an image of `size_px`: kx ≥ 0,
    ky in [−size/2, size/2), without the ky < 0 half of the kx = 0 column, shells 1 … size/2."""
    ky = np.arange(size_px) - size_px // 2
    kx = np.arange(size_px // 2 + 1)
    kxx, kyy = np.meshgrid(kx, ky)
    shell = np.floor(np.sqrt(kxx * kxx + kyy * kyy) + 0.5).astype(np.int64)
    keep = ~((kxx == 0) & (kyy < 0)) & (shell >= 1) & (shell <= size_px // 2)
    return kxx[keep].astype(np.float64), kyy[keep].astype(np.float64), shell[keep]


def _ball_correlation(u):
    """Fourier-space correlation of a density filling a ball, at dimensionless distance u =
    2π·R·Δk: 3(sin u − u cos u)/u³ (1 − u²/10 for small u)."""
    u = np.asarray(u, dtype=np.float64)
    small = u < 1e-3
    us = np.where(small, 1.0, u)
    exact = 3.0 * (np.sin(us) - us * np.cos(us)) / us ** 3
    return np.where(small, 1.0 - u * u / 10.0, exact)


def estimated_accuracy(signal_power_per_shell, sigma2_noise_per_shell, *, ori_size_px: int,
                       pixel_size_angstrom: float, current_size_px: int, particle_diameter_angstrom: float,
                       mean_ctf2_per_shell=1.0, sigma2_fudge: float = 1.0) -> Accuracy:
    """Expected angular and translational accuracy, a spectral version of RELION's
    calculateExpectedAngularErrors.

    RELION's rule: for up to 100 particles, project the reference at the particle's pose, perturb
    rot, tilt or psi (at random) by a growing error δ, or x or y by a growing shift s, and take
    the first trial error at which Σ_k CTF²·|F₁ − F₂|² / (2·sigma2_fudge·σ²(k)) over the image at
    the current size (shells 1 … current_size/2, half plane) exceeds ln 100 = 4.60517 (the two
    poses' likelihoods differ 100-fold); averaged over particles. Trial errors follow RELION's
    ladder (0.05° … 5° steps up to 30°; 0.1 … 2 px steps up to 10 px).

    Here the sum is replaced by its expectation from per-shell spectra (shell r in px of the
    original box, one value per shell 0 … ori_size/2):
    - shifts (exact for a given spectrum): |F₁ − F₂|² = P(r)·4·sin²(π·k_x·s/ori_size), summed over
      the half-plane coefficients, x and y shifts averaged;
    - rotations (model): a coefficient at radius r moves by Δ = 2·sin(δ/2)·r·g (g from the
      geometry of the rotation axis, averaged over the three Euler angles and in-plane angles),
      and for a density filling a ball of diameter `particle_diameter_angstrom` the expected
      |F(k) − F(k+Δ)|² = 2·P(r)·(1 − ρ(2π·R·Δ/ori_size)), ρ(u) = 3(sin u − u·cos u)/u³, R the
      radius in px; the number of coefficients per shell is counted on the half plane.

    Limits of the model: it treats the density as random inside the ball, which holds at high
    resolution. At low resolution a reference is close to a round blob whose projections hardly
    change under rotation, so this acc_rot is then smaller (more optimistic) than RELION's: on
    RELION's own 70 Å spectra (ref_it002_model.star) it gives about 5° where RELION reported its
    30.1° cap; translations agree within a factor of about 1.5 there. Where the projector is at
    hand, `rotation_error_deg_from_snr` / `shift_error_px_from_snr` give RELION's own estimate.

    signal_power_per_shell: power of the reference's projections per Fourier coefficient, in the
        units of sigma2_noise_per_shell (RELION's τ² and σ² share them); see
        `estimated_accuracy_from_model`.
    sigma2_noise_per_shell: image noise power per coefficient; shells with σ² ≤ 0 are skipped.
    mean_ctf2_per_shell: mean CTF² per shell over the particles (scalar or per shell); 1 without CTF.
    Returns Accuracy(rotations_deg, translations_angstrom) (translations: pixel_size × shift).
    """
    p = np.asarray(signal_power_per_shell, dtype=np.float64).reshape(-1)
    s2 = np.asarray(sigma2_noise_per_shell, dtype=np.float64).reshape(-1)
    ctf2 = np.broadcast_to(np.asarray(mean_ctf2_per_shell, dtype=np.float64), p.shape)
    n = min(p.size, s2.size)
    ok = (s2[:n] > 0) & np.isfinite(s2[:n]) & np.isfinite(p[:n])
    # per-coefficient SNR term CTF²·P / (2·fudge·σ²) by shell
    term = np.zeros(n)
    term[ok] = ctf2[:n][ok] * np.maximum(p[:n][ok], 0.0) / (2.0 * sigma2_fudge * s2[:n][ok])

    kx, ky, shell = _half_plane_grid(int(current_size_px))
    inside = shell < n
    kx, ky, shell = kx[inside], ky[inside], shell[inside]
    coef_term = term[shell]

    def shift_snr(s_px):
        a = np.pi * s_px / ori_size_px
        return float(np.sum(coef_term * 2.0 * (np.sin(a * kx) ** 2 + np.sin(a * ky) ** 2)))

    counts = np.bincount(shell, minlength=n)[:n].astype(np.float64)
    shell_term = counts * term  # Σ over the coefficients of a shell
    radii = np.arange(n, dtype=np.float64)
    used = shell_term > 0
    radii, shell_term = radii[used], shell_term[used]
    g, w = _rotation_axis_factors()
    radius_px = 0.5 * particle_diameter_angstrom / pixel_size_angstrom

    def rotation_snr(delta_deg):
        chord = 2.0 * math.sin(math.radians(delta_deg) / 2.0)
        u = 2.0 * np.pi * radius_px * chord * radii[:, None] * g[None, :] / ori_size_px
        decorrelation = 2.0 * (1.0 - _ball_correlation(u)) @ w
        return float(np.sum(shell_term * decorrelation))

    acc_rot = rotation_error_deg_from_snr(rotation_snr)
    acc_trans_px = shift_error_px_from_snr(shift_snr)
    return Accuracy(float(acc_rot), float(acc_trans_px * pixel_size_angstrom))


def _first_resolved(trials, snr):
    """The first trial error whose SNR exceeds ln 100, else the last trial (RELION's cap)."""
    for e in trials:
        if snr(e) > ACCURACY_NEG_LOG_P:
            return e
    return trials[-1]


def rotation_error_deg_from_snr(snr_of_error_deg) -> float:
    """RELION's per-particle angular accuracy search, given the SNR function.

    `snr_of_error_deg(δ)` returns Σ_k CTF²·|F₁ − F₂|² / (2·σ²(k)) between the particle's
    reference projection at its pose and at the pose with rot, tilt or psi (RELION: one at
    random) moved by δ degrees. Returns the first of RELION's trial errors (0.05° steps, then
    0.1, 0.2, 0.5, 1, 2, 5° above 0.2, 1, 2, 5, 10, 20°) whose SNR exceeds ln 100, or 30.1° when
    none up to 30° does. RELION averages this over up to 100 particles: a projection-based
    estimate, as RELION computes it, is this function with the projector in `snr_of_error_deg`.
    """
    return float(_first_resolved(rotation_trials_deg(), snr_of_error_deg))


def shift_error_px_from_snr(snr_of_shift_px) -> float:
    """RELION's per-particle translational accuracy search (pixels), given the SNR function of a
    shift of x or y by s px; trial shifts 0.1 px steps, then 0.2, 0.5, 1, 2 px above 1, 2, 5,
    10 px, up to the first beyond 10 px. RELION reports pixel_size × the mean over particles (Å).
    """
    return float(_first_resolved(translation_trials_px(), snr_of_shift_px))


def _class_spectra(a, half):
    """(K, n) spectra of one half from a (2, K, n), (K, n) or (n,) array."""
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 3:
        a = a[min(half, a.shape[0] - 1)]
    return np.atleast_2d(a)


def estimated_accuracy_from_model(model, current_size_px: int, particle_diameter_angstrom: float, *,
                                  do_ctf: bool = False, mean_ctf2_per_shell=None, half: int = 0,
                                  sigma2_fudge: float = 1.0) -> Accuracy:
    """`estimated_accuracy` from a ModelState, per class, the best (smallest) over classes.

    As in RELION: classes with pdf_class < 0.01 get no estimate; the reference is half 1's
    (`half`, RELION's first follower computes it). The reference's projection power per shell is
    τ²·SSNR/(1 + SSNR) (model.tau2, model.ssnr = RELION's data_vs_prior): the power of a
    Wiener-filtered reconstruction, which is what RELION projects; τ² alone if ssnr is absent.
    Noise: the mean over optics groups of model.sigma2_noise (as 1/σ²). With CTFs and no CTF²
    spectrum, CTF² is taken as 0.5 (the mean of sin²). (999, 999) if nothing can be estimated.
    """
    if model.tau2 is None or model.sigma2_noise is None:
        return Accuracy(UNKNOWN_ACCURACY, UNKNOWN_ACCURACY)
    tau2 = _class_spectra(model.tau2, half)
    ssnr = None if model.ssnr is None else _class_spectra(model.ssnr, half)
    s2 = np.atleast_2d(np.asarray(model.sigma2_noise, dtype=np.float64))
    with np.errstate(divide="ignore"):
        inv = np.where(s2 > 0, 1.0 / np.where(s2 > 0, s2, 1.0), 0.0).mean(axis=0)
    sigma2 = np.where(inv > 0, 1.0 / np.where(inv > 0, inv, 1.0), 0.0)
    if mean_ctf2_per_shell is None:
        mean_ctf2_per_shell = MEAN_CTF2_WITHOUT_SPECTRUM if do_ctf else 1.0
    pdf = None if model.pdf_class is None else np.asarray(model.pdf_class, dtype=np.float64).reshape(-1)
    best_rot, best_trans = UNKNOWN_ACCURACY, UNKNOWN_ACCURACY
    for k in range(tau2.shape[0]):
        if pdf is not None and k < pdf.size and pdf[k] < MIN_CLASS_FRACTION_FOR_ACCURACY:
            continue
        power = tau2[k]
        if ssnr is not None:
            snr_k = np.maximum(ssnr[min(k, ssnr.shape[0] - 1)], 0.0)
            power = power * snr_k / (1.0 + snr_k)
        acc = estimated_accuracy(power, sigma2, ori_size_px=model.ori_size_px,
                                 pixel_size_angstrom=model.pixel_size_angstrom, current_size_px=current_size_px,
                                 particle_diameter_angstrom=particle_diameter_angstrom,
                                 mean_ctf2_per_shell=mean_ctf2_per_shell, sigma2_fudge=sigma2_fudge)
        best_rot = min(best_rot, acc.rotations_deg)
        best_trans = min(best_trans, acc.translations_angstrom)
    return Accuracy(float(best_rot), float(best_trans))

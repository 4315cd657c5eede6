"""RELION's per-iteration STAR outputs: model.star, optimiser.star, sampling.star, data.star's table.

Writers return {block name: dict (single values) or DataFrame (loop)} for `io.star.write_star`,
with RELION 4/5 labels in RELION's order (src/ml_model.cpp MlModel::write, src/ml_optimiser.cpp
MlOptimiser::write, src/healpix_sampling.cpp HealpixSampling::write):

- `model_star_blocks`: run_itNNN_half{1,2}_model.star (or run_itNNN_model.star): model_general,
  model_classes, model_class_N (spectra), model_groups, model_optics_group_N (noise spectra) and,
  when given, model_pdf_orient_class_N; `job_model_star_blocks`, the same for a job's particles (its
  optics and intensity groups, a half set's particles counted in that half's file).
- `optimiser_star_blocks` + `write_optimiser_star`: run_itNNN_optimiser.star, with the command
  line as a comment at the top as RELION writes it.
- `write_sampling_star`: run_itNNN_sampling.star (sampling_general, sampling_directions), the direction table's
  text made once for each HEALPix order and symmetry.

- `particle_table`: the particle table of run_itNNN_data.star with the run's poses; `data_star_write`, the write of
  that file in the writer's own process.

`read_optimiser_star` reads an optimiser.star's general block back. --continue itself reads
`io.resume`'s file beside the optimiser.star.

Units, as RELION 3.1+ writes them: rlnCurrentResolution, rlnAngstromResolution,
rlnEstimatedResolution in Å; rlnResolution and rlnBestResolutionThusFar in 1/Å;
rlnSigmaOffsetsAngst, rlnAccuracyTranslationsAngst, rlnOverallAccuracyTranslationsAngst and the
sampling's rlnOffsetRange/rlnOffsetStep in Å; angles in degrees. Floats are written with the
shortest text that reads back to the same float64 (Python's repr), so values round-trip exactly; the
sampling's direction table, which a run reads back from nowhere, with DIRECTION_DECIMALS decimals.

Deliberate differences from RELION's own files:
- model_classes has rlnClassPriorOffsetX/Y for 2D references only, as RELION writes them, always 0: the centre of
  the offsets' prior that the run used for every class (RELION moves it with the class's offsets).
- rlnFourierCompleteness and rlnSpectralOrientabilityContribution come from optional arguments
  and are 0 when not given (RELION's reader treats a missing completeness as 0 as well).
- model_pdf_orient_class_N is written only when `pdf_direction` is given; RELION's reader starts
  from a uniform distribution when the block is absent.
- optimiser.star's first line is RELION's (`# RELION optimiser; version 5.0.1-cryorefine-0.1.0`: RELION 5.0.1's
  layout, the suffix where RELION's build puts its own).
- optimiser_general has RELION 5's labels in RELION 5's order (MlOptimiser::write), adds rlnCoarseImageSize
  (a RELION 3.0 label RELION still knows), and leaves out the settings and state of gradient refinement
  (rlnGradEmIters, rlnGradHasConverged, rlnGradCurrentStepsize, rlnGradSubsetOrder,
  rlnGradSuspendFinerSamplingIter, rlnGradSuspendLocalSamplingIter, rlnSgd…): it is not run here
  (rlnDoGradientRefine and rlnDoStochasticGradientDescent say so), and RELION's reader defaults them.
- Non-finite floats are written as inf/nan, as RELION writes them (RELION reads them back as 0).
- With --solvent_correct_fsc (a model whose `fsc_unmasked` is set), model.star says which FSC
  rlnGoldStandardFsc is: model_general gets rlnDoSolventFscCorrection, rlnSolventMaskName and
  rlnRandomiseFrom (Å), and each model_class_N the postprocessing curves
  rlnFourierShellCorrelationUnmaskedMaps, rlnFourierShellCorrelationMaskedMaps and
  rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps (RELION's own labels of
  relion_postprocess, which RELION's model reader skips); rlnGoldStandardFsc is then the corrected
  curve, as RELION's refinement uses it.
"""

from __future__ import annotations

import functools
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd

from cryorefine import __version__
from cryorefine.core.sampling import PERTURBATION_FACTOR
from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path
from cryorefine.io.background import InOwnProcess
from cryorefine.io.star import FORMAT_CHUNK, ParticleStar, fixed_point_rows, read_star, star_to_string, write_star

NO_RESOLUTION_ANGSTROM = 999.0  # RELION's rlnAngstromResolution of shell 0
PRIOR_MODE_NONE = 0
PRIOR_MODE_ROT_TILT_PSI = 1  # RELION's PRIOR_ROTTILT_PSI, used for local searches
RELION_LAYOUT_VERSION = "5.0.1"  # the RELION whose files these are laid out as (optimiser.star's first line)
NO_TILT_LIMIT_DEG = -91.0  # RELION's rlnTiltAngleLimit when the tilt is not limited


# ---------------------------------------------------------------------------------- model.star

def model_star_blocks(model, optimiser, config, half: int | None,
                      reference_image_names: list[str], optics_group_names: list[str],
                      optics_group_counts: list[int], *, fourier_completeness=None,
                      pdf_direction=None, scale_groups=None,
                      reference_dimensionality: int = 3,
                      gradient_moment_images: tuple[Sequence[str], Sequence[str]] | None = None) -> dict:
    """Blocks of RELION's model.star for one half (1 or 2) or for the joined/classification model (None).

    Spectra of half h come from row h−1 of `model.tau2`, `model.ssnr`, `model.reference_sigma2`
    (row 0 when half is None); `model.fsc_halves` is the same in both halves' files. The noise
    spectra are per optics group (model_optics_group_N, `optics_group_names`), the intensity groups
    RELION's (`scale_groups`: their names and particle counts, as `data.ParticleSet
    .scale_group_names_and_counts`; default one per optics group): model_groups has a row per group
    with its particle count and `model.scale_correction`. Optional arrays, each (K, N//2+1) for the half
    written: `fourier_completeness` (rlnFourierCompleteness, 0 if None); rlnSpectralOrientabilityContribution is
    written as 0 (RELION's is for the user's information only);
    `pdf_direction` (K, n_directions) writes model_pdf_orient_class_N. A spectrum array that is
    None is written as zeros. `reference_dimensionality`: rlnReferenceDimensionality (2 for 2D class averages);
    `gradient_moment_images`: each class's first- and second-moment file names of a gradient run (model_classes'
    rlnGradMoment1 and rlnGradMoment2, after rlnReferenceImage as RELION writes them).
    """
    if half not in (None, 1, 2):
        raise ValueError(f"half must be 1, 2 or None, got {half!r}")
    row = 0 if half in (None, 1) else 1
    n_classes = int(model.n_classes)
    n_shells = int(model.n_shells)
    pixel = float(model.pixel_size_angstrom)
    ori_size = int(model.ori_size_px)
    names = [str(n) for n in reference_image_names]
    if len(names) != n_classes:
        raise ValueError(f"{len(names)} reference image names for {n_classes} classes")
    groups = [str(n) for n in optics_group_names]
    counts = [int(c) for c in optics_group_counts]
    if len(counts) != len(groups):
        raise ValueError(f"{len(groups)} optics group names but {len(counts)} particle counts")
    n_optics = len(groups)
    sigma2_noise = _array_or_zeros(model.sigma2_noise, (n_optics, n_shells), "sigma2_noise")
    scale_names, scale_counts = (groups, counts) if scale_groups is None else scale_groups
    n_groups = len(scale_names)
    scale = _array_or_value(model.scale_correction, (n_groups,), 1.0, "scale_correction")
    tau2 = _half_spectra(model.tau2, row, n_classes, n_shells, "tau2")
    ssnr = _half_spectra(model.ssnr, row, n_classes, n_shells, "ssnr")
    sigma2_ref = _half_spectra(model.reference_sigma2, row, n_classes, n_shells, "reference_sigma2")
    fsc = _array_or_zeros(model.fsc_halves, (n_classes, n_shells), "fsc_halves")
    completeness = _array_or_zeros(fourier_completeness, (n_classes, n_shells), "fourier_completeness")
    orientability = np.zeros((n_classes, n_shells))
    pdf_class = model.pdf_class if model.pdf_class is not None else model.class_distribution
    pdf_class = _array_or_value(pdf_class, (n_classes,), 1.0 / n_classes, "pdf_class")

    if reference_dimensionality not in (2, 3):
        raise ValueError(f"reference_dimensionality must be 2 or 3, got {reference_dimensionality!r}")
    blocks = {"model_general": {
        "rlnReferenceDimensionality": int(reference_dimensionality),
        "rlnDataDimensionality": 2,
        "rlnOriginalImageSize": ori_size,
        "rlnCurrentResolution": _f(model.current_resolution_angstrom),
        "rlnCurrentImageSize": int(model.current_size_px),
        "rlnPaddingFactor": _f(model.padding_factor),
        "rlnIsHelix": 0,
        "rlnFourierSpaceInterpolator": 1,
        "rlnMinRadiusNnInterpolation": 10,
        "rlnPixelSize": _f(pixel),
        "rlnNrClasses": n_classes,
        "rlnNrBodies": 1,
        "rlnNrGroups": n_groups,
        "rlnNrOpticsGroups": n_optics,
        "rlnTau2FudgeFactor": _f(config.tau2_fudge),
        "rlnNormCorrectionAverage": _f(model.avg_norm_correction),
        "rlnSigmaOffsetsAngst": _f(model.sigma_offset_angstrom),
        "rlnOrientationalPriorMode": PRIOR_MODE_ROT_TILT_PSI if optimiser.local_searches else PRIOR_MODE_NONE,
        "rlnSigmaPriorRotAngle": _f(optimiser.sigma_rot_deg),
        "rlnSigmaPriorTiltAngle": _f(optimiser.sigma_tilt_deg),
        "rlnSigmaPriorPsiAngle": _f(optimiser.sigma_psi_deg),
        "rlnLogLikelihood": _f(model.log_likelihood),
        "rlnAveragePmax": _f(model.ave_pmax),
    }}
    solvent_fsc = getattr(model, "fsc_unmasked", None) is not None
    if solvent_fsc:
        shell = int(model.randomise_from_shell)
        blocks["model_general"].update({
            "rlnDoSolventFscCorrection": 1,
            "rlnSolventMaskName": str(config.solvent_mask),
            "rlnRandomiseFrom": _f(ori_size * pixel / shell if shell > 0 else NO_RESOLUTION_ANGSTROM),
        })

    estimated, total_completeness = zip(*(
        _estimated_resolution_and_completeness(ssnr[k], completeness[k], ori_size, pixel)
        for k in range(n_classes)))
    moments = {}
    if gradient_moment_images is not None:
        first, second = ([str(n) for n in names_k] for names_k in gradient_moment_images)
        if not len(first) == len(second) == n_classes:
            raise ValueError(f"{len(first)} and {len(second)} gradient moment images for {n_classes} classes")
        moments = {"rlnGradMoment1": first, "rlnGradMoment2": second}
    blocks["model_classes"] = pd.DataFrame({
        "rlnReferenceImage": names,
        **moments,
        "rlnClassDistribution": _fcol(pdf_class),
        "rlnAccuracyRotations": _fcol(np.full(n_classes, float(model.accuracy_rotations_deg))),
        "rlnAccuracyTranslationsAngst": _fcol(np.full(n_classes, float(model.accuracy_translations_angstrom))),
        "rlnEstimatedResolution": _fcol(estimated),
        "rlnOverallFourierCompleteness": _fcol(total_completeness),
        # RELION's reader refuses 2D classes without them (MlModel::readStar); the offsets' prior is centred on
        # (0, 0) Å for every class here (jobs.class2d)
        **({"rlnClassPriorOffsetX": _fcol(np.zeros(n_classes)), "rlnClassPriorOffsetY": _fcol(np.zeros(n_classes))}
           if reference_dimensionality == 2 else {}),
    })

    shells = np.arange(n_shells)
    resolution_inv_angstrom = shells / (pixel * ori_size)
    resolution_angstrom = _shell_resolution_angstrom(shells, ori_size, pixel)
    for k in range(n_classes):
        blocks[f"model_class_{k + 1}"] = pd.DataFrame({
            "rlnSpectralIndex": shells,
            "rlnResolution": _fcol(resolution_inv_angstrom),
            "rlnAngstromResolution": _fcol(resolution_angstrom),
            "rlnSsnrMap": _fcol(ssnr[k]),
            "rlnGoldStandardFsc": _fcol(fsc[k]),
            "rlnFourierCompleteness": _fcol(completeness[k]),
            "rlnReferenceSigma2": _fcol(sigma2_ref[k]),
            "rlnReferenceTau2": _fcol(tau2[k]),
            "rlnSpectralOrientabilityContribution": _fcol(orientability[k]),
        })
        if solvent_fsc:
            for label, name in (("rlnFourierShellCorrelationUnmaskedMaps", "fsc_unmasked"),
                                ("rlnFourierShellCorrelationMaskedMaps", "fsc_masked"),
                                ("rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps", "fsc_random_masked")):
                blocks[f"model_class_{k + 1}"][label] = _fcol(
                    _array_or_zeros(getattr(model, name), (n_classes, n_shells), name)[k])

    blocks["model_groups"] = pd.DataFrame({
        "rlnGroupNumber": np.arange(1, n_groups + 1),
        "rlnGroupName": [str(n) for n in scale_names],
        "rlnGroupNrParticles": np.asarray(scale_counts, dtype=np.int64),
        "rlnGroupScaleCorrection": _fcol(scale),
    })

    for g in range(n_optics):
        used = np.flatnonzero(sigma2_noise[g] > 0)  # RELION writes only the shells with noise power
        blocks[f"model_optics_group_{g + 1}"] = pd.DataFrame({
            "rlnSpectralIndex": used.astype(np.int64),
            "rlnResolution": _fcol(resolution_inv_angstrom[used]),
            "rlnSigma2Noise": _fcol(sigma2_noise[g, used]),
        })

    if pdf_direction is not None:
        pdf = np.asarray(pdf_direction, dtype=np.float64)
        if pdf.ndim != 2 or pdf.shape[0] != n_classes:
            raise ValueError(f"pdf_direction must be (n_classes={n_classes}, n_directions), got {pdf.shape}")
        for k in range(n_classes):
            blocks[f"model_pdf_orient_class_{k + 1}"] = pd.DataFrame({"rlnOrientationDistribution": _fcol(pdf[k])})
    return blocks


class RunParticles(Protocol):
    """What a job's model.star needs of its particles (`data.ParticleSet` has it)."""

    def optics_names_and_counts(self) -> tuple[list[str], list[int]]: ...

    def scale_group_names_and_counts(self, members: np.ndarray | None = None) -> tuple[list[str], list[int]]: ...


def job_model_star_blocks(particles: RunParticles, model, optimiser, config, reference_image_names: Sequence[str], *,
                          half: int | None = None, members: np.ndarray | None = None, pdf_direction=None,
                          reference_dimensionality: int = 3,
                          gradient_moment_images: tuple[Sequence[str], Sequence[str]] | None = None) -> dict:
    """`model_star_blocks` of a job's iteration for its particles: their optics groups (the noise spectra's blocks)
    and intensity groups (model_groups), each group's number of particles counted over `members` (particle indices;
    None: all), as RELION counts a half set's particles in that half's model.star (Experiment::
    getNumberOfParticlesPerGroup of the half set, MlOptimiserMpi::initialiseWorkLoad)."""
    names, counts = particles.optics_names_and_counts()
    return model_star_blocks(model, optimiser, config, half, list(reference_image_names), names, counts,
                             pdf_direction=pdf_direction,
                             scale_groups=particles.scale_group_names_and_counts(members),
                             reference_dimensionality=reference_dimensionality,
                             gradient_moment_images=gradient_moment_images)


def _estimated_resolution_and_completeness(ssnr, completeness, ori_size, pixel):
    """RELION's rlnEstimatedResolution (Å) and rlnOverallFourierCompleteness of one class.

    The last shell before the SSNR first drops below 1 is the resolution; the total completeness
    averages the per-shell completeness over the lattice points of a cube of half-width
    (maxres − 1) whose shell (truncated radius) is ≤ maxres (RELION's calculateTotalFourierCoverage).
    With no shell above SSNR 1 the resolution is 999 Å and the completeness 0.
    """
    below = np.flatnonzero(np.asarray(ssnr) < 1.0)
    last = len(ssnr) - 1 if below.size == 0 else int(below[0]) - 1
    maxres = max(last, 0)
    if maxres == 0:
        return NO_RESOLUTION_ANGSTROM, 0.0
    estimated = ori_size * pixel / maxres
    completeness = np.asarray(completeness, dtype=np.float64)
    if not completeness[: maxres + 1].any():
        return estimated, 0.0
    counts = _shell_counts_in_cube(maxres)
    total = float(np.dot(counts, completeness[: maxres + 1]) / counts.sum())
    return estimated, total


@functools.lru_cache(maxsize=16)
def _shell_counts_in_cube(maxres):
    """Number of integer points with |x|,|y|,|z| ≤ maxres−1 per truncated radius 0 … maxres (read-only)."""
    c = np.arange(-(maxres - 1), maxres, dtype=np.float64)
    plane = (c[:, None] ** 2 + c[None, :] ** 2).ravel()
    counts = np.zeros(maxres + 1, dtype=np.int64)
    for z in range(maxres):  # z and −z give the same radii
        r = np.floor(np.sqrt(plane + float(z * z))).astype(np.int64)
        r = r[r <= maxres]
        counts += np.bincount(r, minlength=maxres + 1) * (1 if z == 0 else 2)
    counts.setflags(write=False)
    return counts


def _shell_resolution_angstrom(shells, ori_size, pixel):
    shells = np.asarray(shells, dtype=np.float64)
    out = np.full(shells.shape, NO_RESOLUTION_ANGSTROM)
    nz = shells > 0
    out[nz] = pixel * ori_size / shells[nz]
    return out


# ------------------------------------------------------------------------------ optimiser.star

def optimiser_star_blocks(optimiser, model, config, output_root: str,
                          iteration: int | None = None) -> dict:
    """The data_optimiser_general block of RELION's run_itNNN_optimiser.star.

    File names follow RELION: `<output_root>_itNNN_{half1,half2}_model.star` for gold-standard
    halves (`config.auto_refine`), `<output_root>_itNNN_model.star` otherwise; `iteration` None names the
    files without `_itNNN`. rlnCurrentIteration is `optimiser.iteration` (an `iteration`
    that differs is an error). A refinement's final iteration (`optimiser.do_join_halves`) has only the converged
    run's optimiser.star (`iteration` None, else an error), as RELION's MlOptimiserMpi::iterate writes it after it
    joins the halves: one model file, rlnDoSplitRandomHalves 0 and rlnCurrentIteration -1. Write it with
    `write_optimiser_star` to get the command line comment.
    """
    if iteration is not None and int(iteration) != int(optimiser.iteration):
        raise ValueError(f"iteration {iteration} differs from optimiser.iteration {optimiser.iteration}")
    split = bool(config.auto_refine)
    converged = split and bool(optimiser.do_join_halves)
    if converged and iteration is not None:
        raise ValueError(f"iteration {iteration}: a refinement's final iteration writes only the converged run's "
                         f"optimiser.star, without an iteration number")
    root = _iteration_root(output_root, iteration)
    general = {"rlnOutputRootName": str(output_root)}
    if split and not converged:
        general["rlnModelStarFile"] = f"{root}_half1_model.star"
        general["rlnModelStarFile2"] = f"{root}_half2_model.star"
    else:
        general["rlnModelStarFile"] = f"{root}_model.star"
    diameter = config.particle_diameter_angstrom
    general.update({
        "rlnExperimentalDataStarFile": f"{root}_data.star",
        "rlnTomoTomogramsFile": "",  # RELION's for particles that are not sub-tomograms
        "rlnTomoTrajectoriesFile": "",
        "rlnOrientSamplingStarFile": f"{root}_sampling.star",
        "rlnCurrentIteration": -1 if converged else int(optimiser.iteration),
        "rlnNumberOfIterations": int(config.max_iterations),
        "rlnDoSplitRandomHalves": int(split and not converged),
        "rlnJoinHalvesUntilThisResolution": _f(config.low_resol_join_halves_angstrom if split else -1.0),
        "rlnAdaptiveOversampleOrder": int(config.oversampling),
        "rlnAdaptiveOversampleFraction": _f(config.adaptive_fraction),
        "rlnRandomSeed": int(config.random_seed),
        "rlnParticleDiameter": _f(-1.0 if diameter is None else diameter),
        "rlnWidthMaskEdge": int(round(config.width_mask_edge_px)),
        "rlnDoZeroMask": int(bool(config.zero_mask)),
        "rlnDoSolventFlattening": int(bool(config.flatten_solvent)),
        "rlnDoSolventFscCorrection": int(bool(getattr(config, "solvent_correct_fsc", False))),
        "rlnSolventMaskName": str(config.solvent_mask) if config.solvent_mask else "None",
        "rlnSolventMask2Name": str(config.solvent_mask2) if getattr(config, "solvent_mask2", None) else "None",
        "rlnBodyStarFile": "None",
        "rlnTauSpectrumName": "None",
        "rlnCoarseImageSize": int(model.coarse_size_px),
        "rlnMaximumCoarseImageSize": int(getattr(config, "max_coarse_size_px", -1)),
        "rlnHighresLimitExpectation": _f(getattr(config, "strict_highres_exp_angstrom", -1.0)),
        "rlnLowresLimitExpectation": _f(-1.0),
        "rlnIncrementImageSize": int(config.incr_size_px),
        "rlnDoMapEstimation": 1,
        "rlnDoFastSubsetOptimisation": int(bool(getattr(config, "fast_subsets", False))),
        "rlnDoExternalReconstruct": 0,
        "rlnDoBlush": 0,
        "rlnBlushNoSpectralTrailing": 0,
        "rlnDoGradientRefine": 0,
        "rlnDoStochasticGradientDescent": 0,
        # the fudge every iteration uses, unchanged over the run (RELION's "plain" scheme)
        "rlnTau2FudgeScheme": "plain",
        "rlnTau2FudgeArg": _f(config.tau2_fudge),
        "rlnMaximumSignificantPoses": int(config.max_significants),
        "rlnDoAutoRefine": int(bool(config.auto_refine)),
        "rlnDoAutoSampling": int(bool(config.auto_refine or config.auto_sampling)),
        "rlnAutoLocalSearchesHealpixOrder": int(config.auto_local_healpix_order),
        "rlnNumberOfIterWithoutResolutionGain": int(optimiser.nr_iter_wo_resol_gain),
        "rlnBestResolutionThusFar": _f(optimiser.best_resolution_so_far_inv_angstrom),
        "rlnNumberOfIterWithoutChangingAssignments": int(optimiser.nr_iter_wo_large_hidden_variable_changes),
        "rlnDoSkipAlign": int(bool(getattr(config, "skip_align", False))),
        "rlnDoSkipRotate": 0,
        "rlnOverallAccuracyRotations": _f(optimiser.acc_rot_deg),
        "rlnOverallAccuracyTranslationsAngst": _f(optimiser.acc_trans_angstrom),
        "rlnChangesOptimalOrientations": _f(optimiser.changes_optimal_orientations_deg),
        "rlnChangesOptimalOffsets": _f(optimiser.changes_optimal_offsets_angstrom),
        "rlnChangesOptimalClasses": _f(optimiser.changes_optimal_classes),
        "rlnSmallestChangesOrientations": _f(optimiser.smallest_changes_orientations_deg),
        "rlnSmallestChangesOffsets": _f(optimiser.smallest_changes_offsets_angstrom),
        # RELION's label is an integer (a number of particles)
        "rlnSmallestChangesClasses": int(round(optimiser.smallest_changes_classes)),
        "rlnLocalSymmetryFile": "None",
        "rlnDoHelicalRefine": 0,
        "rlnIgnoreHelicalSymmetry": 0,
        "rlnFourierMask": "None",
        "rlnHelicalTwistInitial": _f(0.0),
        "rlnHelicalRiseInitial": _f(0.0),
        "rlnHelicalCentralProportion": _f(0.3),
        "rlnNrHelicalNStart": 1,
        "rlnHelicalMaskTubeInnerDiameter": _f(-1.0),
        "rlnHelicalMaskTubeOuterDiameter": _f(-1.0),
        "rlnHelicalSymmetryLocalRefinement": 0,
        "rlnHelicalSigmaDistance": _f(-1.0),
        "rlnHelicalKeepTiltPriorFixed": 0,
        "rlnHasConverged": int(bool(optimiser.has_converged)),
        "rlnHasHighFscAtResolLimit": int(bool(optimiser.has_high_fsc_at_resol_limit)),
        "rlnHasLargeSizeIncreaseIterationsAgo": int(optimiser.has_large_size_increase_iterations_ago),
        "rlnDoCorrectNorm": int(bool(config.do_norm)),
        "rlnDoCorrectScale": int(bool(config.do_scale)),
        "rlnDoCorrectCtf": int(bool(config.do_ctf)),
        "rlnDoCenterClasses": int(bool(getattr(config, "center_classes", False))),
        "rlnDoIgnoreCtfUntilFirstPeak": int(bool(config.ctf_intact_first_peak)),
        "rlnCtfDataArePhaseFlipped": 0,
        "rlnDoOnlyFlipCtfPhases": 0,
        "rlnRefsAreCtfCorrected": 1,
        "rlnFixSigmaNoiseEstimates": 0,
        "rlnFixSigmaOffsetEstimates": 0,
        "rlnMaxNumberOfPooledParticles": int(config.pooled_particles),
        "rlnOffsetRangeX": _f(-1.0),
        "rlnOffsetRangeY": _f(-1.0),
        "rlnOffsetRangeZ": _f(-1.0),
    })
    return {"optimiser_general": general}


def write_optimiser_star(path, blocks: dict, argv: list[str]) -> None:
    """Write optimiser.star text, atomically: a version comment, the command line as a comment
    (`# --o … --i …`, as RELION writes it), then the blocks."""
    command = shlex.join(str(a) for a in argv).replace("\r", " ").replace("\n", " ")
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(f"# RELION optimiser; version {RELION_LAYOUT_VERSION}-cryorefine-{__version__}\n")
            fh.write(f"# {command}\n")
            fh.write(star_to_string(blocks))


def read_optimiser_star(path) -> tuple[int, dict]:
    """(rlnCurrentIteration, {label: value} of data_optimiser_general) of an optimiser.star."""
    blocks = read_star(path)
    general = blocks.get("optimiser_general")
    if not isinstance(general, dict):
        raise InputError(f"{path}: no single-value block data_optimiser_general; give a run_itNNN_optimiser.star")
    if "rlnCurrentIteration" not in general:
        raise InputError(f"{path}: data_optimiser_general has no rlnCurrentIteration")
    return int(general["rlnCurrentIteration"]), dict(general)


# ------------------------------------------------------------------------------- sampling.star

def _sampling_general(sampling, optimiser, config, pixel_size_angstrom: float) -> dict:
    """The sampling_general block of run_itNNN_sampling.star (offsets in Å, as RELION 3.1+ writes them). The
    sampling's HEALPix order, offsets and perturbation must be the optimiser's (the --continue reader takes them
    from this file)."""
    for name, a, b in (("healpix_order", sampling.healpix_order, optimiser.healpix_order),
                       ("offset_range_px", sampling.offset_range_px, optimiser.offset_range_px),
                       ("offset_step_px", sampling.offset_step_px, optimiser.offset_step_px),
                       ("perturbation", sampling.perturbation, optimiser.perturbation)):
        if float(a) != float(b):
            raise ValueError(f"sampling.{name} = {a!r} but optimiser.{name} = {b!r}; they must agree")
    pixel = float(pixel_size_angstrom)
    original_order = int(config.healpix_order)
    return {
        "rlnIs3DSampling": 1,
        "rlnIs3DTranslationalSampling": 0,
        "rlnHealpixOrder": int(sampling.healpix_order),
        "rlnSymmetryGroup": str(sampling.symmetry),
        "rlnTiltAngleLimit": _f(NO_TILT_LIMIT_DEG),
        "rlnPsiStep": _f(sampling.psi_step_deg),
        "rlnOffsetRange": _f(sampling.offset_range_px * pixel),
        "rlnOffsetStep": _f(sampling.offset_step_px * pixel),
        "rlnHelicalOffsetStep": _f(-1.0),
        "rlnSamplingPerturbInstance": _f(sampling.perturbation),
        "rlnSamplingPerturbFactor": _f(PERTURBATION_FACTOR),
        "rlnHealpixOrderOriginal": original_order,
        "rlnPsiStepOriginal": _f(360.0 / (6 * 2 ** original_order)),
        "rlnOffsetRangeOriginal": _f(config.offset_range_px * pixel),
        "rlnOffsetStepOriginal": _f(config.offset_step_px * pixel),
    }


def write_sampling_star(path, sampling, optimiser, config, pixel_size_angstrom: float) -> None:
    """run_itNNN_sampling.star: sampling_general (`_sampling_general`) and sampling_directions, the coarse
    directions (rot, tilt) of `sampling`, unperturbed, in RELION's order. Made here: a job hands this to the
    iteration writer's thread. The text of the direction table (786,432 rows at order 8) is made once for each
    HEALPix order and symmetry (`_direction_text`) and written again as it is in the iterations that follow."""
    general = {"sampling_general": _sampling_general(sampling, optimiser, config, pixel_size_angstrom)}
    with atomic_path(path) as tmp:
        Path(tmp).write_text(star_to_string(general) + _direction_text(sampling))


_DIRECTION_TEXTS = {}
DIRECTION_DECIMALS = 10  # the direction table's decimals in run_itNNN_sampling.star (RELION writes 6)
DIRECTION_LABELS = ("rlnAngleRot", "rlnAngleTilt")


def _direction_text(sampling) -> str:
    """The sampling_directions block's text of `sampling`, the same in every iteration at one HEALPix order and
    symmetry (25 MB at order 8), with DIRECTION_DECIMALS decimals made in whole-array steps (`fixed_point_rows`):
    value by value, its 786,432 rows at order 8 took 1.3 s of the interpreter on the writer's thread, and the
    E-step's thread beside it lost 1-1.7 s in the next iteration. The newest two are kept."""
    key = (int(sampling.healpix_order), str(sampling.symmetry))
    if key not in _DIRECTION_TEXTS:
        directions = np.asarray(sampling.directions_deg(), dtype=np.float64)
        header = star_to_string({"sampling_directions": pd.DataFrame(columns=DIRECTION_LABELS)}).rstrip("\n")
        text = f"{header}\n{fixed_point_rows(directions.T, DIRECTION_DECIMALS)}\n\n"
        while len(_DIRECTION_TEXTS) >= 2:
            del _DIRECTION_TEXTS[next(iter(_DIRECTION_TEXTS))]
        _DIRECTION_TEXTS[key] = text
    return _DIRECTION_TEXTS[key]


# ------------------------------------------------------------------------------- data.star

def data_star_write(star: ParticleStar, path: str | Path, table: pd.DataFrame) -> InOwnProcess:
    """The write of a run's data.star (`star`'s optics, the particle `table`) for `io.background.BackgroundWriter`, in
    its own process: the text of 100,000 particles takes a second or more to make, holding the interpreter, which the
    iterations' thread (and an MPI master's answers to its workers) would wait for on the writer's thread. It calls
    `write_star` as `io.star.write_particle_star` does rather than that function, whose `star` argument would send the
    input's whole particle table to the process beside `table`."""
    return InOwnProcess(functools.partial(write_star, {"optics": star.optics, "particles": table}, str(path)))


def particle_table(table, state, halves, pixel_size_angstrom, group_number=None):
    """The particle table `table` (a DataFrame of the input STAR file) with the run's per-particle values of
    `state` (poses in RELION's columns, origins in Å, class numbers from 1), `halves` (rlnRandomSubset;
    None: no half sets, the column is left as the input has it) and `group_number` (rlnGroupNumber, the intensity
    group from 1, which RELION sets as it reads the particles and writes; None: as the input has it)."""
    table = table.copy()
    if group_number is not None:
        table["rlnGroupNumber"] = np.asarray(group_number, dtype=np.int64)
    table["rlnAngleRot"] = state.rot_deg
    table["rlnAngleTilt"] = state.tilt_deg
    table["rlnAnglePsi"] = state.psi_deg
    table["rlnOriginXAngst"] = state.origin_x_px * pixel_size_angstrom
    table["rlnOriginYAngst"] = state.origin_y_px * pixel_size_angstrom
    table["rlnClassNumber"] = state.class_index + 1
    table["rlnNormCorrection"] = state.norm_correction
    table["rlnLogLikeliContribution"] = state.log_likelihood
    table["rlnMaxValueProbDistribution"] = state.pmax
    table["rlnNrOfSignificantSamples"] = state.n_significant
    if halves is not None:
        table["rlnRandomSubset"] = halves
    return table


def _iteration_root(output_root, iteration):
    return str(output_root) if iteration is None else f"{output_root}_it{int(iteration):03d}"


def _f(value) -> str:
    """A float as the shortest text that reads back to the same float64."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    return repr(value)


def _fcol(values) -> list:
    """`_f` of every value (repr of a Python float is its shortest round-trip text, "nan" for NaN), FORMAT_CHUNK
    values a step: one C call over a whole column would keep the interpreter from the E-step's thread for its
    duration (0.37 s for a direction table's column at order 8 on a 2-core CPU)."""
    values = np.asarray(values, dtype=np.float64).ravel()
    text = []
    for start in range(0, values.size, FORMAT_CHUNK):
        text.extend(map(repr, values[start:start + FORMAT_CHUNK].tolist()))
    return text


def _array_or_zeros(array, shape, name):
    return _array_or_value(array, shape, 0.0, name)


def _array_or_value(array, shape, fill, name):
    if array is None:
        return np.full(shape, fill, dtype=np.float64)
    out = np.asarray(array, dtype=np.float64)
    if out.shape != tuple(shape):
        raise ValueError(f"{name} has shape {out.shape}, expected {tuple(shape)}")
    return out


def _half_spectra(array, row, n_classes, n_shells, name):
    if array is None:
        return np.zeros((n_classes, n_shells))
    out = np.asarray(array, dtype=np.float64)
    if out.shape == (2, n_classes, n_shells):
        return out[row]
    if out.shape == (1, n_classes, n_shells) and row == 0:
        return out[0]
    raise ValueError(f"{name} has shape {out.shape}, expected (2, {n_classes}, {n_shells})")


# ---------------------------------------------------------------- run_itNNN_class001_angdist.bild

#: HealpixSampling::writeBildFileOrientationalDistribution's defaults: the longest cylinder reaches this fraction of
#: the radius beyond the sphere, and cylinders are this fraction of the angular step wide
ANGDIST_LENGTH_FRACTION = 0.3
ANGDIST_WIDTH_FRACTION = 0.5
#: a cylinder shorter than this (Å) along every axis is left out (ChimeraX complains about zero-length ones)
ANGDIST_MIN_LENGTH_ANGSTROM = 0.01


def angdist_bild_text(pdf_direction: np.ndarray, rot_deg: np.ndarray, tilt_deg: np.ndarray, box_px: int,
                      pixel_size_angstrom: float, healpix_order: int) -> str:
    """The text of RELION's `*_classNNN_angdist.bild` (HealpixSampling::writeBildFileOrientationalDistribution) for one
    class's direction distribution over the directions (`rot_deg`, `tilt_deg`) of a HEALPix order: for each
    direction of non-zero probability, a `.color r 0 b` line (from blue, 1σ below the mean, to red, 5σ above it)
    and a `.cylinder` from the sphere of radius R = box·pixel/2 around the box's centre outwards along the
    direction, R·0.3·pdf/max(pdf) long and 0.5·π·R·step/360 wide (step: the order's angular step), in Å; C++'s
    default number format (six significant digits)."""
    pdf = np.asarray(pdf_direction, dtype=np.float64).reshape(-1)
    rot, tilt = (np.radians(np.asarray(a, dtype=np.float64).reshape(-1)) for a in (rot_deg, tilt_deg))
    if not (pdf.size == rot.size == tilt.size):
        raise ValueError(f"pdf_direction has {pdf.size} directions, the sampling {rot.size}")
    radius = box_px * pixel_size_angstrom / 2.0
    step_deg = 360.0 / (6 * 2 ** int(healpix_order))
    width = ANGDIST_WIDTH_FRACTION * math.pi * radius * step_deg / 360.0
    mean = pdf.mean() if pdf.size else 0.0
    variance = float(np.mean(pdf * pdf) - mean * mean) if pdf.size else 0.0
    if pdf.size > 1:
        variance *= pdf.size // (pdf.size - 1)  # RELION's computeStats scales by N/(N-1) in integers: 1 from N = 3
    sigma = math.sqrt(abs(variance))
    largest = pdf.max() if pdf.size else 0.0
    shown = pdf > 0
    pdf, rot, tilt = pdf[shown], rot[shown], tilt[shown]
    # RELION's colour scale: the deviation in σ, clipped to [-1, 5], to [0, 1]; where σ is 0 (a uniform
    # distribution) its comparisons with NaN give 5, red
    deviation = np.clip((pdf - mean) / sigma, -1.0, 5.0) if sigma > 0 else np.full(pdf.size, 5.0)
    colour = deviation / 6.0 + 1.0 / 6.0
    outer = radius + ANGDIST_LENGTH_FRACTION * radius * pdf / largest
    v = np.stack([np.cos(rot) * np.sin(tilt), np.sin(rot) * np.sin(tilt), np.cos(tilt)], axis=1)
    long_enough = np.any(np.abs((radius - outer)[:, None] * v) > ANGDIST_MIN_LENGTH_ANGSTROM, axis=1)
    start, end = radius * v + radius, outer[:, None] * v + radius  # the box's centre at (R, R, R)
    # a direction's two lines in one format (its numbers in C++'s default format, %g), an order 8 distribution's
    # hundred thousand directions in a fraction of a second
    rows = zip(colour[long_enough].tolist(), (1.0 - colour[long_enough]).tolist(),
               *(column.tolist() for column in np.concatenate([start, end], axis=1)[long_enough].T))
    line = ".color %g 0 %g\n.cylinder %g %g %g %g %g %g " + f"{width:g}" + "\n"
    return "".join(map(line.__mod__, rows))


def write_angdist_bild(path: str | Path, pdf_direction: np.ndarray, rot_deg: np.ndarray, tilt_deg: np.ndarray,
                       box_px: int, pixel_size_angstrom: float, healpix_order: int) -> None:
    """`angdist_bild_text` written to `path` (atomically)."""
    text = angdist_bild_text(pdf_direction, rot_deg, tilt_deg, box_px, pixel_size_angstrom, healpix_order)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)

"""RELION's per-iteration STAR outputs: model.star, optimiser.star, sampling.star, and --continue.

Writers return {block name: dict (single values) or DataFrame (loop)} for `io.star.write_star`,
with RELION 4/5 labels in RELION's order (src/ml_model.cpp MlModel::write, src/ml_optimiser.cpp
MlOptimiser::write, src/healpix_sampling.cpp HealpixSampling::write):

- `model_star_blocks`: run_itNNN_half{1,2}_model.star (or run_itNNN_model.star): model_general,
  model_classes, model_class_N (spectra), model_groups, model_optics_group_N (noise spectra) and,
  when given, model_pdf_orient_class_N.
- `optimiser_star_blocks` + `write_optimiser_star`: run_itNNN_optimiser.star, with the command
  line as a comment at the top as RELION writes it.
- `sampling_star_blocks`: run_itNNN_sampling.star (sampling_general, sampling_directions).

Readers for --continue: `read_optimiser_star` and `state_from_star_files`, which re-reads the
optimiser.star, the model.star file(s) and the sampling.star it names. What RELION's files do not
hold (random generator state, the configuration, ...) goes into a JSON side file beside the
optimiser.star (`resume_extras_path`), written by `write_resume_extras`.

Units, as RELION 3.1+ writes them: rlnCurrentResolution, rlnAngstromResolution,
rlnEstimatedResolution in Å; rlnResolution and rlnBestResolutionThusFar in 1/Å;
rlnSigmaOffsetsAngst, rlnAccuracyTranslationsAngst, rlnOverallAccuracyTranslationsAngst and the
sampling's rlnOffsetRange/rlnOffsetStep in Å; angles in degrees. Floats are written with the
shortest text that reads back to the same float64 (Python's repr), so values round-trip exactly.

Deliberate differences from RELION's own files:
- model_classes has no rlnClassPriorOffsetX/Y (RELION writes them for 2D references only).
- rlnFourierCompleteness and rlnSpectralOrientabilityContribution come from optional arguments
  and are 0 when not given (RELION's reader treats a missing completeness as 0 as well).
- model_pdf_orient_class_N is written only when `pdf_direction` is given; RELION's reader starts
  from a uniform distribution when the block is absent.
- optimiser_general follows RELION 5 (so, next to RELION 3.1's files, it has rlnDoAutoSampling,
  rlnMaximumSignificantPoses, rlnDoCenterClasses, rlnOffsetRangeX/Y/Z), adds rlnCoarseImageSize
  (a RELION 3.0 label RELION still knows), and leaves out the gradient/SGD, Blush, tomography and
  tau2-scheme labels (features not implemented here; RELION's reader defaults them to off).
- Non-finite floats are written as inf/nan, as RELION writes them (RELION reads them back as 0).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex
from pathlib import Path

import numpy as np
import pandas as pd

from cryorefine import __version__
from cryorefine.errors import InputError
from cryorefine.io.atomic import atomic_path
from cryorefine.io.star import read_star, star_to_string
from cryorefine.state import ModelState, OptimiserState

NO_RESOLUTION_ANGSTROM = 999.0  # RELION's rlnAngstromResolution of shell 0
PRIOR_MODE_NONE = 0
PRIOR_MODE_ROT_TILT_PSI = 1  # RELION's PRIOR_ROTTILT_PSI, used for local searches
DEFAULT_PERTURBATION_FACTOR = 0.5  # relion_refine --perturb
NO_TILT_LIMIT_DEG = -91.0  # RELION's rlnTiltAngleLimit when the tilt is not limited
EXTRAS_FORMAT = "cryorefine-resume-extras"
EXTRAS_VERSION = 1


# ---------------------------------------------------------------------------------- model.star

def model_star_blocks(model: ModelState, optimiser: OptimiserState, config, half: int | None,
                      reference_image_names: list[str], optics_group_names: list[str],
                      optics_group_counts: list[int], *, fourier_completeness=None,
                      orientability_contribution=None, pdf_direction=None) -> dict:
    """Blocks of RELION's model.star for one half (1 or 2) or for the joined/classification model (None).

    Spectra of half h come from row h−1 of `model.tau2`, `model.ssnr`, `model.reference_sigma2`
    (row 0 when half is None); `model.fsc_halves` is the same in both halves' files. One intensity
    group per optics group: model_groups has a row per entry of `optics_group_names` with its
    particle count and `model.scale_correction`. Optional arrays, each (K, N//2+1) for the half
    written: `fourier_completeness` (rlnFourierCompleteness, 0 if None),
    `orientability_contribution` (rlnSpectralOrientabilityContribution, 0 if None);
    `pdf_direction` (K, n_directions) writes model_pdf_orient_class_N. A spectrum array that is
    None is written as zeros.
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
    n_groups = len(groups)
    sigma2_noise = _array_or_zeros(model.sigma2_noise, (n_groups, n_shells), "sigma2_noise")
    scale = _array_or_value(model.scale_correction, (n_groups,), 1.0, "scale_correction")
    tau2 = _half_spectra(model.tau2, row, n_classes, n_shells, "tau2")
    ssnr = _half_spectra(model.ssnr, row, n_classes, n_shells, "ssnr")
    sigma2_ref = _half_spectra(model.reference_sigma2, row, n_classes, n_shells, "reference_sigma2")
    fsc = _array_or_zeros(model.fsc_halves, (n_classes, n_shells), "fsc_halves")
    completeness = _array_or_zeros(fourier_completeness, (n_classes, n_shells), "fourier_completeness")
    orientability = _array_or_zeros(orientability_contribution, (n_classes, n_shells), "orientability_contribution")
    pdf_class = model.pdf_class if model.pdf_class is not None else model.class_distribution
    pdf_class = _array_or_value(pdf_class, (n_classes,), 1.0 / n_classes, "pdf_class")

    blocks = {"model_general": {
        "rlnReferenceDimensionality": 3,
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
        "rlnNrOpticsGroups": n_groups,
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

    estimated, total_completeness = zip(*(
        _estimated_resolution_and_completeness(ssnr[k], completeness[k], ori_size, pixel)
        for k in range(n_classes)))
    blocks["model_classes"] = pd.DataFrame({
        "rlnReferenceImage": names,
        "rlnClassDistribution": _fcol(pdf_class),
        "rlnAccuracyRotations": _fcol(np.full(n_classes, float(model.accuracy_rotations_deg))),
        "rlnAccuracyTranslationsAngst": _fcol(np.full(n_classes, float(model.accuracy_translations_angstrom))),
        "rlnEstimatedResolution": _fcol(estimated),
        "rlnOverallFourierCompleteness": _fcol(total_completeness),
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

    blocks["model_groups"] = pd.DataFrame({
        "rlnGroupNumber": np.arange(1, n_groups + 1),
        "rlnGroupName": groups,
        "rlnGroupNrParticles": np.asarray(counts, dtype=np.int64),
        "rlnGroupScaleCorrection": _fcol(scale),
    })

    for g in range(n_groups):
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

def optimiser_star_blocks(optimiser: OptimiserState, model: ModelState, config, output_root: str,
                          iteration: int | None = None) -> dict:
    """The data_optimiser_general block of RELION's run_itNNN_optimiser.star.

    File names follow RELION: `<output_root>_itNNN_{half1,half2}_model.star` for gold-standard
    halves (`config.auto_refine`), `<output_root>_itNNN_model.star` otherwise or once the halves
    are joined (then rlnModelStarFile2 is empty, as RELION writes it); `iteration` None names the
    final files without `_itNNN`. rlnCurrentIteration is `optimiser.iteration` (an `iteration`
    that differs is an error). Write it with `write_optimiser_star` to get the command line comment.
    """
    if iteration is not None and int(iteration) != int(optimiser.iteration):
        raise ValueError(f"iteration {iteration} differs from optimiser.iteration {optimiser.iteration}")
    root = _iteration_root(output_root, iteration)
    split = bool(config.auto_refine)
    general = {"rlnOutputRootName": str(output_root)}
    if split and not optimiser.do_join_halves:
        general["rlnModelStarFile"] = f"{root}_half1_model.star"
        general["rlnModelStarFile2"] = f"{root}_half2_model.star"
    elif split:
        general["rlnModelStarFile"] = f"{root}_model.star"
        general["rlnModelStarFile2"] = ""
    else:
        general["rlnModelStarFile"] = f"{root}_model.star"
    diameter = config.particle_diameter_angstrom
    general.update({
        "rlnExperimentalDataStarFile": f"{root}_data.star",
        "rlnOrientSamplingStarFile": f"{root}_sampling.star",
        "rlnCurrentIteration": int(optimiser.iteration),
        "rlnNumberOfIterations": int(config.max_iterations),
        "rlnDoSplitRandomHalves": int(split),
        "rlnJoinHalvesUntilThisResolution": _f(config.low_resol_join_halves_angstrom if split else -1.0),
        "rlnAdaptiveOversampleOrder": int(config.oversampling),
        "rlnAdaptiveOversampleFraction": _f(config.adaptive_fraction),
        "rlnRandomSeed": int(config.random_seed),
        "rlnParticleDiameter": _f(-1.0 if diameter is None else diameter),
        "rlnWidthMaskEdge": int(round(config.width_mask_edge_px)),
        "rlnDoZeroMask": int(bool(config.zero_mask)),
        "rlnDoSolventFlattening": int(bool(config.flatten_solvent)),
        "rlnDoSolventFscCorrection": 0,
        "rlnSolventMaskName": str(config.solvent_mask) if config.solvent_mask else "None",
        "rlnSolventMask2Name": "None",
        "rlnBodyStarFile": "None",
        "rlnTauSpectrumName": "None",
        "rlnCoarseImageSize": int(model.coarse_size_px),
        "rlnMaximumCoarseImageSize": -1,
        "rlnHighresLimitExpectation": _f(-1.0),
        "rlnLowresLimitExpectation": _f(-1.0),
        "rlnIncrementImageSize": int(config.incr_size_px),
        "rlnDoMapEstimation": 1,
        "rlnDoFastSubsetOptimisation": 0,
        "rlnDoExternalReconstruct": 0,
        "rlnMaximumSignificantPoses": int(config.max_significants),
        "rlnDoAutoRefine": int(bool(config.auto_refine)),
        "rlnDoAutoSampling": int(bool(config.auto_refine)),
        "rlnAutoLocalSearchesHealpixOrder": int(config.auto_local_healpix_order),
        "rlnNumberOfIterWithoutResolutionGain": int(optimiser.nr_iter_wo_resol_gain),
        "rlnBestResolutionThusFar": _f(optimiser.best_resolution_so_far_inv_angstrom),
        "rlnNumberOfIterWithoutChangingAssignments": int(optimiser.nr_iter_wo_large_hidden_variable_changes),
        "rlnDoSkipAlign": 0,
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
        "rlnDoCenterClasses": 0,
        "rlnDoIgnoreCtfUntilFirstPeak": int(bool(config.ctf_intact_first_peak)),
        "rlnCtfDataArePhaseFlipped": 0,
        "rlnDoOnlyFlipCtfPhases": 0,
        "rlnRefsAreCtfCorrected": 1,
        "rlnFixSigmaNoiseEstimates": 0,
        "rlnFixSigmaOffsetEstimates": 0,
        "rlnMaxNumberOfPooledParticles": int(config.batch_size),
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
            fh.write(f"# cryorefine optimiser; version {__version__} (RELION 3.1+ layout)\n")
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

def sampling_star_blocks(sampling, optimiser: OptimiserState, config, pixel_size_angstrom: float) -> dict:
    """Blocks of RELION's run_itNNN_sampling.star (offsets in Å, as RELION 3.1+ writes them).

    sampling_directions holds the coarse directions (rot, tilt) of `sampling`, unperturbed, in
    RELION's order. The sampling's HEALPix order, offsets and perturbation must be the
    optimiser's (the --continue reader takes them from this file).
    """
    for name, a, b in (("healpix_order", sampling.healpix_order, optimiser.healpix_order),
                       ("offset_range_px", sampling.offset_range_px, optimiser.offset_range_px),
                       ("offset_step_px", sampling.offset_step_px, optimiser.offset_step_px),
                       ("perturbation", sampling.perturbation, optimiser.perturbation)):
        if float(a) != float(b):
            raise ValueError(f"sampling.{name} = {a!r} but optimiser.{name} = {b!r}; they must agree")
    pixel = float(pixel_size_angstrom)
    original_order = int(config.healpix_order)
    general = {
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
        "rlnSamplingPerturbFactor": _f(getattr(config, "perturbation_factor", DEFAULT_PERTURBATION_FACTOR)),
        "rlnHealpixOrderOriginal": original_order,
        "rlnPsiStepOriginal": _f(360.0 / (6 * 2 ** original_order)),
        "rlnOffsetRangeOriginal": _f(config.offset_range_px * pixel),
        "rlnOffsetStepOriginal": _f(config.offset_step_px * pixel),
    }
    directions = np.asarray(sampling.directions_deg(), dtype=np.float64)
    table = pd.DataFrame({"rlnAngleRot": _fcol(directions[:, 0]), "rlnAngleTilt": _fcol(directions[:, 1])})
    return {"sampling_general": general, "sampling_directions": table}


# ------------------------------------------------------------------------------- --continue

def state_from_star_files(optimiser_star_path) -> tuple[ModelState, OptimiserState]:
    """(ModelState without maps, OptimiserState) from an optimiser.star and the files it names.

    Reads the model.star file(s) (half 1 into row 0 and half 2 into row 1 of the per-half spectra;
    one model.star fills both rows) and the sampling.star. Names in the optimiser.star are tried
    as written (relative to the working directory, as RELION does), then beside the optimiser.star.
    Reads RELION 3.0 labels too (pixel-unit offsets and accuracies).

    From the STAR files alone every value is exact except the offset range/step in pixels (held
    in Å: within a few ulp), rlnSmallestChangesClasses (an integer label) and
    `class_distribution` (not held: None). Where the side file of `write_resume_extras`
    (`resume_extras_path`) exists and holds the states, its values replace the STAR files' ones,
    after checking that every scalar agrees (else InputError: a side file of another iteration).
    The maps are left to the caller (run_itNNN_half{1,2}_class001.mrc).
    """
    optimiser_star_path = Path(optimiser_star_path)
    iteration, general = read_optimiser_star(optimiser_star_path)
    folder = optimiser_star_path.parent
    relion30 = "rlnOverallAccuracyTranslationsAngst" not in general
    split = bool(int(general.get("rlnDoSplitRandomHalves", 0)))
    model2_name = str(general.get("rlnModelStarFile2", "")) if split else ""
    joined = split and model2_name in ("", "None")
    model1 = _read_model_star(_locate(general, "rlnModelStarFile", folder, optimiser_star_path))
    model2 = model1 if (not split or joined) else _read_model_star(
        _locate(general, "rlnModelStarFile2", folder, optimiser_star_path))
    sampling_general = _read_sampling_star(_locate(general, "rlnOrientSamplingStarFile", folder, optimiser_star_path))

    g1 = model1["general"]
    pixel = float(g1["rlnPixelSize"])
    offset_unit = 1.0 if relion30 else pixel  # 3.0 sampling offsets are in pixels, 3.1+ in Å
    acc_trans = general.get("rlnOverallAccuracyTranslationsAngst")
    if acc_trans is None:
        acc_trans = float(general["rlnOverallAccuracyTranslations"]) * pixel
    model = ModelState(
        ori_size_px=int(g1["rlnOriginalImageSize"]),
        pixel_size_angstrom=pixel,
        n_classes=int(g1["rlnNrClasses"]),
        padding_factor=float(g1["rlnPaddingFactor"]),
        maps=[],
        pdf_class=model1["pdf_class"],
        sigma2_noise=model1["sigma2_noise"],
        tau2=np.stack([model1["tau2"], model2["tau2"]]),
        ssnr=np.stack([model1["ssnr"], model2["ssnr"]]),
        reference_sigma2=np.stack([model1["reference_sigma2"], model2["reference_sigma2"]]),
        fsc_halves=model1["fsc"],
        sigma_offset_angstrom=model1["sigma_offset_angstrom"],
        avg_norm_correction=float(g1["rlnNormCorrectionAverage"]),
        scale_correction=model1["scale_correction"],
        current_resolution_angstrom=float(g1["rlnCurrentResolution"]),
        current_size_px=int(g1["rlnCurrentImageSize"]),
        coarse_size_px=int(general.get("rlnCoarseImageSize", 0)),
        log_likelihood=float(g1["rlnLogLikelihood"]),
        ave_pmax=float(g1["rlnAveragePmax"]),
        accuracy_rotations_deg=model1["accuracy_rotations_deg"],
        accuracy_translations_angstrom=model1["accuracy_translations_angstrom"],
        class_distribution=None,
    )
    optimiser = OptimiserState(
        iteration=iteration,
        healpix_order=int(sampling_general["rlnHealpixOrder"]),
        offset_range_px=float(sampling_general["rlnOffsetRange"]) / offset_unit,
        offset_step_px=float(sampling_general["rlnOffsetStep"]) / offset_unit,
        perturbation=float(sampling_general.get("rlnSamplingPerturbInstance", 0.0)),
        local_searches=int(g1["rlnOrientationalPriorMode"]) != PRIOR_MODE_NONE,
        sigma_rot_deg=float(g1["rlnSigmaPriorRotAngle"]),
        sigma_tilt_deg=float(g1["rlnSigmaPriorTiltAngle"]),
        sigma_psi_deg=float(g1["rlnSigmaPriorPsiAngle"]),
        nr_iter_wo_resol_gain=int(general["rlnNumberOfIterWithoutResolutionGain"]),
        nr_iter_wo_large_hidden_variable_changes=int(general["rlnNumberOfIterWithoutChangingAssignments"]),
        best_resolution_so_far_inv_angstrom=float(general["rlnBestResolutionThusFar"]),
        changes_optimal_orientations_deg=float(general["rlnChangesOptimalOrientations"]),
        changes_optimal_offsets_angstrom=float(general["rlnChangesOptimalOffsets"]),
        changes_optimal_classes=float(general["rlnChangesOptimalClasses"]),
        smallest_changes_orientations_deg=float(general["rlnSmallestChangesOrientations"]),
        smallest_changes_offsets_angstrom=float(general["rlnSmallestChangesOffsets"]),
        smallest_changes_classes=float(general["rlnSmallestChangesClasses"]),
        has_converged=bool(int(general["rlnHasConverged"])),
        has_high_fsc_at_resol_limit=bool(int(general["rlnHasHighFscAtResolLimit"])),
        has_large_size_increase_iterations_ago=int(general["rlnHasLargeSizeIncreaseIterationsAgo"]),
        do_join_halves=joined,
        acc_rot_deg=float(general["rlnOverallAccuracyRotations"]),
        acc_trans_angstrom=float(acc_trans),
    )
    extras_file = resume_extras_path(optimiser_star_path)
    if extras_file.is_file():
        saved = _read_extras_document(extras_file)
        model = _apply_saved_state(model, saved.get("model_state"), extras_file, "model_state")
        optimiser = _apply_saved_state(optimiser, saved.get("optimiser_state"), extras_file, "optimiser_state")
    return model, optimiser


def _locate(general, label, folder, optimiser_path):
    name = general.get(label)
    if name is None or str(name) in ("", "None"):
        raise InputError(f"{optimiser_path}: data_optimiser_general has no file name in {label}")
    written = Path(str(name))
    for candidate in (written, folder / written.name):
        if candidate.is_file():
            return candidate
    raise InputError(f"{optimiser_path}: {label} names {written}, which is found neither from the working "
                     f"directory nor in {folder}; run from the directory the refinement ran in")


def _read_model_star(path):
    blocks = read_star(path)
    general = blocks.get("model_general")
    if not isinstance(general, dict):
        raise InputError(f"{path}: no single-value block data_model_general; give a model.star")
    general = dict(general)
    n_classes = int(general["rlnNrClasses"])
    n_shells = int(general["rlnOriginalImageSize"]) // 2 + 1
    pixel = float(general["rlnPixelSize"])
    classes = _table(blocks, "model_classes", path)
    if len(classes) != n_classes:
        raise InputError(f"{path}: data_model_classes has {len(classes)} rows for rlnNrClasses {n_classes}")
    if "rlnAccuracyTranslationsAngst" in classes.columns:
        acc_trans = classes["rlnAccuracyTranslationsAngst"].to_numpy(np.float64)
    else:
        acc_trans = classes["rlnAccuracyTranslations"].to_numpy(np.float64) * pixel
    if "rlnSigmaOffsetsAngst" in general:
        sigma_offset = float(general["rlnSigmaOffsetsAngst"])
    else:
        sigma_offset = float(general["rlnSigmaOffsets"]) * pixel
    spectra = {key: np.zeros((n_classes, n_shells)) for key in ("tau2", "ssnr", "reference_sigma2", "fsc")}
    columns = {"tau2": "rlnReferenceTau2", "ssnr": "rlnSsnrMap", "reference_sigma2": "rlnReferenceSigma2",
               "fsc": "rlnGoldStandardFsc"}
    for k in range(n_classes):
        table = _table(blocks, f"model_class_{k + 1}", path)
        idx = _spectral_index(table, n_shells, path, f"model_class_{k + 1}")
        for key, column in columns.items():
            spectra[key][k, idx] = table[column].to_numpy(np.float64)
    noise_names = sorted((n for n in blocks if n.startswith("model_optics_group_")),
                         key=lambda n: int(n.rsplit("_", 1)[1]))
    if not noise_names:  # before RELION 4.0: one noise spectrum per group, the first stands for all
        noise_names = ["model_group_1"] if "model_group_1" in blocks else []
    sigma2_noise = np.zeros((len(noise_names), n_shells))
    for g, name in enumerate(noise_names):
        table = _table(blocks, name, path)
        if len(table):
            sigma2_noise[g, _spectral_index(table, n_shells, path, name)] = table["rlnSigma2Noise"].to_numpy(np.float64)
    scale = None
    if "model_groups" in blocks:
        groups = _table(blocks, "model_groups", path).sort_values("rlnGroupNumber")
        scale = groups["rlnGroupScaleCorrection"].to_numpy(np.float64)
    return {
        "general": general,
        "pdf_class": classes["rlnClassDistribution"].to_numpy(np.float64),
        "accuracy_rotations_deg": float(classes["rlnAccuracyRotations"].iloc[0]),
        "accuracy_translations_angstrom": float(acc_trans[0]),
        "sigma_offset_angstrom": sigma_offset,
        "sigma2_noise": sigma2_noise,
        "scale_correction": scale,
        **spectra,
    }


def _read_sampling_star(path):
    general = read_star(path).get("sampling_general")
    if not isinstance(general, dict):
        raise InputError(f"{path}: no single-value block data_sampling_general; give a sampling.star")
    for label in ("rlnHealpixOrder", "rlnOffsetRange", "rlnOffsetStep"):
        if label not in general:
            raise InputError(f"{path}: data_sampling_general has no {label}")
    return general


def _table(blocks, name, path):
    block = blocks.get(name)
    if block is None:
        raise InputError(f"{path}: block data_{name} is missing")
    if isinstance(block, dict):  # a loop of one row may come back as single values
        return pd.DataFrame([block])
    return block


def _spectral_index(table, n_shells, path, name):
    idx = table["rlnSpectralIndex"].to_numpy(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n_shells):
        raise InputError(f"{path}: data_{name} has rlnSpectralIndex outside 0 … {n_shells - 1}")
    return idx


# ---------------------------------------------------------------------------- resume extras

def resume_extras_path(optimiser_star_path) -> Path:
    """The side file beside run_itNNN_optimiser.star: run_itNNN_optimiser_extra.json."""
    path = Path(optimiser_star_path)
    stem = path.name[: -len(".star")] if path.name.endswith(".star") else path.name
    return path.with_name(f"{stem}_extra.json")


def write_resume_extras(path, extras: dict, *, model: ModelState | None = None,
                        optimiser: OptimiserState | None = None) -> None:
    """Write what --continue needs beyond RELION's files as JSON, atomically.

    `extras` maps names to JSON values, numpy arrays or numpy scalars (arrays come back as
    arrays of the same dtype and shape; floats are exact). Given `model` and/or `optimiser`, their
    scalars and arrays (not the maps) are stored too; `state_from_star_files` then uses them
    where the STAR files hold a value only after a unit conversion or not at all.
    """
    document = {"format": EXTRAS_FORMAT, "version": EXTRAS_VERSION, "extras": _encode(extras)}
    if model is not None:
        document["model_state"] = _encode({f.name: getattr(model, f.name)
                                           for f in dataclasses.fields(model) if f.name != "maps"})
    if optimiser is not None:
        document["optimiser_state"] = _encode(dataclasses.asdict(optimiser))
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            json.dump(document, fh, indent=1, allow_nan=True)


def read_resume_extras(path) -> dict:
    """The `extras` dict given to `write_resume_extras`, arrays restored."""
    return _read_extras_document(Path(path)).get("extras", {})


def _read_extras_document(path):
    if not path.is_file():
        raise InputError(f"{path}: file not found; it is written beside each run_itNNN_optimiser.star")
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != EXTRAS_FORMAT:
        raise InputError(f"{path}: not a cryorefine resume file (no format {EXTRAS_FORMAT!r})")
    return _decode(document)


def _apply_saved_state(state, saved, path, what):
    """`state` with the saved values, after checking that its scalars agree with the STAR files'."""
    if not saved:
        return state
    names = {f.name for f in dataclasses.fields(state)}
    changes = {}
    for name, exact in saved.items():
        if name not in names or name == "maps":
            continue
        current = getattr(state, name)
        if np.ndim(current) == 0 and not _agrees(current, exact):
            raise InputError(f"{path}: {what}.{name} = {exact!r} disagrees with the STAR files ({current!r}); "
                             f"the side file belongs to another iteration: remove it to resume from the STAR "
                             f"files alone")
        changes[name] = exact
    return dataclasses.replace(state, **changes)


def _agrees(from_star, exact):
    """Scalars equal to 1e-9 relative (the STAR value may have gone through a unit conversion or
    been rounded to an integer label)."""
    if from_star is None or exact is None:  # not held in the STAR files, or not set when saved
        return True
    if np.ndim(exact) != 0:
        return False
    a, b = float(from_star), float(exact)
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return a == b or (math.isnan(a) and math.isnan(b))
    if a.is_integer() and round(b) == a:  # an integer label (rlnSmallestChangesClasses)
        return True
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _encode(value):
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise TypeError(f"cannot store a numpy array of dtype {value.dtype} in the resume file")
        return {"__ndarray__": value.ravel().tolist(), "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"resume file keys must be strings, got {key!r}")
            out[key] = _encode(item)
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot store {type(value).__name__} in the resume file; convert it to JSON values")


def _decode(value):
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["__ndarray__"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


# ------------------------------------------------------------------------------------ helpers

def _iteration_root(output_root, iteration):
    return str(output_root) if iteration is None else f"{output_root}_it{int(iteration):03d}"


def _f(value) -> str:
    """A float as the shortest text that reads back to the same float64."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    return repr(value)


def _fcol(values) -> list:
    return [_f(v) for v in np.asarray(values, dtype=np.float64).ravel()]


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

"""model.star, optimiser.star and sampling.star as RELION writes them, and the --continue round trip."""

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import starfile

from cryorefine import __version__
from cryorefine.config import RefineConfig
from cryorefine.core.sampling import Sampling
from cryorefine.em.state import ModelState, OptimiserState
from cryorefine.io import relion_outputs as ro
from cryorefine.io.star import read_star, write_star

# Labels RELION 3.0 wrote that RELION 3.1+ renamed (we write the new ones).
RENAMED_30_TO_31 = {
    "rlnSigmaOffsets": "rlnSigmaOffsetsAngst",
    "rlnAccuracyTranslations": "rlnAccuracyTranslationsAngst",
    "rlnOverallAccuracyTranslations": "rlnOverallAccuracyTranslationsAngst",
}
# Blocks RELION 4.0 renamed: the noise spectra moved from per-group to per-optics-group blocks.
RENAMED_BLOCKS_30_TO_4 = {"model_group_1": "model_optics_group_1"}

# Labels RELION 3.1+/4/5 writes that the RELION 3.0-era files lack.
MODEL_GENERAL_ADDED_SINCE_30 = {"rlnNrOpticsGroups"}
MODEL_CLASSES_ADDED_SINCE_30 = {"rlnEstimatedResolution", "rlnOverallFourierCompleteness"}
MODEL_CLASS_ADDED_SINCE_30 = {"rlnFourierCompleteness"}

# optimiser_general as RELION 5.0.1 writes it (3dem/relion 73f0a3c0, src/ml_optimiser.cpp MlOptimiser::write, the
# EMDL labels' names from src/metadata_label.h), in its order; rlnModelStarFile2 with half sets only
RELION5_OPTIMISER_LABELS = (
    "rlnOutputRootName", "rlnModelStarFile", "rlnModelStarFile2", "rlnExperimentalDataStarFile",
    "rlnTomoTomogramsFile", "rlnTomoTrajectoriesFile", "rlnOrientSamplingStarFile", "rlnCurrentIteration",
    "rlnNumberOfIterations", "rlnDoSplitRandomHalves", "rlnJoinHalvesUntilThisResolution",
    "rlnAdaptiveOversampleOrder", "rlnAdaptiveOversampleFraction", "rlnRandomSeed", "rlnParticleDiameter",
    "rlnWidthMaskEdge", "rlnDoZeroMask", "rlnDoSolventFlattening", "rlnDoSolventFscCorrection",
    "rlnSolventMaskName", "rlnSolventMask2Name", "rlnBodyStarFile", "rlnTauSpectrumName",
    "rlnMaximumCoarseImageSize", "rlnHighresLimitExpectation", "rlnLowresLimitExpectation", "rlnIncrementImageSize",
    "rlnDoMapEstimation", "rlnDoFastSubsetOptimisation", "rlnDoExternalReconstruct", "rlnDoBlush",
    "rlnBlushNoSpectralTrailing", "rlnDoGradientRefine", "rlnDoStochasticGradientDescent", "rlnGradEmIters",
    "rlnGradHasConverged", "rlnGradCurrentStepsize", "rlnGradSubsetOrder", "rlnGradSuspendFinerSamplingIter",
    "rlnGradSuspendLocalSamplingIter", "rlnSgdInitialIterationsFraction", "rlnSgdFinalIterationsFraction",
    "rlnSgdMinimumResolution", "rlnSgdInitialResolution", "rlnSgdFinalResolution", "rlnSgdInitialSubsetSize",
    "rlnSgdFinalSubsetSize", "rlnSgdMuFactor", "rlnSgdSkipAnneal", "rlnSgdClassInactivityThreshold",
    "rlnSgdSubsetSize", "rlnSgdWriteEverySubset", "rlnSgdStepsize", "rlnSgdStepsizeScheme", "rlnTau2FudgeScheme",
    "rlnTau2FudgeArg", "rlnMaximumSignificantPoses", "rlnDoAutoRefine", "rlnDoAutoSampling",
    "rlnAutoLocalSearchesHealpixOrder", "rlnNumberOfIterWithoutResolutionGain", "rlnBestResolutionThusFar",
    "rlnNumberOfIterWithoutChangingAssignments", "rlnDoSkipAlign", "rlnDoSkipRotate", "rlnOverallAccuracyRotations",
    "rlnOverallAccuracyTranslationsAngst", "rlnChangesOptimalOrientations", "rlnChangesOptimalOffsets",
    "rlnChangesOptimalClasses", "rlnSmallestChangesOrientations", "rlnSmallestChangesOffsets",
    "rlnSmallestChangesClasses", "rlnLocalSymmetryFile", "rlnDoHelicalRefine", "rlnIgnoreHelicalSymmetry",
    "rlnFourierMask", "rlnHelicalTwistInitial", "rlnHelicalRiseInitial", "rlnHelicalCentralProportion",
    "rlnNrHelicalNStart", "rlnHelicalMaskTubeInnerDiameter", "rlnHelicalMaskTubeOuterDiameter",
    "rlnHelicalSymmetryLocalRefinement", "rlnHelicalSigmaDistance", "rlnHelicalKeepTiltPriorFixed",
    "rlnHasConverged", "rlnHasHighFscAtResolLimit", "rlnHasLargeSizeIncreaseIterationsAgo", "rlnDoCorrectNorm",
    "rlnDoCorrectScale", "rlnDoCorrectCtf", "rlnDoCenterClasses", "rlnDoIgnoreCtfUntilFirstPeak",
    "rlnCtfDataArePhaseFlipped", "rlnDoOnlyFlipCtfPhases", "rlnRefsAreCtfCorrected", "rlnFixSigmaNoiseEstimates",
    "rlnFixSigmaOffsetEstimates", "rlnMaxNumberOfPooledParticles", "rlnOffsetRangeX", "rlnOffsetRangeY",
    "rlnOffsetRangeZ",
)
# RELION 5's labels left out: the settings and state of gradient refinement, which is not run here
# (rlnDoGradientRefine and rlnDoStochasticGradientDescent are written, 0); RELION's reader defaults them
OPTIMISER_OMITTED_VS_5 = {
    "rlnGradEmIters", "rlnGradHasConverged", "rlnGradCurrentStepsize", "rlnGradSubsetOrder",
    "rlnGradSuspendFinerSamplingIter", "rlnGradSuspendLocalSamplingIter", "rlnSgdInitialIterationsFraction",
    "rlnSgdFinalIterationsFraction", "rlnSgdMinimumResolution", "rlnSgdInitialResolution", "rlnSgdFinalResolution",
    "rlnSgdInitialSubsetSize", "rlnSgdFinalSubsetSize", "rlnSgdMuFactor", "rlnSgdSkipAnneal",
    "rlnSgdClassInactivityThreshold", "rlnSgdSubsetSize", "rlnSgdWriteEverySubset", "rlnSgdStepsize",
    "rlnSgdStepsizeScheme",
}
# optimiser_general against RELION 3.1's own Class3D file (run_it025_optimiser_3D.star):
OPTIMISER_ADDED_VS_31 = {
    "rlnCoarseImageSize",  # a RELION 3.0 label RELION still knows; we keep writing it
    "rlnMaximumSignificantPoses", "rlnDoAutoSampling", "rlnDoCenterClasses",  # RELION 4/5
    "rlnOffsetRangeX", "rlnOffsetRangeY", "rlnOffsetRangeZ",  # RELION 5
    "rlnTomoTomogramsFile", "rlnTomoTrajectoriesFile", "rlnDoBlush", "rlnBlushNoSpectralTrailing",  # RELION 5
    "rlnDoGradientRefine", "rlnTau2FudgeScheme", "rlnTau2FudgeArg",  # RELION 5
}
OPTIMISER_OMITTED_VS_31 = {  # stochastic gradient descent, not implemented (RELION 5 renamed them anyway)
    "rlnDoStochasticEM", "rlnSgdInitialIterations", "rlnSgdFinalIterations",
    "rlnSgdInBetweenIterations", "rlnSgdInitialResolution", "rlnSgdFinalResolution", "rlnSgdInitialSubsetSize",
    "rlnSgdFinalSubsetSize", "rlnSgdMuFactor", "rlnSgdSigma2FudgeInitial", "rlnSgdSigma2FudgeHalflife",
    "rlnSgdSkipAnneal", "rlnSgdSubsetSize", "rlnSgdWriteEverySubset", "rlnSgdStepsize",
}
# ... and against RELION 3.0's (ref_it002_optimiser.star), after the renames:
OPTIMISER_OMITTED_VS_30 = {"rlnDoRealignMovies", "rlnAvailableMemory"}  # dropped by RELION 3.1

# Every label RELION's readers require (MlOptimiser::read, MlModel::read, HealpixSampling::read).
OPTIMISER_REQUIRED = {
    "rlnOutputRootName", "rlnModelStarFile", "rlnExperimentalDataStarFile", "rlnOrientSamplingStarFile",
    "rlnCurrentIteration", "rlnNumberOfIterations", "rlnDoSplitRandomHalves", "rlnJoinHalvesUntilThisResolution",
    "rlnAdaptiveOversampleOrder", "rlnAdaptiveOversampleFraction", "rlnRandomSeed", "rlnParticleDiameter",
    "rlnWidthMaskEdge", "rlnDoZeroMask", "rlnDoSolventFlattening", "rlnSolventMaskName", "rlnSolventMask2Name",
    "rlnTauSpectrumName", "rlnMaximumCoarseImageSize", "rlnHighresLimitExpectation", "rlnIncrementImageSize",
    "rlnDoMapEstimation", "rlnDoAutoRefine", "rlnAutoLocalSearchesHealpixOrder",
    "rlnNumberOfIterWithoutResolutionGain", "rlnBestResolutionThusFar", "rlnNumberOfIterWithoutChangingAssignments",
    "rlnDoSkipAlign", "rlnOverallAccuracyRotations", "rlnChangesOptimalOrientations", "rlnChangesOptimalOffsets",
    "rlnChangesOptimalClasses", "rlnSmallestChangesOrientations", "rlnSmallestChangesOffsets",
    "rlnSmallestChangesClasses", "rlnHasConverged", "rlnHasHighFscAtResolLimit",
    "rlnHasLargeSizeIncreaseIterationsAgo", "rlnDoCorrectNorm", "rlnDoCorrectScale", "rlnDoCorrectCtf",
    "rlnDoIgnoreCtfUntilFirstPeak", "rlnCtfDataArePhaseFlipped", "rlnDoOnlyFlipCtfPhases", "rlnRefsAreCtfCorrected",
    "rlnFixSigmaNoiseEstimates", "rlnFixSigmaOffsetEstimates", "rlnMaxNumberOfPooledParticles",
    "rlnOverallAccuracyTranslationsAngst",
}


def _outputs(real_data):
    return real_data / "relion_outputs"


def _rename(labels):
    return [RENAMED_30_TO_31.get(label, label) for label in labels]


def _labels(block):
    return list(block.columns) if isinstance(block, pd.DataFrame) else list(block)


def make_states(seed=0, size_px=48, n_classes=2, n_groups=2, local=True):
    rng = np.random.default_rng(seed)
    n = size_px // 2 + 1
    model = ModelState(
        ori_size_px=size_px, pixel_size_angstrom=float(rng.uniform(0.7, 3.0)), n_classes=n_classes,
        padding_factor=2.0, pdf_class=rng.dirichlet(np.ones(n_classes)),
        sigma2_noise=rng.uniform(1e-6, 1e-2, (n_groups, n)), tau2=rng.uniform(0, 1, (2, n_classes, n)),
        ssnr=rng.uniform(0, 20, (2, n_classes, n)), reference_sigma2=rng.uniform(0, 1e-3, (2, n_classes, n)),
        fsc_halves=rng.uniform(-0.1, 1, (n_classes, n)), sigma_offset_angstrom=float(rng.uniform(1, 20)),
        avg_norm_correction=float(rng.uniform(0.5, 1.5)), scale_correction=rng.uniform(0.8, 1.2, n_groups),
        current_resolution_angstrom=float(rng.uniform(3, 40)), current_size_px=int(rng.integers(10, size_px)),
        coarse_size_px=int(rng.integers(10, size_px)), log_likelihood=float(rng.normal() * 1e10),
        ave_pmax=float(rng.uniform()), accuracy_rotations_deg=float(rng.uniform(0, 10)),
        accuracy_translations_angstrom=float(rng.uniform(0, 5)), class_distribution=rng.dirichlet(np.ones(n_classes)))
    optimiser = OptimiserState(
        iteration=int(rng.integers(1, 30)), healpix_order=int(rng.integers(1, 4)),
        offset_range_px=float(rng.uniform(1, 10)), offset_step_px=float(rng.uniform(0.3, 2)),
        perturbation=float(rng.uniform(-0.5, 0.5)), local_searches=local, sigma_rot_deg=float(rng.uniform(0, 3)),
        sigma_tilt_deg=float(rng.uniform(0, 3)), sigma_psi_deg=float(rng.uniform(0, 3)),
        nr_iter_wo_resol_gain=int(rng.integers(0, 5)), nr_iter_wo_large_hidden_variable_changes=int(rng.integers(0, 5)),
        best_resolution_so_far_inv_angstrom=float(rng.uniform(0, 0.3)),
        changes_optimal_orientations_deg=float(rng.uniform(0, 30)),
        changes_optimal_offsets_angstrom=float(rng.uniform(0, 5)), changes_optimal_classes=float(rng.uniform(0, 1)),
        smallest_changes_orientations_deg=float(rng.uniform(0, 30)),
        smallest_changes_offsets_angstrom=float(rng.uniform(0, 5)), smallest_changes_classes=float(rng.integers(0, 99)),
        has_converged=bool(rng.integers(2)), has_high_fsc_at_resol_limit=bool(rng.integers(2)),
        has_large_size_increase_iterations_ago=int(rng.integers(0, 4)), do_join_halves=False,
        acc_rot_deg=float(rng.uniform(0, 10)), acc_trans_angstrom=float(rng.uniform(0, 5)))
    return model, optimiser


def make_config(auto_refine=True, **kw):
    return RefineConfig(input_star="particles.star", output_root="out/run", reference_map="ref.mrc",
                        particle_diameter_angstrom=200.0, auto_refine=auto_refine, tau2_fudge=4.0, **kw)


def write_iteration(folder, model, optimiser, config, sampling=None, halves=True):
    """Write one iteration's STAR files as the refinement loop does; returns the optimiser.star path."""
    root = f"{folder}/run"
    it = optimiser.iteration
    sampling = sampling or Sampling(optimiser.healpix_order, optimiser.offset_range_px, optimiser.offset_step_px,
                                    perturbation=optimiser.perturbation)
    names = [f"{root}_it{it:03d}_class{k + 1:03d}.mrc" for k in range(model.n_classes)]
    groups = [f"opticsGroup{g + 1}" for g in range(model.sigma2_noise.shape[0])]
    counts = [100 + g for g in range(len(groups))]
    if halves and not optimiser.do_join_halves:
        for half in (1, 2):
            write_star(ro.model_star_blocks(model, optimiser, config, half, names, groups, counts),
                       f"{root}_it{it:03d}_half{half}_model.star")
    else:
        write_star(ro.model_star_blocks(model, optimiser, config, None, names, groups, counts),
                   f"{root}_it{it:03d}_model.star")
    ro.write_sampling_star(f"{root}_it{it:03d}_sampling.star", sampling, optimiser, config, model.pixel_size_angstrom)
    path = Path(f"{root}_it{it:03d}_optimiser.star")
    ro.write_optimiser_star(path, ro.optimiser_star_blocks(optimiser, model, config, root, it),
                            ["--o", root, "--i", "particles.star", "--healpix_order", "2"])
    return path


# ------------------------------------------------------------------ labels against RELION's files

def test_model_star_labels_match_relion(real_data):
    model, optimiser = make_states(n_classes=1, n_groups=1)
    blocks = ro.model_star_blocks(model, optimiser, make_config(), 1, ["a_class001.mrc"], ["og1"], [10],
                                  pdf_direction=np.full((1, 192), 1 / 192))
    for name in ("rib80s_run003_model_trunc.star", "ref_it002_model.star"):
        relion = read_star(_outputs(real_data) / name)
        # model_general: RELION's order, with rlnNrOpticsGroups (RELION 4+) after rlnNrGroups
        expected = _rename(_labels(relion["model_general"]))
        if "rlnIsHelix" not in expected:  # the 3.0 tutorial file predates rlnIsHelix/rlnNrBodies
            expected.insert(expected.index("rlnPaddingFactor") + 1, "rlnIsHelix")
            expected.insert(expected.index("rlnNrClasses") + 1, "rlnNrBodies")
        expected.insert(expected.index("rlnNrGroups") + 1, "rlnNrOpticsGroups")
        assert _labels(blocks["model_general"]) == expected, name
        assert set(_labels(blocks["model_general"])) - set(_rename(_labels(relion["model_general"]))) <= \
            MODEL_GENERAL_ADDED_SINCE_30 | {"rlnIsHelix", "rlnNrBodies"}
        assert set(_labels(blocks["model_classes"])) == set(_rename(_labels(relion["model_classes"]))) | \
            MODEL_CLASSES_ADDED_SINCE_30
        ours = _labels(blocks["model_class_1"])
        theirs = _labels(relion["model_class_1"])
        assert [label for label in ours if label not in MODEL_CLASS_ADDED_SINCE_30] == theirs, name
    relion = read_star(_outputs(real_data) / "ref_it002_model.star")
    for block in ("model_groups", "model_pdf_orient_class_1"):
        assert _labels(blocks[block]) == _labels(relion[block])
    for old, new in RENAMED_BLOCKS_30_TO_4.items():
        assert _labels(blocks[new]) == _labels(relion[old])
    # RELION's block order
    assert list(blocks) == ["model_general", "model_classes", "model_class_1", "model_groups",
                            "model_optics_group_1", "model_pdf_orient_class_1"]


def test_optimiser_star_labels_match_relion(real_data, tmp_path):
    model, optimiser = make_states()
    ours = ro.optimiser_star_blocks(optimiser, model, make_config(auto_refine=False), "Class3D/job020/run", None)
    ours = _labels(ours["optimiser_general"])
    relion31 = _labels(read_star(_outputs(real_data) / "run_it025_optimiser_3D.star")["optimiser_general"])
    assert set(ours) - set(relion31) == OPTIMISER_ADDED_VS_31
    assert set(relion31) - set(ours) == OPTIMISER_OMITTED_VS_31
    # the labels both have come in RELION's order
    assert [label for label in ours if label in relion31] == [label for label in relion31 if label in ours]
    relion30 = _rename(_labels(read_star(_outputs(real_data) / "ref_it002_optimiser.star")["optimiser_general"]))
    assert set(relion30) - set(ours) == OPTIMISER_OMITTED_VS_30
    assert OPTIMISER_REQUIRED <= set(ours)
    # gold-standard halves: the second model file is named as well
    split = _labels(ro.optimiser_star_blocks(optimiser, model, make_config(), "out/run", None)["optimiser_general"])
    assert set(split) - set(ours) == {"rlnModelStarFile2"}


def test_optimiser_star_labels_are_relion_5s_in_its_order():
    """Every label of RELION 5.0.1's MlOptimiser::write but gradient refinement's, in its order (rlnCoarseImageSize
    after rlnTauSpectrumName), for a classification and for half sets; the values of RELION 5's labels true to the
    run."""
    model, optimiser = make_states()
    for config, second_model in ((make_config(auto_refine=False), False), (make_config(), True)):
        ours = ro.optimiser_star_blocks(optimiser, model, config, "out/run", None)["optimiser_general"]
        expected = [label for label in RELION5_OPTIMISER_LABELS if label not in OPTIMISER_OMITTED_VS_5
                    and (second_model or label != "rlnModelStarFile2")]
        expected.insert(expected.index("rlnTauSpectrumName") + 1, "rlnCoarseImageSize")
        assert list(ours) == expected
        assert (ours["rlnDoBlush"], ours["rlnDoGradientRefine"], ours["rlnDoStochasticGradientDescent"]) == (0, 0, 0)
        assert ours["rlnTomoTomogramsFile"] == ours["rlnTomoTrajectoriesFile"] == ""
        assert (ours["rlnTau2FudgeScheme"], float(ours["rlnTau2FudgeArg"])) == ("plain", config.tau2_fudge)
        assert ours["rlnDoFastSubsetOptimisation"] == 0
    fast = ro.optimiser_star_blocks(optimiser, model, make_config(auto_refine=False, fast_subsets=True), "out/run",
                                    None)["optimiser_general"]
    assert fast["rlnDoFastSubsetOptimisation"] == 1


def test_sampling_star_matches_relion_31(real_data, tmp_path):
    relion = read_star(_outputs(real_data) / "run_it025_sampling_3D.star")
    config = make_config(offset_range_px=5.0, offset_step_px=2.0)
    optimiser = OptimiserState(healpix_order=2, offset_range_px=5.0, offset_step_px=2.0, perturbation=-0.36408)
    sampling = Sampling(2, 5.0, 2.0, perturbation=-0.36408)
    ro.write_sampling_star(tmp_path / "run_it025_sampling.star", sampling, optimiser, config, pixel_size_angstrom=0.885)
    ours = read_star(tmp_path / "run_it025_sampling.star")
    assert _labels(ours["sampling_general"]) == _labels(relion["sampling_general"])
    assert _labels(ours["sampling_directions"]) == _labels(relion["sampling_directions"])
    general = ours["sampling_general"]
    for label, value in relion["sampling_general"].items():  # the same run: 5 px and 2 px at 0.885 Å/px
        if isinstance(value, str):
            assert general[label] == value, label
        else:
            assert float(general[label]) == pytest.approx(value, abs=1e-5), label
    theirs = relion["sampling_directions"][["rlnAngleRot", "rlnAngleTilt"]].to_numpy()
    mine = ours["sampling_directions"].astype(float).to_numpy()
    assert mine.shape == theirs.shape == (192, 2)
    np.testing.assert_allclose(mine, theirs, atol=1e-3)
    # the RELION 3.0 file has the same directions, and a subset of the labels (offsets in px then)
    relion30 = read_star(_outputs(real_data) / "ref_it002_sampling.star")
    assert set(_labels(relion30["sampling_general"])) < set(_labels(ours["sampling_general"]))
    np.testing.assert_allclose(mine, relion30["sampling_directions"].to_numpy(), atol=1e-3)


# --------------------------------------------------------------------------- values and columns

def test_spectra_land_in_their_columns():
    model, optimiser = make_states(size_px=40, n_classes=2, n_groups=2)
    config = make_config()
    n = model.n_shells
    blocks = {half: ro.model_star_blocks(model, optimiser, config, half, ["a", "b"], ["g1", "g2"], [3, 4])
              for half in (1, 2, None)}
    shells = np.arange(n)
    for half, row in ((1, 0), (2, 1), (None, 0)):
        for k in range(2):
            table = blocks[half][f"model_class_{k + 1}"].astype(float)
            np.testing.assert_array_equal(table["rlnSpectralIndex"], shells)
            np.testing.assert_array_equal(table["rlnResolution"], shells / (40 * model.pixel_size_angstrom))
            np.testing.assert_allclose(table["rlnAngstromResolution"][1:], 40 * model.pixel_size_angstrom / shells[1:],
                                       rtol=1e-15)
            assert table["rlnAngstromResolution"][0] == 999.0
            np.testing.assert_array_equal(table["rlnReferenceTau2"], model.tau2[row, k])
            np.testing.assert_array_equal(table["rlnSsnrMap"], model.ssnr[row, k])
            np.testing.assert_array_equal(table["rlnReferenceSigma2"], model.reference_sigma2[row, k])
            np.testing.assert_array_equal(table["rlnGoldStandardFsc"], model.fsc_halves[k])
    general = blocks[1]["model_general"]
    assert float(general["rlnCurrentResolution"]) == model.current_resolution_angstrom
    assert float(general["rlnSigmaOffsetsAngst"]) == model.sigma_offset_angstrom
    assert float(general["rlnSigmaPriorTiltAngle"]) == optimiser.sigma_tilt_deg
    assert general["rlnOrientationalPriorMode"] == 1 and general["rlnTau2FudgeFactor"] == "4.0"
    groups = blocks[1]["model_groups"]
    assert list(groups["rlnGroupName"]) == ["g1", "g2"] and list(groups["rlnGroupNrParticles"]) == [3, 4]
    np.testing.assert_array_equal(groups["rlnGroupScaleCorrection"].astype(float), model.scale_correction)
    classes = blocks[1]["model_classes"]
    np.testing.assert_array_equal(classes["rlnClassDistribution"].astype(float), model.pdf_class)
    assert float(classes["rlnAccuracyTranslationsAngst"][1]) == model.accuracy_translations_angstrom


def test_resolution_columns_equal_relions(real_data):
    """Our rlnResolution / rlnAngstromResolution for RELION's own box and pixel size equal RELION's."""
    for name in ("rib80s_run003_model_trunc.star", "ref_it002_model.star"):
        relion = read_star(_outputs(real_data) / name)
        general = relion["model_general"]
        size, pixel = int(general["rlnOriginalImageSize"]), float(general["rlnPixelSize"])
        model = ModelState(ori_size_px=size, pixel_size_angstrom=pixel)
        ours = ro.model_star_blocks(model, OptimiserState(), make_config(), 1, ["a"], ["g"], [1])["model_class_1"]
        theirs = relion["model_class_1"]
        rows = theirs["rlnSpectralIndex"].to_numpy()
        np.testing.assert_allclose(ours["rlnResolution"].astype(float)[rows], theirs["rlnResolution"], atol=1e-6)
        np.testing.assert_allclose(ours["rlnAngstromResolution"].astype(float)[rows],
                                   theirs["rlnAngstromResolution"], rtol=2e-6)


def test_noise_spectrum_only_shells_with_power():
    model, optimiser = make_states(size_px=32, n_classes=1, n_groups=2)
    model.sigma2_noise[1, 10:] = 0.0
    blocks = ro.model_star_blocks(model, optimiser, make_config(), 1, ["a"], ["g1", "g2"], [1, 1])
    assert len(blocks["model_optics_group_1"]) == 17
    second = blocks["model_optics_group_2"].astype(float)
    np.testing.assert_array_equal(second["rlnSpectralIndex"], np.arange(10))
    np.testing.assert_array_equal(second["rlnSigma2Noise"], model.sigma2_noise[1, :10])


def test_estimated_resolution_and_completeness():
    size, pixel = 64, 1.5
    ssnr = np.full(33, 10.0)
    ssnr[6:] = 0.5
    ssnr[9] = 3.0  # after the first drop: ignored, as RELION does
    completeness = np.linspace(1.0, 0.2, 33)
    estimated, total = ro._estimated_resolution_and_completeness(ssnr, completeness, size, pixel)
    assert estimated == size * pixel / 5
    # brute force over RELION's cube of half-width maxres − 1
    c = np.arange(-4, 5)
    r = np.floor(np.sqrt(c[:, None, None] ** 2 + c[None, :, None] ** 2 + c[None, None, :] ** 2)).astype(int)
    r = r[r <= 5]
    assert total == pytest.approx(completeness[r].mean(), rel=1e-12)
    assert ro._estimated_resolution_and_completeness(np.full(33, 0.5), completeness, size, pixel) == (999.0, 0.0)
    for maxres in (1, 2, 7, 20):
        c = np.arange(-(maxres - 1), maxres)
        r = np.floor(np.sqrt(c[:, None, None] ** 2 + c[None, :, None] ** 2 + c[None, None, :] ** 2)).astype(int)
        np.testing.assert_array_equal(ro._shell_counts_in_cube(maxres),
                                      np.bincount(r[r <= maxres], minlength=maxres + 1))


def test_classes_table_with_completeness():
    model, optimiser = make_states(size_px=32, n_classes=2, n_groups=1)
    model.ssnr[0] = 5.0
    completeness = np.full((2, 17), 0.75)
    classes = ro.model_star_blocks(model, optimiser, make_config(), 1, ["a", "b"], ["g"], [1],
                                   fourier_completeness=completeness)["model_classes"]
    np.testing.assert_allclose(classes["rlnEstimatedResolution"].astype(float), 32 * model.pixel_size_angstrom / 16)
    np.testing.assert_allclose(classes["rlnOverallFourierCompleteness"].astype(float), 0.75, rtol=1e-12)


def test_class_offset_priors_only_for_2d_references():
    """RELION writes rlnClassPriorOffsetX/Y for 2D references and its reader refuses 2D classes without them
    (MlModel::readStar); 3D classes have none."""
    model, optimiser = make_states(size_px=32, n_classes=2, n_groups=1)
    for dims, expected in ((2, True), (3, False)):
        classes = ro.model_star_blocks(model, optimiser, make_config(), None, ["a", "b"], ["g"], [1],
                                       reference_dimensionality=dims)["model_classes"]
        columns = list(classes.columns)
        assert ({"rlnClassPriorOffsetX", "rlnClassPriorOffsetY"} <= set(columns)) is expected, dims
        if expected:  # after the overall completeness, as RELION's MlModel::write puts them
            assert columns[-3:] == ["rlnOverallFourierCompleteness", "rlnClassPriorOffsetX", "rlnClassPriorOffsetY"]


def test_bad_shapes_and_disagreeing_sampling_are_refused(tmp_path):
    model, optimiser = make_states(n_classes=2, n_groups=1)
    with pytest.raises(ValueError, match="reference image names"):
        ro.model_star_blocks(model, optimiser, make_config(), 1, ["a"], ["g"], [1])
    with pytest.raises(ValueError, match="sigma2_noise"):
        ro.model_star_blocks(model, optimiser, make_config(), 1, ["a", "b"], ["g", "h"], [1, 1])
    with pytest.raises(ValueError, match="half"):
        ro.model_star_blocks(model, optimiser, make_config(), 3, ["a", "b"], ["g"], [1])
    sampling = Sampling(optimiser.healpix_order + 1, optimiser.offset_range_px, optimiser.offset_step_px,
                        perturbation=optimiser.perturbation)
    with pytest.raises(ValueError, match="healpix_order"):
        ro.write_sampling_star(tmp_path / "run_sampling.star", sampling, optimiser, make_config(), 1.0)
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="iteration"):
        ro.optimiser_star_blocks(optimiser, model, make_config(), "out/run", optimiser.iteration + 1)


# ------------------------------------------------------------------------------- files on disk

def test_written_files_read_back_with_starfile_and_read_star(tmp_path):
    model, optimiser = make_states()
    config = make_config()
    path = write_iteration(tmp_path, model, optimiser, config)
    text = path.read_text().splitlines()
    assert text[0] == f"# RELION optimiser; version 5.0.1-cryorefine-{__version__}"  # RELION's, with our suffix
    assert text[1] == f"# --o {tmp_path}/run --i particles.star --healpix_order 2"
    for star in sorted(tmp_path.glob("*.star")):
        ours = read_star(star)
        theirs = starfile.read(star, always_dict=True)
        assert list(ours) == list(theirs)
        assert "# version 50001" in star.read_text()  # RELION 5's MetaDataTable version
    it = optimiser.iteration
    half1 = starfile.read(tmp_path / f"run_it{it:03d}_half1_model.star", always_dict=True)
    np.testing.assert_array_equal(half1["model_class_2"]["rlnReferenceTau2"], model.tau2[0, 1])
    half2 = starfile.read(tmp_path / f"run_it{it:03d}_half2_model.star", always_dict=True)
    np.testing.assert_array_equal(half2["model_class_2"]["rlnReferenceTau2"], model.tau2[1, 1])
    iteration, general = ro.read_optimiser_star(path)
    assert iteration == it
    assert general["rlnModelStarFile2"] == f"{tmp_path}/run_it{it:03d}_half2_model.star"
    assert general["rlnOverallAccuracyRotations"] == optimiser.acc_rot_deg
    sampling = starfile.read(tmp_path / f"run_it{it:03d}_sampling.star", always_dict=True)
    assert sampling["sampling_general"]["rlnOffsetRange"] == pytest.approx(
        optimiser.offset_range_px * model.pixel_size_angstrom, rel=1e-15)
    assert len(sampling["sampling_directions"]) == 12 * 4 ** optimiser.healpix_order


def test_sampling_star_written_again_holds_each_orders_directions(tmp_path):
    """write_sampling_star keeps the direction table's text for the next iterations: every file holds its own order's
    and symmetry's general block and directions (the sampling's, unperturbed), whichever was written before."""
    model, optimiser = make_states()
    config = make_config()
    for i, (order, symmetry) in enumerate(((1, "C1"), (2, "C1"), (2, "D2"), (1, "C1"), (2, "C1"))):
        opt = replace(optimiser, healpix_order=order)
        sampling = Sampling(order, opt.offset_range_px, opt.offset_step_px, perturbation=opt.perturbation,
                            symmetry=symmetry)
        path = tmp_path / f"run_it{i:03d}_sampling.star"
        ro.write_sampling_star(path, sampling, opt, config, model.pixel_size_angstrom)
        got = read_star(path)
        assert list(got) == ["sampling_general", "sampling_directions"]
        general = got["sampling_general"]
        assert int(general["rlnHealpixOrder"]) == order and general["rlnSymmetryGroup"] == symmetry
        assert float(general["rlnPsiStep"]) == pytest.approx(sampling.psi_step_deg, abs=1e-6)
        np.testing.assert_allclose(got["sampling_directions"][["rlnAngleRot", "rlnAngleTilt"]].to_numpy(dtype=float),
                                   sampling.directions_deg(), rtol=0, atol=0.6 * 10.0 ** -ro.DIRECTION_DECIMALS)
        assert len(got["sampling_directions"]) == sampling.n_directions


# ------------------------------------------------------------------------------- atomic writes

def test_failed_writes_leave_nothing(tmp_path, monkeypatch):
    model, optimiser = make_states()
    blocks = ro.optimiser_star_blocks(optimiser, model, make_config(), "out/run", None)
    target = tmp_path / "run_it001_optimiser.star"

    def broken(_blocks):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ro, "star_to_string", broken)
    with pytest.raises(RuntimeError):
        ro.write_optimiser_star(target, blocks, ["--o", "out/run"])
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    ro.write_optimiser_star(target, blocks, ["--o", "out/run"])
    before = target.read_text()
    monkeypatch.setattr(ro, "star_to_string", broken)
    with pytest.raises(RuntimeError):
        ro.write_optimiser_star(target, blocks, ["--o", "other"])
    assert target.read_text() == before and os.listdir(tmp_path) == [target.name]



def test_angdist_bild_is_relions_cylinders_and_colours():
    """RELION's *_angdist.bild (HealpixSampling::writeBildFileOrientationalDistribution), worked by hand: box 10 px of
    2 Å (R = 10 Å around the centre (10, 10, 10)), HEALPix order 0 (60°: cylinders 0.5·π·10·60/360 = 2.61799 Å
    wide); pdf 0.5, 0.25, 0, 0.25 along +z, +x, +y, −x: mean 0.25, σ 0.176777 (RELION's N/(N−1) is 1 in integers),
    colours (dev/6 + 1/6) 0.402369 and 0.166667, lengths 0.3·R·pdf/max = 3 and 1.5 Å, no cylinder where pdf is 0."""
    from cryorefine.io.relion_outputs import angdist_bild_text

    text = angdist_bild_text(np.array([0.5, 0.25, 0.0, 0.25]), np.array([0.0, 0.0, 90.0, 180.0]),
                             np.array([0.0, 90.0, 90.0, 90.0]), 10, 2.0, 0)
    assert text.splitlines() == [
        ".color 0.402369 0 0.597631", ".cylinder 10 10 20 10 10 23 2.61799",
        ".color 0.166667 0 0.833333", ".cylinder 20 10 10 21.5 10 10 2.61799",
        ".color 0.166667 0 0.833333", ".cylinder 0 10 10 -1.5 10 10 2.61799",
    ]
    # a uniform distribution: RELION's deviation is NaN there, which its clipping turns into red
    uniform = angdist_bild_text(np.full(2, 0.5), np.zeros(2), np.array([0.0, 90.0]), 10, 2.0, 0)
    assert uniform.splitlines()[0] == ".color 1 0 0" and len(uniform.splitlines()) == 4
    with pytest.raises(ValueError, match="3 directions, the sampling 2"):
        angdist_bild_text(np.ones(3), np.zeros(2), np.zeros(2), 10, 2.0, 0)


def test_angdist_bild_of_many_directions_is_each_direction_s_two_lines():
    """The bild text of a few thousand directions (some of zero probability, some too short to draw) is, line for
    line, what RELION's loop writes one direction at a time, here written out direction by direction."""
    import math

    from cryorefine.io.relion_outputs import ANGDIST_LENGTH_FRACTION, ANGDIST_MIN_LENGTH_ANGSTROM, angdist_bild_text

    rng = np.random.default_rng(4)
    n = 3000
    rot, tilt = rng.uniform(-180, 180, n), rng.uniform(0, 180, n)
    pdf = rng.exponential(size=n) * (rng.random(n) < 0.7)
    pdf[:5] = 1e-9 * pdf.max()  # too short to draw
    text = angdist_bild_text(pdf, rot, tilt, 64, 1.5, 3)
    radius, width = 64 * 1.5 / 2, 0.5 * math.pi * 48 * (360 / 48) / 360
    mean, largest = pdf.mean(), pdf.max()
    sigma = math.sqrt(abs(np.mean(pdf * pdf) - mean * mean))  # RELION's N/(N-1), in integers, is 1 here
    want = []
    for p, r, t in zip(pdf, np.radians(rot), np.radians(tilt)):
        if p <= 0:
            continue
        colour = min(max((p - mean) / sigma, -1.0), 5.0) / 6.0 + 1.0 / 6.0
        outer = radius + ANGDIST_LENGTH_FRACTION * radius * p / largest
        v = [math.cos(r) * math.sin(t), math.sin(r) * math.sin(t), math.cos(t)]
        if max(abs((radius - outer) * x) for x in v) <= ANGDIST_MIN_LENGTH_ANGSTROM:
            continue
        want.append(f".color {colour:g} 0 {1.0 - colour:g}")
        want.append(".cylinder " + " ".join(f"{x:g}" for x in [radius * x + radius for x in v]
                                            + [outer * x + radius for x in v] + [width]))
    assert 1000 < len(want) // 2 < n - 5
    assert text.splitlines() == want


def test_a_data_star_is_written_in_the_writer_s_own_process_as_write_particle_star_writes_it(tmp_path):
    """`data_star_write` hands the writer an `InOwnProcess` write (a data.star's text takes seconds to make for a large
    set, holding the interpreter), which writes what `write_particle_star` writes, and can be sent to a process."""
    import pickle

    from conftest import make_particle_set

    from cryorefine.io.background import BackgroundWriter, InOwnProcess
    from cryorefine.io.relion_outputs import data_star_write
    from cryorefine.io.star import read_particle_star, write_particle_star

    path, _ = make_particle_set(tmp_path / "in", n=5, box=8)
    star = read_particle_star(path)
    table = star.particles.assign(rlnClassNumber=[1, 2, 1, 2, 2])
    write = data_star_write(star, tmp_path / "own.star", table)
    assert isinstance(write, InOwnProcess)
    pickle.dumps(write.call)
    with BackgroundWriter() as writer:
        writer.submit([write])
    write_particle_star(star, tmp_path / "thread.star", table)
    assert (tmp_path / "own.star").read_text() == (tmp_path / "thread.star").read_text()

"""`cryorefine refine` end to end on simulated data with known poses (numpy engine)."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import starfile
from conftest import run_cli

from cryorefine.core import euler, fourier
from cryorefine.core.fourier import downsample_volume
from cryorefine.core.fsc import fsc_volumes
from cryorefine.io.mrc import read_volume, write_volume

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "examples" / "ribosome_64px.mrc"
BOX, PIXEL = 32, 12.0


@pytest.fixture(scope="module")
def refined(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refine")
    truth = downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX)
    write_volume(folder / "truth.mrc", truth, PIXEL)
    assert run_cli("simulate", "--ref", folder / "truth.mrc", "--n", 300, "--snr", 0.5, "--seed", 4,
                   "--o", folder / "sim") == 0
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", folder / "out" / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320,
                   "--flatten_solvent", "--zero_mask", "--offset_range", 3, "--offset_step", 1, "--iter", 3,
                   "--auto_refine", "--split_random_halves")
    assert code == 0
    return folder, truth


def test_outputs_have_relion_names(refined):
    folder, _ = refined
    out = folder / "out"
    for it in (1, 2, 3):
        for suffix in ("data.star", "half1_class001.mrc", "half2_class001.mrc", "half1_model.star",
                       "half2_model.star", "optimiser.star", "sampling.star", "report.png",
                       "half1_class001_angdist.bild", "half2_class001_angdist.bild"):
            assert (out / f"run_it{it:03d}_{suffix}").is_file(), suffix
    data = starfile.read(out / "run_it003_data.star")
    assert {"optics", "particles"} <= set(data)
    cols = set(data["particles"].columns)
    assert {"rlnAngleRot", "rlnOriginXAngst", "rlnMaxValueProbDistribution", "rlnNrOfSignificantSamples",
            "rlnLogLikeliContribution", "rlnRandomSubset"} <= cols


def unit_vectors(rot_deg, tilt_deg):
    rot, tilt = np.radians(np.asarray(rot_deg, float)), np.radians(np.asarray(tilt_deg, float))
    return np.stack([np.cos(rot) * np.sin(tilt), np.sin(rot) * np.sin(tilt), np.cos(tilt)], axis=-1)


def test_each_half_model_holds_its_direction_distribution_and_its_bild(refined):
    """RELION's MlModel::write for each half: data_model_pdf_orient_class_1, one row per direction of the iteration's
    sampling, summing to 1, where that half's particles point; and run_itNNN_half{1,2}_class001_angdist.bild drawn
    from it (HealpixSampling::writeBildFileOrientationalDistribution)."""
    from cryorefine.io.relion_outputs import angdist_bild_text

    folder, _ = refined
    out = folder / "out"
    sampling = starfile.read(out / "run_it003_sampling.star", always_dict=True)
    directions = sampling["sampling_directions"]
    order = int(sampling["sampling_general"]["rlnHealpixOrder"])
    particles = starfile.read(out / "run_it003_data.star")["particles"]
    pdfs = []
    for h in (1, 2):
        model = starfile.read(out / f"run_it003_half{h}_model.star", always_dict=True)
        pdf = model["model_pdf_orient_class_1"]["rlnOrientationDistribution"].to_numpy(dtype=float)
        assert len(pdf) == len(directions)
        assert pdf.min() >= 0 and pdf.sum() == pytest.approx(1.0)
        # the directions nearest to the half's best poses hold most of the distribution
        mine = particles[particles["rlnRandomSubset"] == h]
        cosines = (unit_vectors(mine["rlnAngleRot"], mine["rlnAngleTilt"])
                   @ unit_vectors(directions["rlnAngleRot"], directions["rlnAngleTilt"]).T)
        nearest = np.argmax(cosines, axis=1)
        assert pdf[np.unique(nearest)].sum() > 0.6
        # each best pose within one angular step of a direction holding some of the distribution: the pose is the
        # grid's direction perturbed and oversampled, so not always nearest to the one that took its weight (at
        # order 3 here 27 % of them; a shuffled distribution leaves 35-40 % of the poses farther than a step)
        step_deg = 360.0 / (6 * 2 ** order)
        apart_deg = np.degrees(np.arccos(np.clip(cosines[:, pdf > 0], -1.0, 1.0))).min(axis=1)
        assert (apart_deg < step_deg).mean() > 0.95
        text = (out / f"run_it003_half{h}_class001_angdist.bild").read_text()
        assert text == angdist_bild_text(pdf, directions["rlnAngleRot"], directions["rlnAngleTilt"], BOX, PIXEL,
                                         order)
        assert 0 < text.count(".cylinder") <= np.count_nonzero(pdf)  # none too short to draw
        pdfs.append(pdf)
    assert not np.array_equal(pdfs[0], pdfs[1])  # each half its own particles'


def test_map_improves_beyond_the_initial_low_pass(refined):
    folder, truth = refined
    start = fourier.irfft3_centered(fourier.lowpass_filter_3d(fourier.rfft3_centered(truth), BOX, 50, PIXEL), BOX)
    final, _ = read_volume(folder / "out" / "run_it003_half1_class001.mrc")
    shells = slice(9, 13)  # 43 – 30 Å, beyond the 50 Å start
    fsc_start = np.asarray(fsc_volumes(start, truth))[shells].mean()
    fsc_final = np.asarray(fsc_volumes(final, truth))[shells].mean()
    assert fsc_start < 0.3
    assert fsc_final > 0.75, (fsc_start, fsc_final)


def test_gold_standard_resolution_is_reported_and_better_than_the_start(refined):
    folder, _ = refined
    model = starfile.read(folder / "out" / "run_it003_half1_model.star")
    resolution = float(model["model_general"]["rlnCurrentResolution"])
    assert resolution < 45.0
    fsc = model["model_class_1"]["rlnGoldStandardFsc"].to_numpy()
    assert fsc[1:6].min() > 0.8


def test_recovered_poses_are_close_to_the_truth(refined):
    folder, _ = refined
    truth = starfile.read(folder / "sim" / "particles.star")["particles"]
    found = starfile.read(folder / "out" / "run_it003_data.star")["particles"]
    a = euler.euler_to_matrix(truth["rlnAngleRot"], truth["rlnAngleTilt"], truth["rlnAnglePsi"])
    b = euler.euler_to_matrix(found["rlnAngleRot"], found["rlnAngleTilt"], found["rlnAnglePsi"])
    cos = (np.trace(a @ np.swapaxes(b, -1, -2), axis1=-2, axis2=-1) - 1) / 2
    angle = np.rad2deg(np.arccos(np.clip(cos, -1, 1)))
    assert np.median(angle) < 8.0  # fine angular step at HEALPix order 2: 7.5°
    shift = np.hypot(truth["rlnOriginXAngst"] - found["rlnOriginXAngst"],
                     truth["rlnOriginYAngst"] - found["rlnOriginYAngst"])
    assert np.median(shift) < PIXEL  # fine translation step 0.5 px


def test_reference_box_mismatch_is_refused(tmp_path, refined):
    folder, truth = refined
    write_volume(tmp_path / "big.mrc", np.zeros((40, 40, 40), np.float32), PIXEL)
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", tmp_path / "big.mrc",
                   "--o", tmp_path / "run")
    assert code == 2
    assert not list(tmp_path.glob("run_*"))


def test_trust_ref_size_gives_the_first_iteration_of_the_reference_reboxed_by_hand(tmp_path, refined, caplog):
    """--trust_ref_size with a reference of another box and pixel size (the truth at 8 Å/px in a 60 px box) gives the
    first iteration that the same reference re-scaled and re-boxed by hand to the particles' 12 Å/px and 32 px gives
    (RELION's MlModel::initialiseFromImages: its transform windowed to round(60 · 8 / 12) = 40 px, then the map
    windowed to 32 px about its centre)."""
    folder, truth = refined
    big_ft = np.zeros((48, 48, 48), complex)  # the truth's transform zero-padded to 48 px
    big_ft[8:40, 8:40, 8:40] = np.fft.fftshift(np.fft.fftn(np.fft.ifftshift(truth.astype(np.float64)))) / truth.size
    fine = np.fft.fftshift(np.fft.ifftn(np.fft.ifftshift(big_ft)).real) * 48 ** 3
    other = np.zeros((60, 60, 60))
    other[6:54, 6:54, 6:54] = fine  # centre 24 -> 30
    write_volume(tmp_path / "other.mrc", other.astype(np.float32), 8.0)
    # by hand: the centred transform cropped to 40 px (frequencies -20 … 19), then the map's centre 32 px
    stored = read_volume(tmp_path / "other.mrc")[0].astype(np.float64)
    ft = np.fft.fftshift(np.fft.fftn(np.fft.ifftshift(stored))) / stored.size
    rescaled = np.fft.fftshift(np.fft.ifftn(np.fft.ifftshift(ft[10:50, 10:50, 10:50])).real) * 40 ** 3
    write_volume(tmp_path / "by_hand.mrc", rescaled[4:36, 4:36, 4:36].astype(np.float32), PIXEL)
    args = ("--i", folder / "sim" / "particles.star", "--ini_high", 50, "--ctf", "--particle_diameter", 320,
            "--flatten_solvent", "--zero_mask", "--offset_range", 3, "--offset_step", 1, "--iter", 1, "--cpu")
    with caplog.at_level("WARNING", logger="cryorefine"):
        assert run_cli("refine", *args, "--ref", tmp_path / "other.mrc", "--trust_ref_size", "--o",
                       tmp_path / "trusted" / "run") == 0
    assert "is 60 px at 8 Å/px: re-scaled to 40 px (12 Å/px) and re-boxed from 40 to 32 px" in caplog.text
    assert run_cli("refine", *args, "--ref", tmp_path / "by_hand.mrc", "--o", tmp_path / "by_hand" / "run") == 0
    for h in (1, 2):
        a, b = (read_volume(tmp_path / run / f"run_it001_half{h}_class001.mrc")[0] for run in ("trusted", "by_hand"))
        np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())
    a, b = (starfile.read(tmp_path / run / "run_it001_data.star")["particles"] for run in ("trusted", "by_hand"))
    assert (np.abs(a["rlnAngleRot"] - b["rlnAngleRot"]) < 1e-3).mean() > 0.98
    # and the reference is the truth again, to the resampling's accuracy
    assert np.asarray(fsc_volumes(rescaled[4:36, 4:36, 4:36], truth))[1:12].min() > 0.99


def test_unimplemented_relion_option_is_refused(tmp_path, refined, capsys):
    folder, _ = refined
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", tmp_path / "run", "--local_symmetry", "operators.star")
    assert code == 2
    assert "--local_symmetry" in capsys.readouterr().err


def test_real_relion31_particles_run_two_iterations(real_data, tmp_path):
    """Real RELION 3.1 metadata and 256 px images through two iterations (a smoke test).

    The reference is a featureless Gaussian ball, so --maxsig keeps the broad first posteriors cheap.
    """
    n = 256
    z, y, x = np.mgrid[:n, :n, :n] - n // 2
    write_volume(tmp_path / "ball.mrc", np.exp(-(x ** 2 + y ** 2 + z ** 2) / (2 * 30.0 ** 2)).astype(np.float32), 2.806)
    code = run_cli("refine", "--i", real_data / "relion31/relion31.star", "--ref", tmp_path / "ball.mrc",
                   "--o", tmp_path / "run", "--iter", 2, "--ini_high", 60, "--ctf", "--particle_diameter", 350,
                   "--zero_mask", "--flatten_solvent", "--norm", "--scale", "--maxsig", 30)
    assert code == 0
    data = starfile.read(tmp_path / "run_it002_data.star")
    particles = data["particles"]
    assert len(particles) == 5
    assert {"rlnImageOriginalName", "rlnCtfFigureOfMerit", "rlnGroupNumber"} <= set(particles.columns)
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnNormCorrection"):
        assert np.isfinite(particles[column]).all(), column
    assert float(data["optics"]["rlnImagePixelSize"].iloc[0]) == pytest.approx(2.806)
    half, _ = read_volume(tmp_path / "run_it002_half1_class001.mrc")
    assert half.shape == (n, n, n) and np.isfinite(half).all()


def test_continue_gives_the_same_iteration_as_an_uninterrupted_run(refined, tmp_path, caplog):
    """--continue from iteration 2 reproduces iteration 3 of the uninterrupted run bit for bit; an option of
    the run's sampling given again (here --healpix_order) is ignored with a warning that names it."""
    folder, _ = refined
    with caplog.at_level("WARNING"):
        code = run_cli("refine", "--continue", folder / "out" / "run_it002_optimiser.star", "--o", tmp_path / "run",
                       "--iter", 3, "--healpix_order", 1)
    assert code == 0
    assert "ignored here: --healpix_order" in caplog.text
    for suffix in ("half1_class001.mrc", "half2_class001.mrc"):
        assert (tmp_path / f"run_it003_{suffix}").read_bytes() == (folder / "out" / f"run_it003_{suffix}").read_bytes()
    continued = starfile.read(tmp_path / "run_it003_data.star")["particles"]
    original = starfile.read(folder / "out" / "run_it003_data.star")["particles"]
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnMaxValueProbDistribution"):
        np.testing.assert_array_equal(continued[column], original[column])
    # it went on from iteration 2, whose files it wrote again under its root as RELION does (but the report)
    assert (tmp_path / "run_it002_data.star").is_file() and not (tmp_path / "run_it002_report.png").exists()
    assert not list(tmp_path.glob("run_it001_*"))


def test_continue_takes_the_options_relion_reads_again(refined, tmp_path, caplog):
    """RELION's --continue reads --tau2_fudge, --particle_diameter, masks and a few more from its command line again
    (parseContinue): the continued iteration uses them."""
    folder, _ = refined
    with caplog.at_level("INFO", logger="cryorefine"):
        code = run_cli("refine", "--continue", folder / "out" / "run_it002_optimiser.star", "--o", tmp_path / "run",
                       "--iter", 3, "--tau2_fudge", 3, "--particle_diameter", 300)
    assert code == 0
    assert "--continue: --particle_diameter, --tau2_fudge changed" in caplog.text
    model = starfile.read(tmp_path / "run_it003_half1_model.star")["model_general"]
    optimiser = starfile.read(tmp_path / "run_it003_optimiser.star", always_dict=True)["optimiser_general"]
    assert model["rlnTau2FudgeFactor"] == 3.0 and optimiser["rlnParticleDiameter"] == 300.0
    original = starfile.read(folder / "out" / "run_it003_optimiser.star", always_dict=True)["optimiser_general"]
    assert original["rlnParticleDiameter"] == 320.0


def test_scale_is_estimated_per_micrograph_as_relion_groups_particles(refined, tmp_path):
    """RELION's intensity groups are the micrographs (rlnMicrographName less its job prefix) unless rlnGroupName
    says otherwise: with the images of one micrograph at 0.6 of their amplitude, --scale gives that group the smaller
    scale, model_groups has a row per micrograph, and the particles carry their group's rlnGroupNumber."""
    import mrcfile
    import pandas as pd

    folder, _ = refined
    star = starfile.read(folder / "sim" / "particles.star")
    particles = star["particles"]
    n = len(particles)
    dim = np.arange(n) >= n // 2  # the second half of the file: micrograph b
    with mrcfile.open(folder / "sim" / "particles.mrcs") as m:
        images, voxel = m.data.copy(), m.voxel_size.copy()
    images[dim] *= 0.6
    with mrcfile.new(tmp_path / "scaled.mrcs") as m:
        m.set_data(images.astype(np.float32))
        m.voxel_size = voxel
    particles["rlnImageName"] = [f"{i + 1:06d}@{tmp_path / 'scaled.mrcs'}" for i in range(n)]
    particles["rlnMicrographName"] = np.where(dim, "MotionCorr/job002/Movies/b.mrc", "MotionCorr/job002/Movies/a.mrc")
    starfile.write({"optics": star["optics"], "particles": pd.DataFrame(particles)}, tmp_path / "two.star")
    code = run_cli("refine", "--i", tmp_path / "two.star", "--ref", folder / "truth.mrc", "--o", tmp_path / "run",
                   "--ini_high", 50, "--ctf", "--particle_diameter", 320, "--flatten_solvent", "--zero_mask",
                   "--offset_range", 3, "--offset_step", 1, "--iter", 3, "--scale")
    assert code == 0
    groups = starfile.read(tmp_path / "run_it003_half1_model.star")["model_groups"]
    assert list(groups["rlnGroupName"]) == ["Movies/a.mrc", "Movies/b.mrc"]
    data = starfile.read(tmp_path / "run_it003_data.star")["particles"]
    first = data["rlnRandomSubset"].to_numpy() == 1  # RELION counts half 1's particles in half 1's model.star
    assert list(groups["rlnGroupNrParticles"]) == [int((~dim & first).sum()), int((dim & first).sum())]
    scale = groups["rlnGroupScaleCorrection"].to_numpy()
    assert scale[1] < 0.8 * scale[0], scale  # 0.6 of the amplitude: about 0.75 against 1.25
    np.testing.assert_array_equal(data["rlnGroupNumber"].to_numpy(), np.where(dim, 2, 1))


def test_the_iteration_line_names_the_translations_searched(refined, tmp_path, caplog):
    """The log's line per iteration says the offsets searched, as RELION's says its offset range and step: here
    the command line's 3 px by 1 px of 12 Å, a disc of 29 translations."""
    folder, _ = refined
    with caplog.at_level("INFO", logger="cryorefine"):
        code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc", "--o",
                       tmp_path / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320, "--offset_range", 3,
                       "--offset_step", 1, "--iter", 1)
    assert code == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("iteration 1:")]
    assert len(lines) == 1 and "offsets 36.00 Å by 12.00 Å (29 translations)" in lines[0], lines


def test_continue_needs_its_files(tmp_path, capsys):
    """An optimiser.star without the files cryorefine saves beside it (one of RELION's own runs, say) is refused with
    what to do instead."""
    (tmp_path / "run_it002_optimiser.star").write_text("data_optimiser_general\n_rlnCurrentIteration 2\n")
    assert run_cli("refine", "--continue", tmp_path / "run_it002_optimiser.star") == 2
    assert "start a new run with its run_itNNN_data.star as --i" in capsys.readouterr().err
    assert run_cli("refine", "--continue", tmp_path / "nothing.star") == 2


def test_relax_sym_is_refused_by_name(refined, tmp_path, capsys):
    folder, _ = refined
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", tmp_path / "run", "--sym", "C1", "--relax_sym", "C2")
    assert code == 2
    assert "--relax_sym" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def converge_at_iteration_two(monkeypatch):
    """RELION's convergence forced after iteration 1: iteration 2 is the final one, joining the halves."""
    from dataclasses import replace

    from cryorefine.em import schedule

    original = schedule.check_convergence

    def converge_at_two(optimiser, state, **kwargs):
        optimiser = original(optimiser, state, **kwargs)
        return replace(optimiser, has_converged=True, do_join_halves=True) if optimiser.iteration == 2 else optimiser

    monkeypatch.setattr(schedule, "check_convergence", converge_at_two)


def test_final_joined_iteration_writes_relion_final_outputs(refined, tmp_path, monkeypatch, capsys):
    """Force convergence after iteration 1: iteration 2 joins the halves and writes, as RELION's
    MlOptimiserMpi::iterate does once its iteration number is -1, the converged run's files alone (no run_it002_*):
    the joined map not solvent-flattened, the half maps without τ² and masks (RELION's _unfil.mrc), and an
    optimiser.star of iteration -1 that names one model, and a run_model.star whose model_groups count half 1's
    particles (RELION's first worker of half 1 writes it: MlOptimiserMpi::initialise sets its model's
    nr_particles_per_group to half 1's, Experiment::getNumberOfParticlesPerGroup, and MlOptimiserMpi::iterate has
    rank 1 write the final model.star). The run's end line names those files."""
    import re

    from cryorefine.io.relion_outputs import angdist_bild_text

    converge_at_iteration_two(monkeypatch)
    folder, truth = refined
    capsys.readouterr()
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", tmp_path / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320, "--zero_mask",
                   "--flatten_solvent", "--offset_range", 3, "--offset_step", 1, "--iter", 5)
    assert code == 0
    assert {p.name for p in tmp_path.glob("run_*") if not p.name.startswith(("run_it000_", "run_it001_"))} == {
        "run_data.star", "run_model.star", "run_class001.mrc", "run_class001_angdist.bild",
        "run_half1_class001_unfil.mrc", "run_half2_class001_unfil.mrc", "run_sampling.star", "run_optimiser.star",
        "run_report.png"}
    # every file the run names at its end is one it wrote
    named = re.findall(r"(/\S+?\.(?:mrc|star))\b", capsys.readouterr().out.strip().splitlines()[-1])
    assert len(named) == 5 and all(Path(name).is_file() for name in named), named
    joined, _ = read_volume(tmp_path / "run_class001.mrc")
    half1, _ = read_volume(tmp_path / "run_half1_class001_unfil.mrc")
    half2, _ = read_volume(tmp_path / "run_half2_class001_unfil.mrc")
    assert not np.array_equal(half1, half2)
    # the joined map holds both halves' data: closer to the truth than either half
    fsc = [np.asarray(fsc_volumes(v, truth))[8:14].mean() for v in (joined, half1, half2)]
    assert fsc[0] >= max(fsc[1], fsc[2]) - 0.01
    # --flatten_solvent masks the iterations' maps (zero in the box's corners, outside the particle's sphere), not the
    # final ones
    corners = np.zeros(joined.shape, bool)
    corners[[0, 0, 0, 0, -1, -1, -1, -1], [0, 0, -1, -1, 0, 0, -1, -1], [0, -1, 0, -1, 0, -1, 0, -1]] = True
    assert np.abs(read_volume(tmp_path / "run_it001_half1_class001.mrc")[0][corners]).max() == 0
    for volume in (joined, half1, half2):
        assert np.abs(volume[corners]).max() > 0
    # unregularised half maps keep their noise in the shells of a low FSC, where τ² takes power away from the joined
    # map (and, more, from a half's regularised map: its SSNR is lower)
    model = starfile.read(tmp_path / "run_model.star", always_dict=True)
    low = np.flatnonzero(model["model_class_1"]["rlnGoldStandardFsc"].to_numpy(dtype=float) < 0.5)
    assert low.size >= 2
    power = [fourier.power_spectrum_3d(fourier.rfft3_centered(v.astype(np.float64)))[low].mean()
             for v in (joined, half1, half2)]
    assert min(power[1], power[2]) > 2 * power[0], power
    assert "model_class_1" in model
    # all particles' direction distribution, the halves' weighted by their sizes, and its bild (RELION's final
    # run_class001_angdist.bild); the halves' are iteration 2's sums, so here only its sum and its shape
    subsets = starfile.read(tmp_path / "run_data.star")["particles"]["rlnRandomSubset"].to_numpy()
    assert set(subsets) == {1, 2}
    groups = model["model_groups"]
    assert len(groups) == 1 and list(groups["rlnGroupNrParticles"]) == [int(np.sum(subsets == 1))] \
        and np.sum(subsets == 1) < len(subsets)
    joined_pdf = model["model_pdf_orient_class_1"]["rlnOrientationDistribution"].to_numpy(dtype=float)
    assert joined_pdf.sum() == pytest.approx(1.0)
    directions = starfile.read(tmp_path / "run_sampling.star", always_dict=True)
    assert len(joined_pdf) == len(directions["sampling_directions"])
    assert (tmp_path / "run_class001_angdist.bild").read_text() == angdist_bild_text(
        joined_pdf, directions["sampling_directions"]["rlnAngleRot"],
        directions["sampling_directions"]["rlnAngleTilt"], BOX, PIXEL,
        int(directions["sampling_general"]["rlnHealpixOrder"]))
    # every optimiser.star, the final run_optimiser.star among them (RELION's output node), names files that exist
    for optimiser in sorted(tmp_path.glob("*_optimiser.star")):
        general = starfile.read(optimiser, always_dict=True)["optimiser_general"]
        for label in ("rlnModelStarFile", "rlnModelStarFile2", "rlnExperimentalDataStarFile",
                      "rlnOrientSamplingStarFile"):
            if label in general:
                assert Path(str(general[label])).is_file(), (optimiser, label, general[label])
    final = starfile.read(tmp_path / "run_optimiser.star", always_dict=True)["optimiser_general"]
    assert final["rlnModelStarFile"] == f"{tmp_path / 'run'}_model.star" and "rlnModelStarFile2" not in final
    assert (final["rlnCurrentIteration"], final["rlnDoSplitRandomHalves"], final["rlnHasConverged"]) == (-1, 0, 1)
    # the input names its stack beside itself (particles.mrcs); the run's particles name it from the project (the
    # current) directory, where RELION looks
    stacks = {name.partition("@")[2] for name in starfile.read(tmp_path / "run_data.star")["particles"]["rlnImageName"]}
    assert stacks == {str(folder / "sim" / "particles.mrcs")}


def test_firstiter_cc_iteration_updates_the_average_norm_its_particles_are_divided_by(refined, tmp_path):
    """RELION's default command line has --firstiter_cc with --norm: the cross-correlation iteration sets every
    particle's norm correction (here about a third of 1), and the model's average must follow them, as RELION's
    maximizationOtherParameters does in that iteration too; left at 1, the next iterations divided the images by a
    third of their scale and their posteriors spread (pmax 0.15 where the run without CC had 0.80)."""
    folder, _ = refined
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", tmp_path / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320, "--zero_mask",
                   "--offset_range", 3, "--offset_step", 1, "--iter", 1, "--firstiter_cc", "--norm")
    assert code == 0
    norms = starfile.read(tmp_path / "run_it001_data.star")["particles"]["rlnNormCorrection"].to_numpy()
    assert abs(norms.mean() - 1.0) > 0.05  # the test means something only where the particles' norms moved
    for h in (1, 2):
        average = starfile.read(tmp_path / f"run_it001_half{h}_model.star")["model_general"]["rlnNormCorrectionAverage"]
        assert average == pytest.approx(norms.mean(), rel=1e-6)


# ------------------------------------------------------------------------------------------ --sym

D2_ARGS = ("--ini_high", 50, "--ctf", "--particle_diameter", 320, "--flatten_solvent", "--zero_mask",
           "--offset_range", 3, "--offset_step", 1, "--healpix_order", 1, "--iter", 3)


def _symmetry_error(volume, name):
    """max |V − symmetrised V| / max |V| over the voxels whose images lie in the box (index 0 has none)."""
    from cryorefine.core.symmetry import symmetrise_volume, symmetry_group

    v = np.asarray(volume, dtype=np.float64)
    inner = (slice(1, None),) * 3
    return np.abs(symmetrise_volume(v, symmetry_group(name)) - v)[inner].max() / np.abs(v).max()


@pytest.fixture(scope="module")
def d2_refined(tmp_path_factory):
    """160 particles of a D2-symmetrised map, refined twice from that map low-passed to 50 Å: --sym D2 and C1."""
    folder = tmp_path_factory.mktemp("refine_d2")
    write_volume(folder / "start.mrc", downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX), PIXEL)
    assert run_cli("simulate", "--ref", folder / "start.mrc", "--n", 160, "--snr", 0.5, "--seed", 4, "--sym", "D2",
                   "--o", folder / "sim") == 0
    truth, _ = read_volume(folder / "sim" / "reference_symmetrised.mrc")
    for sym in ("D2", "C1"):
        assert run_cli("refine", "--i", folder / "sim" / "particles.star",
                       "--ref", folder / "sim" / "reference_symmetrised.mrc", "--o", folder / sym / "run",
                       "--sym", sym, *D2_ARGS) == 0
    return folder, truth


def test_d2_refinement_is_at_least_as_close_to_the_truth_as_c1(d2_refined):
    folder, truth = d2_refined
    shells = slice(6, 14)  # 64 – 27 Å

    def fsc(sym):
        return np.mean([np.asarray(fsc_volumes(read_volume(folder / sym / f"run_it003_half{h}_class001.mrc")[0],
                                               truth))[shells].mean() for h in (1, 2)])

    assert fsc("D2") >= fsc("C1"), (fsc("D2"), fsc("C1"))
    assert fsc("D2") > 0.6


def test_d2_refinement_maps_are_d2_symmetric(d2_refined):
    folder, _ = d2_refined
    for it in (1, 2, 3):
        for h in (1, 2):
            volume, _ = read_volume(folder / "D2" / f"run_it{it:03d}_half{h}_class001.mrc")
            assert _symmetry_error(volume, "D2") < 1e-5  # D2 permutes voxels: symmetric to float32 rounding
    c1, _ = read_volume(folder / "C1" / "run_it003_half1_class001.mrc")
    assert _symmetry_error(c1, "D2") > 1e-3


def test_d2_refinement_samples_relions_asymmetric_unit(d2_refined):
    folder, _ = d2_refined
    sampling = starfile.read(folder / "D2" / "run_it003_sampling.star")
    assert sampling["sampling_general"]["rlnSymmetryGroup"] == "D2"
    directions = sampling["sampling_directions"]
    order = int(sampling["sampling_general"]["rlnHealpixOrder"])
    assert len(directions) == 12 * 4 ** order // 4
    rot, tilt = directions["rlnAngleRot"].to_numpy(), directions["rlnAngleTilt"].to_numpy()
    assert np.all((rot >= -1e-9) & (rot <= 180 + 1e-9) & (tilt <= 90 + 1e-9))  # RELION's D2 unit
    full = starfile.read(folder / "C1" / "run_it003_sampling.star")["sampling_directions"]
    assert len(full) == 12 * 4 ** int(starfile.read(folder / "C1" / "run_it003_sampling.star")
                                      ["sampling_general"]["rlnHealpixOrder"])


def test_d2_final_joined_iteration_is_symmetric(d2_refined, tmp_path, monkeypatch):
    converge_at_iteration_two(monkeypatch)
    folder, truth = d2_refined
    assert run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "start.mrc",
                   "--o", tmp_path / "run", "--sym", "D2", *D2_ARGS) == 0  # an asymmetric start: as RELION, as given
    for name in ("run_class001.mrc", "run_half1_class001_unfil.mrc", "run_half2_class001_unfil.mrc"):
        volume, _ = read_volume(tmp_path / name)
        assert _symmetry_error(volume, "D2") < 1e-5, name


@pytest.mark.gpu
def test_d2_refinement_on_the_gpu_matches_the_cpu(d2_refined, tmp_path):
    """The D2 run above (numpy engine) again with the GPU engine: maps agree (FSC ≥ 0.99 to the reported
    resolution), are D2-symmetric, and ≥ 80 % of the poses are within 1° of the CPU's (modulo D2)."""
    from conftest import cupy_or_skip

    from cryorefine.core.symmetry import symmetry_group
    from cryorefine.em import schedule

    cupy_or_skip()
    folder, _ = d2_refined
    assert run_cli("refine", "--i", folder / "sim" / "particles.star",
                   "--ref", folder / "sim" / "reference_symmetrised.mrc", "--o", tmp_path / "run", "--sym", "D2",
                   "--gpu", "0", *D2_ARGS) == 0
    model = starfile.read(folder / "D2" / "run_it003_half1_model.star")
    shell_limit = int(BOX * PIXEL / float(model["model_general"]["rlnCurrentResolution"]))
    for h in (1, 2):
        cpu_map, _ = read_volume(folder / "D2" / f"run_it003_half{h}_class001.mrc")
        gpu_map, _ = read_volume(tmp_path / f"run_it003_half{h}_class001.mrc")
        fsc = np.asarray(fsc_volumes(cpu_map, gpu_map))
        print(f"half {h}: FSC(CPU map, GPU map) min {fsc[1:shell_limit + 1].min():.5f} up to shell {shell_limit}")
        assert fsc[1:shell_limit + 1].min() >= 0.99
        assert _symmetry_error(gpu_map, "D2") < 1e-5
    a = starfile.read(folder / "D2" / "run_it003_data.star")["particles"]
    b = starfile.read(tmp_path / "run_it003_data.star")["particles"]
    angles = np.asarray(schedule.angular_distance_deg(
        a["rlnAngleRot"].to_numpy(), a["rlnAngleTilt"].to_numpy(), a["rlnAnglePsi"].to_numpy(),
        b["rlnAngleRot"].to_numpy(), b["rlnAngleTilt"].to_numpy(), b["rlnAnglePsi"].to_numpy(),
        symmetry_group("D2").rotations))
    print(f"poses: {100 * np.mean(angles <= 1.0):.1f} % within 1° of the CPU's; median {np.median(angles):.3f}°")
    assert np.mean(angles <= 1.0) >= 0.8


# ------------------------------------------------------------- --solvent_mask, --solvent_mask2, --solvent_correct_fsc

@pytest.fixture(scope="module")
def masked(tmp_path_factory, refined):
    """The `refined` particles refined for 2 iterations with a soft mask around the map, a second mask over a
    small ball inside it, and the solvent-corrected FSC."""
    from cryorefine.core.masks import mask_from_map

    folder, truth = refined
    out = tmp_path_factory.mktemp("masked")
    mask = mask_from_map(truth, 0.05 * truth.max(), 1.0, 3.0)
    write_volume(out / "mask.mrc", mask, PIXEL)
    inner = fourier.soft_spherical_mask(BOX, 3.0, 0.0)
    write_volume(out / "inner.mrc", inner, PIXEL)
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", out / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320, "--flatten_solvent",
                   "--zero_mask", "--solvent_mask", out / "mask.mrc", "--solvent_mask2", out / "inner.mrc",
                   "--solvent_correct_fsc", "--offset_range", 3, "--offset_step", 1, "--iter", 2, "--cpu")
    assert code == 0
    return out, mask, inner


def test_the_solvent_mask_replaces_the_sphere_on_the_references(masked, refined):
    out, mask, inner = masked
    folder, _ = refined
    outside = mask == 0
    sphere = fourier.soft_spherical_mask(BOX, 320 / (2 * PIXEL), 5.0)
    between = outside & (sphere > 0.5)  # inside the sphere, outside the mask
    assert between.sum() > 1000
    with_mask, _ = read_volume(out / "run_it002_half1_class001.mrc")
    with_sphere, _ = read_volume(folder / "out" / "run_it002_half1_class001.mrc")
    assert np.abs(with_mask[outside]).max() == 0.0
    assert np.abs(with_sphere[between]).max() > 0.01 * np.abs(with_sphere).max()
    # the second mask's region holds one value: its own average
    core = inner > 0.5
    assert np.ptp(with_mask[core]) < 1e-5 * np.abs(with_mask).max()


def test_the_model_records_the_solvent_corrected_fsc_and_uses_it(masked):
    out, _, _ = masked
    model = starfile.read(out / "run_it002_half1_model.star")
    general = model["model_general"]
    assert int(general["rlnDoSolventFscCorrection"]) == 1 and general["rlnSolventMaskName"].endswith("mask.mrc")
    curves = model["model_class_1"]
    used = curves["rlnGoldStandardFsc"].to_numpy()
    masked_fsc = curves["rlnFourierShellCorrelationMaskedMaps"].to_numpy()
    random = curves["rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps"].to_numpy()
    unmasked = curves["rlnFourierShellCorrelationUnmaskedMaps"].to_numpy()
    start = int(np.flatnonzero(unmasked[1:] < 0.8)[0]) + 1  # RELION: from the first shell below 0.8
    assert float(general["rlnRandomiseFrom"]) == pytest.approx(BOX * PIXEL / start)
    current = int(general["rlnCurrentImageSize"])
    shells = np.arange(start + 2, current // 2 + 1)
    expected = np.where(random[shells] > masked_fsc[shells], 0.0,
                        (masked_fsc[shells] - random[shells]) / (1.0 - random[shells]))
    np.testing.assert_allclose(used[shells], expected, atol=1e-12)
    np.testing.assert_allclose(used[1:start + 2], masked_fsc[1:start + 2], atol=1e-12)
    assert not np.allclose(used[1:], unmasked[1:])
    optimiser = starfile.read(out / "run_it002_optimiser.star")
    assert int(optimiser["rlnDoSolventFscCorrection"]) == 1
    assert str(optimiser["rlnSolventMask2Name"]).endswith("inner.mrc")


def test_continue_of_a_masked_run_gives_the_same_iteration(masked, tmp_path):
    out, _, _ = masked
    code = run_cli("refine", "--continue", out / "run_it001_optimiser.star", "--o", tmp_path / "run", "--iter", 2)
    assert code == 0
    for h in (1, 2):
        assert (tmp_path / f"run_it002_half{h}_class001.mrc").read_bytes() == \
            (out / f"run_it002_half{h}_class001.mrc").read_bytes()
    a = starfile.read(tmp_path / "run_it002_half1_model.star")["model_class_1"]
    b = starfile.read(out / "run_it002_half1_model.star")["model_class_1"]
    np.testing.assert_array_equal(a["rlnGoldStandardFsc"], b["rlnGoldStandardFsc"])


@pytest.mark.parametrize("case", ["zero", "range"])
def test_a_bad_mask_ends_the_run_before_it_starts(refined, tmp_path, capsys, case):
    folder, truth = refined
    data = np.zeros((BOX + 8,) * 3) if case == "zero" else 2.0 * np.ones((BOX,) * 3)
    write_volume(tmp_path / "bad.mrc", data, PIXEL)
    (tmp_path / "job").mkdir()
    code = run_cli("refine", "--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc",
                   "--o", tmp_path / "out" / "run", "--flatten_solvent", "--solvent_mask", tmp_path / "bad.mrc",
                   "--pipeline_control", tmp_path / "job", "--cpu")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--solvent_mask" in err and "bad.mrc" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    assert (tmp_path / "job" / "RELION_JOB_EXIT_FAILURE").is_file()
    assert not (tmp_path / "job" / "RELION_JOB_EXIT_SUCCESS").exists()


def test_a_small_device_gives_the_same_refinement(refined, tmp_path, monkeypatch, caplog):
    """With a device too small for both halves' sums or a whole batch's preparation (em.memory), the idle half waits
    on the host and batches are prepared and run a few images at a time: the same poses and maps, to rounding."""
    import logging

    from cryorefine.estep.backend import NumpyBackend

    converge_at_iteration_two(monkeypatch)
    folder, _ = refined
    args = ("--i", folder / "sim" / "particles.star", "--ref", folder / "truth.mrc", "--ini_high", 50, "--ctf",
            "--particle_diameter", 320, "--zero_mask", "--offset_range", 3, "--offset_step", 1, "--iter", 5)
    assert run_cli("refine", *args, "--o", tmp_path / "roomy" / "run") == 0
    # 15 images of 32 px prepared at a time, runs of at most 61 images of 32 px (em.memory)
    monkeypatch.setattr(NumpyBackend, "free_device_bytes", lambda self: 5e6)
    with caplog.at_level(logging.INFO, logger="cryorefine"):
        assert run_cli("refine", *args, "--o", tmp_path / "small" / "run") == 0
    assert "park" in caplog.text  # the idle half's move is a stage of the E-step
    roomy, small = (starfile.read(tmp_path / name / "run_data.star")["particles"] for name in ("roomy", "small"))
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        np.testing.assert_allclose(small[column], roomy[column], atol=1e-6, err_msg=column)
    want, _ = read_volume(tmp_path / "roomy" / "run_class001.mrc")
    got, _ = read_volume(tmp_path / "small" / "run_class001.mrc")
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_sigma_offset_of_local_searches_stays_the_spread_of_the_offsets(tmp_path):
    """Local searches from the first iteration (--auto_local_healpix_order at --healpix_order): RELION centres the
    offsets' prior on the particle's origin prior, (0, 0) here, as in global searches, so σ_offset (its σ² the
    weighted mean of |offset − prior|² per axis) stays the spread of the particles' offsets about the box centre.
    Centred on the previous offsets it fell to the offsets' change between iterations (3.9, then 2.6 Å here)."""
    truth = downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX)
    write_volume(tmp_path / "truth.mrc", truth, PIXEL)
    assert run_cli("simulate", "--ref", tmp_path / "truth.mrc", "--n", 100, "--snr", 0.5, "--seed", 4,
                   "--o", tmp_path / "sim") == 0
    assert run_cli("refine", "--i", tmp_path / "sim" / "particles.star", "--ref", tmp_path / "truth.mrc",
                   "--o", tmp_path / "out" / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320,
                   "--flatten_solvent", "--zero_mask", "--healpix_order", 1, "--auto_local_healpix_order", 1,
                   "--offset_range", 3, "--offset_step", 1, "--iter", 2, "--auto_refine", "--split_random_halves") == 0
    true_offsets = starfile.read(tmp_path / "sim" / "particles.star")["particles"]
    spread = np.sqrt(np.mean(np.concatenate([true_offsets["rlnOriginXAngst"], true_offsets["rlnOriginYAngst"]]) ** 2))
    assert spread > 15  # 3 px = 36 Å at most, uniform in a disc: 18 Å per axis
    for iteration in (1, 2):
        model = starfile.read(tmp_path / "out" / f"run_it{iteration:03d}_half1_model.star")["model_general"]
        assert int(model["rlnOrientationalPriorMode"]) == 1  # local searches
        sigma = float(model["rlnSigmaOffsetsAngst"])
        assert 0.85 * spread < sigma < 1.15 * spread, (iteration, sigma, spread)


def test_origin_priors_centre_the_offsets_prior_and_are_written_back(tmp_path):
    """Particles whose rlnOriginX/YPriorAngst lie near their true offsets (as a re-extraction from an earlier
    refinement leaves them), refined with local searches from the first iteration: RELION centres the offsets' prior
    on each particle's origin prior, so σ_offset (its σ² the weighted mean of |offset − prior|² per axis) is the
    spread of the offsets about their priors, a few Å here, not their spread about the box centre (≈ 18 Å); the
    offsets found are the true ones; and data.star carries the priors as they were given (RELION writes them back)."""
    truth = downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX)
    write_volume(tmp_path / "truth.mrc", truth, PIXEL)
    assert run_cli("simulate", "--ref", tmp_path / "truth.mrc", "--n", 100, "--snr", 0.5, "--seed", 4,
                   "--o", tmp_path / "sim") == 0
    blocks = starfile.read(tmp_path / "sim" / "particles.star")
    table = blocks["particles"]
    true_offsets = table[["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy()
    priors = true_offsets + np.random.default_rng(8).normal(0.0, 3.0, true_offsets.shape)
    table["rlnOriginXPriorAngst"], table["rlnOriginYPriorAngst"] = priors[:, 0], priors[:, 1]
    table["rlnOriginXAngst"], table["rlnOriginYAngst"] = priors[:, 0], priors[:, 1]  # starting from the priors
    starfile.write(blocks, tmp_path / "sim" / "with_priors.star")
    assert run_cli("refine", "--i", tmp_path / "sim" / "with_priors.star", "--ref", tmp_path / "truth.mrc",
                   "--o", tmp_path / "out" / "run", "--ini_high", 50, "--ctf", "--particle_diameter", 320,
                   "--flatten_solvent", "--zero_mask", "--healpix_order", 1, "--auto_local_healpix_order", 1,
                   "--offset_range", 3, "--offset_step", 1, "--iter", 2, "--auto_refine", "--split_random_halves") == 0
    spread_about_centre = np.sqrt(np.mean(true_offsets ** 2))
    assert spread_about_centre > 15
    for iteration in (1, 2):
        model = starfile.read(tmp_path / "out" / f"run_it{iteration:03d}_half1_model.star")["model_general"]
        sigma = float(model["rlnSigmaOffsetsAngst"])
        data = starfile.read(tmp_path / "out" / f"run_it{iteration:03d}_data.star")["particles"]
        found = data[["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy()
        np.testing.assert_allclose(data[["rlnOriginXPriorAngst", "rlnOriginYPriorAngst"]].to_numpy(), priors,
                                   atol=1e-6)
        about_priors = np.sqrt(np.mean((found - priors) ** 2))
        error = np.median(np.hypot(*(found - true_offsets).T))
        print(f"iteration {iteration}: sigma_offset {sigma:.2f} A, RMS of offset - prior {about_priors:.2f} A, "
              f"median offset error {error:.2f} A")
        assert sigma < 0.5 * spread_about_centre, (iteration, sigma)
        assert 0.7 * about_priors < sigma < 1.5 * about_priors, (iteration, sigma, about_priors)
        assert error < 0.5 * PIXEL, (iteration, error)


def test_accuracy_particles_are_relions_first_hundred_of_half_one():
    """RELION's auto-refine estimates the accuracy from the first 100 particles of its order: half 1's particles
    shuffled once, then sorted by optics group (randomiseParticlesOrder). Half 1 here: the 150 even indices, 60 of
    them (those below 120) in optics group 1, the other 90 in group 2: all 60 of group 1 and 40 of group 2."""
    from cryorefine.jobs.refine import accuracy_particles

    half1 = np.arange(0, 300, 2)
    optics = (np.arange(300) >= 120).astype(np.int64)
    chosen = accuracy_particles(half1, optics, seed=3)
    assert chosen.size == 100 and np.all(np.diff(chosen) > 0)
    assert np.isin(chosen, half1).all()
    assert np.isin(np.arange(0, 120, 2), chosen).all()  # the whole of optics group 1 first
    assert np.array_equal(chosen, accuracy_particles(half1, optics, seed=3))  # the same every iteration
    assert not np.array_equal(chosen, accuracy_particles(half1, optics, seed=4))
    assert np.array_equal(accuracy_particles(half1[:30], optics, seed=3), half1[:30])  # fewer than 100: all


def test_refine_samples_as_relion_estimates_the_accuracy_from_half_one_s_projections(tmp_path):
    """RELION's auto-refine estimates the accuracy every iteration from projections of half 1's map at its
    particles' poses (calculateExpectedAngularErrors). Half 1's map a round blob, whose projections do not change
    under rotation: every particle's angular search ends at RELION's cap (beyond 30°), so HEALPix order 2 (3.75°
    oversampled) is fine enough and the sampling stays (RELION's updateAngularSampling), although half 2's map is
    sharp and a τ² as high as the low-resolution join of the halves leaves it (a data-versus-prior of 999) makes the
    spectral model of the same sum promise an accuracy that would ask for order 3."""
    from conftest import make_particle_set

    from cryorefine.config import RefineConfig
    from cryorefine.em import schedule
    from cryorefine.jobs.refine import RefineJob

    box, pixel = 16, 4.0
    star, _ = make_particle_set(tmp_path, n=12, box=box, pixel_size=pixel, seed=2)
    z, y, x = np.mgrid[:box, :box, :box] - box // 2
    blob = np.exp(-(x * x + y * y + z * z) / 8.0)
    rng = np.random.default_rng(1)
    sharp = rng.normal(size=(box,) * 3) * (x * x + y * y + z * z < 36)
    write_volume(tmp_path / "blob.mrc", blob.astype(np.float32), pixel)
    config = RefineConfig(input_star=str(star), output_root=str(tmp_path / "run"),
                          reference_map=str(tmp_path / "blob.mrc"), do_ctf=True, offset_range_px=3.0,
                          offset_step_px=1.0)
    job = RefineJob(config)
    particles, settings = job.load()
    n_shells = box // 2 + 1
    run = job.start(particles, settings, lambda *_: np.full((1, n_shells), 1e-3))
    model = run.model
    model.maps = [[blob], [sharp]]
    model.tau2 = np.full((2, 1, n_shells), 10.0)
    model.ssnr = np.full((2, 1, n_shells), 999.0)
    # the resolution and the poses have settled: RELION's rule may make the sampling finer
    run.optimiser = dataclasses.replace(run.optimiser, nr_iter_wo_resol_gain=1,
                                        nr_iter_wo_large_hidden_variable_changes=1)
    step_deg = schedule.angular_step_deg(2, config.oversampling)
    spectral = schedule.estimated_accuracy_from_model(model, box, settings.particle_diameter_angstrom, do_ctf=True)
    assert spectral.rotations_deg < step_deg / schedule.FINE_ENOUGH_FRACTION_OF_ACCURACY  # would go to order 3
    job.plan(run, 2)
    assert run.optimiser.acc_rot_deg > 30.0 and model.accuracy_rotations_deg > 30.0
    assert run.optimiser.healpix_order == 2 and run.schedule.has_fine_enough_angular_sampling

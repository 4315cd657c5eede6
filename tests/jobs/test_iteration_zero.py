"""The files RELION writes before iteration 1 (run_it000_*), for refine, classify, class2d (EM and VDAM) and
initial_model, and --continue from them.

RELION 5's set (src/ml_optimiser_mpi.cpp MlOptimiserMpi::initialise, src/ml_optimiser.cpp MlOptimiser::initialise and
MlOptimiser::write, src/ml_model.cpp MlModel::write, read for their behaviour):
- relion_refine_mpi (every auto-refine: RELION runs it only under MPI): the leader writes run_it000_data.star, the
  first worker of each half set run_it000_halfH_model.star with its class map run_it000_halfH_class001.mrc and its
  direction distribution run_it000_halfH_class001_angdist.bild, and run_it000_sampling.star; the first worker also
  run_it000_optimiser.star;
- relion_refine (a Class3D of one MPI process): run_it000_data.star, run_it000_optimiser.star,
  run_it000_model.star, run_it000_classKKK.mrc and run_it000_classKKK_angdist.bild; no sampling.star (the Class3D
  line under mpirun, with it: tests/jobs/test_relion_refine_drop_in.py);
- Class2D and InitialModel: the same write at iteration 0, with MlModel::write's 2D stack (run_it000_classes.mrcs)
  and, under --grad, the momenta; bild files only of 3D classes, and at iteration 0 also under --grad (MlOptimiser's
  do_grad, which suppresses them, is set only once the iterations begin);
- the model.star's spectra: RELION's MlModel::initialiseDataVersusPrior (τ² from the starting map's power spectrum,
  the data versus prior from the particles' number and the initial noise spectra).
Beside them, run_it000_resume.npz: what --continue reads here.
"""

from pathlib import Path

import numpy as np
import pytest
import starfile
from conftest import run_cli

from cryorefine.core.fourier import downsample_volume
from cryorefine.io.mrc import read_stack, read_volume, write_volume

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "examples" / "ribosome_64px.mrc"
BOX, PIXEL, N_PARTICLES = 16, 24.0, 40
ARGS = ("--ini_high", 100, "--ctf", "--particle_diameter", 240, "--zero_mask", "--offset_range", 3, "--offset_step",
        1.5, "--healpix_order", 1, "--cpu", "--random_seed", 5)
REFINE_IT000 = {"run_it000_data.star", "run_it000_half1_class001.mrc", "run_it000_half2_class001.mrc",
                "run_it000_half1_model.star", "run_it000_half2_model.star", "run_it000_half1_class001_angdist.bild",
                "run_it000_half2_class001_angdist.bild", "run_it000_sampling.star", "run_it000_optimiser.star",
                "run_it000_resume.npz"}
CLASSIFY_IT000 = {"run_it000_data.star", "run_it000_class001.mrc", "run_it000_class002.mrc", "run_it000_model.star",
                  "run_it000_class001_angdist.bild", "run_it000_class002_angdist.bild", "run_it000_optimiser.star",
                  "run_it000_resume.npz"}


def relion_initial_spectra(volume, sigma2_noise, n_particles, pdf_class, tau2_fudge):
    """RELION's initialiseDataVersusPrior for one map or one 2D class average, written out here with numpy alone:
    (τ², data versus prior). A map's power is scaled by N² (its normfft) and its evidence divided by 2i; a 2D
    average's neither."""
    n = volume.shape[0]
    ft = np.fft.rfftn(np.asarray(volume, dtype=np.float64), norm="forward")  # |F|² does not see the centre's shift
    k = np.fft.fftfreq(n, 1.0 / n)
    if volume.ndim == 3:
        radius = np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + np.arange(n // 2 + 1)[None, None, :] ** 2)
    else:
        radius = np.sqrt(k[:, None] ** 2 + np.arange(n // 2 + 1)[None, :] ** 2)
    shell = np.rint(radius).astype(int).ravel()
    power = (np.bincount(shell, (np.abs(ft) ** 2).ravel()) / np.bincount(shell))[: n // 2 + 1]
    tau2 = tau2_fudge * power * (n * n if volume.ndim == 3 else 1) / 2.0
    noise = np.asarray(sigma2_noise, dtype=np.float64)
    average = noise[noise.sum(axis=1) > 0].mean(axis=0)
    evidence = n_particles * pdf_class / average
    if volume.ndim == 3:
        evidence[1:] /= 2.0 * np.arange(1, n // 2 + 1)
    return tau2, evidence * tau2


def test_initial_spectra_of_one_fourier_component_by_hand():
    """A map of one Fourier component: cos(2π·3x/8) has 1/2 at kx = 3 in the half transform (normalised by 1/N³), so
    shell 3's mean |F|² is 1/4 over the count of its coefficients, counted here one by one; τ² = fudge·that·N²/2;
    the data versus prior of shell 3 is n·pdf/σ²/(2·3)·τ², σ² the average of the groups with noise (a group of
    zeros is left out, as RELION leaves it out)."""
    from cryorefine.em.references import initial_data_versus_prior

    n = 8
    x = np.arange(n)
    volume = np.broadcast_to(np.cos(2 * np.pi * 3 * x / n)[None, None, :], (n, n, n)).copy()
    count = sum(1 for kz in range(-3, 5) for ky in range(-3, 5) for kx in range(0, 5)
                if round((kz * kz + ky * ky + kx * kx) ** 0.5) == 3)
    noise = np.vstack([np.full(n // 2 + 1, 2.0), np.zeros(n // 2 + 1), np.full(n // 2 + 1, 4.0)])  # average 3
    tau2, data_vs_prior = initial_data_versus_prior([volume, 2 * volume], noise, 12, [0.25, 0.75], tau2_fudge=4.0)
    expected = 4.0 * (0.25 / count) * n * n / 2.0
    np.testing.assert_allclose(tau2[0], np.where(np.arange(5) == 3, expected, 0.0), atol=1e-15)
    np.testing.assert_allclose(tau2[1], 4 * tau2[0], atol=1e-15)  # twice the map, four times the power
    assert data_vs_prior[0, 3] == pytest.approx(12 * 0.25 / 3.0 / 6.0 * expected, rel=1e-12)
    assert data_vs_prior[1, 3] == pytest.approx(12 * 0.75 / 3.0 / 6.0 * 4 * expected, rel=1e-12)
    np.testing.assert_allclose(data_vs_prior[:, [0, 1, 2, 4]], 0.0, atol=1e-12 * data_vs_prior[0, 3])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    folder = tmp_path_factory.mktemp("it000")
    write_volume(folder / "truth.mrc", downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX), PIXEL)
    assert run_cli("simulate", "--ref", folder / "truth.mrc", "--n", N_PARTICLES, "--snr", 0.5, "--seed", 2,
                   "--o", folder / "sim") == 0
    return folder


def check_model_spectra(model_star, class_map, data_star, n_particles, pdf_class, tau2_fudge, row="model_class_1"):
    """The model.star's τ² and data versus prior are RELION's of the map (or the 2D average, a 2D array) written beside
    it and the model's own noise spectra; its direction distribution is uniform over the sampling's directions."""
    model = starfile.read(model_star, always_dict=True)
    shells = BOX // 2 + 1
    noise = np.zeros((1, shells))
    group = model["model_optics_group_1"]
    noise[0, group["rlnSpectralIndex"].to_numpy(dtype=int)] = group["rlnSigma2Noise"].to_numpy(dtype=float)
    assert (noise[0, 1:] > 0).all()
    reference = read_volume(class_map)[0] if isinstance(class_map, (str, Path)) else class_map
    tau2, data_vs_prior = relion_initial_spectra(reference, noise, n_particles, pdf_class, tau2_fudge)
    spectra = model[row]
    assert spectra["rlnReferenceTau2"].to_numpy(dtype=float)[1:].min() > 0
    # the written map is float32: its rounding leaves ~1e-16 of the power above --ini_high's low-pass
    np.testing.assert_allclose(spectra["rlnReferenceTau2"].to_numpy(dtype=float), tau2, rtol=1e-5,
                               atol=1e-12 * tau2.max())
    np.testing.assert_allclose(spectra["rlnSsnrMap"].to_numpy(dtype=float)[1:], data_vs_prior[1:], rtol=1e-5,
                               atol=1e-12 * data_vs_prior[1:].max())
    np.testing.assert_array_equal(spectra["rlnGoldStandardFsc"].to_numpy(dtype=float), 0.0)
    assert len(starfile.read(data_star)["particles"]) == N_PARTICLES
    return model


def test_refine_writes_relions_iteration_0_files_and_continues_from_them(small, tmp_path):
    """RELION's run_it000_* of an auto-refine, their spectra and distributions; --continue from
    run_it000_optimiser.star runs iteration 1 as the run that wrote it does (its maps read back from their float32
    files)."""
    out = tmp_path / "run"
    assert run_cli("refine", "--i", small / "sim" / "particles.star", "--ref", small / "truth.mrc", "--o", out, *ARGS,
                   "--iter", 1) == 0
    assert {p.name for p in tmp_path.glob("run_it000_*")} == REFINE_IT000
    data = starfile.read(tmp_path / "run_it000_data.star")["particles"]
    subsets = data["rlnRandomSubset"].to_numpy()
    np.testing.assert_array_equal(subsets, starfile.read(tmp_path / "run_it001_data.star")["particles"]
                                  ["rlnRandomSubset"])
    sampling = starfile.read(tmp_path / "run_it000_sampling.star", always_dict=True)
    n_directions = len(sampling["sampling_directions"])
    for h in (1, 2):
        model = check_model_spectra(tmp_path / f"run_it000_half{h}_model.star",
                                    tmp_path / f"run_it000_half{h}_class001.mrc", tmp_path / "run_it000_data.star",
                                    int(np.sum(subsets == h)), 1.0, 1.0)  # refine's --tau2_fudge: 1
        pdf = model["model_pdf_orient_class_1"]["rlnOrientationDistribution"].to_numpy(dtype=float)
        np.testing.assert_allclose(pdf, np.full(n_directions, 1.0 / n_directions), rtol=1e-15)
        assert model["model_classes"]["rlnReferenceImage"].iloc[0] == f"{out}_it000_half{h}_class001.mrc"
    # each half's model_groups counts that half's particles of each group (RELION's getNumberOfParticlesPerGroup of
    # the half set), in iteration 0 and after
    for it in (0, 1):
        particles = starfile.read(tmp_path / f"run_it{it:03d}_data.star")["particles"]
        for h in (1, 2):
            groups = starfile.read(tmp_path / f"run_it{it:03d}_half{h}_model.star", always_dict=True)["model_groups"]
            mine = particles["rlnGroupNumber"].to_numpy()[particles["rlnRandomSubset"].to_numpy() == h]
            want = [int(np.sum(mine == g)) for g in groups["rlnGroupNumber"]]
            assert list(groups["rlnGroupNrParticles"]) == want and sum(want) == np.sum(subsets == h) < N_PARTICLES
    general = starfile.read(tmp_path / "run_it000_optimiser.star", always_dict=True)["optimiser_general"]
    assert general["rlnCurrentIteration"] == 0
    for label in ("rlnModelStarFile", "rlnModelStarFile2", "rlnExperimentalDataStarFile", "rlnOrientSamplingStarFile"):
        assert Path(general[label]).is_file(), label
    # both halves start from the same map
    np.testing.assert_array_equal(read_volume(tmp_path / "run_it000_half1_class001.mrc")[0],
                                  read_volume(tmp_path / "run_it000_half2_class001.mrc")[0])

    again = tmp_path / "again"
    again.mkdir()
    for path in tmp_path.glob("run_it000_*"):
        (again / path.name).write_bytes(path.read_bytes())
    assert run_cli("refine", "--continue", again / "run_it000_optimiser.star", "--o", again / "run") == 0
    first = starfile.read(tmp_path / "run_it001_data.star")["particles"]
    continued = starfile.read(again / "run_it001_data.star")["particles"]
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnRandomSubset"):
        np.testing.assert_allclose(continued[column], first[column], atol=1e-6, err_msg=column)
    for h in (1, 2):
        a, b = (read_volume(folder / f"run_it001_half{h}_class001.mrc")[0] for folder in (tmp_path, again))
        np.testing.assert_allclose(b, a, atol=1e-5 * np.abs(a).max())


def test_classify_writes_relions_iteration_0_files(small, tmp_path):
    """RELION's run_it000_* of a Class3D of one process (no sampling.star), two classes from one map: each class's
    data versus prior counts half the particles."""
    out = tmp_path / "run"
    assert run_cli("classify", "--i", small / "sim" / "particles.star", "--ref", small / "truth.mrc", "--o", out,
                   *ARGS, "--K", 2, "--tau2_fudge", 2, "--iter", 1) == 0
    assert {p.name for p in tmp_path.glob("run_it000_*")} == CLASSIFY_IT000
    for k in (1, 2):
        model = check_model_spectra(tmp_path / "run_it000_model.star", tmp_path / f"run_it000_class00{k}.mrc",
                                    tmp_path / "run_it000_data.star", N_PARTICLES, 0.5, 2.0, row=f"model_class_{k}")
    np.testing.assert_allclose(model["model_classes"]["rlnClassDistribution"].to_numpy(dtype=float), [0.5, 0.5])
    pdf = [model[f"model_pdf_orient_class_{k}"]["rlnOrientationDistribution"].to_numpy(dtype=float) for k in (1, 2)]
    assert np.concatenate(pdf).sum() == pytest.approx(1.0) and np.ptp(np.concatenate(pdf)) == 0
    general = starfile.read(tmp_path / "run_it000_optimiser.star", always_dict=True)["optimiser_general"]
    assert general["rlnCurrentIteration"] == 0 and general["rlnModelStarFile"] == f"{out}_it000_model.star"
    assert "rlnModelStarFile2" not in general


def test_an_earlier_runs_iteration_0_files_are_found_and_removed_with_overwrite(small, tmp_path, capsys):
    """A run that left only its iteration-0 files (stopped in iteration 1) is an earlier run: a new run on its root is
    refused naming the --continue of iteration 0, and --overwrite removes those files."""
    from test_cli import assert_one_line_error, run

    for name in REFINE_IT000:
        (tmp_path / name).write_text("earlier run")
    inputs = ["--i", str(small / "sim" / "particles.star"), "--ref", str(small / "truth.mrc"),
              "--o", str(tmp_path / "run"), *map(str, ARGS), "--iter", "1"]
    code, _, err = run(capsys, "refine", *inputs)
    assert_one_line_error(code, err, "holds iteration 0 of an earlier run",
                          f"--continue {tmp_path / 'run'}_it000_optimiser.star")
    code, _, _ = run(capsys, "refine", *inputs, "--overwrite")
    assert code == 0
    assert (tmp_path / "run_it000_data.star").read_text() != "earlier run"


CLASS2D_IT000 = {"run_it000_data.star", "run_it000_classes.mrcs", "run_it000_model.star", "run_it000_optimiser.star",
                 "run_it000_resume.npz"}
CLASS2D_VDAM_IT000 = CLASS2D_IT000 | {"run_it000_1moment.mrcs", "run_it000_2moment.mrcs"}
INITIAL_MODEL_IT000 = {"run_it000_data.star", "run_it000_class001.mrc", "run_it000_1moment001.mrc",
                       "run_it000_1moment002.mrc", "run_it000_2moment001.mrc", "run_it000_model.star",
                       "run_it000_class001_angdist.bild", "run_it000_optimiser.star", "run_it000_resume.npz"}
#: the gradient runs' τ² fudge of iteration 0 (RELION's updateTau2Fudge, "<T>-step"): 1·s + T·(1 − s) with
#: s = 1/(10^((0 − b − a/2)/(a/4)) + 1) ≥ 1/(10^−2 + 1) for any b ≥ 0, a > 0, so between 1 and 1 + (T − 1)/101
def grad_fudge_bounds(tau2_fudge):
    return 1.0, 1.0 + (tau2_fudge - 1.0) / 101.0


@pytest.mark.parametrize("grad", [False, True], ids=["EM", "VDAM"])
def test_class2d_writes_relions_iteration_0_files(small, tmp_path, grad):
    """RELION 5's Class2D of one process writes before iteration 1 (MlOptimiser::initialise → write at iteration 0):
    data.star, optimiser.star, model.star with the classes' stack, and under --grad the momenta (MlModel::write with
    its do_grad); no sampling.star (relion_refine_mpi's), no bild files (3D only). The model.star's spectra are
    RELION's of 2D references: τ² = fudge·P/2, no division by 2i; the τ² fudge under --grad is iteration 0's."""
    out = tmp_path / "run"
    vdam = ("--grad", "--grad_write_iter", 1) if grad else ()
    assert run_cli("class2d", "--i", small / "sim" / "particles.star", "--o", out, "--K", 2, "--iter", 1,
                   "--tau2_fudge", 2, "--ctf", "--particle_diameter", 240, "--psi_step", 30, "--offset_range", 2,
                   "--offset_step", 1, "--cpu", "--random_seed", 5, *vdam) == 0
    assert {p.name for p in tmp_path.glob("run_it000_*")} == (CLASS2D_VDAM_IT000 if grad else CLASS2D_IT000)
    model = starfile.read(tmp_path / "run_it000_model.star", always_dict=True)
    general = model["model_general"]
    assert int(general["rlnReferenceDimensionality"]) == 2
    fudge = float(general["rlnTau2FudgeFactor"])
    low, high = grad_fudge_bounds(2.0) if grad else (2.0, 2.0)
    assert low <= fudge <= high
    averages = read_stack(tmp_path / "run_it000_classes.mrcs")
    assert averages.shape == (2, BOX, BOX)
    for k in (1, 2):
        check_model_spectra(tmp_path / "run_it000_model.star", averages[k - 1].astype(np.float64),
                            tmp_path / "run_it000_data.star", N_PARTICLES, 0.5, fudge, row=f"model_class_{k}")
    classes = model["model_classes"]
    assert list(classes["rlnReferenceImage"]) == [f"{k:06d}@{out}_it000_classes.mrcs" for k in (1, 2)]
    optimiser = starfile.read(tmp_path / "run_it000_optimiser.star", always_dict=True)["optimiser_general"]
    assert int(optimiser["rlnCurrentIteration"]) == 0
    if grad:
        assert list(classes["rlnGradMoment2"]) == [f"{k:06d}@{out}_it000_2moment.mrcs" for k in (1, 2)]
        # two pseudo-half sets' first moments, one second moment, of each class; complex values as pairs of reals
        assert read_stack(tmp_path / "run_it000_1moment.mrcs").shape[0] == 4
        assert read_stack(tmp_path / "run_it000_2moment.mrcs").shape[0] == 2
        # RELION's optimiser has taken no gradient step yet: do_grad false, no mini-batch
        assert int(optimiser["rlnDoGradientRefine"]) == 1 and int(optimiser["rlnDoStochasticGradientDescent"]) == 0
        assert int(optimiser["rlnSgdSubsetSize"]) == 0
    else:
        assert "rlnGradMoment1" not in classes


def test_initial_model_writes_relions_iteration_0_files(small, tmp_path):
    """RELION 5's InitialModel (--grad --denovo_3dref) of one process writes before iteration 1: data.star, the
    de-novo map, the momenta (two pseudo-half sets' first moments, the second), model.star, optimiser.star and the
    bild file of the uniform direction distribution (MlOptimiser::write draws it while its do_grad is still false,
    before the first gradient step); no sampling.star. τ² is RELION's of the map with iteration 0's τ² fudge."""
    out = tmp_path / "run"
    assert run_cli("initial_model", "--i", small / "sim" / "particles.star", "--o", out, "--iter", 1, "--K", 1,
                   "--tau2_fudge", 4, *ARGS[:6], "--healpix_order", 1, "--offset_range", 2, "--offset_step", 1,
                   "--pad", 1, "--cpu", "--random_seed", 5) == 0
    assert {p.name for p in tmp_path.glob("run_it000_*")} == INITIAL_MODEL_IT000
    model_star = tmp_path / "run_it000_model.star"
    fudge = float(starfile.read(model_star, always_dict=True)["model_general"]["rlnTau2FudgeFactor"])
    low, high = grad_fudge_bounds(4.0)
    assert low <= fudge <= high
    model = check_model_spectra(model_star, tmp_path / "run_it000_class001.mrc", tmp_path / "run_it000_data.star",
                                N_PARTICLES, 1.0, fudge)
    classes = model["model_classes"]
    assert classes["rlnGradMoment1"].iloc[0] == f"{out}_it000_1moment001.mrc"
    assert classes["rlnGradMoment2"].iloc[0] == f"{out}_it000_2moment001.mrc"
    pdf = model["model_pdf_orient_class_1"]["rlnOrientationDistribution"].to_numpy(dtype=float)
    assert np.ptp(pdf) == 0 and pdf.sum() == pytest.approx(1.0)
    # one bild line pair (colour, cylinder) per direction of the uniform distribution
    assert len((tmp_path / "run_it000_class001_angdist.bild").read_text().splitlines()) == 2 * pdf.size


def test_continue_under_a_new_root_writes_the_starting_iterations_files_there(small, tmp_path):
    """RELION's --continue with another --o (MlOptimiser::parseContinue takes the new root; MlOptimiser::initialise
    then writes the read state at its iteration, MlOptimiser::write): a Class3D of one process continued from
    iteration 1 under a new root writes run_it001_data.star, run_it001_model.star, the class maps, their bild files and
    run_it001_optimiser.star there (no sampling.star, relion_refine_mpi's; no report) naming the new root's files, then
    iteration 2 as the uninterrupted run; that copy of iteration 1 can itself be continued from."""
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    classify = ("--i", small / "sim" / "particles.star", "--ref", small / "truth.mrc", *ARGS, "--K", 2, "--iter", 2)
    assert run_cli("classify", *classify, "--o", first / "run") == 0
    assert run_cli("classify", "--continue", first / "run_it001_optimiser.star", "--o", second / "run") == 0
    assert {p.name for p in second.glob("run_it001_*")} == {
        "run_it001_data.star", "run_it001_model.star", "run_it001_class001.mrc", "run_it001_class002.mrc",
        "run_it001_class001_angdist.bild", "run_it001_class002_angdist.bild", "run_it001_optimiser.star",
        "run_it001_resume.npz"}
    assert not list(second.glob("run_it000_*"))
    assert (second / "run_it001_data.star").read_bytes() == (first / "run_it001_data.star").read_bytes()
    assert (second / "run_it001_class002.mrc").read_bytes() == (first / "run_it001_class002.mrc").read_bytes()
    model = starfile.read(second / "run_it001_model.star", always_dict=True)
    assert list(model["model_classes"]["rlnReferenceImage"]) == [f"{second}/run_it001_class00{k}.mrc" for k in (1, 2)]
    old = starfile.read(first / "run_it001_model.star", always_dict=True)
    for block in ("model_general", "model_class_2", "model_groups", "model_pdf_orient_class_1"):
        assert str(model[block]) == str(old[block]), block
    text = (second / "run_it001_optimiser.star").read_text()
    # the command line the continued run writes in its own files (here the test's: it runs in this process)
    assert text.splitlines()[1] == (second / "run_it002_optimiser.star").read_text().splitlines()[1]
    general = starfile.read(second / "run_it001_optimiser.star", always_dict=True)["optimiser_general"]
    assert general["rlnOutputRootName"] == str(second / "run")
    assert general["rlnModelStarFile"] == f"{second}/run_it001_model.star"
    assert general["rlnExperimentalDataStarFile"] == f"{second}/run_it001_data.star"
    assert int(general["rlnCurrentIteration"]) == 1
    assert str(first) not in text

    assert run_cli("classify", "--continue", second / "run_it001_optimiser.star", "--o", third / "run") == 0
    for folder in (second, third):
        for name in ("run_it002_class001.mrc", "run_it002_class002.mrc"):
            np.testing.assert_array_equal(read_volume(folder / name)[0], read_volume(first / name)[0])
        continued = starfile.read(folder / "run_it002_data.star")["particles"]
        np.testing.assert_array_equal(continued["rlnClassNumber"],
                                      starfile.read(first / "run_it002_data.star")["particles"]["rlnClassNumber"])


def test_renamed_star_text_moves_only_the_runs_own_names():
    """By hand: names under the old iteration's root (whole values, quoted, after a stack's `NNNNNN@`) move to the new
    root; a name that merely contains the root, another run's name and the particles' stacks stay; the root's own
    name moves only as rlnOutputRootName; the optimiser.star's command line becomes the new one."""
    from cryorefine.io.run_files import renamed_star_text

    text = ("# RELION optimiser; version 5.0.1\n# --o a/run --K 2\n\ndata_optimiser_general\n\n"
            "_rlnOutputRootName\t\t\ta/run\n_rlnModelStarFile\t\t\ta/run_it005_model.star\n"
            "_rlnSolventMaskName\t\t\tb/a/run_it005_mask.mrc\n_rlnTauSpectrumName\t\t\ta/run_it004_model.star\n\n"
            "loop_\n_rlnReferenceImage #1\n000001@a/run_it005_classes.mrcs\n\"a/run_it005_x y.mrc\"\n"
            "000001@Extract/a/run_it005_p.mrcs\n")
    renamed = renamed_star_text(text, "a/run_it005", "c/new_it005", ("a/run", "c/new"),
                                ["--continue", "a/run_it005_optimiser.star", "--o", "c/new"])
    assert renamed == ("# RELION optimiser; version 5.0.1\n# --continue a/run_it005_optimiser.star --o c/new\n\n"
                       "data_optimiser_general\n\n_rlnOutputRootName\t\t\tc/new\n"
                       "_rlnModelStarFile\t\t\tc/new_it005_model.star\n_rlnSolventMaskName\t\t\tb/a/run_it005_mask.mrc\n"
                       "_rlnTauSpectrumName\t\t\ta/run_it004_model.star\n\nloop_\n_rlnReferenceImage #1\n"
                       "000001@c/new_it005_classes.mrcs\n\"c/new_it005_x y.mrc\"\n000001@Extract/a/run_it005_p.mrcs\n")

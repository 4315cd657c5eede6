"""`cryorefine classify` end to end on a simulated mixture (numpy engine): RELION's files, K classes, seeds."""


import numpy as np
import pandas as pd
import pytest
import starfile
from conftest import CLASSIFY_ARGS, make_mixture, make_particle_set, run_cli, write_mrc


@pytest.fixture(scope="module")
def classified(tmp_path_factory):
    """60 + 60 particles of two different maps, classified from their average into K = 2 for 2 iterations."""
    folder = tmp_path_factory.mktemp("classify")
    make_mixture(folder, 60)
    code = run_cli("classify", "--i", folder / "mix.star", "--ref", folder / "avg.mrc", "--o", folder / "out" / "run",
                   "--iter", 2, *CLASSIFY_ARGS)
    assert code == 0
    return folder


def test_a_50_50_mixture_of_two_maps_is_separated(tmp_path):
    """150 + 150 particles (32 px, SNR 0.5) from their average map, K = 2, --tau2_fudge 4, 10 iterations:
    ≥ 95 % of the particles end in the class of the map they were made from."""
    make_mixture(tmp_path, 150)
    code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o", tmp_path / "run",
                   "--iter", 10, "--tau2_fudge", 4, *CLASSIFY_ARGS)
    assert code == 0
    found = starfile.read(tmp_path / "run_it010_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    truth = np.r_[np.zeros(150), np.ones(150)]
    agreement = max(np.mean(found == truth), np.mean(found != truth))  # class numbers may come out swapped
    assert agreement >= 0.95, agreement


def test_outputs_have_relion_names_and_k_classes(classified):
    out = classified / "out"
    for it in (1, 2):
        for suffix in ("data.star", "class001.mrc", "class002.mrc", "model.star", "optimiser.star", "sampling.star",
                       "report.png", "class001_angdist.bild", "class002_angdist.bild"):
            assert (out / f"run_it{it:03d}_{suffix}").is_file(), suffix
        assert not list(out.glob(f"run_it{it:03d}_half*"))
    model = starfile.read(out / "run_it002_model.star")
    classes = model["model_classes"]
    assert len(classes) == 2 and int(model["model_general"]["rlnNrClasses"]) == 2
    assert classes["rlnClassDistribution"].sum() == pytest.approx(1.0)
    assert {"model_class_1", "model_class_2"} <= set(model)
    # RELION's angdist.bild: a coloured cylinder per direction the class's distribution holds
    pdf = model["model_pdf_orient_class_1"]["rlnOrientationDistribution"].to_numpy()
    bild = (out / "run_it002_class001_angdist.bild").read_text().splitlines()
    assert [line.split()[0] for line in bild] == [".color", ".cylinder"] * (len(bild) // 2)
    assert 0 < len(bild) // 2 <= np.count_nonzero(pdf)


def test_seeds_spread_the_particles_over_both_classes(classified):
    first = starfile.read(classified / "out" / "run_it001_data.star")["particles"]
    counts = np.bincount(first["rlnClassNumber"], minlength=3)[1:]
    assert counts.min() >= 40 and counts.sum() == 120  # iteration 1: each particle against one random class


def test_a_star_list_of_references_must_match_k(classified, tmp_path):
    refs = pd.DataFrame({"rlnReferenceImage": [str(classified / "a.mrc"), str(classified / "b.mrc")]})
    starfile.write({"references": refs}, tmp_path / "refs.star")
    code = run_cli("classify", "--i", classified / "mix.star", "--ref", tmp_path / "refs.star",
                   "--o", tmp_path / "run", "--K", 3, "--iter", 1, "--cpu")
    assert code == 2
    assert not list(tmp_path.glob("run_it*"))


def test_auto_refine_options_are_refused(classified, tmp_path, capsys):
    code = run_cli("classify", "--i", classified / "mix.star", "--ref", classified / "avg.mrc", "--o", tmp_path / "run",
                   "--K", 2, "--auto_refine", "--cpu")
    assert code == 2
    assert "--auto_refine" in capsys.readouterr().err
    assert not list(tmp_path.glob("run_it*"))


def test_continue_gives_the_same_iteration_as_an_uninterrupted_run(classified, tmp_path):
    """--continue from iteration 1 reproduces iteration 2 (the first over both classes) bit for bit."""
    out = classified / "out"
    code = run_cli("classify", "--continue", out / "run_it001_optimiser.star", "--o", tmp_path / "run", "--iter", 2)
    assert code == 0
    for k in (1, 2):
        name = f"run_it002_class{k:03d}.mrc"
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()
    continued = starfile.read(tmp_path / "run_it002_data.star")["particles"]
    original = starfile.read(out / "run_it002_data.star")["particles"]
    for column in ("rlnClassNumber", "rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst",
                   "rlnMaxValueProbDistribution"):
        np.testing.assert_array_equal(continued[column], original[column])
    model = starfile.read(tmp_path / "run_it002_model.star")["model_classes"]
    want = starfile.read(out / "run_it002_model.star")["model_classes"]
    np.testing.assert_array_equal(model["rlnClassDistribution"], want["rlnClassDistribution"])
    assert (tmp_path / "run_it002_report.png").is_file()
    # it went on from iteration 1, whose files it wrote again under its root as RELION does (but the report)
    assert (tmp_path / "run_it001_data.star").is_file() and not (tmp_path / "run_it001_report.png").exists()
    assert not list(tmp_path.glob("run_it000_*"))


def test_continue_refuses_a_run_of_the_other_kind(classified, capsys):
    code = run_cli("refine", "--continue", classified / "out" / "run_it001_optimiser.star", "--iter", 2)
    assert code == 2
    assert "classify --continue" in capsys.readouterr().err


def test_classify_with_c4_symmetry_gives_c4_symmetric_classes(tmp_path):
    from conftest import EXAMPLE_MAP

    from cryorefine.core.fourier import downsample_volume
    from cryorefine.core.symmetry import symmetrise_volume, symmetry_group
    from cryorefine.io.mrc import read_volume, write_volume

    write_volume(tmp_path / "map.mrc", downsample_volume(read_volume(EXAMPLE_MAP)[0], 32), 12.0)
    assert run_cli("simulate", "--ref", tmp_path / "map.mrc", "--n", 80, "--snr", 0.5, "--seed", 3, "--sym", "C4",
                   "--o", tmp_path / "sim") == 0
    code = run_cli("classify", "--i", tmp_path / "sim" / "particles.star", "--ref", tmp_path / "map.mrc",
                   "--o", tmp_path / "run", "--iter", 2, "--sym", "C4", *CLASSIFY_ARGS)
    assert code == 0
    g = symmetry_group("C4")
    inner = (slice(1, None),) * 3
    for k in (1, 2):
        volume = read_volume(tmp_path / f"run_it002_class{k:03d}.mrc")[0].astype(np.float64)
        assert np.abs(volume).max() > 0
        assert np.abs(symmetrise_volume(volume, g) - volume)[inner].max() < 1e-5 * np.abs(volume).max()
    model = starfile.read(tmp_path / "run_it002_model.star")
    sampling = starfile.read(tmp_path / "run_it002_sampling.star")
    assert sampling["sampling_general"]["rlnSymmetryGroup"] == "C4"
    n_dir = len(sampling["sampling_directions"])
    assert n_dir == 48 // 4  # HEALPix order 1: 48 directions, a quarter in C4's unit
    assert np.all(np.abs(sampling["sampling_directions"]["rlnAngleRot"]) <= 45 + 1e-9)
    assert len(model["model_pdf_orient_class_1"]) == n_dir


# ------------------------------------------------------------------ --skip_align and local searches

def test_skip_align_with_true_poses_puts_the_particles_in_the_right_class(tmp_path):
    """600 + 600 particles of two maps (32 px, SNR 0.5) with their true poses and origins in the STAR file,
    classified from their average with --skip_align: ≥ 98 % end in the class of the map they were made from,
    and every pose and origin is the STAR file's."""
    make_mixture(tmp_path, 600)
    code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o", tmp_path / "run",
                   "--iter", 7, "--skip_align", *CLASSIFY_ARGS)
    assert code == 0
    found = starfile.read(tmp_path / "run_it007_data.star")["particles"]
    truth = np.r_[np.zeros(600), np.ones(600)]
    classes = found["rlnClassNumber"].to_numpy() - 1
    agreement = max(np.mean(classes == truth), np.mean(classes != truth))  # class numbers may come out swapped
    assert agreement >= 0.98, agreement
    given = starfile.read(tmp_path / "mix.star")["particles"]
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        np.testing.assert_allclose(found[column], given[column], atol=1e-6, err_msg=column)
    optimiser = starfile.read(tmp_path / "run_it007_optimiser.star")
    assert int(optimiser["rlnDoSkipAlign"]) == 1
    model = starfile.read(tmp_path / "run_it007_model.star")
    assert len(model["model_pdf_orient_class_1"]) == 1  # RELION's one direction when skipping alignments


def test_local_searches_stay_near_the_poses_of_the_star_file(classified, tmp_path):
    """--sigma_ang 4 on HEALPix order 3 (7.5°): particles whose STAR psi is the truth stay near the truth; those
    whose STAR psi was turned by 40° cannot reach it (the search spans ±3σ = 12°) and stay near the STAR pose."""
    table = starfile.read(classified / "mix.star")
    particles = table["particles"].iloc[::2].reset_index(drop=True)  # 60 of the 120
    turned = np.arange(len(particles)) % 2 == 1
    truth = particles.copy()
    particles.loc[turned, "rlnAnglePsi"] = particles.loc[turned, "rlnAnglePsi"] + 40.0
    particles["rlnImageName"] = [f"{n.split('@')[0]}@{classified / n.split('@')[1]}" for n in particles["rlnImageName"]]
    starfile.write({"optics": table["optics"], "particles": particles}, tmp_path / "given.star")
    code = run_cli("classify", "--i", tmp_path / "given.star", "--ref", classified / "a.mrc", "--o", tmp_path / "run",
                   "--iter", 1, "--K", 1, "--ini_high", 40, "--ctf", "--particle_diameter", 320, "--zero_mask",
                   "--offset_range", 3, "--offset_step", 1, "--healpix_order", 3, "--sigma_ang", 4, "--cpu")
    assert code == 0
    found = starfile.read(tmp_path / "run_it001_data.star")["particles"]
    to_truth = angles_between(found, truth)
    assert np.median(to_truth[~turned]) < 6.0
    # RELION's window: the direction within 3σ of the STAR direction, psi within 3σ of the STAR psi (to within
    # half a coarse step and the iteration's perturbation)
    window = 3 * 4.0 + 7.5
    assert np.all(directions_between(found, particles) < window)
    # psi alone away from the poles, where psi trades with rot (a particle 12° from a pole: psi 21° and rot 18° apart
    # from the STAR pose, their sum 3°)
    off_poles = (np.minimum(truth["rlnAngleTilt"], 180.0 - truth["rlnAngleTilt"]) > 25.0).to_numpy()
    psi_change = np.abs((found["rlnAnglePsi"] - particles["rlnAnglePsi"] + 180.0) % 360.0 - 180.0)[off_poles]
    assert np.all(psi_change < window), psi_change.max()
    # ... so the turned particles stay away from the truth, except near the poles
    away_from_poles = turned & off_poles
    assert away_from_poles.sum() >= 15
    assert np.all(to_truth[away_from_poles] > 12.0), to_truth[away_from_poles].min()
    model = starfile.read(tmp_path / "run_it001_model.star")["model_general"]
    assert int(model["rlnOrientationalPriorMode"]) == 1 and float(model["rlnSigmaPriorRotAngle"]) == 4.0


def test_sigma_rot_and_sigma_tilt_search_the_directions_with_the_larger_sigma(classified, tmp_path):
    """--sigma_rot 2 --sigma_tilt 4 --sigma_psi 4 is --sigma_ang 4 (RELION's selectOrientationsWithNonZeroPrior-
    Probability with both given: the directions' σ is the larger); model.star says each σ as given."""
    args = ("--i", classified / "mix.star", "--ref", classified / "a.mrc", "--iter", 1, "--K", 1, "--ini_high", 40,
            "--ctf", "--particle_diameter", 320, "--zero_mask", "--offset_range", 3, "--offset_step", 1,
            "--healpix_order", 3, "--cpu", "--random_seed", 3)
    assert run_cli("classify", *args, "--o", tmp_path / "ang" / "run", "--sigma_ang", 4) == 0
    assert run_cli("classify", *args, "--o", tmp_path / "rot_tilt" / "run", "--sigma_rot", 2, "--sigma_tilt", 4,
                   "--sigma_psi", 4) == 0
    a, b = (starfile.read(tmp_path / run / "run_it001_data.star")["particles"] for run in ("ang", "rot_tilt"))
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnMaxValueProbDistribution"):
        np.testing.assert_array_equal(a[column], b[column])
    model = starfile.read(tmp_path / "rot_tilt" / "run_it001_model.star")["model_general"]
    assert int(model["rlnOrientationalPriorMode"]) == 1
    assert [float(model[f"rlnSigmaPrior{n}Angle"]) for n in ("Rot", "Tilt", "Psi")] == [2.0, 4.0, 4.0]


def directions_between(a, b):
    from cryorefine.core.sampling import directions_to_xyz

    da = directions_to_xyz(a["rlnAngleRot"].to_numpy(), a["rlnAngleTilt"].to_numpy())
    db = directions_to_xyz(b["rlnAngleRot"].to_numpy(), b["rlnAngleTilt"].to_numpy())
    return np.rad2deg(np.arccos(np.clip(np.sum(da * db, axis=1), -1, 1)))


def angles_between(a, b):
    from cryorefine.core import euler

    ma = euler.euler_to_matrix(a["rlnAngleRot"], a["rlnAngleTilt"], a["rlnAnglePsi"])
    mb = euler.euler_to_matrix(b["rlnAngleRot"], b["rlnAngleTilt"], b["rlnAnglePsi"])
    cos = (np.trace(ma @ np.swapaxes(mb, -1, -2), axis1=-2, axis2=-1) - 1) / 2
    return np.rad2deg(np.arccos(np.clip(cos, -1, 1)))


@pytest.mark.parametrize("extra, fragment", [
    (("--skip_align", "--sigma_ang", 3), "exclude each other"),
    (("--sigma_ang", -2), "--sigma_ang -2: out of range"),
    (("--sigma_rot", 3), "--sigma_rot without --sigma_tilt"),
    (("--sigma_tilt", 3, "--sigma_psi", 2), "--sigma_tilt without --sigma_rot"),
    (("--sigma_tilt", 0, "--sigma_rot", 2), "--sigma_tilt 0: out of range"),
    (("--relax_sym", "C2"), "--relax_sym: symmetry relaxation"),
    (("--skip_align", "--no_poses"), "rlnAngleRot"),
])
def test_skip_align_and_local_search_input_is_checked(classified, tmp_path, capsys, extra, fragment):
    star = classified / "mix.star"
    if "--no_poses" in extra:
        table = starfile.read(star)
        particles = table["particles"].drop(columns=["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"])
        particles["rlnImageName"] = [f"{n.split('@')[0]}@{classified / n.split('@')[1]}"
                                     for n in particles["rlnImageName"]]
        star = tmp_path / "no_poses.star"
        starfile.write({"optics": table["optics"], "particles": particles}, star)
        extra = tuple(e for e in extra if e != "--no_poses")
    code = run_cli("classify", "--i", star, "--ref", classified / "avg.mrc", "--o", tmp_path / "out" / "run",
                   "--iter", 1, *CLASSIFY_ARGS, *extra)
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_firstiter_cc_gives_every_class_the_directions_of_class_one(classified, tmp_path):
    # the cross-correlation iteration compares all particles with class 1 alone; as in RELION, every class then
    # starts from its map and its direction distribution (not an empty one), and the classes share the particles
    code = run_cli("classify", "--i", classified / "mix.star", "--ref", classified / "avg.mrc", "--o", tmp_path / "run",
                   "--iter", 1, "--firstiter_cc", *CLASSIFY_ARGS)
    assert code == 0
    model = starfile.read(tmp_path / "run_it001_model.star")
    pdf = [model[f"model_pdf_orient_class_{k}"]["rlnOrientationDistribution"].to_numpy() for k in (1, 2)]
    assert pdf[0].sum() > 0 and np.allclose(pdf[0], pdf[1])
    assert sum(p.sum() for p in pdf) == pytest.approx(1.0)
    assert np.allclose(model["model_classes"]["rlnClassDistribution"], 0.5)


def test_the_report_history_matches_the_model_and_optimiser_files(classified):
    # the per-iteration signals the report draws: each class's resolution (the best of them is the run's), and the
    # share of particles that changed class (RELION's rlnChangesOptimalClasses of that iteration's optimiser file)
    from cryorefine.io import resume

    out = classified / "out"
    _, arrays = resume.load(out / "run_it002_optimiser.star")
    per_class, changes = arrays["extra_class_resolutions"], arrays["extra_class_changes"]
    assert per_class.shape == (2, 2) and changes.shape == (2,)
    for it in (1, 2):
        model = starfile.read(out / f"run_it{it:03d}_model.star")["model_general"]
        optimiser = starfile.read(out / f"run_it{it:03d}_optimiser.star", always_dict=True)["optimiser_general"]
        assert per_class[it - 1].min() == pytest.approx(float(model["rlnCurrentResolution"]), rel=1e-6)
        assert changes[it - 1] == pytest.approx(float(optimiser["rlnChangesOptimalClasses"]), abs=1e-6)


@pytest.mark.gpu
def test_skip_align_on_the_gpu_matches_the_cpu(tmp_path):
    """--skip_align classification of 100 + 100 particles with their true poses, 3 iterations, by the numpy and
    the GPU engine: the same classes for ≥ 99 % of the particles, class maps with FSC ≥ 0.99 between the
    engines up to the reported resolution, and the STAR file's poses kept by both."""
    from conftest import cupy_or_skip

    from cryorefine.core.fsc import fsc_volumes
    from cryorefine.io.mrc import read_volume

    cupy_or_skip()
    make_mixture(tmp_path, 100)
    args = [a for a in CLASSIFY_ARGS if a != "--cpu"]
    for name, engine in (("cpu", ["--cpu"]), ("gpu", ["--gpu", "0"])):
        assert run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / name / "run", "--iter", 3, "--skip_align", *args, *engine) == 0
    cpu = starfile.read(tmp_path / "cpu" / "run_it003_data.star")["particles"]
    gpu = starfile.read(tmp_path / "gpu" / "run_it003_data.star")["particles"]
    same = np.mean(cpu["rlnClassNumber"].to_numpy() == gpu["rlnClassNumber"].to_numpy())
    print(f"same class for {100 * same:.1f} % of the particles")
    assert same >= 0.99
    for column in ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst"):
        np.testing.assert_allclose(gpu[column], cpu[column], atol=1e-6, err_msg=column)
    model = starfile.read(tmp_path / "cpu" / "run_it003_model.star")
    box, pixel = 32, 12.0
    shell_limit = int(box * pixel / float(model["model_general"]["rlnCurrentResolution"]))
    for k in (1, 2):
        a, _ = read_volume(tmp_path / "cpu" / f"run_it003_class{k:03d}.mrc")
        b, _ = read_volume(tmp_path / "gpu" / f"run_it003_class{k:03d}.mrc")
        fsc = np.asarray(fsc_volumes(a, b))
        print(f"class {k}: FSC(CPU map, GPU map) min {fsc[1:shell_limit + 1].min():.5f} up to shell {shell_limit}")
        assert fsc[1:shell_limit + 1].min() >= 0.99


@pytest.mark.parametrize("oversampling, said", [(1, True), (2, False)])
def test_a_fine_step_coarser_than_the_compared_detail_is_said_once(tmp_path, caplog, oversampling, said):
    """32 px of 12 Å compared whole (24 Å), a 320 Å particle: order 1 with oversampling 1 steps 15°, resolving
    15/360·π·320/1.2 = 34.9 Å, so with RELION's sampling kept a warning in iteration 1 and not again; oversampling 2
    (7.5°, 17.5 Å) none."""
    make_mixture(tmp_path, 10)
    with caplog.at_level("WARNING", logger="cryorefine"):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / "run", "--iter", 2, *CLASSIFY_ARGS, "--oversampling", oversampling,
                       "--relion_oversampling")
    assert code == 0
    lines = [r.getMessage() for r in caplog.records if "fine angular step" in r.getMessage()]
    assert len(lines) == (1 if said else 0), lines
    if said:
        assert "from iteration 1 on" in lines[0] and "--oversampling 2" in lines[0]


@pytest.mark.parametrize("relion", [False, True])
def test_the_fine_pass_is_sampled_finer_once_the_classes_stall(tmp_path, caplog, relion):
    """The 32 px mixture at --healpix_order 1 (a 15° fine step, too coarse for the 24 Å compared) with a --tau2_fudge
    so high that the classes churn: once the share of particles changing class stops falling (and pmax is high
    enough), the next iteration samples at oversampling 2, says so once, records it in its optimiser file and keeps
    it through a --continue; --relion_oversampling keeps 1."""
    from cryorefine.io.star import read_star

    make_mixture(tmp_path, 20)
    with caplog.at_level("INFO", logger="cryorefine"):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / "run", "--iter", 6, *CLASSIFY_ARGS, "--tau2_fudge", 4,
                       *(["--relion_oversampling"] if relion else []))
    assert code == 0
    said = [r.getMessage() for r in caplog.records if "samples one order finer" in r.getMessage()]
    orders = [int(read_star(tmp_path / f"run_it{i:03d}_optimiser.star")["optimiser_general"]
                  ["rlnAdaptiveOversampleOrder"]) for i in range(1, 7)]
    pmax = [float(read_star(tmp_path / f"run_it{i:03d}_model.star")["model_general"]["rlnAveragePmax"])
            for i in range(1, 7)]
    print(orders, pmax, said)
    if relion:
        assert orders == [1] * 6 and not said
        return
    assert len(said) == 1, said
    first = int(said[0].split("from iteration ")[1].split()[0])
    assert orders == [1] * (first - 1) + [2] * (7 - first)
    assert pmax[first - 2] >= 0.5  # the rule's pmax is the last M-step's
    caplog.clear()  # a --continue keeps the raised order and does not say it again
    with caplog.at_level("INFO", logger="cryorefine"):
        assert run_cli("classify", "--continue", tmp_path / "run_it006_optimiser.star", "--iter", 7) == 0
    assert not [r for r in caplog.records if "samples one order finer" in r.getMessage()]
    assert int(read_star(tmp_path / "run_ct6_it007_optimiser.star")["optimiser_general"]
               ["rlnAdaptiveOversampleOrder"]) == 2  # no --o: RELION's run_ct6


def test_the_pmax_of_a_firstiter_cc_iteration_does_not_sample_the_next_finer(tmp_path, caplog):
    """The mixture at --ini_high 80 compares 30 of its 32 px, so the fine pass may be sampled finer while the
    resolution can still grow, once the pmax reaches 0.5; --firstiter_cc's iteration 1 reports a pmax of 1, which
    is not a likelihood's (taken at its word it raised iteration 2, of pmax 0.02, at 7× the E-step time)."""
    from cryorefine.io.star import read_star

    make_mixture(tmp_path, 20)
    with caplog.at_level("INFO", logger="cryorefine"):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / "run", "--iter", 2, *CLASSIFY_ARGS, "--ini_high", 80, "--firstiter_cc")
    assert code == 0
    assert float(read_star(tmp_path / "run_it001_model.star")["model_general"]["rlnAveragePmax"]) >= 0.5
    assert not [r for r in caplog.records if "samples one order finer" in r.getMessage()]
    assert int(read_star(tmp_path / "run_it002_optimiser.star")["optimiser_general"]["rlnAdaptiveOversampleOrder"]) == 1


def test_coarse_size_caps_the_coarse_pass_and_is_recorded(tmp_path, capsys):
    """RELION's --coarse_size: the coarse pass compares at most that many pixels (here fewer than RELION's own rule
    gives at HEALPix order 3 on this box), the current size is untouched, and the optimiser file records the cap as
    RELION's (rlnMaximumCoarseImageSize). An odd size is refused on one line, exit 2, before anything is written."""
    from cryorefine.io.star import read_star

    make_mixture(tmp_path, 10)
    sizes = {}
    for name, extra in (("free", ()), ("capped", ("--coarse_size", 12))):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / name / "run", "--iter", 1, *CLASSIFY_ARGS, "--healpix_order", 3, *extra)
        assert code == 0
        general = read_star(tmp_path / name / "run_it001_optimiser.star")["optimiser_general"]
        model = read_star(tmp_path / name / "run_it001_model.star")["model_general"]
        sizes[name] = (int(general["rlnCoarseImageSize"]), int(general["rlnMaximumCoarseImageSize"]),
                       int(model["rlnCurrentImageSize"]))
    assert sizes["free"][0] > 12 and sizes["free"][1] == -1
    assert sizes["capped"] == (12, 12, sizes["free"][2])
    capsys.readouterr()
    code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                   tmp_path / "odd" / "run", "--iter", 1, *CLASSIFY_ARGS, "--coarse_size", 13)
    err = capsys.readouterr().err
    assert code == 2 and "--coarse_size 13: out of range" in err and err.count("\n") == 1, err
    assert not (tmp_path / "odd").exists()


def test_strict_highres_exp_sets_the_compared_size_and_is_recorded(tmp_path):
    """RELION's --strict_highres_exp 48 on 32 px of 12 Å: both passes compare 2·round(384/48) = 16 px while the
    current size stays the whole box (ini_high 40 + 10 shells); the optimiser file records the limit as RELION's."""
    make_mixture(tmp_path, 10)
    code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o", tmp_path / "run",
                   "--iter", 1, *CLASSIFY_ARGS, "--strict_highres_exp", 48)
    assert code == 0
    from cryorefine.io.star import read_star

    general = read_star(tmp_path / "run_it001_optimiser.star")["optimiser_general"]
    assert float(general["rlnHighresLimitExpectation"]) == 48.0
    assert int(general["rlnCoarseImageSize"]) == 16
    model = read_star(tmp_path / "run_it001_model.star")["model_general"]
    assert int(model["rlnCurrentImageSize"]) == 32


def test_more_classes_than_particles_is_said(tmp_path, caplog):
    """--K 5 for 4 particles runs, and says that one class at least stays empty."""
    star, _ = make_particle_set(tmp_path, n=4, box=16, pixel_size=4.0, seed=5)
    write_mrc(tmp_path / "ref.mrc", np.random.default_rng(6).normal(size=(16, 16, 16)).astype(np.float32),
              pixel_size=4.0, stack=False)
    with caplog.at_level("WARNING", logger="cryorefine"):
        code = run_cli("classify", "--i", star, "--ref", tmp_path / "ref.mrc", "--o", tmp_path / "run", "--K", 5,
                       "--iter", 1, "--particle_diameter", 40, "--cpu")
    assert code == 0
    lines = [r.getMessage() for r in caplog.records if "--K 5 with 4 particles" in r.getMessage()]
    assert len(lines) == 1 and "give --K 4 or fewer" in lines[0], lines


def test_a_posterior_broader_than_the_fine_pass_holds_is_cut_and_said(tmp_path, caplog, monkeypatch):
    """With room for 704 fine samples a particle (22 coarse samples of RELION's 8 × 4 children), the mixture's first
    iteration keeps at most 22 samples a particle, writes those counts, and says how many particles reached it."""
    from cryorefine.estep import common

    monkeypatch.setattr(common, "FINE_SAMPLES_PER_PARTICLE", 704)
    make_mixture(tmp_path, 10)
    with caplog.at_level("WARNING", logger="cryorefine"):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / "run", "--iter", 1, *CLASSIFY_ARGS, "--relion_oversampling")
    assert code == 0
    counts = starfile.read(tmp_path / "run_it001_data.star")["particles"]["rlnNrOfSignificantSamples"].to_numpy()
    assert counts.max() <= 22 and (counts == 22).any(), counts
    lines = [r.getMessage() for r in caplog.records if "the fine pass's limit" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{np.count_nonzero(counts == 22)} of 20 particles reached the fine pass's limit of 22 " in lines[0]
    assert "--relion_oversampling" not in lines[0]


def test_a_finer_pass_is_limited_by_its_table_and_dropped_where_most_particles_reach_it(tmp_path, caplog,
                                                                                       monkeypatch):
    """The stalling mixture of the test above, with room for a finer-pass table of only 2^12 cells a particle (2
    coarse samples of 64 × 16 children): the iterations at RELION's sampling keep all their samples and say nothing
    of a limit; the raised iteration keeps at most 2 a particle and says so, and as more than half its particles
    reached the limit the next iterations sample at --oversampling again, for the rest of the run and through a
    --continue."""
    from cryorefine.estep import common
    from cryorefine.io.star import read_star

    def orders(last):
        return [int(read_star(tmp_path / f"run_it{i:03d}_optimiser.star")["optimiser_general"]
                    ["rlnAdaptiveOversampleOrder"]) for i in range(1, last + 1)]

    monkeypatch.setattr(common, "FINE_CELLS_PER_PARTICLE", 1 << 12)
    make_mixture(tmp_path, 20)
    with caplog.at_level("INFO", logger="cryorefine"):
        code = run_cli("classify", "--i", tmp_path / "mix.star", "--ref", tmp_path / "avg.mrc", "--o",
                       tmp_path / "run", "--iter", 6, *CLASSIFY_ARGS, "--tau2_fudge", 4)
    assert code == 0
    got = orders(6)
    assert got.count(2) == 1 and got.index(2) < 5, got  # raised once, then dropped
    raised = got.index(2) + 1
    limited = [r.getMessage() for r in caplog.records if "the fine pass's limit of 2 " in r.getMessage()]
    dropped = [r.getMessage() for r in caplog.records if "samples at --oversampling again" in r.getMessage()]
    assert len(limited) == 1 and limited[0].startswith(f"iteration {raised}: ")
    assert "--relion_oversampling" in limited[0]
    assert len(dropped) == 1 and dropped[0].startswith(f"from iteration {raised + 1} on"), dropped
    for i, order in enumerate(got, start=1):
        counts = starfile.read(tmp_path / f"run_it{i:03d}_data.star")["particles"]["rlnNrOfSignificantSamples"]
        if order == 2:
            assert counts.max() <= 2 and 2 * (counts == 2).sum() > counts.size
        else:
            assert counts.max() > 2
    caplog.clear()
    with caplog.at_level("INFO", logger="cryorefine"):
        assert run_cli("classify", "--continue", tmp_path / "run_it006_optimiser.star", "--iter", 7) == 0
    assert int(read_star(tmp_path / "run_ct6_it007_optimiser.star")["optimiser_general"]
               ["rlnAdaptiveOversampleOrder"]) == 1  # no --o: RELION's run_ct6
    assert not [r for r in caplog.records if "samples one order finer" in r.getMessage()]


def test_fast_subsets_search_a_random_subset_and_keep_the_other_poses(classified, tmp_path, monkeypatch, caplog):
    """--fast_subsets with RELION's subsets made small (20 particles per class instead of 1500): iteration 1
    searches 20 of the 120 particles; the other 100 keep the poses of the STAR file."""
    import logging

    from cryorefine.em import schedule

    monkeypatch.setattr(schedule, "FAST_SUBSET_PARTICLES_PER_CLASS", 20)
    caplog.set_level(logging.INFO)
    code = run_cli("classify", "--i", classified / "mix.star", "--ref", classified / "avg.mrc", "--o",
                   tmp_path / "run", "--iter", 1, "--fast_subsets", *CLASSIFY_ARGS[:1], 1, "--firstiter_cc",
                   *CLASSIFY_ARGS[2:])
    assert code == 0
    given = starfile.read(classified / "mix.star")["particles"]
    found = starfile.read(tmp_path / "run_it001_data.star")["particles"]
    moved = ((found["rlnAngleRot"] - given["rlnAngleRot"]).abs() > 1e-3) | (
        (found["rlnAngleTilt"] - given["rlnAngleTilt"]).abs() > 1e-3)
    assert moved.sum() == 20
    assert "--fast_subsets: iteration 1 takes 20 random particles of 120" in caplog.text
    assert "RELION runs its subsets only with --iter 20 or more" in caplog.text


def test_allow_coarser_sampling_coarsens_the_sampling_as_relion(classified, tmp_path):
    """--allow_coarser_sampling, K = 2, --healpix_order 2, --ini_high 80 (40 particles): the cross-correlation
    iteration samples order 1, the coarsest whose 15° step stays below 0.8 × 360 / ⌈π·320 Å / resolution⌉ (over
    20°), with offsets of 0.95 × the range (no accuracy yet, as RELION's); the next iteration estimates the
    accuracy and samples from it, never finer than order 2. Without the option, order 2 and the given step."""
    table = starfile.read(classified / "mix.star")
    few = table["particles"].iloc[::3].reset_index(drop=True)
    few["rlnImageName"] = [f"{n.split('@')[0]}@{classified / n.split('@')[1]}" for n in few["rlnImageName"]]
    starfile.write({"optics": table["optics"], "particles": few}, tmp_path / "few.star")
    args = ("--i", tmp_path / "few.star", "--ref", classified / "avg.mrc", "--iter", 2, "--firstiter_cc", "--K", 2,
            "--ini_high", 80, *CLASSIFY_ARGS[4:-2], 2, "--cpu")
    assert run_cli("classify", "--o", tmp_path / "coarser" / "run", "--allow_coarser_sampling", *args) == 0
    first = starfile.read(tmp_path / "coarser" / "run_it001_sampling.star")["sampling_general"]
    assert int(first["rlnHealpixOrder"]) == 1 and int(first["rlnHealpixOrderOriginal"]) == 2
    assert float(first["rlnOffsetStep"]) == pytest.approx(0.95 * 3 * 12.0)  # Å: 0.95 × 3 px × 12 Å/px
    second = starfile.read(tmp_path / "coarser" / "run_it002_sampling.star")["sampling_general"]
    assert int(second["rlnHealpixOrder"]) <= 2
    classes = starfile.read(tmp_path / "coarser" / "run_it002_model.star")["model_classes"]
    assert (classes["rlnAccuracyRotations"] < 999.0).all()
    assert run_cli("classify", "--o", tmp_path / "plain" / "run", *args[:5], 1, *args[6:]) == 0
    plain = starfile.read(tmp_path / "plain" / "run_it001_sampling.star")["sampling_general"]
    assert int(plain["rlnHealpixOrder"]) == 2 and float(plain["rlnOffsetStep"]) == pytest.approx(12.0)

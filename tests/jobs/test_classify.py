"""`cryorefine classify` end to end on a simulated mixture (numpy engine): RELION's files, K classes, seeds."""


import numpy as np
import pandas as pd
import pytest
import starfile

from conftest import CLASSIFY_ARGS, make_mixture, run_cli

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
                       "report.png"):
            assert (out / f"run_it{it:03d}_{suffix}").is_file(), suffix
        assert not list(out.glob(f"run_it{it:03d}_half*"))
    model = starfile.read(out / "run_it002_model.star")
    classes = model["model_classes"]
    assert len(classes) == 2 and int(model["model_general"]["rlnNrClasses"]) == 2
    assert classes["rlnClassDistribution"].sum() == pytest.approx(1.0)
    assert {"model_class_1", "model_class_2"} <= set(model)


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
        assert (tmp_path / f"run_it002_class{k:03d}.mrc").read_bytes() == (out / f"run_it002_class{k:03d}.mrc").read_bytes()
    continued = starfile.read(tmp_path / "run_it002_data.star")["particles"]
    original = starfile.read(out / "run_it002_data.star")["particles"]
    for column in ("rlnClassNumber", "rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst",
                   "rlnMaxValueProbDistribution"):
        np.testing.assert_array_equal(continued[column], original[column])
    model = starfile.read(tmp_path / "run_it002_model.star")["model_classes"]
    want = starfile.read(out / "run_it002_model.star")["model_classes"]
    np.testing.assert_array_equal(model["rlnClassDistribution"], want["rlnClassDistribution"])
    assert (tmp_path / "run_it002_report.png").is_file()
    assert not (tmp_path / "run_it001_data.star").exists()  # it went on from iteration 2


def test_continue_refuses_a_run_of_the_other_kind(classified, capsys):
    code = run_cli("refine", "--continue", classified / "out" / "run_it001_optimiser.star", "--iter", 2)
    assert code == 2
    assert "classify --continue" in capsys.readouterr().err


def test_classify_with_c4_symmetry_gives_c4_symmetric_classes(tmp_path):
    from cryorefine.core.fourier import downsample_volume
    from cryorefine.core.symmetry import symmetrise_volume, symmetry_group
    from cryorefine.io.mrc import read_volume, write_volume
    from conftest import EXAMPLE_MAP

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

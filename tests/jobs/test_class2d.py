"""`cryorefine class2d` and RELION's Class2D lines through `cryorefine relion_refine`, on a simulated set of three
2D views (tests/jobs/class2d_data.py), numpy engine; and the same run on the GPU engine (marker `gpu`)."""

import itertools
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import starfile
from class2d_data import best_rotated_correlation, make_views_set, true_views
from conftest import mpiexec_or_skip as mpiexec
from conftest import run_cli

from cryorefine.io.mrc import read_volume

LINES_FILE = Path(__file__).resolve().parents[1] / "data" / "relion5_class2d_gui_lines.txt"
#: the options of a small, fast run (the GUI's own lines add theirs)
FAST = ("--psi_step", 15, "--offset_range", 2, "--offset_step", 1, "--particle_diameter", 320, "--cpu")
#: the three views' run (`three_views`) but for --i, --o and the engine
THREE_VIEWS_RUN = ("--K", 3, "--iter", 8, "--tau2_fudge", 2, "--ctf", "--flatten_solvent", "--zero_mask",
                   "--center_classes", "--norm", "--scale", *FAST[:-1])


def matched_agreement(truth, found, k_classes):
    """The share of particles in the class matched to their true view, under the best one-to-one matching."""
    return max(np.mean(np.asarray(perm)[found] == truth) for perm in itertools.permutations(range(k_classes)))


@pytest.fixture(scope="module")
def three_views(tmp_path_factory):
    """60 particles of each of three views (SNR 1, CTFs), K = 3, 8 iterations (about 12 s on one core): the run
    and the true views."""
    folder = tmp_path_factory.mktemp("class2d")
    star, truth = make_views_set(folder, 60, snr=1.0, seed=3)
    code = run_cli("class2d", "--i", star, "--o", folder / "out" / "run", *THREE_VIEWS_RUN, "--cpu")
    assert code == 0
    return folder, star, truth


def test_particles_end_in_the_class_of_their_view_and_the_averages_are_the_views(three_views):
    """Chance is 1/3 (measured: every particle in its view's class by iteration 7; each average correlates ≥ 0.99
    with its view at the best in-plane angle, ≤ 0.9 with the other two)."""
    folder, _, truth = three_views
    found = starfile.read(folder / "out" / "run_it008_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    assert matched_agreement(truth, found, 3) >= 0.9
    averages = read_volume(folder / "out" / "run_it008_classes.mrcs", require_cubic=False)[0]
    views = true_views()
    assert averages.shape == (3,) + views.shape[1:]
    for k in range(3):  # the class's view: the one most of its particles came from
        view = np.bincount(truth[found == k], minlength=3).argmax()
        assert best_rotated_correlation(averages[k], views[view], 6.0) >= 0.9


def test_iteration_1_keeps_every_particle_at_the_centre_translation_as_relions_class2d(three_views):
    """RELION's Class2D offsets prior counts the sampling's translations in Å as if they were pixels (`jobs.class2d`):
    at 12 Å/px a coarse step of 1 px from the previous offset costs about −100 in log prior, so in iteration 1 every
    particle ends at one of the centre translation's four fine children (RELION 5's run_it001_data.star on such a set
    holds 4 distinct offsets). Measured with the translations counted as they are: 15 distinct offsets, up to 1.2 px
    from the centre."""
    folder, _, _ = three_views
    particles = starfile.read(folder / "out" / "run_it001_data.star")["particles"]
    offsets = set(zip(particles["rlnOriginXAngst"].round(3), particles["rlnOriginYAngst"].round(3)))
    assert len(offsets) <= 4, sorted(offsets)


def test_the_outputs_are_relions_2d_files(three_views):
    folder, _, _ = three_views
    out = folder / "out"
    for it in (1, 8):
        for suffix in ("data.star", "classes.mrcs", "model.star", "optimiser.star", "sampling.star", "report.png"):
            assert (out / f"run_it{it:03d}_{suffix}").is_file(), suffix
        assert not list(out.glob(f"run_it{it:03d}_class0*"))  # no 3D class maps
    particles = starfile.read(out / "run_it008_data.star")["particles"]
    assert {"rlnClassNumber", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst", "rlnMaxValueProbDistribution",
            "rlnNrOfSignificantSamples"} <= set(particles.columns)
    assert not {"rlnAngleRot", "rlnAngleTilt"} & set(particles.columns)
    model = starfile.read(out / "run_it008_model.star")
    assert int(model["model_general"]["rlnReferenceDimensionality"]) == 2
    classes = model["model_classes"]
    assert list(classes["rlnReferenceImage"]) == [f"{k:06d}@{out}/run_it008_classes.mrcs" for k in (1, 2, 3)]
    assert classes["rlnClassDistribution"].sum() == pytest.approx(1.0)
    # RELION's MlModel::readStar refuses 2D classes without their offset priors: the centre this run used, (0, 0)
    assert (classes["rlnClassPriorOffsetX"] == 0).all() and (classes["rlnClassPriorOffsetY"] == 0).all()
    general = starfile.read(out / "run_it008_sampling.star")
    assert int(general["rlnIs3DSampling"]) == 0 and float(general["rlnPsiStep"]) == pytest.approx(15.0)


def assert_gpu_run_matches_the_cpu(cpu_folder, gpu_folder, iterations, k_classes, same_class=0.99, same_pose=0.9,
                                   correlation=0.999):
    """The GPU run in `gpu_folder` against the CPU run in `cpu_folder` after each of `iterations`: the same class for
    at least `same_class` of the particles, the same psi and origin for at least `same_pose`, and each class average
    correlating at least `correlation` with the CPU's."""
    for it in iterations:
        cpu = starfile.read(cpu_folder / f"run_it{it:03d}_data.star")["particles"]
        gpu = starfile.read(gpu_folder / f"run_it{it:03d}_data.star")["particles"]
        classes = np.mean(cpu["rlnClassNumber"].to_numpy() == gpu["rlnClassNumber"].to_numpy())
        dpsi = (gpu["rlnAnglePsi"].to_numpy() - cpu["rlnAnglePsi"].to_numpy() + 180.0) % 360.0 - 180.0
        poses = np.mean((np.abs(dpsi) < 1e-3)
                        & np.isclose(gpu["rlnOriginXAngst"], cpu["rlnOriginXAngst"], atol=1e-3)
                        & np.isclose(gpu["rlnOriginYAngst"], cpu["rlnOriginYAngst"], atol=1e-3))
        a = read_volume(cpu_folder / f"run_it{it:03d}_classes.mrcs", require_cubic=False)[0]
        b = read_volume(gpu_folder / f"run_it{it:03d}_classes.mrcs", require_cubic=False)[0]
        correlations = [float(np.corrcoef(a[k].ravel(), b[k].ravel())[0, 1]) for k in range(k_classes)]
        print(f"iteration {it}: same class {100 * classes:.1f} %, same pose {100 * poses:.1f} %, class "
              f"averages' correlations {', '.join(f'{c:.5f}' for c in correlations)}")
        assert classes >= same_class, it
        assert poses >= same_pose, it
        assert min(correlations) >= correlation, (it, correlations)


def test_the_report_is_a_gallery_of_the_k_averages_largest_class_first_with_the_models_sizes(three_views):
    """Iterations 1 and 8: the report's K panels in RELION's order (rlnClassDistribution of model.star, largest
    first), each with model.star's share and the number of particles data.star puts in its class."""
    from test_report import gallery_record

    folder, _, _ = three_views
    for it in (1, 8):
        root = folder / "out" / f"run_it{it:03d}"
        shares = starfile.read(f"{root}_model.star")["model_classes"]["rlnClassDistribution"].to_numpy()
        classes = starfile.read(f"{root}_data.star")["particles"]["rlnClassNumber"].to_numpy()
        record = gallery_record(f"{root}_report.png")
        assert sorted(k for k, _, _ in record) == [1, 2, 3], it
        assert [s for _, s, _ in record] == sorted((s for _, s, _ in record), reverse=True), it
        for k, share, count in record:
            assert share == pytest.approx(shares[k - 1], abs=1e-6), (it, k)
            assert count == np.sum(classes == k), (it, k)


@pytest.mark.gpu
def test_class2d_on_the_gpu_matches_the_cpu(three_views):
    """The three views' run on one GPU (the GPU engine's 2D path, the M-step's reconstructions on the device) against
    the same run on the CPU (`three_views`): after iterations 1 and 8 the same class for ≥ 99 % of the particles,
    the same psi and origin for ≥ 90 %, and each class average correlating ≥ 0.999 with the CPU's."""
    from conftest import cupy_or_skip

    cupy_or_skip()
    folder, star, _ = three_views
    assert run_cli("class2d", "--i", star, "--o", folder / "gpu" / "run", *THREE_VIEWS_RUN, "--gpu", "0") == 0
    assert_gpu_run_matches_the_cpu(folder / "out", folder / "gpu", (1, 8), 3)


def run_under_mpiexec(ranks, job_args, timeout=600):
    """`mpiexec -n RANKS python -m cryorefine JOB_ARGS`: the finished process."""
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)
    command = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "cryorefine", *map(str, job_args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.parametrize("gpus", ["0", "0:1"], ids=["two_workers_on_one_gpu", "a_gpu_each"])
def test_class2d_on_gpus_under_mpiexec_matches_the_cpu(three_views, gpus):
    """The three views' EM run under mpiexec -n 3 (a master and two workers) with --gpu against the CPU run in one
    process (`three_views`), as one GPU matches it (`test_class2d_on_the_gpu_matches_the_cpu`): the two workers on
    one GPU (each its own references, sums added on the host), or on a GPU each (two GPUs: the references made once
    between them and the sums added on the GPUs with NCCL, `runners.mpi`)."""
    from conftest import cupy_or_skip

    from cryorefine.gpu.collectives import nccl_usable

    cp = cupy_or_skip()
    if gpus == "0:1" and (cp.cuda.runtime.getDeviceCount() < 2 or not nccl_usable()):
        pytest.skip("needs two GPUs and CuPy with NCCL")
    folder, star, _ = three_views
    out = folder / f"mpi_gpu_{gpus.replace(':', '_')}"
    result = run_under_mpiexec(3, ("class2d", "--i", star, "--o", out / "run", *THREE_VIEWS_RUN, "--gpu", gpus))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("iteration 8:") == 1
    assert_gpu_run_matches_the_cpu(folder / "out", out, (1, 8), 3)


def test_continue_gives_the_same_iteration_as_an_uninterrupted_run(three_views, tmp_path):
    folder, _, _ = three_views
    code = run_cli("class2d", "--continue", folder / "out" / "run_it004_optimiser.star", "--o", tmp_path / "run",
                   "--iter", 5)
    assert code == 0
    # it went on from iteration 4, whose files it wrote again under its root as RELION does (but the report)
    assert (tmp_path / "run_it004_data.star").is_file() and not (tmp_path / "run_it004_report.png").exists()
    assert not list(tmp_path.glob("run_it003_*"))
    again = starfile.read(tmp_path / "run_it005_data.star")["particles"]
    first = starfile.read(folder / "out" / "run_it005_data.star")["particles"]
    assert np.array_equal(again["rlnClassNumber"], first["rlnClassNumber"])
    assert np.allclose(again["rlnAnglePsi"], first["rlnAnglePsi"])
    a = read_volume(tmp_path / "run_it005_classes.mrcs", require_cubic=False)[0]
    b = read_volume(folder / "out" / "run_it005_classes.mrcs", require_cubic=False)[0]
    assert np.allclose(a, b, atol=1e-5 * np.abs(b).max())


def gui_lines():
    """(setting, line) for each line of LINES_FILE."""
    out, setting = [], None
    for text in LINES_FILE.read_text().splitlines():
        if text.startswith("# Class2D: "):
            setting = text[len("# Class2D: "):]
        elif text.startswith("`which relion_refine"):
            out.append((setting, text))
    return out


#: the GUI settings whose lines cryorefine refuses, with the option the message names
REFUSED = {"allow_coarser Yes": "--allow_coarser_sampling"}


@pytest.fixture(scope="module")
def gui_project(tmp_path_factory):
    """A project folder whose Extract/job018/particles.star holds 20 particles of each view (with an rlnAnglePsi
    column, as an earlier 2D classification's data.star has, for the --skip_align line)."""
    project = tmp_path_factory.mktemp("project")
    star, _ = make_views_set(project / "Extract" / "job018", 20, snr=1.0, seed=5)
    table = starfile.read(star)
    table["particles"]["rlnAnglePsi"] = 0.0
    starfile.write(table, project / "Extract" / "job018" / "particles.star")
    return project


@pytest.mark.parametrize("setting, line", gui_lines(), ids=[s for s, _ in gui_lines()])
def test_relion5_class2d_gui_lines_run_through_relion_refine(gui_project, monkeypatch, setting, line, capsys):
    """Each line, one iteration on the CPU (`--iter 1 --cpu` added, as under "Additional arguments"): it writes
    RELION's files (VDAM's with the momenta: its one iteration is its last) and RELION_JOB_EXIT_SUCCESS, or (coarser
    sampling) is refused in one line naming the option, exit 2, RELION_JOB_EXIT_FAILURE and no iteration's files."""
    monkeypatch.chdir(gui_project)
    words = shlex.split(line)[2:]
    folder = Path(words[words.index("--pipeline_control") + 1])
    folder.mkdir(parents=True, exist_ok=True)
    code = run_cli("relion_refine", *words, "--cpu", "--iter", 1)
    if setting in REFUSED:
        assert code == 2
        err = capsys.readouterr().err
        assert REFUSED[setting] in err and len(err.strip().splitlines()) == 1
        assert (folder / "RELION_JOB_EXIT_FAILURE").exists() or not (folder / "RELION_JOB_EXIT_SUCCESS").exists()
        assert not list(folder.glob("run_it*"))
        return
    assert code == 0, capsys.readouterr().err
    assert (folder / "RELION_JOB_EXIT_SUCCESS").exists()
    for suffix in ("data.star", "classes.mrcs", "model.star", "optimiser.star", "sampling.star"):
        assert (folder / f"run_it001_{suffix}").is_file(), suffix
    vdam = "--grad" in words
    assert (folder / "run_it001_1moment.mrcs").is_file() == vdam
    general = starfile.read(folder / "run_it001_optimiser.star", always_dict=True)["optimiser_general"]
    assert int(general["rlnDoGradientRefine"]) == int(vdam)


def test_class2d_asks_for_cpu_where_gpu_has_no_device_in_one_line(gui_project, tmp_path, capsys):
    """--gpu where CuPy sees no device is refused in one line naming --cpu (on a GPU machine the GPU tests run the
    job: tests/estep/test_cuda_2d.py)."""
    from cryorefine.estep.backend import cupy_available

    if cupy_available():
        pytest.skip("a CUDA device is there: --gpu runs")
    code = run_cli("class2d", "--i", gui_project / "Extract" / "job018" / "particles.star", "--o", tmp_path / "run",
                   "--K", 2, "--iter", 1, "--gpu", "0")
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and ("--cpu" in err)
    assert not list(tmp_path.glob("run_it*"))


def test_bad_input_is_one_line_naming_the_option(gui_project, tmp_path, capsys):
    star = gui_project / "Extract" / "job018" / "particles.star"
    for args, named in ((("--psi_step", -3), "--psi_step"), (("--sym", "C2"), "--sym"),
                        (("--ref", star), "--ref")):
        code = run_cli("class2d", "--i", star, "--o", tmp_path / "run", "--K", 2, "--iter", 1, "--cpu", *args)
        assert code == 2, args
        err = capsys.readouterr().err.strip()
        assert named in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("run_it*"))


def test_help_lists_class2d_options_and_not_3d_ones(capsys):
    assert run_cli("class2d", "--help") == 0
    text = capsys.readouterr().out
    for name in ("--psi_step", "--center_classes", "--K", "--skip_align", "--fast_subsets", "--tau2_fudge"):
        assert name in text
    for name in ("--ref", "--healpix_order", "--sym", "--firstiter_cc", "--solvent_mask", "--auto_local_healpix_order"):
        assert f"{name} " not in text and f"{name}\n" not in text


def test_fast_subsets_in_2d_start_from_100_particles_per_class():
    """RELION's updateSubsetSize with ref_dim 2: 100·K in iterations 1-5, 300·K in 6-10, that or 30 % in 11-15."""
    from cryorefine.em.schedule import FAST_SUBSET_PARTICLES_PER_CLASS_2D, fast_subset_size

    sizes = [fast_subset_size(it, 3, 2000, FAST_SUBSET_PARTICLES_PER_CLASS_2D) for it in (1, 5, 6, 10, 11, 15, 16)]
    assert sizes == [300, 300, 900, 900, 900, 900, None]
    assert fast_subset_size(11, 3, 4000, FAST_SUBSET_PARTICLES_PER_CLASS_2D) == 1200
    assert fast_subset_size(1, 3, 250, FAST_SUBSET_PARTICLES_PER_CLASS_2D) is None  # not smaller than the set


def test_centring_moves_the_centre_of_mass_to_the_centre_within_the_offset_range():
    from cryorefine.jobs.class2d import centre_of_mass_px, centred_image

    n = 32
    y, x = np.mgrid[:n, :n] - n // 2
    blob = np.exp(-((x - 3) ** 2 + (y + 2) ** 2) / 6.0) - 0.05  # negative values do not count (RELION's rule)
    assert np.allclose(centre_of_mass_px(blob), [3.0, -2.0], atol=0.05)
    assert np.allclose(centre_of_mass_px(centred_image(blob, 10.0)), [0.0, 0.0], atol=0.1)
    limited = centre_of_mass_px(centred_image(blob, 1.0))  # moved 1 px towards the centre, no more
    assert np.hypot(*([3.0, -2.0] - limited)) == pytest.approx(1.0, abs=0.1)


def test_under_grad_a_move_cut_to_an_offset_range_equal_to_the_least_move_always_centres():
    """RELION's rule at a 2 px offset range: the centre of mass 3 px away, in 72 directions, is moved 2 px each time;
    the cut vector's length is 2 ± rounding, which alone decided before (some directions were left uncentred, and
    a GPU run under mpiexec, its sums rounded otherwise, and the CPU run differed in whether a class moved). Nearer
    than the least move, nothing moves."""
    from cryorefine.jobs.class2d import centre_of_mass_px, grad_centring_shift_px

    n = 32
    y, x = np.mgrid[:n, :n] - n // 2
    for angle in np.linspace(0.0, 2.0 * np.pi, 72, endpoint=False):
        blob = np.exp(-((x - 3.0 * np.cos(angle)) ** 2 + (y - 3.0 * np.sin(angle)) ** 2) / 4.0)
        assert np.hypot(*centre_of_mass_px(blob)) > 2.5
        shift = grad_centring_shift_px(blob, 2.0, 2.0)
        assert shift is not None, angle
        assert np.hypot(*shift) == pytest.approx(2.0, abs=1e-9)
    near = np.exp(-((x - 1.0) ** 2 + y ** 2) / 4.0)
    assert grad_centring_shift_px(near, 2.0, 2.0) is None


def test_a_relion_continue_line_of_a_2d_run_continues_it_as_class2d(three_views):
    """RELION's optimiser.star does not say a run was 2D; the run's saved state does (rlnDoCenterClasses says what
    the run did)."""
    from cryorefine.cli import relion_refine_command

    folder, _, _ = three_views
    optimiser = folder / "out" / "run_it008_optimiser.star"
    assert relion_refine_command(["--continue", str(optimiser), "--o", "x/run"]) == "class2d"
    general = starfile.read(optimiser)
    assert int(general["rlnDoCenterClasses"]) == 1 and int(general["rlnDoAutoRefine"]) == 0

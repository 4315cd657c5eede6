"""`cryorefine class2d --grad` (RELION 4/5's VDAM 2D classification) on a simulated set of three 2D views
(tests/jobs/class2d_data.py, normalised as extracted particles are), numpy engine: the classes against the true views,
RELION's files where RELION writes them, --continue from a mini-batch iteration giving the uninterrupted run's result,
and mpiexec -n 3 giving the serial run's classes."""

import os
import subprocess
import sys

import numpy as np
import pytest
import starfile
from class2d_data import best_rotated_correlation, make_views_set, true_views
from conftest import assert_m_step_parts_within_the_m_step, run_cli
from conftest import mpiexec_or_skip as mpiexec
from test_class2d import FAST, assert_gpu_run_matches_the_cpu, matched_agreement, run_under_mpiexec

from cryorefine.io.mrc import read_stack

#: the set's pixel size: RELION's 2D offset prior counts the sampling's translations in Å (`jobs.class2d`), so at the
#: EM tests' 12 Å/px a particle moves by less than a coarse step an iteration (at 12 Å/px this run had about half the
#: particles in their view's class after 10 iterations, 59 % after 24; at 3 Å/px 99 % from iteration 6)
VDAM_PIXEL_ANGSTROM = 3.0
#: FAST with the particle's diameter at that pixel size (320 Å at 12 Å/px)
VDAM_FAST = (*FAST[:-3], "--particle_diameter", 80, "--cpu")
#: RELION's GUI VDAM options (--iter and --grad_write_iter made small for a test), but for the engine
VDAM_RUN = ("--grad", "--class_inactivity_threshold", 0.1, "--K", 3, "--tau2_fudge", 2, "--ctf", "--flatten_solvent",
            "--zero_mask", "--center_classes", "--norm", "--scale", *VDAM_FAST[:-1])
VDAM = (*VDAM_RUN, *VDAM_FAST[-1:])


@pytest.fixture(scope="module")
def vdam_run(tmp_path_factory):
    """100 particles of each view (SNR 1, CTFs) at 3 Å/px, 10 iterations with files every 2nd: mini-batches of 200
    (RELION's smallest) in iterations 1-3, then all 300 (about 6 s on two cores)."""
    folder = tmp_path_factory.mktemp("class2d_vdam")
    star, truth = make_views_set(folder, 100, snr=1.0, seed=3, normalised=True, pixel_angstrom=VDAM_PIXEL_ANGSTROM)
    assert run_cli("class2d", "--i", star, "--o", folder / "out" / "run", "--iter", 10, "--grad_write_iter", 2,
                   *VDAM) == 0
    return folder, star, truth


def test_vdam_puts_the_particles_in_the_classes_of_their_views(vdam_run):
    """Chance is 1/3 (measured at 3 Å/px: 99.7 % of the particles in their view's class at iteration 6, 99.3 % at
    10, where each average correlates 0.97 with its view at the best in-plane angle)."""
    folder, _, truth = vdam_run
    found = starfile.read(folder / "out" / "run_it010_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
    assert matched_agreement(truth, found, 3) >= 0.9
    averages = read_stack(folder / "out" / "run_it010_classes.mrcs")
    views = true_views()
    for k in range(3):
        view = np.bincount(truth[found == k], minlength=3).argmax()
        assert best_rotated_correlation(averages[k], views[view], 6.0) >= 0.9


def test_vdam_writes_relions_files_where_relion_writes_them(vdam_run):
    """Every --grad_write_iter iterations, at the last and where the batch holds every particle (from iteration 4:
    200 + round(1/5 · 800) ≥ 300); the momenta as RELION writes them in 2D."""
    folder, _, _ = vdam_run
    out = folder / "out"
    for it in (2, 4, 5, 6, 7, 8, 9, 10):
        for suffix in ("data.star", "classes.mrcs", "model.star", "optimiser.star", "1moment.mrcs", "2moment.mrcs"):
            assert (out / f"run_it{it:03d}_{suffix}").is_file(), (it, suffix)
    for it in (1, 3):
        assert not list(out.glob(f"run_it{it:03d}_*")), it  # nothing, not even what --continue would read
    assert sorted(p.name for p in out.glob("run_it*_resume.npz")) == [  # beside every optimiser.star
        f"run_it{it:03d}_resume.npz" for it in (0, 2, 4, 5, 6, 7, 8, 9, 10)]
    # two pseudo-half sets' first moments of 3 classes, one second moment each; 32 px padded twice: 64 × 2·33
    assert read_stack(out / "run_it010_1moment.mrcs").shape == (6, 64, 66)
    assert read_stack(out / "run_it010_2moment.mrcs").shape == (3, 64, 66)
    classes = starfile.read(out / "run_it010_model.star")["model_classes"]
    assert list(classes["rlnGradMoment1"]) == [f"{k:06d}@{out}/run_it010_1moment.mrcs" for k in (1, 2, 3)]
    general = starfile.read(out / "run_it002_optimiser.star", always_dict=True)["optimiser_general"]
    assert int(general["rlnSgdSubsetSize"]) == 200 and float(general["rlnSgdClassInactivityThreshold"]) == 0.1
    assert float(general["rlnGradCurrentStepsize"]) == pytest.approx(0.9, abs=0.01)
    assert int(starfile.read(out / "run_it010_optimiser.star", always_dict=True)["optimiser_general"]
               ["rlnSgdSubsetSize"]) == -1


def test_continue_from_a_mini_batch_iteration_gives_the_uninterrupted_runs_result(vdam_run, tmp_path):
    """From iteration 2 (its momenta and averaged parameters from mini-batches of 200): iteration 10 is the same,
    bit for bit."""
    folder, _, _ = vdam_run
    assert run_cli("class2d", "--continue", folder / "out" / "run_it002_optimiser.star", "--o", tmp_path / "run",
                   "--iter", 10) == 0
    again = starfile.read(tmp_path / "run_it010_data.star")["particles"]
    first = starfile.read(folder / "out" / "run_it010_data.star")["particles"]
    for column in ("rlnClassNumber", "rlnAnglePsi", "rlnOriginXAngst", "rlnNormCorrection"):
        assert np.array_equal(again[column], first[column]), column
    for suffix in ("classes.mrcs", "1moment.mrcs", "2moment.mrcs"):
        assert np.array_equal(read_stack(tmp_path / f"run_it010_{suffix}"),
                              read_stack(folder / "out" / f"run_it010_{suffix}")), suffix


def test_each_iteration_logs_the_parts_of_its_m_step_em_and_vdam(vdam_run, tmp_path, caplog):
    """The class averages' steps (VDAM) or reconstructions (EM), their centring and masks, the maps shared and the
    other parameters, each iteration, within its M-step's seconds."""
    _, star, _ = vdam_run
    common = ("--i", star, "--iter", 2, "--grad_write_iter", 1, "--K", 3, "--tau2_fudge", 2, "--ctf",
              "--flatten_solvent", "--zero_mask", "--center_classes", *VDAM_FAST)
    for extra, names in (((), {"sums to the device", "τ² of the references", "reconstructions", "centring and masks",
                               "maps shared among the workers", "other parameters"}),
                         (("--grad",), {"class steps", "maps shared among the workers", "centring and masks",
                                        "other parameters"})):
        caplog.clear()
        with caplog.at_level("INFO", logger="cryorefine"):
            assert run_cli("class2d", *common, *extra, "--o", tmp_path / "+".join(extra) / "run") == 0
        assert_m_step_parts_within_the_m_step("\n".join(r.getMessage() for r in caplog.records), (1, 2), names)


def test_the_progress_of_an_iteration_counts_its_mini_batch(vdam_run, tmp_path, monkeypatch):
    """The progress bar's total is the particles the iteration takes (mini-batches of 200 of the 300 in iterations
    1-3), and each iteration's batches add up to it, so that its bar ends with the iteration."""
    from cryorefine import cli

    _, star, _ = vdam_run
    calls = []
    monkeypatch.setattr(cli, "_progress_bar", lambda stream=None: lambda done, total: calls.append((done, total)))
    assert run_cli("class2d", "--i", star, "--o", tmp_path / "run", "--iter", 10, "--grad_write_iter", 10, *VDAM) == 0
    iterations, seen = [], 0
    for done, total in calls:
        seen += done
        if seen == total:
            iterations.append(total)
            seen = 0
    assert iterations == [200, 200, 200] + [300] * 7 and seen == 0


def test_a_relion_continue_line_of_a_vdam_run_continues_it_as_class2d(vdam_run):
    from cryorefine.cli import relion_refine_command

    folder, _, _ = vdam_run
    assert relion_refine_command(["--continue", str(folder / "out" / "run_it010_optimiser.star")]) == "class2d"


def test_fast_subsets_are_refused_with_grad_in_one_line(vdam_run, tmp_path, capsys):
    _, star, _ = vdam_run
    assert run_cli("class2d", "--i", star, "--o", tmp_path / "run", "--iter", 2, "--fast_subsets", *VDAM) == 2
    err = capsys.readouterr().err.strip()
    assert "--fast_subsets" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.glob("run_it*"))


@pytest.mark.mpi
def test_vdam_under_mpiexec_gives_the_classes_of_one_process(vdam_run, tmp_path):
    """mpiexec -n 3 (a master, a worker per pseudo-half set, the classes' steps made by the first): 2 iterations of
    mini-batches, the same classes and averages as one process (float32 rounding), and iteration 0's files with
    run_it000_sampling.star. (EM under mpiexec -n 3, measured the same way: the same classes, averages within 5e-7 of
    one process's.)"""
    _, star, _ = vdam_run
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)
    runs = {}
    for ranks in (1, 3):
        command = [sys.executable, "-m", "cryorefine", "class2d", "--i", str(star), "--o", str(tmp_path / f"n{ranks}"
                   / "run"), "--iter", "2", "--grad_write_iter", "1", *map(str, VDAM)]
        if ranks > 1:
            command = [mpiexec(), "-n", str(ranks), *command]
        runs[ranks] = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
        assert runs[ranks].returncode == 0, runs[ranks].stderr[-2000:]
    assert runs[3].stderr.count("iteration 2:") == 1
    # iteration 0's files: relion_refine_mpi's have the sampling.star that relion_refine's lack
    it000 = {r: {p.name for p in (tmp_path / f"n{r}").glob("run_it000_*")} for r in (1, 3)}
    assert "run_it000_1moment.mrcs" in it000[1] and it000[3] == it000[1] | {"run_it000_sampling.star"}
    for it in (1, 2):
        a, b = (starfile.read(tmp_path / f"n{r}" / f"run_it{it:03d}_data.star")["particles"] for r in (3, 1))
        assert np.array_equal(a["rlnClassNumber"], b["rlnClassNumber"]), it
        got, want = (read_stack(tmp_path / f"n{r}" / f"run_it{it:03d}_classes.mrcs") for r in (3, 1))
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), it


@pytest.mark.gpu
def test_vdam_on_the_gpu_matches_the_cpu(vdam_run):
    """The VDAM run on one GPU (the GPU engine's 2D path for both pseudo-half sets, at most 5·K significant samples a
    particle) against the same run on the CPU (`vdam_run`): after iteration 2 (mini-batches) and 10 (every
    particle) the same class for ≥ 99 % of the particles, the same psi and origin for ≥ 90 %, each class average
    correlating ≥ 0.999 with the CPU's."""
    from conftest import cupy_or_skip

    cupy_or_skip()
    folder, star, _ = vdam_run
    assert run_cli("class2d", "--i", star, "--o", folder / "gpu" / "run", "--iter", 10, "--grad_write_iter", 2,
                   *VDAM_RUN, "--gpu", "0") == 0
    assert_gpu_run_matches_the_cpu(folder / "out", folder / "gpu", (2, 10), 3)


@pytest.mark.gpu
@pytest.mark.mpi
def test_vdam_on_the_gpu_under_mpiexec_matches_the_cpu(vdam_run, tmp_path):
    """mpiexec -n 3 with --gpu 0 (a worker per pseudo-half set on one GPU; the classes' steps made by the first, the
    second's sums sent to it) against one process on the CPU, 2 iterations of mini-batches."""
    from conftest import cupy_or_skip

    cupy_or_skip()
    _, star, _ = vdam_run
    common = ("class2d", "--i", star, "--iter", 2, "--grad_write_iter", 1, *VDAM_RUN)
    assert run_cli(*common, "--o", tmp_path / "cpu" / "run", "--cpu") == 0
    result = run_under_mpiexec(3, (*common, "--o", tmp_path / "gpu" / "run", "--gpu", "0"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_gpu_run_matches_the_cpu(tmp_path / "cpu", tmp_path / "gpu", (1, 2), 3)

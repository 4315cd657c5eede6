"""`mpiexec -n N cryorefine refine`: the same maps as one process, clean failures (CPU engine)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_m_step_parts_within_the_m_step
from conftest import mpiexec_or_skip as mpiexec

from cryorefine.cli import main
from cryorefine.core.fourier import downsample_volume
from cryorefine.core.fsc import fsc_volumes
from cryorefine.io.mrc import read_volume, write_volume

pytestmark = pytest.mark.mpi

EXAMPLE_MAP = Path(__file__).resolve().parents[2] / "examples" / "ribosome_64px.mrc"
REFINE_ARGS = ("--ini_high", "50", "--ctf", "--particle_diameter", "320", "--flatten_solvent", "--zero_mask",
               "--offset_range", "3", "--offset_step", "1", "--cpu")


def run(ranks, folder, out, *extra, env=None, timeout=600):
    command = [sys.executable, "-m", "cryorefine", "refine", "--i", str(folder / "sim" / "particles.star"),
               "--ref", str(folder / "truth.mrc"), "--o", str(folder / out / "run"), *REFINE_ARGS, *extra]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    environment = dict(os.environ, **(env or {}))
    environment.pop("PMI_SIZE", None)  # a test run under mpiexec itself must not pass it on
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mpi")
    write_volume(folder / "truth.mrc", downsample_volume(read_volume(EXAMPLE_MAP)[0], 32), 12.0)
    try:
        main(["simulate", "--ref", str(folder / "truth.mrc"), "--n", "200", "--snr", "0.5", "--seed", "4",
              "--o", str(folder / "sim")])
    except SystemExit as exc:
        assert exc.code == 0
    return folder


def test_maps_do_not_depend_on_the_number_of_ranks(data):
    # 5 ranks also with --preread_images: each worker reads its half set into memory once
    results = {ranks: run(ranks, data, f"n{ranks}", "--iter", "2", *(("--preread_images",) if ranks == 5 else ()))
               for ranks in (1, 3, 5)}
    for ranks, result in results.items():
        assert result.returncode == 0, (ranks, result.stderr[-2000:])
        # the noise pass's seconds, the workers' added up under MPI: one line, from the master alone
        told = re.findall(r"initial noise spectra(?:, the workers' seconds added)?: \d+\.\d s", result.stderr)
        assert len(told) == 1 and ("workers'" in told[0]) == (ranks > 1), (ranks, result.stderr[-2000:])
        # each worker's set-up, one line each, with its named stages (those of 5 ms or more)
        workers = sorted(int(w) for w in re.findall(r"^worker (\d+) on \S+ set up: \d+\.\d s \(particle table read ",
                                                     result.stderr, re.M))
        assert workers == list(range(1, ranks)), (ranks, result.stderr[-2000:])
    assert_same_refinement(data / "n1", [data / "n3", data / "n5"])


def assert_same_refinement(single_folder, other_folders):
    """Iteration 2's half maps agree with one process's (FSC ≥ 0.99 to the current resolution), and so do the poses
    and the random halves."""
    import starfile

    model = starfile.read(single_folder / "run_it002_half1_model.star")
    shell_limit = int(round(32 * 12.0 / float(model["model_general"]["rlnCurrentResolution"])))
    for half in (1, 2):
        single, _ = read_volume(single_folder / f"run_it002_half{half}_class001.mrc")
        for folder in other_folders:
            other, _ = read_volume(folder / f"run_it002_half{half}_class001.mrc")
            fsc = np.asarray(fsc_volumes(single, other))
            assert fsc[1:shell_limit + 1].min() >= 0.99, (folder, half, fsc)
    poses = starfile.read(single_folder / "run_it002_data.star")["particles"]
    for folder in other_folders:
        other = starfile.read(folder / "run_it002_data.star")["particles"]
        np.testing.assert_allclose(other["rlnAngleRot"], poses["rlnAngleRot"], atol=1e-6)
        np.testing.assert_array_equal(other["rlnRandomSubset"], poses["rlnRandomSubset"])


def test_workers_on_two_hosts_copy_the_stacks_once_per_host_and_refine_as_one_process(data, tmp_path):
    """--scratch_dir and --preread_images on a cluster: two workers told they are on one host, then on two (each
    the first of its own). The stacks are copied once per host, under --scratch_dir, and each worker reads from
    its host's copy; the copies are gone at the end; the maps and poses are one process's."""
    single = run(1, data, "hosts_single", "--iter", "2")
    assert single.returncode == 0, single.stderr[-2000:]
    script = Path(__file__).with_name("hosts_script.py")
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)
    originals = {Path(line.split("@", 1)[1]).name for line in
                 (data / "sim" / "particles.star").read_text().split() if "@" in line}
    for hosts in (1, 2):
        seen, scratch = tmp_path / f"seen{hosts}", tmp_path / f"scratch{hosts}"
        seen.mkdir()
        command = [mpiexec(), "-n", "3", sys.executable, str(script), str(hosts), str(seen),
                   "--i", str(data / "sim" / "particles.star"), "--ref", str(data / "truth.mrc"),
                   "--o", str(data / f"hosts{hosts}" / "run"), *REFINE_ARGS, "--iter", "2",
                   "--scratch_dir", str(scratch), "--preread_images"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
        assert result.returncode == 0, (hosts, result.stderr[-2000:])
        read_from = [Path(p) for rank in (1, 2) for p in (seen / f"rank{rank}.txt").read_text().split()]
        folders = {p.parent for p in read_from}
        assert len(folders) == hosts and all(f.parent == scratch for f in folders), (hosts, read_from)
        assert {p.name.split("_", 1)[1] for p in read_from} == originals
        assert list(scratch.iterdir()) == [], "the scratch copies were left behind"
        assert_same_refinement(data / "hosts_single", [data / f"hosts{hosts}"])


def test_the_final_iteration_joins_the_halves_as_one_process_does(data):
    """Convergence forced after iteration 1: in the final iteration the second half's sums cross to the worker
    that makes the joined map (each half's map is made by its own worker before): with 3 and 4 ranks the final
    maps are those of one process."""
    script = Path(__file__).with_name("final_iteration_script.py")
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)  # a test run under mpiexec itself must not pass it on
    for ranks in (1, 3, 4):
        command = [sys.executable, str(script), "--i", str(data / "sim" / "particles.star"), "--ref",
                   str(data / "truth.mrc"), "--o", str(data / f"final_n{ranks}" / "run"), *REFINE_ARGS, "--iter", "5"]
        done = subprocess.run([mpiexec(), "-n", str(ranks), *command] if ranks > 1 else command,
                              capture_output=True, text=True, timeout=600, env=environment)
        assert done.returncode == 0, (ranks, done.stderr[-2000:])
        assert not (data / f"final_n{ranks}" / "run_it003_data.star").exists()  # iteration 2 was the final one
    single = {name: read_volume(data / "final_n1" / name)[0]
              for name in ("run_class001.mrc", "run_half1_class001_unfil.mrc", "run_half2_class001_unfil.mrc")}
    for ranks in (3, 4):
        for name, want in single.items():
            got, _ = read_volume(data / f"final_n{ranks}" / name)
            fsc = np.asarray(fsc_volumes(want, got))
            assert fsc[1:12].min() >= 0.99, (ranks, name, fsc)
        assert not np.array_equal(read_volume(data / f"final_n{ranks}" / "run_half1_class001_unfil.mrc")[0],
                                  read_volume(data / f"final_n{ranks}" / "run_half2_class001_unfil.mrc")[0])


def test_the_solvent_corrected_fsc_under_mpi_matches_one_process(data):
    """--solvent_correct_fsc: half 2's worker gives its unregularised map to half 1's, which computes the corrected
    FSC for both: with 3 ranks the half maps and the model's FSC curves are those of one process."""
    import starfile

    from cryorefine.core.masks import mask_from_map

    truth, _ = read_volume(data / "truth.mrc")
    write_volume(data / "mask.mrc", mask_from_map(truth, 0.05 * truth.max(), 1.0, 3.0), 12.0)
    masked = ("--solvent_mask", str(data / "mask.mrc"), "--solvent_correct_fsc", "--iter", "2")
    for ranks in (1, 3):
        result = run(ranks, data, f"fsc_n{ranks}", *masked)
        assert result.returncode == 0, (ranks, result.stderr[-2000:])
    for half in (1, 2):
        name = f"run_it002_half{half}_class001.mrc"
        fsc = np.asarray(fsc_volumes(read_volume(data / "fsc_n1" / name)[0], read_volume(data / "fsc_n3" / name)[0]))
        assert fsc[1:12].min() >= 0.99, (half, fsc)
    curves = [starfile.read(data / f"fsc_n{r}" / "run_it002_half1_model.star")["model_class_1"] for r in (1, 3)]
    for column in ("rlnGoldStandardFsc", "rlnFourierShellCorrelationMaskedMaps"):
        assert curves[0][column].iloc[1:6].min() > 0.5, column  # a curve, not zeros
        np.testing.assert_allclose(curves[1][column], curves[0][column], atol=0.02)


def test_the_m_steps_maps_are_shared_out_over_the_workers():
    """Each half's map is made by a worker of its half, a classification's classes by its unit's workers in turn,
    and the final iteration's maps all by the worker of half 1, which then receives half 2's sums."""
    from cryorefine.runners.mpi import makers_of_parts

    halves, final = [[(0, 0)], [(1, 0)]], [[(0, 0), (1, 0)]]
    assert makers_of_parts(halves, 2, 2) == {(0, 0): 0, (1, 0): 1}
    assert makers_of_parts(halves, 4, 2) == {(0, 0): 0, (1, 0): 1}
    assert makers_of_parts(halves, 1, 2) == {(0, 0): 0, (1, 0): 0}
    assert makers_of_parts(final, 4, 2) == {(0, 0): 0, (1, 0): 0}
    classes = [[(0, k)] for k in range(5)]
    assert makers_of_parts(classes, 2, 1) == {(0, 0): 0, (0, 1): 1, (0, 2): 0, (0, 3): 1, (0, 4): 0}
    assert makers_of_parts(classes, 8, 1) == {(0, k): k for k in range(5)}
    seeds = [[(u, 0)] for u in range(5)]  # one unit per class, fewer workers than units
    assert makers_of_parts(seeds, 2, 5) == {(u, 0): u % 2 for u in range(5)}


def test_a_failing_worker_ends_the_job_within_seconds_with_one_message(data):
    mpiexec()
    tic = time.perf_counter()
    result = run(3, data, "fail1", "--iter", "3", env={"CRYOREFINE_FAULT": "2:1"}, timeout=120)
    seconds = time.perf_counter() - tic
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("cryorefine: error:")]
    assert len(lines) == 1 and "rank 2 on " in lines[0] and "injected fault at iteration 1" in lines[0], \
        result.stderr[-2000:]
    assert seconds < 30, seconds  # start-up, then the failure at the first batch ends every rank at once


def test_after_a_failure_the_last_completed_iteration_stays(data):
    result = run(3, data, "fail2", "--iter", "3", env={"CRYOREFINE_FAULT": "1:2"}, timeout=300)
    assert result.returncode != 0 and "rank 1 on " in result.stderr
    out = data / "fail2"
    assert (out / "run_it001_optimiser.star").is_file()  # what --continue needs
    assert not (out / "run_it002_optimiser.star").exists()
    assert not [p for p in out.iterdir() if ".tmp" in p.name]  # nothing half-written
    again = subprocess.run([sys.executable, "-m", "cryorefine", "refine", "--continue",
                            str(out / "run_it001_optimiser.star"), "--iter", "2"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (out / "run_ct1_it002_half1_class001.mrc").is_file()  # no --o: RELION's run_ct1


def test_two_ranks_are_refused(data):
    result = run(2, data, "two", "--iter", "1", timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("cryorefine: error:") == 1 and "at least 3 MPI ranks" in result.stderr


def test_mpi_is_recognised_from_the_launchers_environment(monkeypatch):
    from cryorefine.runners.mpi import half_of_rank, launched_with_mpi

    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_with_mpi()
    monkeypatch.setenv("SLURM_NTASKS", "8")  # a plain command inside a batch allocation is not an MPI run
    assert not launched_with_mpi()
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not launched_with_mpi()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "5")
    assert launched_with_mpi()
    assert [half_of_rank(r) for r in (1, 2, 3, 4)] == [0, 1, 0, 1]  # odd ranks half 1, even ranks half 2


# ---------------------------------------------------------------------------------------------- classify
def run_classify(ranks, folder, out, *extra, env=None, timeout=600, engine=("--cpu",)):
    from conftest import CLASSIFY_ARGS

    args = [str(a) for a in CLASSIFY_ARGS if a != "--cpu"] + list(engine)
    command = [sys.executable, "-m", "cryorefine", "classify", "--i", str(folder / "mix.star"),
               "--ref", str(folder / "avg.mrc"), "--o", str(folder / out / "run"), *args, *extra]
    if ranks > 1:
        command = [mpiexec(), "-n", str(ranks), *command]
    environment = dict(os.environ, **(env or {}))
    environment.pop("PMI_SIZE", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


def assert_same_classification(mixture, got, want, iteration, classes=(1, 2), tolerance=1e-5):
    """The runs in folders `got` and `want` of `mixture` gave every particle the same class at `iteration`, and
    class maps that differ by at most `tolerance` of the largest value of `want`'s (float32 rounding)."""
    import starfile

    name = f"run_it{iteration:03d}"
    a, b = (starfile.read(mixture / folder / f"{name}_data.star")["particles"] for folder in (got, want))
    np.testing.assert_array_equal(a["rlnClassNumber"], b["rlnClassNumber"])
    for k in classes:
        a, b = (read_volume(mixture / folder / f"{name}_class{k:03d}.mrc")[0] for folder in (got, want))
        assert np.abs(a - b).max() <= tolerance * np.abs(b).max(), k


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    from conftest import make_mixture

    folder = tmp_path_factory.mktemp("mpi_classify")
    make_mixture(folder, 30)
    return folder


def test_classify_under_mpi_writes_the_single_process_class_maps(mixture):
    """K = 2, 2 iterations (the seeding iteration, then both classes): 2, 3 and 5 ranks give the class maps of
    one process, byte for byte with one worker (2 ranks: it serves both seed units in turn, in the batches of one
    process), to float32 rounding with several (each takes its own share of the particles: other batches, sums
    added in another order); every iteration is run (and logged) once, and only the master writes files: those of
    one process, and run_it000_sampling.star, which relion_refine_mpi writes and relion_refine does not."""
    results = {ranks: run_classify(ranks, mixture, f"n{ranks}", "--iter", "2") for ranks in (1, 2, 3, 5)}
    for ranks, result in results.items():
        assert result.returncode == 0, (ranks, result.stderr[-2000:])
        for it in (1, 2):
            assert result.stderr.count(f"iteration {it}:") == 1, (ranks, result.stderr[-2000:])
        assert_m_step_parts_within_the_m_step(result.stderr, (1, 2), {"reconstructions", "other parameters"})
    single = sorted(p.name for p in (mixture / "n1").iterdir())
    for ranks in (2, 3, 5):
        assert sorted(p.name for p in (mixture / f"n{ranks}").iterdir()) == sorted([*single, "run_it000_sampling.star"])
        for it in (1, 2):
            for k in (1, 2):
                name = f"run_it{it:03d}_class{k:03d}.mrc"
                if ranks == 2:
                    assert (mixture / f"n{ranks}" / name).read_bytes() == (mixture / "n1" / name).read_bytes(), name
                else:
                    got, want = read_volume(mixture / f"n{ranks}" / name)[0], read_volume(mixture / "n1" / name)[0]
                    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (ranks, name)
        import starfile

        got = starfile.read(mixture / f"n{ranks}" / "run_it002_data.star")["particles"]
        want = starfile.read(mixture / "n1" / "run_it002_data.star")["particles"]
        np.testing.assert_array_equal(got["rlnClassNumber"], want["rlnClassNumber"])


def test_more_seed_units_than_workers_are_served_by_every_worker_as_one_process_classifies(mixture):
    """K = 3 on two workers: the seeding iteration's three units (one a class) are each served by both workers and
    added over both, each class's map made by its unit's holder; classes and maps are those of one process."""
    for ranks in (1, 3):
        result = run_classify(ranks, mixture, f"k3_n{ranks}", "--iter", "2", "--K", "3", "--batch", "4")
        assert result.returncode == 0, (ranks, result.stderr[-2000:])
    for it in (1, 2):
        assert_same_classification(mixture, "k3_n3", "k3_n1", it, classes=(1, 2, 3))


def test_a_bad_input_found_while_the_workers_add_up_the_noise_ends_every_rank_with_the_masters_line(mixture):
    """The workers begin the initial noise pass while the master makes the starting maps: a bad input found there
    ends the job with exit code 2 and the master's one line, once the workers' pass has ended (none left waiting)."""
    from conftest import CLASSIFY_ARGS

    script = Path(__file__).with_name("start_failure_script.py")
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)  # a test run under mpiexec itself must not pass it on
    command = [mpiexec(), "-n", "3", sys.executable, str(script), "--i", str(mixture / "mix.star"), "--ref",
               str(mixture / "avg.mrc"), "--o", str(mixture / "start_failure" / "run"),
               *(str(a) for a in CLASSIFY_ARGS), "--batch", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("the starting maps failed") == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_worker_failing_mid_classification_ends_the_job_with_one_line(mixture):
    # batches of 4 (15 an iteration), so that both workers get some of iteration 2's single work unit: with the
    # default batch the one batch goes to whichever worker asks first
    result = run_classify(3, mixture, "fail", "--iter", "3", "--batch", "4", env={"CRYOREFINE_FAULT": "2:2"},
                          timeout=300)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("cryorefine: error:")]
    assert len(lines) == 1 and "rank 2 on " in lines[0] and "injected fault at iteration 2" in lines[0], \
        result.stderr[-2000:]
    assert (mixture / "fail" / "run_it001_optimiser.star").is_file()
    assert not (mixture / "fail" / "run_it002_optimiser.star").exists()


def test_a_killed_worker_ends_the_job_and_continue_on_fewer_ranks_finishes_it(mixture):
    """A worker killed outright (SIGKILL) in iteration 3 of 4: the launcher ends the whole job within seconds; the
    last completed iteration's files stay, and --continue from them on one worker (mpiexec -n 2) ends with the
    classes and class maps of the run that was never interrupted (on two workers: to float32 rounding), having first
    written the files of the iteration it went on from under its root, the sampling.star with them."""

    tic = time.monotonic()
    killed = run_classify(3, mixture, "killed", "--iter", "4", "--batch", "4", env={"CRYOREFINE_FAULT": "2:3:kill"},
                          timeout=300)
    assert killed.returncode != 0
    folder = mixture / "killed"
    last = sorted(folder.glob("run_it00[0-9]_optimiser.star"))[-1]
    assert last.name in ("run_it001_optimiser.star", "run_it002_optimiser.star"), last
    assert not (folder / "run_it003_optimiser.star").exists()
    whole = run_classify(3, mixture, "whole", "--iter", "4", "--batch", "4")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert time.monotonic() - tic < 240  # the killed job did not hang until the test's time limit
    command = [sys.executable, "-m", "cryorefine", "classify", "--continue", str(last), "--o",
               str(mixture / "continued" / "run"), "--iter", "4"]
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)
    continued = subprocess.run([mpiexec(), "-n", "2", *command], capture_output=True, text=True, timeout=300,
                               env=environment)
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert_same_classification(mixture, "continued", "whole", 4, tolerance=1e-4)
    # the iteration it went on from, written again under its root with relion_refine_mpi's sampling.star
    start = last.name[: -len("_optimiser.star")]
    assert (mixture / "continued" / f"{start}_sampling.star").is_file()
    assert (mixture / "continued" / f"{start}_optimiser.star").is_file()


def test_workers_take_the_gpus_of_gpu_or_of_their_node_in_turn(monkeypatch):
    """--gpu 0:1 in rank order; --gpu alone or not given (RELION's automatic assignment): the local rank modulo the
    node's GPUs, so that 4 workers on a 4-GPU node take one each (before, all took device 0)."""
    from cryorefine.runners.mpi import LOCAL_RANK_VARIABLES, device_of_worker

    def never():
        raise AssertionError("the visible GPUs are only asked for without --gpu's devices")

    assert [device_of_worker(r, (0, 1), never) for r in (1, 2, 3, 4)] == [0, 1, 0, 1]
    assert [device_of_worker(r, (3,), never) for r in (1, 2)] == [3, 3]
    for name in LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert [device_of_worker(r, (), lambda: 4) for r in (1, 2, 3, 4)] == [1, 2, 3, 0]  # rank 0 is the master
    assert [device_of_worker(r, (), lambda: 2) for r in (1, 2)] == [1, 0]
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "6")  # the 7th rank of its node, of 8 GPUs
    assert device_of_worker(14, (), lambda: 8) == 6


def test_work_units_are_shared_out_over_the_workers():
    from cryorefine.runners.mpi import holder_of_unit, makers_of_parts, units_of_worker, workers_of_unit

    assert [units_of_worker(w, 4, 2) for w in range(4)] == [[0], [1], [0], [1]]  # refine: halves alternate
    assert [units_of_worker(w, 3, 1) for w in range(3)] == [[0], [0], [0]]  # classify: every worker, one unit
    assert [units_of_worker(w, 2, 6) for w in range(2)] == [[0, 2, 4], [1, 3, 5]]  # seeds of 6 classes, 2 workers
    # seeds of 5 classes on 2 workers, 6 on 4: one unit each would leave some workers with more; every worker
    # serves every unit, and each unit's first worker (its holder, who makes its map) is another
    assert [units_of_worker(w, 2, 5) for w in range(2)] == [[0, 1, 2, 3, 4]] * 2
    assert [workers_of_unit(u, 4, 6) for u in range(6)] == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2],
                                                            [0, 1, 2, 3], [1, 2, 3, 0]]
    assert sorted(makers_of_parts([[(u, 0)] for u in range(6)], 4, 6).values()) == [0, 0, 1, 1, 2, 3]
    for n_workers, n_units in ((4, 2), (3, 1), (2, 5), (1, 3), (4, 6), (2, 6)):
        served = [u for w in range(n_workers) for u in units_of_worker(w, n_workers, n_units)]
        assert sorted(set(served)) == list(range(n_units))  # every unit served
        assert len({len(units_of_worker(w, n_workers, n_units)) for w in range(n_workers)}) == 1  # equal loads
        for u in range(n_units):
            assert workers_of_unit(u, n_workers, n_units)[0] == holder_of_unit(u, n_workers)
            assert u in units_of_worker(holder_of_unit(u, n_workers), n_workers, n_units)


def test_each_worker_is_handed_its_own_share_first_and_then_helps_the_others():
    """A unit's particles in contiguous shares, one per worker (what --preread_images holds on each): a worker gets
    its own share's batches in the unit's order, then the last batches of the share with most left; every batch
    is handed out once."""
    from cryorefine.runners.mpi import batch_queues, next_batch, shares_of_unit

    members = np.random.default_rng(3).permutation(np.arange(0, 200, 2))  # a half set, in direction order
    shares = shares_of_unit(members, 3)
    assert [s.size for s in shares] == [34, 33, 33] and np.array_equal(np.concatenate(shares), np.sort(members))
    class Particles:  # batches as ParticleSet.batches cuts them: runs of the indices given, each ascending
        def batches(self, size, indices):
            return (np.sort(indices[i:i + size]) for i in range(0, len(indices), size))

    queues = batch_queues(Particles(), members, 3, 8)
    handed = {0: [], 1: [], 2: []}
    for worker in [0] * 7 + [1, 2] * 3:  # worker 0 first takes all its own 5 batches, then helps
        handed[worker].append(next_batch(queues, worker))
    assert all(np.isin(b, shares[0]).all() for b in handed[0][:5])
    assert all(np.isin(b, shares[1]).all() or np.isin(b, shares[2]).all() for b in handed[0][5:])
    for worker in (1, 2):
        assert all(np.isin(b, shares[worker]).all() for b in handed[worker])
    while (batch := next_batch(queues, 1)) is not None:
        handed[1].append(batch)
    assert next_batch(queues, 0) is None and next_batch(queues, 2) is None
    every = np.concatenate([b for batches in handed.values() for b in batches])
    assert np.array_equal(np.sort(every), np.sort(members))


def test_relion_s_gui_flags_under_mpi_give_the_classes_of_a_run_without_them(mixture):
    """RELION's GUI line for Class3D under mpirun: --j 1 --pool 3 --preread_images --dont_combine_weights_via_disc
    change nothing in the result (the classes and the maps, to float rounding) against the same run without them;
    --pool is written where RELION writes it and is not the batch."""
    import starfile

    flags = ("--j", "1", "--pool", "3", "--preread_images", "--dont_combine_weights_via_disc")
    results = {name: run_classify(3, mixture, f"gui_{name}", "--iter", "2", *extra)
               for name, extra in (("plain", ()), ("relion", flags))}
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-2000:])
    assert_same_classification(mixture, "gui_relion", "gui_plain", 2)
    optimiser = starfile.read(mixture / "gui_relion" / "run_it002_optimiser.star")
    assert int(optimiser["rlnMaxNumberOfPooledParticles"]) == 3
    assert "preread" in results["relion"].stderr  # the E-step's stage of reading the shares in


def test_a_rank_bound_to_one_cpu_says_so_and_how_to_launch_it_unbound():
    """One CPU of several (Open MPI binds each rank to a core when it starts two or fewer) draws one line naming
    the rank, the host, the CPU and the launcher options that give it more; two CPUs, or a machine of one, none."""
    from cryorefine.runners.mpi import narrow_binding_warning

    line = narrow_binding_warning(2, "node7", {5}, 32)
    assert "rank 2 on node7" in line and "CPU 5 only" in line and "1 of 32" in line
    assert "--bind-to none" in line and "--cpus-per-task" in line and "\n" not in line
    assert narrow_binding_warning(2, "node7", {4, 5}, 32) is None
    assert narrow_binding_warning(1, "laptop", {0}, 1) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs 2 CPUs and Linux")
def test_ranks_started_on_one_cpu_warn_and_still_classify(mixture):
    """mpiexec and its ranks confined to one CPU (as a launcher's binding leaves them): every rank warns once, in
    one line, and the run still ends as it should."""
    from conftest import CLASSIFY_ARGS

    # a small Python sets its affinity to one CPU and becomes mpiexec (no preexec_fn: unsafe beside threads)
    on_one_cpu = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                  "os.execv(sys.argv[1], sys.argv[1:])")
    command = [sys.executable, "-c", on_one_cpu, mpiexec(), "-n", "3", sys.executable, "-m", "cryorefine", "classify",
               "--i", str(mixture / "mix.star"), "--ref", str(mixture / "avg.mrc"),
               "--o", str(mixture / "one_cpu" / "run"), "--iter", "1", *(str(a) for a in CLASSIFY_ARGS)]
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "the launcher bound it there" in line]
    assert sorted(re.search(r"rank (\d+) on", line).group(1) for line in lines) == ["0", "1", "2"], lines


@pytest.mark.gpu
def test_two_gpus_add_their_sums_on_the_devices_as_on_the_host(mixture):
    """Two workers on two GPUs of one host: the class volumes added up with NCCL on the devices give the class
    maps and classes of the host path's MPI reduction (CRYOREFINE_DEVICE_REDUCTION=0), to float32 rounding."""
    from conftest import cupy_or_skip

    from cryorefine.gpu.collectives import nccl_usable

    cp = cupy_or_skip()
    if cp.cuda.runtime.getDeviceCount() < 2 or not nccl_usable():
        pytest.skip("needs two GPUs and CuPy with NCCL")
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    results = {name: run_classify(3, mixture, f"gpus_{name}", "--iter", "3", "--batch", "4", engine=("--gpu", "0:1"),
                                  env={**root, "CRYOREFINE_DEVICE_REDUCTION": flag})
               for name, flag in (("device", "1"), ("host", "0"))}
    for name, result in results.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    assert_same_classification(mixture, "gpus_device", "gpus_host", 3, tolerance=1e-4)


def test_a_failing_worker_leaves_relions_failure_file(mixture):
    job = mixture / "pipeline_fail"
    job.mkdir()
    result = run_classify(3, mixture, "pipeline_fail", "--iter", "2", "--pipeline_control", str(job),
                          env={"CRYOREFINE_FAULT": "1:1"}, timeout=300)
    assert result.returncode != 0
    assert sorted(p.name for p in job.glob("RELION_JOB_*")) == ["RELION_JOB_EXIT_FAILURE"], result.stderr[-2000:]


def test_classify_under_mpi_reads_from_a_scratch_copy_and_removes_it(mixture):
    """The workers of a node copy the stacks once to --scratch_dir and read them there: the same class maps as one
    process reading the stacks where they are (to rounding); nothing left in the scratch folder."""
    scratch = mixture / "scratch"
    results = {r: run_classify(r, mixture, f"scratch_n{r}", "--iter", "2", *(("--scratch_dir", str(scratch)) if r > 1
                                                                             else ())) for r in (1, 3)}
    for r, result in results.items():
        assert result.returncode == 0, (r, result.stderr[-2000:])
    assert "copied to" in results[3].stderr
    for k in (1, 2):
        got, want = (read_volume(mixture / f"scratch_n{r}" / f"run_it002_class{k:03d}.mrc")[0] for r in (3, 1))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), k  # two workers: float32 rounding
    assert list(scratch.iterdir()) == []


def test_objects_with_arrays_cross_in_chunks_intact():
    """`runners.objects.ObjectChannel`, which carries plans, models and maps: send/recv and bcast of objects with
    arrays (contiguous ones as raw bytes in chunks, others in the pickle) arrive intact on every rank
    (objects_script.py checks them there)."""
    script = Path(__file__).with_name("objects_script.py")
    environment = dict(os.environ)
    environment.pop("PMI_SIZE", None)  # a test run under mpiexec itself must not pass it on
    done = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=environment)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.splitlines() == ["all ranks ok"], done.stdout + done.stderr[-2000:]


def test_an_interrupted_master_ends_the_job_with_the_continue_line_and_the_interrupt_s_exit_code(monkeypatch,
                                                                                                  capsys):
    """Ctrl-C or SIGTERM on the master (errors.RunInterrupted) under MPI: the line one process prints (the last
    complete iteration, the --continue line), no rank prefix, and the job aborted with 143 or 130, not a failure's 2;
    a worker's failure keeps its rank line and 2."""
    from cryorefine.errors import RunInterrupted
    from cryorefine.runners import mpi

    class Comm:
        aborted = []

        def Get_rank(self):
            return 1

        def Abort(self, code):
            self.aborted.append(code)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(mpi.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(mpi.os, "_exit", exit_now)
    line = "interrupted (SIGTERM); iteration 4 is the last complete one: resume with `cryorefine classify --continue x`"
    with pytest.raises(SystemExit) as stopped:
        mpi._abort(Comm(), RunInterrupted(line, 143))
    assert stopped.value.code == 143 and Comm.aborted == [143]
    assert capsys.readouterr().err == f"cryorefine: error: {line}\n"
    with pytest.raises(SystemExit) as stopped:
        mpi._abort(Comm(), RuntimeError("CUDA error"))
    assert stopped.value.code == 2 and Comm.aborted == [143, 2]
    assert re.fullmatch(r"cryorefine: error: rank 1 on \S+: RuntimeError: CUDA error\n", capsys.readouterr().err)

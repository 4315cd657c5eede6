"""benchmarks/empiar10028.py in its tiny numpy mode: the script runs, and its table and JSON add up.

No timing is asserted: the figures are only checked for consistency with each other.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import benchmark_modules

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "empiar10028.py"
EXAMPLE_MAP = Path(__file__).resolve().parents[1] / "examples" / "ribosome_64px.mrc"


@pytest.fixture
def empiar10028():
    """benchmarks/empiar10028.py, imported as the benchmark tests import the scripts (benchmarks/ on sys.path)."""
    with benchmark_modules("empiar10028") as (module,):
        yield module


@pytest.fixture
def refine_accuracy():
    """benchmarks/refine_accuracy.py, imported as the benchmark tests import the scripts (benchmarks/ on sys.path)."""
    with benchmark_modules("refine_accuracy") as (module,):
        yield module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("empiar10028")
    done = subprocess.run([sys.executable, str(SCRIPT), "--engine", "numpy", "--work", str(work), "--jobs",
                           "class3d", "refine", "initial_model", "class2d_vdam", "--json", str(work / "out.json")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return work, done.stdout, json.loads((work / "out.json").read_text())


def test_the_jobs_run_with_relion_settings_and_write_their_outputs(tiny_run):
    work, _, results = tiny_run
    class3d = results["jobs"]["class3d"]
    assert "--K 6" in class3d["command"] and "--tau2_fudge 4" in class3d["command"]
    assert [it["iteration"] for it in class3d["iterations"]] == [1, 2]
    for k in range(1, 7):
        assert (work / "class3d" / f"run_it002_class{k:03d}.mrc").is_file()
    refine = results["jobs"]["refine"]
    assert "--auto_local_healpix_order 4" in refine["command"]
    assert (work / "refine" / "run_it002_half1_class001.mrc").is_file()
    initial = results["jobs"]["initial_model"]  # RELION 5's InitialModel GUI line: VDAM, no reference
    assert "--grad --denovo_3dref" in initial["command"] and "--ref" not in initial["command"].split()
    assert (work / "initial_model" / "run_it002_class001.mrc").is_file()
    vdam = results["jobs"]["class2d_vdam"]  # RELION 5's Class2D GUI line as it comes: VDAM
    assert "--grad --class_inactivity_threshold 0.1" in vdam["command"] and "--K 100" in vdam["command"]
    assert (work / "class2d_vdam" / "run_it002_classes.mrcs").is_file()


def test_stage_table_accounts_for_the_measured_time(tiny_run):
    _, stdout, results = tiny_run
    for name, job in results["jobs"].items():
        iterations = job["iterations"]
        rows = {row["stage"]: row for row in job["summary"]["stages"]}
        e_step = sum(it["seconds"]["expectation"] for it in iterations)
        staged = sum(sum(it["stage_seconds"].values()) for it in iterations)
        assert 0 < staged <= e_step * 1.001
        assert rows["image preparation"]["seconds"] > 0
        assert rows["engine set-up (references, cached coarse slices)"]["seconds"] > 0
        assert all(it["stage_seconds"]["setup"] > 0 and "read_wait" in it["stage_seconds"] for it in iterations)
        loop = rows["whole iterations"]
        assert loop["seconds"] == pytest.approx(sum(sum(v for k, v in it["seconds"].items()
                                                        if k in ("plan", "expectation", "maximization", "write"))
                                                    for it in iterations))
        assert all(it["seconds"]["plan"] > 0 for it in iterations)
        assert loop["seconds"] <= job["wall_seconds"]
        # the time outside the iterations: the run's named stages and what none of them holds add up to it
        outside = job["summary"]["outside_iterations"]
        assert outside["initial noise spectra"] > 0 and outside["end: last files written"] > 0
        assert sum(outside.values()) == pytest.approx(job["wall_seconds"] - loop["seconds"])
        assert "outside the iterations (s): engine made" in stdout
        assert loop["particle_iterations_per_second"] == pytest.approx(
            results["n_particles"] * len(iterations) / loop["seconds"])
        assert f"### {name}" in stdout


def test_extrapolation_scales_the_measured_iterations_to_the_full_job(tiny_run, empiar10028):
    """Only in particles: the measured iterations scaled to the full count (and the start), never an iteration that
    was not measured stood in for by one that was: a run of fewer iterations than the job's gives no figure."""
    _, _, results = tiny_run
    n = results["n_particles"]
    scale = 105_247 / n

    def per_iteration(its):
        return [(it["seconds"]["plan"] + it["seconds"]["expectation"] + it["seconds"]["write"]) * scale
                + it["seconds"]["maximization"] for it in its]

    jobs = results["jobs"]
    assert [len(job["iterations"]) for job in jobs.values()] == [2, 2, 2, 2]  # the tiny run's --iterations 2: none
    assert all(job["summary"]["extrapolated_seconds"] is None for job in jobs.values())
    assert jobs["class3d"]["summary"]["extrapolation"] == "none: 2 of the job's 25 iterations measured"
    assert jobs["initial_model"]["summary"]["extrapolation"] == "none: 2 of the job's 200 iterations measured"
    assert jobs["refine"]["summary"]["extrapolation"] == ("none: the auto-refine was stopped after 2 iterations "
                                                          "(--iterations)")
    assert empiar10028.job_iterations("refine") is None and empiar10028.job_iterations("class2d") == 25
    # Class3D's iterations as if all 25 had run: every one of them scaled, and the start
    its = jobs["class3d"]["iterations"]
    whole = dict(jobs["class3d"], iterations=[dict(its[i % len(its)], iteration=i + 1) for i in range(25)])
    summary = empiar10028.summarise(whole, n, None, 25)
    assert summary["extrapolated_seconds"] == pytest.approx(
        summary["start_seconds"] * scale + sum(per_iteration(whole["iterations"])))
    # an auto-refine run to convergence: its iterations, however many, are the whole job
    refine = jobs["refine"]
    summary = empiar10028.summarise(refine, n, None, None)
    assert summary["extrapolated_seconds"] == pytest.approx(
        summary["start_seconds"] * scale + sum(per_iteration(refine["iterations"])))
    assert summary["extrapolation"] == f"105247 particles from {n} particles × 2 measured iterations"
    # a run on all the particles: its own wall time is the figure, nothing is called extrapolated
    summary = empiar10028.summarise(refine, 105_247, None, None)
    assert summary["extrapolated_seconds"] is None
    assert summary["extrapolation"] == "none: the whole job ran on all the particles"


def test_each_iteration_is_set_against_the_cheapest_local_search_iteration(tiny_run, empiar10028):
    """The 1.5× target's table: ratios to the cheapest local iteration, by HEALPix order and search, the last
    iteration apart; none without local searches (the tiny run's two iterations are global)."""
    _, _, results = tiny_run
    assert results["jobs"]["refine"]["summary"]["estep_relative_to_cheapest_local"] is None

    def it(number, order, local, seconds):
        return {"iteration": number, "healpix_order": order, "local_searches": local,
                "seconds": {"expectation": seconds}}

    its = [it(1, 2, False, 3.0), it(2, 3, False, 4.0), it(3, 4, True, 2.5), it(4, 4, True, 2.0), it(5, 5, True, 3.0),
           it(6, 5, True, 6.0)]
    rel = empiar10028.relative_to_cheapest_local(its)
    assert rel["cheapest_iteration"] == 4 and rel["cheapest_seconds"] == 2.0
    assert rel["worst_iteration"] == 6 and rel["worst_ratio"] == 3.0
    groups = {g["group"]: (g["iterations"], g["min"], g["max"]) for g in rel["groups"]}
    assert groups == {"order 2 global": ([1], 1.5, 1.5), "order 3 global": ([2], 2.0, 2.0),
                      "order 4 local": ([3, 4], 1.0, 1.25), "order 5 local": ([5], 1.5, 1.5), "last": ([6], 3.0, 3.0)}


@pytest.mark.mpi
def test_mpi_scaling_runs_one_process_and_a_master_with_two_workers(tmp_path):
    """benchmarks/mpi_scaling.py in its tiny numpy mode: one process and `mpiexec -n 3` on the same Class3D job, the
    MPI stages timed only under MPI, and the same classes and maps from both; with --kill, a worker killed at
    iteration 2 ends the job within seconds and --continue in one process gives the uninterrupted run's classes."""
    beside = Path(sys.executable).parent / "mpiexec"
    if not beside.exists():
        pytest.skip("no mpiexec beside Python (pip install mpich, part of the test extra)")
    script = SCRIPT.parent / "mpi_scaling.py"
    done = subprocess.run([sys.executable, str(script), "--engine", "numpy", "--work", str(tmp_path), "--json",
                           str(tmp_path / "out.json"), "--kill", "2"], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    one, two = results["jobs"]["class3d"]
    assert (one["workers"], two["workers"]) == (1, 2)
    assert "mpiexec -n 3" in two["command"] and "mpiexec" not in one["command"]
    assert [it["iteration"] for it in one["iterations"]] == [it["iteration"] for it in two["iterations"]] == [1, 2]
    for name in ("broadcast", "reduction", "M-step on the workers"):
        assert name in two["stage_totals"] and name not in one["stage_totals"]
    for it in two["iterations"]:  # the master's count of the batches a worker took over from another's share
        taken, handed = it["batches_taken_over_of_handed"]
        assert 0 <= taken <= handed and handed > 0
    assert all(it["batches_taken_over_of_handed"] is None for it in one["iterations"])
    assert two["e_step_seconds"] <= two["wall_seconds"]
    for run in (one, two):  # the untimed ends of the wall time, from the stderr lines' arrival
        parts = run["launch_and_exit_seconds"]
        assert 0.0 < parts["launch"] and 0.0 <= parts["exit"]
        assert parts["launch"] + run["run_start_end_seconds"]["start"] + run["run_start_end_seconds"]["end"] \
            + parts["exit"] <= run["outside_iterations_seconds"] + 0.2  # the log's rounding
    parity = two["parity"]
    assert parity["same_class_fraction"] == 1.0
    assert parity["class_distribution"][0] == parity["class_distribution"][1]
    assert min(parity["map_correlation"].values()) > 0.999999
    killed = results["killed_worker"]
    assert killed["killed"]["returncode"] != 0
    assert killed["killed"]["seconds_from_kill_to_exit"] < 60, killed["killed"]["stderr_tail"]
    assert killed["last_completed"] is not None
    continued = killed["continued_on_one_gpu"]["parity_with_whole"]
    assert continued["iteration_files"] == "run_it004"
    assert continued["same_class_fraction"] >= 0.99 and min(continued["map_correlation"].values()) > 0.9999


def test_refine_accuracy_pairs_particles_whatever_folder_their_stack_is_named_with(refine_accuracy, monkeypatch):
    import pandas as pd

    def table(names, rot, x):
        return {"particles": pd.DataFrame({"rlnImageName": names, "rlnAngleRot": rot, "rlnAngleTilt": [30.0, 30.0],
                                           "rlnAnglePsi": [0.0, 0.0], "rlnOriginXAngst": x,
                                           "rlnOriginYAngst": [0.0, 0.0]})}

    stars = {"truth": table(["1@particles.mrcs", "2@particles.mrcs"], [10.0, 20.0], [1.0, 2.0]),
             # refine names the stack it read by its path, and keeps its own order
             "found": table(["2@/tmp/work/sim/particles.mrcs", "1@/tmp/work/sim/particles.mrcs"], [20.0, 13.0],
                            [2.0, 4.0])}
    monkeypatch.setattr(refine_accuracy, "read_star", lambda path: stars[path])
    angle, shift, _, _ = refine_accuracy.pose_errors("truth", "found")
    np_angle = [float(a) for a in angle]
    assert np_angle[0] == pytest.approx(0.0, abs=1e-6) and np_angle[1] > 1.0  # particle 2 exact, particle 1 off
    assert list(shift) == pytest.approx([0.0, 3.0])


def test_refine_accuracy_finds_the_turn_of_the_map_s_frame_and_the_errors_left(refine_accuracy):
    """Poses that all carry one rotation of 0.5° (a refined map turned as a whole) and each its own error of 0.2°
    about a random axis, with 10 % of the particles in a wrong view: the frame's rotation is found, and the errors left
    in that frame are the particles' own."""
    from bench_common import small_turn

    from cryorefine.core import euler

    rng = np.random.default_rng(3)

    def turn(axes, degrees):
        """A turn by each of `degrees` about each of `axes`."""
        return np.stack([small_turn(d * axis / np.linalg.norm(axis)) for axis, d in zip(axes, degrees)])

    n = 2000
    a = euler.euler_to_matrix(rng.uniform(-180, 180, n), rng.uniform(0, 180, n), rng.uniform(-180, 180, n))
    frame = turn(np.array([[1.0, 2.0, 0.5]]), [0.5])[0]
    own = turn(rng.normal(size=(n, 3)), np.full(n, 0.2))
    b = own @ a @ frame
    wrong = rng.random(n) < 0.1
    b[wrong] = turn(rng.normal(size=(wrong.sum(), 3)), rng.uniform(30, 180, wrong.sum())) @ b[wrong]
    g = refine_accuracy.frame_rotation(a, b)
    assert refine_accuracy.rotation_angles_deg(g[None], frame[None])[0] < 0.05  # a tenth of the turn
    left = refine_accuracy.rotation_angles_deg(a @ g, b)
    assert np.median(left[~wrong]) == pytest.approx(0.2, abs=0.01)
    assert np.median(refine_accuracy.rotation_angles_deg(a, b)[~wrong]) > 0.45  # the frame's turn before the fit


def test_refine_accuracy_gives_relion_the_command_line_cryorefine_gets(refine_accuracy, tmp_path):
    """Both programs: the files, --ctf, the mask, --ini_high, RELION 5 GUI's Refine3D options, the seed and the options
    after `--`, in that order; RELION's run under its launcher with its own options last."""
    relion = tmp_path / "relion_refine_mpi"
    relion.write_text("")
    args, extra = refine_accuracy.parse_args(["--work", str(tmp_path), "--seeds", "2", "3", "--relion", str(relion),
                                              "--relion_extra", "--j 6 --pool 10", "--", "--gpu", "0"])
    setup = {"particle_diameter_angstrom": 280.0, "ini_lowpass_angstrom": 40.0}
    folder = refine_accuracy.run_folder(tmp_path, "relion", 2)
    assert folder == tmp_path / "relion_seed2"
    assert refine_accuracy.run_folder(tmp_path, "cryorefine", None) == tmp_path / "refine"
    options = [str(o) for o in refine_accuracy.refine_options(args, extra, tmp_path, setup, folder, 2)]
    assert options[:13] == ["--i", str(tmp_path / "sim" / "particles_unaligned.star"), "--ref",
                            str(tmp_path / "reference.mrc"), "--o", str(folder / "run"), "--ctf",
                            "--particle_diameter", "280.0", "--ini_high", "40.0", "--auto_refine",
                            "--split_random_halves"]
    assert options[-4:] == ["--random_seed", "2", "--gpu", "0"]
    assert " --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5 --offset_step 2 " in " ".join(options)
    command = refine_accuracy.relion_command(args, options)
    assert command == ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "3", str(relion.resolve()), *options,
                       "--j", "6", "--pool", "10"]


def test_refine_accuracy_reads_the_seconds_between_iterations_from_the_log(refine_accuracy, tmp_path):
    """The lines of a refine log (as em.loop writes them): each iteration's E and M seconds, its E-step stages, and the
    plan's and outputs' seconds that follow it, kept with their iteration."""
    log = tmp_path / "run.log"
    log.write_text(
        "12:00:01 INFO iteration 1: resolution 18.5 Å, order 2, E 0.9 s, M 0.1 s\n"
        "12:00:01 INFO   E-step stages (s): setup 0.3, coarse 0.2\n"
        "12:00:01 INFO   between iterations (s): plan 1.4, outputs 0.2 (of which waiting for the previous "
        "iteration's files 0.0; those took 0.0 on the writer, 0.0 more waiting for their maps)\n"
        "12:00:03 INFO iteration 2: resolution 15.8 Å, order 2, E 0.3 s, M 0.0 s\n"
        "12:00:03 INFO   between iterations (s): plan 1.9, outputs 0.3 (of which waiting 0.1)\n")
    rows = refine_accuracy.log_timings(log)
    assert rows[1] == {"expectation_s": 0.9, "maximisation_s": 0.1, "plan_s": 1.4, "outputs_s": 0.2,
                       "expectation_stages_s": {"setup": 0.3, "coarse": 0.2}}
    assert (rows[2]["plan_s"], rows[2]["outputs_s"], rows[2]["expectation_s"]) == (1.9, 0.3, 0.3)


def test_refine_accuracy_runs_relion_for_the_seeds_asked_only(refine_accuracy, tmp_path, monkeypatch):
    """--relion_seeds: cryorefine for every seed, RELION for those named (its runs do not change with our code)."""
    relion = tmp_path / "relion_refine_mpi"
    relion.write_text("")
    ran = []

    def run_refine(args, extra, work, setup, program, seed):
        ran.append((program, seed))
        return tmp_path / f"{program}{seed}", tmp_path / "log", 0, 1.0, 0.0

    monkeypatch.setattr(refine_accuracy, "prepare", lambda args, work: {})
    monkeypatch.setattr(refine_accuracy, "run_refine", run_refine)
    monkeypatch.setattr(refine_accuracy, "measure", lambda *a: {"program": a[2], "seed": a[3]})
    monkeypatch.setattr(refine_accuracy, "markdown", lambda results: "")
    assert refine_accuracy.main(["--work", str(tmp_path), "--seeds", "1", "2", "3", "--relion", str(relion),
                                 "--relion_seeds", "3", "--keep_maps"]) == 0
    assert ran == [("cryorefine", 1), ("cryorefine", 2), ("cryorefine", 3), ("relion", 3)]


def test_relion_comparison_takes_the_iterations_both_wrote_files_of(empiar10028, monkeypatch, tmp_path):
    """A gradient job writes every 10th iteration's files: the rows' seconds are per iteration between files, and the
    ratio is over the iterations from the first both wrote to the last both wrote."""
    ours = {0: 0.0, 10: 5.0, 20: 12.0, 30: 20.0}
    monkeypatch.setattr(empiar10028, "iteration_file_times", lambda folder: ours)
    relion = {"seconds_from_launch": {"10": 100.0, "20": 250.0, "30": 420.0, "40": 600.0}}
    result = empiar10028.compare_with_relion("initial_model", tmp_path, relion)
    rows = {row["iteration"]: (row["cryorefine_seconds"], row["relion_seconds"]) for row in result["iterations"]}
    assert rows == {10: (0.5, 10.0), 20: (0.7, 15.0), 30: (0.8, 17.0), 40: (None, 18.0)}
    assert result["compared_iterations"] == [11, 30]
    assert (result["cryorefine_seconds"], result["relion_seconds"]) == (15.0, 320.0)
    assert result["ratio"] == pytest.approx(320.0 / 15.0)
    # an EM job's files at every iteration: iterations 2 to the last both finished, as before
    ours = {0: 0.0, 1: 4.0, 2: 5.0, 3: 6.0}
    monkeypatch.setattr(empiar10028, "iteration_file_times", lambda folder: ours)
    result = empiar10028.compare_with_relion("class3d", tmp_path, {"seconds_from_launch": {"1": 60.0, "2": 90.0}})
    assert result["compared_iterations"] == [2, 2] and result["ratio"] == pytest.approx(30.0)
    assert "first_iteration" not in result  # RELION's iteration-0 files unknown
    # RELION stopped during its iteration 2: no ratio over the later iterations, iteration 1 alone
    result = empiar10028.compare_with_relion("class2d", tmp_path, {"seconds_from_launch": {"0": 20.0, "1": 60.0}})
    assert "ratio" not in result
    first = result["first_iteration"]
    assert (first["cryorefine_seconds"], first["relion_seconds"]) == (4.0, 40.0) and first["ratio"] == pytest.approx(10)
    text = empiar10028.format_relion({"relion": {"class2d": {"command": "relion_refine_mpi", "returncode": "stopped",
                                                             "wall_seconds": 80.0, "comparison": result}}})
    assert "no ratio" in text and "iteration 1 alone" in text and "= 10.0×" in text


@pytest.mark.parametrize("script, args", [
    ("empiar10028", ["--engine", "numpy", "--jobs", "class3d"]),
    ("class2d_accuracy", ["--cpu"]),
    ("initial_model_accuracy", ["--cpu"]),
    ("classify_accuracy", ["--cpu"]),
    ("cpu_vs_relion", []),
])
def test_a_relion_program_that_is_not_there_is_refused_before_any_run(tmp_path, script, args):
    """--relion naming a program that is neither a file nor on PATH ends the script at once with exit code 2 and the
    program's name, before it makes a set or runs cryorefine (the work folder stays empty); the same through a
    launcher (`mpirun … relion_refine_mpi`). Before, the scripts ran their own jobs first and then failed to start
    RELION, losing the results (empiar10028.py) or recording an exit code."""
    missing = tmp_path / "nowhere" / "relion_refine_mpi"
    for relion in (str(missing), f"mpirun -n 3 {missing}"):
        work = tmp_path / "work"
        done = subprocess.run([sys.executable, str(SCRIPT.parent / f"{script}.py"), "--work", str(work), *args,
                               "--relion", relion], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert str(missing) in done.stderr and "no such program" in done.stderr
        assert not work.exists() or not any(work.iterdir())


def test_the_package_fingerprint_follows_the_code_that_runs(tmp_path):
    """bench_common.package_fingerprint: the same sources give the same SHA-256 wherever they are, a changed kernel
    or module another (mpi_scaling's --reuse takes an earlier run only with the same fingerprint)."""
    import shutil

    import cryorefine

    source = Path(cryorefine.__file__).resolve().parent
    fingerprint = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_common; "
                   "print(bench_common.package_fingerprint())")

    def of(folder):
        done = subprocess.run([sys.executable, "-c", fingerprint, str(SCRIPT.parent)], capture_output=True, text=True,
                              env={"PYTHONPATH": str(folder), "PATH": ""}, check=True)
        return done.stdout.strip()

    copy = tmp_path / "copy"
    shutil.copytree(source, copy / "cryorefine", ignore=shutil.ignore_patterns("__pycache__"))
    assert of(copy) == of(source.parent)
    kernel = copy / "cryorefine" / "estep" / "kernels" / "fine.cu"
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    assert of(copy) != of(source.parent)


def test_the_host_s_cpus_are_named_from_cpuinfo(tmp_path):
    """bench_common.host_cpus: the first model name of /proc/cpuinfo's format, and the CPUs this process may use
    (at least one); a file without one falls back to the platform's name, never an empty model."""
    with benchmark_modules("bench_common") as (bench_common,):
        host_cpus = bench_common.host_cpus
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n\n"
                    "processor\t: 1\nmodel name\t: Another CPU\n")
    host = host_cpus(info)
    assert host["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert host["cpus"] >= 1
    (tmp_path / "empty").write_text("processor\t: 0\n")
    assert host_cpus(tmp_path / "empty")["model"] and host_cpus(tmp_path / "missing")["model"]


def test_mpi_scaling_keeps_the_environment_a_reuse_must_match():
    """mpi_scaling.run_settings: MPI's parameters, cryorefine's own variables and the GPUs a run sees are kept (a
    --reuse under another OMPI_MCA_ value must run again), the rest of the environment is not."""
    with benchmark_modules("mpi_scaling") as (mpi_scaling,):
        kept = mpi_scaling.run_settings({"PATH": "/usr/bin", "HOME": "/root", "OMPI_MCA_mpi_yield_when_idle": "1",
                                         "CRYOREFINE_FAULT": "2:3", "CUDA_VISIBLE_DEVICES": "0,1",
                                         "OMPI_ALLOW_RUN_AS_ROOT": "1", "PYTHONUNBUFFERED": "1"})
    assert kept == {"CRYOREFINE_FAULT": "2:3", "CUDA_VISIBLE_DEVICES": "0,1", "OMPI_MCA_mpi_yield_when_idle": "1"}
    assert list(kept) == sorted(kept)


def test_main_thread_profile_counts_where_a_command_spends_its_time(tmp_path):
    """benchmarks/main_thread_profile.py around `cryorefine reconstruct` of simulated particles: the command's own
    output is written, and the report finds the command's entry and its job's function on the main thread's stack
    in nearly every sample."""
    from conftest import run_cli

    from cryorefine.core.fourier import downsample_volume
    from cryorefine.io.mrc import read_volume, write_volume

    write_volume(tmp_path / "truth.mrc", downsample_volume(read_volume(EXAMPLE_MAP)[0], 32), 12.0)
    assert run_cli("simulate", "--ref", tmp_path / "truth.mrc", "--n", 300, "--snr", 0.5, "--seed", 2,
                   "--o", tmp_path / "sim") == 0
    report = tmp_path / "profile.txt"
    result = subprocess.run([sys.executable, str(SCRIPT.parent / "main_thread_profile.py"), "--out", str(report), "--",
                             "reconstruct", "--i", str(tmp_path / "sim" / "particles.star"), "--o",
                             str(tmp_path / "map.mrc"), "--ctf", "--half_maps"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "map.mrc").exists()
    text = report.read_text()
    samples = int(re.match(r"wall [\d.]+ s, (\d+) samples", text).group(1))
    assert samples > 20
    inclusive = text.split("== cryorefine functions on the stack\n")[1].split("\n\n")[0]
    counts = {line.split(None, 3)[3]: int(line.split()[2]) for line in inclusive.splitlines()}
    assert counts["cli.py main"] >= 0.9 * samples
    assert counts["jobs/reconstruct.py reconstruct"] >= 0.9 * samples


def test_keep_maps_prunes_the_older_iterations_maps_off_the_jobs_thread(empiar10028, tmp_path):
    names = [f"run_it{i:03d}_class{k:03d}.mrc" for i in (1, 2, 3) for k in (1, 2)] + ["run_it001_data.star"]
    for name in names:
        (tmp_path / name).write_bytes(b"map")
    pruner = empiar10028.MapPruner(tmp_path, 2)
    for _ in range(5):  # after each batch, as a job calls its progress callback
        pruner(1, 10)
    (tmp_path / "run_it004_class001.mrc").write_bytes(b"map")  # written after the last batch
    pruner.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run_it001_data.star", "run_it003_class001.mrc", "run_it003_class002.mrc", "run_it004_class001.mrc"])

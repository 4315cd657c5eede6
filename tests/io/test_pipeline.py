"""RELION's pipeliner protocol (--pipeline_control) and the RELION options a GUI command line carries."""

import numpy as np
from conftest import make_particle_set, run_cli, write_mrc

from cryorefine.io import resume
from cryorefine.io.pipeline import ABORT_NOW, ABORTED, FAILURE, SUCCESS, PipelineControl


def small_set(folder):
    make_particle_set(folder, n=6, box=16, pixel_size=4.0, seed=5)
    write_mrc(folder / "ref.mrc", np.random.default_rng(6).normal(size=(16, 16, 16)).astype(np.float32),
              pixel_size=4.0, stack=False)
    return ["--i", folder / "particles.star", "--ref", folder / "ref.mrc", "--particle_diameter", 40, "--cpu"]


def exit_files(folder):
    return sorted(p.name for p in folder.glob("RELION_JOB_*"))


def test_a_finished_run_leaves_the_success_file_and_honours_pool(tmp_path):
    job = tmp_path / "Refine3D" / "job019"
    code = run_cli("refine", *small_set(tmp_path), "--o", job / "run", "--iter", 1, "--pool", 3, "--j", 1,
                   "--dont_check_norm", "--pipeline_control", job)
    assert code == 0
    assert exit_files(job) == [SUCCESS]
    saved = resume.load_config_values(job / "run_it001_optimiser.star")
    assert saved["pooled_particles"] == 3  # RELION's images per thread, written as RELION writes it
    assert saved["batch_size"] is None  # not the E-step's batch: that comes from the engine's own rule


def test_batch_sets_the_batches_and_pool_does_not(tmp_path):
    code = run_cli("classify", *small_set(tmp_path), "--o", tmp_path / "c" / "run", "--iter", 1, "--K", 1,
                   "--pool", 3, "--batch", 2)
    assert code == 0
    saved = resume.load_config_values(tmp_path / "c" / "run_it001_optimiser.star")
    assert (saved["batch_size"], saved["pooled_particles"]) == (2, 3)


def test_bad_input_leaves_the_failure_file(tmp_path):
    job = tmp_path / "Class3D" / "job020"
    job.mkdir(parents=True)
    code = run_cli("classify", *small_set(tmp_path), "--o", job / "run", "--K", 2, "--healpix_order", 99,
                   "--pipeline_control", job)
    assert code == 2
    assert exit_files(job) == [FAILURE]
    assert not list(job.glob("run_*"))


def test_abort_now_stops_the_run_before_its_next_iteration(tmp_path, capsys):
    """The job stops, says so (not that it had nothing to do), and exits with RELION's status for an abort."""
    job = tmp_path / "Refine3D" / "job021"
    job.mkdir(parents=True)
    (job / ABORT_NOW).touch()
    code = run_cli("refine", *small_set(tmp_path), "--o", job / "run", "--iter", 2, "--pipeline_control", job)
    assert code == 2
    assert exit_files(job) == [ABORTED]
    # no iteration ran: only the files RELION also writes before it checks for an abort (iteration 0's)
    assert not [p for p in job.glob("run_it*") if not p.name.startswith("run_it000_")]
    assert f"aborted: {ABORT_NOW}" in capsys.readouterr().out


def test_an_option_refused_before_the_job_starts_leaves_the_failure_file(tmp_path):
    """RELION's GUI waits for an exit file: an option the command does not know (here RELION 5's --blush) or a
    malformed value ends the job there too."""
    for extra in (("--blush",), ("--iter", "many")):
        job = tmp_path / "Refine3D" / f"job{len(extra)}"
        job.mkdir(parents=True)
        code = run_cli("refine", *small_set(tmp_path), "--o", job / "run", "--pipeline_control", job, *extra)
        assert code == 2
        assert exit_files(job) == [FAILURE], extra
        assert not list(job.glob("run_*"))


def test_a_new_end_replaces_the_exit_file_of_an_earlier_one(tmp_path):
    control = PipelineControl(tmp_path / "job")
    control.finished(FAILURE)
    control.finished(SUCCESS)
    assert exit_files(tmp_path / "job") == [SUCCESS]


def test_threads_must_be_at_least_one(tmp_path):
    assert run_cli("refine", *small_set(tmp_path), "--o", tmp_path / "run", "--j", 0) == 2


def test_a_job_folder_holding_an_earlier_run_is_refused_with_the_failure_file(tmp_path):
    """RELION's GUI runs a job again in its folder only with --continue: a new run there is refused, and the GUI
    still gets its exit file; the earlier run's files stay."""
    job = tmp_path / "Refine3D" / "job022"
    assert run_cli("refine", *small_set(tmp_path), "--o", job / "run", "--iter", 1) == 0
    before = {p.name: p.read_bytes() for p in job.glob("run_*")}
    code = run_cli("refine", *small_set(tmp_path), "--o", job / "run", "--iter", 1, "--pipeline_control", job)
    assert code == 2
    assert exit_files(job) == [FAILURE]
    assert {p.name: p.read_bytes() for p in job.glob("run_*")} == before

"""`cryorefine relion_refine ARGS…`: a relion_refine / relion_refine_mpi command line run as it is, as the job RELION
would run from it, and the `relion_refine` / `relion_refine_mpi` scripts of `cryorefine install-relion-shims DIR`.

The tutorial's four lines (tests/jobs/test_relion_command_lines.py, on its project) go through the drop-in with only
that test's changes (--gpu -> --cpu, the scratch folder, --iter 1); the program's choice between refine and classify
is the drop-in's own, and the same files are checked.
"""

import os
import shlex
import subprocess
import sys

import pytest
import starfile
import test_relion_command_lines as tutorial
from conftest import mpiexec_or_skip, run_cli
from test_relion5_gui_lines import gui_project  # noqa: F401 (a fixture)
from test_relion_command_lines import REFINE3D_JOB019, project  # noqa: F401 (a fixture)

AS_CRYOREFINE = tutorial.as_cryorefine  # that test's rewriting (replaced by the drop-in's in a test below)
TUTORIAL_RUNS = next(mark for mark in tutorial.test_a_tutorial_command_line_runs_and_reports_success.pytestmark
                     if mark.name == "parametrize")


def as_relion_refine(line, scratch):
    """`cryorefine relion_refine` and the line's arguments, with the tutorial test's changes alone."""
    return ["relion_refine", *AS_CRYOREFINE(line, scratch)[1:]]


@pytest.mark.parametrize(*TUTORIAL_RUNS.args, **TUTORIAL_RUNS.kwargs)
def test_a_tutorial_line_runs_through_the_drop_in(project, monkeypatch, tmp_path, line, job, files):  # noqa: F811
    """The same run, exit files and outputs as `cryorefine refine` / `classify` give for the line."""
    from cryorefine.cli import relion_refine_command

    args = as_relion_refine(line, tmp_path / "scratch")
    assert args[1:] == AS_CRYOREFINE(line, tmp_path / "scratch")[1:]
    # --auto_refine lines are refine jobs, the others (with --ref) classify jobs: as RELION runs them
    assert relion_refine_command(args[1:]) == ("refine" if "--auto_refine" in line else "classify")
    monkeypatch.setattr(tutorial, "as_cryorefine", as_relion_refine)
    tutorial.test_a_tutorial_command_line_runs_and_reports_success(project, monkeypatch, tmp_path, line, job, files)


def test_the_job_is_chosen_as_relion_chooses_it(tmp_path):
    from cryorefine.cli import relion_refine_command

    line = ["--o", "a/run", "--auto_refine", "--split_random_halves", "--ref", "r.mrc"]
    assert relion_refine_command(line) == "refine"
    assert relion_refine_command(["--o", "a/run", "--ref=r.mrc", "--K", "4"]) == "classify"
    assert relion_refine_command(["--ref", "r.mrc"]) == "classify"  # RELION: a 3D classification of one class
    assert relion_refine_command([]) is None and relion_refine_command(["--help"]) is None
    # no --ref: RELION's 2D classification; --denovo_3dref: the initial model
    assert relion_refine_command(["--o", "Class2D/job008/run", "--i", "p.star", "--K", "50", "--tau2_fudge", "2"]) \
        == "class2d"
    assert relion_refine_command(["--o", "InitialModel/job015/run", "--grad", "--denovo_3dref", "--i", "p.star",
                                  "--K", "1"]) == "initial_model"
    # --continue: the job of the run continued, read from its optimiser.star as RELION reads it (the GUI's continue
    # lines of Refine3D carry no --auto_refine)
    for auto_refine, job in ((1, "refine"), (0, "classify")):
        optimiser = tmp_path / f"run{auto_refine}_it010_optimiser.star"
        starfile.write({"optimiser_general": {"rlnDoAutoRefine": auto_refine, "rlnRandomSeed": 3}}, optimiser)
        assert relion_refine_command(["--continue", str(optimiser), "--o", "x/run"]) == job
        assert relion_refine_command([f"--continue={optimiser}"]) == job
    # a file that cannot be read: the job the line names, which then says what is wrong with the file
    assert relion_refine_command(["--continue", str(tmp_path / "none.star"), "--auto_refine"]) == "refine"
    assert relion_refine_command(["--continue", str(tmp_path / "none.star")]) == "classify"


def test_an_initial_model_line_with_what_is_not_there_yet_is_refused_in_one_line(capsys, tmp_path):
    """RELION's InitialModel line (no --ref, --denovo_3dref) runs `cryorefine initial_model` (tests/jobs/
    test_initial_model.py); with an option that is not part of it (--fast_subsets, which RELION refuses with --grad):
    exit 2, one line, RELION_JOB_EXIT_FAILURE for the GUI, nothing written."""
    from conftest import make_particle_set
    from test_cli import assert_one_line_error, run

    folder = tmp_path / "InitialModel" / "job015"
    folder.mkdir(parents=True)
    star, _ = make_particle_set(tmp_path)
    line = (f"--o {folder}/run --iter 200 --grad --denovo_3dref --i {star} "
            f"--ctf --K 2 --sym C1 --flatten_solvent --zero_mask --dont_combine_weights_via_disc --pool 3 --pad 1 "
            f"--particle_diameter 200 --oversampling 1 --healpix_order 1 --offset_range 6 --offset_step 2 "
            f"--auto_sampling --tau2_fudge 4 --j 6 --fast_subsets --pipeline_control {folder}/")  # the GUI's --gpu ""
    code, _, err = run(capsys, "relion_refine", *shlex.split(line))  # left out: no CuPy here
    assert_one_line_error(code, err, "No such option: --fast_subsets", "`cryorefine initial_model` does not")
    assert (folder / "RELION_JOB_EXIT_FAILURE").is_file()
    assert not list(folder.glob("run_*"))


def test_options_mean_what_they_mean_to_the_job_run(capsys, tmp_path):
    """No option is taken or dropped on the way: refine's errors and hints, as `cryorefine refine` gives them."""
    from test_cli import assert_one_line_error, run

    code, _, err = run(capsys, "relion_refine", "--auto_refine", "--i", str(tmp_path / "p.star"), "--sigma_ang", "3")
    assert_one_line_error(code, err, "No such option: --sigma_ang", "`cryorefine classify` takes it",
                          "see `cryorefine refine --help`")
    # a classification line with refine's --split_random_halves: refused as `cryorefine classify` refuses it
    code, _, err = run(capsys, "relion_refine", "--ref", "r.mrc", "--split_random_halves")
    assert_one_line_error(code, err, "--split_random_halves: a classification has no half sets",
                          "see `cryorefine classify --help`")
    code, out, _ = run(capsys, "relion_refine", "--auto_refine", "--help")
    assert code == 0 and out.startswith("Usage: cryorefine refine")
    code, out, _ = run(capsys, "relion_refine", "--help")
    assert code == 0 and out.startswith("Usage: cryorefine relion_refine") and "install-relion-shims" in out


def shim_environment(folder):
    """The environment of a process (RELION's GUI) that has `folder` first on PATH, and no Python of its own."""
    environment = dict(os.environ, PATH=f"{folder}{os.pathsep}/usr/bin:/bin")
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PMI_SIZE"):
        environment.pop(name, None)
    return environment


def test_install_relion_shims_writes_scripts_that_run_the_drop_in(tmp_path):
    folder = tmp_path / "relion_bin"
    done = subprocess.run([sys.executable, "-m", "cryorefine", "install-relion-shims", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("relion_refine", "relion_refine_mpi"):
        shim = folder / name
        assert os.access(shim, os.X_OK), name
        assert str(shim) in done.stdout
        assert shlex.quote(sys.executable) in shim.read_text()  # the Python that installed them, with its packages
        # found on PATH, as RELION's GUI finds `which relion_refine_mpi`: it is cryorefine's relion_refine
        ran = subprocess.run([name, "--help"], capture_output=True, text=True, timeout=120,
                             env=shim_environment(folder), cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith("Usage: cryorefine relion_refine")
        ran = subprocess.run([name, "--o", "InitialModel/job015/run", "--denovo_3dref", "--K", "1",
                              "--pipeline_control", "InitialModel/job015/"],
                             capture_output=True, text=True, timeout=120, env=shim_environment(folder), cwd=tmp_path)
        # routed to initial_model, which refuses a line without --i
        assert ran.returncode == 2 and "Missing option '--i'" in ran.stderr and "initial_model" in ran.stderr
        assert (tmp_path / "InitialModel" / "job015" / "RELION_JOB_EXIT_FAILURE").is_file()
    # installed again over its own scripts: written again
    again = subprocess.run([sys.executable, "-m", "cryorefine", "install-relion-shims", str(folder)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr


def test_a_shim_runs_a_refine_job(project, tmp_path):  # noqa: F811
    """The relion_refine_mpi shim on the tutorial's Refine3D line (one process, as the GUI's "MPI procs" 1): a run."""
    assert run_cli("install-relion-shims", tmp_path / "bin") in (0, None)
    words = as_relion_refine(REFINE3D_JOB019.replace("Refine3D/job019/", "Refine3D/job119/"), tmp_path / "scratch")
    (project / "Refine3D" / "job119").mkdir()
    ran = subprocess.run(["relion_refine_mpi", *words[1:]], capture_output=True, text=True, timeout=600,
                         env=shim_environment(tmp_path / "bin"), cwd=project)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert (project / "Refine3D" / "job119" / "RELION_JOB_EXIT_SUCCESS").is_file()
    assert (project / "Refine3D" / "job119" / "run_it001_half2_model.star").is_file()


def test_existing_files_of_another_program_are_not_overwritten(capsys, tmp_path):
    """RELION's own relion_refine in DIR: refused in one line (exit 2), the file untouched, nothing written."""
    from test_cli import assert_one_line_error, run

    folder = tmp_path / "bin"
    folder.mkdir()
    relion = folder / "relion_refine_mpi"
    relion.write_bytes(b"\x7fELF RELION's own program")
    code, _, err = run(capsys, "install-relion-shims", str(folder))
    assert_one_line_error(code, err, str(relion), "not written by cryorefine install-relion-shims")
    assert relion.read_bytes() == b"\x7fELF RELION's own program"
    assert not (folder / "relion_refine").exists()
    # a link to RELION's program counts as that program
    relion.unlink()
    (tmp_path / "relion_refine").write_text("#!/bin/sh\necho RELION\n")
    (folder / "relion_refine").symlink_to(tmp_path / "relion_refine")
    code, _, err = run(capsys, "install-relion-shims", str(folder))
    assert_one_line_error(code, err, str(folder / "relion_refine"))
    assert (tmp_path / "relion_refine").read_text() == "#!/bin/sh\necho RELION\n"


@pytest.mark.mpi
def test_the_drop_in_under_mpirun(project, tmp_path):  # noqa: F811
    """`mpirun -n 3 relion_refine_mpi <the tutorial's Refine3D line>`, the shim: the runner `cryorefine refine` uses
    under MPI (a master and a worker per half set), the half maps written and RELION_JOB_EXIT_SUCCESS."""
    launcher = mpiexec_or_skip()
    assert run_cli("install-relion-shims", tmp_path / "bin") in (0, None)
    words = as_relion_refine(REFINE3D_JOB019.replace("Refine3D/job019/", "Refine3D/job219/"), tmp_path / "scratch")
    (project / "Refine3D" / "job219").mkdir()
    ran = subprocess.run([launcher, "-n", "3", "relion_refine_mpi", *words[1:]], capture_output=True, text=True,
                         timeout=600, env=shim_environment(tmp_path / "bin"), cwd=project)
    assert ran.returncode == 0, ran.stderr[-3000:]
    folder = project / "Refine3D" / "job219"
    assert (folder / "RELION_JOB_EXIT_SUCCESS").is_file()
    assert (folder / "run_it001_half1_class001.mrc").is_file() and (folder / "run_it001_half2_class001.mrc").is_file()
    assert "the workers' seconds added" in ran.stderr, ran.stderr[-3000:]  # the MPI runner's line, said once
    assert ran.stderr.count("iteration 1:") == 1


def test_a_continue_line_runs_the_job_it_continues(project, monkeypatch, tmp_path):  # noqa: F811
    """RELION 3.1's GUI continues a Class3D job with a line of neither --ref nor --K that names the new root itself
    (`--continue … --o …_ct1`; RELION 4 and 5 write the job's own `--o …/run` and relion_refine adds the `_ct1`:
    tests/jobs/test_relion5_gui_continue.py): the drop-in goes on with the classification, as RELION does, from its
    optimiser.star, under that root."""
    monkeypatch.chdir(project)
    line = tutorial.CLASS3D_JOB035.replace("Class3D/job035/", "Class3D/job335/")
    (project / "Class3D" / "job335").mkdir()
    assert run_cli(*as_relion_refine(line, tmp_path / "scratch")) == 0
    folder = project / "Class3D" / "job335"
    (folder / "RELION_JOB_EXIT_SUCCESS").unlink()
    continued = ("--continue Class3D/job335/run_it001_optimiser.star --o Class3D/job335/run_ct1 "
                 "--dont_combine_weights_via_disc --preread_images  --pool 30 --pad 2  --particle_diameter 200 "
                 "--j 12 --cpu --iter 2 --pipeline_control Class3D/job335/")
    assert run_cli("relion_refine", *shlex.split(continued)) == 0
    assert (folder / "RELION_JOB_EXIT_SUCCESS").is_file()
    assert (folder / "run_ct1_it002_class004.mrc").is_file() and (folder / "run_ct1_it002_model.star").is_file()


#: RELION 5's files of a one-iteration run of each GUI default line under relion_refine_mpi (besides
#: RELION_JOB_EXIT_SUCCESS): iteration 0's (MlOptimiserMpi::initialise: the sampling.star too, written by the workers)
#: and iteration 1's (MlOptimiser::write; Class3D --K 1), the run_itNNN_report.png and run_itNNN_resume.npz of
#: cryorefine's own beside them
RELION5_MPI_FILES = {
    "Refine3D": {f"run_it{i:03d}_{suffix}" for i in (0, 1) for suffix in (
        "data.star", "sampling.star", "optimiser.star", "half1_model.star", "half2_model.star",
        "half1_class001.mrc", "half2_class001.mrc", "half1_class001_angdist.bild", "half2_class001_angdist.bild")},
    "Class3D": {f"run_it{i:03d}_{suffix}" for i in (0, 1) for suffix in (
        "data.star", "sampling.star", "optimiser.star", "model.star", "class001.mrc", "class001_angdist.bild")},
}
CRYOREFINE_OWN = {"run_it000_resume.npz", "run_it001_resume.npz", "run_it001_report.png"}


@pytest.mark.mpi
@pytest.mark.parametrize("job", ["Refine3D", "Class3D"])
def test_relion5_gui_default_lines_through_the_mpi_shim(gui_project, tmp_path, job):  # noqa: F811
    """`mpiexec -n 3 relion_refine_mpi <RELION 5's GUI line of every default>` through the shim of
    `cryorefine install-relion-shims` (the line changed only as tests/jobs/test_relion5_gui_lines.py changes it: --gpu
    dropped, --cpu and one iteration added): RELION's exit file and RELION 5's files of the run under MPI, nothing
    else but cryorefine's report and --continue state, and the files its end line names are among them."""
    from test_relion5_gui_lines import LINES, relion_refine_arguments

    line = next(text for kind, setting, text in LINES if kind == job and setting == "every default")
    run_through_the_mpi_shim(gui_project, tmp_path, job, relion_refine_arguments(line)[1:], keep_pythonpath=False)


def gpu_lines():
    """(job, setting, line) of RELION 5's GUI lines that cryorefine runs (tests/jobs/test_relion5_gui_lines.py)."""
    from test_relion5_gui_lines import LINES, REFUSED

    return [(job, setting, line) for job, setting, line in LINES if setting not in REFUSED]


@pytest.mark.mpi
@pytest.mark.gpu
@pytest.mark.parametrize("job, setting, line", gpu_lines(),
                         ids=[f"{job}-{setting.replace(' ', '_')}" for job, setting, _ in gpu_lines()])
def test_relion5_gui_lines_through_the_mpi_shim_on_the_gpu(gui_project, tmp_path, job, setting, line):  # noqa: F811
    """The same on the GPU, for every line that runs: RELION 5's GUI line with "Use GPU acceleration?" Yes (`--gpu
    ""`: RELION's automatic assignment of the node's GPUs to the workers), one iteration, under mpiexec through the
    shim. The Python's own PYTHONPATH is kept (where the GPU machine's packages are)."""
    from conftest import cupy_or_skip
    from test_relion5_gui_lines import relion_refine_arguments

    cupy_or_skip()
    args = relion_refine_arguments(line)[1:]
    args.remove("--cpu")
    args[args.index("--pipeline_control"):args.index("--pipeline_control")] = ["--gpu", ""]
    run_through_the_mpi_shim(gui_project, tmp_path, job, args, keep_pythonpath=True)


def run_through_the_mpi_shim(project_folder, tmp_path, job, args, keep_pythonpath):
    """`mpiexec -n 3 relion_refine_mpi ARGS` through the shim, in the project: RELION 5's files of the run under MPI
    and nothing else but cryorefine's own, and the files its end line names among them."""
    import re

    launcher = mpiexec_or_skip()
    assert run_cli("install-relion-shims", tmp_path / "bin") in (0, None)
    folder = project_folder / args[args.index("--pipeline_control") + 1]
    folder.mkdir(parents=True, exist_ok=True)  # the GUI makes the job's folder
    environment = shim_environment(tmp_path / "bin")
    if keep_pythonpath and os.environ.get("PYTHONPATH"):
        environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
    ran = subprocess.run([launcher, "-n", "3", "relion_refine_mpi", *args], capture_output=True, text=True,
                         timeout=600, env=environment, cwd=project_folder)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "the workers' seconds added" in ran.stderr, ran.stderr[-3000:]  # the MPI runner's line, said once
    written = {p.name for p in folder.iterdir()}
    expected = RELION5_MPI_FILES[job] | CRYOREFINE_OWN | {"RELION_JOB_EXIT_SUCCESS"}
    if "--skip_align" in args:  # RELION writes no direction distributions without alignment
        expected = {name for name in expected if not name.endswith("_angdist.bild")}
    assert written == expected, written
    named = re.findall(r"(\S+?\.(?:mrc|star))\b", ran.stdout.strip().splitlines()[-1])  # files, or their pattern
    assert named and all(list(project_folder.glob(name)) for name in named), (named, ran.stdout)

"""`cryorefine relion_refine ARGS…`: a relion_refine / relion_refine_mpi command line run as it is, as the job RELION
would run from it.

The tutorial's four lines (tests/jobs/test_relion_command_lines.py, on its project) go through the drop-in with only
that test's changes (--gpu -> --cpu, the scratch folder, --iter 1); the program's choice between refine and classify
is the drop-in's own, and the same files are checked.
"""

import shlex

import pytest
import starfile

import test_relion_command_lines as tutorial
from test_relion_command_lines import project  # noqa: F401 (a fixture)

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
    from cryorefine.errors import InputError

    assert relion_refine_command(["--o", "a/run", "--auto_refine", "--split_random_halves", "--ref", "r.mrc"]) == "refine"
    assert relion_refine_command(["--o", "a/run", "--ref=r.mrc", "--K", "4"]) == "classify"
    assert relion_refine_command(["--ref", "r.mrc"]) == "classify"  # RELION: a 3D classification of one class
    assert relion_refine_command([]) is None and relion_refine_command(["--help"]) is None
    for line in (["--o", "Class2D/job008/run", "--i", "p.star", "--K", "50", "--tau2_fudge", "2"],
                 ["--o", "InitialModel/job015/run", "--grad", "--denovo_3dref", "--i", "p.star", "--K", "1"]):
        with pytest.raises(InputError, match="not available in cryorefine yet"):
            relion_refine_command(line)
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


def test_a_line_without_ref_is_refused_in_one_line(capsys, tmp_path):
    """RELION's Class2D line (no --ref): exit 2, one line, RELION_JOB_EXIT_FAILURE for the GUI, nothing written."""
    from test_cli import assert_one_line_error, run

    folder = tmp_path / "Class2D" / "job008"
    folder.mkdir(parents=True)
    line = (f"--o {folder}/run --iter 25 --i Select/job007/particles.star --dont_combine_weights_via_disc "
            f"--preread_images --pool 30 --pad 2 --ctf --tau2_fudge 2 --particle_diameter 200 --K 50 "
            f"--flatten_solvent --zero_mask --center_classes --oversampling 1 --psi_step 12 --offset_range 5 "
            f"--offset_step 2 --norm --scale --j 6 --gpu \"\" --pipeline_control {folder}/")
    code, _, err = run(capsys, "relion_refine", *shlex.split(line))
    assert_one_line_error(code, err, "relion_refine without --ref", "not available in cryorefine yet")
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
    assert code == 0 and out.startswith("Usage: cryorefine relion_refine")

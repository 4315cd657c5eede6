"""RELION 5's GUI continue lines (tests/data/relion5_gui_continue_lines.txt: Refine3D, Class3D, Class2D and
InitialModel, every setting at its default) through `cryorefine relion_refine`: a job started with the GUI's line,
then continued from its iteration 1 with the GUI's continue line, which names the job's own output root
(`--o <job folder>/run`). relion_refine then writes under `<job folder>/run_ct1` (MlOptimiser::parseContinue: an --o
that is the continued run's rlnOutputRootName, or none, becomes that root + `_ct` + the iteration), and so must the
drop-in: the files it writes are compared by name with those RELION writes, listed here from its source.

What this test changes in a line, and why (as tests/jobs/test_relion5_gui_lines.py does):
- `which relion_refine` is the program: the arguments after it go to `cryorefine relion_refine`;
- `--cpu` is added to every line: CI has no GPU;
- the first run is one iteration, the continued run one more, as a user would ask under "Additional arguments":
  `--iter 1` then `--iter 2` (the last --iter counts, as in RELION), `--auto_iter_max 1` then `2` for Refine3D;
- Refine3D and Class3D start at 15 degrees (`--healpix_order 1` added to their first line, the last counting), so
  that their runs take seconds; the continued run keeps the run's sampling (cryorefine's --continue does).
"""

import os
import shlex
from pathlib import Path

import pytest
import starfile
from conftest import run_cli
from test_relion5_gui_lines import gui_project  # noqa: F401 (a fixture)
from test_relion_command_lines import project  # noqa: F401 (a fixture)

LINES_FILE = Path(__file__).resolve().parents[1] / "data" / "relion5_gui_continue_lines.txt"
JOBS = ("Refine3D", "Class3D", "Class2D", "InitialModel")


def gui_lines():
    """{job: {"start": line, "continue": line}} of LINES_FILE, as its `# Job: start|continue` comments name them."""
    out, name = {}, None
    for text in LINES_FILE.read_text().splitlines():
        if text.startswith("# ") and text[2:].partition(": ")[0] in JOBS:
            name = text[2:].split(": ")
        elif text.startswith("`which relion_refine"):
            out.setdefault(name[0], {})[name[1]] = text
    return out


LINES = gui_lines()


def arguments(line, iterations):
    """`cryorefine relion_refine` and the line's arguments, with the changes the module docstring lists."""
    words = shlex.split(line)
    assert words[0] == "`which" and words[1] in ("relion_refine`", "relion_refine_mpi`")
    last = ["--auto_iter_max", str(iterations)] if "Refine3D/" in line else ["--iter", str(iterations)]
    if "--continue" not in words and ("--healpix_order", "2") in zip(words, words[1:]):
        last += ["--healpix_order", "1"]
    return ["relion_refine", *words[2:], "--cpu", *last]


# The files relion_refine writes for a continued run of one process (the GUI's "Number of MPI procs" 1), by
# iteration, under its output root, from RELION 5.0.1's source (src/ml_optimiser.cpp, ml_optimiser_mpi.cpp,
# ml_model.cpp):
# - before going on, the iteration continued from, as it was read (MlOptimiser::initialise: write(DONT_WRITE_SAMPLING,
#   DO_WRITE_DATA, DO_WRITE_OPTIMISER, DO_WRITE_MODEL)): data.star, optimiser.star, the model.star and the model's
#   maps (MlModel::write: class001.mrc, or 2D's classes.mrcs; under --grad the momenta, 1moment/2moment; the
#   classes' angdist.bild only where MlOptimiser::write draws them, not under --grad). An auto-refine runs only under
#   MPI (MlOptimiserMpi::initialise: the leader writes data.star, each half's first worker its sampling.star,
#   optimiser.star, half model.star, half map and bild);
# - each iteration run (MlOptimiser::iterate: write(DO_WRITE_SAMPLING, DO_WRITE_DATA, DO_WRITE_OPTIMISER,
#   DO_WRITE_MODEL)): the same and the sampling.star.
REFINE3D = ("data.star", "sampling.star", "optimiser.star", "half1_model.star", "half2_model.star",
            "half1_class001.mrc", "half2_class001.mrc", "half1_class001_angdist.bild", "half2_class001_angdist.bild")
RELION_FILES = {
    "Refine3D": {1: REFINE3D, 2: REFINE3D},
    "Class3D": {1: ("data.star", "optimiser.star", "model.star", "class001.mrc", "class001_angdist.bild"),
                2: ("data.star", "optimiser.star", "model.star", "class001.mrc", "class001_angdist.bild",
                    "sampling.star")},
    "Class2D": {1: ("data.star", "optimiser.star", "model.star", "classes.mrcs", "1moment.mrcs", "2moment.mrcs"),
                2: ("data.star", "optimiser.star", "model.star", "classes.mrcs", "1moment.mrcs", "2moment.mrcs",
                    "sampling.star")},
    # one class, its momenta of the two pseudo-half sets (1moment001, 1moment002) and 2moment001
    "InitialModel": {1: ("data.star", "optimiser.star", "model.star", "class001.mrc", "1moment001.mrc",
                         "1moment002.mrc", "2moment001.mrc"),
                     2: ("data.star", "optimiser.star", "model.star", "class001.mrc", "1moment001.mrc",
                         "1moment002.mrc", "2moment001.mrc", "sampling.star")},
}
#: cryorefine's own files beside RELION's: what --continue reads (each iteration's), the report (of an iteration run)
CRYOREFINE_OWN = {1: ("resume.npz",), 2: ("resume.npz", "report.png")}


def relion_names(job, root):
    """The names of the files RELION writes under `root` (e.g. run_ct1) for the job's continued run, and
    cryorefine's own beside them."""
    return {f"{root}_it{iteration:03d}_{suffix}" for iteration in (1, 2)
            for suffix in RELION_FILES[job][iteration] + CRYOREFINE_OWN[iteration]}


@pytest.mark.parametrize("job", JOBS)
def test_a_gui_continue_line_writes_relions_files_under_run_ct(gui_project, monkeypatch, capsys, job):  # noqa: F811
    """The job's GUI line (one iteration), then its GUI continue line from run_it001_optimiser.star (one more): the
    files written by the continued run are exactly RELION's under run_ct1, with cryorefine's own; the first run's
    are there as they were (no file under `run_it002`); the continued run's optimiser.star names its root run_ct1,
    and RELION_JOB_EXIT_SUCCESS is written again."""
    monkeypatch.chdir(gui_project)
    start, again = arguments(LINES[job]["start"], 1), arguments(LINES[job]["continue"], 2)
    folder = gui_project / again[again.index("--pipeline_control") + 1]
    folder.mkdir(parents=True, exist_ok=True)  # the GUI makes the job's folder
    assert run_cli(*start) == 0, capsys.readouterr().err[-2000:]
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    (folder / "RELION_JOB_EXIT_SUCCESS").unlink()  # the GUI's continue starts without it
    assert run_cli(*again) == 0, capsys.readouterr().err[-2000:]
    assert (folder / "RELION_JOB_EXIT_SUCCESS").is_file()
    written = {p.name for p in folder.iterdir()} - set(before)
    assert written == relion_names(job, "run_ct1"), sorted(written ^ relion_names(job, "run_ct1"))
    kept = {name for name in before if name.startswith("run_it")}
    assert kept and all((folder / name).stat().st_mtime_ns == before[name] for name in kept)
    general = starfile.read(folder / "run_ct1_it002_optimiser.star", always_dict=True)["optimiser_general"]
    assert general["rlnOutputRootName"] == f"{folder.relative_to(gui_project)}/run_ct1"


def test_a_second_continue_line_with_the_jobs_run_goes_back_to_run(gui_project, monkeypatch, capsys):  # noqa: F811
    """The GUI's continue line of a run continued before (from run_ct1_it002_optimiser.star, still `--o <job>/run`):
    its --o is not that run's root (run_ct1), so relion_refine takes it as given (MlOptimiser::parseContinue) and
    writes under run: iteration 2 as read, then iteration 3."""
    monkeypatch.chdir(gui_project)
    folder = gui_project / "Class3D" / "job117"
    folder.mkdir(parents=True)
    start = arguments(LINES["Class3D"]["start"].replace("job116", "job117"), 1)
    assert run_cli(*start) == 0, capsys.readouterr().err[-2000:]
    line = LINES["Class3D"]["continue"].replace("job116", "job117")
    assert run_cli(*arguments(line, 2)) == 0, capsys.readouterr().err[-2000:]
    before = {p.name for p in folder.iterdir()}
    line = line.replace("run_it001_optimiser.star", "run_ct1_it002_optimiser.star")
    assert run_cli(*arguments(line, 3)) == 0, capsys.readouterr().err[-2000:]
    written = {p.name for p in folder.iterdir()} - before
    files = RELION_FILES["Class3D"]
    assert written == ({f"run_it002_{suffix}" for suffix in files[1] + CRYOREFINE_OWN[1]}
                       | {f"run_it003_{suffix}" for suffix in files[2] + CRYOREFINE_OWN[2]}), sorted(written)


@pytest.mark.parametrize("given, root", [
    (None, "Refine3D/job101/run_ct12"),  # no --o: RELION's default "OLD_ctX"
    ("Refine3D/job101/run", "Refine3D/job101/run_ct12"),  # the run's own root, as the GUI writes it
    ("Refine3D/job101/run_ct12", "Refine3D/job101/run_ct12"),  # RELION 3.1's GUI line
    ("Refine3D/job101/other", "Refine3D/job101/other"),
    ("./Refine3D/job101/run", "./Refine3D/job101/run"),  # RELION compares the text, not the file it names
])
def test_the_continued_root_is_relions(tmp_path, given, root):
    from cryorefine.io.run_files import continued_output_root

    star = tmp_path / "run_it012_optimiser.star"
    star.write_text("# RELION optimiser; version 5.0.1\n# --o Refine3D/job101/run\n\ndata_optimiser_general\n\n"
                    "_rlnOutputRootName         Refine3D/job101/run\n_rlnCurrentIteration         12\n")
    assert continued_output_root(star, given) == root


@pytest.mark.mpi
def test_a_gui_continue_line_under_mpirun_writes_relions_mpi_files(gui_project, monkeypatch, tmp_path,  # noqa: F811
                                                                   capsys):
    """Class3D's continue line as the GUI writes it for "Number of MPI procs" 3 (`which relion_refine_mpi`), run by
    `mpiexec -n 3` through the relion_refine_mpi shim: under run_ct1, the files of iteration 1 as
    MlOptimiserMpi::initialise writes them (the workers' sampling.star too), then iteration 2's."""
    import subprocess

    from conftest import mpiexec_or_skip
    from test_relion_refine_drop_in import shim_environment

    launcher = mpiexec_or_skip()
    monkeypatch.chdir(gui_project)
    folder = gui_project / "Class3D" / "job118"
    folder.mkdir(parents=True)
    assert run_cli(*arguments(LINES["Class3D"]["start"].replace("job116", "job118"), 1)) == 0, \
        capsys.readouterr().err[-2000:]
    before = {p.name for p in folder.iterdir()}
    assert run_cli("install-relion-shims", tmp_path / "bin") in (0, None)
    line = LINES["Class3D"]["continue"].replace("job116", "job118").replace("relion_refine`", "relion_refine_mpi`")
    environment = shim_environment(tmp_path / "bin")
    if os.environ.get("PYTHONPATH"):  # where the packages under test are, if not installed
        environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
    ran = subprocess.run([launcher, "-n", "3", "relion_refine_mpi", *arguments(line, 2)[1:]], capture_output=True,
                         text=True, timeout=300, env=environment, cwd=gui_project)
    assert ran.returncode == 0, ran.stderr[-3000:]
    written = {p.name for p in folder.iterdir()} - before
    files = RELION_FILES["Class3D"]
    assert written == ({f"run_ct1_it001_{suffix}" for suffix in files[1] + ("sampling.star",) + CRYOREFINE_OWN[1]}
                       | {f"run_ct1_it002_{suffix}" for suffix in files[2] + CRYOREFINE_OWN[2]}), sorted(written)

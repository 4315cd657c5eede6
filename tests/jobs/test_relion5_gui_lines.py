"""RELION 5's GUI lines for Refine3D and Class3D (tests/data/relion5_gui_lines.txt: every default, then each Yes/No
setting flipped once, as RELION 5.0.1's src/pipeline_jobs.cpp writes them) run through `cryorefine relion_refine`
on the tutorial test's small project (tests/jobs/test_relion_command_lines.py, its particles file cut to 32
particles), one iteration each on the CPU.

What this test changes in a line, and why:
- `which relion_refine` is the program: the arguments after it go to `cryorefine relion_refine`;
- `--gpu ""` (the "Use GPU acceleration?" Yes line) is dropped, and `--cpu` added to every line: CI has no GPU;
- one iteration, as a user would ask for it under "Additional arguments": `--iter 1` for Class3D (the last --iter
  counts, as in RELION), `--auto_iter_max 1` for Refine3D (RELION's last iteration of an auto-refine).
Every line either runs (RELION_JOB_EXIT_SUCCESS and the iteration's files) or is refused in one line that says what
to do instead (exit 2, RELION_JOB_EXIT_FAILURE, nothing written): those with --blush or the helical options alone.
"""

import shlex
from pathlib import Path

import pandas as pd
import pytest
import starfile
from conftest import run_cli
from test_relion_command_lines import project  # noqa: F401 (a fixture)

LINES_FILE = Path(__file__).resolve().parents[1] / "data" / "relion5_gui_lines.txt"
#: the settings whose lines cryorefine refuses, the option it names, and words of what it says to do instead
REFUSED = {"do_blush Yes": ("--blush", "run this job with RELION, or without Blush"),
           "do_helix Yes": ("--helix", "run helical jobs with RELION")}


def gui_lines():
    """(job, setting, line) for each line of LINES_FILE, the setting as its comment names it."""
    out, setting = [], None
    for text in LINES_FILE.read_text().splitlines():
        if text.startswith("# ") and ": " in text and text.split(":")[0][2:] in ("Refine3D", "Class3D"):
            setting = text[2:]
        elif text.startswith("`which relion_refine"):
            job, _, flipped = setting.partition(": ")
            out.append((job, flipped, text))
            setting = None
    return out


LINES = gui_lines()
#: the particles of the lines' runs: enough for two half sets, few enough for 30 runs in CI
N_PARTICLES = 32


@pytest.fixture(scope="module")
def gui_project(project):  # noqa: F811
    """The tutorial test's project (this module's own copy), Extract/job018/particles.star cut to N_PARTICLES."""
    path = project / "Extract" / "job018" / "particles.star"
    star = starfile.read(path)
    starfile.write({"optics": star["optics"], "particles": pd.DataFrame(star["particles"]).iloc[:N_PARTICLES]},
                   path, overwrite=True)
    return project


def relion_refine_arguments(line):
    """The arguments of `cryorefine relion_refine` for a GUI line (the changes listed in the module docstring)."""
    words = shlex.split(line)
    assert words[0] in ("`which", "`which relion_refine`") and words[1] in ("relion_refine`", "relion_refine_mpi`")
    words = words[2:]
    if "--gpu" in words:
        at = words.index("--gpu")
        assert words[at + 1] == ""
        del words[at:at + 2]
    last = ["--auto_iter_max", "1"] if "--auto_refine" in words else ["--iter", "1"]
    return ["relion_refine", *words, "--cpu", *last]


def test_the_list_holds_both_jobs_with_every_default_and_each_flip():
    """The file is what its header says: the two jobs, a defaults line each, each flip once, no line twice."""
    for job in ("Refine3D", "Class3D"):
        settings = [setting for kind, setting, _ in LINES if kind == job]
        assert settings[0] == "every default"
        assert len(settings) == len(set(settings))
    assert len({line.split(" --pipeline_control")[0].split(" --o ")[1].split(" ", 1)[1] for _, _, line in LINES}) \
        == len(LINES)  # no two lines the same but for their job folder
    flipped = {setting for _, setting, _ in LINES}
    for setting in ("ref_correct_greyscale Yes", "trust_ref_size No", "do_fast_subsets Yes", "allow_coarser Yes",
                    "do_local_ang_searches Yes", "dont_skip_align No", "auto_faster Yes", *REFUSED):
        assert setting in flipped, setting
    defaults = {job: line for job, setting, line in LINES if setting == "every default"}
    for option in ("--firstiter_cc", "--trust_ref_size", "--ctf", "--zero_mask", "--flatten_solvent", "--norm"):
        assert all(f" {option} " in line for line in defaults.values()), option


@pytest.mark.parametrize("job, setting, line", LINES, ids=[f"{job}-{setting.replace(' ', '_')}"
                                                             for job, setting, _ in LINES])
def test_a_gui_line_runs_or_is_refused_in_one_line(gui_project, monkeypatch, capsys, job, setting, line):
    from test_cli import assert_one_line_error, run

    monkeypatch.chdir(gui_project)
    args = relion_refine_arguments(line)
    folder = gui_project / args[args.index("--pipeline_control") + 1]
    folder.mkdir(parents=True, exist_ok=True)  # the GUI makes the job's folder
    if setting in REFUSED:
        option, instead = REFUSED[setting]
        code, _, err = run(capsys, *args)
        assert_one_line_error(code, err, option, instead)
        assert (folder / "RELION_JOB_EXIT_FAILURE").is_file()
        assert not list(folder.glob("run*"))
        return
    assert run_cli(*args) == 0, capsys.readouterr().err[-2000:]
    assert (folder / "RELION_JOB_EXIT_SUCCESS").is_file()
    assert not (folder / "RELION_JOB_EXIT_FAILURE").exists()
    halves = ("half1_", "half2_") if job == "Refine3D" else ("",)
    for half in halves:
        for name in (f"run_it001_{half}class001.mrc", f"run_it001_{half}model.star"):
            assert (folder / name).is_file(), name
    for name in ("run_it001_data.star", "run_it001_optimiser.star", "run_it001_sampling.star"):
        assert (folder / name).is_file(), name
    for half in halves:  # RELION writes each class's (each half's) direction distribution, but not without alignment
        bild = folder / f"run_it001_{half}class001_angdist.bild"
        assert bild.is_file() == ("--skip_align" not in args), bild

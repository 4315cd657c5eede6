"""RELION's own command lines, as its GUI writes them into a job's note.txt, run with `relion_refine_mpi` /
`relion_refine` replaced by `cryorefine refine` / `cryorefine classify`, on a small simulated D2 data set laid
out as the tutorial's project folder; --pipeline_control leaves RELION's exit files.

The lines are those of the RELION tutorial's precalculated results (beta-galactosidase, D2), quoted from their
note.txt files as published with the project (github.com/dzyla/Follow_Relion_gracefully,
content/230416_Relion4_precalc/jobs/job016, job019, job029 and job035 index.md; RELION 4.0 GUI). What this test
changes, and why:
- the program: `which relion_refine_mpi` / `which relion_refine` -> cryorefine refine / classify;
- `--gpu "…"` -> `--cpu`: CI has no GPU (the device numbers of the tutorial's machine would not exist anyway);
- `--scratch_dir /ssd/scheres` -> a scratch folder of the test (there is no /ssd here);
- `--iter 1` appended (the last --iter counts, as in RELION), so each line runs one iteration.
Everything else is verbatim, including the doubled spaces the GUI writes.
"""

import shlex

import numpy as np
import pandas as pd
import pytest
import starfile
from conftest import EXAMPLE_MAP, run_cli

REFINE3D_JOB019 = (
    '`which relion_refine_mpi` --o Refine3D/job019/run --auto_refine --split_random_halves --i '
    'Extract/job018/particles.star --ref Class3D/job016/run_it025_class004_box256.mrc --firstiter_cc --ini_high 50 '
    '--dont_combine_weights_via_disc --scratch_dir /ssd/scheres --pool 3 --pad 2  --skip_gridding  '
    '--auto_ignore_angles --auto_resol_angles --ctf --particle_diameter 200 --flatten_solvent --zero_mask '
    '--oversampling 1 --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5 --offset_step 2 --sym D2 '
    '--low_resol_join_halves 40 --norm --scale  --j 6 --gpu "4:5:6:7"  --pipeline_control Refine3D/job019/')
REFINE3D_JOB029 = (
    '`which relion_refine_mpi` --o Refine3D/job029/run --auto_refine --split_random_halves --i '
    'Polish/job028/shiny.star --ref Refine3D/job025/run_half1_class001_unfil.mrc --ini_high 8 '
    '--dont_combine_weights_via_disc --scratch_dir /ssd/scheres --pool 3 --pad 2  --skip_gridding  --ctf '
    '--particle_diameter 200 --flatten_solvent --zero_mask --solvent_mask MaskCreate/job020/mask.mrc '
    '--solvent_correct_fsc  --oversampling 1 --healpix_order 2 --auto_local_healpix_order 4 --offset_range 5 '
    '--offset_step 2 --sym D2 --low_resol_join_halves 40 --norm --scale  --j 6 --gpu "4:5:6:7"  '
    '--pipeline_control Refine3D/job029/')
CLASS3D_JOB016 = (
    '`which relion_refine_mpi` --o Class3D/job016/run --i Select/job014/particles.star --ref '
    'InitialModel/job015/initial_model.mrc --ini_high 50 --dont_combine_weights_via_disc --preread_images  --pool 30 '
    '--pad 2  --skip_gridding  --ctf --iter 25 --tau2_fudge 4 --particle_diameter 200 --K 4 --flatten_solvent '
    '--zero_mask --oversampling 1 --healpix_order 2 --offset_range 5 --offset_step 2 --sym C1 --norm --scale  --j 6 '
    '--gpu "4:5:6:7"  --pipeline_control Class3D/job016/')
# a later Class3D job of the same project (2023): local searches around the refined poses, with the solvent mask
CLASS3D_JOB035 = (
    '`which relion_refine` --o Class3D/job035/run --i Refine3D/job029/run_data.star --ref '
    'Refine3D/job029/run_class001.mrc --ini_high 10 --dont_combine_weights_via_disc --preread_images  --pool 30 '
    '--pad 2  --ctf --iter 50 --tau2_fudge 4 --particle_diameter 200 --K 4 --flatten_solvent --zero_mask '
    '--solvent_mask MaskCreate/job020/mask.mrc --oversampling 1 --healpix_order 4 --sigma_ang 1.66667 '
    '--offset_range 5 --offset_step 2 --sym D2 --norm --scale  --j 12 --gpu ""  --pipeline_control Class3D/job035/')

BOX, PIXEL, N_PARTICLES = 32, 8.0, 96


def as_cryorefine(line, scratch):
    """The arguments of `cryorefine` for a RELION note.txt line (the changes listed in the module docstring)."""
    words = shlex.split(line.replace("`which relion_refine_mpi`", "refine").replace("`which relion_refine`",
                                                                                   "refine"))
    command = "classify" if "--K" in words else "refine"
    out = [command]
    i = 1
    while i < len(words):
        word = words[i]
        if word == "--gpu":
            out.append("--cpu")
            i += 2
            continue
        if word == "--scratch_dir":
            out += ["--scratch_dir", str(scratch)]
            i += 2
            continue
        out.append(word)
        i += 1
    return out + ["--iter", "1"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A RELION project folder holding every input the four lines name: particles of a D2-symmetric map (the
    example ribosome, 32 px at 8 Å/px, symmetrised), references, a soft mask, and the jobs' folders."""
    from cryorefine.core.fourier import downsample_volume
    from cryorefine.core.masks import mask_from_map
    from cryorefine.core.symmetry import symmetrise_volume, symmetry_group
    from cryorefine.io.mrc import read_volume, write_volume

    root = tmp_path_factory.mktemp("relion_project")
    truth = symmetrise_volume(downsample_volume(read_volume(EXAMPLE_MAP)[0], BOX), symmetry_group("D2"))
    write_volume(root / "truth.mrc", truth, PIXEL)
    assert run_cli("simulate", "--ref", root / "truth.mrc", "--n", N_PARTICLES, "--snr", 0.5, "--seed", 7,
                   "--o", root / "Extract" / "job018", "--cpu") == 0
    star = starfile.read(root / "Extract" / "job018" / "particles.star")
    particles = star["particles"]
    # RELION's STAR files name stacks from the project folder
    particles["rlnImageName"] = [name.replace("@", "@Extract/job018/") for name in particles["rlnImageName"]]
    for path in ("Extract/job018/particles.star", "Select/job014/particles.star", "Polish/job028/shiny.star",
                 "Refine3D/job029/run_data.star"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        starfile.write({"optics": star["optics"], "particles": pd.DataFrame(particles)}, root / path)
    for path in ("Class3D/job016/run_it025_class004_box256.mrc", "InitialModel/job015/initial_model.mrc",
                 "Refine3D/job025/run_half1_class001_unfil.mrc", "Refine3D/job029/run_class001.mrc"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        write_volume(root / path, truth, PIXEL)
    (root / "MaskCreate" / "job020").mkdir(parents=True)
    write_volume(root / "MaskCreate" / "job020" / "mask.mrc", mask_from_map(truth, 0.05 * truth.max(), 1.0, 3.0),
                 PIXEL)
    for job in ("Refine3D/job019", "Class3D/job016", "Class3D/job035"):  # the pipeliner makes the job's folder
        (root / job).mkdir(parents=True, exist_ok=True)
    return root


@pytest.mark.parametrize("line, job, files", [
    (REFINE3D_JOB019, "Refine3D/job019", ["run_it001_half1_class001.mrc", "run_it001_half2_model.star",
                                          "run_it001_data.star", "run_it001_optimiser.star"]),
    (REFINE3D_JOB029, "Refine3D/job029", ["run_it001_half1_class001.mrc", "run_it001_half1_model.star"]),
    (CLASS3D_JOB016, "Class3D/job016", [f"run_it001_class00{k}.mrc" for k in (1, 2, 3, 4)] + ["run_it001_model.star"]),
    (CLASS3D_JOB035, "Class3D/job035", ["run_it001_class004.mrc", "run_it001_data.star"]),
], ids=["Refine3D_job019", "Refine3D_job029_mask", "Class3D_job016", "Class3D_job035_local"])
def test_a_tutorial_command_line_runs_and_reports_success(project, monkeypatch, tmp_path, line, job, files):
    monkeypatch.chdir(project)
    args = as_cryorefine(line, tmp_path / "scratch")
    folder = project / job
    # the project holds the outputs of this job's earlier run that later jobs read (Class3D/job016's run_it025 map,
    # Refine3D/job029's run_class001.mrc and run_data.star); a new run on them is refused (RELION's GUI runs a job
    # again only with --continue), so this run starts without them, and they are put back for the later jobs
    aside = tmp_path / "earlier_run"
    aside.mkdir()
    earlier = [path.rename(aside / path.name) for path in sorted(folder.glob("run_*"))]
    try:
        assert run_cli(*args) == 0
    finally:
        for path in earlier:
            path.rename(folder / path.name)
    assert (folder / "RELION_JOB_EXIT_SUCCESS").is_file()
    assert not (folder / "RELION_JOB_EXIT_FAILURE").exists()
    for name in files:
        assert (folder / name).is_file(), name
    optimiser = starfile.read(folder / "run_it001_optimiser.star")
    assert int(optimiser["rlnMaxNumberOfPooledParticles"]) == int(args[args.index("--pool") + 1])
    if "--solvent_correct_fsc" in args:
        model = starfile.read(folder / "run_it001_half1_model.star")
        assert int(model["model_general"]["rlnDoSolventFscCorrection"]) == 1
        assert int(optimiser["rlnDoSolventFscCorrection"]) == 1
    if "--sigma_ang" in args:
        model = starfile.read(folder / "run_it001_model.star")["model_general"]
        assert int(model["rlnOrientationalPriorMode"]) == 1
        assert float(model["rlnSigmaPriorRotAngle"]) == pytest.approx(1.66667)
    # the scratch copy is gone at the end
    assert not (tmp_path / "scratch").exists() or not any((tmp_path / "scratch").rglob("*.mrcs"))


def test_a_bad_input_leaves_the_failure_file_and_no_iteration(project, monkeypatch, tmp_path):
    """The job029 line with a mask whose values are not in [0, 1]: exit 2 before any work, RELION_JOB_EXIT_FAILURE,
    no outputs (a mask of another box is re-boxed, as RELION's checkMask does)."""
    from cryorefine.io.mrc import write_volume

    monkeypatch.chdir(project)
    (project / "MaskCreate" / "job099").mkdir()
    write_volume(project / "MaskCreate" / "job099" / "mask.mrc", np.full((BOX,) * 3, 2.0, np.float32), PIXEL)
    line = (REFINE3D_JOB029.replace("MaskCreate/job020", "MaskCreate/job099")
            .replace("Refine3D/job029/", "Refine3D/job099/"))
    (project / "Refine3D" / "job099").mkdir()
    assert run_cli(*as_cryorefine(line, tmp_path / "scratch")) == 2
    folder = project / "Refine3D" / "job099"
    assert (folder / "RELION_JOB_EXIT_FAILURE").is_file()
    assert not (folder / "RELION_JOB_EXIT_SUCCESS").exists()
    assert not list(folder.glob("run_*"))


def test_the_lines_are_parsed_as_relion_means_them():
    """The rewriting touches only what the module docstring lists."""
    args = as_cryorefine(REFINE3D_JOB019, "/tmp/scratch")
    assert args[0] == "refine" and args[-2:] == ["--iter", "1"]
    assert args[args.index("--sym") + 1] == "D2" and "--cpu" in args and "--gpu" not in args
    original = shlex.split(REFINE3D_JOB019)[2:]  # after `which relion_refine_mpi`
    kept = [w for w in original if w not in ("--gpu", "4:5:6:7", "--scratch_dir", "/ssd/scheres")]
    assert [w for w in args[1:-2] if w not in ("--cpu", "--scratch_dir", "/tmp/scratch")] == kept
    assert as_cryorefine(CLASS3D_JOB016, "/s")[0] == "classify"


def test_relion_31_gui_flags_and_a_clock_seed_are_taken(project, monkeypatch, tmp_path):
    """RELION 3.1's GUI also writes --no_parallel_disc_io and --ctf_corrected_ref (both change nothing here), and
    --random_seed -1 asks for a seed from the clock: the run takes one and saves it for --continue."""
    from cryorefine.io import resume

    monkeypatch.chdir(project)
    line = REFINE3D_JOB019.replace("Refine3D/job019/", "Refine3D/job031/") + (
        " --no_parallel_disc_io --ctf_corrected_ref --random_seed -1")
    (project / "Refine3D" / "job031").mkdir()
    assert run_cli(*as_cryorefine(line, tmp_path / "scratch")) == 0
    seed = resume.load_config_values(project / "Refine3D" / "job031" / "run_it001_optimiser.star")["random_seed"]
    assert seed > 0
    optimiser = starfile.read(project / "Refine3D" / "job031" / "run_it001_optimiser.star")
    assert int(optimiser["rlnRandomSeed"]) == seed

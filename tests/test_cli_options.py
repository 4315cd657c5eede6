"""What refine, classify and plan list in their help is what they honour, and each default shown is the one used.

The option set of a command is read from its click parameters and its help; what an option does is found by giving
it (PROBES) and comparing the config the command builds with the one it builds without it, and whether the job reads
that part of the config by reading the attributes the job asks of it in a small CPU run (writers of output files,
which copy every option into the optimiser file, and the config's own checks do not count). An option that changes
no config field must be one the command reads itself (READ_BY_THE_COMMAND, each with the place): a new option that
does nothing fails here until it does something or is listed with the code that reads it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import click
import numpy as np
import pytest
from conftest import make_particle_set, write_mrc
from test_cli import assert_one_line_error
from test_cli import run as run_cli_words

from cryorefine import cli
from cryorefine.config import RefineConfig

FIELDS = [f.name for f in dataclasses.fields(RefineConfig)]

#: an option's value that differs from its default ({d}: the folder of the test's files)
PROBES = {
    "--i": ["{d}/other.star"], "--o": ["{d}/other/run"], "--ref": ["{d}/other.mrc"],
    "--continue": ["{d}/run_it001_optimiser.star"], "--overwrite": [], "--particle_diameter": ["20"],
    "--ini_high": ["9"], "--sym": ["C2"], "--ctf": [], "--firstiter_cc": [], "--flatten_solvent": [],
    "--zero_mask": [], "--solvent_mask": ["{d}/mask.mrc"], "--solvent_mask2": ["{d}/mask.mrc"],
    "--solvent_correct_fsc": [], "--ctf_intact_first_peak": [], "--auto_ignore_angles": [], "--auto_resol_angles": [],
    "--pad": ["1.5"], "--healpix_order": ["1"], "--auto_local_healpix_order": ["3"], "--offset_range": ["3"],
    "--offset_step": ["1"], "--oversampling": ["0"], "--tau2_fudge": ["3"], "--iter": ["2"], "--auto_iter_max": ["2"],
    "--adaptive_fraction": ["0.99"], "--maxsig": ["5"], "--strict_highres_exp": ["5"], "--coarse_size": ["12"],
    "--norm": [], "--scale": [], "--low_resol_join_halves": ["30"], "--random_seed": ["3"], "--batch": ["5"],
    "--j": ["1"], "--precision": ["double"], "--scratch_dir": ["{d}/scratch"], "--preread_images": [],
    "--gpu": ["1"], "--cpu": [], "--free_gpu_memory": ["100"], "--pipeline_control": ["{d}/job"], "--K": ["2"],
    "--skip_align": [], "--sigma_ang": ["3"], "--sigma_psi": ["4"], "--sigma_rot": ["2"],
    "--sigma_tilt": ["5"], "--relion_oversampling": [], "--fast_subsets": [],
    "--allow_coarser_sampling": [], "--pool": ["3"],
    "--auto_refine": [], "--split_random_halves": [], "--dont_combine_weights_via_disc": [],
    "--no_parallel_disc_io": [], "--ctf_corrected_ref": [], "--skip_gridding": [], "--dont_check_norm": [],
    "--trust_ref_size": [], "--gpu_memory": ["10"], "--gpu_tflops": ["10"], "--json": [], "--resolution": ["9"],
}

#: options a command reads itself rather than through the config, and where
READ_BY_THE_COMMAND = {
    "refine": {"--continue": "cli._continued_config", "--overwrite": "cli._run_job (job.run's overwrite)",
               "--pipeline_control": "cli._pipeline"},
    "classify": {"--continue": "cli._continued_config", "--overwrite": "cli._run_job (job.run's overwrite)",
                 "--pipeline_control": "cli._pipeline"},
    "plan": {"--gpu": "cli.plan (the device GpuSpec.detect measures)", "--gpu_memory": "GpuSpec.detect",
             "--gpu_tflops": "GpuSpec.detect", "--json": "cli.plan", "--resolution": "plan_run"},
}
#: config fields that only the GPU engine reads (a CPU run cannot show it reading them)
GPU_ONLY = {"gpu_ids": "estep.backend (the devices)", "free_gpu_memory_mb": "gpu.allocator (the arena's size)"}
#: where a read of the config is not the job honouring an option: the files written (they hold every option as
#: RELION's do), the config's own checks and copies, the command line's reporting
NOT_HONOURING = ("relion_outputs.py", "dataclasses.py", "<string>", "copy.py", "cli.py",
                 "config.py:check", "config.py:_check_symmetry", "config.py:to_json", "config.py:from_json")

COMMANDS = ("refine", "classify", "plan")


def run(capsys, *args):
    """`cryorefine ARGS` in this process: (exit code, stdout, stderr)."""
    return run_cli_words(capsys, *(str(a) for a in args))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("options")
    make_particle_set(folder, n=6, box=16, seed=1, stack_name="stack_other.mrcs")
    (folder / "particles.star").rename(folder / "other.star")
    make_particle_set(folder, n=6, box=16)
    rng = np.random.default_rng(3)
    for name in ("ref.mrc", "other.mrc"):
        write_mrc(folder / name, rng.normal(size=(16, 16, 16)).astype(np.float32), pixel_size=1.5, stack=False)
    write_mrc(folder / "mask.mrc", np.ones((16, 16, 16), np.float32), pixel_size=1.5, stack=False)
    return folder


def base_arguments(command, folder):
    if command == "plan":
        return ["--i", f"{folder}/particles.star"]
    return ["--i", f"{folder}/particles.star", "--ref", f"{folder}/ref.mrc", "--o", f"{folder}/out/run"]


def probe(option, folder):
    return [option, *(value.format(d=folder) for value in PROBES[option])]


def listed_options(command):
    """{option: (section, help record, click parameter)} of every option the command's help lists."""
    click_command = cli.cli.commands[command]
    ctx = click.Context(click_command, info_name=command)
    listed = {}
    for param in click_command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None and "--help" not in param.opts:
            listed[param.opts[0]] = (getattr(param, "section", None), record, param)
    return listed


@pytest.fixture
def a_gpu_is_seen(monkeypatch):
    """The engine's options build their config as where CuPy sees a GPU (--gpu then makes a config here too)."""
    from cryorefine.estep import backend

    monkeypatch.setattr(backend, "cupy_available", lambda: True)


def fields_changed(command, folder, option):
    """The config fields that `option` changes (its PROBES value against the command's defaults)."""
    base = cli.config_from_arguments(command, base_arguments(command, folder))
    given = cli.config_from_arguments(command, base_arguments(command, folder) + probe(option, folder))
    return {name for name in FIELDS if getattr(base, name) != getattr(given, name)}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_help_lists_every_option_the_command_takes(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    words = set(re.findall(r"--\w+", out))
    for param in cli.cli.commands[command].params:
        assert param.opts[0] in words, param.opts[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_option_listed_changes_the_config_or_is_read_by_the_command(files, a_gpu_is_seen, command):
    """Every option in the help's first section (what the command honours) sets a config field or is read by the
    command itself; RELION's accepted flags and plan's refine options change nothing the command reads (below)."""
    for option, (section, _, _) in listed_options(command).items():
        assert option in PROBES, f"{option}: add a value to PROBES"
        if section is not None or option in READ_BY_THE_COMMAND[command]:
            continue
        assert fields_changed(command, files, option), (
            f"cryorefine {command} {option} changes nothing in the config; make it do something, or name the code "
            f"that reads it in READ_BY_THE_COMMAND")


def traced_reads(monkeypatch, arguments):
    """{field: where} of the RefineConfig fields read (outside NOT_HONOURING) while `cryorefine ARGUMENTS` runs."""
    reads = {}
    getattribute = object.__getattribute__
    names = set(FIELDS)

    def traced(self, name):
        if name in names:
            frame = sys._getframe(1)
            file = os.path.basename(frame.f_code.co_filename)
            where = f"{file}:{frame.f_code.co_name}"
            if file not in NOT_HONOURING and where not in NOT_HONOURING:
                reads.setdefault(name, where)
        return getattribute(self, name)

    with monkeypatch.context() as patch:
        patch.setattr(RefineConfig, "__getattribute__", traced)
        try:
            cli.main([str(a) for a in arguments])
        except SystemExit as exc:
            assert exc.code in (0, None), exc
    return reads


#: options left out of the traced runs: they need what a CPU run here lacks, or exclude another probe
NOT_IN_TRACED_RUN = {"--gpu", "--continue", "--cpu", "--skip_align", "--json"}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_job_reads_what_each_option_listed_sets_and_nothing_accepted_changes_it(files, monkeypatch, tmp_path,
                                                                                  command):
    """Two small CPU runs of the command (its defaults; every probe at once) and the config fields the job reads in
    them: each option the help lists as honoured sets a field the job reads; RELION's accepted flags, and plan's
    options of refine that do not change the plan, set none that it reads."""
    listed = listed_options(command)
    honoured = [o for o, (section, _, _) in listed.items() if section is None and o not in READ_BY_THE_COMMAND[command]]
    probes = [word for option in honoured if option not in NOT_IN_TRACED_RUN for word in probe(option, files)]
    out = ["--o", tmp_path / "run"] if command != "plan" else []
    cpu = ["--cpu"] if command != "plan" else []
    short = ["--iter", "1"] if command != "plan" else []
    reads = traced_reads(monkeypatch, [command, *base_arguments(command, files), *out, *cpu, *short])
    extra = ["--o", tmp_path / "probed" / "run"] if command != "plan" else []
    reads.update(traced_reads(monkeypatch, [command, *base_arguments(command, files), *probes, *extra, *cpu]))
    with monkeypatch.context() as patch:
        from cryorefine.estep import backend

        patch.setattr(backend, "cupy_available", lambda: True)
        changes = {option: fields_changed(command, files, option) for option in listed}
    for option in honoured:
        fields = changes[option] - set(GPU_ONLY) if command != "plan" else changes[option]
        if changes[option] and not fields:
            continue  # read by the GPU engine alone
        assert fields & set(reads), (f"cryorefine {command} {option} sets {sorted(changes[option])}, which the job "
                                     f"never reads: it does nothing")
    for option, (section, _, _) in listed.items():
        if section is not None:
            read = changes[option] & set(reads)
            assert not read, f"cryorefine {command} {option} ({section}) changes {sorted(read)}, which the job reads"


def shown_default(record):
    found = re.findall(r"\[default: (.*?)\]", record[1])
    return found[-1] if found else None


def a_value(param, shown):
    """Whether a default shown is a value of the option (2.0, C1, single) rather than words (the box, Nyquist)."""
    try:
        param.type.convert(shown, param, None)
    except click.BadParameter:
        return False
    return " " not in shown.strip()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_default_shown_is_the_one_used(files, a_gpu_is_seen, command):
    """A default the help shows as a value, given on the command line, changes nothing in the config the command
    builds; an option with no default shown leaves its field empty (a default in words, such as "the box" or "the
    cores present", is one the job works out from an empty field)."""
    base = cli.config_from_arguments(command, base_arguments(command, files))
    checked = 0
    for option, (_, record, param) in listed_options(command).items():
        if option in READ_BY_THE_COMMAND[command] or param.is_flag:
            continue
        shown = shown_default(record)
        if shown is None:
            for field in fields_changed(command, files, option) - {"input_star", "output_root", "reference_map"}:
                assert getattr(base, field) is None, (
                    f"cryorefine {command} {option}: no default shown, but {field} = {getattr(base, field)!r} is used")
        elif a_value(param, shown):
            given = cli.config_from_arguments(command, base_arguments(command, files) + [option, shown])
            assert given == base, f"cryorefine {command} {option}: the default shown, {shown}, is not the one used"
            checked += 1
    assert checked >= 10


def test_classify_shows_and_uses_its_own_number_of_iterations(files):
    """classify runs 25 iterations unless told, refine at most 50: each help says its own."""
    for command, iterations in (("classify", 25), ("refine", 50)):
        (_, record, _) = listed_options(command)["--iter"]
        assert shown_default(record) == str(iterations)
        assert cli.config_from_arguments(command, base_arguments(command, files)).max_iterations == iterations


@pytest.mark.parametrize("option", ["--low_resol_join_halves", "--auto_local_healpix_order", "--auto_ignore_angles",
                                    "--auto_resol_angles", "--solvent_correct_fsc", "--auto_iter_max"])
def test_classify_refuses_the_options_of_an_auto_refine_naming_refine(capsys, files, option):
    code, _, err = run(capsys, "classify", *base_arguments("classify", files), *probe(option, files))
    assert_one_line_error(code, err, f"No such option: {option}", "`cryorefine refine` take",
                          "`cryorefine classify` does not")


# ---------------------------------------------------------------------------------------------- RELION's options
#: RELION 5's GUI options that cryorefine cannot honour (RELION's pipeline_jobs.cpp, Refine3D / Class3D / MultiBody),
#: with a value where they take one, and what the refusal must say to do instead
UNAVAILABLE = [
    (["--blush"], "drop --blush"),
    (["--blush_skip_spectral_trailing"], "run this job with RELION"),
    (["--helix"], "run helical jobs with RELION"),
    (["--helical_outer_diameter", "200"], "run helical jobs with RELION"),
    (["--helical_twist_initial", "-1.4"], "run helical jobs with RELION"),
    (["--ignore_helical_symmetry"], "drop the helical options"),
    (["--helical_keep_tilt_prior_fixed"], "run helical jobs with RELION"),
    (["--multibody_masks", "bodies.star"], "run the MultiBody job with RELION"),
    (["--reconstruct_subtracted_bodies"], "run the MultiBody job with RELION"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("words, instead", UNAVAILABLE, ids=[words[0] for words, _ in UNAVAILABLE])
def test_relion_options_that_cannot_be_honoured_are_refused_in_one_line_saying_what_to_do(capsys, files, tmp_path,
                                                                                         command, words, instead):
    out = tmp_path / "run"
    arguments = [*base_arguments(command, files), "--o", out, *words] if command != "plan" else [
        *base_arguments(command, files), *words]
    code, stdout, err = run(capsys, command, *arguments)
    assert_one_line_error(code, err, f"{words[0]}: ", instead)
    assert stdout == "" and not list(tmp_path.iterdir())
    # wherever the option stands, and in the form --option=value
    if len(words) == 2:
        code, _, err = run(capsys, command, f"{words[0]}={words[1]}", *arguments[:-2])
        assert_one_line_error(code, err, f"{words[0]}: ", instead)


def test_a_relion_5_gui_line_with_blush_is_refused_and_the_gui_told(capsys, files, tmp_path):
    """RELION 5's Refine3D line with 'Use Blush regularisation?' Yes, through the drop-in: exit 2, one line,
    RELION_JOB_EXIT_FAILURE in the job's folder for the GUI, no output."""
    job = tmp_path / "Refine3D" / "job012"
    job.mkdir(parents=True)
    line = (f"--o {job}/run --auto_refine --split_random_halves --i {files}/particles.star --ref {files}/ref.mrc "
            f"--firstiter_cc --trust_ref_size --ini_high 50 --blush --dont_combine_weights_via_disc --pool 3 --pad 2 "
            f"--ctf --particle_diameter 20 --flatten_solvent --zero_mask --oversampling 1 --healpix_order 2 "
            f"--auto_local_healpix_order 4 --offset_range 5 --offset_step 2 --sym C1 --low_resol_join_halves 40 "
            f"--norm --scale --j 1 --pipeline_control {job}/")
    code, _, err = run(capsys, "relion_refine", *line.split())
    assert_one_line_error(code, err, "--blush: Blush regularisation needs RELION's", "see `cryorefine refine --help`")
    assert (job / "RELION_JOB_EXIT_FAILURE").is_file() and not list(job.glob("run_*"))


@pytest.mark.parametrize("command", ["refine", "classify"])
def test_the_help_names_the_refused_relion_options(capsys, command):
    code, out, _ = run(capsys, command, "--help")
    assert code == 0
    section = out[out.index(cli.REFUSED_SECTION):]
    for name in ("--blush", "--helix", "--helical_", "--multibody_"):
        assert name in section


def test_auto_iter_max_is_refines_last_iteration(capsys, files, tmp_path, caplog):
    """RELION's --auto_iter_max N: the auto-refine stops after iteration N, as --iter N does here; both given, they
    must agree; classify does not take it (RELION's classification does not read it)."""
    config = cli.config_from_arguments("refine", [*base_arguments("refine", files), "--auto_iter_max", "7"])
    assert config.max_iterations == 7
    config = cli.config_from_arguments("refine", [*base_arguments("refine", files), "--iter", "7",
                                                  "--auto_iter_max", "7"])
    assert config.max_iterations == 7
    code, _, err = run(capsys, "refine", *base_arguments("refine", files), "--iter", "5", "--auto_iter_max", "7")
    assert_one_line_error(code, err, "--iter 5 and --auto_iter_max 7", "give one of the two")
    code, _, err = run(capsys, "refine", *base_arguments("refine", files), "--auto_iter_max", "0")
    assert_one_line_error(code, err, "--auto_iter_max 0: out of range")
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "refine", "--i", files / "particles.star", "--ref", files / "ref.mrc", "--o", out,
                          "--cpu", "--healpix_order", "1", "--auto_iter_max", "1")
    assert code == 0 and "not converged after 1 iteration (--iter)" in stdout
    assert (tmp_path / "run_it001_optimiser.star").is_file() and not (tmp_path / "run_it002_optimiser.star").exists()
    # a continue line that raises it goes on to it
    code, stdout, _ = run(capsys, "refine", "--continue", tmp_path / "run_it001_optimiser.star", "--auto_iter_max", "2")
    assert code == 0 and (tmp_path / "run_ct1_it002_optimiser.star").is_file()  # no --o: RELION's run_ct1
    assert not (tmp_path / "run_ct1_it003_optimiser.star").exists()


def test_j_on_a_continue_line_is_taken(files, tmp_path, capsys):
    """RELION's --continue reads --j again: the continued run's threads are the line's."""
    from cryorefine.io import resume

    first = ["--i", files / "particles.star", "--ref", files / "ref.mrc", "--o", tmp_path / "run", "--cpu",
             "--healpix_order", "1", "--K", "1"]
    assert run(capsys, "classify", *first, "--iter", "1", "--j", "2")[0] == 0
    assert resume.load_config_values(tmp_path / "run_it001_optimiser.star")["threads"] == 2
    code, _, err = run(capsys, "classify", "--continue", tmp_path / "run_it001_optimiser.star", "--j", "1",
                       "--iter", "2")
    assert code == 0, err
    assert resume.load_config_values(tmp_path / "run_ct1_it002_optimiser.star")["threads"] == 1


def test_the_options_are_declared_once():
    """Each option name appears in one declaration of JOB_OPTIONS, and the commands' parameters come from there."""
    names = [spec.decls[0] for spec in cli.JOB_OPTIONS]
    assert len(names) == len(set(names))
    declared = set(names)
    own = {"plan": {"--gpu_memory", "--gpu_tflops", "--json", "--resolution"}}
    for command in COMMANDS:
        params = {p.opts[0] for p in cli.cli.commands[command].params} - {"--help"}
        assert params - own.get(command, set()) <= declared, command


# ------------------------------------------------------------------------------------ simulate and reconstruct
#: for simulate and reconstruct: (the job's module and function, the arguments every call has, a value of each option
#: that differs from its default, the options the command reads itself and where)
OTHER_COMMANDS = {
    "simulate": ("cryorefine.jobs.simulate", "simulate", ["--ref", "{d}/ref.mrc", "--n", "3", "--o", "{d}/sim"],
                 {"--n": ["4"], "--snr": ["0.1"], "--defocus": ["1:2"], "--astigmatism": ["0.1"], "--voltage": ["200"],
                  "--cs": ["2"], "--q0": ["0.07"], "--angpix": ["2"], "--max_shift": ["5"],
                  "--particle_diameter": ["20"], "--sym": ["C2"], "--noise": ["coloured"], "--no_ctf": [],
                  "--seed": ["2"], "--float16": [], "--batch": ["7"]},
                 {"--ref": "simulate(ref, …)", "--o": "simulate(…, out_dir, …)",
                  "--gpu": "cli.simulate (the array module)", "--cpu": "cli.simulate (the array module)"}),
    "reconstruct": ("cryorefine.jobs.reconstruct", "reconstruct", ["--i", "{d}/particles.star", "--o", "{d}/map.mrc"],
                    {"--ctf": [], "--sym": ["C2"], "--maxres": ["5"], "--half_maps": [], "--angpix": ["2"],
                     "--pad": ["1.5"], "--batch": ["7"]},
                    {"--i": "reconstruct(star, …)", "--o": "reconstruct(…, out, …)"}),
}


def job_options_of(monkeypatch, command, folder, extra=()):
    """The options object that `cryorefine COMMAND` hands its job (the job itself not run)."""
    import importlib

    module, function, base, _, _ = OTHER_COMMANDS[command]
    handed = []

    def job(*args, **kwargs):
        handed.append(next(a for a in args if dataclasses.is_dataclass(a)))
        return {"n_particles": 3, "box_px": 16, "pixel_size_angstrom": 1.5, "star": "p.star", "map": "m.mrc",
                "fsc_star": "f.star", "resolution_fsc0143_angstrom": 9.0}

    with monkeypatch.context() as patch:
        patch.setattr(importlib.import_module(module), function, job)
        words = [word.format(d=folder) for word in base] + [str(word) for word in extra]
        extra_cpu = ["--cpu"] if command == "simulate" and "--gpu" not in extra else []
        try:
            cli.main([command, *words, *extra_cpu])
        except SystemExit as exc:
            assert exc.code in (0, None), exc
    return handed[0]


@pytest.mark.parametrize("command", sorted(OTHER_COMMANDS))
def test_simulate_and_reconstruct_honour_every_option_and_use_the_defaults_shown(files, monkeypatch, command):
    """Each option of simulate and reconstruct changes the options handed to the job (or is read by the command
    itself); a default shown, given, changes nothing; an option with no default shown leaves its field empty."""
    _, _, _, probes, read = OTHER_COMMANDS[command]
    base = job_options_of(monkeypatch, command, files)
    click_command = cli.cli.commands[command]
    ctx = click.Context(click_command, info_name=command)
    for param in click_command.params:
        option = param.opts[0]
        if option in read:
            continue
        assert option in probes, f"{command} {option}: add a value to OTHER_COMMANDS"
        given = job_options_of(monkeypatch, command, files, [option, *probes[option]])
        changed = [f.name for f in dataclasses.fields(base) if getattr(base, f.name) != getattr(given, f.name)]
        assert changed, f"cryorefine {command} {option} changes nothing the job is handed"
        shown = shown_default(param.get_help_record(ctx))
        if param.is_flag or (shown and not a_value(param, shown)):
            continue
        if shown is None:
            assert all(getattr(base, name) is None for name in changed) or option == "--n", (command, option)
        else:
            assert job_options_of(monkeypatch, command, files, [option, shown]) == base, (command, option, shown)

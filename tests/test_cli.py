"""The command line as a user meets it: output of `info`, and one-line errors with exit code 2."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import make_particle_set, write_mrc

from cryorefine.cli import main


def run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
        raise SystemExit(0)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cryorefine: error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in err


def test_info_particles_text_and_json(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path, n=5, box=16, pixel_size=1.5)
    code, out, _ = run(capsys, "info", str(path))
    assert code == 0
    assert "5 particles" in out and "1.5000 Å/px" in out and "box 16 px" in out and "all present" in out
    assert "rlnAngleRot" in out
    code, out, _ = run(capsys, "info", "--json", str(path))
    info = json.loads(out)
    assert info["n_particles"] == 5
    assert info["optics_groups"][0]["voltage_kv"] == 300.0
    assert info["stacks"] == {"count": 1, "missing": []}
    lo, hi = info["defocus_range_angstrom"]
    assert 10000 <= lo < hi <= 20000


def test_info_reports_missing_stacks(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path)
    (tmp_path / "stack.mrcs").unlink()
    code, out, _ = run(capsys, "info", str(path))
    assert code == 0 and "1 missing" in out


def test_info_mrc_statistics_from_data(tmp_path, capsys):
    vol = np.random.default_rng(0).normal(2.0, 3.0, size=(10, 10, 10)).astype(np.float32)
    write_mrc(tmp_path / "v.mrc", vol, pixel_size=2.2, stack=False)
    code, out, _ = run(capsys, "info", "--json", str(tmp_path / "v.mrc"))
    info = json.loads(out)
    assert info["shape_zyx"] == [10, 10, 10] and info["is_stack"] is False
    assert info["pixel_size_angstrom"] == pytest.approx(2.2)
    assert info["mean"] == pytest.approx(float(vol.mean()), rel=1e-5)
    assert info["rms"] == pytest.approx(float(vol.std()), rel=1e-4)
    assert info["min"] == pytest.approx(float(vol.min())) and info["max"] == pytest.approx(float(vol.max()))


def test_info_real_files(real_data, capsys):
    code, out, _ = run(capsys, "info", "--json", str(real_data / "relion31/relion31.star"))
    info = json.loads(out)
    assert info["n_particles"] == 5 and info["optics_groups"][0]["pixel_size_angstrom"] == pytest.approx(2.806)
    code, out, _ = run(capsys, "info", str(real_data / "relion_outputs/ref_model.mrc"))
    assert "map 100×100×100" in out and "3.5400" in out


def test_missing_file(capsys):
    code, _, err = run(capsys, "info", "no/such/particles.star")
    assert_one_line_error(code, err, "no/such/particles.star", "not found")


def test_unknown_option_is_refused_by_name(capsys, tmp_path):
    code, _, err = run(capsys, "info", "--maxsig", "5", str(tmp_path))
    assert_one_line_error(code, err, "--maxsig")


def test_a_relion_option_not_implemented_is_not_taken_for_a_typo(capsys, tmp_path):
    """--relax_sym is RELION's, not a misspelt --sym: no guess; a near miss (--healpix_ordr) gets one."""
    code, _, err = run(capsys, "refine", "--i", str(tmp_path / "p.star"), "--relax_sym", "C2")
    assert_one_line_error(code, err, "--relax_sym")
    assert "not implemented" in err and "Did you mean" not in err
    code, _, err = run(capsys, "refine", "--i", str(tmp_path / "p.star"), "--healpix_ordr", "3")
    assert_one_line_error(code, err, "Did you mean --healpix_order?")


def test_a_typo_of_an_implemented_option_gets_a_hint_and_is_not_called_unimplemented(capsys, tmp_path):
    """--partcle_diameter is a misspelt --particle_diameter, which refine and classify implement: the hint alone."""
    for command in ("refine", "classify"):
        code, _, err = run(capsys, command, "--i", str(tmp_path / "p.star"), "--partcle_diameter", "200")
        assert_one_line_error(code, err, "No such option: --partcle_diameter. Did you mean --particle_diameter?",
                              f"see `cryorefine {command} --help`")
        assert "not implemented" not in err


def test_truncated_mrc(tmp_path, capsys):
    write_mrc(tmp_path / "s.mrcs", np.ones((5, 16, 16), np.float32))
    raw = (tmp_path / "s.mrcs").read_bytes()
    (tmp_path / "s.mrcs").write_bytes(raw[:-100])
    code, _, err = run(capsys, "info", str(tmp_path / "s.mrcs"))
    assert_one_line_error(code, err, "s.mrcs", "truncated")


def test_missing_required_column(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path)
    path.write_text(path.read_text().replace("_rlnOpticsGroup #", "_rlnOpticsGroupX #", 1))
    code, _, err = run(capsys, "info", str(path))
    assert_one_line_error(code, err, "rlnOpticsGroup", "missing", "data_optics")


def test_conflicting_pixel_sizes(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path, pixel_size=1.5)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((6, 16, 16), np.float32), pixel_size=3.0)
    code, _, err = run(capsys, "info", "--check-images", str(path))
    assert_one_line_error(code, err, "conflicting pixel sizes", "3 Å", "1.5 Å")


@pytest.mark.parametrize("command", ["refine", "classify"])
def test_trust_ref_size_rescales_and_reboxes_a_reference_of_another_size_and_without_it_it_is_refused(
        tmp_path, capsys, caplog, command):
    """RELION 5's GUI writes --trust_ref_size on every Refine3D and Class3D line: a reference of the particles' box
    and pixel size runs as without it; one of another box or pixel size is re-scaled and re-boxed, said in the log;
    without the option it is refused in one line that says to add it (RELION's MlModel::initialiseFromImages), and
    nothing is written."""
    star, _ = make_particle_set(tmp_path, n=6, box=16, pixel_size=6.0)
    rng = np.random.default_rng(1)
    write_mrc(tmp_path / "ref.mrc", rng.normal(size=(16, 16, 16)).astype(np.float32), pixel_size=6.0, stack=False)
    write_mrc(tmp_path / "ref24.mrc", rng.normal(size=(24, 24, 24)).astype(np.float32), pixel_size=6.0, stack=False)
    write_mrc(tmp_path / "ref4A.mrc", rng.normal(size=(16, 16, 16)).astype(np.float32), pixel_size=4.0, stack=False)
    extra = ("--K", "1") if command == "classify" else ()
    common = ("--i", str(star), "--iter", "1", "--cpu", "--firstiter_cc", *extra)
    for name, said in (("ref.mrc", None), ("ref24.mrc", "is re-boxed from 24 to 16 px"),
                       ("ref4A.mrc", "is 16 px at 4 Å/px: re-scaled to 10 px (6.4 Å/px")):
        out = tmp_path / "trusted" / name.removesuffix(".mrc")
        caplog.clear()
        code, _, err = run(capsys, command, *common, "--trust_ref_size", "--ref", str(tmp_path / name), "--o",
                           str(out / "run"))
        assert code == 0, err
        assert (out / "run_it001_optimiser.star").is_file()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--trust_ref_size")]
        assert lines == ([] if said is None else [lines[0]]) and (said is None or said in lines[0]), lines
    for name, fragments in (("ref24.mrc", ("24 px", "16 px")), ("ref4A.mrc", ("4 Å/px", "6 Å/px"))):
        out = tmp_path / name.removesuffix(".mrc")
        code, _, err = run(capsys, command, *common, "--ref", str(tmp_path / name), "--o", str(out / "run"))
        assert_one_line_error(code, err, name, *fragments, "add --trust_ref_size")
        assert not list(out.glob("run_*"))


def test_index_beyond_stack(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path, n=4)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((2, 16, 16), np.float32), pixel_size=1.5)
    code, _, err = run(capsys, "info", "--check-images", str(path))
    assert_one_line_error(code, err, "3@", "beyond the stack")


def test_nan_pixels(tmp_path, capsys):
    path, images = make_particle_set(tmp_path, n=4)
    images[2, 5, 5] = np.inf
    write_mrc(tmp_path / "stack.mrcs", images, pixel_size=1.5)
    code, _, err = run(capsys, "info", "--check-images", str(path))
    assert_one_line_error(code, err, "3@", "NaN or Inf")


def test_mixed_box_sizes(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path, n=4, box=16)
    write_mrc(tmp_path / "stack.mrcs", np.zeros((4, 18, 18), np.float32), pixel_size=1.5)
    code, _, err = run(capsys, "info", "--check-images", str(path))
    assert_one_line_error(code, err, "18 px", "rlnImageSize")


def test_check_images_passes_on_good_data(tmp_path, capsys):
    path, _ = make_particle_set(tmp_path, n=4)
    code, out, _ = run(capsys, "info", "--check-images", str(path))
    assert code == 0 and "all 4 images readable and finite" in out


def test_debug_shows_traceback(capsys):
    from cryorefine.errors import InputError

    with pytest.raises(InputError):
        main(["--debug", "info", "no/such/file.star"])


def test_console_script_runs(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "cryorefine", "info", str(tmp_path / "x.star")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "x.star" in done.stderr


def test_the_console_script_ends_at_once_with_its_whole_output_and_code(tmp_path):
    """`console_main` ends the process with os._exit: what it printed to a pipe is all there, and --debug's
    traceback still comes (an exception other than SystemExit ends it as Python does)."""
    import subprocess
    import sys

    path, _ = make_particle_set(tmp_path, n=5)
    done = subprocess.run([sys.executable, "-m", "cryorefine", "info", str(path)], capture_output=True, text=True)
    shown = subprocess.run([sys.executable, "-c", f"from cryorefine.cli import main; main(['info', {str(path)!r}])"],
                           capture_output=True, text=True)
    assert done.returncode == 0 and shown.returncode == 0
    assert done.stdout == shown.stdout and "5" in done.stdout  # every line, as an ordinary exit gives them
    debug = subprocess.run([sys.executable, "-m", "cryorefine", "--debug", "info", str(tmp_path / "none.star")],
                           capture_output=True, text=True)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "InputError" in debug.stderr


def test_nan_pixels_met_by_refine_name_the_image_and_leave_no_iteration_files(tmp_path, capsys):
    """The E-step reads images unchecked and checks them where it prepares them: the same one-line error."""
    path, images = make_particle_set(tmp_path, n=6)
    images[4, 3, 3] = np.nan
    write_mrc(tmp_path / "stack.mrcs", images, pixel_size=1.5)
    write_mrc(tmp_path / "ref.mrc", np.ones((16, 16, 16), np.float32), pixel_size=1.5)
    out = tmp_path / "out"
    code, _, err = run(capsys, "refine", "--i", str(path), "--ref", str(tmp_path / "ref.mrc"), "--o",
                       str(out / "run"), "--ini_high", "10", "--iter", "1", "--cpu")
    assert_one_line_error(code, err, "5@", "NaN or Inf")
    assert not list(out.glob("run_it*")) if out.exists() else True


def test_a_full_disk_is_named_with_what_to_do_not_as_an_internal_error(tmp_path, capsys, monkeypatch):
    """A map that does not fit on the output's disk: one line saying so, --continue named, exit code 3."""
    import errno

    from cryorefine.io import mrc

    path, images = make_particle_set(tmp_path, n=6)
    write_mrc(tmp_path / "stack.mrcs", images, pixel_size=1.5)
    write_mrc(tmp_path / "ref.mrc", np.ones((16, 16, 16), np.float32), pixel_size=1.5)

    def full(name, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(name))

    monkeypatch.setattr(mrc, "write_volume", full)
    code, _, err = run(capsys, "refine", "--i", str(path), "--ref", str(tmp_path / "ref.mrc"), "--o",
                       str(tmp_path / "out" / "run"), "--ini_high", "10", "--iter", "1", "--cpu")
    lines = err.strip().splitlines()
    assert code == 3 and len(lines) == 1, err
    assert lines[0].startswith("cryorefine: error: no space left on the device writing ")
    assert "run_it000_half1_class001.mrc" in lines[0] and "--continue" in lines[0]  # the first map: iteration 0's
    assert "internal error" not in err and "Traceback" not in err


def _fake_cupy():
    """A stand-in for CuPy's two out-of-memory exception types (the CPU machine has no CuPy)."""
    import types

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    class OutOfMemoryError(MemoryError):
        pass

    runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError)
    memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, memory=memory))


@pytest.mark.parametrize("status, code, start", [(2, 3, "the GPU's memory ran out outside cryorefine's arena"),
                                                 (None, 3, "the GPU's memory ran out outside cryorefine's arena"),
                                                 (700, 1, "internal error")])
def test_a_gpu_out_of_memory_says_so_in_one_line(tmp_path, capsys, monkeypatch, status, code, start):
    """A CUDA call that fails for memory (cudaErrorMemoryAllocation, status 2: e.g. the context's creation on a GPU
    another process has filled) or CuPy's OutOfMemoryError (status None here; a MemoryError) is one line naming the
    likely cause and what to do, exit 3, not an internal error or a host's lack of memory; another CUDA error stays
    an internal error."""
    import sys

    from cryorefine.io import mrc

    path, images = make_particle_set(tmp_path, n=6)
    write_mrc(tmp_path / "stack.mrcs", images, pixel_size=1.5)
    write_mrc(tmp_path / "ref.mrc", np.ones((16, 16, 16), np.float32), pixel_size=1.5)
    cupy = _fake_cupy()

    def failing(*args, **kwargs):
        if status is None:
            raise cupy.cuda.memory.OutOfMemoryError("Out of memory allocating 1,024 bytes")
        raise cupy.cuda.runtime.CUDARuntimeError(status)

    monkeypatch.setattr(mrc, "write_volume", failing)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    code_seen, _, err = run(capsys, "refine", "--i", str(path), "--ref", str(tmp_path / "ref.mrc"), "--o",
                            str(tmp_path / "out" / "run"), "--ini_high", "10", "--iter", "1", "--cpu")
    lines = err.strip().splitlines()
    assert code_seen == code and len(lines) == 1, err
    assert lines[0].startswith(f"cryorefine: error: {start}"), err
    assert ("nvidia-smi" in lines[0]) == (code == 3)


def test_relion_gpu_strings_give_one_device_per_worker():
    import click

    from cryorefine.cli import parse_gpu_ids

    assert parse_gpu_ids("") == ()  # RELION's automatic assignment (runners.mpi.device_of_worker)
    assert parse_gpu_ids("1") == (1,)
    assert parse_gpu_ids("0:1:2:3") == (0, 1, 2, 3)
    assert parse_gpu_ids("0,1:2,3") == (0, 2)  # RELION: ':' between MPI workers, ',' between a worker's threads
    assert parse_gpu_ids("2,3") == (2,)
    with pytest.raises(click.UsageError):
        parse_gpu_ids("0:gpu1")


def small_refine_inputs(folder):
    """A tiny particle set, its reference and the options of a quick CPU refinement."""
    path, images = make_particle_set(folder, n=6)
    write_mrc(folder / "ref.mrc", np.ones((16, 16, 16), np.float32), pixel_size=1.5, stack=False)
    return ["--i", str(path), "--ref", str(folder / "ref.mrc"), "--ini_high", "10", "--cpu"]


def earlier_run_files(out):
    """The files an earlier converged run of 18 iterations left under out/run (their content does not matter)."""
    out.mkdir(parents=True, exist_ok=True)
    for iteration in (1, 2, 18):
        for suffix in ("optimiser.star", "resume.npz", "half1_class001.mrc"):
            (out / f"run_it{iteration:03d}_{suffix}").write_text("earlier run")
    for name in ("run_class001.mrc", "run_data.star", "run_model.star", "run_optimiser.star"):
        (out / name).write_text("earlier run")
    return sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("command", ["refine", "classify"])
def test_a_new_run_on_the_root_of_an_earlier_run_is_refused_naming_it_and_the_way_on(tmp_path, capsys, command):
    """--o out/run over another run's files: one line naming the folder, the run found and --continue of its last
    iteration, exit 2, before any work (its files untouched, no file of the new run)."""
    out = tmp_path / "out"
    before = earlier_run_files(out)
    code, stdout, err = run(capsys, command, *small_refine_inputs(tmp_path), "--o", str(out / "run"), "--iter", "1")
    assert_one_line_error(code, err, f"--o {out / 'run'}", f"{out} holds iterations 1–18 and the final files",
                          "of an earlier run", f"--continue {out / 'run'}_it018_optimiser.star", "a new --o",
                          "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == before
    assert all((out / name).read_text() == "earlier run" for name in before)
    assert stdout == ""


def test_a_root_with_only_the_final_files_of_a_run_is_refused_without_a_continue_line(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run_data.star").write_text("earlier run")
    code, _, err = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(out / "run"), "--iter", "1")
    assert_one_line_error(code, err, "the final files (run_data.star) of an earlier run", "a new --o")
    assert "--continue" not in err


def test_overwrite_removes_the_earlier_runs_files_and_a_new_root_beside_them_is_free(tmp_path, capsys):
    """--overwrite: the earlier run's files with that root are gone, the new run's are there; another root in the
    same folder (out/other) is not another run's and is neither refused nor touched."""
    out = tmp_path / "out"
    earlier_run_files(out)
    (out / "notes.txt").write_text("mine")
    inputs = small_refine_inputs(tmp_path)
    code, stdout, _ = run(capsys, "refine", *inputs, "--o", str(out / "other"), "--iter", "1")
    assert code == 0 and (out / "other_it001_optimiser.star").is_file()
    code, stdout, _ = run(capsys, "refine", *inputs, "--o", str(out / "run"), "--iter", "1", "--overwrite")
    assert code == 0
    names = {p.name for p in out.iterdir()}
    assert not names & {"run_it002_optimiser.star", "run_it018_optimiser.star", "run_it018_resume.npz",
                        "run_class001.mrc", "run_data.star", "run_model.star", "run_optimiser.star"}
    assert {"run_it001_optimiser.star", "run_it001_resume.npz", "notes.txt", "other_it001_optimiser.star"} <= names
    assert (out / "run_it001_half1_class001.mrc").read_bytes() != b"earlier run"


def test_overwrite_is_in_the_help_of_refine_and_classify(capsys):
    for command in ("refine", "classify"):
        code, stdout, _ = run(capsys, command, "--help")
        assert code == 0 and "--overwrite" in stdout


def test_the_end_line_of_a_run_stopped_by_iter_names_its_own_last_maps_and_says_not_converged(tmp_path, capsys):
    code, stdout, _ = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(tmp_path / "out" / "run"),
                          "--iter", "2")
    assert code == 0
    root = tmp_path / "out" / "run_it002"
    assert stdout.strip().splitlines()[-1].startswith("not converged after 2 iterations (--iter); resolution ")
    for name in ("half1_class001.mrc", "half2_class001.mrc"):
        assert f"{root}_{name}" in stdout and Path(f"{root}_{name}").is_file()
    assert f"--continue {root}_optimiser.star" in stdout
    assert "run_class001.mrc" not in stdout


def test_a_continued_run_says_where_it_went_on_from_and_names_no_map_it_did_not_write(tmp_path, capsys, caplog):
    """--continue from iteration 1 (no --o: RELION's root run_ct1) where a map of an earlier converged run with that
    root lies (run_ct1_class001.mrc): the run says it went on from iteration 1, and its end line counts the
    iteration it ran, names its number and this run's maps, not that map."""
    out = tmp_path / "out"
    assert run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(out / "run"), "--iter", "1")[0] == 0
    (out / "run_ct1_class001.mrc").write_text("an earlier run's map")
    with caplog.at_level("INFO", logger="cryorefine"):
        code, stdout, _ = run(capsys, "refine", "--continue", str(out / "run_it001_optimiser.star"), "--iter", "2")
    assert code == 0
    assert "continued from iteration 1" in caplog.text
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("not converged after 1 iteration (iteration 2, continued from iteration 1)"), last
    assert f"{out / 'run_ct1_it002'}_half1_class001.mrc" in last and "class001.mrc " not in f"{last} "


def test_the_end_line_of_a_converged_run_names_its_final_map(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    from cryorefine.em import schedule

    original = schedule.check_convergence

    def converge_at_two(optimiser, state, **kwargs):
        optimiser = original(optimiser, state, **kwargs)
        return replace(optimiser, has_converged=True, do_join_halves=True) if optimiser.iteration == 2 else optimiser

    monkeypatch.setattr(schedule, "check_convergence", converge_at_two)
    code, stdout, _ = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(tmp_path / "run"),
                          "--iter", "5")
    assert code == 0
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("converged after 2 iterations; final resolution ") and \
        last.endswith(f"map: {tmp_path / 'run'}_class001.mrc"), last
    assert (tmp_path / "run_class001.mrc").is_file()


def test_the_end_line_of_a_continued_classification_counts_its_iterations(tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "classify", *small_refine_inputs(tmp_path), "--K", "1", "--o", str(out / "run"),
               "--iter", "1")[0] == 0
    code, stdout, _ = run(capsys, "classify", "--continue", str(out / "run_it001_optimiser.star"), "--iter", "3")
    assert code == 0
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("2 iterations (iterations 2–3, continued from iteration 1); resolution "), last
    assert last.endswith(f"maps: {out / 'run_ct1'}_it003_class*.mrc")  # no --o: RELION's run_ct1


def interrupt_at(monkeypatch, iteration, interruption=KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) as a refinement plans `iteration`."""
    from cryorefine.jobs.refine import RefineJob

    original = RefineJob.plan

    def plan(self, run_state, planned, estimate_accuracy=None):
        if planned == iteration:
            raise interruption()
        return original(self, run_state, planned, estimate_accuracy)

    monkeypatch.setattr(RefineJob, "plan", plan)


def test_ctrl_c_names_the_last_complete_iteration_and_the_continue_line_that_resumes_it(tmp_path, capsys,
                                                                                       monkeypatch):
    """Ctrl-C in iteration 3: one line naming iteration 2 and the exact --continue line, exit 130; that line
    resumes the run; Ctrl-C in the first iteration of that continued run names the file it went on from."""
    star = tmp_path / "out" / "run_it002_optimiser.star"
    interrupt_at(monkeypatch, 3)
    code, _, err = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(tmp_path / "out" / "run"),
                       "--iter", "5")
    assert code == 130
    assert err.strip() == (f"cryorefine: error: interrupted (Ctrl-C); iteration 2 is the last complete one: resume "
                           f"with `cryorefine refine --continue {star}`")
    assert star.is_file() and not (tmp_path / "out" / "run_it003_optimiser.star").exists()
    code, _, err = run(capsys, "refine", "--continue", str(star), "--o", str(tmp_path / "again" / "run"))
    assert code == 130 and f"iteration 2 is the last complete one: resume with `cryorefine refine --continue {star}`" \
        in err
    monkeypatch.undo()
    code, stdout, _ = run(capsys, "refine", "--continue", str(star), "--iter", "3")
    assert code == 0 and "continued from iteration 2" in stdout


def test_ctrl_c_in_the_first_iteration_names_iteration_0_and_before_it_there_is_nothing_to_continue_from(
        tmp_path, capsys, monkeypatch):
    """Ctrl-C in iteration 1: iteration 0's files (RELION's run_it000_*, written before iteration 1) are the last
    complete ones, and their --continue line runs iteration 1; Ctrl-C as the run starts, before them: nothing to
    continue from."""
    from cryorefine.jobs.refine import RefineJob

    star = tmp_path / "run_it000_optimiser.star"
    interrupt_at(monkeypatch, 1)
    code, _, err = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(tmp_path / "run"), "--iter", "2")
    assert code == 130
    assert err.strip() == (f"cryorefine: error: interrupted (Ctrl-C); iteration 0 is the last complete one: resume "
                           f"with `cryorefine refine --continue {star}`")
    monkeypatch.undo()
    code, stdout, _ = run(capsys, "refine", "--continue", str(star), "--iter", "1")
    assert code == 0 and "(iteration 1, continued from iteration 0)" in stdout
    assert (tmp_path / "run_ct0_it001_half1_class001.mrc").is_file()  # no --o: RELION's run_ct0

    def interrupted_start(self, *args):
        raise KeyboardInterrupt()

    monkeypatch.setattr(RefineJob, "start", interrupted_start)
    code, _, err = run(capsys, "refine", *small_refine_inputs(tmp_path), "--o", str(tmp_path / "again" / "run"),
                       "--iter", "2")
    assert code == 130 and "before iteration 1 was complete: nothing to continue from" in err
    assert len(err.strip().splitlines()) == 1


def test_sigterm_names_the_last_complete_iteration_and_the_continue_line(tmp_path):
    """SIGTERM (a scheduler's stop) as iteration 3 starts, in a process of its own: the same line as Ctrl-C, exit
    code 143 (128 + SIGTERM), the iteration named complete."""
    import subprocess
    import sys

    inputs = small_refine_inputs(tmp_path)
    script = ("import os, signal, sys\n"
              "from cryorefine.jobs.refine import RefineJob\n"
              "from cryorefine.cli import main\n"
              "original = RefineJob.plan\n"
              "def plan(self, state, iteration, estimate_accuracy=None):\n"
              "    if iteration == 3:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return original(self, state, iteration, estimate_accuracy)\n"
              "RefineJob.plan = plan\n"
              "main(sys.argv[1:])\n")
    done = subprocess.run([sys.executable, "-c", script, "refine", *inputs, "--o", str(tmp_path / "run"),
                           "--iter", "5"], capture_output=True, text=True, timeout=300)
    star = tmp_path / "run_it002_optimiser.star"
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"cryorefine: error: interrupted (SIGTERM); iteration 2 is the last complete one: resume with "
        f"`cryorefine refine --continue {star}`")
    assert star.is_file()


def test_the_progress_bar_is_cleared_as_each_iteration_ends():
    """On a terminal each iteration's bar goes once its particles are done, before the iteration's lines and the
    process's quick end; elsewhere there is no bar."""
    import io
    import re

    from cryorefine.cli import _progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    update = _progress_bar(screen)
    for total in (10, 6):  # two iterations
        update(4, total)
        assert f"/{total} " in screen.getvalue().rsplit("\r", 1)[-1]  # a bar of this iteration's total drawn
        update(total - 4, total)
        assert re.search(r"\r +\r$", screen.getvalue())  # the bar's line blanked and the cursor back at its start
    assert _progress_bar(io.StringIO()) is None  # not a terminal: silent

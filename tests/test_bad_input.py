"""Every bad input refused at the door: exit 2, one short message naming the culprit, no traceback, no output.

A battery of malformed files and invocations of every command, built from one small valid particle set,
and a property-style test that feeds random bytes and random truncations of valid files to the commands.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import starfile
from conftest import make_particle_set, write_mrc

from cryorefine.cli import main


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    """A valid 16 px particle set (6 particles, RELION 3.1 file) and a 16 px reference beside it."""
    folder = tmp_path_factory.mktemp("valid")
    star, _ = make_particle_set(folder, n=6, box=16, pixel_size=4.0, seed=3)
    rng = np.random.default_rng(4)
    write_mrc(folder / "ref.mrc", rng.normal(size=(16, 16, 16)).astype(np.float32), pixel_size=4.0, stack=False)
    return folder


def run(capsys, args):
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def edit_star(folder, particles=None, optics=None):
    """folder/particles.star with its tables changed by the given functions (DataFrame -> DataFrame)."""
    blocks = starfile.read(folder / "particles.star", always_dict=True)
    if particles:
        blocks["particles"] = particles(blocks["particles"])
    if optics:
        blocks["optics"] = optics(blocks["optics"])
    starfile.write(blocks, folder / "particles.star")


def set_column(name, value, row=None, table="particles"):
    def change(df):
        if name not in df.columns:  # a valid column first, then the bad value
            df[name] = 1
        df[name] = df[name].astype(object)
        if row is None:
            df[name] = value
        else:
            df.loc[row, name] = value
        return df
    return {table: change}


def drop_column(name, table="particles"):
    return {table: lambda df: df.drop(columns=[name])}


REFINE = ("refine", "--i", "{d}/particles.star", "--ref", "{d}/ref.mrc", "--o", "{d}/out/run", "--iter", "1", "--cpu",
          "--particle_diameter", "40")
CLASSIFY = ("classify", "--i", "{d}/particles.star", "--ref", "{d}/ref.mrc", "--o", "{d}/out/run", "--iter", "1",
            "--cpu", "--K", "2", "--particle_diameter", "40")
CLASS2D = ("class2d", "--i", "{d}/particles.star", "--o", "{d}/out/run", "--iter", "1", "--cpu", "--K", "2",
           "--particle_diameter", "40")
INITIAL_MODEL = ("initial_model", "--i", "{d}/particles.star", "--o", "{d}/out/run", "--iter", "1", "--cpu",
                 "--particle_diameter", "40")
RECONSTRUCT = ("reconstruct", "--i", "{d}/particles.star", "--o", "{d}/out/map.mrc")
SIMULATE = ("simulate", "--ref", "{d}/ref.mrc", "--n", "4", "--o", "{d}/out", "--cpu")
PLAN = ("plan", "--i", "{d}/particles.star", "--ref", "{d}/ref.mrc", "--o", "{d}/out/run")

# (name, command, extra arguments, change to the STAR file (kwargs of edit_star) or a callable(folder), culprit)
CASES = [
    # STAR values, every column the reader uses
    ("text in rlnDefocusU", REFINE, (), set_column("rlnDefocusU", "abc", row=2), "rlnDefocusU"),
    ("text in rlnDefocusV", RECONSTRUCT, ("--ctf",), set_column("rlnDefocusV", "x", row=0), "rlnDefocusV"),
    ("text in rlnDefocusAngle", REFINE, ("--ctf",), set_column("rlnDefocusAngle", "?", row=1), "rlnDefocusAngle"),
    ("text in rlnAngleRot", RECONSTRUCT, (), set_column("rlnAngleRot", "north", row=3), "rlnAngleRot"),
    ("text in rlnAngleTilt", RECONSTRUCT, (), set_column("rlnAngleTilt", "up", row=3), "rlnAngleTilt"),
    ("text in rlnAnglePsi", RECONSTRUCT, (), set_column("rlnAnglePsi", "--", row=5), "rlnAnglePsi"),
    ("text in rlnOriginXAngst", REFINE, (), set_column("rlnOriginXAngst", "left", row=0), "rlnOriginXAngst"),
    ("text in rlnOriginYAngst", RECONSTRUCT, (), set_column("rlnOriginYAngst", "o", row=4), "rlnOriginYAngst"),
    ("NaN in rlnDefocusU", REFINE, ("--ctf",), set_column("rlnDefocusU", "nan", row=1), "rlnDefocusU"),
    ("inf in rlnAngleRot", RECONSTRUCT, (), set_column("rlnAngleRot", "inf", row=1), "rlnAngleRot"),
    ("text in rlnCtfBfactor", RECONSTRUCT, ("--ctf",), set_column("rlnCtfBfactor", "b"), "rlnCtfBfactor"),
    ("text in rlnPhaseShift", RECONSTRUCT, ("--ctf",), set_column("rlnPhaseShift", "p"), "rlnPhaseShift"),
    ("text in rlnCtfScalefactor", RECONSTRUCT, ("--ctf",), set_column("rlnCtfScalefactor", "s"), "rlnCtfScalefactor"),
    ("text in rlnNormCorrection", REFINE, ("--norm",), set_column("rlnNormCorrection", "n"), "rlnNormCorrection"),
    ("text in rlnRandomSubset", REFINE, (), set_column("rlnRandomSubset", "half"), "rlnRandomSubset"),
    ("text in rlnClassNumber", CLASSIFY, (), set_column("rlnClassNumber", "c"), "rlnClassNumber"),
    ("text in rlnOpticsGroup", REFINE, (), set_column("rlnOpticsGroup", "g", row=0), "rlnOpticsGroup"),
    ("unknown optics group", REFINE, (), set_column("rlnOpticsGroup", 7, row=0), "rlnOpticsGroup"),
    ("negative pixel size", REFINE, (), set_column("rlnImagePixelSize", -4.0, table="optics"), "rlnImagePixelSize"),
    ("zero pixel size", RECONSTRUCT, (), set_column("rlnImagePixelSize", 0.0, table="optics"), "rlnImagePixelSize"),
    ("text pixel size", RECONSTRUCT, (), set_column("rlnImagePixelSize", "px", table="optics"), "rlnImagePixelSize"),
    ("amplitude contrast 1.5", REFINE, ("--ctf",), set_column("rlnAmplitudeContrast", 1.5, table="optics"),
     "rlnAmplitudeContrast"),
    ("negative voltage", REFINE, ("--ctf",), set_column("rlnVoltage", -300.0, table="optics"),
     "column rlnVoltage: -300.0 is not"),  # a number as written, not numpy's repr
    ("text Cs", RECONSTRUCT, ("--ctf",), set_column("rlnSphericalAberration", "cs", table="optics"),
     "rlnSphericalAberration"),
    ("text image size", REFINE, (), set_column("rlnImageSize", "big", table="optics"), "rlnImageSize"),
    ("no rlnImageName", REFINE, (), drop_column("rlnImageName"), "rlnImageName"),
    ("malformed image name", REFINE, (), set_column("rlnImageName", "two@stack.mrcs", row=1), "two@stack.mrcs"),
    ("image index 0", RECONSTRUCT, (), set_column("rlnImageName", "000000@stack.mrcs", row=1), "stack.mrcs"),
    ("image index 0 names the STAR file", REFINE, (), set_column("rlnImageName", "0@stack.mrcs", row=2),
     "particles.star"),
    ("image index beyond the stack", REFINE, (), set_column("rlnImageName", "000099@stack.mrcs", row=1), "stack.mrcs"),
    ("missing stack", RECONSTRUCT, (), set_column("rlnImageName", "000001@gone.mrcs", row=1), "gone.mrcs"),
    ("no particles", REFINE, (), {"particles": lambda df: df.iloc[:0]}, "particles.star"),
    # files of every kind the commands open
    ("STAR file of random bytes", REFINE, (), lambda d: (d / "particles.star").write_bytes(bytes(range(256)) * 4),
     "particles.star"),
    ("STAR file cut in half", RECONSTRUCT, (),
     lambda d: (d / "particles.star").write_text((d / "particles.star").read_text()[:300]), "particles.star"),
    ("reference of random bytes", REFINE, (), lambda d: (d / "ref.mrc").write_bytes(b"\x01" * 5000), "ref.mrc"),
    ("reference cut short", REFINE, (), lambda d: (d / "ref.mrc").write_bytes((d / "ref.mrc").read_bytes()[:3000]),
     "ref.mrc"),
    ("reference of another box", REFINE, (),
     lambda d: write_mrc(d / "ref.mrc", np.ones((20, 20, 20), np.float32), pixel_size=4.0, stack=False), "ref.mrc"),
    ("stack cut short", RECONSTRUCT, (),
     lambda d: (d / "stack.mrcs").write_bytes((d / "stack.mrcs").read_bytes()[:2000]), "stack.mrcs"),
    ("stack with an unknown MRC mode", RECONSTRUCT, (), lambda d: _set_mode(d / "stack.mrcs", 9), "stack.mrcs"),
    ("missing --i", REFINE, (), lambda d: (d / "particles.star").unlink(), "particles.star"),
    ("missing --ref", CLASSIFY, (), lambda d: (d / "ref.mrc").unlink(), "ref.mrc"),
    ("--o under a regular file", REFINE, ("--o", "{d}/afile/run"), lambda d: (d / "afile").write_text("x"), "afile"),
    ("reconstruct --o under a regular file", RECONSTRUCT, ("--o", "{d}/afile/map.mrc"),
     lambda d: (d / "afile").write_text("x"), "afile"),
    ("simulate --o is a regular file", SIMULATE, ("--o", "{d}/afile"), lambda d: (d / "afile").write_text("x"),
     "afile"),
    ("info on random bytes", ("info", "{d}/junk.star"), (), lambda d: (d / "junk.star").write_bytes(bytes(range(256))),
     "junk.star"),
    ("info on an MRC cut short", ("info", "{d}/ref.mrc"), (),
     lambda d: (d / "ref.mrc").write_bytes((d / "ref.mrc").read_bytes()[:1100]), "ref.mrc"),
    ("--continue from a cut resume file", ("refine", "--continue", "{d}/run_it001_optimiser.star"), (),
     lambda d: _cut_resume(d), "run_it001_resume.npz"),
    ("--continue from a garbage optimiser star", ("refine", "--continue", "{d}/bad_it001_optimiser.star"), (),
     lambda d: (d / "bad_it001_optimiser.star").write_bytes(b"\x00\xff" * 100), "bad_it001"),
    # numeric options, RELION's ranges
    ("--healpix_order 99", REFINE, ("--healpix_order", "99"), None, "--healpix_order"),
    ("--healpix_order -1", REFINE, ("--healpix_order", "-1"), None, "--healpix_order"),
    ("--auto_local_healpix_order -2", REFINE, ("--auto_local_healpix_order", "-2"), None, "--auto_local_healpix_order"),
    ("--offset_range -3", REFINE, ("--offset_range", "-3"), None, "--offset_range"),
    ("--offset_step 0", REFINE, ("--offset_step", "0"), None, "--offset_step"),
    ("--batch 0", REFINE, ("--batch", "0"), None, "--batch"),
    ("--pool 0", REFINE, ("--pool", "0"), None, "--pool 0"),
    ("classify's --K given to refine", REFINE, ("--K", "3"), None, "cryorefine classify"),
    ("--pad 0", REFINE, ("--pad", "0"), None, "--pad"),
    ("--tau2_fudge 0", CLASSIFY, ("--tau2_fudge", "0"), None, "--tau2_fudge"),
    ("--adaptive_fraction 1.5", REFINE, ("--adaptive_fraction", "1.5"), None, "--adaptive_fraction"),
    ("--oversampling -1", REFINE, ("--oversampling", "-1"), None, "--oversampling"),
    ("--iter 0", CLASSIFY, ("--iter", "0"), None, "--iter"),
    ("--particle_diameter -10", REFINE, ("--particle_diameter", "-10"), None, "--particle_diameter"),
    ("--ini_high -5", REFINE, ("--ini_high", "-5"), None, "--ini_high"),
    ("--free_gpu_memory -1", REFINE, ("--free_gpu_memory", "-1"), None, "--free_gpu_memory"),
    ("--K 0", CLASSIFY, ("--K", "0"), None, "--K"),
    ("plan --gpu_memory -1", PLAN, ("--gpu_memory", "-1"), None, "--gpu_memory"),
    ("plan --gpu_memory below --free_gpu_memory", PLAN, ("--gpu_memory", "1"), None, "--free_gpu_memory 2048 MB"),
    ("plan --gpu_tflops 0", PLAN, ("--gpu_tflops", "0"), None, "--gpu_tflops"),
    ("plan --healpix_order 40", PLAN, ("--healpix_order", "40"), None, "--healpix_order"),
    ("simulate --n 0", SIMULATE, ("--n", "0"), None, "--n"),
    ("simulate --snr -1", SIMULATE, ("--snr", "-1"), None, "--snr"),
    ("simulate --defocus abc", SIMULATE, ("--defocus", "abc"), None, "--defocus"),
    ("simulate --angpix 0", SIMULATE, ("--angpix", "0"), None, "--angpix"),
    ("simulate --batch 0", SIMULATE, ("--batch", "0"), None, "--batch"),
    ("simulate --n beyond the disk", SIMULATE, ("--n", "1000000000000"), None, "--n 1000000000000"),
    ("reconstruct --maxres -2", RECONSTRUCT, ("--maxres", "-2"), None, "--maxres"),
    ("reconstruct --pad 0", RECONSTRUCT, ("--pad", "0"), None, "--pad"),
    ("reconstruct --batch 0", RECONSTRUCT, ("--batch", "0"), None, "--batch"),
    ("reconstruct --sym X9", RECONSTRUCT, ("--sym", "X9"), None, "X9"),
    ("refine --sym X9", REFINE, ("--sym", "X9"), None, "X9"),
    ("classify --sym D", CLASSIFY, ("--sym", "D"), None, "--sym D"),
    ("refine --sym I5", REFINE, ("--sym", "I5"), None, "I5"),
    ("classify --sym C1,C2", CLASSIFY, ("--sym", "C1,C2"), None, "--sym C1,C2"),
    ("refine --sym I --healpix_order 1", REFINE, ("--sym", "I", "--healpix_order", "1"), None, "--healpix_order 2"),
    ("plan --sym S3", PLAN, ("--sym", "S3"), None, "S3"),
    ("--offset_range beyond half the box", REFINE, ("--offset_range", "9"), None, "--offset_range 9"),
    ("classify --offset_range beyond half the box", CLASSIFY, ("--offset_range", "100"), None, "--offset_range 100"),
    ("plan --offset_range beyond half the box", PLAN, ("--offset_range", "12"), None, "--offset_range 12"),
    # the 2D classification and the initial model: their own options, and the particle files they read
    ("class2d --K 0", CLASS2D, ("--K", "0"), None, "--K 0"),
    ("class2d --psi_step 0", CLASS2D, ("--psi_step", "0"), None, "--psi_step 0"),
    ("class2d --psi_step 400", CLASS2D, ("--psi_step", "400"), None, "--psi_step 400"),
    ("class2d --grad_write_iter 0", CLASS2D, ("--grad", "--grad_write_iter", "0"), None, "--grad_write_iter 0"),
    ("class2d --class_inactivity_threshold -1", CLASS2D, ("--grad", "--class_inactivity_threshold", "-1"), None,
     "--class_inactivity_threshold -1"),
    ("class2d --fast_subsets with --grad", CLASS2D, ("--grad", "--fast_subsets"), None, "--fast_subsets"),
    ("class2d --offset_range beyond half the box", CLASS2D, ("--offset_range", "100"), None, "--offset_range 100"),
    ("class2d --ref", CLASS2D, ("--ref", "{d}/ref.mrc"), None, "--ref"),
    ("class2d image index beyond the stack", CLASS2D, (), set_column("rlnImageName", "000099@stack.mrcs", row=1),
     "stack.mrcs"),
    ("class2d text in rlnAnglePsi", CLASS2D, (), set_column("rlnAnglePsi", "--", row=2), "rlnAnglePsi"),
    ("initial_model --K 0", INITIAL_MODEL, ("--K", "0"), None, "--K 0"),
    ("initial_model --sym X9", INITIAL_MODEL, ("--sym", "X9"), None, "X9"),
    ("initial_model --healpix_order 99", INITIAL_MODEL, ("--healpix_order", "99"), None, "--healpix_order 99"),
    ("initial_model --offset_step 0", INITIAL_MODEL, ("--offset_step", "0"), None, "--offset_step 0"),
    ("initial_model --tau2_fudge 0", INITIAL_MODEL, ("--tau2_fudge", "0"), None, "--tau2_fudge 0"),
    ("initial_model missing stack", INITIAL_MODEL, (), set_column("rlnImageName", "000001@gone.mrcs", row=1),
     "gone.mrcs"),
    # output folders that cannot be made (/proc takes no new folder, even from root)
    *[pytest.param(name, command, extra, None, option,
                   marks=pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc"), id=name)
      for name, command, extra, option in (
          ("--o in a folder that takes none", REFINE, ("--o", "/proc/cryorefine_none/run"), "--o"),
          ("classify --scratch_dir in a folder that takes none", CLASSIFY,
           ("--scratch_dir", "/proc/cryorefine_none"), "--scratch_dir"),
          ("reconstruct --o in a folder that takes none", RECONSTRUCT, ("--o", "/proc/cryorefine_none/map.mrc"),
           "--o"),
          ("simulate --o in a folder that takes none", SIMULATE, ("--o", "/proc/cryorefine_none"), "--o"),
          ("plan --o in a folder that takes none", PLAN, ("--o", "/proc/cryorefine_none/run"), "--o"),
          ("--pipeline_control in a folder that takes none", REFINE, ("--pipeline_control", "/proc/cryorefine_none"),
           "--pipeline_control"))],
]


def _set_mode(path, mode):
    data = bytearray(path.read_bytes())
    data[12:16] = int(mode).to_bytes(4, "little")
    path.write_bytes(bytes(data))


def _cut_resume(folder):
    """A first iteration's files whose resume file lost its second half."""
    assert run_quiet(["refine", "--i", folder / "particles.star", "--ref", folder / "ref.mrc", "--o", folder / "run",
                      "--iter", "1", "--cpu", "--particle_diameter", "40"]) == 0
    path = folder / "run_it001_resume.npz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def run_quiet(args):
    try:
        main([str(a) for a in args])
    except SystemExit as exc:
        return exc.code
    return 0


def outputs_under(folder, before):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p not in before)


@pytest.mark.parametrize("name, command, extra, change, culprit", CASES,
                         ids=[c.id if hasattr(c, "id") else c[0] for c in CASES])
def test_bad_input_is_refused_with_one_line_naming_it(valid, tmp_path, capsys, name, command, extra, change, culprit):
    folder = tmp_path / "case"
    shutil.copytree(valid, folder)
    if isinstance(change, dict):
        edit_star(folder, **change)
    elif change is not None:
        change(folder)
    capsys.readouterr()
    before = set(p for p in folder.rglob("*") if p.is_file())
    args = [a.format(d=folder) for a in command]
    extra = [a.format(d=folder) for a in extra]
    if "--o" in extra and "--o" in args:  # the case's own --o replaces the command's
        i = args.index("--o")
        del args[i:i + 2]
    code, err = run(capsys, args + extra)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == 2, (code, err[-3000:])
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    assert 1 <= len(lines) <= 3, err
    assert culprit in err, (culprit, err)
    assert outputs_under(folder, before) == [], outputs_under(folder, before)


def test_simulate_refuses_more_particles_than_the_memory_holds(valid, tmp_path, capsys, monkeypatch):
    """A table larger than the memory available is refused before anything is drawn or written (the kernel's
    out-of-memory killer would end the process without a word); the check asks the machine, so the test gives it a
    small answer."""
    from cryorefine.core import arrays
    from cryorefine.jobs import simulate

    folder = tmp_path / "case"
    shutil.copytree(valid, folder)
    monkeypatch.setattr(arrays, "available_memory_bytes", lambda: 10 * simulate.HOST_BYTES_PER_PARTICLE)
    args = [a.format(d=folder) for a in SIMULATE]
    args[args.index("--n") + 1] = "11"
    code, err = run(capsys, args)
    assert code == 2, err
    assert "--n 11" in err and "memory" in err and "Traceback" not in err, err
    assert not (folder / "out").exists()
    args[args.index("--n") + 1] = "10"  # as many as it holds: made
    code, err = run(capsys, args)
    assert code == 0, err
    assert (folder / "out" / "particles.star").is_file()


COMMANDS = {"info": ("info", "{d}/{f}"), "reconstruct": RECONSTRUCT, "refine": REFINE}


@pytest.mark.parametrize("seed", range(24))
def test_random_bytes_and_truncations_never_reach_an_internal_error(valid, tmp_path, capsys, seed):
    """A random one of the files (STAR, stack, reference) replaced by random bytes or cut at a random place, then a
    random command: it either still runs (a STAR file cut after a whole row is valid) or ends with exit 2, a few
    lines naming no internal error, and no output."""
    rng = np.random.default_rng(seed)
    folder = tmp_path / "case"
    shutil.copytree(valid, folder)
    name = str(rng.choice(["particles.star", "stack.mrcs", "ref.mrc"]))
    data = (folder / name).read_bytes()
    if rng.random() < 0.5:
        corrupted = rng.integers(0, 256, int(rng.integers(0, 3 * len(data)))).astype(np.uint8).tobytes()
    else:
        corrupted = data[: int(rng.integers(0, len(data)))]
    (folder / name).write_bytes(corrupted)
    command = str(rng.choice(list(COMMANDS)))
    args = [a.format(d=folder, f=name) for a in COMMANDS[command]]
    before = set(p for p in folder.rglob("*") if p.is_file())
    capsys.readouterr()
    code, err = run(capsys, args)
    assert "Traceback" not in err and "internal error" not in err, (name, command, err[-3000:])
    if code != 0:
        lines = [line for line in err.strip().splitlines() if line.startswith("cryorefine: error:")]
        assert code == 2 and len(lines) == 1, (name, command, code, err[-3000:])
        assert outputs_under(folder, before) == [], (name, command)

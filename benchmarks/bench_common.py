"""What the benchmark scripts share: `cryorefine` run as a subprocess and timed, another program (RELION) run with
a time limit, the seconds between a run's iteration files, the options after `--` split off to be passed on to the
command, the parser with --work and --gpu / --cpu of the accuracy scripts, the check that a --relion command can run
(`missing_program`, `refuse_missing_programs`), and an atomic model cut down to some of its chains (`model_chains`,
for --chains). A helper module imported by the other scripts; run alone it only answers --help."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def split_at_double_dash(argv):
    """(the script's own arguments, those after the first `--`, passed on to cryorefine as they are)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def run_cli(*args, log_path=None):
    """`python -m cryorefine ARGS` with this Python, its output in log_path (or discarded), the command shown on
    stderr; its wall seconds. Exits naming the log when the command fails."""
    command = [sys.executable, "-m", "cryorefine", *(str(a) for a in args)]
    print("$ cryorefine " + " ".join(command[3:]), file=sys.stderr, flush=True)
    tic = time.perf_counter()
    with open(log_path or os.devnull, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"cryorefine {args[0]} failed (exit code {code}); see {log_path or 'its output (not kept)'}")
    return time.perf_counter() - tic


def package_fingerprint():
    """A SHA-256 of the cryorefine package this Python imports (every .py and .cu file under it, by relative path and
    bytes), which is the code the scripts' `python -m cryorefine` subprocesses run (the same PYTHONPATH): what a
    result was measured with, and what a --reuse must find unchanged."""
    import hashlib

    import cryorefine

    root = Path(cryorefine.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def host_cpus(cpuinfo_path="/proc/cpuinfo"):
    """This machine's CPUs as the results record them: {"model": the first "model name" of `cpuinfo_path` (else
    the platform's processor), "cpus": how many this process may run on}. Two hosts of one GPU kind differ most in
    the stages their CPUs drive, so every result names its host's."""
    import platform

    model = ""
    with contextlib.suppress(OSError):
        for line in Path(cpuinfo_path).read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
                break
    from cryorefine.estep.backend import available_cores

    return {"model": model or platform.processor() or platform.machine(), "cpus": available_cores()}


#: programs that start another one named later on their command line
LAUNCHERS = ("mpirun", "mpiexec", "srun", "taskset", "nice", "numactl", "timeout", "env")


def missing_program(command):
    """Why RELION's `command`, as a script's --relion gives it (a path or a command, perhaps after a launcher such as
    mpirun), cannot start: its first word, or after a launcher (`LAUNCHERS`) its first word naming a relion_
    program, is neither a file nor on PATH; None when they are there. The scripts check it before their own runs,
    which would otherwise take their time first and lose their results to the missing program."""
    words = shlex.split(command)
    named = [w for w in words if Path(w).name.startswith("relion_")]
    launched = named[:1] if words and Path(words[0]).name in LAUNCHERS else []
    for word in dict.fromkeys(words[:1] + launched):
        if not (Path(word).is_file() or shutil.which(word)):
            return f"{word}: no such program (neither a file nor on PATH)"
    return None


def refuse_missing_programs(parser, options, names=("relion",)):
    """End the script through `parser.error` (exit code 2) at the first option of `names` whose command's program is
    missing (`missing_program`)."""
    for name in names:
        command = getattr(options, name)
        if command and (problem := missing_program(command)):
            parser.error(f"--{name} {problem}")


def run_logged(command, log_path, cwd, timeout_seconds=None):
    """Run `command` (a list) in `cwd`, its output in `log_path`, the command shown on stderr; after
    `timeout_seconds` its whole process group (an mpirun and its ranks) is stopped. (its exit code, or "stopped",
    and its wall seconds)."""
    print("$ " + shlex.join(command), file=sys.stderr, flush=True)
    tic = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            code = process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = "stopped"
    return code, time.perf_counter() - tic


def iteration_file_times(folder, root="run"):
    """{iteration: modification time} of the `root`_itNNN_model.star files in `folder` (iteration 0's included where
    the program writes one): when each iteration's files were written, alike for cryorefine and RELION."""
    prefix = len(root) + 3
    return {int(p.name[prefix:prefix + 3]): p.stat().st_mtime
            for p in Path(folder).glob(f"{root}_it[0-9][0-9][0-9]_model.star")}


def seconds_per_iteration(folder, root="run"):
    """{iteration: seconds} from the previous iteration's model.star to this one's (`iteration_file_times`), divided
    by the iterations between them (a --grad run writes its files every --grad_write_iter iterations)."""
    return seconds_between(iteration_file_times(folder, root))


def seconds_between(times):
    """{iteration: seconds} from each iteration's time in `times` ({iteration: time}) back to the one before it in
    `times`, divided by the iterations between them; the first has none."""
    order = sorted(times)
    return {b: (times[b] - times[a]) / (b - a) for a, b in zip(order, order[1:])}


def model_chains(model, chains, out):
    """The atomic model `model` with only the chains named in `chains` (comma-separated), written to `out` (mmCIF)."""
    import gemmi

    keep = set(chains.split(","))
    structure = gemmi.read_structure(str(model))
    for chain_model in structure:
        for name in sorted({chain.name for chain in chain_model} - keep):
            chain_model.remove_chain(name)
    if not any(len(chain_model) for chain_model in structure):
        sys.exit(f"--chains {chains}: none of these chains is in {model}")
    structure.setup_entities()
    structure.make_mmcif_document().write_file(str(out))
    return out


def normalised_with_noise(signal, circle, snr, rng):
    """Clean images `signal` (B, N, N) divided by the σ of white noise of variance var(signal)/`snr` inside the
    particle circle `circle` (N, N), and that noise (σ 1, drawn from `rng` in one call) added: particles at that SNR
    normalised as RELION's extraction normalises them (background σ 1)."""
    sigma = np.sqrt(signal[:, circle].var(axis=1) / snr)
    return signal / sigma[:, None, None] + rng.normal(size=signal.shape)


def simulated_particle_tables(params, pixel_angstrom, box_px, optics_values):
    """The optics table, the particle table without poses (what a freshly extracted set holds: image names
    NNNNNN@particles.mrcs, defocus) and the same with the true poses, of a set simulated with `params` (as
    `jobs.simulate.draw_parameters` gives them); `optics_values` (voltage kV, Cs mm, amplitude contrast)."""
    import pandas as pd

    voltage_kv, cs_mm, q0 = optics_values
    n = len(params["rot_deg"])
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"], "rlnAmplitudeContrast": [q0],
                           "rlnSphericalAberration": [cs_mm], "rlnVoltage": [voltage_kv],
                           "rlnImagePixelSize": [pixel_angstrom], "rlnImageSize": [box_px],
                           "rlnImageDimensionality": [2]})
    particles = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@particles.mrcs" for i in range(n)],
                              "rlnDefocusU": params["defocus_u_angstrom"], "rlnDefocusV": params["defocus_v_angstrom"],
                              "rlnDefocusAngle": params["defocus_angle_deg"], "rlnOpticsGroup": np.ones(n, dtype=int)})
    truth = particles.assign(rlnAngleRot=params["rot_deg"], rlnAngleTilt=params["tilt_deg"],
                             rlnAnglePsi=params["psi_deg"], rlnOriginXAngst=params["origin_x_angstrom"],
                             rlnOriginYAngst=params["origin_y_angstrom"])
    return optics, particles, truth


def work_and_engine_parser(description, epilog, job, formatter_class=argparse.HelpFormatter):
    """An ArgumentParser with --work (required) and one of --gpu / --cpu (required) for the `job` runs."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog, formatter_class=formatter_class)
    parser.add_argument("--work", required=True, type=Path, help="Work folder (created if missing).")
    engine = parser.add_mutually_exclusive_group(required=True)
    engine.add_argument("--gpu", action="store_true", help=f"{job} with the GPU engine (device 0).")
    engine.add_argument("--cpu", action="store_true", help=f"{job} with the numpy engine.")
    return parser


def small_turn(vector_deg):
    """The rotation matrix of a turn by |v| degrees about v (x, y, z) (Rodrigues)."""
    v = np.deg2rad(np.asarray(vector_deg, dtype=np.float64))
    angle = float(np.linalg.norm(v))
    if angle == 0.0:
        return np.eye(3)
    k = v / angle
    cross = np.array([[0.0, -k[2], k[1]], [k[2], 0.0, -k[0]], [-k[1], k[0], 0.0]])
    return np.eye(3) + np.sin(angle) * cross + (1.0 - np.cos(angle)) * cross @ cross


def rotation_angles_deg(a, b):
    """The angle (degrees) of the rotation that takes each matrix b[i] to a[i] (…, 3, 3); a number for one pair."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (np.trace(a @ np.swapaxes(b, -1, -2), axis1=-2, axis2=-1) - 1) / 2
    return np.rad2deg(np.arccos(np.clip(cos, -1, 1)))


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()

"""How well does `cryorefine refine` recover a known structure from simulated particles, beside RELION 5? Simulates
particles from a map, refines them without their poses from the map low-passed (for each --seeds, with RELION's
relion_refine_mpi too when --relion names it, with the same options), and reports for each run the resolution it
claims, the FSC against the truth beside a reconstruction at the true poses, the pose errors, and per iteration
the median angular and offset errors, the FSC of half 1 against the truth, the HEALPix order, σ_offset, the
resolution and what moves the order on (Markdown on stdout, everything in WORK/results.json). Options after `--`
go to every run of both programs.

The benchmark runs the real command lines, step by step, in one work folder:

1. truth     the map (--map, by default examples/ribosome_64px.mrc, its header's pixel size or --angpix),
             Fourier-cropped to --box pixels if asked (`core.fourier.downsample_volume`), or with --model the
             density of an atomic model (`density.density_from_model`, e.g. PDB 7P6Z: .bench/7p6z.cif.gz) in a
             --box px box of --angpix Å/px at --model_resolution Å: WORK/truth.mrc.
2. simulate  `cryorefine simulate`: --n particles at --snr (measured inside the particle circle)
             with the command's default CTFs (defocus 0.8–2.5 µm, 300 kV) and origin offsets:
             WORK/sim/particles.star, whose poses are the ground truth. A copy without the pose
             columns, WORK/sim/particles_unaligned.star, is what refine is given (as particles
             freshly extracted would be), so that it does not start from the true origins;
             --keep_true_poses gives it the simulated file as it is.
3. reference the truth low-passed to --ini_lowpass Å: WORK/reference.mrc.
4. baseline  `cryorefine reconstruct --ctf --half_maps` at the true poses: WORK/truepose/recon*.mrc.
             What refinement would reach if it found every pose exactly (--no_truepose: skipped).
5. refine    for each --seeds S (none given: one run without --random_seed), `cryorefine refine --i STAR
             --ref WORK/reference.mrc --o FOLDER/run --ctf --particle_diameter D --ini_high <ini_lowpass>` and
             RELION 5 GUI's Refine3D options (AUTO_REFINE: --auto_refine --split_random_halves --pad 2
             --flatten_solvent --zero_mask --oversampling 1 --healpix_order 2 --auto_local_healpix_order 4
             --offset_range 5 --offset_step 2 --sym C1 --low_resol_join_halves 40 --norm --scale), then
             --random_seed S and every option given after `--` (a later option overrides an earlier one, e.g.
             `-- --gpu 0 --iter 10`) into WORK/cryorefine_seedS (WORK/refine without seeds); its log beside
             the folder (FOLDER.log); its wall time is measured around the subprocess. D is
             --particle_diameter, by default worked out from the truth's extent; simulate measures the SNR in
             the same circle.
6. relion    with --relion PATH (relion_refine_mpi), the same command line run by RELION under
             --relion_mpirun (a master and a worker per half: RELION splits random halves only under MPI)
             with --relion_extra appended (its threads, --pool, --preread_images …), in WORK/sim (RELION reads
             image names relative to where it runs), into WORK/relion_seedS; --relion_seconds stops a run and
             measures the iterations it finished; --relion_seeds runs it for some of the seeds only. `-- --gpu 0`
             means GPU 0 to both programs.
7. measure   per run:
             - the resolution it reports (rlnCurrentResolution, RELION's SSNR > 1 rule) and where its
               half-map FSC (rlnGoldStandardFsc) falls below 0.5 and 0.143, from run_model.star when the
               run converged, else from the last run_itNNN_half1_model.star, next to the same for the
               true-pose half maps;
             - the FSC against the truth of the refined map (run_class001.mrc, else the last iteration's
               half-1 map) next to that of the true-pose reconstruction from the same particles (the full
               map, or half 1 for a half map) and of the starting reference: the resolutions where each
               falls below 0.5 and 0.143, and a few shells;
             - the median and 90th percentile of the angle between refined and true rotation matrices
               (degrees) and of the distance between refined and true origins (Å); the same angles once
               the refined map's small turn as a whole is fitted (`frame_rotation`), and that turn;
             - per iteration (run_itNNN_*): the median angular and offset errors (data.star), the FSC of
               half 1 against the truth at 0.5 and 0.143, the HEALPix order (sampling.star), σ_offset,
               the angular accuracy and the resolution (half1_model.star), the changes of the poses and
               the two counters that decide the next HEALPix order (optimiser.star), and for cryorefine
               the plan, expectation, maximisation and outputs seconds (and the E-step's stages) from its
               log; the wall seconds between the iterations' half-1 model files.
8. report    Markdown tables on stdout and everything in WORK/results.json (or --json), written again after
             every run; then every iteration's maps but the last are deleted (--keep_maps keeps them).

No hand or frame alignment is made for the FSCs: the reference comes from the truth, so a refined map in
another hand or frame means the refinement failed (and the FSC against the truth shows it).
FSCs against the truth are unmasked, over the whole box.

Run it with the Python that has cryorefine installed, e.g.

    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/bench            # 2,000 particles, 64 px
    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/bench --skip_simulate -- --iter 10
    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/tiny --n 200 --box 32 --snr 0.5 \\
        --ini_lowpass 48 -- --iter 2                                                 # a quick check
    python3 benchmarks/refine_accuracy.py --work /tmp/r128 --model .bench/7p6z.cif.gz --box 128 --angpix 2.8 \\
        --model_resolution 6 --n 5000 --seeds 1 2 3 --relion /tmp/relion/build/bin/relion_refine_mpi -- --gpu 0

--skip_simulate keeps the truth, particles, reference and true-pose reconstruction of an earlier
run in WORK (made with the same options) and only refines again; the old run folders are removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import model_chains, rotation_angles_deg, split_at_double_dash

from cryorefine.core import euler, fourier
from cryorefine.core.fsc import fsc_volumes, resolution_at_threshold
from cryorefine.io.mrc import read_volume, write_volume
from cryorefine.io.star import read_particle_star, read_star, write_particle_star

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MAP = REPO / "examples" / "ribosome_64px.mrc"
POSE_COLUMNS = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst")
# RELION 5 GUI's Refine3D line (tests/data/relion5_gui_lines.txt) less the files, --ini_high, --particle_diameter,
# --ctf and the threads: what both programs are given
AUTO_REFINE = ("--auto_refine", "--split_random_halves", "--pad", "2", "--flatten_solvent", "--zero_mask",
               "--oversampling", "1", "--healpix_order", "2", "--auto_local_healpix_order", "4", "--offset_range", "5",
               "--offset_step", "2", "--sym", "C1", "--low_resol_join_halves", "40", "--norm", "--scale")
RELION_MPIRUN = "mpirun --allow-run-as-root --oversubscribe -n 3"
RELION_EXTRA = "--j 4 --pool 30 --dont_combine_weights_via_disc --preread_images"
ITERATION_LINE = re.compile(r"iteration (\d+): resolution ([\d.]+|inf) Å.*E ([\d.]+) s, M ([\d.]+) s")
STAGES_LINE = re.compile(r"E-step stages \(s\): (.+)$")  # follows its iteration's line
BETWEEN_LINE = re.compile(r"between iterations \(s\): plan ([\d.]+), outputs ([\d.]+)")  # follows it too
# what decides when a refinement moves to the next HEALPix order (RELION's updateAngularSampling): optimiser.star's
# changes of the poses in the iteration and its two counters, as both programs write them
OPTIMISER_LABELS = {"changes_orientations_deg": "rlnChangesOptimalOrientations",
                    "changes_offsets_angstrom": "rlnChangesOptimalOffsets",
                    "iterations_without_resolution_gain": "rlnNumberOfIterWithoutResolutionGain",
                    "iterations_without_hidden_changes": "rlnNumberOfIterWithoutChangingAssignments"}
SETUP_FILE = "setup.json"


# ------------------------------------------------------------------------------ command line

def parse_args(argv):
    """(options, extra refine options): everything after the first `--` goes to every run as it is."""
    argv, extra = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- are passed on to every run of `cryorefine refine` "
                                            "(and of relion_refine_mpi with --relion).")
    parser.add_argument("--work", required=True, type=Path, help="Work folder (created if missing).")
    parser.add_argument("--map", type=Path, default=DEFAULT_MAP, help="Ground-truth map (cubic MRC).")
    parser.add_argument("--model", type=Path, default=None,
                        help="Atomic model (PDB/mmCIF) whose density is the truth, in a --box px box of --angpix Å/px.")
    parser.add_argument("--chains", default=None,
                        help="Keep only these chains of --model (author names, comma-separated), e.g. one subunit.")
    parser.add_argument("--model_resolution", type=float, default=None,
                        help="Resolution (Å) of the model's density [default: band-limited at Nyquist].")
    parser.add_argument("--angpix", type=float, default=None,
                        help="Pixel size (Å) of the truth before any crop: the model's density, or the map's in place "
                             "of its header's.")
    parser.add_argument("--box", type=int, default=None,
                        help="Fourier-crop the map to this box [default: keep]; the model's box (required with it).")
    parser.add_argument("--n", type=int, default=2000, help="Number of particles.")
    parser.add_argument("--snr", type=float, default=0.05, help="Signal-to-noise ratio of the images.")
    parser.add_argument("--ini_lowpass", type=float, default=40.0,
                        help="Resolution (Å) of the starting reference, also refine's --ini_high.")
    parser.add_argument("--particle_diameter", type=float, default=None,
                        help="Mask diameter in Å [default: from the truth map's extent].")
    parser.add_argument("--seed", type=int, default=1, help="Random seed of the simulation.")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="--random_seed of each refinement (each program) [default: one run without it].")
    parser.add_argument("--keep_true_poses", action="store_true",
                        help="Give refine the simulated STAR file with its true poses and origins.")
    parser.add_argument("--skip_simulate", action="store_true",
                        help="Reuse truth, particles, reference and true-pose reconstruction in WORK.")
    parser.add_argument("--keep_maps", action="store_true",
                        help="Keep every iteration's maps (by default only the last iteration's and the final ones stay "
                             "once a run is measured).")
    parser.add_argument("--json", type=Path, default=None, help="Results file [default: WORK/results.json].")
    parser.add_argument("--no_truepose", action="store_true",
                        help="Skip the reconstruction at the true poses (its columns are left empty).")
    parser.add_argument("--relion", type=Path, default=None,
                        help="relion_refine_mpi: run RELION with the same options on the same files, for each seed.")
    parser.add_argument("--relion_mpirun", default=RELION_MPIRUN,
                        help="Launcher of the RELION runs [default: %(default)s].")
    parser.add_argument("--relion_extra", default=RELION_EXTRA,
                        help="Options of the RELION runs alone [default: %(default)s].")
    parser.add_argument("--relion_seconds", type=float, default=None,
                        help="Stop each RELION run after this many seconds (its finished iterations are measured).")
    parser.add_argument("--relion_seeds", type=int, nargs="+", default=None,
                        help="Run RELION for these of --seeds only (its runs do not change with cryorefine's code) "
                             "[default: every seed].")
    args = parser.parse_args(argv)
    if args.model is not None and (args.box is None or args.angpix is None):
        parser.error("--model needs --box and --angpix")
    if args.relion is not None and not args.relion.is_file():
        parser.error(f"--relion {args.relion}: no such file; give the path of relion_refine_mpi")
    if args.relion_seeds is not None and (args.relion is None or not set(args.relion_seeds) <= set(args.seeds or [])):
        parser.error("--relion_seeds: give it with --relion, and only seeds that --seeds names")
    return args, extra


def run_cli(*args, log_path=None):
    """Run `python -m cryorefine ARGS`; with log_path its output is also written there. Returns (code, output)."""
    command = [sys.executable, "-m", "cryorefine", *(str(a) for a in args)]
    print("$ " + " ".join(command[1:]), file=sys.stderr, flush=True)
    lines = []
    with (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process,
          open(log_path or os.devnull, "w") as log):
        for line in process.stdout:
            sys.stderr.write("  " + line)
            lines.append(line)
            log.write(line)
            log.flush()
    return process.returncode, "".join(lines)


def run_or_exit(*args):
    code, _ = run_cli(*args)
    if code != 0:
        sys.exit(f"cryorefine {args[0]} failed (exit code {code})")


# ----------------------------------------------------------------------------- preparation

def estimate_particle_diameter(volume, pixel):
    """Twice the largest radius where |density| exceeds 10 % of its maximum, plus 20 Å, in tens of Å, ≤ the box."""
    n = volume.shape[0]
    c = n // 2
    z, y, x = np.mgrid[:n, :n, :n]
    radius = np.sqrt((x - c) ** 2 + (y - c) ** 2 + (z - c) ** 2)
    extent = radius[np.abs(volume) > 0.1 * np.abs(volume).max()].max() * pixel
    return float(min(n * pixel, 10 * math.ceil((2 * extent + 20) / 10)))


def truth_volume(args, work):
    """(the truth (N, N, N), its pixel size in Å, its source) of --model (its --chains) or --map."""
    if args.model is not None:
        from cryorefine.density import density_from_model

        model = args.model if args.chains is None else model_chains(args.model, args.chains, work / "model.cif")
        volume = density_from_model(model, args.box, args.angpix, args.model_resolution)
        source = str(args.model) + ("" if args.chains is None else f" chains {args.chains}")
        return np.asarray(volume, np.float64), float(args.angpix), source
    volume, pixel = read_volume(args.map)
    pixel = args.angpix or pixel
    if pixel is None:
        sys.exit(f"{args.map}: the header has no pixel size; give --angpix")
    box = args.box or volume.shape[0]
    if box != volume.shape[0]:
        pixel = pixel * volume.shape[0] / box
        volume = fourier.downsample_volume(volume, box)
    return np.asarray(volume, np.float64), float(pixel), str(args.map)


def prepare(args, work):
    """Steps 1–4: truth, particles, reference, true-pose reconstruction. Returns the setup dict."""
    volume, pixel, source = truth_volume(args, work)
    box = volume.shape[0]
    diameter = args.particle_diameter or estimate_particle_diameter(volume, pixel)
    write_volume(work / "truth.mrc", volume.astype(np.float32), pixel)

    run_or_exit("simulate", "--ref", work / "truth.mrc", "--n", args.n, "--snr", args.snr, "--seed", args.seed,
                "--particle_diameter", diameter, "--o", work / "sim")
    star = read_particle_star(work / "sim" / "particles.star")
    write_particle_star(star, work / "sim" / "particles_unaligned.star",
                        star.particles.drop(columns=[c for c in POSE_COLUMNS if c in star.particles.columns]))

    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume), box, args.ini_lowpass, pixel)
    write_volume(work / "reference.mrc", fourier.irfft3_centered(ft, box).astype(np.float32), pixel)

    if not args.no_truepose:
        (work / "truepose").mkdir(exist_ok=True)
        run_or_exit("reconstruct", "--i", work / "sim" / "particles.star", "--o", work / "truepose" / "recon.mrc",
                    "--ctf", "--half_maps")
    setup = {"map": source, "box_px": box, "pixel_size_angstrom": pixel, "n_particles": args.n,
             "snr": args.snr, "seed": args.seed, "ini_lowpass_angstrom": args.ini_lowpass,
             "particle_diameter_angstrom": diameter, "model_resolution_angstrom": args.model_resolution}
    (work / SETUP_FILE).write_text(json.dumps(setup, indent=1))
    return setup


# ---------------------------------------------------------------------------------- refine

def run_folder(work, program, seed):
    """WORK/<program>_seed<S>; without seeds WORK/refine (cryorefine) or WORK/relion."""
    if seed is None:
        return work / ("refine" if program == "cryorefine" else "relion")
    return work / f"{program}_seed{seed}"


def refine_options(args, extra, work, setup, folder, seed):
    """The options both programs are given, --i, --ref and --o first."""
    star = work / "sim" / ("particles.star" if args.keep_true_poses else "particles_unaligned.star")
    return ["--i", star, "--ref", work / "reference.mrc", "--o", folder / "run", "--ctf",
            "--particle_diameter", setup["particle_diameter_angstrom"], "--ini_high", setup["ini_lowpass_angstrom"],
            *AUTO_REFINE, *(["--random_seed", seed] if seed is not None else []), *extra]


def relion_command(args, options):
    """relion_refine_mpi's command line: the launcher, the program, the options, --relion_extra."""
    return [*shlex.split(args.relion_mpirun), str(args.relion.resolve()), *(str(o) for o in options),
            *shlex.split(args.relion_extra)]


def run_refine(args, extra, work, setup, program, seed):
    """Step 5 or 6 for one seed. Returns (folder, log, exit code, wall seconds, start time as a Unix time)."""
    folder = run_folder(work, program, seed)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    log = folder.with_suffix(".log")
    options = refine_options(args, extra, work, setup, folder, seed)
    started = time.time()
    tic = time.perf_counter()
    if program == "cryorefine":
        code, _ = run_cli("refine", *options, log_path=log)
    else:
        command = relion_command(args, options)
        print("$ " + " ".join(command), file=sys.stderr, flush=True)
        with open(log, "w") as out:  # in WORK/sim: RELION reads image names relative to where it runs
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=work / "sim",
                                       start_new_session=True)
            try:
                code = process.wait(timeout=args.relion_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 15)
                process.wait()
                code = "stopped"
    return folder, log, code, time.perf_counter() - tic, started


# ------------------------------------------------------------------------------- measuring

def resolutions(fsc, box, pixel):
    """Resolution (Å) where an FSC curve first falls below 0.5 and 0.143."""
    return {f"fsc_{t}": resolution_at_threshold(fsc, box, pixel, t) for t in (0.5, 0.143)}


def image_key(name: str) -> str:
    """An image name without the stack's folder ("12@particles.mrcs"): refine writes the path of the stack it read,
    which may not be the one the input STAR file named."""
    number, _, stack = str(name).partition("@")
    return f"{number}@{os.path.basename(stack)}"


def pose_errors(truth_star, refined_star):
    """Angles (degrees) between true and refined rotations, and origin distances (Å), per particle; the angles left
    once the refined poses are turned by the one rotation of the map's frame that fits them best (`frame_rotation`):
    the map of a refinement may turn a little as a whole, which moves every pose alike; and that rotation's angle."""
    truth = read_star(truth_star)["particles"]
    found = read_star(refined_star)["particles"]
    truth = truth.set_index(truth["rlnImageName"].map(image_key))
    found = found.set_index(found["rlnImageName"].map(image_key))
    truth = truth.loc[found.index]
    a = euler.euler_to_matrix(truth["rlnAngleRot"], truth["rlnAngleTilt"], truth["rlnAnglePsi"])
    b = euler.euler_to_matrix(found["rlnAngleRot"], found["rlnAngleTilt"], found["rlnAnglePsi"])
    angle = rotation_angles_deg(a, b)
    frame = frame_rotation(a, b)
    shift = np.hypot(truth["rlnOriginXAngst"].to_numpy() - found["rlnOriginXAngst"].to_numpy(),
                     truth["rlnOriginYAngst"].to_numpy() - found["rlnOriginYAngst"].to_numpy())
    return angle, shift, rotation_angles_deg(a @ frame, b), float(rotation_angles_deg(frame[None], np.eye(3)[None])[0])


def frame_rotation(a, b, keep_fraction=0.8):
    """The rotation G (3×3) for which a[i]·G is closest to b[i] (least squares over the matrices, the best
    `keep_fraction` of the particles once a first fit over all of them has ranked them, so that particles in a wrong
    view do not pull it): a refined map turned by G as a whole gives every pose b = a·G."""
    keep = np.arange(len(a))
    for _ in range(2):
        u, _, vt = np.linalg.svd(np.einsum("nji,njk->ik", a[keep], b[keep]))
        g = u @ np.diag([1.0, 1.0, np.linalg.det(u @ vt)]) @ vt
        residual = rotation_angles_deg(a @ g, b)
        keep = np.argsort(residual)[: max(3, int(keep_fraction * len(a)))]
    return g


def log_timings(log):
    """Per iteration of cryorefine's log: E and M seconds, the E-step's stages, and the plan's and the outputs'
    seconds between iterations ({} for RELION's)."""
    rows = {}
    current = None
    for line in (log.read_text(errors="replace") if log.exists() else "").splitlines():
        if match := ITERATION_LINE.search(line):
            current = rows[int(match[1])] = {
                "expectation_s": float(match[3]), "maximisation_s": float(match[4])}
        elif (match := STAGES_LINE.search(line)) and current is not None:
            current["expectation_stages_s"] = {name: float(seconds) for name, seconds in
                                               (item.rsplit(" ", 1) for item in match[1].split(", "))}
        elif (match := BETWEEN_LINE.search(line)) and current is not None:
            current["plan_s"], current["outputs_s"] = float(match[1]), float(match[2])
    return rows


def iterations_written(out):
    return sorted(int(path.name[6:9]) for path in out.glob("run_it[0-9][0-9][0-9]_half1_model.star")
                  if int(path.name[6:9]) > 0)


def last_iteration(out):
    found = iterations_written(out)
    return found[-1] if found else None


def _general(path, block):
    """The single-value block `block` of a STAR file (a dict), {} when the file or block is missing."""
    if not Path(path).exists():
        return {}
    table = read_star(path).get(block)
    if table is None:
        return {}
    return table if isinstance(table, dict) else table.iloc[0].to_dict()


def _number(mapping, key):
    try:
        return float(mapping[key])
    except (KeyError, TypeError, ValueError):
        return None


def per_iteration(out, log, truth, truth_star, box, pixel, started):
    """Step 7's rows per iteration (run_itNNN_* of both programs)."""
    timings = log_timings(log)
    rows, previous = [], started
    for it in iterations_written(out):
        root = out / f"run_it{it:03d}"
        model_star = Path(f"{root}_half1_model.star")
        model = _general(model_star, "model_general")
        classes = read_star(model_star).get("model_classes")
        sampling = _general(f"{root}_sampling.star", "sampling_general")
        optimiser = _general(f"{root}_optimiser.star", "optimiser_general")
        row = {"iteration": it, "resolution_angstrom": _number(model, "rlnCurrentResolution"),
               "healpix_order": _number(sampling, "rlnHealpixOrder"),
               "sigma_offset_angstrom": _number(model, "rlnSigmaOffsetsAngst"),
               "image_size_px": _number(model, "rlnCurrentImageSize"),
               "offset_range_angstrom": _number(sampling, "rlnOffsetRange"),
               "offset_step_angstrom": _number(sampling, "rlnOffsetStep"),
               "accuracy_rotations_deg": (None if classes is None or "rlnAccuracyRotations" not in classes
                                          else float(classes["rlnAccuracyRotations"].iloc[0])),
               **{key: _number(optimiser, label) for key, label in OPTIMISER_LABELS.items()},
               "wall_s": model_star.stat().st_mtime - previous, **timings.get(it, {})}
        previous = model_star.stat().st_mtime
        data = Path(f"{root}_data.star")
        if data.exists():
            angle, shift, in_frame, _ = pose_errors(truth_star, data)
            row.update(median_angle_error_deg=float(np.median(angle)), median_offset_error_angstrom=float(np.median(shift)),
                       median_angle_error_map_frame_deg=float(np.median(in_frame)))
        half1 = Path(f"{root}_half1_class001.mrc")
        if half1.exists():
            fsc = np.asarray(fsc_volumes(read_volume(half1)[0].astype(np.float64), truth))
            row.update({f"half1_vs_truth_{key}": value for key, value in resolutions(fsc, box, pixel).items()})
        rows.append(row)
    return rows


def measure(work, setup, program, seed, folder, log, code, seconds, started, extra, keep_true_poses):
    box, pixel = setup["box_px"], setup["pixel_size_angstrom"]
    out = folder
    truth, _ = read_volume(work / "truth.mrc")
    truth = truth.astype(np.float64)
    last = last_iteration(out)
    if last is None:
        print(f"{program} wrote no iteration (exit code {code}); see {log}", file=sys.stderr)
        return {"program": program, "seed": seed, "exit_code": code, "wall_s": seconds, "log": str(log),
                "iterations": 0}
    converged = (out / "run_class001.mrc").exists() and (out / "run_model.star").exists()
    truepose = work / "truepose"
    if converged:
        model_star, refined_map, data_star = out / "run_model.star", out / "run_class001.mrc", out / "run_data.star"
        baseline_map = truepose / "recon.mrc"
    else:
        root = out / f"run_it{last:03d}"
        model_star, refined_map = Path(f"{root}_half1_model.star"), Path(f"{root}_half1_class001.mrc")
        data_star = Path(f"{root}_data.star")
        baseline_map = truepose / "recon_half1.mrc"

    model = read_star(model_star)
    gold_fsc = model["model_class_1"]["rlnGoldStandardFsc"].to_numpy(np.float64)
    maps = [("refined", refined_map), ("true_poses", baseline_map), ("reference", work / "reference.mrc")]
    curves = {name: np.asarray(fsc_volumes(read_volume(path)[0].astype(np.float64), truth))
              for name, path in maps if path.exists()}
    fsc_star = truepose / "recon_fsc.star"
    half_curves = {"refined": gold_fsc}
    if fsc_star.exists():
        half_curves["true_poses"] = read_star(fsc_star)["fsc"]["rlnFourierShellCorrelation"].to_numpy()
    angle, shift, in_frame, frame_turn = pose_errors(work / "sim" / "particles.star", data_star)
    iterations = per_iteration(out, log, truth, work / "sim" / "particles.star", box, pixel, started)
    walls = [row["wall_s"] for row in iterations]
    return {
        "program": program, "seed": seed, "command_extra": extra,
        "input": "true poses" if keep_true_poses else "no poses",
        "exit_code": code, "wall_s": seconds, "iterations": len(iterations), "converged": converged,
        "log": str(log), "model_star": str(model_star), "map": str(refined_map), "data_star": str(data_star),
        "baseline_map": str(baseline_map), "seconds_per_iteration": float(np.mean(walls)) if walls else None,
        "reported_resolution_angstrom": float(model["model_general"]["rlnCurrentResolution"]),
        "half_map_fsc": {f"{name}_{t}": resolution_at_threshold(curve, box, pixel, t)
                         for name, curve in half_curves.items() for t in (0.5, 0.143)},
        "fsc_vs_truth": {name: {**resolutions(curve, box, pixel), "curve": curve.tolist()}
                         for name, curve in curves.items()},
        "half_map_fsc_curves": {name: curve.tolist() for name, curve in half_curves.items()},
        "angle_error_deg": {"median": float(np.median(angle)), "p90": float(np.percentile(angle, 90))},
        "angle_error_map_frame_deg": {"median": float(np.median(in_frame)), "p90": float(np.percentile(in_frame, 90))},
        "map_frame_turn_deg": frame_turn,
        "offset_error_angstrom": {"median": float(np.median(shift)), "p90": float(np.percentile(shift, 90))},
        "per_iteration": iterations,
    }


# -------------------------------------------------------------------------------- reporting

def angstrom(value):
    return "–" if value is None or not math.isfinite(value) else f"{value:.1f}"


def figure(value, digits=2):
    return "–" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(results):
    s, runs = results["setup"], results["runs"]
    box, pixel = s["box_px"], s["pixel_size_angstrom"]
    title = (f"### refine accuracy: {Path(s['map']).name}, {box} px at {pixel:.2f} Å/px (Nyquist {2 * pixel:.1f} Å), "
             f"{s['n_particles']} particles, SNR {s['snr']:g}, start {s['ini_lowpass_angstrom']:g} Å, "
             f"mask {s['particle_diameter_angstrom']:g} Å")
    extra = " ".join(results["command_extra"]) or "(nothing)"
    lines = [title, "", f"Both programs: {' '.join(AUTO_REFINE)}, then {extra}; from {results['input']}.", "",
             row("program", "seed", "exit", "iterations", "wall (s)", "reported (Å)", "half-map FSC 0.143 (Å)",
                 "FSC vs truth 0.5 / 0.143 (Å)", "median / 90 % angle (°)", "in the map's frame (°)",
                 "median / 90 % offset (Å)"),
             row(*["---"] * 11)]
    for r in runs:
        if not r.get("iterations"):
            lines.append(row(r["program"], r["seed"], r["exit_code"], 0, f"{r['wall_s']:.1f}", *["–"] * 6))
            continue
        fsc, angle, offset = r["fsc_vs_truth"]["refined"], r["angle_error_deg"], r["offset_error_angstrom"]
        lines.append(row(r["program"], r["seed"], r["exit_code"],
                         f"{r['iterations']}{'' if r['converged'] else ' (not converged)'}", f"{r['wall_s']:.1f}",
                         angstrom(r["reported_resolution_angstrom"]), angstrom(r["half_map_fsc"]["refined_0.143"]),
                         f"{angstrom(fsc['fsc_0.5'])} / {angstrom(fsc['fsc_0.143'])}",
                         f"{angle['median']:.2f} / {angle['p90']:.2f}", frame_cell(r),
                         f"{offset['median']:.2f} / {offset['p90']:.2f}"))
    done = [r for r in runs if r.get("iterations")]
    if done:
        first = done[0]
        base = first["fsc_vs_truth"].get("true_poses")
        start = first["fsc_vs_truth"].get("reference")
        lines += ["", f"True poses ({'full map' if first['converged'] else 'half 1'}): FSC vs truth 0.5 / 0.143 "
                      f"{angstrom(base and base['fsc_0.5'])} / {angstrom(base and base['fsc_0.143'])} Å; half maps 0.143 "
                      f"{angstrom(first['half_map_fsc'].get('true_poses_0.143'))} Å; start reference "
                      f"{angstrom(start and start['fsc_0.5'])} / {angstrom(start and start['fsc_0.143'])} Å."]
    for r in done:
        lines += ["", f"{r['program']}, seed {r['seed']}, per iteration (half 1 against the truth):", "",
                  row("iteration", "order", "size (px)", "offsets (Å)", "resolution (Å)", "σ_offset (Å)",
                      "acc rot (°)", "median angle (°)", "in the map's frame (°)", "median offset (Å)", "FSC 0.5 (Å)",
                      "FSC 0.143 (Å)", "changes (°, Å)", "counters", "plan / E / M / outputs (s)", "wall (s)"),
                  row(*["---"] * 16)]
        for it in r["per_iteration"]:
            timing = "–" if "expectation_s" not in it else " / ".join(
                "–" if it.get(key) is None else f"{it[key]:.1f}"
                for key in ("plan_s", "expectation_s", "maximisation_s", "outputs_s"))
            change_deg, change_angstrom = it.get("changes_orientations_deg"), it.get("changes_offsets_angstrom")
            counters = [it.get(key) for key in ("iterations_without_resolution_gain",
                                                "iterations_without_hidden_changes")]
            order = it.get("healpix_order")
            size, step, span = (it.get(k) for k in ("image_size_px", "offset_step_angstrom", "offset_range_angstrom"))
            lines.append(row(it["iteration"], "–" if order is None else int(order),
                             "–" if size is None else int(size),
                             "–" if step is None or span is None else f"{span:.2f} by {step:.2f}",
                             angstrom(it["resolution_angstrom"]), figure(it["sigma_offset_angstrom"]),
                             figure(it["accuracy_rotations_deg"]), figure(it.get("median_angle_error_deg")),
                             figure(it.get("median_angle_error_map_frame_deg")),
                             figure(it.get("median_offset_error_angstrom")),
                             angstrom(it.get("half1_vs_truth_fsc_0.5")), angstrom(it.get("half1_vs_truth_fsc_0.143")),
                             "–" if change_deg is None or change_angstrom is None
                             else f"{change_deg:.2f}, {change_angstrom:.2f}",
                             "–" if None in counters else " / ".join(str(int(c)) for c in counters),
                             timing, angstrom(it["wall_s"])))
    return "\n".join(lines)


def frame_cell(run):
    """The median / 90th percentile angular error once the map's frame is fitted, and how far the frame turned (– for
    results without them)."""
    frame, turn = run.get("angle_error_map_frame_deg"), run.get("map_frame_turn_deg")
    cell = "–" if frame is None else f"{frame['median']:.2f} / {frame['p90']:.2f}"
    return cell if turn is None else f"{cell} (turned {turn:.2f}°)"


def finite_or_none(value):
    """JSON has no inf/nan: write them as null."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(argv=None):
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.skip_simulate:
        if not (work / SETUP_FILE).exists():
            sys.exit(f"--skip_simulate: {work / SETUP_FILE} not found; run once without it")
        setup = json.loads((work / SETUP_FILE).read_text())
    else:
        setup = prepare(args, work)
    runs, codes = [], []
    for seed in args.seeds or [None]:
        with_relion = args.relion is not None and (args.relion_seeds is None or seed in args.relion_seeds)
        for program in ["cryorefine"] + (["relion"] if with_relion else []):
            folder, log, code, seconds, started = run_refine(args, extra, work, setup, program, seed)
            codes.append(code)
            runs.append(measure(work, setup, program, seed, folder, log, code, seconds, started, extra,
                                args.keep_true_poses))
            if not args.keep_maps:  # a 256 px run writes 0.2 GB of maps an iteration: keep the disk for the next
                last = last_iteration(folder)
                for path in folder.glob("run_it[0-9][0-9][0-9]_*.mrc"):
                    if int(path.name[6:9]) != last:
                        path.unlink()
            results = {"setup": setup, "command_extra": extra, "auto_refine_options": list(AUTO_REFINE),
                       "relion_command": None if args.relion is None else [args.relion_mpirun, str(args.relion),
                                                                            args.relion_extra],
                       "input": "true poses" if args.keep_true_poses else "no poses", "runs": runs}
            out = args.json or work / "results.json"
            out.write_text(json.dumps(finite_or_none(results), indent=1))  # after every run
    print(markdown(results))
    print(f"\nresults: {out}", file=sys.stderr)
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())

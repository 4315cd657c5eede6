"""How well does `cryorefine refine` recover a known structure from simulated particles? Simulates particles from
a map, refines them without their poses from the map low-passed, and reports the resolution refine claims, the
FSC against the truth beside a reconstruction at the true poses, the pose errors and the time per iteration
(Markdown on stdout, everything in WORK/results.json). Options after `--` go to `cryorefine refine`.

The benchmark runs the real command line, step by step, in one work folder:

1. truth     the map (--map, by default examples/ribosome_64px.mrc), Fourier-cropped to --box
             pixels if asked (`core.fourier.downsample_volume`): WORK/truth.mrc.
2. simulate  `cryorefine simulate`: --n particles at --snr (measured inside the particle circle)
             with the command's default CTFs (defocus 0.8–2.5 µm, 300 kV) and origin offsets:
             WORK/sim/particles.star, whose poses are the ground truth. A copy without the pose
             columns, WORK/sim/particles_unaligned.star, is what refine is given (as particles
             freshly extracted would be), so that it does not start from the true origins;
             --keep_true_poses gives it the simulated file as it is.
3. reference the truth low-passed to --ini_lowpass Å: WORK/reference.mrc.
4. baseline  `cryorefine reconstruct --ctf --half_maps` at the true poses: WORK/truepose/recon*.mrc.
             What refinement would reach if it found every pose exactly.
5. refine    `cryorefine refine --ctf --particle_diameter D --ini_high <ini_lowpass>` from the
             reference into WORK/refine/run, with every option given after `--` appended (a later
             option overrides an earlier one, e.g. `-- --iter 10 --ini_high 30`). D is
             --particle_diameter, by default worked out from the truth's extent; simulate
             measures the SNR in the same circle. refine's log goes to WORK/refine.log; its wall
             time is measured around the subprocess.
6. measure   - the resolution that refine reports (rlnCurrentResolution, RELION's SSNR > 1 rule)
               and where its half-map FSC (rlnGoldStandardFsc) falls below 0.5 and 0.143, from
               run_model.star when the run converged, else from the last run_itNNN_half1_model.star,
               next to the same for the true-pose half maps;
             - the FSC against the truth of the refined map (run_class001.mrc, else the last
               iteration's half-1 map) next to that of the true-pose reconstruction from the same
               particles (the full map, or half 1 for a half map) and of the starting reference:
               the resolutions where each falls below 0.5 and 0.143, and a few shells;
             - the median and 90th percentile of the angle between refined and true rotation
               matrices (degrees) and the median distance between refined and true origins (Å);
             - the time per iteration: expectation and maximisation seconds (and the E-step's
               stages, in results.json) from refine's log lines, and wall seconds between the
               iterations' last written files.
7. report    Markdown tables on stdout and everything in WORK/results.json.

No hand or frame alignment is made: the reference comes from the truth, so a refined map in
another hand or frame means the refinement failed (and the FSC against the truth shows it).
FSCs against the truth are unmasked, over the whole box.

Run it with the Python that has cryorefine installed, e.g.

    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/bench            # 2,000 particles, 64 px
    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/bench --skip_simulate -- --iter 10
    .venv/bin/python benchmarks/refine_accuracy.py --work /tmp/tiny --n 200 --box 32 --snr 0.5 \\
        --ini_lowpass 48 -- --iter 2                                                 # a quick check

--skip_simulate keeps the truth, particles, reference and true-pose reconstruction of an earlier
run in WORK (made with the same options) and only refines again; the old WORK/refine is removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import split_at_double_dash

from cryorefine.core import euler, fourier
from cryorefine.core.fsc import fsc_volumes, resolution_at_threshold
from cryorefine.io.mrc import read_volume, write_volume
from cryorefine.io.star import read_particle_star, read_star, write_particle_star

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MAP = REPO / "examples" / "ribosome_64px.mrc"
POSE_COLUMNS = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst", "rlnOriginYAngst")
ITERATION_LINE = re.compile(r"iteration (\d+): resolution ([\d.]+|inf) Å.*E ([\d.]+) s, M ([\d.]+) s")
STAGES_LINE = re.compile(r"E-step stages \(s\): (.+)$")  # follows its iteration's line
SETUP_FILE = "setup.json"


# ------------------------------------------------------------------------------ command line

def parse_args(argv):
    """(options, extra refine options): everything after the first `--` goes to refine as it is."""
    argv, extra = split_at_double_dash(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- are passed on to `cryorefine refine`.")
    parser.add_argument("--work", required=True, type=Path, help="Work folder (created if missing).")
    parser.add_argument("--map", type=Path, default=DEFAULT_MAP, help="Ground-truth map (cubic MRC).")
    parser.add_argument("--box", type=int, default=None, help="Fourier-crop the map to this box [default: keep].")
    parser.add_argument("--n", type=int, default=2000, help="Number of particles.")
    parser.add_argument("--snr", type=float, default=0.05, help="Signal-to-noise ratio of the images.")
    parser.add_argument("--ini_lowpass", type=float, default=40.0,
                        help="Resolution (Å) of the starting reference, also refine's --ini_high.")
    parser.add_argument("--particle_diameter", type=float, default=None,
                        help="Mask diameter in Å [default: from the truth map's extent].")
    parser.add_argument("--seed", type=int, default=1, help="Random seed of the simulation.")
    parser.add_argument("--keep_true_poses", action="store_true",
                        help="Give refine the simulated STAR file with its true poses and origins.")
    parser.add_argument("--skip_simulate", action="store_true",
                        help="Reuse truth, particles, reference and true-pose reconstruction in WORK.")
    return parser.parse_args(argv), extra


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


def prepare(args, work):
    """Steps 1–4: truth, particles, reference, true-pose reconstruction. Returns the setup dict."""
    volume, pixel = read_volume(args.map)
    if pixel is None:
        sys.exit(f"{args.map}: the header has no pixel size")
    box = args.box or volume.shape[0]
    if box != volume.shape[0]:
        pixel = pixel * volume.shape[0] / box
        volume = fourier.downsample_volume(volume, box)
    diameter = args.particle_diameter or estimate_particle_diameter(volume, pixel)
    write_volume(work / "truth.mrc", volume, pixel)

    run_or_exit("simulate", "--ref", work / "truth.mrc", "--n", args.n, "--snr", args.snr, "--seed", args.seed,
                "--particle_diameter", diameter, "--o", work / "sim")
    star = read_particle_star(work / "sim" / "particles.star")
    write_particle_star(star, work / "sim" / "particles_unaligned.star",
                        star.particles.drop(columns=[c for c in POSE_COLUMNS if c in star.particles.columns]))

    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume.astype(np.float64)), box, args.ini_lowpass, pixel)
    write_volume(work / "reference.mrc", fourier.irfft3_centered(ft, box), pixel)

    (work / "truepose").mkdir(exist_ok=True)
    run_or_exit("reconstruct", "--i", work / "sim" / "particles.star", "--o", work / "truepose" / "recon.mrc",
                "--ctf", "--half_maps")

    setup = {"map": str(args.map), "box_px": box, "pixel_size_angstrom": pixel, "n_particles": args.n,
             "snr": args.snr, "seed": args.seed, "ini_lowpass_angstrom": args.ini_lowpass,
             "particle_diameter_angstrom": diameter}
    (work / SETUP_FILE).write_text(json.dumps(setup, indent=1))
    return setup


# ---------------------------------------------------------------------------------- refine

def run_refine(args, extra, work, setup):
    """Step 5. Returns (exit code, wall seconds, start time as a Unix time)."""
    out = work / "refine"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    star = work / "sim" / ("particles.star" if args.keep_true_poses else "particles_unaligned.star")
    started = time.time()
    tic = time.perf_counter()
    code, _ = run_cli("refine", "--i", star, "--ref", work / "reference.mrc", "--o", out / "run", "--ctf",
                      "--particle_diameter", setup["particle_diameter_angstrom"],
                      "--ini_high", setup["ini_lowpass_angstrom"], *extra, log_path=work / "refine.log")
    return code, time.perf_counter() - tic, started


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
    """Angles (degrees) between true and refined rotations, and origin distances (Å), per particle."""
    truth = read_star(truth_star)["particles"]
    found = read_star(refined_star)["particles"]
    truth = truth.set_index(truth["rlnImageName"].map(image_key))
    found = found.set_index(found["rlnImageName"].map(image_key))
    truth = truth.loc[found.index]
    a = euler.euler_to_matrix(truth["rlnAngleRot"], truth["rlnAngleTilt"], truth["rlnAnglePsi"])
    b = euler.euler_to_matrix(found["rlnAngleRot"], found["rlnAngleTilt"], found["rlnAnglePsi"])
    cos = (np.trace(a @ np.swapaxes(b, -1, -2), axis1=-2, axis2=-1) - 1) / 2
    angle = np.rad2deg(np.arccos(np.clip(cos, -1, 1)))
    shift = np.hypot(truth["rlnOriginXAngst"].to_numpy() - found["rlnOriginXAngst"].to_numpy(),
                     truth["rlnOriginYAngst"].to_numpy() - found["rlnOriginYAngst"].to_numpy())
    return angle, shift


def iteration_timings(work, refine_started):
    """Per iteration: resolution, E and M seconds (refine's log) and wall seconds (file times)."""
    rows = {}
    log = work / "refine.log"
    current = None
    for line in (log.read_text() if log.exists() else "").splitlines():
        if match := ITERATION_LINE.search(line):
            current = rows[int(match[1])] = {
                "iteration": int(match[1]), "resolution_angstrom": float(match[2]),
                "expectation_s": float(match[3]), "maximisation_s": float(match[4])}
        elif (match := STAGES_LINE.search(line)) and current is not None:
            current["expectation_stages_s"] = {name: float(seconds) for name, seconds in
                                               (item.rsplit(" ", 1) for item in match[1].split(", "))}
    previous = refine_started
    for it in sorted(rows):
        done = work / "refine" / f"run_it{it:03d}_report.png"  # the last file written in an iteration
        if done.exists():
            rows[it]["wall_s"] = done.stat().st_mtime - previous
            previous = done.stat().st_mtime
    return [rows[it] for it in sorted(rows)]


def last_iteration(out):
    found = sorted(out.glob("run_it[0-9][0-9][0-9]_half1_model.star"))
    return int(found[-1].name[6:9]) if found else None


def measure(work, setup, refine_code, refine_seconds, refine_started, extra, keep_true_poses):
    box, pixel = setup["box_px"], setup["pixel_size_angstrom"]
    out = work / "refine"
    truth, _ = read_volume(work / "truth.mrc")
    truth = truth.astype(np.float64)
    last = last_iteration(out)
    if last is None:
        sys.exit(f"refine wrote no iteration (exit code {refine_code}); see {work / 'refine.log'}")
    converged = (out / "run_class001.mrc").exists() and (out / "run_model.star").exists()
    if converged:
        model_star, refined_map, data_star = out / "run_model.star", out / "run_class001.mrc", out / "run_data.star"
        baseline_map = work / "truepose" / "recon.mrc"
    else:
        root = out / f"run_it{last:03d}"
        model_star, refined_map = Path(f"{root}_half1_model.star"), Path(f"{root}_half1_class001.mrc")
        data_star = Path(f"{root}_data.star")
        baseline_map = work / "truepose" / "recon_half1.mrc"

    model = read_star(model_star)
    gold_fsc = model["model_class_1"]["rlnGoldStandardFsc"].to_numpy(np.float64)
    curves = {name: np.asarray(fsc_volumes(read_volume(path)[0].astype(np.float64), truth))
              for name, path in (("refined", refined_map), ("true_poses", baseline_map),
                                 ("reference", work / "reference.mrc"))}
    true_pose_halves = read_star(work / "truepose" / "recon_fsc.star")["fsc"]["rlnFourierShellCorrelation"].to_numpy()
    angle, shift = pose_errors(work / "sim" / "particles.star", data_star)
    iterations = iteration_timings(work, refine_started)
    walls = [row["wall_s"] for row in iterations if "wall_s" in row]

    return {
        "setup": setup,
        "refine": {"command_extra": extra, "input": "true poses" if keep_true_poses else "no poses",
                   "exit_code": refine_code, "wall_s": refine_seconds, "iterations": len(iterations) or last,
                   "converged": converged, "model_star": str(model_star), "map": str(refined_map),
                   "data_star": str(data_star), "baseline_map": str(baseline_map),
                   "seconds_per_iteration": float(np.mean(walls)) if walls else None},
        "reported_resolution_angstrom": float(model["model_general"]["rlnCurrentResolution"]),
        "half_map_fsc": {f"{name}_{t}": resolution_at_threshold(curve, box, pixel, t)
                         for name, curve in (("refined", gold_fsc), ("true_poses", true_pose_halves))
                         for t in (0.5, 0.143)},
        "fsc_vs_truth": {name: {**resolutions(curve, box, pixel), "curve": curve.tolist()}
                         for name, curve in curves.items()},
        "half_map_fsc_curves": {"refined": gold_fsc.tolist(), "true_poses": true_pose_halves.tolist()},
        "angle_error_deg": {"median": float(np.median(angle)), "p90": float(np.percentile(angle, 90))},
        "offset_error_angstrom": {"median": float(np.median(shift)), "p90": float(np.percentile(shift, 90))},
        "per_iteration": iterations,
    }


# -------------------------------------------------------------------------------- reporting

def angstrom(value):
    return "–" if value is None or not math.isfinite(value) else f"{value:.1f}"


def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(results):
    s, r = results["setup"], results["refine"]
    fsc, half = results["fsc_vs_truth"], results["half_map_fsc"]
    angle, offset = results["angle_error_deg"], results["offset_error_angstrom"]
    box, pixel = s["box_px"], s["pixel_size_angstrom"]
    maps = ("refined", "true_poses", "reference")
    title = (f"### refine accuracy: {Path(s['map']).name}, {box} px at {pixel:.2f} Å/px (Nyquist {2 * pixel:.1f} Å), "
             f"{s['n_particles']} particles, SNR {s['snr']:g}, start {s['ini_lowpass_angstrom']:g} Å, "
             f"mask {s['particle_diameter_angstrom']:g} Å")
    run = (f"refine {' '.join(r['command_extra']) or '(default options)'} from {r['input']}: "
           f"exit code {r['exit_code']}, {r['iterations']} iterations, "
           f"{'converged' if r['converged'] else 'not converged'}, {r['wall_s']:.1f} s wall; compared maps: "
           f"{'final full maps' if r['converged'] else 'half 1 of the last iteration'}")
    lines = [title, "", run, "",
             row("measure", "refined", "true poses", "start reference"), row("---", "---", "---", "---"),
             row("resolution refine reports, rlnCurrentResolution (Å)",
                 angstrom(results["reported_resolution_angstrom"]), "", "")]
    for t in ("0.5", "0.143"):
        lines.append(row(f"half-map FSC {t} (Å)", angstrom(half[f"refined_{t}"]), angstrom(half[f"true_poses_{t}"]),
                         ""))
    for t in ("0.5", "0.143"):
        lines.append(row(f"FSC vs truth {t} (Å)", *(angstrom(fsc[name][f"fsc_{t}"]) for name in maps)))
    lines += [row("median / 90 % angular error (°)", f"{angle['median']:.2f} / {angle['p90']:.2f}", "0", ""),
              row("median / 90 % offset error (Å)", f"{offset['median']:.2f} / {offset['p90']:.2f}", "0", ""),
              row("wall time per iteration, mean (s)", angstrom(r["seconds_per_iteration"]), "", ""),
              "",
              row("shell", "resolution (Å)", "FSC vs truth, refined", "true poses", "start reference"),
              row("---", "---", "---", "---", "---")]
    for shell in sorted(set(np.linspace(2, box // 2, 8).round().astype(int))):
        lines.append(row(shell, f"{box * pixel / shell:.1f}", *(f"{fsc[name]['curve'][shell]:.3f}" for name in maps)))
    lines += ["", row("iteration", "resolution (Å)", "E (s)", "M (s)", "wall (s)"),
              row("---", "---", "---", "---", "---")]
    for it in results["per_iteration"]:
        lines.append(row(it["iteration"], angstrom(it["resolution_angstrom"]), f"{it['expectation_s']:.1f}",
                         f"{it['maximisation_s']:.1f}", angstrom(it.get("wall_s"))))
    return "\n".join(lines)


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
    code, seconds, started = run_refine(args, extra, work, setup)
    results = measure(work, setup, code, seconds, started, extra, args.keep_true_poses)
    (work / "results.json").write_text(json.dumps(finite_or_none(results), indent=1))
    print(markdown(results))
    print(f"\nresults: {work / 'results.json'}", file=sys.stderr)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

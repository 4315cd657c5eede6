"""cryorefine's CPU engine against RELION's CPU code: the same job, one after the other, on the same cores.
Simulates a 64 px ribosome set, runs relion_refine (or relion_refine_mpi for an auto-refine) and `cryorefine
--cpu` with the same options and threads, and reports the wall seconds of each command and of each iteration,
their ratio and each program's final resolution (JSON in --json).

    python benchmarks/cpu_vs_relion.py --work /tmp/cpu_bench                      # 300 particles, K=1, 2 iterations
    python benchmarks/cpu_vs_relion.py --work /tmp/cpu_bench --job refine --n 1000  # auto-refine to convergence
    python benchmarks/cpu_vs_relion.py --work /tmp/cpu_bench --job refine --n 1000 --cap_relion 1
                    # cryorefine to convergence first, then RELION for at most as long (a bound on the ratio)
    taskset -c 0,1 python benchmarks/cpu_vs_relion.py ... --j 2                   # on two given cores

Steps, in one work folder:

1. data     a 64 px, 4.57 Å/px map of the 70S ribosome (PDB 7P6Z through `density_from_model` at 10 Å,
            or examples/ribosome_64px.mrc re-labelled 4.57 Å/px when the model file is missing), --n
            particles made by `cryorefine simulate` (CTF, white noise at SNR --snr in the particle
            circle), and the map low-passed to 40 Å as the reference. Image names in the STAR file
            are absolute, so RELION (which reads them relative to where it runs) finds them too.
2. relion   `relion_refine` (RELION's CPU build, e.g. Debian's `relion` package; --relion names
            another binary or a command prefix) with the job's options and `--j J`; for refine
            `mpirun -n 3 relion_refine_mpi` (RELION splits random halves only under MPI: a master and
            a worker per half, each worker with --j J/2); skipped when it is not found.
3. ours     `python -m cryorefine classify|refine` with the same options, `--cpu --j J`.
4. report   wall seconds of each whole command (start-up included) and per iteration (between the
            iterations' run_itNNN_model.star files, the same rule for both programs), their ratio,
            and each program's final resolution; JSON in --json (default
            benchmarks/results/cpu_vs_relion_<job>_<n>.json).

Jobs (the options are those of the issue that set the target):
  classify  --K 1 --iter 2 --healpix_order 1 --offset_range 3 --offset_step 2 --particle_diameter 270
            --ini_high 40 --ctf --zero_mask --flatten_solvent --tau2_fudge 4 --pad 2 --oversampling 1
  refine    --auto_refine --split_random_halves --healpix_order 2 --auto_local_healpix_order 4
            --offset_range 5 --offset_step 2 --particle_diameter 270 --ini_high 40 --ctf --zero_mask
            --flatten_solvent --pad 2 --oversampling 1 --low_resol_join_halves 40 (to convergence)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import refuse_missing_programs

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO.parent / "shared/data/real/models/7p6z.cif.gz"
BOX_PX, PIXEL_ANGSTROM = 64, 4.57

COMMON = ["--particle_diameter", "270", "--ini_high", "40", "--ctf", "--zero_mask", "--flatten_solvent",
          "--pad", "2", "--oversampling", "1", "--random_seed", "1"]
RELION = {"classify": "relion_refine",
          "refine": "mpirun --allow-run-as-root --oversubscribe -n 3 relion_refine_mpi"}
JOBS = {
    "classify": ["--K", "1", "--iter", "2", "--healpix_order", "1", "--offset_range", "3", "--offset_step", "2",
                 "--tau2_fudge", "4"] + COMMON,
    "refine": ["--auto_refine", "--split_random_halves", "--healpix_order", "2", "--auto_local_healpix_order", "4",
               "--offset_range", "5", "--offset_step", "2", "--low_resol_join_halves", "40"] + COMMON,
}


def make_data(work: Path, n: int, snr: float, seed: int, model: Path) -> tuple[Path, Path]:
    from cryorefine.core.fourier import lowpass_filter_3d
    from cryorefine.io.mrc import read_volume, write_volume

    truth = work / "truth.mrc"
    if model.exists():
        from cryorefine.density import density_from_model

        volume = np.asarray(density_from_model(model, BOX_PX, PIXEL_ANGSTROM, 10.0), np.float32)
    else:
        volume, _ = read_volume(REPO / "examples/ribosome_64px.mrc")
    write_volume(truth, volume, PIXEL_ANGSTROM)
    low = np.fft.irfftn(lowpass_filter_3d(np.fft.rfftn(volume), BOX_PX, 40.0, PIXEL_ANGSTROM), s=volume.shape,
                        axes=(0, 1, 2))
    reference = work / "ref_lp40.mrc"
    write_volume(reference, low.astype(np.float32), PIXEL_ANGSTROM)
    sim = work / "sim"
    subprocess.run([sys.executable, "-m", "cryorefine", "simulate", "--ref", str(truth), "--n", str(n),
                    "--snr", str(snr), "--seed", str(seed), "--particle_diameter", "270", "--o", str(sim), "--cpu"],
                   check=True, stdout=subprocess.DEVNULL)
    # absolute image names: RELION reads them relative to the folder it runs in
    star = sim / "particles.star"
    text = star.read_text()
    text = re.sub(r"(\d+)@(particles\.mrcs)", lambda m: f"{m.group(1)}@{(sim / m.group(2)).resolve()}", text)
    absolute = sim / "particles_abs.star"
    absolute.write_text(text)
    return absolute, reference


def iteration_files(folder: Path) -> list[Path]:
    """run_itNNN_model.star (classify) or run_itNNN_half1_model.star (refine) of iterations 1, 2, ..."""
    files = sorted(folder.glob("run_it[0-9][0-9][0-9]_model.star")) or sorted(
        folder.glob("run_it[0-9][0-9][0-9]_half1_model.star"))
    return [path for path in files if int(path.name[6:9]) > 0]


def iteration_seconds(folder: Path, start: float) -> list[float]:
    """Seconds between consecutive iterations' model files (the first from the command's start)."""
    return list(np.diff([start] + [path.stat().st_mtime for path in iteration_files(folder)]))


def final_resolution(folder: Path) -> float | None:
    candidates = [folder / "run_model.star"] + sorted(folder.glob("run_it[0-9][0-9][0-9]_model.star"))[::-1]
    candidates += sorted(folder.glob("run_it[0-9][0-9][0-9]_half1_model.star"))[::-1]
    for path in candidates:
        if path.exists():
            match = re.search(r"_rlnCurrentResolution\s+([0-9.eE+-]+)", path.read_text())
            if match:
                return float(match.group(1))
    return None


def timed(command: list[str], folder: Path, log: Path, stop_after: int | None = None,
          max_seconds: float | None = None) -> dict:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    command = command + ["--o", str(folder / "run")]
    start = time.time()
    tic = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=folder, start_new_session=True)
        stopped = False
        while process.poll() is None:
            if stop_after and len(iteration_files(folder)) >= stop_after:
                time.sleep(1.0)  # the iteration's other files
                stopped = True
            elif max_seconds and time.perf_counter() - tic > max_seconds:
                stopped = True
            if stopped:
                os.killpg(process.pid, 15)
                process.wait()
                break
            time.sleep(0.2)
        rc = process.returncode
    seconds = time.perf_counter() - tic
    return {"command": " ".join(command), "returncode": rc, "seconds": round(seconds, 2),
            "finished": rc == 0 and not stopped, "max_seconds": max_seconds,
            "iteration_seconds": [round(s, 2) for s in iteration_seconds(folder, start)],
            "iterations": len(iteration_seconds(folder, start)), "resolution_angstrom": final_resolution(folder),
            "stopped_after_iteration": stop_after,
            "log": str(log)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--job", choices=sorted(JOBS), default="classify")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--snr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--model", type=Path, default=MODEL, help="atomic model of the map [default: %(default)s]")
    parser.add_argument("--j", type=int, default=2, help="threads of both programs")
    parser.add_argument("--relion", default=None,
                        help="RELION's command prefix [default: relion_refine for classify; for refine, whose "
                             "random halves RELION only splits under MPI, mpirun -n 3 relion_refine_mpi: a master "
                             "and one worker per half, as RELION runs it]")
    parser.add_argument("--skip_relion", action="store_true")
    parser.add_argument("--stop_after", type=int, default=None,
                        help="stop each program once it has written this many iterations (a job too long to "
                             "run to convergence here: the first N iterations of both, measured)")
    parser.add_argument("--cap_relion", type=float, default=None, metavar="F",
                        help="run cryorefine first, then RELION for at most F times cryorefine's whole time (for "
                             "jobs RELION takes hours to finish here): if RELION has not finished by then, "
                             "cryorefine/RELION is at most 1/F, a measured bound")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    refuse_missing_programs(parser, args)

    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    star, reference = make_data(work, args.n, args.snr, args.seed, args.model)
    options = JOBS[args.job]
    report = {"job": args.job, "n_particles": args.n, "snr": args.snr, "threads": args.j,
              "box_px": BOX_PX, "pixel_size_angstrom": PIXEL_ANGSTROM, "options": " ".join(options),
              "cpus_allowed": len(os.sched_getaffinity(0))}
    relion = (args.relion or RELION[args.job]).split()
    if Path(relion[0]).exists():  # a path: the programs run in their own folders
        relion[0] = str(Path(relion[0]).resolve())
    ours_command = [sys.executable, "-m", "cryorefine", "refine" if args.job == "refine" else "classify",
                    "--i", str(star), "--ref", str(reference), "--cpu", "--j", str(args.j)]
    ours_options = [o for o in options if o not in ("--auto_refine", "--split_random_halves")]

    def run_ours():
        report["cryorefine"] = timed(ours_command + ours_options, work / "cryorefine", work / "cryorefine.log",
                                     args.stop_after)

    if args.cap_relion:
        run_ours()
    if not args.skip_relion and shutil.which(relion[0]):
        # under MPI each of RELION's two workers gets half of the threads: both programs on J cores
        relion_threads = max(1, args.j // 2) if args.job == "refine" and args.relion is None else args.j
        report["relion_threads_per_rank"] = relion_threads
        cap = args.cap_relion * report["cryorefine"]["seconds"] if args.cap_relion else None
        report["relion"] = timed(relion + ["--i", str(star), "--ref", str(reference)] + options
                                 + ["--j", str(relion_threads)], work / "relion", work / "relion.log",
                                 args.stop_after, cap)
    if not args.cap_relion:
        run_ours()
    if "relion" in report:
        ours, theirs = report["cryorefine"], report["relion"]
        report["ratio_total"] = round(ours["seconds"] / theirs["seconds"], 3)
        if theirs["max_seconds"] and not theirs["finished"] and ours["finished"]:
            report["ratio_total_at_most"] = report.pop("ratio_total")  # RELION stopped before finishing
        report["ratio_per_iteration"] = [round(a / b, 3) for a, b in zip(ours["iteration_seconds"],
                                                                         theirs["iteration_seconds"]) if b > 0]
    out = args.json or REPO / f"benchmarks/results/cpu_vs_relion_{args.job}_{args.n}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for name in ("relion", "cryorefine"):
        if name in report:
            r = report[name]
            print(f"{name:10s} {r['seconds']:8.1f} s  rc {r['returncode']}  {r['iterations']} iterations  "
                  f"per iteration {[float(s) for s in r['iteration_seconds']]}  resolution {r['resolution_angstrom']} Å")
    if "ratio_total_at_most" in report:
        print(f"cryorefine / RELION: at most {report['ratio_total_at_most']:.2f}× in total (RELION stopped "
              f"unfinished after {report['relion']['seconds']:.0f} s)")
    if "ratio_total" in report:
        print(f"cryorefine / RELION: {report['ratio_total']:.2f}× in total, per iteration {[float(r) for r in report['ratio_per_iteration']]}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

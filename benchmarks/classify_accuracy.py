"""How accurate is 3D classification, iteration by iteration? Simulates a two-state set with known states (a
ribosome map and the same with a ball of density erased), classifies it with K=2 for each seed, and reports after
every iteration the share of particles in the class of their true state, the class shares and the resolution,
beside RELION's relion_refine on the same files when --relion names it (table on stdout, JSON in the work folder).

    python benchmarks/classify_accuracy.py --work /tmp/cls --gpu --seeds 1 2 3       # the full set, 15 iterations
    python benchmarks/classify_accuracy.py --work /tmp/cls --cpu --seeds 1 --n 400 --iter 8
    python benchmarks/classify_accuracy.py --work /tmp/cls --gpu --snr 0.05 --seeds 1 2 3     # the hard set
    python3 benchmarks/classify_accuracy.py --work /tmp/c30s --gpu --seeds 1 2 3 --model .bench/7p6z.cif.gz \\
        --chains B,D,F,A,H,J,C,S,O,K,M,I,L,N,R,T,G,Q,E,P,5 --angpix 5.0 --ball_angstrom 45 \\
        --relion "mpirun --allow-run-as-root -n 3 /tmp/relion/build/bin/relion_refine_mpi --gpu 0:0" --relion_j 4
                                      # the 30S subunit of 7P6Z, beside RELION 5's GPU build (a worker per class)

Steps, in one work folder:

1. maps      state A: examples/ribosome_64px.mrc (or --map) relabelled --angpix Å/px (the 70S ribosome in a
             64 px box), or with --model the density of an atomic model (e.g. PDB 7P6Z, the 70S ribosome)
             at --model_resolution Å in a 64 px box of --angpix Å/px (--chains: only those chains, e.g. one
             subunit; --box: Fourier-cropped to that box, the pixel size scaled to match); state B: A with a ball of density erased, its radius
             (--ball_angstrom, 55 Å) and centre chosen so that it removes --erase_fraction (13.5 %) of A's
             positive mass; the reference: A low-passed to 40 Å.
2. particles --n particles, each state drawn with probability 1/2 (seeded), made by `cryorefine simulate`
             (uniform random poses, CTF with defocus 0.9–2.5 µm at 300 kV, white noise at --snr in the
             particle circle); one STAR file in a shuffled order, the true states in states.txt. With
             --relion_project CMD the images are RELION's own (`relion_project --ang --ctf --add_noise`,
             e.g. Debian's build) at the same poses, CTFs and origins, their white noise set to the same
             --snr in the particle circle (measured on RELION's noiseless projections): the kind of set the
             issue's RELION-made images were.
3. classify  for each --seeds S: `cryorefine classify --K 2 --iter 15 --tau2_fudge 4 --particle_diameter 270
             --ini_high 40 --ctf --zero_mask --flatten_solvent --healpix_order 2 --offset_range 5
             --offset_step 2 --random_seed S` (the options of the set RELION 5 reached 94.2 % on), and
             whatever follows `--`.
4. measure   after every iteration, the share of particles in the class of their true state (the better of
             the two ways to pair classes with states), the class distribution, the resolution the run reports,
             and the job's wall time.
5. relion    with --relion CMD, the same job run by RELION (`relion_refine`, e.g. Debian's CPU build, --j
             --relion_j) on the same files and seeds, measured the same way (--relion_seconds stops a run and
             measures the iterations it finished).

A table goes to stdout, everything to WORK/results.json (or --json).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import model_chains, refuse_missing_programs, run_cli, split_at_double_dash, work_and_engine_parser

from cryorefine.core import fourier
from cryorefine.io.mrc import open_mrc, read_volume, write_volume
from cryorefine.io.star import read_particle_star, read_star, write_particle_star

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MAP = REPO / "examples" / "ribosome_64px.mrc"
CLASSIFY = ["--K", "2", "--tau2_fudge", "4", "--particle_diameter", "270", "--ini_high", "40", "--ctf",
            "--zero_mask", "--flatten_solvent", "--healpix_order", "2", "--offset_range", "5", "--offset_step", "2"]


def parse_args(argv):
    argv, extra = split_at_double_dash(argv)
    parser = work_and_engine_parser(__doc__.split("\n\n")[0], "Options after -- are passed on to every `cryorefine classify` run.", "Classify")
    parser.add_argument("--map", type=Path, default=DEFAULT_MAP, help="State A (cubic MRC).")
    parser.add_argument("--model", type=Path, default=None, help="Atomic model whose density is state A.")
    parser.add_argument("--chains", default=None,
                        help="Keep only these chains of --model (author names, comma-separated), e.g. one subunit.")
    parser.add_argument("--model_resolution", type=float, default=10.0, help="Resolution of that density (Å).")
    parser.add_argument("--angpix", type=float, default=4.57, help="Pixel size given to the map (Å).")
    parser.add_argument("--box", type=int, default=None,
                        help="Fourier-crop both states to this box (px), the pixel size scaled to match [default: 64].")
    parser.add_argument("--ball_angstrom", type=float, default=55.0, help="Radius of the erased ball (Å).")
    parser.add_argument("--erase_fraction", type=float, default=0.135, help="Share of A's mass erased for B.")
    parser.add_argument("--n", type=int, default=1000, help="Particles of both states together.")
    parser.add_argument("--snr", type=float, default=0.2, help="Signal-to-noise ratio of the images.")
    parser.add_argument("--iter", type=int, default=15, help="Iterations of each classification.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="--random_seed of each run.")
    parser.add_argument("--data_seed", type=int, default=7, help="Random seed of the simulation.")
    parser.add_argument("--relion", default=None,
                        help="Also run RELION's relion_refine (this command or path) with the same options on the same "
                             "files, for the same seeds")
    parser.add_argument("--relion_j", type=int, default=1, help="--j of the RELION runs.")
    parser.add_argument("--relion_project", default=None,
                        help="Make the images with RELION's relion_project (this command or path) instead of "
                             "`cryorefine simulate`, at the same poses, CTFs, origins and SNR")
    parser.add_argument("--relion_seconds", type=float, default=None,
                        help="Stop each RELION run after this many seconds (its finished iterations are measured).")
    parser.add_argument("--json", type=Path, default=None, help="Results file [default: WORK/results.json].")
    options = parser.parse_args(argv)
    refuse_missing_programs(parser, options, ("relion", "relion_project"))
    return options, extra


def erased_state(volume, radius_px, fraction):
    """A copy of `volume` with the ball of `radius_px` whose positive mass is nearest `fraction` of the whole
    set to zero (centres tried on a 2 px grid inside the map's mass), and that share."""
    v = np.asarray(volume, dtype=np.float64)
    positive = np.maximum(v, 0.0)
    total = positive.sum()
    n = v.shape[0]
    axis = np.arange(n) - n // 2
    z, y, x = np.meshgrid(axis, axis, axis, indexing="ij")
    best = None
    for cz in range(-n // 4, n // 4 + 1, 2):
        for cy in range(-n // 4, n // 4 + 1, 2):
            for cx in range(-n // 4, n // 4 + 1, 2):
                ball = (z - cz) ** 2 + (y - cy) ** 2 + (x - cx) ** 2 <= radius_px ** 2
                share = positive[ball].sum() / total
                if best is None or abs(share - fraction) < abs(best[0] - fraction):
                    best = (share, ball)
    out = v.copy()
    out[best[1]] = 0.0
    return out, float(best[0])


def make_set(work, options, engine):
    if options.model is not None:
        from cryorefine.density import density_from_model

        model = options.model if options.chains is None else model_chains(options.model, options.chains,
                                                                            work / "model.cif")
        volume = np.asarray(density_from_model(model, 64, options.angpix, options.model_resolution), np.float64)
    else:
        volume = read_volume(options.map)[0].astype(np.float64)
    pixel = options.angpix
    if options.box and options.box != volume.shape[0]:  # a smaller box, the same particle: coarser pixels
        pixel *= volume.shape[0] / options.box
        volume = fourier.downsample_volume(volume, options.box)
    box = volume.shape[0]
    b, erased = erased_state(volume, options.ball_angstrom / pixel, options.erase_fraction)
    for name, v in (("state_a", volume), ("state_b", b)):
        write_volume(work / f"{name}.mrc", v.astype(np.float32), pixel)
    low = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume), box, 40.0, pixel)
    write_volume(work / "ref_lp40.mrc", fourier.irfft3_centered(low, box).astype(np.float32), pixel)
    rng = np.random.default_rng(options.data_seed)
    states = rng.integers(0, 2, options.n)
    tables = []
    for state, name in enumerate(("state_a", "state_b")):
        count = int(np.sum(states == state))
        run_cli("simulate", "--ref", work / f"{name}.mrc", "--n", count, "--snr", options.snr, "--defocus", "0.9:2.5",
                "--particle_diameter", 270, "--seed", options.data_seed + 10 * state, "--o", work / f"sim_{name}",
                engine, log_path=work / f"simulate_{name}.log")
        if options.relion_project:
            relion_images(work / f"sim_{name}", work / f"{name}.mrc", pixel, options.snr, options.relion_project)
        star = read_particle_star(work / f"sim_{name}" / "particles.star")
        tables.append((star, name))
    first = tables[0][0]
    rows = [t.particles.assign(rlnImageName=t.particles["rlnImageName"].str.replace("@", f"@sim_{name}/"))
            for t, name in tables]
    import pandas as pd

    order = rng.permutation(options.n)
    mixed = pd.concat(rows, ignore_index=True)
    labels = np.concatenate([np.full(len(t.particles), s) for s, (t, _) in enumerate(tables)])
    mixed, labels = mixed.iloc[order].reset_index(drop=True), labels[order]
    write_particle_star(first, work / "particles.star", mixed)
    np.savetxt(work / "states.txt", labels, fmt="%d")
    return erased


def relion_images(folder, volume_path, pixel, snr, command):
    """Replace the images of `folder`/particles.star by relion_project's at the same poses, CTFs and origins: first
    noiseless, to measure the signal's variance inside the particle circle (270 Å, as `cryorefine simulate`
    measures its SNR), then with white noise of variance signal / `snr`; the STAR file then names RELION's stack."""
    program = command.split()
    star = folder / "particles.star"

    def project(root, *noise):
        subprocess.run(program + ["--i", str(volume_path), "--o", str(folder / root), "--ang", str(star), "--ctf",
                                  "--angpix", str(pixel), *noise], check=True, capture_output=True, text=True)
        return folder / f"{root}.mrcs"

    with open_mrc(project("relion_clean")) as mrc:
        clean = np.asarray(mrc.data, dtype=np.float64)
    n = clean.shape[-1]
    axis = np.arange(n) - n // 2
    inside = axis[:, None] ** 2 + axis[None, :] ** 2 <= (270.0 / (2 * pixel)) ** 2
    sigma = float(np.sqrt(np.mean(clean[:, inside].var(axis=1)) / snr))
    stack = project("relion", "--add_noise", "--white_noise", f"{sigma:.6g}")
    (folder / "relion_clean.mrcs").unlink()
    table = read_particle_star(star)
    names = [f"{i + 1:06d}@{stack.name}" for i in range(len(table.particles))]
    write_particle_star(table, star, table.particles.assign(rlnImageName=names))


def accuracy(classes, states):
    """The share in the class of their true state, the better of the two pairings of classes with states."""
    right = float(np.mean(np.asarray(classes) - 1 == states))
    return max(right, 1.0 - right)


def measured(folder, iterations, states):
    """Accuracy, class shares and reported resolution after each of the first `iterations` iterations of the run
    in `folder` (those whose files exist)."""
    accuracy_per_iteration, shares, resolutions = [], [], []
    for it in range(1, iterations + 1):
        data, model = folder / f"run_it{it:03d}_data.star", folder / f"run_it{it:03d}_model.star"
        if not (data.exists() and model.exists()):
            break
        table = read_star(data)["particles"]
        accuracy_per_iteration.append(round(accuracy(table["rlnClassNumber"].to_numpy(), states), 4))
        counts = np.bincount(table["rlnClassNumber"].to_numpy() - 1, minlength=2)
        shares.append([round(float(c) / len(table), 3) for c in counts])
        resolutions.append(round(float(read_star(model)["model_general"]["rlnCurrentResolution"]), 2))
    return {"accuracy_per_iteration": accuracy_per_iteration,
            "final": accuracy_per_iteration[-1] if accuracy_per_iteration else None,
            "best": max(accuracy_per_iteration, default=None), "class_shares_per_iteration": shares,
            "resolution_angstrom_per_iteration": resolutions}


def one_seed(work, seed, options, extra, engine, states):
    folder = work / f"seed{seed}"
    folder.mkdir(exist_ok=True)
    tic = time.perf_counter()
    run_cli("classify", "--i", work / "particles.star", "--ref", work / "ref_lp40.mrc", "--o", folder / "run",
            "--iter", options.iter, "--random_seed", seed, *CLASSIFY, engine, *extra, "--overwrite",
            log_path=folder / "classify.log")
    return {"seed": seed, "wall_seconds": round(time.perf_counter() - tic, 1), **measured(folder, options.iter, states)}


def one_relion_seed(work, seed, options, states):
    """The same job with RELION, run in `work` (RELION reads image names relative to where it runs)."""
    folder = work / f"relion_seed{seed}"
    folder.mkdir(exist_ok=True)
    program = options.relion.split()
    if Path(program[0]).exists():  # a path: RELION runs in the work folder
        program[0] = str(Path(program[0]).resolve())
    command = program + ["--i", "particles.star", "--ref", "ref_lp40.mrc", "--o", f"{folder.name}/run", "--iter",
                         str(options.iter), "--random_seed", str(seed), "--j", str(options.relion_j), *CLASSIFY]
    print("$ " + " ".join(command), file=sys.stderr, flush=True)
    tic = time.perf_counter()
    with open(folder / "relion.log", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                  timeout=options.relion_seconds).returncode
        except subprocess.TimeoutExpired:
            code = "stopped"
    return {"seed": seed, "program": "relion", "returncode": code, "wall_seconds": round(time.perf_counter() - tic, 1),
            **measured(folder, options.iter, states)}


def main(argv=None):
    options, extra = parse_args(sys.argv[1:] if argv is None else argv)
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    engine = "--gpu" if options.gpu else "--cpu"
    erased = make_set(work, options, engine)
    states = np.loadtxt(work / "states.txt", dtype=int)
    runs = [one_seed(work, seed, options, extra, engine, states) for seed in options.seeds]
    if options.relion:
        runs += [one_relion_seed(work, seed, options, states) for seed in options.seeds]
    report = {"n": options.n, "snr": options.snr, "iterations": options.iter, "engine": engine[2:],
              "erased_share": round(erased, 4), "state_b_share": round(float(states.mean()), 4),
              "options": " ".join(CLASSIFY + extra), "runs": runs}
    out = options.json or work / "results.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    marks = [i for i in (5, 10, 15) if i <= options.iter] or [options.iter]
    print("| program | seed | " + " | ".join(f"it {i}" for i in marks) + " | best | final − best | s |")
    print("|---" * (len(marks) + 5) + "|")
    for r in runs:
        acc = r["accuracy_per_iteration"]
        if not acc:
            print(f"| {r.get('program', 'cryorefine')} | {r['seed']} | no iteration finished |")
            continue
        print(f"| {r.get('program', 'cryorefine')} | {r['seed']} | "
              + " | ".join(f"{100 * acc[i - 1]:.1f}" if i <= len(acc) else "–" for i in marks)
              + f" | {100 * r['best']:.1f} | {100 * (r['final'] - r['best']):.1f} | {r['wall_seconds']:.0f} |")
    ours = [r["final"] for r in runs if "program" not in r]
    print(f"cryorefine mean final {100 * np.mean(ours):.1f} %; erased {100 * erased:.1f} % of the mass; "
          f"wrote {out}")


if __name__ == "__main__":
    main()

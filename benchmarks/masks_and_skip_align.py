"""What do --solvent_mask, --solvent_correct_fsc and --skip_align give on simulated data with a known truth? A
small particle in a big box refined with the sphere alone, with a solvent mask and with the solvent-corrected
FSC (FSC against the truth, reported resolution); the corrected FSC of a true-pose reconstruction against the
truth; a two-state set classified with --skip_align (share in the right class per iteration). Tables on stdout
and WORK/results.json; --only runs one part.

1. truth     the example ribosome Fourier-cropped to --inner px and padded into a --box px box (a small particle
             in a big box: most of the box is solvent), at --pixel Å/px: WORK/truth.mrc; a soft mask around it
             (`core.masks.mask_from_map`: 5 % of the maximum, 1 px wider, 3 px soft edge): WORK/mask.mrc.
2. simulate  `cryorefine simulate` of --n particles at --snr (inside the particle's circle); refine is given the
             particles without their poses (WORK/sim/unaligned.star), and a reference low-passed to --ini_high.
3. refine    three runs of `cryorefine refine` with the same options (--flatten_solvent --zero_mask --ctf, the
             sphere of --diameter Å; options after `--` are appended):
               sphere    the spherical mask alone,
               mask      + --solvent_mask WORK/mask.mrc,
               mask_fsc  + --solvent_mask WORK/mask.mrc --solvent_correct_fsc.
4. measure   per run, from the final map (run_class001.mrc; else the last iteration's half-1 map): the FSC
             against the truth over the whole box and inside the mask (both maps times the mask), where each
             falls below 0.5 and 0.143; the resolution refine reports (rlnCurrentResolution of run_model.star,
             else of the last half-1 model), and how many shells it is from the truth's FSC-0.5 point (inside the
             mask: the region the corrected FSC speaks for).
   truepose  the same particles reconstructed at their true poses (`cryorefine reconstruct --ctf --half_maps`):
             where the FSC between the half maps falls below 0.143, unmasked and solvent-corrected with the mask
             (`core.fsc.solvent_corrected_fsc`, as --solvent_correct_fsc computes it), next to where the FSC of
             the whole reconstruction against the truth (inside the mask) falls below 0.5: RELION's
             gold-standard relation, checked without a refinement having to converge.
5. skip_align  two maps (the ribosome at 32 px, and a copy with a piece removed and a blob added), --skip_n
             particles of each with their true poses, `cryorefine classify --K 2 --skip_align` from their
             average: the fraction in the right class after each iteration, and the time.
Tables on stdout and WORK/results.json.

    .venv/bin/python benchmarks/masks_and_skip_align.py --work /tmp/masks           # the defaults below
    .venv/bin/python benchmarks/masks_and_skip_align.py --work /tmp/masks --only skip_align
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from bench_common import run_cli

from cryorefine.core import fourier
from cryorefine.core.fsc import fsc_volumes
from cryorefine.core.masks import mask_from_map
from cryorefine.io.mrc import read_volume, write_volume
from cryorefine.io.star import read_star

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_MAP = REPO / "examples" / "ribosome_64px.mrc"
RUNS = {"sphere": [], "mask": ["--solvent_mask", "{mask}"],
        "mask_fsc": ["--solvent_mask", "{mask}", "--solvent_correct_fsc"]}


def shell_below(curve, threshold):
    """The last shell before the curve first drops below `threshold` (from shell 1)."""
    below = np.flatnonzero(np.asarray(curve)[1:] < threshold)
    return int(below[0]) if below.size else len(curve) - 1


def angstrom(shell, box, pixel):
    return box * pixel / shell if shell > 0 else float("inf")


# ------------------------------------------------------------------------------ 1-4: masks
def make_truth(work, box, inner, pixel):
    small = fourier.downsample_volume(read_volume(EXAMPLE_MAP)[0], inner)
    truth = np.zeros((box,) * 3, np.float32)
    start = box // 2 - inner // 2
    truth[start:start + inner, start:start + inner, start:start + inner] = small
    mask = mask_from_map(truth, 0.05 * truth.max(), 1.0, 3.0)
    write_volume(work / "truth.mrc", truth, pixel)
    write_volume(work / "mask.mrc", mask, pixel)
    return truth, mask


def simulate(work, args):
    run_cli("simulate", "--ref", work / "truth.mrc", "--n", args.n, "--snr", args.snr, "--seed", 11,
            "--particle_diameter", args.inner * args.pixel, "--o", work / "sim", "--cpu", log_path=work / "simulate.log")
    blocks = read_star(work / "sim" / "particles.star")
    table = blocks["particles"].drop(columns=["rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi", "rlnOriginXAngst",
                                              "rlnOriginYAngst"])
    import starfile

    starfile.write({"optics": blocks["optics"], "particles": table}, work / "sim" / "unaligned.star")
    truth, _ = read_volume(work / "truth.mrc")
    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(truth), args.box, args.ini_high, args.pixel)
    write_volume(work / "reference.mrc", fourier.irfft3_centered(ft, args.box), args.pixel)


def refine(work, name, args, extra):
    out = work / name
    out.mkdir(exist_ok=True)
    options = [o.format(mask=work / "mask.mrc") for o in RUNS[name]]
    seconds = run_cli("refine", "--i", work / "sim" / "unaligned.star", "--ref", work / "reference.mrc",
                      "--o", out / "run", "--ini_high", args.ini_high, "--ctf", "--particle_diameter", args.diameter,
                      "--flatten_solvent", "--zero_mask", "--iter", args.iter, "--cpu", *options, *extra, "--overwrite",
                      log_path=work / f"{name}.log")
    return seconds


def measure(work, name, truth, mask, box, pixel):
    out = work / name
    if (out / "run_class001.mrc").is_file():
        final, model_file, converged = out / "run_class001.mrc", out / "run_model.star", True
    else:
        last = sorted(out.glob("run_it*_half1_class001.mrc"))[-1]
        final = last
        model_file = Path(str(last).replace("_class001.mrc", "_model.star"))
        converged = False
    volume, _ = read_volume(final)
    whole = np.asarray(fsc_volumes(volume, truth))
    inside = np.asarray(fsc_volumes(volume * mask, truth * mask))
    model = read_star(model_file)
    general = model["model_general"]
    reported = float(general["rlnCurrentResolution"])
    reported_shell = int(round(box * pixel / reported))
    truth_shell = shell_below(inside, 0.5)
    # iteration 0's files come before iteration 1; a converged run's final iteration writes run_optimiser.star
    iterations = len([p for p in out.glob("run_it*_optimiser.star") if not p.name.startswith("run_it000_")]) + converged
    row = {"run": name, "converged": converged, "final_map": str(final), "iterations": iterations,
           "fsc_truth_0.5_A": angstrom(shell_below(whole, 0.5), box, pixel),
           "fsc_truth_0.143_A": angstrom(shell_below(whole, 0.143), box, pixel),
           "fsc_truth_masked_0.5_A": angstrom(truth_shell, box, pixel),
           "fsc_truth_masked_0.143_A": angstrom(shell_below(inside, 0.143), box, pixel),
           "fsc_truth_mean_shells_8_16": float(whole[8:17].mean()),
           "reported_A": reported, "reported_shell": reported_shell, "truth_masked_0.5_shell": truth_shell,
           "shells_off": reported_shell - truth_shell,
           "fsc_used": "solvent-corrected" if "rlnDoSolventFscCorrection" in general else "unmasked half maps"}
    return row


def true_pose_fsc(work, truth, mask, box, pixel):
    import starfile

    from cryorefine.core.fsc import solvent_corrected_fsc

    folder = work / "truepose"
    folder.mkdir(exist_ok=True)
    table = starfile.read(work / "sim" / "particles.star")
    rng = np.random.default_rng(0)
    table["particles"]["rlnRandomSubset"] = rng.permutation(np.arange(len(table["particles"])) % 2) + 1
    table["particles"]["rlnImageName"] = [n.replace("@", f"@{work / 'sim'}/") for n in table["particles"]["rlnImageName"]]
    starfile.write(table, folder / "particles.star")
    run_cli("reconstruct", "--i", folder / "particles.star", "--o", folder / "recon.mrc", "--ctf", "--half_maps",
            log_path=folder / "reconstruct.log")
    halves = [read_volume(folder / f"recon_half{h}.mrc")[0] for h in (1, 2)]
    full, _ = read_volume(folder / "recon.mrc")
    unmasked = np.asarray(fsc_volumes(*halves))
    corrected = solvent_corrected_fsc(halves[0], halves[1], mask, np.random.default_rng(1))
    to_truth = np.asarray(fsc_volumes(full * mask, truth * mask))
    to_truth_whole = np.asarray(fsc_volumes(full, truth))
    shells = {"half_maps_unmasked_0.143": shell_below(unmasked, 0.143),
              "half_maps_corrected_0.143": shell_below(corrected.corrected, 0.143),
              "half_maps_masked_uncorrected_0.143": shell_below(corrected.masked, 0.143),
              "map_vs_truth_masked_0.5": shell_below(to_truth, 0.5),
              "map_vs_truth_whole_0.5": shell_below(to_truth_whole, 0.5)}
    return {name: {"shell": s, "angstrom": angstrom(s, box, pixel)} for name, s in shells.items()}


# ------------------------------------------------------------------------------ 5: skip_align
def skip_align(work, n_each, iterations):
    import pandas as pd
    import starfile

    folder = work / "skip_align"
    folder.mkdir(exist_ok=True)
    a = fourier.downsample_volume(read_volume(EXAMPLE_MAP)[0], 32)
    z, y, x = np.mgrid[:32, :32, :32] - 16
    b = a.copy()
    b[(x - 6) ** 2 + (y - 2) ** 2 + (z + 3) ** 2 < 36] = 0.0
    b += 0.6 * a.max() * np.exp(-((x + 9) ** 2 + (y + 4) ** 2 + (z - 5) ** 2) / 8.0)
    for name, volume in (("a", a), ("b", b), ("avg", (a + b) / 2)):
        write_volume(folder / f"{name}.mrc", volume, 12.0)
    tables = []
    for seed, name in ((1, "a"), (2, "b")):
        run_cli("simulate", "--ref", folder / f"{name}.mrc", "--n", n_each, "--snr", 0.5, "--seed", seed,
                "--o", folder / f"sim_{name}", "--cpu")
        t = starfile.read(folder / f"sim_{name}" / "particles.star")
        t["particles"]["rlnImageName"] = t["particles"]["rlnImageName"].str.replace("@", f"@sim_{name}/")
        tables.append(t)
    mixed = pd.concat([t["particles"] for t in tables]).reset_index(drop=True)
    starfile.write({"optics": tables[0]["optics"], "particles": mixed}, folder / "mix.star")
    seconds = run_cli("classify", "--i", folder / "mix.star", "--ref", folder / "avg.mrc", "--o",
                      folder / "out" / "run", "--K", 2, "--iter", iterations, "--skip_align", "--ini_high", 40,
                      "--ctf", "--particle_diameter", 320, "--flatten_solvent", "--zero_mask", "--cpu",
                      log_path=folder / "classify.log")
    truth = np.r_[np.zeros(n_each), np.ones(n_each)]
    per_iteration = []
    for it in range(1, iterations + 1):
        found = starfile.read(folder / "out" / f"run_it{it:03d}_data.star")["particles"]["rlnClassNumber"].to_numpy() - 1
        per_iteration.append(float(max(np.mean(found == truth), np.mean(found != truth))))
    return {"particles": 2 * n_each, "iterations": iterations, "seconds": seconds,
            "right_class_per_iteration": per_iteration}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--box", type=int, default=48)
    parser.add_argument("--inner", type=int, default=24, help="box of the ribosome before padding (px)")
    parser.add_argument("--pixel", type=float, default=8.0)
    parser.add_argument("--n", type=int, default=600)
    parser.add_argument("--snr", type=float, default=0.05)
    parser.add_argument("--diameter", type=float, default=300.0, help="--particle_diameter of refine (Å)")
    parser.add_argument("--ini_high", type=float, default=40.0)
    parser.add_argument("--iter", type=int, default=20)
    parser.add_argument("--skip_n", type=int, default=600, help="particles per class of the skip_align figure")
    parser.add_argument("--skip_iter", type=int, default=8)
    parser.add_argument("--only", choices=["masks", "truepose", "skip_align"], default=None)
    parser.add_argument("extra", nargs="*", help="after --: options appended to every refine")
    args = parser.parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    results = {"options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if args.only in (None, "masks"):
        truth, mask = make_truth(work, args.box, args.inner, args.pixel)
        simulate(work, args)
        rows = []
        for name in RUNS:
            seconds = refine(work, name, args, args.extra)
            row = measure(work, name, truth, mask, args.box, args.pixel)
            row["seconds"] = seconds
            rows.append(row)
        results["masks"] = rows
        print(f"\n{args.n} particles, {args.box} px box at {args.pixel} Å/px, ribosome in {args.inner} px, SNR "
              f"{args.snr}; Nyquist {2 * args.pixel:.1f} Å\n")
        print("| run | converged (iterations) | FSC vs truth 0.5 / 0.143 (Å) | inside the mask 0.5 / 0.143 (Å) | "
              "reported (Å) | shells from the truth's 0.5 (masked) | FSC used | time (s) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['run']} | {'yes' if r['converged'] else 'no'} ({r['iterations']}) | "
                  f"{r['fsc_truth_0.5_A']:.1f} / {r['fsc_truth_0.143_A']:.1f} | "
                  f"{r['fsc_truth_masked_0.5_A']:.1f} / {r['fsc_truth_masked_0.143_A']:.1f} | {r['reported_A']:.1f} | "
                  f"{r['shells_off']:+d} | {r['fsc_used']} | {r['seconds']:.0f} |")
    if args.only in (None, "truepose"):
        if args.only == "truepose":  # the truth, mask and particles of an earlier run in WORK, else made now
            if not (work / "sim" / "particles.star").is_file():
                make_truth(work, args.box, args.inner, args.pixel)
                simulate(work, args)
            truth, mask = read_volume(work / "truth.mrc")[0], read_volume(work / "mask.mrc")[0]
        result = true_pose_fsc(work, truth, mask, args.box, args.pixel)
        results["truepose"] = result
        print("\nTrue-pose reconstruction of the same particles: where each curve falls below its threshold\n")
        print("| curve | threshold | shell | Å |")
        print("| --- | --- | --- | --- |")
        for name, value in result.items():
            label, threshold = name.rsplit("_", 1)
            print(f"| {label} | {threshold} | {value['shell']} | {value['angstrom']:.1f} |")
    if args.only in (None, "skip_align"):
        result = skip_align(work, args.skip_n, args.skip_iter)
        results["skip_align"] = result
        print(f"\n--skip_align, {result['particles']} particles (two maps, true poses), K = 2 from their average: "
              f"right class per iteration {', '.join(f'{100 * f:.1f} %' for f in result['right_class_per_iteration'])}"
              f"; {result['seconds']:.0f} s")
    (work / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

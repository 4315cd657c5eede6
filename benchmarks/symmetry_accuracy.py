"""Does --sym pay as it should? For each point group G, simulates a G-symmetric set and refines n particles with
--sym G and |G| times as many with C1, from the same reference and options, and reports each final map's FSC
against the truth (0.5 and 0.143), the resolution refine reports, the map's symmetry error, the iterations and the
wall time (table on stdout, JSON in the work folder).

For each group G given (default D2 and O), in WORK/G:

1. truth     examples/ribosome_64px.mrc (or --map) Fourier-cropped to --box px, symmetrised with G by
             `cryorefine simulate --sym G` (WORK/G/sim/reference_symmetrised.mrc: the ground truth).
2. simulate  n·factor particles at --snr from that map (factor = --c1_factor, by default the number of
             rotations of G: what the symmetry multiplies the data by); the first n form the symmetric
             set (WORK/G/sim/sym.star), all of them the C1 set.
3. reference the truth low-passed to --ini_lowpass Å (a start without a hand or frame to find).
4. refine    `cryorefine refine --sym G` on the n particles and `--sym C1` on the n·factor ones, both
             gold-standard auto-refinements from the same reference with the same options (--ctf,
             --flatten_solvent, --zero_mask, --ini_high = --ini_lowpass, at most --iter iterations,
             --gpu or --cpu, and whatever follows `--`).
5. measure   for each run's final map (run_class001.mrc when it converged, else the last iteration's
             half-1 map): the FSC against the truth and where it falls below 0.5 and 0.143; the
             resolution refine reports; the mean FSC against the truth over the shells beyond
             --ini_lowpass (informative when both curves reach Nyquist); the symmetry error
             max |V − S(V)| / max |V| over the voxels whose images lie in the box (S: the real-space
             group average of `core.symmetry.symmetrise_volume`, trilinear, so exact only for groups
             that permute voxels: C2, C4, D2, D4, O, ...); the iterations and the wall time.

A Markdown table goes to stdout and everything to WORK/results.json (or --json). Examples:

    python benchmarks/symmetry_accuracy.py --work /tmp/sym --cpu                       # D2 and O, 32 px
    python benchmarks/symmetry_accuracy.py --work /tmp/sym --gpu --box 64 --n 2000 --groups D2 O I
    python benchmarks/symmetry_accuracy.py --work /tmp/sym --cpu --groups D2 --n 200 -- --healpix_order 1
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import run_cli, split_at_double_dash, work_and_engine_parser

from cryorefine.core import fourier
from cryorefine.core.fsc import fsc_volumes, resolution_at_threshold
from cryorefine.core.symmetry import symmetrise_volume, symmetry_group
from cryorefine.io.mrc import read_volume, write_volume
from cryorefine.io.star import read_particle_star, read_star, write_particle_star

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MAP = REPO / "examples" / "ribosome_64px.mrc"


def parse_args(argv):
    argv, extra = split_at_double_dash(argv)
    parser = work_and_engine_parser(__doc__.split("\n\n")[0], "Options after -- are passed on to both `cryorefine refine` runs.", "Refine")
    parser.add_argument("--groups", nargs="+", default=["D2", "O"], help="Point groups to measure.")
    parser.add_argument("--map", type=Path, default=DEFAULT_MAP, help="Map to symmetrise and project (cubic MRC).")
    parser.add_argument("--box", type=int, default=32, help="Fourier-crop the map to this box (px).")
    parser.add_argument("--n", type=int, default=200, help="Particles of the symmetric set.")
    parser.add_argument("--c1_factor", type=int, default=None,
                        help="The C1 run gets this many times --n particles [default: the group's rotations].")
    parser.add_argument("--snr", type=float, default=0.1, help="Signal-to-noise ratio of the images.")
    parser.add_argument("--ini_lowpass", type=float, default=50.0, help="Starting reference and --ini_high (Å).")
    parser.add_argument("--particle_diameter", type=float, default=None, help="Mask diameter (Å) [default: the box].")
    parser.add_argument("--iter", type=int, default=25, help="At most this many iterations per refinement.")
    parser.add_argument("--seed", type=int, default=3, help="Random seed of the simulation.")
    parser.add_argument("--json", type=Path, default=None, help="Results file [default: WORK/results.json].")
    return parser.parse_args(argv), extra


def symmetry_error(volume, group):
    """max |V − S(V)| / max |V| over the voxels whose symmetry images lie in the box (index 0 has none)."""
    v = np.asarray(volume, dtype=np.float64)
    inner = (slice(1, None),) * 3
    return float(np.abs(symmetrise_volume(v, group) - v)[inner].max() / np.abs(v).max())


def final_map(root):
    """(path of the run's final map, converged?)."""
    root = Path(root)
    if Path(f"{root}_class001.mrc").is_file():
        return Path(f"{root}_class001.mrc"), True
    last = sorted(root.parent.glob(f"{root.name}_it*_half1_class001.mrc"))[-1]
    return last, False


def reported_resolution(map_path):
    """rlnCurrentResolution of the model file beside a run's final or last half map."""
    name = map_path.name
    model = (map_path.with_name(name.replace("_class001.mrc", "_model.star")) if "_half1_" not in name
             else map_path.with_name(name.replace("_half1_class001.mrc", "_half1_model.star")))
    return float(read_star(model)["model_general"]["rlnCurrentResolution"])


def measure(run_root, truth, group, box, pixel, seconds, ini_lowpass):
    path, converged = final_map(run_root)
    volume, _ = read_volume(path)
    fsc = np.asarray(fsc_volumes(volume.astype(np.float64), truth))
    iterations = len(list(Path(run_root).parent.glob(f"{Path(run_root).name}_it*_optimiser.star")))
    return {"map": str(path), "converged": converged, "iterations": iterations, "wall_seconds": seconds,
            "reported_resolution_angstrom": reported_resolution(path),
            "fsc_truth_0.5_angstrom": resolution_at_threshold(fsc, box, pixel, 0.5, interpolate=True),
            "fsc_truth_0.143_angstrom": resolution_at_threshold(fsc, box, pixel, 0.143, interpolate=True),
            "fsc_truth_mean_beyond_ini_high": float(fsc[int(box * pixel / ini_lowpass) + 1: box // 2 + 1].mean()),
            "fsc_truth": [round(float(f), 4) for f in fsc],
            f"symmetry_error_{group.name}": symmetry_error(volume, group)}


def one_group(name, options, extra, work):
    group = symmetry_group(name)
    factor = options.c1_factor or int(group.rotations.shape[0])
    folder = work / group.name
    folder.mkdir(parents=True, exist_ok=True)
    volume, map_pixel = read_volume(options.map)
    n_map = volume.shape[0]
    pixel = map_pixel * n_map / options.box
    write_volume(folder / "map.mrc", fourier.downsample_volume(volume.astype(np.float64), options.box), pixel)
    engine = "--gpu" if options.gpu else "--cpu"
    run_cli("simulate", "--ref", folder / "map.mrc", "--n", options.n * factor, "--snr", options.snr,
            "--seed", options.seed, "--sym", group.name, "--o", folder / "sim", engine,
            log_path=folder / "simulate.log")
    truth = read_volume(folder / "sim" / "reference_symmetrised.mrc")[0].astype(np.float64)
    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(truth), options.box, options.ini_lowpass, pixel)
    write_volume(folder / "reference.mrc", fourier.irfft3_centered(ft, options.box), pixel)
    star = read_particle_star(folder / "sim" / "particles.star")
    subset = star.particles.iloc[: options.n]
    write_particle_star(star, folder / "sim" / "sym.star", subset)  # beside the stack its image names point to
    diameter = options.particle_diameter or options.box * pixel
    common = ("--ref", folder / "reference.mrc", "--ctf", "--particle_diameter", diameter, "--ini_high",
              options.ini_lowpass, "--flatten_solvent", "--zero_mask", "--iter", options.iter, engine, *extra)
    results = {"group": group.name, "order": group.order, "n_sym": options.n, "n_c1": options.n * factor,
               "box_px": options.box, "pixel_size_angstrom": pixel, "snr": options.snr}
    for label, sym, particles in (("sym", group.name, folder / "sim" / "sym.star"),
                                  ("c1", "C1", folder / "sim" / "particles.star")):
        start = time.monotonic()
        run_cli("refine", "--i", particles, "--o", folder / label / "run", "--sym", sym, *common, "--overwrite",
                log_path=folder / f"refine_{label}.log")
        results[label] = measure(folder / label / "run", truth, group, options.box, pixel, time.monotonic() - start,
                                 options.ini_lowpass)
        results[label]["command"] = "cryorefine refine " + " ".join(
            str(a) for a in ("--i", particles, "--o", folder / label / "run", "--sym", sym, *common))
    return results


def table(all_results):
    lines = ["| group | run | particles | iterations | reported Å | FSC-truth 0.5 Å | FSC-truth 0.143 Å "
             "| mean FSC-truth beyond --ini_high | symmetry error | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_results:
        for label, n in (("sym", r["n_sym"]), ("c1", r["n_c1"])):
            m = r[label]
            lines.append(f"| {r['group']} | {'--sym ' + r['group'] if label == 'sym' else 'C1'} | {n} | "
                         f"{m['iterations']}{'' if m['converged'] else ' (not converged)'} | "
                         f"{m['reported_resolution_angstrom']:.1f} | {m['fsc_truth_0.5_angstrom']:.1f} | "
                         f"{m['fsc_truth_0.143_angstrom']:.1f} | {m['fsc_truth_mean_beyond_ini_high']:.3f} | "
                         f"{m['symmetry_error_' + r['group']]:.1e} | "
                         f"{m['wall_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    options, extra = parse_args(sys.argv[1:] if argv is None else argv)
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    all_results = [one_group(name, options, extra, work) for name in options.groups]
    out = options.json or work / "results.json"
    out.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, "groups": all_results}, indent=2))
    print(table(all_results))
    print(f"\n(results: {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

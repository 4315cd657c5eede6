"""How accurate is 2D classification, beside RELION 5? Simulates particles of several maps at a few dozen known
views (known in-plane angles and origins, CTFs, SNR 0.05), runs RELION 5's Class2D GUI lines (EM and VDAM) with
`cryorefine class2d` and, with --relion, with RELION's relion_refine on the same files and seeds, and reports for
both the share of particles in a class of their true view and each class average's FRC against the true projection
of its view, after every iteration whose files exist, and the wall time (a table on stdout, everything in
WORK/results.json or --json).

    python benchmarks/class2d_accuracy.py --work /tmp/c2d --gpu                       # 20,000 particles, EM and VDAM
    python benchmarks/class2d_accuracy.py --work /tmp/c2d --gpu --algorithms em \\
        --relion /tmp/relion/build/bin/relion_refine_mpi --relion_launcher "mpirun --allow-run-as-root -n 3" \\
        --relion_extra "--gpu 0:0"                                                   # beside RELION 5 on the GPU
    python benchmarks/class2d_accuracy.py --work /tmp/tiny --cpu --n 300 --box 32 --views_per_map 2 --iter 3 \\
        --grad_iter 4 --grad_write_iter 2                                             # a quick check on the CPU

Steps, in one work folder:

1. maps      --maps (default: ribosome blobs rod), each a 64 px map at 6 Å/px: `ribosome` is
             examples/ribosome_64px.mrc (the 70S ribosome, PDB 7P6Z, at 15 Å); `blobs` a compact cluster and
             `rod` a bent chain of Gaussian blobs (fixed seeds), both low-passed to 15 Å; or a path to a cubic
             MRC of the same box. --box Fourier-crops them all (the pixel size scaled to match).
2. views     --views_per_map directions per map, spread over the sphere (a Fibonacci spiral, rotated a
             little further for each map): view v is (map, rot, tilt). Its truth is the map's CTF-free
             projection at that direction, psi 0, centred (WORK/true_views.mrcs).
3. particles --n particles (shuffled), each of a random view, at a random psi, an origin uniform in a disc of
             3 px, a CTF (defocus 0.8–3 µm, astigmatism up to 0.05 µm, 300 kV, Cs 2.7 mm, Q0 0.1), the
             projection made as `cryorefine simulate` makes it (`jobs.simulate.simulate_images`), then divided
             by the σ of white noise of variance var(signal)/--snr inside the particle circle and that noise
             (σ 1) added, as RELION's extraction normalises particles. WORK/particles.star (no poses: what a
             freshly extracted set holds), WORK/truth.star (the true psi and origins, rlnClassNumber the
             view + 1). Cached: a later run with the same settings reuses them.
4. runs      for each --algorithms and --seeds S, RELION 5's Class2D GUI line (GUI_LINES: the GUI's new-job line
             with --K, --particle_diameter (90 % of the box) and --iter set, as tests/data holds them) with
             --random_seed S: `cryorefine class2d` with --gpu 0 or --cpu (and what follows `--`); with
             --relion, the same line run by RELION (--relion_launcher before it, its --j and --pool from
             --relion_j / --relion_pool, --relion_extra after it, e.g. `--gpu 0:0`), in the work folder.
5. measure   for every iteration whose run_itNNN_data.star and run_itNNN_classes.mrcs exist (EM: every one;
             VDAM: every --grad_write_iter-th and the last), with the same code for both programs:
             - counts[k, v]: the particles of true view v in class k (particles matched by image number);
             - in a class of their view ("majority"): each class is given the view most of its particles have
               (ties: the lower view), and the share of the particles whose class is given their view;
             - one to one: classes and views paired one to one (at most min(K, views) pairs) so that the paired
               classes hold as many particles of their view as possible (the Hungarian algorithm); the share of
               the particles in the class paired with their view. Equal to the majority share when every view
               is the majority of exactly one class; never above it;
             - views found: the views that are the majority of at least one non-empty class;
             - each non-empty class average against the truth of its majority view: the in-plane rotation and
               shift of the truth that best correlate with the average (3° then 0.5° steps, integer then
               0.25 px shifts), then their FRC; per class the mean FRC over shells 1 to that of the maps'
               resolution (15 Å, at most Nyquist) and where the FRC first falls below 0.5; per run their
               particle-weighted mean and median;
             - from run_itNNN_model.star: the resolution, the image size compared, the average pmax, the
               offsets' σ and the average norm correction (where the programs' schedules part);
             - seconds per iteration: the time between the iterations' run_itNNN_model.star files, divided by
               the iterations between them (both programs' files alike); the run's wall time around the process.
6. report    a table of the last measured iteration of each run on stdout, every iteration in the JSON.

With --relion_seconds a RELION run is stopped after that many seconds and the iterations it finished are
measured. A run that fails is reported as failed (its log named) and the others go on.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import (
    normalised_with_noise,
    refuse_missing_programs,
    run_logged,
    seconds_per_iteration,
    simulated_particle_tables,
    split_at_double_dash,
    work_and_engine_parser,
)

from cryorefine.core import euler, fourier
from cryorefine.core.arrays import to_host
from cryorefine.core.fsc import fourier_shell_correlation, resolution_at_threshold
from cryorefine.core.projector import Projector
from cryorefine.io.mrc import parse_image_name, read_stack, read_volume, write_stack
from cryorefine.io.star import read_star, write_star

REPO = Path(__file__).resolve().parents[1]
RIBOSOME_MAP = REPO / "examples" / "ribosome_64px.mrc"
MAP_BOX_PX, MAP_PIXEL_ANGSTROM = 64, 6.0
#: the maps' resolution (the example ribosome's; the blob maps are low-passed to it): the mean FRC stops there
MAP_RESOLUTION_ANGSTROM = 15.0
MADE_MAPS = ("ribosome", "blobs", "rod")
MAX_ORIGIN_PX = 3.0
DEFOCUS_UM, ASTIGMATISM_UM, VOLTAGE_KV, CS_MM, Q0 = (0.8, 3.0), 0.05, 300.0, 2.7, 0.1
DIAMETER_FRACTION_OF_BOX = 0.9
#: RELION 5's Class2D GUI lines for a new job (tests/data/relion5_class2d_gui_lines.txt: VDAM, the GUI's default,
#: and 'Use EM algorithm? Yes'), but for --o, which each program is given apart; {i}, {K}, {diameter}, {iter}, {j}
#: and {pool} are filled in
GUI_LINES = {
    "vdam": "--grad --class_inactivity_threshold 0.1 --grad_write_iter {write_iter} --iter {iter} --i {i} "
            "--dont_combine_weights_via_disc --pool {pool} --pad 2 --ctf --tau2_fudge 2 --particle_diameter "
            "{diameter} --K {K} --flatten_solvent --zero_mask --center_classes --oversampling 1 --psi_step 12 "
            "--offset_range 5 --offset_step 2 --norm --scale --j {j}",
    "em": "--iter {iter} --i {i} --dont_combine_weights_via_disc --pool {pool} --pad 2 --ctf --tau2_fudge 2 "
          "--particle_diameter {diameter} --K {K} --flatten_solvent --zero_mask --center_classes --oversampling 1 "
          "--psi_step 12 --offset_range 5 --offset_step 2 --norm --scale --j {j}",
}
GUI_THREADS, GUI_POOL = 1, 3  # the GUI's defaults, what cryorefine is given (neither changes a GPU run)
COARSE_ANGLE_STEP_DEG, FINE_ANGLE_STEP_DEG, FINE_ANGLE_STEPS = 3.0, 0.5, 3  # the search for a class's frame
FINE_SHIFT_STEP_PX, FINE_SHIFT_STEPS = 0.25, 2


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv):
    argv, extra = split_at_double_dash(argv)
    parser = work_and_engine_parser(__doc__.split("\n\n")[0],
                                    "Options after -- are passed on to every `cryorefine class2d` run.",
                                    "cryorefine class2d",
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", nargs="+", default=list(MADE_MAPS),
                        help=f"The maps: {', '.join(MADE_MAPS)} or paths to cubic MRC maps of {MAP_BOX_PX} px at "
                             f"{MAP_PIXEL_ANGSTROM:g} Å/px [default: %(default)s].")
    parser.add_argument("--views_per_map", type=int, default=8, help="Known views of each map [default: 8].")
    parser.add_argument("--box", type=int, default=MAP_BOX_PX,
                        help=f"Fourier-crop the maps to this box (px), the pixel size scaled [default: {MAP_BOX_PX}].")
    parser.add_argument("--n", type=int, default=20_000, help="Particles of all views together [default: 20,000].")
    parser.add_argument("--snr", type=float, default=0.05, help="Signal-to-noise ratio of the images [default: 0.05].")
    parser.add_argument("--data_seed", type=int, default=7, help="Random seed of the simulation.")
    parser.add_argument("--K", type=int, default=None, help="Classes [default: as many as the views].")
    parser.add_argument("--algorithms", nargs="+", choices=sorted(GUI_LINES), default=["em", "vdam"],
                        help="Which GUI lines to run [default: em vdam].")
    parser.add_argument("--iter", type=int, default=25, help="--iter of the EM line [default: 25, the GUI's].")
    parser.add_argument("--grad_iter", type=int, default=200, help="--iter of the VDAM line [default: 200].")
    parser.add_argument("--grad_write_iter", type=int, default=10,
                        help="--grad_write_iter of the VDAM line [default: 10, the GUI's].")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="--random_seed of each run [default: 1].")
    parser.add_argument("--relion", default=None,
                        help="Also run RELION's relion_refine or relion_refine_mpi (this path or command) on the "
                             "same files with the same lines and seeds.")
    parser.add_argument("--relion_launcher", default="",
                        help='Put before RELION\'s command, e.g. "mpirun --allow-run-as-root -n 3".')
    parser.add_argument("--relion_extra", default="",
                        help='Added to RELION\'s line, e.g. "--gpu 0:0" (one word: --relion_extra=--cpu).')
    parser.add_argument("--relion_j", type=int, default=4, help="--j of the RELION runs [default: 4].")
    parser.add_argument("--relion_pool", type=int, default=30, help="--pool of the RELION runs [default: 30].")
    parser.add_argument("--relion_seconds", type=float, default=None,
                        help="Stop each RELION run after this many seconds (its finished iterations are measured).")
    parser.add_argument("--relion_only", action="store_true",
                        help="Run RELION alone (the set made or found in --work), e.g. in a machine call of its own.")
    parser.add_argument("--json", type=Path, default=None, help="Results file [default: WORK/results.json].")
    options = parser.parse_args(argv)
    for name in ("n", "views_per_map", "box", "iter", "grad_iter", "grad_write_iter"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} {getattr(options, name)}: give a positive number")
    if options.box > MAP_BOX_PX or options.box % 2:
        parser.error(f"--box {options.box}: give an even box of at most {MAP_BOX_PX} px")
    if not options.snr > 0:
        parser.error(f"--snr {options.snr}: give a positive ratio")
    refuse_missing_programs(parser, options)
    return options, extra


def gui_line(algorithm, star, k_classes, diameter_angstrom, iterations, write_iter=10, threads=GUI_THREADS,
             pool=GUI_POOL):
    """RELION 5's Class2D GUI line of `algorithm` ("em" or "vdam") as a list of words, without --o."""
    text = GUI_LINES[algorithm].format(i=star, K=k_classes, diameter=f"{diameter_angstrom:g}", iter=iterations,
                                       write_iter=write_iter, j=threads, pool=pool)
    return text.split()


# ---------------------------------------------------------------------------------------------- the set
def blob_map(name, box_px, pixel_angstrom):
    """A map of Gaussian blobs (fixed seeds): `blobs` a compact cluster of 14, `rod` a bent chain of 10 along
    about 230 Å; low-passed to MAP_RESOLUTION_ANGSTROM."""
    rng = np.random.default_rng({"blobs": 11, "rod": 12}[name])
    if name == "blobs":
        centres = rng.normal(scale=40.0, size=(14, 3))
        sigmas = rng.uniform(8.0, 16.0, 14)
    else:
        t = np.linspace(-1.0, 1.0, 10)
        centres = np.stack([115.0 * t, 45.0 * t ** 2 - 15.0, 25.0 * np.sin(2.5 * t)], axis=1)
        sigmas = np.full(10, 11.0)
        sigmas[-1] = 18.0  # a knob at one end
    centres -= centres.mean(axis=0)
    axis = (np.arange(box_px) - box_px // 2) * pixel_angstrom
    z, y, x = np.meshgrid(axis, axis, axis, indexing="ij")
    volume = np.zeros((box_px,) * 3)
    for (cx, cy, cz), s in zip(centres, sigmas):
        volume += np.exp(-((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2) / (2 * s * s))
    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume), box_px, MAP_RESOLUTION_ANGSTROM, pixel_angstrom)
    return fourier.irfft3_centered(ft, box_px)


def load_maps(names, box_px):
    """{name: (box, box, box) float64} at `box_px` (Fourier-cropped), and the pixel size (Å)."""
    maps = {}
    for name in names:
        if name == "ribosome":
            volume = read_volume(RIBOSOME_MAP)[0]
        elif name in MADE_MAPS:
            volume = blob_map(name, MAP_BOX_PX, MAP_PIXEL_ANGSTROM)
        else:
            volume, _ = read_volume(name)
            if volume.shape[0] != MAP_BOX_PX:
                sys.exit(f"--maps {name}: a {volume.shape[0]} px map; give maps of {MAP_BOX_PX} px at "
                         f"{MAP_PIXEL_ANGSTROM:g} Å/px")
        volume = np.asarray(volume, dtype=np.float64)
        if box_px != MAP_BOX_PX:
            volume = fourier.downsample_volume(volume, box_px)
        maps[Path(name).stem if name not in MADE_MAPS else name] = volume
    return maps, MAP_PIXEL_ANGSTROM * MAP_BOX_PX / box_px


def view_directions(n_views, turn_deg=0.0):
    """(rot, tilt) in degrees of `n_views` directions spread over the sphere (a Fibonacci spiral), turned about z by
    `turn_deg`."""
    i = np.arange(n_views)
    z = 1.0 - (2.0 * i + 1.0) / n_views
    rot = (np.rad2deg(i * np.pi * (3.0 - np.sqrt(5.0))) + turn_deg) % 360.0 - 180.0
    return np.stack([rot, np.rad2deg(np.arccos(z))], axis=1)


def true_views(maps, views_per_map):
    """The views: a list of (map name, rot, tilt), and their CTF-free projections (V, N, N) at psi 0, centred."""
    views, images = [], []
    for m, (name, volume) in enumerate(maps.items()):
        directions = view_directions(views_per_map, turn_deg=37.0 * m)
        matrices = euler.euler_to_matrix(directions[:, 0], directions[:, 1], np.zeros(views_per_map))
        ft = Projector(volume, 2.0).project(matrices)
        images.append(fourier.irfft2_centered(ft, volume.shape[0]))
        views += [(name, float(rot), float(tilt)) for rot, tilt in directions]
    return views, np.concatenate(images)


def simulate_set(work, options):
    """Make (or find, made with the same settings) WORK/particles.star, truth.star, true_views.mrcs; returns the
    views (map, rot, tilt), their true images, the true view of each particle (in STAR order) and the pixel size."""
    from cryorefine.jobs.simulate import SimulationOptions, simulate_images

    settings = {"maps": options.maps, "views_per_map": options.views_per_map, "box": options.box, "n": options.n,
                "snr": options.snr, "data_seed": options.data_seed}
    stamp = work / "settings.json"
    maps, pixel = load_maps(options.maps, options.box)
    views, truth_images = true_views(maps, options.views_per_map)
    if stamp.exists() and json.loads(stamp.read_text()) == settings and (work / "truth.star").exists():
        table = read_star(work / "truth.star")["particles"]
        return views, truth_images, table["rlnClassNumber"].to_numpy() - 1, pixel
    box, n = options.box, options.n
    rng = np.random.default_rng(options.data_seed)
    view_of = rng.integers(0, len(views), n)
    radius, angle = MAX_ORIGIN_PX * pixel * np.sqrt(rng.uniform(0, 1, n)), rng.uniform(0, 2 * np.pi, n)
    mean_defocus = rng.uniform(*DEFOCUS_UM, n) * 1e4
    astigmatism = rng.uniform(0.0, ASTIGMATISM_UM, n) * 1e4
    params = {"rot_deg": np.array([views[v][1] for v in view_of]), "tilt_deg": np.array([views[v][2] for v in view_of]),
              "psi_deg": np.round(rng.uniform(-180.0, 180.0, n), 3),
              "origin_x_angstrom": np.round(radius * np.cos(angle), 3),
              "origin_y_angstrom": np.round(radius * np.sin(angle), 3),
              "defocus_u_angstrom": np.round(mean_defocus + astigmatism / 2, 1),
              "defocus_v_angstrom": np.round(mean_defocus - astigmatism / 2, 1),
              "defocus_angle_deg": np.round(rng.uniform(0.0, 180.0, n), 2)}
    clean = SimulationOptions(n_particles=n, snr=float("inf"), voltage_kv=VOLTAGE_KV, cs_mm=CS_MM,
                              amplitude_contrast=Q0)
    diameter_px = DIAMETER_FRACTION_OF_BOX * box
    circle = np.hypot(*(np.mgrid[:box, :box] - box // 2)) <= diameter_px / 2
    images = np.empty((n, box, box), dtype=np.float32)
    noise = np.random.default_rng([options.data_seed, 1])
    xp = np
    if options.gpu:  # the projections on the GPU where CuPy sees one (the same images, to rounding)
        from cryorefine.estep.backend import cupy_available

        if cupy_available():
            import cupy as xp
    for m, volume in enumerate(maps.values()):
        projector = Projector(xp.asarray(volume), 2.0, xp=xp)
        mine = np.flatnonzero(view_of // options.views_per_map == m)
        for start in range(0, mine.size, 1024):
            index = mine[start:start + 1024]
            signal = to_host(simulate_images(projector, params, index, clean, pixel, box, circle, 0,
                                             xp=xp)).astype(np.float64)
            images[index] = normalised_with_noise(signal, circle, options.snr, noise)
    write_stack(work / "particles.mrcs", images, pixel)
    write_stack(work / "true_views.mrcs", truth_images, pixel)
    optics, particles, truth = simulated_particle_tables(params, pixel, box, (VOLTAGE_KV, CS_MM, Q0))
    write_star({"optics": optics, "particles": particles}, work / "particles.star")
    write_star({"optics": optics, "particles": truth.assign(rlnClassNumber=view_of + 1)}, work / "truth.star")
    stamp.write_text(json.dumps(settings))
    return views, truth_images, view_of, pixel


# ---------------------------------------------------------------------------------------------- measures
def class_view_counts(classes, views, k_classes, n_views):
    """counts[k, v]: how many particles of true view v (0-based) are in class k (0-based)."""
    counts = np.zeros((k_classes, n_views), dtype=np.int64)
    np.add.at(counts, (np.asarray(classes), np.asarray(views)), 1)
    return counts


def majority_views(counts):
    """The view given to each class: the one most of its particles have (the lower on a tie); -1 for an empty
    class."""
    counts = np.asarray(counts)
    return np.where(counts.sum(axis=1) > 0, counts.argmax(axis=1), -1)


def best_pairing(values):
    """Rows and columns of `values` (R, C) paired one to one, min(R, C) pairs, so that the sum of the paired values
    is the largest (the Hungarian algorithm, O(n³)): a list of (row, column)."""
    values = np.asarray(values, dtype=np.float64)
    rows, columns = values.shape
    n = max(rows, columns)
    cost = np.zeros((n + 1, n + 1))
    cost[1:rows + 1, 1:columns + 1] = -values  # padded rows and columns: value 0
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    owner = np.zeros(n + 1, dtype=np.int64)  # owner[j]: the row of column j (1-based; 0 none)
    way = np.zeros(n + 1, dtype=np.int64)
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        least = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        while True:
            used[j0] = True
            i0 = owner[j0]
            free = ~used[1:]
            reduced = cost[i0, 1:] - u[i0] - v[1:]
            better = free & (reduced < least[1:])
            least[1:][better] = reduced[better]
            way[1:][better] = j0
            candidates = np.where(free, least[1:], np.inf)
            j1 = int(np.argmin(candidates)) + 1
            delta = candidates[j1 - 1]
            u[owner[used]] += delta
            v[used] -= delta
            least[~used] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    return [(int(owner[j]) - 1, j - 1) for j in range(1, columns + 1) if 0 < owner[j] <= rows]


def class_shares(counts):
    """The shares of the particles in a class of their view, by majority and one to one, and the views found."""
    counts = np.asarray(counts)
    total = max(int(counts.sum()), 1)
    majority = majority_views(counts)
    paired = sum(int(counts[k, v]) for k, v in best_pairing(counts))
    return {"majority": float(counts.max(axis=1).sum()) / total, "one_to_one": paired / total,
            "views_found": int(np.unique(majority[majority >= 0]).size)}


def rotated_transforms(image, angles_deg):
    """The half transforms (A, N, N//2+1) of `image` turned in its plane by each angle (a 2D projector, bilinear
    in the padded transform, as the programs turn their references)."""
    angles = np.asarray(angles_deg, dtype=np.float64)
    zeros = np.zeros(angles.size)
    return Projector(np.asarray(image, dtype=np.float64), 2.0).project(euler.euler_to_matrix(zeros, zeros, angles))


def coarse_turns(truth):
    """The truth's half transforms at every COARSE_ANGLE_STEP_DEG (`aligned_truth`'s first search)."""
    return rotated_transforms(truth, np.arange(0.0, 360.0, COARSE_ANGLE_STEP_DEG))


def aligned_truth(average, truth, turns=None):
    """The truth turned and shifted in its plane to best correlate with the class average: its half transform, the
    angle (degrees) and the shift (x, y) in px. First every COARSE_ANGLE_STEP_DEG with integer shifts (the
    cross-correlation; `turns`: the truth's `coarse_turns` made before), then FINE_ANGLE_STEP_DEG and
    FINE_SHIFT_STEP_PX steps about the best."""
    n = average.shape[0]
    target = fourier.rfft2_centered(np.asarray(average, dtype=np.float64))
    angles = np.arange(0.0, 360.0, COARSE_ANGLE_STEP_DEG)
    turns = coarse_turns(truth) if turns is None else turns
    correlation = np.fft.irfft2(target[None] * np.conj(turns), s=(n, n))
    a, y, x = np.unravel_index(int(np.argmax(correlation)), correlation.shape)
    shift = np.array([x if x <= n // 2 else x - n, y if y <= n // 2 else y - n], dtype=np.float64)
    fine = angles[a] + FINE_ANGLE_STEP_DEG * np.arange(-FINE_ANGLE_STEPS, FINE_ANGLE_STEPS + 1)
    steps = FINE_SHIFT_STEP_PX * np.arange(-FINE_SHIFT_STEPS, FINE_SHIFT_STEPS + 1)
    sy, sx = (g.ravel() for g in np.meshgrid(shift[1] + steps, shift[0] + steps, indexing="ij"))
    turned = rotated_transforms(truth, fine)
    moved = fourier.phase_shift_2d(turned[:, None], sx[None, :], sy[None, :], n)  # (angles, shifts, N, N//2+1)
    weights = fourier.hermitian_weights_2d(n)
    score = np.einsum("yx,asyx->as", weights, (target * np.conj(moved)).real)
    best_angle, best_shift = np.unravel_index(int(np.argmax(score)), score.shape)
    return moved[best_angle, best_shift], float(fine[best_angle]), (float(sx[best_shift]), float(sy[best_shift]))


def class_frc(average, truth, pixel_angstrom, limit_angstrom=MAP_RESOLUTION_ANGSTROM, turns=None):
    """The FRC of a class average against the truth in its best frame (`aligned_truth`, `turns` passed on): the
    curve (shells 0 … N/2), its mean over shells 1 to the shell of `limit_angstrom` (at most N/2), where it first
    falls below 0.5 (Å) and the frame."""
    n = average.shape[0]
    truth_ft, angle, shift = aligned_truth(average, truth, turns)
    frc = fourier_shell_correlation(fourier.rfft2_centered(np.asarray(average, dtype=np.float64)), truth_ft,
                                    set_shell0_to_one=False)
    last = min(n // 2, int(n * pixel_angstrom / limit_angstrom))
    return {"frc": [round(float(f), 4) for f in frc], "mean_frc": float(np.mean(frc[1:last + 1])),
            "frc05_angstrom": resolution_at_threshold(frc, n, pixel_angstrom, 0.5),
            "angle_deg": angle, "shift_px": shift}


def iteration_files(folder):
    """{iteration: root} of the iterations (≥ 1) in `folder` whose data.star and classes.mrcs both exist."""
    found = {}
    for data in folder.glob("run_it[0-9][0-9][0-9]_data.star"):
        iteration = int(data.name[6:9])
        if iteration >= 1 and (folder / f"run_it{iteration:03d}_classes.mrcs").exists():
            found[iteration] = folder / f"run_it{iteration:03d}"
    return dict(sorted(found.items()))


def measure_iteration(root, view_of, truth_images, pixel_angstrom, k_classes, turns):
    """The shares and the class averages' FRCs of one iteration's files (`root`_data.star, _classes.mrcs); `turns`
    {view: its `coarse_turns`}, filled as views are met."""
    table = read_star(f"{root}_data.star")["particles"]
    numbers = np.array([parse_image_name(name)[0] - 1 for name in table["rlnImageName"]])
    classes = table["rlnClassNumber"].to_numpy().astype(np.int64) - 1
    counts = class_view_counts(classes, view_of[numbers], k_classes, len(truth_images))
    averages = read_stack(f"{root}_classes.mrcs")
    result = {**class_shares(counts), "classes": []}
    for k, view in enumerate(majority_views(counts)):
        if view < 0 or not np.any(averages[k]):
            continue
        if view not in turns:
            turns[view] = coarse_turns(truth_images[view])
        frc = class_frc(averages[k], truth_images[view], pixel_angstrom, turns=turns[view])
        result["classes"].append({"class": k + 1, "view": int(view), "particles": int(counts[k].sum()),
                                  "of_its_view": int(counts[k, view]), **frc})
    weights = np.array([c["particles"] for c in result["classes"]], dtype=np.float64)
    if weights.size:
        result["mean_frc"] = float(np.average([c["mean_frc"] for c in result["classes"]], weights=weights))
        result["median_frc05_angstrom"] = float(np.median([c["frc05_angstrom"] for c in result["classes"]]))
    return result


#: model.star's values of each iteration kept beside the shares (where the two programs' schedules part)
MODEL_GENERAL = {"rlnCurrentResolution": "resolution_angstrom", "rlnCurrentImageSize": "image_size_px",
                 "rlnAveragePmax": "ave_pmax", "rlnSigmaOffsetsAngst": "sigma_offset_angstrom",
                 "rlnNormCorrectionAverage": "norm_correction_average"}


def model_values(root):
    """The `MODEL_GENERAL` values of `root`_model.star (those it has; none where the file is missing)."""
    path = Path(f"{root}_model.star")
    if not path.exists():
        return {}
    general = read_star(path).get("model_general", {})
    return {name: float(general[label]) for label, name in MODEL_GENERAL.items() if label in general}


def measure_run(folder, view_of, truth_images, pixel_angstrom, k_classes, turns=None):
    """Every iteration of the run in `folder` with its files: shares, FRCs (the classes' details only for the
    last) and seconds per iteration. `turns`: as `measure_iteration`'s, kept from run to run."""
    seconds = seconds_per_iteration(folder)
    turns = {} if turns is None else turns
    iterations = []
    for iteration, root in iteration_files(folder).items():
        measured = measure_iteration(root, view_of, truth_images, pixel_angstrom, k_classes, turns)
        iterations.append({"iteration": iteration, "seconds_per_iteration": seconds.get(iteration),
                           **model_values(root), **measured})
    for it in iterations[:-1]:
        for c in it["classes"]:
            del c["frc"], c["angle_deg"], c["shift_px"]
    return iterations


# ---------------------------------------------------------------------------------------------- runs
def one_run(work, program, algorithm, seed, options, extra, k_classes, diameter_angstrom):
    """One program's run of one GUI line and seed in WORK/<program>_<algorithm>_seed<S>; its record."""
    folder = work / f"{program}_{algorithm}_seed{seed}"
    if folder.exists():
        for old in folder.glob("run_*"):
            old.unlink()
    folder.mkdir(exist_ok=True)
    iterations = options.iter if algorithm == "em" else options.grad_iter
    if program == "cryorefine":
        line = gui_line(algorithm, "particles.star", k_classes, diameter_angstrom, iterations,
                        options.grad_write_iter)
        engine = ["--gpu", "0"] if options.gpu else ["--cpu"]
        command = [sys.executable, "-m", "cryorefine", "class2d", "--o", f"{folder.name}/run", *line,
                   "--random_seed", str(seed), *engine, *extra]
        timeout = None
    else:
        line = gui_line(algorithm, "particles.star", k_classes, diameter_angstrom, iterations,
                        options.grad_write_iter, options.relion_j, options.relion_pool)
        program_words = shlex.split(options.relion)
        if Path(program_words[0]).exists():  # a path: RELION runs in the work folder
            program_words[0] = str(Path(program_words[0]).absolute())
        command = [*shlex.split(options.relion_launcher), *program_words, "--o", f"{folder.name}/run", *line,
                   "--random_seed", str(seed), *shlex.split(options.relion_extra)]
        timeout = options.relion_seconds
    code, wall = run_logged(command, folder / "run.log", work, timeout)
    if code not in (0, "stopped"):
        tail = (folder / "run.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"{program} {algorithm} seed {seed} failed (exit code {code}): {tail[0]}; see {folder / 'run.log'}",
              file=sys.stderr)
    return {"program": program, "algorithm": algorithm, "seed": seed, "command": shlex.join(command),
            "returncode": code, "wall_seconds": round(wall, 1), "iterations_asked": iterations}


# ---------------------------------------------------------------------------------------------- report
def table(runs):
    """The last measured iteration of each run, as Markdown."""
    lines = ["| algorithm | program | seed | iteration | in a class of their view | one to one | views found | "
             "mean FRC (to 15 Å) | median FRC 0.5 (Å) | s / iteration | wall s |", "|---" * 11 + "|"]
    for r in runs:
        head = f"| {r['algorithm']} | {r['program']} | {r['seed']} |"
        if not r["iterations"]:
            lines.append(f"{head} none (exit code {r['returncode']}) | | | | | | | {r['wall_seconds']:.0f} |")
            continue
        last = r["iterations"][-1]
        seconds = [it["seconds_per_iteration"] for it in r["iterations"] if it["seconds_per_iteration"]]
        lines.append(f"{head} {last['iteration']} of {r['iterations_asked']} | {100 * last['majority']:.1f} % | "
                     f"{100 * last['one_to_one']:.1f} % | {last['views_found']} | {last.get('mean_frc', 0):.3f} | "
                     f"{last.get('median_frc05_angstrom', float('inf')):.1f} | "
                     f"{np.median(seconds) if seconds else float('nan'):.2f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    options, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if (options.relion is not None and not options.relion.strip()) or (options.relion_only and not options.relion):
        sys.exit("--relion: give relion_refine's path or command")
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tic = time.perf_counter()
    views, truth_images, view_of, pixel = simulate_set(work, options)
    simulate_seconds = time.perf_counter() - tic
    k_classes = options.K or len(views)
    diameter = round(DIAMETER_FRACTION_OF_BOX * options.box * pixel)
    programs = ([] if options.relion_only else ["cryorefine"]) + (["relion"] if options.relion else [])
    runs, turns = [], {}
    for algorithm in options.algorithms:
        for seed in options.seeds:
            for program in programs:
                run = one_run(work, program, algorithm, seed, options, extra, k_classes, diameter)
                run["iterations"] = measure_run(work / f"{program}_{algorithm}_seed{seed}", view_of, truth_images,
                                                pixel, k_classes, turns)
                runs.append(run)
    report = {"n": options.n, "box_px": options.box, "pixel_size_angstrom": pixel, "snr": options.snr,
              "K": k_classes, "particle_diameter_angstrom": diameter, "maps": options.maps,
              "views": [{"view": v, "map": m, "rot_deg": round(r, 2), "tilt_deg": round(t, 2)}
                        for v, (m, r, t) in enumerate(views)],
              "particles_per_view": np.bincount(view_of, minlength=len(views)).tolist(),
              "simulate_seconds": round(simulate_seconds, 1), "extra": extra, "runs": runs,
              "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])}
    out = options.json or work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{options.n} particles of {len(views)} views ({', '.join(options.maps)}), {options.box} px at "
          f"{pixel:g} Å/px, SNR {options.snr:g}, K {k_classes}; set made in {simulate_seconds:.0f} s (0: reused)")
    print(table(runs))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""How close to the truth is an initial model made from particles alone, beside RELION 5? Simulates particles of two
maps of different shape at random poses (CTFs, SNR 0.05, no poses in the STAR file), runs RELION 5's InitialModel GUI
line with `cryorefine initial_model` and, with --relion, with RELION's relion_refine on the same files and seeds,
aligns each run's map to the truth (rotation, translation and hand) and reports its FSC against the truth; with
--follow_refine an auto-refine from each aligned map and one from the truth low-passed to 40 Å (a table on stdout,
everything in WORK/results.json or --json).

    python benchmarks/initial_model_accuracy.py --work /tmp/im --gpu --seeds 1 2 3        # 10,000 particles a map
    python benchmarks/initial_model_accuracy.py --work /tmp/im --gpu --relion_only --seeds 1 \\
        --relion /tmp/relion/build/bin/relion_refine --relion_extra "--gpu 0"          # RELION 5, one process
    python benchmarks/initial_model_accuracy.py --work /tmp/im --gpu --seeds 1 2 3 --follow_refine --reuse
    python benchmarks/initial_model_accuracy.py --work /tmp/tiny --cpu --n 200 --box 24 --iter 3   # a CPU check

Steps, in one work folder, each map in a folder of its own (WORK/<map>):

1. maps      --maps (default: ribosome rod), each a 64 px map at 6 Å/px as class2d_accuracy.py makes them
             (`ribosome`: examples/ribosome_64px.mrc, the 70S ribosome at 15 Å; `rod`: a bent chain of Gaussian
             blobs with a knob at one end, at 15 Å; `blobs`: a compact cluster; or a path to a cubic MRC map of
             64 px at 6 Å/px), Fourier-cropped to --box (the pixel size scaled): WORK/<map>/truth.mrc, and the
             truth low-passed to 40 Å, WORK/<map>/reference_40A.mrc.
2. particles --n particles of each map, as `cryorefine simulate` draws them (`jobs.simulate.draw_parameters`:
             poses uniform over SO(3), origins in a disc of 3 px) with class2d_accuracy.py's CTFs (defocus
             0.8–3 µm, astigmatism up to 0.05 µm, 300 kV, Cs 2.7 mm, Q0 0.1), projected as `cryorefine simulate`
             projects them, divided by the σ of white noise of variance var(signal)/--snr inside the particle
             circle and that noise (σ 1) added, as RELION's extraction normalises particles
             (`bench_common.normalised_with_noise`): WORK/<map>/particles.star without poses (what a freshly
             extracted set holds) and WORK/<map>/truth.star with them. Cached: a later call with the same
             settings reuses them.
3. runs      for each --seeds S, RELION 5's InitialModel GUI line (GUI_LINE, tests/data/
             relion5_initial_model_gui_lines.txt: --iter, --particle_diameter (90 % of the box) set) with
             --random_seed S: `cryorefine initial_model` with --gpu 0 or --cpu (and what follows `--`); with
             --relion, the same line run by RELION (--relion_launcher before it, its --j and --pool from
             --relion_j / --relion_pool, --relion_extra after it, e.g. `--gpu 0`), both in WORK/<map>, into
             WORK/<map>/<program>_seed<S>. RELION 5 runs this line as one process only: its GUI refuses MPI for
             InitialModel and relion_refine_mpi refuses --grad without --split_random_halves ("Gradient
             refinement is not supported together with MPI"). --relion_seconds stops a RELION run; the last
             iteration it wrote is measured. With --reuse a run whose folder holds its record (run.json) is
             measured, not run again.
4. measure   the map of the last iteration written (run_itNNN_class001.mrc, alike for both programs), aligned to
             the truth (`align_to_truth`):
             - global: the truth Fourier-cropped to 24 px, turned (in Fourier space, from its transform padded
               twice) by every rotation of a HEALPix order-2 grid with in-plane steps of 15° (4,608 rotations,
               15° apart) and low-passed to half of that box's Nyquist, correlated over every translation (FFT
               cross-correlation) with the map and with its mirror image (z → −z about the centre);
             - local, for each hand's best rotation: the map moved so that it turns about its own centre (the
               sub-pixel peak of its cross-correlation with the truth turned back), then hill-climbing on 32 px
               copies low-passed to 0.8 of Nyquist (turns of 6°, 3°, 1.5°, 0.75° about x, y, z and their
               combinations, the normalised correlation with the truth); moved again and the two finest steps
               again; the hand of the higher correlation kept;
             - the map moved, turned at the full box (on a twice finer grid, Fourier-padded, to keep the
               interpolation's loss small) and moved by the cross-correlation's remaining peak (sub-pixel: a
               parabola through it on each axis): WORK/<map>/<program>_seed<S>/aligned.mrc;
             - its FSC against the truth (unmasked, the whole box) and where it falls below 0.5 and 0.143.
             On the truth turned, moved and mirrored by known amounts the turn is found within a degree or two and
             the FSC is 1 to the truth's resolution (tests/test_initial_model_benchmark.py). Every
             --measure_every-th iteration written before the last is measured too, its turn refined locally
             from the last one's (same hand). Seconds per iteration (between the model.star files,
             `bench_common.seconds_per_iteration`) and the wall time.
5. refine    with --follow_refine, per map: `cryorefine refine` with RELION 5 GUI's Refine3D options
             (refine_accuracy.AUTO_REFINE) and --ctf --particle_diameter D --ini_high 40 --random_seed S, to
             convergence (--refine_iter caps it; --refine_extra is added), on the same particles from each initial
             model's aligned map (WORK/<map>/<program>_seed<S>/aligned.mrc, into refine_from_<program>_seed<S>;
             the initial models of the call's runs, found again with --reuse) and, for the first
             seed, from the truth low-passed to 40 Å (into refine_from_truth40_seed<S>): the resolution each
             reports, its half maps' FSC at 0.143, and the final map's FSC against the truth after a local
             alignment (same hand, refined from no turn).
6. report    Markdown tables on stdout; everything in the JSON, written again after every run.

A run that fails is reported as failed (its log named) and the others go on.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from bench_common import (
    normalised_with_noise,
    refuse_missing_programs,
    run_logged,
    seconds_per_iteration,
    simulated_particle_tables,
    small_turn,
    split_at_double_dash,
    work_and_engine_parser,
)
from class2d_accuracy import (
    ASTIGMATISM_UM,
    CS_MM,
    DEFOCUS_UM,
    DIAMETER_FRACTION_OF_BOX,
    GUI_POOL,
    GUI_THREADS,
    MADE_MAPS,
    MAP_BOX_PX,
    Q0,
    VOLTAGE_KV,
    load_maps,
)
from refine_accuracy import AUTO_REFINE, finite_or_none, iterations_written

from cryorefine.core import euler, fourier
from cryorefine.core.fsc import fsc_volumes, resolution_at_threshold
from cryorefine.core.projector import Projector
from cryorefine.core.sampling import healpix_angles_deg
from cryorefine.em.align_symmetry import rotated_volume
from cryorefine.io.mrc import read_volume, write_stack, write_volume
from cryorefine.io.star import read_star, write_star

DEFAULT_MAPS = ("ribosome", "rod")
#: RELION 5's InitialModel GUI line for a new job (tests/data/relion5_initial_model_gui_lines.txt) but for --o, which
#: each program is given apart; {i}, {diameter}, {iter}, {j} and {pool} are filled in
GUI_LINE = ("--iter {iter} --grad --denovo_3dref --i {i} --ctf --K 1 --sym C1 --flatten_solvent --zero_mask "
            "--dont_combine_weights_via_disc --pool {pool} --pad 1 --particle_diameter {diameter} --oversampling 1 "
            "--healpix_order 1 --offset_range 6 --offset_step 2 --auto_sampling --tau2_fudge 4 --j {j}")
REFINE_START_ANGSTROM = 40.0  # the true map's low-pass for the comparison refine, and both refines' --ini_high
#: the alignment's search: HEALPix order and in-plane step of the global grid, the boxes of the global and local
#: searches, their low-pass (a share of the box's Nyquist) and the local search's turns
COARSE_ORDER, COARSE_PSI_STEP_DEG = 2, 15.0
COARSE_STEP_DEG = 15.0  # the grid's spacing: HEALPix order 2's directions and the in-plane step
COARSE_BOX_PX, LOCAL_BOX_PX = 24, 32
COARSE_LOWPASS_OF_NYQUIST, LOCAL_LOWPASS_OF_NYQUIST = 0.5, 0.8
LOCAL_STEPS_DEG = (6.0, 3.0, 1.5, 0.75)
LOCAL_MOVES = 4  # at most this many moves of the centre at one step size
HANDS = ("as is", "mirrored")


# ---------------------------------------------------------------------------------------------- options
def parse_args(argv):
    argv, extra = split_at_double_dash(argv)
    parser = work_and_engine_parser(__doc__.split("\n\n")[0],
                                    "Options after -- are passed on to every `cryorefine initial_model` run.",
                                    "cryorefine's runs",
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--maps", nargs="+", default=list(DEFAULT_MAPS),
                        help="The maps: ribosome, rod, blobs or paths to cubic MRC maps of 64 px at 6 Å/px "
                             "[default: %(default)s].")
    parser.add_argument("--box", type=int, default=MAP_BOX_PX,
                        help=f"Fourier-crop the maps to this box (px), the pixel size scaled [default: {MAP_BOX_PX}].")
    parser.add_argument("--n", type=int, default=10_000, help="Particles of each map [default: 10,000].")
    parser.add_argument("--snr", type=float, default=0.05, help="Signal-to-noise ratio of the images [default: 0.05].")
    parser.add_argument("--data_seed", type=int, default=7, help="Random seed of the simulation.")
    parser.add_argument("--iter", type=int, default=200, help="--iter of the GUI line [default: 200, the GUI's].")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="--random_seed of each run [default: 1].")
    parser.add_argument("--measure_every", type=int, default=50,
                        help="Also measure every this many iterations' map written before the last [default: 50; "
                             "0: the last only].")
    parser.add_argument("--follow_refine", action="store_true",
                        help="An auto-refine from each aligned initial model and one from the truth low-passed to "
                             "40 Å.")
    parser.add_argument("--refine_iter", type=int, default=None,
                        help="Stop the auto-refines after this many iterations [default: at convergence].")
    parser.add_argument("--refine_extra", default="",
                        help='Added to every auto-refine\'s line (a later option overrides an earlier one), e.g. '
                             '"--healpix_order 1" for a quick check.')
    parser.add_argument("--reuse", action="store_true",
                        help="Measure a run whose folder holds its record (run.json) instead of running it again.")
    parser.add_argument("--relion", default=None,
                        help="Also run RELION's relion_refine (this path or command) on the same files with the same "
                             "line and seeds.")
    parser.add_argument("--relion_launcher", default="", help="Put before RELION's command.")
    parser.add_argument("--relion_extra", default="",
                        help='Added to RELION\'s line, e.g. "--gpu 0" (one word: --relion_extra=--cpu).')
    parser.add_argument("--relion_j", type=int, default=4, help="--j of the RELION runs [default: 4].")
    parser.add_argument("--relion_pool", type=int, default=30, help="--pool of the RELION runs [default: 30].")
    parser.add_argument("--relion_seconds", type=float, default=None,
                        help="Stop each RELION run after this many seconds (the last iteration written is measured).")
    parser.add_argument("--relion_only", action="store_true",
                        help="Run RELION alone (the sets made or found in --work), e.g. in a machine call of its own.")
    parser.add_argument("--json", type=Path, default=None, help="Results file [default: WORK/results.json].")
    options = parser.parse_args(argv)
    for name in ("n", "box", "iter"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} {getattr(options, name)}: give a positive number")
    if options.box > MAP_BOX_PX or options.box % 2 or options.box < 16:
        parser.error(f"--box {options.box}: give an even box of 16 to {MAP_BOX_PX} px")
    if not options.snr > 0:
        parser.error(f"--snr {options.snr}: give a positive ratio")
    if options.measure_every < 0 or (options.refine_iter is not None and options.refine_iter < 1):
        parser.error("--measure_every and --refine_iter: give a positive number (--measure_every 0: the last only)")
    if (options.relion is not None and not options.relion.strip()) or (options.relion_only and not options.relion):
        parser.error("--relion: give relion_refine's path or command")
    refuse_missing_programs(parser, options)
    for name in options.maps:
        if name not in MADE_MAPS and not Path(name).is_file():
            parser.error(f"--maps {name}: no such file; give {', '.join(MADE_MAPS)} or a map's path")
    return options, extra


def gui_line(star, diameter_angstrom, iterations, threads=GUI_THREADS, pool=GUI_POOL):
    """RELION 5's InitialModel GUI line as a list of words, without --o."""
    return GUI_LINE.format(i=star, diameter=f"{diameter_angstrom:g}", iter=iterations, j=threads, pool=pool).split()


# ---------------------------------------------------------------------------------------------- the sets
def simulate_set(folder, volume, pixel, options):
    """Make (or find, made with the same settings) `folder`/particles.star (no poses), truth.star, truth.mrc and
    reference_40A.mrc of one map; the settings written beside them."""
    from cryorefine.jobs.simulate import SimulationOptions, draw_parameters, simulate_images

    box, n = volume.shape[0], options.n
    settings = {"box": box, "n": n, "snr": options.snr, "data_seed": options.data_seed,
                "truth_sum": round(float(volume.sum()), 6)}
    stamp = folder / "settings.json"
    if stamp.exists() and json.loads(stamp.read_text()) == settings and (folder / "truth.star").exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_volume(folder / "truth.mrc", volume.astype(np.float32), pixel)
    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume), box, REFINE_START_ANGSTROM, pixel)
    write_volume(folder / "reference_40A.mrc", fourier.irfft3_centered(ft, box).astype(np.float32), pixel)
    clean = SimulationOptions(n_particles=n, snr=float("inf"), defocus_range_um=DEFOCUS_UM,
                              astigmatism_um=ASTIGMATISM_UM, voltage_kv=VOLTAGE_KV, cs_mm=CS_MM, amplitude_contrast=Q0)
    params = draw_parameters(n, clean, pixel, np.random.default_rng(options.data_seed))
    circle = np.hypot(*(np.mgrid[:box, :box] - box // 2)) <= DIAMETER_FRACTION_OF_BOX * box / 2
    noise = np.random.default_rng([options.data_seed, 1])
    projector = Projector(volume, 2.0)
    images = np.empty((n, box, box), dtype=np.float32)
    for start in range(0, n, 1024):
        index = np.arange(start, min(n, start + 1024))
        signal = simulate_images(projector, params, index, clean, pixel, box, circle, 0).astype(np.float64)
        images[index] = normalised_with_noise(signal, circle, options.snr, noise)
    write_stack(folder / "particles.mrcs", images, pixel)
    optics, particles, truth = simulated_particle_tables(params, pixel, box, (VOLTAGE_KV, CS_MM, Q0))
    write_star({"optics": optics, "particles": particles}, folder / "particles.star")
    write_star({"optics": optics, "particles": truth}, folder / "truth.star")
    stamp.write_text(json.dumps(settings))


# ---------------------------------------------------------------------------------------------- the alignment
def mirrored(volume):
    """`volume` (N, N, N) reflected through the plane z = 0 about its centre (voxel N//2): the other hand."""
    return np.roll(np.asarray(volume)[::-1], 1, axis=0)


def coarse_rotations(order=COARSE_ORDER, psi_step_deg=COARSE_PSI_STEP_DEG):
    """(R, 3, 3): every HEALPix direction of `order` with every in-plane angle `psi_step_deg` apart."""
    directions = 12 * 4 ** order
    rot, tilt = healpix_angles_deg(order, np.arange(directions))
    psi = np.arange(0.0, 360.0, psi_step_deg)
    return euler.euler_to_matrix(np.repeat(rot, psi.size), np.repeat(tilt, psi.size), np.tile(psi, directions))


def lowpass_weights(box_px, share_of_nyquist):
    """The low-pass of the searches on a half transform (N, N, N//2+1): 1 to `share_of_nyquist` of Nyquist, a cosine
    edge of one shell, and 0 at shell 0 (the maps' means are left out of their correlation)."""
    weights = fourier.raised_cosine(fourier.radius_3d(box_px), share_of_nyquist * box_px / 2, 1.0)
    weights[0, 0, 0] = 0.0
    return weights


def working_transform(volume, box_px, share_of_nyquist):
    """The half transform (`fourier.rfft3_centered`) of `volume` Fourier-cropped to `box_px`, `lowpass_weights`
    applied."""
    small = fourier.downsample_volume(volume, box_px) if volume.shape[0] != box_px else np.asarray(volume, np.float64)
    return fourier.rfft3_centered(small) * lowpass_weights(box_px, share_of_nyquist)


def turned_transforms(volume, matrices, share_of_nyquist):
    """The half transforms (R, N, N, N//2+1, complex64) of `volume` (N, N, N) turned by each of `matrices` as
    `rotated_volume` turns it, `lowpass_weights` applied: the transform of the map zero-padded to 2N, read by
    trilinear interpolation at Mᵀk (Hermitian symmetry where that has a negative x) for the coefficients k inside
    the low-pass."""
    box = volume.shape[0]
    padded = fourier.rfft3_centered(fourier.window_volume(np.asarray(volume, np.float64), 2 * box))
    weights = lowpass_weights(box, share_of_nyquist)
    kz, ky, kx = (np.asarray(k)[weights > 0] for k in fourier.frequencies_3d(box))
    keep = np.flatnonzero(weights.ravel() > 0)
    out = np.zeros((len(matrices), weights.size), dtype=np.complex64)
    for start in range(0, len(matrices), 512):
        chunk = np.asarray(matrices[start:start + 512], dtype=np.float64)
        # the source of k: Mᵀk in (x, y, z), on the padded transform's grid (twice as fine)
        qx, qy, qz = (2.0 * (chunk[:, 0, i, None] * kx + chunk[:, 1, i, None] * ky + chunk[:, 2, i, None] * kz)
                      for i in range(3))
        flip = qx < 0
        qx, qy, qz = np.where(flip, -qx, qx), np.where(flip, -qy, qy), np.where(flip, -qz, qz)
        x0, y0, z0 = np.floor(qx).astype(np.int64), np.floor(qy).astype(np.int64), np.floor(qz).astype(np.int64)
        fx, fy, fz = qx - x0, qy - y0, qz - z0
        value = np.zeros(qx.shape, dtype=np.complex128)
        for dz in (0, 1):
            for dy in (0, 1):
                for dx in (0, 1):
                    weight = (fz if dz else 1 - fz) * (fy if dy else 1 - fy) * (fx if dx else 1 - fx)
                    value += weight * padded[(z0 + dz) % (2 * box), (y0 + dy) % (2 * box),
                                             np.minimum(x0 + dx, box)]
        # × 8: the padded transform's normalisation (1/(2N)³) made that of `working_transform` (1/N³)
        out[start:start + len(chunk), keep] = 8.0 * np.where(flip, np.conj(value), value) * weights.ravel()[keep]
    return out.reshape((len(matrices),) + weights.shape)


def correlation_peaks(target_ft, moving_ft, box_px):
    """For each transform in `moving_ft` (…, N, N, N//2+1): the largest normalised cross-correlation with
    `target_ft` over all translations, and the translation (z, y, x, integer px) that moves it there."""
    products = target_ft * np.conj(moving_ft)
    cc = np.fft.irfftn(products, s=(box_px,) * 3, axes=(-3, -2, -1))
    flat = cc.reshape(cc.shape[:-3] + (-1,))
    best = flat.argmax(axis=-1)
    peak = np.take_along_axis(flat, best[..., None], axis=-1)[..., 0]
    norms = np.sqrt(_inner(target_ft, target_ft, box_px) * _inner(moving_ft, moving_ft, box_px))
    shifts = np.stack(np.unravel_index(best, (box_px,) * 3), axis=-1)
    shifts = np.where(shifts > box_px // 2, shifts - box_px, shifts)
    return peak * box_px ** 3 / np.maximum(norms, 1e-30), shifts


def correlations(target_ft, moving_ft, box_px):
    """The normalised correlation (no translation) of each transform in `moving_ft` (…, N, N, N//2+1) with
    `target_ft`."""
    return _inner(target_ft, moving_ft, box_px) / np.sqrt(np.maximum(
        _inner(target_ft, target_ft, box_px) * _inner(moving_ft, moving_ft, box_px), 1e-300))


def _inner(a_ft, b_ft, box_px):
    """Σ a·b of the real maps of half transforms (…, N, N, N//2+1) (Parseval, but for the factor N³)."""
    weights = np.full(box_px // 2 + 1, 2.0)
    weights[0] = 1.0
    if box_px % 2 == 0:
        weights[-1] = 1.0
    return np.einsum("...zyx,x->...", (a_ft * np.conj(b_ft)).real, weights)


@dataclass(frozen=True)
class PreparedTruth:
    """The truth and what every alignment to it uses: its transform at the local search's box, and the transforms
    of the truth turned by each of the global grid's rotations at the global search's box (made once a map)."""

    truth: np.ndarray
    rotations: np.ndarray
    turned_ft: np.ndarray
    local_box_px: int
    local_ft: np.ndarray


def prepare_truth(truth):
    """The truth turned by every rotation of `coarse_rotations` (at COARSE_BOX_PX) and its local-box transform."""
    truth = np.asarray(truth, dtype=np.float64)
    box = truth.shape[0]
    coarse_box, local_box = min(COARSE_BOX_PX, box), min(LOCAL_BOX_PX, box)
    small = fourier.downsample_volume(truth, coarse_box) if coarse_box != box else truth
    rotations = coarse_rotations()
    turned = turned_transforms(small, rotations, COARSE_LOWPASS_OF_NYQUIST)
    return PreparedTruth(truth, rotations, turned, local_box,
                         working_transform(truth, local_box, LOCAL_LOWPASS_OF_NYQUIST))


@dataclass(frozen=True)
class Alignment:
    """The map put onto the truth: the hand ("as is" or "mirrored": reflected by `mirrored` first), the rotation
    applied to it (`rotated_volume`'s matrix), the shift (z, y, x px) of the turned map onto the truth, the normalised
    correlation at the local box of each hand's best rotation, and the aligned map (full box):
    aligned = shift_volume(rotated_volume(hand's map, matrix), shift_px)."""

    hand: str
    matrix: np.ndarray
    shift_px: tuple
    scores: dict
    aligned: np.ndarray


def global_search(moving, prepared, chunk=256):
    """The global grid's best rotation for `moving` (the matrix that turns it onto the truth) and its score."""
    coarse_box = prepared.turned_ft.shape[1]
    moving_ft = working_transform(moving, coarse_box, COARSE_LOWPASS_OF_NYQUIST)
    scores = np.empty(len(prepared.rotations))
    for start in range(0, len(scores), chunk):
        scores[start:start + chunk] = correlation_peaks(prepared.turned_ft[start:start + chunk], moving_ft,
                                                        coarse_box)[0]
    best = int(np.argmax(scores))
    return prepared.rotations[best].T, float(scores[best])


def centring_shift(moving, prepared, matrix):
    """The shift (z, y, x px, sub-pixel) that puts `moving` where the truth turned back by `matrix` is: moved by it,
    the map turns about its own centre onto the truth."""
    return best_shift(rotated_volume(prepared.truth, np.asarray(matrix).T), moving)


def local_search(moving, prepared, matrix, steps_deg=LOCAL_STEPS_DEG):
    """Hill-climbing from `matrix` over turns about x, y, z and their combinations (each of −s, 0, +s), for each step
    s: the best matrix and its score, the normalised correlation of the turned map (`moving` centred: no translation)
    with the truth at the local box."""
    box = prepared.local_box_px
    small = fourier.downsample_volume(moving, box) if moving.shape[0] != box else np.asarray(moving, np.float64)
    grid = np.array([(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)], dtype=np.float64)

    def scores(matrices):
        return correlations(prepared.local_ft, turned_transforms(small, np.asarray(matrices), LOCAL_LOWPASS_OF_NYQUIST),
                            box)

    best = np.asarray(matrix, dtype=np.float64)
    score = float(scores([best])[0])
    for step in steps_deg:
        for _ in range(LOCAL_MOVES):
            candidates = [small_turn(step * g) @ best for g in grid if g.any()]
            values = scores(candidates)
            if values.max() <= score:
                break
            best, score = candidates[int(values.argmax())], float(values.max())
    return best, score


def turned_finely(volume, matrix):
    """`volume` turned by `matrix` on a twice finer grid (Fourier-padded, trilinear, Fourier-cropped back): the
    interpolation loses little below Nyquist."""
    box = volume.shape[0]
    fine = fourier.resample_volume(np.asarray(volume, dtype=np.float64), 2 * box)
    return fourier.downsample_volume(rotated_volume(fine, matrix), box)


def shift_volume(volume, shift_px):
    """`volume` moved by (z, y, x) px (a phase shift: periodic, sub-pixel)."""
    box = volume.shape[0]
    kz, ky, kx = fourier.frequencies_3d(box)
    phase = np.exp(-2j * np.pi * (kz * shift_px[0] + ky * shift_px[1] + kx * shift_px[2]) / box)
    return np.fft.irfftn(np.fft.rfftn(volume) * phase, s=volume.shape, axes=(0, 1, 2))


def best_shift(target, moving):
    """The shift (z, y, x px) that moves `moving` onto `target`: the FFT cross-correlation's peak, refined on each
    axis by a parabola through it and its two neighbours."""
    box = target.shape[0]
    cc = np.fft.irfftn(np.fft.rfftn(target) * np.conj(np.fft.rfftn(moving)), s=target.shape, axes=(0, 1, 2))
    peak = np.unravel_index(int(np.argmax(cc)), cc.shape)
    shift = []
    for axis in range(3):
        around = []
        for d in (-1, 0, 1):
            index = list(peak)
            index[axis] = (index[axis] + d) % box
            around.append(cc[tuple(index)])
        below, at, above = around
        curvature = below - 2 * at + above
        offset = 0.5 * (below - above) / curvature if curvature < 0 else 0.0
        value = peak[axis] + float(np.clip(offset, -0.5, 0.5))
        shift.append(value - box if value > box / 2 else value)
    return tuple(shift)


def turned_shift(matrix, shift_zyx):
    """A shift (z, y, x) of a map before it is turned by `matrix`, as the shift after the turn."""
    return tuple(float(v) for v in (np.asarray(matrix) @ np.asarray(shift_zyx, dtype=np.float64)[::-1])[::-1])


def align_to_truth(volume, prepared, start=None):
    """`volume` put onto the truth of `prepared` (module docstring, step 4): an Alignment. For each hand the global
    grid's best rotation (with `start`, a (hand, matrix) pair, e.g. of another map of the same run: no global search,
    that hand and rotation), the map moved so that it turns about its own centre, the local search, moved again and
    the local search's finest steps."""
    volume = np.asarray(volume, dtype=np.float64)
    found = {}
    for hand in HANDS if start is None else (start[0],):
        moving = mirrored(volume) if hand == "mirrored" else volume
        matrix = global_search(moving, prepared)[0] if start is None else start[1]
        steps = LOCAL_STEPS_DEG if start is None else LOCAL_STEPS_DEG[1:]
        for passing in (steps, steps[-2:]):
            centring = centring_shift(moving, prepared, matrix)
            matrix, score = local_search(shift_volume(moving, centring), prepared, matrix, passing)
        found[hand] = (matrix, score, moving, centring_shift(moving, prepared, matrix))
    hand = max(found, key=lambda h: found[h][1])
    matrix, _, moving, centring = found[hand]
    turned = turned_finely(shift_volume(moving, centring), matrix)
    residual = best_shift(prepared.truth, turned)
    shift = tuple(a + b for a, b in zip(turned_shift(matrix, centring), residual))
    return Alignment(hand, matrix, shift, {h: round(found[h][1], 4) for h in found}, shift_volume(turned, residual))


def fsc_figures(aligned, truth, pixel_angstrom):
    """The FSC of an aligned map against the truth: where it falls below 0.5 and 0.143 (Å), and the curve."""
    fsc = np.asarray(fsc_volumes(np.asarray(aligned, np.float64), np.asarray(truth, np.float64)))
    box = truth.shape[0]
    return {"fsc_0.5_angstrom": resolution_at_threshold(fsc, box, pixel_angstrom, 0.5),
            "fsc_0.143_angstrom": resolution_at_threshold(fsc, box, pixel_angstrom, 0.143),
            "fsc": [round(float(f), 4) for f in fsc]}


def alignment_record(alignment, truth, pixel_angstrom):
    """An Alignment and its FSC against the truth, for the JSON."""
    rot, tilt, psi = (float(a) for a in euler.matrix_to_euler(alignment.matrix))
    return {"hand": alignment.hand, "turn_rot_tilt_psi_deg": [round(rot, 2), round(tilt, 2), round(psi, 2)],
            "shift_zyx_px": [round(s, 2) for s in alignment.shift_px], "scores": alignment.scores,
            **fsc_figures(alignment.aligned, truth, pixel_angstrom)}


# ---------------------------------------------------------------------------------------------- runs
def written_maps(folder):
    """{iteration: map} of the run_itNNN_class001.mrc files (iterations ≥ 1) in `folder`."""
    return dict(sorted((int(p.name[6:9]), p) for p in folder.glob("run_it[0-9][0-9][0-9]_class001.mrc")
                       if int(p.name[6:9]) > 0))


def launch(folder, command, cwd, timeout_seconds, reuse):
    """Run `command` in `cwd`, its output in `folder`/run.log, its record in `folder`/run.json; with `reuse` and a
    record there, that record. The record: the command, the exit code (or "stopped") and the wall seconds."""
    record_file = folder / "run.json"
    if reuse and record_file.exists():
        print(f"reusing {folder}", file=sys.stderr)
        return json.loads(record_file.read_text())
    if folder.exists():
        for old in folder.glob("run_*"):
            old.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    code, wall = run_logged(command, folder / "run.log", cwd, timeout_seconds)
    if code not in (0, "stopped"):
        tail = (folder / "run.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"{folder.name} failed (exit code {code}): {tail[0]}; see {folder / 'run.log'}", file=sys.stderr)
    record = {"command": shlex.join(command), "returncode": code, "wall_seconds": round(wall, 1)}
    record_file.write_text(json.dumps(record))
    return record


def initial_model_command(folder_name, program, seed, options, extra, diameter_angstrom):
    """The command line of one program's initial model of one seed into `folder_name`/run (run in the map's folder),
    and the seconds after which it is stopped (None: never)."""
    if program == "cryorefine":
        engine = ["--gpu", "0"] if options.gpu else ["--cpu"]
        return [sys.executable, "-m", "cryorefine", "initial_model", "--o", f"{folder_name}/run",
                *gui_line("particles.star", diameter_angstrom, options.iter), "--random_seed", str(seed), *engine,
                *extra], None
    program_words = shlex.split(options.relion)
    if Path(program_words[0]).exists():  # a path: RELION runs in the map's folder
        program_words[0] = str(Path(program_words[0]).absolute())
    return [*shlex.split(options.relion_launcher), *program_words, "--o", f"{folder_name}/run",
            *gui_line("particles.star", diameter_angstrom, options.iter, options.relion_j, options.relion_pool),
            "--random_seed", str(seed), *shlex.split(options.relion_extra)], options.relion_seconds


def initial_model_run(map_folder, program, seed, options, extra, diameter_angstrom):
    """One program's initial model of one seed in `map_folder`/<program>_seed<S>: its record."""
    folder = map_folder / f"{program}_seed{seed}"
    command, timeout = initial_model_command(folder.name, program, seed, options, extra, diameter_angstrom)
    record = launch(folder, command, map_folder, timeout, options.reuse)
    return {"program": program, "seed": seed, "iterations_asked": options.iter, **record}


def measure_initial_model(folder, prepared, pixel_angstrom, measure_every):
    """The last written map of the run in `folder` aligned to the truth and its FSC, and those of every
    `measure_every`-th iteration before it (aligned from the last one's turn); seconds per iteration."""
    maps = written_maps(folder)
    if not maps:
        return {"last_iteration": None}
    last = max(maps)
    tic = time.perf_counter()
    final = align_to_truth(read_volume(maps[last])[0], prepared)
    align_seconds = time.perf_counter() - tic
    write_volume(folder / "aligned.mrc", final.aligned.astype(np.float32), pixel_angstrom)
    iterations = []
    for iteration, path in maps.items():
        if iteration != last and measure_every and iteration % measure_every == 0:
            alignment = align_to_truth(read_volume(path)[0], prepared, start=(final.hand, final.matrix))
            record = alignment_record(alignment, prepared.truth, pixel_angstrom)
            del record["fsc"]
            iterations.append({"iteration": iteration, **record})
    seconds = list(seconds_per_iteration(folder).values())
    return {"last_iteration": last, "final": alignment_record(final, prepared.truth, pixel_angstrom),
            "align_seconds": round(align_seconds, 1), "iterations": iterations,
            "seconds_per_iteration": round(float(np.median(seconds)), 3) if seconds else None}


def refine_command(start, seed, options, diameter_angstrom):
    """`cryorefine refine` (RELION 5 GUI's Refine3D options) of the map's particles from `start` ("truth40": the truth
    low-passed to 40 Å, or an initial model's run folder name: its aligned map), run in the map's folder: its folder
    name and command line."""
    if start == "truth40":
        folder, reference = f"refine_from_truth40_seed{seed}", "reference_40A.mrc"
    else:
        folder, reference = f"refine_from_{start}", f"{start}/aligned.mrc"
    engine = ["--gpu", "0"] if options.gpu else ["--cpu"]
    return folder, [sys.executable, "-m", "cryorefine", "refine", "--i", "particles.star", "--ref", reference, "--o",
                    f"{folder}/run", "--ctf", "--particle_diameter", f"{diameter_angstrom:g}", "--ini_high",
                    f"{REFINE_START_ANGSTROM:g}", *AUTO_REFINE, "--random_seed", str(seed), *engine,
                    *(["--iter", str(options.refine_iter)] if options.refine_iter else []),
                    *shlex.split(options.refine_extra)]


def measure_refine(folder, prepared, pixel_angstrom):
    """A refine's iterations, whether it converged, the resolution it reports, its half maps' FSC at 0.143 and its
    final map's FSC against the truth after a local alignment (same hand, from no turn)."""
    done = iterations_written(folder)
    if not done:
        return {"iterations": 0}
    converged = (folder / "run_class001.mrc").exists() and (folder / "run_model.star").exists()
    if converged:
        model_star, final_map = folder / "run_model.star", folder / "run_class001.mrc"
    else:
        model_star = folder / f"run_it{done[-1]:03d}_half1_model.star"
        final_map = folder / f"run_it{done[-1]:03d}_half1_class001.mrc"
    model = read_star(model_star)
    general = model["model_general"]
    general = general if isinstance(general, dict) else general.iloc[0].to_dict()
    gold = model["model_class_1"]["rlnGoldStandardFsc"].to_numpy(np.float64)
    box = prepared.truth.shape[0]
    alignment = align_to_truth(read_volume(final_map)[0], prepared, start=("as is", np.eye(3)))
    record = alignment_record(alignment, prepared.truth, pixel_angstrom)
    return {"iterations": len(done), "converged": converged,
            "reported_resolution_angstrom": float(general["rlnCurrentResolution"]),
            "half_maps_fsc_0.143_angstrom": resolution_at_threshold(gold, box, pixel_angstrom, 0.143),
            "vs_truth": record}


# ---------------------------------------------------------------------------------------------- report
def angstrom(value):
    return "–" if value is None or not math.isfinite(value) else f"{value:.1f}"


def table(runs, refines):
    """The initial models' and the refines' figures, as Markdown."""
    lines = ["| map | program | seed | iteration | hand (score) | FSC vs truth 0.5 / 0.143 (Å) | s / iteration | "
             "wall s |", "|---" * 8 + "|"]
    for r in runs:
        head = f"| {r['map']} | {r['program']} | {r['seed']} |"
        final = r.get("final")
        if final is None:
            lines.append(f"{head} none (exit code {r['returncode']}) | | | | {r['wall_seconds']:.0f} |")
            continue
        per_iteration = r["seconds_per_iteration"]
        lines.append(f"{head} {r['last_iteration']} of {r['iterations_asked']} | {final['hand']} "
                     f"({final['scores'][final['hand']]:.3f}) | {angstrom(final['fsc_0.5_angstrom'])} / "
                     f"{angstrom(final['fsc_0.143_angstrom'])} | "
                     f"{'–' if per_iteration is None else f'{per_iteration:.2f}'} | {r['wall_seconds']:.0f} |")
    if refines:
        lines += ["", "| map | auto-refine from | seed | iterations | reported (Å) | half maps 0.143 (Å) | "
                      "FSC vs truth 0.5 / 0.143 (Å) | wall s |", "|---" * 8 + "|"]
        for r in refines:
            head = f"| {r['map']} | {r['start']} | {r['seed']} |"
            if not r.get("iterations"):
                lines.append(f"{head} none (exit code {r['returncode']}) | | | | {r['wall_seconds']:.0f} |")
                continue
            truth = r["vs_truth"]
            lines.append(f"{head} {r['iterations']}{'' if r['converged'] else ' (not converged)'} | "
                         f"{angstrom(r['reported_resolution_angstrom'])} | "
                         f"{angstrom(r['half_maps_fsc_0.143_angstrom'])} | {angstrom(truth['fsc_0.5_angstrom'])} / "
                         f"{angstrom(truth['fsc_0.143_angstrom'])} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    options, extra = parse_args(sys.argv[1:] if argv is None else argv)
    work = options.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    maps, pixel = load_maps(options.maps, options.box)
    diameter = round(DIAMETER_FRACTION_OF_BOX * options.box * pixel)
    programs = ([] if options.relion_only else ["cryorefine"]) + (["relion"] if options.relion else [])
    report = {"n": options.n, "box_px": options.box, "pixel_size_angstrom": pixel, "snr": options.snr,
              "particle_diameter_angstrom": diameter, "maps": list(maps), "gui_line": GUI_LINE,
              "auto_refine_options": list(AUTO_REFINE), "extra": extra, "simulate_seconds": {}, "runs": [],
              "refines": [], "command": shlex.join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])}
    out = options.json or work / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(finite_or_none(report), indent=1) + "\n")

    for name, volume in maps.items():
        map_folder = work / name
        tic = time.perf_counter()
        simulate_set(map_folder, volume, pixel, options)
        report["simulate_seconds"][name] = round(time.perf_counter() - tic, 1)
        prepared = prepare_truth(volume)
        for seed in options.seeds:
            for program in programs:
                run = {"map": name, **initial_model_run(map_folder, program, seed, options, extra, diameter)}
                run.update(measure_initial_model(map_folder / f"{program}_seed{seed}", prepared, pixel,
                                                 options.measure_every))
                report["runs"].append(run)
                save()
        if not options.follow_refine:
            continue
        starts = [(f"{r['program']}_seed{r['seed']}", r["seed"]) for r in report["runs"]
                  if r["map"] == name and r.get("final")] + [("truth40", options.seeds[0])]
        for start, seed in starts:
            folder, command = refine_command(start, seed, options, diameter)
            record = launch(map_folder / folder, command, map_folder, None, options.reuse)
            report["refines"].append({"map": name, "start": start, "seed": seed, **record,
                                      **measure_refine(map_folder / folder, prepared, pixel)})
            save()
    save()
    print(f"{options.n} particles of each map ({', '.join(maps)}), {options.box} px at {pixel:g} Å/px, SNR "
          f"{options.snr:g}, mask {diameter} Å; sets made in "
          f"{', '.join(f'{s:.1f}' for s in report['simulate_seconds'].values())} s (about 0: reused)")
    print(table(report["runs"], report["refines"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

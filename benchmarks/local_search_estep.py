"""E-step time of local searches as the HEALPix order rises: the late iterations of an auto-refinement.

For each order, particles projected at random poses from a reference in the real box (360 px,
1.34 Å/px: the density of --model, an atomic model, else a smooth blob density whose posteriors
stay broad at high resolution), CTF-like rings and white noise at --snr, are searched locally
around previous poses that
are the truth moved by about half of σ, with RELION's σ for that order (two oversampled steps) and
the image sizes of a late iteration (resolution 2·pixel/0.75 Å, as `cryorefine plan`'s late moment).
A warm-up batch runs first (compilation), then every particle in batches of --batch. Printed and
written as JSON per order: orientations per particle (mean, largest), E-step seconds per 10,000
particles with the engine's stages, the set-up, and the arena's high water.

    python benchmarks/local_search_estep.py --model 7p6z.cif.gz --orders 4 5 6 7 --particles 2000 \
        --json results/local_search_h100.json

The numbers are measured on --particles particles and scaled to 10,000 (labelled so): every batch of
an iteration costs the same work per particle, there is no per-iteration start besides the set-up,
which is reported on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from estep_throughput import make_inputs, sub_batch, timed_setup, warm_up  # noqa: E402

from cryorefine.core import fourier  # noqa: E402
from cryorefine.core.sampling import Sampling  # noqa: E402
from cryorefine.em import schedule  # noqa: E402
from cryorefine.estep.common import local_orientations  # noqa: E402

BOX_PX, PIXEL_ANGSTROM, DIAMETER_ANGSTROM = 360, 1.34, 360.0
PER = 10_000


def order_setup(setup, batch, order, rng, offset_range_px=3.0):
    """The set-up and batch of a local search at HEALPix `order` (late-iteration sizes), priors near the truth."""
    sigma = schedule.local_search_sigma_deg(order, 1)
    sizes = schedule.image_sizes(2 * PIXEL_ANGSTROM / 0.75, order, DIAMETER_ANGSTROM, BOX_PX, PIXEL_ANGSTROM, 10,
                                 False, False, ave_pmax=0.5, oversampling=1)
    current, coarse = sizes.current_size_px, sizes.coarse_size_px
    sampling = Sampling(healpix_order=order, offset_range_px=offset_range_px, offset_step_px=1.0)
    n = batch.indices.size
    moved = {name: getattr(batch, name) + rng.normal(0, sigma / 2, n)
             for name in ("prior_rot_deg", "prior_tilt_deg", "prior_psi_deg")}
    moved["prior_tilt_deg"] = np.clip(moved["prior_tilt_deg"], 0, 180)
    images = fourier.window_ft_2d(batch.images_ft, current)
    ctf = fourier.window_ft_2d(batch.ctf, current)
    b = replace(batch, images_ft=images, images_ft_unmasked=images, ctf=ctf, **moved)
    s = replace(setup, sampling=sampling, current_size_px=current, coarse_size_px=coarse, local_searches=True,
                sigma_rot_deg=sigma, sigma_psi_deg=sigma, sigma_offset_px=1.5)
    return s, b, sigma


def run_order(cp, setup, batch, batch_size, free_gpu_memory_mb):
    from cryorefine.gpu.allocator import DeviceArena, Scope

    arena = DeviceArena(free_gpu_memory_mb=free_gpu_memory_mb)
    try:
        with arena.installed(), arena.scope(Scope.GLOBAL):
            warm_up(arena, setup, batch, batch_size)  # a whole batch: its shapes compile here, not in the timing
            with arena.scope(Scope.ITERATION):
                engine, setup_seconds = timed_setup(cp, arena, setup)
                n = batch.indices.size
                parts = [sub_batch(batch, np.arange(start, min(n, start + batch_size)))  # host copies, not timed
                         for start in range(0, n, batch_size)]
                tic = time.perf_counter()  # the neighbourhoods' sizes, apart from the E-step's timing
                counts = [local_orientations(setup, part.prior_rot_deg, part.prior_tilt_deg,
                                             part.prior_psi_deg).counts() for part in parts]
                count_seconds = time.perf_counter() - tic
                tic = time.perf_counter()
                significant = []
                for part in parts:
                    result = engine.run(part)
                    significant.append(result.n_significant)
                engine.sums()
                cp.cuda.get_current_stream().synchronize()
                seconds = time.perf_counter() - tic
                stages = dict(engine.stage_seconds)
                del engine
            high_water = int(arena.high_water_bytes)
    finally:
        arena.close()
    counts = np.concatenate(counts)
    significant = np.concatenate(significant)
    return {"particles": int(n), "setup_seconds": setup_seconds, "estep_seconds": seconds,
            "orientation_count_seconds": count_seconds, "stage_seconds": stages,
            "orientations_per_particle_mean": float(counts.mean()), "orientations_per_particle_max": int(counts.max()),
            "significant_per_particle_mean": float(significant.mean()), "arena_high_water_bytes": high_water}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, nargs="+", default=[4, 5, 6, 7])
    parser.add_argument("--particles", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256, help="particles per engine.run call")
    parser.add_argument("--snr", type=float, default=0.05)
    parser.add_argument("--model", type=Path, default=None, help="atomic model of the reference (default: blobs)")
    parser.add_argument("--offset_range", type=float, default=3.0,
                        help="translation disc radius in px, step 1 px (3: 29 translations; 1.5: 9, as the late "
                             "iterations of the stand-in's auto-refine)")
    parser.add_argument("--free_gpu_memory", type=float, default=2048.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    tic = time.perf_counter()
    volume = None
    if args.model is not None:
        from cryorefine.density import density_from_model

        volume = density_from_model(args.model, BOX_PX, PIXEL_ANGSTROM)
    setup, batch = make_inputs(BOX_PX, args.particles, args.snr, seed=3, xp=cp, volume=volume)
    setup = replace(setup, pixel_size_angstrom=PIXEL_ANGSTROM)
    print(f"inputs: {args.particles} particles, {BOX_PX} px, {time.perf_counter() - tic:.1f} s", flush=True)
    rng = np.random.default_rng(4)
    rows = []
    for order in args.orders:
        s, b, sigma = order_setup(setup, batch, order, rng, args.offset_range)
        r = run_order(cp, s, b, args.batch, args.free_gpu_memory)
        scale = PER / r["particles"]
        r.update(order=order, sigma_deg=sigma, current_size_px=s.current_size_px, coarse_size_px=s.coarse_size_px,
                 grid_orientations=s.sampling.n_orientations, translations=s.sampling.n_translations,
                 estep_seconds_per_10k_scaled=r["estep_seconds"] * scale)
        rows.append(r)
        stages = ", ".join(f"{k} {v * scale:.2f}" for k, v in r["stage_seconds"].items() if v)
        print(f"order {order} (σ {sigma:.2f}°, grid {r['grid_orientations']:,} orientations, sizes "
              f"{r['current_size_px']}/{r['coarse_size_px']} px, {r['translations']} translations): "
              f"{r['orientations_per_particle_mean']:.0f} orientations per particle (largest "
              f"{r['orientations_per_particle_max']}), {r['significant_per_particle_mean']:.1f} significant; "
              f"E-step {r['estep_seconds_per_10k_scaled']:.2f} s per 10,000 particles (scaled from {r['particles']}; "
              f"{stages}); set-up {r['setup_seconds']:.2f} s; arena high water "
              f"{r['arena_high_water_bytes'] / 1e9:.2f} GB", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"box_px": BOX_PX, "pixel_size_angstrom": PIXEL_ANGSTROM, "snr": args.snr,
                                         "reference": str(args.model or "blobs"), "orders": rows}, indent=1))


if __name__ == "__main__":
    main()

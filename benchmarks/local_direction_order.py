"""Does the order of a local search's particles change its coarse kernel's time? (benchmarks/README.md,
"Local searches in the order of the directions").

A local search's coarse kernel (local.cu) projects each particle's own neighbourhood of the reference: the
voxels near one central plane, as thick as the neighbourhood is wide. The particles of a batch are worked on at
once; when they come from one region of the sphere (`em.estep.in_direction_order`), their planes are near each
other and the GPU's cache holds what they share. This script times one launch of the kernel on a batch of 512
particles taken from a data set of N particles with uniformly random poses:

- `index order`: the first 512 (the STAR file's order: directions from all over the sphere);
- `along the curve`: 512 consecutive particles after sorting the data set along HEALPix's NEST curve of the
  directions (what a batch holds with `in_direction_order`), for N = 5,000 (a half set of 10,000),
  50,000 and 500,000.

Shapes of the 360 px stand-in's auto-refine: HEALPix order 5 at a coarse size of 198 px (current 210) and
order 8 at 214 px, 9 translations, each neighbourhood the real one of `Sampling.local_orientations` with σ one
coarse step (about 177 orientations, padded to the widest). Milliseconds per launch (CUDA events, the mean of 5
after a warm one); the reference is random (its values do not change the time).

    python benchmarks/local_direction_order.py --json results/local_direction_order_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from bench_common import half_plane_coefficients, launch_ms

BOX_PX, BATCH, N_T = 360, 512, 9
SHAPES = ((5, 210, 198), (8, 214, 214))  # (HEALPix order, current size, coarse size)
DATA_SETS = (5_000, 50_000, 500_000)


def random_poses(n, rng):
    """(rot, tilt, psi) in degrees of n uniformly random rotations."""
    return rng.uniform(-180, 180, n), np.degrees(np.arccos(rng.uniform(-1, 1, n))), rng.uniform(-180, 180, n)


def batch_of(poses, along_curve, rng):
    """The poses of one batch of BATCH particles: the first ones, or BATCH consecutive ones along the curve."""
    if not along_curve:
        return tuple(a[:BATCH] for a in poses)
    from cryorefine.core.sampling import healpix_pixels
    from cryorefine.em.estep import DIRECTION_CURVE_ORDER

    order = np.argsort(healpix_pixels(DIRECTION_CURVE_ORDER, poses[0], poses[1]), kind="stable")
    start = int(rng.integers(0, order.size - BATCH))
    return tuple(a[order[start:start + BATCH]] for a in poses)


def neighbourhood_matrices(order, batch_poses):
    """(BATCH·width, 9) float64 matrices of each particle's local orientations (padded to the widest), the width
    and each particle's own count."""
    from cryorefine.core.sampling import Sampling
    from cryorefine.em import schedule

    sampling = Sampling(healpix_order=order, offset_range_px=2, offset_step_px=1)
    sigma = schedule.local_search_sigma_deg(order, 1)
    local = sampling.local_orientations(*batch_poses, sigma, sigma)
    orientation, _ = local.padded()
    return (sampling.orientation_matrices(index=orientation.reshape(-1)).reshape(-1, 9), orientation.shape[1],
            local.counts())


def time_launch(cp, order, current, coarse, batch_poses):
    from cryorefine.core.grid import PaddedGrid
    from cryorefine.estep import kernels

    grid = PaddedGrid.create(BOX_PX, 2, current // 2)
    d, _, w = grid.shape
    vol = cp.random.standard_normal((d, d, 2 * w), dtype=cp.float32).view(cp.complex64)
    geometry = (np.int32(d), np.int32(w), np.int32(grid.origin), np.float32(grid.padding_factor),
                np.float32((coarse // 2 * grid.padding_factor) ** 2 * 1.00001))
    kx, ky = half_plane_coefficients(coarse, cp)
    kc = kx.size
    mats, width, counts = neighbourhood_matrices(order, batch_poses)
    mats = cp.asarray(mats, cp.float32)
    rt, tt, name = kernels.local_tile(N_T)
    tiles = kernels.local_tiles(counts, rt, xp=cp)
    ldt = -(-N_T // tt) * tt
    moved = cp.random.standard_normal((BATCH, kc, 2 * ldt), dtype=cp.float32).view(cp.complex64)
    pair = cp.random.random((BATCH, kc), dtype=cp.float32)
    row = cp.random.random(BATCH, dtype=cp.float64) + 1e3
    out = cp.empty((BATCH, 1, width, N_T), cp.float32)
    fn = kernels.kernel_module().get_function(name)
    launch = ((tiles[0].size, ldt // tt, 1), (kernels.LOCAL_THREADS,),
              (vol, *geometry, mats, *tiles, kx, ky, np.int32(kc), moved, np.int32(ldt), pair, row, np.int32(width),
               np.int32(N_T), np.int32(0), np.int32(1), np.int32(0), out))
    return launch_ms(cp, fn, launch, 5), width


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    import cupy as cp

    rng = np.random.default_rng(0)
    rows = []
    for order, current, coarse in SHAPES:
        for n in DATA_SETS:
            poses = random_poses(n, rng)
            for along in (False, True):
                if not along and n != DATA_SETS[0]:
                    continue  # the index order's batch is as spread whatever N
                ms, width = time_launch(cp, order, current, coarse, batch_of(poses, along, rng))
                row = {"healpix_order": order, "coarse_px": coarse, "n_particles": n,
                       "batch": "along the curve" if along else "index order", "width": width, "ms": round(ms, 3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

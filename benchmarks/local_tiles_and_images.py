"""Two GPU measurements behind the late local searches' figures (benchmarks/README.md, "Late local searches").

1. The local search's coarse kernel (local.cu) in each translation tile of 16, 32 and 64 on the shapes of a
   late auto-refine iteration of the 360 px stand-in: 512 particles × 177 orientations (each particle's
   within 6° of a random pose), coarse sizes 100, 214 and 360 px, 9 to 49 translations; milliseconds per
   launch (CUDA events, 3 launches after a warm one), the tile `estep.kernels.local_tile` picks, and the
   largest relative difference from the tile of 32 (the one the kernel used for every search before).
2. Where the image preparation's time goes: `images.prepare_batch` on 2,048 simulated 360 px particles in
   batches of 512 read ahead into pinned memory, each step timed with the device synchronised around it
   (the first pass includes CuPy's compilation; the second is the figure).

    python benchmarks/local_tiles_and_images.py --work /tmp/tiles --json results/local_diff2_tiles_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from bench_common import half_plane_coefficients, launch_ms

BOX_PX, PIXEL_ANGSTROM, N_PARTICLES, BATCH, WIDTH = 360, 1.34, 2048, 512, 177


def rotations_near_random_poses(n_poses, per_pose, spread_deg, rng):
    """(n_poses·per_pose, 9) rotation matrices: random poses, each turned by up to `spread_deg` about random axes."""
    q = rng.normal(size=(n_poses, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    base = np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
                     2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
                     2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)], axis=1).reshape(-1, 3, 3)
    n = n_poses * per_pose
    axis = rng.normal(size=(n, 3))
    axis /= np.linalg.norm(axis, axis=1, keepdims=True)
    angle = np.radians(rng.uniform(-spread_deg, spread_deg, n))[:, None, None]
    k = np.zeros((n, 3, 3))
    k[:, 0, 1], k[:, 0, 2], k[:, 1, 2] = -axis[:, 2], axis[:, 1], -axis[:, 0]
    k[:, 1, 0], k[:, 2, 0], k[:, 2, 1] = axis[:, 2], -axis[:, 1], axis[:, 0]
    turn = np.eye(3)[None] + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k
    return np.einsum("bij,brjk->brik", base, turn.reshape(n_poses, per_pose, 3, 3)).reshape(-1, 9)


def tiles(cp):
    from cryorefine.core.grid import PaddedGrid
    from cryorefine.estep import kernels

    module = kernels.kernel_module()
    rng = np.random.default_rng(0)
    rows = []
    for size in (100, 214, 360):
        grid = PaddedGrid.create(BOX_PX, 2, size // 2)
        d, _, w = grid.shape
        vol = cp.random.standard_normal((d, d, 2 * w), dtype=cp.float32).view(cp.complex64)
        geometry = (np.int32(d), np.int32(w), np.int32(grid.origin), np.float32(grid.padding_factor),
                    np.float32(grid.r_max_padded ** 2 * 1.00001))
        kx, ky = half_plane_coefficients(size, cp)
        kc = kx.size
        mats = cp.asarray(rotations_near_random_poses(BATCH, WIDTH, 6.0, rng), cp.float32)
        pair = cp.random.random((BATCH, kc), dtype=cp.float32)
        row = cp.random.random(BATCH, dtype=cp.float64) + 1e3
        for n_t in (9, 13, 21, 29, 49):
            ldt = -(-n_t // 64) * 64
            moved = cp.random.standard_normal((BATCH, kc, 2 * ldt), dtype=cp.float32).view(cp.complex64)
            result, outputs = {}, {}
            for tt in kernels.LOCAL_TRANSLATION_TILES:
                rt, fn = 4 * kernels.LOCAL_THREADS // tt, module.get_function(f"local_diff2_t{tt}")
                counts = np.full(BATCH, WIDTH)
                tiles = kernels.local_tiles(counts, rt, xp=cp)
                out = cp.empty((BATCH, 1, WIDTH, n_t), cp.float32)
                launch = ((tiles[0].size, -(-n_t // tt), 1), (kernels.LOCAL_THREADS,),
                          (vol, *geometry, mats, *tiles, kx, ky, np.int32(kc), moved, np.int32(ldt), pair, row,
                           np.int32(WIDTH), np.int32(n_t), np.int32(0), np.int32(1), np.int32(0), out))
                result[f"t{tt}"] = launch_ms(cp, fn, launch, 3)
                outputs[tt] = out
            for tt, out in outputs.items():
                result[f"t{tt}_maxrel_vs_t32"] = float(cp.max(cp.abs(out - outputs[32]) / cp.abs(outputs[32])))
            chosen = kernels.local_tile(n_t)[2].split("_")[-1]
            result.update(size=size, kc=kc, n_t=n_t, chosen=chosen, speedup_vs_t32=result["t32"] / result[chosen])
            print(json.dumps(result), flush=True)
            rows.append(result)
            del moved
        del vol
    return rows


def image_preparation(cp, work):
    import mrcfile

    from cryorefine import images
    from cryorefine.core import fourier
    from cryorefine.data import load_particles
    from cryorefine.io import mrc

    os.makedirs(work, exist_ok=True)
    star = os.path.join(work, "sim", "particles.star")
    if not os.path.exists(star):
        g = np.fft.fftfreq(BOX_PX)
        blur = np.exp(-(g[:, None, None] ** 2 + g[None, :, None] ** 2 + g[None, None, :] ** 2) / (2 * 0.03 ** 2))
        noise = np.random.default_rng(1).normal(size=(BOX_PX,) * 3)
        volume = np.real(np.fft.ifftn(np.fft.fftn(noise) * blur)).astype(np.float32)
        with mrcfile.new(os.path.join(work, "ref.mrc"), overwrite=True) as m:
            m.set_data(volume)
            m.voxel_size = PIXEL_ANGSTROM
        subprocess.run([sys.executable, "-m", "cryorefine", "simulate", "--ref", os.path.join(work, "ref.mrc"), "--n",
                        str(N_PARTICLES), "--o", os.path.join(work, "sim"), "--gpu", "0", "--particle_diameter",
                        "360"], check=True)
    particles = load_particles(star)
    settings = images.ImageSettings(BOX_PX, PIXEL_ANGSTROM, 360.0, 5.0, True, True, 0, False)
    seconds = {}

    def timed(module, name):
        original = getattr(module, name)

        def wrapper(*a, **k):
            cp.cuda.Device().synchronize()
            tic = time.perf_counter()
            value = original(*a, **k)
            cp.cuda.Device().synchronize()
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - tic
            return value

        setattr(module, name, wrapper)

    for name in ("to_device", "device_shifted_images", "shell_power", "ctf_2d"):
        timed(images, name)
    timed(fourier, "rfft2_of_shifted")
    timed(fourier, "window_ft_2d")
    passes = []
    batches = [np.arange(i, min(N_PARTICLES, i + BATCH)) for i in range(0, N_PARTICLES, BATCH)]
    with mrc.StackReader() as reader:
        for rep in range(2):
            seconds.clear()
            total = 0.0
            for indices, read in particles.read_ahead(iter(batches), reader, cp):
                cp.cuda.Device().synchronize()
                tic = time.perf_counter()
                batch = images.prepare_batch(particles, indices, reader, settings, 214, 1.0, 5, xp=cp, images=read)
                cp.cuda.Device().synchronize()
                total += time.perf_counter() - tic
                del batch
            record = {"pass": rep, "prepare_seconds": total, "particles": N_PARTICLES, **seconds}
            print(json.dumps(record), flush=True)
            passes.append(record)
    return passes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/tiles", help="folder for the simulated particles")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    import cupy as cp

    results = {"local": tiles(cp), "images": image_preparation(cp, args.work)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

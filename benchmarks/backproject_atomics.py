"""Back-projection with its atomic adds six ways, side by side on one GPU (Hopper).

    python benchmarks/backproject_atomics.py [--size 214] [--particles 500] [--rows 40]

The kernels of the package (`backproject_slices`) are compiled five times: as they are (one float4 atomic for the
data and one float2 for the weights of an x edge's two voxels where they are aligned, `atomic_add_x_pair`), with
-DUNPAIRED_ATOMICS (one float2 atomic per voxel's complex sum and a scalar one for its weight), with -DSCALAR_ATOMICS
(scalar atomics only), with -DINTERLEAVED_VOXELS (a volume of one float4 of re, im, weight and 0 a voxel, so that
an x edge's data and weights share one 32-byte sector) and with -DGROUPED_VOXELS (x-runs of four voxels, their data
then their weights, 48 bytes: 12 bytes a voxel as now, an even x edge's data and weights mostly on one line). The
first is run twice: with the rows in groups of 8 (the engine's groups, a coarse orientation's children: a
coefficient that stays in one voxel cube from row to row is summed in registers and goes to memory once) and a row
at a time, as the unpaired and scalar ones; the interleaved and grouped ones in groups of 8. Each back-projects the
same slices: --particles clusters of --rows orientations within about a degree of each other (as a late local
search's significant orientations are), in groups of 8 children within about 0.1° (HEALPix order 9's step is
0.11°), every coefficient of a --size px image (the E-step's disc) with a positive weight, into one class's padded
(×2) volume. Prints each variant's kernel time (median of 5) and the largest difference of its sums from the
first's, relative to the largest sum.
"""

import argparse
import time

import numpy as np

GROUP = 8  # rows per group: the children of a coarse orientation at oversampling 1


def main():
    import cupy as cp

    from cryorefine.core import euler
    from cryorefine.estep.common import Coefficients
    from cryorefine.estep.kernels import COMPILE_OPTIONS, kernel_source

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", type=int, default=214, help="Current image size (px).")
    parser.add_argument("--particles", type=int, default=500)
    parser.add_argument("--rows", type=int, default=40, help="Orientations per particle (a multiple of 8).")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    coef = Coefficients.create(args.size)
    n_coef = coef.positions.size
    poses = rng.uniform([-180, 0, -180], [180, 180, 180], (args.particles, 3))
    parents = poses[:, None, :] + rng.normal(0, 0.5, (args.particles, args.rows // GROUP, 3))
    angles = (parents[:, :, None, :] + rng.normal(0, 0.05, parents.shape[:2] + (GROUP, 3))).reshape(-1, 3)
    mats = cp.asarray(euler.euler_to_matrix(angles[:, 0], angles[:, 1], angles[:, 2]).reshape(-1, 9), cp.float32)
    n_rows = angles.shape[0]
    data = (cp.random.standard_normal((n_rows, n_coef), dtype=cp.float32)
            + 1j * cp.random.standard_normal((n_rows, n_coef), dtype=cp.float32)).astype(cp.complex64)
    weight = cp.random.uniform(0.1, 1.0, (n_rows, n_coef), dtype=cp.float32)
    row_class = cp.zeros(n_rows, dtype=cp.int32)
    kx, ky = cp.asarray(coef.kx, cp.float32), cp.asarray(coef.ky, cp.float32)
    pf = 2.0
    r_pad = pf * args.size / 2
    d = 2 * int(r_pad) + 3
    w = int(r_pad) + 2
    origin = d // 2
    results = {}
    for name, extra, group in (("x-edge float4 atomics, groups of 8", (), GROUP),
                               ("x-edge float4 atomics, a row at a time", (), 1),
                               ("float2 atomics", ("-DUNPAIRED_ATOMICS",), 1),
                               ("scalar atomics", ("-DSCALAR_ATOMICS",), 1),
                               ("interleaved voxels (re, im, weight, 0), groups of 8", ("-DINTERLEAVED_VOXELS",),
                                GROUP),
                               ("four voxels' data then their weights, groups of 8", ("-DGROUPED_VOXELS",), GROUP)):
        fn = cp.RawModule(code=kernel_source(), options=COMPILE_OPTIONS + extra).get_function("backproject_slices")
        interleaved, grouped = "-DINTERLEAVED_VOXELS" in extra, "-DGROUPED_VOXELS" in extra
        n_voxels = d * d * w
        times = []
        for _ in range(6):
            if interleaved:
                vol, vol_w = cp.zeros(n_voxels * 4, dtype=cp.float32), cp.zeros(1, dtype=cp.float32)
            elif grouped:
                vol, vol_w = cp.zeros(-(-n_voxels // 4) * 12 + 12, dtype=cp.float32), cp.zeros(1, dtype=cp.float32)
            else:
                vol, vol_w = cp.zeros(n_voxels * 2, dtype=cp.float32), cp.zeros(n_voxels, dtype=cp.float32)
            cp.cuda.Device().synchronize()
            tic = time.perf_counter()
            fn(((n_coef + 127) // 128, min(n_rows // group, 65535)), (128,),
               (data, weight, mats, row_class, np.int32(n_rows), np.int32(group), kx, ky, np.int32(n_coef), np.int32(d), np.int32(w),
                np.int32(origin), np.float32(pf), np.float32(r_pad * r_pad * (1 + 1e-5)), np.int64(d * d * w), vol,
                vol_w))
            cp.cuda.Device().synchronize()
            times.append(time.perf_counter() - tic)
        if interleaved:  # the data (re, im) and weights of each voxel, as the other layouts hold them
            vol, vol_w = vol.reshape(-1, 4)[:, :2].reshape(-1), vol.reshape(-1, 4)[:, 2].copy()
        elif grouped:
            runs = vol[:-12].reshape(-1, 12)
            vol, vol_w = runs[:, :8].reshape(-1)[:2 * n_voxels], runs[:, 8:].reshape(-1)[:n_voxels]
        results[name] = (float(np.median(times[1:])), vol, vol_w)
        print(f"{name}: {results[name][0] * 1e3:.1f} ms for {n_rows} slices of {n_coef} coefficients "
              f"({n_rows * n_coef / results[name][0] / 1e9:.2f} G coefficients/s)")
    first, (_, a, aw) = next(iter(results.items()))
    for name, (_, b, bw) in list(results.items())[1:]:
        print(f"{name} against {first}: the data sums differ by {float(cp.abs(a - b).max() / cp.abs(a).max()):.2e} "
              f"of the largest, the weights by {float(cp.abs(aw - bw).max() / cp.abs(aw).max()):.2e}")


if __name__ == "__main__":
    main()

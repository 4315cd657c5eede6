"""The global search's coarse product on CUDA cores (`coarse_diff2`, FP32) and on tensor cores, three TF32
products per FP32 one, with `mma.sync` (`coarse_diff2_tf32`) and, on compute capability 9.0, with Hopper's
warp-group products (`coarse_diff2_wgmma`), side by side on the shapes of the jobs that use it.

For each shape, the kernels run the same likelihood epilogue on the same random operands (K × M shifted
images, K × N slices, coefficient-major and padded as the engine pads them): milliseconds per launch (CUDA
events, 5 launches after a warm one), achieved TFLOP/s counted as FP32 work (2·M·N·K), and the largest error
against float64 over 4,096 random outputs, relative to the sum of the magnitudes summed (random signs make a
sum itself near 0). Shapes (M = particles × translations, N = orientations, K = 2 × coefficients):

- class3d_26px: Class3D's global search at a 26 px coarse size, 512 particles × 21 translations, 4,608 orientations;
- refine_order3_50px: the auto-refine's order-3 global search at 50 px, 36,864 orientations, 512 particles × 21
  translations (the 10k job's order-3 iterations search 45: a taller product of the same kind);
- refine_order2_100px and whole_box_360px: larger coarse sizes (the case estep_throughput.py times).

    python benchmarks/coarse_tensor_cores.py --json benchmarks/results/coarse_tensor_cores_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from bench_common import half_plane_coefficients, launch_ms

SHAPES = {  # name: (particles, translations, orientations, coarse size px)
    "class3d_26px": (512, 21, 4608, 26),
    "refine_order3_50px": (512, 21, 36864, 50),
    "refine_order2_100px": (512, 21, 4608, 100),
    "whole_box_360px": (256, 21, 4608, 360),
}
LABELS = {"coarse_diff2": "FP32", "coarse_diff2_tf32": "3xTF32 mma.sync", "coarse_diff2_wgmma": "3xTF32 wgmma"}


def device_kernels(compute_capability):
    """The coarse kernels a device of `compute_capability` runs, CUDA cores first."""
    kernels = ["coarse_diff2", "coarse_diff2_tf32"]
    if str(compute_capability) == "90":
        kernels.append("coarse_diff2_wgmma")
    return kernels


def measure(cp, name, n_particles, n_translations, n_orientations, size_px, repeats, rng, module=None,
            kernels=("coarse_diff2", "coarse_diff2_tf32")):
    """The `kernels` of `module` (default: the package's) on one shape; their times, FLOP/s and errors."""
    import functools

    from cryorefine.estep.kernels import (
        GEMM_BK,
        GEMM_BM,
        GEMM_BN,
        GEMM_THREADS,
        coarse_shared_bytes,
        kernel_module,
        round_up,
    )

    n_coef = int(half_plane_coefficients(size_px, cp)[0].size)
    m, k = n_particles * n_translations, 2 * n_coef
    lda, ldb, kd = round_up(m, GEMM_BM), round_up(n_orientations, GEMM_BN), round_up(k, GEMM_BK)
    a = np.zeros((kd, lda), np.float32)
    b = np.zeros((kd, ldb), np.float32)
    a[:k, :m] = rng.standard_normal((k, m))
    b[:k, :n_orientations] = rng.standard_normal((k, n_orientations))
    row = rng.standard_normal(n_particles).astype(np.float32)
    pair = rng.standard_normal((n_particles, n_orientations)).astype(np.float32)
    a_d, b_d, row_d, pair_d = (cp.asarray(v) for v in (a, b, row, pair))
    module = module or kernel_module()
    pick = rng.integers(0, [n_particles, n_orientations, n_translations], (4096, 3))
    terms = a[:k, pick[:, 0] * n_translations + pick[:, 2]].astype(np.float64) * b[:k, pick[:, 1]]
    want = row[pick[:, 0]] + pair[pick[:, 0], pick[:, 1]] - terms.sum(axis=0)
    scale = np.abs(row[pick[:, 0]]) + np.abs(pair[pick[:, 0], pick[:, 1]]) + np.abs(terms).sum(axis=0)
    result = {"shape": name, "m": m, "n": n_orientations, "k": k}
    for kernel in kernels:
        out = cp.empty((n_particles, n_orientations * n_translations), cp.float32)
        args = (a_d, b_d, np.int32(lda), np.int32(ldb), np.int32(kd), np.int32(m), np.int32(n_orientations),
                np.int32(n_translations), row_d, pair_d, np.int32(0), np.int32(n_orientations), np.int32(0), out)
        fn = functools.partial(module.get_function(kernel), shared_mem=coarse_shared_bytes(kernel))
        ms = launch_ms(cp, fn, ((ldb // GEMM_BN, lda // GEMM_BM), (GEMM_THREADS,), args), repeats)
        got = cp.asnumpy(out).reshape(n_particles, n_orientations, n_translations)[pick[:, 0], pick[:, 1], pick[:, 2]]
        result[kernel] = {"ms": ms, "tflops": 2.0 * m * n_orientations * k / (ms / 1e3) / 1e12,
                          "max_error_relative_to_sum_of_magnitudes": float(np.max(np.abs(got - want) / scale))}
        del out
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args(argv)
    import cupy as cp

    device = cp.cuda.Device()
    if int(device.compute_capability) < 80:
        sys.exit(f"compute capability {device.compute_capability}: coarse_diff2_tf32 needs 8.0 or later")
    rng = np.random.default_rng(0)
    kernels = device_kernels(device.compute_capability)
    results = []
    for name in args.shapes:
        r = measure(cp, name, *SHAPES[name], args.repeats, rng, kernels=kernels)
        results.append(r)
        fp32 = r["coarse_diff2"]
        parts = [f"{LABELS[k]} {r[k]['ms']:8.2f} ms {r[k]['tflops']:5.1f} TFLOP/s "
                 f"err {r[k]['max_error_relative_to_sum_of_magnitudes']:.1e}"
                 + (f" {fp32['ms'] / r[k]['ms']:.2f}×" if k != "coarse_diff2" else "") for k in kernels]
        print(f"{name:22s} M {r['m']:6d} N {r['n']:6d} K {r['k']:6d} | " + " | ".join(parts), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": cp.cuda.runtime.getDeviceProperties(device.id)["name"].decode(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

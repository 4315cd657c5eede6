"""Per-call time of `core.fourier.shell_sum` on the GPU: the one-launch kernel of `gpu.shell_sums` against the
array path it replaced (`fourier.shell_sum_by_bincount`: a boolean mask for the coefficients beyond the last shell,
then `bincount`).

    python benchmarks/shell_sums.py            # needs CuPy and a CUDA device

Two shapes: a 32 × 723 × 362 slab of a 360 px padded volume (181 shells, as the M-step's noise spectra) and the
power of 200 images at 214 px (108 shells, as every batch's image preparation). Prints each path's milliseconds a
call over 50 calls, the part of it before the host could go on, and the largest relative difference of the sums.
"""

from __future__ import annotations

import time

import numpy as np


def main():
    import cupy as cp

    from cryorefine.core import fourier

    cases = (("slab 32 x 723 x 362", (32, 723, 362), (), 181), ("200 images 214 x 108", (214, 108), (200,), 108))
    for label, shape, lead, n_shells in cases:
        idx = np.indices(shape).astype(np.float64)
        r = np.sqrt(sum((idx[i] - shape[i] // 2) ** 2 for i in range(len(shape)))) / 2.0
        shells = cp.asarray(np.where(r < n_shells - 0.5, np.rint(r), n_shells).astype(np.int64))
        values = cp.random.random(lead + shape)
        old = fourier.shell_sum_by_bincount(values, shells, n_shells, cp)
        new = fourier.shell_sum(values, shells, n_shells, cp)
        print(label, "largest relative difference", float(cp.max(cp.abs(old - new) / cp.maximum(cp.abs(old), 1e-300))))
        paths = (("array path", lambda: fourier.shell_sum_by_bincount(values, shells, n_shells, cp)),
                 ("kernel", lambda: fourier.shell_sum(values, shells, n_shells, cp)))
        for name, call in paths:
            cp.cuda.Device().synchronize()
            start = time.perf_counter()
            for _ in range(50):
                call()
            host = time.perf_counter() - start
            cp.cuda.Device().synchronize()
            total = time.perf_counter() - start
            print(f"  {name:10s} {total / 50 * 1e3:7.3f} ms a call ({host / 50 * 1e3:.3f} ms before the host could go on)")


if __name__ == "__main__":
    main()

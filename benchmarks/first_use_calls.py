"""The first calls a GPU job makes, each timed twice on the device with the files it adds to CuPy's kernel cache
($CUPY_CACHE_DIR) and the driver's JIT cache ($CUDA_CACHE_PATH): the package's kernel module, cuFFT R2C plans for
360 and 214 px batches, an axis sort and cumsum, the coarse weights' significance cut on an order-2 and an order-3
shape, argsort and unique. Run it on empty caches to see what a first run on a machine compiles:

    CUPY_CACHE_DIR=$(mktemp -d) CUDA_CACHE_PATH=$(mktemp -d) python benchmarks/first_use_calls.py
"""
import argparse
import functools
import os
import time
from pathlib import Path

import numpy as np


def cache_dirs():
    return {"cupy": Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache")),
            "driver": Path(os.environ.get("CUDA_CACHE_PATH", Path.home() / ".nv" / "ComputeCache"))}


def cached_files(dirs):
    return {k: {str(p) for p in v.rglob("*") if p.is_file()} if v.exists() else set() for k, v in dirs.items()}


def timed(cp, dirs, label, call, times=2):
    for attempt in range(1, times + 1):
        before = cached_files(dirs)
        cp.cuda.Device().synchronize()
        tic = time.perf_counter()
        call()
        cp.cuda.Device().synchronize()
        seconds = time.perf_counter() - tic
        after = cached_files(dirs)
        new = {k: len(after[k] - before[k]) for k in dirs}
        print(f"{label} call {attempt}: {seconds:.3f} s, new cache files {new}", flush=True)


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import cupy as cp

    from cryorefine.estep.cuda import coarse_significant
    from cryorefine.estep.kernels import kernel_module
    from cryorefine.gpu.fft_plans import rfft2_forward

    dirs = cache_dirs()
    print("CUPY_ACCELERATORS", repr(os.environ.get("CUPY_ACCELERATORS")), {k: str(v) for k, v in dirs.items()},
          flush=True)
    timed(cp, dirs, "our kernel module", lambda: kernel_module(device_id=0), times=1)
    rng = np.random.default_rng(0)
    for px in (360, 214):
        x = cp.asarray(rng.standard_normal((1024, px, px), dtype=np.float32))
        timed(cp, dirs, f"rfft2 plan+transform {px} px", functools.partial(rfft2_forward, x))
        timed(cp, dirs, f"cupy.fft.irfft2 {px} px", lambda x=x: cp.fft.irfft2(cp.fft.rfft2(x)))
        del x
    p = cp.asarray(rng.random((1024, 3000)))
    timed(cp, dirs, "sort axis 1 float64", lambda: cp.sort(-p, axis=1))
    timed(cp, dirs, "cumsum axis 1 float64", lambda: cp.cumsum(p, axis=1))
    # rows of (batch, class, orientations, translations) as an order-2 and an order-3 global search gives them
    for label, (b, r, t) in (("order 2", (1024, 4608, 21)), ("order 3", (1024, 36864, 45))):
        d2 = cp.asarray(rng.standard_normal((b, 1, r, t), dtype=np.float32) * 30 + 1e4)
        prior_ko = cp.zeros((1, 1, r, 1))
        prior_t = cp.zeros((b, 1, 1, t))
        timed(cp, dirs, f"coarse_significant {label}",
              functools.partial(coarse_significant, cp, d2, prior_ko, prior_t, 0.999, -1, 0))
        del d2, prior_ko, prior_t
    q = cp.asarray(rng.integers(0, 10 ** 6, 10 ** 6))
    timed(cp, dirs, "argsort int64", lambda: cp.argsort(q))
    timed(cp, dirs, "unique int64 return_inverse", lambda: cp.unique(q, return_inverse=True))


if __name__ == "__main__":
    main()

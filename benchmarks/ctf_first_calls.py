"""The first calls of core.ctf.ctf_2d on the GPU at batch sizes 200, 512, 464 and 512 again (360 px, float64),
each timed with the device synchronised: on an empty CuPy cache they show what CuPy compiles and for which sizes.

    CUPY_CACHE_DIR=$(mktemp -d) python benchmarks/ctf_first_calls.py
    git show c6b9eb1~1:src/cryorefine/core/ctf.py > /tmp/ctf_before.py
    CUPY_CACHE_DIR=$(mktemp -d) python benchmarks/ctf_first_calls.py --module /tmp/ctf_before.py
"""
import argparse
import importlib.util
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", default=None, help="time ctf_2d from this file instead of the package's")
    args = parser.parse_args()
    import cupy as cp

    if args.module:
        spec = importlib.util.spec_from_file_location("ctf_other", args.module)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from cryorefine.core import ctf as module
    rng = np.random.default_rng(0)
    for b in (200, 512, 464, 512):
        params = dict(defocus_u_angstrom=rng.uniform(5e3, 3e4, b), defocus_v_angstrom=rng.uniform(5e3, 3e4, b),
                      defocus_angle_deg=rng.uniform(-180, 180, b), voltage_kv=np.full(b, 300.0),
                      cs_mm=np.full(b, 2.7), amplitude_contrast=np.full(b, 0.1), phase_shift_deg=np.zeros(b),
                      bfactor=np.zeros(b), scale=np.ones(b))
        cp.cuda.Device().synchronize()
        tic = time.perf_counter()
        module.ctf_2d(360, 1.34, **params, xp=cp, dtype=np.float64)
        cp.cuda.Device().synchronize()
        print(f"{args.module or 'the package'}: B={b}: {time.perf_counter() - tic:.3f} s", flush=True)


if __name__ == "__main__":
    main()

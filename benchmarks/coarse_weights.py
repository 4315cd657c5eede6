"""The coarse weights of a global search on the GPU (`estep.cuda.coarse_significant`: weights.cu's two kernels
reading each particle's row of diff2, then the cut on the candidates), timed alone on the shapes of the jobs.

Shapes (particles × classes × orientations × translations): Class3D K=6 at HEALPix order 2 with 21 translations
(580,608 samples a particle) and the auto-refine's order-3 global search with 45 translations (1,658,880). The
diff2 rows are synthetic: a minimum of 1e5 plus exponentially distributed excesses, "sharp" (mean excess 3,000:
nearly every weight underflows, as in a converged classification), "middling" (mean excess 30: about a third of the
samples are candidates) or "broad" (mean excess 3: every weight counts, as in the first iterations). Milliseconds
per call (CUDA events, 3 calls after a warm one) and the samples kept. Runs against whichever `cryorefine` is on
PYTHONPATH, so two trees can be compared on one machine:

    python benchmarks/coarse_weights.py --json results/coarse_weights_h100.json
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np

SHAPES = {"class3d_order2": (512, 6, 4608, 21), "refine_order3": (512, 1, 36864, 45)}
SPREADS = {"sharp": 3000.0, "middling": 30.0, "broad": 3.0}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args(argv)
    import cupy as cp

    from cryorefine.estep.cuda import coarse_significant

    results = []
    for name, (b, k, r, t) in SHAPES.items():
        for spread_name, spread in SPREADS.items():
            rng = cp.random.default_rng(0)
            d2 = (1e5 + rng.exponential(spread, (b, k, r, t))).astype(cp.float32)
            prior_ko = cp.log(rng.uniform(0.5, 1.0, (1, k, r, 1)))
            prior_t = -rng.uniform(0.0, 2.0, (b, 1, 1, t))
            call = functools.partial(coarse_significant, cp, d2, prior_ko, prior_t, 0.999, 0, 0)
            kept = call()[2]
            times = []
            for _ in range(args.repeats):
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                call()
                stop.record()
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop))
            row = {"shape": name, "rows": spread_name, "samples_per_particle": k * r * t, "particles": b,
                   "ms": float(np.median(times)), "kept_per_particle_median": float(np.median(kept))}
            results.append(row)
            print(f"{name:15s} {spread_name:6s} {b} × {k * r * t:,} samples: {row['ms']:8.2f} ms, "
                  f"kept per particle (median) {row['kept_per_particle_median']:.0f}", flush=True)
            del d2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

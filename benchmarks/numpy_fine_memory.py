"""The numpy engine's memory on a flat posterior: the peak of one batch's E-step and sums (tracemalloc, which counts
numpy's arrays), against the fine grid the engine keeps for the unit, and its time. A flat posterior (σ² far above the
images' power) makes nearly every (class, orientation, translation) significant, so every particle's fine table holds
the whole grid: the broadest case a classification's first iterations approach.

    python benchmarks/numpy_fine_memory.py [--box 32] [--classes 3] [--particles 3] [--threads 1]

HEALPix order 1 (576 orientations), offsets 6 px range and 2 px step (29 translations), random blob maps.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
from estep_throughput import blob_volume

from cryorefine.core import euler, fourier
from cryorefine.core.projector import Projector
from cryorefine.core.sampling import Sampling
from cryorefine.estep.engine import Batch, IterationSetup
from cryorefine.estep.reference import NumpyEngine


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--box", type=int, default=32)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--particles", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    box, n = args.box, args.particles
    rng = np.random.default_rng(3)
    projectors = [Projector(blob_volume(rng, box).astype(np.float64)) for _ in range(args.classes)]
    sampling = Sampling(healpix_order=1, offset_range_px=6, offset_step_px=2)
    images = (projectors[0].project(euler.euler_to_matrix(*rng.uniform(0, 180, (3, n))), box)
              + fourier.rfft2_centered(rng.normal(size=(n, box, box))))
    half = box // 2 + 1
    batch = Batch(indices=np.arange(n), images_ft=images, images_ft_unmasked=images, ctf=np.ones((n, box, half)),
                  optics_index=np.zeros(n, np.int64), old_origin_px=np.zeros((n, 2)),
                  residual_origin_px=np.zeros((n, 2)), prior_rot_deg=np.zeros(n), prior_tilt_deg=np.zeros(n),
                  prior_psi_deg=np.zeros(n), old_class=np.zeros(n, np.int64), norm_correction=np.ones(n),
                  power_beyond_current=np.zeros((n, half)))
    setup = IterationSetup(projectors=projectors, sigma2_noise=np.full((1, half), 1e3), sampling=sampling,
                           ori_size_px=box, current_size_px=box, coarse_size_px=box, pixel_size_angstrom=2.0,
                           log_pdf_class=np.log(np.full(args.classes, 1.0 / args.classes)), sigma_offset_px=30.0)
    engine = NumpyEngine(threads=args.threads)
    engine.setup(setup)
    rows = args.classes * sampling.n_orientations * engine.tables.n_fine_orientations
    grid_mb = rows * engine.fine.positions.size * (16 + 16 + 8) / 1e6  # projections, data, weight (float64)
    tracemalloc.start()
    tic = time.perf_counter()
    result = engine.run(batch)
    engine.sums()
    seconds = time.perf_counter() - tic
    peak_mb = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    samples = args.classes * sampling.n_orientations * sampling.n_translations
    print(f"box {box} px, {engine.fine.positions.size} coefficients, {args.classes} classes, {n} particles, "
          f"{args.threads} threads: significant {int(result.n_significant.min())}-{int(result.n_significant.max())}"
          f" of {samples}; fine grid {grid_mb:.0f} MB; peak {peak_mb:.0f} MB; {seconds:.1f} s")


if __name__ == "__main__":
    main()

"""The converged run's files that repeat the final iteration's: written again, or copied.

An auto-refine ends by writing run_data.star and run_half{1,2}_class001_unfil.mrc, whose bytes are those of the
final iteration's run_itNNN_data.star and run_itNNN_half{1,2}_class001.mrc. This times, on this machine's disk, one
map of --box px written by `io.mrc.write_volume` (float32 conversion, header statistics, the write) against a copy of
the written file (`io.atomic.copy_atomically`), and a particle STAR file of each --particles count written by
`io.star.write_star` against a copy, --repeat times each, and checks that the copies hold the same bytes.

    python benchmarks/final_files.py --box 360 --particles 10000 105247 --repeat 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from cryorefine.io import mrc
from cryorefine.io.atomic import copy_atomically
from cryorefine.io.star import write_star


def timed(fn, *args):
    tic = time.perf_counter()
    fn(*args)
    return time.perf_counter() - tic


def particle_blocks(n, rng):
    """A RELION 3.1 particle table of n rows with a refinement's columns."""
    columns = ("AngleRot", "AngleTilt", "AnglePsi", "OriginXAngst", "OriginYAngst", "DefocusU", "DefocusV",
               "DefocusAngle", "LogLikeliContribution", "MaxValueProbDistribution", "NormCorrection")
    table = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@Particles/stack.mrcs" for i in range(n)],
                          **{f"rln{c}": rng.random(n) for c in columns},
                          "rlnOpticsGroup": np.ones(n, int), "rlnRandomSubset": rng.integers(1, 3, n),
                          "rlnNrOfSignificantSamples": rng.integers(1, 9, n)})
    optics = pd.DataFrame({"rlnOpticsGroup": [1], "rlnOpticsGroupName": ["opticsGroup1"],
                           "rlnImagePixelSize": [1.34], "rlnImageSize": [360], "rlnImageDimensionality": [2]})
    return {"optics": optics, "particles": table}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--box", type=int, default=360, help="map size in px")
    parser.add_argument("--particles", type=int, nargs="+", default=[10_000, 105_247])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        work = Path(folder)
        volume = rng.standard_normal((args.box,) * 3)
        for _ in range(args.repeat):
            write = timed(mrc.write_volume, work / "written.mrc", volume, 1.34)
            copy = timed(copy_atomically, work / "written.mrc", work / "copied.mrc")
            same = (work / "written.mrc").read_bytes() == (work / "copied.mrc").read_bytes()
            print(f"{args.box} px map: written {write:.3f} s, copied {copy:.3f} s, same bytes {same}", flush=True)
        for n in args.particles:
            blocks = particle_blocks(n, rng)
            for _ in range(args.repeat):
                write = timed(write_star, blocks, work / "written.star")
                copy = timed(copy_atomically, work / "written.star", work / "copied.star")
                print(f"{n} particles' STAR file: written {write:.3f} s, copied {copy:.3f} s", flush=True)


if __name__ == "__main__":
    main()

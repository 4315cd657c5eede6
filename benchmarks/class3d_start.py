"""The initial references of a Class3D job from one map (`jobs.classify.initial_references`: the map read, low-passed
to --ini_high, one per class), each run in a fresh process as a job's start is: seconds and peak resident memory.
The map is random, of the box and pixel size asked for. Runs against whichever `cryorefine` is on PYTHONPATH, so two
trees can be compared on one machine:

    python benchmarks/class3d_start.py --box 360 --classes 6 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

CHILD = """
import json, resource, sys, time, types
from cryorefine.jobs.classify import initial_references
path, k, box, pixel, ini_high = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
config = types.SimpleNamespace(reference_map=path, n_classes=k, ini_high_angstrom=ini_high)
tic = time.perf_counter()
maps, _ = initial_references(config, box, pixel)
print(json.dumps({"seconds": time.perf_counter() - tic, "arrays": len({id(m) for m in maps}),
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--box", type=int, default=360)
    parser.add_argument("--pixel", type=float, default=1.34)
    parser.add_argument("--classes", type=int, default=6)
    parser.add_argument("--ini_high", type=float, default=60.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    from cryorefine.io import mrc

    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "reference.mrc"
        volume = np.random.default_rng(0).random((args.box,) * 3, dtype=np.float32)
        mrc.write_volume(path, volume, args.pixel)
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.classes), str(args.box),
                                  str(args.pixel), str(args.ini_high)], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout))
            print(f"{args.classes} classes at {args.box} px: {runs[-1]['seconds']:.2f} s, {runs[-1]['arrays']} "
                  f"arrays, peak RSS {runs[-1]['peak_rss_gb']:.2f} GB", flush=True)


if __name__ == "__main__":
    main()

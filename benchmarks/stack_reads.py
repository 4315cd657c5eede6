"""How fast `StackReader` reads a batch of images from a stack in the page cache: what the E-step's read-ahead thread
does for every batch while the GPU works on the one before.

A float32 (or float16) stack of `--n` images of `--box` px is written once under `--work`, then read into one
reused host buffer in batches of `--batch`, two ways: the batches' images consecutive in the stack (a global search's
batches, one run each), and each batch a random set of images read in the stack's order (a local search's batches,
its particles taken along the curve of their directions: many short runs). Each way is timed with the reader's own
threads (`io.mrc.READ_THREADS`) and with one, then again from the whole stack held in memory (`--preread_images`,
`io.mrc.PrereadImages`); GB/s are the images' bytes over the median batch's seconds.

    python benchmarks/stack_reads.py --work /tmp/stack_reads --json results/stack_reads_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mrcfile
import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="folder for the stack (written once, kept)")
    parser.add_argument("--n", type=int, default=2048, help="images in the stack")
    parser.add_argument("--box", type=int, default=360, help="image size, px")
    parser.add_argument("--batch", type=int, default=512, help="images a batch")
    parser.add_argument("--float16", action="store_true", help="a float16 stack (MRC mode 12)")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the stack each way")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    from cryorefine.io import mrc

    dtype = np.float16 if args.float16 else np.float32
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"stack_{args.n}x{args.box}_{np.dtype(dtype).name}.mrcs"
    if not path.exists():
        rng = np.random.default_rng(0)
        with mrcfile.new(path) as handle:  # float16 stays float16 (MRC mode 12)
            handle.set_data(rng.standard_normal((args.n, args.box, args.box)).astype(dtype))
            handle.set_image_stack()
    paths = [str(path)] * args.batch
    buffer = np.empty((args.batch, args.box, args.box), dtype)
    batch_bytes = buffer.nbytes
    rng = np.random.default_rng(1)
    ways = {
        "consecutive": [np.arange(s, s + args.batch) for s in range(0, args.n - args.batch + 1, args.batch)],
        "scattered": [np.sort(rng.choice(args.n, args.batch, replace=False)) for _ in range(args.n // args.batch)],
    }
    results = {"n": args.n, "box_px": args.box, "batch": args.batch, "dtype": np.dtype(dtype).name,
               "read_threads": mrc.READ_THREADS, "cpu_count": os.cpu_count(), "ms_per_batch": {}}
    for threads in (mrc.READ_THREADS, 1):
        for way, batches in ways.items():
            with mrc.StackReader(threads=threads) as reader:
                reader.read(paths, batches[0] + 1, out=buffer, check_finite=False)  # opened, checked, cached
                seconds = []
                for _ in range(args.repeat):
                    for rows in batches:
                        tic = time.perf_counter()
                        reader.read(paths, rows + 1, out=buffer, check_finite=False)
                        seconds.append(time.perf_counter() - tic)
            report(results, f"{way}, {threads} thread{'s' if threads > 1 else ''}", seconds, batch_bytes)
    # --preread_images: the whole stack held in memory (PrereadImages), each batch copied out of it
    for threads in (mrc.READ_THREADS, 1):
        with mrc.PrereadImages([str(path)] * args.n, np.arange(1, args.n + 1), threads=threads) as held:
            for way, batches in ways.items():
                seconds = []
                for _ in range(args.repeat):
                    for rows in batches:
                        tic = time.perf_counter()
                        held.read(paths, rows + 1, out=buffer)
                        seconds.append(time.perf_counter() - tic)
                report(results, f"preread, {way}, {threads} thread{'s' if threads > 1 else ''}", seconds, batch_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def report(results, name, seconds, batch_bytes):
    ms = 1e3 * float(np.median(seconds))
    results["ms_per_batch"][name] = ms
    print(f"{name:32s} {ms:7.1f} ms a batch ({batch_bytes / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()

"""What the benchmark scripts share: `cryorefine` run as a subprocess, options passed on after `--`, and the
GPU kernel benchmarks' half-plane coefficients and launch timing (CuPy passed in, never imported here)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def split_at_double_dash(argv):
    """(the script's own arguments, those after the first `--`, passed on to cryorefine as they are)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def run_cli(*args, log_path=None):
    """`python -m cryorefine ARGS` with this Python, its output in log_path (or discarded), the command shown on
    stderr; its wall seconds. Exits naming the log when the command fails."""
    command = [sys.executable, "-m", "cryorefine", *(str(a) for a in args)]
    print("$ cryorefine " + " ".join(command[3:]), file=sys.stderr, flush=True)
    tic = time.perf_counter()
    with open(log_path or os.devnull, "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"cryorefine {args[0]} failed (exit code {code}); see {log_path or 'its output (not kept)'}")
    return time.perf_counter() - tic


def work_and_engine_parser(description, epilog, job):
    """An ArgumentParser with --work (required) and one of --gpu / --cpu (required) for the `job` runs."""
    parser = argparse.ArgumentParser(description=description, epilog=epilog)
    parser.add_argument("--work", required=True, type=Path, help="Work folder (created if missing).")
    engine = parser.add_mutually_exclusive_group(required=True)
    engine.add_argument("--gpu", action="store_true", help=f"{job} with the GPU engine (device 0).")
    engine.add_argument("--cpu", action="store_true", help=f"{job} with the numpy engine.")
    return parser


def half_plane_coefficients(size_px, cp):
    """(kx, ky) of a half plane's coefficients within radius size/2 (the E-step's disc), float32 on the device."""
    import numpy as np

    r = size_px // 2
    xs, ys = np.meshgrid(np.arange(0, r + 1), np.arange(-r, r + 1), indexing="ij")
    keep = (xs * xs + ys * ys <= r * r) & ~((xs == 0) & (ys < 0))
    return cp.asarray(xs[keep], cp.float32), cp.asarray(ys[keep], cp.float32)


def launch_ms(cp, fn, launch, repeats):
    """Milliseconds per launch of the raw kernel `fn(*launch)`: one warm launch, then the mean of `repeats` timed
    with CUDA events."""
    fn(*launch)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        fn(*launch)
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / repeats

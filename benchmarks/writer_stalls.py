"""How long the E-step's thread waits for the interpreter while the iteration writer formats a STAR table.

An iteration's files are written on a thread beside the next E-step. At HEALPix order 8 a refinement's
files hold tables of 786,432 directions (the sampling's directions, each half's orientation distribution).
While that thread formats them, the E-step's thread, which launches the GPU's work between short waits,
needs the interpreter back every few milliseconds. This script formats such a table (--rows rows of two
float columns) --repeat times on a thread, while the main thread sleeps 1 ms at a time, and reports the
longest time the main thread took to come back, the time lost in returns slower than 20 ms, and the number of
its 1 ms steps (each is one wait of the E-step's thread for the GPU, after which it needs the interpreter back).
--switch_interval sets the interpreter's thread switch interval (Python's default is 5 ms, which a run keeps).
"seconds_lost" adds up what every return took beyond its 1 ms.

    python benchmarks/writer_stalls.py --rows 786432 --repeat 3 [--switch_interval 0.0005]
    python benchmarks/writer_stalls.py --table particles --rows 105247 --repeat 1

--table particles formats a data.star-like particle table instead: 20 float columns, an image and a micrograph
name, a class number (the sampling's direction table is no longer formatted this way: `io.star.fixed_point_rows`).
--table report draws an iteration's report PNG for --rows particles, on the thread or (--in_own_process) as the
loop's writer does, in its drawing process.

    python benchmarks/writer_stalls.py --table report --rows 10000 --repeat 3 [--in_own_process]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from functools import partial

import numpy as np
import pandas as pd

from cryorefine.io.background import BackgroundWriter, InOwnProcess
from cryorefine.io.star import star_to_string


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=786432, help="rows of the table (786,432: HEALPix order 8)")
    parser.add_argument("--repeat", type=int, default=3, help="times the table is formatted")
    parser.add_argument("--table", choices=("directions", "particles", "report"), default="directions",
                        help="two float columns (directions), a data.star-like table (particles), or the "
                             "iteration's report PNG for --rows particles (report)")
    parser.add_argument("--in_own_process", action="store_true",
                        help="--table report: drawn as the loop's writer draws it, in its drawing process "
                             "(io.background.InOwnProcess)")
    parser.add_argument("--switch_interval", type=float, default=None,
                        help="the interpreter's thread switch interval in seconds (default: Python's)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    rng = np.random.default_rng(0)
    if args.table == "report":
        table = None
    elif args.table == "directions":
        table = pd.DataFrame({"rlnAngleRot": rng.random(args.rows) * 360,
                              "rlnAngleTilt": rng.random(args.rows) * 180})
    else:
        i = np.arange(args.rows)
        table = pd.DataFrame({**{f"rlnValue{c}": rng.random(args.rows) * 1000 for c in range(20)},
                              "rlnImageName": [f"{n + 1:06d}@Particles/stack_{n // 1000:04d}.mrcs" for n in i],
                              "rlnMicrographName": [f"Micrographs/mic_{n // 100:05d}.mrc" for n in i],
                              "rlnClassNumber": rng.integers(1, 7, args.rows)})
    done = threading.Event()

    def writer():
        if args.in_own_process:
            with BackgroundWriter() as background:
                for _ in range(args.repeat):
                    background.submit([InOwnProcess(partial(draw_report, args.rows))])
        else:
            for _ in range(args.repeat):
                if args.table == "report":
                    draw_report(args.rows)
                else:
                    star_to_string({args.table: table})
        done.set()

    thread = threading.Thread(target=writer)
    tic = time.perf_counter()
    thread.start()
    waits, last = [], time.perf_counter()
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        waits.append(now - last)
        last = now
    thread.join()
    waits = np.array(waits)
    print(json.dumps({"table": args.table, "rows": args.rows, "repeat": args.repeat,
                      "in_own_process": args.in_own_process,
                      "switch_interval_s": sys.getswitchinterval(),
                      "writer_seconds": round(time.perf_counter() - tic, 3),
                      "main_thread_steps": int(waits.size), "longest_wait_ms": round(1e3 * float(waits.max()), 1),
                      "seconds_in_waits_over_20ms": round(float(waits[waits > 0.02].sum()), 3),
                      "seconds_lost": round(float(np.maximum(waits - 0.001, 0.0).sum()), 3)}))


def draw_report(n_particles):
    """The iteration report of a 360 px run at 5 Å with `n_particles` particles, as the loop's writer draws it."""
    from cryorefine.report import write_iteration_report

    rng = np.random.default_rng(1)
    write_iteration_report("writer_stalls_report.png", iteration=5, fsc=np.linspace(1.0, 0.0, 181), ori_size_px=360,
                           pixel_size_angstrom=1.34, resolution_angstrom=5.0,
                           rot_deg=rng.uniform(-180.0, 180.0, n_particles),
                           tilt_deg=rng.uniform(0.0, 180.0, n_particles),
                           timings_seconds={**{f"E: stage {i}": 1.0 for i in range(14)}, "M-step": 1.0})


if __name__ == "__main__":
    main()

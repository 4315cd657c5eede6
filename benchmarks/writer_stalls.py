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
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np
import pandas as pd

from cryorefine.io.star import star_to_string


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=786432, help="rows of the table (786,432: HEALPix order 8)")
    parser.add_argument("--repeat", type=int, default=3, help="times the table is formatted")
    parser.add_argument("--table", choices=("directions", "particles"), default="directions",
                        help="two float columns (directions), or a data.star-like table (particles)")
    parser.add_argument("--switch_interval", type=float, default=None,
                        help="the interpreter's thread switch interval in seconds (default: Python's)")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    rng = np.random.default_rng(0)
    if args.table == "directions":
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
        for _ in range(args.repeat):
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
                      "switch_interval_s": sys.getswitchinterval(),
                      "writer_seconds": round(time.perf_counter() - tic, 3),
                      "main_thread_steps": int(waits.size), "longest_wait_ms": round(1e3 * float(waits.max()), 1),
                      "seconds_in_waits_over_20ms": round(float(waits[waits > 0.02].sum()), 3),
                      "seconds_lost": round(float(np.maximum(waits - 0.001, 0.0).sum()), 3)}))


if __name__ == "__main__":
    main()

"""Where a cryorefine command's main thread spends its wall time, by function and by line: the command run in this
process while a thread of ours reads the main thread's stack every --period_ms (`sys._current_frames`).

The main thread drives the GPU (it launches the kernels and waits for them), so its time is what a GPU job waits
for beside the kernels themselves. cProfile cannot show it for this program under Python 3.12, which records every
thread's calls (the writer's, the readers') into one profile. A sample is taken when the interpreter lets this
thread run, so the run sets the interpreter's switch interval to the period, and code that holds the interpreter
long is slowed most: read the report as shares of the sampled wall time, not as the command's own seconds.

    python benchmarks/main_thread_profile.py --out profile.txt -- classify --i particles.star --ref ref.mrc \\
        --o out/run --K 6 --iter 25 ... --gpu 0

The report: the sampled wall, then the cryorefine functions on the stack (inclusive), the innermost cryorefine line,
the innermost two (line and caller), and the innermost frame of any module, each with its seconds and samples.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

from bench_common import split_at_double_dash

SECTIONS = 60  # rows of each section of the report


class MainThreadSampler:
    """A daemon thread counting the main thread's stack every `period_seconds` while it runs (`start`, `stop`)."""

    def __init__(self, period_seconds: float):
        self.period_seconds = period_seconds
        self.main_id = threading.main_thread().ident
        self.inclusive: collections.Counter = collections.Counter()  # every cryorefine function on the stack, once
        self.innermost: collections.Counter = collections.Counter()  # the innermost cryorefine line
        self.pairs: collections.Counter = collections.Counter()  # it and the cryorefine line that called it
        self.anywhere: collections.Counter = collections.Counter()  # the innermost frame of any module
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="main-thread sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_seconds):
            frame = sys._current_frames().get(self.main_id)
            if frame is not None:
                self.add(frame)

    def add(self, frame) -> None:
        """Count one sample of the stack whose innermost frame is `frame`."""
        self.samples += 1
        code = frame.f_code
        self.anywhere[f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1
        lines, functions = [], set()
        while frame is not None:
            code = frame.f_code
            if "/cryorefine/" in code.co_filename:
                where = code.co_filename.split("/cryorefine/")[-1]
                lines.append(f"{where}:{frame.f_lineno} {code.co_name}")
                functions.add(f"{where} {code.co_name}")
            frame = frame.f_back
        self.inclusive.update(functions)
        if lines:
            self.innermost[lines[0]] += 1
            self.pairs[" <- ".join(lines[:2])] += 1

    def report(self, wall_seconds: float, rows: int = SECTIONS) -> str:
        """The report's text: each count as seconds of `wall_seconds` (its share of the samples) and samples."""
        per_sample = wall_seconds / max(self.samples, 1)
        out = [f"wall {wall_seconds:.1f} s, {self.samples} samples (one every {per_sample * 1e3:.2f} ms)"]
        for title, counts in (("cryorefine functions on the stack", self.inclusive),
                              ("innermost cryorefine line", self.innermost),
                              ("innermost cryorefine line <- its caller", self.pairs),
                              ("innermost frame, any module", self.anywhere)):
            out += ["", f"== {title}"]
            out += [f"{n * per_sample:9.2f} s {n:8d}  {name}" for name, n in counts.most_common(rows)]
        return "\n".join(out) + "\n"


def main(argv=None):
    own, command = split_at_double_dash(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the report (text)")
    parser.add_argument("--period_ms", type=float, default=0.5, help="milliseconds between samples (default 0.5)")
    args = parser.parse_args(own)
    if not command:
        parser.error("give the cryorefine command after --, e.g. -- classify --i particles.star ...")
    from cryorefine.cli import main as cryorefine_main

    sampler = MainThreadSampler(args.period_ms / 1e3)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(args.period_ms / 1e3)
    sampler.start()
    tic = time.perf_counter()
    try:
        cryorefine_main(command)
    finally:
        wall = time.perf_counter() - tic
        sampler.stop()
        sys.setswitchinterval(switch)
        args.out.write_text(sampler.report(wall))
        print(f"main_thread_profile: {sampler.samples} samples over {wall:.1f} s in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()

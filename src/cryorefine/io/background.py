"""Iteration outputs written on a thread while the next iteration computes.

An iteration's files (data STAR, maps, model/sampling/optimiser STAR, report) take seconds to
write, mostly the maps (K × N³ float32 and their header statistics); the E-step of the next
iteration does not need them. `BackgroundWriter.submit` takes the writes of one iteration as a
list of callables over snapshots (arrays and tables that the loop does not change afterwards) and
runs them in order on one thread. A new submit first waits for the previous one, so at most one
iteration's outputs are in flight, and leaving the `with` block waits for the last. An error in a
write is raised in the loop at the next submit or at the end; every file is written atomically
(temporary name, then rename), so none is left half-written, and the optimiser STAR file, which
`--continue` starts from, comes last in its iteration.

A write wrapped in `InOwnProcess` (the report PNG: matplotlib draws holding the interpreter, for
tens of milliseconds at a time; a data.star, whose text for 100,000 particles takes a second or more to
make) runs in a drawing process of the writer's instead, started at the first such write: on the
writer's thread it would keep the E-step's thread, which needs the interpreter back after each of its
waits for the GPU, waiting for it (and an MPI master's answers to its workers). Where no process can be
started (no /dev/shm), or the drawing process dies, such writes run on the thread, with a warning.

`Together(writes)` runs writes of files of their own side by side on threads (the maps, the STAR files, the report;
numpy and the file system let go of the interpreter as they work) and ends when all have: an iteration's maps,
one after the other, took longer than a 4-GPU iteration of the 105k Class3D.

A `WaitFor(ready)` among the writes holds the ones after it until `ready()` says True (an MPI master's maps
arriving from its workers while the next E-step runs); leaving the `with` block on an error stops the wait.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

log = logging.getLogger("cryorefine")


class InOwnProcess:
    """A write (a picklable callable: a module-level function and its arguments) that the writer runs in its
    drawing process."""

    def __init__(self, call):
        self.call = call


SIDE_BY_SIDE_THREADS = 8  # the threads of `Together` writes


class Together:
    """Writes of files of their own, run side by side (`BackgroundWriter`); the writes after it start once all
    have ended. An error in one is raised once the others have ended."""

    def __init__(self, writes):
        self.writes = list(writes)


class WaitFor:
    """Not a write: the writes after it wait until `ready()` (asked every `poll_seconds`) returns True."""

    def __init__(self, ready, poll_seconds=0.002):
        self.ready = ready
        self.poll_seconds = poll_seconds


class WriterCancelled(RuntimeError):
    """A `WaitFor` given up: the loop left its `with BackgroundWriter()` on an error."""


class BackgroundWriter:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="writer")
        self._pending: Future | None = None
        # the drawing process, started at the first drawing; False where there can be none
        self._drawing: ProcessPoolExecutor | bool | None = None
        self._cancelled = threading.Event()  # set when the `with` is left on an error: a WaitFor stops waiting
        self._side: ThreadPoolExecutor | None = None  # the threads of `Together` writes, started at the first
        # the last finished submit's seconds on the writer thread: {"waiting": in its WaitFor, "writing": the rest}
        self.last_seconds: dict[str, float] = {}

    def submit(self, writes) -> float:
        """Run the callables `writes` in order on the writer thread, after the previous submit's (InOwnProcess
        ones in the drawing process, the thread waiting for each). Returns the seconds it waited for the previous
        submit's writes to end. With no writes (a VDAM iteration between those whose files it writes) nothing waits:
        the previous submit's writes go on while the next iteration runs, and their error, if one has been raised by
        then, is raised here."""
        writes = list(writes)
        if not writes:
            if self._pending is not None and self._pending.done():
                self.wait()
            return 0.0
        tic = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - tic
        self._pending = self._pool.submit(self._run_all, list(writes))
        return waited

    def wait(self):
        """Block until the submitted writes are done; raise the first error one of them raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self.wait()
            else:
                self._cancelled.set()
        finally:
            self._pool.shutdown(wait=True)
            if self._side is not None:
                self._side.shutdown(wait=True)
            if self._drawing:
                self._drawing.shutdown(wait=True)
        return False

    def _run_all(self, writes):
        start = time.perf_counter()
        waiting = 0.0
        for write in writes:
            if isinstance(write, WaitFor):
                tic = time.perf_counter()
                while not write.ready():
                    if self._cancelled.wait(write.poll_seconds):
                        raise WriterCancelled("the run ended on an error before this iteration's files were whole")
                waiting += time.perf_counter() - tic
            elif isinstance(write, Together):
                if self._side is None:
                    self._side = ThreadPoolExecutor(SIDE_BY_SIDE_THREADS, thread_name_prefix="writer side")
                futures = [self._side.submit(self._run_one, w) for w in write.writes]
                wait(futures)
                for future in futures:
                    future.result()  # the first error, once every write has ended
            else:
                self._run_one(write)
        self.last_seconds = {"waiting": waiting, "writing": time.perf_counter() - start - waiting}

    def _run_one(self, write):
        if isinstance(write, InOwnProcess):
            self._run_in_process(write.call)
        else:
            write()

    def _run_in_process(self, call):
        if self._drawing is None:
            try:
                self._drawing = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            except OSError as exc:  # no semaphores (no /dev/shm)
                log.warning("no drawing process (%s); the reports and data.star files are written beside the "
                            "iterations, slowing them", exc)
                self._drawing = False
        if self._drawing:
            try:
                future = self._drawing.submit(call)  # the process starts here, at the first write
            except (OSError, BrokenProcessPool) as exc:  # no process could be started
                self._stop_drawing(f"no drawing process ({exc})")
                return call()
            try:
                return future.result()
            except BrokenProcessPool as exc:
                self._stop_drawing(f"the drawing process ended ({exc})")
        return call()

    def _stop_drawing(self, why):
        log.warning("%s; the reports and data.star files are written beside the iterations, slowing them", why)
        self._drawing.shutdown(wait=False)
        self._drawing = False

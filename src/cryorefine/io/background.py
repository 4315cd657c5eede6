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
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


class BackgroundWriter:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="writer")
        self._pending = None

    def submit(self, writes):
        """Run the callables `writes` in order on the writer thread, after the previous submit's."""
        self.wait()
        self._pending = self._pool.submit(_run_all, list(writes))

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
        finally:
            self._pool.shutdown(wait=True)
        return False


def _run_all(writes):
    for write in writes:
        write()

"""Page-locked host blocks made ahead, on a thread during an MPI worker's set-up, for CuPy's pinned pool.

The M-step leaves every map on the host in page-locked memory (its own maps through `core.arrays.to_host_pinned`,
an MPI worker's received ones through `gpu.collectives.DeviceCollectives.broadcast_host`), so that they move at the
bus's speed. CuPy's pool keeps a block that is let go for the next request of the same size, so from the fourth
iteration on (two M-steps' maps are alive at once) no new block is made; the first three made them, about 0.11 s
for each 187 MB block of a 360 px map on an H200 host, and on two GPUs each worker's collective then waited for its
peer's: "maps shared among the workers" took 0.8-1.0 s in iterations 2 and 3 of the 105k Class3D, 0.03-0.08 s with
the blocks made ahead. Made during the set-up, they lengthened the run's start less than they shortened the first
three M-steps (105k Class3D on two H200s, six iterations: start 7.2 against 6.3 s, M-steps 0.9 against 3.8 s, the
two in different leases); made while an E-step ran, they held up its CUDA calls (docs/benchmark-conclusions.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

#: blocks smaller than this are made when first asked for (a 2D class average or a 128 px map: milliseconds)
MIN_BLOCK_BYTES = 32 << 20


class PinnedAhead:
    """A thread making page-locked blocks of `block_bytes` (one for each entry) on the current device and giving
    them to CuPy's pool, where the first requests of the same sizes find them; `wait` for it before the work it
    should not slow (its page-locking slows the process's other threads). Entries below MIN_BLOCK_BYTES are left
    out. `first`, where given, runs on the thread before the blocks (another part of a set-up that must not run
    beside them: an MPI worker's NCCL communicator), on a stream of its own; `wait` returns what it returned."""

    def __init__(self, block_bytes: Sequence[int], first: Callable[[], Any] | None = None) -> None:
        import cupy

        self.sizes = [int(n) for n in block_bytes if int(n) >= MIN_BLOCK_BYTES]
        self.made_bytes = 0
        self.first_seconds = 0.0  # how long `first` took on the thread
        self._first = first
        self._first_result: Any = None
        self._first_failure: BaseException | None = None
        self._device_id = cupy.cuda.Device().id
        self.failure: BaseException | None = None  # why the thread made fewer blocks than asked, if it did
        self._thread = threading.Thread(target=self._make, name="page-locked blocks", daemon=True)
        self._started = bool(self.sizes) or first is not None
        if self._started:
            self._thread.start()

    def _make(self) -> None:
        import cupy
        import cupyx
        import numpy as np

        with cupy.cuda.Device(self._device_id):  # pinned for the caller's device's context
            if self._first is not None:
                tic = time.perf_counter()
                try:
                    with cupy.cuda.Stream(non_blocking=True):  # not ordered with the caller's work meanwhile
                        self._first_result = self._first()
                except BaseException as exc:  # noqa: BLE001 - raised by `wait`, on the caller's thread
                    self._first_failure = exc
                self.first_seconds = time.perf_counter() - tic
            try:
                blocks = []
                for size in self.sizes:
                    blocks.append(cupyx.empty_pinned(size, dtype=np.uint8))
                    self.made_bytes += size
                del blocks  # back to the pool, kept there for the requests of the same sizes
            except Exception as exc:  # noqa: BLE001 - no room to lock more host memory: the blocks come when asked for
                self.failure = exc

    def wait(self) -> Any:
        """Waits for the thread to end; `first`'s result (None without one), or its exception raised here."""
        if self._started:
            self._thread.join()
        if self._first_failure is not None:
            raise self._first_failure
        return self._first_result

"""The compute backend of one process: numpy on the host, or CuPy on one GPU with its stack arena
(`gpu.allocator`): what makes the engines of this package.

A backend is an object passed to whoever needs it (never a global): the array module batches are
prepared with, a fresh E-step engine per work unit, and the device-memory lifetimes as context
managers: `run_scope()` for the whole run (the GPU arena and its GLOBAL scope), `iteration_scope()`
around one iteration's E- and M-step, `maximization_scope()` around the M-step. On the host the
scopes do nothing. Large arrays move between the host and the device with `to_host`/`to_device`
(sums that wait on the host while the device is needed for other work, `em.memory`);
`free_device_bytes()` says how much room there is (None on the host: nothing waits). Importing this
module imports neither CuPy nor an engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.core.projector import Projector
    from cryorefine.estep.engine import Engine

log = logging.getLogger(__name__)


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def make_backend(config: RefineConfig, device_id: int | None = None, shared_by: int = 1) -> Backend:
    """The backend config.engine names: "numpy" (at config.dtype, on config.threads threads, by default
    an equal share of this machine's cores among the `shared_by` processes on it), or "cuda" on
    `device_id` (default config.gpu_ids[0], else 0) with an arena of the free memory minus
    config.free_gpu_memory_mb (at most an equal share of the card when `shared_by` processes use it)."""
    if config.engine == "cuda":
        if device_id is None:
            device_id = config.gpu_ids[0] if config.gpu_ids else 0
        return CudaBackend(device_id, config.free_gpu_memory_mb, shared_by=shared_by)
    threads = config.threads if config.threads is not None else max(1, available_cores() // max(1, shared_by))
    return NumpyBackend(np.dtype(config.dtype), threads)


def available_cores() -> int:
    """How many CPUs this process may run on."""
    return len(available_cpus())


def available_cpus() -> set[int]:
    """The CPUs this process may run on (all of the machine's where the system does not say)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return set(range(os.cpu_count() or 1))


class NumpyBackend:
    """The numpy engine (`estep.reference`) on the host."""

    name = "numpy"
    array_module = np

    def __init__(self, dtype: npt.DTypeLike = np.float64, threads: int = 1) -> None:
        self.dtype = np.dtype(dtype)
        self.sums_dtype = self.dtype  # the real dtype of the back-projection sums
        self.threads = int(threads)
        self.high_water_bytes = {}
        self.iteration_peak_bytes = []

    def describe(self) -> str:
        return f"numpy ({self.dtype}, {self.threads} thread{'s' if self.threads != 1 else ''})"

    def make_engine(self) -> Engine:
        from cryorefine.estep.reference import NumpyEngine

        return NumpyEngine(self.dtype, self.threads)

    def run_scope(self) -> AbstractContextManager[NumpyBackend]:
        return contextlib.nullcontext(self)

    def iteration_scope(self) -> AbstractContextManager[NumpyBackend]:
        return contextlib.nullcontext(self)

    def maximization_scope(self) -> AbstractContextManager[NumpyBackend]:
        return contextlib.nullcontext(self)

    def estimate_accuracy(self, request, particles):
        """`request` (`em.accuracy.AccuracyRequest`) estimated from `particles` on the host."""
        return request.estimate(particles)

    def free_device_bytes(self) -> None:
        """None: everything is on the host already."""
        return None

    def synchronize(self) -> None:
        """Nothing runs ahead of the host."""

    def on_device(self, array: Array) -> bool:
        return True

    def to_device(self, array: Array) -> Array:
        return array

    def to_host(self, array: Array) -> Array:
        return array

    def release_cached(self) -> None:
        """Nothing is cached on the host."""

    def shared_projectors(self, maps: Sequence[Array], padding_factor: float, r_max_px: int,
                          owners: Sequence[int], me: int, share: Callable[[Array, int], object]) -> list[Projector]:
        """The projectors of `maps` as the numpy engine makes them (`IterationSetup.projectors`), each transform
        computed only where `owners[k]` is `me` and then `share(data, owners[k])`d, class by class in order (every
        worker calls `share` for every class: from the owner to the others, in place)."""
        from cryorefine.core.grid import PaddedGrid
        from cryorefine.core.projector import Projector

        grid = PaddedGrid.create(np.shape(maps[0])[0], padding_factor, r_max_px, ndim=np.ndim(maps[0]))
        out = []
        for k, volume in enumerate(maps):
            data = (Projector(volume, padding_factor, r_max_px).data if owners[k] == me
                    else np.zeros(grid.shape, dtype=np.complex128))
            share(data, owners[k])
            out.append(Projector.from_transform(data, grid))
        return out


class CudaBackend:
    """The CuPy engine (`estep.cuda`) on one device, its memory from one stack arena.

    `run_scope()` creates the arena (free memory minus `free_gpu_memory_mb`), installs it as CuPy's
    allocator and opens the GLOBAL scope; `iteration_scope()` opens an ITERATION scope, so everything
    of an iteration is freed at once; `make_engine()` gives a fresh `CupyEngine` on the arena.
    """

    name = "cuda"
    sums_dtype = np.dtype(np.float32)  # the back-projection sums, as RELION's GPU build keeps them

    def __init__(self, device_id: int = 0, free_gpu_memory_mb: float = 2048.0, use_arena: bool = True,
                 shared_by: int = 1) -> None:
        self.device_id = int(device_id)
        self.free_gpu_memory_mb = float(free_gpu_memory_mb)
        self.shared_by = int(shared_by)
        self.use_arena = use_arena
        self.arena = None
        self.high_water_bytes = {}  # after a run: the arena's high-water mark per scope (bytes)
        self.iteration_peak_bytes = []  # after a run: the arena's peak in use during each iteration (bytes)

    def describe(self) -> str:
        return f"GPU {self.device_id} (CuPy kernels)"

    @property
    def array_module(self) -> ArrayModule:
        """cupy: images are prepared on the device (images.prepare_batch, the initial noise spectra)."""
        import cupy

        return cupy

    def make_engine(self) -> Engine:
        from cryorefine.estep.cuda import CupyEngine

        return CupyEngine(self.device_id, self.arena)

    @contextlib.contextmanager
    def run_scope(self) -> Iterator[CudaBackend]:
        import cupy

        from cryorefine.estep.kernels import first_use_notice, kernel_module, mark_kernels_warm
        from cryorefine.gpu import kept
        from cryorefine.gpu.allocator import DeviceArena, Scope, describe_usage

        with cupy.cuda.Device(self.device_id):
            first_use_notice()
            # the kernels' module (all but the fine pass's instances) compiles on a thread of its own from here, on
            # a version's first run while the particles are read and the noise spectra added up; the first
            # iteration that asks for it waits for that one compilation (none once CuPy's cache holds it)
            threading.Thread(target=kernel_module, args=((), self.device_id), daemon=True,
                             name=f"compile GPU kernels, GPU {self.device_id}").start()
            try:
                if not self.use_arena:
                    yield self
                else:
                    self.arena = DeviceArena(self.device_id, self.free_gpu_memory_mb, shared_by=self.shared_by)
                    try:
                        with self.arena.installed(), self.arena.scope(Scope.GLOBAL):
                            yield self
                        log.info("GPU %d memory: %s", self.device_id, describe_usage(self.arena))
                    finally:
                        self.high_water_bytes = {level.name: int(v)
                                                 for level, v in self.arena.high_water_by_scope().items()}
                        self.high_water_bytes["total"] = int(self.arena.high_water_bytes)
                        self.iteration_peak_bytes = [int(v) for v in self.arena.iteration_peaks]
                        self.arena.close()
                        self.arena = None
            finally:  # the run's kept cuFFT plans and device tables go with it, while the device is still set up
                kept.clear_all()
            mark_kernels_warm()  # the run's iterations have ended: the kernels they used are in the cache

    @contextlib.contextmanager
    def iteration_scope(self) -> Iterator[CudaBackend]:
        from cryorefine.gpu.allocator import Scope

        if self.arena is None:
            yield self
            return
        with self.arena.scope(Scope.ITERATION):
            yield self

    @contextlib.contextmanager
    def maximization_scope(self) -> Iterator[CudaBackend]:
        """The M-step's many large temporaries come from a caching pool inside the iteration's scope."""
        if self.arena is None:
            yield self
            return
        with self.arena.pooled():
            yield self

    def estimate_accuracy(self, request, particles):
        """`request` (`em.accuracy.AccuracyRequest`) estimated from `particles` on the device, between iterations: in
        a scope of its own under the run's (PARTICLE: it counts as no iteration in `iteration_peak_bytes`), its
        temporaries from a caching pool, all freed on return; on the host where the arena lacks the room."""
        import cupy

        from cryorefine.gpu.allocator import ArenaOutOfMemory, Scope

        if self.arena is None:
            return request.estimate(particles, cupy)
        try:
            with self.arena.scope(Scope.PARTICLE), self.arena.pooled():
                return request.estimate(particles, cupy)
        except ArenaOutOfMemory as exc:
            log.info("the accuracy estimate made on the host: %s", exc)
        return request.estimate(particles)

    def free_device_bytes(self) -> int | None:
        """Bytes free for this run on the device now (`gpu.allocator.free_device_bytes`)."""
        from cryorefine.gpu.allocator import free_device_bytes

        return free_device_bytes(self.arena)

    def synchronize(self) -> None:
        """Wait for the work queued on the device (so that a stage's seconds are its own)."""
        self.array_module.cuda.get_current_stream().synchronize()

    def on_device(self, array: Array) -> bool:
        from cryorefine.core.arrays import array_module

        return array_module(array) is not np

    def to_device(self, array: Array) -> Array:
        """`array` on the device (a host array copied there; a device array as it is)."""
        from cryorefine.core.arrays import to_device

        return array if self.on_device(array) else to_device(array, self.array_module)

    def to_host(self, array: Array) -> np.ndarray:
        """A host copy of `array` (pageable: a pinned buffer of gigabytes would cost more to make than it saves)."""
        from cryorefine.core.arrays import to_host

        return to_host(array)

    def release_cached(self) -> None:
        """The M-step's caching pool gives its unused blocks back to the arena, so that memory freed below them
        (sums moved to the host) can be used again."""
        if self.arena is not None:
            self.arena.release_pooled()

    def shared_projectors(self, maps: Sequence[Array], padding_factor: float, r_max_px: int,
                          owners: Sequence[int], me: int, share: Callable[[Array, int], object]) -> list[Projector]:
        """The projectors of `maps` as the CuPy engine makes them, views of one (K, …) complex64 device array that
        the engine takes as its references without a copy (`estep.cuda`): each transform computed only where
        `owners[k]` is `me` (its temporaries in a scope of their own, as the engine's), then `share(data,
        owners[k])`d class by class in order (in place, on the current stream, which this waits for)."""
        import cupy

        from cryorefine.core.projector import Projector
        from cryorefine.estep.cuda import padded_transforms

        with cupy.cuda.Device(self.device_id):
            stack, grid = padded_transforms(cupy, maps, padding_factor, r_max_px, self.arena,
                                            made_here=lambda k: owners[k] == me)
            for k in range(len(maps)):
                share(stack[k], owners[k])
            cupy.cuda.get_current_stream().synchronize()
            return [Projector.from_transform(stack[k], grid, cupy) for k in range(len(maps))]


#: The backend of a process: numpy on the host, or CuPy on one GPU.
Backend: TypeAlias = NumpyBackend | CudaBackend

"""The MPI workers' collectives on their GPUs with NCCL, device to device (NVLink, PCIe or the network), where CuPy
has NCCL and each worker has a GPU of its own; the MPI runner moves the data through the host otherwise.

- `DeviceCollectives.reduce`: a work unit's sums added up onto the worker that makes a map. On four H200s of one
  host the host path (copy to the host, MPI reduction, copy back) took about 1 s a worker an iteration for the six
  class volumes of the 105k Class3D's late iterations: a quarter of its E-step.
- `DeviceCollectives.broadcast`: a device array of one worker on every worker, in place.
- `DeviceCollectives.broadcast_host`: a host buffer of one worker (a map it made) on every worker, through the
  GPUs, which the M-step's sharing of the maps among the workers uses (`runners.objects.ObjectChannel`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from cryorefine.gpu import DeviceArray

#: "0" turns the device path off (the host path then runs everywhere): what the benchmarks compare
DEVICE_REDUCTION_VARIABLE = "CRYOREFINE_DEVICE_REDUCTION"
#: device memory a worker leaves outside its arena for NCCL's buffers, beside --free_gpu_memory (NCCL allocates them
#: as its collectives first run; with the arena holding all but --free_gpu_memory, the first reduction of a 4-GPU
#: Class3D at 360 px failed with NCCL_ERROR_UNHANDLED_CUDA_ERROR)
NCCL_RESERVE_MB = 2048.0


def nccl_usable() -> bool:
    """True when CuPy imports with NCCL and the device path is not turned off (`DEVICE_REDUCTION_VARIABLE`)."""
    if os.environ.get(DEVICE_REDUCTION_VARIABLE, "1") == "0":
        return False
    try:
        from cupy.cuda import nccl
    except Exception:  # no CuPy, or a CuPy without NCCL
        return False
    return bool(getattr(nccl, "available", True))


class DeviceCollectives:
    """An NCCL communicator over the ranks of an MPI communicator (one GPU each, the current device of each): made
    collectively, as the MPI communicator's ranks all make it at once (`DeviceCollectives.maker(comm)()`)."""

    def __init__(self, rank: int, communicator) -> None:
        self.rank = rank  # in the MPI communicator it was made over (`maker`)
        self._comm = communicator  # CuPy's NcclCommunicator

    @staticmethod
    def maker(mpi_comm) -> Callable[[], DeviceCollectives]:
        """Exchanges NCCL's id among the ranks of `mpi_comm` now (a collective of theirs, in MPI) and returns the
        rest of the making, which needs no MPI: a function, to be called once on any thread by every rank, that
        returns this rank's `DeviceCollectives` once all have called it."""
        from cupy.cuda import nccl

        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        unique_id = mpi_comm.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)

        return lambda: DeviceCollectives(rank, nccl.NcclCommunicator(size, unique_id, rank))

    def warm_up(self) -> None:
        """One small and one large reduction and broadcast: NCCL connects the ranks and allocates its buffers on a
        communicator's first collectives of each size class (about half a second on two H200s), here instead of in
        the first iteration's reduction and M-step. Ordered on the current stream, which it waits for."""
        import cupy

        # its arrays from CuPy's own pool, outside NCCL_RESERVE_MB's room beside the arena, never from an arena's
        # scopes: a worker warms up on a thread while its main thread uses the arena
        pool = cupy.get_default_memory_pool()
        with cupy.cuda.using_allocator(pool.malloc):
            for count in (1 << 10, 1 << 24):
                array = cupy.zeros(count, dtype=cupy.float32)
                self.reduce(array, 0)
                self.broadcast(array, 0)
                del array
            cupy.cuda.get_current_stream().synchronize()
        pool.free_all_blocks()

    def broadcast(self, array: DeviceArray, root: int) -> DeviceArray:
        """Rank `root`'s `array` (`takes`) on every rank, in place: the other ranks' arrays of the same shape and
        dtype are overwritten. Ordered on the current stream."""
        import cupy
        from cupy.cuda import nccl

        real = np.dtype(array.dtype).type(0).real.dtype
        count = array.size * (2 if np.iscomplexobj(array) else 1)
        kind = nccl.NCCL_FLOAT32 if real == np.float32 else nccl.NCCL_FLOAT64
        stream = cupy.cuda.get_current_stream()
        self._comm.broadcast(array.data.ptr, array.data.ptr, count, kind, root, stream.ptr)
        return array

    @staticmethod
    def takes(array: object) -> bool:
        """True for the arrays `reduce` adds: contiguous CuPy arrays of float32 or float64 reals or complexes."""
        import cupy

        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous:
            return False
        return array.dtype in (np.float32, np.float64, np.complex64, np.complex128)

    def reduce(self, array: DeviceArray, root: int) -> DeviceArray | None:
        """`array` (`takes`) added over the ranks onto rank `root`, in place there and returned; None on the others
        (their array is sent before this returns). Ordered on the current stream."""
        import cupy
        from cupy.cuda import nccl

        real = np.dtype(array.dtype).type(0).real.dtype
        count = array.size * (2 if np.iscomplexobj(array) else 1)
        kind = nccl.NCCL_FLOAT32 if real == np.float32 else nccl.NCCL_FLOAT64
        stream = cupy.cuda.get_current_stream()
        self._comm.reduce(array.data.ptr, array.data.ptr, count, kind, nccl.NCCL_SUM, root, stream.ptr)
        if self.rank == root:
            return array
        stream.synchronize()
        return None

    def broadcast_host(self, buffer: np.ndarray | None, nbytes: int, root: int) -> np.ndarray:
        """Rank `root`'s host bytes (`buffer`, a flat uint8 numpy array of `nbytes` there; None on the others) on
        every rank: uploaded on the root, broadcast by NCCL, downloaded into page-locked memory on the others (the
        next upload of a map received so runs at the bus's speed). The root's `buffer` is returned as it is."""
        import cupy
        import cupyx
        from cupy.cuda import nccl

        stream = cupy.cuda.get_current_stream()
        on_device = cupy.empty(nbytes, dtype=cupy.uint8)
        if self.rank == root:
            on_device.set(buffer, stream=stream)
        self._comm.broadcast(on_device.data.ptr, on_device.data.ptr, nbytes, nccl.NCCL_UINT8, root, stream.ptr)
        out = buffer
        if self.rank != root:
            out = cupyx.empty_pinned(nbytes, dtype=np.uint8)
            on_device.get(out=out, stream=stream)
        stream.synchronize()
        return out  # type: ignore[return-value]  # the root's buffer is given there

"""Python objects of any size between MPI ranks (plans, models and their maps), the arrays as raw bytes.

`ObjectChannel(comm)` sends, receives and broadcasts objects as pickle protocol 5 does with out-of-band buffers:
the object's pickle without its contiguous arrays goes as one small message, then each array's bytes go as plain
byte messages of at most CHUNK_BYTES, received into fresh buffers that the unpickled arrays then use (no copy on
either side). mpi4py's `util.pkl5` sends the same buffers through derived datatypes: two 360³ float32 maps crossed
at 1.4–1.8 GB/s with it and at 3.2–6.1 GB/s with this, near plain sends of the arrays (3.5–6.6 GB/s), between two
ranks of one host under Open MPI and MPICH (docs/benchmark-conclusions.md, mpi_objects.py).

With `device` (a `gpu.collectives.DeviceCollectives` over the same ranks, one GPU each) `allgather` moves the arrays
through the GPUs instead: each rank's arrays broadcast by NCCL in turn, received into page-locked memory.
`isend_arrays` and `irecv_arrays` move plain arrays without waiting for them (the maps a master receives while its
workers go on with the next E-step).
"""

from __future__ import annotations

import pickle

import numpy as np

CHUNK_BYTES = 1 << 27  # bytes per message of a buffer (128 MB): well inside MPI's int counts
ALLGATHER_TAG = 0x0A11  # the arrays of `allgather` (a tag of their own on the channel's communicator)


class ObjectChannel:
    """`send`, `recv`, `bcast` and `allgather` of Python objects over `comm`, as mpi4py's lower-case methods take
    them."""

    def __init__(self, comm, chunk_bytes=CHUNK_BYTES, device=None):
        self.comm = comm
        self.chunk_bytes = int(chunk_bytes)
        self.device = device  # a gpu.collectives.DeviceCollectives over comm's ranks: allgather through the GPUs

    def send(self, obj, dest, tag):
        header, views = _dumps(obj)
        self.comm.send((header, [v.nbytes for v in views]), dest=dest, tag=tag)
        for view in views:
            for piece in self._pieces(view):
                self.comm.Send(piece, dest=dest, tag=tag)

    def recv(self, source, tag):
        from mpi4py import MPI

        status = MPI.Status()
        header, sizes = self.comm.recv(source=source, tag=tag, status=status)
        source = status.Get_source()  # the buffers come from the header's sender, whatever `source` allowed
        buffers = [np.empty(size, dtype=np.uint8) for size in sizes]
        for buffer in buffers:
            for piece in self._pieces(buffer):
                self.comm.Recv(piece, source=source, tag=tag)
        return pickle.loads(header, buffers=buffers)

    def bcast(self, obj, root):
        is_root = self.comm.Get_rank() == root
        header, views = _dumps(obj) if is_root else (None, None)
        header, sizes = self.comm.bcast((header, [v.nbytes for v in views]) if is_root else None, root=root)
        buffers = views if is_root else [np.empty(size, dtype=np.uint8) for size in sizes]
        for buffer in buffers:
            for piece in self._pieces(buffer):
                self.comm.Bcast(piece, root=root)
        return obj if is_root else pickle.loads(header, buffers=buffers)

    def allgather(self, obj):
        """Every rank's `obj`, in rank order (this rank's as it is): the pickles gathered, then each rank's arrays
        sent to every other rank and received from each at once, so that the ranks' transfers run side by side
        rather than one broadcast after another."""
        from mpi4py import MPI

        comm = self.comm
        header, views = _dumps(obj)
        headers = comm.allgather((header, [v.nbytes for v in views]))
        if self.device is not None:
            return self._allgather_through_devices(obj, views, headers)
        requests, received = self._receives(headers, ALLGATHER_TAG)
        for rank in received:  # each pair's messages arrive in the order they were sent
            requests += [comm.Isend(piece, dest=rank, tag=ALLGATHER_TAG) for view in views
                         for piece in self._pieces(view)]
        MPI.Request.Waitall(requests)
        return self._objects(obj, received)

    def _allgather_through_devices(self, obj, views, headers):
        """`allgather`'s arrays through the GPUs (`device`): every rank's arrays broadcast in rank order."""
        me = self.comm.Get_rank()
        received = {}
        for rank, (other_header, sizes) in enumerate(headers):
            buffers = [self.device.broadcast_host(np.frombuffer(views[i], dtype=np.uint8) if rank == me else None,
                                                  size, rank) for i, size in enumerate(sizes)]
            if rank != me:
                received[rank] = (other_header, buffers)
        return self._objects(obj, received)

    def isend_arrays(self, arrays, dest, tag):
        """Start sending C-contiguous numpy `arrays` to rank `dest` in chunks; the requests (MPI.Request.Waitall
        them before the arrays change or go; an `irecv_arrays` of the same shapes receives them)."""
        return [self.comm.Isend(piece, dest=dest, tag=tag) for array in arrays
                for piece in self._pieces(array.reshape(-1).view(np.uint8))]

    def irecv_arrays(self, like, source, tag):
        """(new arrays shaped and typed as `like`'s (shape, dtype) pairs, their receive requests) of an
        `isend_arrays` of rank `source`; the arrays are whole once the requests are complete."""
        arrays = [np.empty(shape, dtype=dtype) for shape, dtype in like]
        requests = [self.comm.Irecv(piece, source=source, tag=tag) for array in arrays
                    for piece in self._pieces(array.reshape(-1).view(np.uint8))]
        return arrays, requests

    def _receives(self, headers, tag):
        """(receive requests, {rank: (pickle, buffers)}) of every other rank's arrays, posted at once, from the
        gathered (pickle, array sizes) of every rank."""
        me = self.comm.Get_rank()
        requests, received = [], {}
        for rank, (other_header, sizes) in enumerate(headers):
            if rank != me:
                buffers = [np.empty(size, dtype=np.uint8) for size in sizes]
                received[rank] = (other_header, buffers)
                requests += [self.comm.Irecv(piece, source=rank, tag=tag)
                             for buffer in buffers for piece in self._pieces(buffer)]
        return requests, received

    def _objects(self, obj, received):
        """Every rank's object in rank order: this rank's `obj`, the others' unpickled from `_receives`."""
        me = self.comm.Get_rank()
        return [obj if rank == me else pickle.loads(received[rank][0], buffers=received[rank][1])
                for rank in range(self.comm.Get_size())]

    def _pieces(self, buffer):
        """A flat byte buffer (numpy uint8 array or memoryview of bytes) in messages of at most chunk_bytes."""
        flat = np.frombuffer(buffer, dtype=np.uint8) if not isinstance(buffer, np.ndarray) else buffer
        return [flat[start:start + self.chunk_bytes] for start in range(0, flat.size, self.chunk_bytes)]


def _dumps(obj):
    """(pickle of `obj` without its out-of-band buffers, those buffers as flat byte memoryviews)."""
    buffers = []
    header = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return header, [b.raw() for b in buffers]

"""Run under mpiexec -n 3 by tests/runners/test_mpi.py: objects with arrays of several kinds sent, received,
broadcast and gathered by all, and plain arrays sent onto one rank without waiting, by `ObjectChannel` in small
chunks; every rank checks what it got against what it would have sent, and rank 0 prints one line for all: "all
ranks ok", or each rank's differences."""

import sys
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from cryorefine.runners.objects import ObjectChannel


@dataclass
class Model:
    maps: list
    name: str
    count: int


def payload(seed):
    rng = np.random.default_rng(seed)
    big = rng.normal(size=(37, 41, 29)).astype(np.float32)  # 175,973 bytes: several chunks of 4,096
    frozen = rng.normal(size=3000)
    frozen.setflags(write=False)  # as the sampling's cached tables are: sent from a read-only buffer
    return {"model": Model([big, (big[::2] * 1j).astype(np.complex64), np.zeros(0)], "run", 7),
            "strided": big[:, ::3, 1],  # not contiguous: pickled in band
            "fortran": np.asfortranarray(rng.integers(0, 9, (5, 6))),
            "tuple": (1.5, "x", None), "bytes": bytes(range(256)), "frozen": frozen}


def same(a, b):
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, Model):
        return same(a.maps, b.maps) and (a.name, a.count) == (b.name, b.count)
    return a == b


def main():
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    channel = ObjectChannel(comm, chunk_bytes=4096)
    problems = []
    got = channel.bcast(payload(0) if rank == 0 else None, root=0)
    if not same(payload(0), got):
        problems.append("bcast from 0")
    if rank != 0:
        got["model"].maps[0][0, 0, 0] = 1.0  # received arrays are writable
    # 1 -> 0 and 2 -> 0 in turns, with the same tag: each sender's messages arrive in order
    if rank == 0:
        for source in (2, 1, 2):
            if not same(payload(source), channel.recv(source=source, tag=5)):
                problems.append(f"recv from {source}")
        # from any source: the buffers follow their own header's sender
        seen = sorted(channel.recv(source=MPI.ANY_SOURCE, tag=6)["model"].count for _ in range(2))
        if seen != [1, 2]:
            problems.append(f"recv from any source: {seen}")
    else:
        channel.send(payload(rank), dest=0, tag=5)
        if rank == 2:
            channel.send(payload(rank), dest=0, tag=5)
        mine = payload(rank)
        mine["model"].count = rank
        channel.send(mine, dest=0, tag=6)
    workers = comm.Split(MPI.UNDEFINED if rank == 0 else 0, rank)
    if rank != 0:
        got = ObjectChannel(workers, chunk_bytes=1000).bcast(payload(9) if rank == 1 else None, root=0)
        if not same(payload(9), got):
            problems.append("bcast among the workers")
    # every rank's object to every rank, arrays crossing all at once
    everyone = ObjectChannel(comm, chunk_bytes=4096).allgather(payload(20 + rank) if rank != 1 else {})
    if not (len(everyone) == 3 and everyone[1] == {} and all(same(payload(20 + r), everyone[r]) for r in (0, 2))):
        problems.append("allgather")
    # plain arrays onto one rank without waiting (the workers' maps onto the master): several senders, one tag
    channel = ObjectChannel(comm, chunk_bytes=4096)
    sent = [np.ascontiguousarray(payload(30 + rank)["model"].maps[k]) for k in (0, 1)] if rank != 0 else []
    requests = channel.isend_arrays(sent, 0, 7) if rank != 0 else []
    if rank == 0:
        arriving = {r: channel.irecv_arrays([(a.shape, a.dtype) for a in payload(30 + r)["model"].maps[:2]], r, 7)
                    for r in (2, 1)}
        MPI.Request.Waitall([q for _, received in arriving.values() for q in received])
        for r, (arrays, _) in arriving.items():
            if not same(payload(30 + r)["model"].maps[:2], arrays):
                problems.append(f"arrays from {r}")
    MPI.Request.Waitall(requests)
    every = comm.gather(problems, root=0)
    if rank == 0:
        failed = [f"rank {r}: {', '.join(p)}" for r, p in enumerate(every) if p]
        print("all ranks ok" if not failed else "failed: " + "; ".join(failed), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

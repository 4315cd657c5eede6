"""How fast a model's maps cross between two MPI ranks on one host: mpi4py's pkl5 against ObjectChannel.

    mpirun -n 2 python benchmarks/mpi_objects.py [--maps 2] [--box 360]

--maps float32 maps of --box³ (a refinement's two half maps, or a classification's K maps) go from rank 0 to
rank 1 by `send`/`recv` and by `bcast`, through `mpi4py.util.pkl5.Intracomm` (how plans and models crossed
before) and `cryorefine.runners.objects.ObjectChannel` (the same pickle protocol 5, the arrays' bytes as plain
byte messages), and through plain `Send`/`Recv` of the arrays into arrays made for them (the floor). Each is timed
twice between barriers; rank 1 prints the second's GB/s. Then the M-step's exchange between workers: every rank
gives --maps maps and gets every other rank's, by one ObjectChannel broadcast from each rank in turn and by
`ObjectChannel.allgather` (all transfers at once); the GB/s count the bytes each rank receives.
"""

import argparse
import time

import numpy as np


def main():
    from mpi4py import MPI
    from mpi4py.util import pkl5

    from cryorefine.runners.objects import ObjectChannel

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--maps", type=int, default=2)
    parser.add_argument("--box", type=int, default=360)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    maps = [np.ones((args.box,) * 3, np.float32) for _ in range(args.maps)]
    size = sum(m.nbytes for m in maps)

    def plain(op):
        for m in maps:
            out = m if rank == 0 else np.empty_like(m)
            if op == "bcast":
                comm.Bcast(out, root=0)
            elif rank == 0:
                comm.Send(out, dest=1, tag=3)
            else:
                comm.Recv(out, source=0, tag=3)

    def channel_op(channel):
        def run(op):
            if op == "bcast":
                channel.bcast(maps if rank == 0 else None, root=0)
            elif rank == 0:
                channel.send(maps, dest=1, tag=2)
            else:
                channel.recv(source=0, tag=2)
        return run

    ways = (("mpi4py.util.pkl5", channel_op(pkl5.Intracomm(comm))), ("ObjectChannel", channel_op(ObjectChannel(comm))),
            ("plain Send/Bcast of the arrays", plain))
    if rank == 1:
        print(f"{args.maps} float32 maps of {args.box}³ ({size / 1e6:.0f} MB), {MPI.Get_library_version().splitlines()[0]}")
    for name, run in ways:
        for op in ("send", "bcast"):
            for repeat in range(2):
                comm.Barrier()
                tic = time.perf_counter()
                run(op)
                comm.Barrier()
                if rank == 1 and repeat == 1:
                    print(f"{name:32s} {op:5s} {size / (time.perf_counter() - tic) / 1e9:6.2f} GB/s", flush=True)
    channel = ObjectChannel(comm)
    exchanges = (("a broadcast from each rank in turn",
                  lambda: [channel.bcast(maps if r == rank else None, root=r) for r in range(comm.Get_size())]),
                 ("ObjectChannel.allgather", lambda: channel.allgather(maps)))
    received = size * (comm.Get_size() - 1)
    for name, run in exchanges:
        for repeat in range(2):
            comm.Barrier()
            tic = time.perf_counter()
            run()
            comm.Barrier()
            if rank == 1 and repeat == 1:
                print(f"every rank's maps to all, {name:34s} {received / (time.perf_counter() - tic) / 1e9:6.2f} GB/s",
                      flush=True)


if __name__ == "__main__":
    main()

"""The E-step's end under MPI: a work unit's class volumes added up over its workers' GPUs, on the host (copy to
the host, MPI reduction, copy back: the runner's path without NCCL) and on the devices (`gpu.collectives`, NCCL).

Run with one rank per GPU (the workers alone, no master); the volumes are those of a Class3D iteration at
--current_px (the padded grid's half transform: data complex64 and weights float32 per class), random.

    mpirun --allow-run-as-root -n 2 python benchmarks/mpi_reduction.py --current_px 124 --classes 6
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--current_px", type=int, default=124)
    parser.add_argument("--classes", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import cupy
    from mpi4py import MPI

    from cryorefine.core.grid import PaddedGrid
    from cryorefine.estep.engine import flat_reals, from_flat_reals
    from cryorefine.gpu.collectives import DeviceCollectives

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    shape = PaddedGrid.create(360, 2.0, args.current_px // 2).shape
    rng = cupy.random.default_rng(rank)
    volumes = []
    for _ in range(args.classes):
        volumes.append((rng.standard_normal(shape, dtype=cupy.float32) + 1j * rng.standard_normal(shape, dtype=cupy.float32)).astype(cupy.complex64))
        volumes.append(rng.standard_normal(shape, dtype=cupy.float32))
    nbytes = sum(v.nbytes for v in volumes)
    cupy.get_default_memory_pool().free_all_blocks()
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    reducer = DeviceCollectives.maker(comm)()
    reducer.reduce(volumes[0].copy(), 0)  # the first collectives connect NCCL's channels
    reducer.broadcast_host(np.zeros(1 << 20, np.uint8) if rank == 0 else None, 1 << 20, 0)
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    nccl_mb = comm.allreduce((free_before - cupy.cuda.runtime.memGetInfo()[0]) / 2**20, op=MPI.MAX)

    def host(v, root):
        flat = flat_reals(v, np.float32)
        out = np.zeros_like(flat) if rank == root else None
        chunk = 1 << 24
        for start in range(0, flat.size, chunk):
            comm.Reduce(flat[start:start + chunk], out[start:start + chunk] if out is not None else None,
                        op=MPI.SUM, root=root)
        return None if out is None else cupy.asarray(from_flat_reals(out, v.shape, v.dtype))

    def device(v, root):
        return reducer.reduce(v.copy(), root)

    results = {}
    for name, reduce in (("host (MPI)", host), ("devices (NCCL)", device)):
        seconds = []
        for _ in range(args.repeats + 1):
            comm.Barrier()
            cupy.cuda.Device().synchronize()
            tic = time.perf_counter()
            kept = [reduce(v, i % size) for i, v in enumerate(volumes)]
            cupy.cuda.Device().synchronize()
            seconds.append(time.perf_counter() - tic)
            del kept
        results[name] = comm.allreduce(float(np.median(seconds[1:])), op=MPI.MAX)
    check = host(volumes[0], 0), device(volumes[0], 0)
    if rank == 0:
        difference = float(abs(check[0] - check[1]).max() / abs(check[0]).max())
        print(f"{size} GPUs, {args.classes} classes at current size {args.current_px} px (grid {shape}), "
              f"{nbytes / 1e9:.2f} GB a worker; largest difference {difference:.1e}; device memory NCCL took "
              f"outside CuPy's pool: {nccl_mb:.0f} MB (the most of any rank)")
        for name, value in results.items():
            print(f"  {name}: {value:.3f} s")


if __name__ == "__main__":
    main()

"""Peak GPU memory and seconds of the final iteration of an auto-refine, outside the particles: the two
half sets' sums, one reference's padded transform (the E-step's set-up) and the M-step, by box size and
arena size.

For each --box and arena (--arena_gb, one per box; default: the device's free memory less 2 GB): the GPU
engine's sums of half 1 (float32, the whole box's padded grid, --pad 2) are made in the arena's ITERATION
scope as the engine makes them, filled with a smooth random signal; where the run would keep the idle half
on the host (`em.estep.sums_wait_on_host`), they are moved there, as the E-step does when half 1 ends; then
half 2's sums, and one reference map transformed as the engine's set-up does (`core.projector.Projector` on
the device, in a PARTICLE scope); then the job's own M-step of the final iteration
(`jobs.refine.RefineJob.maximize`: FSC, both halves' maps, the halves joined, flattened solvent) inside the
backend's maximization scope. The arena's high water is read after each part. The particles' own memory
(the E-step's batches) is not here: it is planned from what is left (`cryorefine plan`).

    python benchmarks/mstep_memory.py --box 360 512 800 --arena_gb 8 16 78 --json results/mstep_memory_h100.json
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from cryorefine.config import RefineConfig
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import Projector
from cryorefine.em.estep import sums_wait_on_host
from cryorefine.em.schedule import ImageSizes
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState
from cryorefine.estep.backend import CudaBackend
from cryorefine.estep.engine import WeightedSums
from cryorefine.gpu.allocator import ArenaOutOfMemory, Scope
from cryorefine.jobs.refine import RefineJob

GB = 1e9


def _half_sums(grid, arena):
    """One half's sums as the engine allocates them ((K, …) complex64 data and float32 weights), filled."""
    import cupy as cp

    data = cp.zeros((1,) + grid.shape, dtype=cp.complex64)
    weight = cp.zeros((1,) + grid.shape, dtype=cp.float32)
    with arena.scope(Scope.PARTICLE), arena.pooled():  # the filling's temporaries, freed in any order
        for planes in grid.slabs():
            r2 = grid.radius2(cp, planes)
            envelope = cp.exp(-r2 / (0.1 * grid.r_max_padded ** 2))
            noise = cp.random.standard_normal((2,) + r2.shape, dtype=cp.float32)
            data[0, planes] = (envelope * (noise[0] + 1j * noise[1])).astype(cp.complex64)
            weight[0, planes] = cp.where(r2 <= grid.r_max_padded ** 2, 1.0 + envelope, 0.0).astype(cp.float32)
            del r2, envelope, noise
    n_shells = grid.size_px // 2 + 1
    sums = WeightedSums.zeros(None, 1, 1, n_shells, 1, data=[data[0]], weight=[weight[0]])
    sums.sigma2_noise[:] = 1.0
    sums.sumw_group[:] = sums.n_particles = 1000
    return sums


def one_box(box, backend):
    import cupy as cp

    arena = backend.arena
    grid = PaddedGrid.create(box, 2.0, box // 2)
    config = RefineConfig(input_star="", output_root="", reference_map="", flatten_solvent=True)
    job = RefineJob(config)
    job.masks = SolventMasks(flatten=True, sphere_radius_px=0.45 * box, edge_px=5.0)
    model = ModelState(ori_size_px=box, pixel_size_angstrom=1.34, sigma2_noise=np.ones((1, box // 2 + 1)))
    plan = SimpleNamespace(final=True, sizes=ImageSizes(box, box), iteration=30, do_cc=False)
    unit = SimpleNamespace(setup=SimpleNamespace(ori_size_px=box, padding_factor=2.0, current_size_px=box),
                           classes=np.zeros(1, dtype=int))
    out = {"box_px": box, "arena_gb": arena.capacity_bytes / GB, "grid_shape": list(grid.shape),
           "padded_box_px": grid.padded_size_px}
    with backend.iteration_scope():
        arena.reset_peaks()
        before = arena.top
        park = sums_wait_on_host(backend, [unit, unit])
        out["idle_half_on_host"] = park
        sums = [_half_sums(grid, arena)]
        tic = time.perf_counter()
        if park:  # as the E-step leaves half 1 when half 2 starts
            sums[0].move_volumes(backend.to_host)
        out["park_seconds"] = time.perf_counter() - tic
        sums.append(_half_sums(grid, arena))
        cp.cuda.get_current_stream().synchronize()
        out["sums_on_device_gb"] = (arena.top - before) / GB

        # the E-step's set-up: one reference's padded transform, kept in a (K, …) array
        tic = time.perf_counter()
        reference = cp.empty((1,) + grid.shape, dtype=cp.complex64)
        with arena.scope(Scope.PARTICLE), arena.pooled():  # as the engine's set-up (estep.cuda)
            volume = cp.random.standard_normal((box,) * 3, dtype=cp.float32)
            projector = Projector(volume, 2.0, box // 2, dtype=np.float32, xp=cp, out=reference[0])
            del projector, volume
        cp.cuda.get_current_stream().synchronize()
        out["reference_seconds"] = time.perf_counter() - tic
        out["estep_setup_high_water_gb"] = arena.high_water_bytes / GB
        del reference

        arena.reset_peaks()
        tic = time.perf_counter()
        with backend.maximization_scope():
            new = job.maximize(model, sums, plan, backend)
            cp.cuda.get_current_stream().synchronize()
        out["mstep_seconds"] = time.perf_counter() - tic
        out["mstep_high_water_gb"] = arena.high_water_bytes / GB
        out["map_finite"] = bool(np.isfinite(new.joined_map).all() and all(np.isfinite(m[0]).all()
                                                                          for m in new.maps))
        out["fsc_shell_1"] = float(new.fsc_halves[0, 1])
        del sums
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--box", type=int, nargs="+", default=[360, 512, 800])
    parser.add_argument("--arena_gb", type=float, nargs="+", default=None,
                        help="the arena for each box (GB; default: the device's free memory less 2 GB)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    if args.arena_gb is not None and len(args.arena_gb) != len(args.box):
        parser.error("--arena_gb: one size per --box")
    cp.random.seed(0)
    rows = []
    for i, box in enumerate(args.box):
        free_mb = 2048.0
        if args.arena_gb is not None:  # leave free all but that much of what the device has free now
            free_mb = max(0.0, cp.cuda.runtime.memGetInfo()[0] - args.arena_gb[i] * GB) / 2 ** 20
        backend = CudaBackend(0, free_gpu_memory_mb=free_mb)
        try:
            with backend.run_scope():
                row = one_box(box, backend)
        except ArenaOutOfMemory as error:  # recorded: the box does not fit this arena
            row = {"box_px": box, "out_of_memory": str(error)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

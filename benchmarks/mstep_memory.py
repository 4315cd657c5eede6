"""Peak GPU memory and seconds of the final iteration of an auto-refine, outside the particles: the two
half sets' sums, one reference's padded transform (the E-step's set-up) and the M-step, by box size.

For each --box: the GPU engine's sums of both halves (float32, the whole box's padded grid, --pad 2) are
made in the arena's ITERATION scope as the engine makes them, filled with a smooth random signal; then one
reference map is transformed as the engine's set-up does (`core.projector.Projector` on the device, in a
PARTICLE scope); then the M-step of the final iteration runs as `jobs.refine.RefineJob.maximize` runs it
(`em.mstep`: both halves' back-projectors, the FSC between them, each half's noise spectrum and map, then the
halves joined and the joined map), with flattened solvent, inside the backend's maximization scope. The
arena's high water is read after each part. The particles' own memory (the E-step's batches) is not here:
it is planned from what is left (`cryorefine plan`).

    python benchmarks/mstep_memory.py --box 360 512 800 --json results/mstep_memory_h100.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import Projector
from cryorefine.em import mstep
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState
from cryorefine.estep.backend import CudaBackend
from cryorefine.gpu.allocator import ArenaOutOfMemory, Scope

GB = 1e9


class _Config:  # the options the M-step reads
    padding_factor = 2.0
    symmetry = "C1"
    tau2_fudge = 1.0


def one_box(box, backend):
    import cupy as cp

    arena = backend.arena
    grid = PaddedGrid.create(box, 2.0, box // 2)
    model = ModelState(ori_size_px=box, pixel_size_angstrom=1.34)
    masks = SolventMasks(flatten=True, sphere_radius_px=0.45 * box, edge_px=5.0)
    out = {"box_px": box, "grid_shape": list(grid.shape), "padded_box_px": grid.padded_size_px}
    with backend.iteration_scope():
        arena.reset_peaks()
        before = arena.top
        halves = []
        for _ in range(2):  # as the engine allocates them: (K, …) complex64 data and float32 weights
            data = cp.zeros((1,) + grid.shape, dtype=cp.complex64)
            weight = cp.zeros((1,) + grid.shape, dtype=cp.float32)
            with arena.scope(Scope.PARTICLE), arena.pooled():  # the filling's temporaries, freed in any order
                for planes in grid.slabs():
                    r2 = grid.radius2(cp, planes)
                    envelope = cp.exp(-r2 / (0.1 * grid.r_max_padded ** 2))
                    noise = cp.random.standard_normal((2,) + r2.shape, dtype=cp.float32)
                    data[0, planes] = (envelope * (noise[0] + 1j * noise[1])).astype(cp.complex64)
                    weight[0, planes] = cp.where(r2 <= grid.r_max_padded ** 2, 1.0 + envelope, 0.0).astype(
                        cp.float32)
                    del r2, envelope, noise
            halves.append((data, weight))
        cp.cuda.get_current_stream().synchronize()
        out["sums_gb"] = (arena.top - before) / GB

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
            bps = [mstep.backprojector(d[0], w[0], model, _Config, box, cp) for d, w in halves]
            fsc = mstep.half_sets_fsc(bps, cp)
            tau2 = np.full(box // 2 + 1, 1.0)
            maps = [mstep.reconstruct_map(bp, tau2, model, _Config, cp, masks) for bp in bps]
            sigma2 = [bp.noise_sigma2() for bp in bps]
            joined = mstep.reconstruct_map(mstep.joined_backprojector(bps, model, _Config, box, cp), tau2, model,
                                           _Config, cp, masks)
            cp.cuda.get_current_stream().synchronize()
            del bps, sigma2
        out["mstep_seconds"] = time.perf_counter() - tic
        out["mstep_high_water_gb"] = arena.high_water_bytes / GB
        out["map_finite"] = bool(np.isfinite(joined).all() and all(np.isfinite(m).all() for m in maps))
        out["fsc_shell_1"] = float(fsc[1])
        del halves, data, weight
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--box", type=int, nargs="+", default=[360, 512, 800])
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import cupy as cp

    cp.random.seed(0)
    backend = CudaBackend(0, free_gpu_memory_mb=2048)
    rows = []
    with backend.run_scope():
        for box in args.box:
            try:
                row = one_box(box, backend)
            except ArenaOutOfMemory as error:  # recorded: the box does not fit this device
                row = {"box_px": box, "out_of_memory": str(error)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""E-step throughput of the GPU engine (and of the numpy engine on the same inputs) at whole-box image sizes and
RELION's default refinement sampling: particle-iterations per second per stage, the coarse kernel's FLOP/s
against the card's measured FP32 peak and cuBLAS, the arena's high water and the M-step's time, for each --boxes
size (JSON with --json).

For each box size, a blob reference and particles projected from it at random poses, with
CTF-like modulation and white noise at --snr, are pushed through the engines at RELION's
default refinement sampling (HEALPix order 2 = 7.5°, 4,608 orientations; offsets 5 px range,
2 px step = 21 translations; oversampling 1) with the image sizes at the whole box (coarse =
current = box: the most expensive case). Printed and written as JSON:

- particle-iterations per second per E-step stage (coarse, weights, fine, sums, backproject)
  and overall; the numpy engine's on a few particles of the same inputs;
- the coarse kernel alone (`coarse_diff2`, timed with CUDA events on the batch's shapes):
  achieved FP32 FLOP/s against the card's FP32 peak, measured here with an FMA kernel, and
  cuBLAS SGEMM (cupy.matmul) on the same shapes for comparison;
- the arena's high-water mark per scope (peak GPU memory of the engine);
- the M-step (reconstruction of a half map on the GPU) time.

    python benchmarks/estep_throughput.py --boxes 128 256 360 --particles 256 --json benchmarks/results/estep.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from cryorefine.core import euler, fourier
from cryorefine.core.sampling import Sampling
from cryorefine.estep.engine import Batch, IterationSetup

FMA_PEAK_SOURCE = r"""
extern "C" __global__ void fma_peak(float* out, int iterations, float a, float b)
{
    float x0 = threadIdx.x, x1 = x0 + 1, x2 = x0 + 2, x3 = x0 + 3, x4 = x0 + 4, x5 = x0 + 5, x6 = x0 + 6, x7 = x0 + 7;
    for (int i = 0; i < iterations; ++i) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            x0 = fmaf(x0, a, b); x1 = fmaf(x1, a, b); x2 = fmaf(x2, a, b); x3 = fmaf(x3, a, b);
            x4 = fmaf(x4, a, b); x5 = fmaf(x5, a, b); x6 = fmaf(x6, a, b); x7 = fmaf(x7, a, b);
        }
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7;
}
"""


def blob_volume(rng, n, blobs=40):
    """A smooth random density filling about half the box (many Gaussian blobs)."""
    g = np.arange(n) - n // 2
    vol = np.zeros((n, n, n), np.float32)
    for _ in range(blobs):
        c = rng.uniform(-n / 5, n / 5, 3)
        s = rng.uniform(n / 40, n / 16)
        ex = np.exp(-((g - c[0]) ** 2) / (2 * s * s)).astype(np.float32)
        ey = np.exp(-((g - c[1]) ** 2) / (2 * s * s)).astype(np.float32)
        ez = np.exp(-((g - c[2]) ** 2) / (2 * s * s)).astype(np.float32)
        vol += ez[:, None, None] * ey[None, :, None] * ex[None, None, :]
    return vol


def make_inputs(n, n_particles, snr, seed, xp=np, volume=None):
    """Reference (`volume`, else a blob density), particles (projections × CTF-like rings + white noise at
    `snr`), σ² from their power."""
    rng = np.random.default_rng(seed)
    volume = blob_volume(rng, n) if volume is None else np.asarray(volume, dtype=np.float32)
    sampling = Sampling(healpix_order=2, offset_range_px=5, offset_step_px=2)
    from cryorefine.core.projector import Projector

    projector = Projector(xp.asarray(volume), dtype=np.float32, xp=xp)
    rot, tilt, psi = (rng.uniform(-180, 180, n_particles), rng.uniform(0, 180, n_particles),
                      rng.uniform(-180, 180, n_particles))
    clean = projector.project(xp.asarray(euler.euler_to_matrix(rot, tilt, psi), dtype=xp.float32))
    del projector
    k2 = (fourier.radius_2d(n)[:, : n // 2 + 1] / n) ** 2
    ctf = np.sin(rng.uniform(20, 60, (n_particles, 1, 1)) * k2[None] + 0.1).astype(np.float32)
    signal = fourier.irfft2_centered(clean * xp.asarray(ctf), n, xp)
    del clean
    noise_sd = float(xp.sqrt(xp.var(signal) / snr))
    noisy = signal + xp.asarray(rng.normal(scale=noise_sd, size=signal.shape).astype(np.float32))
    images = fourier.rfft2_centered(noisy, xp).astype(xp.complex64)
    images = images.get() if xp is not np else images
    shells = fourier.shell_index_2d(n)
    power = np.mean(np.abs(images) ** 2, axis=0)
    sums = np.bincount(shells.reshape(-1), weights=power.reshape(-1), minlength=n // 2 + 1)[: n // 2 + 1]
    counts = np.bincount(shells.reshape(-1), minlength=n // 2 + 1)[: n // 2 + 1]
    sigma2 = (sums / np.maximum(counts, 1) / 2.0)[None, :]
    old = rng.uniform(-2, 2, (n_particles, 2))
    batch = Batch(indices=np.arange(n_particles), images_ft=images, images_ft_unmasked=images, ctf=ctf,
                  optics_index=np.zeros(n_particles, np.int64), old_origin_px=old,
                  residual_origin_px=old - np.round(old), prior_rot_deg=rot, prior_tilt_deg=tilt, prior_psi_deg=psi,
                  old_class=np.zeros(n_particles, np.int64), norm_correction=np.ones(n_particles),
                  power_beyond_current=np.zeros((n_particles, n // 2 + 1)))
    setup = IterationSetup(projectors=None, maps=[volume], sigma2_noise=sigma2, sampling=sampling, ori_size_px=n,
                           current_size_px=n, coarse_size_px=n, pixel_size_angstrom=1.34, log_pdf_class=np.zeros(1),
                           sigma_offset_px=3.0)
    return setup, batch


def sub_batch(batch, rows):
    fields = {name: getattr(batch, name) for name in batch.__dataclass_fields__}
    return Batch(**{name: (value[rows] if isinstance(value, np.ndarray) else value) for name, value in fields.items()})


def measure_fp32_peak(cp):
    kernel = cp.RawKernel(FMA_PEAK_SOURCE, "fma_peak")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    blocks, threads, iterations = sms * 16, 256, 4096
    out = cp.empty(blocks * threads, cp.float32)
    args = (out, np.int32(iterations), np.float32(0.999), np.float32(1e-3))
    kernel((blocks,), (threads,), args)
    times = []
    for _ in range(5):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        kernel((blocks,), (threads,), args)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    flops = 2.0 * 8 * 16 * iterations * blocks * threads
    return flops / float(np.median(times))


def time_coarse_kernel(cp, n_particles, n_translations, n_orientations, n_coef, repeats=5):
    """The coarse_diff2 kernel alone on the shapes of one batch; also cuBLAS SGEMM (cupy.matmul) on them."""
    from cryorefine.estep.kernels import GEMM_BK, GEMM_BM, GEMM_BN, GEMM_THREADS, kernel_module, round_up

    rng = cp.random.default_rng(0)
    m = n_particles * n_translations
    lda, ldb, kd = round_up(m, GEMM_BM), round_up(n_orientations, GEMM_BN), round_up(2 * n_coef, GEMM_BK)
    a = rng.standard_normal((kd, lda), dtype=cp.float32)
    b = rng.standard_normal((kd, ldb), dtype=cp.float32)
    a[2 * n_coef:] = 0  # the padding rows are zero in the engine too
    b[2 * n_coef:] = 0
    row = rng.standard_normal(n_particles, dtype=cp.float32)
    pair = rng.standard_normal((n_particles, n_orientations), dtype=cp.float32)
    out = cp.empty((n_particles, n_orientations * n_translations), cp.float32)
    fn = kernel_module().get_function("coarse_diff2")
    args = (a, b, np.int32(lda), np.int32(ldb), np.int32(kd), np.int32(m), np.int32(n_orientations),
            np.int32(n_translations), row, pair, np.int32(0), np.int32(n_orientations), np.int32(0), out)

    def launch():
        fn((ldb // GEMM_BN, lda // GEMM_BM), (GEMM_THREADS,), args)

    def timed(f):
        f()
        times = []
        for _ in range(repeats):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            f()
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(times))

    flops = 2.0 * m * n_orientations * 2 * n_coef
    t_kernel = timed(launch)
    # correctness spot check of a few outputs against float64
    got = cp.asnumpy(out).reshape(n_particles, n_orientations, n_translations)
    ah, bh = cp.asnumpy(a[: 2 * n_coef, :m]).astype(np.float64), cp.asnumpy(b[: 2 * n_coef, :n_orientations])
    idx = np.random.default_rng(1).integers(0, [n_particles, n_orientations, n_translations], (16, 3))
    rowh, pairh = cp.asnumpy(row), cp.asnumpy(pair)
    errs = []
    for bi, ni, ti in idx:
        terms = ah[:, bi * n_translations + ti] * bh[:, ni].astype(np.float64)
        want = rowh[bi] + pairh[bi, ni] - terms.sum()
        # error relative to the magnitude of what was summed (random signs make the sum itself ≈ 0)
        errs.append(abs(got[bi, ni, ti] - want) / (abs(rowh[bi]) + abs(pairh[bi, ni]) + np.abs(terms).sum()))
    at, bt = a[: 2 * n_coef, :m].T.copy(), b[: 2 * n_coef, :n_orientations].copy()
    t_blas = timed(lambda: cp.matmul(at, bt))
    return {"m": m, "n": n_orientations, "k": 2 * n_coef, "seconds": t_kernel, "tflops": flops / t_kernel / 1e12,
            "cublas_seconds": t_blas, "cublas_tflops": flops / t_blas / 1e12, "max_error_vs_float64_relative_to_sum_of_magnitudes": max(errs)}


def warm_up(arena, setup, batch, n_particles):
    """The GPU engine on the batch's first `n_particles` (compilation, first launches), not timed; then the
    arena's peaks are reset."""
    from cryorefine.estep.cuda import CupyEngine
    from cryorefine.gpu.allocator import Scope

    with arena.scope(Scope.ITERATION):
        engine = CupyEngine(arena=arena)
        engine.setup(setup)
        engine.run(sub_batch(batch, np.arange(min(n_particles, batch.indices.size))))
        engine.sums()
        del engine
    arena.reset_peaks()


def timed_setup(cp, arena, setup):
    """A GPU engine on the arena, set up for `setup`, and the seconds of its set-up."""
    from cryorefine.estep.cuda import CupyEngine

    tic = time.perf_counter()
    engine = CupyEngine(arena=arena)
    engine.setup(setup)
    cp.cuda.get_current_stream().synchronize()
    return engine, time.perf_counter() - tic


def run_gpu(cp, setup, batch, batch_size, free_gpu_memory_mb):
    from cryorefine.gpu.allocator import DeviceArena, Scope

    arena = DeviceArena(free_gpu_memory_mb=free_gpu_memory_mb)
    try:
        with arena.installed(), arena.scope(Scope.GLOBAL):
            warm_up(arena, setup, batch, 4)
            with arena.scope(Scope.ITERATION):
                engine, setup_seconds = timed_setup(cp, arena, setup)
                tic = time.perf_counter()
                n = batch.indices.size
                for start in range(0, n, batch_size):
                    engine.run(sub_batch(batch, np.arange(start, min(n, start + batch_size))))
                sums = engine.sums()
                cp.cuda.get_current_stream().synchronize()
                total = time.perf_counter() - tic
                stages = dict(engine.stage_seconds)
                plan = engine.plan.describe()
                # the M-step of one half: reconstruction on the GPU
                from cryorefine.core.projector import BackProjector

                bp = BackProjector.from_arrays(sums.data[0], sums.weight[0], setup.ori_size_px, 2.0,
                                               setup.current_size_px // 2, xp=cp)
                with arena.pooled():
                    bp.reconstruct()  # first call: CuPy compiles its elementwise kernels
                    cp.cuda.get_current_stream().synchronize()
                    tic = time.perf_counter()
                    vol = bp.reconstruct()
                    cp.cuda.get_current_stream().synchronize()
                    mstep = time.perf_counter() - tic
                del vol, bp, sums, engine
            peaks = {level.name: int(v) for level, v in arena.high_water_by_scope().items()}
            high_water = int(arena.high_water_bytes)
    finally:
        arena.close()
    return {"particles": int(batch.indices.size), "seconds": total, "setup_seconds": setup_seconds,
            "stage_seconds": stages, "mstep_reconstruct_seconds": mstep, "plan": plan,
            "arena_high_water_bytes": high_water, "arena_peaks_by_scope_bytes": peaks}


def run_numpy(setup, batch, n_particles):
    from cryorefine.estep.reference import NumpyEngine

    engine = NumpyEngine(np.float32)
    engine.setup(setup)
    tic = time.perf_counter()
    engine.run(sub_batch(batch, np.arange(n_particles)))
    engine.sums()
    return {"particles": n_particles, "seconds": time.perf_counter() - tic, "stage_seconds": dict(engine.stage_seconds)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--boxes", type=int, nargs="+", default=[128, 256, 360])
    parser.add_argument("--particles", type=int, default=256, help="particles per box on the GPU")
    parser.add_argument("--batch", type=int, default=128, help="particles per engine.run call")
    parser.add_argument("--numpy_particles", type=int, default=2, help="particles for the numpy engine (0: skip)")
    parser.add_argument("--numpy_boxes", type=int, nargs="*", default=[128], help="boxes the numpy engine runs on")
    parser.add_argument("--snr", type=float, default=0.05)
    parser.add_argument("--free_gpu_memory", type=float, default=2048.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import cupy as cp

    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    peak = measure_fp32_peak(cp)
    print(f"device: {device}; measured FP32 FMA peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    results = {"device": device, "fp32_peak_tflops": peak / 1e12, "boxes": {}}
    for n in args.boxes:
        tic = time.perf_counter()
        setup, batch = make_inputs(n, args.particles, args.snr, seed=n, xp=cp)
        print(f"box {n}: inputs in {time.perf_counter() - tic:.1f} s", flush=True)
        gpu = run_gpu(cp, setup, batch, args.batch, args.free_gpu_memory)
        from cryorefine.estep.common import Coefficients

        kc = Coefficients.create(n).positions.size
        kernel = time_coarse_kernel(cp, min(args.batch, args.particles), setup.sampling.n_translations,
                                    setup.sampling.n_orientations, kc)
        entry = {"gpu": gpu, "coarse_kernel": kernel, "n_coefficients": kc,
                 "n_orientations": setup.sampling.n_orientations, "n_translations": setup.sampling.n_translations}
        if args.numpy_particles and n in args.numpy_boxes:
            entry["numpy"] = run_numpy(setup, batch, args.numpy_particles)
        results["boxes"][str(n)] = entry
        print(json.dumps(entry, indent=1), flush=True)
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def print_table(results):
    peak = results["fp32_peak_tflops"]
    print(f"\n{results['device']}, FP32 peak (measured) {peak:.1f} TFLOP/s\n")
    print("| box | particle-it/s (GPU) | coarse | weights | fine | sums | backproject | coarse kernel TFLOP/s (% peak) "
          "| cuBLAS TFLOP/s | peak arena GB | M-step s | numpy particle-it/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, e in results["boxes"].items():
        g = e["gpu"]
        p = g["particles"]
        st = g["stage_seconds"]
        rate = {k: (p / v if v > 0 else float("inf")) for k, v in st.items()}
        k = e["coarse_kernel"]
        cpu = e.get("numpy")
        cpu_rate = f"{cpu['particles'] / cpu['seconds']:.3f}" if cpu else "-"
        print(f"| {n} | {p / g['seconds']:.1f} | {rate['coarse']:.1f} | {rate['weights']:.1f} | {rate['fine']:.1f} | "
              f"{rate['sums']:.1f} | {rate['backproject']:.1f} | {k['tflops']:.1f} ({100 * k['tflops'] / peak:.0f} %) | "
              f"{k['cublas_tflops']:.1f} | {g['arena_high_water_bytes'] / 1e9:.2f} | "
              f"{g['mstep_reconstruct_seconds']:.2f} | {cpu_rate} |")


if __name__ == "__main__":
    sys.exit(main())

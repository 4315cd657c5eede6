"""`cryorefine plan`: what a refinement or a classification will need on the GPU, predicted without running it.

For three moments of a refinement — the first iteration (image size from --ini_high, global search at
--healpix_order), a late iteration (local searches at --auto_local_healpix_order, the image size
at --resolution, by default three quarters of Nyquist) and the final iteration (the whole box, halves
joined) — or two of a classification (--K: the first iteration, and a late one at --resolution with
global searches at --healpix_order; K classes in one work unit, no halves, no final iteration) — the plan
gives the image sizes, the sampling, the GPU engine's batch and chunk sizes (`estep.cuda_plan.plan_batches`
on the arena the run would have), the peak device memory per scope (ITERATION: back-projection
sums, references, the images' upload buffers, cached coarse slices; PARTICLE: the prepared batch and
one sub-batch; ORIENTATION: one chunk; the M-step's reconstruction and, with --sym, its
symmetrisation of the sums; where both halves' sums do not fit, the idle half waits on the host and
one half is counted, `em.memory`), and an estimated E-step
time per iteration: for a global search from the coarse pass's arithmetic at the throughput measured on
an H100 (about 65 % of the FP32 peak for the coarse kernel, the coarse pass about a third of the E-step;
benchmarks/estep_throughput.py) or a floor per particle, plus a fixed cost, for a local search from its
particles, trilinear interpolations and image sizes; both fitted to whole jobs of the 360 px stand-in on an
H100 (`benchmarks/plan_estep_fit.py`). With --sym the orientations are those of the group's asymmetric unit
(`core.sampling.Sampling`), so the E-step shrinks with the group's order.

A run that cannot fit is refused with the option that would make it fit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cryorefine.core.grid import PaddedGrid, padded_size_px
from cryorefine.core.sampling import Sampling
from cryorefine.em import memory, schedule
from cryorefine.errors import InputError
from cryorefine.estep.cuda_plan import (
    FINE_SAMPLE_BYTES,
    SLICE_ROW_BYTES_PER_COEF,
    local_per_particle_bytes,
    per_particle_bytes,
    plan_batches,
)
from cryorefine.gpu.staging import UploadSlots

if TYPE_CHECKING:  # for annotations only (the particle set's module is imported when a plan reads the particles)
    from cryorefine.config import RefineConfig
    from cryorefine.data import ParticleSet

GB = 1e9
COARSE_KERNEL_FRACTION_OF_PEAK = 0.65  # measured: 44 of 65 TFLOP/s on the H100 (benchmarks/)
COARSE_SHARE_OF_ESTEP = 0.35  # coarse pass / whole E-step on the GPU at 256–360 px (benchmarks/estep_throughput.py)
# a local search's E-step (the local coarse kernel projects its slices itself, so its cost follows the trilinear
# interpolations, classes × orientations × coarse coefficients, not the translations): a fixed cost per iteration
# (from the set-up stages and the 2,000-particle, 64 px local iterations of benchmarks/refine_accuracy.py, 0.4–0.9
# s in all), one per particle (its image read and prepared at the whole box), one per interpolation and one per
# coefficient at the current size (the fine pass, the sums, the back-projection); the last two scale with the FP32
# peak against REFERENCE_TFLOPS. The last three are fitted by `benchmarks/plan_estep_fit.py` (its docstring names
# the runs) to the local iterations (orders 4–8 and the final one) of two converged auto-refines of the 360 px
# stand-in on the H100 SXM, 10,000 and 20,000 particles in the GPU's default batches of 1,024: estimate / measured
# 0.80–1.16 (the constants before, fitted to runs of 512-particle batches, gave 1.06–1.56 on them). The fit puts the
# per-particle cost at 0: at these sizes the per-coefficient term carries it.
LOCAL_ESTEP_FIXED_SECONDS = 0.3
LOCAL_ESTEP_SECONDS_PER_PARTICLE = 0.0
LOCAL_ESTEP_SECONDS_PER_INTERPOLATION = 1.77e-11
LOCAL_ESTEP_SECONDS_PER_FINE_COEFFICIENT = 4.24e-9
REFERENCE_TFLOPS = 66.9  # what GpuSpec.detect reports on the H100 SXM of the fit (132 SMs × 128 lanes × 2 × 1.98 GHz)
# a global search's E-step: a fixed cost per iteration, plus per particle the coarse pass's arithmetic / its share,
# or a floor however small the images. The fixed cost and the floor are fitted by `benchmarks/plan_estep_fit.py`
# to iterations 6–25 of the Class3D K=6 job at 360 px (coarse size 26 px, where the floor holds) on 10,000 and
# 105,247 particles on the H100 with batches of 512, the GPU's default
# (results/{class3d_10k_h100_weights_fused,empiar10028_class3d_105k_h100_fused_weights}.json): estimate / measured
# 0.78–1.11 (the floor alone was 1.7e-4 s a particle: 0.66–0.93 on 10,000 particles, 1.16–1.52 on 105,247)
GLOBAL_ESTEP_FIXED_SECONDS = 0.88
MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE = 1.14e-4
SYMMETRISE_SLAB_BYTES = 400e6  # symmetry.symmetrise_padded_sums: ~2^20 elements per slab × ~400 B of temporaries


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: float
    fp32_tflops: float

    @classmethod
    def detect(cls, device_id: int = 0, memory_gb: float | None = None, tflops: float | None = None) -> GpuSpec:
        """The device's name, free memory and FP32 peak (SMs × 128 lanes × 2 × clock) when CuPy sees it;
        else an H100 SXM 80 GB (REFERENCE_TFLOPS, the same reckoning) unless --gpu_memory/--gpu_tflops say
        otherwise."""
        name, memory, peak = "NVIDIA H100 80GB (assumed: no GPU visible)", 80 * GB, REFERENCE_TFLOPS
        try:
            import cupy

            with cupy.cuda.Device(device_id):
                props = cupy.cuda.runtime.getDeviceProperties(device_id)
                free, _ = cupy.cuda.runtime.memGetInfo()
                clock_ghz = props["clockRate"] / 1e6
                name = props["name"].decode()
                memory = float(free)
                peak = props["multiProcessorCount"] * 128 * 2 * clock_ghz / 1e3
        except Exception:  # no CuPy or no device: the assumed card
            pass
        if memory_gb:
            name = f"{name} planned with {memory_gb:g} GB"
        return cls(name, memory_gb * GB if memory_gb else memory, tflops or peak)


@dataclass(frozen=True)
class Moment:
    label: str
    current_size_px: int
    coarse_size_px: int
    n_orientations: int
    n_translations: int
    particles_per_batch: int
    cache_coarse_slices: bool
    iteration_bytes: float  # ITERATION scope at the E-step's peak (sums on the device, references, uploads, slices)
    particle_bytes: float  # one sub-batch
    orientation_bytes: float  # one chunk
    maximization_bytes: float  # the M-step's peak
    estep_seconds: float
    half_waits_on_host: bool = False  # the idle half's sums wait on the host (em.memory)
    kept_images_bytes: float = 0.0  # the run's scope: the particle images kept on the device (data.KeptImages)

    @property
    def peak_bytes(self) -> float:
        return self.kept_images_bytes + max(self.iteration_bytes + self.particle_bytes + self.orientation_bytes,
                                            self.maximization_bytes)


def coefficients(size_px: int) -> int:
    """The Fourier coefficients an E-step compares at an image size of `size_px`."""
    from cryorefine.estep.common import Coefficients

    return Coefficients.create(size_px).positions.size


def local_estep_terms(n_particles: int, n_classes: int, n_orientations: int, coarse_coefficients: int,
                      current_coefficients: int, fp32_tflops: float) -> tuple[float, float, float, float]:
    """What a local search's E-step time is made of, one figure per LOCAL_ESTEP_ constant: (1,
    particles, interpolations, coefficients at the current size), the last two scaled from `fp32_tflops` to
    REFERENCE_TFLOPS."""
    scale = REFERENCE_TFLOPS / fp32_tflops
    return (1.0, float(n_particles), n_particles * n_classes * n_orientations * coarse_coefficients * scale,
            n_particles * current_coefficients * scale)


def local_estep_seconds(n_particles: int, n_classes: int, n_orientations: int, coarse_coefficients: int,
                        current_coefficients: int, fp32_tflops: float) -> float:
    """The estimated E-step seconds of one local-search iteration (the fit above)."""
    constants = (LOCAL_ESTEP_FIXED_SECONDS, LOCAL_ESTEP_SECONDS_PER_PARTICLE, LOCAL_ESTEP_SECONDS_PER_INTERPOLATION,
                 LOCAL_ESTEP_SECONDS_PER_FINE_COEFFICIENT)
    terms = local_estep_terms(n_particles, n_classes, n_orientations, coarse_coefficients, current_coefficients,
                              fp32_tflops)
    return float(sum(c * t for c, t in zip(constants, terms)))


def global_coarse_seconds_per_particle(n_classes: int, n_orientations: int, n_translations: int,
                                       coarse_coefficients: int, fp32_tflops: float) -> float:
    """A global search's E-step per particle from its coarse pass's arithmetic (the pass its share of the E-step)."""
    coarse_flops = 2.0 * n_classes * n_orientations * n_translations * 2 * coarse_coefficients
    return coarse_flops / (COARSE_KERNEL_FRACTION_OF_PEAK * fp32_tflops * 1e12) / COARSE_SHARE_OF_ESTEP


def global_estep_seconds(n_particles: int, n_classes: int, n_orientations: int, n_translations: int,
                         coarse_coefficients: int, fp32_tflops: float) -> float:
    """The estimated E-step seconds of one global-search iteration: the fixed cost, and per particle the coarse
    pass's share or the floor, whichever is larger."""
    per_particle = max(global_coarse_seconds_per_particle(n_classes, n_orientations, n_translations,
                                                          coarse_coefficients, fp32_tflops),
                       MIN_GLOBAL_ESTEP_SECONDS_PER_PARTICLE)
    return GLOBAL_ESTEP_FIXED_SECONDS + n_particles * per_particle


def local_neighbourhood_orientations(sampling: Sampling, oversampling: int) -> int:
    """The orientations within 3σ of one pose at the sampling's order, σ as RELION sets it for local searches."""
    sigma = schedule.local_search_sigma_deg(sampling.healpix_order, oversampling)
    return int(sampling.local_orientations(np.zeros(1), np.full(1, 90.0), np.zeros(1), sigma, sigma).counts()[0])


def image_itemsize(particles: ParticleSet) -> int:
    """Bytes per pixel of the images as a GPU run uploads them (`StackReader.wire_dtype`): 2 where every stack
    holds float16, else 4, also where the stacks cannot be opened here (the larger figure)."""
    from cryorefine.io.mrc import StackReader

    try:
        with StackReader() as reader:
            return reader.wire_dtype(particles.stacks).itemsize
    except InputError:
        return 4


@dataclass(frozen=True)
class PlannedRun:
    """What every moment of a plan shares: the run's options, its particles and box, and the GPU's arena.
    `units`: 2 half sets (refine), each of the config's classes, or 1 (classify); `image_itemsize` the bytes per
    pixel of the images uploaded; `kept_images` how many of them stay on the device from one iteration to the next
    (`em.estep.kept_images`, in the arena beside every iteration)."""

    config: RefineConfig
    gpu: GpuSpec
    n_particles: int
    box_px: int
    arena_bytes: float
    units: int = 2
    image_itemsize: int = 4
    kept_images: int = 0

    @property
    def kept_images_bytes(self) -> float:
        return float(self.kept_images) * self.box_px ** 2 * self.image_itemsize


def predict_moment(label: str, run: PlannedRun, sizes: schedule.ImageSizes, sampling: Sampling,
                   n_orientations: int, local: bool = False) -> Moment:
    """Memory per scope and time of one iteration of `run` at these image sizes (the GPU engine's allocations); in
    a local search (`local`) `n_orientations` is one particle's neighbourhood."""
    config, gpu, n_particles, box = run.config, run.gpu, run.n_particles, run.box_px
    arena_bytes, units, n_classes = run.arena_bytes - run.kept_images_bytes, run.units, config.n_classes
    current, coarse = sizes.current_size_px, sizes.coarse_size_px
    grid = PaddedGrid.create(box, config.padding_factor, current // 2)
    volume = float(np.prod(grid.shape))
    npad = padded_size_px(box, config.padding_factor)
    sums_per_half = memory.sums_bytes(grid.shape, n_classes)
    references = memory.references_bytes(grid.shape, box, n_classes)
    reconstruction = memory.reconstruction_bytes(grid.shape, box, npad)
    waits = memory.halves_wait_on_host(arena_bytes, [sums_per_half] * units, references, reconstruction)
    # the E-step: both halves' sums, or the one worked on while the other waits on the host
    estep_sums = sums_per_half * (1 if waits else units)
    kc, kf = coefficients(coarse), coefficients(current)
    n_t = sampling.n_translations
    children = sampling.n_fine_orientations() * sampling.n_fine_translations()
    # the batch of prepared images the engine is handed (em.estep: joined from the parts it was prepared in)
    # a GPU run's, wherever it is planned; no more than a unit's particles (a half set, or all of them)
    batch = min(config.batch_size_for(box, on_gpu=True), max(1, math.ceil(n_particles / units)))
    # the images' overlapped uploads (gpu.staging) where they have room
    uploads = UploadSlots.nbytes(batch, (box, box), run.image_itemsize)
    uploads = uploads if uploads <= memory.upload_slots_room(arena_bytes) else 0.0
    fixed = estep_sums + references + uploads
    prepared = (min(batch, memory.images_per_engine_run(max(arena_bytes - fixed, 1), current))
                * memory.PREPARED_BYTES_PER_PIXEL * float(current) ** 2)
    plan = plan_batches(max(arena_bytes - fixed - prepared, 1), kc, kf, n_orientations, n_t, n_classes,
                        batch, children, local=local)
    slices = 3 * math.ceil(2 * kc / 8) * 8 * 4 / 2 * n_orientations * n_classes if plan.cache_coarse_slices else 0.0
    chunk = 3 * 2 * kc * 4 / 2 * plan.orientations_per_chunk if not plan.cache_coarse_slices else 0.0
    per_particle = (local_per_particle_bytes if local else per_particle_bytes)(kc, kf, n_orientations, n_t, n_classes)
    # the prepared batch, one sub-batch, and at most one group of fine samples (its size depends on how broad the
    # posteriors are)
    particle = prepared + plan.particles_per_batch * per_particle + plan.fine_samples_per_group * FINE_SAMPLE_BYTES
    orientation = max(chunk, plan.slice_rows_per_chunk * SLICE_ROW_BYTES_PER_COEF * kf
                      if plan.slice_rows_per_chunk < 1 << 16 else 0.0)
    # the M-step: both halves' sums where they fit beside a reconstruction (the final iteration joins them in
    # place), else one at a time (em.mstep.HalfSums); with --sym a copy of one class's sums
    turns = units > 1 and memory.halves_take_turns(arena_bytes - sums_per_half, sums_per_half, reconstruction)
    mstep_sums = sums_per_half * (1 if turns else units)
    maximization = mstep_sums + reconstruction
    if sampling.group.order > 1:
        maximization = max(maximization, mstep_sums + volume * (8 + 4) + SYMMETRISE_SLAB_BYTES)
    if local:
        estep = local_estep_seconds(n_particles, n_classes, n_orientations, kc, kf, gpu.fp32_tflops)
    else:
        estep = global_estep_seconds(n_particles, n_classes, n_orientations, n_t, kc, gpu.fp32_tflops)
    return Moment(label, current, coarse, n_orientations, n_t, plan.particles_per_batch, plan.cache_coarse_slices,
                  estep_sums + references + uploads + slices, particle, orientation, maximization, estep, waits,
                  run.kept_images_bytes)


def plan_run(config: RefineConfig, gpu: GpuSpec, late_resolution_angstrom: float | None = None) -> dict[str, Any]:
    """The moments of a run of `config` on `gpu`: a refinement's first, late and final iterations, or a
    classification's first and late ones (global searches at --healpix_order, one work unit of K classes, no final
    iteration at the whole box); the late one at `late_resolution_angstrom`, by default three quarters of Nyquist.
    Raises InputError if one cannot fit."""
    from cryorefine.data import load_particles

    particles = load_particles(config.input_star)
    box, pixel = particles.geometry()
    config.check_for_box(box)
    n = len(particles)
    itemsize = image_itemsize(particles)
    diameter = schedule.default_particle_diameter_angstrom(config, box, pixel)
    arena = gpu.memory_bytes - config.free_gpu_memory_mb * 2 ** 20
    if arena <= 0:  # as the run's arena would refuse (gpu.allocator.DeviceArena)
        raise InputError(f"no GPU memory arena on {gpu.name}: {gpu.memory_bytes / GB:.3g} GB minus --free_gpu_memory "
                         f"{config.free_gpu_memory_mb:g} MB leaves none; lower --free_gpu_memory or plan for a larger "
                         f"GPU (--gpu_memory)")
    res0 = schedule.current_resolution(box, pixel, iteration=0,
                                       ini_high_angstrom=schedule.starting_resolution_angstrom(config))
    late = late_resolution_angstrom or 2 * pixel / 0.75
    if late < 2 * pixel:
        raise InputError(f"--resolution {late:g}: beyond Nyquist ({2 * pixel:.2f} Å at {pixel:.3f} Å/px); give "
                         f"{2 * pixel:.2f} Å or more")
    refine = config.auto_refine
    reserve = memory.whole_box_iteration_bytes(box, config.padding_factor, config.n_classes * (2 if refine else 1))
    kept = memory.kept_images_capacity(arena, box * box * itemsize, n, reserve)
    run = PlannedRun(config, gpu, n, box, arena, units=2 if refine else 1, image_itemsize=itemsize, kept_images=kept)
    moments = []
    for label, resolution, order, local, final in (
            ("first", res0.resolution_angstrom, config.healpix_order, False, False),
            (f"late (local searches, {late:.1f} Å)", late, config.auto_local_healpix_order, True, False),
            ("final", 2 * pixel, config.auto_local_healpix_order, True, True)) if refine else (
            ("first", res0.resolution_angstrom, config.healpix_order, False, False),
            (f"late ({late:.1f} Å)", late, config.healpix_order, False, False)):
        sizes = schedule.image_sizes(resolution, order, diameter, box, pixel, config.incr_size_px, False, final,
                                     ave_pmax=0.0, oversampling=config.oversampling,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        sampling = Sampling(healpix_order=order, offset_range_px=config.offset_range_px,
                            offset_step_px=config.offset_step_px, symmetry=config.symmetry)
        n_orient = sampling.n_orientations
        if local:
            n_orient = local_neighbourhood_orientations(sampling, config.oversampling)
        moments.append(predict_moment(label, run, sizes, sampling, n_orient, local=local))
    worst = max(moments, key=lambda m: m.peak_bytes)
    if worst.peak_bytes > arena:
        need_gb = (worst.peak_bytes + config.free_gpu_memory_mb * 2 ** 20) / GB
        hint = (f"lower --free_gpu_memory to {max(0.0, (gpu.memory_bytes - worst.peak_bytes) / 2 ** 20 - 256):.0f}"
                if worst.peak_bytes < gpu.memory_bytes - 512 * 2 ** 20 else
                f"use a GPU with at least {need_gb:.0f} GB, or --pad 1 (padded volumes one eighth the size)")
        if worst.label.startswith("late") and late_resolution_angstrom is None:
            hint += (f"; the late iteration is planned at {late:.1f} Å (three quarters of Nyquist): --resolution "
                     f"plans it at the resolution the job is expected to reach")
        raise InputError(f"{config.input_star}: the {worst.label} iteration needs {worst.peak_bytes / GB:.3g} GB of "
                         f"GPU memory but the arena on {gpu.name} has {arena / GB:.3g} GB; {hint}")
    return {"particles": n, "box_px": box, "pixel_size_angstrom": pixel, "gpu": gpu, "arena_bytes": arena,
            "kept_images": kept, "kept_images_bytes": run.kept_images_bytes, "moments": moments}


def format_plan(result: Mapping[str, Any]) -> str:
    gpu = result["gpu"]
    lines = [f"{result['particles']} particles, {result['box_px']} px at {result['pixel_size_angstrom']:.3f} Å/px; "
             f"{gpu.name}: arena {result['arena_bytes'] / GB:.1f} GB, FP32 peak {gpu.fp32_tflops:.1f} TFLOP/s",
             f"images kept on the GPU from one iteration to the next (in one process): {result['kept_images']:,} of "
             f"{result['particles']:,} ({result['kept_images_bytes'] / GB:.2f} GB of the arena, in every peak below)",
             "",
             "| iteration | size / coarse px | orientations × translations | particles per batch | ITERATION GB "
             "| PARTICLE GB | ORIENTATION GB | M-step GB | peak GB | E-step s (est.) | idle half on host |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["moments"]:
        lines.append(f"| {m.label} | {m.current_size_px} / {m.coarse_size_px} | {m.n_orientations} × {m.n_translations}"
                     f"{' (slices cached)' if m.cache_coarse_slices else ''} | {m.particles_per_batch} | "
                     f"{m.iteration_bytes / GB:.2f} | {m.particle_bytes / GB:.2f} | {m.orientation_bytes / GB:.2f} | "
                     f"{m.maximization_bytes / GB:.2f} | {m.peak_bytes / GB:.2f} | {m.estep_seconds:.1f} | "
                     f"{'yes' if m.half_waits_on_host else 'no'} |")
    return "\n".join(lines)

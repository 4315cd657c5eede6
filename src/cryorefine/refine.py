"""`cryorefine refine`: RELION's gold-standard 3D auto-refine, iteration by iteration.

Each iteration: schedule (sizes, sampling) -> E-step per half set (images -> engine) ->
half-map FSC -> M-step (τ² from the FSC, reconstruction, noise/offset/norm/scale updates) ->
resolution and convergence -> RELION's outputs. The engine is an object passed in
(`estep.reference.NumpyEngine` on the CPU); nothing here knows how it computes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np

from cryorefine import schedule
from cryorefine.core import fourier
from cryorefine.core.arrays import array_module, to_host
from cryorefine.core.fsc import fourier_shell_correlation, ssnr_from_fsc, tau2_from_fsc
from cryorefine.core.projector import BackProjector
from cryorefine.data import load_particles
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup
from cryorefine.core.sampling import next_perturbation
from cryorefine.images import ImageSettings, NoiseEstimate, coefficients_per_shell, prepare_batch
from cryorefine.io import mrc
from cryorefine.io.atomic import atomic_path
from cryorefine.io.background import BackgroundWriter
from cryorefine.io.relion_outputs import (model_star_blocks, optimiser_star_blocks, sampling_star_blocks,
                                          write_optimiser_star)
from cryorefine.io.star import write_particle_star, write_star
from cryorefine.report import write_iteration_report
from cryorefine.state import ModelState

log = logging.getLogger("cryorefine.refine")

MIN_SIGMA2_OFFSET_ANGSTROM2 = 2.0  # RELION's --min_sigma2_offset
INITIAL_SIGMA_OFFSET_ANGSTROM = 10.0  # RELION's --offset


@dataclass
class ParticleState:
    """What changes per particle from one iteration to the next."""

    rot_deg: np.ndarray
    tilt_deg: np.ndarray
    psi_deg: np.ndarray
    origin_x_px: np.ndarray
    origin_y_px: np.ndarray
    class_index: np.ndarray
    norm_correction: np.ndarray
    pmax: np.ndarray
    n_significant: np.ndarray
    log_likelihood: np.ndarray

    @classmethod
    def from_particles(cls, particles, pixel_size_angstrom):
        n = len(particles)
        return cls(particles.rot_deg.copy(), particles.tilt_deg.copy(), particles.psi_deg.copy(),
                   particles.origin_x_angstrom / pixel_size_angstrom, particles.origin_y_angstrom / pixel_size_angstrom,
                   np.zeros(n, np.int64), particles.norm_correction.copy(), np.zeros(n), np.zeros(n, np.int64),
                   np.zeros(n))

    def copy(self):
        return ParticleState(**{f.name: getattr(self, f.name).copy() for f in dataclasses.fields(self)})

    def store(self, indices, result):
        self.rot_deg[indices] = result.rot_deg
        self.tilt_deg[indices] = result.tilt_deg
        self.psi_deg[indices] = result.psi_deg
        self.origin_x_px[indices] = result.origin_x_px
        self.origin_y_px[indices] = result.origin_y_px
        self.class_index[indices] = result.class_index
        self.norm_correction[indices] = result.norm_correction
        self.pmax[indices] = result.pmax
        self.n_significant[indices] = result.n_significant
        self.log_likelihood[indices] = result.log_likelihood


@dataclass
class IterationReport:
    iteration: int
    resolution_angstrom: float
    current_size_px: int
    coarse_size_px: int
    healpix_order: int
    local_searches: bool
    changes_orientations_deg: float
    changes_offsets_angstrom: float
    ave_pmax: float
    seconds: dict = field(default_factory=dict)  # expectation, maximization, write
    stage_seconds: dict = field(default_factory=dict)  # the E-step's: images, then the engine's stages
    stage_flops: dict = field(default_factory=dict)  # useful floating-point operations of the engine's stages


def refine(config, argv=(), make_engine=None, progress=None, resume_from=None):
    """Run a gold-standard refinement; returns the list of IterationReports.

    `make_engine()` returns a fresh engine (default: the numpy engine at config.dtype, or the GPU
    engine when config.engine is "cuda"). A factory may also offer `run_scope()` (entered for
    the whole run), `iteration_scope()` (around each iteration's E- and M-step) and
    `maximization_scope()` (around the M-step): the GPU engines' device-memory lifetimes.
    `progress(done, total)` is called after each batch when given. `resume_from` is a
    run_itNNN_optimiser.star: the run goes on from iteration NNN + 1 exactly as it would have.
    """
    from cryorefine.parallel import launched_with_mpi

    if make_engine is None and launched_with_mpi():
        from cryorefine.parallel import refine_mpi

        return refine_mpi(config, argv, progress, resume_from)  # the master's reports; None on a worker
    if make_engine is None:
        make_engine = default_engine_factory(config)
    with _scope_of(make_engine, "run_scope"):
        return _refine(config, argv, make_engine, progress, resume_from)


def read_reference(path, box, pixel):
    """A reference map checked against the particles: cubic of their box, at their pixel size."""
    reference, ref_pixel = mrc.read_volume(path)
    if reference.shape[0] != box:
        raise InputError(f"{path}: the reference is {reference.shape[0]} px but the particles are "
                         f"{box} px; resize the reference (relion_image_handler --new_box {box})")
    if ref_pixel is not None and abs(ref_pixel - pixel) > 0.01 * pixel:
        raise InputError(f"{path}: conflicting pixel sizes, the reference is {ref_pixel:g} Å/px but "
                         f"the particles are {pixel:g} Å/px; rescale the reference (relion_image_handler --rescale_angpix)")
    return reference


def lowpass_to_ini_high(volume, config, box, pixel):
    """The volume low-passed to --ini_high (unchanged without it), with numpy or cupy as the volume is."""
    if not config.ini_high_angstrom:
        return volume
    xp = array_module(volume)
    ft = fourier.lowpass_filter_3d(fourier.rfft3_centered(volume, xp), box, config.ini_high_angstrom, pixel, xp=xp)
    return fourier.irfft3_centered(ft, box, xp)


def default_engine_factory(config):
    """The engine factory that config.engine names ("numpy", or "cuda" on config.gpu_ids[0])."""
    if config.engine == "cuda":
        from cryorefine.estep.cuda import CudaEngines

        device = config.gpu_ids[0] if config.gpu_ids else 0
        log.info("E-step engine: GPU %d (CuPy kernels)", device)
        return CudaEngines(device, config.free_gpu_memory_mb)
    from cryorefine.estep.reference import NumpyEngine

    log.info("E-step engine: numpy (%s)", config.dtype)

    def make_engine():
        return NumpyEngine(np.dtype(config.dtype))

    return make_engine


def _scope_of(factory, name):
    import contextlib

    scope = getattr(factory, name, None)
    return scope() if scope is not None else contextlib.nullcontext()


def _refine(config, argv, make_engine, progress, resume_from, on_setup=None):
    """The run set up (checks, halves, initial model) and iterated; `on_setup(particles, settings, halves)` is
    called once all is ready, just before the first iteration (the MPI master starts its workers there)."""

    if config.symmetry.upper() != "C1":
        raise InputError(f"--sym {config.symmetry}: refine handles C1 only so far (the reconstruction does not yet "
                         f"symmetrise the half maps); run with --sym C1")
    particles = load_particles(config.input_star)
    box, pixel = particles.geometry()
    if config.do_ctf:
        particles.require_ctf()
    reference = read_reference(config.reference_map, box, pixel)
    out_root = Path(config.output_root)
    out_root.parent.mkdir(parents=True, exist_ok=True)
    diameter = schedule.default_particle_diameter_angstrom(config, box, pixel)
    settings = ImageSettings(box, pixel, diameter, config.width_mask_edge_px, config.zero_mask, config.do_ctf,
                             config.random_seed)
    halves = particles.half_sets(config.random_seed)
    if "rlnRandomSubset" in particles.star.particles.columns and not np.array_equal(halves, particles.random_subset):
        log.warning("%s: rlnRandomSubset does not split the particles into two halves; using a random split "
                    "(seed %d)", config.input_star, config.random_seed)
    members = [np.flatnonzero(halves == h) for h in (1, 2)]
    if min(m.size for m in members) == 0:
        raise InputError(f"{config.input_star}: refinement needs at least 2 particles, one per half set")
    n_optics = len(particles.optics_groups)
    if resume_from is not None:
        model, optimiser, sched, rng, state = load_resume(resume_from, box, len(particles))
        if on_setup:
            on_setup(particles, settings, halves)
        return _iterate(config, argv, make_engine, progress, particles, settings, halves, members, diameter,
                        out_root, model, optimiser, sched, rng, state, optimiser.iteration + 1)
    state = ParticleState.from_particles(particles, pixel)
    optimiser, sched = schedule.initial_schedule(config)
    model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=1,
                       padding_factor=config.padding_factor, pdf_class=np.ones(1),
                       sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                       scale_correction=np.ones(n_optics))
    start = lowpass_to_ini_high(reference.astype(np.float64), config, box, pixel)
    model.maps = [[start.copy()], [start.copy()]]
    model.sigma2_noise = _initial_noise(particles, settings, n_optics, config.batch_size,
                                        image_array_module(make_engine))
    if not config.ini_high_angstrom:
        log.warning("no --ini_high: the reference is used unfiltered and the first image size is set for %.0f Å",
                    schedule.DEFAULT_START_RESOLUTION_ANGSTROM)
    res = schedule.current_resolution(box, pixel, iteration=0,
                                      ini_high_angstrom=schedule.starting_resolution_angstrom(config))
    model.current_resolution_angstrom = res.resolution_angstrom
    rng = np.random.default_rng(config.random_seed)
    if on_setup:
        on_setup(particles, settings, halves)
    return _iterate(config, argv, make_engine, progress, particles, settings, halves, members, diameter, out_root,
                    model, optimiser, sched, rng, state, 1)


def _iterate(config, argv, make_engine, progress, particles, settings, halves, members, diameter, out_root,
             model, optimiser, sched, rng, state, first_iteration):
    box, pixel = model.ori_size_px, model.pixel_size_angstrom
    reports = []
    with BackgroundWriter() as writer:
        for iteration in range(first_iteration, config.max_iterations + 1):
            timings = {}
            optimiser = replace(optimiser, iteration=iteration)
            optimiser = schedule.check_convergence(optimiser, sched)
            final = optimiser.do_join_halves
            sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order, diameter, box,
                                         pixel, sched.incr_size_px, optimiser.has_high_fsc_at_resol_limit, final,
                                         ave_pmax=model.ave_pmax, oversampling=config.oversampling)
            model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
            do_cc = iteration == 1 and config.firstiter_cc
            if not do_cc and model.tau2 is not None:
                acc = schedule.estimated_accuracy_from_model(model, sizes.current_size_px, diameter,
                                                             do_ctf=config.do_ctf)
                optimiser = replace(optimiser, acc_rot_deg=acc.rotations_deg,
                                    acc_trans_angstrom=acc.translations_angstrom)
                model.accuracy_rotations_deg, model.accuracy_translations_angstrom = acc
            if iteration > 1:
                optimiser, sched = schedule.update_sampling(optimiser, model, config, sched)
            optimiser = replace(optimiser, perturbation=next_perturbation(optimiser.perturbation, 0.5, rng))
            sampling = schedule.sampling_from_optimiser(optimiser, config)

            expectation_maximization = getattr(make_engine, "expectation_maximization", _expectation_maximization)
            with _scope_of(make_engine, "iteration_scope"):
                fsc, changes, timings, stages, flops = expectation_maximization(
                    config, make_engine, progress, particles, settings, members, model, optimiser, sampling, sizes,
                    state, iteration, do_cc, final, timings)
            tic = time.perf_counter()
            optimiser, sched = schedule.update_size_flags_from_fsc(optimiser, sched, fsc, sizes.current_size_px)
            res = schedule.current_resolution(box, pixel, fsc_halves=fsc, tau2_fudge=config.tau2_fudge,
                                              halves_joined=final, iteration=iteration,
                                              ini_high_angstrom=config.ini_high_angstrom,
                                              firstiter_cc=config.firstiter_cc)
            optimiser = schedule.update_change_counters(
                optimiser, changes.orientations_deg, changes.offsets_angstrom, changes.classes, res.resolution_angstrom,
                previous_resolution_angstrom=model.current_resolution_angstrom, pixel_size_angstrom=pixel,
                oversampling=config.oversampling)
            model.current_resolution_angstrom = res.resolution_angstrom
            optimiser = replace(optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)
            timings["maximization"] += time.perf_counter() - tic

            tic = time.perf_counter()
            snapshot = state.copy()  # the next E-step changes `state` while the writer thread reads this
            save_resume(f"{out_root}_it{iteration:03d}_resume.npz", config, model, optimiser, sched, rng, snapshot)
            writes = _iteration_writes(out_root, iteration, particles, snapshot, halves, model, optimiser, config,
                                       sampling, argv)
            writes.insert(-1, partial(
                write_iteration_report, f"{out_root}_it{iteration:03d}_report.png", iteration=iteration,
                fsc=np.array(model.fsc_halves[0]), ori_size_px=box, pixel_size_angstrom=pixel,
                resolution_angstrom=res.resolution_angstrom, rot_deg=snapshot.rot_deg, tilt_deg=snapshot.tilt_deg,
                timings_seconds={**{f"E: {k}": v for k, v in stages.items()}, "M-step": timings["maximization"]},
                halves_joined=final))
            if final:
                writes += _final_writes(out_root, particles, snapshot, halves, model, optimiser, config)
            writer.submit(writes)
            timings["write"] = time.perf_counter() - tic  # the loop's share: building the outputs, waiting for the last
            report = IterationReport(iteration, res.resolution_angstrom, sizes.current_size_px, sizes.coarse_size_px,
                                     optimiser.healpix_order, optimiser.local_searches, changes.orientations_deg,
                                     changes.offsets_angstrom, model.ave_pmax, timings, dict(stages), flops)
            reports.append(report)
            log.info("iteration %d: resolution %.2f Å, size %d/%d px, healpix %d%s, Δangle %.2f°, Δoffset %.2f Å, "
                     "pmax %.3f, E %.1f s, M %.1f s", iteration, res.resolution_angstrom, sizes.current_size_px,
                     sizes.coarse_size_px, optimiser.healpix_order, " (local)" if optimiser.local_searches else "",
                     changes.orientations_deg, changes.offsets_angstrom, model.ave_pmax, timings["expectation"],
                     timings["maximization"])
            log.info("  E-step stages (s): %s", ", ".join(f"{name} {seconds:.1f}"
                                                           for name, seconds in stages.items()))
            if final:
                break
    return reports


def _expectation_maximization(config, make_engine, progress, particles, settings, members, model, optimiser, sampling,
                              sizes, state, iteration, do_cc, final, timings):
    """The E-step of both half sets (one engine each), then the M-step; returns (FSC, changes, timings, stages,
    flops) with `stages` the E-step's seconds per stage (engine set-up, waits for the read-ahead thread, image
    preparation, then the engine's) and `flops` the engine's useful floating-point operations per stage."""
    tic = time.perf_counter()
    old = state.copy()
    sums = []
    stages = {}  # seconds per E-step stage: set-up, read waits, image preparation, then the engine's own
    flops = {}
    for h in (0, 1):
        tic_setup = time.perf_counter()
        engine = make_engine()
        engine.setup(_iteration_setup(model, optimiser, config, sampling, sizes, h, do_cc))
        tic_wait = add_seconds(stages, "setup", tic_setup)
        preread = np.arange(len(particles)) if config.preread_images else None
        with particles.image_reader(preread) as reader:
            batches = particles.batches(config.batch_size, members[h])
            for batch_indices, images in particles.read_ahead(batches, reader, image_array_module(engine)):
                tic_images = add_seconds(stages, "read_wait", tic_wait)
                batch = prepare_batch(particles, batch_indices, reader, settings, sizes.current_size_px,
                                      model.avg_norm_correction, iteration, state.origin_x_px, state.origin_y_px,
                                      image_norms(config, state), state.class_index,
                                      (old.rot_deg, old.tilt_deg, old.psi_deg), xp=image_array_module(engine),
                                      images=images)
                del images
                add_seconds(stages, "images", tic_images)
                state.store(batch_indices, engine.run(batch))
                del batch  # its device arrays go before the next batch's (the arena is a stack)
                if progress:
                    progress(batch_indices.size, len(particles))
                tic_wait = time.perf_counter()
        sums.append(engine.sums())
        add_engine_stages(stages, engine, flops)
        del engine
    keep_norms_unless_refined(config, old, state)
    timings["expectation"] = time.perf_counter() - tic

    tic = time.perf_counter()
    changes = _hidden_variable_changes(old, state, model.pixel_size_angstrom, config.symmetry)
    with _scope_of(make_engine, "maximization_scope"):
        fsc = _maximize(model, optimiser, config, sums, sizes, final, do_cc)
    del sums
    timings["maximization"] = time.perf_counter() - tic
    return fsc, changes, timings, stages, flops


def image_norms(config, state):
    """The norm corrections images are multiplied by (avg/norm): the particles' own with --norm, else none
    (RELION applies and updates rlnNormCorrection only with --norm)."""
    return state.norm_correction if config.do_norm else np.ones_like(state.norm_correction)


def keep_norms_unless_refined(config, old, state):
    """Without --norm the particles keep the norm corrections they came with."""
    if not config.do_norm:
        state.norm_correction[:] = old.norm_correction


def add_seconds(stages, name, tic):
    """Add the seconds since `tic` to stages[name]; returns now (the next stage's tic)."""
    now = time.perf_counter()
    stages[name] = stages.get(name, 0.0) + now - tic
    return now


def add_engine_stages(stages, engine, flops=None):
    """Add an engine's seconds per stage (if it keeps them) to `stages`, its operation counts to `flops`."""
    for name, seconds in getattr(engine, "stage_seconds", {}).items():
        stages[name] = stages.get(name, 0.0) + seconds
    for name, count in getattr(engine, "stage_flops", {}).items() if flops is not None else ():
        flops[name] = flops.get(name, 0.0) + count


def image_array_module(engine):
    """The array module an engine (or engine factory) wants its batches prepared with (numpy by default)."""
    return getattr(engine, "array_module", np)


def _initial_noise(particles, settings, n_optics, batch_size, xp=np):
    """RELION's initial noise spectra from the masked images at their stored origins."""
    noise = NoiseEstimate.empty(n_optics, settings.ori_size_px)
    with mrc.StackReader() as reader:
        for indices, images in particles.read_ahead(particles.batches(batch_size), reader, xp):
            batch = prepare_batch(particles, indices, reader, settings, settings.ori_size_px, 1.0, 0, xp=xp,
                                  images=images)
            del images
            noise.add(batch.images_ft, batch.optics_index, batch.power_beyond_current)
            del batch  # its device arrays go before the next batch's (the GPU arena is a stack)
    return noise.sigma2()


def _iteration_setup(model, optimiser, config, sampling, sizes, half, do_cc):
    sigma_offset_px = model.sigma_offset_angstrom / model.pixel_size_angstrom
    setup = IterationSetup(
        projectors=None, maps=[model.maps[half][0]], sigma2_noise=model.sigma2_noise, sampling=sampling,
        ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px, coarse_size_px=sizes.coarse_size_px,
        pixel_size_angstrom=model.pixel_size_angstrom, log_pdf_class=np.log(np.maximum(model.pdf_class, 1e-300)),
        sigma_offset_px=sigma_offset_px, do_cc=do_cc, adaptive_fraction=config.adaptive_fraction,
        max_significants=config.max_significants, local_searches=optimiser.local_searches,
        sigma_rot_deg=optimiser.sigma_rot_deg, sigma_psi_deg=optimiser.sigma_psi_deg,
        scale_correction=model.scale_correction if config.do_scale else None,
        data_vs_prior=None if model.ssnr is None else model.ssnr[half], padding_factor=config.padding_factor,
        avg_norm_correction=model.avg_norm_correction)
    return setup


def _backprojector(data, weight, model, config, sizes, xp):
    data = xp.asarray(data, dtype=xp.complex128)
    weight = xp.asarray(weight, dtype=xp.float64)
    return BackProjector.from_arrays(data, weight, model.ori_size_px, config.padding_factor,
                                     sizes.current_size_px // 2, xp=xp)


def _maximize(model, optimiser, config, sums, sizes, joined, do_cc):
    """RELION's maximization for two half sets: FSC, τ², maps and the other parameters; returns the FSC.

    Runs where the sums are: on the GPU (CuPy FFTs, FSC and noise spectra on the device) for
    the GPU engine's sums, with numpy otherwise; the maps come back to the host.
    """
    box = model.ori_size_px
    n_shells = model.n_shells
    xp = array_module(sums[0].data[0])
    bps = [_backprojector(s.data[0], s.weight[0], model, config, sizes, xp) for s in sums]
    if joined:
        joined_bp = _backprojector(bps[0].data + bps[1].data, bps[0].weight + bps[1].weight, model, config, sizes,
                                   xp)
    avg = [bp.downsampled_average() for bp in bps]
    fsc = np.zeros(n_shells)
    fsc_part = to_host(fourier_shell_correlation(avg[0], avg[1], xp=xp))
    del avg
    fsc[: min(n_shells, fsc_part.size)] = fsc_part[:n_shells]
    if config.low_resol_join_halves_angstrom and not joined:
        _join_halves_at_low_resolution(bps, config.low_resol_join_halves_angstrom, model)
    tau2 = np.zeros((2, 1, n_shells))
    ssnr = np.zeros((2, 1, n_shells))
    ref_sigma2 = np.zeros((2, 1, n_shells))
    radius_px = schedule.default_particle_diameter_angstrom(config, box, model.pixel_size_angstrom) / (
        2 * model.pixel_size_angstrom)

    def reconstruct(bp, whole):
        sigma2 = to_host(bp.noise_sigma2())[:n_shells]
        t2 = np.asarray(tau2_from_fsc(fsc, sigma2, config.tau2_fudge, whole_instead_of_half=whole))[:n_shells]
        volume = bp.reconstruct(tau2=xp.asarray(t2), tau2_fudge=config.tau2_fudge)
        if config.flatten_solvent:
            volume = volume * fourier.soft_spherical_mask(box, radius_px, config.width_mask_edge_px, xp)
        # the maps go on as they are written (float32), so a continued run sees exactly the same
        return to_host(volume).astype(np.float32), sigma2, t2

    maps = []
    for h, bp in enumerate(bps):
        volume, sigma2, t2 = reconstruct(bp, False)
        tau2[h, 0, : t2.size] = t2
        ref_sigma2[h, 0, : sigma2.size] = sigma2
        s = np.asarray(ssnr_from_fsc(fsc, config.tau2_fudge, whole_instead_of_half=joined))
        ssnr[h, 0, : s.size] = s[:n_shells]
        maps.append([volume])
    model.maps = maps
    model.joined_map = reconstruct(joined_bp, True)[0] if joined else None
    model.tau2, model.ssnr, model.reference_sigma2, model.fsc_halves = tau2, ssnr, ref_sigma2, fsc[None, :]

    maximize_other_parameters(model, config, sums, do_cc)
    model.class_distribution = np.ones(1)
    return fsc


def maximize_other_parameters(model, config, sums, do_cc):
    """RELION's maximizationOtherParameters from a list of WeightedSums (two halves, or one set):
    noise spectra, σ offsets (at least 2 Å²), average norm (--norm) and scales (--scale), with CC
    (--firstiter_cc) only the log-likelihood and average pmax."""
    box = model.ori_size_px
    total = sum(s.n_particles for s in sums)
    if not do_cc:
        sigma2_sum = sum(s.sigma2_noise for s in sums)
        sumw = sum(s.sumw_group for s in sums)
        per_shell = coefficients_per_shell(box)
        new = sigma2_sum / (2.0 * np.maximum(sumw, 1e-300)[:, None] * np.maximum(per_shell, 1.0)[None, :])
        keep = new > 1e-14
        model.sigma2_noise = np.where(keep, new, model.sigma2_noise)
        offset2 = sum(s.sigma2_offset_angstrom2 for s in sums) / (2.0 * total)
        model.sigma_offset_angstrom = math.sqrt(max(offset2, MIN_SIGMA2_OFFSET_ANGSTROM2))
        if config.do_norm:
            model.avg_norm_correction = sum(s.norm_correction for s in sums) / total
        if config.do_scale and sums[0].scale_aa is not None:
            xa = sum(s.scale_xa for s in sums)
            aa = sum(s.scale_aa for s in sums)
            scale = np.where(aa > 0, xa / np.maximum(aa, 1e-300), 1.0)
            median = np.median(scale)
            scale = np.clip(scale, median / 5, median * 5)
            model.scale_correction = scale / np.mean(scale)
    model.log_likelihood = sum(s.log_likelihood for s in sums)
    model.ave_pmax = sum(s.sum_pmax for s in sums) / total


def _join_halves_at_low_resolution(bps, resolution_angstrom, model):
    """RELION's joinTwoHalvesAtLowResolution: both halves get the sum of their data below a resolution."""
    grid = bps[0].grid
    shell_limit = model.ori_size_px * model.pixel_size_angstrom / resolution_angstrom
    r2 = grid.radius2(bps[0].xp)
    low = r2 <= (shell_limit * grid.padding_factor) ** 2
    data = bps[0].data[low] + bps[1].data[low]
    weight = bps[0].weight[low] + bps[1].weight[low]
    for bp in bps:
        bp.data[low] = data
        bp.weight[low] = weight


def _hidden_variable_changes(old, new, pixel, symmetry):
    from cryorefine.core.symmetry import symmetry_group

    mats = symmetry_group(symmetry).rotations if symmetry.upper() != "C1" else None
    angles = schedule.angular_distance_deg(old.rot_deg, old.tilt_deg, old.psi_deg, new.rot_deg, new.tilt_deg,
                                           new.psi_deg, symmetry_matrices=mats)
    d2 = ((new.origin_x_px - old.origin_x_px) ** 2 + (new.origin_y_px - old.origin_y_px) ** 2) * pixel ** 2
    return schedule.hidden_variable_changes_from_sums(float(np.sum(angles)), float(np.sum(d2)),
                                                      float(np.sum(new.class_index != old.class_index)),
                                                      float(new.rot_deg.size))


def _particle_table(particles, state, halves, pixel):
    table = particles.star.particles.copy()
    table["rlnAngleRot"] = state.rot_deg
    table["rlnAngleTilt"] = state.tilt_deg
    table["rlnAnglePsi"] = state.psi_deg
    table["rlnOriginXAngst"] = state.origin_x_px * pixel
    table["rlnOriginYAngst"] = state.origin_y_px * pixel
    table["rlnClassNumber"] = state.class_index + 1
    table["rlnNormCorrection"] = state.norm_correction
    table["rlnLogLikeliContribution"] = state.log_likelihood
    table["rlnMaxValueProbDistribution"] = state.pmax
    table["rlnNrOfSignificantSamples"] = state.n_significant
    table["rlnRandomSubset"] = halves
    return table


def _optics_names_and_counts(particles):
    names = [g.name for g in particles.optics_groups]
    return names, [int((particles.optics_index == i).sum()) for i in range(len(names))]


def _iteration_writes(out_root, iteration, particles, state, halves, model, optimiser, config, sampling, argv):
    """The writes of one iteration's files as callables over what they need now (the particle table and the
    STAR blocks are built here; the maps are the model's, which the next M-step replaces rather than
    changes); the optimiser STAR file comes last."""
    root = f"{out_root}_it{iteration:03d}"
    pixel = model.pixel_size_angstrom
    names, counts = _optics_names_and_counts(particles)
    writes = [partial(write_particle_star, particles.star, f"{root}_data.star",
                      _particle_table(particles, state, halves, pixel))]
    for h in (1, 2):
        writes += [partial(mrc.write_volume, f"{root}_half{h}_class001.mrc", model.maps[h - 1][0], pixel),
                   partial(write_star, model_star_blocks(model, optimiser, config, h,
                                                         [f"{root}_half{h}_class001.mrc"], names, counts),
                           f"{root}_half{h}_model.star")]
    writes += [partial(write_star, sampling_star_blocks(sampling, optimiser, config, pixel), f"{root}_sampling.star"),
               partial(write_optimiser_star, f"{root}_optimiser.star",
                       optimiser_star_blocks(optimiser, model, config, str(out_root), iteration), list(argv))]
    return writes


def _final_writes(out_root, particles, state, halves, model, optimiser, config):
    """The converged run's files (run_data.star, run_class001.mrc, unfiltered half maps, run_model.star)."""
    pixel = model.pixel_size_angstrom
    names, counts = _optics_names_and_counts(particles)
    writes = [partial(write_particle_star, particles.star, f"{out_root}_data.star",
                      _particle_table(particles, state, halves, pixel)),
              partial(mrc.write_volume, f"{out_root}_class001.mrc", model.joined_map, pixel)]
    writes += [partial(mrc.write_volume, f"{out_root}_half{h}_class001_unfil.mrc", model.maps[h - 1][0], pixel)
               for h in (1, 2)]
    writes.append(partial(write_star, model_star_blocks(model, optimiser, config, None, [f"{out_root}_class001.mrc"],
                                                        names, counts), f"{out_root}_model.star"))
    return writes


# ---------------------------------------------------------------------- --continue
_MODEL_ARRAYS = ("pdf_class", "sigma2_noise", "tau2", "ssnr", "reference_sigma2", "fsc_halves", "scale_correction",
                 "class_distribution")


def save_resume(path, config, model, optimiser, sched, rng, state, extra_arrays=None):
    """Everything beyond RELION's files that an exact --continue needs, beside run_itNNN_optimiser.star
    (`sched` None for a classification; `extra_arrays` what else the loop carries, see `resume_extra_arrays`)."""
    import json

    scalars = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
               if f.name not in _MODEL_ARRAYS + ("maps", "joined_map")}
    document = {"config": json.loads(config.to_json()), "model": scalars,
                "optimiser": dataclasses.asdict(optimiser),
                "schedule": None if sched is None else dataclasses.asdict(sched),
                "rng": rng.bit_generator.state}
    arrays = {f"model_{name}": getattr(model, name) for name in _MODEL_ARRAYS if getattr(model, name) is not None}
    arrays.update({f"particle_{f.name}": getattr(state, f.name) for f in dataclasses.fields(state)})
    arrays.update({f"extra_{name}": np.asarray(value) for name, value in (extra_arrays or {}).items()})
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            np.savez(handle, document=np.array(json.dumps(document, default=_plain)), **arrays)


def _plain(value):
    """numpy scalars as Python numbers for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot save {type(value).__name__} for --continue")


def resume_path(optimiser_star):
    name = str(optimiser_star)
    if not name.endswith("_optimiser.star"):
        raise InputError(f"{optimiser_star}: --continue takes a run_itNNN_optimiser.star file")
    return Path(name[: -len("_optimiser.star")] + "_resume.npz")


def load_resume_config(optimiser_star):
    """The RefineConfig a run was started with, from the files beside its optimiser.star."""
    import json

    from cryorefine.config import RefineConfig

    document = json.loads(str(_open_resume(optimiser_star)["document"]))
    return RefineConfig.from_json(json.dumps(document["config"]))


def resume_extra_arrays(optimiser_star):
    """The `extra_arrays` that save_resume stored beside `optimiser_star`."""
    return {name[len("extra_"):]: value for name, value in _open_resume(optimiser_star).items()
            if name.startswith("extra_")}


def load_resume(optimiser_star, box, n_particles, map_paths=None, classification=False):
    """(model, optimiser, schedule state, rng, particle state) after the iteration of `optimiser_star`.

    The maps are read from the iteration's files: the two half maps, or `map_paths(root)` (a list of
    paths per half set, e.g. the classes of a classification) where given."""
    import json

    from cryorefine.state import OptimiserState

    saved = _open_resume(optimiser_star)
    document = json.loads(str(saved["document"]))
    if (document["schedule"] is None) != classification:
        mine, other = ("classification", "classify") if document["schedule"] is None else ("refinement", "refine")
        raise InputError(f"{optimiser_star}: belongs to a {mine}; continue it with `cryorefine {other} --continue`")
    model = ModelState(**document["model"])
    for name in _MODEL_ARRAYS:
        if f"model_{name}" in saved:
            setattr(model, name, saved[f"model_{name}"])
    if model.ori_size_px != box:
        raise InputError(f"{optimiser_star}: the run was {model.ori_size_px} px, the particles are {box} px")
    optimiser = OptimiserState(**document["optimiser"])
    sched = None if document["schedule"] is None else schedule.ScheduleState(**document["schedule"])
    rng = np.random.default_rng()
    rng.bit_generator.state = document["rng"]
    state = ParticleState(**{f.name: saved[f"particle_{f.name}"] for f in dataclasses.fields(ParticleState)})
    if state.rot_deg.size != n_particles:
        raise InputError(f"{optimiser_star}: the run had {state.rot_deg.size} particles, the STAR file has "
                         f"{n_particles}; continue with the same --i")
    root = str(optimiser_star)[: -len("_optimiser.star")]
    paths = map_paths(root) if map_paths else [[f"{root}_half{h}_class001.mrc"] for h in (1, 2)]
    model.maps = [[mrc.read_volume(path)[0] for path in half] for half in paths]
    return model, optimiser, sched, rng, state


def _open_resume(optimiser_star):
    path = resume_path(optimiser_star)
    if not Path(optimiser_star).is_file():
        raise InputError(f"{optimiser_star}: file not found; give a run_itNNN_optimiser.star of an earlier run")
    if not path.is_file():
        raise InputError(f"{path}: not found; --continue needs the files an iteration writes beside its optimiser.star")
    with np.load(path) as data:
        return {name: data[name] for name in data.files}

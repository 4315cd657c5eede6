"""Gold-standard 3D auto-refinement (relion_refine --auto_refine --split_random_halves).

Two half sets, each refined against its own map: every iteration is one work unit per half
(`em.estep.WorkUnit`), the half maps' FSC gives τ² and the resolution, RELION's auto-sampling
schedule (`em.schedule`) refines the angular and translational sampling, switches to local
searches and decides convergence; the final iteration joins the halves to Nyquist.

With --sym (any point group of `core.symmetry`), as relion_refine: the projection directions are
those of the group's asymmetric unit (`core.sampling.Sampling`, RELION's healpix_sampling.cpp), each
half's back-projected sums are symmetrised right after they are combined (`em.mstep.backprojector`,
RELION's symmetriseReconstructions), so that the FSC, τ², the noise spectra and both maps are the
group's; local searches take the nearest symmetry mate of each direction, and the angular changes
behind the convergence test are the smallest over the group's rotations (`em.schedule`). The
initial reference is used as given: like RELION, nothing is symmetrised before the first M-step.

Outputs per iteration: run_itNNN_data.star, run_itNNN_half{1,2}_class001.mrc,
run_itNNN_half{1,2}_model.star (with each half's direction distribution, data_model_pdf_orient_class_1),
run_itNNN_half{1,2}_class001_angdist.bild (that distribution as RELION draws it),
run_itNNN_optimiser.star, run_itNNN_sampling.star (with rlnSymmetryGroup and the unit's directions),
run_itNNN_report.png. Before iteration 1, as RELION's relion_refine_mpi writes them, the same files of iteration 0
but the report (run_it000_*: the starting maps, the particles as read and split, uniform direction distributions,
and in each half's model.star the initial noise spectra and RELION's starting τ² and data-versus-prior spectra,
`em.references.initial_data_versus_prior`); --continue can start from its optimiser.star. The final iteration
writes, as RELION's does, only the converged run's files, without an iteration number: run_data.star,
run_class001.mrc (the joined halves' map, not solvent-flattened), run_half{1,2}_class001_unfil.mrc (each half's map
without τ² and masks), run_model.star (its model_groups counting half 1's particles, as RELION's first worker
writes it), run_class001_angdist.bild (all particles' directions), run_sampling.star,
run_optimiser.star (naming those three; rlnCurrentIteration -1) and run_report.png.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from functools import partial

import numpy as np

from cryorefine.core.arrays import to_host, to_host_pinned
from cryorefine.core.fsc import solvent_corrected_fsc, ssnr_from_fsc, tau2_from_fsc
from cryorefine.em import accuracy, loop, mstep, schedule
from cryorefine.em.estep import WorkUnit
from cryorefine.em.references import initial_data_versus_prior, initial_tau2, lowpass_to_ini_high, read_reference
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState, ParticleState, RunState
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup
from cryorefine.io import mrc
from cryorefine.io.background import InOwnProcess, Together
from cryorefine.io.relion_outputs import (
    data_star_write,
    job_model_star_blocks,
    optimiser_star_blocks,
    particle_table,
    write_angdist_bild,
    write_optimiser_star,
    write_sampling_star,
)
from cryorefine.io.run_files import iteration_root
from cryorefine.io.star import write_star
from cryorefine.report import write_iteration_report

log = logging.getLogger("cryorefine.refine")

INITIAL_SIGMA_OFFSET_ANGSTROM = 10.0  # RELION's --offset


def run(config, runner, argv=(), progress=None, resume_from=None, stop_requested=None, overwrite=False):
    """Run a refinement with `runner` (runners.serial or runners.mpi); the IterationReports (None on an MPI
    worker). `resume_from`: a run_itNNN_optimiser.star, continued from the iteration after it."""
    return loop.run(RefineJob(config), runner, argv, progress, resume_from, stop_requested, overwrite)


def half_direction_distributions(sums: list) -> np.ndarray | None:
    """Each half's direction distribution, (2, 1, n_directions), from its WeightedSums' `pdf_direction` over its
    total (RELION's pdf_direction of each half's model: its particles' weights per direction, summing to 1); None
    where the sums have none."""
    if any(s.pdf_direction is None for s in sums):
        return None
    out = []
    for s in sums:
        pdf = np.asarray(s.pdf_direction, dtype=np.float64).reshape(1, -1)
        total = pdf.sum()
        out.append(pdf / total if total > 0 else np.full(pdf.shape, 1.0 / pdf.size))
    return np.stack(out)


def accuracy_particles(half1: np.ndarray, optics_index: np.ndarray, seed: int) -> np.ndarray:
    """The particles of RELION's accuracy estimate in an auto-refine: the first `em.accuracy.N_TRIAL_PARTICLES` of
    half 1 (`half1`, indices) in an order drawn once from `seed` and then sorted by optics group (RELION's
    randomiseParticlesOrder, which its relion_refine does once, before iteration 1), the same every iteration;
    ascending."""
    order = np.random.default_rng(seed + 1).permutation(np.asarray(half1, dtype=np.int64))
    order = order[np.argsort(np.asarray(optics_index)[order], kind="stable")]
    return np.sort(order[:accuracy.N_TRIAL_PARTICLES])


class RefineJob:
    """The refinement as the iteration loop (`em.loop`) runs it."""

    kind = "refine"
    min_mpi_ranks = 3  # a master and one worker per half set
    relion_runs_only_under_mpi = True  # RELION's auto-refine: its files are relion_refine_mpi's, in one process too

    def __init__(self, config):
        self.config = config
        self.halves = None  # half set (1 or 2) per particle, once loaded
        self.particles = None
        self.accuracy_particles = None  # those of the accuracy estimate (`accuracy_particles`), once loaded
        self.masks = None  # em.solvent.SolventMasks, read by load (on an MPI worker: at its first M-step)

    # ------------------------------------------------------------------ set-up
    def load(self):
        config = self.config
        particles, settings = loop.particles_and_settings(config)
        self.reference = read_reference(config.reference_map, settings.ori_size_px, settings.pixel_size_angstrom,
                                        config.trust_ref_size)
        self.diameter_angstrom = settings.particle_diameter_angstrom
        self.masks = SolventMasks.from_config(config, settings.ori_size_px, settings.pixel_size_angstrom,
                                              self.diameter_angstrom, say=True)
        halves = particles.half_sets(config.random_seed)
        if "rlnRandomSubset" in particles.star.particles.columns and not np.array_equal(halves,
                                                                                       particles.random_subset):
            log.warning("%s: rlnRandomSubset does not split the particles into two halves; using a random split "
                        "(seed %d)", config.input_star, config.random_seed)
        self.members = [np.flatnonzero(halves == h) for h in (1, 2)]
        if min(m.size for m in self.members) == 0:
            raise InputError(f"{config.input_star}: refinement needs at least 2 particles, one per half set")
        self.halves, self.particles = halves, particles
        self.accuracy_particles = accuracy_particles(self.members[0], particles.optics_index, config.random_seed)
        return particles, settings

    def start(self, particles, settings, noise_spectra):
        config = self.config
        rng = np.random.default_rng(config.random_seed)  # the run's draws: the sampling's perturbations first
        box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
        n_optics = len(particles.optics_groups)
        optimiser, sched = schedule.initial_schedule(config, rng)
        sched = sched.counted_from(optimiser)  # as relion_refine_mpi's leader counts the changes (ScheduleState)
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=1,
                           padding_factor=config.padding_factor, pdf_class=np.ones(1),
                           sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(particles.n_scale_groups))
        first = lowpass_to_ini_high(self.reference.astype(np.float64), config, box, pixel)
        model.maps = [[first.copy()], [first.copy()]]
        model.sigma2_noise = noise_spectra(particles, settings, n_optics)
        if not config.ini_high_angstrom:
            log.warning("no --ini_high: the reference is used unfiltered and the first image size is set for %.0f Å",
                        schedule.DEFAULT_START_RESOLUTION_ANGSTROM)
        starting = schedule.starting_resolution_angstrom(config)
        model.current_resolution_angstrom = schedule.current_resolution(
            box, pixel, iteration=0, ini_high_angstrom=starting).resolution_angstrom
        return RunState(model, optimiser, ParticleState.from_particles(particles, pixel),
                        rng, sched)

    def resume(self, run, particles, iteration_root):
        run.model.maps = [[mrc.read_volume(f"{iteration_root}_half{h}_class001.mrc")[0]] for h in (1, 2)]
        run.schedule = run.schedule.counted_from(run.optimiser)  # RELION's leader reads the iteration's sampling

    # ------------------------------------------------------------------ one iteration
    def plan(self, run, iteration, estimate_accuracy=None):
        config, model = self.config, run.model
        box, pixel = model.ori_size_px, model.pixel_size_angstrom
        optimiser = replace(run.optimiser, iteration=iteration)
        optimiser = schedule.check_convergence(optimiser, run.schedule,
                                               auto_ignore_angle_changes=config.auto_ignore_angles)
        final = optimiser.do_join_halves
        sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order, self.diameter_angstrom,
                                     box, pixel, run.schedule.incr_size_px, optimiser.has_high_fsc_at_resol_limit,
                                     final, ave_pmax=model.ave_pmax, oversampling=config.oversampling,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
        # --strict_highres_exp: the size both E-step passes compare (None: the current size)
        likelihood = schedule.likelihood_size_px(config.strict_highres_exp_angstrom, box, pixel, sizes.current_size_px)
        do_cc = iteration == 1 and config.firstiter_cc
        if not do_cc and model.sigma2_noise is not None:
            acc = self._accuracy(run, likelihood or sizes.current_size_px,
                                 estimate_accuracy or accuracy.estimate_on_host)
            optimiser = replace(optimiser, acc_rot_deg=acc.rotations_deg, acc_trans_angstrom=acc.translations_angstrom)
            model.accuracy_rotations_deg, model.accuracy_translations_angstrom = acc
        if iteration > 1:
            optimiser, run.schedule = schedule.update_sampling(
                optimiser, model, config, run.schedule, auto_ignore_angle_changes=config.auto_ignore_angles,
                auto_resolution_based_angles=config.auto_resol_angles)
        optimiser = schedule.perturbed(optimiser, run.rng)
        sampling = schedule.sampling_from_optimiser(optimiser, config)
        run.optimiser = optimiser
        units = [WorkUnit(f"half {h + 1}", self.members[h], np.zeros(1, np.int64),
                          self._setup(model, optimiser, sampling, sizes, likelihood, h, do_cc)) for h in (0, 1)]
        return loop.IterationPlan(iteration, sizes, sampling, do_cc, units, final)

    def _accuracy(self, run, compared_size_px, estimate):
        """RELION's estimate of the angular and translational accuracy (calculateExpectedAngularErrors, every
        iteration of an auto-refine but a --firstiter_cc one): half 1's map projected at the current poses of
        `accuracy_particles`, on the images the E-step compares (`em.accuracy.projected_accuracy`), made by
        `estimate` (`em.accuracy.Estimator`)."""
        config, model, poses = self.config, run.model, run.particles
        chosen = self.accuracy_particles
        request = accuracy.AccuracyRequest(
            [model.maps[0][0]], np.ones(1), model.sigma2_noise, chosen,
            np.stack([poses.rot_deg[chosen], poses.tilt_deg[chosen], poses.psi_deg[chosen]], axis=1),
            current_size_px=compared_size_px, padding_factor=config.padding_factor, do_ctf=config.do_ctf,
            ctf_intact_first_peak=config.ctf_intact_first_peak, seed=config.random_seed)
        return estimate(request, self.particles)

    def _setup(self, model, optimiser, sampling, sizes, likelihood_size_px, half, do_cc):
        config = self.config
        return IterationSetup(
            projectors=None, maps=[model.maps[half][0]], sigma2_noise=model.sigma2_noise, sampling=sampling,
            ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px, coarse_size_px=sizes.coarse_size_px,
            pixel_size_angstrom=model.pixel_size_angstrom, log_pdf_class=np.log(np.maximum(model.pdf_class, 1e-300)),
            sigma_offset_px=model.sigma_offset_angstrom / model.pixel_size_angstrom, do_cc=do_cc,
            adaptive_fraction=config.adaptive_fraction, max_significants=config.max_significants,
            local_searches=optimiser.local_searches, sigma_rot_deg=optimiser.sigma_rot_deg,
            sigma_psi_deg=optimiser.sigma_psi_deg, scale_correction=model.scale_correction if config.do_scale else None,
            data_vs_prior=None if model.ssnr is None else model.ssnr[half], padding_factor=config.padding_factor,
            avg_norm_correction=model.avg_norm_correction, likelihood_size_px=likelihood_size_px)

    @staticmethod
    def host_map_bytes(box_px):
        """The two half maps an M-step leaves on the host (float32)."""
        return [4 * box_px ** 3] * 2

    def maximization_groups(self, plan):
        """Each half's map is made where its sums are; the final iteration's joined map needs both halves'."""
        return [[(0, 0), (1, 0)]] if plan.final else [[(0, 0)], [(1, 0)]]

    def maximize(self, model, sums, plan, backend, peers=mstep.ALONE, parts=None):
        """RELION's maximization for two half sets: FSC, τ², maps and the other parameters.

        Runs on `backend` (estep.backend): on the GPU (CuPy FFTs, FSC and noise spectra on the device) for the GPU
        engine, with numpy otherwise; the maps come back to the host. Each half is on the device while it is
        worked on; where both do not fit, they take turns and the other waits on the host (`mstep.HalfSums`):
        first each half's low-resolution sums, averaged into both halves (RELION's joinTwoHalvesAtLowResolution,
        before the FSC as in RELION, so that the FSC is 1 there), then each half's part of the FSC, then each half's
        map.

        Under MPI each half's map is made by the worker that holds its sums, as on RELION's ranks (`sums` holds the
        volumes of the halves made here, None for the others; `peers` are the other workers): the makers share their
        low-resolution sums and each joins its half; half 2's maker gives its part of the FSC (the downsampled
        average, or the unregularised map with --solvent_correct_fsc) to half 1's maker, which computes the FSC for
        both; the maps are then shared, so that every worker holds both. The final iteration's joined map is made
        where both halves are.
        """
        config = self.config
        model = dataclasses.replace(model)
        joined = plan.final
        current = plan.sizes.current_size_px
        n_shells = model.n_shells
        xp = backend.array_module
        halves = mstep.HalfSums(sums, backend, model, config, current)
        masks = self._masks(model)
        join_low = config.low_resol_join_halves_angstrom > 0 and not joined  # RELION: 0 or less joins nothing
        first_here = 0 in halves.here  # this process computes the FSC
        fsc_inputs, low_joined = {}, None
        if join_low:  # RELION joins the halves at low resolution before their FSC (joinTwoHalvesAtLowResolution)
            low = {}
            for h in halves.order():
                bp = halves.backprojector(h)
                low[h] = mstep.low_resolution_sums(bp, config.low_resol_join_halves_angstrom, model)
                del bp
            low = mstep.gathered(peers, low)  # every worker holds both halves' low-resolution sums
            low_joined = mstep.averaged_low_resolution_sums(low[0], low[1])
            del low
        for i, h in enumerate(halves.order()):
            bp = halves.backprojector(h)
            if join_low:
                mstep.join_at_low_resolution(bp, low_joined, config.low_resol_join_halves_angstrom, model)
            if masks.correct_fsc:  # the unregularised half maps (host)
                fsc_inputs[h] = to_host(mstep.unregularised_map(bp, xp))
            elif (halves.parking and i == 0) or not first_here:  # leaves the device, or goes to half 1's maker
                fsc_inputs[h] = mstep.downsampled_average(bp)
            else:
                fsc_inputs[h] = (bp.data, bp.weight)
            del bp
        fsc_inputs.update(mstep.gathered(peers, {} if first_here else fsc_inputs))
        shared = None
        if first_here:
            shared = {"fsc": np.zeros(n_shells), "curves": None}
            if masks.correct_fsc:  # RELION: the FSC of the unregularised half maps, masked and corrected for the mask
                rng = np.random.default_rng([config.random_seed, plan.iteration])
                unfiltered = [xp.asarray(fsc_inputs[h]) for h in range(2)]
                curves = solvent_corrected_fsc(unfiltered[0], unfiltered[1], xp.asarray(masks.mask), rng, xp)
                del unfiltered
                shared["fsc"][:] = curves.corrected[:n_shells]
                shared["fsc"][current // 2 + 1:] = 0.0  # RELION: nothing beyond the current size
                shared["curves"] = curves
            else:
                fsc_part = mstep.half_sets_fsc(fsc_inputs[0], fsc_inputs[1], halves.grid, xp)
                shared["fsc"][: min(n_shells, fsc_part.size)] = fsc_part[:n_shells]
        del fsc_inputs, low_joined
        shared = mstep.gathered(peers, {"shared": shared} if first_here else {})["shared"]
        fsc, curves = shared["fsc"], shared["curves"]
        if curves is not None:
            model.fsc_unmasked, model.fsc_masked = curves.unmasked[None, :], curves.masked[None, :]
            model.fsc_random_masked = curves.random_masked[None, :]
            model.randomise_from_shell = curves.randomise_from_shell
            if curves.randomise_from_shell < 0 and first_here:
                log.warning("--solvent_correct_fsc: the FSC of the unmasked half maps never drops below 0.8; the "
                            "unmasked FSC is used (RELION does the same; it goes away as the resolution improves)")

        # the final iteration as RELION's: its maps are not solvent-flattened, and each half's map is the one written
        # as run_half?_class001_unfil.mrc, without τ² and masks (the joined map has τ² of the joined FSC)
        final_masks = dataclasses.replace(masks, flatten=False)

        def reconstruct(bp, whole):
            sigma2 = to_host(bp.noise_sigma2())[:n_shells]
            t2 = np.asarray(tau2_from_fsc(fsc, sigma2, config.tau2_fudge, whole_instead_of_half=whole))[:n_shells]
            if not joined:
                volume = mstep.reconstruct_map(bp, t2, model, config, xp, masks)
            elif whole:
                volume = mstep.reconstruct_map(bp, t2, model, config, xp, final_masks)
            else:
                volume = to_host_pinned(mstep.unregularised_map(bp, xp).astype(np.float32, copy=False))
            return volume, sigma2, t2

        made = {}
        for h in halves.order():
            bp = halves.backprojector(h)
            made[h] = reconstruct(bp, False)
            del bp
            if not joined:
                halves.release(h)
        # the final iteration's map of both halves: one half's sums added into the other's (their maps are made)
        model.joined_map = reconstruct(halves.joined(), True)[0] if joined and len(halves.here) == 2 else None
        del halves
        made = mstep.gathered(peers, made)  # every worker holds both maps
        tau2 = np.zeros((2, 1, n_shells))
        ssnr = np.zeros((2, 1, n_shells))
        ref_sigma2 = np.zeros((2, 1, n_shells))
        maps = [None, None]
        for h, (volume, sigma2, t2) in made.items():
            tau2[h, 0, : t2.size] = t2
            ref_sigma2[h, 0, : sigma2.size] = sigma2
            s = np.asarray(ssnr_from_fsc(fsc, config.tau2_fudge, whole_instead_of_half=joined))
            ssnr[h, 0, : s.size] = s[:n_shells]
            maps[h] = [volume]
        model.maps = maps
        model.tau2, model.ssnr, model.reference_sigma2, model.fsc_halves = tau2, ssnr, ref_sigma2, fsc[None, :]
        mstep.maximize_other_parameters(model, config, sums, plan.do_cc)
        model.class_distribution = np.ones(1)
        model.pdf_direction = half_direction_distributions(sums)
        return model

    def _masks(self, model):
        if self.masks is None:  # an MPI worker's first M-step: the master has checked the files
            self.masks = SolventMasks.for_model(self.config, model)
        return self.masks

    def update(self, run, plan, changes):
        config, model = self.config, run.model
        fsc = model.fsc_halves[0]
        optimiser, run.schedule = schedule.update_size_flags_from_fsc(run.optimiser, run.schedule, fsc,
                                                                      plan.sizes.current_size_px)
        res = schedule.current_resolution(model.ori_size_px, model.pixel_size_angstrom, fsc_halves=fsc,
                                          tau2_fudge=config.tau2_fudge, halves_joined=plan.final,
                                          iteration=plan.iteration, ini_high_angstrom=config.ini_high_angstrom,
                                          firstiter_cc=config.firstiter_cc)
        optimiser = schedule.update_change_counters(
            optimiser, changes.orientations_deg, changes.offsets_angstrom, changes.classes, res.resolution_angstrom,
            previous_resolution_angstrom=model.current_resolution_angstrom,
            pixel_size_angstrom=model.pixel_size_angstrom, oversampling=config.oversampling, counted=run.schedule)
        model.current_resolution_angstrom = res.resolution_angstrom
        run.optimiser = replace(optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)

    def finished(self, run, plan):
        return plan.final

    def summary(self, run, plan, changes):
        optimiser, sampling, pixel = run.optimiser, plan.sampling, run.model.pixel_size_angstrom
        return (f"resolution {run.model.current_resolution_angstrom:.2f} Å, size {plan.sizes.current_size_px}/"
                f"{plan.sizes.coarse_size_px} px, healpix {optimiser.healpix_order}"
                f"{' (local)' if optimiser.local_searches else ''}, offsets {sampling.offset_range_px * pixel:.2f} Å "
                f"by {sampling.offset_step_px * pixel:.2f} Å ({sampling.n_translations} translations), "
                f"Δangle {changes.orientations_deg:.2f}°, Δoffset {changes.offsets_angstrom:.2f} Å, "
                f"pmax {run.model.ave_pmax:.3f}")

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def _angdist_write(path, pdf_direction, model, sampling, iteration):
        """The write of RELION's `*_class001_angdist.bild` at `path` (`write_angdist_bild`) for one half's (or the
        joined) direction distribution over the directions of `sampling`, the iteration's; None where there is none
        (an iteration continued from files written before the distribution was kept)."""
        if pdf_direction is None:
            return None
        directions = np.asarray(sampling.directions_deg())
        pdf = np.asarray(pdf_direction).reshape(-1)
        if pdf.size != len(directions):
            log.warning("iteration %d: the direction distribution has %d directions, the sampling %d; no %s",
                        iteration, pdf.size, len(directions), path)
            return None
        return partial(write_angdist_bild, path, pdf, directions[:, 0], directions[:, 1], model.ori_size_px,
                       model.pixel_size_angstrom, sampling.healpix_order)

    def _joined_direction_distribution(self, model):
        """The direction distribution of all particles (the final model's): the halves' weighted by their sizes."""
        if model.pdf_direction is None:
            return None
        sizes = np.array([m.size for m in self.members], dtype=np.float64)
        halves = np.asarray(model.pdf_direction, dtype=np.float64).reshape(2, 1, -1)
        return np.tensordot(sizes / sizes.sum(), halves, axes=1)

    def _half_model_blocks(self, model, optimiser, root, half, pdf_direction):
        """The blocks of `root`_half`half`_model.star (`job_model_star_blocks`): model_groups counts the half set's
        particles, as RELION's (the half's workers count theirs, MlOptimiserMpi::initialiseWorkLoad)."""
        return job_model_star_blocks(self.particles, model, optimiser, self.config, [f"{root}_half{half}_class001.mrc"],
                                     half=half, members=self.members[half - 1], pdf_direction=pdf_direction)

    def _particle_table(self, snapshot, pixel):
        particles = self.particles
        return particle_table(particles.star.particles, snapshot, self.halves, pixel,
                              group_number=particles.scale_group_index + 1)

    def initial_outputs(self, run, argv, under_mpi):
        """RELION's files of iteration 0, before iteration 1 (MlOptimiserMpi::initialise; an auto-refine runs only
        under MPI in RELION, so `under_mpi` changes nothing): run_it000_data.star (the particles as read, with their
        half sets), run_it000_half{1,2}_class001.mrc (the starting map), run_it000_half{1,2}_model.star and
        run_it000_half{1,2}_class001_angdist.bild (uniform direction distributions), run_it000_sampling.star, then
        run_it000_optimiser.star. Each half's model.star has the initial noise spectra and RELION's starting τ² and
        data versus prior of that half's particles (`em.references.initial_data_versus_prior`)."""
        config, model, optimiser = self.config, run.model, run.optimiser
        root = iteration_root(config.output_root, 0)
        pixel = model.pixel_size_angstrom
        particles = self.particles
        sampling = schedule.sampling_from_optimiser(optimiser, config)
        uniform = np.full((1, sampling.n_directions), 1.0 / sampling.n_directions)
        frozen, sizes = replace(model), [self.members[h].size for h in (0, 1)]  # the loop goes on meanwhile

        def model_stars():  # on the writer's thread; both halves' starting map is transformed once where one
            tau2 = initial_tau2([frozen.maps[0][0], frozen.maps[1][0]], config.tau2_fudge)
            data_vs_prior = [initial_data_versus_prior(frozen.maps[h], frozen.sigma2_noise, sizes[h], np.ones(1),
                                                       config.tau2_fudge, tau2=tau2[h:h + 1])[1][0] for h in (0, 1)]
            written = replace(frozen, tau2=tau2[:, None], ssnr=np.stack(data_vs_prior)[:, None])
            for h in (1, 2):
                write_star(self._half_model_blocks(written, optimiser, root, h, uniform), f"{root}_half{h}_model.star")

        writes = [data_star_write(particles.star, f"{root}_data.star",
                          self._particle_table(run.particles.copy(), pixel))]
        for h in (1, 2):
            writes += [partial(mrc.write_volume, f"{root}_half{h}_class001.mrc", model.maps[h - 1][0], pixel),
                       self._angdist_write(f"{root}_half{h}_class001_angdist.bild", uniform, model, sampling, 0)]
        writes += [model_stars,
                   partial(write_sampling_star, f"{root}_sampling.star", sampling, optimiser, config, pixel)]
        return [Together([write for write in writes if write is not None]),
                partial(write_optimiser_star, f"{root}_optimiser.star",
                        optimiser_star_blocks(optimiser, model, config, str(config.output_root), 0), list(argv))]

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        """The iteration's files as callables over what they need now (the particle table and the STAR blocks are
        built here; the maps are the model's, which the next M-step replaces rather than changes); the optimiser
        STAR file comes last. The final iteration writes the converged run's files instead (`_final_outputs`)."""
        if plan.final:
            return self._final_outputs(run, plan, snapshot, timings, stages, argv)
        config, model, optimiser = self.config, run.model, run.optimiser
        root = iteration_root(config.output_root, plan.iteration)
        pixel = model.pixel_size_angstrom
        particles = self.particles
        halves_pdf = (None if model.pdf_direction is None
                      else np.asarray(model.pdf_direction, dtype=np.float64).reshape(2, 1, -1))
        writes = [data_star_write(particles.star, f"{root}_data.star",
                          self._particle_table(snapshot, pixel))]
        for h in (1, 2):
            pdf = None if halves_pdf is None else halves_pdf[h - 1]
            writes += [partial(mrc.write_volume, f"{root}_half{h}_class001.mrc", model.maps[h - 1][0], pixel),
                       partial(write_star, self._half_model_blocks(model, optimiser, root, h, pdf),
                               f"{root}_half{h}_model.star")]
            writes.append(self._angdist_write(f"{root}_half{h}_class001_angdist.bild", pdf, model, plan.sampling,
                                              plan.iteration))
        writes += [partial(write_sampling_star, f"{root}_sampling.star", plan.sampling, optimiser, config, pixel),
                   self._report_write(f"{root}_report.png", run, plan, snapshot, timings, stages)]
        writes = [write for write in writes if write is not None]
        # side by side (each its own file), then the optimiser STAR file, which --continue reads
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_star_blocks(
            optimiser, model, config, str(config.output_root), plan.iteration), list(argv))]

    def _final_outputs(self, run, plan, snapshot, timings, stages, argv):
        """The final iteration's files, as RELION's MlOptimiserMpi::iterate writes them once the halves are joined
        (its iteration number set to -1): the converged run's files without an iteration number, and no
        run_itNNN_* file. The half maps are the unregularised ones (`maximize`); run_optimiser.star comes last."""
        config, model, optimiser = self.config, run.model, run.optimiser
        out_root = config.output_root
        pixel = model.pixel_size_angstrom
        particles = self.particles
        joined_pdf = self._joined_direction_distribution(model)
        # written, as RELION's, by the first worker of half 1: its model_groups count half 1's particles
        joined = job_model_star_blocks(particles, model, optimiser, config, [f"{out_root}_class001.mrc"],
                                       members=self.members[0], pdf_direction=joined_pdf)
        writes = [data_star_write(particles.star, f"{out_root}_data.star",
                          self._particle_table(snapshot, pixel)),
                  partial(mrc.write_volume, f"{out_root}_class001.mrc", model.joined_map, pixel),
                  *(partial(mrc.write_volume, f"{out_root}_half{h}_class001_unfil.mrc", model.maps[h - 1][0], pixel)
                    for h in (1, 2)),
                  partial(write_star, joined, f"{out_root}_model.star"),
                  self._angdist_write(f"{out_root}_class001_angdist.bild", joined_pdf, model, plan.sampling,
                                      plan.iteration),
                  partial(write_sampling_star, f"{out_root}_sampling.star", plan.sampling, optimiser, config, pixel),
                  self._report_write(f"{out_root}_report.png", run, plan, snapshot, timings, stages)]
        return [Together([write for write in writes if write is not None]),
                partial(write_optimiser_star, f"{out_root}_optimiser.star",
                        optimiser_star_blocks(optimiser, model, config, str(out_root)), list(argv))]

    @staticmethod
    def _report_write(path, run, plan, snapshot, timings, stages):
        model = run.model
        return InOwnProcess(partial(write_iteration_report, path, iteration=plan.iteration,
                                    fsc=np.array(model.fsc_halves[0]), ori_size_px=model.ori_size_px,
                                    pixel_size_angstrom=model.pixel_size_angstrom,
                                    resolution_angstrom=model.current_resolution_angstrom,
                                    rot_deg=snapshot.rot_deg, tilt_deg=snapshot.tilt_deg,
                                    timings_seconds={**{f"E: {k}": v for k, v in stages.items()},
                                                     "M-step": timings["maximization"]},
                                    halves_joined=plan.final))

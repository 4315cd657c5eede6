"""3D classification into K classes (relion_refine --K N, without --auto_refine).

All particles form one set; K references are refined side by side. RELION's rules:
- references: a single map is copied to all K classes (low-passed to --ini_high); in the first
  likelihood iteration (the second with --firstiter_cc) every particle is compared with one
  class drawn at random, so each class is rebuilt from a random ~1/K of the data ("seeds"); a
  STAR file of maps (rlnReferenceImage) gives one class per map and no seeds;
- with --firstiter_cc the first iteration uses class 1 alone (cross-correlation), and its map,
  low-passed to --ini_high again, is copied to every class;
- τ² of a class is the power spectrum of its previous reference (as the projector computes it);
  the reconstruction adds 1/(pf³·tau2_fudge·τ²) to the weights from shell 5 on; the SSNR (data vs prior) is
  tau2_fudge·τ²/σ²_reconstruction; the resolution is where the best class's SSNR drops below 1;
- the class distribution is Σw per class and the class prior of the next search (RELION's prior is
  the joint distribution of classes and directions; it is written to the model file, after a
  cross-correlation iteration class 1's for every class, but not used as a prior: on two-state
  sets it put fewer particles in their true class); the sampling stays as given (no auto-sampling), except
  that the fine pass samples one order finer (orientations and translations) once the average pmax reaches 0.5,
  while the E-step compares less than the box and RELION's fine step resolves less than the box's Nyquist, or
  else from the iteration after the share of particles changing class stops falling where that step resolves
  less than the E-step compares (`schedule.classification_sampling_raised`; --relion_oversampling keeps
  RELION's), and every one of --iter iterations runs (no convergence test); --iter counts from the start of
  the run (a --continue from iteration N runs N+1 … --iter);
- --skip_align: the poses and origins of the STAR file are kept, only the class is searched (one
  orientation and one translation per particle, `em.given_poses`; a single pass at the current
  image size, no oversampling, no perturbation);
- --sigma_ang (σ of rot, tilt and psi) or --sigma_psi alone: local searches of ±3σ around each
  particle's pose (the STAR file's in the first iteration, the previous iteration's after), with
  Gaussian priors, on the HEALPix grid of --healpix_order; as in RELION, --sigma_ang sets all three;
- --flatten_solvent with --solvent_mask / --solvent_mask2: the class maps are masked after each
  M-step as in refine (`em.solvent`);
- --sym, as in refine: directions of the asymmetric unit, every class's sums symmetrised before
  its reconstruction (the direction distribution then counts the unit's directions).
Each iteration's E-step is one work unit of all particles against all classes, or, in the
cross-correlation iteration, against class 1, or, in the seeding iteration, one unit per class
of the particles drawn for it. Outputs per iteration: run_itNNN_data.star (rlnClassNumber),
run_itNNN_classKKK.mrc, run_itNNN_model.star (K classes), run_itNNN_optimiser.star,
run_itNNN_sampling.star, and run_itNNN_report.png (class distributions and the share of particles
that changed class over the iterations, each class's resolution over the iterations, SSNR per class,
orientations). Before iteration 1, as RELION writes them, the files of iteration 0 (run_it000_*: the particles as
read, the starting maps, the model with uniform class and direction distributions, the initial noise spectra and
RELION's starting τ² and data-versus-prior spectra, the direction distributions' bild files, the optimiser.star, and
under mpirun, as relion_refine_mpi, the sampling.star); --continue can start from its optimiser.star.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np

from cryorefine.core.arrays import to_host, to_host_pinned
from cryorefine.core.projector import Projector
from cryorefine.em import loop, mstep, schedule
from cryorefine.em.estep import WorkUnit, fine_pass_limits_reached
from cryorefine.em.given_poses import GivenPoses
from cryorefine.em.references import initial_data_versus_prior, lowpass_to_ini_high, read_reference
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState, ParticleState, RunState
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup, WeightedSums
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
from cryorefine.io.star import read_star, write_star
from cryorefine.jobs.refine import INITIAL_SIGMA_OFFSET_ANGSTROM
from cryorefine.report import write_classification_report

log = logging.getLogger("cryorefine.classify")
#: RELION refuses --fast_subsets with fewer iterations than this (here a warning)
FAST_SUBSETS_RELION_MIN_ITERATIONS = 20
#: the random stream of --fast_subsets' draws (apart from the seeds' draws of the same iteration)
FAST_SUBSETS_STREAM = 1


def run(config, runner, argv=(), progress=None, resume_from=None, stop_requested=None, overwrite=False):
    """Run a 3D classification of config.n_classes classes with `runner`; the IterationReports (None on an MPI
    worker). `resume_from`: a run_itNNN_optimiser.star of an earlier run, continued from the iteration after it."""
    return loop.run(ClassifyJob(config), runner, argv, progress, resume_from, stop_requested, overwrite)


def classification_summary(run: RunState, plan, changes, angle_name: str = "angle") -> str:
    """An iteration's log line of a classification: resolution, sizes, class shares, the changes of the hidden
    variables (the angle's as Δ`angle_name`) and the average pmax."""
    model = run.model
    return (f"resolution {model.current_resolution_angstrom:.2f} Å, size {plan.sizes.current_size_px}/"
            f"{plan.sizes.coarse_size_px} px, classes {' '.join(f'{100 * p:.0f}%' for p in model.pdf_class)}, "
            f"Δ{angle_name} {changes.orientations_deg:.2f}°, Δoffset {changes.offsets_angstrom:.2f} Å, "
            f"Δclass {changes.classes:.3f}, pmax {model.ave_pmax:.3f}")


def initial_references(config, box, pixel):
    """K maps (float64) and whether they came from one map (then iteration 1 or 2 draws random seeds). From one map,
    the classes share one read-only array: the M-step replaces maps and nothing changes one in place, so K copies of
    a 360 px map (2.2 GB) would only cost the start their time."""
    path = Path(config.reference_map)
    if path.suffix.lower() == ".star":
        table = read_star(path)
        rows = next((b for b in table.values() if hasattr(b, "columns") and "rlnReferenceImage" in b.columns), None)
        if rows is None:
            raise InputError(f"{path}: no rlnReferenceImage column; give a map, or a STAR file listing one map per "
                             f"class")
        names = [str(n) for n in rows["rlnReferenceImage"]]
        if len(names) != config.n_classes:
            raise InputError(f"{path}: lists {len(names)} maps but --K is {config.n_classes}; give --K {len(names)}")
        maps = [lowpass_to_ini_high(read_reference(path.parent / n, box, pixel, config.trust_ref_size)
                                    .astype(np.float64), config, box, pixel) for n in names]
        return maps, False
    single = lowpass_to_ini_high(read_reference(path, box, pixel, config.trust_ref_size).astype(np.float64), config,
                                 box, pixel)
    single.setflags(write=False)
    return [single] * config.n_classes, config.n_classes > 1


def class_angdist_writes(root: str, model: ModelState, sampling, iteration: int) -> list:
    """The writes of RELION's `root`_classKKK_angdist.bild of each class of a 3D model (its direction distribution
    over the directions of `sampling`, the iteration's); none where the model has no distribution, or one of other
    directions (a warning)."""
    if model.pdf_direction is None:
        return []
    directions = np.asarray(sampling.directions_deg())
    pdf = np.asarray(model.pdf_direction).reshape(model.n_classes, -1)
    if pdf.shape[1] != len(directions):
        log.warning("iteration %d: the direction distribution has %d directions, the sampling %d; no "
                    "*_angdist.bild written", iteration, pdf.shape[1], len(directions))
        return []
    return [partial(write_angdist_bild, f"{root}_class{k + 1:03d}_angdist.bild", pdf[k], directions[:, 0],
                    directions[:, 1], model.ori_size_px, model.pixel_size_angstrom, sampling.healpix_order)
            for k in range(model.n_classes)]


class ClassifyJob:
    """The classification as the iteration loop (`em.loop`) runs it. Its extras, per iteration so far: the
    class distribution (`class_distributions`), the share of particles that changed class (`class_changes`)
    and each class's resolution in Å (`class_resolutions`); and whether the classes start from seeds
    (`seeded`)."""

    kind = "classify"
    min_mpi_ranks = 2  # a master and a worker

    def __init__(self, config):
        self.config = config
        self.particles = None
        self.masks = None  # em.solvent.SolventMasks, read by load (on an MPI worker: at its first M-step)
        self.fine_step_said = False  # the warning that the fine angular step is coarse is given once

    # ------------------------------------------------------------------ set-up
    def load(self):
        config = self.config
        particles, settings = loop.particles_and_settings(config)
        self.diameter_angstrom = settings.particle_diameter_angstrom
        self.masks = SolventMasks.from_config(config, settings.ori_size_px, settings.pixel_size_angstrom,
                                              self.diameter_angstrom, say=True)
        if config.skip_align and (config.sigma_ang_deg or config.sigma_psi_deg or config.sigma_rot_deg
                                  or config.sigma_tilt_deg):
            raise InputError("--skip_align and --sigma_ang/--sigma_psi/--sigma_rot/--sigma_tilt exclude each other: "
                             "--skip_align keeps the poses, local searches refine them; give one")
        if not config.sigma_ang_deg and bool(config.sigma_rot_deg) != bool(config.sigma_tilt_deg):
            given, other = ("--sigma_rot", "--sigma_tilt") if config.sigma_rot_deg else ("--sigma_tilt", "--sigma_rot")
            raise InputError(f"{given} without {other}: a prior on {given[8:]} alone is not implemented; give both "
                             f"(the directions' σ is the larger, as in RELION) or --sigma_ang")
        for option, value in (("--sigma_psi", config.sigma_psi_deg), ("--sigma_rot", config.sigma_rot_deg),
                              ("--sigma_tilt", config.sigma_tilt_deg)):
            if config.sigma_ang_deg and value:
                log.info("%s %g: --sigma_ang %g sets the σ of all three angles (RELION's rule); %s is not used",
                         option, value, config.sigma_ang_deg, option)
        angles = {"rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi"}
        if (config.skip_align or self.local_sigmas()) and not angles <= set(particles.pose_columns):
            raise InputError(f"{config.input_star}: no rlnAngleRot/rlnAngleTilt/rlnAnglePsi columns; "
                             f"{'--skip_align' if config.skip_align else 'local searches'} need the poses "
                             f"of an earlier refinement (its run_data.star)")
        if config.allow_coarser_sampling and config.n_classes == 1:
            log.info("--allow_coarser_sampling: changes nothing with one class (--K 1), as in RELION")
        if config.fast_subsets and config.max_iterations < FAST_SUBSETS_RELION_MIN_ITERATIONS:
            log.warning("--fast_subsets with --iter %d: RELION runs its subsets only with --iter %d or more (they take "
                        "the first 15 iterations); here the %d iterations take them", config.max_iterations,
                        FAST_SUBSETS_RELION_MIN_ITERATIONS, config.max_iterations)
        self.particles = particles
        return particles, settings

    def local_sigmas(self):
        """(σ of rot, σ of tilt, σ of psi) in degrees of --sigma_ang, --sigma_rot with --sigma_tilt, --sigma_psi
        (RELION's parseInitial: --sigma_ang sets all three; each other one its own angle), or None without local
        searches; 0 searches that angle fully. The directions are searched with σ the larger of rot's and tilt's
        (RELION's selectOrientationsWithNonZeroPriorProbability, both given)."""
        config = self.config
        if config.sigma_ang_deg:
            return (float(config.sigma_ang_deg),) * 3
        if config.sigma_rot_deg or config.sigma_psi_deg:
            return float(config.sigma_rot_deg or 0.0), float(config.sigma_tilt_deg or 0.0), float(config.sigma_psi_deg
                                                                                                  or 0.0)
        return None

    def start(self, particles, settings, noise_spectra):
        config = self.config
        rng = np.random.default_rng(config.random_seed)  # the run's draws: the sampling's perturbations first
        k_classes = int(config.n_classes)
        if k_classes > len(particles):
            log.warning("--K %d with %d particles: %d classes or more will hold no particle; give --K %d or fewer",
                        k_classes, len(particles), k_classes - len(particles), len(particles))
        box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
        maps, seeded = initial_references(config, box, pixel)
        n_optics = len(particles.optics_groups)
        optimiser, _ = schedule.initial_schedule(config, rng)
        sigmas = self.local_sigmas()
        if sigmas is not None:  # RELION's PRIOR_ROTTILT_PSI from the first iteration on
            optimiser = replace(optimiser, local_searches=True, sigma_rot_deg=sigmas[0], sigma_tilt_deg=sigmas[1],
                                sigma_psi_deg=sigmas[2])
        # --skip_align: RELION's sampling has one direction, so the direction distribution has one entry
        n_dir = 1 if config.skip_align else schedule.sampling_from_optimiser(optimiser, config).n_directions
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=k_classes,
                           padding_factor=config.padding_factor, pdf_class=np.full(k_classes, 1.0 / k_classes),
                           sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(particles.n_scale_groups),
                           pdf_direction=np.full((k_classes, n_dir), 1.0 / (k_classes * n_dir)))
        model.maps = [maps]
        model.sigma2_noise = noise_spectra(particles, settings, n_optics)
        starting = schedule.starting_resolution_angstrom(config)
        model.current_resolution_angstrom = schedule.current_resolution(
            box, pixel, iteration=0, ini_high_angstrom=starting).resolution_angstrom
        return RunState(model, optimiser, ParticleState.from_particles(particles, pixel),
                        rng,
                        extras={"class_distributions": np.zeros((0, k_classes)), "class_changes": np.zeros(0),
                                "class_resolutions": np.zeros((0, k_classes)), "seeded": seeded})

    def resume(self, run, particles, iteration_root):
        run.extras["seeded"] = bool(run.extras["seeded"])
        run.model.maps = [[mrc.read_volume(f"{iteration_root}_class{k + 1:03d}.mrc")[0]
                           for k in range(self.config.n_classes)]]

    # ------------------------------------------------------------------ one iteration
    def plan(self, run, iteration, estimate_accuracy=None):
        config, model = self.config, run.model
        k_classes = int(config.n_classes)
        optimiser = replace(run.optimiser, iteration=iteration)
        sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order, self.diameter_angstrom,
                                     model.ori_size_px, model.pixel_size_angstrom, config.incr_size_px, False, False,
                                     ave_pmax=model.ave_pmax, oversampling=config.oversampling,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        if config.skip_align:  # RELION: no oversampling, so one pass at the current size
            sizes = schedule.ImageSizes(sizes.current_size_px, sizes.current_size_px)
        model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
        # --strict_highres_exp: the size both E-step passes compare (None: the current size)
        likelihood = schedule.likelihood_size_px(config.strict_highres_exp_angstrom, model.ori_size_px,
                                                 model.pixel_size_angstrom, sizes.current_size_px)
        do_cc = iteration == 1 and config.firstiter_cc
        if config.allow_coarser_sampling and k_classes > 1 and not (config.skip_align or self.local_sigmas()):
            optimiser = self._coarser_sampling(optimiser, model, sizes, likelihood, do_cc)
        if not config.skip_align:  # RELION does not perturb the poses it keeps
            optimiser = schedule.perturbed(optimiser, run.rng)
        sampling = schedule.sampling_from_optimiser(optimiser, config)
        global_search = not (config.skip_align or self.local_sigmas())
        if global_search and not do_cc:
            sampling = self._fine_sampling(run, iteration, sampling, likelihood or sizes.current_size_px, model)
        # the order `_fine_sampling` may raise the fine pass to later: the GPU engine compiles its kernels ahead
        ahead = config.oversampling + 1 if global_search and not self._finer_sampling_settled(run) else None
        run.optimiser = optimiser
        raised = sampling.oversampling > config.oversampling
        everyone = self._subset(iteration, len(run.particles.rot_deg))
        seeds_now = run.extras["seeded"] and iteration == (2 if config.firstiter_cc else 1)
        poses = run.particles

        def unit(name, members, classes, class_prior):
            searched = (GivenPoses.of(poses.rot_deg, poses.tilt_deg, poses.psi_deg, members) if config.skip_align
                        else sampling)
            return WorkUnit(name, members, np.asarray(classes, dtype=np.int64),
                            self._setup(model, searched, sizes, likelihood, classes, do_cc, class_prior, optimiser,
                                        next_oversampling=ahead, fine_pass_raised=raised))

        if do_cc:  # class 1 alone, all particles
            units = [unit("class 1 (cross-correlation)", everyone, [0], False)]
        elif seeds_now:  # each particle against one random class
            draw = np.random.default_rng(config.random_seed + iteration).integers(0, k_classes, everyone.size)
            units = [unit(f"class {k + 1} seeds", np.flatnonzero(draw == k), [k], False) for k in range(k_classes)]
        else:
            units = [unit("all classes", everyone, list(range(k_classes)), True)]
        return loop.IterationPlan(iteration, sizes, sampling, do_cc, units)

    def _coarser_sampling(self, optimiser, model, sizes, likelihood_size_px, do_cc):
        """--allow_coarser_sampling: the accuracy of the images the E-step compares (not estimated in a
        cross-correlation iteration, nor before the first M-step), and the steps it allows
        (`schedule.coarser_sampling`); said where they change."""
        config = self.config
        if not do_cc and model.tau2 is not None:
            acc = schedule.estimated_accuracy_from_model(model, likelihood_size_px or sizes.current_size_px,
                                                         self.diameter_angstrom, do_ctf=config.do_ctf)
            optimiser = replace(optimiser, acc_rot_deg=acc.rotations_deg, acc_trans_angstrom=acc.translations_angstrom)
            model.accuracy_rotations_deg, model.accuracy_translations_angstrom = acc
        coarser = schedule.coarser_sampling(optimiser, config, particle_diameter_angstrom=self.diameter_angstrom,
                                            resolution_angstrom=model.current_resolution_angstrom,
                                            pixel_size_angstrom=model.pixel_size_angstrom, cc_iteration=do_cc)
        if (coarser.healpix_order, coarser.offset_step_px) != (optimiser.healpix_order, optimiser.offset_step_px):
            log.info("--allow_coarser_sampling: iteration %d samples HEALPix order %d (%.3g°) and offsets of %.3g px "
                     "(accuracy %.3g°, %.3g Å)", optimiser.iteration, coarser.healpix_order,
                     schedule.angular_step_deg(coarser.healpix_order), coarser.offset_step_px,
                     optimiser.acc_rot_deg, optimiser.acc_trans_angstrom)
        return coarser

    def _subset(self, iteration, n_particles):
        """The particles of this iteration's E-step: all, or with --fast_subsets RELION's random subset
        (`schedule.fast_subset_size`), drawn afresh each iteration from --random_seed; the others keep their poses
        and classes."""
        config = self.config
        size = schedule.fast_subset_size(iteration, config.n_classes, n_particles) if config.fast_subsets else None
        if size is None:
            return np.arange(n_particles)
        log.info("--fast_subsets: iteration %d takes %d random particles of %d", iteration, size, n_particles)
        draw = np.random.default_rng([config.random_seed, iteration, FAST_SUBSETS_STREAM])
        return np.sort(draw.permutation(n_particles)[:size])

    def _finer_sampling_settled(self, run):
        """Whether the fine pass's order is settled for the rest of the run: raised already, dropped for good
        (`_drop_finer_sampling_where_too_broad`), or RELION's throughout (--relion_oversampling)."""
        return bool(self.config.relion_oversampling or run.extras.get("finer_sampling_from")
                    or run.extras.get("finer_sampling_dropped"))

    def _fine_sampling(self, run, iteration, sampling, compared_size_px, model):
        """`sampling` at one order of oversampling finer from the iteration `schedule.classification_sampling_raised`
        says on (not with --relion_oversampling); says so once, with its reason, and warns once where the step used
        is still too coarse for the size the E-step compares."""
        config = self.config
        k = config.oversampling

        def step_at(oversampling, size_px=compared_size_px):
            return schedule.fine_step(sampling.healpix_order, oversampling, self.diameter_angstrom, size_px,
                                      model.ori_size_px, model.pixel_size_angstrom)

        step = step_at(k)
        # the most the E-step may compare: the box, or --strict_highres_exp's size
        ceiling_px = schedule.likelihood_size_px(config.strict_highres_exp_angstrom, model.ori_size_px,
                                                 model.pixel_size_angstrom, model.ori_size_px) or model.ori_size_px
        ceiling = step_at(k, ceiling_px)
        raised = int(run.extras.get("finer_sampling_from", 0))
        # a --firstiter_cc iteration's pmax (1) says nothing of the likelihood's posteriors
        pmax = None if config.firstiter_cc and iteration == 2 else model.ave_pmax
        why = None if self._finer_sampling_settled(run) else schedule.classification_sampling_raised(
            run.extras["class_changes"], pmax, step, ceiling)
        if why:
            raised = run.extras["finer_sampling_from"] = iteration
            if why == schedule.RAISED_AT_STALL:
                reason = (f"the share of particles changing class has stopped falling "
                          f"({run.extras['class_changes'][-1]:.3f}, average pmax {model.ave_pmax:.2f}), and "
                          f"RELION's {step.step_deg:.3g}° resolves {step.resolves_angstrom:.1f} Å at the particle's "
                          f"edge, less than the {step.compared_angstrom:.1f} Å compared ({compared_size_px} px)")
            else:
                reason = (f"the E-step compares {step.compared_angstrom:.1f} Å ({compared_size_px} of {ceiling_px} "
                          f"px), so the resolution can still grow, and RELION's {step.step_deg:.3g}° resolves "
                          f"{step.resolves_angstrom:.1f} Å at the particle's edge, less than the "
                          f"{ceiling.compared_angstrom:.1f} Å that {ceiling_px} px hold (average pmax "
                          f"{model.ave_pmax:.2f})")
            log.info("from iteration %d on the fine pass samples one order finer (%.3g°, %.3g px): %s; "
                     "--relion_oversampling keeps RELION's", iteration, sampling.angular_sampling_deg(k + 1),
                     sampling.offset_sampling_px(k + 1), reason)
        if raised:
            k += 1
            step = step_at(k)
        if step.too_coarse and (raised or config.relion_oversampling) and not self.fine_step_said:
            self.fine_step_said = True
            log.warning("the fine angular step (%.3g°, --healpix_order %d, oversampling %d) resolves %.1f Å at the "
                        "particle's edge, less than the %.1f Å the E-step compares from iteration %d on (%d px): "
                        "particles may change class on their poses' errors from one iteration to the next; "
                        "%s--healpix_order %d samples finer", step.step_deg, sampling.healpix_order, k,
                        step.resolves_angstrom, step.compared_angstrom, iteration, compared_size_px,
                        f"--oversampling {k + 1} or " if config.relion_oversampling else "",
                        sampling.healpix_order + 1)
        return replace(sampling, oversampling=k) if raised else sampling

    def _setup(self, model, sampling, sizes, likelihood_size_px, classes, do_cc, class_prior, optimiser,
               next_oversampling=None, fine_pass_raised=False):
        """The engine set-up of a unit of `classes`; the class prior is the class distribution where
        `class_prior`, else flat. RELION's prior in global searches is instead the joint distribution of
        classes and directions of the last M-step (pdf_direction); measured on two-state sets
        (benchmarks/classify_accuracy.py), it put fewer particles in their true class, so it is kept and written
        but not used. Local searches with the optimiser's σ (--sigma_ang, --sigma_psi); with --skip_align the
        engines' local-search path restricted by `em.given_poses.GivenPoses` to each particle's own pose."""
        config = self.config
        with np.errstate(divide="ignore"):
            log_class = (np.log(np.asarray(model.pdf_class, dtype=np.float64)[classes]) if class_prior
                         else np.zeros(len(classes)))
        return IterationSetup(
            projectors=None, maps=[model.maps[0][k] for k in classes], sigma2_noise=model.sigma2_noise,
            sampling=sampling, ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px,
            coarse_size_px=sizes.coarse_size_px, pixel_size_angstrom=model.pixel_size_angstrom,
            log_pdf_class=log_class, sigma_offset_px=model.sigma_offset_angstrom / model.pixel_size_angstrom,
            do_cc=do_cc, adaptive_fraction=config.adaptive_fraction, max_significants=config.max_significants,
            scale_correction=model.scale_correction if config.do_scale else None,
            data_vs_prior=None if model.ssnr is None else model.ssnr[0][classes],
            padding_factor=config.padding_factor, avg_norm_correction=model.avg_norm_correction,
            local_searches=bool(config.skip_align or optimiser.local_searches),
            sigma_rot_deg=max(optimiser.sigma_rot_deg, optimiser.sigma_tilt_deg), sigma_psi_deg=optimiser.sigma_psi_deg,
            likelihood_size_px=likelihood_size_px, next_oversampling=next_oversampling,
            fine_pass_raised=fine_pass_raised)

    def host_map_bytes(self, box_px):
        """The K class maps an M-step leaves on the host (float32)."""
        return [4 * box_px ** 3] * int(self.config.n_classes)

    def maximization_groups(self, plan):
        """Every class's map is made apart (under MPI by one of its unit's workers, the classes shared out)."""
        return [[(u, i)] for u, unit in enumerate(plan.units) for i in range(len(unit.classes))]

    def maximize(self, model, sums, plan, backend, peers=mstep.ALONE, parts=None):
        """Per class: τ² of the previous reference, reconstruction, SSNR; then the class and direction
        distributions and the rest. On `backend`'s device (each class's sums are moved there in turn).

        Under MPI each worker makes the maps of the classes whose volumes it holds (`sums`: None for the others)
        and they are shared among the workers (`peers`), so that every worker holds every map."""
        config = self.config
        model = dataclasses.replace(model)
        k_classes = model.n_classes
        xp = backend.array_module
        small = WeightedSums.total([s.without_volumes().spread_to_classes(unit.classes, k_classes)
                                    for s, unit in zip(sums, plan.units)])
        box, n_shells = model.ori_size_px, model.n_shells
        r_max = plan.sizes.current_size_px // 2
        tau2 = np.zeros((1, k_classes, n_shells))
        ssnr = np.zeros((1, k_classes, n_shells))
        ref_sigma2 = np.zeros((1, k_classes, n_shells))
        total_weight = float(np.sum(small.pdf_class))
        pdf_class = np.asarray(small.pdf_class, dtype=np.float64) / max(total_weight, 1e-300)
        here = {int(k): (s, i) for s, unit in zip(sums, plan.units) for i, k in enumerate(unit.classes)
                if mstep.volumes_here(s, i)}
        made = {}
        powers = {}  # τ² of each previous map, by identity: the classes seeded from one map share it
        for k, (s, i) in sorted(here.items()):
            with mstep.timed_part(parts, "sums to the device", xp):
                data, weight = backend.to_device(s.data[i]), backend.to_device(s.weight[i])
                s.data[i] = s.weight[i] = None  # let go as each class is made
            previous = model.maps[0][k]
            with mstep.timed_part(parts, "τ² of the references", xp):
                if id(previous) not in powers:
                    # τ²: the power of the reference's padded transform, in the sums' precision (float32 on the GPU)
                    t2 = to_host(Projector(xp.asarray(previous), config.padding_factor, r_max, dtype=weight.dtype,
                                           xp=xp).power_spectrum)
                    t2 = np.asarray(t2, dtype=np.float64)[:n_shells]
                    t2[r_max + 1:] = 0.0
                    powers[id(previous)] = t2
                t2 = powers[id(previous)].copy()
            with mstep.timed_part(parts, "reconstructions", xp):
                bp = mstep.backprojector(data, weight, model, config, plan.sizes.current_size_px, xp)
                del data, weight
                if pdf_class[k] <= 0 or float(bp.weight.sum()) <= 0:
                    continue  # an empty class: a map of zeros
                sigma2 = to_host(bp.noise_sigma2())[:n_shells]
                made[k] = (mstep.reconstruct_map(bp, t2, model, config, xp, self._masks(model)), t2, sigma2)
                del bp
        with mstep.timed_part(parts, "maps shared among the workers", xp):
            made = mstep.gathered(peers, made)  # every worker holds every map
        new_maps = mstep.class_maps_and_spectra(made, model.maps[0][:k_classes], (tau2, ref_sigma2, ssnr),
                                                config.tau2_fudge, r_max)
        if plan.do_cc:  # class 1 seeds every class: low-passed again, the class distribution shared out
            with mstep.timed_part(parts, "class 1 low-passed", xp):
                first = to_host_pinned(lowpass_to_ini_high(xp.asarray(new_maps[0], dtype=xp.float64), config, box,
                                                           model.pixel_size_angstrom).astype(xp.float32))
            # one map for every class, as the first references are (maps are replaced, never changed in place), not
            # a float32 copy of it for each (at 360 px and K=6: six conversions and 1.1 GB more)
            new_maps = [first] * k_classes
            tau2[0, :], ssnr[0, :], ref_sigma2[0, :] = tau2[0, 0], ssnr[0, 0], ref_sigma2[0, 0]
            pdf_class = np.full(k_classes, 1.0 / k_classes)
        model.maps = [new_maps]
        model.tau2, model.ssnr, model.reference_sigma2 = tau2, ssnr, ref_sigma2
        model.pdf_class = pdf_class
        model.class_distribution = pdf_class
        pdf = np.asarray(small.pdf_direction, dtype=np.float64).reshape(k_classes, -1)
        if plan.do_cc:  # class 1's directions for every class
            pdf = np.repeat(pdf[:1], k_classes, axis=0)
        total = pdf.sum()
        model.pdf_direction = pdf / total if total > 0 else np.full(pdf.shape, 1.0 / pdf.size)
        with mstep.timed_part(parts, "other parameters", xp):
            mstep.maximize_other_parameters(model, config, [small], plan.do_cc)
        return model

    def _masks(self, model):
        if self.masks is None:  # an MPI worker's first M-step: the master has checked the files
            self.masks = SolventMasks.for_model(self.config, model)
        return self.masks

    def update(self, run, plan, changes):
        config, model = self.config, run.model
        model.current_resolution_angstrom = schedule.current_resolution(
            model.ori_size_px, model.pixel_size_angstrom, data_vs_prior=model.ssnr[0], iteration=plan.iteration,
            ini_high_angstrom=config.ini_high_angstrom, firstiter_cc=config.firstiter_cc,
            check_high_res_side=False).resolution_angstrom
        run.optimiser = replace(run.optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)
        per_class = [schedule.current_resolution(
            model.ori_size_px, model.pixel_size_angstrom, data_vs_prior=model.ssnr[0][k:k + 1],
            iteration=plan.iteration, ini_high_angstrom=config.ini_high_angstrom, firstiter_cc=config.firstiter_cc,
            check_high_res_side=False).resolution_angstrom for k in range(model.n_classes)]
        self._drop_finer_sampling_where_too_broad(run, plan)
        run.append_history("class_distributions", np.asarray(model.pdf_class, dtype=np.float64))
        run.append_history("class_changes", changes.classes)
        run.append_history("class_resolutions", np.asarray(per_class))

    @staticmethod
    def _drop_finer_sampling_where_too_broad(run, plan):
        """Where more than half the particles of a finer-sampled iteration reached the finer pass's limit
        (`estep.common.fine_pass_limit`), their coarse posteriors are too broad for it (the raise asked for an
        average pmax of at least 0.5): the next iterations sample at --oversampling again, and for the rest of the
        run."""
        raised = [r for r in fine_pass_limits_reached(plan.units, run.particles.n_significant) if r.raised]
        n_reached, n_particles = sum(r.n_reached for r in raised), sum(r.n_particles for r in raised)
        if not raised or 2 * n_reached <= n_particles:
            return
        run.extras["finer_sampling_from"] = 0
        run.extras["finer_sampling_dropped"] = plan.iteration
        log.warning("from iteration %d on the fine pass samples at --oversampling again (RELION's): %d of %d "
                    "particles reached the finer pass's limit in iteration %d, their coarse posteriors too broad "
                    "for it", plan.iteration + 1, n_reached, n_particles, plan.iteration)

    def finished(self, run, plan):
        return False  # every one of --iter iterations runs

    def summary(self, run, plan, changes):
        return classification_summary(run, plan, changes)

    # ------------------------------------------------------------------ outputs
    def _angdist_writes(self, root, model, sampling, iteration):
        """`class_angdist_writes`; none with --skip_align, as RELION writes none."""
        return [] if self.config.skip_align else class_angdist_writes(root, model, sampling, iteration)

    def initial_outputs(self, run, argv, under_mpi):
        """RELION's files of iteration 0, before iteration 1: run_it000_data.star, run_it000_classKKK.mrc (the
        starting maps), run_it000_model.star (uniform class and direction distributions, the initial noise spectra,
        RELION's starting τ² and data versus prior: `em.references.initial_data_versus_prior`),
        run_it000_classKKK_angdist.bild (not with --skip_align), then run_it000_optimiser.star; under mpirun also
        run_it000_sampling.star, as relion_refine_mpi writes it and relion_refine does not
        (MlOptimiserMpi::initialise, MlOptimiser::initialise)."""
        config, model, optimiser = self.config, run.model, run.optimiser
        root = iteration_root(config.output_root, 0)
        pixel = model.pixel_size_angstrom
        particles = self.particles
        frozen = replace(model)  # the loop goes on: its later models are new objects, their arrays new arrays

        def model_star(path):  # on the writer's thread: the starting τ² transforms each distinct map
            tau2, data_vs_prior = initial_data_versus_prior(frozen.maps[0], frozen.sigma2_noise, len(particles),
                                                            frozen.pdf_class, config.tau2_fudge)
            written = replace(frozen, tau2=tau2[None], ssnr=data_vs_prior[None])
            write_star(job_model_star_blocks(particles, written, optimiser, config, maps,
                                             pdf_direction=frozen.pdf_direction), path)

        sampling = schedule.sampling_from_optimiser(optimiser, config)
        maps = [f"{root}_class{k + 1:03d}.mrc" for k in range(model.n_classes)]
        table = particle_table(particles.star.particles, run.particles.copy(), None, pixel,
                               group_number=particles.scale_group_index + 1)
        writes = [data_star_write(particles.star, f"{root}_data.star", table),
                  *(partial(mrc.write_volume, name, model.maps[0][k], pixel) for k, name in enumerate(maps)),
                  partial(model_star, f"{root}_model.star"),
                  *self._angdist_writes(root, model, sampling, 0)]
        if under_mpi:
            writes.append(partial(write_sampling_star, f"{root}_sampling.star", sampling, optimiser, config, pixel))
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_star_blocks(
            optimiser, model, config, str(config.output_root), 0), list(argv))]

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        """The writes of one iteration's files as callables over what they need now (tables and STAR blocks are
        built here; the maps are the model's, which the next M-step replaces rather than changes); the
        optimiser STAR file comes last."""
        config, model, optimiser = self.config, run.model, run.optimiser
        root = iteration_root(config.output_root, plan.iteration)
        pixel = model.pixel_size_angstrom
        particles = self.particles
        table = particle_table(particles.star.particles, snapshot, None, pixel,  # no half sets
                               group_number=particles.scale_group_index + 1)
        maps = [f"{root}_class{k + 1:03d}.mrc" for k in range(model.n_classes)]
        writes = [data_star_write(particles.star, f"{root}_data.star", table)]
        writes += [partial(mrc.write_volume, name, model.maps[0][k], pixel) for k, name in enumerate(maps)]
        writes += [  # side by side (each its own file), then the optimiser STAR file, which --continue reads
            partial(write_star, job_model_star_blocks(particles, model, optimiser, config, maps,
                                                      pdf_direction=model.pdf_direction), f"{root}_model.star"),
            partial(write_sampling_star, f"{root}_sampling.star", plan.sampling, optimiser, config, pixel),
            *self._angdist_writes(root, model, plan.sampling, plan.iteration),
            InOwnProcess(partial(write_classification_report, f"{root}_report.png", iteration=plan.iteration,
                                 class_distributions=np.array(run.extras["class_distributions"]),
                                 ssnr=model.ssnr[0].copy(),
                                 class_changes=np.array(run.extras["class_changes"]),
                                 class_resolutions_angstrom=np.array(run.extras["class_resolutions"]),
                                 ori_size_px=model.ori_size_px, pixel_size_angstrom=pixel,
                                 resolution_angstrom=model.current_resolution_angstrom, rot_deg=snapshot.rot_deg,
                                 tilt_deg=snapshot.tilt_deg, timings_seconds=dict(timings)))]
        # the oversampling this iteration used (one more once `_fine_sampling` raised it)
        used = replace(config, oversampling=plan.sampling.oversampling)
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_star_blocks(
            optimiser, model, used, str(config.output_root), plan.iteration), list(argv))]

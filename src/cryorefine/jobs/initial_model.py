"""A 3D initial model from the particles alone (relion_refine --grad --denovo_3dref: RELION's InitialModel, VDAM).

No reference is given. RELION's rules, as this job follows them:
- the initial maps (`denovo_maps`), one per class (--K): a subset of the particles (RELION's: at least 1,000, at least
  5 per class), shared out over the classes at random (particle i of a random permutation in class i mod K), each at
  a random orientation (RELION's draw: rot and psi uniform over 360°, tilt over 180°); each class's CTF-weighted
  back-projection averaged (data Σ CTF·X, weights Σ CTF²), low-passed to --ini_high; then RELION 4/5's blobs
  (initialiseReferences): 40 Gaussian blobs at random places about the centre (σ of the places diameter/6, width
  diameter/10, amplitudes the average's magnitude there) minus half of 40 more, scaled to the average's standard
  deviation, low-passed again and softly masked to the particle's circle (--particle_diameter);
- every iteration is one gradient step (VDAM, `em.gradient`): an E-step of a random mini-batch (RELION's sizes,
  `em.gradient.initial_model_subset_sizes`, growing over the iterations; with several classes every particle in the
  last iteration), split into two pseudo-half sets (by the parity of the particle's index, as RELION's
  storeWeightedSums), each an E-step work unit against every class, the class distribution the classes' prior;
  the M-step (`em.gradient.vdam_maximization`) moves each class's map along the batch's gradient with momentum, the
  step size and τ² fudge following RELION's schedule over --iter (RELION's GUI: 200), a class's step scaled by its
  share; the class distribution and the other model parameters (noise spectra, σ of the offsets, norm and scale
  corrections, direction distributions) are averaged with momentum 0.9 as RELION's maximizationOtherParameters
  does under --grad;
- the sampling starts as given (--healpix_order, --offset_range, --offset_step, --oversampling; RELION's GUI: 1, 6,
  2, 1); with --auto_sampling (RELION's GUI gives it) it may get finer every 10 iterations as RELION's relion_refine
  does under --grad (`em.gradient.auto_sampling`: the HEALPix order up to 3, one below RELION's order of local
  searches, the offsets' step and range from the estimated accuracy and the last changes), the accuracy estimated
  before iteration 1, every 10th and the last from projections at 100 particles' poses, as RELION estimates it
  (`em.accuracy.projected_accuracy`); the image size follows
  the resolution, where the best class's SSNR (--tau2_fudge·τ²/σ²) drops below 1;
  --flatten_solvent masks the maps to the particle's sphere after each update; --maxsig without a value is RELION's
  100 per class under --grad.
Outputs, as RELION writes them under --grad (every --grad_write_iter iterations, RELION's 10, the last, and those
whose batch holds every particle): run_itNNN_classNNN.mrc, run_itNNN_data.star, run_itNNN_model.star,
run_itNNN_sampling.star, run_itNNN_optimiser.star, run_itNNN_report.png (each class map's central slices and
projections, `report.write_map_gallery`: the maps as they form), and the momenta as RELION writes them
(run_itNNN_1momentNNN.mrc of the two pseudo-half sets, classes 1…K and K+1…2K, run_itNNN_2momentNNN.mrc; model.star's
rlnGradMoment1/2):
--continue reads them back and goes on exactly as the run would have. Before iteration 1, as RELION writes them, the
files of iteration 0 (run_it000_*: the particles, the de-novo maps, the momenta, the model.star with RELION's starting
τ² and data-versus-prior spectra, the uniform direction distributions' bild files, the optimiser.star, and under
mpirun the sampling.star); --continue can start from its optimiser.star. Under mpirun the E-steps and the classes' steps
are shared out over the workers as in the other jobs. With --gpu the E-steps run on the GPU engine (one GPU, or under
mpirun each worker's GPU), as refine's and classify's: the same work units, the same cap on the significant poses
(`estep.common.significants_limit`, which both engines cut with); the VDAM step itself stays on the host.
initial_model.mrc beside the run is the largest class of the last iteration (RELION's relion_align_symmetry
--select_largest_class); with --sym, as RELION's InitialModel job, the run is in C1 and that map is turned to the
group's axes and symmetrised (`em.align_symmetry`, RELION's relion_align_symmetry).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cryorefine.core import euler
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import BackProjector
from cryorefine.core.reconstruct import soft_mask_outside_map
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em import accuracy, gradient, loop, mstep, schedule
from cryorefine.em.align_symmetry import align_to_symmetry
from cryorefine.em.estep import WorkUnit
from cryorefine.em.references import blobs, initial_data_versus_prior, lowpass_to_ini_high
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState, ParticleState, RunState
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup
from cryorefine.images import prepare_batch
from cryorefine.io import mrc
from cryorefine.io.background import InOwnProcess, Together
from cryorefine.io.relion_outputs import (
    data_star_write,
    job_model_star_blocks,
    optimiser_star_blocks,
    particle_table,
    write_optimiser_star,
    write_sampling_star,
)
from cryorefine.io.run_files import iteration_root
from cryorefine.io.star import write_star
from cryorefine.jobs.classify import class_angdist_writes
from cryorefine.jobs.refine import INITIAL_SIGMA_OFFSET_ANGSTROM
from cryorefine.report import write_map_gallery

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.data import ParticleSet
    from cryorefine.images import ImageSettings

log = logging.getLogger("cryorefine.initial_model")
#: RELION's particles for the initial noise spectra and the de-novo averages (minimum_nr_particles_sigma2_noise in
#: 2D data), at least DENOVO_PARTICLES_PER_CLASS per class
DENOVO_PARTICLES = 1000
DENOVO_PARTICLES_PER_CLASS = 5
#: the spread of the places of RELION's blobs of the initial map (SomGraph::make_blobs_3d), a share of the diameter
BLOB_PLACE_SIGMA_OF_DIAMETER = 1.0 / 6.0
#: RELION's most significant poses per class under --grad without --maxsig
MAX_SIGNIFICANTS_PER_CLASS = 100
#: the random streams of the de-novo map, the mini-batches and their halves
DENOVO_STREAM = 3
SUBSET_STREAM = 4
ALIGN_STREAM = 5
#: the map of the last iteration, aligned to --sym's axes and symmetrised, beside the run (RELION's InitialModel job
#: writes it in its folder)
INITIAL_MODEL_NAME = "initial_model.mrc"


def run(config, runner, argv=(), progress=None, resume_from=None, stop_requested=None, overwrite=False):
    """Run the initial model with `runner`; the IterationReports (None on an MPI worker). `resume_from`: a
    run_itNNN_optimiser.star of an earlier initial model, continued after it."""
    return loop.run(InitialModelJob(config), runner, argv, progress, resume_from, stop_requested, overwrite)


def check_config(config: RefineConfig) -> None:
    """The options this job runs; an InputError in one line for the others."""
    for option, value in (("--firstiter_cc", config.firstiter_cc), ("--fast_subsets", config.fast_subsets),
                          ("--skip_align", config.skip_align), ("--sigma_ang", config.sigma_ang_deg),
                          ("--sigma_psi", config.sigma_psi_deg)):
        if value:
            raise InputError(f"initial_model: {option} is not part of RELION's initial model (--grad); drop it")


def blobs_map(average: np.ndarray, diameter_px: float, rng: np.random.Generator) -> np.ndarray:
    """RELION 4/5's blobs of the initial map (make_blobs_3d twice, `em.references.blobs`): places about the centre
    with σ diameter/6."""
    return blobs(average, diameter_px, BLOB_PLACE_SIGMA_OF_DIAMETER, rng)


def denovo_maps(particles: ParticleSet, settings: ImageSettings, config: RefineConfig,
                batch_size: int) -> list[np.ndarray]:
    """The initial maps of the --K classes (float64, (N, N, N)) from the particles alone: see the module docstring."""
    box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
    k_classes = int(config.n_classes)
    draw = np.random.default_rng([config.random_seed, DENOVO_STREAM])
    order = draw.permutation(len(particles))[:max(DENOVO_PARTICLES, DENOVO_PARTICLES_PER_CLASS * k_classes)]
    class_of = np.empty(len(particles), dtype=np.int64)
    class_of[order] = np.arange(order.size) % k_classes
    chosen = np.sort(order)
    rot, tilt, psi = draw.uniform(0, 360, chosen.size), draw.uniform(0, 180, chosen.size), draw.uniform(0, 360,
                                                                                                       chosen.size)
    sums = [BackProjector(box, config.padding_factor, box // 2) for _ in range(k_classes)]
    with particles.image_reader() as reader:
        for start in range(0, chosen.size, batch_size):
            part = slice(start, start + batch_size)
            batch = prepare_batch(particles, chosen[part], reader, settings, box, 1.0, 0)
            mats = euler.euler_to_matrix(rot[part], tilt[part], psi[part])
            classes = class_of[chosen[part]]
            for k, bp in enumerate(sums):
                mine = classes == k
                if mine.any():
                    ctf = batch.ctf[mine]
                    bp.backproject(batch.images_ft[mine] * ctf, ctf * ctf, mats[mine])
    diameter_px = settings.particle_diameter_angstrom / pixel
    maps = []
    for bp in sums:
        average = lowpass_to_ini_high(bp.reconstruct(), config, box, pixel)
        volume = lowpass_to_ini_high(blobs_map(average, diameter_px, draw), config, box, pixel)
        maps.append(soft_mask_outside_map(np.asarray(volume, dtype=np.float64), diameter_px / 2.0,
                                          config.width_mask_edge_px))
    return maps


def moment_file_names(root: str, n_classes: int) -> list[tuple[str, str, str]]:
    """RELION's files of each class's momenta under --grad (MlModel::write of 3D classes): (first moment of the first
    pseudo-half set, of the second, second moment) = root_1momentNNN.mrc (class k), root_1momentNNN.mrc (class
    K + k), root_2momentNNN.mrc (class k)."""
    return [(f"{root}_1moment{k + 1:03d}.mrc", f"{root}_1moment{n_classes + k + 1:03d}.mrc",
             f"{root}_2moment{k + 1:03d}.mrc") for k in range(n_classes)]


def write_moments(root: str, moments: list, grid: PaddedGrid) -> None:
    """The classes' momenta in RELION's files (`moment_file_names`, `em.gradient.moments_as_relion`)."""
    for names, class_moments in zip(moment_file_names(root, len(moments)), moments):
        first, second = gradient.moments_as_relion(class_moments, grid)
        for name, values in zip(names, (*first, second)):
            mrc.write_volume(name, values, 1.0)


def read_moments(root: str, n_classes: int, grid: PaddedGrid) -> list:
    """The classes' momenta from RELION's files (`write_moments`); an InputError naming a file that is missing."""
    moments = []
    for names in moment_file_names(root, n_classes):
        for name in names:
            if not Path(name).is_file():
                raise InputError(f"{name}: not found; --continue of a gradient run needs the momenta its iteration "
                                 f"wrote; continue from an iteration whose files are all there")
        arrays = [mrc.read_volume(name, require_cubic=False)[0] for name in names]
        moments.append(gradient.moments_from_relion(arrays[:2], arrays[2], grid))
    return moments


class InitialModelJob:
    """The initial model as the iteration loop (`em.loop`) runs it; the VDAM momenta live in the model."""

    kind = "initial_model"
    min_mpi_ranks = 2

    def __init__(self, config):
        # RELION's InitialModel runs relion_refine in C1 and aligns the map to --sym's axes at the end
        self.symmetry = config.symmetry
        self.config = config = dataclasses.replace(config, symmetry="C1")
        self.particles = None
        self.masks = None  # em.solvent.SolventMasks, made by load (on an MPI worker: at its first M-step)
        self.phases = gradient.gradient_phases(int(config.max_iterations))
        self.subset_sizes = (0, 0)

    # ------------------------------------------------------------------ set-up
    def load(self):
        check_config(self.config)
        particles, settings = loop.particles_and_settings(self.config)
        self.diameter_angstrom = settings.particle_diameter_angstrom
        self.masks = SolventMasks.from_config(self.config, settings.ori_size_px, settings.pixel_size_angstrom,
                                              self.diameter_angstrom, say=True)
        self.particles, self.settings = particles, settings
        self.subset_sizes = gradient.initial_model_subset_sizes(len(particles))
        log.info("initial model: %d iterations (%d initial, %d in between, %d final), mini-batches of %d to %d of "
                 "%d particles", self.phases.n_iterations, self.phases.initial, self.phases.between,
                 self.phases.final, *self.subset_sizes, len(particles))
        return particles, settings

    def start(self, particles, settings, noise_spectra):
        config = self.config
        rng = np.random.default_rng(config.random_seed)  # the run's draws: the sampling's perturbations first
        k_classes = int(config.n_classes)
        box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
        optimiser, _ = schedule.initial_schedule(config, rng)
        n_dir = schedule.sampling_from_optimiser(optimiser, config).n_directions
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=k_classes,
                           padding_factor=config.padding_factor, pdf_class=np.full(k_classes, 1.0 / k_classes),
                           sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(particles.n_scale_groups),
                           pdf_direction=np.full((k_classes, n_dir), 1.0 / (k_classes * n_dir)))
        model.sigma2_noise = noise_spectra(particles, settings, len(particles.optics_groups))
        model.maps = [denovo_maps(particles, settings, config, config.batch_size_for(box))]
        model.current_resolution_angstrom = schedule.current_resolution(
            box, pixel, iteration=0, ini_high_angstrom=schedule.starting_resolution_angstrom(config)
        ).resolution_angstrom
        grid = gradient.full_grid(box, config.padding_factor, 3)
        model.moments = [gradient.Moments.start(grid) for _ in range(k_classes)]
        poses = ParticleState.from_particles(particles, pixel)
        return RunState(model, optimiser, poses, rng,
                        extras={"step_sizes": np.zeros(0), "subset_sizes": np.zeros(0)})

    def resume(self, run, particles, iteration_root):
        """The maps and the momenta of the iteration's files (RELION's names)."""
        k_classes = int(self.config.n_classes)
        maps = []
        for k in range(k_classes):
            name = f"{iteration_root}_class{k + 1:03d}.mrc"
            if not Path(name).is_file():
                raise InputError(f"{name}: not found; the run has {k_classes} classes; continue with the run's own "
                                 f"files")
            maps.append(mrc.read_volume(name)[0])
        run.model.maps = [maps]
        grid = gradient.full_grid(run.model.ori_size_px, self.config.padding_factor, 3)
        run.model.moments = read_moments(iteration_root, k_classes, grid)

    # ------------------------------------------------------------------ one iteration
    def batch(self, iteration: int, n_particles: int) -> tuple[np.ndarray, np.ndarray]:
        """The two pseudo-half sets of the iteration's mini-batch (sorted particle indices): a random draw of
        RELION's size (`em.gradient.mini_batch`), split as RELION splits them (`em.gradient.pseudo_halves`)."""
        return gradient.pseudo_halves(gradient.mini_batch(iteration, self.phases, self.subset_sizes, n_particles,
                                                          int(self.config.n_classes), self.config.random_seed,
                                                          SUBSET_STREAM))

    def plan(self, run, iteration, estimate_accuracy=None):
        config, model = self.config, run.model
        k_classes = int(config.n_classes)
        optimiser = gradient.counters_at_start(replace(run.optimiser, iteration=iteration), iteration)
        sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order,
                                     self.diameter_angstrom, model.ori_size_px, model.pixel_size_angstrom,
                                     config.incr_size_px, False, False, ave_pmax=model.ave_pmax,
                                     oversampling=config.oversampling,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
        likelihood_size_px = schedule.likelihood_size_px(config.strict_highres_exp_angstrom, model.ori_size_px,
                                                         model.pixel_size_angstrom, sizes.current_size_px)
        optimiser = self._sampling(optimiser, run, likelihood_size_px or sizes.current_size_px,
                                   estimate_accuracy or accuracy.estimate_on_host)
        optimiser = schedule.perturbed(optimiser, run.rng)
        run.optimiser = optimiser
        sampling = schedule.sampling_from_optimiser(optimiser, config)
        max_sig = (config.max_significants if config.max_significants > 0
                   else MAX_SIGNIFICANTS_PER_CLASS * k_classes)
        with np.errstate(divide="ignore"):
            log_class = np.log(np.asarray(model.pdf_class, dtype=np.float64))
        setup = IterationSetup(
            projectors=None, maps=list(model.maps[0]), sigma2_noise=model.sigma2_noise, sampling=sampling,
            ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px,
            coarse_size_px=sizes.coarse_size_px, pixel_size_angstrom=model.pixel_size_angstrom,
            log_pdf_class=log_class, sigma_offset_px=model.sigma_offset_angstrom / model.pixel_size_angstrom,
            do_cc=False, adaptive_fraction=config.adaptive_fraction, max_significants=max_sig,
            scale_correction=model.scale_correction if config.do_scale else None,
            data_vs_prior=None if model.ssnr is None else model.ssnr[0],
            padding_factor=config.padding_factor, avg_norm_correction=model.avg_norm_correction,
            likelihood_size_px=likelihood_size_px)
        n_particles = len(run.particles.rot_deg)
        halves = self.batch(iteration, n_particles)
        units = [WorkUnit(f"pseudo-half {h + 1}", members, np.arange(k_classes, dtype=np.int64), setup)
                 for h, members in enumerate(halves)]
        return gradient.GradientPlan(
            iteration, sizes, sampling, False, units, step_size=gradient.step_size(iteration, self.phases),
            tau2_fudge=gradient.tau2_fudge_at(iteration, self.phases, config.tau2_fudge),
            whole_batch=sum(h.size for h in halves) == n_particles)

    def _sampling(self, optimiser, run, compared_size_px, estimate):
        """The iteration's accuracy estimate (made by `estimate`, an `em.accuracy.Estimator`) and, with
        --auto_sampling, its sampling (module docstring); a new HEALPix order starts the direction distributions
        afresh, even (RELION's initialisePdfDirection)."""
        config, model = self.config, run.model
        if (model.sigma2_noise is not None and self.particles is not None
                and gradient.estimates_accuracy(optimiser.iteration, self.phases.n_iterations)):
            # RELION's estimate from projections at the poses of 100 particles taken at random
            n = len(self.particles)
            chosen = np.sort(np.random.default_rng((config.random_seed, optimiser.iteration)).choice(
                n, min(n, accuracy.N_TRIAL_PARTICLES), replace=False))
            poses = run.particles
            acc = estimate(accuracy.AccuracyRequest(
                list(model.maps[0]), model.pdf_class, model.sigma2_noise, chosen,
                np.stack([poses.rot_deg[chosen], poses.tilt_deg[chosen], poses.psi_deg[chosen]], axis=1),
                current_size_px=compared_size_px,
                padding_factor=config.padding_factor, do_ctf=config.do_ctf,
                ctf_intact_first_peak=config.ctf_intact_first_peak, seed=config.random_seed + optimiser.iteration),
                self.particles)
            optimiser = replace(optimiser, acc_rot_deg=acc.rotations_deg, acc_trans_angstrom=acc.translations_angstrom)
            model.accuracy_rotations_deg, model.accuracy_translations_angstrom = acc
        if not (config.auto_sampling and gradient.updates_sampling(optimiser.iteration)):
            return optimiser
        before = optimiser
        optimiser = gradient.auto_sampling(optimiser, model, config)
        if optimiser.healpix_order != before.healpix_order:
            n_dir = schedule.sampling_from_optimiser(optimiser, config).n_directions
            model.pdf_direction = np.full((model.n_classes, n_dir), 1.0 / (model.n_classes * n_dir))
        if (optimiser.healpix_order, optimiser.offset_step_px, optimiser.offset_range_px) != (
                before.healpix_order, before.offset_step_px, before.offset_range_px):
            log.info("--auto_sampling: iteration %d samples HEALPix order %d (%.3g°) and offsets in steps of %.3g px "
                     "within %.3g px (accuracy %.3g°, %.3g Å)", optimiser.iteration, optimiser.healpix_order,
                     schedule.angular_step_deg(optimiser.healpix_order, config.oversampling), optimiser.offset_step_px,
                     optimiser.offset_range_px, optimiser.acc_rot_deg, optimiser.acc_trans_angstrom)
        return optimiser

    def maximization_groups(self, plan):
        """Each class's map is made from both pseudo-half sets' sums."""
        return [[(0, k), (1, k)] for k in range(len(plan.units[0].classes))]

    def maximize(self, model, sums, plan, backend, peers=mstep.ALONE, parts=None):
        """The VDAM step of every class (`em.gradient.vdam_maximization`, on the backend's device), each map then masked
        (--flatten_solvent)."""
        if self.masks is None:  # an MPI worker, which does not load the run
            self.masks = SolventMasks.for_model(self.config, model)
        masks = self.masks
        model, _ = gradient.vdam_maximization(model, sums, plan, self.config, peers,
                                              lambda volume, moments: (masks.apply(volume), moments),
                                              xp=backend.array_module, parts=parts)
        return model

    def update(self, run, plan, changes):
        config, model = self.config, run.model
        previous_resolution_angstrom = model.current_resolution_angstrom
        model.current_resolution_angstrom = schedule.current_resolution(
            model.ori_size_px, model.pixel_size_angstrom, data_vs_prior=model.ssnr[0], iteration=plan.iteration,
            ini_high_angstrom=config.ini_high_angstrom, check_high_res_side=False).resolution_angstrom
        optimiser = replace(run.optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                            changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                            changes_optimal_classes=changes.classes)
        # RELION's updateOverallChangesInHiddenVariables and updateCurrentResolution: the counters --auto_sampling reads
        run.optimiser = schedule.update_change_counters(
            optimiser, changes.orientations_deg, changes.offsets_angstrom, changes.classes,
            model.current_resolution_angstrom, previous_resolution_angstrom=previous_resolution_angstrom,
            pixel_size_angstrom=model.pixel_size_angstrom, oversampling=config.oversampling)
        n_batch = sum(unit.members.size for unit in plan.units)
        run.extras["step_sizes"] = np.append(run.extras["step_sizes"], plan.step_size)
        run.extras["subset_sizes"] = np.append(run.extras["subset_sizes"], n_batch)
        run.append_history("class_distributions", np.asarray(model.pdf_class, dtype=np.float64))

    def finished(self, run, plan):
        return False  # every one of --iter iterations runs

    def summary(self, run, plan, changes):
        model = run.model
        n_batch = sum(unit.members.size for unit in plan.units)
        shares = (f", classes {' '.join(f'{p:.2f}' for p in model.pdf_class)}" if model.n_classes > 1 else "")
        return (f"resolution {model.current_resolution_angstrom:.2f} Å, size {plan.sizes.current_size_px}/"
                f"{plan.sizes.coarse_size_px} px, mini-batch {n_batch}, step {plan.step_size:.2f}, τ² fudge "
                f"{plan.tau2_fudge:.2f}{shares}, pmax {model.ave_pmax:.3f}")

    # ------------------------------------------------------------------ outputs
    def writes_files(self, plan) -> bool:
        """RELION writes a gradient run's files every --grad_write_iter iterations, at the last, and in every
        iteration whose batch holds every particle (`em.gradient.writes_files`)."""
        return gradient.writes_files(plan.iteration, int(self.config.max_iterations), plan.whole_batch,
                                     self.config.grad_write_iter)

    def initial_outputs(self, run, argv, under_mpi):
        """RELION's files of iteration 0, before iteration 1 (MlOptimiser::initialise; MlOptimiserMpi::initialise
        under mpirun): run_it000_data.star, run_it000_classNNN.mrc (the de-novo maps), the momenta before the first
        step (run_it000_1momentNNN.mrc, run_it000_2momentNNN.mrc), run_it000_model.star (uniform class and direction
        distributions, the initial noise spectra, RELION's starting τ² and data versus prior with iteration 0's τ²
        fudge: `em.references.initial_data_versus_prior`), run_it000_classNNN_angdist.bild (RELION draws the uniform
        distributions before the first gradient step, and none after), then run_it000_optimiser.star; under mpirun
        also run_it000_sampling.star, as relion_refine_mpi writes it and relion_refine does not."""
        config, model, optimiser = self.config, run.model, run.optimiser
        fudge = gradient.tau2_fudge_at(0, self.phases, config.tau2_fudge)
        frozen, n_particles = replace(model), len(self.particles)  # the loop goes on meanwhile

        def model_star(blocks_of, path):  # on the writer's thread: the starting τ² transforms each map
            tau2, data_vs_prior = initial_data_versus_prior(frozen.maps[0], frozen.sigma2_noise, n_particles,
                                                            frozen.pdf_class, fudge)
            write_star(blocks_of(replace(frozen, tau2=tau2[None], ssnr=data_vs_prior[None])), path)

        sampling = schedule.sampling_from_optimiser(optimiser, config)
        return self._files(model, optimiser, run.particles.copy(), sampling if under_mpi else None, fudge, None, argv,
                           model_star, class_angdist_writes(iteration_root(config.output_root, 0), model, sampling, 0))

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        """The iteration's files (RELION's names) where RELION writes them (`writes_files`); the optimiser STAR file
        last."""
        if not self.writes_files(plan):
            return []
        config, model = self.config, run.model
        writes = []
        if plan.iteration == int(config.max_iterations):
            largest = int(np.argmax(model.pdf_class))  # RELION's relion_align_symmetry --select_largest_class
            # under MPI the map's array is filled as it arrives: read when written
            writes.append(partial(self.write_initial_model, model.maps[0][largest], model.pixel_size_angstrom))
        return self._files(model, run.optimiser, snapshot, plan.sampling, plan.tau2_fudge, plan, argv, None, writes)

    def _files(self, model, optimiser, poses, sampling, tau2_fudge, plan, argv, model_star, extra):
        """The writes of the files of `optimiser`'s iteration: data.star (the particles' `poses`), the class maps, the
        momenta, model.star (its blocks, `blocks_of(model)`, made now, with rlnTau2FudgeFactor `tau2_fudge`, RELION's
        of the iteration; or, where given, `model_star(blocks_of, path)` writes it on the writer's thread),
        sampling.star where `sampling` is given, the `extra` writes, then optimiser.star (with the gradient labels of
        `plan`, None before iteration 1)."""
        config, particles = self.config, self.particles
        k_classes = model.n_classes
        root = iteration_root(config.output_root, optimiser.iteration)
        pixel = model.pixel_size_angstrom
        table = particle_table(particles.star.particles, poses, None, pixel,
                               group_number=particles.scale_group_index + 1)
        maps = [f"{root}_class{k + 1:03d}.mrc" for k in range(k_classes)]
        moment_files = moment_file_names(root, k_classes)
        model_config = replace(config, tau2_fudge=tau2_fudge)

        def blocks_of(written):
            return job_model_star_blocks(particles, written, optimiser, model_config, maps,
                                         pdf_direction=written.pdf_direction,
                                         gradient_moment_images=([first for first, _, _ in moment_files],
                                                                 [second for _, _, second in moment_files]))

        grid = gradient.full_grid(model.ori_size_px, config.padding_factor, 3)
        writes = [data_star_write(particles.star, f"{root}_data.star", table),
                  *(partial(mrc.write_volume, name, volume, pixel) for name, volume in zip(maps, model.maps[0])),
                  partial(write_moments, root, list(model.moments), grid),
                  (partial(write_star, blocks_of(model), f"{root}_model.star") if model_star is None
                   else partial(model_star, blocks_of, f"{root}_model.star")), *extra]
        if sampling is not None:
            writes.append(partial(write_sampling_star, f"{root}_sampling.star", sampling, optimiser, config, pixel))
        optimiser_blocks = optimiser_star_blocks(optimiser, model, config, str(config.output_root),
                                                 optimiser.iteration)
        if plan is not None:  # under MPI the maps' arrays are filled as they arrive: drawn when written
            writes.append(InOwnProcess(partial(write_map_gallery, f"{root}_report.png", list(model.maps[0]),
                                               np.asarray(model.pdf_class, dtype=np.float64), iteration=plan.iteration,
                                               resolution_angstrom=model.current_resolution_angstrom)))
        optimiser_blocks["optimiser_general"].update(gradient.optimiser_labels(
            plan, config, self.phases, self.subset_sizes, len(particles),
            (gradient.INITIAL_MODEL_STEP_SIZE, gradient.INITIAL_MODEL_FIRST_STEP_SIZE)))
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_blocks,
                                          list(argv))]

    def write_initial_model(self, volume: np.ndarray, pixel_size_angstrom: float) -> None:
        """INITIAL_MODEL_NAME beside the run: the last iteration's largest class, with --sym other than C1 turned to
        the group's axes and symmetrised (`em.align_symmetry`, RELION's relion_align_symmetry --apply_sym)."""
        path = Path(self.config.output_root).parent / INITIAL_MODEL_NAME
        volume = np.array(volume, dtype=np.float64)
        group = symmetry_group(self.symmetry)
        if group.order > 1:
            aligned = align_to_symmetry(volume, group, np.random.default_rng([self.config.random_seed,
                                                                              ALIGN_STREAM]))
            log.info("initial model: turned by rot %.1f°, tilt %.1f°, psi %.1f° to the axes of %s (asymmetry %.3g → "
                     "%.3g) and symmetrised: %s", *aligned.angles_deg, self.symmetry, aligned.asymmetry_before,
                     aligned.asymmetry_after, path)
            volume = aligned.volume
        mrc.write_volume(str(path), np.asarray(volume, dtype=np.float32), pixel_size_angstrom)

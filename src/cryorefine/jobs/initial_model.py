"""A 3D initial model from the particles alone (relion_refine --grad --denovo_3dref: RELION's InitialModel, VDAM).

No reference is given. RELION's rules, as this job follows them:
- the initial map (`denovo_map`): a random orientation for each of a subset of the particles (RELION's draw: rot and
  psi uniform over 360°, tilt over 180°), their CTF-weighted back-projection averaged (data Σ CTF·X, weights Σ CTF²),
  low-passed to --ini_high; then RELION 4/5's blobs (initialiseReferences): 40 Gaussian blobs at random places
  about the centre (σ of the places diameter/6, width diameter/10, amplitudes the average's magnitude there) minus
  half of 40 more, scaled to the average's standard deviation, low-passed again and softly masked to the
  particle's circle (--particle_diameter);
- every iteration is one gradient step (VDAM, `em.gradient`): an E-step of a random mini-batch (RELION's sizes,
  `em.gradient.initial_model_subset_sizes`, growing over the iterations), split into two pseudo-half sets (by the
  parity of the particle's index, as RELION's storeWeightedSums), each an E-step work unit against the same map;
  the M-step moves the map along the batch's gradient with momentum, the step size and τ² fudge following RELION's
  schedule over --iter (RELION's GUI: 200); the other model parameters
  (noise spectra, σ of the offsets, norm and scale corrections, direction distribution) are averaged with
  momentum 0.9 as RELION's maximizationOtherParameters does under --grad;
- the sampling stays as given (--healpix_order, --offset_range, --offset_step, --oversampling; RELION's GUI: 1, 6,
  2, 1); the image size follows the resolution, where the model's SSNR (--tau2_fudge·τ²/σ²) drops below 1;
  --flatten_solvent masks the map to the particle's sphere after each update; --maxsig without a value is RELION's
  100 per class under --grad.
Outputs, as RELION writes them under --grad (every 10th iteration, the last, and those whose batch holds every
particle): run_itNNN_class001.mrc,
run_itNNN_data.star, run_itNNN_model.star, run_itNNN_sampling.star, run_itNNN_optimiser.star.
--sym: as RELION's InitialModel job, the run is in C1 and the last map is turned to the group's axes and symmetrised
(`em.align_symmetry`, RELION's relion_align_symmetry); that map is initial_model.mrc beside the run (the last map as
it is for C1), as RELION's job writes it in its folder.
Not yet: --K above 1, the GPU engine, MPI, --continue, RELION's --auto_sampling steps (every 10 iterations).
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
from cryorefine.core.arrays import to_host
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.reconstruct import soft_mask_outside_map
from cryorefine.core.sampling import next_perturbation
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em import gradient, loop, mstep, schedule
from cryorefine.em.align_symmetry import align_to_symmetry
from cryorefine.em.estep import WorkUnit
from cryorefine.em.references import lowpass_to_ini_high
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState, ParticleState, RunState
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup, WeightedSums
from cryorefine.images import prepare_batch
from cryorefine.io import mrc
from cryorefine.io.background import Together
from cryorefine.io.relion_outputs import (
    model_star_blocks,
    optimiser_star_blocks,
    particle_table,
    write_optimiser_star,
    write_sampling_star,
)
from cryorefine.io.star import write_particle_star, write_star
from cryorefine.jobs.refine import INITIAL_SIGMA_OFFSET_ANGSTROM

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.data import ParticleSet
    from cryorefine.images import ImageSettings

log = logging.getLogger("cryorefine.initial_model")
#: the engine the initial model runs on for now
ENGINE = "numpy"
#: RELION's particles for the initial noise spectra and the de-novo average (minimum_nr_particles_sigma2_noise in
#: 2D data), at least 5 per class
DENOVO_PARTICLES = 1000
#: RELION's blobs of the initial map (initialiseReferences, SomGraph::make_blobs_3d)
N_BLOBS = 40
BLOB_PLACE_SIGMA_OF_DIAMETER = 1.0 / 6.0
BLOB_WIDTH_OF_DIAMETER = 1.0 / 10.0
#: RELION's --grad_write_iter: the files of every so many iterations (and of the last)
WRITE_EVERY = 10
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
    """Run the initial model with `runner`; the IterationReports."""
    if resume_from is not None:
        raise InputError("initial_model: --continue is not available yet; start the run again")
    return loop.run(InitialModelJob(config), runner, argv, progress, resume_from, stop_requested, overwrite)


def check_config(config: RefineConfig) -> None:
    """The options this first version runs; an InputError in one line for the others."""
    if config.engine != ENGINE:
        raise InputError("initial_model: the GPU engine does not run the initial model yet; run it on the CPU engine "
                         "(drop --gpu)")
    if int(config.n_classes) != 1:
        raise InputError(f"initial_model: --K {config.n_classes}: one class only for now; give --K 1")
    for option, value in (("--firstiter_cc", config.firstiter_cc), ("--fast_subsets", config.fast_subsets),
                          ("--skip_align", config.skip_align), ("--sigma_ang", config.sigma_ang_deg),
                          ("--sigma_psi", config.sigma_psi_deg)):
        if value:
            raise InputError(f"initial_model: {option} is not part of RELION's initial model (--grad); drop it")


def blobs_map(average: np.ndarray, diameter_px: float, rng: np.random.Generator) -> np.ndarray:
    """RELION 4/5's blobs of the initial map (make_blobs_3d twice): N_BLOBS Gaussians exp(−|x − c|²/(diameter/10)²)
    at places c drawn about the centre (σ diameter/6), each of the magnitude of `average` at its place, minus half of
    another N_BLOBS; scaled to the standard deviation of `average`."""
    n = average.shape[0]
    grid = np.indices(average.shape, dtype=np.float64)

    def blobs() -> np.ndarray:
        out = np.zeros(average.shape)
        places = rng.normal(0.0, diameter_px * BLOB_PLACE_SIGMA_OF_DIAMETER, (N_BLOBS, 3)) + n / 2.0
        width = diameter_px * BLOB_WIDTH_OF_DIAMETER
        for place in places:
            idx = tuple(int(v) for v in place)
            if not all(0 <= i < n for i in idx):
                continue
            amplitude = abs(float(average[idx]))
            r2 = sum((grid[a] - place[a]) ** 2 for a in range(3))
            out += amplitude * np.exp(-r2 / (width * width))
        return out

    volume = blobs() - blobs() / 2.0
    spread = float(volume.std())
    return volume * (float(average.std()) / spread) if spread > 0 else volume


def denovo_map(particles: ParticleSet, settings: ImageSettings, config: RefineConfig, batch_size: int) -> np.ndarray:
    """The initial map (float64, (N, N, N)) from the particles alone: see the module docstring."""
    box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
    draw = np.random.default_rng([config.random_seed, DENOVO_STREAM])
    chosen = np.sort(draw.permutation(len(particles))[:DENOVO_PARTICLES])
    rot, tilt, psi = draw.uniform(0, 360, chosen.size), draw.uniform(0, 180, chosen.size), draw.uniform(0, 360,
                                                                                                       chosen.size)
    bp = BackProjector(box, config.padding_factor, box // 2)
    with particles.image_reader() as reader:
        for start in range(0, chosen.size, batch_size):
            part = slice(start, start + batch_size)
            batch = prepare_batch(particles, chosen[part], reader, settings, box, 1.0, 0)
            mats = euler.euler_to_matrix(rot[part], tilt[part], psi[part])
            bp.backproject(batch.images_ft * batch.ctf, batch.ctf * batch.ctf, mats)
    average = lowpass_to_ini_high(bp.reconstruct(), config, box, pixel)
    diameter_px = settings.particle_diameter_angstrom / pixel
    volume = lowpass_to_ini_high(blobs_map(average, diameter_px, draw), config, box, pixel)
    return soft_mask_outside_map(np.asarray(volume, dtype=np.float64), diameter_px / 2.0, config.width_mask_edge_px)


def with_momentum(previous: float | np.ndarray | None, new: float | np.ndarray, mu: float) -> float | np.ndarray:
    """mu·previous + (1 − mu)·new (RELION's parameters under --grad); `new` where there is no previous value."""
    if previous is None:
        return new
    return mu * np.asarray(previous) + (1.0 - mu) * np.asarray(new)


class InitialModelJob:
    """The initial model as the iteration loop (`em.loop`) runs it; the VDAM momenta live on the job (serial
    runner only)."""

    kind = "initial_model"
    min_mpi_ranks = 2

    def __init__(self, config):
        # RELION's InitialModel runs relion_refine in C1 and aligns the map to --sym's axes at the end
        self.symmetry = config.symmetry
        self.config = config = dataclasses.replace(config, symmetry="C1")
        self.particles = None
        self.moments = None  # em.gradient.Moments of the class
        self.masks = None
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
        box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
        optimiser, _ = schedule.initial_schedule(config)
        n_dir = schedule.sampling_from_optimiser(optimiser, config).n_directions
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=1,
                           padding_factor=config.padding_factor, pdf_class=np.ones(1),
                           sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(particles.n_scale_groups),
                           pdf_direction=np.full((1, n_dir), 1.0 / n_dir))
        model.sigma2_noise = noise_spectra(particles, settings, len(particles.optics_groups))
        model.maps = [[denovo_map(particles, settings, config, config.batch_size_for(box))]]
        model.current_resolution_angstrom = schedule.current_resolution(
            box, pixel, iteration=0, ini_high_angstrom=schedule.starting_resolution_angstrom(config)
        ).resolution_angstrom
        self.moments = gradient.Moments.start(PaddedGrid.create(box, config.padding_factor, box // 2))
        poses = ParticleState.from_particles(particles, pixel)
        return RunState(model, optimiser, poses, np.random.default_rng(config.random_seed),
                        extras={"step_sizes": np.zeros(0), "subset_sizes": np.zeros(0)})

    def resume(self, run, particles, iteration_root):
        raise InputError("initial_model: --continue is not available yet; start the run again")

    # ------------------------------------------------------------------ one iteration
    def batch(self, iteration: int, n_particles: int) -> tuple[np.ndarray, np.ndarray]:
        """The two pseudo-half sets of the iteration's mini-batch (sorted particle indices): a random draw of
        RELION's size (`em.gradient.subset_size`; every particle where it would hold them all), split as RELION
        splits them, by the parity of the particle's index (even: the first)."""
        size = gradient.subset_size(iteration, self.phases, *self.subset_sizes, n_particles)
        draw = np.random.default_rng([self.config.random_seed, iteration, SUBSET_STREAM])
        members = np.sort(draw.permutation(n_particles)[: size or n_particles])
        return members[members % 2 == 0], members[members % 2 == 1]

    def plan(self, run, iteration):
        config, model = self.config, run.model
        optimiser = replace(run.optimiser, iteration=iteration)
        sizes = schedule.image_sizes(model.current_resolution_angstrom, optimiser.healpix_order,
                                     self.diameter_angstrom, model.ori_size_px, model.pixel_size_angstrom,
                                     config.incr_size_px, False, False, ave_pmax=model.ave_pmax,
                                     oversampling=config.oversampling,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        model.current_size_px, model.coarse_size_px = sizes.current_size_px, sizes.coarse_size_px
        optimiser = replace(optimiser, perturbation=next_perturbation(optimiser.perturbation, 0.5, run.rng))
        run.optimiser = optimiser
        sampling = schedule.sampling_from_optimiser(optimiser, config)
        max_sig = config.max_significants if config.max_significants > 0 else MAX_SIGNIFICANTS_PER_CLASS
        setup = IterationSetup(
            projectors=None, maps=[model.maps[0][0]], sigma2_noise=model.sigma2_noise, sampling=sampling,
            ori_size_px=model.ori_size_px, current_size_px=sizes.current_size_px,
            coarse_size_px=sizes.coarse_size_px, pixel_size_angstrom=model.pixel_size_angstrom,
            log_pdf_class=np.zeros(1), sigma_offset_px=model.sigma_offset_angstrom / model.pixel_size_angstrom,
            do_cc=False, adaptive_fraction=config.adaptive_fraction, max_significants=max_sig,
            scale_correction=model.scale_correction if config.do_scale else None,
            data_vs_prior=None if model.ssnr is None else model.ssnr[0],
            padding_factor=config.padding_factor, avg_norm_correction=model.avg_norm_correction,
            likelihood_size_px=schedule.likelihood_size_px(config.strict_highres_exp_angstrom, model.ori_size_px,
                                                           model.pixel_size_angstrom, sizes.current_size_px))
        halves = self.batch(iteration, len(run.particles.rot_deg))
        units = [WorkUnit(f"pseudo-half {h + 1}", members, np.zeros(1, dtype=np.int64), setup)
                 for h, members in enumerate(halves)]
        return loop.IterationPlan(iteration, sizes, sampling, False, units)

    def maximization_groups(self, plan):
        """The one map is made from both pseudo-half sets' sums."""
        return [[(0, 0), (1, 0)]]

    def maximize(self, model, sums, plan, backend, peers=mstep.ALONE):
        """The VDAM step of the map (`em.gradient.gradient_update`) and RELION's other parameters with momentum."""
        config = self.config
        previous_model = model
        model = dataclasses.replace(model)
        small = WeightedSums.total([s.without_volumes() for s in sums])
        box, n_shells = model.ori_size_px, model.n_shells
        r_max = plan.sizes.current_size_px // 2
        grid = PaddedGrid.create(box, config.padding_factor, r_max)
        previous = np.asarray(model.maps[0][0], dtype=np.float64)
        reference_ft = Projector(previous, config.padding_factor, r_max, do_gridding=False).data
        tau2 = np.zeros((1, 1, n_shells))
        t2 = np.asarray(Projector(previous, config.padding_factor, r_max).power_spectrum, dtype=np.float64)[:n_shells]
        t2[r_max + 1:] = 0.0
        tau2[0, 0, : t2.size] = t2
        halves = [(to_host(s.data[0]), to_host(s.weight[0])) for s in sums]
        for s in sums:
            s.data[0] = s.weight[0] = None
        # the noise of the reconstruction from the first pseudo-half set's weights (RELION's updateSSNRarrays of
        # its first back-projector)
        sigma2 = np.asarray(to_host(BackProjector.from_arrays(halves[0][0], halves[0][1], box, config.padding_factor,
                                                              r_max).noise_sigma2()), dtype=np.float64)[:n_shells]
        iteration = plan.iteration
        fudge = gradient.tau2_fudge_at(iteration, self.phases, config.tau2_fudge)
        step = gradient.class_step_size(gradient.step_size(iteration, self.phases), float(model.pdf_class[0]), 1)
        update = gradient.gradient_update(reference_ft, halves, grid, self.moments, step=step, tau2_fudge=fudge)
        volume = gradient.map_from_padded_ft(update.reference_ft, grid)
        volume = self.masks.apply(volume)
        model.maps = [[np.asarray(volume, dtype=np.float32)]]
        ssnr = np.zeros((1, 1, n_shells))
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(sigma2 > 0, fudge * t2[: sigma2.size] / sigma2, 0.0)
        s[r_max + 1:] = 0.0
        ssnr[0, 0, : s.size] = s
        ref_sigma2 = np.zeros((1, 1, n_shells))
        ref_sigma2[0, 0, : sigma2.size] = sigma2
        model.tau2, model.ssnr, model.reference_sigma2 = tau2, ssnr, ref_sigma2
        model.pdf_class = model.class_distribution = np.ones(1)
        model.fsc_halves = update.fsc_estimate[None, :n_shells]
        pdf = np.asarray(small.pdf_direction, dtype=np.float64).reshape(1, -1)
        total = pdf.sum()
        pdf = pdf / total if total > 0 else np.full(pdf.shape, 1.0 / pdf.size)
        mstep.maximize_other_parameters(model, config, [small], False)
        whole = sum(unit.members.size for unit in plan.units) == len(self.particles)
        self._with_momentum(model, previous_model, pdf, 0.0 if whole else gradient.MOMENTUM)
        return model

    @staticmethod
    def _with_momentum(model, previous, pdf_direction, mu):
        """RELION's maximizationOtherParameters under --grad: each parameter the mini-batch estimates is averaged
        with its previous value, momentum `mu` (RELION's 0.9; 0 where the batch holds every particle; the first
        iteration's previous values are the start's)."""
        model.sigma2_noise = with_momentum(previous.sigma2_noise, model.sigma2_noise, mu)
        model.sigma_offset_angstrom = float(np.sqrt(with_momentum(previous.sigma_offset_angstrom ** 2,
                                                                  model.sigma_offset_angstrom ** 2, mu)))
        model.avg_norm_correction = float(with_momentum(previous.avg_norm_correction, model.avg_norm_correction, mu))
        if model.scale_correction is not None and previous.scale_correction is not None:
            model.scale_correction = with_momentum(previous.scale_correction, model.scale_correction, mu)
        old = previous.pdf_direction
        if old is not None and np.shape(old) == np.shape(pdf_direction):
            pdf_direction = with_momentum(old, pdf_direction, mu)
        model.pdf_direction = pdf_direction

    def update(self, run, plan, changes):
        config, model = self.config, run.model
        model.current_resolution_angstrom = schedule.current_resolution(
            model.ori_size_px, model.pixel_size_angstrom, data_vs_prior=model.ssnr[0], iteration=plan.iteration,
            ini_high_angstrom=config.ini_high_angstrom, check_high_res_side=False).resolution_angstrom
        run.optimiser = replace(run.optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)
        n_batch = sum(unit.members.size for unit in plan.units)
        run.extras["step_sizes"] = np.append(run.extras["step_sizes"],
                                             gradient.step_size(plan.iteration, self.phases))
        run.extras["subset_sizes"] = np.append(run.extras["subset_sizes"], n_batch)

    def finished(self, run, plan):
        return False  # every one of --iter iterations runs

    def summary(self, run, plan, changes):
        model = run.model
        n_batch = sum(unit.members.size for unit in plan.units)
        return (f"resolution {model.current_resolution_angstrom:.2f} Å, size {plan.sizes.current_size_px}/"
                f"{plan.sizes.coarse_size_px} px, mini-batch {n_batch}, step "
                f"{gradient.step_size(plan.iteration, self.phases):.2f}, τ² fudge "
                f"{gradient.tau2_fudge_at(plan.iteration, self.phases, self.config.tau2_fudge):.2f}, "
                f"pmax {model.ave_pmax:.3f}")

    # ------------------------------------------------------------------ outputs
    def writes_files(self, plan) -> bool:
        """RELION writes a gradient run's files every WRITE_EVERY iterations, at the last, and in every iteration
        whose batch holds every particle (MlOptimiser::write)."""
        every = sum(unit.members.size for unit in plan.units) == len(self.particles)
        return every or plan.iteration % WRITE_EVERY == 0 or plan.iteration == int(self.config.max_iterations)

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        """The iteration's files (RELION's names) where RELION writes them (`writes_files`); the optimiser STAR file
        last."""
        if not self.writes_files(plan):
            return []
        config, model, optimiser = self.config, run.model, run.optimiser
        out_root = config.output_root
        root = f"{out_root}_it{plan.iteration:03d}"
        pixel = model.pixel_size_angstrom
        particles = self.particles
        table = particle_table(particles.star.particles, snapshot, None, pixel,
                               group_number=particles.scale_group_index + 1)
        names, counts = particles.optics_names_and_counts()
        maps = [f"{root}_class001.mrc"]
        blocks = model_star_blocks(model, optimiser, config, None, maps, names, counts,
                                   pdf_direction=model.pdf_direction,
                                   scale_groups=particles.scale_group_names_and_counts())
        writes = [partial(write_particle_star, particles.star, f"{root}_data.star", table),
                  partial(mrc.write_volume, maps[0], model.maps[0][0], pixel),
                  partial(write_star, blocks, f"{root}_model.star"),
                  partial(write_sampling_star, f"{root}_sampling.star", plan.sampling, optimiser, config, pixel)]
        if plan.iteration == int(config.max_iterations):
            writes.append(partial(self.write_initial_model, np.array(model.maps[0][0], dtype=np.float64), pixel))
        optimiser_blocks = optimiser_star_blocks(optimiser, model, config, str(out_root), plan.iteration)
        self._gradient_labels(optimiser_blocks["optimiser_general"], plan)
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_blocks,
                                          list(argv))]

    def write_initial_model(self, volume: np.ndarray, pixel_size_angstrom: float) -> None:
        """INITIAL_MODEL_NAME beside the run: the last map, with --sym other than C1 turned to the group's axes and
        symmetrised (`em.align_symmetry`, RELION's relion_align_symmetry --apply_sym)."""
        path = Path(self.config.output_root).parent / INITIAL_MODEL_NAME
        group = symmetry_group(self.symmetry)
        if group.order > 1:
            aligned = align_to_symmetry(volume, group, np.random.default_rng([self.config.random_seed,
                                                                              ALIGN_STREAM]))
            log.info("initial model: turned by rot %.1f°, tilt %.1f°, psi %.1f° to the axes of %s (asymmetry %.3g → "
                     "%.3g) and symmetrised: %s", *aligned.angles_deg, self.symmetry, aligned.asymmetry_before,
                     aligned.asymmetry_after, path)
            volume = aligned.volume
        mrc.write_volume(str(path), np.asarray(volume, dtype=np.float32), pixel_size_angstrom)

    def _gradient_labels(self, general: dict, plan) -> None:
        """RELION's gradient labels of optimiser_general (MlOptimiser::write) for this run."""
        n_batch = sum(unit.members.size for unit in plan.units)
        initial, final = self.subset_sizes
        general.update({
            "rlnDoGradientRefine": 1, "rlnDoStochasticGradientDescent": 1,
            "rlnTau2FudgeScheme": f"{self.config.tau2_fudge:.6f}-step",
            "rlnGradEmIters": 0, "rlnGradHasConverged": 0,
            "rlnGradCurrentStepsize": f"{gradient.step_size(plan.iteration, self.phases):.6f}",
            "rlnSgdInitialIterationsFraction": f"{gradient.INITIAL_FRACTION:.6f}",
            "rlnSgdFinalIterationsFraction": f"{gradient.FINAL_FRACTION:.6f}",
            "rlnSgdInitialSubsetSize": initial, "rlnSgdFinalSubsetSize": final,
            "rlnSgdMuFactor": f"{gradient.MOMENTUM:.6f}",
            "rlnSgdSubsetSize": n_batch if n_batch < len(self.particles) else -1,
            "rlnSgdWriteEverySubset": WRITE_EVERY,
            "rlnSgdStepsize": f"{gradient.INITIAL_MODEL_STEP_SIZE:.6f}",
            "rlnSgdStepsizeScheme": f"{gradient.INITIAL_MODEL_FIRST_STEP_SIZE / gradient.INITIAL_MODEL_STEP_SIZE:.6f}"
                                    f"-step",
        })

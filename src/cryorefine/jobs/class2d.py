"""2D classification into K classes (relion_refine without --ref: RELION's Class2D, the EM algorithm).

The same machinery as the 3D jobs with 2D references (RELION's ref_dim 2): a class is an (N, N) image whose
"projection" at an in-plane angle psi is its transform rotated (`core.projector` on a 2D grid); the sampling is
psi alone (`core.sampling.Sampling.in_plane`: --psi_step, RELION's 10° without it; its 2^oversampling children)
and the translations of --offset_range/--offset_step; each iteration's E-step is one work unit of the particles
against every class, on the numpy engine or, with --gpu, on the GPU engine's 2D path (a GPU per process); the
M-step reconstructs each class from its 2D sums on the engine's device, regularised by τ², the power of the class's
previous image, times --tau2_fudge (RELION's GUI writes 2 for Class2D). RELION's rules:
- no --ref (EM and VDAM alike, RELION 4/5's initialiseReferences): each class starts from RELION's random Gaussian
  blobs (`em.references.blobs`) as high as its share of the first 1,000 particles of each optics group (particle i
  in class i mod K, each at a random psi, CTF-weighted and averaged), low-passed to --ini_high, or without it to
  RELION's shell 0.07·box, and faded to the mean outside the particle's circle (`initial_references`);
- --center_classes: after each M-step every class average is moved to its centre of mass (of its positive
  values; at most --offset_range pixels), as RELION's centerClasses;
- --flatten_solvent: the averages outside the circle of --particle_diameter set to zero with a soft edge;
- --fast_subsets: iterations 1-5 take 100 random particles per class, 6-10 three times as many, 11-15 that or 30 %
  of the data (RELION's sizes in 2D); --skip_align: each particle keeps its psi and origin, only its class is
  searched; --zero_mask, --ctf, --ctf_intact_first_peak, --norm, --scale, --oversampling, --iter, --K,
  --particle_diameter and --continue as in the 3D jobs; every one of --iter iterations runs;
- the class distribution is the class prior of the next search; the resolution is where the best class's SSNR
  (tau2_fudge·τ²/σ²) drops below 1; the coarse pass compares images of the size the coarse psi step resolves at
  the particle's edge (RELION's keep-safe factor 1.5 in 2D).
VDAM (--grad, RELION 4/5's GUI default: `--grad --class_inactivity_threshold 0.1 --grad_write_iter 10 --iter 200`):
each iteration is a gradient step (`em.gradient`) on a random mini-batch of RELION's 2D sizes
(`em.gradient.class2d_subset_sizes`: from max(min(0.5 %, 10,000), 200) to max(min(5 %, 100,000), 1,000) particles,
every particle in the last iteration), split into two pseudo-half sets by the parity of the particle's index, each an
E-step work unit against every class (without --maxsig a particle keeps at most 5·K significant coarse samples over
all K classes, RELION's maximum_significants under --grad in 2D; both engines cut with it, `estep.common`);
each class's average moves along its gradient with momentum (`em.gradient.vdam_maximization`), the step size from 0.9
to 0.3 and the τ² fudge from 1 to --tau2_fudge over RELION's phases of --iter; the class distribution and the other
parameters take momentum 0.9; between the initial and the final phase the least active class, where its share is
below --class_inactivity_threshold of an even share, becomes a copy of the class of the largest gradient;
--center_classes moves an average only by 2 px or more (or 1 % of the diameter), with its momenta, and not in the
final phase but for the last iteration (RELION's rules under --grad); --fast_subsets is refused (RELION's rule).
The files are written every --grad_write_iter iterations, at the last, and where the batch holds every particle, with
the momenta as RELION writes them (run_itNNN_1moment.mrcs, the first moments of the two pseudo-half sets, classes
1…K then K+1…2K; run_itNNN_2moment.mrcs; model.star's rlnGradMoment1/2), from which --continue goes on exactly as
the run would have. Under mpirun (EM and VDAM) the E-steps and the classes' M-steps are shared out over the workers.
With --gpu the E-steps run on the GPU engine's 2D path (one GPU per process, EM and VDAM, in one process or under
mpirun: the workers' sums added on their GPUs and the references made once among them where each has a GPU of its
own); EM's reconstructions run on the engine's device, VDAM's steps on the host (`em.gradient`). The offsets' prior
counts the sampling's translations as RELION's Class2D does (`IterationSetup.offset_prior_translation_scale`: RELION
adds them in Å to offsets in pixels before the prior, so that about the previous offset the prior is the pixel size
in Å times narrower; at 6 Å/px a particle then rarely moves by more than a fine step an iteration, as RELION's do),
and is centred on (0, 0) for every class (model.star's rlnClassPriorOffsetX/Y, which RELION's reader needs, are 0).
RELION moves each class's centre to the class's weighted sum of offsets divided by the weight of all particles
(maximizationOtherParameters), which is the class's share of the particles times its mean offset (with K = 24 or
100, a few per cent of that mean). The particles' rlnOriginX/YPriorAngst are not used, as in RELION's 2D
classification.
Outputs per iteration: run_itNNN_classes.mrcs (the K class averages, one stack),
run_itNNN_model.star, run_itNNN_data.star (rlnClassNumber, rlnAnglePsi, rlnOriginXAngst/YAngst, no
rlnAngleRot/Tilt), run_itNNN_optimiser.star, run_itNNN_sampling.star, run_itNNN_report.png (the class averages as
a gallery in RELION's order, largest class first, with their shares of the particles and the particles whose best
class each is). Before iteration 1, as RELION writes them, the files of iteration 0
(run_it000_*: the particles, the initial averages, the model.star with RELION's starting τ² and data-versus-prior
spectra of 2D references, with --grad the momenta, the optimiser.star, and under mpirun the sampling.star);
--continue can start from its optimiser.star.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cryorefine.core import euler, fourier
from cryorefine.core.arrays import to_host
from cryorefine.core.grid import relion_round
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.reconstruct import soft_mask_outside_map
from cryorefine.core.sampling import Sampling
from cryorefine.em import gradient, loop, mstep, schedule
from cryorefine.em.estep import WorkUnit
from cryorefine.em.given_poses import GivenPoses
from cryorefine.em.references import blobs, initial_data_versus_prior
from cryorefine.em.state import ModelState, ParticleState, RunState
from cryorefine.errors import InputError
from cryorefine.estep.engine import IterationSetup, WeightedSums
from cryorefine.images import prepare_batch
from cryorefine.io import mrc
from cryorefine.io.background import InOwnProcess, Together
from cryorefine.io.relion_outputs import (
    data_star_write,
    job_model_star_blocks,
    optimiser_star_blocks,
    particle_table,
    write_optimiser_star,
)
from cryorefine.io.run_files import iteration_root
from cryorefine.io.star import write_star
from cryorefine.jobs.classify import classification_summary
from cryorefine.jobs.refine import INITIAL_SIGMA_OFFSET_ANGSTROM
from cryorefine.report import write_class_gallery

if TYPE_CHECKING:  # for annotations only
    from cryorefine.config import RefineConfig
    from cryorefine.data import ParticleSet
    from cryorefine.images import ImageSettings

log = logging.getLogger("cryorefine.class2d")
#: RELION's coarse psi step in 2D without --psi_step
DEFAULT_PSI_STEP_DEG = 10.0
#: without --ini_high the initial averages are low-passed at this fraction of the box in shells (RELION, for
#: do_average_unaligned: "0.07 dig.freq.", Scheres 2010)
INITIAL_LOWPASS_FRACTION_OF_BOX = 0.07
#: the random streams of the initial subsets, of --fast_subsets' draws and of --grad's mini-batches
INITIAL_SUBSETS_STREAM = 2
FAST_SUBSETS_STREAM = 1
GRAD_SUBSET_STREAM = 4
#: under --grad in 2D without --maxsig a particle keeps at most this many significant coarse samples per class, over
#: all classes together (RELION's maximum_significants = 5·K)
GRAD_MAX_SIGNIFICANTS_PER_CLASS = 5
#: under --grad an average is centred only where it moves at least this many pixels, or this share of the particle's
#: diameter (RELION's centerClasses: small moves upset the momenta)
GRAD_CENTRE_MIN_SHIFT_PX = 2.0
GRAD_CENTRE_MIN_SHIFT_OF_DIAMETER = 0.01
#: RELION's width of the low-pass edge of the initial references (WIDTH_FMASK_EDGE), in shells
INITIAL_LOWPASS_EDGE_SHELLS = 2.0
#: RELION's particles per optics group averaged into the initial classes (--nr_parts_sigma2noise's 1000 in 2D)
INITIAL_PARTICLES_PER_OPTICS_GROUP = 1000
#: the spread of the places of RELION's blobs in 2D (SomGraph::make_blobs_2d), a share of the particle's diameter
BLOB_PLACE_SIGMA_OF_DIAMETER = 1.0 / 7.0


def run(config, runner, argv=(), progress=None, resume_from=None, stop_requested=None, overwrite=False):
    """Run a 2D classification of config.n_classes classes with `runner`; the IterationReports (None on an MPI
    worker). `resume_from`: a run_itNNN_optimiser.star of an earlier 2D classification, continued after it."""
    return loop.run(Class2DJob(config), runner, argv, progress, resume_from, stop_requested, overwrite)


def psi_step_deg(config: RefineConfig) -> float:
    """The coarse in-plane step: --psi_step, else RELION's 10° for 2D."""
    return float(config.psi_step_deg) if config.psi_step_deg else DEFAULT_PSI_STEP_DEG


def initial_resolution_angstrom(config: RefineConfig, box_px: int, pixel_size_angstrom: float) -> float:
    """The low-pass of the initial averages and the first iteration's resolution: --ini_high, else the resolution
    of RELION's shell round(0.07·box)."""
    if config.ini_high_angstrom:
        return float(config.ini_high_angstrom)
    return box_px * pixel_size_angstrom / max(1, relion_round(INITIAL_LOWPASS_FRACTION_OF_BOX * box_px))


def lowpass_image(image: np.ndarray, resolution_angstrom: float, pixel_size_angstrom: float) -> np.ndarray:
    """An (N, N) image low-passed as RELION's initialLowPassFilterReferences: a raised cosine two shells wide
    through 0.5 at the resolution's shell."""
    n = image.shape[0]
    shell = n * pixel_size_angstrom / resolution_angstrom
    gain = fourier.raised_cosine(fourier.radius_2d(n), shell - INITIAL_LOWPASS_EDGE_SHELLS / 2,
                                 INITIAL_LOWPASS_EDGE_SHELLS)
    return fourier.irfft2_centered(fourier.rfft2_centered(image) * gain, n)


def initial_subset(optics_index: np.ndarray, per_optics_group: int) -> np.ndarray:
    """The particles (indices, in the STAR file's order) RELION 5 averages into the initial classes without --ref: the
    first `per_optics_group` of each optics group in the file's order (calculateSumOfPowerSpectraAndAverageImage with
    --nr_parts_sigma2noise; INITIAL_PARTICLES_PER_OPTICS_GROUP)."""
    optics_index = np.asarray(optics_index)
    taken = np.zeros(optics_index.size, dtype=bool)
    for group in np.unique(optics_index):
        taken[np.flatnonzero(optics_index == group)[:per_optics_group]] = True
    return np.flatnonzero(taken)


def initial_references(particles: ParticleSet, settings: ImageSettings, config: RefineConfig,
                       batch_size: int) -> list[np.ndarray]:
    """K starting class images (float64 (N, N)) as RELION 4/5 makes them without --ref, for EM and VDAM alike:
    - the average of a subset (`initial_subset`), particle i of the file in class i mod K, each at a random psi:
      the CTF-weighted average of the masked images (data Σ CTF·X at its psi, weights Σ CTF², no τ²) up to half the
      low-pass shell (RELION back-projects them at a current size of the shell's number) — low-passed
      (`initial_resolution_angstrom`);
    - in its place RELION's blobs (`em.references.blobs`, places about the centre with σ diameter/7), low-passed
      again and faded to the mean outside the particle's circle (softMaskOutsideMap, --particle_diameter, the mask's
      edge width). A class without particles starts from zeros."""
    k_classes = int(config.n_classes)
    box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
    draw = np.random.default_rng([config.random_seed, INITIAL_SUBSETS_STREAM])
    chosen = initial_subset(particles.optics_index, INITIAL_PARTICLES_PER_OPTICS_GROUP)
    class_of = np.arange(len(particles)) % k_classes
    psi = np.zeros(len(particles))
    psi[chosen] = draw.uniform(0.0, 360.0, chosen.size)
    resolution = initial_resolution_angstrom(config, box, pixel)
    r_max = max(1, min(box // 2, relion_round(box * pixel / resolution) // 2))
    sums = [BackProjector(box, config.padding_factor, r_max, ndim=2) for _ in range(k_classes)]
    size = min(box, 2 * (r_max + 1))  # the images and CTFs out to r_max alone: what the back-projection takes
    with particles.image_reader() as reader:
        for indices in particles.batches(batch_size, chosen):
            batch = prepare_batch(particles, indices, reader, settings, size, 1.0, 0)
            mats = euler.euler_to_matrix(np.zeros(indices.size), np.zeros(indices.size), psi[indices])
            for k in range(k_classes):
                mine = class_of[indices] == k
                if mine.any():
                    ctf = batch.ctf[mine]
                    sums[k].backproject(batch.images_ft[mine] * ctf, ctf * ctf, mats[mine])
    diameter_px = settings.particle_diameter_angstrom / pixel
    out = []
    for bp in sums:
        if float(np.sum(bp.weight)) <= 0:
            out.append(np.zeros((box, box)))
            continue
        average = lowpass_image(np.asarray(bp.reconstruct(), dtype=np.float64), resolution, pixel)
        image = lowpass_image(blobs(average, diameter_px, BLOB_PLACE_SIGMA_OF_DIAMETER, draw), resolution, pixel)
        out.append(np.asarray(soft_mask_outside_map(image, diameter_px / 2.0, config.width_mask_edge_px),
                              dtype=np.float64))
    return out


def centre_of_mass_px(image: np.ndarray) -> np.ndarray:
    """(x, y) of the centre of mass of an image's positive values relative to its centre N//2 (RELION's
    centerOfMass: negative values do not count); zeros where nothing is positive."""
    n = image.shape[0]
    positive = np.where(image > 0, image, 0.0)
    mass = float(positive.sum())
    if mass <= 0:
        return np.zeros(2)
    k = np.arange(n, dtype=np.float64) - n // 2
    return np.array([positive.sum(axis=0) @ k, positive.sum(axis=1) @ k]) / mass  # column and row masses


def centring_move_px(image: np.ndarray, max_shift_px: float) -> tuple[np.ndarray, float]:
    """(the (x, y) move that brings the image's centre of mass (`centre_of_mass_px`) to the centre, at most
    `max_shift_px` long (RELION's centerClasses: at most the offset range); its length, exactly `max_shift_px`
    where the move was cut to it, not the cut vector's length with its rounding)."""
    com = centre_of_mass_px(image)
    length = float(np.hypot(*com))
    if length > max_shift_px > 0:
        return com * (-max_shift_px / length), float(max_shift_px)
    return -com, length


def centring_shift_px(image: np.ndarray, max_shift_px: float) -> np.ndarray:
    """The move of `centring_move_px`."""
    return centring_move_px(image, max_shift_px)[0]


def grad_centring_shift_px(image: np.ndarray, max_shift_px: float, least_shift_px: float) -> np.ndarray | None:
    """Under --grad, the move that centres the image (`centring_move_px`), or None where it is shorter than
    `least_shift_px` (RELION's centerClasses: small moves upset the momenta). A move cut to `max_shift_px` counts
    as exactly that long: where the offset range equals the least move, as in RELION's rule at a 2 px range, the
    rescaled vector's rounding does not decide whether the class is centred."""
    shift, length = centring_move_px(image, max_shift_px)
    return None if length < least_shift_px else shift


def shifted_image(image: np.ndarray, shift_px: np.ndarray) -> np.ndarray:
    """The image moved by `shift_px` (x, y), sub-pixel by a phase shift of its transform."""
    if not np.any(shift_px):
        return image
    n = image.shape[0]
    ft = fourier.phase_shift_2d(fourier.rfft2_centered(image)[None], shift_px[:1], shift_px[1:], n)[0]
    return fourier.irfft2_centered(ft, n)


def centred_image(image: np.ndarray, max_shift_px: float) -> np.ndarray:
    """The image moved so that its centre of mass comes to the centre (`centring_shift_px`)."""
    return shifted_image(image, centring_shift_px(image, max_shift_px))


def moment_stack_names(root: str) -> tuple[str, str]:
    """RELION's files of a 2D gradient run's momenta (MlModel::write, ref_dim 2): the first moments of the two
    pseudo-half sets (classes 1…K, then K+1…2K) and the second moments, one stack each."""
    return f"{root}_1moment.mrcs", f"{root}_2moment.mrcs"


class Class2DJob:
    """The 2D classification as the iteration loop (`em.loop`) runs it. Its extras, per iteration so far: the
    class distribution (`class_distributions`), the share of particles that changed class (`class_changes`)
    and each class's resolution in Å (`class_resolutions`)."""

    kind = "class2d"
    min_mpi_ranks = 2  # a master and a worker

    def __init__(self, config):
        self.config = config
        self.particles = None
        self.settings = None
        self.phases = gradient.gradient_phases(int(config.max_iterations))  # --grad's
        self.subset_sizes = (0, 0)  # --grad's mini-batches, set by load

    # ------------------------------------------------------------------ set-up
    def load(self):
        config = self.config
        if config.sigma_ang_deg or config.sigma_psi_deg:
            raise InputError("class2d: local searches (--sigma_ang/--sigma_psi) are not available in 2D; drop them")
        if config.firstiter_cc:
            raise InputError("class2d: --firstiter_cc is not available in 2D; drop it")
        if config.symmetry.upper() != "C1":
            raise InputError(f"class2d: --sym {config.symmetry}: 2D classes have no point-group symmetry; drop --sym")
        if config.grad and config.fast_subsets:
            raise InputError("class2d: --fast_subsets cannot be used with --grad (as in RELION: VDAM takes its own "
                             "mini-batches); drop --fast_subsets")
        particles, settings = loop.particles_and_settings(config)
        settings = replace(settings, per_particle_offset_priors=False)  # RELION's ref_dim 2
        if config.skip_align and "rlnAnglePsi" not in particles.pose_columns:
            raise InputError(f"{config.input_star}: no rlnAnglePsi column; --skip_align keeps each particle's psi and "
                             f"origin, as an earlier 2D classification's run_data.star has them")
        self.diameter_angstrom = settings.particle_diameter_angstrom
        self.particles, self.settings = particles, settings
        if config.grad:
            self.subset_sizes = gradient.class2d_subset_sizes(len(particles))
            log.info("VDAM: %d iterations (%d initial, %d in between, %d final), mini-batches of %d to %d of %d "
                     "particles", self.phases.n_iterations, self.phases.initial, self.phases.between,
                     self.phases.final, *self.subset_sizes, len(particles))
        return particles, settings

    def _diameter_angstrom(self, model):
        """The particle's diameter (Å) of the run (what load finds; an MPI worker, which does not load, from the
        model's box)."""
        return schedule.default_particle_diameter_angstrom(self.config, model.ori_size_px, model.pixel_size_angstrom)

    def start(self, particles, settings, noise_spectra):
        config = self.config
        rng = np.random.default_rng(config.random_seed)  # the run's draws: the sampling's perturbations first
        k_classes = int(config.n_classes)
        if k_classes > len(particles):
            log.warning("--K %d with %d particles: %d classes or more will hold no particle; give --K %d or fewer",
                        k_classes, len(particles), k_classes - len(particles), len(particles))
        box, pixel = settings.ori_size_px, settings.pixel_size_angstrom
        model = ModelState(ori_size_px=box, pixel_size_angstrom=pixel, n_classes=k_classes,
                           padding_factor=config.padding_factor, pdf_class=np.full(k_classes, 1.0 / k_classes),
                           sigma_offset_angstrom=INITIAL_SIGMA_OFFSET_ANGSTROM,
                           scale_correction=np.ones(particles.n_scale_groups),
                           pdf_direction=np.full((k_classes, 1), 1.0 / k_classes))
        model.sigma2_noise = noise_spectra(particles, settings, len(particles.optics_groups))
        model.maps = [initial_references(particles, settings, config, config.batch_size_for(box))]
        model.current_resolution_angstrom = initial_resolution_angstrom(config, box, pixel)
        optimiser, _ = schedule.initial_schedule(config, rng)
        if config.grad:
            grid = gradient.full_grid(box, config.padding_factor, 2)
            model.moments = [gradient.Moments.start(grid) for _ in range(k_classes)]
        poses = ParticleState.from_particles(particles, pixel)
        poses.rot_deg[:] = 0.0  # 2D: psi alone
        poses.tilt_deg[:] = 0.0
        if not config.skip_align:
            poses.psi_deg[:] = 0.0
        return RunState(model, optimiser, poses, rng,
                        extras={"class_distributions": np.zeros((0, k_classes)), "class_changes": np.zeros(0),
                                "class_resolutions": np.zeros((0, k_classes))})

    def resume(self, run, particles, iteration_root):
        stack = mrc.read_stack(f"{iteration_root}_classes.mrcs")
        if stack.shape[0] != self.config.n_classes:
            raise InputError(f"{iteration_root}_classes.mrcs: holds {stack.shape[0]} classes, the run has "
                             f"{self.config.n_classes}")
        run.model.maps = [[np.array(image, dtype=np.float32) for image in stack]]
        if self.config.grad:
            run.model.moments = read_moment_stacks(iteration_root, int(self.config.n_classes),
                                                   gradient.full_grid(run.model.ori_size_px,
                                                                      self.config.padding_factor, 2))

    # ------------------------------------------------------------------ one iteration
    def plan(self, run, iteration, estimate_accuracy=None):
        config, model = self.config, run.model
        k_classes = int(config.n_classes)
        box, pixel = model.ori_size_px, model.pixel_size_angstrom
        sizes = schedule.image_sizes(model.current_resolution_angstrom, 0, self.diameter_angstrom, box, pixel,
                                     config.incr_size_px, False, False, ave_pmax=model.ave_pmax, oversampling=0,
                                     strict_highres_exp_angstrom=config.strict_highres_exp_angstrom,
                                     max_coarse_size_px=config.max_coarse_size_px)
        current = sizes.current_size_px
        coarse = sizes.coarse_size_px
        if config.oversampling > 0 and config.strict_highres_exp_angstrom <= 0 and not config.skip_align:
            coarse = schedule.coarse_size_2d_px(psi_step_deg(config), self.diameter_angstrom, box, pixel, current,
                                                config.max_coarse_size_px)
        elif config.skip_align:
            coarse = current
        sizes = schedule.ImageSizes(current, coarse)
        model.current_size_px, model.coarse_size_px = current, coarse
        likelihood = schedule.likelihood_size_px(config.strict_highres_exp_angstrom, box, pixel, current)
        optimiser = replace(run.optimiser, iteration=iteration)
        if not config.skip_align:  # RELION does not perturb the poses it keeps
            optimiser = schedule.perturbed(optimiser, run.rng)
        run.optimiser = optimiser
        sampling = self._sampling(optimiser)
        poses = run.particles
        with np.errstate(divide="ignore"):
            log_class = np.log(np.asarray(model.pdf_class, dtype=np.float64))

        def unit(name, members, max_significants):
            searched = (GivenPoses.of(poses.rot_deg, poses.tilt_deg, poses.psi_deg, members) if config.skip_align
                        else sampling)
            setup = IterationSetup(
                projectors=None, maps=list(model.maps[0]), sigma2_noise=model.sigma2_noise, sampling=searched,
                ori_size_px=box, current_size_px=current, coarse_size_px=coarse, pixel_size_angstrom=pixel,
                log_pdf_class=log_class, sigma_offset_px=model.sigma_offset_angstrom / pixel,
                adaptive_fraction=config.adaptive_fraction, max_significants=max_significants,
                scale_correction=model.scale_correction if config.do_scale else None,
                data_vs_prior=None if model.ssnr is None else model.ssnr[0],
                padding_factor=config.padding_factor, avg_norm_correction=model.avg_norm_correction,
                local_searches=bool(config.skip_align), likelihood_size_px=likelihood, ref_dim=2,
                offset_prior_translation_scale=pixel)
            return WorkUnit(name, members, np.arange(k_classes, dtype=np.int64), setup)

        n_particles = len(poses.psi_deg)
        if not config.grad:
            units = [unit("all classes", self._subset(iteration, n_particles), config.max_significants)]
            return loop.IterationPlan(iteration, sizes, sampling, False, units)
        batch = gradient.mini_batch(iteration, self.phases, self.subset_sizes, n_particles, k_classes,
                                    config.random_seed, GRAD_SUBSET_STREAM)
        max_sig = (config.max_significants if config.max_significants > 0
                   else GRAD_MAX_SIGNIFICANTS_PER_CLASS * k_classes)
        units = [unit(f"pseudo-half {h + 1}", members, max_sig)
                 for h, members in enumerate(gradient.pseudo_halves(batch))]
        phases = self.phases
        return gradient.GradientPlan(
            iteration, sizes, sampling, False, units,
            step_size=gradient.step_size(iteration, phases, gradient.CLASS2D_STEP_SIZE,
                                         gradient.CLASS2D_FIRST_STEP_SIZE),
            tau2_fudge=gradient.tau2_fudge_at(iteration, phases, config.tau2_fudge),
            whole_batch=batch.size == n_particles,
            may_replace_class=phases.initial < iteration < phases.initial + phases.between)

    def _sampling(self, optimiser):
        """The in-plane sampling of `optimiser`'s iteration."""
        return Sampling(optimiser.healpix_order, optimiser.offset_range_px, optimiser.offset_step_px,
                        psi_step_deg=psi_step_deg(self.config), oversampling=self.config.oversampling,
                        perturbation=optimiser.perturbation, in_plane=True)

    def _subset(self, iteration, n_particles):
        """All particles, or with --fast_subsets RELION's random subset of 2D (`schedule.fast_subset_size` from 100
        per class), drawn afresh each iteration; the others keep their poses and classes."""
        config = self.config
        size = (schedule.fast_subset_size(iteration, config.n_classes, n_particles,
                                          schedule.FAST_SUBSET_PARTICLES_PER_CLASS_2D)
                if config.fast_subsets else None)
        if size is None:
            return np.arange(n_particles)
        log.info("--fast_subsets: iteration %d takes %d random particles of %d", iteration, size, n_particles)
        draw = np.random.default_rng([config.random_seed, iteration, FAST_SUBSETS_STREAM])
        return np.sort(draw.permutation(n_particles)[:size])

    def maximization_groups(self, plan):
        """Every class's average is made apart (under --grad from both pseudo-half sets' sums)."""
        if self.config.grad:
            return [[(0, i), (1, i)] for i in range(len(plan.units[0].classes))]
        return [[(0, i)] for i in range(len(plan.units[0].classes))]

    def maximize(self, model, sums, plan, backend, peers=mstep.ALONE, parts=None):
        """Per class: τ² from the previous average's power, the 2D reconstruction, its SSNR, on the backend's device
        where the sums are (the GPU engine's stay there); --center_classes and --flatten_solvent on the new average
        (on the host); then the class distribution and RELION's other parameters. Under --grad,
        `_maximize_gradient`."""
        config = self.config
        if config.grad:
            return self._maximize_gradient(model, sums, plan, peers, backend.array_module, parts)
        xp = backend.array_module
        model = dataclasses.replace(model)
        k_classes = model.n_classes
        unit = plan.units[0]
        small = WeightedSums.total([s.without_volumes().spread_to_classes(u.classes, k_classes)
                                    for s, u in zip(sums, plan.units)])
        n_shells = model.n_shells
        r_max = plan.sizes.current_size_px // 2
        tau2, ssnr, ref_sigma2 = (np.zeros((1, k_classes, n_shells)) for _ in range(3))
        total_weight = float(np.sum(small.pdf_class))
        pdf_class = np.asarray(small.pdf_class, dtype=np.float64) / max(total_weight, 1e-300)
        mask = self._mask(model)
        made = {}
        for i, k in enumerate(unit.classes):
            if not mstep.volumes_here(sums[0], i):
                continue
            with mstep.timed_part(parts, "sums to the device", xp):
                data, weight = backend.to_device(sums[0].data[i]), backend.to_device(sums[0].weight[i])
                sums[0].data[i] = sums[0].weight[i] = None
            if pdf_class[k] <= 0 or float(weight.sum()) <= 0:
                continue  # an empty class: an image of zeros
            with mstep.timed_part(parts, "τ² of the references", xp):
                previous = xp.asarray(np.asarray(model.maps[0][k], dtype=np.float64))
                t2 = np.asarray(to_host(Projector(previous, config.padding_factor, r_max, xp=xp).power_spectrum),
                                dtype=np.float64)[:n_shells]
                t2[r_max + 1:] = 0.0
            with mstep.timed_part(parts, "reconstructions", xp):
                bp = BackProjector.from_arrays(data, weight, model.ori_size_px, config.padding_factor, r_max, xp=xp)
                sigma2 = np.asarray(to_host(bp.noise_sigma2()), dtype=np.float64)[:n_shells]
                image = np.asarray(to_host(bp.reconstruct(tau2=xp.asarray(t2), tau2_fudge=config.tau2_fudge,
                                                          minres_map_px=schedule.MINRES_MAP_SHELL)), dtype=np.float64)
                del bp, data, weight
            with mstep.timed_part(parts, "centring and masks", np):
                if config.center_classes:  # RELION: centerClasses, then solventFlatten
                    image = centred_image(image, plan.sampling.offset_range_px)
                if mask is not None:
                    image = image * mask
            made[int(k)] = (image.astype(np.float32), t2, sigma2)
        with mstep.timed_part(parts, "maps shared among the workers", xp):
            made = mstep.gathered(peers, made)
        new_maps = mstep.class_maps_and_spectra(made, model.maps[0][:k_classes], (tau2, ref_sigma2, ssnr),
                                                config.tau2_fudge, r_max)
        model.maps = [new_maps]
        model.tau2, model.ssnr, model.reference_sigma2 = tau2, ssnr, ref_sigma2
        model.pdf_class = model.class_distribution = pdf_class
        pdf = np.asarray(small.pdf_direction, dtype=np.float64).reshape(k_classes, -1)
        total = pdf.sum()
        model.pdf_direction = pdf / total if total > 0 else np.full(pdf.shape, 1.0 / pdf.size)
        with mstep.timed_part(parts, "other parameters", np):
            mstep.maximize_other_parameters(model, config, [small], False)
        return model

    def _mask(self, model):
        """--flatten_solvent's soft circle of the particle's diameter, or None."""
        if not self.config.flatten_solvent:
            return None
        return fourier.soft_circular_mask(model.ori_size_px, self._diameter_angstrom(model) /
                                          (2 * model.pixel_size_angstrom), self.config.width_mask_edge_px)

    def _maximize_gradient(self, model, sums, plan, peers, xp, parts):
        """VDAM's M-step (`em.gradient.vdam_maximization`, --class_inactivity_threshold, each class's step on `xp`'s
        device), each average then centred (--center_classes, RELION's rule under --grad: `grad_centring_shift_px`)
        with its first moments, and masked (--flatten_solvent); the seconds of its parts added to `parts`."""
        config = self.config
        mask = self._mask(model)
        centre = config.center_classes and (plan.iteration < self.phases.initial + self.phases.between
                                            or plan.iteration == int(config.max_iterations))
        least_shift_px = max(GRAD_CENTRE_MIN_SHIFT_OF_DIAMETER * self._diameter_angstrom(model)
                             / model.pixel_size_angstrom, GRAD_CENTRE_MIN_SHIFT_PX)
        grid = gradient.full_grid(model.ori_size_px, config.padding_factor, 2)

        def finish(image, moments):
            if centre:
                shift = grad_centring_shift_px(image, plan.sampling.offset_range_px, least_shift_px)
                if shift is not None:
                    image = shifted_image(image, shift)
                    moments = gradient.shifted_moments(moments, grid, shift)
            return (image if mask is None else image * mask), moments

        model, replaced = gradient.vdam_maximization(model, sums, plan, config, peers, finish,
                                                     config.class_inactivity_threshold, xp, parts)
        if replaced is not None:
            log.info("iteration %d: class %d (its share below --class_inactivity_threshold %g of an even share) "
                     "replaced by a copy of class %d", plan.iteration, replaced.dropped + 1,
                     config.class_inactivity_threshold, replaced.copied + 1)
        return model

    def update(self, run, plan, changes):
        config, model = self.config, run.model

        def resolution(ssnr):
            return schedule.current_resolution(
                model.ori_size_px, model.pixel_size_angstrom, data_vs_prior=ssnr, iteration=plan.iteration,
                ini_high_angstrom=config.ini_high_angstrom, check_high_res_side=False).resolution_angstrom

        model.current_resolution_angstrom = resolution(model.ssnr[0])
        run.optimiser = replace(run.optimiser, changes_optimal_orientations_deg=changes.orientations_deg,
                                changes_optimal_offsets_angstrom=changes.offsets_angstrom,
                                changes_optimal_classes=changes.classes)
        per_class = [resolution(model.ssnr[0][k:k + 1]) for k in range(model.n_classes)]
        run.append_history("class_distributions", np.asarray(model.pdf_class, dtype=np.float64))
        run.append_history("class_changes", changes.classes)
        run.append_history("class_resolutions", np.asarray(per_class))

    def finished(self, run, plan):
        return False  # every one of --iter iterations runs

    def summary(self, run, plan, changes):
        line = classification_summary(run, plan, changes, angle_name="psi")
        if not self.config.grad:
            return line
        return (f"{line}, mini-batch {sum(unit.members.size for unit in plan.units)}, step {plan.step_size:.2f}, "
                f"τ² fudge {plan.tau2_fudge:.2f}")

    # ------------------------------------------------------------------ outputs
    def initial_outputs(self, run, argv, under_mpi):
        """RELION's files of iteration 0, before iteration 1 (MlOptimiser::initialise; MlOptimiserMpi::initialise
        under mpirun): run_it000_data.star, run_it000_classes.mrcs (the initial class averages), run_it000_model.star
        (uniform class distribution, the initial noise spectra, RELION's starting τ² and data versus prior of 2D
        references: `em.references.initial_data_versus_prior`), with --grad run_it000_1moment.mrcs and
        run_it000_2moment.mrcs (the momenta before the first step), then run_it000_optimiser.star; under mpirun also
        run_it000_sampling.star, as relion_refine_mpi writes it and relion_refine does not. No report."""
        config, model, optimiser = self.config, run.model, run.optimiser
        fudge = gradient.tau2_fudge_at(0, self.phases, config.tau2_fudge) if config.grad else config.tau2_fudge
        tau2, data_vs_prior = initial_data_versus_prior(model.maps[0], model.sigma2_noise, len(self.particles),
                                                        model.pdf_class, fudge)
        written = replace(model, tau2=tau2[None], ssnr=data_vs_prior[None])
        sampling = self._sampling(optimiser) if under_mpi else None
        return self._files(written, optimiser, run.particles.copy(), sampling, fudge, None, argv)

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        """The iteration's files (RELION's names) as callables; the optimiser STAR file comes last. Under --grad
        only where RELION writes them (`em.gradient.writes_files`), with the momenta."""
        config, model = self.config, run.model
        if config.grad and not gradient.writes_files(plan.iteration, int(config.max_iterations), plan.whole_batch,
                                                     config.grad_write_iter):
            return []
        fudge = plan.tau2_fudge if config.grad else config.tau2_fudge
        return self._files(model, run.optimiser, snapshot, plan.sampling, fudge, plan, argv)

    def _files(self, model, optimiser, poses, sampling, tau2_fudge, plan, argv):
        """The writes of the files of `optimiser`'s iteration: data.star (the particles' `poses`), classes.mrcs,
        model.star (its rlnTau2FudgeFactor `tau2_fudge`, RELION's of the iteration), the momenta under --grad,
        sampling.star and the report where `sampling` and `plan` are given (None before iteration 1), then
        optimiser.star."""
        config, particles = self.config, self.particles
        root = iteration_root(config.output_root, optimiser.iteration)
        pixel = model.pixel_size_angstrom
        table = particle_table(particles.star.particles, poses, None, pixel,
                               group_number=particles.scale_group_index + 1)
        table = table.drop(columns=[c for c in ("rlnAngleRot", "rlnAngleTilt") if c in table.columns])
        stack = f"{root}_classes.mrcs"
        first, second = moment_stack_names(root)
        blocks = job_model_star_blocks(
            particles, model, optimiser, replace(config, tau2_fudge=tau2_fudge), stack_entries(stack, model.n_classes),
            pdf_direction=model.pdf_direction, reference_dimensionality=2,
            gradient_moment_images=((stack_entries(first, model.n_classes), stack_entries(second, model.n_classes))
                                    if config.grad else None))
        classes = list(model.maps[0])  # under MPI their arrays are filled as the maps arrive: stacked when written
        optimiser_blocks = optimiser_star_blocks(optimiser, model, config, str(config.output_root),
                                                 optimiser.iteration)
        writes = [data_star_write(particles.star, f"{root}_data.star", table),
                  partial(write_class_stack, stack, classes, pixel),
                  partial(write_star, blocks, f"{root}_model.star")]
        if config.grad:
            writes.insert(0, partial(write_moment_stacks, root, list(model.moments),
                                     gradient.full_grid(model.ori_size_px, config.padding_factor, 2), pixel))
            optimiser_blocks["optimiser_general"].update(gradient.optimiser_labels(
                plan, config, self.phases, self.subset_sizes, len(particles),
                (gradient.CLASS2D_STEP_SIZE, gradient.CLASS2D_FIRST_STEP_SIZE), config.class_inactivity_threshold))
        if sampling is not None:
            writes.append(partial(write_star, sampling_star_blocks(sampling, config, pixel), f"{root}_sampling.star"))
        if plan is not None:
            writes.append(InOwnProcess(partial(write_gallery, f"{root}_report.png", classes,
                                               np.asarray(model.pdf_class, dtype=np.float64), iteration=plan.iteration,
                                               resolution_angstrom=model.current_resolution_angstrom,
                                               particle_counts=np.bincount(poses.class_index,
                                                                           minlength=model.n_classes))))
        return [Together(writes), partial(write_optimiser_star, f"{root}_optimiser.star", optimiser_blocks,
                                          list(argv))]


def stack_entries(stack: str, count: int) -> list[str]:
    """RELION's names of the first `count` images of a stack: 000001@stack, 000002@stack, …"""
    return [f"{k + 1:06d}@{stack}" for k in range(count)]


def write_class_stack(path: str, images: list, pixel_size_angstrom: float) -> None:
    """The class averages in one stack (RELION's run_itNNN_classes.mrcs)."""
    mrc.write_stack(path, np.stack([np.asarray(m, dtype=np.float32) for m in images]), pixel_size_angstrom)


def write_gallery(path: str, images: list, shares: np.ndarray, **settings) -> None:
    """The report's gallery of the class averages (`report.write_class_gallery`)."""
    write_class_gallery(path, np.stack([np.asarray(m, dtype=np.float32) for m in images]), shares, **settings)


def write_moment_stacks(root: str, moments: list, grid, pixel_size_angstrom: float) -> None:
    """The classes' momenta as RELION writes them in 2D (`moment_stack_names`, `em.gradient.moments_as_relion`)."""
    pairs = [gradient.moments_as_relion(m, grid) for m in moments]
    first, second = moment_stack_names(root)
    mrc.write_stack(first, np.stack([f[0] for f, _ in pairs] + [f[1] for f, _ in pairs]), pixel_size_angstrom)
    mrc.write_stack(second, np.stack([s for _, s in pairs]), pixel_size_angstrom)


def read_moment_stacks(root: str, n_classes: int, grid) -> list:
    """The classes' momenta from RELION's 2D files (`write_moment_stacks`); an InputError naming a file that is
    missing or of another number of classes."""
    first, second = moment_stack_names(root)
    for name in (first, second):
        if not Path(name).is_file():
            raise InputError(f"{name}: not found; --continue of a --grad run needs the momenta its iteration wrote; "
                             f"continue from an iteration whose files are all there")
    firsts, seconds = mrc.read_stack(first), mrc.read_stack(second)
    if firsts.shape[0] != 2 * n_classes or seconds.shape[0] != n_classes:
        raise InputError(f"{first}: holds the momenta of {seconds.shape[0]} classes, the run has {n_classes}")
    return [gradient.moments_from_relion((firsts[k], firsts[n_classes + k]), seconds[k], grid)
            for k in range(n_classes)]


def sampling_star_blocks(sampling: Sampling, config: RefineConfig, pixel_size_angstrom: float) -> dict:
    """RELION's run_itNNN_sampling.star of a 2D classification: sampling_general alone (rlnIs3DSampling 0, the psi
    step, offsets in Å), no table of directions."""
    pixel = float(pixel_size_angstrom)
    return {"sampling_general": {
        "rlnIs3DSampling": 0,
        "rlnIs3DTranslationalSampling": 0,
        "rlnHealpixOrder": int(sampling.healpix_order),
        "rlnSymmetryGroup": "C1",
        "rlnTiltAngleLimit": "-91",
        "rlnPsiStep": f"{sampling.psi_step_deg:.6f}",
        "rlnOffsetRange": f"{sampling.offset_range_px * pixel:.6f}",
        "rlnOffsetStep": f"{sampling.offset_step_px * pixel:.6f}",
        "rlnHelicalOffsetStep": "-1",
        "rlnSamplingPerturbInstance": f"{sampling.perturbation:.6f}",
        "rlnSamplingPerturbFactor": "0.5",
        "rlnPsiStepOriginal": f"{psi_step_deg(config):.6f}",
        "rlnOffsetRangeOriginal": f"{config.offset_range_px * pixel:.6f}",
        "rlnOffsetStepOriginal": f"{config.offset_step_px * pixel:.6f}",
    }}

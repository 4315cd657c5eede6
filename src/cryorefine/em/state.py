"""What a run knows between iterations, as plain dataclasses: the model (RELION's MlModel), the
optimiser's schedule (RELION's MlOptimiser fields), the particles' poses (`ParticleState`), and
`RunState`, everything the iteration loop carries (and --continue restores).

Spectra are per Fourier shell of the original box, index 0 … ori_size_px//2. Arrays indexed
by half set have 2 rows (half 1, half 2); with one class, class axes have length 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # for annotations only
    from cryorefine.data import ParticleSet
    from cryorefine.estep.engine import BatchResult


@dataclass
class ModelState:
    ori_size_px: int
    pixel_size_angstrom: float
    n_classes: int = 1
    padding_factor: float = 2.0
    maps: list = field(default_factory=list)  # [half][class] real-space maps (N, N, N) float
    joined_map: np.ndarray | None = None  # the final map from both halves (last iteration)
    pdf_class: np.ndarray | None = None  # (K,)
    sigma2_noise: np.ndarray | None = None  # (n_optics_groups, N//2+1) noise power per shell
    tau2: np.ndarray | None = None  # (2, K, N//2+1)
    ssnr: np.ndarray | None = None  # (2, K, N//2+1)
    reference_sigma2: np.ndarray | None = None  # (2, K, N//2+1) reconstruction noise per shell (1/mean weight)
    fsc_halves: np.ndarray | None = None  # (K, N//2+1) gold-standard FSC (with --solvent_correct_fsc: corrected)
    fsc_unmasked: np.ndarray | None = None  # (K, N//2+1) --solvent_correct_fsc: FSC of the unmasked half maps,
    fsc_masked: np.ndarray | None = None  # ... of the masked ones,
    fsc_random_masked: np.ndarray | None = None  # ... of the masked ones with randomised phases
    randomise_from_shell: int = -1  # ... from this shell (−1: none)
    sigma_offset_angstrom: float = 10.0
    avg_norm_correction: float = 1.0
    scale_correction: np.ndarray | None = None  # (n_optics_groups,)
    # (n_scale_groups,) the particles of each intensity group (RELION's nr_particles_per_group): the weights of the
    # scales' mean; set by the loop from the particles (None: every group weighs the same)
    particles_per_scale_group: np.ndarray | None = None
    current_resolution_angstrom: float = np.inf
    current_size_px: int = 0
    coarse_size_px: int = 0
    log_likelihood: float = 0.0
    ave_pmax: float = 0.0
    accuracy_rotations_deg: float = 999.0
    accuracy_translations_angstrom: float = 999.0
    class_distribution: np.ndarray | None = None  # (K,)
    pdf_direction: np.ndarray | None = None  # (K, n_directions) the direction distribution per class; a
    # refinement's (2, 1, n_directions), one per half set
    moments: list | None = None  # a gradient run's (VDAM, --grad) per class: em.gradient.Moments (RELION's Igrad1/2);
    # --continue reads them from the iteration's files, not from the saved state

    @property
    def n_shells(self) -> int:
        return self.ori_size_px // 2 + 1


@dataclass
class OptimiserState:
    iteration: int = 0
    healpix_order: int = 2
    offset_range_px: float = 6.0
    offset_step_px: float = 2.0
    perturbation: float = 0.0
    local_searches: bool = False  # RELION's orientational_prior_mode
    sigma_rot_deg: float = 0.0  # local-search prior widths
    sigma_tilt_deg: float = 0.0
    sigma_psi_deg: float = 0.0
    nr_iter_wo_resol_gain: int = 0
    nr_iter_wo_large_hidden_variable_changes: int = 0
    best_resolution_so_far_inv_angstrom: float = 0.0
    changes_optimal_orientations_deg: float = 999.0
    changes_optimal_offsets_angstrom: float = 999.0
    changes_optimal_classes: float = 999.0
    smallest_changes_orientations_deg: float = 999.0
    smallest_changes_offsets_angstrom: float = 999.0
    smallest_changes_classes: float = 999.0
    has_converged: bool = False
    has_high_fsc_at_resol_limit: bool = False
    has_large_size_increase_iterations_ago: int = 0
    do_join_halves: bool = False  # the final iteration: halves joined, to Nyquist
    acc_rot_deg: float = 999.0
    acc_trans_angstrom: float = 999.0


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
    def from_particles(cls, particles: ParticleSet, pixel_size_angstrom: float) -> ParticleState:
        n = len(particles)
        return cls(particles.rot_deg.copy(), particles.tilt_deg.copy(), particles.psi_deg.copy(),
                   particles.origin_x_angstrom / pixel_size_angstrom, particles.origin_y_angstrom / pixel_size_angstrom,
                   np.zeros(n, np.int64), particles.norm_correction.copy(), np.zeros(n), np.zeros(n, np.int64),
                   np.zeros(n))

    def copy(self) -> ParticleState:
        return ParticleState(**{f.name: getattr(self, f.name).copy() for f in dataclasses.fields(self)})

    def store(self, indices: np.ndarray, result: BatchResult) -> None:
        """The per-particle results of a batch (an estep.engine.BatchResult) at `indices`."""
        for f in dataclasses.fields(self):
            getattr(self, f.name)[indices] = getattr(result, f.name)


@dataclass
class RunState:
    """Everything the iteration loop carries from one iteration to the next.

    `schedule` is the auto-sampling state of a refinement (None in a classification); `extras` holds
    what else a job keeps (numbers and arrays), saved and restored with the rest by --continue.
    """

    model: ModelState
    optimiser: OptimiserState
    particles: ParticleState
    rng: np.random.Generator
    schedule: object = None
    extras: dict = field(default_factory=dict)

    def append_history(self, name: str, value: npt.ArrayLike) -> None:
        """Add this iteration's `value` to the history extras[name] (one row per iteration; a run continued from
        files written before the history was kept starts it empty)."""
        value = np.asarray(value, dtype=np.float64)
        history = np.asarray(self.extras.get(name, np.zeros((0,) + value.shape)), dtype=np.float64)
        self.extras[name] = np.concatenate([history.reshape((-1,) + value.shape), value[None]])


@dataclass
class IterationReport:
    """What one iteration did, for the command's summary, the benchmarks and the tests."""

    iteration: int
    resolution_angstrom: float
    current_size_px: int
    coarse_size_px: int
    healpix_order: int
    local_searches: bool
    changes_orientations_deg: float
    changes_offsets_angstrom: float
    ave_pmax: float
    seconds: dict = field(default_factory=dict)  # plan, expectation, maximization, write
    stage_seconds: dict = field(default_factory=dict)  # the E-step's: set-up, read waits, images, the engine's stages
    stage_flops: dict = field(default_factory=dict)  # useful floating-point operations of the engine's stages


class RunReports(list):
    """A run's IterationReports in order, with the time outside them in named stages (seconds): `start_seconds`
    from the run's set-up to its first iteration's plan, `end_seconds` after its last report (the last files
    written, the device and the workers let go). `finished`: the job's final iteration ran (a refinement converged
    and wrote its final files); `continued_from`: the iteration a --continue went on from (None: a new run)."""

    def __init__(self):
        super().__init__()
        self.start_seconds = {}
        self.end_seconds = {}
        self.finished = False
        self.continued_from = None

"""What a refinement knows between iterations: the model (RELION's MlModel) and the
optimiser's schedule (RELION's MlOptimiser fields), as plain dataclasses.

Spectra are per Fourier shell of the original box, index 0 … ori_size_px//2. Arrays indexed
by half set have 2 rows (half 1, half 2); with one class, class axes have length 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    fsc_halves: np.ndarray | None = None  # (K, N//2+1) gold-standard FSC
    sigma_offset_angstrom: float = 10.0
    avg_norm_correction: float = 1.0
    scale_correction: np.ndarray | None = None  # (n_optics_groups,)
    current_resolution_angstrom: float = np.inf
    current_size_px: int = 0
    coarse_size_px: int = 0
    log_likelihood: float = 0.0
    ave_pmax: float = 0.0
    accuracy_rotations_deg: float = 999.0
    accuracy_translations_angstrom: float = 999.0
    class_distribution: np.ndarray | None = None  # (K,)

    @property
    def n_shells(self):
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

"""The E-step engine contract: what goes into an engine and what comes out of it.

Per iteration the loop calls `engine.setup(IterationSetup)`, then `engine.run(Batch)` for each
batch of particles (returning a `BatchResult`), then `engine.sums()` for the accumulated
`WeightedSums` of the half set the engine serves. The numpy engine (`estep.reference`) is the
oracle; the CuPy engine implements the same contract.

Conventions (RELION's): images are half transforms (`core.fourier`) windowed to the current
size; a particle's origin o (px) means its centre sits at N//2 − o, so shifting the image by
+o centres it; the translation t searched in an iteration is relative to the old origin, and
the new origin is old + t. diff2 = Σ_k |X_t(k) − CTF(k)·P(k)|² / (2σ²(k)) over the valid
coefficients of the half transform (round(|k|) ≤ n/2, without the kx = 0, ky < 0 half column,
and without k = 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class IterationSetup:
    """Everything an engine needs for one iteration of one half set."""

    projectors: list | None  # per class: core.projector.Projector of this half's reference (None: from maps)
    sigma2_noise: np.ndarray  # (n_optics, ori_size//2+1) per-component noise variance per shell
    sampling: object  # core.sampling.Sampling of this iteration (perturbed)
    ori_size_px: int
    current_size_px: int
    coarse_size_px: int
    pixel_size_angstrom: float
    log_pdf_class: np.ndarray  # (K,)
    log_pdf_direction: np.ndarray | None = None  # (K, n_directions) or None for uniform
    sigma_offset_px: float = 10.0
    do_cc: bool = False  # normalised cross-correlation instead of likelihood (--firstiter_cc)
    adaptive_fraction: float = 0.999
    max_significants: int = -1
    local_searches: bool = False
    sigma_rot_deg: float = 0.0  # local-search prior widths (direction, psi)
    sigma_psi_deg: float = 0.0
    scale_correction: np.ndarray | None = None  # (n_optics,)
    data_vs_prior: np.ndarray | None = None  # (K, ori_size//2+1), for the scale sums
    padding_factor: float = 2.0
    avg_norm_correction: float = 1.0  # the model's average norm correction (images were scaled by avg/norm)
    maps: list | None = None  # per class: the real-space reference (N, N, N); each engine builds its projectors


@dataclass
class Batch:
    """A batch of prepared particles (`cryorefine.images.prepare_batch`)."""

    indices: np.ndarray  # (B,) particle indices in the ParticleSet
    images_ft: np.ndarray  # (B, n, n//2+1) complex: masked, norm-corrected, centred on round(old origin)
    images_ft_unmasked: np.ndarray  # (B, n, n//2+1) complex, the same without the mask (for back-projection)
    ctf: np.ndarray  # (B, n, n//2+1) real, CTF·ctf_scale (ones without --ctf)
    optics_index: np.ndarray  # (B,) int
    old_origin_px: np.ndarray  # (B, 2) x, y: the origin the particle had
    residual_origin_px: np.ndarray  # (B, 2): old origin − the integer shift already applied
    prior_rot_deg: np.ndarray  # (B,) previous best pose: the centre of local searches
    prior_tilt_deg: np.ndarray
    prior_psi_deg: np.ndarray
    old_class: np.ndarray  # (B,) 0-based
    norm_correction: np.ndarray  # (B,) the norm correction applied to the images
    power_beyond_current: np.ndarray  # (B, ori_size//2+1) image power per shell (for shells ≥ n/2)


@dataclass
class BatchResult:
    """Per-particle results of a batch, in batch order."""

    rot_deg: np.ndarray
    tilt_deg: np.ndarray
    psi_deg: np.ndarray
    origin_x_px: np.ndarray  # new origin (old + best translation), RELION's sign
    origin_y_px: np.ndarray
    class_index: np.ndarray  # 0-based
    pmax: np.ndarray  # rlnMaxValueProbDistribution
    n_significant: np.ndarray  # rlnNrOfSignificantSamples (coarse samples holding adaptive_fraction)
    log_likelihood: np.ndarray  # rlnLogLikeliContribution
    norm_correction: np.ndarray  # new rlnNormCorrection


@dataclass
class WeightedSums:
    """Sums over the particles of one half set, reduced over workers before the M-step."""

    data: list  # per class: complex padded Fourier data (BackProjector.data)
    weight: list  # per class: real padded weights
    sigma2_noise: np.ndarray  # (n_optics, n_shells) Σ w |X − CTF·P|² per shell
    sumw_group: np.ndarray  # (n_optics,) Σ w (number of particles, weights sum to 1 each)
    sigma2_offset_angstrom2: float = 0.0  # Σ w |offset − prior|² in Å²
    pdf_class: np.ndarray = field(default_factory=lambda: np.zeros(1))  # (K,)
    pdf_direction: np.ndarray | None = None  # (K, n_directions)
    norm_correction: float = 0.0  # Σ new norm corrections
    scale_xa: np.ndarray | None = None  # (n_optics,)
    scale_aa: np.ndarray | None = None  # (n_optics,)
    log_likelihood: float = 0.0
    sum_pmax: float = 0.0
    n_particles: int = 0

"""The E-step engine contract: what goes into an engine and what comes out of it.

Per iteration the loop calls `engine.setup(IterationSetup)`, then `engine.run(Batch)` for each
batch of particles (returning a `BatchResult`), then `engine.sums()` for the accumulated
`WeightedSums` of the half set the engine serves. The numpy engine (`estep.reference`) is the
oracle; the CuPy engine implements the same contract.

The layer: `estep.common` holds what both engines share (the coefficient layout, the set-up tables
`IterationTables`, the compressed fine weights, the significance rule), `estep.reference` the numpy
engine, `estep.cuda` the CuPy engine, `estep.cuda_plan` its batch and chunk sizes (no CuPy import),
`estep.kernels` the CUDA sources and their per-device loader; `estep.backend` makes the engines.

Conventions (RELION's): images are half transforms (`core.fourier`) windowed to the current
size; a particle's origin o (px) means its centre sits at N//2 − o, so shifting the image by
+o centres it; the translation t searched in an iteration is relative to the old origin, and
the new origin is old + t. diff2 = Σ_k |X_t(k) − CTF(k)·P(k)|² / (2σ²(k)) over the valid
coefficients of the half transform (round(|k|) ≤ n/2, without the kx = 0, ky < 0 half column,
and without k = 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule
from cryorefine.core.grid import complex_dtype_for

if TYPE_CHECKING:  # for annotations only
    from cryorefine.core.sampling import LocalOrientations


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
    # --strict_highres_exp: the fine pass's likelihood compares the coefficients up to this size (the coarse one);
    # None: up to the current size. The sums keep the current size.
    likelihood_size_px: int | None = None
    log_pdf_direction: np.ndarray | None = None  # (K, n_directions) or None for uniform
    sigma_offset_px: float = 10.0
    # the sampling's translations count this many times in the offset prior (not in the σ_offset sums): 1, or in a 2D
    # classification the pixel size in Å, as RELION's Class2D computes it (it adds the translations in Å to offsets
    # in pixels before the prior: a prior pixel-size times narrower about the previous offset;
    # docs/pose-accuracy-audit.md, row 10)
    offset_prior_translation_scale: float = 1.0
    do_cc: bool = False  # normalised cross-correlation instead of likelihood (--firstiter_cc)
    adaptive_fraction: float = 0.999
    max_significants: int = -1
    # the fine pass samples finer than --oversampling (a classification's raise): besides its fine samples, the table
    # of a particle's fine pass is limited (estep.common.fine_pass_limit)
    fine_pass_raised: bool = False
    local_searches: bool = False
    sigma_rot_deg: float = 0.0  # local-search prior widths (direction, psi)
    sigma_psi_deg: float = 0.0
    scale_correction: np.ndarray | None = None  # (n_scale_groups,) per intensity group; None without --scale
    data_vs_prior: np.ndarray | None = None  # (K, ori_size//2+1), for the scale sums
    padding_factor: float = 2.0
    avg_norm_correction: float = 1.0  # the model's average norm correction (images were scaled by avg/norm)
    maps: list | None = None  # per class: the real-space reference (N, N, N); each engine builds its projectors
    # an oversampling order a later iteration may switch to (a classification's raise): the GPU engine compiles its
    # fine-pass kernels for it in the background (None: none expected)
    next_oversampling: int | None = None
    # 3: the references are maps (N, N, N) and the sums 3D; 2: 2D references (N, N) compared at in-plane rotations
    # (RELION's ref_dim 2, a 2D classification: `core.projector` on 2D grids, an in-plane sampling)
    ref_dim: int = 3

    @property
    def n_scale_groups(self) -> int | None:
        """The intensity groups the scale sums are kept for: one per scale (--scale); None (one per optics group)
        without."""
        return None if self.scale_correction is None else int(np.size(self.scale_correction))


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
    power_beyond_current: np.ndarray  # (B, ori_size//2+1) per shell, the masked image's power at |k| > current/2
    scale_group_index: np.ndarray | None = None  # (B,) int: the intensity group of --scale (None: the optics group)
    # (B, 2) x, y: the centre of the offsets' prior (RELION's rlnOriginX/YPriorAngst in px), in global and local
    # searches alike; None: (0, 0), RELION's centre where the STAR file gives none
    origin_prior_px: np.ndarray | None = None

    def __post_init__(self):
        if self.scale_group_index is None:
            self.scale_group_index = self.optics_index
        if self.origin_prior_px is None:
            self.origin_prior_px = np.zeros((len(self.indices), 2))


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


def flat_reals(array: Array, real: npt.DTypeLike) -> np.ndarray:
    """`array` (host or device) as one flat, contiguous host array of the real dtype `real`, a complex array's
    values as pairs of reals: how sums cross between MPI ranks and are added there."""
    from cryorefine.core.arrays import to_host

    real = np.dtype(real)
    host = to_host(array)
    if np.iscomplexobj(host):
        host = np.ascontiguousarray(host, dtype=complex_dtype_for(real)).view(real)
    return np.ascontiguousarray(host, dtype=real).reshape(-1)


def from_flat_reals(flat: npt.ArrayLike, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """The array of `shape` and `dtype` that `flat_reals` made `flat` of (float32 or float64 reals, pairs of them
    for a complex dtype)."""
    flat = np.asarray(flat)
    real = flat.dtype if flat.dtype in (np.float32, np.float64) else np.dtype(np.float64)
    flat = flat.astype(real, copy=False)
    out = (flat.view(complex_dtype_for(real)) if np.iscomplexobj(np.empty(0, dtype)) else flat).reshape(shape)
    return out if out.dtype == dtype else out.astype(dtype)


def _per_class(default=None, factory=None):
    """A WeightedSums field indexed by class first (a list per class, or an array with a class axis 0)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"per_class": True})
    return field(default=default, metadata={"per_class": True})


@dataclass
class WeightedSums:
    """Sums over the particles of one work unit (a half set, or a set of classes), reduced over workers
    before the M-step.

    Every field is handled by `pack`/`unpack`, `spread_to_classes` and `total` through
    `dataclasses.fields`, so a new field travels through MPI and class merges without more code:
    a list (one volume per class) or an array travels as float64, a number as one element of the
    scalars vector. Fields marked per class have the class as their first index.
    """

    data: list = _per_class(factory=list)  # per class: complex padded Fourier data (BackProjector.data)
    weight: list = _per_class(factory=list)  # per class: real padded weights
    sigma2_noise: np.ndarray | None = None  # (n_optics, n_shells) Σ w |X − CTF·P|² per shell
    sumw_group: np.ndarray | None = None  # (n_optics,) Σ w (number of particles, weights sum to 1 each)
    sigma2_offset_angstrom2: float = 0.0  # Σ w |offset − prior|² in Å²
    pdf_class: np.ndarray = _per_class(factory=lambda: np.zeros(1))  # (K,)
    pdf_direction: np.ndarray | None = _per_class()  # (K, n_directions)
    norm_correction: float = 0.0  # Σ new norm corrections
    scale_xa: np.ndarray | None = None  # (n_scale_groups,) per intensity group (`data.scale_groups_of`)
    scale_aa: np.ndarray | None = None  # (n_scale_groups,)
    log_likelihood: float = 0.0
    sum_pmax: float = 0.0
    n_particles: int = 0

    @classmethod
    def zeros(cls, volume_shape: tuple[int, ...], n_classes: int, n_optics: int, n_shells: int, n_directions: int,
              xp: ArrayModule = np, data: list[Array] | None = None, weight: list[Array] | None = None,
              real_dtype: npt.DTypeLike = np.float64, n_scale_groups: int | None = None) -> WeightedSums:
        """Empty sums of `n_classes` classes; the volumes (complex data and real weights of `volume_shape`,
        `real_dtype` and its complex) are made with `xp` unless an engine gives its own (lists of K arrays); the
        scale sums per intensity group (`n_scale_groups`, default one per optics group)."""
        n_scale = n_optics if n_scale_groups is None else n_scale_groups
        real = np.dtype(real_dtype)
        complex_ = complex_dtype_for(real)
        return cls(data=data if data is not None else [xp.zeros(volume_shape, complex_) for _ in range(n_classes)],
                   weight=weight if weight is not None else [xp.zeros(volume_shape, real)
                                                             for _ in range(n_classes)],
                   sigma2_noise=np.zeros((n_optics, n_shells)), sumw_group=np.zeros(n_optics),
                   pdf_class=np.zeros(n_classes), pdf_direction=np.zeros((n_classes, n_directions)),
                   scale_xa=np.zeros(n_scale), scale_aa=np.zeros(n_scale))

    @property
    def n_classes(self) -> int:
        return len(self.data)

    def move_volumes(self, move: Callable[[Array], Array]) -> WeightedSums:
        """Every class's data and weight replaced, in place and one at a time, by `move(array)` (a copy on the
        host or on the device: `estep.backend`)."""
        for volumes in (self.data, self.weight):
            for k, array in enumerate(volumes):
                volumes[k] = move(array)
        return self

    def without_volumes(self) -> WeightedSums:
        """These sums without the class volumes (data and weight empty lists): all the M-step needs beside the
        maps, small enough to share."""
        return replace(self, data=[], weight=[])

    def pack(self, volume_real_dtype: npt.DTypeLike = np.float64) -> list[np.ndarray]:
        """The sums as a list of flat host arrays (complex volumes viewed as pairs of reals), every array field in
        field order and, last, one vector of the number fields. The class volumes are of `volume_real_dtype`
        (float64 by default, what a reduction adds in; the engine's own float32 to send sums as they are), every
        other array float64."""
        arrays, scalars = [], []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                arrays.extend(flat_reals(v, volume_real_dtype) for v in value)
            elif value is None:
                arrays.append(np.zeros(0))
            elif np.ndim(value) == 0:
                scalars.append(float(value))
            else:
                arrays.append(flat_reals(value, np.float64))
        return arrays + [np.asarray(scalars, dtype=np.float64)]

    def unpack(self, arrays: Iterable[np.ndarray]) -> WeightedSums:
        """New host sums shaped like these (the template) and of their dtypes (the volumes: float32 sums stay
        float32 once reduced in float64) from `pack`'s list of arrays (of float64, or float32 volumes)."""
        arrays = list(arrays)
        scalars = iter(arrays.pop().tolist())
        arrays = iter(arrays)

        def shaped(template: Any, flat: np.ndarray) -> np.ndarray:
            return from_flat_reals(flat, np.shape(template), getattr(template, "dtype", np.dtype(np.float64)))

        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                values[f.name] = [shaped(v, next(arrays)) for v in value]
            elif value is None:
                next(arrays)
                values[f.name] = None
            elif np.ndim(value) == 0:
                values[f.name] = type(value)(round(next(scalars)) if isinstance(value, int) else next(scalars))
            else:
                values[f.name] = shaped(value, next(arrays))
        return type(self)(**values)

    def spread_to_classes(self, classes: npt.ArrayLike, n_classes: int) -> WeightedSums:
        """These sums of the classes `classes` (their numbers, in this order) as sums of all `n_classes`:
        zeros for the others. The volumes stay where they are (host or device)."""
        from cryorefine.core.arrays import array_module, to_host

        values = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if not f.metadata.get("per_class") or value is None:
                values[f.name] = value
            elif isinstance(value, list) and not value:  # no volumes
                values[f.name] = []
            elif isinstance(value, list):
                xp = array_module(value[0])
                given = {int(k): v for k, v in zip(classes, value)}
                values[f.name] = [given[k] if k in given else xp.zeros_like(value[0]) for k in range(n_classes)]
            else:
                value = to_host(value)
                out = np.zeros((n_classes,) + value.shape[1:], dtype=value.dtype)
                out[np.asarray(classes)] = value
                values[f.name] = out
        return type(self)(**values)

    @staticmethod
    def total(parts: Sequence[WeightedSums]) -> WeightedSums:
        """Field-wise sum of WeightedSums of the same shapes."""
        first = parts[0]
        values = {}
        for f in fields(first):
            items = [getattr(p, f.name) for p in parts]
            if items[0] is None:
                values[f.name] = None
            elif isinstance(items[0], list):
                values[f.name] = [sum(column[1:], column[0]) for column in zip(*items)]
            else:
                values[f.name] = sum(items[1:], items[0])
        return type(first)(**values)


class Engine(Protocol):
    """What the E-step's batch loop (`em.estep`) asks of an engine, for one work unit of one iteration."""

    array_module: Any  # numpy or cupy: the module batches are prepared with (images.prepare_batch)
    stage_seconds: dict  # seconds per stage of the engine's own work, summed over its batches
    stage_flops: dict  # useful floating-point operations per stage (may be empty)

    def setup(self, setup: IterationSetup) -> None:
        """References, noise model, sampling and priors of the iteration; sums start at zero."""

    def run(self, batch: Batch, local: LocalOrientations | None = None) -> BatchResult:
        """The E-step of one batch: per-particle results; the weighted sums are accumulated. `local`: the batch's
        local-search neighbourhoods (`estep.common.local_orientations` of its priors) where the caller computed
        them ahead; None: the engine computes them (None too in a global search)."""

    def sums(self) -> WeightedSums:
        """The sums accumulated over every batch since `setup`."""

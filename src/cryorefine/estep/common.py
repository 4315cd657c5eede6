"""What both E-step engines share: the coefficient layout, the compressed fine weights, the host tables
of an iteration's set-up, and array-module-generic helpers.

`IterationTables.create(setup)` is the set-up arithmetic both engines start from (1/σ² at the
coefficients, the log normalisation of the likelihood, the sampling's tables); the numpy engine uses
the tables as they are (float64), the CuPy engine uploads them (float32 where its kernels are). Every
function here takes host arrays, or an `xp` (numpy or cupy), and imports no CuPy itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule

if TYPE_CHECKING:  # for annotations only
    from cryorefine.core.sampling import LocalOrientations
    from cryorefine.estep.engine import IterationSetup

#: The coefficients' order: tiles of TILE_ROWS ky rows × TILE_COLUMNS kx (a warp's 32 lanes), tile rows in the
#: half transform's row order (ky ≥ 0 up, then the negative rows), tiles along kx within a tile row. Neighbours in
#: the order are neighbours in the plane, so a slice's consecutive coefficients, rotated into the padded volume,
#: read and add to a compact patch of it rather than a long line.
TILE_ROWS, TILE_COLUMNS = 4, 8
_NEGATIVE_ROWS_FROM = 1 << 20  # a negative row ky ranks as this + ky: after the rows ky ≥ 0 of any box, and in tiles
#                                 that do not depend on the box (a multiple of TILE_ROWS)

#: No coarse weight at or below this (the smallest normal float64, relative to the row's best) is a candidate, even at
#: an adaptive fraction of 1: below it exp's results are subnormal, where numpy's and CUDA's round differently.
#: weights.cu's CR_WEIGHT_FLOOR is the same number.
WEIGHT_FLOOR = float(np.finfo(np.float64).tiny)


@dataclass(frozen=True)
class Coefficients:
    """The valid coefficients of an (n, n//2+1) half transform, in a fixed order (in tiles, see TILE_ROWS).

    |k| ≤ n/2, without the kx = 0, ky < 0 half column (Friedel mates of kx = 0, ky > 0). The order depends on
    (ky, kx) alone, not on n: the coefficients of a smaller size within a larger one are in the same order there.
    """

    size_px: int
    positions: np.ndarray  # flat positions in the (n, n//2+1) array
    kx: np.ndarray
    ky: np.ndarray
    shell: np.ndarray  # round(|k|)

    @classmethod
    def create(cls, size_px: int, radius_px: float | None = None) -> Coefficients:
        from cryorefine.core.fourier import signed_frequencies

        r = size_px / 2 if radius_px is None else radius_px
        ky = signed_frequencies(size_px).astype(np.int64)[:, None]
        kx = np.arange(size_px // 2 + 1)[None, :]
        keep = (kx * kx + ky * ky <= r * r) & ~((kx == 0) & (ky < 0))
        keep = np.broadcast_to(keep, (size_px, size_px // 2 + 1))
        pos = np.flatnonzero(keep)
        kxf = np.broadcast_to(kx, keep.shape).reshape(-1)[pos]
        kyf = np.broadcast_to(ky, keep.shape).reshape(-1)[pos]
        row = np.where(kyf >= 0, kyf, _NEGATIVE_ROWS_FROM + kyf)
        order = np.lexsort((kxf % TILE_COLUMNS, row % TILE_ROWS, kxf // TILE_COLUMNS, row // TILE_ROWS))
        pos, kxf, kyf = pos[order], kxf[order], kyf[order]
        shell = np.rint(np.sqrt(kxf * kxf + kyf * kyf)).astype(np.int64)
        return cls(size_px, pos, kxf.astype(np.float64), kyf.astype(np.float64), shell)

    def positions_in(self, size_px: int) -> np.ndarray:
        """Flat positions of these coefficients in a half transform of another size."""
        return (self.ky.astype(np.int64) % size_px) * (size_px // 2 + 1) + self.kx.astype(np.int64)

    def gather(self, arrays: Array) -> Array:
        """(…, n, n//2+1) -> (…, n_coefficients)."""
        return arrays.reshape(arrays.shape[:-2] + (-1,))[..., self.positions]

    def scatter(self, values: Array, xp: ArrayModule = np) -> Array:
        """(…, n_coefficients) -> (…, n, n//2+1), zeros elsewhere."""
        out = xp.zeros(values.shape[:-1] + (self.size_px * (self.size_px // 2 + 1),), dtype=values.dtype)
        out[..., self.positions] = values
        return out.reshape(values.shape[:-1] + (self.size_px, self.size_px // 2 + 1))

    def phase(self, shifts_px: npt.ArrayLike, ori_size_px: int, dtype: npt.DTypeLike) -> np.ndarray:
        """exp(−2πi k·s/N) (…, n_coefficients) for shifts (…, 2) in px: moves images by +s."""
        s = np.asarray(shifts_px)
        arg = (-2.0 * np.pi / ori_size_px) * (s[..., 0:1] * self.kx + s[..., 1:2] * self.ky)
        return np.exp(1j * arg).astype(dtype)


@dataclass
class FineBlocks:
    """Fine weights of one particle, compressed: one base index per block of children.

    `coarse_index[i]` = (class·n_orientations + orientation)·n_translations + translation of a
    significant coarse sample; `weights[i, f]` the normalised weight of its child f =
    io·n_fine_translations + it (RELION's oversampled order), zero where not significant.
    """

    coarse_index: np.ndarray  # (n_blocks,) int64
    weights: np.ndarray  # (n_blocks, children per block)


@dataclass(frozen=True, eq=False)
class IterationTables:
    """The host tables of one iteration's set-up (`IterationSetup`), the same for both engines."""

    n_classes: int
    fine: Coefficients  # the coefficients at the current size
    coarse: Coefficients  # the coefficients at the coarse size
    coarse_selection: np.ndarray  # positions of the coarse coefficients among the fine ones, in coarse order
    sigma2: np.ndarray  # (n_optics, n_shells) float64 noise spectra
    minv_fine: np.ndarray  # (n_optics, n_fine) 1/σ² of the likelihood (0 at k = 0)
    minv_store: np.ndarray  # (n_optics, n_fine) 1/σ² of the sums (k = 0 kept)
    minv_coarse: np.ndarray  # (n_optics, n_coarse) 1/σ² of the coarse likelihood
    logsigma2: np.ndarray  # (n_optics,) Σ log(2πσ²) over the valid coefficients: the likelihood's normalisation
    sampling: object  # the iteration's core.sampling.Sampling (perturbed)
    n_orientations: int  # R, orientation o = direction (o // n_psi) · n_psi + psi (o % n_psi)
    n_psi: int
    translations: np.ndarray  # (T, 2) float64 coarse translations (px)
    fine_translations: np.ndarray  # (T, n_fine_translations, 2) float64 their children (px)
    n_fine_orientations: int  # children of a coarse orientation
    n_fine_translations: int  # children of a coarse translation
    scale: np.ndarray | None  # (n_scale_groups,) float64 intensity scale corrections (None without --scale)
    scale_use: np.ndarray | None  # (K, n_fine) bool: coefficients in the scale sums (data_vs_prior > 3), or None

    @classmethod
    def create(cls, setup: IterationSetup) -> IterationTables:
        s = setup
        n_classes = len(s.projectors) if s.projectors is not None else len(s.maps)
        fine = Coefficients.create(s.current_size_px)
        coarse = Coefficients.create(s.coarse_size_px)
        r2 = fine.kx ** 2 + fine.ky ** 2
        coarse_selection = np.flatnonzero(r2 <= (s.coarse_size_px / 2) ** 2)
        # the coarse coefficient order must equal this selection's order
        assert coarse_selection.size == coarse.positions.size
        sigma2 = np.asarray(s.sigma2_noise, dtype=np.float64)
        shell = fine.shell
        # --strict_highres_exp: the likelihood's coefficients end at the likelihood size (RELION compares both
        # passes at its coarse size, which is then no larger; with --skip_align the one pass is at the current
        # size, so the coarse table is cut too); the sums (minv_store) keep them all
        reach = s.likelihood_size_px
        compared = r2 <= (reach / 2) ** 2 if reach else np.ones(r2.shape, bool)
        valid_log = np.where(compared[None, :] & (shell[None, :] > 0) & (shell[None, :] < sigma2.shape[1]),
                             np.log(2 * np.pi * np.maximum(sigma2[:, np.minimum(shell, sigma2.shape[1] - 1)],
                                                           1e-300)), 0.0)
        sampling = s.sampling
        translations = np.asarray(sampling.translations_px(), dtype=np.float64)
        n_trans = translations.shape[0]
        fine_translations = np.asarray(sampling.fine_translations_px(np.arange(n_trans)), dtype=np.float64)
        scale = None if s.scale_correction is None else np.asarray(s.scale_correction, np.float64)
        scale_use = None
        if s.data_vs_prior is not None and s.scale_correction is not None:
            dvp = np.asarray(s.data_vs_prior)
            scale_use = dvp[:, np.minimum(shell, dvp.shape[1] - 1)] > 3.0
        return cls(n_classes=n_classes, fine=fine, coarse=coarse, coarse_selection=coarse_selection, sigma2=sigma2,
                   minv_fine=inverse_sigma2(sigma2, shell, keep_origin=False) * compared[None, :],
                   minv_store=inverse_sigma2(sigma2, shell, keep_origin=True),
                   minv_coarse=(inverse_sigma2(sigma2, coarse.shell, keep_origin=False)
                                * compared[None, coarse_selection]),
                   logsigma2=valid_log.sum(axis=1), sampling=sampling, n_orientations=int(sampling.n_orientations),
                   n_psi=int(sampling.n_psi), translations=translations, fine_translations=fine_translations,
                   n_fine_orientations=sampling.n_fine_orientations(),
                   n_fine_translations=sampling.n_fine_translations(), scale=scale, scale_use=scale_use)

    def orientation_matrices(self, index: npt.ArrayLike | None = None, xp: ArrayModule = np) -> Array:
        """(n, 3, 3) float64 matrices of the orientations `index` (host ints; all of them by default), made in
        `xp` (cupy: on the device)."""
        return xp.asarray(self.sampling.orientation_matrices(xp=xp, index=index), dtype=xp.float64)

    @property
    def n_translations(self) -> int:
        return self.translations.shape[0]

    @property
    def children_per_block(self) -> int:
        """Fine samples per significant coarse sample: n_fine_orientations × n_fine_translations."""
        return self.n_fine_orientations * self.n_fine_translations

    @property
    def n_optics(self) -> int:
        return self.sigma2.shape[0]

    @property
    def n_shells(self) -> int:
        return self.sigma2.shape[1]


def inverse_sigma2(sigma2: np.ndarray, shell: np.ndarray, keep_origin: bool) -> np.ndarray:
    """1/σ² (n_optics, n_coefficients) at the coefficients' shells; 0 beyond the spectra (and at k = 0
    unless `keep_origin`: RELION leaves k = 0 out of the likelihood but not out of the sums)."""
    inside = shell < sigma2.shape[1]
    values = np.where(inside[None, :], 1.0 / np.maximum(sigma2[:, np.minimum(shell, sigma2.shape[1] - 1)], 1e-300),
                      0.0)
    if not keep_origin:
        values[:, shell == 0] = 0.0
    return values


def local_orientations(setup: IterationSetup, prior_rot_deg: npt.ArrayLike, prior_tilt_deg: npt.ArrayLike,
                       prior_psi_deg: npt.ArrayLike) -> LocalOrientations | None:
    """Each particle's orientations and their log priors (core.sampling.LocalOrientations) in a local search of
    `setup`, around its previous pose (a batch's prior_rot_deg, prior_tilt_deg, prior_psi_deg); None in a global
    search."""
    if not setup.local_searches:
        return None
    return setup.sampling.local_orientations(prior_rot_deg, prior_tilt_deg, prior_psi_deg, setup.sigma_rot_deg,
                                             setup.sigma_psi_deg)


def groups_by_size(sizes: npt.ArrayLike, limit: int) -> list[np.ndarray]:
    """Consecutive index groups whose sizes add up to at most `limit` (a group holds at least one)."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(np.asarray(sizes).tolist()):
        if i > start and total + size > limit:
            groups.append(np.arange(start, i))
            start, total = i, 0
        total += size
    groups.append(np.arange(start, len(sizes)))
    return groups


#: The most fine samples (significant coarse samples × their children) one particle may take into the fine pass: the
#: GPU engine plans its fine pass in groups of particles of up to this many (estep.cuda_plan), a group holding at
#: least one particle. At RELION's 8 × 4 children a coarse sample, a million significant samples.
FINE_SAMPLES_PER_PARTICLE = 1 << 25

#: A classification's finer pass (IterationSetup.fine_pass_raised): the most cells of one particle's fine table. The
#: numpy engine's table of a particle's significant (class, orientation) pairs' fine orientations by its significant
#: translations' fine translations holds about ten float64 temporaries of this size (1.3 GB).
FINE_CELLS_PER_PARTICLE = 1 << 24


def fine_pass_limit(setup: IterationSetup) -> int:
    """The most significant coarse samples a particle may take into the fine pass of `setup` (an
    engine.IterationSetup), whatever the samples are; 0 where every coarse sample fits. N samples have N times
    their children in fine samples (at most FINE_SAMPLES_PER_PARTICLE); in a classification's finer pass, whose 64 ×
    16 children a sample are 32 times RELION's, they also span a table of at most min(N, K·R) (class, orientation)
    pairs by min(N, T) translations, each with its children (at most FINE_CELLS_PER_PARTICLE cells): on the built-in
    example's order-2 grid at 29 translations, 564 samples. RELION's sampling of the same grid fits whole."""
    sampling = setup.sampling
    n_pairs = len(setup.log_pdf_class) * sampling.n_orientations
    n_translations = sampling.n_translations
    n_fine_o, n_fine_t = sampling.n_fine_orientations(), sampling.n_fine_translations()

    def fits(n: int) -> bool:
        samples = n * n_fine_o * n_fine_t
        cells = min(n, n_pairs) * n_fine_o * min(n, n_translations) * n_fine_t
        return samples <= FINE_SAMPLES_PER_PARTICLE and (not setup.fine_pass_raised or cells <= FINE_CELLS_PER_PARTICLE)

    n_samples = n_pairs * n_translations
    if fits(n_samples):
        return 0
    low, high = 1, n_samples  # `low` samples fit (or low is 1), `high` do not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def significants_limit(setup: IterationSetup) -> int:
    """The most significant coarse samples a particle keeps in `setup`'s coarse pass: --maxsig (setup's
    max_significants), or fewer where the fine pass would not hold more (`fine_pass_limit`); ≤ 0: no limit. Both
    engines cut with it, so that they keep the same samples."""
    limit = fine_pass_limit(setup)
    if limit <= 0:
        return setup.max_significants
    return limit if setup.max_significants <= 0 else min(limit, setup.max_significants)


def significant_samples(weights: Array, adaptive_fraction: float, max_significants: int,
                        xp: ArrayModule) -> tuple[Array, Array]:
    """Mask (B, S) of the fewest samples holding `adaptive_fraction` of each row's mass, and their count (B,).

    Here rather than in `estep.cuda` because it is array-module generic: the tests check it with numpy
    against `NumpyEngine._significant` without a GPU, and on the device against the GPU engine's fused
    coarse weights (which pack the candidates themselves and share `significance_cut`).

    The numpy engine's rule (sort each row, cumulate, cut at the fraction) on candidates only: weights
    at or below ε = (1 − fraction)·total / (2·S) (and never below WEIGHT_FLOOR) add up to at most half the
    mass the cut leaves out, so
    the samples before the cut are all candidates, and sorting a row's candidates gives the same count
    as sorting the whole row (up to the last bits of the row total, summed pairwise here and in sequence
    there, which only matters for a weight exactly at the cut). Rows of a converged refinement hold a few
    hundred candidates among hundreds of thousands of samples.
    """
    b_count, n_samples = weights.shape
    total = weights.sum(axis=1)
    epsilon = xp.maximum((1.0 - adaptive_fraction) * total / (2.0 * n_samples), WEIGHT_FLOOR)
    candidate = weights > epsilon[:, None]
    counts = candidate.sum(axis=1)
    width = max(1, int(counts.max()))
    rows, cols = xp.nonzero(candidate)
    del candidate
    starts = xp.cumsum(counts) - counts
    packed = xp.zeros((b_count, width), dtype=weights.dtype)
    packed[rows, xp.arange(rows.size) - starts[rows]] = weights[rows, cols]
    del rows, cols
    threshold, n_sig = significance_cut(packed, counts, total, adaptive_fraction, max_significants, xp)
    del packed
    return significant_mask(weights, threshold[:, None]), n_sig


def significant_mask(weights: Array, threshold: Array) -> Array:
    """The significance rule every cut ends with: a sample is kept when its weight is at least its row's
    `threshold` (broadcasting to `weights`) and positive."""
    return (weights >= threshold) & (weights > 0)


def significance_cut(packed: Array, counts: Array, total: Array, adaptive_fraction: float, max_significants: int,
                     xp: ArrayModule) -> tuple[Array, Array]:
    """The cut of `significant_samples` from each row's candidates alone: `packed` (B, width) holds a row's
    `counts` candidates (weights above ε) in any order, zeros after them; `total` is the row's whole mass.
    Returns the smallest weight kept per row (`significant_mask` applies it) and the count kept (B,)."""
    b_count = packed.shape[0]
    sorted_w = -xp.sort(-packed, axis=1)
    if adaptive_fraction >= 1.0:  # all of the mass: every candidate (every weight above WEIGHT_FLOOR)
        n_sig = xp.maximum(counts, 1)
    else:
        cum = xp.cumsum(sorted_w, axis=1)
        # counted as int64: CuPy sums booleans with a reduction it compiles for each power-of-two class of the
        # row length (the candidates' width, new with the data), int64 with CUB's precompiled one
        n_sig = xp.sum((cum < adaptive_fraction * total[:, None]).astype(xp.int64), axis=1) + 1
        del cum
        n_sig = xp.minimum(n_sig, xp.maximum(counts, 1))
    if max_significants > 0:
        n_sig = xp.minimum(n_sig, max_significants)
    return sorted_w[xp.arange(b_count), n_sig - 1], n_sig

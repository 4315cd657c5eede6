"""RELION's orientational and translational sampling (HealpixSampling), vectorised.

Coarse sampling (RELION's setOrientations / setTranslations):
- directions: the HEALPix pixel centres of order N in NEST ordering (12·4^N), rot = φ and
  tilt = θ of the pixel centre in degrees, rot wrapped into [−180, 180] (RELION's
  getDirectionFromHealPix + checkDirection). With a symmetry group only the directions in its
  asymmetric unit are kept, in increasing pixel order (`direction_ipix` maps back);
- psi: n_psi = ceil(360 / step) angles ipsi·step, ipsi = 0 … n_psi−1, the first at 0 degrees,
  step = 360 / n_psi; by default the requested step is 360/(6·2^N) (order 2: 15°, 24 angles);
- translations: all (i·step, j·step) with x² + y² ≤ range² (+10⁻³ px², RELION's round-off
  margin), i outer (x) and j inner (y), both from −ceil(range/step) up.

Index orderings (RELION's getPositionSamplingPoint):
- orientation index  o = dir_index · n_psi + psi_index
- coarse sample index s = o · n_trans + trans_index

Oversampling k (RELION's getOrientations / pushbackOversampledPsiAngles /
getTranslationsInPixel): each coarse orientation has n_fo = 4^k·2^k children and each coarse
translation n_ft = 4^k children, so each coarse sample has n_fo·n_ft fine ones (k = 1: 8 × 4 = 32).
- child directions: the 4^k HEALPix pixels of order N+k inside the coarse pixel, HEALPix x
  index inner and y index outer (for k = 1 this is NEST order 4·ipix + 0 … 3);
- child psi: psi − step/2 + (0.5 + i)·step/2^k, i = 0 … 2^k−1 (k = 1: psi ∓ step/4);
- child translations: x − step/2 + (0.5 + i)·step/2^k (outer), y likewise (inner);
  k = 1: (−,−), (−,+), (+,−), (+,+) times step/4;
- fine orientation child io = dir_child · 2^k + psi_child; fine sample f = io · n_ft + it
  (RELION's getPositionOversampledSamplingPoint), so block s·n_fo·n_ft + f holds the fine weights
  of coarse sample s.

The random perturbation RELION applies to a whole iteration's sampling (its
`rlnSamplingPerturbInstance`, here `perturbation`) rotates every orientation A to
A·E(p·a, p·a, p·a), a the coarse angular step, and adds p·offset_step to x and y of every
translation; `next_perturbation` draws the next instance as RELION's
resetRandomlyPerturbedSampling does.

Local searches (selectOrientationsWithNonZeroPriorProbability): directions within
sigma_cutoff·σ of the prior direction (angle between directions, the smallest over the
symmetry mates) and psi angles within sigma_cutoff·σ_psi of the prior psi are kept, with
Gaussian priors normalised over the kept ones; if none is within range, the nearest is kept.
Each particle's neighbourhood is found on its own (HEALPix discs around the prior direction's
mates, a window of psi angles) and kept as a ragged list (`LocalOrientations`): nothing the size
of the whole grid is made, however fine the sampling.

In-plane sampling (`Sampling.in_plane`, RELION's 2D classification, ref_dim 2): one direction, rot =
tilt = 0, so that an orientation is its psi alone (o = psi_index); psi every `psi_step_deg`; each
coarse orientation has 2^k children (psi − step/2 + (0.5 + i)·step/2^k) and each translation 4^k;
the perturbation adds p·psi_step to every psi (and p·offset_step to the translations), keeping rot
and tilt 0; psi angles are given in (−180, 180]. No local searches.

Angles are in degrees and translations in pixels throughout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule

from .arrays import host_flat
from .euler import euler_to_matrix, matrix_to_euler
from .symmetry import SymmetryGroup, asymmetric_unit_mask, symmetry_group

_OFFSET_MARGIN_PX2 = 1e-3


def healpix_nside(order: int) -> int:
    """HEALPix Nside of an order (2^order)."""
    return 1 << int(order)


def healpix_angles_deg(order: int, ipix: npt.ArrayLike) -> tuple:
    """(rot, tilt) in degrees of HEALPix NEST pixel centres, rot in [−180, 180] as in RELION."""
    import healpy  # local import: keep importing this module cheap

    theta, phi = healpy.pix2ang(healpix_nside(order), np.asarray(ipix, dtype=np.int64), nest=True)
    rot = np.rad2deg(phi)
    rot = np.where(rot > 180.0, rot - 360.0, rot)
    return rot, np.rad2deg(theta)


def healpix_pixels(order: int, rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike) -> np.ndarray:
    """HEALPix NEST pixels of order `order` holding the directions (rot, tilt) in degrees, of any range (the
    inverse of `healpix_angles_deg` at the pixels' centres)."""
    import healpy

    x, y, z = np.moveaxis(directions_to_xyz(rot_deg, tilt_deg), -1, 0)
    return np.asarray(healpy.vec2pix(healpix_nside(order), x, y, z, nest=True), dtype=np.int64)


def directions_to_xyz(rot_deg: Array | npt.ArrayLike, tilt_deg: Array | npt.ArrayLike, xp: ArrayModule = np) -> Array:
    """Unit projection directions (…, 3) of (rot, tilt): RELION's Euler_angles2direction."""
    r = xp.deg2rad(xp.asarray(rot_deg, dtype=xp.float64))
    t = xp.deg2rad(xp.asarray(tilt_deg, dtype=xp.float64))
    st = xp.sin(t)
    return xp.stack([xp.cos(r) * st, xp.sin(r) * st, xp.cos(t)], axis=-1)


def _morton_offsets(k: int) -> np.ndarray:
    """NEST offsets of the 4^k sub-pixels (x inner, y outer) of a pixel k orders up."""
    fact = 1 << k
    i = np.tile(np.arange(fact), fact)  # x, inner
    j = np.repeat(np.arange(fact), fact)  # y, outer
    out = np.zeros(fact * fact, dtype=np.int64)
    for bit in range(k):
        out |= ((i >> bit) & 1) << (2 * bit)
        out |= ((j >> bit) & 1) << (2 * bit + 1)
    return out


def _wrap_deg(a, xp=np):
    """Angles into (−180, 180]."""
    return a - 360.0 * xp.ceil((a - 180.0) / 360.0)


class FineSamples(NamedTuple):
    """Children of coarse samples: angles (n, n_fo) in degrees, translations (n, n_ft, 2) in px."""

    rot_deg: object
    tilt_deg: object
    psi_deg: object
    translations_px: object


@dataclass(frozen=True, eq=False)
class LocalOrientations:
    """The orientations of a local search, particle by particle, as one ragged list.

    Particle b's orientations are `orientation[offsets[b]:offsets[b + 1]]` (indices dir·n_psi + psi,
    increasing) with their log priors `log_prior[…]`: the direction's and the psi's Gaussian priors,
    each normalised over the kept ones, added.
    """

    offsets: np.ndarray  # (B + 1,) int64
    orientation: np.ndarray  # (n,) int64
    log_prior: np.ndarray  # (n,) float64

    @property
    def n_particles(self) -> int:
        return int(self.offsets.size - 1)

    def counts(self) -> np.ndarray:
        """(B,) orientations per particle."""
        return np.diff(self.offsets)

    def particle_of(self) -> np.ndarray:
        """(n,) the particle of each entry."""
        return np.repeat(np.arange(self.n_particles), self.counts())

    def rows(self, start: int, stop: int) -> LocalOrientations:
        """The particles start … stop − 1 (consecutive), renumbered from 0."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return LocalOrientations(self.offsets[start:stop + 1] - lo, self.orientation[lo:hi], self.log_prior[lo:hi])

    def padded(self, width: int | None = None, xp: ArrayModule = np) -> tuple[Array, Array]:
        """(B, width) orientations (0 where a particle has fewer) and log priors (−inf there), made in `xp`
        from the ragged list; width defaults to the largest count."""
        counts = self.counts()
        width = int(counts.max(initial=1)) if width is None else int(width)
        offsets = xp.asarray(self.offsets)
        entry = xp.arange(self.orientation.size)
        b = xp.searchsorted(offsets, entry, side="right") - 1  # particle of each entry (empty ones skipped)
        j = entry - offsets[b]
        orientation = xp.zeros((self.n_particles, width), dtype=xp.int64)
        log_prior = xp.full((self.n_particles, width), -np.inf)
        orientation[b, j] = xp.asarray(self.orientation)
        log_prior[b, j] = xp.asarray(self.log_prior)
        return orientation, log_prior


def _ragged_product(offsets_a, values_a, offsets_b, values_b):
    """Per row, every pair (a, b) of two ragged lists, a outer: the offsets and the two entry indices."""
    count_a, count_b = np.diff(offsets_a), np.diff(offsets_b)
    counts = count_a * count_b
    offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
    row = np.repeat(np.arange(counts.size), counts)
    j = np.arange(offsets[-1]) - offsets[row]
    ia = offsets_a[row] + j // count_b[row]
    ib = offsets_b[row] + j % count_b[row]
    return offsets, values_a[ia], values_b[ib]


def _normalised_gaussian(dist, row, n_rows, sigma, cutoff):
    """Log Gaussian priors of ragged candidates (`dist`, their `row`, rows in order): the candidates
    within cutoff·sigma of each row, else its nearest alone (the first of equals), normalised per row.
    Returns the mask of kept candidates and their log priors."""
    keep = dist < cutoff * sigma
    starts = np.searchsorted(row, np.arange(n_rows))
    has = np.zeros(n_rows, dtype=bool)
    np.logical_or.at(has, row, keep)
    for r in np.flatnonzero(~has):  # nothing in range: the nearest
        stop = starts[r + 1] if r + 1 < n_rows else row.size
        keep[starts[r] + int(np.argmin(dist[starts[r]:stop]))] = True
    logp = -(dist[keep] ** 2) / (2.0 * sigma * sigma)
    kept_row = row[keep]
    top = np.full(n_rows, -np.inf)
    np.maximum.at(top, kept_row, logp)
    total = np.zeros(n_rows)
    np.add.at(total, kept_row, np.exp(logp - top[kept_row]))
    return keep, logp - (top + np.log(total))[kept_row]


# a block of HEALPix pixels (one and its 8 neighbours) holds every point within this many of its pixel
# sizes (healpy.nside2resol) of any point of the middle pixel: measured ≥ 0.70 at orders 0–5
# (tests/core/test_sampling.py checks the neighbourhoods this gives against discs)
_BLOCK_REACH_IN_PIXELS = 0.5
# a local search's candidate directions are measured for this many (particle, candidate) pairs at a time
LOCAL_CANDIDATES_PER_CHUNK = 1 << 18


def _neighbourhood_pixels(order: int, centres, radius_rad: float) -> np.ndarray:
    """(B, C) NEST pixels of order `order` (−1 for none) holding, for each row b, every pixel whose centre
    is within `radius_rad` of any of the unit vectors centres[b] (G, 3), each once.

    The coarsest order M whose pixel block (a pixel and its 8 neighbours) around a point reaches
    `radius_rad` gives the candidates: each block pixel's children of order N are the NEST range
    [p·4^(N−M), (p + 1)·4^(N−M)). Vectorised over rows and mates (no per-particle disc query).
    """
    import healpy

    centres = np.asarray(centres, dtype=np.float64)
    b_count, n_mates = centres.shape[:2]
    coarse = next((m for m in range(order, -1, -1)
                   if _BLOCK_REACH_IN_PIXELS * healpy.nside2resol(healpix_nside(m)) >= radius_rad), None)
    if coarse is None:  # the disc is wider than any block: every pixel
        return np.broadcast_to(np.arange(12 * 4 ** order, dtype=np.int64), (b_count, 12 * 4 ** order))
    nside = healpix_nside(coarse)
    theta, phi = healpy.vec2ang(centres.reshape(-1, 3))
    block = np.concatenate([healpy.ang2pix(nside, theta, phi, nest=True)[None, :],
                            healpy.get_all_neighbours(nside, theta, phi, nest=True)], axis=0)  # (9, B·G)
    block = np.sort(block.reshape(9, b_count, n_mates).transpose(1, 2, 0).reshape(b_count, 9 * n_mates), axis=1)
    block[:, 1:][block[:, 1:] == block[:, :-1]] = -1  # each coarse pixel once (mates' blocks overlap)
    per = 4 ** (order - coarse)
    pix = block[:, :, None] * per + np.arange(per, dtype=np.int64)[None, None, :]
    return np.where(block[:, :, None] >= 0, pix, -1).reshape(b_count, -1)


class DirectionTables(NamedTuple):
    """The coarse directions of one HEALPix order in one group's asymmetric unit (all read-only)."""

    ipix: np.ndarray  # (D,) HEALPix NEST pixel of each direction, increasing
    angles_deg: np.ndarray  # (D, 2) rot, tilt
    of_pixel: np.ndarray  # (12·4^N,) direction index of each pixel, −1 outside the unit
    vectors: np.ndarray  # (D, 3) unit vectors


@functools.lru_cache(maxsize=2)
def direction_tables(healpix_order: int, symmetry: str) -> DirectionTables:
    """DirectionTables of `healpix_order` and `symmetry`, made once for the iterations that share them: every
    iteration has a Sampling of its own (its perturbation), and at order 8 these tables take about a tenth of a
    second to make. Two kept: an auto-refine's current order and the one before it. The first call also imports
    healpy (with astropy and matplotlib, about a second), which an MPI worker does while it sets itself up."""
    n_pix = 12 * 4 ** healpix_order
    ipix = np.arange(n_pix, dtype=np.int64)
    group = symmetry_group(symmetry)
    if group.order > 1:
        rot, tilt = healpix_angles_deg(healpix_order, ipix)
        ipix = ipix[asymmetric_unit_mask(directions_to_xyz(rot, tilt), group)]
    rot, tilt = healpix_angles_deg(healpix_order, ipix)
    angles = np.stack([rot, tilt], axis=-1)
    of_pixel = np.full(n_pix, -1, dtype=np.int64)
    of_pixel[ipix] = np.arange(ipix.size)
    vectors = directions_to_xyz(angles[:, 0], angles[:, 1])
    for table in (ipix, angles, of_pixel, vectors):
        table.setflags(write=False)
    return DirectionTables(ipix, angles, of_pixel, vectors)


def _in_plane_directions() -> DirectionTables:
    ipix, angles = np.zeros(1, np.int64), np.zeros((1, 2))
    of_pixel, vectors = np.zeros(1, np.int64), np.array([[0.0, 0.0, 1.0]])
    for table in (ipix, angles, of_pixel, vectors):
        table.setflags(write=False)
    return DirectionTables(ipix, angles, of_pixel, vectors)


#: the one direction of in-plane sampling (rot = tilt = 0)
_IN_PLANE_DIRECTIONS = _in_plane_directions()


@dataclass(frozen=True)
class Sampling:
    """The sampling of one iteration (RELION's HealpixSampling state).

    healpix_order: HEALPix order N of the coarse directions.
    offset_range_px, offset_step_px: the translation disc (radius and grid step, pixels).
    symmetry: RELION symmetry symbol; directions are restricted to its asymmetric unit.
    psi_step_deg: requested in-plane step (None: 360/(6·2^N)); stored as the step actually
        used, 360/ceil(360/requested), as RELION does. `with_healpix_order` resets it;
        dataclasses.replace keeps it.
    oversampling: default oversampling order k of the fine pass (RELION's adaptive_oversampling).
    perturbation: RELION's random perturbation instance p (fraction of a step), 0 for none.
    in_plane: psi alone (2D references: one direction, rot = tilt = 0; see the module docstring); the
        HEALPix order then only sets the default psi step.
    """

    healpix_order: int
    offset_range_px: float
    offset_step_px: float
    symmetry: str = "C1"
    psi_step_deg: float | None = None
    oversampling: int = 1
    perturbation: float = 0.0
    in_plane: bool = False

    def __post_init__(self):
        if int(self.healpix_order) != self.healpix_order or self.healpix_order < 0:
            raise ValueError(f"healpix_order must be a non-negative integer, got {self.healpix_order!r}")
        if not self.offset_step_px > 0:
            raise ValueError(f"offset_step_px must be positive, got {self.offset_step_px!r}")
        if not self.offset_range_px >= 0:
            raise ValueError(f"offset_range_px must be non-negative, got {self.offset_range_px!r}")
        if int(self.oversampling) != self.oversampling or self.oversampling < 0:
            raise ValueError(f"oversampling must be a non-negative integer, got {self.oversampling!r}")
        requested = self.psi_step_deg
        if requested is None or requested <= 0:
            requested = 360.0 / (6 * 2 ** int(self.healpix_order))
        n_psi = int(math.ceil(360.0 / requested - 1e-9))
        object.__setattr__(self, "psi_step_deg", 360.0 / n_psi)
        object.__setattr__(self, "healpix_order", int(self.healpix_order))
        object.__setattr__(self, "oversampling", int(self.oversampling))
        object.__setattr__(self, "symmetry", symmetry_group(self.symmetry).name)
        object.__setattr__(self, "in_plane", bool(self.in_plane))
        if self.in_plane and self.symmetry != "C1":
            raise ValueError(f"in-plane sampling has no point-group symmetry, got {self.symmetry}")

    @property
    def ref_dim(self) -> int:
        """2 for in-plane sampling (2D references), else 3: RELION's ref_dim."""
        return 2 if self.in_plane else 3

    # ------------------------------------------------------------------ variants

    def with_healpix_order(self, healpix_order: int, psi_step_deg: float | None = None) -> Sampling:
        """The same sampling at another HEALPix order, psi step reset to that order's default."""
        return Sampling(healpix_order, self.offset_range_px, self.offset_step_px, self.symmetry,
                        psi_step_deg, self.oversampling, self.perturbation, self.in_plane)

    def with_offsets(self, offset_range_px: float, offset_step_px: float) -> Sampling:
        """The same sampling with another translation disc."""
        return Sampling(self.healpix_order, offset_range_px, offset_step_px, self.symmetry,
                        self.psi_step_deg, self.oversampling, self.perturbation, self.in_plane)

    # ------------------------------------------------------------------ sizes

    @property
    def group(self) -> SymmetryGroup:
        return symmetry_group(self.symmetry)

    @property
    def n_directions(self) -> int:
        return int(self.direction_ipix.shape[0])

    @property
    def n_psi(self) -> int:
        return int(round(360.0 / self.psi_step_deg))

    @property
    def n_orientations(self) -> int:
        return self.n_directions * self.n_psi

    @property
    def n_translations(self) -> int:
        return int(self._translations_unperturbed.shape[0])

    @property
    def n_coarse_samples(self) -> int:
        return self.n_orientations * self.n_translations

    def n_fine_orientations(self, oversampling: int | None = None) -> int:
        """Children per coarse orientation: 4^k directions × 2^k psi (in-plane: 2^k psi)."""
        k = self._k(oversampling)
        return 2 ** k if self.in_plane else 8 ** k

    def n_fine_translations(self, oversampling: int | None = None) -> int:
        """Children per coarse translation: 4^k."""
        k = self._k(oversampling)
        return 4 ** k

    def angular_sampling_deg(self, oversampling: int | None = None) -> float:
        """RELION's reported angular sampling 360/(6·2^(N+k)) (k defaults to `oversampling`); in-plane, the psi
        step / 2^k."""
        if self.in_plane:
            return self.psi_step_deg / 2 ** self._k(oversampling)
        return 360.0 / (6 * 2 ** (self.healpix_order + self._k(oversampling)))

    def offset_sampling_px(self, oversampling: int | None = None) -> float:
        """Translational step after k orders of oversampling: offset_step / 2^k."""
        return self.offset_step_px / 2 ** self._k(oversampling)

    def _k(self, oversampling):
        k = self.oversampling if oversampling is None else int(oversampling)
        if k < 0:
            raise ValueError(f"oversampling must be non-negative, got {oversampling!r}")
        return k

    # ------------------------------------------------------------------ coarse grid

    @property
    def direction_ipix(self) -> np.ndarray:
        """HEALPix NEST pixel (order N) of each coarse direction, increasing (read-only); in-plane, [0]."""
        return self._tables.ipix

    @property
    def _directions(self) -> np.ndarray:
        return self._tables.angles_deg

    @property
    def _tables(self) -> DirectionTables:
        return _IN_PLANE_DIRECTIONS if self.in_plane else direction_tables(self.healpix_order, self.symmetry)

    @functools.cached_property
    def _translations_unperturbed(self) -> np.ndarray:
        step, rng = float(self.offset_step_px), float(self.offset_range_px)
        m = int(math.ceil(rng / step - 1e-12))
        i = np.arange(-m, m + 1, dtype=np.float64) * step
        x = np.repeat(i, i.size)  # outer
        y = np.tile(i, i.size)  # inner
        keep = x * x + y * y <= rng * rng + _OFFSET_MARGIN_PX2
        out = np.stack([x[keep], y[keep]], axis=-1)
        out.setflags(write=False)
        return out

    def directions_deg(self, xp: ArrayModule = np) -> Array:
        """(n_dir, 2) rot, tilt of the coarse directions (not perturbed)."""
        return xp.asarray(self._directions)

    def direction_vectors(self, xp: ArrayModule = np) -> Array:
        """(n_dir, 3) unit projection directions of the coarse directions."""
        d = self._directions
        return directions_to_xyz(xp.asarray(d[:, 0]), xp.asarray(d[:, 1]), xp)

    def psi_deg(self, xp: ArrayModule = np) -> Array:
        """(n_psi,) coarse psi angles ipsi·step (not perturbed)."""
        return xp.arange(self.n_psi, dtype=xp.float64) * self.psi_step_deg

    def orientations_deg(self, xp: ArrayModule = np, index: npt.ArrayLike | None = None) -> tuple[Array, Array, Array]:
        """(rot, tilt, psi), each (n_dir·n_psi,), orientation index dir·n_psi + psi; perturbed. With
        `index` (host ints), those orientations only."""
        return self._perturb_angles(*self._unperturbed_orientations_deg(xp, index), xp)

    def orientation_matrices(self, xp: ArrayModule = np, index: Array | npt.ArrayLike | None = None,
                             directions_deg: Array | None = None) -> Array:
        """(n_orient, 3, 3) RELION Euler matrices of `orientations_deg` (perturbed); with `index`, of those.

        Made in `xp` as the unperturbed matrix times the perturbation's, the rotation `_perturb_angles` turns back
        into angles. The angles of `index` are gathered on the host, or, given `directions_deg` (this sampling's
        `directions_deg(xp)`, kept by a caller that makes matrices batch after batch), where `xp` runs: an index
        on the device then never leaves it."""
        if self.in_plane:  # rot = tilt = 0 stay so: the perturbation is a psi offset
            return euler_to_matrix(*self._perturb_angles(*self._unperturbed_orientations_deg(xp, index,
                                                                                          directions_deg), xp), xp=xp)
        m = euler_to_matrix(*self._unperturbed_orientations_deg(xp, index, directions_deg), xp=xp)
        if not self.perturbation:
            return m
        a = self.perturbation * self.angular_sampling_deg(0)
        return (m.reshape(-1, 3) @ euler_to_matrix(a, a, a, xp=xp)).reshape(m.shape)

    def _unperturbed_orientations_deg(self, xp, index, directions_deg=None):
        if index is None:
            d = self.directions_deg(xp)
            psi = self.psi_deg(xp)
            n_psi = psi.shape[0]
            return xp.repeat(d[:, 0], n_psi), xp.repeat(d[:, 1], n_psi), xp.tile(psi, d.shape[0])
        if directions_deg is None:  # gathered on the host
            table, o = self._directions, host_flat(index, np.int64)
        else:  # where the caller's table is
            table, o = directions_deg, xp.asarray(index, dtype=xp.int64).reshape(-1)
        d = table[o // self.n_psi]
        return xp.asarray(d[:, 0]), xp.asarray(d[:, 1]), xp.asarray((o % self.n_psi) * self.psi_step_deg)

    def translations_px(self, xp: ArrayModule = np) -> Array:
        """(n_trans, 2) coarse translations (x, y) in pixels, RELION's order; perturbed."""
        t = xp.asarray(self._translations_unperturbed)
        if self.perturbation:
            t = t + self.perturbation * self.offset_step_px
        return t

    def split_coarse_index(self, coarse_index: Array | npt.ArrayLike, xp: ArrayModule = np) -> tuple[Array, Array]:
        """(orientation index, translation index) of coarse sample indices o·n_trans + t."""
        s = xp.asarray(coarse_index, dtype=xp.int64)
        return s // self.n_translations, s % self.n_translations

    def split_orientation_index(self, orientation_index: Array | npt.ArrayLike,
                                xp: ArrayModule = np) -> tuple[Array, Array]:
        """(direction index, psi index) of orientation indices dir·n_psi + psi."""
        o = xp.asarray(orientation_index, dtype=xp.int64)
        return o // self.n_psi, o % self.n_psi

    # ------------------------------------------------------------------ fine grid

    def fine_orientations_deg(self, orientation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                              xp: ArrayModule = np) -> tuple[Array, Array, Array]:
        """Children of coarse orientations: (rot, tilt, psi), each (n, 8^k), perturbed.

        Child io = dir_child·2^k + psi_child, dir_child over the 4^k HEALPix pixels of order N+k
        in the coarse pixel (HEALPix x inner, y outer), psi_child over psi − step/2 +
        (0.5 + i)·step/2^k.
        """
        return self.fine_orientations(orientation_index, oversampling, xp, matrices=False)[:3]

    def fine_orientations(self, orientation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                          xp: ArrayModule = np, matrices: bool = True) -> tuple[Array, Array, Array, Array | None]:
        """`fine_orientations_deg`'s children (rot, tilt, psi), each (n, 8^k), and their RELION Euler matrices
        (n, 8^k, 3, 3), perturbed, in `xp` (None for the matrices with `matrices` False).

        A child's matrix is Rz(psi)·Ry(tilt)·Rz(rot)·P (P the perturbation's rotation): Ry(tilt)·Rz(rot)·P is made
        once per distinct fine direction (4^k of each coarse direction, on the host) and each psi child turns its
        first two rows, instead of a matrix from angles for every child (an order-2 grid at oversampling 2 with its
        matrices 0.34 -> 0.10 s on the CPU machine); a perturbed child's angles are its matrix's (`matrix_to_euler`),
        as RELION perturbs.
        """
        k = self._k(oversampling)
        o = host_flat(orientation_index, np.int64)
        idir, ipsi = o // self.n_psi, o % self.n_psi
        n_dc, n_pc = 4 ** k, 2 ** k
        step = self.psi_step_deg
        psi = xp.asarray(ipsi)[:, None] * step - 0.5 * step + (0.5 + xp.arange(n_pc))[None, :] * step / n_pc
        if self.in_plane:  # psi children only
            zeros = xp.zeros(psi.shape)
            rot, tilt, psi = self._perturb_angles(zeros, zeros.copy(), psi, xp)
            return rot, tilt, psi, euler_to_matrix(rot, tilt, psi, xp=xp) if matrices else None
        # the distinct directions' children from healpy on the host, each child where xp runs
        directions, inverse = np.unique(idir, return_inverse=True)
        fine_pix = self.direction_ipix[directions][:, None] * n_dc + _morton_offsets(k)[None, :]
        rot_d, tilt_d = healpix_angles_deg(self.healpix_order + k, fine_pix)  # (directions, 4^k)
        inverse = xp.asarray(inverse.reshape(-1))
        m = None
        if matrices or self.perturbation:  # the matrices, and a perturbed sampling's angles from them
            tilted = euler_to_matrix(rot_d, tilt_d, np.zeros_like(rot_d))  # Ry(tilt)·Rz(rot), (directions, 4^k, 3, 3)
            if self.perturbation:
                a = self.perturbation * self.angular_sampling_deg(0)
                tilted = tilted @ euler_to_matrix(a, a, a)
            part = xp.asarray(tilted)[inverse][:, :, None]  # (n, 4^k, 1, 3, 3)
            angle = xp.deg2rad(psi)
            cos, sin = xp.cos(angle)[:, None, :, None], xp.sin(angle)[:, None, :, None]  # (n, 1, 2^k, 1)
            m = xp.empty((o.size, n_dc, n_pc, 3, 3))
            m[..., 0, :] = cos * part[..., 0, :] + sin * part[..., 1, :]
            m[..., 1, :] = cos * part[..., 1, :] - sin * part[..., 0, :]
            m[..., 2, :] = part[..., 2, :]
            m = m.reshape(o.size, n_dc * n_pc, 3, 3)
        if self.perturbation:
            rot, tilt, psi = matrix_to_euler(m, xp=xp)
        else:
            rot = xp.repeat(xp.asarray(rot_d)[inverse], n_pc, axis=1)
            tilt = xp.repeat(xp.asarray(tilt_d)[inverse], n_pc, axis=1)
            psi = xp.tile(psi, (1, n_dc))
        return rot, tilt, psi, m if matrices else None

    def fine_translations_px(self, translation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                             xp: ArrayModule = np) -> Array:
        """Children of coarse translations: (n, 4^k, 2) (x, y) in pixels, perturbed.

        Child it = ix·2^k + iy with offsets −step/2 + (0.5 + i)·step/2^k in x (outer), y (inner).
        """
        k = self._k(oversampling)
        t = host_flat(translation_index, np.int64)
        n_sub = 2 ** k
        step = self.offset_step_px
        sub = -0.5 * step + (0.5 + np.arange(n_sub)) * step / n_sub
        dx = np.repeat(sub, n_sub)
        dy = np.tile(sub, n_sub)
        base = self._translations_unperturbed[t]
        out = np.stack([base[:, 0:1] + dx[None, :], base[:, 1:2] + dy[None, :]], axis=-1)
        if self.perturbation:
            out = out + self.perturbation * step
        return xp.asarray(out)

    def fine_samples(self, coarse_index: Array | npt.ArrayLike, oversampling: int | None = None,
                     xp: ArrayModule = np) -> FineSamples:
        """Children of coarse samples s = o·n_trans + t (fine sample f = io·n_ft + it)."""
        s = host_flat(coarse_index, np.int64)
        o, t = s // self.n_translations, s % self.n_translations
        rot, tilt, psi = self.fine_orientations_deg(o, oversampling, xp)
        return FineSamples(rot, tilt, psi, self.fine_translations_px(t, oversampling, xp))

    def fine_samples_flat(self, coarse_index: Array | npt.ArrayLike, oversampling: int | None = None,
                          xp: ArrayModule = np) -> tuple[Array, Array, Array, Array, Array]:
        """Children of coarse samples as (rot, tilt, psi, x, y), each (n, n_fo·n_ft), f = io·n_ft + it."""
        fs = self.fine_samples(coarse_index, oversampling, xp)
        n_ft = fs.translations_px.shape[1]
        n_fo = fs.rot_deg.shape[1]
        rot = xp.repeat(fs.rot_deg, n_ft, axis=1)
        tilt = xp.repeat(fs.tilt_deg, n_ft, axis=1)
        psi = xp.repeat(fs.psi_deg, n_ft, axis=1)
        tx = xp.tile(fs.translations_px[:, :, 0], (1, n_fo))
        ty = xp.tile(fs.translations_px[:, :, 1], (1, n_fo))
        return rot, tilt, psi, tx, ty

    # ------------------------------------------------------------------ perturbation

    def _perturb_angles(self, rot, tilt, psi, xp):
        if self.in_plane:  # psi moved by the perturbation, into (−180, 180] as RELION writes angles
            return rot, tilt, _wrap_deg(psi + self.perturbation * self.psi_step_deg, xp)
        if not self.perturbation:
            return rot, tilt, psi
        a = self.perturbation * self.angular_sampling_deg(0)
        shape = rot.shape
        m = euler_to_matrix(rot.reshape(-1), tilt.reshape(-1), psi.reshape(-1), xp=xp)
        m = m @ euler_to_matrix(a, a, a, xp=xp)
        r, t, p = matrix_to_euler(m, xp=xp)
        return r.reshape(shape), t.reshape(shape), p.reshape(shape)

    # ------------------------------------------------------------------ local searches

    def local_orientations(self, prior_rot_deg: npt.ArrayLike, prior_tilt_deg: npt.ArrayLike,
                           prior_psi_deg: npt.ArrayLike, sigma_dir_deg: float, sigma_psi_deg: float,
                           sigma_cutoff: float = 3.0) -> LocalOrientations:
        """Each particle's orientations and Gaussian log priors around its prior pose (B,) for a local
        search (RELION's selectOrientationsWithNonZeroPriorProbability).

        A direction is kept if its angle to the prior direction, the smallest over the symmetry
        mates R d, is < sigma_cutoff·sigma_dir_deg; a psi if its wrapped difference to the prior
        psi is < sigma_cutoff·sigma_psi_deg. A sigma ≤ 0 keeps every sample with a flat prior.
        If nothing is in range, the nearest sample alone is kept.
        """
        if self.in_plane:
            raise ValueError("in-plane sampling has no local searches")
        pr, pt, pp = (host_flat(a, np.float64) for a in (prior_rot_deg, prior_tilt_deg, prior_psi_deg))
        n = pr.size
        if sigma_dir_deg > 0:
            dir_offsets, dirs, dir_lp = self._local_directions(pr, pt, sigma_dir_deg, sigma_cutoff)
        else:
            dir_offsets = np.arange(n + 1, dtype=np.int64) * self.n_directions
            dirs = np.tile(np.arange(self.n_directions, dtype=np.int64), n)
            dir_lp = np.full(dirs.size, -math.log(self.n_directions))
        if sigma_psi_deg > 0:
            psi_offsets, psis, psi_lp = self._local_psi(pp, sigma_psi_deg, sigma_cutoff)
        else:
            psi_offsets = np.arange(n + 1, dtype=np.int64) * self.n_psi
            psis = np.tile(np.arange(self.n_psi, dtype=np.int64), n)
            psi_lp = np.full(psis.size, -math.log(self.n_psi))
        offsets, i_dir, i_psi = _ragged_product(dir_offsets, np.arange(dirs.size), psi_offsets, np.arange(psis.size))
        return LocalOrientations(offsets, dirs[i_dir] * self.n_psi + psis[i_psi], dir_lp[i_dir] + psi_lp[i_psi])

    @property
    def _direction_of_pixel(self) -> np.ndarray:
        """Direction index of each HEALPix pixel of order N, −1 outside the asymmetric unit."""
        return direction_tables(self.healpix_order, self.symmetry).of_pixel

    @property
    def _direction_vectors(self) -> np.ndarray:
        return direction_tables(self.healpix_order, self.symmetry).vectors

    def _local_directions(self, prior_rot_deg, prior_tilt_deg, sigma_deg, cutoff):
        """Ragged (offsets, directions, log priors) of the directions near each prior direction: the
        candidates are the pixels of order N inside a block of coarser pixels around each symmetry mate
        of the prior (`_neighbourhood_pixels`), their exact angles decide. Particles go in chunks of about
        LOCAL_CANDIDATES_PER_CHUNK candidates (a group of 60 mates has 60 blocks per particle)."""
        import healpy

        n = prior_rot_deg.size
        mats = np.asarray(self.group.matrices)
        q = directions_to_xyz(prior_rot_deg, prior_tilt_deg)  # (B, 3)
        mates = np.einsum("bj,gjk->bgk", q, mats)  # q·R: the angle to d is the one between Rᵀq and d
        # at least two pixels wide: the candidates hold the nearest direction when none is in range
        radius = max(math.radians(cutoff * sigma_deg), 2.0 * healpy.nside2resol(healpix_nside(self.healpix_order)))
        counts, directions, log_priors = [], [], []
        start, step = 0, 1  # the first particle alone tells how many candidates a particle has
        while start < n:
            pix = _neighbourhood_pixels(self.healpix_order, mates[start:start + step], radius)  # (b, C), −1: none
            chunk = self._directions_in_range(pix, mates[start:start + step], sigma_deg, cutoff)
            counts.append(chunk[0])
            directions.append(chunk[1])
            log_priors.append(chunk[2])
            start += step
            step = max(1, LOCAL_CANDIDATES_PER_CHUNK // max(pix.shape[1], 1))
        counts = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
        return (offsets, np.concatenate(directions or [np.zeros(0, np.int64)]),
                np.concatenate(log_priors or [np.zeros(0)]))

    def _directions_in_range(self, pix, mates, sigma_deg, cutoff):
        """Counts (b,), directions and log priors of `_local_directions` for candidate pixels (b, C) (−1: none)
        around the mates (b, G, 3) of b particles."""
        n = pix.shape[0]
        found = np.where(pix >= 0, self._direction_of_pixel[pix], -1)  # increasing where ≥ 0 (NEST ranges)
        empty = ~(found >= 0).any(axis=1)
        if empty.any():  # no unit pixel near any mate (a tiny disc): every direction is a candidate
            width = max(found.shape[1], self.n_directions)
            found = np.pad(found, ((0, 0), (0, width - found.shape[1])), constant_values=-1)
            found[empty] = -1
            found[empty, :self.n_directions] = np.arange(self.n_directions)
        # the candidates in range (a hair wider: the angles below decide); a particle with none keeps all of its
        # candidates, of which _normalised_gaussian keeps the nearest
        least = math.cos(math.radians(cutoff * sigma_deg)) - 1e-9
        if mates.shape[1] == 1:  # C1: every candidate is a direction, measured in place
            cosine = np.einsum("bck,bk->bc", self._direction_vectors[np.maximum(found, 0)], mates[:, 0])
            valid = found >= 0
            near = valid & (cosine > least)
            near |= valid & ~near.any(axis=1)[:, None]
            row, col = np.nonzero(near)
            cand, cosine = found[row, col], cosine[row, col]
        else:  # the unit's directions only (1/|G| of the candidates)
            row, col = np.nonzero(found >= 0)
            cand = found[row, col]
            cosine = np.einsum("ngk,nk->ng", mates[row], self._direction_vectors[cand]).max(axis=1)
            near = cosine > least
            has = np.zeros(n, dtype=bool)
            has[row[near]] = True
            near |= ~has[row]
            row, cand, cosine = row[near], cand[near], cosine[near]
        angle = np.rad2deg(np.arccos(np.clip(cosine, -1.0, 1.0)))
        keep, log_prior = _normalised_gaussian(angle, row, n, sigma_deg, cutoff)
        return np.bincount(row[keep], minlength=n).astype(np.int64), cand[keep], log_prior

    def _local_psi(self, prior_psi_deg, sigma_deg, cutoff):
        """Ragged (offsets, psi indices, log priors) of the psi angles near each prior psi."""
        step, n_psi = self.psi_step_deg, self.n_psi
        half = int(math.ceil(cutoff * sigma_deg / step)) + 1
        if 2 * half + 1 >= n_psi:
            cand = np.broadcast_to(np.arange(n_psi), (prior_psi_deg.size, n_psi))
        else:  # a window around the nearest psi, increasing
            centre = np.rint(prior_psi_deg / step).astype(np.int64)
            cand = np.sort((centre[:, None] + np.arange(-half, half + 1)[None, :]) % n_psi, axis=1)
        dpsi = np.abs(_wrap_deg(cand * step - prior_psi_deg[:, None]))
        row = np.repeat(np.arange(cand.shape[0]), cand.shape[1])
        keep, log_prior = _normalised_gaussian(dpsi.reshape(-1), row, cand.shape[0], sigma_deg, cutoff)
        offsets = np.r_[0, np.cumsum(np.bincount(row[keep], minlength=cand.shape[0]))].astype(np.int64)
        return offsets, cand.reshape(-1)[keep].astype(np.int64), log_prior


def offset_log_prior(translations_px: Array | npt.ArrayLike, old_offset_px: Array | npt.ArrayLike,
                     sigma_offset_px: float, prior_offset_px: Array | npt.ArrayLike | None = None,
                     xp: ArrayModule = np, translation_scale: float = 1.0) -> Array:
    """log P(offset) (B, n_trans) of the absolute offsets old + t (RELION's pdf_offset).

    −|old + s·t − prior|² / (2σ²), prior at (0, 0) unless given (B, 2), s the `translation_scale` (1, or the
    pixel size in Å in a 2D classification: `estep.engine.IterationSetup.offset_prior_translation_scale`); not
    normalised, as in RELION. With σ below 0.01 px the prior is a delta: 0 at the prior, −inf elsewhere.
    """
    t = translation_scale * xp.asarray(translations_px, dtype=xp.float64)
    old = xp.asarray(old_offset_px, dtype=xp.float64).reshape(-1, 2)
    prior = (xp.zeros_like(old) if prior_offset_px is None
             else xp.asarray(prior_offset_px, dtype=xp.float64).reshape(-1, 2))
    diff = old[:, None, :] + t[None, :, :] - prior[:, None, :]
    d2 = xp.sum(diff * diff, axis=-1)
    if sigma_offset_px * sigma_offset_px < 1e-4:
        return xp.where(d2 > 0, -xp.inf, 0.0)
    return -d2 / (2.0 * sigma_offset_px * sigma_offset_px)


#: RELION's --perturb: each iteration's random perturbation of the sampling is within ± this share of a step
PERTURBATION_FACTOR = 0.5


def next_perturbation(current: float, factor: float, rng: np.random.Generator) -> float:
    """RELION's resetRandomlyPerturbedSampling: add U(factor/2, factor), wrap into [−factor, factor)."""
    if factor <= 0:
        return 0.0
    p = current + rng.uniform(0.5 * factor, factor)
    return float((p + factor) % (2.0 * factor) - factor)

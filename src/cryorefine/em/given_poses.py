"""The sampling of --skip_align: every particle keeps the pose and origin it has, and only its class is
searched (RELION's do_skip_align, ml_optimiser.cpp: one orientation and one translation per particle,
no oversampling, no perturbation).

`GivenPoses` stands in for a `core.sampling.Sampling` in an engine's set-up, so the one E-step
(`em.estep`, either engine, unchanged) does the work: its orientations are the poses of a work unit's
particles, indexed as one direction × one "psi" per particle (orientation i = particle i of the unit),
its one translation is (0, 0) relative to the particle's origin (whose sub-pixel part the engines
apply as a phase shift), and its `local_orientations` keeps, for each particle of a batch, its own
orientation alone. The engines' local-search path then projects each particle's own orientation and
the weights run over the classes. The class sums' direction distribution has one direction, as
RELION's has with --skip_align.

A batch's particles are found among the unit's poses by their pose values, which the E-step hands
back unchanged (the best sample of a particle is its own orientation).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule, host_flat
from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.sampling import LocalOrientations


@dataclass(frozen=True, eq=False)
class GivenPoses:
    """One orientation per particle of a work unit (angles in degrees, (n,) float64), one translation."""

    rot_deg: np.ndarray
    tilt_deg: np.ndarray
    psi_deg: np.ndarray
    symmetry: str = "C1"
    healpix_order: int = 0
    offset_range_px: float = 0.0
    offset_step_px: float = 1.0
    oversampling: int = 0
    perturbation: float = 0.0

    @classmethod
    def of(cls, rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike, psi_deg: npt.ArrayLike,
           members: npt.ArrayLike) -> GivenPoses:
        """The poses of the particles `members` (indices into the per-particle arrays), in that order."""
        members = np.asarray(members, dtype=np.int64)
        return cls(*(np.asarray(a, dtype=np.float64)[members].copy() for a in (rot_deg, tilt_deg, psi_deg)))

    # ------------------------------------------------------------------ sizes (Sampling's names)
    @property
    def n_directions(self) -> int:
        return 1

    @property
    def n_psi(self) -> int:
        return int(self.rot_deg.size)

    @property
    def n_orientations(self) -> int:
        return int(self.rot_deg.size)

    @property
    def n_translations(self) -> int:
        return 1

    @property
    def psi_step_deg(self) -> float:
        return 360.0

    def n_fine_orientations(self, oversampling: int | None = None) -> int:
        return 1

    def n_fine_translations(self, oversampling: int | None = None) -> int:
        return 1

    def angular_sampling_deg(self, oversampling: int | None = None) -> float:
        return 360.0 / (6 * 2 ** self.healpix_order)

    # ------------------------------------------------------------------ the grid
    def orientations_deg(self, xp: ArrayModule = np, index: npt.ArrayLike | None = None) -> tuple[Array, Array, Array]:
        """The poses of `index` (host or device ints; all by default), as arrays of `xp`."""
        pick = slice(None) if index is None else host_flat(index, np.int64)
        return xp.asarray(self.rot_deg[pick]), xp.asarray(self.tilt_deg[pick]), xp.asarray(self.psi_deg[pick])

    def orientation_matrices(self, xp: ArrayModule = np, index: npt.ArrayLike | None = None,
                             directions_deg: Array | None = None) -> Array:
        """Sampling's call: `directions_deg`, the device table of a grid's directions, has nothing to give here (the
        poses are the unit's own), and an `index` on the device is gathered on the host, as the children are."""
        return euler_to_matrix(*self.orientations_deg(xp, index), xp=xp)

    def directions_deg(self, xp: ArrayModule = np) -> Array:
        return xp.zeros((1, 2))

    def translations_px(self, xp: ArrayModule = np) -> Array:
        return xp.zeros((1, 2))

    def fine_translations_px(self, translation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                             xp: ArrayModule = np) -> Array:
        n = int(np.asarray(translation_index).size)
        return xp.zeros((n, 1, 2))

    def fine_orientations_deg(self, orientation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                              xp: ArrayModule = np) -> tuple[Array, Array, Array]:
        """The 'children' of orientations: the orientations themselves, (n, 1) each."""
        o = host_flat(orientation_index, np.int64)
        return tuple(xp.asarray(a[o][:, None]) for a in (self.rot_deg, self.tilt_deg, self.psi_deg))

    def fine_orientations(self, orientation_index: Array | npt.ArrayLike, oversampling: int | None = None,
                          xp: ArrayModule = np, matrices: bool = True) -> tuple[Array, Array, Array, Array | None]:
        """`fine_orientations_deg` and, unless `matrices` is False, their Euler matrices (n, 1, 3, 3), as
        `core.sampling.Sampling.fine_orientations` gives a grid's children."""
        rot, tilt, psi = self.fine_orientations_deg(orientation_index, oversampling, xp)
        return rot, tilt, psi, euler_to_matrix(rot, tilt, psi, xp=xp) if matrices else None

    # ------------------------------------------------------------------ each particle its own pose
    @functools.cached_property
    def _index_of_pose(self):
        return {pose: i for i, pose in enumerate(zip(self.rot_deg.tolist(), self.tilt_deg.tolist(),
                                                     self.psi_deg.tolist()))}

    def index_of(self, rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike, psi_deg: npt.ArrayLike) -> np.ndarray:
        """The orientation index of each pose (B,) (host arrays): the unit's particle with exactly that pose, else
        the nearest orientation."""
        rot, tilt, psi = (host_flat(a, np.float64) for a in (rot_deg, tilt_deg, psi_deg))
        table = self._index_of_pose
        out = np.array([table.get(p, -1) for p in zip(rot.tolist(), tilt.tolist(), psi.tolist())], dtype=np.int64)
        missing = np.flatnonzero(out < 0)
        if missing.size:
            mine = euler_to_matrix(self.rot_deg, self.tilt_deg, self.psi_deg).reshape(-1, 9)
            theirs = euler_to_matrix(rot[missing], tilt[missing], psi[missing]).reshape(-1, 9)
            out[missing] = np.argmax(theirs @ mine.T, axis=1)  # largest trace of Rᵀ·R': smallest rotation angle
        return out

    def local_orientations(self, prior_rot_deg: npt.ArrayLike, prior_tilt_deg: npt.ArrayLike,
                           prior_psi_deg: npt.ArrayLike, sigma_dir_deg: float = 0.0, sigma_psi_deg: float = 0.0,
                           sigma_cutoff: float = 3.0) -> LocalOrientations:
        """LocalOrientations of a batch: each particle its own orientation alone (log prior 0). The sigmas are
        not used."""
        index = self.index_of(prior_rot_deg, prior_tilt_deg, prior_psi_deg)
        return LocalOrientations(np.arange(index.size + 1, dtype=np.int64), index, np.zeros(index.size))

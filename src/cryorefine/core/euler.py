"""RELION's ZYZ Euler angles (rot, tilt, psi, in degrees) and rotation matrices.

The matrix A of a pose maps map (3D) coordinates into image coordinates: the projection of a
map V at pose A is P(x, y) = ∫ V(Aᵀ (x, y, z)) dz, and its Fourier transform is the central
slice F3(Aᵀ (kx, ky, 0)) (RELION's Euler_angles2matrix / Projector::project).

Every function takes an array module `xp` (numpy or cupy) and is vectorised over leading axes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cryorefine.core.arrays import Array, ArrayModule


def euler_to_matrix(rot_deg: npt.ArrayLike, tilt_deg: npt.ArrayLike, psi_deg: npt.ArrayLike,
                    xp: ArrayModule = np) -> Array:
    """Rotation matrices (..., 3, 3) from RELION Euler angles in degrees."""
    a = xp.deg2rad(xp.asarray(rot_deg, dtype=xp.float64))
    b = xp.deg2rad(xp.asarray(tilt_deg, dtype=xp.float64))
    g = xp.deg2rad(xp.asarray(psi_deg, dtype=xp.float64))
    a, b, g = xp.broadcast_arrays(a, b, g)
    ca, sa = xp.cos(a), xp.sin(a)
    cb, sb = xp.cos(b), xp.sin(b)
    cg, sg = xp.cos(g), xp.sin(g)
    cc, cs = cb * ca, cb * sa
    sc, ss = sb * ca, sb * sa
    rows = [
        [cg * cc - sg * sa, cg * cs + sg * ca, -cg * sb],
        [-sg * cc - cg * sa, -sg * cs + cg * ca, sg * sb],
        [sc, ss, cb],
    ]
    return xp.stack([xp.stack(r, axis=-1) for r in rows], axis=-2)


def matrix_to_euler(matrix: npt.ArrayLike, xp: ArrayModule = np) -> tuple[Array, Array, Array]:
    """RELION Euler angles (rot, tilt, psi) in degrees from rotation matrices (..., 3, 3).

    tilt is in [0, 180]; for tilt 0 or 180 the split between rot and psi is ambiguous and,
    as in RELION, rot is set to 0.
    """
    m = xp.asarray(matrix, dtype=xp.float64)
    abs_sb = xp.sqrt(m[..., 0, 2] ** 2 + m[..., 1, 2] ** 2)
    regular = abs_sb > 16 * np.finfo(np.float32).eps
    psi = xp.arctan2(m[..., 1, 2], -m[..., 0, 2])
    rot = xp.arctan2(m[..., 2, 1], m[..., 2, 0])
    tilt = xp.arctan2(abs_sb, m[..., 2, 2])
    # Degenerate tilt (0 or 180 degrees): rot = 0, all in-plane rotation in psi.
    up = m[..., 2, 2] > 0
    psi_deg_case = xp.where(up, xp.arctan2(-m[..., 1, 0], m[..., 0, 0]),
                            xp.arctan2(m[..., 1, 0], -m[..., 0, 0]))
    tilt_deg_case = xp.where(up, 0.0, np.pi)
    rot = xp.where(regular, rot, 0.0)
    tilt = xp.where(regular, tilt, tilt_deg_case)
    psi = xp.where(regular, psi, psi_deg_case)
    return xp.rad2deg(rot), xp.rad2deg(tilt), xp.rad2deg(psi)

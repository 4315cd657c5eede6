"""Point groups with RELION's names and axes; asymmetric unit; symmetrising maps."""

import numpy as np
import pytest

from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.fourier import irfft3_centered, rfft3_centered
from cryorefine.core.symmetry import (
    angular_distance_deg,
    asymmetric_unit_mask,
    equivalent_pose_matrices,
    symmetrise_half_transform,
    symmetrise_volume,
    symmetry_group,
    to_asymmetric_unit,
)

ORDERS = {
    "C1": 1, "C2": 2, "C4": 4, "C7": 7, "C12": 12, "CI": 2, "CS": 2, "C2V": 4, "C3V": 6, "C4H": 8,
    "S4": 4, "S6": 6, "D1": 2, "D2": 4, "D3": 6, "D5": 10, "D2H": 8, "D3H": 12, "D4H": 16, "D3V": 12,
    "D4V": 16, "T": 12, "TD": 24, "TH": 24, "O": 24, "OH": 48, "I": 60, "I1": 60, "I2": 60, "I3": 60,
    "I4": 60, "IH": 120, "I1H": 120, "I2H": 120, "I3H": 120, "I4H": 120,
}
IMPROPER = {"CI", "CS", "C2V", "C3V", "C4H", "S4", "S6", "D2H", "D3H", "D4H", "D3V", "D4V", "TD", "TH",
            "OH", "IH", "I1H", "I2H", "I3H", "I4H"}


def _contains(mats, m, tol=1e-6):
    return bool(np.any(np.max(np.abs(mats - m), axis=(1, 2)) < tol))


def _same_set(a, b, tol=1e-6):
    return a.shape == b.shape and all(_contains(b, m, tol) for m in a)


def _unit(v):
    v = np.asarray(v, dtype=float)
    return v / np.linalg.norm(v)


def _has_axis(group, axis, fold, tol=1e-5):
    """True if the group has the rotation by 360/fold about `axis` (RELION's decimal axis)."""
    u = _unit(axis)
    a = 2 * np.pi / fold
    k = np.array([[0, -u[2], u[1]], [u[2], 0, -u[0]], [-u[1], u[0], 0]])
    r = np.cos(a) * np.eye(3) + np.sin(a) * k + (1 - np.cos(a)) * np.outer(u, u)
    return _contains(group.matrices, r, tol)


def _has_mirror(group, normal, tol=1e-5):
    n = _unit(normal)
    return _contains(group.matrices, np.eye(3) - 2 * np.outer(n, n), tol)


@pytest.mark.parametrize("name, order", sorted(ORDERS.items()))
def test_group_order_closure_inverses_determinants(name, order):
    g = symmetry_group(name)
    m = g.matrices
    assert m.shape == (order, 3, 3)
    assert np.allclose(m[0], np.eye(3))
    # orthogonal, det ±1, improper operators exactly where the group has them
    assert np.allclose(np.einsum("gji,gjk->gik", m, m), np.eye(3), atol=1e-10)
    det = np.linalg.det(m)
    assert np.allclose(np.abs(det), 1.0)
    n_improper = int(np.sum(det < 0))
    assert n_improper == (order // 2 if name in IMPROPER else 0)
    # all distinct
    diffs = np.max(np.abs(m[:, None] - m[None, :]), axis=(2, 3))
    assert np.all(diffs[~np.eye(order, dtype=bool)] > 1e-6)
    # closure and inverses
    for a in m:
        assert _contains(m, a.T)
        prods = np.einsum("ij,gjk->gik", a, m)
        for p in prods:
            assert _contains(m, p)


def test_unknown_symbols_raise_naming_them():
    for bad in ["X3", "C", "I5", "I5H", "S3", "C123", "", "D2X", "Q"]:
        with pytest.raises(ValueError, match=repr(bad) if bad else "''"):
            symmetry_group(bad)


def test_names_are_case_insensitive_and_i_is_i2():
    assert _same_set(symmetry_group("d2").matrices, symmetry_group("D2").matrices)
    assert _same_set(symmetry_group("i").matrices, symmetry_group("I2").matrices)
    assert _same_set(symmetry_group("Ih").matrices, symmetry_group("I2H").matrices)


def test_relion_axes_cyclic_dihedral():
    # C<n>: n-fold about z
    assert _contains(symmetry_group("C4").matrices, np.array([[0.0, -1, 0], [1, 0, 0], [0, 0, 1]]))
    assert _has_axis(symmetry_group("C7"), [0, 0, 1], 7)
    # D<n>: 2-fold along x (RELION: rot_axis 2 1 0 0)
    d2 = symmetry_group("D2")
    assert _contains(d2.matrices, np.diag([1.0, -1, -1]))
    assert _has_axis(symmetry_group("D5"), [1, 0, 0], 2) and _has_axis(symmetry_group("D5"), [0, 0, 1], 5)
    assert not _has_axis(symmetry_group("D5"), [0, 1, 0], 2)
    # mirrors: CS z, C<n>V y, D<n>V x, D<n>H z (RELION's mirror_plane lines)
    assert _has_mirror(symmetry_group("CS"), [0, 0, 1])
    assert _has_mirror(symmetry_group("C3V"), [0, 1, 0]) and not _has_mirror(symmetry_group("C3V"), [1, 0, 0])
    assert _has_mirror(symmetry_group("D3V"), [1, 0, 0])
    assert _has_mirror(symmetry_group("D3H"), [0, 0, 1])
    assert _contains(symmetry_group("CI").matrices, -np.eye(3))
    # RELION's S<n>: (n/2)-fold + inversion
    assert _contains(symmetry_group("S6").matrices, -np.eye(3)) and _has_axis(symmetry_group("S6"), [0, 0, 1], 3)


def test_relion_axes_polyhedral():
    # Decimal axes as written in RELION's SymList::fill_symmetry_class.
    t = symmetry_group("T")
    assert _has_axis(t, [0, 0, 1], 3) and _has_axis(t, [0.0, 0.816496, 0.577350], 2)
    assert _has_mirror(symmetry_group("TD"), [1.4142136, 2.4494897, 0.0])
    th = symmetry_group("TH")
    assert _has_axis(th, [0.0, -0.816496, -0.577350], 2) and _contains(th.matrices, -np.eye(3))
    o = symmetry_group("O")
    assert _has_axis(o, [0.5773502, 0.5773502, 0.5773502], 3) and _has_axis(o, [0, 0, 1], 4)
    assert _has_mirror(symmetry_group("OH"), [0, 1, 1])
    i2 = symmetry_group("I2")
    assert _has_axis(i2, [0, 0, 1], 2)
    assert _has_axis(i2, [0.525731114, 0, 0.850650807], 5)
    assert _has_axis(i2, [0, 0.356822076, 0.934172364], 3)
    assert not _has_axis(i2, [0, 0, 1], 5)
    i1 = symmetry_group("I1")
    assert _has_axis(i1, [1, 0, 0], 2)
    assert _has_axis(i1, [0.85065080702670, 0, -0.5257311142635], 5)
    assert _has_axis(i1, [0.9341723640, 0.3568220765, 0], 3)
    i3 = symmetry_group("I3")
    assert _has_axis(i3, [-0.5257311143, 0, 0.8506508070], 2)
    assert _has_axis(i3, [0, 0, 1], 5)
    assert _has_axis(i3, [-0.4911234778630044, 0.3568220764705179, 0.7946544753759428], 3)
    i4 = symmetry_group("I4")
    assert _has_axis(i4, [0.5257311143, 0, 0.8506508070], 2)
    assert _has_axis(i4, [0.8944271932547096, 0, 0.4472135909903704], 5)
    assert _has_axis(i4, [0.4911234778630044, 0.3568220764705179, 0.7946544753759428], 3)
    assert _has_mirror(symmetry_group("IH"), [1, 0, 0])
    assert _has_mirror(symmetry_group("I1H"), [0, 0, -1])
    assert _has_mirror(symmetry_group("I3H"), [0.850650807, 0, 0.525731114])
    assert _has_mirror(symmetry_group("I4H"), [0.850650807, 0, -0.525731114])


def test_icosahedral_orientations_relate_as_in_relion_asymmetric_units():
    # RELION's removeSymmetryEquivalentPointsGeometric builds the I1/I3/I4 units from the I2 one
    # rotated by Euler_angles2matrix(0, 90, 0), (0, 31.7174745559, 0) and (0, -31.7174745559, 0).
    i2 = symmetry_group("I2").matrices
    for name, tilt in [("I1", 90.0), ("I3", 31.7174745559), ("I4", -31.7174745559)]:
        a = euler_to_matrix(0.0, tilt, 0.0)
        assert _same_set(np.einsum("ij,gjk,lk->gil", a, i2, a), symmetry_group(name).matrices, tol=1e-8), name


def _random_directions(n, seed):
    d = np.random.default_rng(seed).normal(size=(n, 3))
    return d / np.linalg.norm(d, axis=1, keepdims=True)


@pytest.mark.parametrize("name", ["C1", "C4", "C7", "CI", "CS", "C3V", "C4H", "S4", "D1", "D2", "D3", "D3V",
                                  "D4H", "D3H", "D5H", "D1V", "T", "TD", "TH", "O", "OH", "I", "I1", "I3", "I4", "IH",
                                  "I1H", "I3H", "I4H"])
def test_asymmetric_unit_holds_exactly_one_image_of_each_direction(name):
    g = symmetry_group(name)
    d = _random_directions(400, 1)
    images = np.einsum("gij,nj->ngi", g.matrices, d)
    inside = asymmetric_unit_mask(images.reshape(-1, 3), g).reshape(len(d), g.order)
    assert np.all(inside.sum(axis=1) == 1)
    mapped, index = to_asymmetric_unit(d, g)
    assert np.all(asymmetric_unit_mask(mapped, g))
    assert np.allclose(mapped, np.einsum("nij,nj->ni", g.matrices[index], d))
    # the unit covers 1/order of the sphere
    frac = asymmetric_unit_mask(_random_directions(6000, 2), g).mean()
    assert abs(frac * g.order - 1.0) < 0.15 + 3 * np.sqrt(g.order / 6000.0)


def test_asymmetric_unit_on_border_points_fixed_by_operators():
    # Directions on rotation axes / mirror planes: still exactly one distinct image inside.
    pts = np.array([[0, 0, 1.0], [0, 0, -1.0], [1, 0, 0], [0, 1, 0], _unit([1, 1, 0]), _unit([1, 1, 1]),
                    _unit([0.525731114, 0, 0.850650807]), _unit([np.cos(np.pi / 4), np.sin(np.pi / 4), 0.3])])
    for name in ["C4", "D2", "CS", "C3V", "D4H", "O", "OH", "I", "IH"]:
        g = symmetry_group(name)
        images = np.einsum("gij,nj->ngi", g.matrices, pts)
        inside = asymmetric_unit_mask(images.reshape(-1, 3), g).reshape(len(pts), g.order)
        for i in range(len(pts)):
            chosen = images[i][inside[i]]
            assert len(chosen) >= 1, name
            assert np.allclose(chosen, chosen[0], atol=1e-9), name


def _rot_tilt(d):
    return np.degrees(np.arctan2(d[:, 1], d[:, 0])), np.degrees(np.arccos(np.clip(d[:, 2], -1, 1)))


def test_asymmetric_units_match_relion_geometric_regions():
    d = _random_directions(4000, 3)
    rot, tilt = _rot_tilt(d)
    margin = 1.0  # degrees away from the borders
    cases = {
        "C4": (np.abs(rot) < 45 - margin, np.abs(rot) > 45 + margin),
        "CI": (tilt < 90 - margin, tilt > 90 + margin),
        "C3V": ((rot > margin) & (rot < 60 - margin), (rot < -margin) | (rot > 60 + margin)),
        "D2": ((rot > margin) & (rot < 180 - margin) & (tilt < 90 - margin),
               (rot < -margin) | (tilt > 90 + margin)),
        "D4H": ((rot > 90 + margin) & (rot < 135 - margin) & (tilt < 90 - margin),
                (rot < 90 - margin) | (rot > 135 + margin) | (tilt > 90 + margin)),
        "D3V": ((rot > 90 + margin) & (rot < 150 - margin) & (tilt < 90 - margin),
                (rot < 90 - margin) | (rot > 150 + margin) | (tilt > 90 + margin)),
    }
    for name, (surely_in, surely_out) in cases.items():
        mask = asymmetric_unit_mask(d, symmetry_group(name))
        assert np.all(mask[surely_in]), name
        assert not np.any(mask[surely_out]), name


# RELION's planes (healpix_sampling.cpp, removeSymmetryEquivalentPointsGeometric), as its decimals
_RELION_I = [(0, 1, 0), (-0.4999999839058737, -0.8090170074556163, 0.3090169861701543),
             (0.4999999839058737, -0.8090170074556163, 0.3090169861701543)]
_RELION_I4 = [(0, 0, 1), (0.187592467856686, -0.303530987314591, -0.491123477863004),
              (0.187592467856686, 0.303530987314591, -0.491123477863004)]


def _plane_margins(d, normals, tilt_deg=0.0, sign=1.0):
    a = euler_to_matrix(0.0, tilt_deg, 0.0)
    return np.stack([sign * d @ (a @ _unit(v)) for v in normals], axis=1)


def _relion_unit(d, name, margin_deg):
    """(surely inside, surely outside) RELION's unit of `name`, margin_deg away from its borders."""
    rot, tilt = _rot_tilt(d)
    m = margin_deg
    s = np.sin(np.radians(m))
    if name in ("D3", "D5", "D7"):
        k = int(name[1])
        lo, hi = 90 - 180 / k, 90 + 180 / k
        return ((rot > lo + m) & (rot < hi - m) & (tilt < 90 - m), (rot < lo - m) | (rot > hi + m) | (tilt > 90 + m))
    if name == "T":
        planes = _plane_margins(d, [(-0.942809, 0, 0), (0.471405, 0.272165, 0.7698), (0.471404, 0.816497, 0)])
        ranged, out_range = (rot > 90 + m) & (rot < 150 - m), (rot < 90 - m) | (rot > 150 + m)
    elif name == "O":
        planes = _plane_margins(d, [(0, -1, 1), (1, 1, 0), (-1, 1, 0)])
        ranged = (rot > 45 + m) & (rot < 135 - m) & (tilt < 90 - m)
        out_range = (rot < 45 - m) | (rot > 135 + m) | (tilt > 90 + m)
    else:
        tilt_of = {"I": 0.0, "I1": 90.0, "I3": 31.7174745559, "I4": -31.7174745559}[name]
        planes = (_plane_margins(d, _RELION_I4, tilt_of, -1.0) if name == "I4"
                  else _plane_margins(d, _RELION_I, tilt_of))
        ranged, out_range = np.ones(len(d), bool), np.zeros(len(d), bool)
    return ranged & np.all(planes > s, axis=1), out_range | np.any(planes < -s, axis=1)


@pytest.mark.parametrize("name", ["D3", "D5", "D7", "T", "O", "I", "I1", "I3", "I4"])
def test_asymmetric_units_of_odd_dihedral_and_platonic_groups_are_relions(name):
    d = _random_directions(20000, 7)
    surely_in, surely_out = _relion_unit(d, name, 0.5)
    assert surely_in.sum() > 0.5 * len(d) / symmetry_group(name).order
    mask = asymmetric_unit_mask(d, symmetry_group(name))
    assert np.all(mask[surely_in]), name
    assert not np.any(mask[surely_out]), name


def test_asymmetric_unit_of_relions_groups_whose_region_is_not_one():
    # RELION's D3H region (90 <= rot <= 150) crosses the mirror plane at rot = 120: it is no unit of D3H
    # (nor D1V's and D1H's); the Dirichlet cell used instead still has one image of every direction
    for name in ("D3H", "D5H", "D1V", "D1H"):
        g = symmetry_group(name)
        d = _random_directions(500, 8)
        images = np.einsum("gij,nj->ngi", g.matrices, d)
        inside = asymmetric_unit_mask(images.reshape(-1, 3), g).reshape(len(d), g.order)
        assert np.all(inside.sum(axis=1) == 1), name


def test_equivalent_poses_give_identical_projections_of_a_symmetric_map():
    g = symmetry_group("D3")
    rng = np.random.default_rng(4)
    centres = rng.normal(size=(3, 3)) * 5

    def sym_map(x):  # symmetric by construction: sum over the group of blobs at R^T c
        out = 0.0
        for r in g.matrices:
            for c in centres:
                out = out + np.exp(-np.sum((x - r.T @ c) ** 2, axis=-1) / 8.0)
        return out

    a = euler_to_matrix(30.0, 70.0, -20.0)
    p = rng.normal(size=(50, 3)) * 4  # image-frame points (x, y, z)
    ref = sym_map(p @ a)  # V(Aᵀ p)
    poses = equivalent_pose_matrices(a, g)
    assert poses.shape == (6, 3, 3)
    for b in poses:
        assert np.allclose(sym_map(p @ b), ref)
        assert angular_distance_deg(a, b, g) < 1e-6
    assert angular_distance_deg(a, poses[1]) > 1.0
    assert abs(angular_distance_deg(a, a @ euler_to_matrix(0, 0, 10.0)) - 10.0) < 1e-6


# ---------------------------------------------------------------- symmetrising maps

def _blob_volume(n, centres, sigma):
    c = n // 2
    ax = np.arange(n) - c
    z, y, x = np.meshgrid(ax, ax, ax, indexing="ij")
    v = np.zeros((n, n, n))
    for cx, cy, cz in centres:
        v += np.exp(-((x - cx) ** 2 + (y - cy) ** 2 + (z - cz) ** 2) / (2 * sigma ** 2))
    return v


def _analytic_symmetrised(n, centres, sigma, group):
    # mean over R of V(R x); a blob at c seen through R is a blob at Rᵀ c
    return np.mean([_blob_volume(n, centres @ r, sigma) for r in group.matrices], axis=0)


@pytest.fixture(scope="module")
def blobs():
    rng = np.random.default_rng(5)
    return rng.uniform(-7, 7, size=(3, 3)), 2.5


@pytest.mark.parametrize("name, tol", [("C4", 1e-9), ("D2", 1e-9), ("O", 1e-9), ("C5", 0.03), ("D3V", 0.03),
                                       ("I", 0.03), ("TD", 0.03)])
def test_symmetrise_volume_matches_analytic(blobs, name, tol):
    centres, sigma = blobs
    n = 33
    g = symmetry_group(name)
    v = _blob_volume(n, centres, sigma)
    exact = _analytic_symmetrised(n, centres, sigma, g)
    out = symmetrise_volume(v, g)
    assert out.shape == v.shape
    assert np.max(np.abs(out - exact)) < tol * exact.max()


def _apply_integer_op(vol, r):
    """vol sampled at R x for an integer matrix R, odd box (N//2 symmetric range)."""
    n = vol.shape[0]
    c = n // 2
    ax = np.arange(n) - c
    z, y, x = np.meshgrid(ax, ax, ax, indexing="ij")
    src = np.einsum("ij,jzyx->izyx", r.astype(int), np.stack([x, y, z])) + c
    return vol[src[2], src[1], src[0]]


@pytest.mark.parametrize("name", ["C4", "D2", "O", "D4H"])
def test_symmetrise_random_volume_is_invariant_and_idempotent(name):
    g = symmetry_group(name)
    vol = np.random.default_rng(6).normal(size=(17, 17, 17))
    s = symmetrise_volume(vol, g)
    for r in g.matrices:  # every operator of these groups permutes voxels
        assert np.allclose(_apply_integer_op(s, np.rint(r)), s, atol=1e-12)
    assert np.allclose(symmetrise_volume(s, g), s, atol=1e-12)
    assert not np.allclose(s, vol)


def test_symmetrise_smooth_volume_idempotent_for_icosahedral(blobs):
    centres, sigma = blobs
    g = symmetry_group("I3")
    v = _blob_volume(33, centres, sigma)
    s = symmetrise_volume(v, g)
    s2 = symmetrise_volume(s, g)
    assert np.max(np.abs(s2 - s)) < 0.03 * s.max()
    assert np.max(np.abs(s - v)) > 0.3 * v.max()


# Odd boxes: operators that permute voxels are exact up to the coefficients beyond r_max
# (the blob tails at the box edge leak a little there). Otherwise a 2x padded box, as the
# back-projector's arrays are, keeps Fourier-space trilinear interpolation accurate.
@pytest.mark.parametrize("name, big, tol", [("C4", 33, 2e-4), ("D2", 33, 2e-4), ("C5", 64, 0.06), ("I", 48, 0.06)])
def test_symmetrise_half_transform_matches_analytic(blobs, name, big, tol):
    centres, sigma = blobs
    g = symmetry_group(name)
    v = _blob_volume(big, centres, sigma)
    ft = rfft3_centered(v)
    avg = symmetrise_half_transform(ft, g, average=True)
    out = irfft3_centered(avg, big)
    exact = _analytic_symmetrised(big, centres, sigma, g)
    assert np.max(np.abs(out - exact)) < tol * exact.max()
    # default (RELION's) sum: the order times the average inside r_max, unchanged outside
    summed = symmetrise_half_transform(ft, g)
    kz = np.fft.fftfreq(big, 1.0 / big)
    kx = np.arange(big // 2 + 1)
    r = np.sqrt(kz[:, None, None] ** 2 + kz[None, :, None] ** 2 + kx[None, None, :] ** 2)
    inside = r <= big // 2 - 1
    assert np.allclose(summed[inside], g.order * avg[inside])
    assert np.array_equal(summed[~inside], ft[~inside])


def test_symmetrise_half_transform_real_weights():
    g = symmetry_group("C4")
    w = np.abs(rfft3_centered(np.random.default_rng(7).normal(size=(16, 16, 16)))) ** 2
    out = symmetrise_half_transform(w, g, average=True)
    assert out.dtype == np.float64
    # a 90 degree rotation about z maps integer frequencies onto each other: the average of
    # the 4 rotated copies at (kx, ky, kz) = (3, 1, 2)
    def val(kx, ky, kz):
        if kx < 0:
            kx, ky, kz = -kx, -ky, -kz
        return w[kz % 16, ky % 16, kx]
    expected = np.mean([val(3, 1, 2), val(-1, 3, 2), val(-3, -1, 2), val(1, -3, 2)])
    assert np.isclose(out[2, 1, 3], expected)


# ------------------------------------------------------- symmetrising back-projected sums (M-step)

def _one_view_sums(n, group_poses, seed=11):
    """(slice, pose A) of a random map, and a BackProjector with that slice back-projected at each pose."""
    from cryorefine.core.projector import BackProjector, Projector

    rng = np.random.default_rng(seed)
    a = euler_to_matrix(np.array([30.0]), np.array([50.0]), np.array([10.0]))
    slices = Projector(rng.normal(size=(n, n, n)), 2.0).project(a)
    bp = BackProjector(n, 2.0)
    for r in group_poses:
        bp.backproject(slices, None, a @ r.T)
    return bp


@pytest.mark.parametrize("name", ["C4", "D2", "O"])
def test_symmetrised_sums_of_one_view_equal_the_sums_of_its_equivalent_views(name):
    # These groups map the padded grid onto itself, so RELION's interpolation in applyPointGroupSymmetry is exact:
    # symmetrising the sums of one view gives the sums of the view back-projected at every equivalent pose A·Rᵀ.
    from cryorefine.core.reconstruct import enforce_hermitian_symmetry

    g = symmetry_group(name)
    one = _one_view_sums(24, [np.eye(3)])
    every = _one_view_sums(24, g.rotations)
    one.symmetrise(g)
    data, weight = enforce_hermitian_symmetry(every.data, every.weight)
    inside = one.grid.radius2(np) <= one.grid.r_max_padded ** 2  # RELION symmetrises within r_max only
    assert np.abs(weight[inside]).max() > 0
    np.testing.assert_allclose(one.weight[inside], weight[inside], atol=1e-12 * weight.max())
    np.testing.assert_allclose(one.data[inside], data[inside], atol=1e-12 * np.abs(data).max())
    assert one.hermitian_enforced


@pytest.mark.parametrize("name", ["C5", "D3", "I"])
def test_symmetrised_sums_of_other_groups_reconstruct_what_all_equivalent_views_do(name):
    # Off the grid the sums are interpolated (as in RELION); the maps still agree closely, even from three views
    # (of which the unsymmetrised map is a poor one).
    from cryorefine.core.projector import BackProjector, Projector

    g = symmetry_group(name)
    n = 24
    rng = np.random.default_rng(3)
    vol = symmetrise_volume(_blob_volume(n, rng.uniform(-6, 6, size=(4, 3)), 1.5), g)
    poses = euler_to_matrix(rng.uniform(-180, 180, 3), np.degrees(np.arccos(rng.uniform(-1, 1, 3))),
                            rng.uniform(-180, 180, 3))
    slices = Projector(vol, 2.0).project(poses)
    sym, every, plain = BackProjector(n, 2.0), BackProjector(n, 2.0), BackProjector(n, 2.0)
    sym.backproject(slices, None, poses)
    plain.backproject(slices, None, poses)
    sym.symmetrise(g)
    for r in g.rotations:
        every.backproject(slices, None, poses @ r.T)
    a, b, c = sym.reconstruct(), every.reconstruct(), plain.reconstruct()
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert corr > 0.985, corr
    assert np.corrcoef(c.ravel(), b.ravel())[0, 1] < 0.95


def test_reconstruction_from_symmetrised_sums_is_symmetric():
    # Random sums, symmetrised with O (which permutes voxels): the map is invariant under every operator of O.
    from cryorefine.core.projector import BackProjector

    g = symmetry_group("O")
    rng = np.random.default_rng(9)
    bp = BackProjector(20, 2.0)
    bp.data[...] = rng.normal(size=bp.data.shape) + 1j * rng.normal(size=bp.data.shape)
    bp.weight[...] = rng.uniform(0.5, 1.5, size=bp.weight.shape)
    c1 = bp.reconstruct()
    bp.symmetrise(g)
    vol = bp.reconstruct()
    inner = (slice(1, None),) * 3  # index 0 of an even box has no mirror image in the box
    err = np.abs(symmetrise_volume(vol, g) - vol)[inner].max() / np.abs(vol).max()
    assert err < 1e-10, err
    assert np.abs(symmetrise_volume(c1, g) - c1)[inner].max() / np.abs(c1).max() > 0.1  # not so without


def test_symmetrise_padded_sums_keeps_what_lies_beyond_the_radius_and_c1():
    from cryorefine.core.projector import BackProjector
    from cryorefine.core.symmetry import symmetrise_padded_sums

    rng = np.random.default_rng(2)
    bp = BackProjector(16, 2.0)
    bp.data[...] = rng.normal(size=bp.data.shape) + 1j * rng.normal(size=bp.data.shape)
    bp.weight[...] = rng.random(bp.weight.shape)
    radius = bp.grid.r_max_padded - 4
    data, weight = symmetrise_padded_sums(bp.data, bp.weight, symmetry_group("C3"), radius)
    outside = bp.grid.radius2(np) > radius ** 2
    assert np.array_equal(data[outside], bp.data[outside]) and np.array_equal(weight[outside], bp.weight[outside])
    assert not np.allclose(weight[~outside], bp.weight[~outside])
    data, weight = symmetrise_padded_sums(bp.data, bp.weight, symmetry_group("C1"), radius)
    assert np.array_equal(data, bp.data) and np.array_equal(weight, bp.weight)
    with pytest.raises(ValueError):
        symmetrise_padded_sums(bp.data, bp.weight[:-1], symmetry_group("C3"), radius)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["C4", "D3", "I"])
def test_symmetrise_padded_sums_on_the_device_matches_the_host(name):
    from conftest import cupy_or_skip

    from cryorefine.core.projector import BackProjector
    from cryorefine.core.symmetry import symmetrise_padded_sums

    cp = cupy_or_skip()
    rng = np.random.default_rng(12)
    bp = BackProjector(28, 2.0)
    data = rng.normal(size=bp.data.shape) + 1j * rng.normal(size=bp.data.shape)
    weight = rng.random(bp.weight.shape)
    g = symmetry_group(name)
    want = symmetrise_padded_sums(data, weight, g, bp.grid.r_max_padded)
    got = symmetrise_padded_sums(cp.asarray(data), cp.asarray(weight), g, bp.grid.r_max_padded, xp=cp,
                                 chunk_coeffs=1 << 14)  # several slabs
    for a, b in zip(got, want):
        err = np.abs(cp.asnumpy(a) - b).max() / np.abs(b).max()
        print(f"{name}: max error relative to the largest value {err:.2e}")
        assert err < 1e-12

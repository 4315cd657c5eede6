"""RELION's HEALPix / psi / translation sampling, oversampling children, local searches."""

from pathlib import Path

import healpy
import numpy as np
import pytest

from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.sampling import (
    LocalOrientations,
    Sampling,
    directions_to_xyz,
    next_perturbation,
    offset_log_prior,
)
from cryorefine.core.symmetry import asymmetric_unit_mask, symmetry_group

RELION_OUTPUTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "real" / "relion_outputs"


def _angle_deg(a, b):
    """Angle between unit vectors (..., 3)."""
    return np.degrees(np.arccos(np.clip(np.sum(a * b, axis=-1), -1.0, 1.0)))


def test_counts_order_2_and_3():
    s2 = Sampling(healpix_order=2, offset_range_px=5, offset_step_px=2)
    assert (s2.n_directions, s2.n_psi, s2.n_orientations) == (192, 24, 4608)
    assert s2.psi_step_deg == 15.0
    assert s2.n_translations == 21
    assert s2.n_coarse_samples == 4608 * 21
    s3 = s2.with_healpix_order(3)
    assert (s3.n_directions, s3.n_psi, s3.n_orientations) == (768, 48, 36864)
    assert s3.psi_step_deg == 7.5
    assert s2.directions_deg().shape == (192, 2)
    rot, tilt, psi = s3.orientations_deg()
    assert rot.shape == tilt.shape == psi.shape == (36864,)


def test_reported_angular_and_offset_sampling():
    s = Sampling(2, 5, 2, oversampling=1)
    assert s.angular_sampling_deg() == 7.5  # 360 / (6 * 2^(2+1))
    assert s.angular_sampling_deg(0) == 15.0
    assert Sampling(4, 5, 2, oversampling=2).angular_sampling_deg() == 360 / (6 * 64)
    assert s.offset_sampling_px() == 1.0
    assert (s.n_fine_orientations(), s.n_fine_translations()) == (8, 4)
    assert (s.n_fine_orientations(2), s.n_fine_translations(2)) == (64, 16)


def test_psi_rounding_like_relion():
    # RELION: nr_psi = ceil(360 / psi_step), psi_step = 360 / nr_psi, first psi at 0
    s = Sampling(2, 5, 2, psi_step_deg=7.0)
    assert s.n_psi == 52 and np.isclose(s.psi_step_deg, 360 / 52)
    psi = s.psi_deg()
    assert psi[0] == 0.0 and np.allclose(np.diff(psi), 360 / 52)


def _read_relion_directions(path):
    rows, in_loop = [], False
    for line in path.read_text().splitlines():
        if line.startswith("data_sampling_directions"):
            in_loop = True
            continue
        if in_loop:
            parts = line.split()
            if len(parts) == 2 and not parts[0].startswith("_"):
                rows.append([float(parts[0]), float(parts[1])])
    return np.array(rows)


@pytest.mark.parametrize("fname", ["run_it025_sampling_3D.star", "ref_it002_sampling.star"])
def test_directions_match_relion_sampling_star(fname):
    path = RELION_OUTPUTS / fname
    if not path.exists():
        pytest.skip(f"{path} not available")
    relion = _read_relion_directions(path)
    assert relion.shape == (192, 2)
    ours = Sampling(2, 5, 2).directions_deg()
    assert np.allclose(ours, relion, atol=2e-5)


def test_directions_are_unit_healpix_and_roughly_uniform():
    s = Sampling(3, 5, 2)
    d = s.direction_vectors()
    assert np.allclose(np.linalg.norm(d, axis=1), 1.0)
    rot, tilt = s.directions_deg().T
    assert np.all((rot >= -180) & (rot <= 180)) and np.all((tilt >= 0) & (tilt <= 180))
    # rot = phi, tilt = theta of the NEST pixel centres
    pix = healpy.ang2pix(8, np.radians(tilt), np.radians(rot), nest=True)
    assert np.array_equal(pix, np.arange(768))
    # nearest-neighbour spacing close to the nominal 7.5 degrees, and no clumps
    ang = _angle_deg(d[:, None, :], d[None, :, :])
    np.fill_diagonal(ang, 1e9)
    nn = ang.min(axis=1)
    assert 0.8 * 7.5 < nn.mean() < 1.2 * 7.5
    assert nn.min() > 0.6 * 7.5
    # balanced: the mean direction is near zero
    assert np.linalg.norm(d.mean(axis=0)) < 1e-6


def test_orientation_ordering():
    s = Sampling(1, 3, 1)
    rot, tilt, psi = s.orientations_deg()
    dirs, psis = s.directions_deg(), s.psi_deg()
    o = np.array([0, 1, s.n_psi - 1, s.n_psi, 7 * s.n_psi + 5, s.n_orientations - 1])
    assert np.allclose(rot[o], dirs[o // s.n_psi, 0])
    assert np.allclose(tilt[o], dirs[o // s.n_psi, 1])
    assert np.allclose(psi[o], psis[o % s.n_psi])
    idir, ipsi = s.split_orientation_index(o)
    assert np.array_equal(idir * s.n_psi + ipsi, o)
    m = s.orientation_matrices()
    assert np.allclose(m[o], euler_to_matrix(rot[o], tilt[o], psi[o]))


def test_translations_disc_range5_step2():
    t = Sampling(2, offset_range_px=5, offset_step_px=2).translations_px()
    assert t.shape == (21, 2)
    assert np.all(np.hypot(t[:, 0], t[:, 1]) <= 5 + 1e-9)
    # every grid point of the disc, each once
    g = np.arange(-10, 11) * 2.0
    grid = np.array([(x, y) for x in g for y in g if x * x + y * y <= 25])
    assert sorted(map(tuple, t)) == sorted(map(tuple, grid))
    # RELION's order: x outer, y inner
    assert [tuple(v) for v in t] == sorted(map(tuple, t))
    assert tuple(t[10]) == (0.0, 0.0)
    assert Sampling(2, 0, 2).n_translations == 1
    assert Sampling(2, 1, 1).n_translations == 5  # points on the circle are kept
    assert Sampling(2, 4.425, 1.77).n_translations == 21


def test_children_oversampling_1_order_and_distances():
    s = Sampling(2, 5, 2)
    coarse = np.array([0, 1, 4608 * 21 - 1, 12345])
    fs = s.fine_samples(coarse)
    assert fs.rot_deg.shape == (4, 8) and fs.translations_px.shape == (4, 4, 2)
    o, t = s.split_coarse_index(coarse)
    rot, tilt, psi = s.orientations_deg()
    trans = s.translations_px()
    for i in range(len(coarse)):
        parent = directions_to_xyz(rot[o[i]], tilt[o[i]])
        kids = directions_to_xyz(fs.rot_deg[i], fs.tilt_deg[i])
        assert np.all(_angle_deg(kids, parent) < s.angular_sampling_deg(0))
        # 4 HEALPix children in NEST order, 2 psi each
        ipix = s.direction_ipix[o[i] // s.n_psi]
        kid_pix = healpy.ang2pix(8, np.radians(fs.tilt_deg[i]), np.radians(fs.rot_deg[i]), nest=True)
        assert np.array_equal(kid_pix, np.repeat(4 * ipix + np.arange(4), 2))
        assert np.allclose(fs.psi_deg[i], psi[o[i]] + np.tile([-3.75, 3.75], 4))
        # translations (-,-), (-,+), (+,-), (+,+) times step/4
        assert np.allclose(fs.translations_px[i] - trans[t[i]], [[-0.5, -0.5], [-0.5, 0.5], [0.5, -0.5], [0.5, 0.5]])
    # flattened: fine sample f = io * 4 + it
    r, tl, p, tx, ty = s.fine_samples_flat(coarse)
    assert r.shape == (4, 32)
    f = 3 * 4 + 2
    assert np.isclose(r[1, f], fs.rot_deg[1, 3]) and np.isclose(p[1, f], fs.psi_deg[1, 3])
    assert np.isclose(tx[1, f], fs.translations_px[1, 2, 0]) and np.isclose(ty[1, f], fs.translations_px[1, 2, 1])


def test_children_cover_the_fine_grid():
    s = Sampling(2, 5, 2)
    # directions: the children of all coarse directions are all order-3 pixels, once each
    o = np.arange(s.n_directions) * s.n_psi
    rot, tilt, _ = s.fine_orientations_deg(o)
    pix = healpy.ang2pix(8, np.radians(tilt[:, ::2]), np.radians(rot[:, ::2]), nest=True)
    assert np.array_equal(np.sort(pix.ravel()), np.arange(768))
    # psi: children of all coarse psi form a uniform grid with half the step
    _, _, psi = s.fine_orientations_deg(np.arange(s.n_psi))
    fine = np.sort(psi[:, :2].ravel() % 360)
    assert len(fine) == 48 and np.allclose(np.diff(fine), 7.5)
    # translations: children at distance step*sqrt(2)/4, forming the half-step grid
    t = s.fine_translations_px(np.arange(s.n_translations))
    d = t - s.translations_px()[:, None, :]
    assert np.allclose(np.hypot(d[..., 0], d[..., 1]), np.sqrt(2) / 2)
    flat = t.reshape(-1, 2)
    assert len({tuple(np.round(v, 9)) for v in flat}) == 84
    assert np.allclose(np.round(flat - 0.5), flat - 0.5)


def test_children_oversampling_2_follow_relion_loop_order():
    s = Sampling(1, 2, 2, oversampling=2)
    o = np.array([5 * s.n_psi + 3, 40 * s.n_psi])
    rot, tilt, psi = s.fine_orientations_deg(o)
    assert rot.shape == (2, 64)
    for i in range(2):
        ipix = s.direction_ipix[o[i] // s.n_psi]
        # RELION's getOrientations: fine HEALPix (x, y, face) with y outer and x inner
        x, y, face = healpy.pix2xyf(2, int(ipix), nest=True)
        expected = [healpy.xyf2pix(8, 4 * x + a, 4 * y + b, face, nest=True) for b in range(4) for a in range(4)]
        got = healpy.ang2pix(8, np.radians(tilt[i, ::4]), np.radians(rot[i, ::4]), nest=True)
        assert np.array_equal(got, expected)
        step = s.psi_step_deg
        base = (o[i] % s.n_psi) * step
        assert np.allclose(psi[i, :4], base + np.array([-3, -1, 1, 3]) * step / 8)
    t = s.fine_translations_px([0])
    assert t.shape == (1, 16, 2)
    base = s.translations_px()[0]
    sub = np.array([-0.75, -0.25, 0.25, 0.75])
    assert np.allclose(t[0] - base, np.stack([np.repeat(sub, 4), np.tile(sub, 4)], axis=-1))


@pytest.mark.parametrize("name", ["C4", "D2"])
def test_asymmetric_unit_of_an_invariant_grid(name):
    g = symmetry_group(name)
    s = Sampling(2, 5, 2, symmetry=name)
    full = Sampling(2, 5, 2)
    # the order-2 HEALPix grid is mapped onto itself by these groups: exactly a quarter is kept
    assert s.n_directions == 48
    assert s.n_orientations == 48 * 24
    kept = s.direction_vectors()
    all_d = full.direction_vectors()
    outside = np.setdiff1d(np.arange(192), s.direction_ipix)
    assert len(outside) == 144
    for i in outside:
        images = np.einsum("gij,j->gi", g.matrices, all_d[i])
        # some operator maps it exactly onto a kept direction
        assert np.min(np.linalg.norm(images[:, None, :] - kept[None, :, :], axis=-1)) < 1e-9
    # no two kept directions are symmetry mates
    for j, d in enumerate(kept):
        images = np.einsum("gij,j->gi", g.matrices[1:], d)
        dist = np.linalg.norm(images[:, None, :] - kept[None, :, :], axis=-1)
        dist[:, j] = np.where(np.linalg.norm(images - d, axis=1) < 1e-9, 1.0, dist[:, j])
        assert np.all(dist > 1e-9)
    if name == "C4":  # RELION's unit: |rot| <= 45
        assert np.all(np.abs(s.directions_deg()[:, 0]) <= 45 + 1e-9)


@pytest.mark.parametrize("name, order", [("D3", 4), ("I", 4), ("O", 3), ("C7", 3)])
def test_asymmetric_unit_fraction_and_mapping(name, order):
    g = symmetry_group(name)
    s = Sampling(order, 5, 2, symmetry=name)
    n_all = 12 * 4 ** order
    assert abs(s.n_directions * g.order / n_all - 1.0) < 0.15
    # every direction outside the unit has a symmetry image inside it
    full = Sampling(order, 5, 2).direction_vectors()
    outside = np.setdiff1d(np.arange(n_all), s.direction_ipix)
    images = np.einsum("gij,nj->ngi", g.matrices, full[outside])
    inside = asymmetric_unit_mask(images.reshape(-1, 3), g).reshape(len(outside), g.order)
    assert np.all(inside.any(axis=1))
    # and every point of the sphere is near a kept direction's mate (near axes, where the unit
    # is narrower than a pixel, a little farther than one step, as with RELION's unit)
    probe = np.random.default_rng(0).normal(size=(300, 3))
    probe /= np.linalg.norm(probe, axis=1, keepdims=True)
    mates = np.einsum("gij,nj->gni", g.matrices, s.direction_vectors()).reshape(-1, 3)
    nearest = _angle_deg(probe[:, None, :], mates[None, :, :]).min(axis=1)
    assert nearest.max() < 1.5 * s.angular_sampling_deg(0)


def _brute_sym_angle(prior_rot, prior_tilt, dirs, group):
    q = directions_to_xyz(prior_rot, prior_tilt)
    best = np.full(len(dirs), 1e9)
    for r in group.matrices:
        best = np.minimum(best, _angle_deg(dirs @ r.T, q))
    return best


def _dense_local_prior(s, group, prior_rot, prior_tilt, prior_psi, sigma, sigma_psi):
    """The local prior over the whole grid, (n_dir·n_psi,), −inf outside: every direction and psi measured."""
    ang = _brute_sym_angle(prior_rot, prior_tilt, s.direction_vectors(), group)
    dpsi = np.abs((s.psi_deg() - prior_psi + 180) % 360 - 180)

    def gaussian(dist, sig):
        keep = dist < 3 * sig
        if not keep.any():
            keep = np.arange(dist.size) == np.argmin(dist)
        lp = np.where(keep, -dist ** 2 / (2 * sig ** 2), -np.inf)
        return lp - np.log(np.sum(np.exp(lp[keep])))

    return (gaussian(ang, sigma)[:, None] + gaussian(dpsi, sigma_psi)[None, :]).reshape(-1)


@pytest.mark.parametrize("name, order, sigma, sigma_psi", [("C1", 3, 4.0, 6.0), ("D2", 3, 4.0, 6.0),
                                                           ("O", 4, 3.0, 2.0), ("C1", 6, 0.94, 0.94)])
def test_local_search_keeps_exactly_the_samples_within_3_sigma(name, order, sigma, sigma_psi):
    """Each particle's orientations are those of the whole grid within 3σ (directions measured to every
    symmetry mate of the prior), with the Gaussian priors normalised over the kept ones; poles included."""
    s = Sampling(order, 5, 2, symmetry=name)
    g = symmetry_group(name)
    prior_rot = np.array([10.0, -120.0, 75.0, 33.0, -179.9])
    prior_tilt = np.array([30.0, 100.0, 170.0, 0.05, 179.99])
    prior_psi = np.array([5.0, 200.0, 359.0, -3.0, 180.0])
    local = s.local_orientations(prior_rot, prior_tilt, prior_psi, sigma, sigma_psi)
    assert local.n_particles == 5
    for b in range(5):
        want = _dense_local_prior(s, g, prior_rot[b], prior_tilt[b], prior_psi[b], sigma, sigma_psi)
        segment = slice(local.offsets[b], local.offsets[b + 1])
        got_o, got_lp = local.orientation[segment], local.log_prior[segment]
        assert np.array_equal(got_o, np.flatnonzero(np.isfinite(want)))
        assert got_o.size >= 3
        np.testing.assert_allclose(got_lp, want[got_o], rtol=1e-12, atol=1e-12)
        assert np.isclose(np.exp(got_lp).sum(), 1.0)


def test_local_search_holds_the_neighbourhood_not_the_grid():
    """At order 6 (18.9 M orientations) a particle's local search holds about 177 of them."""
    s = Sampling(6, 5, 2)
    local = s.local_orientations(np.array([10.0, 50.0]), np.array([80.0, 20.0]), np.array([0.0, 90.0]), 0.94, 0.94)
    assert s.n_orientations > 18_000_000
    assert np.all((100 < local.counts()) & (local.counts() < 300))


def test_local_search_falls_back_to_the_nearest_sample():
    s = Sampling(2, 5, 2)
    local = s.local_orientations([3.0], [47.0], [7.0], sigma_dir_deg=0.01, sigma_psi_deg=0.01)
    assert local.counts()[0] == 1 and local.log_prior[0] == 0.0
    direction, psi = divmod(int(local.orientation[0]), s.n_psi)
    ang = _angle_deg(s.direction_vectors(), directions_to_xyz(3.0, 47.0))
    assert direction == int(np.argmin(ang))
    assert psi == 0  # 7 degrees is nearest to psi 0 (step 15)
    flat = s.local_orientations([3.0], [47.0], [7.0], sigma_dir_deg=0, sigma_psi_deg=0)
    assert np.array_equal(flat.orientation, np.arange(s.n_orientations))
    np.testing.assert_allclose(flat.log_prior, -np.log(s.n_orientations))


def test_orientations_of_an_index_are_those_of_the_grid():
    s = Sampling(2, 3, 1.5, perturbation=0.3)
    pick = np.array([5, 0, 700, 5])
    np.testing.assert_allclose(s.orientation_matrices(index=pick), s.orientation_matrices()[pick], atol=1e-12)
    # gathered from a direction table the caller keeps (on the device in the GPU engine; numpy's here)
    table = s.directions_deg()
    np.testing.assert_allclose(s.orientation_matrices(index=pick, directions_deg=table),
                               s.orientation_matrices()[pick], atol=1e-12)
    np.testing.assert_allclose(s.orientation_matrices(index=pick.reshape(2, 2), directions_deg=table),
                               s.orientation_matrices()[pick], atol=1e-12)


def test_offset_log_prior():
    t = Sampling(2, 5, 2).translations_px()
    old = np.array([[1.0, -2.0], [0.0, 0.0]])
    lp = offset_log_prior(t, old, sigma_offset_px=3.0)
    assert lp.shape == (2, 21)
    d2 = np.sum((old[0] + t) ** 2, axis=1)
    assert np.allclose(lp[0], -d2 / 18.0)
    lp2 = offset_log_prior(t, old, 3.0, prior_offset_px=np.array([[1.0, -2.0], [2.0, 2.0]]))
    assert np.allclose(lp2[0], -np.sum(t ** 2, axis=1) / 18.0)
    delta = offset_log_prior(t, old[1:], 0.0)
    assert np.isfinite(delta).sum() == 1 and delta[0, 10] == 0.0


def test_perturbation_rotates_orientations_and_shifts_translations():
    p = 0.3
    s0 = Sampling(1, 3, 1.5)
    s = Sampling(1, 3, 1.5, perturbation=p)
    a = p * s.angular_sampling_deg(0)
    m0 = s0.orientation_matrices()
    m = s.orientation_matrices()
    assert np.allclose(m, m0 @ euler_to_matrix(a, a, a), atol=1e-9)
    assert np.allclose(s.translations_px(), s0.translations_px() + p * 1.5)
    fo = s.fine_orientations_deg([3])
    fo0 = s0.fine_orientations_deg([3])
    assert np.allclose(euler_to_matrix(*fo), euler_to_matrix(*fo0) @ euler_to_matrix(a, a, a), atol=1e-9)
    assert np.allclose(s.fine_translations_px([2]), s0.fine_translations_px([2]) + p * 1.5)
    rng = np.random.default_rng(1)
    cur = 0.0
    seen = []
    for _ in range(200):
        new = next_perturbation(cur, 0.5, rng)
        assert -0.5 <= new < 0.5
        step = (new - cur) % 1.0
        assert 0.25 - 1e-12 <= step <= 0.5 + 1e-12
        seen.append(new)
        cur = new
    assert np.std(seen) > 0.1
    assert next_perturbation(0.2, 0.0, rng) == 0.0


def test_invalid_settings_raise():
    with pytest.raises(ValueError):
        Sampling(-1, 5, 2)
    with pytest.raises(ValueError):
        Sampling(2, 5, 0)
    with pytest.raises(ValueError, match="Q7"):
        Sampling(2, 5, 2, symmetry="Q7")


def test_local_orientations_split_and_pad_by_particle():
    s = Sampling(3, 5, 2)
    local = s.local_orientations(np.array([10.0, 50.0, -90.0]), np.array([80.0, 20.0, 120.0]),
                                 np.array([0.0, 90.0, 200.0]), 4.0, 100.0)  # psi: every angle
    counts = local.counts()
    orientation, log_prior = local.padded()
    assert orientation.shape == (3, counts.max())
    for b in range(3):
        segment = slice(local.offsets[b], local.offsets[b + 1])
        assert np.array_equal(orientation[b, :counts[b]], local.orientation[segment])
        assert np.all(np.isneginf(log_prior[b, counts[b]:])) and np.all(np.isfinite(log_prior[b, :counts[b]]))
        assert np.all(np.diff(local.orientation[segment]) > 0)  # increasing within a particle
    tail = local.rows(1, 3)
    assert tail.n_particles == 2 and np.array_equal(tail.counts(), counts[1:])
    np.testing.assert_array_equal(tail.orientation, local.orientation[local.offsets[1]:])


def test_padded_local_orientations_keep_each_particle_in_its_row_when_some_have_none():
    offsets = np.array([0, 0, 3, 3, 4, 4])  # particles 0, 2 and 4 without orientations
    local = LocalOrientations(offsets, np.array([7, 9, 30, 2]), np.array([-1.0, -2.0, -3.0, -4.0]))
    orientation, log_prior = local.padded(width=4)
    np.testing.assert_array_equal(orientation, [[0] * 4, [7, 9, 30, 0], [0] * 4, [2, 0, 0, 0], [0] * 4])
    expected = np.full((5, 4), -np.inf)
    expected[1, :3] = [-1.0, -2.0, -3.0]
    expected[3, 0] = -4.0
    np.testing.assert_array_equal(log_prior, expected)


# 3σ just inside half a pixel of order N − 2 (healpy.nside2resol): the widest disc whose candidates come from
# blocks of 9 pixels of that order, the tightest case of the neighbourhood search
_EDGE_SIGMA_DEG = 0.999 * 0.5 * 58.6323 / 2 ** 3 / 3


@pytest.mark.parametrize("name, order, sigma, n", [
    ("C1", 1, 15.0, 40), ("C1", 4, 3.75, 40), ("C1", 7, 0.47, 40), ("C1", 8, 0.23, 40), ("C1", 5, 40.0, 40),
    ("I", 3, 7.5, 40), ("D7", 4, 3.75, 40), ("C4", 2, 0.5, 40), ("C1", 5, _EDGE_SIGMA_DEG, 400),
    ("C1", 6, _EDGE_SIGMA_DEG / 2, 200)])
def test_local_directions_of_random_priors_are_those_of_the_whole_grid(name, order, sigma, n):
    """Random priors (poles and the asymmetric units' edges included by chance), at the schedule's
    σ = 2 oversampled steps, beyond it and at the edge of the candidate blocks, wide and narrow: the directions
    kept are those the whole grid holds within 3σ of a mate of the prior (or the nearest alone)."""
    s = Sampling(order, 5, 2, symmetry=name)
    g = symmetry_group(name)
    rng = np.random.default_rng(order)
    v = rng.normal(size=(n, 3))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    prior_tilt = np.degrees(np.arccos(v[:, 2]))
    prior_rot = np.degrees(np.arctan2(v[:, 1], v[:, 0]))
    prior_psi = np.zeros(n)
    local = s.local_orientations(prior_rot, prior_tilt, prior_psi, sigma, 360.0)  # psi: every angle
    for b in range(n):
        ang = _brute_sym_angle(prior_rot[b], prior_tilt[b], s.direction_vectors(), g)
        keep = ang < 3 * sigma
        if not keep.any():
            keep = np.arange(ang.size) == np.argmin(ang)
        segment = slice(local.offsets[b], local.offsets[b + 1])
        got_dirs = np.unique(local.orientation[segment] // s.n_psi)
        assert np.array_equal(got_dirs, np.flatnonzero(keep)), b


def test_healpix_pixels_find_the_pixels_of_their_centres():
    """`healpix_pixels` inverts `healpix_angles_deg` at pixel centres, also for tilts and rots given outside
    [0, 180] and [−180, 180] (the same directions)."""
    from cryorefine.core.sampling import healpix_angles_deg, healpix_pixels

    pix = np.arange(12 * 4 ** 3)
    rot, tilt = healpix_angles_deg(3, pix)
    np.testing.assert_array_equal(healpix_pixels(3, rot, tilt), pix)
    np.testing.assert_array_equal(healpix_pixels(3, rot + 720.0, tilt), pix)
    np.testing.assert_array_equal(healpix_pixels(3, rot + 180.0, -tilt), pix)  # (rot + 180, −tilt): the same axis


def test_iterations_at_one_order_share_the_direction_tables():
    """Every iteration has a Sampling of its own (its perturbation); the direction tables of an order and group are
    made once and shared (at order 8 they take about a tenth of a second to make), read-only, and another group or
    order gets its own."""
    a = Sampling(healpix_order=3, offset_range_px=5, offset_step_px=2, perturbation=0.1)
    b = Sampling(healpix_order=3, offset_range_px=3, offset_step_px=1, perturbation=0.4)
    assert a.direction_ipix is b.direction_ipix
    assert a.directions_deg() is b.directions_deg()
    d2 = Sampling(healpix_order=3, offset_range_px=5, offset_step_px=2, symmetry="D2")
    assert d2.direction_ipix is not a.direction_ipix and d2.n_directions < a.n_directions
    assert a.with_healpix_order(2).direction_ipix is not a.direction_ipix
    with pytest.raises(ValueError):
        a.direction_ipix[0] = 1


@pytest.mark.parametrize("perturbation", [0.0, 0.3, -0.41])
@pytest.mark.parametrize("oversampling", [0, 1, 2])
@pytest.mark.parametrize("symmetry", ["C1", "D2"])
def test_fine_orientation_matrices_are_the_euler_matrices_of_their_angles(perturbation, oversampling, symmetry):
    s = Sampling(2, 5, 2, symmetry=symmetry, oversampling=oversampling, perturbation=perturbation)
    index = np.r_[np.arange(0, s.n_orientations, 5), 3, 3]  # a repeated orientation as well
    rot, tilt, psi, matrices = s.fine_orientations(index)
    assert matrices.shape == (index.size, 8 ** oversampling, 3, 3)
    np.testing.assert_allclose(matrices, euler_to_matrix(rot, tilt, psi), atol=1e-12)
    for mine, theirs in zip((rot, tilt, psi), s.fine_orientations_deg(index)):
        np.testing.assert_array_equal(mine, theirs)


def test_in_plane_fine_orientation_matrices_turn_psi_alone():
    s = Sampling(0, 5, 2, oversampling=1, perturbation=0.2, in_plane=True, psi_step_deg=6)
    rot, tilt, psi, matrices = s.fine_orientations(np.arange(s.n_orientations))
    assert np.all(rot == 0) and np.all(tilt == 0)
    np.testing.assert_allclose(matrices, euler_to_matrix(rot, tilt, psi), atol=1e-12)

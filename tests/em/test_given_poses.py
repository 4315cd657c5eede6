"""--skip_align's sampling: each particle of a unit keeps its own pose; the numpy engine only picks classes."""

import numpy as np
import pytest

from cryorefine.core import fourier
from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.projector import Projector
from cryorefine.em.given_poses import GivenPoses
from cryorefine.estep.engine import Batch, IterationSetup
from cryorefine.estep.reference import NumpyEngine


def random_poses(rng, n):
    return rng.uniform(-180, 180, n), rng.uniform(0, 180, n), rng.uniform(-180, 180, n)


def test_each_particle_finds_its_own_pose_among_the_units():
    rng = np.random.default_rng(0)
    rot, tilt, psi = random_poses(rng, 50)
    members = rng.permutation(50)[:30]
    poses = GivenPoses.of(rot, tilt, psi, members)
    assert poses.n_orientations == 30 and poses.n_directions == 1 and poses.n_translations == 1
    pick = members[[4, 0, 29, 4]]
    assert np.array_equal(poses.index_of(rot[pick], tilt[pick], psi[pick]), [4, 0, 29, 4])
    local = poses.local_orientations(rot[pick], tilt[pick], psi[pick])
    assert np.array_equal(local.counts(), [1, 1, 1, 1])
    assert np.array_equal(local.orientation, [4, 0, 29, 4]) and np.all(local.log_prior == 0)
    # a pose that is not exactly in the table: the nearest orientation (here one nudged by 0.01°)
    assert poses.index_of(rot[pick[:1]] + 0.01, tilt[pick[:1]], psi[pick[:1]])[0] == 4
    # children are the orientations themselves
    r, t, p = poses.fine_orientations_deg(np.array([3]))
    assert (r[0, 0], t[0, 0], p[0, 0]) == (rot[members[3]], tilt[members[3]], psi[members[3]])
    assert np.allclose(poses.orientation_matrices()[3], euler_to_matrix(rot[members[3]], tilt[members[3]],
                                                                          psi[members[3]]))


def test_the_poses_take_the_grid_samplings_call_for_matrices():
    """The GPU engine asks a local search's sampling for matrices with its device table of directions
    (`Sampling.orientation_matrices(xp, index, directions_deg)`); --skip_align's poses stand in for a Sampling
    there, so they take the same call and give their own poses' matrices."""
    rng = np.random.default_rng(1)
    rot, tilt, psi = random_poses(rng, 12)
    poses = GivenPoses.of(rot, tilt, psi, np.arange(12))
    index = np.array([[7, 2], [2, 11]])
    got = poses.orientation_matrices(np, index.reshape(-1), poses.directions_deg(np))
    assert np.allclose(got, euler_to_matrix(rot[[7, 2, 2, 11]], tilt[[7, 2, 2, 11]], psi[[7, 2, 2, 11]]))


def test_the_numpy_engine_keeps_poses_and_origins_and_picks_the_class():
    """Noise-free projections of two different maps at random poses and sub-pixel origins: with GivenPoses the
    engine returns each particle's own pose and origin, and the class of the map it came from."""
    n = 24
    rng = np.random.default_rng(1)
    maps = [fourier.irfft3_centered(fourier.rfft3_centered(rng.standard_normal((n,) * 3))
                                    * (fourier.radius_3d(n) < 6), n) for _ in range(2)]
    b = 12
    rot, tilt, psi = random_poses(rng, b)
    truth = rng.integers(0, 2, b)
    origin = rng.uniform(-0.4, 0.4, (b, 2))  # residual (sub-pixel) origins
    images = np.empty((b, n, n // 2 + 1), complex)
    mats = euler_to_matrix(rot, tilt, psi)
    for k in (0, 1):
        sel = np.flatnonzero(truth == k)
        proj = Projector(maps[k], 2.0, n // 2).project(mats[sel], n)
        # the particle's centre sits at N//2 − origin: the shift by +origin centres it (see estep.engine)
        ky, kx = fourier.frequencies_2d(n)
        phase = np.exp(2j * np.pi * (kx[None] * origin[sel, 0, None, None] + ky[None] * origin[sel, 1, None, None])
                       / n)
        images[sel] = proj * phase
    poses = GivenPoses.of(rot, tilt, psi, np.arange(b))
    setup = IterationSetup(projectors=None, maps=maps, sigma2_noise=np.full((1, n // 2 + 1), 1e-3), sampling=poses,
                           ori_size_px=n, current_size_px=n, coarse_size_px=n, pixel_size_angstrom=4.0,
                           log_pdf_class=np.log([0.5, 0.5]), local_searches=True)
    engine = NumpyEngine()
    engine.setup(setup)
    batch = Batch(indices=np.arange(b), images_ft=images, images_ft_unmasked=images, ctf=np.ones(images.shape, float),
                  optics_index=np.zeros(b, int), old_origin_px=origin, residual_origin_px=origin, prior_rot_deg=rot,
                  prior_tilt_deg=tilt, prior_psi_deg=psi, old_class=np.zeros(b, int), norm_correction=np.ones(b),
                  power_beyond_current=np.zeros((b, n // 2 + 1)))
    result = engine.run(batch)
    assert np.array_equal(result.class_index, truth)
    assert np.array_equal(result.rot_deg, rot) and np.array_equal(result.psi_deg, psi)
    assert np.allclose(result.origin_x_px, origin[:, 0]) and np.allclose(result.origin_y_px, origin[:, 1])
    assert np.all(result.n_significant <= 2)
    assert engine.sums().pdf_direction.shape == (2, 1)
    assert engine.sums().pdf_class.sum() == pytest.approx(b)

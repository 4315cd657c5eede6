"""2D references (RELION's ref_dim 2): the projector's in-plane rotations, the back-projector as its adjoint, the
2D reconstruction, and the in-plane sampling, each against an independent computation."""

import numpy as np
import pytest

from cryorefine.core import euler, fourier
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import BackProjector, Projector, padded_references_2d
from cryorefine.core.sampling import Sampling

N = 32


def blobs():
    y, x = np.mgrid[:N, :N] - N // 2
    return np.exp(-((x - 3) ** 2 + (y + 2) ** 2) / 20.0) + 0.5 * np.exp(-((x + 5) ** 2 + (y - 4) ** 2) / 8.0)


def in_circle(n, radius):
    ky = fourier.signed_frequencies(n, np)[:, None]
    kx = np.arange(n // 2 + 1)[None, :]
    return ky * ky + kx * kx <= radius * radius


def psi_matrices(psi_deg):
    psi = np.atleast_1d(np.asarray(psi_deg, dtype=np.float64))
    return euler.euler_to_matrix(np.zeros_like(psi), np.zeros_like(psi), psi)


def test_the_unrotated_projection_of_an_image_is_its_transform():
    image = blobs()
    projection = Projector(image, 2.0, do_gridding=False).project(np.eye(3)[None], N)[0]
    expected = fourier.rfft2_centered(image)
    inside = in_circle(N, N // 2)
    assert np.abs(projection - expected)[inside].max() < 1e-12 * np.abs(expected).max() + 1e-15
    assert np.all(projection[~inside] == 0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_a_stack_of_references_is_transformed_as_each_one_alone(dtype):
    """One batched transform of three images (with gridding, r_max 10): each the Projector of that image alone;
    without gridding, each one's unrotated projection is its own transform."""
    images = np.stack([blobs(), blobs()[::-1], 0.5 * blobs().T])
    grid = PaddedGrid.create(N, 2.0, 10, ndim=2)
    stack = padded_references_2d(images, grid, dtype)
    assert stack.shape == (3,) + grid.shape
    for k in range(3):
        alone = Projector(images[k], 2.0, 10, dtype=dtype).data
        assert alone.dtype == stack.dtype
        assert np.array_equal(stack[k], alone), k
    plain = padded_references_2d(images, PaddedGrid.create(N, 2.0, N // 2, ndim=2), np.float64, do_gridding=False)
    inside = in_circle(N, N // 2)
    for k in range(3):
        projection = Projector.from_transform(plain[k], PaddedGrid.create(N, 2.0, N // 2, ndim=2)).project(
            np.eye(3)[None], N)[0]
        expected = fourier.rfft2_centered(images[k])
        assert np.abs(projection - expected)[inside].max() < 1e-12 * np.abs(expected).max() + 1e-15


def test_a_quarter_turn_of_psi_is_the_image_turned_a_quarter():
    """psi = 90°: a grid point goes to a grid point, so the slice is exact; np.rot90 turns about (N−1)/2, the box's
    centre N//2 is one pixel off after it."""
    image = blobs()
    projection = Projector(image, 2.0, do_gridding=False).project(psi_matrices(90.0), N)[0]
    turned = np.roll(np.rot90(image, 1), 1, axis=0)
    other = np.roll(np.rot90(image, -1), 1, axis=1)
    inside = in_circle(N, N // 2 - 1)
    assert np.abs(projection - fourier.rfft2_centered(turned))[inside].max() < 1e-12
    assert np.abs(projection - fourier.rfft2_centered(other))[inside].max() > 1e-3  # the other sense is not


def test_back_projection_is_the_adjoint_of_projection_on_the_data():
    rng = np.random.default_rng(1)
    projector = Projector(rng.normal(size=(N, N)), 2.0, r_max_px=N // 2 - 2, do_gridding=False)
    mats = psi_matrices(rng.uniform(0, 360, 5))
    slices = rng.normal(size=(5, N, N // 2 + 1)) + 1j * rng.normal(size=(5, N, N // 2 + 1))
    slices[:, N // 2 + 1:, 0] = 0  # the kx = 0, ky < 0 half column back-projection leaves out
    bp = BackProjector(N, 2.0, r_max_px=N // 2 - 2, ndim=2)
    bp.backproject(slices, None, mats)
    # the mirrored points are conjugated: adjoint for the real inner product Re⟨a, b⟩
    left = np.vdot(projector.project(mats, N), slices).real
    right = np.vdot(projector.data, bp.data).real
    assert bp.data.shape == projector.data.shape == projector.grid.shape
    assert abs(left - right) < 1e-9 * abs(left)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_image_comes_back_from_its_rotated_projections(dtype):
    """As in 3D (tests/core/test_projector.py), the padded points next to the origin are estimated from samples
    further out, which leaves a slightly negative background (here about 1.5 % of the peak): the shape and the
    scale come back, the offset is not tested."""
    image = blobs()
    psi = np.arange(0.0, 360.0, 5.0)
    mats = psi_matrices(psi)
    bp = BackProjector(N, 2.0, ndim=2, dtype=dtype)
    bp.backproject(Projector(image, 2.0).project(mats, N), None, mats)
    back = bp.reconstruct()
    assert back.shape == (N, N) and back.dtype == dtype
    inner = np.hypot(*(np.mgrid[:N, :N] - N // 2)) < N // 2 - 4
    a, b = back[inner] - back[inner].mean(), image[inner] - image[inner].mean()
    assert np.corrcoef(a, b)[0, 1] > 0.9995
    assert 0.98 < (a @ b) / (b @ b) < 1.02
    assert np.abs(a - b).max() < 0.015 * image.max()


def test_the_noise_of_a_2d_reconstruction_takes_pf_squared():
    bp = BackProjector(N, 2.0, ndim=2)
    bp.weight[...] = 1.0
    sigma2 = bp.noise_sigma2()
    assert np.allclose(sigma2[1:N // 2 - 1], 1.0 / 4.0)  # count / Σ pf²·1


def test_in_plane_sampling_has_psi_alone():
    s = Sampling(0, 5.0, 2.0, psi_step_deg=12.0, oversampling=1, perturbation=0.25, in_plane=True)
    assert (s.n_directions, s.n_psi, s.n_fine_orientations(), s.n_fine_translations()) == (1, 30, 2, 4)
    assert s.angular_sampling_deg() == 6.0 and s.ref_dim == 2
    rot, tilt, psi = s.orientations_deg()
    assert np.all(rot == 0) and np.all(tilt == 0)
    assert np.all((psi > -180) & (psi <= 180))
    assert np.allclose(np.sort(psi % 360), np.arange(30) * 12.0 + 3.0)
    assert np.allclose(s.orientation_matrices(), psi_matrices(psi))
    rot, tilt, psi = s.fine_orientations_deg([0, 29])
    assert np.all(rot == 0) and np.all(tilt == 0)
    assert np.allclose(psi, [[0.0, 6.0], [-12.0, -6.0]])
    with pytest.raises(ValueError):
        Sampling(0, 5.0, 2.0, symmetry="C2", in_plane=True)

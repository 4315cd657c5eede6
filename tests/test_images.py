"""Image preparation (images.py): background noise, per-image rolls, transforms and CTFs at the current size."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_particle_set

from cryorefine.core import fourier
from cryorefine.core.ctf import CtfParameters, ctf_2d
from cryorefine.data import load_particles
from cryorefine.images import ImageSettings, background_noise, prepare_batch, prepare_in_parts, roll_each
from cryorefine.io import mrc


def test_background_noise_is_standard_normal_and_white():
    noise = background_noise(5, 3, np.arange(4), 64)
    assert noise.shape == (4, 64, 64)
    assert abs(noise.mean()) < 0.03
    assert abs(noise.std() - 1.0) < 0.02
    # fourth moment of a normal is 3; neighbouring pixels uncorrelated
    assert abs(np.mean(noise ** 4) - 3.0) < 0.15
    assert abs(np.mean(noise[:, :, 1:] * noise[:, :, :-1])) < 0.03
    assert abs(np.corrcoef(noise[0].ravel(), noise[1].ravel())[0, 1]) < 0.05


def test_background_noise_depends_on_particle_and_iteration_not_on_the_batch():
    batch = background_noise(1, 2, np.array([3, 7, 11]), 16)
    alone = background_noise(1, 2, np.array([7]), 16)
    np.testing.assert_array_equal(batch[1], alone[0])
    assert not np.allclose(background_noise(1, 3, np.array([7]), 16), alone)
    assert not np.allclose(background_noise(2, 2, np.array([7]), 16), alone)


def test_roll_each_rolls_each_image_by_its_own_shift():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(5, 12, 12))
    sx, sy = rng.integers(-6, 7, 5), rng.integers(-6, 7, 5)
    rolled = roll_each(images, sx, sy)
    for b in range(5):
        np.testing.assert_array_equal(rolled[b], np.roll(images[b], (sy[b], sx[b]), axis=(-2, -1)))


@pytest.fixture
def particles(tmp_path):
    star, _ = make_particle_set(tmp_path, n=5, box=32, pixel_size=2.0, seed=4)
    return load_particles(star)


@pytest.mark.parametrize("zero_mask", [True, False])
def test_prepared_batch_matches_a_direct_computation(particles, zero_mask):
    settings = ImageSettings(32, 2.0, 40.0, zero_mask=zero_mask, do_ctf=True, random_seed=9)
    indices = np.array([1, 3, 4])
    current = 20
    with mrc.StackReader() as reader:
        batch = prepare_batch(particles, indices, reader, settings, current, 1.2, 4)
        raw = particles.read_images(indices, reader).astype(np.float64)

    ox = particles.origin_x_angstrom[indices] / 2.0
    oy = particles.origin_y_angstrom[indices] / 2.0
    norm = 1.2 / particles.norm_correction[indices]
    mask = fourier.soft_circular_mask(32, 10.0, 5.0)
    for row, i in enumerate(indices):
        img = np.roll(raw[row] * norm[row], (int(np.floor(oy[row] + 0.5)), int(np.floor(ox[row] + 0.5))), axis=(0, 1))
        np.testing.assert_allclose(batch.images_ft_unmasked[row],
                                   fourier.window_ft_2d(fourier.rfft2_centered(img), current), atol=1e-12)
        outside = mask < 1e-6
        if zero_mask:
            masked = img * mask
        else:
            noise = background_noise(9, 4, np.array([i]), 32)[0]
            masked = img * mask + (1 - mask) * noise * img[outside].std()
        np.testing.assert_allclose(batch.images_ft[row], fourier.window_ft_2d(fourier.rfft2_centered(masked), current),
                                   atol=1e-12)
    full_ctf = ctf_2d(32, CtfParameters(2.0, particles.defocus_u_angstrom[indices],
                                        particles.defocus_v_angstrom[indices], particles.defocus_angle_deg[indices],
                                        300.0, 2.7, 0.1), dtype=np.float64)
    np.testing.assert_allclose(batch.ctf, fourier.window_ft_2d(full_ctf, current), atol=1e-12)
    np.testing.assert_allclose(batch.residual_origin_px[:, 0], ox - np.floor(ox + 0.5))


def test_ctf_intact_first_peak_leaves_the_lowest_frequencies_at_one(particles):
    """--ctf_intact_first_peak: the batch's CTF (which the E-step and the back-projection both use) is 1 up to
    the CTF's first peak and the plain CTF beyond it."""
    indices = np.array([0, 2])
    plain_settings = ImageSettings(32, 2.0, 40.0, zero_mask=True, do_ctf=True)
    intact_settings = ImageSettings(32, 2.0, 40.0, zero_mask=True, do_ctf=True, ctf_intact_first_peak=True)
    with mrc.StackReader() as reader:
        plain = prepare_batch(particles, indices, reader, plain_settings, 32, 1.0, 1).ctf
        intact = prepare_batch(particles, indices, reader, intact_settings, 32, 1.0, 1).ctf
    assert np.all(np.abs(plain[:, 0, 0]) < 0.2)  # the CTF at k = 0 is the amplitude contrast alone
    assert np.all(intact[:, 0, :2] == 1.0)
    changed = intact != plain
    assert np.all(intact[changed] == 1.0)
    # what changed lies below the first peak: for each particle, at lower |k| than everything unchanged that
    # has |CTF| < 1 somewhere beyond the peak (the high-frequency oscillations)
    k = np.hypot(*np.meshgrid(np.r_[0:17, -15:0], np.arange(17), indexing="ij"))
    for b in range(2):
        assert changed[b].any()
        assert k[changed[b]].max() < k[~changed[b] & (np.abs(plain[b]) < 0.999)].max()


def test_a_batch_prepared_in_parts_is_the_batch_prepared_whole(particles):
    """em.estep prepares a batch of large images a few at a time and hands the engine the joined batch."""
    import dataclasses

    settings = ImageSettings(32, 2.0, 40.0, zero_mask=False, do_ctf=True, random_seed=3)
    indices = np.array([4, 0, 2, 3, 1])
    with mrc.StackReader() as reader:
        images = particles.read_images(indices, reader)

        def prepare(part):
            return prepare_batch(particles, indices[part], reader, settings, 24, 1.1, 2, images=images[part])

        whole = prepare(slice(0, 5))
        joined = prepare_in_parts(prepare, [slice(0, 2), slice(2, 4), slice(4, 5)])
        tail = prepare_in_parts(prepare, [slice(1, 3), slice(3, 5)])  # a run that starts inside the batch
    for f in dataclasses.fields(whole):
        want = getattr(whole, f.name)
        np.testing.assert_array_equal(getattr(joined, f.name), want, err_msg=f.name)
        np.testing.assert_array_equal(getattr(tail, f.name), want[1:], err_msg=f.name)


@pytest.mark.parametrize("current", [20, 21, 32])
def test_noise_sums_hold_every_coefficient_of_each_shell_once(particles, current):
    """Against a reference of zeros every sample's difference is the masked image itself, so the E-step's noise
    sums (its coefficients' differences plus the power it leaves out) are each shell's whole power: the shell
    that the current size's circle splits (|k| = current/2 rounds to it from both sides) included. RELION's
    projections are 0 beyond that circle, so its sums are the same."""
    from cryorefine.core.projector import Projector
    from cryorefine.core.sampling import Sampling
    from cryorefine.estep.engine import IterationSetup
    from cryorefine.estep.reference import NumpyEngine
    from cryorefine.images import shell_power

    settings = ImageSettings(32, 2.0, 40.0, zero_mask=True, do_ctf=True)
    indices = np.arange(5)
    with mrc.StackReader() as reader:
        batch = prepare_batch(particles, indices, reader, settings, current, 1.0, 1)
        whole = prepare_batch(particles, indices, reader, settings, 32, 1.0, 1).images_ft
    expected = shell_power(whole, 32, 17).sum(axis=0)
    engine = NumpyEngine()
    engine.setup(IterationSetup(projectors=[Projector(np.zeros((32, 32, 32)))], sigma2_noise=np.ones((1, 17)),
                                sampling=Sampling(healpix_order=0, offset_range_px=1, offset_step_px=1),
                                ori_size_px=32, current_size_px=current, coarse_size_px=min(current, 16),
                                pixel_size_angstrom=2.0, log_pdf_class=np.zeros(1), sigma_offset_px=3.0))
    engine.run(batch)
    np.testing.assert_allclose(engine.sums().sigma2_noise[0], expected, rtol=1e-9)


def test_a_batch_carries_each_particle_s_origin_prior_in_pixels(tmp_path):
    """The centre of the offsets' prior of a 3D job's batch is the particle's rlnOriginX/YPriorAngst over the pixel
    size (RELION's exp_prior), (0, 0) where the file has none; a 2D classification's settings leave it at (0, 0)
    (RELION centres 2D priors on the class's mean offset)."""
    from dataclasses import replace

    import starfile

    with_priors, _ = make_particle_set(tmp_path / "priors", n=5, box=32, pixel_size=2.0, seed=4, origin_priors=True)
    without, _ = make_particle_set(tmp_path / "none", n=5, box=32, pixel_size=2.0, seed=4)
    table = starfile.read(with_priors)["particles"]
    settings = ImageSettings(32, 2.0, 40.0)
    indices = np.array([4, 0, 2])
    with mrc.StackReader() as reader:
        batch = prepare_batch(load_particles(with_priors), indices, reader, settings, 20, 1.0, 1)
        flat = prepare_batch(load_particles(with_priors), indices, reader,
                             replace(settings, per_particle_offset_priors=False), 20, 1.0, 1)
        none = prepare_batch(load_particles(without), indices, reader, settings, 20, 1.0, 1)
    want = table[["rlnOriginXPriorAngst", "rlnOriginYPriorAngst"]].to_numpy()[indices] / 2.0
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(batch.origin_prior_px, want, rtol=1e-12)
    np.testing.assert_array_equal(flat.origin_prior_px, np.zeros((3, 2)))
    np.testing.assert_array_equal(none.origin_prior_px, np.zeros((3, 2)))


def test_an_image_with_a_nan_pixel_is_named_by_its_position_and_stack(particles):
    """A batch holding an image with a NaN pixel stops with the reader's one-line error naming that image's position
    and stack (the first such image of the batch), not a crash later in the E-step."""
    from pathlib import Path

    from cryorefine.errors import InputError

    settings = ImageSettings(32, 2.0, 40.0, zero_mask=True, do_ctf=True)
    indices = np.array([0, 2, 3])
    with mrc.StackReader() as reader:
        images = particles.read_images(indices, reader)
        images[1, 5, 7] = np.nan
        images[2, 0, 0] = np.inf
        with pytest.raises(InputError, match=rf"^{particles.stack_indices[2]}@.*{Path(particles.stack_paths[2]).name}"):
            prepare_batch(particles, indices, reader, settings, 20, 1.0, 1, images=images)

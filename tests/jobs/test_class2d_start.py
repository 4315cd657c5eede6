"""class2d's starting class images without --ref, as RELION 4/5 makes them (MlOptimiser::initialiseReferences and
calculateSumOfPowerSpectraAndAverageImage): RELION's random Gaussian blobs as high as the average of the first
particles of each optics group, low-passed and faded outside the particle's circle; EM and VDAM start alike."""

import numpy as np
import pytest
from class2d_data import make_views_set


def test_the_subset_is_the_first_particles_of_each_optics_group_in_file_order():
    from cryorefine.jobs.class2d import initial_subset

    optics = np.array([0, 1, 1, 0, 2, 0, 1, 0, 2, 1])
    assert initial_subset(optics, 2).tolist() == [0, 1, 2, 3, 4, 8]
    assert initial_subset(optics, 100).tolist() == list(range(10))


def relions_blobs_2d(amplitudes, places, diameter_px):
    """RELION's make_blobs_2d written out pixel by pixel for given places ((row, column) pairs): each blob exp(−((x −
    x_b)² + (y − y_b)²)·(10/diameter)²) times |amplitudes| at the place's truncated pixel, none outside the box."""
    n = amplitudes.shape[0]
    out = np.zeros((n, n))
    sigma_inv = 10.0 / diameter_px
    for y_b, x_b in places:
        if not (0 <= int(y_b) < n and 0 <= int(x_b) < n):
            continue
        height = abs(amplitudes[int(y_b), int(x_b)])
        for y in range(n):
            for x in range(n):
                out[y, x] += np.exp(-((x - x_b) * sigma_inv) ** 2 - ((y - y_b) * sigma_inv) ** 2) * height
    return out


def test_blobs_are_relions_positive_draw_minus_half_a_negative_one_scaled_to_the_averages_spread():
    from cryorefine.em.references import N_BLOBS, blobs

    n, diameter = 20, 14.0
    yy, xx = np.mgrid[:n, :n]
    average = np.cos(xx / 3.0) + 0.5 * np.sin(yy / 2.0)  # heights that differ from place to place
    got = blobs(average, diameter, 1.0 / 7.0, np.random.default_rng(11))
    draws = np.random.default_rng(11)
    positive, negative = (draws.normal(0.0, diameter / 7.0, (N_BLOBS, 2)) + n / 2.0 for _ in range(2))
    want = relions_blobs_2d(average, positive, diameter) - relions_blobs_2d(average, negative, diameter) / 2.0
    want *= average.std() / want.std()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert got.std() == pytest.approx(average.std())
    assert not np.any(blobs(np.zeros((n, n)), diameter, 1.0 / 7.0, np.random.default_rng(1)))


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """20 particles of each of three views (SNR 1, CTFs): the particle set and image settings of a K = 3 run."""
    from cryorefine.config import RefineConfig
    from cryorefine.em import loop

    folder = tmp_path_factory.mktemp("class2d_start")
    star, _ = make_views_set(folder, 20, snr=1.0, seed=4)
    config = RefineConfig(input_star=str(star), output_root=str(folder / "run"), reference_map="", n_classes=3,
                          particle_diameter_angstrom=320.0, do_ctf=True, zero_mask=True, auto_refine=False,
                          random_seed=2)
    particles, settings = loop.particles_and_settings(config)
    return config, particles, settings


def test_the_start_reads_only_the_first_particles_of_each_optics_group(views, monkeypatch):
    from cryorefine.jobs import class2d

    config, particles, settings = views
    read = []

    def prepared(particles, indices, *args, **kwargs):
        read.extend(np.asarray(indices).tolist())
        return prepare_batch(particles, indices, *args, **kwargs)

    prepare_batch = class2d.prepare_batch
    monkeypatch.setattr(class2d, "prepare_batch", prepared)
    monkeypatch.setattr(class2d, "INITIAL_PARTICLES_PER_OPTICS_GROUP", 25)
    class2d.initial_references(particles, settings, config, 8)
    assert sorted(read) == list(range(25))  # one optics group: particles 1-25 of the file, each once


def test_the_start_is_blobs_faded_outside_the_particles_circle(views):
    """Each class image is smooth blobs low-passed at RELION's shell 0.07·box (2 of 32 px: measured, 1.4-3.0e-4 of
    the power beyond shell 3, what the fading adds), flat (one value) beyond the mask's edge, and the classes differ
    (their own subset and blobs: correlations 0.35-0.89)."""
    from cryorefine.core import fourier
    from cryorefine.jobs.class2d import initial_references

    config, particles, settings = views
    images = initial_references(particles, settings, config, 8)
    n = settings.ori_size_px
    assert len(images) == 3 and all(image.shape == (n, n) for image in images)
    radius = np.hypot(*(np.mgrid[:n, :n] - n // 2))
    diameter_px = settings.particle_diameter_angstrom / settings.pixel_size_angstrom
    outside = radius > diameter_px / 2 + config.width_mask_edge_px
    shell = fourier.radius_2d(n)
    for image in images:
        assert image.std() > 0
        assert np.ptp(image[outside]) <= 1e-9 * np.abs(image).max()
        power = np.abs(fourier.rfft2_centered(image)) ** 2
        assert power[shell > 3].sum() < 1e-3 * power.sum()
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert np.corrcoef(images[a].ravel(), images[b].ravel())[0, 1] < 0.99

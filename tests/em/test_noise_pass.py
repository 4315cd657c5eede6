"""The initial noise pass: a batch prepared in parts where the device's free memory is short, and its waits for the
image reads told apart from the preparation."""

import time

import numpy as np
from conftest import make_particle_set

from cryorefine.data import load_particles
from cryorefine.em import memory
from cryorefine.em.estep import initial_noise_spectra, noise_batch_sums
from cryorefine.images import ImageSettings


def test_a_batch_prepared_in_parts_gives_the_spectra_of_the_whole_batch(tmp_path):
    star, _ = make_particle_set(tmp_path, n=23, box=32, pixel_size=2.0, seed=3)
    particles = load_particles(star)
    settings = ImageSettings(32, 2.0, 50.0, do_ctf=True)
    whole = initial_noise_spectra(particles, settings, 1, 23)
    # free memory for 5 images a part: 23 images in 5 parts
    five = 5.5 * memory.PREPARATION_BYTES_PER_PIXEL * 32 ** 2 / memory.PREPARATION_SHARE
    assert memory.images_per_preparation(five, 32) == 5
    sums = list(noise_batch_sums(particles, settings, 1, enumerate(particles.batches(23)), free_bytes=lambda: five))
    assert [number for number, _ in sums] == [0]
    power, optics, _ = sums[0][1]
    assert power.shape[0] == optics.shape[0] == 23
    in_parts = initial_noise_spectra(particles, settings, 1, 23, free_bytes=lambda: five)
    np.testing.assert_allclose(in_parts, whole, rtol=1e-10)
    _, (power_whole, _, ft_whole) = next(noise_batch_sums(particles, settings, 1, enumerate(particles.batches(23))))
    np.testing.assert_array_equal(power, power_whole)
    np.testing.assert_allclose(sums[0][1][2], ft_whole, rtol=1e-10, atol=1e-12 * np.abs(ft_whole).max())


def test_the_noise_pass_tells_its_waits_for_the_reads_apart_from_the_preparation(tmp_path):
    """The start's noise pass reads every image once: the seconds spent waiting for the reads and those spent
    preparing the images are added up apart, under the E-step's stage names."""
    star, _ = make_particle_set(tmp_path, n=12, box=32, pixel_size=2.0, seed=4)
    particles = load_particles(star)
    settings = ImageSettings(32, 2.0, 50.0, do_ctf=True)
    read_ahead = particles.read_ahead

    def slow_reads(*args, **kwargs):  # each batch's images come 50 ms late
        for batch in read_ahead(*args, **kwargs):
            time.sleep(0.05)
            yield batch

    particles.read_ahead = slow_reads
    stages = {}
    spectra = initial_noise_spectra(particles, settings, 1, 4, stages=stages)
    assert set(stages) == {"read_wait", "images"}
    assert stages["read_wait"] >= 3 * 0.05 and stages["images"] > 0  # 3 batches of 4
    del particles.read_ahead
    np.testing.assert_array_equal(spectra, initial_noise_spectra(particles, settings, 1, 4))

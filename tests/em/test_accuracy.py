"""em.accuracy: RELION's projection-based accuracy estimate (calculateExpectedAngularErrors), against a trial-by-trial
computation written out coefficient by coefficient, and on maps whose answer is known."""

import numpy as np
import pytest
from conftest import make_particle_set

from cryorefine.core.ctf import ctf_2d
from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.projector import Projector
from cryorefine.data import load_particles
from cryorefine.em import schedule
from cryorefine.em.accuracy import projected_accuracy

BOX = 16
PIXEL = 4.0


@pytest.fixture(scope="module")
def particles(tmp_path_factory):
    star, _ = make_particle_set(tmp_path_factory.mktemp("acc"), n=3, box=BOX, pixel_size=PIXEL, seed=5)
    return load_particles(star)


def smooth_random_map(seed):
    rng = np.random.default_rng(seed)
    volume = rng.normal(size=(BOX, BOX, BOX))
    f = np.fft.rfftn(volume)
    k = np.sqrt(sum(g ** 2 for g in np.meshgrid(np.fft.fftfreq(BOX), np.fft.fftfreq(BOX), np.fft.rfftfreq(BOX),
                                                   indexing="ij")))
    volume = np.fft.irfftn(f * np.exp(-(k / 0.18) ** 2), s=volume.shape, axes=(0, 1, 2))
    z, y, x = np.mgrid[:BOX, :BOX, :BOX] - BOX // 2
    return volume * (x * x + y * y + z * z < (BOX // 2 - 2) ** 2)


def round_blob(sigma_px=2.0):
    z, y, x = np.mgrid[:BOX, :BOX, :BOX] - BOX // 2
    return np.exp(-(x * x + y * y + z * z) / (2 * sigma_px ** 2))


def estimate(maps, sigma2, particles, indices=(0, 1, 2), pdf=None, do_ctf=True, current=BOX):
    indices = np.asarray(indices)
    angles = np.stack([particles.rot_deg, particles.tilt_deg, particles.psi_deg], axis=1)[indices]
    return projected_accuracy(maps, np.full(len(maps), 1.0 / len(maps)) if pdf is None else pdf, sigma2, particles,
                              indices, angles,
                              current_size_px=current, padding_factor=2.0, do_ctf=do_ctf)


def snr_written_out(f1, f2, ctf, sigma2):
    """Σ CTF²|F1 − F2|² / (2σ²(shell)) over every coefficient of the half transform with shell 1 … n/2."""
    total = 0.0
    n = f1.shape[0]
    for iy in range(n):
        ky = iy if iy < n // 2 else iy - n
        for kx in range(n // 2 + 1):
            shell = int(np.floor(np.sqrt(kx * kx + ky * ky) + 0.5))
            if 1 <= shell <= n // 2:
                total += ctf[iy, kx] ** 2 * abs(f1[iy, kx] - f2[iy, kx]) ** 2 / (2.0 * sigma2[shell])
    return total


def first_trial(trials, snr_of):
    for e in trials:
        if snr_of(e) > 4.60517:
            return e
    return trials[-1]


@pytest.mark.parametrize("current", [BOX, 10], ids=["whole box", "current size below the box"])
def test_one_particle_gives_the_trial_by_trial_errors_of_one_angle_and_one_axis(particles, current):
    """Written out through the whole map's projector at the current size (below the box, the estimate projects the
    map Fourier-cropped to that size, whose coefficients are the same)."""
    volume = smooth_random_map(1)
    sigma2 = np.full(BOX // 2 + 1, 2e-4)
    i = 1
    angles = np.array([particles.rot_deg[i], particles.tilt_deg[i], particles.psi_deg[i]])
    projector = Projector(volume, 2.0, current // 2)
    f1 = projector.project(euler_to_matrix(*angles), image_size_px=current)
    pixel = np.array([PIXEL * BOX / current])  # the CTF of the same frequencies at the current size
    ctf = np.asarray(ctf_2d(current, particles.ctf_parameters(np.array([i]), pixel)))[0].astype(np.float64)

    def rotation_error(which):
        def snr(e):
            moved = angles.copy()
            moved[which] += e
            return snr_written_out(f1, projector.project(euler_to_matrix(*moved), image_size_px=current), ctf, sigma2)
        return first_trial(schedule.rotation_trials_deg(), snr)

    def shift_error(axis):
        ky = np.fft.fftfreq(current, 1.0 / current)[:, None]
        kx = np.arange(current // 2 + 1)[None, :]
        k = kx if axis == 0 else ky
        return first_trial(schedule.translation_trials_px(),
                           lambda s: snr_written_out(f1, f1 * np.exp(-2j * np.pi * k * s / BOX), ctf, sigma2))

    by_angle = {rotation_error(which) for which in range(3)}
    by_axis = {shift_error(axis) * PIXEL for axis in range(2)}
    assert min(by_angle) < 30.0 and min(by_axis) < 10.0 * PIXEL  # the set resolves both
    acc = estimate([volume], sigma2, particles, indices=[i], current=current)
    # the whole box: the same trial; the cropped map's trilinear projections differ from the whole map's by about 1 %,
    # which may move the answer to the next trial
    steps = 0 if current == BOX else 1
    rotations, shifts = list(schedule.rotation_trials_deg()), [t * PIXEL for t in schedule.translation_trials_px()]

    def near(value, trials, found):
        at = int(np.argmin(np.abs(np.asarray(trials) - value)))
        return any(abs(at - int(np.argmin(np.abs(np.asarray(trials) - f)))) <= steps for f in found)

    assert near(acc.rotations_deg, rotations, by_angle), (acc, by_angle)
    assert near(acc.translations_angstrom, shifts, by_axis), (acc, by_axis)


def test_a_round_blob_cannot_be_oriented_but_can_be_centred(particles):
    """Projections of a ball do not change under rotation: every particle reaches RELION's cap of the angular
    search (30° and one more step), while its shifts are found well within RELION's 10 px."""
    acc = estimate([round_blob()], np.full(BOX // 2 + 1, 1e-3), particles, do_ctf=False)
    assert acc.rotations_deg > 30.0
    assert acc.translations_angstrom < 2.0 * PIXEL


def test_more_noise_gives_larger_errors(particles):
    volume = smooth_random_map(2)
    quiet = estimate([volume], np.full(BOX // 2 + 1, 1e-4), particles)
    noisy = estimate([volume], np.full(BOX // 2 + 1, 1.6e-3), particles)
    assert noisy.rotations_deg > quiet.rotations_deg and noisy.translations_angstrom > quiet.translations_angstrom


def test_classes_below_one_percent_are_left_out_and_the_best_class_counts(particles):
    sharp, blob = smooth_random_map(3), round_blob()
    sigma2 = np.full(BOX // 2 + 1, 2e-4)
    alone, ball = estimate([sharp], sigma2, particles), estimate([blob], sigma2, particles)
    both = estimate([blob, sharp], sigma2, particles, pdf=np.array([0.5, 0.5]))
    # RELION keeps the best class's angles and, apart, the best class's offsets
    assert both == (alone.rotations_deg, min(alone.translations_angstrom, ball.translations_angstrom))
    assert estimate([sharp, blob], sigma2, particles, pdf=np.array([0.005, 0.995])).rotations_deg > 30.0
    assert estimate([sharp], sigma2, particles, pdf=np.array([0.001])) == (schedule.UNKNOWN_ACCURACY,
                                                                           schedule.UNKNOWN_ACCURACY)


@pytest.mark.gpu
@pytest.mark.parametrize("current", [BOX, 10], ids=["whole box", "current size below the box"])
def test_the_estimate_on_the_gpu_is_the_host_s(particles, cp, current):
    """The projections and sums on the device (xp=cupy) give each particle the same trials as on the host."""
    volume = smooth_random_map(4)
    sigma2 = np.full(BOX // 2 + 1, 3e-4)
    angles = np.stack([particles.rot_deg, particles.tilt_deg, particles.psi_deg], axis=1)
    for i in range(3):
        on = {xp.__name__: projected_accuracy([volume], np.ones(1), sigma2, particles, [i], angles[[i]],
                                              current_size_px=current, padding_factor=2.0, do_ctf=True, xp=xp)
              for xp in (np, cp)}
        assert on["cupy"] == on["numpy"], (i, on)
        assert on["numpy"].rotations_deg < 30.0  # a trial that is found, not the cap


@pytest.mark.gpu
def test_a_gpu_run_estimates_on_its_device_between_iterations_and_leaves_its_arena_as_it_was(particles, cp):
    """`CudaBackend.estimate_accuracy` inside the run's arena: the host's estimate, in a scope of its own that frees
    every block it took."""
    from cryorefine.em.accuracy import AccuracyRequest
    from cryorefine.estep.backend import CudaBackend

    angles = np.stack([particles.rot_deg, particles.tilt_deg, particles.psi_deg], axis=1)
    request = AccuracyRequest([smooth_random_map(5)], np.ones(1), np.full(BOX // 2 + 1, 3e-4), np.arange(3), angles,
                              current_size_px=10, padding_factor=2.0, do_ctf=True)
    backend = CudaBackend(0)
    with backend.run_scope():
        before = backend.arena.top
        assert backend.estimate_accuracy(request, particles) == request.estimate(particles)
        assert backend.arena.top == before and backend.arena.escaped_blocks == 0

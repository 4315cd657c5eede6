"""em.gradient: RELION's VDAM schedule (figures worked out by hand from ml_optimiser.cpp's formulas) and the update on
small padded grids."""

import numpy as np
import pytest

from cryorefine.core.projector import Projector
from cryorefine.em import gradient


def test_the_phases_of_200_iterations_are_relions():
    assert gradient.gradient_phases(200) == gradient.GradientPhases(60, 100, 40)
    assert gradient.gradient_phases(15) == gradient.GradientPhases(4, 8, 3)  # 4.5 and 3.0 truncated
    # shares above 0.9 together: scaled by 1/(0.6 + 0.5 + 0.1) (1.2000000000000002 in doubles, as in RELION: 49.99… and
    # 41.66… iterations, truncated)
    assert gradient.gradient_phases(100, 0.6, 0.5) == gradient.GradientPhases(49, 10, 41)


def test_the_initial_models_mini_batches_are_relions():
    assert gradient.initial_model_subset_sizes(10_000) == (200, 1000)
    assert gradient.initial_model_subset_sizes(105_247) == (526, 10524)
    assert gradient.initial_model_subset_sizes(2_000_000) == (5000, 50000)
    phases = gradient.gradient_phases(200)
    assert gradient.subset_size(1, phases, 200, 1000, 10_000) == 200
    assert gradient.subset_size(59, phases, 200, 1000, 10_000) == 200
    assert gradient.subset_size(110, phases, 200, 1000, 10_000) == 600  # half way: 200 + 0.5 · 800
    assert gradient.subset_size(111, phases, 200, 1000, 10_000) == 608
    assert gradient.subset_size(160, phases, 200, 1000, 10_000) == 1000
    assert gradient.subset_size(200, phases, 200, 1000, 10_000) == 1000
    assert gradient.subset_size(200, phases, 200, 1000, 900) is None  # the batch would hold them all


def test_the_step_size_and_the_tau2_fudge_follow_relions_sigmoids():
    phases = gradient.gradient_phases(200)
    assert gradient.step_size(1, phases) == pytest.approx(0.9, abs=1e-6)
    # x = 110: 10^((110 − 60 − 25)/12.5) = 100, so the step is 0.9/101 + 0.5 · 100/101
    assert gradient.step_size(110, phases) == pytest.approx((0.9 + 50.0) / 101.0)
    assert gradient.step_size(85, phases) == pytest.approx(0.7)  # the sigmoid's middle
    assert gradient.step_size(200, phases) == pytest.approx(0.5, abs=1e-9)
    assert gradient.tau2_fudge_at(1, phases, 4.0) == pytest.approx(1.0, abs=1e-9)
    assert gradient.tau2_fudge_at(72.5, phases, 4.0) == pytest.approx(2.5)  # 60 + 25/2: the middle
    assert gradient.tau2_fudge_at(200, phases, 4.0) == pytest.approx(4.0)
    assert gradient.class_step_size(0.5, 1.0, 1) == pytest.approx(0.5 * (1 - np.exp(-13.0)))


def blob_map(n=16, seed=0):
    rng = np.random.default_rng(seed)
    z, y, x = np.indices((n, n, n)) - n // 2
    volume = np.zeros((n, n, n))
    for centre in rng.uniform(-3, 3, (4, 3)):
        volume += np.exp(-((x - centre[0]) ** 2 + (y - centre[1]) ** 2 + (z - centre[2]) ** 2) / 4.0)
    return volume


def test_map_from_padded_ft_inverts_the_projectors_transform():
    volume = blob_map()
    projector = Projector(volume, 2.0, None, do_gridding=False)
    # the projector keeps |k| ≤ N/2 (a sphere, not the cube's corners): a smooth map comes back to 2e-4 of its peak
    assert np.allclose(gradient.map_from_padded_ft(projector.data, projector.grid), volume, atol=1e-3)
    # within a smaller radius: the map low-passed (most of a smooth map's power is inside)
    small = Projector(volume, 2.0, 4, do_gridding=False)
    back = gradient.map_from_padded_ft(small.data, small.grid)
    assert np.corrcoef(back.ravel(), volume.ravel())[0, 1] > 0.99
    assert not np.allclose(back, volume, atol=1e-3)


def test_updates_move_the_reference_to_the_batches_map():
    """Two pseudo-halves whose sums hold a target map (weights 10, a little noise in each): 30 updates bring
    another map to the target, to a correlation above 0.95 from 0.41 (measured 0.978; with momentum 0.9 the way there
    swings: 0.99 after 12, 0.51 after 15); the FSC estimate is high where the target has power. (A reference of zeros
    would not move: its FSC estimate is zero, as in RELION.)"""
    n, pf = 16, 2.0
    target = Projector(blob_map(seed=1), pf, None, do_gridding=False)
    grid = target.grid
    rng = np.random.default_rng(2)
    moments = gradient.Moments.start(grid)
    start = blob_map(seed=5)
    reference = Projector(start, pf, None, do_gridding=False).data
    assert np.corrcoef(start.ravel(), blob_map(seed=1).ravel())[0, 1] < 0.5
    for _ in range(30):
        halves = []
        for _h in range(2):
            noise = 0.02 * (rng.normal(size=grid.shape) + 1j * rng.normal(size=grid.shape))
            weight = np.full(grid.shape, 10.0)
            halves.append(((target.data + noise) * weight, weight))
        step = gradient.gradient_update(reference, halves, grid, moments, step=0.9, tau2_fudge=1.0)
        reference = step.reference_ft
    found = gradient.map_from_padded_ft(reference, grid)
    assert np.corrcoef(found.ravel(), blob_map(seed=1).ravel())[0, 1] > 0.95
    assert step.fsc_estimate[:3].min() > 0.9
    assert step.fsc_estimate.shape == (n // 2 + 1,)

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


def test_2d_classifications_mini_batches_are_relions_and_a_last_iteration_of_classes_takes_all():
    """RELION's initialiseGeneral for ref_dim 2: max(min(0.5 %, 10000), 200) and max(min(5 %, 100000), 1000)."""
    assert gradient.class2d_subset_sizes(10_000) == (200, 1000)
    assert gradient.class2d_subset_sizes(105_247) == (526, 5262)
    assert gradient.class2d_subset_sizes(3_000_000) == (10000, 100000)
    phases = gradient.gradient_phases(200)
    assert gradient.subset_size(200, phases, 200, 1000, 10_000, n_classes=1) == 1000
    assert gradient.subset_size(200, phases, 200, 1000, 10_000, n_classes=50) is None  # updateSubsetSize's rule
    assert gradient.subset_size(199, phases, 200, 1000, 10_000, n_classes=50) == 1000
    # the 2D step size: "3-step" from 0.9 to 0.3; the middle of the sigmoid at 60 + 25 is 0.6
    assert gradient.step_size(85, phases, gradient.CLASS2D_STEP_SIZE, gradient.CLASS2D_FIRST_STEP_SIZE) == \
        pytest.approx(0.6)
    first, second = gradient.pseudo_halves(np.array([2, 3, 8, 11, 14]))
    assert first.tolist() == [2, 8, 14] and second.tolist() == [3, 11]


def test_the_least_active_class_is_replaced_by_a_copy_of_the_most_erring_one():
    """RELION's rule: drop the class of the smallest share where it is below threshold / (classes with a share);
    copy the class of the largest error (mean power of its step times its share)."""
    shares = np.array([0.5, 0.02, 0.3, 0.18])
    errors = np.array([1.0, 9.0, 5.0, 0.1]) * shares  # 0.5, 0.18, 1.5, 0.018
    assert gradient.class_to_replace(shares, errors, 0.1) == (1, 2)  # 0.02 < 0.1 / 4
    assert gradient.class_to_replace(shares, errors, 0.05) is None  # 0.02 ≥ 0.05 / 4
    assert gradient.class_to_replace(shares, errors, 0.0) is None
    # a class without a share does not count among the active ones: 0.02 < 0.1 / 3 as well, and 0 is the least
    assert gradient.class_to_replace(np.array([0.5, 0.02, 0.48, 0.0]), errors, 0.1) == (3, 2)


def test_the_moments_go_to_relions_files_and_back_exactly():
    """RELION's layout: (Np[, Np], 2·(Np/2 + 1)) float32, real and imaginary parts side by side, frequency 0 at Np/2;
    a round trip gives back every value an update reads (inside the radius)."""
    for ndim, n in ((2, 16), (3, 8)):
        grid = gradient.full_grid(n, 2.0, ndim)
        rng = np.random.default_rng(ndim)
        moments = gradient.Moments.start(grid)
        inside = grid.radius2() < grid.r_max_padded ** 2
        for m in moments.first:
            m[...] = np.where(inside, rng.normal(size=grid.shape) + 1j * rng.normal(size=grid.shape), 0)
        moments.second[...] = np.where(inside, rng.uniform(0.5, 2.0, grid.shape), 1.0)
        first, second = gradient.moments_as_relion(moments, grid)
        assert first[0].shape == (2 * n,) * (ndim - 1) + (2 * (n + 1),) and first[0].dtype == np.float32
        # frequency (ky, kx) = (1, 2) of the first pseudo-half set: row Np/2 + 1, columns 4 and 5
        o = grid.origin
        if ndim == 2:
            assert first[0][n + 1, 4] == moments.first[0][o + 1, 2].real
            assert first[0][n + 1, 5] == moments.first[0][o + 1, 2].imag
        back = gradient.moments_from_relion(first, second, grid)
        for a, b in zip(back.first + [back.second], moments.first + [moments.second]):
            assert np.array_equal(a[inside], b[inside])


def test_moving_a_2d_class_moves_its_moments_as_its_transform():
    """RELION's centerClasses under --grad shifts the first moments by the image's move: the padded transform of the
    image moved by whole pixels is the transform of the image with the moments' phase."""
    n = 16
    y, x = np.mgrid[:n, :n] - n // 2
    image = np.exp(-((x - 1) ** 2 + (y + 2) ** 2) / 2.0)
    moved = np.roll(image, (-1, 3), axis=(0, 1))  # 3 px along x, −1 px along y
    grid = gradient.full_grid(n, 2.0, 2)
    moments = gradient.Moments.start(grid)
    moments.first = [Projector(image, 2.0, None, do_gridding=False).data.astype(np.complex64)] * 2
    shifted = gradient.shifted_moments(moments, grid, np.array([3.0, -1.0]))
    want = Projector(moved, 2.0, None, do_gridding=False).data
    assert np.abs(shifted.first[0] - want).max() < 1e-3 * np.abs(want).max()  # the other way: about 2


def test_map_from_padded_ft_inverts_the_2d_projectors_transform():
    n = 16
    y, x = np.mgrid[:n, :n] - n // 2
    image = np.exp(-((x - 2) ** 2 + (y + 1) ** 2) / 4.0)
    projector = Projector(image, 2.0, None, do_gridding=False)
    assert np.allclose(gradient.map_from_padded_ft(projector.data, projector.grid), image, atol=1e-3)


def test_the_accuracy_and_the_sampling_are_looked_at_on_relions_iterations():
    """RELION's expectationSetup under --grad: the accuracy before iterations 0 and 1, every 10th and the last; the
    sampling (--auto_sampling) from iteration 2 on, every 10th; the counters start at 0 before iteration 10."""
    from cryorefine.em.state import OptimiserState

    assert [i for i in range(0, 45) if gradient.estimates_accuracy(i, 43)] == [0, 1, 10, 20, 30, 40, 43]
    assert [i for i in range(0, 201) if gradient.updates_sampling(i)] == list(range(10, 201, 10))
    counted = OptimiserState(nr_iter_wo_resol_gain=2, nr_iter_wo_large_hidden_variable_changes=3)
    for iteration, kept in ((9, False), (10, True), (11, True)):
        at_start = gradient.counters_at_start(counted, iteration)
        assert (at_start.nr_iter_wo_resol_gain, at_start.nr_iter_wo_large_hidden_variable_changes) == (
            (2, 3) if kept else (0, 0)), iteration


#: RELION's GUI sampling of the initial model (--healpix_order 1 --offset_range 6 --offset_step 2 --oversampling 1), at
#: 2 Å a pixel: offsets in steps of 4 Å within 12 Å
GUI_SAMPLING = dict(healpix_order=1, offset_range_px=6.0, offset_step_px=2.0)


@pytest.mark.parametrize("given, expected", [
    # the resolution did not improve, 15° (order 1, oversampled once) ≥ 0.75 · 5°: order 2; step min(1.5, 0.75 · 3) · 2
    # = 3 Å, range 5 · 1.2 = 6 Å (below 1.3 · 12, above 1.5 · 3, not above 4 · 3)
    (dict(), dict(healpix_order=2, offset_step_px=1.5, offset_range_px=3.0)),
    # order 3 stays 3 (4 would be local searches, which a gradient run never makes); the offsets change alike
    (dict(healpix_order=3), dict(healpix_order=3, offset_step_px=1.5, offset_range_px=3.0)),
    # 15° against 0.75 · 19.9° = 14.925°: finer still
    (dict(acc_rot_deg=19.9), dict(healpix_order=2, offset_step_px=1.5, offset_range_px=3.0)),
    # 15° below 0.75 · 20.1° = 15.075°: fine enough, nothing changes
    (dict(acc_rot_deg=20.1), dict(GUI_SAMPLING)),
    # the resolution improved in the last iteration: nothing changes
    (dict(nr_iter_wo_resol_gain=0), dict(GUI_SAMPLING)),
    # offsets that changed by 10 Å: range min(1.3 · 12, 50) = 15.6 Å, above 4 steps: halved to 7.8 Å
    (dict(changes_optimal_offsets_angstrom=10.0), dict(healpix_order=2, offset_step_px=1.5, offset_range_px=3.9)),
    # a step of 2 Å already: the accuracy's 3 Å would be coarser, so step and range stay
    (dict(offset_step_px=1.0), dict(healpix_order=2, offset_step_px=1.0, offset_range_px=6.0)),
])
def test_auto_sampling_follows_relions_rule_under_grad(given, expected):
    from cryorefine.config import RefineConfig
    from cryorefine.em.state import ModelState, OptimiserState

    config = RefineConfig(input_star="p.star", output_root="out/run", reference_map="", auto_refine=False,
                          oversampling=1, auto_sampling=True)
    state = dict(GUI_SAMPLING, nr_iter_wo_resol_gain=1, nr_iter_wo_large_hidden_variable_changes=0, acc_rot_deg=5.0,
                 acc_trans_angstrom=3.0, changes_optimal_offsets_angstrom=1.2)
    state.update(given)
    optimiser = gradient.auto_sampling(OptimiserState(**state), ModelState(ori_size_px=64, pixel_size_angstrom=2.0),
                                       config)
    got = dict(healpix_order=optimiser.healpix_order, offset_step_px=optimiser.offset_step_px,
               offset_range_px=optimiser.offset_range_px)
    assert got == pytest.approx(expected)
    assert not optimiser.local_searches
    changed = got != {name: state[name] for name in expected}
    assert optimiser.nr_iter_wo_resol_gain == (0 if changed else state["nr_iter_wo_resol_gain"])


def class_step_inputs(ndim, n=16, pf=2.0, r_max=6):
    """A class's previous map, its two pseudo-half sets' sums (complex64 data, float32 weights, as the engines make
    them) at radius `r_max`, and momenta after earlier steps (first moments not zero)."""
    from cryorefine.core.grid import PaddedGrid

    rng = np.random.default_rng(7)
    previous = blob_map(n, seed=3) if ndim == 3 else blob_map(n, seed=3)[n // 2]
    grid = PaddedGrid.create(n, pf, r_max, ndim=ndim)
    target = Projector(blob_map(n, seed=4) if ndim == 3 else blob_map(n, seed=4)[n // 2], pf, r_max,
                       do_gridding=False).data
    halves = []
    for _ in range(2):
        weight = rng.uniform(5.0, 15.0, grid.shape)
        noise = 0.05 * (rng.normal(size=grid.shape) + 1j * rng.normal(size=grid.shape))
        halves.append((((target + noise) * weight).astype(np.complex64), weight.astype(np.float32)))
    full = gradient.full_grid(n, pf, ndim)
    moments = gradient.Moments.start(full)
    for m in moments.first:
        m[...] = 0.01 * (rng.normal(size=full.shape) + 1j * rng.normal(size=full.shape))
    moments.second[...] = rng.uniform(0.5, 2.0, full.shape)
    return previous, halves, moments, dict(padding_factor=pf, r_max=r_max, step=0.3, tau2_fudge=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("ndim", [2, 3])
def test_a_class_s_step_on_the_gpu_is_the_host_s(ndim):
    """`update_class` with the sums on the GPU (xp=cupy, as the GPU engine leaves them) gives the host's map, τ²,
    σ², momenta, FSC estimate and mean power, as host arrays, and leaves the momenta it was given as they were."""
    from conftest import cupy_or_skip

    cp = cupy_or_skip()
    previous, halves, moments, settings = class_step_inputs(ndim)
    before = moments.copy()
    host = gradient.update_class(previous, [(d.copy(), w.copy()) for d, w in halves], moments, **settings)
    device = gradient.update_class(previous, [(cp.asarray(d), cp.asarray(w)) for d, w in halves], moments,
                                   xp=cp, **settings)
    for name in ("map", "tau2", "sigma2", "fsc_estimate"):
        want, got = getattr(host, name), getattr(device, name)
        assert isinstance(got, np.ndarray), name
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9 * float(np.abs(want).max()), err_msg=name)
    np.testing.assert_allclose(device.mean_power, host.mean_power, rtol=1e-6)
    for got, want in zip([*device.moments.first, device.moments.second], [*host.moments.first, host.moments.second],
                         strict=True):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    for got, want in zip([*moments.first, moments.second], [*before.first, before.second], strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(host.moments.second, before.second)  # the step moved them


def test_a_class_s_step_leaves_the_momenta_it_was_given():
    previous, halves, moments, settings = class_step_inputs(2)
    before = moments.copy()
    update = gradient.update_class(previous, halves, moments, **settings)
    for got, want in zip([*moments.first, moments.second], [*before.first, before.second], strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.allclose(update.moments.first[0], before.first[0])


def test_a_stack_of_2d_classes_steps_as_each_class_alone():
    """`update_classes_2d` (the classes in one pass of stacked arrays) gives each class what `update_class` gives it
    alone: classes with momenta after earlier steps and with fresh ones, different maps, sums and steps, at a radius
    below the box's."""
    rng = np.random.default_rng(11)
    previous, halves, moments, settings = class_step_inputs(2)
    full = gradient.full_grid(previous.shape[0], settings["padding_factor"], 2)
    classes = []
    for k in range(3):
        scale = 1.0 + 0.5 * k
        class_halves = [((d * scale + 0.1 * k * rng.normal(size=d.shape)).astype(np.complex64),
                         (w * rng.uniform(0.5, 1.5, w.shape)).astype(np.float32)) for d, w in halves]
        class_moments = moments.copy() if k != 1 else gradient.Moments.start(full)
        classes.append((previous * scale + 0.01 * rng.normal(size=previous.shape), class_halves, class_moments,
                        0.3 / (k + 1)))
    common = dict(padding_factor=settings["padding_factor"], r_max=settings["r_max"],
                  tau2_fudge=settings["tau2_fudge"])
    alone = [gradient.update_class(p, [(d.copy(), w.copy()) for d, w in h], m, step=step, **common)
             for p, h, m, step in classes]
    together = gradient.update_classes_2d([p for p, *_ in classes],
                                          [[(d.copy(), w.copy()) for d, w in h] for _, h, _, _ in classes],
                                          [m for _, _, m, _ in classes], steps=[c[3] for c in classes], **common)
    assert len(together) == len(alone)
    for got, want in zip(together, alone, strict=True):
        for name in ("map", "tau2", "sigma2", "fsc_estimate"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-12,
                                       atol=1e-12 * float(np.abs(getattr(want, name)).max()), err_msg=name)
        assert got.mean_power == pytest.approx(want.mean_power, rel=1e-12)
        for g, w in zip([*got.moments.first, got.moments.second], [*want.moments.first, want.moments.second],
                        strict=True):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7 * float(np.abs(w).max()))
    assert not np.allclose(together[0].map, together[2].map)  # the classes' own maps, not one class's thrice


def test_2d_classes_are_stepped_in_stacks_that_cover_each_class_once():
    from cryorefine.core.grid import PaddedGrid

    grid = gradient.full_grid(360, 2.0, 2)
    stacks = gradient.class_stacks(100, grid)
    assert [k for stack in stacks for k in stack] == list(range(100))
    assert max(len(s) for s in stacks) * int(np.prod(grid.shape)) <= gradient.CLASS_STACK_ELEMENTS
    assert len(stacks) > 1
    assert gradient.class_stacks(3, PaddedGrid.create(4096, 2.0, ndim=2)) == [range(0, 1), range(1, 2), range(2, 3)]


@pytest.mark.gpu
def test_a_stack_of_2d_classes_steps_on_the_gpu_as_on_the_host():
    """`update_classes_2d` with the sums on the GPU gives the host's updates."""
    from conftest import cupy_or_skip

    cp = cupy_or_skip()
    previous, halves, moments, settings = class_step_inputs(2)
    fresh = gradient.Moments.start(gradient.full_grid(previous.shape[0], settings["padding_factor"], 2))
    step = settings.pop("step")
    inputs = ([previous, 2.0 * previous], [moments, fresh])
    host = gradient.update_classes_2d(inputs[0], [[(d.copy(), w.copy()) for d, w in halves] for _ in range(2)],
                                      inputs[1], steps=[step, step / 2], **settings)
    device = gradient.update_classes_2d(inputs[0], [[(cp.asarray(d), cp.asarray(w)) for d, w in halves]
                                                    for _ in range(2)], inputs[1], steps=[step, step / 2], xp=cp,
                                        **settings)
    for got, want in zip(device, host, strict=True):
        for name in ("map", "tau2", "sigma2", "fsc_estimate"):
            assert isinstance(getattr(got, name), np.ndarray), name
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-6,
                                       atol=1e-9 * float(np.abs(getattr(want, name)).max()), err_msg=name)
        np.testing.assert_allclose(got.mean_power, want.mean_power, rtol=1e-6)
        for g, w in zip([*got.moments.first, got.moments.second], [*want.moments.first, want.moments.second],
                        strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max()))

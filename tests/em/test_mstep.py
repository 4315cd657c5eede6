"""The M-step's back-projectors: --sym symmetrises the sums as RELION's symmetriseReconstructions does."""

import numpy as np
import pytest

from cryorefine.config import RefineConfig
from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.reconstruct import enforce_hermitian_symmetry, reconstruction_noise_sigma2
from cryorefine.core.symmetry import symmetry_group
from cryorefine.em import mstep
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState

N = 24


def _config(symmetry):
    return RefineConfig(input_star="", output_root="", reference_map="", symmetry=symmetry, flatten_solvent=True)


def _masks():
    """--flatten_solvent with the soft sphere (rotation invariant, so every group keeps it)."""
    return SolventMasks(flatten=True, sphere_radius_px=N / 2 - 2, edge_px=2.0)


def _sums(poses, seed=5):
    """(data, weight) of slices of a random map at `poses` (the slices of the first pose, at every pose)."""
    rng = np.random.default_rng(seed)
    first = euler_to_matrix(np.array([20.0, -70.0]), np.array([40.0, 110.0]), np.array([5.0, 60.0]))
    slices = Projector(rng.normal(size=(N, N, N)), 2.0).project(first)
    weights = rng.uniform(0.5, 1.0, size=slices.shape)  # as CTF²
    bp = BackProjector(N, 2.0)
    for extra in poses:
        bp.backproject(slices, weights, first @ extra.T)
    return bp.data, bp.weight


@pytest.mark.parametrize("name", ["C4", "D2"])
def test_mstep_map_of_symmetrised_sums_is_that_of_every_equivalent_view(name):
    # C4 and D2 permute the grid: the M-step with --sym must give what C1 gives for the views back-projected at
    # every equivalent pose, τ² regularisation included (the x = 0 plane made Hermitian once, not twice).
    g = symmetry_group(name)
    model = ModelState(ori_size_px=N, pixel_size_angstrom=3.0)
    tau2 = np.random.default_rng(1).uniform(0.01, 0.1, N // 2 + 1)
    sym = mstep.backprojector(*_sums([np.eye(3)]), model, _config(name), N, np)
    every = mstep.backprojector(*_sums(g.rotations), model, _config("C1"), N, np)
    a = mstep.reconstruct_map(sym, tau2, model, _config(name), np, _masks())
    b = mstep.reconstruct_map(every, tau2, model, _config("C1"), np, _masks())
    np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max())
    # RELION's noise spectrum of the reconstruction is taken from the symmetrised (so Hermitian) weights
    hermitian = enforce_hermitian_symmetry(every.data, every.weight)[1]
    np.testing.assert_allclose(sym.noise_sigma2(), reconstruction_noise_sigma2(hermitian, every.grid), rtol=1e-9)
    # the final iteration's joined halves (the second's sums added into the first's)
    sym2 = mstep.backprojector(*_sums([np.eye(3)]), model, _config(name), N, np)
    every2 = mstep.backprojector(*_sums(g.rotations), model, _config("C1"), N, np)
    joined = mstep.joined_backprojector(sym, [(sym2.data, sym2.weight)])
    joined_every = mstep.joined_backprojector(every, [(every2.data, every2.weight)])
    np.testing.assert_allclose(mstep.reconstruct_map(joined, tau2 * 2, model, _config(name), np, _masks()),
                               mstep.reconstruct_map(joined_every, tau2 * 2, model, _config("C1"), np, _masks()),
                               atol=1e-5 * np.abs(b).max())


def test_c1_leaves_the_sums_as_they_are():
    data, weight = _sums([np.eye(3)])
    before = data.copy(), weight.copy()
    bp = mstep.backprojector(data, weight, ModelState(ori_size_px=N, pixel_size_angstrom=3.0), _config("C1"), N, np)
    assert np.array_equal(bp.data, before[0]) and np.array_equal(bp.weight, before[1])
    assert not bp.hermitian_enforced


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["D2", "O", "I"])
def test_symmetric_mstep_on_the_device_matches_the_host(name):
    from conftest import cupy_or_skip

    cp = cupy_or_skip()
    g = symmetry_group(name)
    model = ModelState(ori_size_px=N, pixel_size_angstrom=3.0)
    tau2 = np.random.default_rng(1).uniform(0.01, 0.1, N // 2 + 1)
    data, weight = _sums([np.eye(3)] + list(g.rotations[1:3]))
    host = mstep.backprojector(data.copy(), weight.copy(), model, _config(name), N, np)
    device = mstep.backprojector(cp.asarray(data), cp.asarray(weight), model, _config(name), N, cp)
    np.testing.assert_allclose(cp.asnumpy(device.weight), host.weight, atol=1e-12 * host.weight.max())
    np.testing.assert_allclose(cp.asnumpy(device.noise_sigma2()), host.noise_sigma2(), rtol=1e-10)
    want = mstep.reconstruct_map(host, tau2, model, _config(name), np, _masks())
    got = mstep.reconstruct_map(device, tau2, model, _config(name), cp, _masks())
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_the_lowest_shells_are_not_regularised():
    # RELION's --minres_map: τ² adds 1/(pf³·T·τ²) to the weights from shell 5 on only. With a tiny τ² the
    # shells from 5 on vanish, those below keep the data over the weights (up to what the padded grid's windowing
    # spreads between neighbouring shells); regularised in every shell, they would vanish too (difference ≈ 1)
    model = ModelState(ori_size_px=N, pixel_size_angstrom=3.0)
    bp = mstep.backprojector(*_sums([np.eye(3)]), model, _config("C1"), N, np)
    tiny, large = np.full(N // 2 + 1, 1e-12), np.full(N // 2 + 1, 1e12)
    no_masks = SolventMasks(flatten=False, sphere_radius_px=N / 2 - 2, edge_px=2.0)
    k = np.meshgrid(np.fft.fftfreq(N) * N, np.fft.fftfreq(N) * N, np.fft.rfftfreq(N) * N, indexing="ij")
    shells = np.rint(np.sqrt(sum(f ** 2 for f in k))).astype(int)
    a = np.fft.rfftn(mstep.reconstruct_map(bp, tiny, model, _config("C1"), np, no_masks))
    b = np.fft.rfftn(mstep.reconstruct_map(bp, large, model, _config("C1"), np, no_masks))

    def difference(selected):
        return np.linalg.norm(a[selected] - b[selected]) / np.linalg.norm(b[selected])

    assert difference(shells <= 2) < 0.25
    assert difference((shells >= 6) & (shells < N // 2)) > 0.95


@pytest.mark.gpu
def test_float32_device_mstep_matches_the_float64_host():
    # the GPU engine's sums are float32 (complex64 data): FSC, noise spectrum, joined halves and maps from them, on
    # the device in slabs, against the host's float64 M-step of the same sums
    from conftest import cupy_or_skip

    cp = cupy_or_skip()
    model = ModelState(ori_size_px=N, pixel_size_angstrom=3.0)
    tau2 = np.random.default_rng(1).uniform(0.01, 0.1, N // 2 + 1)
    halves = [_sums([np.eye(3)], seed=5), _sums([np.eye(3)], seed=6)]
    host = [mstep.backprojector(d.copy(), w.copy(), model, _config("C1"), N, np) for d, w in halves]
    device = [mstep.backprojector(cp.asarray(d, dtype=cp.complex64), cp.asarray(w, dtype=cp.float32), model,
                                  _config("C1"), N, cp) for d, w in halves]
    assert device[0].data.dtype == cp.complex64  # not widened
    np.testing.assert_allclose(mstep.half_sets_fsc(*[(b.data, b.weight) for b in device], device[0].grid, cp),
                               mstep.half_sets_fsc(*[(b.data, b.weight) for b in host], host[0].grid, np), atol=1e-5)
    np.testing.assert_allclose(cp.asnumpy(device[0].noise_sigma2()), host[0].noise_sigma2(), rtol=1e-5)
    for d, h in zip(device, host):
        want = mstep.reconstruct_map(h, tau2, model, _config("C1"), np, _masks())
        got = mstep.reconstruct_map(d, tau2, model, _config("C1"), cp, _masks())
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    want = mstep.reconstruct_map(mstep.joined_backprojector(host[0], [(host[1].data, host[1].weight)]), tau2 * 2,
                                 model, _config("C1"), np, _masks())
    got = mstep.reconstruct_map(mstep.joined_backprojector(device[0], [(device[1].data, device[1].weight)]), tau2 * 2,
                                model, _config("C1"), cp, _masks())
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_intensity_scales_are_clipped_about_relions_median_and_averaged_over_the_particles():
    """RELION's maximizationOtherParameters with --scale, worked by hand: four groups whose sums give the scales
    1, 2, 3 and 20; the median is the upper middle value, 3 (not 2.5), so 20 is clipped to 15; the groups hold 1, 1, 1
    and 5 particles, so the scales are divided by (1 + 2 + 3 + 5·15)/8 = 81/8, not by the groups' mean 21/4."""
    from cryorefine.estep.engine import WeightedSums

    box = 8
    sums = WeightedSums.zeros((box, box, box // 2 + 1), 1, 1, box // 2 + 1, 1, n_scale_groups=4)
    sums.scale_aa = np.array([2.0, 1.0, 1.0, 0.5])
    sums.scale_xa = np.array([1.0, 2.0, 3.0, 20.0]) * sums.scale_aa
    sums.sigma2_noise[:] = 1.0
    sums.sumw_group[:] = 8.0
    sums.n_particles = 8
    model = ModelState(box, 2.0, sigma2_noise=np.ones((1, box // 2 + 1)), scale_correction=np.ones(4),
                       particles_per_scale_group=np.array([1, 1, 1, 5]))
    config = RefineConfig(input_star="p.star", output_root="r", reference_map="m.mrc", do_scale=True)
    mstep.maximize_other_parameters(model, config, [sums], do_cc=False)
    np.testing.assert_allclose(model.scale_correction, np.array([1.0, 2.0, 3.0, 15.0]) * 8.0 / 81.0)


def test_the_rest_of_an_m_step_is_what_its_parts_leave_of_it():
    """`parts_with_rest`: the M-step's seconds in none of the job's timed parts, never negative (the parts are timed
    apart from the whole and may round above it); a job that times no parts gets none."""
    parts = {"reconstructions": 0.5, "other parameters": 0.25}
    with_rest = mstep.parts_with_rest(parts, 1.0)
    assert with_rest == {"reconstructions": 0.5, "other parameters": 0.25, mstep.REST_PART: pytest.approx(0.25)}
    assert parts == {"reconstructions": 0.5, "other parameters": 0.25}  # the job's own dict is left as it was
    assert mstep.parts_with_rest(parts, 0.7)[mstep.REST_PART] == 0.0
    assert mstep.parts_with_rest({}, 1.0) == {}

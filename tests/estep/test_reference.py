"""The numpy E-step engine against brute force, on small random problems."""

from dataclasses import fields, replace

import numpy as np
import pytest
from conftest import significance_by_full_sort

from cryorefine.core import euler, fourier
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.sampling import Sampling
from cryorefine.estep.common import Coefficients
from cryorefine.estep.engine import Batch, IterationSetup
from cryorefine.estep.reference import NumpyEngine

N = 16


def blob_volume(rng, n=N, blobs=6):
    z, y, x = np.mgrid[:n, :n, :n] - n // 2
    vol = np.zeros((n, n, n))
    for _ in range(blobs):
        c = rng.uniform(-n / 5, n / 5, 3)
        vol += np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) / (2 * rng.uniform(1.0, 2.0) ** 2))
    return vol


def make_batch(images_ft, ctf, origins, residual=None):
    b = images_ft.shape[0]
    residual = np.zeros((b, 2)) if residual is None else residual
    return Batch(indices=np.arange(b), images_ft=images_ft, images_ft_unmasked=images_ft, ctf=ctf,
                 optics_index=np.zeros(b, np.int64), old_origin_px=origins, residual_origin_px=residual,
                 prior_rot_deg=np.zeros(b), prior_tilt_deg=np.zeros(b), prior_psi_deg=np.zeros(b),
                 old_class=np.zeros(b, np.int64), norm_correction=np.ones(b),
                 power_beyond_current=np.zeros((b, N // 2 + 1)))


def noisy_projections(rng, projector, n, noise):
    """Half transforms of n projections at random poses plus white noise of standard deviation `noise`."""
    images = projector.project(euler.euler_to_matrix(*rng.uniform(0, 180, (3, n))), N)
    return images + fourier.rfft2_centered(rng.normal(size=(n, N, N)) * noise)


@pytest.fixture
def problem():
    rng = np.random.default_rng(11)
    volume = blob_volume(rng)
    projector = Projector(volume)
    sampling = Sampling(healpix_order=1, offset_range_px=2, offset_step_px=2)
    sigma2 = rng.uniform(0.5, 2.0, (1, N // 2 + 1)) * 1e-4
    return rng, volume, projector, sampling, sigma2


def setup_for(projector, sampling, sigma2, coarse=N, **kw):
    return IterationSetup(projectors=[projector], sigma2_noise=sigma2, sampling=sampling, ori_size_px=N,
                          current_size_px=N, coarse_size_px=coarse, pixel_size_angstrom=2.0,
                          log_pdf_class=np.zeros(1), sigma_offset_px=3.0, **kw)


def test_coarse_diff2_equals_brute_force(problem):
    rng, volume, projector, sampling, sigma2 = problem
    engine = NumpyEngine()
    engine.setup(setup_for(projector, sampling, sigma2, coarse=12))
    images = fourier.rfft2_centered(rng.normal(size=(3, N, N)) * 0.01)
    ctf = rng.uniform(-1, 1, (3, N, N // 2 + 1))
    residual = rng.uniform(-0.5, 0.5, (3, 2))
    coarse = engine.coarse
    x = coarse.gather(fourier.window_ft_2d(images, 12))
    c = coarse.gather(fourier.window_ft_2d(ctf, 12))
    minv = engine.minv_coarse[0]
    proj = engine.coarse_projections[0]
    shifts = residual[:, None, :] + engine.translations[None]
    x_shift = x[:, None, :] * coarse.phase(shifts, N, complex)
    got = engine._diff2_dense(x, x_shift, c, engine.minv_coarse[[0, 0, 0]], proj)  # (B, R, T)
    for b in range(3):
        for r in rng.choice(proj.shape[0], 5, replace=False):
            for t in range(engine.translations.shape[0]):
                expected = 0.5 * np.sum(minv * np.abs(x_shift[b, t] - c[b] * proj[r]) ** 2)
                assert got[b, r, t] == pytest.approx(expected, rel=1e-10)
    # the coarse projections are the projector's slices at the coarse size
    direct = coarse.gather(projector.project(engine.tables.orientation_matrices()[:4], 12))
    np.testing.assert_allclose(proj[:4], direct, rtol=1e-12, atol=1e-15)


def test_noise_free_particles_at_grid_poses_are_found_exactly(problem):
    rng, volume, projector, sampling, sigma2 = problem
    engine = NumpyEngine()
    # noise broad enough that the coarse pass keeps the true pose's parent among the significant samples, and a flat
    # offset prior: under noise this broad the prior each child takes from its coarse translation would outweigh
    # the likelihood's preference within a coarse step
    engine.setup(replace(setup_for(projector, sampling, sigma2 * 1e3, adaptive_fraction=0.99999), sigma_offset_px=1e3))
    # true poses: fine-grid children of random coarse samples; origins = coarse translation + child offset
    coarse_index = rng.choice(sampling.n_coarse_samples, 4, replace=False)
    rot, tilt, psi, tx, ty = sampling.fine_samples_flat(coarse_index)
    child = rng.integers(0, rot.shape[1], 4)
    pick = (np.arange(4), child)
    truth = euler.euler_to_matrix(rot[pick], tilt[pick], psi[pick])
    origins = np.stack([tx[pick], ty[pick]], axis=1)
    slices = projector.project(truth, N)
    # a particle with origin o sits at centre − o: the image is the projection moved by −o
    images = fourier.phase_shift_2d(slices, -origins[:, 0], -origins[:, 1], N)
    ctf = np.ones((4, N, N // 2 + 1))
    result = engine.run(make_batch(images, ctf, np.zeros((4, 2))))
    found = euler.euler_to_matrix(result.rot_deg, result.tilt_deg, result.psi_deg)
    np.testing.assert_allclose(found, truth, atol=1e-9)
    np.testing.assert_allclose(result.origin_x_px, origins[:, 0], atol=1e-9)
    np.testing.assert_allclose(result.origin_y_px, origins[:, 1], atol=1e-9)


def test_weights_are_normalised_and_blocks_hold_32_children(problem):
    rng, volume, projector, sampling, sigma2 = problem
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup_for(projector, sampling, sigma2 * 1e4, adaptive_fraction=0.999))
    images = noisy_projections(rng, projector, 5, 0.02)
    result = engine.run(make_batch(images, np.ones((5, N, N // 2 + 1)), np.zeros((5, 2))))
    sums = engine.sums()
    # kept fine samples hold at least adaptive_fraction of each particle's mass
    assert sums.pdf_class[0] >= 0.999 * 5 - 1e-9 and sums.pdf_class[0] <= 5 + 1e-9
    assert sums.pdf_direction.sum() == pytest.approx(sums.pdf_class[0])
    for blocks, pmax, n_sig in zip(engine.last_blocks, result.pmax, result.n_significant):
        assert blocks.weights.shape == (n_sig, 32)
        assert blocks.weights.max() == pytest.approx(pmax)
        assert blocks.weights.sum() <= 1 + 1e-12
        assert np.unique(blocks.coarse_index).size == blocks.coarse_index.size
    assert (result.pmax > 0).all() and (result.pmax <= 1).all()


def test_weighted_sums_equal_sample_by_sample_back_projection(problem):
    """The engine's per-orientation sums equal back-projecting every kept fine sample on its own:
    w·CTF·X_shifted/σ² into data and w·CTF²/σ² into weight, X moved by its origin."""
    rng, volume, projector, sampling, sigma2 = problem
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup_for(projector, sampling, sigma2 * 10))
    matrices = euler.euler_to_matrix(*rng.uniform(0, 180, (3, 2)))
    ctf = np.broadcast_to(fourier.radius_2d(N) / N + 0.5, (2, N, N // 2 + 1)).copy()
    images = projector.project(matrices, N) * ctf + fourier.rfft2_centered(rng.normal(size=(2, N, N)) * 0.02)
    residual = rng.uniform(-0.5, 0.5, (2, 2))
    old = rng.uniform(-1, 1, (2, 2))
    engine.run(make_batch(images, ctf, old, residual))
    sums = engine.sums()
    expected = BackProjector(N, 2.0, N // 2)
    coef = engine.fine
    minv = engine.minv_store[0]
    n_samples = 0
    for b, blocks in enumerate(engine.last_blocks):
        per_class = sampling.n_orientations * sampling.n_translations
        rot, tilt, psi, tx, ty = sampling.fine_samples_flat(blocks.coarse_index % per_class)
        for i, f in zip(*np.nonzero(blocks.weights)):
            w = blocks.weights[i, f]
            shifted = fourier.phase_shift_2d(images[b], residual[b, 0] + tx[i, f], residual[b, 1] + ty[i, f], N)
            data = coef.scatter(coef.gather(shifted * ctf[b]) * minv * w)[None]
            weight = coef.scatter(coef.gather(ctf[b] ** 2) * minv * w)[None]
            expected.backproject(data, weight, euler.euler_to_matrix(rot[i, f], tilt[i, f], psi[i, f])[None])
            n_samples += 1
    assert n_samples > 2
    scale = np.abs(expected.data).max()
    np.testing.assert_allclose(sums.data[0], expected.data, rtol=1e-8, atol=1e-10 * scale)
    np.testing.assert_allclose(sums.weight[0], expected.weight, rtol=1e-8, atol=1e-10 * expected.weight.max())


def test_scale_sums_equal_sample_by_sample_sums_per_class(problem):
    """The scale sums (RELION's per-group scale correction) equal their definition summed sample by sample: w·Σ
    use·CTF·Re(X_shifted·conj(P)) and w·Σ use·CTF²·|P|², P the kept sample's projection of its own class and `use`
    that class's coefficients whose data-vs-prior ratio exceeds 3."""
    rng, volume, projector, sampling, sigma2 = problem
    projectors = [projector, Projector(blob_volume(rng))]
    dvp = np.array([np.full(N // 2 + 1, 10.0), np.where(np.arange(N // 2 + 1) < N // 4, 10.0, 0.0)])
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(replace(setup_for(projector, sampling, sigma2 * 30, scale_correction=np.ones(1), data_vs_prior=dvp),
                         projectors=projectors, log_pdf_class=np.log([0.5, 0.5])))
    matrices = euler.euler_to_matrix(*rng.uniform(0, 180, (3, 3)))
    ctf = np.broadcast_to(fourier.radius_2d(N) / N + 0.5, (3, N, N // 2 + 1)).copy()
    images = projector.project(matrices, N) * ctf + fourier.rfft2_centered(rng.normal(size=(3, N, N)) * 0.02)
    residual = rng.uniform(-0.5, 0.5, (3, 2))
    engine.run(make_batch(images, ctf, rng.uniform(-1, 1, (3, 2)), residual))
    sums = engine.sums()
    coef = engine.fine
    use = engine.tables.scale_use
    xa = aa = 0.0
    classes_seen = set()
    n_block = sampling.n_orientations * sampling.n_translations
    for b, blocks in enumerate(engine.last_blocks):
        rot, tilt, psi, tx, ty = sampling.fine_samples_flat(blocks.coarse_index % n_block)
        for i, f in zip(*np.nonzero(blocks.weights)):
            k = blocks.coarse_index[i] // n_block
            classes_seen.add(int(k))
            w = blocks.weights[i, f]
            mat = euler.euler_to_matrix(rot[i, f], tilt[i, f], psi[i, f])[None]
            p = coef.gather(projectors[k].project(mat, N))[0]
            x = coef.gather(fourier.phase_shift_2d(images[b], residual[b, 0] + tx[i, f], residual[b, 1] + ty[i, f], N))
            c = coef.gather(ctf[b])
            xa += w * np.sum(use[k] * c * (x.real * p.real + x.imag * p.imag))
            aa += w * np.sum(use[k] * c ** 2 * (p.real ** 2 + p.imag ** 2))
    assert classes_seen == {0, 1} and not use[1].all()  # both classes kept samples, with different coefficients
    np.testing.assert_allclose(sums.scale_xa[0], xa, rtol=1e-9)
    np.testing.assert_allclose(sums.scale_aa[0], aa, rtol=1e-9)


def test_single_precision_engine_agrees_with_double(problem):
    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 6, 0.05)
    batch = make_batch(images, np.ones((6, N, N // 2 + 1)), rng.uniform(-1, 1, (6, 2)), rng.uniform(-0.5, 0.5, (6, 2)))
    results = []
    for dtype in (np.float64, np.float32):
        engine = NumpyEngine(dtype)
        engine.setup(setup_for(projector, sampling, sigma2 * 100))
        results.append(engine.run(batch))
    a, b = results
    np.testing.assert_array_equal(a.rot_deg, b.rot_deg)
    np.testing.assert_array_equal(a.psi_deg, b.psi_deg)
    np.testing.assert_allclose(a.origin_x_px, b.origin_x_px)
    np.testing.assert_allclose(a.log_likelihood, b.log_likelihood, rtol=1e-4)


def test_cross_correlation_mode_keeps_only_the_best(problem):
    rng, volume, projector, sampling, sigma2 = problem
    engine = NumpyEngine()
    engine.setup(setup_for(projector, sampling, sigma2, do_cc=True))
    images = projector.project(euler.euler_to_matrix(*rng.uniform(0, 180, (3, 3))), N) * 7.0  # CC ignores scale
    result = engine.run(make_batch(images, np.ones((3, N, N // 2 + 1)), np.zeros((3, 2))))
    assert (result.pmax == 1.0).all()
    assert (result.n_significant == 1).all()
    assert engine.sums().pdf_class[0] == pytest.approx(3.0)


def test_coefficients_cover_the_half_plane_once():
    c = Coefficients.create(12)
    kx, ky = c.kx, c.ky
    assert ((kx == 0) & (ky < 0)).sum() == 0
    assert (kx ** 2 + ky ** 2 <= 36).all()
    full = {(int(a), int(b)) for a, b in zip(kx, ky)}
    for x in range(-6, 7):
        for y in range(-6, 7):
            if x * x + y * y <= 36 and (x, y) != (0, 0):
                assert (x, y) in full or (-x, -y) in full


@pytest.mark.parametrize("coarse, fine", [(26, 36), (100, 214), (198, 214), (214, 360), (31, 64)])
def test_coefficients_of_a_smaller_size_keep_their_order_among_a_larger_one_s(coarse, fine):
    """The engines take the coarse coefficients out of the fine ones in the fine order (IterationTables'
    coarse_selection) and use them in the coarse order: the two orders must agree. And consecutive coefficients
    are neighbours in the plane: each tile of 4 ky rows × 8 kx is one run of the order (in row order, none is)."""
    small, large = Coefficients.create(coarse), Coefficients.create(fine)
    inside = large.kx ** 2 + large.ky ** 2 <= (coarse / 2) ** 2
    np.testing.assert_array_equal(large.kx[inside], small.kx)
    np.testing.assert_array_equal(large.ky[inside], small.ky)
    tile = (np.floor_divide(large.ky, 4).astype(np.int64) << 32) + np.floor_divide(large.kx, 8).astype(np.int64)
    starts = np.flatnonzero(np.diff(tile) != 0) + 1  # each tile one run of consecutive coefficients
    assert np.unique(tile).size == starts.size + 1
    assert (np.diff(np.concatenate([[0], starts, [tile.size]])) == 32).sum() > tile.size // 64  # most are whole


def test_fine_pass_in_groups_gives_the_same_result(problem):
    """Splitting a batch's coarse and fine passes into chunks and groups of particles, and keeping the fine
    grid's projections and slices for the unit or not (to bound memory), changes nothing."""
    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 5, 0.05)
    batch = make_batch(images, np.ones((5, N, N // 2 + 1)), rng.uniform(-1, 1, (5, 2)))
    outputs = []
    for limit in (1 << 30, 1):  # one group; one particle per group
        engine = NumpyEngine()
        engine.fine_table_elements = limit
        engine.coarse_elements = limit
        engine.iteration_slice_elements = limit  # the fine grid's projections and slices kept, or not
        engine.setup(setup_for(projector, sampling, sigma2 * 100))
        outputs.append((engine.run(batch), engine.sums()))
    (a, sa), (b, sb) = outputs
    for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "pmax", "log_likelihood", "norm_correction"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12)
    np.testing.assert_allclose(sa.data[0], sb.data[0], rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(sa.sigma2_noise, sb.sigma2_noise, rtol=1e-12)


def _weight_rows(seed, n_rows=40, n_samples=5000):
    """Rows like the coarse pass's: exp(−Δ) of a spread of posteriors, sharp to flat, maximum 1 each."""
    rng = np.random.default_rng(seed)
    breadth = np.geomspace(0.02, 200.0, n_rows)[:, None]
    delta = rng.exponential(1.0, (n_rows, n_samples)) * rng.uniform(1, 50, (n_rows, 1)) / breadth
    delta[np.arange(n_rows), rng.integers(0, n_samples, n_rows)] = 0.0
    weights = np.exp(-delta)
    weights[3, 10:20] = 1.0  # ties at the top
    weights[5] = 0.0
    weights[5, 7] = 1.0  # a one-hot row (cross-correlation iterations)
    return weights


@pytest.mark.parametrize("fraction,max_sig", [(0.999, 0), (0.5, 0), (1.0, 0), (0.999, 25)])
def test_significance_on_candidates_equals_the_full_sort(fraction, max_sig):
    from cryorefine.estep.common import significant_samples

    weights = _weight_rows(11)
    want_mask, want_n = significance_by_full_sort(weights, fraction, max_sig)
    mask, n_sig = significant_samples(weights, fraction, max_sig, np)
    np.testing.assert_array_equal(n_sig, want_n)
    np.testing.assert_array_equal(mask, want_mask)
    if fraction == 1.0:
        np.testing.assert_array_equal(mask, weights > np.finfo(np.float64).tiny)
    assert want_n.min() == 1 and (fraction == 1.0 or 1 < want_n.max() < weights.shape[1])  # sharp to broad rows


def test_threads_change_nothing(problem):
    """The fine pass on several threads adds each particle's sums in particle order: the same sums, bit for bit."""
    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 7, 0.05)
    batch = make_batch(images, np.ones((7, N, N // 2 + 1)), rng.uniform(-1, 1, (7, 2)), rng.uniform(-0.5, 0.5, (7, 2)))
    outputs = []
    for threads in (1, 3):
        engine = NumpyEngine(np.float32, threads=threads)
        engine.setup(setup_for(projector, sampling, sigma2 * 100))
        outputs.append((engine.run(batch), engine.sums()))
    (a, sa), (b, sb) = outputs
    for name in ("rot_deg", "psi_deg", "origin_x_px", "pmax", "log_likelihood", "norm_correction"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(sa.data[0], sb.data[0])
    np.testing.assert_array_equal(sa.sigma2_noise, sb.sigma2_noise)
    assert sa.sigma2_offset_angstrom2 == sb.sigma2_offset_angstrom2


def test_rows_taken_a_chunk_at_a_time_change_nothing(monkeypatch, problem):
    """A particle's fine pass takes its table's rows in chunks (to bound memory): one row a chunk gives the
    results and sums of whole tables, two classes' rows in one chunk or in many."""
    from cryorefine.estep import reference

    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 4, 0.05)
    batch = make_batch(images, np.ones((4, N, N // 2 + 1)), rng.uniform(-1, 1, (4, 2)))
    second = Projector(blob_volume(rng))
    outputs = []
    for elements in (1 << 30, 1):
        monkeypatch.setattr(reference, "ROW_CHUNK_ELEMENTS", elements)
        engine = NumpyEngine()
        setup = setup_for(projector, sampling, sigma2 * 1e4, scale_correction=np.ones(1),
                          data_vs_prior=np.array([np.full(N // 2 + 1, 10.0), np.linspace(10.0, 0.0, N // 2 + 1)]))
        engine.setup(replace(setup, projectors=[projector, second], log_pdf_class=np.log([0.6, 0.4])))
        outputs.append((engine.run(batch), engine.sums()))
    (a, sa), (b, sb) = outputs
    assert (a.n_significant > 50).all()  # broad enough for many rows a particle
    assert sb.scale_xa.any() and sb.scale_aa.any() and (sb.pdf_class > 0.1).all()  # the scale sums, both classes
    for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "class_index", "pmax", "log_likelihood",
                 "norm_correction"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12)
    for k in range(2):
        np.testing.assert_allclose(sa.data[k], sb.data[k], rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(sa.weight[k], sb.weight[k], rtol=1e-10, atol=1e-14)
    for name in ("sigma2_noise", "scale_xa", "scale_aa", "pdf_class", "pdf_direction"):  # sums of differences
        want = getattr(sb, name)
        np.testing.assert_allclose(getattr(sa, name), want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("threads", [1, 3])
def test_a_flat_posterior_s_fine_pass_holds_the_grid_and_a_table_a_thread(monkeypatch, threads):
    """A flat posterior puts every (class, orientation, translation) into each particle's fine table. The fine
    pass then holds the unit's fine grid (projections and slices) and, per particle under way, its slices and its
    (rows × columns) tables, but no further copies of them: its peak stays within twice their sum (the chunks of
    rows taken small here, so that they count for little)."""
    import tracemalloc

    from cryorefine.estep import reference

    monkeypatch.setattr(reference, "ROW_CHUNK_ELEMENTS", 1 << 14)
    rng = np.random.default_rng(5)
    projectors = [Projector(blob_volume(rng)) for _ in range(2)]
    sampling = Sampling(healpix_order=1, offset_range_px=6, offset_step_px=2)
    n = 8
    batch = make_batch(noisy_projections(rng, projectors[0], n, 0.05), np.ones((n, N, N // 2 + 1)), np.zeros((n, 2)))
    flat = setup_for(projectors[0], sampling, np.full((1, N // 2 + 1), 1e6))
    engine = NumpyEngine(threads=threads)
    engine.setup(replace(flat, projectors=projectors, log_pdf_class=np.log([0.5, 0.5]), sigma_offset_px=30.0))
    n_coef, t = engine.fine.positions.size, engine.tables
    rows = 2 * sampling.n_orientations * t.n_fine_orientations
    grid = rows * n_coef * (16 + 16 + 8)  # projections, data, weight
    per_particle = rows * n_coef * 16 + rows * sampling.n_translations * t.n_fine_translations * 8
    tracemalloc.start()
    try:
        result = engine.run(batch)
        engine.sums()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (result.n_significant > 0.99 * 2 * sampling.n_orientations * sampling.n_translations).all()  # flat
    print(f"peak {peak / 1e6:.0f} MB, grid {grid / 1e6:.0f} MB, a particle {per_particle / 1e6:.0f} MB")
    assert peak < 2 * (grid + (threads + 1) * per_particle)


def test_local_search_scores_each_particle_alone(problem):
    """A local search scores each particle on its own orientations: a batch gives each particle the poses,
    weights and sums it gets in a batch of its own."""
    rng, volume, projector, sampling, sigma2 = problem
    rot, tilt, psi = rng.uniform(-180, 180, 6), rng.uniform(10, 170, 6), rng.uniform(-180, 180, 6)
    images = projector.project(euler.euler_to_matrix(rot, tilt, psi), N)
    images = images + fourier.rfft2_centered(rng.normal(size=(6, N, N)) * 0.05)
    batch = make_batch(images, np.ones((6, N, N // 2 + 1)), rng.uniform(-1, 1, (6, 2)))
    batch.prior_rot_deg[:], batch.prior_tilt_deg[:], batch.prior_psi_deg[:] = rot + 3, tilt - 2, psi + 4
    setup = setup_for(projector, sampling, sigma2 * 100, local_searches=True, sigma_rot_deg=12.0, sigma_psi_deg=12.0)
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup)
    together = engine.run(batch)
    blocks = engine.last_blocks
    assert 1 < np.mean(together.n_significant)
    for b in range(6):
        alone_engine = NumpyEngine(keep_blocks=True)
        alone_engine.setup(setup)
        one = {f.name: getattr(batch, f.name)[b:b + 1] for f in fields(batch)}
        alone = alone_engine.run(type(batch)(**one))
        for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "pmax", "n_significant"):
            np.testing.assert_allclose(getattr(alone, name)[0], getattr(together, name)[b], rtol=1e-12)
        np.testing.assert_allclose(alone.log_likelihood[0], together.log_likelihood[b], rtol=1e-10)
        np.testing.assert_array_equal(alone_engine.last_blocks[0].coarse_index, blocks[b].coarse_index)
        np.testing.assert_allclose(alone_engine.last_blocks[0].weights, blocks[b].weights, rtol=1e-9, atol=1e-15)


def test_local_search_across_the_asymmetric_unit_border_finds_the_symmetry_mate():
    """C4: a particle whose previous pose lies outside the unit (rot + 90°) is searched around that pose's
    mates (RELION's selectOrientationsWithNonZeroPriorProbability): the pose found is the truth's mate in the
    unit, exactly."""
    from cryorefine.core.symmetry import angular_distance_deg, symmetrise_volume, symmetry_group

    rng = np.random.default_rng(5)
    group = symmetry_group("C4")
    projector = Projector(symmetrise_volume(blob_volume(rng), group))
    sampling = Sampling(healpix_order=2, offset_range_px=2, offset_step_px=2, symmetry="C4")
    sigma2 = rng.uniform(0.5, 2.0, (1, N // 2 + 1)) * 1e-1
    engine = NumpyEngine()
    engine.setup(setup_for(projector, sampling, sigma2, adaptive_fraction=0.99999, local_searches=True,
                           sigma_rot_deg=8.0, sigma_psi_deg=8.0))
    inner = np.flatnonzero(np.abs(sampling.directions_deg()[:, 0]) < 30) * sampling.n_psi * sampling.n_translations
    coarse_index = rng.choice(inner, 3, replace=False)  # coarse samples well inside the unit, zero offsets
    rot, tilt, psi, tx, ty = sampling.fine_samples_flat(coarse_index)
    pick = (np.arange(3), rng.integers(0, rot.shape[1], 3))
    truth = euler.euler_to_matrix(rot[pick], tilt[pick], psi[pick])
    quarter = group.rotations[np.argmin([abs(r[0, 1] + 1) for r in group.rotations])]  # 90° about z
    mate = truth @ quarter.T  # the same projection, direction rotated by 90° out of the unit
    prior_rot, prior_tilt, prior_psi = euler.matrix_to_euler(mate)
    assert np.all(np.abs(prior_rot) > 45)
    origins = np.stack([tx[pick], ty[pick]], axis=1)
    images = fourier.phase_shift_2d(projector.project(truth, N), -origins[:, 0], -origins[:, 1], N)
    batch = replace(make_batch(images, np.ones((3, N, N // 2 + 1)), np.zeros((3, 2))), prior_rot_deg=prior_rot,
                    prior_tilt_deg=prior_tilt, prior_psi_deg=prior_psi)
    result = engine.run(batch)
    found = euler.euler_to_matrix(result.rot_deg, result.tilt_deg, result.psi_deg)
    np.testing.assert_allclose(found, truth, atol=1e-9)
    assert np.all(angular_distance_deg(found, mate, group) < 1e-6)


def test_the_likelihood_size_leaves_the_coefficients_beyond_it_out_of_the_posterior(problem):
    """--strict_highres_exp (likelihood_size_px 10 of 16 px, the coarse pass at that size as the schedule sets it):
    what the images hold beyond |k| = 5 changes no pose, class or pmax; without the limit it does."""
    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 4, 0.02)
    ky, kx = fourier.frequencies_2d(N)
    beyond = kx ** 2 + ky ** 2 > 25
    changed = images + beyond * (rng.normal(size=images.shape) + 1j * rng.normal(size=images.shape)) * 0.05
    ctf = np.ones((4, N, N // 2 + 1))

    def results(likelihood_size, imgs):
        engine = NumpyEngine()
        engine.setup(setup_for(projector, sampling, sigma2 * 1e3, coarse=10, likelihood_size_px=likelihood_size))
        return engine.run(make_batch(imgs, ctf, np.zeros((4, 2))))

    limited, limited_changed = results(10, images), results(10, changed)
    for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "origin_y_px", "pmax"):
        np.testing.assert_allclose(getattr(limited_changed, name), getattr(limited, name), rtol=1e-9, atol=1e-9)
    whole, whole_changed = results(None, images), results(None, changed)
    assert not np.allclose(whole_changed.pmax, whole.pmax, rtol=1e-6)


def _fits(n, n_pairs, n_translations, children_o, children_t, samples, cells, raised):
    """Whether n significant coarse samples fit: their fine samples, and in a raised pass the worst table they can
    span (as many distinct (class, orientation) pairs and translations as they can, each with its children)."""
    table = min(n, n_pairs) * children_o * min(n, n_translations) * children_t
    return n * children_o * children_t <= samples and (not raised or table <= cells)


@pytest.mark.parametrize("order, offset_range, oversampling, k_classes, samples, cells, raised", [
    (2, 6, 2, 1, 1 << 25, 1 << 24, True),  # a classification's finer pass on the built-in example's grid
    (2, 6, 1, 1, 1 << 25, 1 << 24, True),  # the same grid at RELION's oversampling fits whole
    (1, 3, 1, 2, 1 << 25, 1 << 14, True),  # fewer samples than translations
    (1, 3, 2, 3, 1 << 25, 1 << 20, True),
    (2, 6, 2, 1, 1 << 25, 1 << 24, False),  # not raised: the fine samples alone
    (1, 3, 1, 2, 1 << 12, 1 << 24, False)])
def test_the_fine_pass_limit_is_the_most_samples_that_fit(monkeypatch, order, offset_range, oversampling,
                                                          k_classes, samples, cells, raised):
    from cryorefine.estep import common

    monkeypatch.setattr(common, "FINE_SAMPLES_PER_PARTICLE", samples)
    monkeypatch.setattr(common, "FINE_CELLS_PER_PARTICLE", cells)
    sampling = Sampling(healpix_order=order, offset_range_px=offset_range, offset_step_px=offset_range / 3,
                        oversampling=oversampling)
    setup = IterationSetup(projectors=None, sigma2_noise=np.ones((1, 3)), sampling=sampling, ori_size_px=N,
                           current_size_px=N, coarse_size_px=N, pixel_size_angstrom=2.0,
                           log_pdf_class=np.zeros(k_classes), fine_pass_raised=raised)
    n_pairs, n_t = k_classes * sampling.n_orientations, sampling.n_translations
    fits = lambda n: _fits(n, n_pairs, n_t, 8 ** oversampling, 4 ** oversampling, samples, cells, raised)  # noqa: E731
    limit = common.fine_pass_limit(setup)
    if fits(n_pairs * n_t):
        assert limit == 0
    else:
        assert 1 <= limit < n_pairs * n_t
        assert fits(limit) and not fits(limit + 1)


@pytest.mark.parametrize("maxsig, want", [(-1, "limit"), (0, "limit"), (5, 5), (10 ** 9, "limit")])
def test_maxsig_and_the_fine_pass_limit_keep_the_smaller(monkeypatch, problem, maxsig, want):
    from cryorefine.estep import common

    _, _, projector, sampling, sigma2 = problem
    monkeypatch.setattr(common, "FINE_CELLS_PER_PARTICLE", 1 << 12)
    setup = setup_for(projector, sampling, sigma2, max_significants=maxsig, fine_pass_raised=True)
    limit = common.fine_pass_limit(setup)
    assert limit > 5
    assert common.significants_limit(setup) == (limit if want == "limit" else want)
    monkeypatch.setattr(common, "FINE_CELLS_PER_PARTICLE", 1 << 40)  # every sample fits: --maxsig alone
    assert common.significants_limit(setup) == maxsig
    assert common.significants_limit(replace(setup, fine_pass_raised=False)) == maxsig  # RELION's sampling


def test_a_broad_posterior_keeps_the_fine_pass_limit_s_most_probable_samples(monkeypatch, problem):
    """Where a finer pass's table would not fit, a particle keeps the most probable coarse samples that fit, as
    --maxsig with that number would: the same results and sums."""
    from cryorefine.estep import common

    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 4, 0.05)
    batch = make_batch(images, np.ones((4, N, N // 2 + 1)), rng.uniform(-1, 1, (4, 2)))
    broad = sigma2 * 1e6  # a nearly flat posterior: most coarse samples are significant
    monkeypatch.setattr(common, "FINE_CELLS_PER_PARTICLE", 1 << 12)
    limit = common.fine_pass_limit(setup_for(projector, sampling, broad, fine_pass_raised=True))
    limited = NumpyEngine()
    limited.setup(setup_for(projector, sampling, broad, fine_pass_raised=True))
    got = limited.run(batch)
    as_maxsig = NumpyEngine()
    as_maxsig.setup(setup_for(projector, sampling, broad, max_significants=limit))
    want = as_maxsig.run(batch)
    unlimited = NumpyEngine()
    unlimited.setup(setup_for(projector, sampling, broad))
    assert (unlimited.run(batch).n_significant > limit).all()
    assert (got.n_significant == limit).all()
    for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "pmax", "log_likelihood", "n_significant"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    np.testing.assert_array_equal(limited.sums().data[0], as_maxsig.sums().data[0])


def test_fine_blocks_are_kept_only_when_asked(problem):
    """A job's engine keeps no particle's FineBlocks (a broad posterior's are large); the results are the same."""
    rng, volume, projector, sampling, sigma2 = problem
    images = noisy_projections(rng, projector, 3, 0.05)
    batch = make_batch(images, np.ones((3, N, N // 2 + 1)), np.zeros((3, 2)))
    results = []
    for keep in (False, True):
        engine = NumpyEngine(keep_blocks=keep)
        engine.setup(setup_for(projector, sampling, sigma2 * 100))
        results.append(engine.run(batch))
        assert len(engine.last_blocks) == (3 if keep else 0)
    for name in ("rot_deg", "pmax", "log_likelihood", "n_significant"):
        np.testing.assert_array_equal(getattr(results[0], name), getattr(results[1], name))


def _offset_prior_problem(rng, n, local, prior_given):
    """n particles, previous offsets up to 1.5 px, prior centres up to 1 px from the box centre (or none given:
    RELION's (0, 0)); previous poses for a local search; the offsets' σ 1.5 px, so that the prior is felt."""
    sampling = Sampling(healpix_order=1, offset_range_px=2, offset_step_px=2)
    old = rng.uniform(-1.5, 1.5, (n, 2))
    prior = rng.uniform(-1.0, 1.0, (n, 2)) if prior_given else None
    angles = rng.uniform(-180, 180, n), rng.uniform(10, 170, n), rng.uniform(-180, 180, n)
    kw = dict(local_searches=True, sigma_rot_deg=12.0, sigma_psi_deg=12.0) if local else {}
    return sampling, old, prior, angles, kw


@pytest.mark.parametrize("prior_given", [True, False], ids=["origin prior", "no origin prior"])
@pytest.mark.parametrize("local", [True, False], ids=["local", "global"])
@pytest.mark.parametrize("scale", [1.0, 1.3], ids=["translations as they are", "Class2D's translations scaled"])
def test_the_offset_prior_is_centred_on_the_origin_prior_and_taken_at_the_coarse_translation(local, prior_given,
                                                                                              scale):
    """RELION's pdf_offset (convertAllSquaredDifferencesToWeights): exp(−|old + s·t − prior|²/2σ²) with t the coarse
    translation, prior the particle's rlnOriginX/YPriorAngst or (0, 0), in local searches as in global ones, and
    every oversampled child of t takes t's value; s is 1, or what a 2D classification sets
    (`offset_prior_translation_scale`, its pixel size in Å). Against a reference of zeros every sample fits the image
    equally (diff2 the same everywhere), so each kept child's weight is its prior alone: orientation prior ×
    offset prior, worked out here from the coarse translations."""
    from cryorefine.estep.common import local_orientations

    rng = np.random.default_rng(21)
    n = 4
    sampling, old, prior, angles, kw = _offset_prior_problem(rng, n, local, prior_given)
    setup = replace(setup_for(Projector(np.zeros((N, N, N))), sampling, np.full((1, N // 2 + 1), 1e-4),
                              adaptive_fraction=0.999, **kw), sigma_offset_px=1.5, offset_prior_translation_scale=scale)
    images = fourier.rfft2_centered(rng.normal(size=(n, N, N)))
    batch = replace(make_batch(images, np.ones((n, N, N // 2 + 1)), old, old - np.round(old)),
                    prior_rot_deg=angles[0], prior_tilt_deg=angles[1], prior_psi_deg=angles[2], origin_prior_px=prior)
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup)
    engine.run(batch)
    centre = np.zeros((n, 2)) if prior is None else prior
    neighbourhoods = local_orientations(setup, *angles)
    translations = sampling.translations_px()
    n_trans, n_orient = sampling.n_translations, sampling.n_orientations
    n_fine_t = sampling.n_fine_translations()
    for b, blocks in enumerate(engine.last_blocks):
        orientation, t = np.divmod(blocks.coarse_index, n_trans)
        orientation = orientation % n_orient
        if local:
            own = slice(neighbourhoods.offsets[b], neighbourhoods.offsets[b + 1])
            olp = dict(zip(neighbourhoods.orientation[own].tolist(), neighbourhoods.log_prior[own]))
            orientation_prior = np.array([olp[o] for o in orientation.tolist()])
        else:
            orientation_prior = np.zeros(orientation.size)
        offset_prior = -np.sum((old[b] + scale * translations[t] - centre[b]) ** 2, axis=1) / (2 * 1.5 ** 2)
        expected = np.broadcast_to((orientation_prior + offset_prior)[:, None], blocks.weights.shape)
        kept = blocks.weights > 0
        assert kept.sum() >= 0.9 * kept.size and np.unique(t).size == n_trans  # the prior is felt, not cut away
        # log w − log prior is the particle's normalisation alone (exact up to rounding)
        residual = np.log(blocks.weights[kept]) - expected[kept]
        assert np.ptp(residual) < 1e-9, (b, np.ptp(residual))
        # every child of a coarse translation has its weight: n_fine_t children per fine orientation alike
        per_t = blocks.weights.reshape(blocks.weights.shape[0], -1, n_fine_t)
        np.testing.assert_allclose(per_t, per_t[..., :1].repeat(n_fine_t, axis=2), rtol=1e-12)


@pytest.mark.parametrize("prior_given", [True, False], ids=["origin prior", "no origin prior"])
def test_sigma_offset_after_a_local_search_is_the_weighted_spread_of_the_offsets_about_the_prior(problem,
                                                                                                prior_given):
    """RELION's σ²_offset (storeWeightedSums, maximizationOtherParameters) after a local search: Σ w·|old + t −
    prior|² over the kept fine samples, t the fine translation, summed over particles and divided by 2 · the
    number of particles (two axes) — the spread of the offsets about the prior centre, not about the previous
    offsets. Worked out here sample by sample from the engine's fine weights and the sampling's fine
    translations, and compared to em.mstep's σ."""
    from cryorefine.config import RefineConfig
    from cryorefine.em import mstep
    from cryorefine.em.state import ModelState

    rng, volume, projector, _, sigma2 = problem
    n = 6
    sampling, old, prior, angles, kw = _offset_prior_problem(rng, n, True, prior_given)
    old = old * 2  # offsets of up to 3 px: their spread about the centre is well above RELION's 2 Å² floor
    truth = euler.euler_to_matrix(angles[0] - 3, angles[1] + 2, angles[2] - 4)
    images = fourier.phase_shift_2d(projector.project(truth, N), -old[:, 0], -old[:, 1], N)
    images = images + fourier.rfft2_centered(rng.normal(size=(n, N, N)) * 0.05)
    batch = replace(make_batch(images, np.ones((n, N, N // 2 + 1)), old, old - np.round(old)),
                    prior_rot_deg=angles[0], prior_tilt_deg=angles[1], prior_psi_deg=angles[2], origin_prior_px=prior)
    setup = setup_for(projector, sampling, sigma2 * 100, **kw)
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup)
    engine.run(batch)
    sums = engine.sums()
    centre = np.zeros((n, 2)) if prior is None else prior
    pixel = setup.pixel_size_angstrom
    per_class = sampling.n_orientations * sampling.n_translations
    weighted, about_old = 0.0, 0.0
    for b, blocks in enumerate(engine.last_blocks):
        *_, tx, ty = sampling.fine_samples_flat(blocks.coarse_index % per_class)  # (blocks, children) px
        dx, dy = old[b, 0] + tx - centre[b, 0], old[b, 1] + ty - centre[b, 1]
        weighted += np.sum(blocks.weights * (dx ** 2 + dy ** 2))
        about_old += np.sum(blocks.weights * (tx ** 2 + ty ** 2))
    sigma2_offset = weighted * pixel ** 2 / (2 * n)
    assert sigma2_offset > 4 * mstep.MIN_SIGMA2_OFFSET_ANGSTROM2  # above the floor …
    assert sigma2_offset > 3 * about_old * pixel ** 2 / (2 * n)  # … and far from the spread about the old offsets
    assert sums.sigma2_offset_angstrom2 == pytest.approx(weighted * pixel ** 2, rel=1e-10)
    model = ModelState(ori_size_px=N, pixel_size_angstrom=pixel, sigma2_noise=sigma2 * 100)
    mstep.maximize_other_parameters(model, RefineConfig(input_star="p.star", output_root="o/run", reference_map=""),
                                    [sums], do_cc=False)
    assert model.sigma_offset_angstrom == pytest.approx(np.sqrt(sigma2_offset), rel=1e-10)


def test_the_origin_priors_of_a_star_file_centre_the_offsets_prior(tmp_path):
    """A particle file's rlnOriginX/YPriorAngst, through `images.prepare_batch`, centre the offsets' prior: against a
    reference of zeros each kept sample's weight is its offset prior exp(−|old + t − prior|²/2σ²) alone (t its coarse
    translation, global search), with old and prior the file's origins and priors over the pixel size. Before the
    batches carried the priors the centre was (0, 0)."""
    import starfile
    from conftest import make_particle_set

    from cryorefine.data import load_particles
    from cryorefine.images import ImageSettings, prepare_batch
    from cryorefine.io import mrc

    n, pixel, sigma_px = 4, 2.0, 1.5
    star, _ = make_particle_set(tmp_path, n=n, box=N, pixel_size=pixel, seed=3, origin_priors=True)
    table = starfile.read(star)["particles"]
    old = table[["rlnOriginXAngst", "rlnOriginYAngst"]].to_numpy() / pixel
    prior = table[["rlnOriginXPriorAngst", "rlnOriginYPriorAngst"]].to_numpy() / pixel
    sampling = Sampling(healpix_order=1, offset_range_px=2, offset_step_px=2)
    setup = replace(setup_for(Projector(np.zeros((N, N, N))), sampling, np.full((1, N // 2 + 1), 1e-4),
                              adaptive_fraction=0.999), sigma_offset_px=sigma_px)
    with mrc.StackReader() as reader:
        batch = prepare_batch(load_particles(star), np.arange(n), reader, ImageSettings(N, pixel, None), N, 1.0, 1)
    engine = NumpyEngine(keep_blocks=True)
    engine.setup(setup)
    engine.run(batch)
    translations, n_trans = sampling.translations_px(), sampling.n_translations
    for b, blocks in enumerate(engine.last_blocks):
        t = blocks.coarse_index % n_trans
        assert np.unique(t).size >= 3  # the prior is felt over several translations, not cut down to one
        offset_prior = -np.sum((old[b] + translations[t] - prior[b]) ** 2, axis=1) / (2 * sigma_px ** 2)
        kept = blocks.weights > 0
        residual = np.log(blocks.weights[kept]) - np.broadcast_to(offset_prior[:, None], blocks.weights.shape)[kept]
        assert np.ptp(residual) < 1e-9, (b, np.ptp(residual))  # log w − log prior: the normalisation alone

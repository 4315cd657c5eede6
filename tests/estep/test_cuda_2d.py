"""The CuPy engine's 2D path (RELION's ref_dim 2: a 2D classification's references, compared at in-plane rotations)
against its numpy twin: the kernels of the 2D module, coarse and fine diff2, a whole batch of several classes.
The whole class2d job on the GPU against the CPU is tests/jobs/test_class2d.py's.

All tests need a CUDA device and CuPy (marker `gpu`); they skip without one.
"""

import numpy as np
import pytest
from engine_pairs import (
    assert_same_fine_weights,
    assert_same_results,
    fine_diff2_against_brute_force,
    noise_spectrum,
    run_both,
)

from cryorefine.core import euler, fourier
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.core.sampling import Sampling
from cryorefine.em.given_poses import GivenPoses
from cryorefine.estep.common import Coefficients
from cryorefine.estep.engine import Batch, IterationSetup
from cryorefine.estep.reference import NumpyEngine

pytestmark = pytest.mark.gpu


def psi_matrices(psi_deg):
    zeros = np.zeros(np.size(psi_deg))
    return euler.euler_to_matrix(zeros, zeros, np.asarray(psi_deg, dtype=np.float64))


def blob_image(rng, n, blobs=6):
    """An (n, n) image of Gaussian blobs of random places, widths and heights."""
    y, x = np.mgrid[:n, :n] - n // 2
    image = np.zeros((n, n))
    for _ in range(blobs):
        c = rng.uniform(-n / 5, n / 5, 2)
        s = rng.uniform(n / 16, n / 8)
        image += rng.uniform(0.5, 1.0) * np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2) / (2 * s * s))
    return image


def random_problem_2d(seed, n, n_particles, n_classes=3, psi_step_deg=10.0, offset_range=2.0, offset_step=1.0,
                      oversampling=1, noise=0.3, sigma_scale=1.0, skip_align=False, **setup_kw):
    """K 2D references and noisy CTF-modulated images of them at random classes, in-plane angles and origins; the
    set-up of a 2D classification's iteration (in-plane sampling, or with `skip_align` each particle's own psi)."""
    rng = np.random.default_rng(seed)
    references = [blob_image(rng, n) for _ in range(n_classes)]
    truth = rng.integers(0, n_classes, n_particles)
    psi = rng.uniform(-180, 180, n_particles)
    zeros = np.zeros(n_particles)
    mats = psi_matrices(psi)
    images = np.stack([Projector(references[k]).project(m) for k, m in zip(truth, mats)])
    ctf = np.cos(rng.uniform(0.5, 3, (n_particles, 1, 1)) * np.arange(n)[:, None] / n
                 + np.arange(n // 2 + 1)[None, :] / n)
    ctf = np.broadcast_to(ctf, images.shape).copy()
    real = fourier.irfft2_centered(images * ctf, n) + rng.normal(scale=noise * np.std(references[0]),
                                                                 size=(n_particles, n, n))
    images = fourier.rfft2_centered(real)
    sigma2 = noise_spectrum(images, n, sigma_scale)
    old = rng.uniform(-1.5, 1.5, (n_particles, 2))
    batch = Batch(indices=np.arange(n_particles), images_ft=images, images_ft_unmasked=images * 1.01, ctf=ctf,
                  optics_index=np.zeros(n_particles, np.int64), old_origin_px=old,
                  residual_origin_px=old - np.round(old), prior_rot_deg=zeros, prior_tilt_deg=zeros, prior_psi_deg=psi,
                  old_class=truth, norm_correction=rng.uniform(0.9, 1.1, n_particles),
                  power_beyond_current=np.zeros((n_particles, n // 2 + 1)))
    if skip_align:  # --skip_align: each particle its own psi and origin, the class searched (a local search)
        sampling = GivenPoses.of(zeros, zeros, psi, np.arange(n_particles))
    else:
        sampling = Sampling(0, offset_range, offset_step, psi_step_deg=psi_step_deg, oversampling=oversampling,
                            perturbation=0.3, in_plane=True)
    kw = dict(current_size_px=n, coarse_size_px=n, pixel_size_angstrom=2.0,
              log_pdf_class=np.log(np.linspace(1.0, 2.0, n_classes) / np.linspace(1.0, 2.0, n_classes).sum()),
              sigma_offset_px=3.0, local_searches=skip_align)
    kw.update(setup_kw)
    setup = IterationSetup(projectors=None, maps=references, sigma2_noise=sigma2, sampling=sampling, ori_size_px=n,
                           ref_dim=2, **kw)
    return truth, setup, batch


def geometry(grid):
    """The kernels' grid arguments (d, w, origin, pf, r_pad²) of a 2D grid (d, w)."""
    d, w = grid.shape
    return (np.int32(d), np.int32(w), np.int32(grid.origin), np.float32(grid.padding_factor),
            np.float32(grid.r_max_padded ** 2 * (1 + 1e-5)))


# ---------------------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("r_max_px", [None, 17])
def test_2d_projection_kernels_match_the_projector(cp, r_max_px):
    """project_slices and project_slices_planar of the 2D module (bilinear, in-plane rotations) against
    `Projector.project` on a 2D grid, float32; a radius below the image's keeps the coefficients beyond it 0."""
    from cryorefine.estep.kernels import kernel_module

    rng = np.random.default_rng(1)
    n, rows = 48, 50
    projector = Projector(rng.normal(size=(n, n)), r_max_px=r_max_px, dtype=np.float32)
    assert projector.grid.ndim == 2
    coef = Coefficients.create(n)
    nc = coef.positions.size
    mats = psi_matrices(rng.uniform(-180, 180, rows))
    want = coef.gather(projector.project(mats))
    module = kernel_module(ref_dim=2)
    vol = cp.asarray(projector.data, dtype=cp.complex64)
    mats_d = cp.asarray(mats.reshape(-1, 9), dtype=cp.float32)
    kx, ky = cp.asarray(coef.kx, dtype=cp.float32), cp.asarray(coef.ky, dtype=cp.float32)
    out = cp.empty((rows, nc), dtype=cp.complex64)
    module.get_function("project_slices_of_classes")(
        ((nc + 127) // 128, 7), (128,),  # fewer y blocks than slices: each takes several
        (vol, *geometry(projector.grid), np.int64(vol.size), cp.zeros(rows, dtype=cp.int32), mats_d, kx, ky,
         np.int32(nc), np.int32(rows), out))
    got = cp.asnumpy(out)
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) / scale < 1e-5
    if r_max_px is not None:
        assert np.all(got[:, coef.shell > r_max_px + 1] == 0)
    ldb = 64
    b = cp.zeros((2 * nc, ldb), dtype=cp.float32)
    p2 = cp.zeros((nc, ldb), dtype=cp.float32)
    module.get_function("project_slices_planar")(
        ((rows + 31) // 32, 5), (32, 8),
        (vol, *geometry(projector.grid), mats_d, kx, ky, np.int32(nc), np.int32(rows), np.int32(ldb), b, p2))
    b, p2 = cp.asnumpy(b), cp.asnumpy(p2)
    planar = (b[:nc, :rows] + 1j * b[nc:, :rows]).T
    assert np.max(np.abs(planar - want)) / scale < 1e-5
    np.testing.assert_allclose(p2[:, :rows].T, np.abs(got) ** 2, rtol=1e-5, atol=1e-6 * scale ** 2)


@pytest.mark.parametrize("group", [1, 2])
def test_2d_backprojection_kernel_matches_the_backprojector(cp, group):
    """backproject_slices of the 2D module into two classes' padded 2D sums (the class stride a 2D grid's size):
    random angles, and pairs 0.05° apart (a coarse angle's two children, often in one square from row to row), with
    groups of 2 summed in registers first; the sums are `BackProjector.backproject`'s on a 2D grid either way."""
    from cryorefine.estep.kernels import kernel_module

    rng = np.random.default_rng(2)
    n, rows = 32, 40
    coef = Coefficients.create(n)
    nc = coef.positions.size
    psi = rng.uniform(-180, 180, rows)
    psi[16:] = np.repeat(psi[16:40:2], 2) + rng.normal(0, 0.05, 24)
    mats = psi_matrices(psi)
    data = (rng.normal(size=(rows, nc)) + 1j * rng.normal(size=(rows, nc))).astype(np.complex64)
    weight = rng.uniform(-0.2, 1.0, (rows, nc)).astype(np.float32)  # some ≤ 0: skipped by both
    weight[19] = 0.0
    row_class = (np.arange(rows) // 4 % 2).astype(np.int32)  # whole groups to one class
    wants = []
    for k in range(2):
        want = BackProjector(n, 2.0, n // 2, dtype=np.float32, ndim=2)
        mine = row_class == k
        want.backproject(coef.scatter(data[mine]), coef.scatter(weight[mine]), mats[mine])
        wants.append(want)
    grid = wants[0].grid
    vol = cp.zeros((2,) + grid.shape, dtype=cp.complex64)
    wvol = cp.zeros((2,) + grid.shape, dtype=cp.float32)
    kernel_module(ref_dim=2).get_function("backproject_slices")(
        ((nc + 127) // 128, 3), (128,),  # fewer y blocks than groups: each takes several
        (cp.asarray(data), cp.asarray(weight), cp.asarray(mats.reshape(-1, 9), dtype=cp.float32),
         cp.asarray(row_class), np.int32(rows), np.int32(group), cp.asarray(coef.kx, dtype=cp.float32),
         cp.asarray(coef.ky, dtype=cp.float32), np.int32(nc), *geometry(grid), np.int64(vol[0].size),
         vol.view(cp.float32), wvol))
    for k, want in enumerate(wants):
        got_d, got_w = cp.asnumpy(vol[k]), cp.asnumpy(wvol[k])
        assert np.max(np.abs(got_d - want.data)) / np.max(np.abs(want.data)) < 1e-5, k
        assert np.max(np.abs(got_w - want.weight)) / np.max(want.weight) < 1e-5, k


# ---------------------------------------------------------------------------------------- diff2
def test_2d_coarse_diff2_relative_error_below_1e5(cp):
    """The coarse product of three classes' in-plane slices at a smaller coarse size, against float64."""
    from cryorefine.estep.cuda import CupyEngine

    n = 48
    _, setup, batch = random_problem_2d(4, n, 6, coarse_size_px=n // 2 + 4, offset_range=3, offset_step=1.5)
    gpu = CupyEngine(keep_blocks=True)
    gpu.setup(setup)
    gpu.run(batch)
    got = gpu.last_coarse_diff2[0]  # (B, K·R·T)
    ref = NumpyEngine(np.float64, keep_blocks=True)
    ref.setup(setup)
    sel = ref._fine_to_coarse_selection()
    x = ref.fine.gather(batch.images_ft)[:, sel]
    c = ref.fine.gather(batch.ctf)[:, sel]
    shifts = batch.residual_origin_px[:, None, :] + ref.translations[None]
    x_shift = x[:, None, :] * ref.coarse.phase(shifts, n, complex)
    minv = ref.minv_coarse[batch.optics_index]
    want = np.stack([ref._diff2_dense(x, x_shift, c, minv, p) for p in ref.coarse_projections], axis=1)
    assert want.shape == (6, 3, 36, 13)  # 36 psi; 13 translations within 3 px at steps of 1.5 px
    want = want.reshape(got.shape)
    rel = np.max(np.abs(got - want) / np.abs(want))
    print(f"2D coarse diff2: max relative error vs float64 {rel:.2e}")
    assert rel <= 1e-5, rel
    np.testing.assert_array_equal(np.argmin(got, axis=1), np.argmin(want, axis=1))


@pytest.mark.parametrize("oversampling", [1, 2])  # 2 × 4 and 4 × 16 children a block
def test_2d_fine_diff2_relative_error_below_1e5(cp, oversampling, fine_slices):
    """The fine pass's diff2 of every child against float64 brute force: 0.5·Σ minv·|X moved − CTF·P|² with P the
    class's reference rotated in plane to the child's psi (`Projector.project` on the 2D grid)."""
    from cryorefine.estep.cuda import CupyEngine

    _, setup, batch = random_problem_2d(6, 40, 5, sigma_scale=30.0, oversampling=oversampling)
    gpu = CupyEngine(keep_blocks=True)
    gpu.setup(setup)
    gpu.run(batch)
    ref = NumpyEngine(np.float64, keep_blocks=True)
    ref.setup(setup)
    b_blk, k_blk = gpu.last_fine[0][:2]
    assert b_blk.size > 5 and np.unique(cp.asnumpy(k_blk) if hasattr(k_blk, "get") else k_blk).size > 1
    assert gpu.last_fine[0][4].shape[1] == 2 ** oversampling * 4 ** oversampling  # children a block

    def in_plane(rot, tilt, psi):
        assert np.all(rot == 0) and np.all(tilt == 0)
        return psi_matrices(psi)

    got, want = fine_diff2_against_brute_force(cp, ref, setup, batch, gpu.last_fine[0], in_plane)
    rel = np.max(np.abs(got - want) / np.abs(want))
    print(f"2D fine diff2: {got.size} children, max relative error vs float64 {rel:.2e}")
    assert rel <= 1e-5, rel


# ---------------------------------------------------------------------------------------- a whole batch
@pytest.mark.parametrize("kw", [dict(), dict(sigma_scale=5.0), dict(coarse_size_px=20), dict(oversampling=2),
                                dict(skip_align=True), dict(sigma_scale=1.0, max_significants=15),
                                # RELION's Class2D offset prior: the translations count 1.5 times in it, σ 1.5 px
                                dict(sigma_scale=5.0, sigma_offset_px=1.5, offset_prior_translation_scale=1.5)],
                         ids=["global", "broad", "coarse_size", "oversampling_2", "skip_align", "vdam_5_per_class",
                              "class2d_offset_prior"])
def test_2d_batch_results_and_sums_match_the_numpy_engine(cp, kw, fine_slices):
    """A batch of 14 particles against three 2D classes: best psi, origins and classes, pmax, log-likelihoods,
    significant samples, norm corrections, the compressed fine weights and every class's back-projected 2D sums
    agree with the float64 numpy engine. `vdam_5_per_class`: class2d --grad's cut at 5·K significant coarse samples
    (measured on the numpy engine: 3 of the 14 particles would keep 17-22 without it, and the 15th and 16th weights of
    each differ by a factor of 1.09 or more, far beyond float32 rounding, so both engines keep the same 15)."""
    kw = dict(dict(sigma_scale=2.0), **kw)
    truth, setup, batch = random_problem_2d(7, 32, 14, **kw)
    ref, want, gpu, got = run_both(setup, batch)
    assert np.mean(want.class_index == truth) >= 0.9  # a problem with an answer
    if setup.max_significants > 0:  # the cut binds
        assert want.n_significant.max() == setup.max_significants
    assert_same_results(got, want)
    sw, sg = ref.sums(), gpu.sums()
    np.testing.assert_allclose(sg.sigma2_noise, sw.sigma2_noise, rtol=1e-3)
    np.testing.assert_allclose(sg.pdf_class, sw.pdf_class, atol=1e-3)
    np.testing.assert_allclose(sg.pdf_direction, sw.pdf_direction, atol=1e-3)
    assert sg.sigma2_offset_angstrom2 == pytest.approx(sw.sigma2_offset_angstrom2, rel=1e-3)
    for k in range(3):
        assert sg.data[k].shape == sw.data[k].shape == ref.backprojectors[k].grid.shape  # (2R+3, R+2)
        scale = np.max(np.abs(sw.data[k]))
        assert scale > 0, k
        assert np.max(np.abs(cp.asnumpy(sg.data[k]) - sw.data[k])) / scale < 1e-3, k
        assert np.max(np.abs(cp.asnumpy(sg.weight[k]) - sw.weight[k])) / np.max(sw.weight[k]) < 1e-3, k
    assert_same_fine_weights(ref, gpu, batch)


def test_2d_reconstruction_on_the_device_matches_the_host(cp):
    """The M-step's 2D reconstruction (τ², the noise spectrum and the image) from the GPU's sums, on the device
    (CuPy) and on the host (numpy), as class2d's M-step makes it on the engine's device."""
    _, setup, batch = random_problem_2d(8, 32, 14)
    from cryorefine.estep.cuda import CupyEngine

    gpu = CupyEngine()
    gpu.setup(setup)
    gpu.run(batch)
    sums = gpu.sums()
    previous = setup.maps[0]
    for xp in (np, cp):
        data, weight = (cp.asnumpy(a) if xp is np else a for a in (sums.data[0], sums.weight[0]))
        tau2 = Projector(xp.asarray(previous), 2.0, 16, xp=xp).power_spectrum
        bp = BackProjector.from_arrays(data, weight, 32, 2.0, 16, xp=xp)
        image = bp.reconstruct(tau2=tau2, tau2_fudge=2.0, minres_map_px=5)
        made = [cp.asnumpy(a) if xp is cp else a for a in (tau2, bp.noise_sigma2(), image)]
        if xp is np:
            want = made
    for name, a, b in zip(("tau2", "sigma2", "image"), made, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))), err_msg=name)
    assert want[2].shape == (32, 32)

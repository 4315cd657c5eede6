"""What the GPU engine's parity tests in 3D (test_cuda.py) and in 2D (test_cuda_2d.py) share (their fixtures `cp`
and `fine_slices` are conftest's): both engines run on one batch, a problem's white-noise spectrum, and the float64
brute force of the fine pass's squared differences that the GPU's are checked against, and the checks of a
batch's results and compressed fine weights."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cryorefine.core import fourier
from cryorefine.estep.reference import NumpyEngine


def run_both(setup, batch):
    """(numpy engine, its results, GPU engine, its results) of one batch, both keeping their blocks."""
    from cryorefine.estep.cuda import CupyEngine

    ref = NumpyEngine(np.float64, keep_blocks=True)
    ref.setup(setup)
    want = ref.run(batch)
    gpu = CupyEngine(keep_blocks=True)
    gpu.setup(setup)
    got = gpu.run(batch)
    return ref, want, gpu, got


def noise_spectrum(images: np.ndarray, n: int, sigma_scale: float) -> np.ndarray:
    """(1, n//2 + 1): half the mean power per shell of the half transforms `images` (B, n, n//2 + 1), times
    `sigma_scale`: the σ² of the problems' white noise."""
    power = np.mean(np.abs(images) ** 2, axis=0)
    shells = fourier.shell_index_2d(n).reshape(-1)
    sums = np.bincount(shells, weights=power.reshape(-1), minlength=n // 2 + 1)[: n // 2 + 1]
    counts = np.bincount(shells, minlength=n // 2 + 1)[: n // 2 + 1]
    return (sums / np.maximum(counts, 1) / 2.0 * sigma_scale)[None, :]


def fine_diff2_against_brute_force(cp, ref, setup, batch, fine_block,
                                   matrices: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]):
    """(GPU, float64) fine squared differences of at most ~20,000 children of the GPU's fine block `fine_block`
    ((particle, class, orientation, translation) indices of its blocks and their (blocks, children) diff2), the
    float64 ones 0.5·Σ |X shifted − CTF·P|²/σ² (the numpy engine's definition) with each child's projection made
    by `ref`'s projectors at `matrices(rot, tilt, psi)` (degrees, flat)."""
    b_blk, k_blk, o_blk, t_blk, got = fine_block
    b_blk, k_blk, o_blk, t_blk = (cp.asnumpy(a) if hasattr(a, "get") else np.asarray(a)
                                  for a in (b_blk, k_blk, o_blk, t_blk))
    every = max(1, b_blk.size * got.shape[1] // 20000)
    b_blk, k_blk, o_blk, t_blk, got = b_blk[::every], k_blk[::every], o_blk[::every], t_blk[::every], got[::every]
    rot, tilt, psi, tx, ty = setup.sampling.fine_samples_flat(o_blk * ref.n_trans + t_blk)  # (blocks, children)
    mats = matrices(rot.reshape(-1), tilt.reshape(-1), psi.reshape(-1))
    children = rot.shape[1]
    k_child = np.repeat(k_blk, children)
    proj = np.zeros((mats.shape[0], ref.fine.positions.size), complex)
    for k, projector in enumerate(ref.setup_.projectors):
        rows = np.flatnonzero(k_child == k)
        proj[rows] = ref.fine.gather(projector.project(mats[rows], setup.current_size_px))
    b_child = np.repeat(b_blk, children)
    shifts = batch.residual_origin_px[b_child] + np.stack([tx.reshape(-1), ty.reshape(-1)], axis=1)
    x = ref.fine.gather(batch.images_ft)[b_child] * ref.fine.phase(shifts, setup.ori_size_px, complex)
    c = ref.fine.gather(batch.ctf)[b_child]
    minv = ref.minv_fine[np.asarray(batch.optics_index)[b_child]]
    want = (0.5 * np.sum(minv * np.abs(x - c * proj) ** 2, axis=1)).reshape(got.shape)
    return got, want


def assert_same_results(got, want) -> None:
    """The GPU engine's results of a batch `got` are the numpy engine's `want`: the best poses and classes, the
    significant samples' counts, pmax, log-likelihoods and norm corrections, each to its float32 tolerance."""
    for name in ("rot_deg", "tilt_deg", "psi_deg", "origin_x_px", "origin_y_px", "class_index"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(got.n_significant, want.n_significant)
    np.testing.assert_allclose(got.pmax, want.pmax, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(got.log_likelihood, want.log_likelihood, rtol=1e-5)
    np.testing.assert_allclose(got.norm_correction, want.norm_correction, rtol=1e-4)


def assert_same_fine_weights(ref, gpu, batch) -> None:
    """The engines' compressed fine weights of `batch` (kept blocks) agree: the same weight on every child of the
    coarse samples both kept; a block of one engine alone (float32 against float64 can swap samples of nearly equal
    weight at the significance cut) carries ≈ no weight."""
    assert len(ref.last_blocks) == len(gpu.last_blocks) == batch.indices.size
    for bw, bg in zip(ref.last_blocks, gpu.last_blocks):
        want_w = dict(zip(bw.coarse_index.tolist(), bw.weights))
        got_w = dict(zip(bg.coarse_index.tolist(), bg.weights))
        common = sorted(set(want_w) & set(got_w))
        assert len(common) >= 0.9 * max(len(want_w), len(got_w))
        np.testing.assert_allclose([got_w[c] for c in common], [want_w[c] for c in common], atol=2e-3)
        assert sum(want_w[c].sum() for c in set(want_w) - set(got_w)) < 1e-3
        assert sum(got_w[c].sum() for c in set(got_w) - set(want_w)) < 1e-3

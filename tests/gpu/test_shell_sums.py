"""gpu.shell_sums against its numpy twin, the numpy path of core.fourier.shell_sum."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.core import fourier
from cryorefine.gpu import shell_sums

pytestmark = pytest.mark.gpu


def _case(rng, lead, shape, n_shells, dtype, shell_dtype):
    values = rng.standard_normal(lead + shape)
    if np.dtype(dtype).kind == "c":
        values = values + 1j * rng.standard_normal(lead + shape)
    values = values.astype(dtype)
    # shells 0 … n_shells + 3: those at or beyond n_shells must be dropped
    shells = rng.integers(0, n_shells + 4, size=shape).astype(shell_dtype)
    return values, shells


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64, np.complex128, np.int64])
@pytest.mark.parametrize("shell_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_device_shell_sums_match_the_numpy_path(dtype, shell_dtype, lead):
    cp = cupy_or_skip()
    rng = np.random.default_rng(7)
    values, shells = _case(rng, lead, (37, 20), 24, dtype, shell_dtype)
    expected = fourier.shell_sum(values, shells, 24, np)
    got = fourier.shell_sum(cp.asarray(values), cp.asarray(shells), 24, cp)
    assert got.shape == expected.shape == lead + (24,)
    assert got.dtype == expected.dtype
    np.testing.assert_allclose(cp.asnumpy(got), expected, rtol=1e-12, atol=1e-12)


def test_many_blocks_and_rows_sum_every_coefficient_once():
    """Rows of a padded volume's slab size: blocks loop over their share, and every block adds its histogram."""
    cp = cupy_or_skip()
    rng = np.random.default_rng(3)
    shape = (64, 130, 67)
    r = np.sqrt(np.sum(np.square(np.indices(shape) - np.array([32, 65, 0])[:, None, None, None]), axis=0))
    shells = np.rint(r).astype(np.int64)
    values = rng.random(shape)
    expected = fourier.shell_sum(values, shells, 60, np)
    got = cp.asnumpy(fourier.shell_sum(cp.asarray(values), cp.asarray(shells), 60, cp))
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # every kept coefficient once: the counts of ones are the histogram of the shells
    counts = cp.asnumpy(fourier.shell_sum(cp.ones(shape), cp.asarray(shells), 60, cp))
    np.testing.assert_array_equal(counts, np.bincount(shells[shells < 60].ravel(), minlength=60))
    batch = rng.random((300, 40, 21)).astype(np.float32)  # many rows (a batch of images), one block or few each
    img_shells = rng.integers(0, 25, size=(40, 21))
    np.testing.assert_allclose(cp.asnumpy(fourier.shell_sum(cp.asarray(batch), cp.asarray(img_shells), 21, cp)),
                               fourier.shell_sum(batch, img_shells, 21, np), rtol=1e-5)


def test_non_contiguous_values_and_shells():
    cp = cupy_or_skip()
    rng = np.random.default_rng(5)
    values = rng.standard_normal((30, 40))
    shells = rng.integers(0, 12, size=(30, 40))
    expected = fourier.shell_sum(values.T, shells.T, 10, np)  # transposed views: not C-contiguous
    got = fourier.shell_sum(cp.asarray(values).T, cp.asarray(shells).T, 10, cp)
    np.testing.assert_allclose(cp.asnumpy(got), expected, rtol=1e-12)


def test_histograms_too_large_for_shared_memory_take_the_array_path():
    cp = cupy_or_skip()
    n_shells = shell_sums.MAX_SHARED_BYTES // 8 + 1
    assert not shell_sums.fits(n_shells, False)
    rng = np.random.default_rng(1)
    values = rng.random(5000)
    shells = rng.integers(0, n_shells, size=5000)
    got = fourier.shell_sum(cp.asarray(values), cp.asarray(shells), n_shells, cp)
    np.testing.assert_allclose(cp.asnumpy(got), fourier.shell_sum(values, shells, n_shells, np), rtol=1e-12)

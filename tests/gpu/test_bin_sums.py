"""gpu.bin_sums and the device path of core.reconstruct.downsampled_average against their numpy twins."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.core import reconstruct
from cryorefine.core.grid import PaddedGrid
from cryorefine.gpu.bin_sums import bin_sums

pytestmark = pytest.mark.gpu


def test_bin_sums_match_bincount():
    cp = cupy_or_skip()
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 500, size=20000)
    values = (rng.standard_normal(20000) + 1j * rng.standard_normal(20000)).astype(np.complex64)
    weights = rng.random(20000).astype(np.float32)
    re, im, den = (cp.asnumpy(a) for a in bin_sums(cp.asarray(idx), cp.asarray(values), cp.asarray(weights), 600))
    np.testing.assert_allclose(re, np.bincount(idx, values.real.astype(np.float64), 600), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(im, np.bincount(idx, values.imag.astype(np.float64), 600), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(den, np.bincount(idx, weights.astype(np.float64), 600), rtol=1e-12, atol=1e-12)
    _, _, counts = bin_sums(cp.asarray(idx), cp.asarray(values), 1.0, 600)  # a scalar weight counts the values
    np.testing.assert_array_equal(cp.asnumpy(counts), np.bincount(idx, minlength=600))


@pytest.mark.parametrize("size,r_max", [(24, None), (25, 9)])
@pytest.mark.parametrize("divide", [True, False])
def test_downsampled_average_on_the_device_matches_the_host(size, r_max, divide):
    cp = cupy_or_skip()
    rng = np.random.default_rng(size)
    grid = PaddedGrid.create(size, 2.0, r_max)
    data = (rng.standard_normal(grid.shape) + 1j * rng.standard_normal(grid.shape)).astype(np.complex64)
    weight = rng.random(grid.shape).astype(np.float32)
    want = reconstruct.downsampled_average(data, weight, grid, divide, np)
    got = reconstruct.downsampled_average(cp.asarray(data), cp.asarray(weight), grid, divide, cp)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=1e-5, atol=1e-6)
    # the same points kept: zero exactly where the host's is
    np.testing.assert_array_equal(cp.asnumpy(got) == 0, want == 0)

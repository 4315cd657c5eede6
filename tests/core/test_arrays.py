"""Host array helpers (core.arrays)."""

import numpy as np
import pytest

from cryorefine.core.arrays import add_rows_at


@pytest.mark.parametrize("trailing", [(), (7,), (3, 4)])
def test_rows_added_at_repeated_indices_sum_as_numpys_add_at(trailing):
    rng = np.random.default_rng(5)
    index = rng.integers(0, 6, size=200)  # groups 0-5, most repeated, some perhaps absent
    index[:3] = 4
    rows = rng.standard_normal((200,) + trailing)
    total = rng.standard_normal((9,) + trailing)
    expected = total.copy()
    np.add.at(expected, index, rows)
    add_rows_at(total, index, rows)
    np.testing.assert_allclose(total, expected, rtol=1e-12, atol=1e-12)


def test_no_rows_add_nothing():
    total = np.ones((3, 2))
    add_rows_at(total, np.zeros(0, dtype=np.int64), np.zeros((0, 2)))
    np.testing.assert_array_equal(total, np.ones((3, 2)))

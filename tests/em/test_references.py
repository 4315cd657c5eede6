"""The starting references: --ini_high's low-pass as RELION's initialLowPassFilterReferences."""

import numpy as np

from cryorefine.config import RefineConfig
from cryorefine.core import fourier
from cryorefine.em.references import lowpass_to_ini_high


def test_ini_high_lowpass_goes_through_one_half_at_the_ini_high_shell():
    # a point at the centre has a flat transform, so the filtered transform is the filter: 1 up to one shell
    # below the --ini_high shell (8 here), 0.5 at it, 0 from one shell above it
    box, pixel = 32, 2.0
    point = np.zeros((box, box, box))
    point[box // 2, box // 2, box // 2] = 1.0
    config = RefineConfig(input_star="", output_root="", reference_map="", ini_high_angstrom=box * pixel / 8)
    gain = np.abs(fourier.rfft3_centered(lowpass_to_ini_high(point, config, box, pixel)))
    gain /= np.abs(fourier.rfft3_centered(point))
    r = fourier.radius_3d(box)
    np.testing.assert_allclose(gain[r <= 7], 1.0, atol=1e-9)
    np.testing.assert_allclose(gain[np.isclose(r, 8.0)], 0.5, atol=1e-9)
    assert np.abs(gain[r >= 9]).max() < 1e-9
    inside = (r > 7) & (r < 9)
    np.testing.assert_allclose(gain[inside], 0.5 - 0.5 * np.cos(np.pi * (9 - r[inside]) / 2), atol=1e-9)

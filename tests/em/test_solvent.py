"""Masks of the references: RELION's checks on the files and solventFlatten's use of them."""

import numpy as np
import pytest
from conftest import write_mrc

from cryorefine.config import RefineConfig
from cryorefine.core import fourier
from cryorefine.em.solvent import SolventMasks, read_mask
from cryorefine.errors import InputError

BOX, PIXEL = 24, 3.0


def config(**kw):
    base = dict(input_star="p.star", output_root="out/run", reference_map="ref.mrc", particle_diameter_angstrom=48.0,
                flatten_solvent=True)
    base.update(kw)
    return RefineConfig(**base)


def mask_file(path, data=None, pixel=PIXEL):
    if data is None:
        data = fourier.soft_spherical_mask(BOX, 6.0, 3.0)
    write_mrc(path, np.asarray(data, dtype=np.float32), pixel, stack=False)
    return path


@pytest.mark.parametrize("case, fragment", [
    ("range", "outside [0, 1]"),
    ("zero", "zero everywhere"),
    ("missing", "file not found"),
    ("not_mrc", "--solvent_mask"),
])
def test_bad_masks_are_refused_with_the_option_the_file_and_what_to_do(tmp_path, case, fragment):
    path = tmp_path / "mask.mrc"
    if case == "range":
        mask_file(path, 1.5 * fourier.soft_spherical_mask(BOX, 6.0, 3.0))
    elif case == "zero":
        mask_file(path, np.zeros((BOX,) * 3))
    elif case == "not_mrc":
        path.write_text("not a map\n")
    with pytest.raises(InputError) as err:
        read_mask("--solvent_mask", path, BOX, PIXEL)
    message = str(err.value)
    assert fragment in message and str(path) in message and "\n" not in message
    assert message.startswith("--solvent_mask")


def test_a_mask_of_another_box_or_pixel_size_is_rescaled_and_reboxed_as_relions_check_mask(tmp_path, caplog):
    """RELION's checkMask (with or without --trust_ref_size): the mask's transform windowed to round(N·its pixel /
    the particles') made even upwards, then the map cropped or zero-padded about its centre to the particles' box,
    values clipped to [0, 1]; said in one warning."""
    import logging

    truth = fourier.soft_spherical_mask(BOX, 6.0, 3.0)
    # the same mask at 2 Å/px (36 px, its transform zero-padded) in a 41 px box: round(41 · 2 / 3) = 27 -> 28 px
    # (2.93 Å/px), then cropped to 24
    fine = fourier.window_volume(fourier.resample_volume(truth, 36), 41)
    path = mask_file(tmp_path / "fine.mrc", np.clip(fine, 0, 1), pixel=2.0)
    with caplog.at_level(logging.WARNING, logger="cryorefine"):
        mask = read_mask("--solvent_mask", path, BOX, PIXEL, say=True)
    expected = np.clip(fourier.window_volume(fourier.resample_volume(np.clip(fine, 0, 1).astype(np.float32)
                                                                     .astype(np.float64), 28), BOX), 0, 1)
    np.testing.assert_allclose(mask, expected, atol=1e-12)
    assert np.abs(mask - truth).max() < 0.15  # the same sphere, 2 % larger
    assert mask.min() >= 0 and mask.max() <= 1
    [record] = [r for r in caplog.records if "--solvent_mask" in r.getMessage()]
    assert "41 px at 2 Å/px: re-scaled to 28 px (2.929 Å/px; the nearest even box" in record.getMessage()
    assert "re-boxed from 28 to 24 px" in record.getMessage()
    # a mask of the particles' pixel size in another box: re-boxed only
    boxed = mask_file(tmp_path / "boxed.mrc", fourier.window_volume(truth, 30))
    np.testing.assert_array_equal(read_mask("--solvent_mask", boxed, BOX, PIXEL),
                                  np.clip(truth.astype(np.float32), 0, 1))


def test_values_a_rounding_error_outside_zero_one_are_clipped(tmp_path):
    data = fourier.soft_spherical_mask(BOX, 6.0, 3.0)
    data[0, 0, 0], data[BOX // 2, BOX // 2, BOX // 2] = -1e-5, 1.0 + 1e-5
    mask = read_mask("--solvent_mask", mask_file(tmp_path / "m.mrc", data), BOX, PIXEL)
    assert mask.min() == 0.0 and mask.max() == 1.0


def test_the_sphere_is_used_without_a_mask_and_nothing_without_flatten_solvent(tmp_path):
    rng = np.random.default_rng(0)
    vol = rng.standard_normal((BOX,) * 3)
    sphere = SolventMasks.from_config(config(), BOX, PIXEL, 48.0)
    assert np.allclose(sphere.apply(vol), vol * fourier.soft_spherical_mask(BOX, 8.0, 5.0))
    off = SolventMasks.from_config(config(flatten_solvent=False, solvent_mask=str(mask_file(tmp_path / "m.mrc"))),
                                   BOX, PIXEL, 48.0)
    assert off.apply(vol) is vol


def test_the_host_sphere_is_made_once_and_each_m_step_gets_the_same_product(monkeypatch):
    """The soft sphere is made at the first M-step and kept (not made again at every one, where it cost far more than
    the product); every later M-step's product is the first's, and the kept sphere cannot be changed by a caller."""
    rng = np.random.default_rng(1)
    vol = rng.standard_normal((BOX,) * 3)
    masks = SolventMasks.from_config(config(), BOX, PIXEL, 48.0)
    made = []
    real = fourier.soft_spherical_mask

    def counted(*args, **kwargs):
        made.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fourier, "soft_spherical_mask", counted)
    first = masks.apply(vol)
    for _ in range(3):
        np.testing.assert_array_equal(masks.apply(vol), first)
    assert made == [BOX]
    np.testing.assert_allclose(masks.apply(vol.astype(np.float32)), first, rtol=1e-6)
    assert made == [BOX, BOX]  # float32 maps get a float32 sphere of their own
    with pytest.raises(ValueError):
        masks.reference_mask(BOX)[0, 0, 0] = 2.0


def test_a_solvent_mask_replaces_the_sphere_and_a_second_mask_flattens_its_region(tmp_path):
    rng = np.random.default_rng(1)
    vol = rng.standard_normal((BOX,) * 3) + 1.0
    first = fourier.soft_spherical_mask(BOX, 6.0, 3.0)
    inner = (fourier.soft_spherical_mask(BOX, 2.0, 0.0) > 0.5).astype(np.float32)
    masks = SolventMasks.from_config(config(solvent_mask=str(mask_file(tmp_path / "a.mrc", first)),
                                            solvent_mask2=str(mask_file(tmp_path / "b.mrc", inner))), BOX, PIXEL, 48.0)
    out = masks.apply(vol)
    outside_inner = inner == 0
    assert np.allclose(out[outside_inner], (vol * first)[outside_inner], atol=1e-6)
    assert np.allclose(out[inner == 1], (vol * first)[inner == 1].mean(), atol=1e-6)


def test_solvent_fsc_correction_needs_a_mask_and_half_sets(tmp_path):
    path = str(mask_file(tmp_path / "m.mrc"))
    assert SolventMasks.from_config(config(solvent_mask=path, solvent_correct_fsc=True), BOX, PIXEL, 48.0).correct_fsc
    assert not SolventMasks.from_config(config(solvent_correct_fsc=True), BOX, PIXEL, 48.0).correct_fsc
    assert not SolventMasks.from_config(config(solvent_mask=path, solvent_correct_fsc=True, auto_refine=False),
                                        BOX, PIXEL, 48.0).correct_fsc

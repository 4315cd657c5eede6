"""WeightedSums moves through MPI and class merges field by field: pack/unpack, spread_to_classes, total."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from cryorefine.estep.engine import WeightedSums


def random_sums(rng, n_classes=2, shape=(5, 5, 3), n_optics=2, n_shells=4, n_dir=6):
    sums = WeightedSums.zeros(shape, n_classes, n_optics, n_shells, n_dir)
    sums.data = [rng.normal(size=shape) + 1j * rng.normal(size=shape) for _ in range(n_classes)]
    sums.weight = [rng.uniform(size=shape) for _ in range(n_classes)]
    for name in ("sigma2_noise", "sumw_group", "pdf_class", "pdf_direction", "scale_xa", "scale_aa"):
        setattr(sums, name, rng.uniform(size=getattr(sums, name).shape))
    sums.sigma2_offset_angstrom2, sums.norm_correction = rng.uniform(), rng.uniform()
    sums.log_likelihood, sums.sum_pmax, sums.n_particles = rng.normal(), rng.uniform(), int(rng.integers(1, 99))
    return sums


def assert_same(a, b):
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, list):
            assert len(x) == len(y)
            for u, v in zip(x, y):
                np.testing.assert_array_equal(u, v, err_msg=name)
                assert u.dtype == v.dtype, name
        elif x is None:
            assert y is None, name
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)
            assert type(x) is type(y) or np.asarray(x).dtype == np.asarray(y).dtype, name


def test_pack_and_unpack_give_back_every_field_exactly():
    sums = random_sums(np.random.default_rng(1))
    arrays = sums.pack()
    assert all(a.dtype == np.float64 and a.ndim == 1 for a in arrays)
    back = WeightedSums.zeros((5, 5, 3), 2, 2, 4, 6).unpack([a.copy() for a in arrays])
    assert_same(back, sums)
    assert isinstance(back.n_particles, int)


def test_float32_volumes_travel_as_they_are():
    """Sums with the GPU engine's float32 volumes packed with volume_real_dtype float32 (how a worker sends its
    unit's sums to rank 1): the volumes cross as float32 pairs, half the bytes of float64, and come back bit for
    bit in their own dtypes; the other fields stay float64."""
    sums = random_sums(np.random.default_rng(3))
    sums.data = [d.astype(np.complex64) for d in sums.data]
    sums.weight = [w.astype(np.float32) for w in sums.weight]
    arrays = sums.pack(volume_real_dtype=np.float32)
    n_volumes = len(sums.data) + len(sums.weight)
    assert all(a.dtype == np.float32 for a in arrays[:n_volumes])
    assert all(a.dtype == np.float64 for a in arrays[n_volumes:])
    assert sum(a.nbytes for a in arrays[:n_volumes]) * 2 == sum(a.nbytes for a in sums.pack()[:n_volumes])
    template = WeightedSums.zeros((5, 5, 3), 2, 2, 4, 6, real_dtype=np.float32)
    back = template.unpack([a.copy() for a in arrays])
    assert_same(back, sums)


def test_a_new_field_travels_without_more_code():
    @dataclass
    class WithMore(WeightedSums):
        extra_spectrum: np.ndarray = field(default_factory=lambda: np.zeros(3))
        extra_count: float = 0.0

    sums = WithMore(**vars(random_sums(np.random.default_rng(2))))
    sums.extra_spectrum, sums.extra_count = np.array([1.0, 2.0, 3.5]), 7.25
    template = WithMore(**vars(WeightedSums.zeros((5, 5, 3), 2, 2, 4, 6)))
    back = template.unpack(sums.pack())
    np.testing.assert_array_equal(back.extra_spectrum, [1.0, 2.0, 3.5])
    assert back.extra_count == 7.25


def test_sums_of_some_classes_spread_to_all_and_add_up():
    rng = np.random.default_rng(3)
    one, other = random_sums(rng, n_classes=1), random_sums(rng, n_classes=1)
    spread = [one.spread_to_classes([2], 3), other.spread_to_classes([0], 3)]
    total = WeightedSums.total(spread)
    np.testing.assert_array_equal(total.data[2], one.data[0])
    np.testing.assert_array_equal(total.data[0], other.data[0])
    assert not total.data[1].any() and not total.weight[1].any()
    np.testing.assert_array_equal(total.pdf_class, [other.pdf_class[0], 0.0, one.pdf_class[0]])
    np.testing.assert_array_equal(total.pdf_direction[2], one.pdf_direction[0])
    np.testing.assert_array_equal(total.sigma2_noise, one.sigma2_noise + other.sigma2_noise)  # not per class
    assert total.n_particles == one.n_particles + other.n_particles
    assert total.log_likelihood == pytest.approx(one.log_likelihood + other.log_likelihood)

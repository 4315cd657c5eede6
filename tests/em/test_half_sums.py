"""A refinement's halves take turns on a device too small for both (em.mstep.HalfSums, em.estep.sums_wait_on_host):
the M-step gives the same model bit for bit as with both halves in memory, and never holds more than one half's
sums on the device."""

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from cryorefine.config import RefineConfig
from cryorefine.core.euler import euler_to_matrix
from cryorefine.core.fourier import soft_spherical_mask
from cryorefine.core.grid import PaddedGrid
from cryorefine.core.projector import BackProjector, Projector
from cryorefine.em import memory
from cryorefine.em.estep import sums_wait_on_host
from cryorefine.em.schedule import ImageSizes
from cryorefine.em.solvent import SolventMasks
from cryorefine.em.state import ModelState
from cryorefine.estep.backend import NumpyBackend
from cryorefine.estep.engine import WeightedSums
from cryorefine.jobs.refine import RefineJob

N = 24


class OnDevice(np.ndarray):
    """A numpy array standing for one on the pretend device."""


class SmallDevice(NumpyBackend):
    """The numpy engine with a pretend device of `capacity` bytes: arrays moved there are OnDevice copies whose
    bytes are counted while they live (`live`, `peak`)."""

    def __init__(self, capacity):
        super().__init__(np.float32)
        self.capacity, self.live, self.peak = capacity, 0, 0

    def free_device_bytes(self):
        return self.capacity - self.live

    def on_device(self, array):
        return isinstance(array, OnDevice)

    def to_device(self, array):
        if self.on_device(array):
            return array
        out = np.array(array).view(OnDevice)
        self.live += out.nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(out, self._freed, out.nbytes)
        return out

    def _freed(self, nbytes):
        self.live -= nbytes

    def to_host(self, array):
        return np.array(array)  # a plain ndarray copy


def _half(seed):
    """One half's float32 sums of slices of a random map at random poses, as a WeightedSums."""
    rng = np.random.default_rng(seed)
    n = 40
    angles = rng.uniform(0, 360, (3, n))
    angles[1] = np.degrees(np.arccos(rng.uniform(-1, 1, n)))
    matrices = euler_to_matrix(*angles)
    slices = Projector(rng.normal(size=(N, N, N)), 2.0).project(matrices)
    bp = BackProjector(N, 2.0)
    bp.backproject(slices, rng.uniform(0.5, 1.0, size=slices.shape), matrices)
    sums = WeightedSums.zeros(None, 1, 1, N // 2 + 1, 10, data=[bp.data.astype(np.complex64)],
                              weight=[bp.weight.astype(np.float32)])
    sums.sigma2_noise[:] = rng.uniform(1, 2, sums.sigma2_noise.shape)
    sums.sumw_group[:] = n
    sums.n_particles = n
    return sums


def _maximize(backend, final, correct_fsc, device_halves):
    config = RefineConfig(input_star="", output_root="", reference_map="", flatten_solvent=True)
    job = RefineJob(config)
    mask = soft_spherical_mask(N, N / 2 - 4, 3.0) if correct_fsc else None
    job.masks = SolventMasks(flatten=True, sphere_radius_px=N / 2 - 2, edge_px=2.0, mask=mask,
                             correct_fsc=correct_fsc)
    model = ModelState(ori_size_px=N, pixel_size_angstrom=4.0, sigma2_noise=np.ones((1, N // 2 + 1)))
    plan = SimpleNamespace(final=final, sizes=ImageSizes(N, N), iteration=3, do_cc=False)
    sums = [_half(1), _half(2)]
    for h in device_halves:  # as the E-step leaves them: the last half on the device
        sums[h].move_volumes(backend.to_device)
    return job.maximize(model, sums, plan, backend)


def _half_bytes():
    return memory.sums_bytes(PaddedGrid.create(N, 2.0).shape, 1)


def _reconstruction_bytes():
    grid = PaddedGrid.create(N, 2.0)
    return memory.reconstruction_bytes(grid.shape, N, grid.padded_size_px)


@pytest.mark.parametrize("final,correct_fsc", [(False, False), (True, False), (False, True)])
def test_halves_taking_turns_give_the_same_model(final, correct_fsc):
    want = _maximize(NumpyBackend(np.float32), final, correct_fsc, device_halves=())
    # room for one half and a reconstruction, not for two halves
    small = SmallDevice(1.5 * _half_bytes() + _reconstruction_bytes())
    got = _maximize(small, final, correct_fsc, device_halves=(1,))
    assert small.peak <= _half_bytes() + 1024  # one half's data and weights, never both halves
    for name in ("tau2", "ssnr", "reference_sigma2", "fsc_halves", "sigma2_noise"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    for h in range(2):
        np.testing.assert_array_equal(got.maps[h][0], want.maps[h][0])
    if final:
        np.testing.assert_array_equal(got.joined_map, want.joined_map)
    assert small.live == 0  # nothing of the sums is left on the device
    # with room for both, both come to the device (and the model is the same again)
    roomy = SmallDevice(4 * _half_bytes() + _reconstruction_bytes())
    again = _maximize(roomy, final, correct_fsc, device_halves=(1,))
    assert roomy.peak >= 2 * _half_bytes()
    np.testing.assert_array_equal(again.maps[0][0], want.maps[0][0])


def _unit(box, current, ref_dim=3, n_classes=1):
    setup = SimpleNamespace(ori_size_px=box, padding_factor=2.0, current_size_px=current, ref_dim=ref_dim)
    return SimpleNamespace(setup=setup, classes=np.zeros(n_classes, dtype=int))


@pytest.mark.parametrize("box,gb,waits", [(360, 80, False), (360, 8, True), (512, 80, False), (512, 16, True),
                                          (800, 78, True)])
def test_the_idle_half_waits_on_the_host_only_where_both_do_not_fit(box, gb, waits):
    # the final iteration's sums: 2.25 GB per half at 360 px, 6.5 GB at 512 px, 24.6 GB at 800 px
    units = [_unit(box, box), _unit(box, box)]
    assert sums_wait_on_host(SmallDevice(gb * 1e9), units) is waits
    assert sums_wait_on_host(NumpyBackend(), units) is False  # the host holds everything already
    # an early iteration's small image size never needs it
    assert sums_wait_on_host(SmallDevice(gb * 1e9), [_unit(box, box // 4)] * 2) is False


def test_a_2d_classification_is_sized_on_2d_grids():
    """K = 100 classes of 360 px at padding 2 (R = 360): 2D grids of 723 × 362, 12 bytes an element of sums (314 MB a
    unit) and 8 of references (209 MB) besides a few tens of MB of temporaries, a reconstruction below 100 MB: two
    such units' sums stay on an 8 GB device, where 3D grids of that size (227 GB of sums a unit) would not."""
    grid = PaddedGrid.create(360, 2.0, 180, ndim=2)
    assert grid.shape == (723, 362)
    assert memory.sums_bytes(grid.shape, 100) == 100 * 723 * 362 * 12
    references = memory.references_bytes(grid.shape, 360, 100)
    assert 100 * 723 * 362 * 8 < references < 1.3 * 100 * 723 * 362 * 8
    assert memory.reconstruction_bytes(grid.shape, 360, grid.padded_size_px) < 1e8
    assert sums_wait_on_host(SmallDevice(8e9), [_unit(360, 360, ref_dim=2, n_classes=100)] * 2) is False
    assert sums_wait_on_host(SmallDevice(8e9), [_unit(360, 360, ref_dim=3, n_classes=100)] * 2) is True


@pytest.mark.gpu
def test_halves_taking_turns_on_the_gpu_give_the_same_model():
    # on the device, in an arena with room for one half and a reconstruction: the same model, bit for bit, as in an
    # arena with room for both; the arena's top comes back down when the idle half leaves
    from conftest import cupy_or_skip

    from cryorefine.estep.backend import CudaBackend

    cp = cupy_or_skip()
    models, peaks = [], []
    for room in (1.2 * _half_bytes() + _reconstruction_bytes(), 1e9):
        # the device's free memory with no earlier arena or pooled block left to be freed later (after earlier tests,
        # one freed after this measurement gave the first arena room for both halves)
        backend = None
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        free_mb = (cp.cuda.runtime.memGetInfo()[0] - room) / 2 ** 20
        backend = CudaBackend(0, free_gpu_memory_mb=free_mb)
        with backend.run_scope(), backend.iteration_scope(), backend.maximization_scope():
            backend.arena.reset_peaks()
            models.append(_maximize(backend, True, False, device_halves=(1,)))
            peaks.append(backend.arena.high_water_bytes)
    # Were the idle half kept on the device, both arenas would run the same M-step and reach the same top. The tops
    # need not differ by a whole half, as the temporaries above the halves at each top differ: on the H100 they were
    # 1.06 halves apart with the shell sums of masks and bincount, 0.66 with those of gpu.shell_sums
    assert peaks[0] < peaks[1] - 0.5 * _half_bytes()
    for name in ("tau2", "fsc_halves", "reference_sigma2"):
        np.testing.assert_array_equal(getattr(models[0], name), getattr(models[1], name), err_msg=name)
    np.testing.assert_array_equal(models[0].maps[1][0], models[1].maps[1][0])
    np.testing.assert_array_equal(models[0].joined_map, models[1].joined_map)


def test_halves_are_joined_at_low_resolution_before_their_fsc():
    # RELION's iterate: joinTwoHalvesAtLowResolution, then compareTwoHalves on the joined sums, so the halves'
    # FSC is 1 wherever the join reaches: --low_resol_join_halves 40 Å in a 24 px box of 4 Å/px joins up to
    # shell ceil(96 / 40) = 3 (padded radius 6): shell 1 holds only joined coefficients, shell 2 nearly only
    model = _maximize(NumpyBackend(np.float64), False, False, device_halves=())
    fsc = model.fsc_halves[0]
    assert fsc[1] == pytest.approx(1.0, abs=1e-6)
    assert fsc[2] > 0.99
    assert fsc[6] < 0.99  # beyond the join the halves differ

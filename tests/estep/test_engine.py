"""The E-step engine contract (`estep.engine.Engine`), one test class run for every engine.

`EngineContract` holds the tests; each engine is a subclass that says how to make its backend
(`estep.backend`): the numpy engine here, the CuPy engine in the `gpu` subclass (skipped without CuPy
and a device). A new engine gets the whole contract with one more subclass. The engines are driven as
the E-step drives them: `backend.make_engine()` inside the backend's run and iteration scopes, batches
prepared with the engine's `array_module`.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from conftest import cupy_or_skip

from cryorefine.core import euler, fourier
from cryorefine.core.arrays import to_host
from cryorefine.core.projector import Projector
from cryorefine.core.sampling import Sampling
from cryorefine.estep.engine import Batch, BatchResult, IterationSetup, WeightedSums

N = 16  # box (px)
K = 2  # classes
BATCHES = (np.arange(0, 3), np.arange(3, 5))  # two batches of one work unit


def blob_volume(rng, blobs=6):
    z, y, x = np.mgrid[:N, :N, :N] - N // 2
    vol = np.zeros((N, N, N))
    for _ in range(blobs):
        c = rng.uniform(-N / 5, N / 5, 3)
        vol += np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) / (2 * rng.uniform(1.0, 2.0) ** 2))
    return vol


def tiny_problem(seed=3, n_particles=5):
    """Two class maps, a coarse sampling, noisy CTF-modulated projections of random poses at random origins.

    adaptive_fraction = 1 keeps every sample of weight above 2.2e-308 of the best, so each particle's weights sum to
    1."""
    rng = np.random.default_rng(seed)
    maps = [blob_volume(rng) for _ in range(K)]
    sampling = Sampling(healpix_order=1, offset_range_px=2, offset_step_px=2)
    mats = euler.euler_to_matrix(rng.uniform(-180, 180, n_particles), rng.uniform(0, 180, n_particles),
                                 rng.uniform(-180, 180, n_particles))
    truth = rng.integers(0, K, n_particles)
    images = np.stack([Projector(maps[k]).project(m[None], N)[0] for k, m in zip(truth, mats)])
    ctf = np.broadcast_to(np.cos(fourier.radius_2d(N) / N * rng.uniform(1, 3, (n_particles, 1, 1))),
                          images.shape).copy()
    real = fourier.irfft2_centered(images * ctf, N)
    real += rng.normal(scale=0.5 * real.std(), size=real.shape)
    images = fourier.rfft2_centered(real)
    shells = fourier.shell_index_2d(N).reshape(-1)
    power = np.mean(np.abs(images) ** 2, axis=0).reshape(-1)
    counts = np.maximum(np.bincount(shells, minlength=N // 2 + 1)[: N // 2 + 1], 1)
    sigma2 = (np.bincount(shells, weights=power, minlength=N // 2 + 1)[: N // 2 + 1] / counts / 2.0 * 1e-2)[None]
    old = rng.uniform(-1.5, 1.5, (n_particles, 2))
    batch = Batch(indices=np.arange(n_particles), images_ft=images, images_ft_unmasked=images, ctf=ctf,
                  optics_index=np.zeros(n_particles, np.int64), old_origin_px=old,
                  residual_origin_px=old - np.round(old), prior_rot_deg=np.zeros(n_particles),
                  prior_tilt_deg=np.zeros(n_particles), prior_psi_deg=np.zeros(n_particles),
                  old_class=np.zeros(n_particles, np.int64), norm_correction=rng.uniform(0.9, 1.1, n_particles),
                  power_beyond_current=np.zeros((n_particles, N // 2 + 1)))
    setup = IterationSetup(projectors=None, maps=maps, sigma2_noise=sigma2, sampling=sampling, ori_size_px=N,
                           current_size_px=N, coarse_size_px=12, pixel_size_angstrom=2.0,
                           log_pdf_class=np.log(np.full(K, 1.0 / K)), sigma_offset_px=3.0, adaptive_fraction=1.0,
                           scale_correction=np.ones(1), data_vs_prior=np.full((K, N // 2 + 1), 5.0))
    return setup, batch


def prepared(batch, rows, xp):
    """Rows of a batch as images.prepare_batch gives them: transforms and CTFs in `xp`, the rest on the host."""
    on_device = ("images_ft", "images_ft_unmasked", "ctf")
    return Batch(**{f.name: (xp.asarray(getattr(batch, f.name)[rows]) if f.name in on_device
                             else getattr(batch, f.name)[rows]) for f in dataclasses.fields(Batch)})


class EngineContract:
    """The tests every engine passes; a subclass gives the classmethod `make_backend` (a estep.backend backend)."""

    @classmethod
    def make_backend(cls):
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls):
        return cls.make_backend()

    @pytest.fixture(scope="class")
    @classmethod
    def outcome(cls, backend):
        """One work unit, set up, run in two batches and summed inside the backend's scopes (kept open while
        the class's tests look at the results; everything is let go before they end)."""
        setup, batch = tiny_problem()
        with backend.run_scope(), backend.iteration_scope():
            engine = backend.make_engine()
            engine.setup(setup)
            results = [engine.run(prepared(batch, rows, engine.array_module)) for rows in BATCHES]
            out = types.SimpleNamespace(engine=engine, setup=setup, results=results, sums=engine.sums())
            yield out
            out.__dict__.clear()
            del engine, results

    def test_run_returns_a_host_result_per_particle(self, outcome):
        for rows, result in zip(BATCHES, outcome.results):
            assert isinstance(result, BatchResult)
            for f in dataclasses.fields(BatchResult):
                value = getattr(result, f.name)
                assert isinstance(value, np.ndarray), f.name
                assert value.shape == (rows.size,), f.name
                assert np.isfinite(value).all(), f.name
            assert ((result.class_index >= 0) & (result.class_index < K)).all()
            assert ((result.pmax > 0) & (result.pmax <= 1 + 1e-9)).all()
            assert (result.n_significant >= 1).all()
            assert (result.norm_correction > 0).all()

    def test_sums_have_the_shapes_of_the_setup(self, outcome):
        sums, setup = outcome.sums, outcome.setup
        n_optics, n_shells = setup.sigma2_noise.shape
        assert isinstance(sums, WeightedSums) and sums.n_classes == K
        assert len(sums.weight) == K
        assert sums.data[0].shape == sums.weight[0].shape
        assert np.iscomplexobj(sums.data[0]) and not np.iscomplexobj(sums.weight[0])
        assert sums.sigma2_noise.shape == (n_optics, n_shells)
        assert sums.pdf_class.shape == (K,)
        assert sums.pdf_direction.shape == (K, setup.sampling.n_directions)
        assert sums.sumw_group.shape == sums.scale_xa.shape == sums.scale_aa.shape == (n_optics,)
        for f in dataclasses.fields(WeightedSums):
            value = getattr(sums, f.name)
            for v in (value if isinstance(value, list) else [value]):
                assert np.isfinite(to_host(v)).all(), f.name

    def test_pack_and_unpack_round_trip_the_sums_exactly(self, outcome):
        sums = outcome.sums
        packed = sums.pack()
        assert all(isinstance(a, np.ndarray) and a.dtype == np.float64 and a.ndim == 1 for a in packed)
        back = sums.unpack(packed)
        for f in dataclasses.fields(WeightedSums):
            got, want = getattr(back, f.name), getattr(sums, f.name)
            if isinstance(want, list):
                assert len(got) == len(want), f.name
                for g, w in zip(got, want):
                    w = to_host(w)
                    assert g.shape == w.shape and np.array_equal(g, w), f.name
            elif want is None:
                assert got is None, f.name
            elif np.ndim(want) == 0:
                assert type(got) is type(want) and got == want, f.name
            else:
                assert np.shape(got) == np.shape(want) and np.array_equal(got, to_host(want)), f.name
        for a, b in zip(back.pack(), packed, strict=True):
            np.testing.assert_array_equal(a, b)

    def test_sums_count_every_particle_once(self, outcome):
        sums = outcome.sums
        n = sum(rows.size for rows in BATCHES)
        assert sums.n_particles == n and isinstance(sums.n_particles, int)
        assert sums.pdf_class.sum() == pytest.approx(n, rel=1e-9)
        assert sums.pdf_direction.sum() == pytest.approx(n, rel=1e-9)
        assert sums.sumw_group.sum() == pytest.approx(n, rel=1e-12)
        assert sums.norm_correction == pytest.approx(sum(r.norm_correction.sum() for r in outcome.results))
        assert sums.sum_pmax == pytest.approx(sum(r.pmax.sum() for r in outcome.results))
        assert sums.log_likelihood == pytest.approx(sum(r.log_likelihood.sum() for r in outcome.results))

    def test_engine_exposes_its_array_module_and_stage_counters(self, backend, outcome):
        fresh = backend.make_engine()  # before any set-up too
        for engine in (fresh, outcome.engine):
            assert isinstance(engine.array_module, types.ModuleType)
            assert engine.array_module is backend.array_module
            assert isinstance(engine.stage_seconds, dict) and isinstance(engine.stage_flops, dict)
            assert all(isinstance(v, float) and v >= 0 for v in engine.stage_seconds.values())
            assert all(isinstance(v, float) and v >= 0 for v in engine.stage_flops.values())
        assert sum(outcome.engine.stage_seconds.values()) > 0


class TestNumpyEngine(EngineContract):
    @classmethod
    def make_backend(cls):
        from cryorefine.estep.backend import NumpyBackend

        return NumpyBackend(np.float64)


@pytest.mark.gpu
class TestCupyEngine(EngineContract):
    @classmethod
    def make_backend(cls):
        cupy_or_skip()
        from cryorefine.estep.backend import CudaBackend

        return CudaBackend(0)

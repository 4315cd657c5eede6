"""The E-step's batch loop (em.estep.run_batches) computes a local search's neighbourhoods of the next batch on a
thread while the engine runs this one: each batch gets those of its own particles under its own unit's set-up,
and the results are those of an engine computing them itself, bit for bit."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
from conftest import make_particle_set

from cryorefine.core.sampling import Sampling
from cryorefine.data import load_particles
from cryorefine.em import estep
from cryorefine.em.estep import BatchInputs, WorkUnit, run_batches
from cryorefine.em.state import ParticleState
from cryorefine.estep.backend import NumpyBackend
from cryorefine.estep.common import local_orientations
from cryorefine.estep.engine import BatchResult, IterationSetup
from cryorefine.images import ImageSettings
from cryorefine.io import mrc

N = 16
N_PARTICLES = 14
BATCH = 3


class Recording:
    """An engine that notes each batch's indices, its unit's set-up and the neighbourhoods it was handed, and runs
    the wrapped engine with them (or, with `ignore_given`, without: the engine computes its own)."""

    def __init__(self, engine, log, ignore_given):
        self.engine, self.log, self.ignore_given = engine, log, ignore_given

    def __getattr__(self, name):  # array_module, stage_seconds, stage_flops
        return getattr(self.engine, name)

    def setup(self, setup):
        self.setup_ = setup
        self.engine.setup(setup)

    def run(self, batch, local=None):
        self.log.append((self.setup_, batch, local))
        return self.engine.run(batch, local=None if self.ignore_given else local)

    def sums(self):
        return self.engine.sums()


class RecordingBackend(NumpyBackend):
    """The numpy backend making Recording engines; with `room=0` a pretend device with no room, on which every
    batch goes to the engine one image per run."""

    def __init__(self, ignore_given=False, room=None):
        super().__init__(np.float64)
        self.log, self.ignore_given, self.room = [], ignore_given, room

    def make_engine(self):
        return Recording(super().make_engine(), self.log, self.ignore_given)

    def free_device_bytes(self):
        return self.room


def unit_setup(seed, sampling, sigma_deg):
    rng = np.random.default_rng(seed)
    z, y, x = np.mgrid[:N, :N, :N] - N // 2
    volume = sum(np.exp(-((x - c[0]) ** 2 + (y - c[1]) ** 2 + (z - c[2]) ** 2) / 4.0)
                 for c in rng.uniform(-3, 3, (5, 3)))
    return IterationSetup(projectors=None, maps=[volume], sigma2_noise=np.full((1, N // 2 + 1), 0.5),
                          sampling=sampling, ori_size_px=N, current_size_px=N, coarse_size_px=12,
                          pixel_size_angstrom=2.0, log_pdf_class=np.zeros(1), sigma_offset_px=3.0,
                          scale_correction=np.ones(1), data_vs_prior=np.full((1, N // 2 + 1), 5.0),
                          local_searches=True, sigma_rot_deg=sigma_deg, sigma_psi_deg=sigma_deg)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    """Two half sets of 7 particles under different local-search set-ups (samplings, symmetry, widths)."""
    star, _ = make_particle_set(tmp_path_factory.mktemp("ahead"), n=N_PARTICLES, box=N, pixel_size=2.0, seed=5)
    particles = load_particles(star)
    settings = ImageSettings(N, 2.0, 16.0, width_mask_edge_px=2.0, do_ctf=True, random_seed=1)
    previous = ParticleState.from_particles(particles, 2.0)
    units = [WorkUnit("half 1", np.arange(0, N_PARTICLES, 2), np.zeros(1, np.int64),
                      unit_setup(1, Sampling(2, 2.0, 1.0, perturbation=0.2), 12.0)),
             WorkUnit("half 2", np.arange(1, N_PARTICLES, 2), np.zeros(1, np.int64),
                      unit_setup(2, Sampling(3, 2.0, 1.0, symmetry="C2"), 7.0))]
    inputs = BatchInputs(3, N, 1.0, previous, use_norms=True)
    return particles, settings, units, inputs


def e_step(problem, backend):
    """run_batches over both units in batches of BATCH: ([(unit, indices, BatchResult)], sums, stages, seconds)."""
    particles, settings, units, inputs = problem
    work = ((u, indices) for u, unit in enumerate(units) for indices in particles.batches(BATCH, unit.members))
    results, stages = [], {}
    tic = time.perf_counter()
    with mrc.StackReader() as reader:
        sums = run_batches(backend, units, work, particles, settings, inputs, reader,
                           lambda u, indices, result: results.append((u, indices.copy(), result)), stages, {})
    return results, sums, stages, time.perf_counter() - tic


def assert_same_neighbourhoods(got, want):
    for name in ("offsets", "orientation", "log_prior"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.parametrize("room", [None, 0], ids=["one run per batch", "one image per run"])
def test_each_batch_is_handed_the_neighbourhoods_of_its_own_particles(problem, room):
    particles, settings, units, inputs = problem
    backend = RecordingBackend(room=room)
    results, _, _, _ = e_step(problem, backend)
    assert len(backend.log) == (3 + 3 if room is None else N_PARTICLES)  # batches of 3, 3 and 1 per half, or one by one
    previous = inputs.previous
    alone = {int(b[0]) for unit in units for b in particles.batches(BATCH, unit.members) if b.size == 1}
    for (setup, batch, local), (u, indices, _) in zip(backend.log, results, strict=True):
        assert setup is units[u].setup and np.isin(indices, units[u].members).all()
        np.testing.assert_array_equal(batch.indices, indices)
        if room == 0 and int(indices[0]) not in alone:  # a batch in several runs: the engine computes each run's
            assert local is None
            continue
        assert local is not None and local.n_particles == indices.size
        # the engine's own computation from the batch, and the sampling's from the particles' previous poses
        assert_same_neighbourhoods(local, local_orientations(setup, batch.prior_rot_deg, batch.prior_tilt_deg,
                                                             batch.prior_psi_deg))
        assert_same_neighbourhoods(local, setup.sampling.local_orientations(
            previous.rot_deg[indices], previous.tilt_deg[indices], previous.psi_deg[indices], setup.sigma_rot_deg,
            setup.sigma_psi_deg))
    # the two units' neighbourhoods differ (a batch under the other unit's set-up would be seen)
    first, other = backend.log[0][0], units[1].setup
    batch = backend.log[0][1]
    assert other is not first
    assert not np.array_equal(local_orientations(first, batch.prior_rot_deg, batch.prior_tilt_deg,
                                                 batch.prior_psi_deg).orientation,
                              local_orientations(other, batch.prior_rot_deg, batch.prior_tilt_deg,
                                                 batch.prior_psi_deg).orientation)


def test_results_are_those_of_engines_computing_their_own_neighbourhoods(problem):
    ahead, ahead_sums, _, _ = e_step(problem, RecordingBackend())
    own, own_sums, _, _ = e_step(problem, RecordingBackend(ignore_given=True))
    for (u, indices, got), (v, want_indices, want) in zip(ahead, own, strict=True):
        assert u == v
        np.testing.assert_array_equal(indices, want_indices)
        for f in dataclasses.fields(BatchResult):
            np.testing.assert_array_equal(getattr(got, f.name), getattr(want, f.name), err_msg=f.name)
    assert sorted(ahead_sums) == sorted(own_sums) == [0, 1]
    for u in own_sums:
        for a, b in zip(ahead_sums[u].pack(), own_sums[u].pack(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_units_of_the_same_references_transform_them_once(problem):
    """Units whose set-ups hold the same map objects (a gradient run's pseudo-half sets) are set up with one set of
    projectors, made once by the backend, and give the results of engines transforming copies of them, bit for
    bit; units of equal maps that are not the same objects each transform their own."""
    particles, settings, units, inputs = problem
    maps = units[0].setup.maps
    same = [dataclasses.replace(u, setup=dataclasses.replace(u.setup, maps=maps)) for u in units]
    copies = [dataclasses.replace(u, setup=dataclasses.replace(u.setup, maps=[m.copy() for m in maps]))
              for u in units]
    runs = {}
    for name, these in (("same", same), ("copies", copies)):
        backend = RecordingBackend()
        made = []
        share = backend.shared_projectors

        def counted(*args, made=made, share=share):
            made.append(args)
            return share(*args)

        backend.shared_projectors = counted
        results, sums, _, _ = e_step((particles, settings, these, inputs), backend)
        runs[name] = (results, sums, made, [setup for setup, _, _ in backend.log])
    _, _, made, setups = runs["same"]
    assert len(made) == 1
    assert all(setup.maps is None and setup.projectors is setups[0].projectors for setup in setups)
    assert {setup.sampling for setup in setups} == {u.setup.sampling for u in units}  # each unit's own otherwise
    _, _, made, setups = runs["copies"]
    assert made == [] and all(setup.projectors is None for setup in setups)
    for (u, indices, got), (v, want_indices, want) in zip(runs["same"][0], runs["copies"][0], strict=True):
        assert u == v
        np.testing.assert_array_equal(indices, want_indices)
        for f in dataclasses.fields(BatchResult):
            np.testing.assert_array_equal(getattr(got, f.name), getattr(want, f.name), err_msg=f.name)
    for u in (0, 1):
        for a, b in zip(runs["same"][1][u].pack(), runs["copies"][1][u].pack(), strict=True):
            np.testing.assert_array_equal(a, b)


def test_neighbourhoods_are_computed_on_a_thread_and_only_waiting_for_them_is_counted(problem, monkeypatch):
    """With neighbourhoods that take 0.2 s each, the batches' are computed on the thread; the stages add up to no
    more than the E-step's wall time (the thread's work is not counted beside the main thread's), and the waits
    are stage `orientations`."""
    threads = []

    def slow(setup, *priors):
        threads.append(threading.current_thread().name)
        time.sleep(0.2)
        return local_orientations(setup, *priors)

    monkeypatch.setattr(estep, "local_orientations", slow)
    backend = RecordingBackend()
    _, _, stages, seconds = e_step(problem, backend)
    main = threading.current_thread().name
    assert threads[:2] == [main, main]  # the samplings' lazy tables, one particle per unit
    assert len(threads) == 2 + 6 and all(name.startswith("neighbourhoods") for name in threads[2:])
    assert all(local is not None for _, _, local in backend.log)
    assert stages["orientations"] >= 0.4  # the two first uses at least
    assert sum(stages.values()) <= seconds + 1e-3


def test_a_local_search_takes_its_particles_along_the_directions_curve(problem):
    """`in_direction_order`: a local search's members sorted by the NEST pixel of their previous directions at the
    curve's order (consecutive batches from one region of the sphere), the same particles; a global search's
    members as they were; the batches still read each one's images in stack order."""
    from cryorefine.core.sampling import healpix_pixels

    particles, _, units, inputs = problem
    rng = np.random.default_rng(8)
    rot, tilt = rng.uniform(-180, 180, N_PARTICLES), np.degrees(np.arccos(rng.uniform(-1, 1, N_PARTICLES)))
    global_unit = dataclasses.replace(units[1], setup=dataclasses.replace(units[1].setup, local_searches=False))
    ordered = estep.in_direction_order([units[0], global_unit], rot, tilt)
    members = ordered[0].members
    assert sorted(members.tolist()) == units[0].members.tolist()
    cells = healpix_pixels(estep.DIRECTION_CURVE_ORDER, rot[members], tilt[members])
    assert np.all(np.diff(cells) >= 0)
    assert not np.array_equal(members, units[0].members)  # 7 random directions are not in index order
    np.testing.assert_array_equal(ordered[1].members, units[1].members)
    for batch in particles.batches(BATCH, members):
        assert np.all(np.diff(batch) > 0)

"""em.loop: what the loop does around the iterations, beside the jobs' own tests."""

import contextlib
import gc
import time
import types

import numpy as np

from cryorefine.em.loop import IterationPlan, StepOutcome, long_lived_objects_frozen, run
from cryorefine.em.state import ModelState, OptimiserState, ParticleState, RunState


def test_objects_alive_before_the_iterations_are_frozen_until_they_end():
    """The garbage collector's full passes skip what lived before the iterations (the particle table, caches), and
    nothing stays frozen after them: a process that runs several jobs does not keep the earlier ones' objects."""
    gc.unfreeze()
    long_lived = [[i] for i in range(10_000)]  # tracked containers, alive before the iterations
    with long_lived_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen >= len(long_lived)
        made_inside = [[i] for i in range(10_000)]  # an iteration's objects stay with the collector
        assert gc.get_freeze_count() == frozen
        del made_inside
    assert gc.get_freeze_count() == 0
    del long_lived


def test_objects_are_let_go_when_the_iterations_fail():
    gc.unfreeze()
    try:
        with long_lived_objects_frozen():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("an iteration failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


class _SlowRunner:
    """A runner whose steps take known times: its set-up, the noise pass, each iteration's E- and M-step, its end."""

    leads = True

    def __init__(self, naps):
        self.naps = naps

    @contextlib.contextmanager
    def session(self):
        time.sleep(self.naps["session"])
        yield self
        time.sleep(self.naps["session_end"])

    def staged(self, particles):
        return contextlib.nullcontext(particles)

    def estimate_accuracy(self, request, particles):
        return request.estimate(particles)

    def announce(self, particles, settings):
        pass

    def begin_initial_noise(self, particles, settings):
        pass

    def initial_noise_spectra(self, particles, settings, n_optics):
        time.sleep(self.naps["noise"])
        return np.ones((n_optics, 5))

    def expectation_maximization(self, job, plan, model, previous, particles, settings, store, progress):
        time.sleep(self.naps["step"])
        return StepOutcome(model, {"coarse": self.naps["step"]}, {}, self.naps["step"], 0.0)


class _ThreeParticles(list):
    """Three particles in one intensity group (what the loop reads of a ParticleSet besides its length)."""

    def scale_group_names_and_counts(self):
        return ["group1"], [3]


class _SlowJob:
    """A job of two iterations over three particles whose load, start, plans and files take known times."""

    kind = "refine"

    def __init__(self, folder, naps):
        self.naps = naps
        self.config = types.SimpleNamespace(output_root=str(folder / "run"), max_iterations=2, do_norm=True,
                                            symmetry="C1", to_json=lambda: "{}")

    def load(self):
        time.sleep(self.naps["load"])
        return _ThreeParticles(range(3)), None

    def start(self, particles, settings, noise_spectra):
        time.sleep(self.naps["start"])
        model = ModelState(ori_size_px=8, pixel_size_angstrom=1.0, sigma2_noise=noise_spectra(particles, settings, 1))
        zeros = np.zeros(3)
        state = ParticleState(zeros, zeros, zeros, zeros, zeros, np.zeros(3, np.int64), np.ones(3), zeros,
                              np.zeros(3, np.int64), zeros)
        return RunState(model, OptimiserState(), state, np.random.default_rng(0))

    def plan(self, run, iteration, estimate_accuracy=None):
        time.sleep(self.naps["plan"])
        run.optimiser.iteration = iteration
        return IterationPlan(iteration, types.SimpleNamespace(current_size_px=8, coarse_size_px=8), None, False, [])

    def update(self, run, plan, changes):
        pass

    def outputs(self, run, plan, snapshot, timings, stages, argv):
        return [lambda: time.sleep(self.naps["files"])]

    def summary(self, run, plan, changes):
        return "slow"

    def finished(self, run, plan):
        return False


def test_every_second_of_a_run_is_in_a_named_stage(tmp_path):
    """The run's start and end are timed stage by stage, and each iteration's plan beside its E- and M-step: the
    named stages hold what the job and the runner spent in each, and together the whole run but a few ms."""
    naps = {"session": 0.3, "load": 0.3, "start": 0.3, "noise": 0.4, "plan": 0.3, "step": 0.05, "files": 0.3,
            "session_end": 0.3}
    slack = 0.2  # a busy machine's sleeps overrun; each stage is still told from its neighbours (≥ 0.3 s each)
    tic = time.perf_counter()
    reports = run(_SlowJob(tmp_path, naps), _SlowRunner(naps))
    wall = time.perf_counter() - tic
    start, end = reports.start_seconds, reports.end_seconds
    expected = {"device and workers set up": naps["session"], "particles, reference and masks read": naps["load"],
                "initial model (maps, schedule)": naps["start"], "initial noise spectra": naps["noise"]}
    for name, seconds in expected.items():
        assert seconds <= start[name] < seconds + slack, (name, start[name])
    assert naps["files"] * 0.9 <= end["last files written"] < naps["files"] + slack  # the last iteration's files
    assert naps["session_end"] <= end["device and workers let go"] < naps["session_end"] + slack
    assert [r.iteration for r in reports] == [1, 2]
    for r in reports:
        assert naps["plan"] <= r.seconds["plan"] < naps["plan"] + slack
    named = sum(start.values()) + sum(end.values()) + sum(sum(r.seconds.values()) for r in reports)
    assert wall - slack < named <= wall

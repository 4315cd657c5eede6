"""The one iteration loop that every job runs, serially or under MPI.

    session (the backend's run scope; under MPI the workers are told the run is set up)
    job.load → job.start (or the saved state of --continue)
    iteration 0's files (a new run: RELION's run_it000_*, the state before iteration 1), on the writer's thread;
        or, a run continued under a new root, the files of the iteration it goes on from, written again there
    for each iteration:
        job.plan          schedule: image sizes, sampling, the E-step's work units
        runner            E-step of every unit (batches, per-particle results), sums reduced,
                          job.maximize on them (the M-step: new maps and model)
        job.update        resolution, convergence, what the job keeps between iterations
        outputs           --continue's state, then job.outputs written on a thread
        until job.finished or --iter

A refinement's final iteration (`IterationPlan.final`) writes only the converged run's files, as RELION does: no
run_itNNN_* files and no --continue state of its own.

A job (`Job`) states what it needs from the loop; the runner (`runners.serial.SerialRunner`,
`runners.mpi.MpiRunner`) decides where each step runs. Nothing here knows how an engine computes
or how many processes there are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cryorefine.data import load_particles
from cryorefine.em import schedule
from cryorefine.em.estep import add_seconds, fine_pass_limits_reached, in_direction_order, keep_norms_unless_refined
from cryorefine.em.state import IterationReport, ModelState, OptimiserState, ParticleState, RunReports, RunState
from cryorefine.errors import InputError, RunInterrupted, Terminated
from cryorefine.images import ImageSettings
from cryorefine.io import resume, run_files
from cryorefine.io.background import BackgroundWriter, Together

log = logging.getLogger("cryorefine")


@dataclass
class IterationPlan:
    """What one iteration's E- and M-step do: sent to every MPI worker."""

    iteration: int
    sizes: Any  # em.schedule.ImageSizes
    sampling: Any  # core.sampling.Sampling (perturbed)
    do_cc: bool  # cross-correlation instead of likelihood (--firstiter_cc, first iteration)
    units: list  # em.estep.WorkUnit: the E-step's work, one engine set-up each
    final: bool = False  # the last iteration (a refinement's halves joined, to Nyquist)

    @property
    def n_particles(self) -> int:
        """The particles this iteration's E-step takes (a gradient run's mini-batch, else all): its units' members."""
        return sum(len(unit.members) for unit in self.units)


@dataclass
class StepOutcome:
    """What a runner's E- and M-step gave: the new model, and where the time went."""

    model: Any  # em.state.ModelState after the M-step
    stages: dict  # E-step seconds per stage (summed over workers under MPI; its "broadcast" is the master's)
    flops: dict  # useful floating-point operations per engine stage
    expectation_seconds: float
    maximization_seconds: float
    maximization_stages: dict = dataclasses.field(default_factory=dict)  # MPI: seconds of the M-step's parts
    # seconds of the job's own M-step parts (`em.mstep.timed_part`; under MPI as rank 1 ran them), where it times them
    maximization_parts: dict = dataclasses.field(default_factory=dict)
    # MPI: an io.background.WaitFor of the model's maps, which reach the master while the next E-step runs (the
    # loop touches no map until its files are written: a plan only names them, and its accuracy estimate is made on
    # rank 1, which holds them; `Runner.estimate_accuracy`)
    maps_arrival: Any = None


class Job(Protocol):
    """A kind of run (refine, classify): what the loop asks of it."""

    kind: str  # "refine" or "classify": what --continue checks a saved run against
    config: Any  # config.RefineConfig
    min_mpi_ranks: int  # the fewest MPI ranks (master included) the job runs on

    def load(self):
        """(ParticleSet, images.ImageSettings), the inputs checked (`particles_and_settings` does the common part);
        the loop then makes the output folder."""

    def start(self, particles, settings, noise_spectra) -> RunState:
        """The state before iteration 1 (initial maps, schedule; the initial noise spectra from the runner's
        `noise_spectra(particles, settings, n_optics)`)."""

    def resume(self, run: RunState, particles, iteration_root: str) -> None:
        """A --continue state (its box and particle count already checked) completed: its maps read from the
        files of `iteration_root` (out/run_itNNN)."""

    def plan(self, run: RunState, iteration: int, estimate_accuracy=None) -> IterationPlan:
        """The schedule of `iteration` (updates run.optimiser); its work units. An accuracy estimate it needs it asks
        of `estimate_accuracy` (an `em.accuracy.Estimator`: the runner's; None: `estimate_on_host`)."""

    def maximization_groups(self, plan: IterationPlan) -> list:
        """The maps of the M-step in groups, each a list of (unit, class index in the unit) whose sums must be in
        one process to be made (an MPI runner shares the groups out over the workers; one process makes all)."""

    def maximize(self, model, sums: list, plan: IterationPlan, backend, peers, parts=None):
        """The M-step on `backend` (estep.backend): a new ModelState from `model` and the reduced WeightedSums of
        each unit (their volumes on the host or the device; the job moves them as it needs and may let them go).
        Under MPI every worker runs it on the volumes of the groups it makes (None for the others; every unit's
        other sums are whole everywhere) and shares what the others need through `peers.gather_all` (one
        process: `em.mstep.ALONE`); every worker's model then has every map. A job may add the seconds of its
        parts to the dict `parts` (`em.mstep.timed_part`)."""

    def update(self, run: RunState, plan: IterationPlan, changes) -> None:
        """After the M-step (run.model is the new model): resolution, convergence, the job's extras."""

    def outputs(self, run: RunState, plan: IterationPlan, snapshot, timings: dict, stages: dict, argv) -> list:
        """The iteration's files as callables (run on the writer thread), RELION's names."""

    # A job may also have (jobs without it write no iteration-0 files and cannot be continued from iteration 0):
    # def initial_outputs(self, run: RunState, argv, under_mpi: bool) -> list:
    #     """The files RELION writes before iteration 1 (run_it000_*: the starting maps, model, particles and
    #     optimiser.star) as callables, as relion_refine (`under_mpi` False) or relion_refine_mpi writes them."""
    # and `relion_runs_only_under_mpi = True` where RELION runs the job only as relion_refine_mpi (its files, such as
    # the sampling.star a --continue under a new root writes again, are then that program's in one process too).
    # and, for maps large enough that page-locking their host copies costs the first iterations time:
    # def host_map_bytes(self, box_px: int) -> list[int]:
    #     """The bytes of each map an M-step leaves on the host (every map, on every MPI worker), which a runner
    #     may have made page-locked ahead (`gpu.pinned.PinnedAhead`)."""

    def summary(self, run: RunState, plan: IterationPlan, changes) -> str:
        """The iteration's log line, after "iteration N: "."""

    def finished(self, run: RunState, plan: IterationPlan) -> bool:
        """True when `plan` was the last iteration (a refinement's final one)."""


class Runner(Protocol):
    """Where the loop's steps run (`runners.serial.SerialRunner`, `runners.mpi.MpiRunner`): what the loop asks."""

    leads: bool  # this process runs the loop (False: an MPI worker, which serves instead)
    n_workers: int  # the worker processes under MPI (0: this process runs everything)

    def serve(self, job) -> None:
        """An MPI worker's part of the whole run."""

    def initial_noise_spectra(self, particles, settings, n_optics):
        """RELION's initial noise spectra (n_optics, shells) from all images, on the runner's engines."""

    def begin_initial_noise(self, particles, settings) -> None:
        """Start the initial noise pass where it runs beside this process (MPI: on the workers), so that
        `initial_noise_spectra` of these particles, called by `job.start` once the starting maps are made, only
        collects it; nothing where it would run here."""

    def session(self):
        """A context manager around the run (the device arena; MPI: the workers' start and stop, failures)."""

    def staged(self, particles):
        """A context manager giving the particles whose images the run reads (--scratch_dir copies)."""

    def estimate_accuracy(self, request, particles):
        """A plan's accuracy estimate (`em.accuracy.AccuracyRequest`; the `em.accuracy.Estimator` the loop gives
        `job.plan`): one process makes it on its engine's device; under MPI the first worker, on its device, with the
        maps it holds (RELION's first follower makes it too)."""

    def expectation_maximization(self, job, plan, model, previous, particles, settings, store, progress) -> StepOutcome:
        """The E-step of every unit of `plan` (results through `store(indices, BatchResult)`) and `job.maximize`."""


def run(job, runner, argv=(), progress=None, resume_from=None, stop_requested=None, overwrite=False):
    """Run `job` to its end with `runner`; its `RunReports` (None on an MPI worker).

    `progress(done, total)` is called as batches finish; `resume_from` is a run_itNNN_optimiser.star:
    the run goes on from iteration NNN + 1 exactly as it would have. `stop_requested()` is asked before
    each iteration: when it says so, the run ends there (its last iteration's files stay valid for
    --continue). A new run (no `resume_from`) refuses an output root that holds an earlier run's files, or with
    `overwrite` (--overwrite) removes them first (`io.run_files`).
    """
    if not runner.leads:  # an MPI worker: serves the master's E- and M-steps until the run ends
        runner.serve(job)
        return None
    config = job.config
    reports = RunReports()
    clock = StageClock(reports.start_seconds)

    def noise_spectra(*args):  # job.start's call, timed apart from the rest of the start
        clock.mark(INITIAL_MODEL)
        spectra = runner.initial_noise_spectra(*args)
        clock.mark("initial noise spectra")
        return spectra

    with runner.session() as session, interruption_reported(job.kind, config.output_root, reports, resume_from), \
            contextlib.ExitStack() as stack:
        clock.mark("device and workers set up")
        if resume_from is None:
            run_files.check_no_earlier_run(config.output_root, overwrite, log)
        particles, settings = job.load()
        Path(config.output_root).parent.mkdir(parents=True, exist_ok=True)
        particles = stack.enter_context(runner.staged(particles))
        if resume_from is None:  # the workers' noise pass runs while job.start makes the starting maps
            runner.begin_initial_noise(particles, settings)
        clock.mark("particles, reference and masks read")
        if resume_from is not None:
            state = restored_state(resume_from, job.kind)
            if state.model.ori_size_px != settings.ori_size_px:
                raise InputError(f"{resume_from}: the run was {state.model.ori_size_px} px, the particles are "
                                 f"{settings.ori_size_px} px")
            if state.particles.rot_deg.size != len(particles):
                raise InputError(f"{resume_from}: the run had {state.particles.rot_deg.size} particles, the STAR "
                                 f"file has {len(particles)}; continue with the same --i")
            scales = state.model.scale_correction
            if scales is not None and np.size(scales) != particles.n_scale_groups:  # a run saved before its groups
                log.warning("%s: %d intensity scales saved for %d groups of the particles; the scales start again "
                            "from 1", resume_from, np.size(scales), particles.n_scale_groups)
                state.model.scale_correction = np.ones(particles.n_scale_groups)
            job.resume(state, particles, resume.iteration_root(resume_from))
            reports.continued_from = state.optimiser.iteration
            log.info("continued from iteration %d (%s)", state.optimiser.iteration, resume_from)
            clock.mark("saved state read (--continue)")
        else:
            state = job.start(particles, settings, noise_spectra)
            clock.mark(INITIAL_MODEL)
        # the weights of the intensity scales' mean (RELION's nr_particles_per_group): of the particles, not saved
        state.model.particles_per_scale_group = np.asarray(particles.scale_group_names_and_counts()[1])
        session.announce(particles, settings)
        clock.mark("workers told the run is set up")
        out_root = config.output_root
        with BackgroundWriter() as writer, long_lived_objects_frozen():
            clock.mark("long-lived objects frozen")
            if resume_from is None:
                initial_files_submitted(job, state, runner, writer, argv)
                clock.mark("iteration 0's files handed to the writer")
            else:
                continued_files_submitted(job, state, runner, writer, argv, resume_from)
            log_stages("run start", reports.start_seconds)
            for iteration in range(state.optimiser.iteration + 1, config.max_iterations + 1):
                if stop_requested is not None and stop_requested():
                    log.warning("stopped before iteration %d as asked (RELION_JOB_ABORT_NOW)", iteration)
                    break
                tic = time.perf_counter()
                plan = job.plan(state, iteration, runner.estimate_accuracy)
                plan = dataclasses.replace(plan, units=in_direction_order(plan.units, state.particles.rot_deg,
                                                                          state.particles.tilt_deg))
                previous = state.particles.copy()
                plan_seconds = time.perf_counter() - tic
                outcome = runner.expectation_maximization(job, plan, state.model, previous, particles, settings,
                                                          state.particles.store, progress)
                tic = time.perf_counter()
                keep_norms_unless_refined(config.do_norm, previous, state.particles)
                changes = schedule.hidden_variable_changes(previous, state.particles,
                                                           state.model.pixel_size_angstrom, config.symmetry)
                state.model = outcome.model
                for reached in fine_pass_limits_reached(plan.units, state.particles.n_significant):
                    log.warning("iteration %d: %d of %d particles reached the fine pass's limit of %d significant "
                                "coarse samples (%d fine samples each; a broad coarse posterior), each keeping its %d "
                                "most probable; --maxsig sets a limit of its own%s", iteration, reached.n_reached,
                                reached.n_particles, reached.limit, reached.children, reached.limit,
                                ", --relion_oversampling keeps RELION's sampling, 32 times fewer fine samples"
                                if reached.raised else "")
                job.update(state, plan, changes)
                timings = {"plan": plan_seconds, "expectation": outcome.expectation_seconds,
                           "maximization": outcome.maximization_seconds + time.perf_counter() - tic}

                tic = time.perf_counter()
                snapshot = state.particles.copy()  # the next E-step changes the state while the writer reads this
                writes = job.outputs(state, plan, snapshot, timings, outcome.stages, argv)
                # what --continue reads beside the iteration's optimiser.star: none where the iteration writes no
                # files (a gradient run's iterations between --grad_write_iter's: 8.4 MB and 15-20 ms each at 105,247
                # particles, and no optimiser.star to go on from) nor in the final iteration (no optimiser.star)
                if writes and not plan.final:
                    resume.save(f"{out_root}_it{iteration:03d}{resume.SUFFIX}", *saved_state(job.kind, config, state,
                                                                                              snapshot))
                submitted = writes if outcome.maps_arrival is None else [outcome.maps_arrival, *writes]
                waited = writer.submit(submitted)
                timings["write"] = time.perf_counter() - tic  # the loop's share: building the outputs, and waiting
                # the previous iteration's files on the writer's thread (none said where this one wrote nothing and
                # so did not wait for them)
                previous_files = dict(writer.last_seconds) if submitted else {}
                model, optimiser = state.model, state.optimiser
                reports.append(IterationReport(
                    iteration, model.current_resolution_angstrom, plan.sizes.current_size_px,
                    plan.sizes.coarse_size_px, optimiser.healpix_order, bool(optimiser.local_searches),
                    changes.orientations_deg, changes.offsets_angstrom, model.ave_pmax, timings,
                    dict(outcome.stages), dict(outcome.flops)))
                log.info("iteration %d: %s, E %.1f s, M %.1f s", iteration, job.summary(state, plan, changes),
                         timings["expectation"], timings["maximization"])
                log.info("  E-step stages (s): %s", ", ".join(f"{name} {seconds:.1f}"
                                                               for name, seconds in outcome.stages.items()))
                log.info("  between iterations (s): plan %.1f, outputs %.1f (of which waiting for the previous "
                         "iteration's files %.1f; those took %.1f on the writer, %.1f more waiting for their maps)",
                         plan_seconds, timings["write"], waited, previous_files.get("writing", 0.0),
                         previous_files.get("waiting", 0.0))
                if outcome.maximization_stages:
                    log.info("  M-step stages (s): %s", ", ".join(f"{name} {seconds:.1f}" for name, seconds
                                                                   in outcome.maximization_stages.items()))
                if outcome.maximization_parts:
                    log.info("  M-step parts (s): %s", ", ".join(f"{name} {seconds:.2f}" for name, seconds
                                                                  in outcome.maximization_parts.items()))
                if job.finished(state, plan):
                    reports.finished = True
                    break
            end = StageClock(reports.end_seconds)
            writer.wait()
            end.mark("last files written")
        end.mark("long-lived objects thawed")
    end.mark("device and workers let go")
    log_stages("run end", reports.end_seconds)
    return reports


INITIAL_MODEL = "initial model (maps, schedule)"


def initial_files_submitted(job, state: RunState, runner, writer, argv) -> None:
    """A new run's iteration-0 files (`job.initial_outputs`, RELION's run_it000_*) handed to `writer`, after the
    state --continue reads beside run_it000_optimiser.star (a continued run then goes on from iteration 1 exactly as
    this one does, but for its maps, read back from their files). Nothing for a job without iteration-0 files."""
    initial_outputs = getattr(job, "initial_outputs", None)
    if initial_outputs is None:
        return
    root = run_files.iteration_root(job.config.output_root, 0)
    resume.save(f"{root}{resume.SUFFIX}", *saved_state(job.kind, job.config, state, state.particles.copy()))
    writer.submit(initial_outputs(state, list(argv), runner.n_workers > 0))


def continued_files_submitted(job, state: RunState, runner, writer, argv, resume_from: str) -> None:
    """A run continued under a new output root (--continue: RELION's <root>_ct<N> where --o is none or the run's
    own, `io.run_files.continued_output_root`; or another --o): the files of the iteration it goes on from written
    again under that root before the next iteration, as RELION's MlOptimiser::initialise writes them
    (`io.run_files.continued_iteration_writes`: the sampling.star as relion_refine_mpi writes it, under mpirun or for
    an auto-refine, which RELION runs only under MPI), after the state --continue reads beside their optimiser.star,
    so that the new root's copy of that iteration can itself be continued from. Nothing under the run's own root."""
    with_sampling = runner.n_workers > 0 or bool(getattr(job, "relion_runs_only_under_mpi", False))
    writes = run_files.continued_iteration_writes(resume_from, job.config.output_root, list(argv), with_sampling)
    if not writes:
        return
    iteration = state.optimiser.iteration
    resume.save(f"{run_files.iteration_root(job.config.output_root, iteration)}{resume.SUFFIX}",
                *saved_state(job.kind, job.config, state, state.particles.copy()))
    writer.submit([Together(writes[:-1]), writes[-1]])
    log.info("iteration %d's files written again under %s (the continued run's root)", iteration,
             job.config.output_root)


@contextlib.contextmanager
def interruption_reported(kind: str, out_root: str, reports, resume_from: str | None):
    """Ctrl-C (KeyboardInterrupt) or SIGTERM (errors.Terminated) in the run becomes RunInterrupted, raised once the
    writer has finished the files of the iterations it was given (its `with` waits for them): the message names
    the last iteration whose files --continue reads are on disk and the command that resumes it."""
    try:
        yield
    except KeyboardInterrupt as exc:
        how, exit_code = ("SIGTERM", 143) if isinstance(exc, Terminated) else ("Ctrl-C", 130)
        iterations = [r.iteration for r in reports] if resume_from is not None else [0, *(r.iteration for r in
                                                                                          reports)]
        complete = run_files.last_complete_iteration(out_root, iterations, resume_from)
        if complete is None:
            raise RunInterrupted(f"interrupted ({how}) before iteration 1 was complete: nothing to continue from; "
                                 f"start the run again (with --overwrite where it left files)", exit_code) from None
        iteration, optimiser_star = complete
        raise RunInterrupted(f"interrupted ({how}); iteration {iteration} is the last complete one: resume with "
                             f"`cryorefine {kind} --continue {optimiser_star}`", exit_code) from None


class StageClock:
    """Seconds of consecutive stages added to `into` by name, each from the previous mark (or the clock's start)."""

    def __init__(self, into):
        self.into = into
        self.tic = time.perf_counter()

    def mark(self, name):
        self.tic = add_seconds(self.into, name, self.tic)


def log_stages(label, stages):
    """One log line: the stages' total and each stage of 5 ms or more."""
    shown = [f"{name} {seconds:.2f}" for name, seconds in stages.items() if seconds >= 0.005]
    log.info("%s: %.1f s%s", label, sum(stages.values()), f" ({', '.join(shown)})" if shown else "")


@contextlib.contextmanager
def long_lived_objects_frozen():
    """The objects alive when the iterations start (the particle table, the sampling's and the engine's caches,
    the modules) are left out of the garbage collector's full passes until they end. A full pass goes over every
    tracked object while it holds the interpreter; the iteration writer's garbage set them off on its thread
    beside the E-step, whose thread waited 0.11-0.14 s each time (11 times in the 10k auto-refine)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def particles_and_settings(config):
    """The particle set of config.input_star (with CTF columns for --ctf) and the image settings of the run
    (the particle diameter clipped to the box, with a warning)."""
    particles = load_particles(config.input_star)
    box, pixel = particles.geometry()
    config.check_for_box(box)
    if config.do_ctf:
        particles.require_ctf()
    schedule.warn_if_diameter_clipped(config, box, pixel, log)
    settings = ImageSettings(box, pixel, schedule.default_particle_diameter_angstrom(config, box, pixel),
                             config.width_mask_edge_px, config.zero_mask, config.do_ctf, config.random_seed,
                             config.ctf_intact_first_peak)
    return particles, settings


# ---------------------------------------------------------------------- --continue
MODEL_ARRAYS = ("pdf_class", "sigma2_noise", "tau2", "ssnr", "reference_sigma2", "fsc_halves", "scale_correction",
                "class_distribution", "pdf_direction", "fsc_unmasked", "fsc_masked", "fsc_random_masked")


def saved_state(kind, config, state, particles):
    """(document, arrays) of io.resume for `state` with the per-particle values `particles`."""
    import json

    scalars = {f.name: getattr(state.model, f.name) for f in dataclasses.fields(state.model)
               if f.name not in MODEL_ARRAYS + ("maps", "joined_map", "moments", "particles_per_scale_group")}
    document = {"config": json.loads(config.to_json()), "job": kind, "model": scalars,
                "optimiser": dataclasses.asdict(state.optimiser),
                "schedule": None if state.schedule is None else dataclasses.asdict(state.schedule),
                "rng": state.rng.bit_generator.state,
                "extras": {k: v for k, v in state.extras.items() if np.ndim(v) == 0}}
    arrays = {f"model_{name}": getattr(state.model, name) for name in MODEL_ARRAYS
              if getattr(state.model, name) is not None}
    arrays.update({f"particle_{f.name}": getattr(particles, f.name) for f in dataclasses.fields(particles)})
    arrays.update({f"extra_{k}": np.asarray(v) for k, v in state.extras.items() if np.ndim(v) > 0})
    return document, arrays


def restored_state(optimiser_star, kind):
    """The RunState saved beside `optimiser_star` (without maps: the job reads them), checked to be of `kind`."""
    document, arrays = resume.load(optimiser_star)
    saved_kind = document.get("job") or ("classify" if document["schedule"] is None else "refine")
    if saved_kind != kind:
        mine = "classification" if saved_kind == "classify" else "refinement"
        raise InputError(f"{optimiser_star}: belongs to a {mine}; continue it with `cryorefine {saved_kind} "
                         f"--continue`")
    model = ModelState(**document["model"])
    for name in MODEL_ARRAYS:
        if f"model_{name}" in arrays:
            setattr(model, name, arrays[f"model_{name}"])
    rng = np.random.default_rng()
    rng.bit_generator.state = document["rng"]
    particles = ParticleState(**{f.name: arrays[f"particle_{f.name}"] for f in dataclasses.fields(ParticleState)})
    extras = dict(document.get("extras", {}))
    extras.update({name[len("extra_"):]: value for name, value in arrays.items() if name.startswith("extra_")})
    sched = None if document["schedule"] is None else schedule.ScheduleState(**document["schedule"])
    return RunState(model, OptimiserState(**document["optimiser"]), particles, rng, sched, extras)

"""One process runs the whole job: every work unit's batches in turn on its backend (the GPU engine
when CuPy sees a device, else numpy), then the job's M-step on the same backend."""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from cryorefine.data import scratch_copy
from cryorefine.em import mstep
from cryorefine.em.estep import (
    BatchInputs,
    add_seconds,
    empty_sums,
    initial_noise_spectra,
    kept_images,
    kept_images_reserve_bytes,
    run_batches,
    sums_wait_on_host,
)
from cryorefine.em.loop import StepOutcome, log_stages

log = logging.getLogger("cryorefine")


class SerialRunner:
    """Runs the E- and M-steps in this process on `backend` (estep.backend)."""

    leads = True  # runs the iteration loop itself
    n_workers = 0  # no MPI workers: this process runs everything

    def __init__(self, backend, batch_size_for, preread_images=False, scratch_dir=None):
        self.backend = backend
        self.batch_size_for = batch_size_for  # particles per batch of images of a box (config.batch_size_for)
        self.preread_images = bool(preread_images)
        self.scratch_dir = scratch_dir
        self.kept = None  # the images kept on the GPU (em.estep.kept_images), decided before the first E-step

    def initial_noise_spectra(self, particles, settings, n_optics):
        """The initial noise pass over all images, prepared on the backend (the device's arena is open)."""
        stages = {}
        with self.backend.iteration_scope():
            spectra = initial_noise_spectra(particles, settings, n_optics, self.batch_size_for(settings.ori_size_px),
                                            self.backend.array_module, self.backend.free_device_bytes, stages)
        log_stages("initial noise spectra", stages)
        return spectra

    def begin_initial_noise(self, particles, settings):
        """Nothing: the noise pass runs here, when job.start asks for it."""

    @contextlib.contextmanager
    def session(self):
        """The whole run inside the backend's run scope (the GPU arena)."""
        with self.backend.run_scope():
            try:
                yield self
            finally:
                self.kept = None  # its device memory goes back before the arena closes

    def announce(self, particles, settings):
        """Nothing to tell: there are no workers."""

    def estimate_accuracy(self, request, particles):
        """A plan's accuracy estimate (`em.accuracy.AccuracyRequest`), made on the backend (the GPU where the run has
        one)."""
        return self.backend.estimate_accuracy(request, particles)

    def staged(self, particles):
        """The particles read from copies of their stacks under --scratch_dir for the run (data.scratch_copy)."""
        return scratch_copy(particles, self.scratch_dir, log)

    def expectation_maximization(self, job, plan, model, previous, particles, settings, store, progress):
        tic = time.perf_counter()
        stages, flops = {}, {}
        inputs = BatchInputs(plan.iteration, plan.sizes.current_size_px, model.avg_norm_correction, previous,
                             job.config.do_norm)
        work = ((u, indices) for u, unit in enumerate(plan.units)
                for indices in particles.batches(self.batch_size_for(settings.ori_size_px), unit.members))

        def on_result(u, indices, result):
            store(indices, result)
            if progress:
                progress(indices.size, plan.n_particles)

        if self.kept is None:  # between iterations, in the run's scope
            reserve = kept_images_reserve_bytes(job.config, model, particles.geometry()[0])
            self.kept = kept_images(self.backend, particles, np.arange(len(particles)), reserve, log) or False
        with self.backend.iteration_scope():
            preread = np.arange(len(particles)) if self.preread_images else None
            reading = time.perf_counter()
            with particles.image_reader(preread) as reader:
                if preread is not None:
                    add_seconds(stages, "preread", reading)  # the first iteration reads them in
                sums = run_batches(self.backend, plan.units, work, particles, settings, inputs, reader, on_result,
                                   stages, flops, park_finished=sums_wait_on_host(self.backend, plan.units),
                                   kept=self.kept or None)
            sums = [sums[u] if u in sums else empty_sums(unit, self.backend.array_module, self.backend.sums_dtype)
                    for u, unit in enumerate(plan.units)]
            expectation = time.perf_counter() - tic
            tic = time.perf_counter()
            parts = {}
            with self.backend.maximization_scope():
                new_model = job.maximize(model, sums, plan, self.backend, mstep.ALONE, parts=parts)
            del sums
        maximization = time.perf_counter() - tic
        return StepOutcome(new_model, stages, flops, expectation, maximization,
                           maximization_parts=mstep.parts_with_rest(parts, maximization))

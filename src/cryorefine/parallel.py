"""MPI master/worker refinement: `mpirun -n N cryorefine refine ...` (N ≥ 3).

Rank 0 is the master: it reads the STAR file, splits the halves, runs the loop of `refine.py`
(schedule, M-step, every output file) and, for each iteration's E-step, broadcasts the model and
hands out particle batches on request (one queue per half, so a slow worker simply asks less
often), storing each batch's per-particle results as they come back. Workers (odd ranks: half 1,
even ranks: half 2) read their batches' images themselves, run their own engine (the GPU engine
on one device each when CuPy sees one, else numpy; `--preread_images` keeps their half's
images in memory), and at the end of the E-step their weighted sums are added up by MPI
reductions inside the half's communicator of workers, in chunks of host buffers, onto the half's
first worker (rank 1, rank 2). Rank 2 passes half 2's sums to rank 1, which runs refine's M-step
for both halves (on its GPU when it has one) and sends the updated model to the master. The
M-step is refine's own code, so results do not depend on the number of ranks beyond the order
of floating-point sums.

Failure: an exception on any rank prints one line naming the rank, the host and the cause, and
aborts the whole job (MPI_Abort, exit code 2): no rank is left waiting. A bad input found while
the master sets the run up ends every rank with exit code 2 and one message from the master.

CRYOREFINE_FAULT="RANK:ITERATION" makes that worker raise at its first batch of that iteration:
the hook the failure tests use.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

from cryorefine.errors import InputError

TAG_REQUEST = 11  # worker -> master: ("ready", None) or ("result", (indices, BatchResult))
TAG_WORK = 12  # master -> worker: particle indices of the next batch, or None when the half is done
TAG_SUMS = 13  # rank 2 -> rank 1: half 2's reduced sums
TAG_MODEL = 14  # rank 1 -> master: the model after the M-step, and the FSC
REDUCE_CHUNK_ELEMENTS = 1 << 24  # float64 elements per MPI reduction (128 MB)
# the job size as the launchers set it (not SLURM_NTASKS: a plain command inside a batch job is no MPI run)
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                         "SLURM_LOCALID", "PMIX_LOCAL_RANK")


def launched_with_mpi():
    """True when this process is one of several started by mpirun/mpiexec/srun (from their environment)."""
    for name in _SIZE_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 1:
            return True
    return False


def rank_from_environment():
    """This process's rank as mpirun/srun set it (0 without MPI)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


def half_of_rank(rank):
    """0 (half 1) for odd ranks, 1 (half 2) for even ranks > 0."""
    return 0 if rank % 2 == 1 else 1


def _local_rank(rank):
    for name in _LOCAL_RANK_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return rank


def _abort(comm, exc):
    """One line naming the rank, host and cause, then end every rank of the job."""
    rank = comm.Get_rank()
    message = str(exc) if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
    sys.stderr.write(f"cryorefine: error: rank {rank} on {socket.gethostname()}: {message}\n")
    sys.stderr.flush()
    time.sleep(1.0)  # let mpirun forward the line before the abort tears the job down
    comm.Abort(2)


def refine_mpi(config, argv=(), progress=None, resume_from=None):
    """The refinement under MPI: the master's reports on rank 0, None on the workers."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 3:
        if rank == 0:
            raise InputError(f"mpirun -n {size}: refine needs at least 3 MPI ranks (a master and one worker per "
                             f"half set); run with -n 3 or more, or without mpirun")
        sys.exit(2)
    # one communicator per half set, of its workers alone: rank 1 leads half 1, rank 2 half 2
    half_comm = comm.Split(MPI.UNDEFINED if rank == 0 else half_of_rank(rank), rank)
    if rank == 0:
        return _master(comm, config, argv, progress, resume_from)
    try:
        _worker(comm, half_comm, config)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        _abort(comm, exc)
    return None


# ---------------------------------------------------------------------------------------------- master
class _Master:
    """Plays the engine factory for refine's loop: its expectation_maximization farms the E-step out."""

    def __init__(self, comm, config, progress):
        self.comm, self.config, self.progress = comm, config, progress
        self.started = False

    def announce(self, particles, settings, halves):
        """First broadcast: the run is set up (the workers load the particles and go on)."""
        self.comm.bcast(("setup", (settings, halves)), root=0)
        self.started = True

    def expectation_maximization(self, config, make_engine, progress, particles, settings, members, model, optimiser,
                                 sampling, sizes, state, iteration, do_cc, final, timings):
        from cryorefine import refine as single

        comm = self.comm
        tic = time.perf_counter()
        old = state.copy()
        comm.bcast(("iteration", (model, optimiser, sampling, sizes, state, iteration, do_cc, final)), root=0)
        queues = [list(particles.batches(config.batch_size, members[h])) for h in (0, 1)]
        workers_left = comm.Get_size() - 1
        from mpi4py import MPI

        status = MPI.Status()
        while workers_left:
            while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REQUEST, status=status):
                time.sleep(0.0005)  # poll gently: the master must not take a core from the workers
            source = status.Get_source()
            kind, payload = comm.recv(source=source, tag=TAG_REQUEST)
            if kind == "result":
                indices, result = payload
                state.store(indices, result)
                if progress:
                    progress(indices.size, len(particles))
            queue = queues[half_of_rank(source)]
            if queue:
                comm.send(queue.pop(0), dest=source, tag=TAG_WORK)
            else:
                comm.send(None, dest=source, tag=TAG_WORK)
                workers_left -= 1
        single.keep_norms_unless_refined(config, old, state)
        stages, flops = {}, {}
        for worker_stages, worker_flops in comm.gather(({}, {}), root=0)[1:]:  # the workers' E-steps are over
            for name, seconds in worker_stages.items():
                stages[name] = stages.get(name, 0.0) + seconds
            for name, count in worker_flops.items():
                flops[name] = flops.get(name, 0.0) + count
        timings["expectation"] = time.perf_counter() - tic
        tic = time.perf_counter()
        changes = single._hidden_variable_changes(old, state, model.pixel_size_angstrom, config.symmetry)
        # the M-step runs on rank 1 (on its GPU when it has one); the model comes back updated
        updated, fsc = comm.recv(source=1, tag=TAG_MODEL)
        model.__dict__.update(updated.__dict__)
        timings["maximization"] = time.perf_counter() - tic
        return fsc, changes, timings, stages, flops

    def __call__(self):  # refine's loop never asks the master for an engine of its own
        raise RuntimeError("the MPI master runs no engine")


def _master(comm, config, argv, progress, resume_from):
    from cryorefine import refine as single

    master = _Master(comm, config, progress)
    try:
        reports = single._refine(config, argv, master, progress, resume_from, on_setup=master.announce)
    except BaseException as exc:
        if not master.started:  # nothing distributed yet: every rank ends quietly, the master reports
            comm.bcast(("error", None), root=0)
            raise
        _abort(comm, exc)
    comm.bcast(("stop", None), root=0)
    return reports


# ---------------------------------------------------------------------------------------------- worker
def _worker(comm, half_comm, config):
    from cryorefine.data import load_particles
    from cryorefine.images import prepare_batch
    from cryorefine.refine import (_iteration_setup, _scope_of, add_engine_stages, default_engine_factory,
                                   image_array_module, image_norms)

    rank = comm.Get_rank()
    kind, payload = comm.bcast(None, root=0)
    if kind != "setup":  # the master could not set the run up and says why
        sys.exit(2)
    settings, halves = payload
    particles = load_particles(config.input_star, check_stacks=False)
    half = half_of_rank(rank)
    mine = np.flatnonzero(np.asarray(halves) == half + 1)  # this worker's half set (--preread_images reads it)
    fault = os.environ.get("CRYOREFINE_FAULT", "")
    fault_rank, _, fault_iteration = fault.partition(":")
    factory = default_engine_factory(_worker_config(config, rank, comm.Get_size()))
    with _scope_of(factory, "run_scope"):
        while True:
            kind, payload = comm.bcast(None, root=0)
            if kind != "iteration":
                return
            model, optimiser, sampling, sizes, state, iteration, do_cc, final = payload
            with _scope_of(factory, "iteration_scope"):
                tic_setup = time.perf_counter()
                engine = factory()
                engine.setup(_iteration_setup(model, optimiser, config, sampling, sizes, half, do_cc))
                stages, flops = {"setup": time.perf_counter() - tic_setup, "images": 0.0}, {}
                comm.send(("ready", None), dest=0, tag=TAG_REQUEST)
                with particles.image_reader(mine if config.preread_images else None) as reader:
                    while True:
                        indices = comm.recv(source=0, tag=TAG_WORK)
                        if indices is None:
                            break
                        if fault_rank == str(rank) and fault_iteration == str(iteration):
                            raise RuntimeError(f"injected fault at iteration {iteration} (CRYOREFINE_FAULT)")
                        tic = time.perf_counter()
                        batch = prepare_batch(particles, indices, reader, settings, sizes.current_size_px,
                                              model.avg_norm_correction, iteration, state.origin_x_px,
                                              state.origin_y_px, image_norms(config, state), state.class_index,
                                              (state.rot_deg, state.tilt_deg, state.psi_deg),
                                              xp=image_array_module(engine))
                        stages["images"] += time.perf_counter() - tic
                        result = engine.run(batch)
                        del batch  # its device arrays go before the next batch's (the arena is a stack)
                        comm.send(("result", (indices, result)), dest=0, tag=TAG_REQUEST)
                sums = engine.sums()
                add_engine_stages(stages, engine, flops)
                del engine
                host = _reduce_sums(half_comm, sums, root_receives=half_comm.Get_rank() == 0)
                del sums
                comm.gather((stages, flops), root=0)
                if rank == 2:  # the leader of half 2 hands its sums to rank 1
                    _send_sums(comm, host, dest=1)
                elif rank == 1:
                    both = [host, _recv_sums(comm, _sums_template(model, config, sampling, sizes), source=2)]
                    _maximization_on_worker(comm, factory, model, optimiser, config, both, sizes, final, do_cc)
                del host


def _worker_config(config, rank, size):
    """The engine of this worker: its GPU (from --gpu, else local rank modulo the visible GPUs)."""
    from dataclasses import replace

    if config.engine != "cuda":
        return config
    worker_index = rank - 1
    if config.gpu_ids:
        device = config.gpu_ids[worker_index % len(config.gpu_ids)]
    else:
        import cupy

        device = _local_rank(rank) % max(1, cupy.cuda.runtime.getDeviceCount())
    return replace(config, gpu_ids=(device,))


# ---------------------------------------------------------------------------------------------- sums
def _sums_fields(sums):
    """The arrays of WeightedSums in a fixed order (host float64 views), and the scalars as one vector."""
    from cryorefine.core.arrays import to_host

    def host(a):
        a = to_host(a)
        if np.iscomplexobj(a):
            a = np.ascontiguousarray(a, dtype=np.complex128).view(np.float64)
        return np.ascontiguousarray(a, dtype=np.float64)

    arrays = [host(d) for d in sums.data] + [host(w) for w in sums.weight]
    arrays += [host(sums.sigma2_noise), host(sums.sumw_group), host(sums.pdf_class),
               host(sums.pdf_direction), host(sums.scale_xa), host(sums.scale_aa)]
    scalars = np.array([sums.sigma2_offset_angstrom2, sums.norm_correction, sums.log_likelihood, sums.sum_pmax,
                        sums.n_particles], dtype=np.float64)
    return arrays, scalars


def _reduce_sums(half_comm, sums, root_receives):
    """Σ over the half's workers of their sums: host WeightedSums on the half's root (rank 0 of half_comm),
    None elsewhere. Reduced in chunks of host float64 buffers."""
    from mpi4py import MPI

    arrays, scalars = _sums_fields(sums)
    totals = []
    for a in arrays + [scalars]:
        flat = a.reshape(-1)
        out = np.zeros_like(flat) if root_receives else None
        for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
            stop = min(flat.size, start + REDUCE_CHUNK_ELEMENTS)
            half_comm.Reduce(flat[start:stop], out[start:stop] if root_receives else None, op=MPI.SUM, root=0)
        totals.append(out)
    if not root_receives:
        return None
    return _sums_from_fields(sums, totals)


def _send_sums(comm, sums, dest):
    arrays, scalars = _sums_fields(sums)
    for a in arrays + [scalars]:
        flat = a.reshape(-1)
        for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
            comm.Send(flat[start:start + REDUCE_CHUNK_ELEMENTS], dest=dest, tag=TAG_SUMS)


def _recv_sums(comm, template, source):
    """The sums `_send_sums` sent, received into the shapes of `template`."""
    arrays, scalars = _sums_fields(template)
    totals = []
    for a in arrays + [scalars]:
        flat = np.empty(a.size)
        for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
            comm.Recv(flat[start:start + REDUCE_CHUNK_ELEMENTS], source=source, tag=TAG_SUMS)
        totals.append(flat)
    return _sums_from_fields(template, totals)


def _maximization_on_worker(comm, factory, model, optimiser, config, sums, sizes, final, do_cc):
    """refine's M-step for both halves on this worker (its GPU when it has one); the model goes to the master."""
    from cryorefine.refine import _maximize, _scope_of

    xp = np
    if config.engine == "cuda":
        import cupy as xp
    with _scope_of(factory, "maximization_scope"):
        for s in sums:
            s.data = [xp.asarray(d) for d in s.data]
            s.weight = [xp.asarray(w) for w in s.weight]
        fsc = _maximize(model, optimiser, config, sums, sizes, final, do_cc)
        del sums
    comm.send((model, fsc), dest=0, tag=TAG_MODEL)


def _sums_from_fields(sums, totals):
    """`sums` with its arrays and scalars replaced by `totals` (the order of `_sums_fields`)."""
    k = len(sums.data)
    sums.data = [totals[i].view(np.complex128).reshape(sums.data[i].shape) for i in range(k)]
    sums.weight = [totals[k + i].reshape(sums.weight[i].shape) for i in range(k)]
    rest = totals[2 * k:]
    sums.sigma2_noise = rest[0].reshape(sums.sigma2_noise.shape)
    sums.sumw_group, sums.pdf_class = rest[1], rest[2]
    sums.pdf_direction = rest[3].reshape(sums.pdf_direction.shape)
    sums.scale_xa, sums.scale_aa = rest[4], rest[5]
    s = rest[6]
    sums.sigma2_offset_angstrom2, sums.norm_correction, sums.log_likelihood, sums.sum_pmax = (float(v) for v in s[:4])
    sums.n_particles = int(round(s[4]))
    return sums


def _sums_template(model, config, sampling, sizes):
    """Zero WeightedSums shaped like a worker's (to receive sums into)."""
    from cryorefine.core.projector import PaddedGrid
    from cryorefine.estep.engine import WeightedSums

    grid = PaddedGrid.create(model.ori_size_px, config.padding_factor, sizes.current_size_px // 2)
    k = len(model.maps[0])
    n_optics, n_shells = np.asarray(model.sigma2_noise).shape
    return WeightedSums(data=[np.zeros(grid.shape, np.complex128) for _ in range(k)],
                        weight=[np.zeros(grid.shape) for _ in range(k)],
                        sigma2_noise=np.zeros((n_optics, n_shells)), sumw_group=np.zeros(n_optics),
                        pdf_class=np.zeros(k), pdf_direction=np.zeros((k, sampling.n_directions)),
                        scale_xa=np.zeros(n_optics), scale_aa=np.zeros(n_optics))

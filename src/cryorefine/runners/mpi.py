"""MPI master and workers: `mpirun -n N cryorefine refine|classify ...` serves every job.

Rank 0 is the master: it runs the iteration loop (`em.loop`: set-up, schedule, every output
file). The set-up's initial noise pass over all images is shared out: worker w prepares batches
w, w + W, … on its engine and the master adds their sums in batch order. For each iteration's
E-step the master broadcasts the plan (the work units) and the model and hands out (work unit,
batch of particle indices) on request, storing each batch's per-particle results as they come
back. Each unit's particles are cut into one share per worker of the unit (contiguous blocks of
particle indices, `shares_of_unit`): a worker is handed its own share's batches first, then helps the
worker with most left, so that the workers end together and `--preread_images` holds each image
once among them (each worker its share; a batch taken over from another's is read from the stacks).
Workers (ranks 1 … N−1) are assigned work units: with at least as many workers as units,
worker w serves unit w mod U (refine: odd ranks half 1, even ranks half 2), else worker w serves
the units u with u mod W = w, one after the other, where U is a multiple of W, and otherwise every worker serves
every unit (`units_of_worker`: the workers end together). A worker reads its batches' images itself (the
next batch's while the GPU works on the current one; a GPU worker keeps its share's images on its device where
they fit, `em.estep.kept_images`, and reads them once), runs its own engine (the GPU engine on one
device each when CuPy sees one, else numpy; `--preread_images` has the system read its share into the host's
file cache) and asks for the next batch before it starts on the current one; each batch's results go to the master
without waiting for its receive. Where each worker serves one unit of several classes, the unit's workers make the
classes' reference transforms once among them, each every W-th class, and share them (`_with_shared_references`).

At the end of the E-step every worker takes part in the job's M-step, as RELION's ranks share out its
reconstructions: the job names its maps in groups whose sums must be in one process
(`Job.maximization_groups`: a refinement's two halves, or its final iteration's joined pair; a
classification's classes), and each group is made by one of its unit's workers, a unit's groups taken by its
workers in turn (`makers_of_parts`). The sums of each unit are added up by MPI reductions inside the
communicator of the unit's workers (in chunks of host buffers; the class volumes in the engine's precision, the
other sums in float64): each class volume onto the worker
that makes its map, the other sums onto the unit's first worker (a unit's only worker keeps them where they
are); a volume whose maker does not serve its unit (the final iteration's second half) crosses to it, and the
units' other sums (noise spectra, distributions, norms: small) are shared by all. Every worker then runs the
job's M-step on the volumes it holds, exchanging what the others need (the FSC's part of a half, the maps it
made) through `WorkerPeers.gather_all` (through the GPUs with NCCL where each worker has its own), so that every
worker ends with every map; rank 1 sends the new model to the master with its maps' shapes, and every worker starts
sending the master a share of the maps (`maps_of_worker`) and goes on: the maps cross while the next E-step runs,
the master's writer waiting for them before it writes the iteration's files (where MPI takes calls from several
threads; else the master receives them before it goes on). The master's next broadcast names the maps the workers
hold (`HeldMap`) instead of sending them again.
Plans, models and maps go as pickle protocol 5 with their arrays as raw bytes
(`runners.objects.ObjectChannel`), of any size. The M-step is the job's own code, so results do not depend on
the number of ranks beyond the order of floating-point sums.
Every stage is timed: `broadcast` (the master's), `last maps to the master` (a worker's wait, after its E-step, for its
share of the last maps to have crossed) and `reduction` (the workers'), and the M-step's parts (sums to their makers,
the M-step on the workers as rank 1 saw it, the model's way to the master).

Failure: an exception on any rank prints one line naming the rank, the host and the cause, and
aborts the whole job (MPI_Abort, exit code 2): no rank is left waiting. A failing worker tells the
master (TAG_FAILURE), which stops where it polls for the workers, lets its writer finish the last
completed iteration's files (what --continue starts from), prints the worker's line and aborts the
job; a worker the master does not hear within FAILURE_GRACE_SECONDS (it waits in a collective)
prints its line and aborts the job itself. A bad input found while
the master sets the run up ends every rank with exit code 2 and one message from the master.

A worker killed outright (SIGKILL: the kernel's OOM killer, a node's failure) cannot tell anyone: the launcher
(mpirun, mpiexec, srun) sees the process end and ends the job within a second or so, with its own message naming
the process and the signal; the last completed iteration's files stay valid for --continue, on any number of ranks.

CRYOREFINE_FAULT="RANK:ITERATION" makes that worker raise at its first batch of that iteration, and
"RANK:ITERATION:kill" kill itself there: the hooks the failure tests use.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from cryorefine.core.grid import complex_dtype_for
from cryorefine.core.sampling import direction_tables
from cryorefine.data import load_particles, scratch_copy
from cryorefine.em import mstep
from cryorefine.em.estep import (
    BatchInputs,
    add_counts,
    add_seconds,
    empty_sums,
    kept_images,
    kept_images_reserve_bytes,
    noise_batch_sums,
    run_batches,
    sums_wait_on_host,
)
from cryorefine.em.loop import StageClock, StepOutcome, log_stages
from cryorefine.errors import InputError, RunInterrupted, resource_message
from cryorefine.estep.backend import available_cpus, make_backend
from cryorefine.estep.engine import flat_reals, from_flat_reals
from cryorefine.gpu.collectives import NCCL_RESERVE_MB, DeviceCollectives, nccl_usable
from cryorefine.gpu.pinned import PinnedAhead
from cryorefine.images import NoiseEstimate
from cryorefine.io.background import WaitFor
from cryorefine.runners.objects import ObjectChannel

TAG_REQUEST = 11  # worker -> master: ("ready", None) or ("result", (unit, indices, BatchResult))
TAG_WORK = 12  # master -> worker: (unit, particle indices) of the next batch, or None when its units are done
TAG_SUMS = 13  # a unit's holder -> the worker that makes a map of it without serving it: the class volume
TAG_NOISE = 15  # worker -> master: (batch number, NoiseEstimate.batch_sums, its stage seconds so far): noise pass
TAG_FAILURE = 16  # worker -> master: the one line of a worker's failure ("rank R on HOST: cause")
TAG_MODEL = 17  # rank 1 -> master: the new model (its maps as (shape, dtype)), the M-step's stages and parts
TAG_MAPS = 18  # worker -> master: the bytes of its share of the new maps (`maps_of_worker`)
TAG_ACCURACY = 19  # rank 1 -> master: the accuracy estimate a plan asked for (`em.accuracy.AccuracyRequest`)
FAILURE_GRACE_SECONDS = 20.0  # how long a failed worker waits for the master to end the job before it does
# how often the master's writer, idle while it waits for the maps, asks MPI to receive them (the workers, in their
# next broadcast's wait by then, move them along meanwhile). At 1 ms (the workers then asked as often) the 105k
# Class3D's end took 2.7 s on two H200s against one GPU's 1.2 s (the last six 187 MB maps crossing); at this, 2.1 and
# 2.6 s against one GPU's 2.1 s on another host
MAPS_RECEIVE_POLL_SECONDS = 0.0002
# fewer CPUs than this for a rank (where the machine has them) draws a warning, which asks for ADVISED_CPUS_PER_RANK:
# a worker's E-step thread, its image reads and its maps' transfer (a thread waiting in MPI, which polls), the
# master's loop and its writer
MIN_CPUS_PER_RANK, ADVISED_CPUS_PER_RANK = 2, 4
REDUCE_CHUNK_ELEMENTS = 1 << 24  # reals per MPI message or reduction (128 MB of float64)
# the job size as the launchers set it (not SLURM_NTASKS: a plain command inside a batch job is no MPI run)
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID", "PMIX_LOCAL_RANK")


@dataclass(frozen=True)
class HeldMap:
    """In the master's broadcast, a map every worker holds already: model.maps[half][klass] of the last M-step."""

    half: int
    klass: int


def launched_with_mpi():
    """True when this process is one of several started by mpirun/mpiexec/srun (from their environment)."""
    for name in SIZE_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit() and int(value) > 1:
            return True
    return False


def rank_from_environment():
    """This process's rank as mpirun/srun set it (0 without MPI)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return 0


def half_of_rank(rank):
    """0 (half 1) for odd ranks, 1 (half 2) for even ranks > 0: the unit of a refinement's worker."""
    return (rank - 1) % 2


def units_of_worker(worker, n_workers, n_units):
    """The work units worker `worker` (0-based, of `n_workers`) serves, in the order it serves them: with at least
    as many workers as units, unit `worker` mod U; with fewer, the units u with u mod W = `worker` where that shares
    them out evenly (U a multiple of W), else every unit (a classification's seeding iteration, a unit per class:
    six on four workers would be two, two, one and one units of the same size)."""
    if n_workers >= n_units:
        return [worker % n_units]
    if n_units % n_workers == 0:
        return [u for u in range(n_units) if u % n_workers == worker]
    return list(range(n_units))


def holder_of_unit(unit, n_workers):
    """The worker that holds a unit's reduced sums (its first worker)."""
    return unit % n_workers


def workers_of_unit(unit, n_workers, n_units):
    """The workers that serve a unit, its holder (`holder_of_unit`) first, then on in worker order (so that the first
    of every unit is not one worker where every worker serves every unit)."""
    holder = holder_of_unit(unit, n_workers)
    serving = [w for w in range(n_workers) if unit in units_of_worker(w, n_workers, n_units)]
    return sorted(serving, key=lambda w: (w - holder) % n_workers)


def shares_of_unit(members, n_workers):
    """A unit's particles split into `n_workers` shares, one per worker of the unit in its order (`workers_of_unit`):
    contiguous blocks of particle indices (of the stacks' order, which reads them as blocks). A worker is handed
    the batches of its own share first and prereads it alone (--preread_images); the master and the workers
    compute the same split."""
    return np.array_split(np.sort(np.asarray(members)), max(1, n_workers))


def batch_queues(particles, unit_members, n_workers, batch_size):
    """One deque of batches per worker of a unit, each of its share (`shares_of_unit`) in the unit's order."""
    members = np.asarray(unit_members)
    queues = []
    for share in shares_of_unit(members, n_workers):
        queues.append(deque(particles.batches(batch_size, members[np.isin(members, share)])))
    return queues


def next_batch(queues, worker):
    """The next batch for `worker` (its place in the unit's workers) from the unit's queues (`batch_queues`): its
    own share's next batch, else the last batch of the share with the most left (its images not preread by this
    worker), else None."""
    if queues[worker]:
        return queues[worker].popleft()
    donor = max(range(len(queues)), key=lambda w: len(queues[w]))
    return queues[donor].pop() if queues[donor] else None


def maps_of_worker(maps, worker, n_workers):
    """[(half, class, map)] of the model's maps (`maps[half][class]`, every worker holds them all after the M-step)
    that worker `worker` sends to the master: every n_workers-th, so that the maps cross side by side."""
    flat = [(h, k, m) for h, row in enumerate(maps) if row is not None for k, m in enumerate(row)]
    return flat[worker::n_workers]


def makers_of_parts(groups, n_workers, n_units):
    """{(unit, class index in the unit): worker} for the M-step's groups of maps (`Job.maximization_groups`): each
    group is made by one of the workers of its first unit, the groups of a unit taken by its workers in turn, so
    that a unit's classes are shared out over its workers and the two halves of a refinement go to their own."""
    makers, taken = {}, {}
    for group in groups:
        unit = group[0][0]
        candidates = workers_of_unit(unit, n_workers, n_units)
        worker = candidates[taken.get(unit, 0) % len(candidates)]
        taken[unit] = taken.get(unit, 0) + 1
        for part in group:
            makers[tuple(part)] = worker
    return makers


def device_of_worker(rank, gpu_ids, visible_devices):
    """The GPU of the worker of MPI rank `rank` (rank 1 is the first worker): --gpu's devices in rank order,
    worker w the (w mod n)th; with none given (--gpu alone or not at all, RELION's automatic assignment) its local
    rank on its node modulo the node's visible GPUs (`visible_devices()`, asked only then), so that the workers of
    a node spread over its GPUs rather than all taking device 0."""
    if gpu_ids:
        return gpu_ids[(rank - 1) % len(gpu_ids)]
    return _local_rank(rank) % max(1, int(visible_devices()))


def _local_rank(rank):
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name)
        if value and value.isdigit():
            return int(value)
    return rank


def narrow_binding_warning(rank: int, host: str, cpus: set[int], machine_cpus: int) -> str | None:
    """The one line that says rank `rank` on `host` may run on the CPUs `cpus` only, fewer than MIN_CPUS_PER_RANK
    of the machine's `machine_cpus` (the launcher bound it there: Open MPI's mpirun binds each rank to one core
    when it starts two ranks or fewer, Slurm each task to its --cpus-per-task), or None where it has enough."""
    if len(cpus) >= min(MIN_CPUS_PER_RANK, machine_cpus):
        return None
    named = ", ".join(str(c) for c in sorted(cpus))
    return (f"rank {rank} on {host} may run on CPU {named} only ({len(cpus)} of {machine_cpus}: the launcher bound "
            f"it there), and all its threads share it; launch with `mpirun --bind-to none` (Open MPI binds each "
            f"rank to one core when it starts two or fewer) or give each Slurm task --cpus-per-task "
            f"{ADVISED_CPUS_PER_RANK} or more")


def node_communicator(workers):
    """The workers of this worker's host, as one communicator (MPI's shared-memory split): --scratch_dir copies the
    stacks once per host, and --preread_images divides a host's memory among its workers."""
    from mpi4py import MPI

    return workers.Split_type(MPI.COMM_TYPE_SHARED)


class WorkerFailed(Exception):
    """Raised on the master when a worker reports its failure; `line` is the worker's "rank R on HOST: cause"."""

    def __init__(self, line):
        super().__init__(line)
        self.line = line


def _failure_line(comm, exc):
    """ "rank R on HOST: cause" of an exception on this rank (a worker's reported one as it came)."""
    if isinstance(exc, WorkerFailed):
        return exc.line
    message = str(exc) if isinstance(exc, InputError) else resource_message(exc) or f"{type(exc).__name__}: {exc}"
    return f"rank {comm.Get_rank()} on {socket.gethostname()}: {message}"


def _abort(comm, exc, on_abort=None):
    """One line naming the rank, host and cause, then end every rank of the job (exit code 2). A run interrupted
    on the master (Ctrl-C, SIGTERM: `errors.RunInterrupted`) says what one process says, the last complete iteration
    and the --continue line, and ends with its exit code (130, 143)."""
    if on_abort is not None:
        try:
            on_abort()
        except OSError:
            pass  # the job ends either way
    interrupted = isinstance(exc, RunInterrupted)
    sys.stderr.write(f"cryorefine: error: {exc if interrupted else _failure_line(comm, exc)}\n")
    sys.stderr.flush()
    time.sleep(1.0)  # let mpirun forward the line before the abort tears the job down
    code = exc.exit_code if interrupted else 2
    comm.Abort(code)
    os._exit(code)  # MPI_Abort may return before the launcher's kill arrives: nothing after it may run (the loop's
    # normal end would write RELION_JOB_EXIT_SUCCESS)


def _report_failure(comm, exc, on_abort=None):
    """A worker's failure: the master is told, and ends the job once its writer has finished; if it does not
    within FAILURE_GRACE_SECONDS, this worker ends the job itself."""
    try:
        comm.isend(_failure_line(comm, exc), dest=0, tag=TAG_FAILURE)
        deadline = time.monotonic() + FAILURE_GRACE_SECONDS
        while time.monotonic() < deadline:  # the master's abort ends this process here
            time.sleep(0.05)
    finally:
        _abort(comm, exc, on_abort)


class MpiRunner:
    """The master (rank 0) runs the loop; the workers serve it (`serve`)."""

    def __init__(self, config, min_ranks, on_abort=None):
        from mpi4py import MPI

        self.config = config
        self.on_abort = on_abort
        self.comm = MPI.COMM_WORLD
        # the same communicator for Python objects of any size (plans, models): pickle protocol 5, arrays as raw bytes
        self.objects = ObjectChannel(self.comm)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        if self.size < min_ranks:
            if self.rank == 0:
                raise InputError(f"mpirun -n {self.size}: this job needs at least {min_ranks} MPI ranks (a master "
                                 f"and {'one worker per half set' if min_ranks > 2 else 'a worker'}); run with -n "
                                 f"{min_ranks} or more, or without mpirun")
            sys.exit(2)
        self.leads = self.rank == 0
        self.n_workers = self.size - 1
        # the workers alone (rank 1 is worker 0), to split into the communicators of units
        self.workers = self.comm.Split(MPI.UNDEFINED if self.rank == 0 else 0, self.rank)
        self.announced = False
        self._unit_comms = {}
        # the maps of the last M-step (made by the workers): the master's to know them, every worker's to use them
        self.held_maps = []
        # the workers as each other's peers in the M-step
        self.peers = None if self.rank == 0 else WorkerPeers(ObjectChannel(self.workers))
        self.exclusive_gpu = False  # a worker: whether it has a GPU no other worker uses (set as it starts)
        self.maps_outgoing = None  # a worker: the thread moving its share of the last maps to the master
        self.noise_batches_left = 0  # the master: batches of the workers' noise pass whose sums it has not received
        warning = narrow_binding_warning(self.rank, socket.gethostname(), available_cpus(), os.cpu_count() or 1)
        if warning:
            logging.getLogger("cryorefine").warning(warning)

    def begin_initial_noise(self, particles, settings, n_optics=None):
        """The workers start the initial noise pass (`_noise_batches`), each batch's sums sent here as it is ready,
        while this process goes on (job.start makes the starting maps); `initial_noise_spectra` collects them."""
        n_optics = len(particles.optics_groups) if n_optics is None else n_optics
        self.objects.bcast(("noise", (settings, n_optics)), root=0)
        self.noise_batches_left = -(-len(particles) // self.config.batch_size_for(settings.ori_size_px))

    def initial_noise_spectra(self, particles, settings, n_optics):
        """The initial noise pass shared out before the run is announced: worker w prepares batches w, w + W, …
        on its engine and sends each batch's sums here, where they are added in batch order (bit for bit as one
        process adds them). The workers' seconds waiting for their reads and preparing their images, added up,
        are logged in one line."""
        if not self.noise_batches_left:  # not begun (`begin_initial_noise`, the loop's call before job.start)
            self.begin_initial_noise(particles, settings, n_optics)
        noise = NoiseEstimate.empty(n_optics, settings.ori_size_px)
        pending = {}
        worker_stages = {}  # rank -> that worker's seconds so far, by stage
        for number in range(self.noise_batches_left):
            while number not in pending:
                source, (received, sums, stages) = self._next_noise_batch()
                pending[received], worker_stages[source] = sums, stages
            noise.add_batch_sums(*pending.pop(number))
        totals = {}
        for stages in worker_stages.values():
            add_counts(totals, stages)
        log_stages("initial noise spectra, the workers' seconds added", totals)
        return noise.sigma2()

    def _next_noise_batch(self):
        """(worker's rank, (batch number, its sums, the worker's stage seconds)) of the next noise batch to arrive."""
        from mpi4py import MPI

        status = MPI.Status()
        while not self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_NOISE, status=status):
            self._raise_worker_failure()
            time.sleep(0.0005)  # poll gently, as the E-step's master does
        source = status.Get_source()
        self.noise_batches_left -= 1
        return source, self.comm.recv(source=source, tag=TAG_NOISE)

    # ------------------------------------------------------------------ master
    def _raise_worker_failure(self):
        """Raise WorkerFailed when a worker has reported its failure (the master's polling loops ask)."""
        from mpi4py import MPI

        status = MPI.Status()
        if self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_FAILURE, status=status):
            raise WorkerFailed(self.comm.recv(source=status.Get_source(), tag=TAG_FAILURE))

    @contextlib.contextmanager
    def session(self):
        """The master's run: a failure before the workers were told the run is set up ends every rank with
        the master's message; after that, it aborts the job."""
        try:
            yield self
        except BaseException as exc:
            # nothing distributed yet and no worker failed: every rank ends quietly, the master reports
            if not self.announced and not isinstance(exc, WorkerFailed):
                try:
                    while self.noise_batches_left:  # the workers' noise pass, begun, ends first
                        self._next_noise_batch()
                except WorkerFailed as failed:
                    _abort(self.comm, failed, self.on_abort)
                self.objects.bcast(("error", None), root=0)
                raise
            _abort(self.comm, exc, self.on_abort)
        self.objects.bcast(("stop", None), root=0)

    def staged(self, particles):
        """The master reads no images; the workers copy the stacks to --scratch_dir after the noise pass."""
        return contextlib.nullcontext(particles)

    def estimate_accuracy(self, request, particles):
        """A plan's accuracy estimate (`em.accuracy.AccuracyRequest`), made by rank 1 as RELION's first follower makes
        it: on its engine's device, from its own particle set (the same STAR file's) and the maps it holds (those it
        does not hold cross with the request, as an iteration's do); the master holds no device."""
        from mpi4py import MPI

        self.objects.bcast(("accuracy", replace(request, maps=self._without_held(request.maps))), root=0)
        status = MPI.Status()
        while not self.comm.Iprobe(source=1, tag=TAG_ACCURACY, status=status):
            self._raise_worker_failure()
            time.sleep(0.0005)
        return self.comm.recv(source=1, tag=TAG_ACCURACY)

    def announce(self, particles, settings):
        """First broadcast: the run is set up (the workers load the particles and go on)."""
        self.objects.bcast(("setup", settings), root=0)
        self.announced = True

    def expectation_maximization(self, job, plan, model, previous, particles, settings, store, progress):
        from mpi4py import MPI

        comm = self.comm
        tic = time.perf_counter()
        self.objects.bcast(("iteration", self._without_held_maps(plan, model) + (previous,)), root=0)
        broadcast = time.perf_counter() - tic
        batch_size = self.config.batch_size_for(settings.ori_size_px)
        n_units = len(plan.units)
        served = {w: units_of_worker(w, self.n_workers, n_units) for w in range(self.n_workers)}
        unit_workers = [workers_of_unit(u, self.n_workers, n_units) for u in range(n_units)]
        queues = [batch_queues(particles, unit.members, len(unit_workers[u]), batch_size)
                  for u, unit in enumerate(plan.units)]
        workers_left, outstanding, handed, taken_over = self.n_workers, 0, 0, 0
        status = MPI.Status()
        while workers_left or outstanding:
            while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_REQUEST, status=status):
                self._raise_worker_failure()
                time.sleep(0.0005)  # poll gently: the master must not take a core from the workers
            source = status.Get_source()
            kind, payload = comm.recv(source=source, tag=TAG_REQUEST)
            if kind == "result":
                _, indices, result = payload
                store(indices, result)
                outstanding -= 1
                if progress:
                    progress(indices.size, plan.n_particles)
                continue
            worker = source - 1
            work = None
            for unit in served[worker]:  # a unit's batches come together: the next unit once this one has none
                place = unit_workers[unit].index(worker)
                own_left = bool(queues[unit][place])
                batch = next_batch(queues[unit], place)
                if batch is not None:
                    work = (unit, batch)
                    handed += 1
                    taken_over += not own_left
                    break
            comm.send(work, dest=source, tag=TAG_WORK)
            if work is None:
                workers_left -= 1
            else:
                outstanding += 1
        stages, flops = {"broadcast": broadcast}, {}
        walls = []
        for worker_stages, worker_flops, wall in comm.gather(({}, {}, 0.0), root=0)[1:]:  # the E-steps are over
            add_counts(stages, worker_stages)
            add_counts(flops, worker_flops)
            walls.append(wall)
        logging.getLogger("cryorefine").info("  batches taken over from another worker's share (read from the stacks, "
                                             "not held by the worker): %d of %d", taken_over, handed)
        logging.getLogger("cryorefine").info("  the workers' E-steps (s, from the plan's arrival to their sums "
                                             "reduced): %s", ", ".join(f"{w:.1f}" for w in walls))
        expectation = time.perf_counter() - tic
        tic = time.perf_counter()
        # the workers' M-step: the model from rank 1, its maps from every worker (`maps_of_worker`), received while
        # the next E-step runs (the writer waits for them before it writes the iteration's files)
        new_model, maximization_stages, parts = self.objects.recv(source=1, tag=TAG_MODEL)
        new_model, arrival = self._maps_received(new_model)
        maximization = time.perf_counter() - tic
        maximization_stages["model to the master"] = max(0.0, maximization - sum(maximization_stages.values()))
        self.held_maps = new_model.maps  # every worker holds them too
        return StepOutcome(new_model, stages, flops, expectation, maximization, maximization_stages, parts, arrival)

    def _maps_received(self, model):
        """(`model` with its maps, which rank 1 sent as (shape, dtype), as arrays that the workers' shares of them
        are received into, a WaitFor of their arrival). The receives are completed on the writer's thread where
        MPI allows calls from several threads, else here, before the next E-step."""
        from mpi4py import MPI

        maps = [None if row is None else list(row) for row in model.maps]
        requests = []
        for worker in range(self.n_workers):
            share = maps_of_worker(maps, worker, self.n_workers)
            arrays, received = self.objects.irecv_arrays([like for _, _, like in share], worker + 1, TAG_MAPS)
            for (half, klass, _), array in zip(share, arrays):
                maps[half][klass] = array
            requests += received
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            MPI.Request.Waitall(requests)
            return replace(model, maps=maps), None
        return replace(model, maps=maps), WaitFor(lambda: MPI.Request.Testall(requests), MAPS_RECEIVE_POLL_SECONDS)

    # ------------------------------------------------------------------ workers
    def serve(self, job):
        """A worker's run: E-steps of its units and its part of the M-steps, until the master stops."""
        try:
            self._serve(job)
        except SystemExit:
            raise
        except KeyboardInterrupt as exc:  # Ctrl-C reaches every rank: the master says where the run stands
            time.sleep(FAILURE_GRACE_SECONDS)  # its abort ends this process here; else this worker ends the job
            _abort(self.comm, exc, self.on_abort)
        except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
            _report_failure(self.comm, exc, self.on_abort)

    def _serve(self, job):
        # the worker sets itself up (the particle table, its device) while the master reads and checks the run's
        # input; a failure of its own is raised only once the master goes on: a bad input is the master's to report
        with contextlib.ExitStack() as scope:
            setup = {}  # this worker's set-up, stage by stage (logged once the master goes on)
            clock = StageClock(setup)
            ahead = None
            try:
                particles = load_particles(self.config.input_star, check_stacks=False)
                clock.mark("particle table read")
                # the first iteration's directions (and healpy's import, about a second) made now, not in its set-up,
                # and before the set-up's thread starts: beside its page-locking they took 2.0-3.0 s, alone 0.8-1.0 s
                direction_tables(self.config.healpix_order, self.config.symmetry)
                clock.mark("first directions")
                backend, ahead = scope.enter_context(self._worker_backend(clock, self._host_maps(job, particles)))
                failure = None
            except Exception as exc:  # noqa: BLE001 - raised below unless the master ends the run first
                failure = exc
            kind, payload = self.objects.bcast(None, root=0)
            if kind not in ("noise", "setup"):  # the master could not set the run up and says why
                sys.exit(2)
            if failure is not None:
                raise failure
            clock.mark("waiting for the master")
            log_stages(f"worker {self.rank} on {socket.gethostname()} set up", setup)
            if kind == "noise":  # the master's set-up asks for the initial noise pass (a fresh run)
                self._noise_batches(backend, particles, *payload)
                kind, payload = self.objects.bcast(None, root=0)
            if kind != "setup":  # the master could not set the run up and says why
                sys.exit(2)
            self._set_up_ahead_joined(ahead)
            self._iterations(job, backend, particles, payload)

    def _set_up_ahead_joined(self, ahead):
        """The end of the set-up made on a thread (`_worker_backend`): the NCCL collectives in place, the time
        waited for them logged."""
        if ahead is None:
            return
        tic = time.perf_counter()
        self.peers.channel.device = ahead.wait()
        log = logging.getLogger("cryorefine")
        if self.peers.channel.device is not None or ahead.made_bytes:
            log.info("worker %d: made on a thread during the set-up: NCCL's collectives (%.2f s), %.1f GB of "
                     "page-locked blocks for the maps; waited %.2f s for them after the initial noise pass", self.rank,
                     ahead.first_seconds, ahead.made_bytes / 1e9, time.perf_counter() - tic)
        if ahead.failure is not None:
            log.warning("worker %d: %.1f GB of page-locked memory made ahead for the maps, then %s; the first M-steps "
                        "make the rest", self.rank, ahead.made_bytes / 1e9, ahead.failure)

    @contextlib.contextmanager
    def _worker_backend(self, clock, host_map_bytes):
        """(this worker's E-step backend, in its run scope; the rest of its set-up on a thread,
        `gpu.pinned.PinnedAhead`, or None). `clock` (`em.loop.StageClock`) marks the device's set-up.

        The thread makes, where every worker has a GPU of its own, the NCCL collectives the M-step shares the maps
        through (and their first collectives, which connect the ranks), then page-locked blocks for two M-steps' maps
        of `host_map_bytes`, so that the first three M-steps make none: there each worker's collective waited for its
        peer's (0.8-1.0 s in iterations 2 and 3 of the 105k Class3D on two H200s). Neither is needed before iteration
        1, so they are made while the worker waits for the master and makes its share of the initial noise pass
        (`_set_up_ahead_joined` waits for them after it). Made in line, NCCL's set-up took 0.9 s alone and 3.0 s
        beside the blocks, and the start waited for them."""
        config = self._worker_config()
        device = (socket.gethostname(), config.gpu_ids[0] if config.engine == "cuda" else None)
        shared_by = self.workers.allgather(device).count(device)  # workers of this node on this GPU
        self.exclusive_gpu = config.engine == "cuda" and shared_by == 1  # NCCL takes one GPU a worker
        if self.exclusive_gpu and self.n_workers > 1 and nccl_usable():  # room outside the arena for NCCL's buffers
            config = replace(config, free_gpu_memory_mb=config.free_gpu_memory_mb + NCCL_RESERVE_MB)
        backend = make_backend(config, shared_by=shared_by)
        with backend.run_scope():
            clock.mark("device and its arena")
            make_collectives = self._device_collectives_maker(self.workers)
            ahead = None
            if backend.name == "cuda":
                ahead = PinnedAhead(2 * host_map_bytes, first=None if make_collectives is None
                                    else lambda: _warmed_up(make_collectives()))
            clock.mark("NCCL's id exchanged")
            yield backend, ahead

    @staticmethod
    def _host_maps(job, particles):
        """The bytes of each map an M-step of `job` leaves on this worker's host (`Job.host_map_bytes`; none where the
        job does not say)."""
        host_map_bytes = getattr(job, "host_map_bytes", None)
        return [] if host_map_bytes is None else list(host_map_bytes(particles.geometry()[0]))

    def _noise_batches(self, backend, particles, settings, n_optics):
        """This worker's share of the initial noise pass (`initial_noise_spectra`), each batch's sums to the master."""
        worker = self.rank - 1
        mine = ((number, indices) for number, indices in enumerate(particles.batches(self.config.batch_size_for(
            settings.ori_size_px)))
                if number % self.n_workers == worker)
        stages = {}
        with backend.iteration_scope():
            for number, sums in noise_batch_sums(particles, settings, n_optics, mine, backend.array_module,
                                                 backend.free_device_bytes, stages):
                self.comm.send((number, sums, dict(stages)), dest=0, tag=TAG_NOISE)

    def _iterations(self, job, backend, particles, settings):
        """The E- and M-steps of the run, from the stack copies under --scratch_dir if asked."""
        node = node_communicator(self.workers) if self.config.scratch_dir or self.config.preread_images else None
        node_workers = 1 if node is None else node.Get_size()  # --preread_images: they share the host's memory
        kept = None  # the images this worker keeps on its GPU (em.estep.kept_images), from its first E-step on
        with scratch_copy(particles, self.config.scratch_dir, logging.getLogger("cryorefine"), node) as particles:
            while True:
                kind, payload = self.objects.bcast(None, root=0)
                if kind == "accuracy":  # the master's plan asks for an estimate: the first worker makes it
                    if self.rank == 1:
                        request = replace(payload, maps=self._with_held(payload.maps))
                        self.comm.send(backend.estimate_accuracy(request, particles), dest=0, tag=TAG_ACCURACY)
                    continue
                if kind != "iteration":
                    self._maps_sent()
                    return
                plan, model, previous = payload
                plan, model = self._with_held_maps(plan, model)
                owned = self._own_share(plan, len(particles))
                if kept is None and owned is not None:  # between iterations: in the run's scope
                    reserve = kept_images_reserve_bytes(self.config, model, particles.geometry()[0])
                    kept = kept_images(backend, particles, owned, reserve, logging.getLogger("cryorefine")) or False
                elif kept and owned is not None:
                    kept.own(owned)
                with backend.iteration_scope():
                    self._iteration(job, backend, particles, settings, plan, model, previous, node_workers,
                                    kept or None)

    def _own_share(self, plan, n_particles):
        """This worker's particles of the units it serves (`_share`), which it is handed first each iteration: all
        `n_particles` where it is the only worker; None where a plan has more units than workers (a classification's
        seeding iteration: a unit per class), whose shares are not the job's."""
        n_units = len(plan.units)
        if self.n_workers == 1:
            return np.arange(n_particles)
        if n_units > self.n_workers:
            return None
        mine = units_of_worker(self.rank - 1, self.n_workers, n_units)
        return np.concatenate([self._share(plan.units[u].members, u, n_units) for u in mine])

    def _iteration(self, job, backend, particles, settings, plan, model, previous, node_workers, kept):
        from mpi4py import MPI

        comm, worker = self.comm, self.rank - 1
        start = time.perf_counter()
        n_units = len(plan.units)
        mine = units_of_worker(worker, self.n_workers, n_units)
        stages, flops = {}, {}
        inputs = BatchInputs(plan.iteration, plan.sizes.current_size_px, model.avg_norm_correction, previous,
                             self.config.do_norm)

        sending = []  # the batches' results on their way to the master: the engine goes on meanwhile (a result is
        # larger than MPI's eager limit, so a blocking send waited for the master's receive, a few ms a batch)

        def on_result(u, indices, result):
            sending.append(comm.isend(("result", (u, indices, result)), dest=0, tag=TAG_REQUEST))
            while sending and sending[0].Test():  # those the master has received let go of their bytes
                sending.pop(0)

        # --preread_images: this worker's share of its unit, so that the workers together hold each image once. A
        # classification's seeding iteration (a unit per class, more than the workers) adds none: the shares stay
        # those of the job's unit
        preread = self._own_share(plan, len(particles)) if self.config.preread_images else None
        units = self._with_shared_references(plan, mine, backend, stages)
        reading = time.perf_counter()
        with particles.image_reader(preread, sharers=node_workers) as reader:
            if preread is not None:
                add_seconds(stages, "preread", reading)  # the first iteration reads them in
            sums = run_batches(backend, units, self._work(plan.iteration), particles, settings, inputs, reader,
                               on_result, stages, flops,
                               park_finished=sums_wait_on_host(backend, [plan.units[u] for u in mine]), kept=kept)
        del units
        tic = time.perf_counter()
        MPI.Request.Waitall(sending)
        add_seconds(stages, "results", tic)
        host = {u: (sums.pop(u) if u in sums else empty_sums(plan.units[u], real_dtype=backend.sums_dtype))
                for u in mine}
        del sums
        tic = time.perf_counter()
        self._maps_sent()  # the last maps reached the master while this E-step ran (else this worker waits here)
        tic = add_seconds(stages, "last maps to the master", tic)
        makers = makers_of_parts(job.maximization_groups(plan), self.n_workers, n_units)
        held = self._reduce(host, plan, makers, backend.sums_dtype)
        del host
        stages["reduction"] = time.perf_counter() - tic
        comm.gather((stages, flops, time.perf_counter() - start), root=0)
        tic = time.perf_counter()
        all_sums = self._sums_of_makers(held, plan, makers, backend.sums_dtype)
        del held
        received = time.perf_counter() - tic
        parts = {}
        with backend.maximization_scope():  # the job moves the sums to the device as they fit
            new_model = job.maximize(model, all_sums, plan, backend, self.peers, parts=parts)
            del all_sums
        if worker == 0:  # the model with its maps as (shape, dtype): every worker sends the master a share of them
            shapes = [None if row is None else [(m.shape, m.dtype) for m in row] for row in new_model.maps]
            on_workers = time.perf_counter() - tic - received
            self.objects.send((replace(new_model, maps=shapes), {
                "sums to their makers": received, "M-step on the workers": on_workers},
                mstep.parts_with_rest(parts, on_workers)), dest=0, tag=TAG_MODEL)
        share = [np.ascontiguousarray(m) for _, _, m in maps_of_worker(new_model.maps, worker, self.n_workers)]
        self._send_maps(share)
        self.held_maps = new_model.maps  # every worker's M-step shared the maps out

    def _with_shared_references(self, plan, mine, backend, stages):
        """The plan's units, this worker's own with its classes' references made once among the unit's workers
        (stage `references`): each worker transforms every W-th class (the engine's projector set-up, the padded
        transform of each map) and they share them, through NCCL where the unit's workers have GPUs of their own,
        through MPI on the host with the numpy engine. Where a GPU is shared by several workers, a worker serves
        several units or a unit has one class, each engine makes its own as in one process."""
        units = list(plan.units)
        n_units = len(units)
        if len(mine) != 1 or n_units > self.n_workers:
            return units
        u = mine[0]
        setup = units[u].setup
        if setup.maps is None or setup.projectors is not None or len(setup.maps) < 2:
            return units
        unit_comm, device = self._unit_comm(n_units)
        size = unit_comm.Get_size()
        if size == 1 or (backend.name == "cuda" and device is None):
            return units
        share = device.broadcast if backend.name == "cuda" else functools.partial(_host_broadcast, unit_comm)
        tic = time.perf_counter()
        projectors = backend.shared_projectors(setup.maps, setup.padding_factor, setup.current_size_px // 2,
                                               [k % size for k in range(len(setup.maps))], unit_comm.Get_rank(),
                                               share)
        units[u] = replace(units[u], setup=replace(setup, maps=None, projectors=projectors))
        add_seconds(stages, "references", tic)
        return units

    def _unit_comm(self, n_units):
        """(MPI communicator of the workers of this worker's unit, its NCCL collectives or None) where each worker
        serves one unit (`units_of_worker`), made once per number of units; one unit's workers are all the workers,
        whose NCCL communicator is made as they start."""
        if n_units not in self._unit_comms:
            worker = self.rank - 1
            self._unit_comms[n_units] = ((self.workers, self.peers.channel.device) if n_units == 1
                                         else self._unit_communicators(worker % n_units, worker))
        return self._unit_comms[n_units]

    def _send_maps(self, share):
        """This worker's share of the new maps on its way to the master while the next E-step runs: a thread of its
        own waits in MPI for the sends (MPI moves a large message as the sender's calls ask it to: the E-step's calls,
        one a batch, left the master's writer waiting 3.5 s an iteration on four H200s; a thread asking every 1 ms
        took 1.2 s an iteration to move the 105k Class3D's three 187 MB maps and slowed the E-step's host work
        meanwhile). Where MPI takes calls from one thread only, they are sent before the worker goes on."""
        from mpi4py import MPI

        requests = self.objects.isend_arrays(share, 0, TAG_MAPS)
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            MPI.Request.Waitall(requests)
            return
        self.maps_outgoing = threading.Thread(target=MPI.Request.Waitall, args=(requests,), name="maps to the master",
                                              daemon=True)
        self.maps_outgoing.start()

    def _maps_sent(self):
        """Wait until this worker's share of the last maps has reached the master."""
        if self.maps_outgoing is not None:
            self.maps_outgoing.join()
        self.maps_outgoing = None

    def _share(self, members, unit, n_units):
        """This worker's share of a unit's particles (`shares_of_unit`)."""
        workers = workers_of_unit(unit, self.n_workers, n_units)
        return shares_of_unit(members, len(workers))[workers.index(self.rank - 1)]

    # ------------------------------------------------------------------ maps
    def _without_held(self, maps):
        """`maps` (a list, or None) with every map the workers hold already (`held_maps`, the last M-step's, which the
        workers shared among them) replaced by its place (`HeldMap`): each map crosses to the master once per
        iteration. Maps are only ever replaced, never changed in place, so a held map is recognised by its
        identity."""
        held = {id(m): HeldMap(h, k) for h, row in enumerate(self.held_maps) for k, m in enumerate(row)}
        return None if maps is None else [held.get(id(m), m) for m in maps]

    def _with_held(self, maps):
        """A worker's `maps` from the master's, every `HeldMap` replaced by the map it names."""
        return None if maps is None else [self.held_maps[m.half][m.klass] if isinstance(m, HeldMap) else m
                                          for m in maps]

    def _without_held_maps(self, plan, model):
        """(plan, model) with every held map replaced by its place (`_without_held`)."""
        units = [replace(u, setup=replace(u.setup, maps=self._without_held(u.setup.maps))) for u in plan.units]
        return replace(plan, units=units), replace(model, maps=[self._without_held(row) for row in model.maps])

    def _with_held_maps(self, plan, model):
        """A worker's (plan, model) from the master's, every `HeldMap` replaced by the map it names."""
        units = [replace(u, setup=replace(u.setup, maps=self._with_held(u.setup.maps))) for u in plan.units]
        return replace(plan, units=units), replace(model, maps=[self._with_held(row) for row in model.maps])

    def _work(self, iteration):
        """(unit, indices) of this worker's batches as the master hands them out, asked for one ahead."""
        comm = self.comm
        fault_rank, fault_iteration, how = (os.environ.get("CRYOREFINE_FAULT", "").split(":") + ["", "", ""])[:3]
        while True:
            comm.send(("ready", None), dest=0, tag=TAG_REQUEST)
            item = comm.recv(source=0, tag=TAG_WORK)
            if item is None:
                return
            if fault_rank == str(self.rank) and fault_iteration == str(iteration):
                if how == "kill":  # as the kernel's OOM killer or a node's failure ends a process: no word from it
                    # (but this line, which says when, for the time the launcher takes to end the job)
                    print(f"worker {self.rank} killing itself at unix time {time.time():.3f}", file=sys.stderr,
                          flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at iteration {iteration} (CRYOREFINE_FAULT)")
            yield item

    def _worker_config(self):
        """This worker's engine: its GPU (`device_of_worker`)."""
        config = self.config
        if config.engine != "cuda":
            return config

        def visible():
            import cupy

            return cupy.cuda.runtime.getDeviceCount()

        return replace(config, gpu_ids=(device_of_worker(self.rank, config.gpu_ids, visible),))

    # ------------------------------------------------------------------ sums
    def _reduce(self, sums, plan, makers, real_dtype):
        """{unit: host or device WeightedSums} of this worker after the reduction over each unit's workers: each class
        volume reduced onto the worker that makes its map (`makers`; onto the unit's holder where that worker is not
        one of the unit's, `_sums_of_makers` sends it on), the other sums onto the unit's holder (`holder_of_unit`).
        A class volume not held here is None; the other sums are whole only on the holder. The volumes are added in
        the engine's precision (`real_dtype`), the other sums in float64; a unit's only worker keeps them where
        they are, or copies them to the host in that precision when it serves several units. Where every worker
        serves every unit (`units_of_worker`), each unit is added over all the workers, one unit after the other."""
        n_units = len(plan.units)
        if self.n_workers < n_units and n_units % self.n_workers == 0:  # each unit has one worker, which holds it
            return {u: s.unpack(s.pack(volume_real_dtype=real_dtype)) for u, s in sums.items()}
        if self.n_workers < n_units:  # every worker serves every unit: each is added over all of them, in order
            return {u: self._reduce_unit(u, sums[u], self.workers, self.peers.channel.device, plan, makers,
                                         real_dtype) for u in sorted(sums)}
        (u, s), = sums.items()
        unit_comm, device = self._unit_comm(n_units)
        if unit_comm.Get_size() == 1:  # the unit's only worker: its sums are the unit's, where they are
            return {u: s}
        return {u: self._reduce_unit(u, s, unit_comm, device, plan, makers, real_dtype)}

    def _reduce_unit(self, u, s, unit_comm, device, plan, makers, real_dtype):
        """Unit `u`'s WeightedSums `s` added over `unit_comm`, the communicator of its workers (`_reduce`)."""
        from mpi4py import MPI

        unit_workers = workers_of_unit(u, self.n_workers, len(plan.units))
        in_comm = sorted(unit_workers)  # the communicators rank the workers in worker order
        holder = in_comm.index(holder_of_unit(u, self.n_workers))

        def reduced(array, root, dtype, wire=np.float64):
            """`array` added over the unit's workers onto `root` (its rank in the unit): on the GPUs where every
            worker's is a device array of `dtype` (`gpu.collectives`), else on the host in the reals of `wire`, in
            chunks; there of `dtype` (None elsewhere)."""
            if device is not None:
                here = bool(DeviceCollectives.takes(array) and array.dtype == dtype)
                on_device = unit_comm.allreduce(here, op=MPI.LAND)
                if on_device:
                    return device.reduce(array, root)
            flat = flat_reals(array, wire)
            out = np.zeros_like(flat) if unit_comm.Get_rank() == root else None
            for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
                stop = min(flat.size, start + REDUCE_CHUNK_ELEMENTS)
                unit_comm.Reduce(flat[start:stop], out[start:stop] if out is not None else None, op=MPI.SUM,
                                 root=root)
            return None if out is None else from_flat_reals(out, np.shape(array), dtype)

        data, weight = [], []
        for c in range(len(s.data)):
            maker = makers[(u, c)]
            root = in_comm.index(maker) if maker in in_comm else holder
            # the class volumes in the engine's own precision: each worker's are float32 sums of thousands of
            # atomic adds, and float64 on the wire doubled the bytes and cost a conversion on each side (the
            # reduction of Class3D's six volumes grew to 1.3 s a worker an iteration on two H200s)
            data.append(reduced(s.data[c], root, complex_dtype_for(real_dtype), real_dtype))
            s.data[c] = None
            weight.append(reduced(s.weight[c], root, np.dtype(real_dtype), real_dtype))
            s.weight[c] = None
        small = s.without_volumes()
        flats = [reduced(flat, holder, np.float64) for flat in small.pack()]
        small = small.unpack(flats) if unit_comm.Get_rank() == holder else small
        return replace(small, data=data, weight=weight)

    def _unit_communicators(self, color, key):
        """(MPI communicator of the workers of this worker's unit, its `_device_collectives` or None)."""
        unit_comm = self.workers.Split(color, key)
        return unit_comm, self._device_collectives(unit_comm)

    def _device_collectives(self, comm):
        """NCCL collectives (`gpu.collectives.DeviceCollectives`) over the workers of `comm`, made by all of them at
        once; None (the host path) unless every one has a GPU of its own and CuPy has NCCL, or for one worker."""
        make = self._device_collectives_maker(comm)
        return None if make is None else make()

    def _device_collectives_maker(self, comm):
        """`_device_collectives`, its MPI part done now by all of `comm`'s workers: the function that makes them
        (`DeviceCollectives.maker`), or None."""
        from mpi4py import MPI

        usable = self.exclusive_gpu and comm.Get_size() > 1 and nccl_usable()
        if not comm.allreduce(usable, op=MPI.LAND):
            return None
        return DeviceCollectives.maker(comm)

    def _sums_of_makers(self, held, plan, makers, real_dtype):
        """Every unit's WeightedSums for this worker's M-step: the class volumes of the maps it makes (those reduced
        onto a unit's holder for a worker that does not serve the unit cross to it here; None for the maps others
        make) and every unit's other sums, whole (shared out by the holders)."""
        worker = self.rank - 1
        n_units = len(plan.units)
        for (u, c), maker in sorted(makers.items()):  # in one order on every worker: sends meet their receives
            holder = holder_of_unit(u, self.n_workers)
            if maker in workers_of_unit(u, self.n_workers, n_units):  # its volume was reduced onto it
                continue
            if worker == holder:
                for array in (held[u].data[c], held[u].weight[c]):
                    self._send_array(array, maker, real_dtype)
                held[u].data[c] = held[u].weight[c] = None
            elif worker == maker:
                template = empty_sums(plan.units[u], real_dtype=real_dtype)
                held.setdefault(u, template).data[c] = self._receive_array(template.data[c], holder, real_dtype)
                held[u].weight[c] = self._receive_array(template.weight[c], holder, real_dtype)
        smalls = mstep.gathered(self.peers, {u: held[u].without_volumes() for u in held
                                             if holder_of_unit(u, self.n_workers) == worker})
        out = []
        for u, unit in enumerate(plan.units):
            volumes = [held[u] if u in held and makers[(u, c)] == worker else None for c in range(len(unit.classes))]
            out.append(replace(smalls[u], data=[v.data[c] if v is not None else None for c, v in enumerate(volumes)],
                               weight=[v.weight[c] if v is not None else None for c, v in enumerate(volumes)]))
        return out

    def _send_array(self, array, dest, real_dtype):
        """A class volume to worker `dest` in the engine's precision (`real_dtype`), in chunks."""
        flat = flat_reals(array, real_dtype)
        for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
            self.comm.Send(flat[start:start + REDUCE_CHUNK_ELEMENTS], dest=dest + 1, tag=TAG_SUMS)

    def _receive_array(self, like, source, real_dtype):
        """A class volume shaped and typed as `like`, sent by worker `source` (`_send_array`) in `real_dtype`."""
        flat = np.empty(like.size * (2 if np.iscomplexobj(like) else 1), dtype=real_dtype)
        for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
            self.comm.Recv(flat[start:start + REDUCE_CHUNK_ELEMENTS], source=source + 1, tag=TAG_SUMS)
        return from_flat_reals(flat, like.shape, like.dtype)


def _warmed_up(collectives):
    """`collectives` after their first collectives (`DeviceCollectives.warm_up`)."""
    collectives.warm_up()
    return collectives


def _host_broadcast(comm, array, root):
    """`array` (a contiguous numpy array) of rank `root` of `comm` on every rank, in place, in chunks."""
    flat = array.reshape(-1).view(np.float64 if array.dtype.itemsize % 8 == 0 else np.float32)
    for start in range(0, flat.size, REDUCE_CHUNK_ELEMENTS):
        comm.Bcast(flat[start:start + REDUCE_CHUNK_ELEMENTS], root=root)


class WorkerPeers:
    """The MPI workers as each other's peers in the M-step (`em.mstep.Alone` for one process): `gather_all` gives
    every worker's object to every worker, in worker order (`runners.objects.ObjectChannel.allgather`)."""

    def __init__(self, channel):
        self.channel = channel  # an ObjectChannel over the workers' communicator

    def gather_all(self, mine):
        return self.channel.allgather(mine)

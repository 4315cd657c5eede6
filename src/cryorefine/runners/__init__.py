"""Where a job's iterations run: one process (`serial.SerialRunner`) or an MPI master with
workers (`mpi.MpiRunner`). Both serve every job through `em.loop`; neither imports a job."""

from __future__ import annotations

import logging


def for_config(config, min_mpi_ranks, on_abort=None):
    """The MPI runner when this process was started by mpirun/srun (the job needs `min_mpi_ranks`; `on_abort()` is
    called on a failing rank before the job is aborted), else one process on the backend config.engine names."""
    from cryorefine.runners.mpi import MpiRunner, launched_with_mpi

    if launched_with_mpi():
        return MpiRunner(config, min_mpi_ranks, on_abort)
    from cryorefine.estep.backend import make_backend
    from cryorefine.runners.serial import SerialRunner

    backend = make_backend(config)
    logging.getLogger("cryorefine").info("E-step engine: %s", backend.describe())
    return SerialRunner(backend, config.batch_size_for, config.preread_images, config.scratch_dir)

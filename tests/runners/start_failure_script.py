"""Run by tests/runners/test_mpi.py under mpiexec: `cryorefine classify` whose starting maps fail with a bad input
(as a reference found wrong while job.start makes them would), after the workers have begun the initial noise pass.
Arguments: those of `cryorefine classify`."""

import sys

import cryorefine.jobs.classify as classify
from cryorefine.cli import main
from cryorefine.errors import InputError


def failing_references(*args, **kwargs):
    raise InputError("the starting maps failed (a test's bad input)")


classify.initial_references = failing_references
main(["classify", *sys.argv[1:]])

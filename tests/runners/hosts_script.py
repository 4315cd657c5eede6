"""Run by tests/runners/test_mpi.py under mpiexec: `cryorefine refine` whose workers are told they are on
HOSTS hosts (worker w on host w mod HOSTS), as on a cluster, though they all run here. Each worker writes, into the
folder STACKS_SEEN, the stacks it read its images from. Arguments: HOSTS, STACKS_SEEN, then those of
`cryorefine refine`."""

import contextlib
import sys
from pathlib import Path

import cryorefine.runners.mpi as runner
from cryorefine.cli import main

hosts, seen = int(sys.argv[1]), Path(sys.argv[2])
copy = runner.scratch_copy


def node_communicator(workers):
    return workers.Split(workers.Get_rank() % hosts, workers.Get_rank())


@contextlib.contextmanager
def scratch_copy(particles, scratch_dir, log, share=None):
    with copy(particles, scratch_dir, log, share) as read_from:
        yield read_from
        stacks = sorted(set(read_from.stack_paths.tolist()))
    from mpi4py import MPI

    (seen / f"rank{MPI.COMM_WORLD.Get_rank()}.txt").write_text("\n".join(stacks))


runner.node_communicator = node_communicator
runner.scratch_copy = scratch_copy
main(["refine", *sys.argv[3:]])

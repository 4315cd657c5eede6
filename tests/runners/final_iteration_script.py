"""Run by tests/runners/test_mpi.py, alone or under mpiexec: `cryorefine refine` with RELION's convergence forced
after iteration 1 (as tests/jobs/test_refine.py forces it), so that iteration 2 is the final one, joining the
halves. Arguments: those of `cryorefine refine`."""

import sys
from dataclasses import replace

from cryorefine.cli import main
from cryorefine.em import schedule

original = schedule.check_convergence


def converge_at_two(optimiser, state, **kwargs):
    optimiser = original(optimiser, state, **kwargs)
    return replace(optimiser, has_converged=True, do_join_halves=True) if optimiser.iteration == 2 else optimiser


schedule.check_convergence = converge_at_two
main(["refine", *sys.argv[1:]])

#!/bin/bash
# RELION's queue-submission template for cryorefine on a Slurm cluster.
#
# In RELION's GUI (Running tab of Refine3D or Class3D): "Submit to queue?" Yes, "Standard submission script" this
# file, "Number of MPI procs" = GPUs + 1 (a master and one worker per GPU), "Number of threads" 4 or more (each rank's
# CPUs under Slurm: a GPU worker's E-step, image reads and maps' transfer run on threads of their own, and a rank
# bound to one CPU ran the 10k Class3D at half speed). "Queue submit command" sbatch. RELION fills in its variables
# (job name, queue, MPI procs, threads, the command) and submits; the job's relion_refine_mpi line is run as it is by
# `cryorefine relion_refine` (`--auto_refine` lines as `cryorefine refine`, the others as `cryorefine classify`).
# RELION's pipeline sees the job end through the RELION_JOB_EXIT_* file that --pipeline_control (on every GUI line)
# makes cryorefine write.
#
# Leave "Which GPUs to use" empty: each worker then takes a GPU of its own node (local rank modulo the node's
# GPUs), on any number of nodes. --gpu "0:1:2:3" names devices in rank order, which holds on one node only.
#
#SBATCH --job-name=XXXnameXXX
#SBATCH --partition=XXXqueueXXX
#SBATCH --ntasks=XXXmpinodesXXX
#SBATCH --cpus-per-task=XXXthreadsXXX
#SBATCH --gres=gpu:XXXextra1XXX
#SBATCH --output=XXXoutfileXXX
#SBATCH --error=XXXerrfileXXX
#
# The --gres line takes RELION's first extra variable: set RELION_QSUB_EXTRA1="GPUs per node" (and a default,
# e.g. RELION_QSUB_EXTRA1_DEFAULT=4) in the environment RELION's GUI starts from.

set -u
CRYOREFINE=${CRYOREFINE:-cryorefine}             # the cryorefine command of the cluster's environment
CRYOREFINE_MPIRUN=${CRYOREFINE_MPIRUN:-mpirun}   # or "srun --mpi=pmix" where the cluster launches MPI so

# RELION's own command line, as its GUI wrote it (its first word `which relion_refine_mpi`: a path, or nothing
# where RELION is not installed on the nodes)
relion_line=(XXXcommandXXX)
if [[ ${#relion_line[@]} -gt 0 && ${relion_line[0]} != --* ]]; then
    relion_line=("${relion_line[@]:1}")
fi
exec $CRYOREFINE_MPIRUN -n XXXmpinodesXXX $CRYOREFINE relion_refine "${relion_line[@]}"

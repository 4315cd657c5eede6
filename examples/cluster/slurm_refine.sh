#!/bin/bash
# A Slurm batch script: cryorefine's auto-refine on two nodes of four GPUs each (a master and eight workers).
# Submit from the RELION project folder (the STAR file's image paths are relative to it):
#     sbatch examples/cluster/slurm_refine.sh
# Nothing here assumes one node: every worker reads its own images (--scratch_dir copies the stacks once to each
# node's local disk; give a path that exists on every node), takes a GPU of its own node (no --gpu devices: local
# rank modulo the node's GPUs) and exchanges its sums with the others through MPI alone.
#
#SBATCH --job-name=cryorefine
#SBATCH --nodes=2
#SBATCH --ntasks=9
#SBATCH --gres=gpu:4
#SBATCH --cpus-per-task=4
#SBATCH --time=12:00:00
#SBATCH --output=Refine3D/job100/run.out
#SBATCH --error=Refine3D/job100/run.err

set -eu
mkdir -p Refine3D/job100
# the master (rank 0) needs no GPU and little memory; Slurm places it with the first node's workers
srun --mpi=pmix cryorefine refine \
    --i Select/job050/particles.star --ref InitialModel/job060/initial_model.mrc --o Refine3D/job100/run \
    --ini_high 40 --particle_diameter 200 --sym C1 --ctf --flatten_solvent --zero_mask \
    --norm --scale --firstiter_cc --auto_local_healpix_order 4 --offset_range 5 --offset_step 2 \
    --scratch_dir /scratch/$USER --pipeline_control Refine3D/job100/

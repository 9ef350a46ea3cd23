#!/bin/bash

# Parameters
#SBATCH --account=my-account
#SBATCH --cpus-per-task=12
#SBATCH --error=/shared/cqk-megatron/runs/1b-coupled-4x8/submitit/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=1b-coupled-4x8
#SBATCH --mem=0
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --open-mode=append
#SBATCH --output=/shared/cqk-megatron/runs/1b-coupled-4x8/submitit/%j_0_log.out
#SBATCH --partition=h100
#SBATCH --qos=normal
#SBATCH --requeue
#SBATCH --signal=USR1@300
#SBATCH --time=2880
#SBATCH --wckey=submitit

# setup
source /shared/cqk-megatron/.venv/bin/activate
export PYTHONPATH=<REPO>${PYTHONPATH:+:$PYTHONPATH}
export SUBMITIT_PREEMPT_SIGNAL=USR1
export OMP_NUM_THREADS=8
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_IB_TIMEOUT=22
echo "cqk-attempt: begins ${SLURM_RESTART_COUNT:-0} on $(hostname)" >&2

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /shared/cqk-megatron/runs/1b-coupled-4x8/submitit/%j_%t_log.out --error /shared/cqk-megatron/runs/1b-coupled-4x8/submitit/%j_%t_log.err --kill-on-bad-exit=1 /shared/cqk-megatron/.venv/bin/python -u -m submitit.core._submit /shared/cqk-megatron/runs/1b-coupled-4x8/submitit


# teardown
cqk_srun_exit=$?  # srun's, kept for the step below
/shared/cqk-megatron/.venv/bin/python -m launch.attempts after-srun /shared/cqk-megatron/runs/1b-coupled-4x8/submitit $cqk_srun_exit

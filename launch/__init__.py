"""The cluster front door: submit runs and sweeps with submitit, to Slurm or locally.

    cqk submit --config configs/runs/tiny_cpu.yaml --cluster local --tasks 2
    cqk submit --config RUN.yaml --profile configs/clusters/X.yaml --cluster slurm
    cqk submit --sweep configs/sweeps/ladder.yaml --profile ... --cluster slurm
    cqk status RUN_DIR

A package (not only a script) so that the job side can import ``launch.job`` when
submitit unpickles the submitted callable.
"""

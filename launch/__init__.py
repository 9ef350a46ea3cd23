"""The cluster front door: submit runs and sweeps with submitit, to Slurm or locally.

    python launch/submit.py --config configs/runs/tiny_cpu.yaml --cluster local --tasks 2
    python launch/submit.py --config RUN.yaml --profile configs/clusters/X.yaml --cluster slurm
    python launch/submit.py --sweep configs/sweeps/ladder.yaml --profile ... --cluster slurm
    python launch/submit.py status RUN_DIR

A package (not only a script) so that the job side can import ``launch.job`` when
submitit unpickles the submitted callable.
"""

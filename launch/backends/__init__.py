"""Launch backends: where a job's tasks run, behind one protocol (``base.Backend``).

``slurm`` (sbatch through submitit, the scheduler owns the jobs) and ``local`` (this
machine, no scheduler) ship; ``register_backend`` adds another, and ``--cluster NAME``
picks one. Nothing outside this package compares a backend's name (a test says so).
"""

from launch.backends.base import ACTIVE_STATES, FINAL_STATES, Backend, is_active
from launch.backends.registry import (
    BACKEND_NAMES,
    backend_names,
    get_backend,
    register_backend,
)

__all__ = [
    "ACTIVE_STATES",
    "BACKEND_NAMES",
    "FINAL_STATES",
    "Backend",
    "backend_names",
    "get_backend",
    "is_active",
    "register_backend",
]

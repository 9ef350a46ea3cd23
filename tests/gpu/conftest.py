"""tests/gpu/ holds the GPU acceptance command (accept.py, run on a GPU machine: see
docs/gpu.md) and its wheel script; pytest never collects them here (its --dry-run is
tested by tests/test_gpu_accept.py)."""

collect_ignore_glob = ["*.py"]

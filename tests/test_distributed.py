"""Process groups in one process: rebuilding Megatron's model-parallel groups (what every
tool that builds a model in-process does, and many tests) must not leak gloo contexts."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Counts this process's threads (gloo's are native, invisible to `threading`) after one
# and after eleven builds of the TP=PP=1 groups. Run in a fresh interpreter so that no
# group another test made is counted.
SCRIPT = textwrap.dedent(
    """
    import os
    from cqk_megatron.config import RunConfig
    from cqk_megatron.parallel.process_groups import init_single_process

    def threads():
        return len(os.listdir("/proc/self/task"))

    init_single_process(RunConfig())
    once = threads()
    for _ in range(10):
        init_single_process(RunConfig())
    print(once, threads())
    """
)


def test_rebuilding_model_parallel_groups_leaks_no_threads():
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    once, eleven = map(int, done.stdout.split()[-2:])
    # Before the fix each rebuild left ~20 groups behind, 51 threads a build (65 -> 575).
    assert eleven <= once + 2, f"{once} threads after one build, {eleven} after eleven"

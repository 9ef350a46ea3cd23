"""Slurm job states, from its accounting when it has one, else from the controller.

``sacct`` needs the accounting daemon (slurmdbd); clusters without it answer "accounting
storage is disabled", and submitit then reports every job as UNKNOWN. ``scontrol show
job`` answers from slurmctld's memory instead, which keeps a job for ``MinJobAge``
seconds after it ends (300 by default); after that the honest answer is ``UNKNOWN``.
The ``slurm`` launch backend (``launch/backends/slurm.py``) asks here.
"""

from __future__ import annotations

import subprocess


def _run(command: list[str]) -> str | None:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _from_sacct(job_ids: list[str]) -> dict[str, str] | None:
    command = ["sacct", "--noheader", "--parsable2", "--allocations", "-o", "JobID,State"]
    for job_id in job_ids:
        command += ["-j", job_id]
    out = _run(command)
    if out is None:
        return None
    states = {}
    for line in out.splitlines():
        job_id, _, state = line.partition("|")
        if job_id in job_ids:
            states[job_id] = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0"
    return states


def controller_state(job_id: str) -> str:
    """The job's state in slurmctld's memory (``UNKNOWN`` once it has forgotten it)."""
    out = _run(["scontrol", "show", "job", "--oneliner", job_id])
    if not out:
        return "UNKNOWN"
    for line in out.splitlines():  # an array's parent lists every task; take this one
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        array = f"{fields.get('ArrayJobId')}_{fields.get('ArrayTaskId')}"
        if fields.get("JobId") == job_id or array == job_id or len(out.splitlines()) == 1:
            return fields.get("JobState", "UNKNOWN")
    return "UNKNOWN"


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """``{job id: state}`` for Slurm job ids (``123`` or array tasks ``123_4``)."""
    states = _from_sacct(job_ids) or {}
    for job_id in job_ids:
        if job_id not in states:
            states[job_id] = controller_state(job_id)
    return states

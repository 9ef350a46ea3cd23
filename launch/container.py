"""Running a job's tasks in a container, as a cluster profile's ``container`` block asks.

Two runtimes, the two that Slurm sites use most:

- ``pyxis`` (NVIDIA's Slurm plugin for enroot): srun itself starts each task in the image
  (``--container-image``, ``--container-mounts``, ``--container-workdir``);
- ``apptainer`` (or Singularity): each task's command is ``apptainer exec [--nv] --bind
  MOUNTS IMAGE python ...``.

The checkout and the runs root are read at the same paths inside the container as outside
(the job exports ``PYTHONPATH=<checkout>`` and writes ``log.root``), so ``mounts`` must
bind them there: ``/shared:/shared`` binds a shared filesystem that holds both. The batch
script's own lines after srun (a failed attempt's record, the requeue) run in the image
too: as a one-task job step (pyxis) or through ``apptainer exec`` (Apptainer).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from cqk_megatron.config import ConfigError

RUNTIMES = ("pyxis", "apptainer")
# The python of an image, when the profile does not name one.
IMAGE_PYTHON = "python"


@dataclass
class Container:
    """A profile's ``container`` block."""

    image: str  # pyxis: a registry image (nvcr.io#nvidia/pytorch:25.01-py3) or a .sqsh file
    runtime: str = "pyxis"  # pyxis | apptainer
    mounts: list[str] = field(default_factory=list)  # host:container paths, e.g. /shared:/shared
    workdir: str | None = None  # pyxis: the tasks' working directory inside the image
    options: list[str] = field(default_factory=list)  # further flags to srun or apptainer exec


def check_container(container: Container, where: str) -> None:
    if container.runtime not in RUNTIMES:
        raise ConfigError(
            f"{where}: container.runtime={container.runtime!r} is unknown; use one of "
            f"{list(RUNTIMES)}"
        )
    if not container.image.strip():
        raise ConfigError(f"{where}: container.image is empty; name the image to run in")


def srun_container_args(container: Container | None) -> list[str]:
    """srun's flags that start each task in the image (pyxis); none for Apptainer."""
    if container is None or container.runtime != "pyxis":
        return []
    args = [f"--container-image={container.image}"]
    if container.mounts:
        args.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir:
        args.append(f"--container-workdir={container.workdir}")
    return [*args, *container.options]


def task_python(container: Container | None, python: str, gpus: bool) -> str:
    """The command that starts a task's python: ``python`` itself, or (Apptainer) python
    inside the image."""
    if container is None or container.runtime != "apptainer":
        return python
    words = ["apptainer", "exec", *(["--nv"] if gpus else [])]
    if container.mounts:
        words += ["--bind", ",".join(container.mounts)]
    words += [*container.options, container.image]
    return " ".join(shlex.quote(w) for w in words) + f" {python}"


def batch_python(container: Container | None, python: str, gpus: bool) -> str:
    """The command that starts python for the batch script's own lines (on the job's first
    node, outside srun): in the image as well, so that it finds the same packages."""
    if container is None:
        return python
    if container.runtime == "apptainer":
        return task_python(container, python, gpus)
    step = ["srun", "--nodes=1", "--ntasks=1", *srun_container_args(container)]
    return " ".join(shlex.quote(w) for w in step) + f" {python}"

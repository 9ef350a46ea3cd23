"""``cqk submit --dry-run``: what would be submitted, the pre-flight verdict first.

Each run is checked as a submission checks it (``cqk_megatron.planner.preflight``, with
checkpoints verified by hash), and nothing is written or queued. The first line says
whether the submission would go ahead; the exit code is the one the submission would end
with: 0 when every run can start (or finished already, and would be skipped),
``EXIT_REFUSED`` (2) when one would be refused.

A single run then prints its folder, layout, resolved config and sbatch script. A sweep
prints one line per run (name, layout, verdict) and each refusal once, with the number of
runs it refuses, so that a ladder of a hundred runs whose data is missing reads in a
screen; its sbatch scripts are written with ``--emit-sbatch DIR``.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

import yaml

from cqk_megatron.config import to_dict
from cqk_megatron.errors import EXIT_REFUSED
from launch import run_dir as runs
from launch.backends import Backend
from launch.jobs import held_by, job_name, submitit_folder
from launch.resolve import RunSpec


@dataclass(frozen=True)
class Verdict:
    """What a submission would do with one run: ``start``, ``skip`` or ``refuse``."""

    action: str
    why: str = ""  # the refusal's one line, or why the run is skipped
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.action == "start":
            return "can start"
        return f"{'would be refused' if self.action == 'refuse' else 'skipped'}: {self.why}"


def verdict(spec: RunSpec, resume: str) -> Verdict:
    """The submission's decision for ``spec``, from files only."""
    from cqk_megatron.planner.preflight import PreflightError, preflight

    if runs.is_finished(spec.run_dir, spec.config.train.train_steps):
        return Verdict("skip", "finished")
    held = held_by(spec)
    if held is not None:
        return Verdict("skip", held)
    try:
        notes = preflight(spec.config, resume, hash_checkpoints=True)
    except PreflightError as error:
        return Verdict("refuse", str(error))
    return Verdict("start", notes=tuple(notes))


def refusal_pattern(spec: RunSpec, why: str) -> str:
    """A refusal's words with the run's own name and folder taken out, so that the same
    cause in many runs of a sweep reads as one."""
    return why.replace(str(spec.run_dir), "<run folder>").replace(spec.name, "<run>")


def headline(verdicts: list[Verdict]) -> str:
    counts = Counter(v.action for v in verdicts)
    refused = counts["refuse"]
    if len(verdicts) == 1:
        return f"pre-flight: {verdicts[0].describe()}"
    told = f"{counts['start']} can start, {refused} would be refused, {counts['skip']} skipped"
    return f"pre-flight: {len(verdicts)} runs: {told}"


def single_run(spec: RunSpec, found: Verdict, details: list[str]) -> list[str]:
    lines = [headline([found])]
    lines += [f"==> run {spec.name}: {spec.folder_line()}", f"==> layout: {spec.layout()}"]
    lines += ["==> resolved config", yaml.safe_dump(to_dict(spec.config), sort_keys=False)]
    return [*(line.rstrip() for line in lines), *details]


def sweep_runs(specs: list[RunSpec], verdicts: list[Verdict], jobs: int) -> list[str]:
    """The headline, each refusal once (numbered), then one line per run."""
    lines = [headline(verdicts)]
    causes: dict[str, int] = {}
    counts: Counter[str] = Counter()
    for spec, found in zip(specs, verdicts, strict=True):
        if found.action == "refuse":
            cause = refusal_pattern(spec, found.why)
            causes.setdefault(cause, len(causes) + 1)
            counts[cause] += 1
    for cause, number in causes.items():
        lines.append(f"refusal [{number}] ({counts[cause]} runs): {cause}")
    width = max(len(p.name) for p in specs)
    for spec, found in zip(specs, verdicts, strict=True):
        if found.action == "refuse":
            said = f"refused [{causes[refusal_pattern(spec, found.why)]}]"
        else:
            said = found.describe()
        lines.append(f"{spec.name:<{width}}  {spec.layout()}  {said}")
    lines.append(
        f"==> {jobs} job(s) by resources; write their sbatch scripts with --emit-sbatch DIR"
    )
    return lines


def dry_run(
    specs: list[RunSpec],
    groups: list[list[RunSpec]],
    profile,
    backend: Backend,
    sweep,
    resume: str,
) -> int:
    """Print the dry run; the exit code the submission would end with."""
    verdicts = [verdict(spec, resume) for spec in specs]
    for spec, found in zip(specs, verdicts, strict=True):
        for note in found.notes:  # as the submission prints them
            print(f"{spec.name}: {note}", file=sys.stderr)
    if sweep is None and len(specs) == 1:
        where = [(g, submitit_folder(g, sweep), job_name(g, sweep)) for g in groups]
        details = backend.dry_run(where, profile, array=False)
        lines = single_run(specs[0], verdicts[0], details)
    else:
        lines = sweep_runs(specs, verdicts, len(groups))
    sys.stdout.write("\n".join(lines) + "\n")
    refused = any(v.action == "refuse" for v in verdicts)
    return EXIT_REFUSED if refused else 0

"""Submit training runs and sweeps with submitit, to Slurm or on this machine.

    cqk submit --config configs/runs/tiny_cpu.yaml --cluster local --tasks 2
    cqk submit --config configs/runs/1b_4x8.yaml \\
        --profile configs/clusters/example_h100.yaml --cluster slurm [--dry-run]
    cqk submit --sweep configs/sweeps/ladder.yaml --profile ... --cluster slurm
    cqk status RUN_DIR [RUN_DIR ...]
    cqk cancel RUN_DIR [RUN_DIR ...]

Trailing ``section.key=value`` arguments override the run config (every run of a sweep).
``--dry-run`` submits nothing: it prints the pre-flight verdict first (and exits 2 when a
run would be refused), then the resolved config, the parallel layout and the sbatch script
(a sweep: one line per run and each refusal once; ``launch/dry_run.py``). ``--emit-sbatch
DIR`` also writes a plain sbatch script per run for submitting by hand
(``launch/sbatch_file.py``). Runs that finished are skipped; runs with a job still queued
or running, or whose folder another live process holds (``lease.json``), are skipped; the
others are checked before anything is written or queued
(``cqk_megatron.planner.preflight``: data, tokenizer, sequence length, the run folder's
recorded config and checkpoints, free disk; a refusal is one line and exit 2), then
submitted, and resume from their newest complete checkpoint
(``--resume`` says otherwise, for the first attempt only). Waiting on its jobs, the launcher
exits 0 when every run finished, 2 when each unfinished run was refused by its job after
it was queued (``refused: RUN: why``: a twin submission, checkpoints that no longer
verify), else 1 (``not finished: RUN``).

``--cluster`` names a launch backend (``launch/backends/``: ``slurm``, ``local``, or one
registered with ``launch.backends.register_backend``). This module is the command line
only: submitting and following jobs is the library ``launch/jobs.py``, which
``launch.api`` uses too.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Run as a script, the repository root is not on sys.path; the job side imports
# ``launch.job`` by that name, so the launcher must too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from cqk_megatron.cli.args import program  # noqa: E402
from cqk_megatron.config import ConfigError  # noqa: E402
from cqk_megatron.errors import EXIT_REFUSED  # noqa: E402
from cqk_megatron.run.checkpoint_files import RESUME_HELP  # noqa: E402
from launch import run_dir as runs  # noqa: E402
from launch import sbatch_file  # noqa: E402
from launch.backends import Backend, backend_names, get_backend  # noqa: E402
from launch.cancel import main as cancel_main  # noqa: E402
from launch.dry_run import dry_run  # noqa: E402
from launch.jobs import (  # noqa: E402, F401 (the launcher's names, as before the split)
    LOCAL_CHECK_S,
    POLL_S,
    Progress,
    cancel_jobs,
    group_by_resources,
    held_by,
    job_name,
    submit_group,
    submitit_folder,
    triage,
)
from launch.resolve import RunSpec, explained_configs, resolve_run, resolve_sweep  # noqa: E402
from launch.resources import load_profile, parse_key_values  # noqa: E402
from launch.status import describe  # noqa: E402
from launch.status import main as status_main  # noqa: E402


def add_resource_options(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group("resources (override the profile and the sweep)")
    r.add_argument("--nodes", type=int, help="nodes per run")
    r.add_argument("--gpus-per-node", type=int, help="GPUs per node; one task per GPU")
    r.add_argument("--tasks", type=int, help="tasks (processes) per node on CPU nodes")
    r.add_argument("--cpus-per-task", type=int, help="CPU cores per task")
    r.add_argument("--mem", help="memory per node, Slurm syntax (64G; 0 = all)")
    r.add_argument("--partition", help="Slurm partition")
    r.add_argument("--account", help="Slurm account to charge")
    r.add_argument("--qos", help="Slurm quality of service")
    r.add_argument("--time", help="time limit per job: minutes, HH:MM:SS or D-HH:MM:SS")
    r.add_argument("--constraint", help="Slurm node features, e.g. h100")
    r.add_argument("--exclusive", action="store_true", default=None, help="whole nodes")
    r.add_argument("--job-name", help="Slurm job name (default: from the run or sweep)")
    r.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other sbatch option, e.g. --slurm-arg mail-type=END (repeatable)",
    )
    r.add_argument(
        "--signal-delay",
        type=int,
        dest="signal_delay_s",
        help="seconds before the time limit that USR1 asks the job to checkpoint",
    )
    r.add_argument("--max-requeues", type=int, help="times a job may requeue itself")
    r.add_argument(
        "--max-restarts",
        type=int,
        help="times a failed attempt (a rank died, hung or crashed) is relaunched from the "
        "newest complete checkpoint",
    )
    r.add_argument(
        "--max-identical-failures",
        type=int,
        help="stop once this many attempts in a row failed the same way (rank, exit, step)",
    )
    r.add_argument("--array-parallelism", type=int, help="sweep jobs running at once")


def parse_args(argv: list[str]) -> argparse.Namespace:
    prog = program("launch/submit.py")
    # as typed: "cqk submit" goes with "cqk status", "launch/submit.py" with its own
    others = "cqk" if prog.startswith("cqk") else prog
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=f"Also: {others} status RUN_DIR... (job state, progress, log tail); "
        f"{others} cancel RUN_DIR... (end a run's job, every process of it).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="run config YAML (configs/runs/...)")
    what.add_argument(
        "--sweep", help="sweep YAML (configs/sweeps/...): one job array per resource set"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    parser.add_argument(
        "--cluster",
        help="the launch backend: slurm, local (this machine), or one registered with "
        "launch.backends.register_backend; required unless the profile names one",
    )
    parser.add_argument(
        "--profile", help="cluster profile YAML (configs/clusters/...) with defaults"
    )
    add_resource_options(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="submit nothing: the pre-flight verdict first, then what would be submitted; "
        "exits 2 when a run would be refused",
    )
    parser.add_argument(
        "--emit-sbatch",
        metavar="DIR",
        help="a dry run that also writes a plain sbatch script (and its resolved config) "
        "per run into DIR, to read and submit by hand with sbatch (Slurm only)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print each run's config as it would run (includes, cluster profile and "
        "overrides applied; each value that is not the default says where it was set) and "
        "exit without submitting",
    )
    parser.add_argument("--resume", default="auto", help=RESUME_HELP + " (default: %(default)s)")
    parser.add_argument(
        "--skip-preflight",
        action="store_true",
        help="submit without checking data, run folder and disk from here (when this "
        "machine cannot see the files the job will read)",
    )
    wait = parser.add_mutually_exclusive_group()
    wait.add_argument(
        "--wait",
        action="store_true",
        default=None,
        help="wait for the jobs to end (the default with --cluster local)",
    )
    wait.add_argument("--no-wait", action="store_false", dest="wait", help="return once submitted")
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines"),
        default="auto",
        help="while waiting: a progress bar per run (what auto shows on a terminal) or a line "
        "per run every 30 s (default: %(default)s)",
    )
    return parser.parse_intermixed_args(argv)  # overrides may come between options


def cli_resources(args: argparse.Namespace, gpu_profile: bool) -> dict:
    if args.tasks is not None and args.gpus_per_node:
        raise ConfigError("give --gpus-per-node (one task per GPU) or --tasks (CPU), not both")
    if args.tasks is not None and gpu_profile:
        raise ConfigError("this profile's nodes have GPUs: one task per GPU, use --gpus-per-node")
    values = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "tasks_per_node": args.tasks,
        "cpus_per_task": args.cpus_per_task,
        "mem": args.mem,
        "partition": args.partition,
        "account": args.account,
        "qos": args.qos,
        "time": args.time,
        "constraint": args.constraint,
        "exclusive": args.exclusive,
        "job_name": args.job_name,
        "signal_delay_s": args.signal_delay_s,
        "max_requeues": args.max_requeues,
        "max_restarts": args.max_restarts,
        "max_identical_failures": args.max_identical_failures,
        "array_parallelism": args.array_parallelism,
    }
    if args.tasks is not None:
        values["gpus_per_node"] = 0
    if args.slurm_arg:
        values["slurm_args"] = parse_key_values(args.slurm_arg, "--slurm-arg")
    return values


# -- submission ------------------------------------------------------------------------------


def preflight_refusal(specs: list[RunSpec], resume: str) -> str | None:
    """The first run that would fail, as one line (``None``: all can start); notes are
    printed. Reads only: nothing is written or queued before this passes."""
    from cqk_megatron.planner.preflight import PreflightError, preflight

    for spec in specs:
        try:
            notes = preflight(spec.config, resume, hash_checkpoints=True)
        except PreflightError as error:
            return f"{spec.name}: {error}"
        for note in notes:
            print(f"{spec.name}: {note}", file=sys.stderr)
    return None


# -- stop signals ----------------------------------------------------------------------------
# SIGTERM and SIGHUP to a launcher that waits on local jobs cancel them, as Ctrl-C does: each
# job saves a checkpoint and stops, and the same command resumes it. Why not detach: a local
# job has no scheduler to own it, the launcher is its owner. SIGTERM is how `timeout`, a
# process supervisor, a CI runner or the end of a Slurm allocation asks a program to stop,
# and SIGHUP is what a closed terminal or ssh session sends; in each case nobody is left to
# watch the job, which would train on unseen, holding the machine and the run's folder.
# srun ends its job step on these signals too. A job meant to outlive the launcher is
# submitted with --no-wait (a launcher started under nohup keeps SIGHUP ignored). Slurm
# jobs stay queued, as on Ctrl-C: the scheduler owns them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StopSignal(BaseException):  # like KeyboardInterrupt: no ``except Exception`` eats it
    """SIGTERM or SIGHUP reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class StopSignals:
    """Raise ``StopSignal`` on SIGTERM and SIGHUP, except inside ``deferred()``: a job
    submitted there is recorded and watched before the signal acts, so that the cancel
    knows of every job this launcher started."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending: int | None = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers while the launcher submits and waits; the previous ones after.
        Only the main thread can set them (the launcher called as a library elsewhere
        keeps the default behaviour)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        for signum, handler in previous.items():
            if handler is not signal.SIG_IGN:  # nohup: SIGHUP stays ignored
                signal.signal(signum, self._received)
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def ignore(self) -> None:
        """While the cancel runs: a second signal must not cut it short."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

    def _received(self, signum: int, frame) -> None:
        if self.deferring:
            self.pending = signum
            return
        raise StopSignal(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        signum, self.pending = self.pending, None
        if signum is not None:
            raise StopSignal(signum)


STOPS = StopSignals()


def say(text: str, file=None) -> None:
    """Print, even to a terminal that has gone (SIGHUP): the cancel goes on regardless."""
    try:
        print(text, file=file or sys.stdout, flush=True)
    except OSError:
        pass


def stop_jobs(backend: Backend, pending: list, how: str, code: int) -> int:
    """Ctrl-C, SIGTERM or SIGHUP (``how``) while the launcher runs: jobs the launcher owns
    (local) are cancelled (each saves a checkpoint), a scheduler's stay queued. Returns
    ``code``."""
    STOPS.ignore()
    if not backend.launcher_owns_jobs:
        say(
            f"\n{how}: the jobs stay queued (follow them: cqk status RUN; end them: cqk cancel RUN)"
        )
        return code
    say(f"\n{how}: cancelling the {backend.name} jobs (each saves a checkpoint)...")
    try:
        left = cancel_jobs(backend, pending)
    except KeyboardInterrupt:  # a second Ctrl-C: the jobs stop at once, without a traceback
        return stop_jobs_at_once(backend, pending, code)
    if left:
        ids = ", ".join(str(job.job_id) for job in left)
        say(f"job(s) {ids} still ending; follow: cqk status RUN", file=sys.stderr)
    else:
        say("cancelled; run the same command again to resume")
    return code


STOP_NOW_WAIT_S = 60.0  # the controller kills what is left 10 s after its second signal


def stop_jobs_at_once(backend: Backend, pending: list, code: int) -> int:
    """A second Ctrl-C while the jobs save: a second cancel, which the local job's
    controller passes on as "now" (``launch.local_job``), and a bounded wait for the jobs
    to end. Their ranks abandon the save in progress: each run's newest complete checkpoint
    stays the one it resumes from. Returns ``code``."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a third one must not cut it
    say(
        f"interrupted again: stopping the {backend.name} jobs at once, without their saves "
        "(each run resumes from its newest complete checkpoint)"
    )
    try:
        left = cancel_jobs(backend, pending, wait_s=STOP_NOW_WAIT_S)
    finally:  # the launcher called from Python: its caller's Ctrl-C works again
        signal.signal(signal.SIGINT, previous)
    if left:
        ids = ", ".join(str(job.job_id) for job in left)
        say(f"job(s) {ids} still ending; follow: cqk status RUN", file=sys.stderr)
    return code


def unfinished_exit(specs: list[RunSpec], unfinished: list[str], job_ids: dict[str, str]) -> int:
    """The launcher's exit code when runs it waited for did not finish: ``EXIT_REFUSED`` (2)
    when every one of them was refused by its job after it was queued (its folder held by
    another job, checkpoints that do not verify, bad data: what the pre-flight refuses with
    2 too, and what a resubmission as it is cannot change), else 1. Says which and why."""
    run_dirs = {p.name: p.run_dir for p in specs}
    refused = {}
    for name in unfinished:
        job_id = job_ids.get(name)
        reason = runs.job_refusal(run_dirs[name], job_id) if job_id is not None else None
        if reason is not None:
            refused[name] = reason
    for name, reason in refused.items():
        print(f"refused: {name}: {reason.splitlines()[0]}", file=sys.stderr)
    if len(refused) == len(unfinished):
        return EXIT_REFUSED
    print(f"not finished: {', '.join(n for n in unfinished if n not in refused)}", file=sys.stderr)
    return 1


def _resolve(args: argparse.Namespace) -> tuple[Backend, object, list[RunSpec]]:
    """The backend, the cluster profile and the validated runs (``ConfigError``)."""
    profile = load_profile(args.profile)
    cluster = args.cluster or profile.cluster
    if cluster is None:
        choices = " or ".join(f"--cluster {name}" for name in backend_names())
        raise ConfigError(
            f"say where to run: {choices} (or 'cluster:' in the profile); the launcher "
            "does not guess from what is installed"
        )
    backend = get_backend(cluster)
    resources = cli_resources(args, profile.gpus)
    if args.sweep:
        specs = resolve_sweep(args.sweep, args.overrides, profile, resources, cluster)
    else:
        specs = [resolve_run(args.config, args.overrides, profile, resources, cluster)]
    return backend, profile, specs


def _triage_groups(groups: list[list[RunSpec]]) -> list[list[RunSpec]]:
    """Each group's runs that may be submitted now; the others are said and skipped."""
    todos = []
    for group in groups:
        todo = []
        for spec in group:
            reason = triage(spec)
            if reason is None:
                todo.append(spec)
            else:
                print(f"skipped {spec.name}: {reason} ({spec.run_dir})", flush=True)
        todos.append(todo)
    return todos


class SubmissionFailed(Exception):
    """A group could not be submitted (the launcher exits 1, naming its runs)."""


def _submit_all(todos, profile, backend: Backend, args, argv, progress) -> dict[str, str]:
    """Submit every group; the job id of each run submitted."""
    job_ids: dict[str, str] = {}
    for todo in filter(None, todos):
        for note in backend.submission_notes():
            print(f"note: {note}", file=sys.stderr)
        try:
            jobs = submit_group(
                todo, profile, backend, args.sweep, argv, progress, args.resume, STOPS.deferred
            )
        except (RuntimeError, OSError) as error:  # sbatch's refusal, no srun, ...
            names = ", ".join(p.name for p in todo)
            raise SubmissionFailed(f"submitting {names} failed: {error}") from error
        job_ids.update((p.name, str(j.job_id)) for p, j in zip(todo, jobs, strict=True))
    return job_ids


def _all_finished(specs: list[RunSpec]) -> bool:
    return all(runs.is_finished(p.run_dir, p.config.train.train_steps) for p in specs)


def _report_unfinished(specs: list[RunSpec], job_ids: dict[str, str]) -> int:
    """After the wait: 0 when every run finished, else what ``unfinished_exit`` says."""
    unfinished = [
        p.name for p in specs if not runs.is_finished(p.run_dir, p.config.train.train_steps)
    ]
    if not unfinished:
        print("all runs finished")
        return 0
    for spec in specs:
        if spec.name in unfinished:
            print(describe(spec.run_dir), file=sys.stderr)
    return unfinished_exit(specs, unfinished, job_ids)


def emit_scripts(specs: list[RunSpec], profile, backend: Backend, folder: str) -> None:
    """``--emit-sbatch``: the plain sbatch scripts, one per run (Slurm only)."""
    if not backend.sbatch_scripts:
        raise ConfigError(
            f"--emit-sbatch writes Slurm scripts, and --cluster is {backend.name}: "
            "use --cluster slurm (or a profile with cluster: slurm)"
        )
    for script in sbatch_file.emit(specs, profile, Path(folder)):
        print(f"wrote {script} (submit it with: sbatch {script})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    if argv[:1] == ["cancel"]:
        return cancel_main(argv[1:])
    args = parse_args(argv)
    try:
        backend, profile, specs = _resolve(args)
        groups = group_by_resources(specs, profile, args.sweep)
        if args.print_config:
            print(explained_configs(specs), end="")
            return 0
        if args.dry_run or args.emit_sbatch:
            code = dry_run(specs, groups, profile, backend, args.sweep, args.resume)
            if args.emit_sbatch:
                emit_scripts(specs, profile, backend, args.emit_sbatch)
            return code
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    todos = _triage_groups(groups)
    refusal = None
    if not args.skip_preflight:
        refusal = preflight_refusal([p for todo in todos for p in todo], args.resume)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    progress = Progress(backend, args.progress, total=sum(map(len, todos)))
    wait = args.wait if args.wait is not None else backend.launcher_owns_jobs
    with STOPS.installed():
        try:
            job_ids = _submit_all(todos, profile, backend, args, argv, progress)
            if not job_ids:
                print("nothing submitted")
                return 0 if _all_finished(specs) else 1
            if wait:
                if backend.launcher_owns_jobs:
                    print(
                        f"waiting; Ctrl-C, SIGTERM or SIGHUP cancel the {backend.name} jobs "
                        "(each saves a checkpoint), --no-wait leaves them running",
                        flush=True,
                    )
                progress.wait()
        except SubmissionFailed as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return stop_jobs(backend, progress.jobs(), "interrupted", 130)
        except StopSignal as stop:
            return stop_jobs(backend, progress.jobs(), stop.name, 128 + stop.signum)
    return _report_unfinished(specs, job_ids) if wait else 0


if __name__ == "__main__":
    sys.exit(main())

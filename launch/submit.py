"""Submit training runs and sweeps with submitit, to Slurm or on this machine.

    python launch/submit.py --config configs/runs/tiny_cpu.yaml --cluster local --tasks 2
    python launch/submit.py --config configs/runs/1b_4x8.yaml \\
        --profile configs/clusters/example_h100.yaml --cluster slurm [--dry-run]
    python launch/submit.py --sweep configs/sweeps/ladder.yaml --profile ... --cluster slurm
    python launch/submit.py status RUN_DIR [RUN_DIR ...]
    python launch/submit.py cancel RUN_DIR [RUN_DIR ...]

Trailing ``section.key=value`` arguments override the run config (every run of a sweep).
``--dry-run`` prints the resolved config, the parallel layout and the sbatch script, and
submits nothing. Runs that finished are skipped; runs with a job still queued or running,
or whose folder another live process holds (``lease.json``), are skipped; the others are
checked before anything is written or queued (``cqk_megatron.preflight``: data, tokenizer,
sequence length, the run folder's recorded config and checkpoints, free disk; a refusal
is one line and exit 2), then submitted, and resume from their newest complete checkpoint
(``--resume`` says otherwise, for the first attempt only). Waiting on its jobs, the launcher
exits 0 when every run finished, 2 when each unfinished run was refused by its job after
it was queued (``refused: RUN: why``: a twin submission, checkpoints that no longer
verify), else 1 (``not finished: RUN``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Run as a script, the repository root is not on sys.path; the job side imports
# ``launch.job`` by that name, so the launcher must too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from cqk_megatron.checkpoint_files import RESUME_HELP  # noqa: E402
from cqk_megatron.config import ConfigError, to_dict  # noqa: E402
from cqk_megatron.exit_codes import EXIT_REFUSED  # noqa: E402
from cqk_megatron.run_folder import CONFIG, SUBMITIT, write_config  # noqa: E402
from launch import run_dir as runs  # noqa: E402
from launch import slurm_state  # noqa: E402
from launch.plan import RunPlan, plan_run, plan_sweep  # noqa: E402
from launch.resources import CLUSTERS, load_profile, parse_key_values  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/submit.py",
        description=__doc__.split("\n\n")[0],
        epilog="Also: launch/submit.py status RUN_DIR... (job state, progress, log tail); "
        "launch/submit.py cancel RUN_DIR... (end a run's job, every process of it).",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", help="run config YAML (configs/runs/...)")
    what.add_argument(
        "--sweep", help="sweep YAML (configs/sweeps/...): one job array per resource set"
    )
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    parser.add_argument(
        "--cluster",
        choices=CLUSTERS,
        help="slurm, or local (this machine); required unless the profile names one",
    )
    parser.add_argument(
        "--profile", help="cluster profile YAML (configs/clusters/...) with defaults"
    )
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
    parser.add_argument("--dry-run", action="store_true", help="print, submit nothing")
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


# -- dry run ---------------------------------------------------------------------------------


def dry_run(plans: list[RunPlan], groups: list[list[RunPlan]], profile, cluster: str, sweep) -> str:
    from launch.executors import sbatch_script

    out = []
    for plan in plans:
        out.append(f"==> run {plan.name}: {plan.run_dir}")
        out.append(f"==> layout: {plan.layout()}")
        if sweep is None:
            out.append("==> resolved config")
            out.append(yaml.safe_dump(to_dict(plan.config), sort_keys=False).rstrip())
    if cluster == "local":
        out.append("==> local executor: no sbatch script (the tasks run on this machine)")
        return "\n".join(out) + "\n"
    for group in groups:
        folder = submitit_folder(group, sweep)
        names = ", ".join(p.name for p in group)
        kind = f"job array of {len(group)}" if sweep is not None else "job"
        out.append(f"==> sbatch script ({kind}: {names}; submitit folder {folder})")
        out.append(
            sbatch_script(
                folder, profile, group[0].resources, job_name(group, sweep), len(group)
            ).rstrip()
        )
    return "\n".join(out) + "\n"


# -- submission ------------------------------------------------------------------------------


def submitit_folder(group: list[RunPlan], sweep) -> Path:
    if sweep is None:
        return group[0].run_dir / SUBMITIT
    return Path(group[0].config.log.root) / SUBMITIT


def job_name(group: list[RunPlan], sweep) -> str:
    """A single run's name, or the sweep's ``name`` (which prefixes its runs' names)."""
    if sweep is None:
        return group[0].name
    return (yaml.safe_load(Path(sweep).read_text()) or {}).get("name") or Path(sweep).stem


def triage(plan: RunPlan) -> str | None:
    """Why ``plan`` must not be submitted now (finished, or a job of it is active)."""
    if runs.is_finished(plan.run_dir, plan.config.train.train_steps):
        return "finished"
    last = runs.last_submission(plan.run_dir)
    if last is not None:
        state = slurm_state.job_state(str(last["job_id"]), last["cluster"])
        if slurm_state.is_active(state):
            return f"job {last['job_id']} is {state}"
    return held_by(plan)


def held_by(plan: RunPlan) -> str | None:
    """Why not now, if a live process holds the run's lease (a job the launcher does not
    know of, a plain cqk-train, or a cancelled job's ranks still saving)."""
    from cqk_megatron import run_lease

    holder = run_lease.live_holder(plan.run_dir)
    return None if holder is None else f"in use by {holder.describe()}"


def preflight_refusal(plans: list[RunPlan], resume: str, dry_run: bool = False) -> str | None:
    """The first run that would fail, as one line (``None``: all can start); notes are
    printed. Reads only: nothing is written or queued before this passes."""
    from cqk_megatron.preflight import PreflightError, preflight

    for plan in plans:
        try:
            notes = preflight(plan.config, resume, hash_checkpoints=True)
        except PreflightError as error:
            if dry_run:
                print(f"note: {plan.name}: pre-flight would refuse: {error}", file=sys.stderr)
                continue
            return f"{plan.name}: {error}"
        for note in notes:
            print(f"{plan.name}: {note}", file=sys.stderr)
    return None


def cancel_local_jobs(jobs: list) -> list:
    """Ctrl-C (or SIGTERM, SIGHUP) while waiting on local jobs: they run in sessions of
    their own, so end them (each saves a checkpoint; the same command resumes them).
    Returns the jobs still running after the wait (their controllers kill what is left
    ``CANCEL_GRACE_S`` after the signal)."""
    for job in jobs:
        if not job.done():
            os.kill(int(job.job_id), signal.SIGTERM)
    for job in jobs:
        deadline = time.monotonic() + 180
        while not job.done() and time.monotonic() < deadline:
            time.sleep(0.5)
    return [job for job in jobs if not job.done()]


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


def stop_jobs(cluster: str, pending: list, how: str, code: int) -> int:
    """Ctrl-C, SIGTERM or SIGHUP (``how``) while the launcher runs: local jobs are
    cancelled (each saves a checkpoint), Slurm jobs stay queued. Returns ``code``."""
    STOPS.ignore()
    if cluster != "local":
        say(
            f"\n{how}: the jobs stay queued (follow them: submit.py status RUN; "
            "end them: submit.py cancel RUN)"
        )
        return code
    say(f"\n{how}: cancelling the local jobs (each saves a checkpoint)...")
    left = cancel_local_jobs(pending)
    if left:
        ids = ", ".join(str(job.job_id) for job in left)
        say(f"job(s) {ids} still ending; follow: submit.py status RUN", file=sys.stderr)
    else:
        say("cancelled; run the same command again to resume")
    return code


def group_by_resources(plans: list[RunPlan], profile, sweep) -> list[list[RunPlan]]:
    """Runs with identical sbatch settings share one job array."""
    from launch.executors import REPO
    from launch.resources import sbatch_parameters

    groups: dict[str, list[RunPlan]] = {}
    for plan in plans:
        key = repr(sorted(sbatch_parameters(profile, plan.resources, REPO, "").items()))
        key += str(plan.config.log.root)
        groups.setdefault(key, []).append(plan)
    return list(groups.values())


def record_submission(plan: RunPlan, job, cluster: str, array: bool, argv: list[str]) -> None:
    runs.append_event(
        plan.run_dir,
        "submitted",
        job_id=job.job_id,
        cluster=cluster,
        array=array,
        submitit_folder=str(job.paths.folder),
        resources=vars(plan.resources),
        command=["launch/submit.py", *argv],
    )
    print(f"submitted {plan.name}: job {job.job_id} ({cluster}) -> {plan.run_dir}", flush=True)


def submit_group(
    group: list[RunPlan],
    profile,
    cluster: str,
    sweep,
    argv: list[str],
    progress: Progress,
    resume: str = "auto",
) -> list:
    """Submit runs that share resources: one Slurm job, or one job array for several.
    Each submitted job is added to ``progress``."""
    from launch.executors import local_executor, slurm_executor
    from launch.job import TrainingJob, free_local_port

    resources = group[0].resources
    for plan in group:
        # A run that has started keeps its recorded config until a job really starts it.
        if not (plan.run_dir / CONFIG).exists():
            write_config(plan.run_dir, plan.config)
    relaunch = {
        "max_restarts": resources.max_restarts,
        "max_identical_failures": resources.max_identical_failures,
        "resume": resume,
    }
    if cluster == "local":
        # Every task runs on this machine: a port checked free here now beats a derived one.
        callables = [
            TrainingJob(
                to_dict(p.config), resources.max_requeues, master_port=free_local_port(), **relaunch
            )
            for p in group
        ]
    else:
        callables = [
            TrainingJob(to_dict(p.config), resources.max_requeues, **relaunch) for p in group
        ]
    if cluster == "local":
        # No job arrays here: at most array_parallelism runs at once on this machine; the
        # sweep's progress is shown while a run waits for its turn.
        jobs = []
        for plan, job_callable in zip(group, callables, strict=True):
            while sum(not job.done() for job in jobs) >= resources.array_parallelism:
                progress.poll()
                progress.pause()
            executor = local_executor(
                plan.run_dir / SUBMITIT, profile, plan.resources, plan.run_dir
            )
            with STOPS.deferred():  # a job started here is known to the cancel
                jobs.append(executor.submit(job_callable))
                record_submission(plan, jobs[-1], cluster, False, argv)
                progress.add(plan, jobs[-1])
        return jobs
    folder = submitit_folder(group, sweep)
    executor = slurm_executor(folder, profile, resources, job_name(group, sweep))
    with STOPS.deferred():  # a job queued here is recorded in its run folder
        if len(group) == 1:
            jobs = [executor.submit(callables[0])]
        else:
            with executor.batch():
                jobs = [executor.submit(c) for c in callables]
        for plan, job in zip(group, jobs, strict=True):
            record_submission(plan, job, cluster, len(group) > 1, argv)
            progress.add(plan, job)
    return jobs


# Seconds between two looks at the submitted jobs while the launcher waits. On Slurm each
# look runs scontrol (or sacct) once per pending job: 5 s keeps that load on a busy
# controller small and is soon enough for jobs that run minutes to days. Local jobs are
# this process's children: the wait also ends as soon as one of them exits (a free
# Popen.poll), so a sweep's next run starts at once. CQK_PROGRESS_POLL_S overrides it
# (the tests' Slurm jobs, which last seconds).
POLL_S = float(os.environ.get("CQK_PROGRESS_POLL_S", "5"))
LOCAL_CHECK_S = 0.1  # how often a local job's exit is looked for during that wait


class Progress:
    """Where the submitted jobs stand, read from each run's metrics (the jobs write to
    their own log files): a bar per run on a terminal (``mode="bar"``), else a line per
    run every 30 s (``"lines"``), and a line when a job ends, with the sweep's count."""

    def __init__(
        self, cluster: str, mode: str = "auto", total: int = 0, poll_s: float | None = None
    ) -> None:
        self.cluster, self.total = cluster, total  # total: runs to submit
        self.poll_s = POLL_S if poll_s is None else poll_s
        self.mode = ("bar" if sys.stdout.isatty() else "lines") if mode == "auto" else mode
        self.pending: dict[str, tuple[RunPlan, object]] = {}
        self.bars: dict = {}
        self.ended = 0
        self._last_print = 0.0

    def add(self, plan: RunPlan, job) -> None:
        self.pending[plan.name] = (plan, job)

    def _open_bars(self) -> None:
        # Opened at the first poll, not at submission: --no-wait draws none.
        from tqdm import tqdm

        for name, (plan, _) in self.pending.items():
            if name not in self.bars:
                self.bars[name] = tqdm(total=plan.config.train.train_steps, desc=name, unit="step")

    def poll(self) -> None:
        """One look at every pending job: report those that ended, show the others."""
        if self.mode == "bar":
            self._open_bars()
        for name, (plan, job) in list(self.pending.items()):
            # A local job's own process handle is the surest word on it.
            local = self.cluster == "local"
            state = job.state if local else slurm_state.job_state(job.job_id, self.cluster)
            if not slurm_state.is_active(state):
                self._update_bar(plan)
                if name in self.bars:
                    self.bars.pop(name).close()
                self.ended += 1
                count = f" [{self.ended}/{self.total} ended]" if self.total > 1 else ""
                done = runs.is_finished(plan.run_dir, plan.config.train.train_steps)
                outcome = "the run finished" if done else "the run did not finish"
                print(f"{name}: job {job.job_id} ended ({state}): {outcome}{count}", flush=True)
                del self.pending[name]
        for plan, _ in self.pending.values():
            self._update_bar(plan)
        if self.mode != "bar" and self.pending and time.monotonic() - self._last_print > 30:
            self._last_print = time.monotonic()
            for name, (plan, _) in self.pending.items():
                record = runs.latest_train_record(plan.run_dir)
                steps = plan.config.train.train_steps
                text = (
                    f"step {record['step']}/{steps}, loss {record['loss']:.4f}"
                    if record
                    else "starting"
                )
                print(f"{name}: {text}", flush=True)

    def wait(self) -> None:
        """Until every job has ended (each poll reads every pending run's metrics file)."""
        while self.pending:
            self.poll()
            if self.pending:
                self.pause()

    def pause(self) -> None:
        """Until the next look: ``poll_s``, or less once a local job has exited."""
        deadline = time.monotonic() + self.poll_s
        while (left := deadline - time.monotonic()) > 0:
            if self.cluster == "local" and any(job.done() for _, job in self.pending.values()):
                return
            time.sleep(min(LOCAL_CHECK_S, left))

    def _update_bar(self, plan: RunPlan) -> None:
        bar = self.bars.get(plan.name)
        record = runs.latest_train_record(plan.run_dir) if bar is not None else None
        if record is None:
            return
        bar.n = record["step"]
        bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")


def unfinished_exit(plans: list[RunPlan], unfinished: list[str], job_ids: dict[str, str]) -> int:
    """The launcher's exit code when runs it waited for did not finish: ``EXIT_REFUSED`` (2)
    when every one of them was refused by its job after it was queued (its folder held by
    another job, checkpoints that do not verify, bad data: what the pre-flight refuses with
    2 too, and what a resubmission as it is cannot change), else 1. Says which and why."""
    run_dirs = {p.name: p.run_dir for p in plans}
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


def pending_jobs(progress: Progress) -> list:
    return [job for _, job in progress.pending.values()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["status"]:
        from launch.status import main as status_main

        return status_main(argv[1:])
    if argv[:1] == ["cancel"]:
        from launch.cancel import main as cancel_main

        return cancel_main(argv[1:])
    args = parse_args(argv)
    try:
        profile = load_profile(args.profile)
        cluster = args.cluster or profile.cluster
        if cluster is None:
            raise ConfigError(
                "say where to run: --cluster slurm or --cluster local (or 'cluster:' in the "
                "profile); the launcher does not guess from what is installed"
            )
        resources = cli_resources(args, profile.gpus)
        if args.sweep:
            plans = plan_sweep(args.sweep, args.overrides, profile, resources, cluster)
        else:
            plans = [plan_run(args.config, args.overrides, profile, resources, cluster)]
        groups = group_by_resources(plans, profile, args.sweep)
        if args.dry_run:
            sys.stdout.write(dry_run(plans, groups, profile, cluster, args.sweep))
            preflight_refusal(plans, args.resume, dry_run=True)
            return 0
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    todos = []
    for group in groups:
        todo = []
        for plan in group:
            reason = triage(plan)
            if reason is None:
                todo.append(plan)
            else:
                print(f"skipped {plan.name}: {reason} ({plan.run_dir})", flush=True)
        todos.append(todo)
    refusal = None
    if not args.skip_preflight:
        refusal = preflight_refusal([p for todo in todos for p in todo], args.resume)
    if refusal is not None:
        print(f"error: {refusal}", file=sys.stderr)
        return 2

    submitted_plans = []
    job_ids: dict[str, str] = {}  # run name: the job this launcher submitted for it
    progress = Progress(cluster, args.progress, total=sum(map(len, todos)))
    with STOPS.installed():
        try:
            for todo in todos:
                if not todo:
                    continue
                if cluster == "slurm" and "SLURM_CONF" not in os.environ:
                    print(
                        "note: SLURM_CONF is not set; sbatch uses its default configuration",
                        file=sys.stderr,
                    )
                try:
                    jobs = submit_group(
                        todo, profile, cluster, args.sweep, argv, progress, args.resume
                    )
                except (RuntimeError, OSError) as error:  # sbatch's refusal, no srun, ...
                    names = ", ".join(p.name for p in todo)
                    print(f"error: submitting {names} failed: {error}", file=sys.stderr)
                    return 1
                submitted_plans += todo
                job_ids.update((p.name, str(j.job_id)) for p, j in zip(todo, jobs, strict=True))
            if not submitted_plans:
                print("nothing submitted")
                return (
                    0
                    if all(runs.is_finished(p.run_dir, p.config.train.train_steps) for p in plans)
                    else 1
                )
            wait = args.wait if args.wait is not None else cluster == "local"
            if wait:
                if cluster == "local":
                    print(
                        "waiting; Ctrl-C, SIGTERM or SIGHUP cancel the local jobs (each saves a "
                        "checkpoint), --no-wait leaves them running",
                        flush=True,
                    )
                progress.wait()
        except KeyboardInterrupt:
            return stop_jobs(cluster, pending_jobs(progress), "interrupted", 130)
        except StopSignal as stop:
            return stop_jobs(cluster, pending_jobs(progress), stop.name, 128 + stop.signum)
    if wait:
        unfinished = [
            p.name for p in plans if not runs.is_finished(p.run_dir, p.config.train.train_steps)
        ]
        if unfinished:
            from launch.status import describe

            for plan in plans:
                if plan.name in unfinished:
                    print(describe(plan.run_dir), file=sys.stderr)
            return unfinished_exit(plans, unfinished, job_ids)
        print("all runs finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())

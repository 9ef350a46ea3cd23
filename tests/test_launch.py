"""launch/submit.py against a real one-node Slurm cluster and submitit's local executor.

The Slurm daemons (munged, slurmctld, slurmd from Debian's packages) are started by
scripts/slurm/start.sh in a session fixture and stopped at the end if this session started
them. Without the packages the Slurm tests fail when CI is set (install them with
scripts/slurm/install.sh) and are skipped otherwise.

Every training job is the same tiny 2-rank (DP=2, gloo) run of configs/runs/tiny_cpu.yaml
on mock data, so one uninterrupted run (through the local executor) is the reference that
the Slurm run and the interrupted runs (scontrol requeue, a real time limit, a local
requeue) must reproduce bit for bit: the same loss at every step, the same final
validation loss and the same final parameters.

Measured on the 2-core development machine when it was otherwise idle: the module takes
about 2.5 minutes, most of it the time-limit test (it waits for slurmctld's 30 s clock).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from _overrides import replaced
from _slurm_bed import skip_or_fail, slurm_problem

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # launch/ is a package of the repository, not installed
    sys.path.insert(0, str(REPO))
SUBMIT = [sys.executable, str(REPO / "launch" / "submit.py")]
LOCAL_PROFILE = ["--profile", "configs/clusters/local.yaml"]
STEPS = 120
RUN = [
    "--config",
    "configs/runs/tiny_cpu.yaml",
    *LOCAL_PROFILE,
    "--tasks",
    "2",
    f"train.train_steps={STEPS}",
    "train.checkpoint.save_interval=20",
    "train.eval_interval=100",
]
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
JOB_TIMEOUT_S = 420  # generous: CI machines are shared; nothing here asserts on time
# The launcher looks at a waited-for Slurm job every 5 s by default; these jobs last
# seconds, so it looks every second (its local jobs end its wait as soon as they exit).
POLL = {"CQK_PROGRESS_POLL_S": "1"}
OUR_JOBS: list[str] = []  # cancelled at the end, so a failed test leaves the cluster free


# -- helpers ---------------------------------------------------------------------------------


def submit(*args: str, timeout: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [*SUBMIT, *args],
            cwd=REPO,
            env={**os.environ, **POLL},  # os.environ now: SLURM_CONF is set by the fixture
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as error:
        raise AssertionError(f"{error}\n{log_tails(args)}") from None


def log_tails(args: tuple[str, ...], lines: int = 30) -> str:
    """The end of every submitit log of the run named in ``args``: why a job hung."""
    settings = dict(a.split("=", 1) for a in args if a.startswith(("log.root=", "name=")))
    if set(settings) != {"log.root", "name"}:
        return "(no run folder in the arguments)"
    folder = Path(settings["log.root"], settings["name"])
    tails = []
    for log in sorted(folder.glob("submitit/**/*_log.*")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(tails) or f"(no submitit logs under {folder})"


def job_id_of(out: subprocess.CompletedProcess) -> str:
    match = re.search(r"submitted \S+: job (\S+) \(", out.stdout)
    assert match, f"no job submitted:\n{out.stdout}\n{out.stderr}"
    return match.group(1)


def status(run_dir: Path) -> str:
    return submit("status", str(run_dir), timeout=60).stdout


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def events(run_dir: Path, event: str) -> list[dict]:
    path = run_dir / "jobs.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [e for e in map(json.loads, lines) if e["event"] == event]


def steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"kind": "train"' in line for line in path.read_text().splitlines())


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True
    )
    return dict(part.split("=", 1) for part in out.stdout.split() if "=" in part)


def wait_until(
    condition,
    what: str,
    run_dir: Path | None = None,
    job_id: str | None = None,
    timeout: float = JOB_TIMEOUT_S,
) -> None:
    """Poll ``condition`` until true; fail early (with the run's status) if the job ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if job_id is not None and job_fields(job_id).get("JobState") in (
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
        ):
            if condition():
                return
            break
        time.sleep(0.25)
    detail = status(run_dir) if run_dir is not None else ""
    pytest.fail(f"gave up waiting for {what}\n{detail}")


def wait_for_finished_job(run_dir: Path, job_id: str) -> None:
    wait_until(
        lambda: (
            job_fields(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
        ),
        f"job {job_id} to end",
        run_dir,
        job_id,
    )
    assert job_fields(job_id)["JobState"] == "COMPLETED", status(run_dir)


def model_state(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / f"iter_{step:07d}" / "engine" / "pp0" / "ds"
    return torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every step's loss, the final validation loss and the final weights, bit for bit."""
    losses = {r["step"]: r["loss"] for r in records(run_dir, "train")}
    expected = {r["step"]: r["loss"] for r in records(reference, "train")}
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses == expected
    assert records(run_dir, "valid")[-1]["val_loss"] == records(reference, "valid")[-1]["val_loss"]
    assert records(run_dir, "summary")[-1]["steps"] == STEPS
    ours, theirs = model_state(run_dir, STEPS), model_state(reference, STEPS)
    tensors = [name for name, value in theirs.items() if isinstance(value, torch.Tensor)]
    assert len(tensors) > 10 and ours.keys() == theirs.keys()
    for name in tensors:
        assert torch.equal(ours[name], theirs[name]), name


# -- the cluster -----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def slurm():
    """SLURM_CONF of a running one-node cluster (started here if it is not running)."""
    problem = slurm_problem(
        SLURM_TOOLS,
        root_reason="scripts/slurm/start.sh must run as root (slurmd starts jobs as their users)",
    )
    if problem:
        skip_or_fail(problem)
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm" / "start.sh")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"scripts/slurm/start.sh failed:\n{out.stdout}\n{out.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", out.stdout).group(1)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    yield conf
    if "started" in out.stderr:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "stop.sh")], timeout=120)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


LOCAL_REQUEUED = [
    *RUN,
    "--cluster",
    "local",
    "name=local-requeued",
    # stops the run as a signal would (checkpoint, exit 75); rank 0 then exits with
    # submitit's local requeue code and the local controller restarts it
    "train.resilience.exit_after_steps=30",
]


def start_submit(root: Path, name: str, *args: str) -> subprocess.Popen:
    """``submit.py *args`` in the background (its own session), its output in a file."""
    with (root / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [*SUBMIT, *args, f"log.root={root}"],
            cwd=REPO,
            env={**os.environ, **POLL},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish_submit(root: Path, name: str, process: subprocess.Popen) -> tuple[int, str]:
    """The launcher's exit code and output, once it has ended (killed, with its local
    jobs, past ``JOB_TIMEOUT_S``)."""
    try:
        process.wait(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        end_launcher(root, name, process)
    output = (root / f"{name}.log").read_text()
    assert process.returncode is not None and process.returncode >= 0, output[-3000:]
    return process.returncode, output


def end_launcher(root: Path, name: str, process: subprocess.Popen) -> None:
    """Kill a launcher still running, and its local jobs (each in a session of its own)."""
    if process.poll() is None:
        _kill_session(process.pid)
        process.wait()
        for started in events(root / name, "submitted"):
            _kill_session(int(started["job_id"]))


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture(scope="module")
def local_requeued(root):
    """The local executor's requeue (its test is at the end), started with the
    reference: the two local jobs share the machine instead of running one after the
    other. Yields the launcher's process; killed with its job if it outlives the module."""
    process = start_submit(root, "local-requeued", *LOCAL_REQUEUED)
    yield process
    end_launcher(root, "local-requeued", process)  # its test did not run (or failed first)


@pytest.fixture(scope="module")
def reference(root, local_requeued) -> Path:
    """The uninterrupted run, through submitit's local executor (no Slurm needed)."""
    code, output = finish_submit(
        root,
        "reference",
        start_submit(root, "reference", *RUN, "--cluster", "local", "name=reference"),
    )
    assert code == 0, output[-3000:]
    return root / "reference"


@pytest.fixture(scope="module", autouse=True)
def cancel_leftovers():
    yield
    if OUR_JOBS and shutil.which("scancel"):
        subprocess.run(["scancel", *OUR_JOBS], capture_output=True)


# -- Slurm -----------------------------------------------------------------------------------


def test_two_task_job_on_slurm_writes_metrics_checkpoints_and_records(slurm, root, reference):
    out = submit(*RUN, "--cluster", "slurm", f"log.root={root}", "name=on-slurm", "--wait")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    job_id = job_id_of(out)
    OUR_JOBS.append(job_id)
    run_dir = root / "on-slurm"
    assert f"job {job_id} ended (COMPLETED)" in out.stdout
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    final = run_dir / "checkpoints" / f"iter_{STEPS:07d}"
    assert (final / "manifest.json").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == final.name
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["train_steps"] == STEPS
    # The launcher's and the job's records: job id, rendezvous, Slurm environment, logs.
    (submitted,) = events(run_dir, "submitted")
    (started,) = events(run_dir, "started")
    (finished,) = events(run_dir, "finished")
    assert submitted["job_id"] == started["job_id"] == finished["job_id"] == job_id
    assert submitted["cluster"] == "slurm" and finished["exit"] == 0
    assert started["attempt"] == 1 and started["slurm"]["SLURM_JOB_ID"] == job_id
    assert started["slurm"]["SLURM_NTASKS"] == "2"
    rendezvous = started["rendezvous"]
    assert rendezvous["WORLD_SIZE"] == "2" and rendezvous["RANK"] == "0"
    assert rendezvous["MASTER_PORT"] == str(20000 + int(job_id) % 12000)  # from the job id
    assert rendezvous["MASTER_ADDR"] == started["hosts"][0]
    for task in (0, 1):  # submitit's logs, one pair per task
        assert (run_dir / "submitit" / f"{job_id}_{task}_log.out").is_file()
    assert f"step {STEPS:>6}" in Path(started["log"]["stdout"]).read_text()
    script = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --signal=USR1@30" in script
    report = status(run_dir)
    assert f"job        {job_id} (slurm): COMPLETED, attempt 1" in report
    assert f"finished   yes: {STEPS} steps" in report
    assert f"progress   step {STEPS}, loss " in report and "log tail" in report
    # The same function under Slurm and under the local executor: the same run.
    assert_same_run(run_dir, reference)
    # A finished run is not submitted again.
    again = submit(*RUN, "--cluster", "slurm", f"log.root={root}", "name=on-slurm")
    assert again.returncode == 0 and "skipped on-slurm: finished" in again.stdout
    assert len(events(run_dir, "submitted")) == 1


def test_scontrol_requeue_checkpoints_requeues_and_ends_like_the_reference(slurm, root, reference):
    out = submit(*RUN, "--cluster", "slurm", f"log.root={root}", "name=requeued")
    job_id = job_id_of(out)
    OUR_JOBS.append(job_id)
    run_dir = root / "requeued"
    # Past the periodic save at step 20: the save on SIGTERM is not the process's first.
    wait_until(lambda: steps_done(run_dir) >= 25, "step 25", run_dir, job_id)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    wait_for_finished_job(run_dir, job_id)
    (stopped,) = events(run_dir, "stopped")
    assert stopped["exit"] == 75 and stopped["requeue"].startswith("left to Slurm")
    assert [e["attempt"] for e in events(run_dir, "started")] == [1, 2]
    log = Path(events(run_dir, "started")[-1]["log"]["stdout"]).read_text()
    stop_step = int(re.search(r"stopping at step (\d+) \(SIGTERM\)", log).group(1))
    assert 25 <= stop_step < STEPS
    assert f"resumed from {run_dir}/checkpoints/iter_{stop_step:07d} at step {stop_step}" in log
    assert_same_run(run_dir, reference)


def _time_limit_ticks(log_file: Path) -> list[float]:
    """When this slurmctld checked time limits (every 30 s from its start; logged at
    debug2). Lines before its last start belong to an earlier one, with another phase."""
    ticks = []
    for line in log_file.read_text(errors="replace").splitlines():
        if "Running as primary controller" in line:
            ticks = []
        elif "Testing job time limits" in line:
            ticks.append(datetime.fromisoformat(line[1 : line.index("]")]).timestamp())
    return ticks


def _seconds(slurm_duration: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, clock = slurm_duration.rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


@pytest.mark.slow
def test_time_limit_warning_checkpoints_requeues_and_ends_like_the_reference(
    slurm, root, reference
):
    """A real time limit: Slurm sends USR1 signal_delay_s before it (--signal=USR1@90), the
    job checkpoints and requeues itself, and the requeued job finishes the run.

    slurmctld looks at time limits every 30 s, so when the signal comes is vague by 30 s.
    To make it come mid-run, the test suspends the job at step 25, shortens its limit to a
    whole minute that puts the signal due, and resumes it 1.5 s before slurmctld's next
    check (read from its log): the signal comes at that check. The requeued job gets its
    10 minutes back (else it would be warned again while starting up).
    """
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True)
    ctld_log = Path(re.search(r"SlurmctldLogFile\s*=\s*(\S+)", config.stdout).group(1))
    out = submit(
        *RUN,
        "--cluster",
        "slurm",
        f"log.root={root}",
        "name=time-limited",
        "--time",
        "10",
        "--signal-delay",
        "90",
    )
    job_id = job_id_of(out)
    OUR_JOBS.append(job_id)
    run_dir = root / "time-limited"
    wait_until(lambda: steps_done(run_dir) >= 25, "step 25", run_dir, job_id)
    subprocess.run(["scontrol", "suspend", job_id], check=True)
    ran_s = _seconds(job_fields(job_id)["RunTime"])  # frozen while suspended
    lead_s = 1.5
    # On resume the job ends at resume + limit - ran. The limit puts that end more than
    # 30 s after the next check (no kill before the requeue) and at most 90 + 30 s after
    # it (USR1@90 due at that check: slurmctld sends it 30 s early at worst).
    limit_min = math.ceil((ran_s + lead_s + 32) / 60)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit_min}"], check=True)
    wait_until(
        lambda: _time_limit_ticks(ctld_log), "slurmctld's first time-limit check", timeout=40
    )
    next_check = _time_limit_ticks(ctld_log)[-1]
    while next_check - lead_s < time.time() + 0.5:
        next_check += 30
    time.sleep(next_check - lead_s - time.time())
    subprocess.run(["scontrol", "resume", job_id], check=True)
    wait_until(lambda: events(run_dir, "stopped"), "the stop on USR1", run_dir, job_id, timeout=120)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=10"], check=True)
    wait_for_finished_job(run_dir, job_id)

    (stopped,) = events(run_dir, "stopped")
    assert stopped["exit"] == 75 and stopped["requeue"] == "requeued"  # by the job itself
    assert f"warning signal 10 to JobId={job_id}" in ctld_log.read_text(errors="replace")
    assert [e["attempt"] for e in events(run_dir, "started")] == [1, 2]
    log = Path(events(run_dir, "started")[-1]["log"]["stdout"]).read_text()
    stop_step = int(re.search(r"stopping at step (\d+) \(SIGUSR1\)", log).group(1))
    assert 25 <= stop_step < STEPS
    assert f"at step {stop_step} (exactly)" in log
    assert_same_run(run_dir, reference)


def test_sweep_goes_out_as_a_job_array_and_resubmitting_skips_finished_runs(slurm, root):
    sweep = root / "two_runs.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "name": "sw",
                "variants": ["standard", "coupled"],
                "seeds": [0],
                "common": {"log.wandb_mode": "disabled", "train.eval_iters": 1},
                "schedule": {"warmup_fraction": 0.1, "min_lr_ratio": 0.1, "eval_fraction": 0.5},
                "sizes": {
                    "tiny": {
                        "model": "runs/tiny_cpu.yaml",
                        "tokens": 20 * 8 * 32,
                        "lr": 3e-3,
                        "global_batch_size": 8,
                        "micro_batch_size": 2,
                        "layout": {
                            "tensor_parallel": 1,
                            "pipeline_parallel": 1,
                            "nodes": 1,
                            "gpus_per_node": 1,
                        },
                    }
                },
            }
        )
    )
    command = [
        "--sweep",
        str(sweep),
        *LOCAL_PROFILE,
        "--cluster",
        "slurm",
        "--array-parallelism",
        "2",
        f"log.root={root}",
    ]
    out = submit(*command, "--wait")
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    names = ["sw-tiny-standard-s0", "sw-tiny-coupled-s0"]
    ids = [events(root / name, "submitted")[0]["job_id"] for name in names]
    array_id = ids[0].split("_")[0]
    assert ids == [f"{array_id}_0", f"{array_id}_1"]  # one array, one task per run
    script = (root / "submitit" / f"{array_id}_submission.sh").read_text()
    assert "#SBATCH --array=0-1%2" in script and "#SBATCH --ntasks-per-node=1" in script
    for name in names:
        assert records(root / name, "summary")[-1]["steps"] == 20
        assert yaml.safe_load((root / name / "config.yaml").read_text())["name"] == name
    assert (
        records(root / names[0], "train")[-1]["loss"]
        != records(root / names[1], "train")[-1]["loss"]
    )

    assert f"job        {ids[1]} (slurm): COMPLETED" in status(root / names[1])

    again = submit(*command)
    assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
    for name in names:
        assert f"skipped {name}: finished" in again.stdout
        assert len(events(root / name, "submitted")) == 1
    assert "nothing submitted" in again.stdout


def test_a_run_with_a_queued_job_is_not_submitted_twice(slurm, root):
    held = subprocess.run(
        ["sbatch", "--hold", "--parsable", "--wrap", "true", "-o", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    )
    job_id = held.stdout.strip().split(";")[0]
    try:
        run_dir = root / "queued"
        run_dir.mkdir()
        (run_dir / "jobs.jsonl").write_text(
            json.dumps({"event": "submitted", "job_id": job_id, "cluster": "slurm", "time": 0})
            + "\n"
        )
        out = submit(*RUN, "--cluster", "slurm", f"log.root={root}", "name=queued")
        assert out.returncode == 1
        assert f"skipped queued: job {job_id} is PENDING" in out.stdout
        assert f"job        {job_id} (slurm): PENDING, not started yet" in status(run_dir)
    finally:
        subprocess.run(["scancel", job_id], check=True)


def test_cancel_ends_a_slurm_job_after_its_ranks_save_and_frees_the_run(slurm, root):
    run = replaced(RUN, "train.train_steps=100000")
    out = submit(*run, "--cluster", "slurm", f"log.root={root}", "name=cancelled")
    job_id = job_id_of(out)
    OUR_JOBS.append(job_id)
    run_dir = root / "cancelled"
    wait_until(lambda: steps_done(run_dir) >= 3, "step 3", run_dir, job_id)
    assert json.loads((run_dir / "lease.json").read_text())["job_id"] == job_id
    out = submit("cancel", str(run_dir), timeout=300)
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    assert f"scancel {job_id}" in out.stdout and "the run is free" in out.stdout
    assert not (run_dir / "lease.json").exists()
    (stopped,) = events(run_dir, "stopped")  # SIGTERM: the ranks saved, Slurm ends the job
    assert stopped["exit"] == 75 and stopped["requeue"].startswith("left to Slurm")
    last = records(run_dir, "train")[-1]["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"iter_{last:07d}"
    assert not slurm_state_is_active(job_id)


def slurm_state_is_active(job_id: str) -> bool:
    from launch.backends import get_backend, is_active

    return is_active(get_backend("slurm").job_state(job_id))


# -- no cluster needed ----------------------------------------------------------------------


def test_dry_run_of_the_1b_run_on_4x8_gpus_prints_the_expected_sbatch_script(tmp_path):
    out = submit(
        "--config",
        "configs/runs/1b_4x8.yaml",
        "--profile",
        "configs/clusters/example_h100.yaml",
        "--cluster",
        "slurm",
        "--dry-run",
    )
    # Its data is not on this machine: the verdict comes first, and the exit is the
    # refusal's, as the submission's would be; what would be submitted follows.
    assert out.returncode == 2, out.stderr
    text = out.stdout
    first = text.splitlines()[0]
    assert first.startswith("pre-flight: would be refused: dataset '/shared/"), first
    assert "==> layout: TP 1 x PP 1 x DP 32 = world size 32 (4 nodes x 8 GPUs" in text
    resolved = yaml.safe_load(text.split("==> resolved config\n")[1].split("==> ")[0])
    assert (
        resolved["model"]["hidden_size"] == 2048
        and resolved["attention"]["coupling"] == "hamiltonian"
    )
    script = text.split("==> sbatch script")[1].split("\n", 1)[1]
    script = script.replace(str(REPO), "<REPO>")
    expected = (REPO / "tests" / "expected" / "sbatch_1b_4x8.sh").read_text()
    assert script == expected
    assert "submitted" not in text
    # Command-line options win over the profile; any sbatch option passes through.
    out = submit(
        "--config",
        "configs/runs/1b_4x8.yaml",
        "--profile",
        "configs/clusters/example_h100.yaml",
        "--partition",
        "debug",
        "--time",
        "2:00:00",
        "--slurm-arg",
        "mail-type=END",
        "--dry-run",
    )
    for line in ("#SBATCH --partition=debug", "#SBATCH --time=120", "#SBATCH --mail-type=END"):
        assert line in out.stdout


def test_a_dry_run_that_can_start_says_so_first_and_exits_0(tmp_path):
    out = submit(*RUN, "--cluster", "slurm", f"log.root={tmp_path}", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "pre-flight: can start"
    assert "==> sbatch script" in out.stdout and not tmp_path.joinpath("tiny-cpu").exists()


def test_a_sweeps_dry_run_is_a_line_per_run_and_each_refusal_once(tmp_path):
    """The ladder (96 runs) names no data: one headline, the refusal once with its count,
    one line per run, a line on the jobs; exit 2 as its submission would."""
    out = submit(
        "--sweep",
        "configs/sweeps/ladder.yaml",
        "--profile",
        "configs/clusters/example_h100.yaml",
        f"log.root={tmp_path}",
        "--dry-run",
    )
    assert out.returncode == 2, out.stderr
    lines = out.stdout.splitlines()
    runs = [line for line in lines if line.startswith("ladder-")]
    assert (
        lines[0]
        == f"pre-flight: {len(runs)} runs: 0 can start, {len(runs)} would be refused, 0 skipped"
    )
    assert len(runs) == 96 and all(line.endswith("refused [1]") for line in runs)
    assert lines[1].startswith("refusal [1] (96 runs): data.prefixes is empty")
    assert len(lines) == len(runs) + 3, lines[len(runs) + 2 :]
    assert out.stdout.count("data.prefixes is empty") == 1 and out.stderr == ""


# A site's profile: srun flags and a container (pyxis/enroot or Apptainer).
CONTAINERS = {
    "pyxis": "container: {image: 'nvcr.io#nvidia/pytorch:25.01-py3', mounts: ['/shared:/shared']}",
    "apptainer": "container: {runtime: apptainer, image: /shared/cqk.sif, mounts: [/shared]}",
}


def site_profile(folder: Path, container: str) -> Path:
    path = folder / f"site-{container}.yaml"
    local = (REPO / "configs" / "clusters" / "local.yaml").read_text()
    extra = f"cluster: slurm\nsrun_args: ['--cpu-bind=cores']\n{CONTAINERS[container]}\n"
    path.write_text(local + extra)
    return path


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_profiles_take_srun_arguments_and_a_container(container, tmp_path):
    profile = site_profile(tmp_path, container)
    out = submit(
        "--config",
        "configs/runs/tiny_cpu.yaml",
        "--profile",
        str(profile),
        f"log.root={tmp_path}",
        "--dry-run",
    )
    assert out.returncode == 0, out.stderr
    (srun,) = [line for line in out.stdout.splitlines() if "submitit.core._submit" in line]
    assert "--cpu-bind=cores" in srun
    if container == "pyxis":
        assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in srun
        assert "--container-mounts=/shared:/shared" in srun
        (teardown,) = [line for line in out.stdout.splitlines() if "after-srun" in line]
        assert teardown.startswith("srun --nodes=1 --ntasks=1 '--container-image=nvcr.io#")
    else:
        assert " apptainer exec --bind /shared /shared/cqk.sif python -u -m submitit" in srun
    bad = tmp_path / "bad.yaml"
    bad.write_text("container: {runtime: docker, image: x}\n")
    out = submit(
        "--config",
        "configs/runs/tiny_cpu.yaml",
        "--profile",
        str(bad),
        "--cluster",
        "slurm",
        "--dry-run",
    )
    assert out.returncode == 2 and "container.runtime='docker' is unknown" in out.stderr


@pytest.mark.parametrize("container", sorted(CONTAINERS))
def test_emit_sbatch_writes_a_plain_script_that_slurm_accepts(container, slurm, tmp_path):
    profile = site_profile(tmp_path, container)
    jobs = tmp_path / "jobs"
    out = submit(
        "--config",
        "configs/runs/tiny_cpu.yaml",
        "--profile",
        str(profile),
        f"log.root={tmp_path}/runs",
        "--emit-sbatch",
        str(jobs),
    )
    assert out.returncode == 0, out.stderr
    script = jobs / "tiny-cpu.sbatch"
    assert f"wrote {script}" in out.stdout and not (tmp_path / "runs").exists()
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --signal=USR1@30" in text
    assert f"-m cqk_megatron.train --config {jobs / 'tiny-cpu.yaml'}" in text
    assert "submitit" not in text.replace("SUBMITIT_PREEMPT_SIGNAL", "")
    config = yaml.safe_load((jobs / "tiny-cpu.yaml").read_text())
    assert config["log"]["root"] == f"{tmp_path}/runs" and config["name"] == "tiny-cpu"
    checked = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
    assert "to start at" in checked.stderr  # a verdict, and nothing queued


def test_an_impossible_layout_is_refused_before_anything_is_submitted(tmp_path):
    out = submit(
        *RUN,
        "--cluster",
        "slurm",
        "--tasks",
        "3",
        "parallel.tensor_parallel=2",
        f"log.root={tmp_path}/runs",
    )
    assert out.returncode == 2
    assert (
        "world size 3 is not divisible by parallel.tensor_parallel=2 x "
        "parallel.pipeline_parallel=1" in out.stderr
    )
    assert "submitted" not in out.stdout and not (tmp_path / "runs").exists()
    # The layout a config pins must match the job's size, and where to run is never guessed.
    out = submit(
        "--config",
        "configs/runs/1b_4x8.yaml",
        "--profile",
        "configs/clusters/example_h100.yaml",
        "--nodes",
        "2",
        "--dry-run",
    )
    assert out.returncode == 2 and "parallel.world_size=32 but the job has 16 tasks" in out.stderr
    out = submit(*RUN, f"log.root={tmp_path}/runs")
    assert out.returncode == 2 and "--cluster slurm or --cluster local" in out.stderr


def test_the_same_job_through_the_local_executor(reference):
    (started,) = events(reference, "started")
    assert started["cluster"] == "local" and started["rendezvous"]["WORLD_SIZE"] == "2"
    # a local job's port is chosen free by the launcher, below the ephemeral range
    assert 20000 <= int(started["rendezvous"]["MASTER_PORT"]) < 32000
    assert events(reference, "finished")[0]["exit"] == 0
    assert [r["step"] for r in records(reference, "train")] == list(range(1, STEPS + 1))
    assert records(reference, "summary")[-1]["steps"] == STEPS
    assert (reference / "checkpoints" / f"iter_{STEPS:07d}" / "manifest.json").is_file()
    for task in (0, 1):
        assert (reference / "submitit" / f"{started['job_id']}_{task}_log.out").is_file()
    report = status(reference)
    assert f"job        {started['job_id']} (local): FINISHED, attempt 1" in report
    assert f"finished   yes: {STEPS} steps" in report


def test_requeues_are_bounded(tmp_path, monkeypatch):
    import launch.local_job
    from cqk_megatron.errors import EXIT_REQUEUE
    from launch.job import TrainingJob

    job = TrainingJob(config={}, max_requeues=2)
    outcome, code = job._requeue(SimpleNamespace(cluster="slurm"), attempt=3)
    assert outcome == "refused: requeued 2 times already (max_requeues)" and code == EXIT_REQUEUE
    local = SimpleNamespace(cluster="local", job_id="4321", paths=SimpleNamespace(folder=tmp_path))
    # this test's process is not a local controller: the task would be an orphan
    outcome, code = job._requeue(local, attempt=2)
    assert outcome.startswith("not requeued: the job's controller (job 4321) is gone")
    monkeypatch.setattr(launch.local_job, "is_controller", lambda pid: True)
    outcome, code = job._requeue(local, attempt=2)
    assert outcome == "requeued" and code == 144  # submitit's local controller restarts it
    (tmp_path / "4321.cancelled").touch()  # launch.local_job's controller was cancelled
    outcome, code = job._requeue(local, attempt=2)
    assert outcome == "cancelled: not requeued" and code == EXIT_REQUEUE


def test_time_syntax_agrees_with_slurm_and_ports_stay_below_the_ephemeral_range():
    from cqk_megatron.parallel.ports import rendezvous_port
    from launch.resources import time_minutes

    assert [time_minutes(t) for t in ("90", "1:30", "01:30:00", "2-00:00:00", "1-2")] == [
        90,
        2,
        90,
        2880,
        1560,
    ]
    assert rendezvous_port("45") == 20045 and rendezvous_port("12045") == 20045
    # below Linux's ephemeral range, where outgoing connections and gloo's listeners live
    assert all(20000 <= rendezvous_port(str(i)) < 32768 for i in range(0, 70000, 7))


def test_plain_srun_derives_the_same_port_as_the_launcher():
    from cqk_megatron.parallel.ports import rendezvous_port
    from cqk_megatron.parallel.process_groups import discover

    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "31337"}
    found = discover({**env, "SLURM_JOB_NODELIST": "node[3-4]"})
    assert (found.rank, found.world_size, found.master_addr) == (1, 2, "node3")
    assert found.master_port == rendezvous_port("31337") == 27337


def test_a_local_job_gets_a_port_that_is_free_and_not_handed_out_twice():
    import socket

    from launch.backends.local import free_local_port

    with socket.socket() as busy:
        for port in range(27000, 28000):  # occupy a port of the rendezvous range
            try:
                busy.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        busy.listen()
        first = free_local_port(port)
        assert first != port and 20000 <= first < 32000
    second = free_local_port(first)
    assert second != first  # two local jobs submitted together never share a port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", second))  # and it is free


def test_the_local_executor_requeues_a_stopped_run_and_it_ends_like_the_reference(
    root, reference, local_requeued
):
    # LOCAL_REQUEUED: train.resilience.exit_after_steps=30 stops the run (checkpoint, exit 75) and
    # the local controller restarts it. Started with the reference (the fixture).
    code, output = finish_submit(root, "local-requeued", local_requeued)
    assert code == 0, output[-3000:]
    run_dir = root / "local-requeued"
    (stopped,) = events(run_dir, "stopped")
    assert stopped["exit"] == 75 and stopped["requeue"] == "requeued"
    assert [e["attempt"] for e in events(run_dir, "started")] == [1, 2]
    assert_same_run(run_dir, reference)


def test_the_launcher_wait_ends_when_a_local_job_exits_and_lasts_poll_s_on_slurm(monkeypatch):
    """Between two looks at its jobs the launcher waits ``poll_s`` (Slurm: each look asks
    the controller), but a local job's exit ends that wait at once (the next run of a
    sweep starts then, not up to 5 s later). On a fake clock: nothing here is timed."""
    from launch import jobs as launcher
    from launch.backends import get_backend

    clock = [0.0]
    monkeypatch.setattr(launcher.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(launcher.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    class Job:
        def __init__(self, exits_at: float) -> None:
            self.exits_at = exits_at

        def done(self) -> bool:
            return clock[0] >= self.exits_at

    assert launcher.POLL_S == 5.0 or "CQK_PROGRESS_POLL_S" in os.environ  # the default
    for cluster, low, high in (("local", 1.0, 1.0 + launcher.LOCAL_CHECK_S), ("slurm", 5, 5)):
        clock[0] = 0.0
        progress = launcher.Progress(get_backend(cluster), "lines", poll_s=5.0)
        progress.pending = {"a": (None, Job(exits_at=1.0)), "b": (None, Job(exits_at=60.0))}
        progress.pause()
        assert low - 1e-6 <= clock[0] <= high + 1e-6, (cluster, clock[0])


def test_a_sigterm_during_start_up_reaches_the_training_loop_once_it_listens():
    """submitit drops a SIGTERM ("Bypassing signal SIGTERM"): one that comes before the
    training loop has its handler (a cancel during start-up) is kept and sent again."""
    from launch.job import keep_early_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    got: list[int] = []
    try:
        keep_early_sigterm(check_s=0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # start-up: kept (this process goes on)
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))  # the loop's
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)

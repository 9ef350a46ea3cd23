"""One job per run folder: a lease file that the running job holds and renews.

``RUN/lease.json`` names its holder: host, PID (and the PID's start time, so a reused PID
is not mistaken for it), boot id, job id, and a heartbeat that rank 0 renews every
``CQK_LEASE_HEARTBEAT_S`` seconds (30). A second job on the same run refuses to start
and names the holder. A holder is dead, and its lease is taken over, when

- it ran on this host (same boot) and its process is gone, or
- it ran elsewhere and its heartbeat is older than ``CQK_LEASE_TTL_S`` seconds (300):
  another node's processes cannot be seen from here, and file locks (``flock``) are not
  reliable across nodes on network filesystems, so the heartbeat is the evidence.

The lease file is made complete and then hard-linked into place (``link`` is atomic and
fails if the name exists, on local and NFS filesystems alike); a stale lease is replaced
under a ``lease.json.takeover`` file created exclusively, so two contenders never both
win. Torch-free: the launcher reads leases before it queues a job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from cqk_megatron.errors import Refusal
from cqk_megatron.run.unwritable import no_space_error

LEASE = "lease.json"  # in the run folder (run/folder.py lists the folder's files)
TAKEOVER_STALE_S = 60.0  # a takeover file older than this was left by a dead contender


def heartbeat_s() -> float:
    return float(os.environ.get("CQK_LEASE_HEARTBEAT_S", "30"))


def ttl_s() -> float:
    return float(os.environ.get("CQK_LEASE_TTL_S", "300"))


class LeaseHeld(Refusal, RuntimeError):
    """The run folder is held by another live job; the message names it."""


class LeaseLost(RuntimeError):
    """Another job took this run's lease (this one was judged dead): stop writing."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _job_id() -> str | None:
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        if os.environ.get(name):
            if name == "SLURM_ARRAY_JOB_ID":
                return f"{os.environ[name]}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
            return os.environ[name]
    return None


@dataclass
class Holder:
    host: str
    pid: int
    token: str
    started: float
    heartbeat: float
    boot_id: str = ""
    pid_start: str | None = None
    job_id: str | None = None
    command: str = ""

    @classmethod
    def me(cls) -> Holder:
        now = time.time()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            token=uuid.uuid4().hex,
            started=now,
            heartbeat=now,
            boot_id=_boot_id(),
            pid_start=_process_start(os.getpid()),
            job_id=_job_id(),
            command=" ".join(sys.argv)[:300],
        )

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        job = f"job {self.job_id}, " if self.job_id else ""
        return (
            f"{job}host {self.host}, pid {self.pid}, last heartbeat "
            f"{max(0.0, now - self.heartbeat):.0f} s ago"
        )

    def alive(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if self.host == socket.gethostname() and (not self.boot_id or self.boot_id == _boot_id()):
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass  # another user's live process
            return self.pid_start is None or _process_start(self.pid) == self.pid_start
        if self.host == socket.gethostname():
            return False  # this host rebooted since
        return now - self.heartbeat < ttl_s()


def read_holder(run_dir: Path) -> Holder | None:
    """The lease's holder; a file that cannot be read is reported as a dead holder."""
    path = Path(run_dir) / LEASE
    try:
        data = json.loads(path.read_text())
        return Holder(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return Holder(host="?", pid=0, token="unreadable", started=0.0, heartbeat=0.0)


def live_holder(run_dir: Path) -> Holder | None:
    """Who holds the run now, if it is alive."""
    holder = read_holder(run_dir)
    return holder if holder is not None and holder.alive() else None


def held_message(run_dir: Path, holder: Holder) -> str:
    return (
        f"run folder {run_dir} is in use by another job ({holder.describe()}); one job per "
        "run: wait for it to end, cancel it (cqk cancel "
        f"{run_dir}), or train under another name=..."
    )


def _write_record(path: Path, holder: Holder) -> None:
    with open(path, "w") as handle:
        handle.write(json.dumps(asdict(holder)))
        handle.flush()
        os.fsync(handle.fileno())


def _place(temporary: Path, path: Path) -> None:
    """Put ``temporary`` at ``path`` if nothing is there; ``FileExistsError`` otherwise."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise
    except OSError:  # a filesystem without hard links: exclusive create instead
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(temporary.read_text())


class Lease:
    """This process's lease on a run folder; renewed by a daemon thread until released."""

    def __init__(self, run_dir: Path, holder: Holder) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEASE
        self.holder = holder
        self.lost_to: Holder | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(heartbeat_s()):
            current = read_holder(self.run_dir)
            if current is None or current.token != self.holder.token:
                self.lost_to = current
                print(
                    f"error: this job lost its lease on {self.run_dir}"
                    + (f" to {current.describe()}" if current else "")
                    + "; it stops writing checkpoints",
                    file=sys.stderr,
                    flush=True,
                )
                return
            self.holder.heartbeat = time.time()
            temporary = self.path.with_name(f".{LEASE}.{self.holder.token}.beat")
            try:
                _write_record(temporary, self.holder)
                os.replace(temporary, self.path)
            except OSError as error:  # a full disk must not kill the job: try next time
                temporary.unlink(missing_ok=True)
                print(f"warning: lease heartbeat failed ({error})", file=sys.stderr)

    def check(self) -> None:
        """Raise ``LeaseLost`` if another job holds the run now."""
        current = read_holder(self.run_dir)
        if self.lost_to is not None or current is None or current.token != self.holder.token:
            who = current.describe() if current is not None else "nobody (the file is gone)"
            raise LeaseLost(
                f"this job no longer holds {self.path} (it is held by {who}); it was judged "
                "dead and the run was taken over, so this job stops without writing more"
            )

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        current = read_holder(self.run_dir)
        if current is not None and current.token == self.holder.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire(run_dir: Path) -> Lease:
    """Take the run's lease, or raise ``LeaseHeld`` naming its live holder (or
    ``NoSpaceError`` where the filesystem refuses the lease's file: full, read-only)."""
    run_dir = Path(run_dir)
    path = run_dir / LEASE
    me = Holder.me()
    temporary = run_dir / f".{LEASE}.{me.token}.new"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_record(temporary, me)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise no_space_error(path, error) from error
    try:
        for _ in range(5):
            try:
                _place(temporary, path)
                return Lease(run_dir, me)
            except FileExistsError:
                pass
            holder = read_holder(run_dir)
            if holder is None:
                continue  # released meanwhile: try again
            if holder.alive():
                raise LeaseHeld(held_message(run_dir, holder))
            if _take_over(run_dir, holder, temporary):
                return Lease(run_dir, me)
        raise LeaseHeld(f"could not take the lease {path}: other jobs keep taking it")
    finally:
        temporary.unlink(missing_ok=True)


def _take_over(run_dir: Path, stale: Holder, temporary: Path) -> bool:
    """Replace the ``stale`` lease with ours, unless another contender got there first."""
    mutex = run_dir / f"{LEASE}.takeover"
    try:
        os.close(os.open(mutex, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        try:
            if time.time() - mutex.stat().st_mtime > TAKEOVER_STALE_S:
                mutex.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        return False
    try:
        current = read_holder(run_dir)
        if current is not None and current.token != stale.token:
            return False  # someone took it (or it was renewed) meanwhile
        os.replace(temporary, run_dir / LEASE)
        print(
            f"note: took over the lease of {run_dir} from a dead holder ({stale.describe()})",
            file=sys.stderr,
        )
        return True
    finally:
        mutex.unlink(missing_ok=True)

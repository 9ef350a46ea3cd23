"""The write stage of an asynchronous save (``async_save``): a child process, forked from
the training thread once the save is staged in host memory, writes the files and hashes
them while training goes on.

Why a process forked per save (as Megatron-Core's ``TemporalAsyncCaller`` does) and not
a thread, nor a persistent spawned worker (Megatron's ``PersistentAsyncCaller``, torch
DCP's process checkpointer):

- A thread shares the interpreter lock with training. ``torch.save`` releases it while
  it copies a storage's bytes but holds it between them, as do pickling and the Python
  of Megatron's writer and of the hashing; a writer preempted while it holds the lock
  holds up the training thread until it runs again: tens to hundreds of milliseconds on
  a loaded CPU, in some saves and not others (``tests/test_async_stall.py``).
- A forked child sees the staged host copies as they are, with nothing pickled or
  copied again: the staged objects (Megatron's write buckets, the engine's captured
  ``torch.save`` calls, with their storage sharing) are written as a synchronous save
  writes them, the same bytes. A spawned worker would first need every tensor moved into
  shared memory and every object pickled across, on the training thread, and a new
  interpreter that imports torch and Megatron.
- A process per save holds no state from one save to the next. The fork copies this
  process's page tables, paid at the stage, which training waits for anyway; and on CPU,
  where the state is in host memory, each page that training writes while the child
  lives is copied once (copy-on-write). On GPU the state is in device memory.

The child is forked from the main thread at a step boundary, never from another thread
(a fork copies the locks that other threads hold at that moment, and a child that
needs one of them waits for good). It touches no CUDA and no process group: the staged
copies are in host memory (on GPU the device-to-host copy is made first, as
Megatron does), and the rank is passed in. It asks the kernel to kill it when its rank
ends (``orphans.die_with_parent``: a rank killed with SIGKILL leaves no writer behind),
ignores the stop signals (a stop waits for the write in flight), and leaves
with ``os._exit`` whatever happens (it never returns into the training loop, runs no
exit handler and flushes none of the rank's buffers). It reports through a pipe: each
request's write results (which Megatron's finalize functions read from its results
queue), the first failure, and the digests of the files it wrote. The rank reads the
pipe at each poll without blocking, and every wait for the child is bounded: past
``train.resilience.save_timeout_s`` it is killed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import select
import shutil
import signal
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from cqk_megatron.run.unwritable import is_unwritable
from cqk_megatron.training import checkpoint
from cqk_megatron.training.checkpoint import FAILURES, WriteLog
from cqk_megatron.training.resilience import orphans
from cqk_megatron.training.resilience.preemption import STOP_SIGNALS

# Tests only: the write waits until this many step boundaries have passed since the save
# was staged (or until the save is waited for), so that a test sees steps train while a
# write is in flight, and can stop or kill the job then, without depending on how fast
# this machine writes. Read here and nowhere else.
HOLD_STEPS_ENV = "CQK_TEST_ASYNC_SAVE_HOLD_STEPS"
HOLD_BOUND_S = 300.0
REAP_BOUND_S = 30.0  # a killed child's exit, waited for at most
_LENGTH = struct.Struct("<Q")  # the report's length, before the report


@dataclass
class Staged:
    """One rank's save, held in host memory until the writer writes it."""

    files: list[tuple[Path, object, dict]] = field(default_factory=list)
    requests: list = field(default_factory=list)  # Megatron's AsyncRequests, in order


@dataclass
class Report:
    """What the child sends back: each request's write results (``None`` for a request
    whose writer reports elsewhere), the first failure, and the digests of its files."""

    results: list = field(default_factory=list)
    error: BaseException | None = None
    digests: dict[str, str] = field(default_factory=dict)


# -- in the child ----------------------------------------------------------------------


def write_staged(staged: Staged, staging: Path, with_hashes: bool, rank: int) -> Report:
    """Write ``staged``: Megatron's requests, then each captured ``torch.save``, then hash
    what this rank wrote. A write the filesystem refuses removes ``staging`` at once: the
    training thread's next write (a metrics line) must not be the one that meets the full
    disk; the failure is reported, as the cause, at the next step boundary."""
    report = Report()
    try:
        log = WriteLog()
        for request in staged.requests:
            report.results.append(_write_request(request))
        for path, obj, extra in staged.files:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(obj, path, *extra["args"], **extra["kwargs"])
            log.paths.append(path)
        if with_hashes:
            report.digests = checkpoint.own_digests(staging, log, rank)
    except FAILURES as caught:
        report.error = caught
        if is_unwritable(caught):
            shutil.rmtree(staging, ignore_errors=True)
    return report


def _write_request(request: AsyncRequest) -> dict | Exception | None:
    """Megatron's write of one asynchronous request; its results ({bucket: results}, or
    the first exception), which its finalize function later reads from its queue. Its own
    function (``write_preloaded_data_multiproc``) forks again, a process a bucket, each
    waited for without a bound: its per-bucket function runs here instead, one bucket
    after another, and this child is the one process to bound."""
    kind, write = _write_request_kind(request), request.async_fn
    if kind == "none":
        return None
    if kind == "other":
        write(*request.async_fn_args, **request.async_fn_kwargs)  # as given
        return None
    transform_list, _use_msc = write.args
    _rank, buckets, _results_queue = request.async_fn_args
    results: dict = {}
    for index, bucket in enumerate(buckets):
        local: queue.Queue = queue.Queue()
        count: queue.Queue = queue.Queue()
        count.put(index)
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, index, bucket, local, count, use_fsync=True
        )
        _, outcome = local.get()
        if isinstance(outcome, Exception):
            return outcome
        results[index] = outcome
    return results


def _without_data(request: AsyncRequest) -> AsyncRequest:
    """``request`` without its write buckets (the child writes them; the rank keeps only
    what finalizing needs: its results queue and finalize functions)."""
    if _write_request_kind(request) != "buckets":
        return request
    rank, _buckets, results_queue = request.async_fn_args
    return request._replace(async_fn_args=(rank, [], results_queue))


def _write_request_kind(request: AsyncRequest) -> str:
    """``"none"``, ``"buckets"`` (Megatron's filesystem writer, whose per-bucket function
    runs in the child) or ``"other"`` (run as given)."""
    write = request.async_fn
    if write is None:
        return "none"
    name = getattr(getattr(write, "func", None), "__name__", "")
    return "buckets" if name == "write_preloaded_data_multiproc" else "other"


def _child(writer: Writer, parent: int) -> int:
    """The child's whole life: bound to its parent, deaf to stop signals, held (tests),
    then the write, and its report sent. The exit code says only whether it reported."""
    orphans.helper_dies_with_parent(parent, from_main_thread=True)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    gc.disable()  # a collection would touch, and so copy, every page of the parent's heap
    torch.set_num_threads(1)  # writing needs none, and the rank's cores are training
    os.close(writer._read_fd)
    if writer._release_fd is not None:
        os.close(writer._release_fd)
    if writer._hold_fd is not None:
        _held(writer._hold_fd)
    report = write_staged(writer.staged, writer.staging, writer.with_hashes, writer.rank)
    _send(writer._write_fd, report)
    return 0


def _held(fd: int) -> None:
    """Tests: wait for the rank's release (bounded). A rank that dies first does not
    release it: the child holds on, as it would in the middle of a long write, so that a
    test sees it end with its rank (``orphans``), not because the rank let it go."""
    deadline = time.monotonic() + HOLD_BOUND_S
    ready, _, _ = select.select([fd], [], [], HOLD_BOUND_S)
    if ready and not os.read(fd, 1):  # end of file: the rank is gone
        time.sleep(max(0.0, deadline - time.monotonic()))


def _send(fd: int, report: Report) -> None:
    try:
        payload = pickle.dumps(report)
    except Exception:  # an unpicklable error: its type and text are what the rank needs
        if report.error is not None:
            report.error = _picklable(report.error)
        report.results = [_picklable(r) for r in report.results]
        payload = pickle.dumps(report)
    data = memoryview(_LENGTH.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def _picklable(value):  # an exception, or a request's results
    try:
        pickle.dumps(value)
    except Exception:
        return RuntimeError(f"{type(value).__name__}: {value}")
    return value


# -- in the rank -----------------------------------------------------------------------


class Writer:
    """One rank's write of one staged save, in a child process (see the module's
    docstring). ``start`` forks it; ``is_alive`` and ``join`` read its report; afterwards
    ``error`` and ``digests`` hold what it said, and ``results`` each request's write
    results."""

    def __init__(
        self, staged: Staged, staging: Path, with_hashes: bool, rank: int | None = None
    ) -> None:
        self.staged, self.staging, self.with_hashes = staged, staging, with_hashes
        self.rank = torch.distributed.get_rank() if rank is None else rank
        self.hold_steps = int(os.environ.get(HOLD_STEPS_ENV, "0"))
        self.digests: dict[str, str] = {}
        self.results: list = []
        self.error: BaseException | None = None
        self.pid: int | None = None
        self._received = bytearray()
        self._read_fd = self._write_fd = -1
        self._hold_fd: int | None = None
        self._release_fd: int | None = None

    def start(self) -> None:
        """Fork the child (from the main thread, at a step boundary). The rank keeps no
        reference to the staged host copies: the child has them, and the memory is the
        child's alone once the rank has let go of it."""
        self._read_fd, self._write_fd = os.pipe()
        if self.hold_steps > 0:
            self._hold_fd, self._release_fd = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns from here
            code = 1
            try:
                code = _child(self, parent)
            finally:
                os._exit(code)
        self.pid = pid
        os.close(self._write_fd)
        if self._hold_fd is not None:
            os.close(self._hold_fd)
        os.set_blocking(self._read_fd, False)
        self.staged = Staged(requests=[_without_data(r) for r in self.staged.requests])

    def release(self) -> None:
        """Let a held write begin (tests; see ``HOLD_STEPS_ENV``)."""
        if self._release_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._release_fd, b"go")
                os.close(self._release_fd)
            self._release_fd = None

    def is_alive(self) -> bool:
        """Whether the child is still writing; reads its report so far, without waiting."""
        if self.pid is None:
            return False
        self._read_available()
        ended, status = os.waitpid(self.pid, os.WNOHANG)
        if ended == 0:
            return True
        self._finish(status)
        return False

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the child to end."""
        deadline = time.monotonic() + timeout
        while self.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            select.select([self._read_fd], [], [], min(left, 0.1))

    def kill(self) -> None:
        """End the child now (a write past its time) and reap it, bounded: a child stuck
        in the kernel (a hung network filesystem) dies only when its write returns, and
        is then left to the init process."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_BOUND_S
        while (reaped := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self._finish(reaped[1], killed=True)

    def finalize(self) -> None:
        """Once the child has reported without error: Megatron's finalize functions of
        each request (rank 0 writes the distributed checkpoints' metadata), each given
        its write results where it reads them."""
        for request, results in zip(self.staged.requests, self.results, strict=True):
            if _write_request_kind(request) == "buckets":
                request.async_fn_args[2].put(results)
            for finalize in request.finalize_fns:
                finalize()

    def _read_available(self) -> None:
        while True:
            try:
                chunk = os.read(self._read_fd, 1 << 20)
            except BlockingIOError:
                return
            if not chunk:
                return
            self._received += chunk

    def _finish(self, status: int, killed: bool = False) -> None:
        """The child has ended: take its report, or say how it ended without one."""
        pid, self.pid = self.pid, None
        self._read_available()
        os.close(self._read_fd)
        self.release()
        report = self._report()
        if report is None:
            if not killed:
                self.error = RuntimeError(
                    f"the checkpoint writer process (pid {pid}) of {self.staging} ended "
                    f"without a report ({_how_it_ended(status)})"
                )
            return
        self.results, self.error, self.digests = report.results, report.error, report.digests

    def _report(self) -> Report | None:
        if len(self._received) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._received)
        if len(self._received) < _LENGTH.size + length:
            return None
        return pickle.loads(bytes(self._received[_LENGTH.size : _LENGTH.size + length]))


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"

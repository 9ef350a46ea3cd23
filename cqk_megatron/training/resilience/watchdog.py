"""A watchdog per rank: a dead, stopped or stuck rank is named in seconds, and no rank
waits for it until a collective times out.

Design (read against nvidia-resiliency-ext's rank monitors, heartbeat every 30 s with 60 s
soft and 90 s hard timeouts, and torchft's 5 s heartbeats), in three parts:

- **Liveness, from a thread** (``heartbeat.py``). Every ``train.resilience.heartbeat_interval_s`` a
  daemon thread of each rank writes its state to the job's TCPStore and reads every
  rank's: a heartbeat counter, the step, the phase and how long it has been in it, host,
  PID and where its main thread is. A silent peer, or a store that stops answering or
  closes, is lost.
- **Progress, from the main loop** (``phases.py``). The loop marks phases (``enter``/
  ``phase``), each with a bound. A rank whose main thread overruns it is stuck. Which
  rank stopped is read from how far each got (``progress.py``): the collectives it has
  issued on each process group, published with every beat. A rank behind its peers on a
  group is named; they wait for it, wherever their main threads happen to block (under
  NCCL in ``.item()`` or a synchronize, not in ``torch.distributed``). Where every rank
  issued the same, those whose main thread is *not* inside ``torch.distributed``/
  DeepSpeed's comm are named; if every one is waiting, all are named.
- **The verdict** (this module). The first rank to decide publishes it; every surviving
  rank prints one line (``watchdog: ...``) naming the lost rank, its host, PID, step and
  phase, appends it to ``RUN/faults.jsonl``, and exits with ``EXIT_WATCHDOG`` (76) from
  the thread (``os._exit``: its main thread may be blocked in C++). The launcher
  relaunches the job.
- **Errors on the main thread.** A collective that fails because a peer died (gloo's
  "Connection reset by peer") is not reported as such: the main thread waits (bounded)
  for the verdict, which names the peer. Any other exception is published as this
  rank's crash (so peers stop at once) and recorded, then raised.

Store reads block without a bound when the store's process is stopped, so every store
call runs on a helper thread that the watchdog waits for with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from cqk_megatron.errors import EXIT_WATCHDOG, is_refusal
from cqk_megatron.training.resilience import faults
from cqk_megatron.training.resilience.heartbeat import Heartbeats
from cqk_megatron.training.resilience.phases import OVER, Bounds, PhaseClock, judge_phases
from cqk_megatron.training.resilience.progress import issued_collectives
from cqk_megatron.training.resilience.verdict import append_fault, first_line, verdict_line

__all__ = ["Bounds", "Watchdog", "current", "enter", "phase", "record_rendezvous_failure"]
__all__ += ["watching"]

# A main thread whose innermost Python frame is in one of these waits on its peers.
_COLLECTIVE_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm")


def _where(thread_id: int) -> tuple[str, bool]:
    """The innermost Python frame of a thread, and whether it waits in a collective."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "?", False
    code = frame.f_code
    text = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    return text, any(part in code.co_filename for part in _COLLECTIVE_CODE)


class Watchdog:
    """One per rank; ``start`` after the process group exists, ``close`` at the end."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store_addr: str,
        store_port: int,
        bounds: Bounds,
        run_dir: Path | None = None,
        store_host: str = "rank 0",
        generation: int = 0,
    ) -> None:
        self.rank, self.world_size, self.bounds = rank, world_size, bounds
        self.run_dir = run_dir
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._main = threading.main_thread().ident
        self._seq = 0
        self._stop = threading.Event()
        self._wake = threading.Event()  # beat now (a long phase began, or stop)
        self._clock = PhaseClock(bounds, rank, announce=self._wake.set)
        self._verdict_ready = threading.Event()
        self._crash: str | None = None
        self._symptom: str | None = None
        self._heartbeats = (
            Heartbeats(
                rank, world_size, store_addr, store_port, bounds, store_host, generation, self.host
            )
            if world_size > 1
            else None
        )
        self._thread = threading.Thread(target=self._run, name="cqk-watchdog", daemon=True)

    # -- the main thread's side ------------------------------------------------------------

    def start(self) -> Watchdog:
        self._thread.start()
        faults.on_phase("startup", 0, self.rank)
        return self

    def enter(self, name: str, step: int) -> None:
        """See ``PhaseClock.enter``."""
        self._clock.enter(name, step)

    def phase(self, name: str, step: int | None = None):
        """See ``PhaseClock.phase`` (a context manager)."""
        return self._clock.phase(name, step)

    def close(self) -> None:
        """This rank is done (finished or stopping to requeue): its silence from now on
        is not a fault, and it judges nobody. The store's host waits (bounded) until the
        others are done too: its process ending takes the store with it."""
        if not self._crash:  # a crash stays published where it happened
            self._clock.done()
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.bounds.heartbeat_timeout_s + 1)
        if self._heartbeats is None:
            return
        try:
            self._heartbeats.publish(self._state_json, self.bounds.heartbeat_timeout_s)
            if self.rank == 0 and self._heartbeats.store_host == "rank 0" and not self._crash:
                self._heartbeats.wait_for_others()
        finally:
            self._heartbeats.calls.close(wait_s=1.0)

    def on_error(self, error: BaseException) -> None:
        """The main thread got ``error``. A communication error waits (bounded) for the
        watchdog's verdict, which ends the process naming the lost peer; anything else is
        published as this rank's crash and recorded. Returns to let the caller raise."""
        if _is_communication_error(error) and self._heartbeats is not None:
            self._symptom = first_line(error, 120) or None
            # The peer's silence is noticed within heartbeat_timeout_s (+ a beat or two).
            self._verdict_ready.wait(self.bounds.heartbeat_timeout_s + 3 * self.bounds.interval_s)
            return
        self._stop.set()  # this rank raises now: it judges nobody (peers stop on its crash)
        self._crash = f"{type(error).__name__}: {first_line(error, 200)}"
        phase = self._clock.current
        self._record(
            {
                "event": "crashed",
                "rank": self.rank,
                "host": self.host,
                "pid": self.pid,
                "step": phase.step,
                "phase": phase.name,
                "error": self._crash,
            }
        )
        if self._heartbeats is not None:  # peers stop now instead of after the timeout
            self._heartbeats.publish(self._state_json, self.bounds.heartbeat_timeout_s)

    def on_refusal(self, error: BaseException) -> None:
        """Every rank refused together (``collectives.from_rank0``, a save's agreed outcome):
        nobody is lost. Refused before training, the run's folder stays as it was (no
        record); refused once steps have run (a full disk at a save), rank 0 records why
        in ``faults.jsonl``: it is what ended the job."""
        step = self._clock.current.step
        self.enter("shutdown", step)
        if self._clock.steps_begun and self.rank == 0:
            self._record(
                {
                    "event": "refused",
                    "rank": self.rank,
                    "host": self.host,
                    "pid": self.pid,
                    "step": step,
                    "reason": f"{type(error).__name__}: {first_line(error, 2000)}",
                }
            )

    # -- the thread --------------------------------------------------------------------------

    def _state_json(self, verdict: dict | None = None) -> str:
        phase = self._clock.current
        where, waiting = _where(self._main)
        state = {
            "seq": self._seq,
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "step": phase.step,
            "phase": phase.name,
            "age_s": round(time.monotonic() - phase.started, 3),
            "bound_s": phase.bound_s if phase.bound_s != float("inf") else None,
            "where": where,
            "waiting": waiting,
            "issued": issued_collectives(),
        }
        if self._crash:
            state["crashed"] = self._crash
        if verdict:
            state["verdict"] = verdict
        return json.dumps(state)

    def _run(self) -> None:
        while not self._stop.is_set():
            beat = time.monotonic()
            self._seq += 1
            verdict = self._beat()
            if verdict is not None and not self._stop.is_set():
                self._fire(verdict)
                return
            self._wake.wait(max(0.0, self.bounds.interval_s - (time.monotonic() - beat)))
            self._wake.clear()

    def _beat(self) -> dict | None:
        """One heartbeat: publish, read the peers, judge; the verdict, if any."""
        if self._heartbeats is None:
            return judge_phases(
                {self.rank: json.loads(self._state_json())}, self.bounds.heartbeat_timeout_s
            )
        outcome = self._heartbeats.exchange(self._state_json())
        now = time.monotonic()
        status, value = outcome
        if status != "ok":
            return self._store_trouble(status, value, now)
        verdict, states = self._heartbeats.read(value, now)
        if verdict is not None:
            return verdict
        states[self.rank] = json.loads(self._state_json())
        return judge_phases(states, self.bounds.heartbeat_timeout_s)

    def _store_trouble(self, status: str, value, now: float) -> dict | None:
        lost = self._heartbeats.unanswered(status, value, now)
        if lost is None:
            return None
        last = self._heartbeats.store_host_state()
        if self._clock.current.name in OVER or last.get("phase") in OVER:
            # Training is over here or on the store's host: its process may end first.
            self._stop.set()
            return None
        return self._heartbeats.store_lost(now, *lost)

    def _fire(self, verdict: dict) -> None:
        """Print the one line, record it, tell the peers, and end this process."""
        line = verdict_line(verdict, self.rank, self.host, self._symptom)
        print(line, file=sys.stderr, flush=True)
        self._record(
            {"event": "lost", "by_rank": self.rank, "by_host": self.host, **verdict, "line": line}
        )
        self._verdict_ready.set()
        if self._heartbeats is not None and "adopted_from" not in verdict:
            # Let the others read it (and name the same rank) before a store host goes.
            mine = self._heartbeats.key(self.rank)
            self._heartbeats.calls.call(lambda c: c.set(mine, self._state_json(verdict)), 1.0)
            time.sleep(min(2 * self.bounds.interval_s, 5.0))
        sys.stdout.flush()
        _end_helper_processes()
        os._exit(EXIT_WATCHDOG)

    def _record(self, record: dict) -> None:
        append_fault(self.run_dir, record)


def _end_helper_processes() -> None:
    """os._exit skips multiprocessing's cleanup: end this process's children (Megatron's
    checkpoint-writer manager) so that they do not outlive it."""
    import multiprocessing

    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()


def _is_communication_error(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        marker in text
        for marker in ("gloo", "nccl", "connection", "broken pipe", "timed out", "socket")
    )


# -- the process's watchdog (no-ops when none runs) ----------------------------------------

_CURRENT: Watchdog | None = None
_GENERATION = 0


def current() -> Watchdog | None:
    return _CURRENT


def enter(name: str, step: int) -> None:
    if _CURRENT is not None:
        _CURRENT.enter(name, step)


@contextlib.contextmanager
def phase(name: str, step: int | None = None):
    if _CURRENT is None:
        yield
        return
    with _CURRENT.phase(name, step):
        yield


@contextlib.contextmanager
def watching(config, dist_env, run_dir: Path | None = None):
    """Run the body under this rank's watchdog (started now, closed after)."""
    global _CURRENT, _GENERATION
    from cqk_megatron.parallel.process_groups import _uses_agent_store

    _GENERATION += 1
    watchdog = Watchdog(
        dist_env.rank,
        dist_env.world_size,
        dist_env.master_addr,
        dist_env.master_port,
        Bounds.from_config(config),
        run_dir,
        store_host="torchrun's agent on the first node" if _uses_agent_store() else "rank 0",
        generation=_GENERATION,
    ).start()
    _CURRENT = watchdog
    try:
        yield watchdog
    except BaseException as error:
        if is_refusal(error):
            watchdog.on_refusal(error)
        elif not isinstance(error, (KeyboardInterrupt, SystemExit)):
            watchdog.on_error(error)
        raise
    finally:
        _CURRENT = None
        watchdog.close()


def record_rendezvous_failure(run_dir: Path | None, message: str, rank: int) -> None:
    """The line for a rank that gave up at rendezvous (no watchdog runs yet)."""
    line = f"watchdog: {message}. Rank {rank} exits {EXIT_WATCHDOG}."
    print(line, file=sys.stderr, flush=True)
    append_fault(run_dir, {"event": "rendezvous", "by_rank": rank, "line": line})

"""A watchdog per rank: a dead, stopped or stuck rank is named in seconds, and no rank
waits for it until a collective times out.

Design (read against nvidia-resiliency-ext's rank monitors, heartbeat every 30 s with 60 s
soft and 90 s hard timeouts, and torchft's 5 s heartbeats):

- **Liveness, from a thread.** Every ``train.heartbeat_interval_s`` a daemon thread of
  each rank writes its state to the job's TCPStore (a client connection of its own to
  the default group's store, with a short timeout) and reads every rank's: a heartbeat
  counter, the step, the phase and how long it has been in it, host, PID and where its
  main thread is. A rank whose counter stops changing for ``train.heartbeat_timeout_s``
  (killed, SIGSTOPped, its node gone from the network: no TCP reset needed) is lost;
  so is the store's host (rank 0, or torchrun's agent) when the store stops answering
  or closes. Ages are each rank's own clock: no clock is compared across nodes.
- **Progress, from the main loop.** The loop marks phases (``enter``/``phase``):
  start-up, data loading, a step, evaluation, a checkpoint save, shutdown. Each has a
  bound (``Bounds``). A rank whose main thread overruns it is stuck: deadlocked, or in
  a collective that one peer never joined. Among the overrunning ranks, those whose main
  thread is *not* inside ``torch.distributed``/DeepSpeed's comm are named (they are the
  cause; the others wait for them); if every one is waiting, all are named.
- **The verdict.** The first rank to decide publishes it; every surviving rank prints one
  line (``watchdog: ...``) naming the lost rank, its host, PID, step and phase, appends
  it to ``RUN/faults.jsonl``, and exits with ``EXIT_WATCHDOG`` (76) from the thread
  (``os._exit``: its main thread may be blocked in C++). The launcher relaunches the job.
- **Errors on the main thread.** A collective that fails because a peer died (gloo's
  "Connection reset by peer") is not reported as such: the main thread waits (bounded)
  for the verdict, which names the peer. Any other exception is published as this
  rank's crash (so peers stop at once) and recorded, then raised.

Store reads block without a bound when the store's process is stopped, so every store
call runs on a helper thread that the watchdog waits for with a deadline.

All-to-all reads cost each rank one ``multi_get`` of N small keys per interval: fine for
dozens to hundreds of ranks; thousands would want a tree.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from cqk_megatron.exit_codes import EXIT_WATCHDOG
from cqk_megatron.refusals import is_refusal
from cqk_megatron.run_folder import FAULTS
from cqk_megatron.training import faults

# Phases that are long and rare: a beat at once tells the peers (steps beat on the clock).
_ANNOUNCED = ("eval", "save", "shutdown")
_KEY = "cqk/watchdog/"
# A main thread whose innermost Python frame is in one of these waits on its peers.
_COLLECTIVE_CODE = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm")


@dataclass(frozen=True)
class Bounds:
    """How long anything may take (seconds); ``from_config`` maps ``train.*`` onto it."""

    interval_s: float = 5.0
    heartbeat_timeout_s: float = 30.0
    init_s: float = 300.0  # start-up and the first step
    step_s: float = 60.0  # a step, a data fetch, one evaluation batch
    save_s: float = 600.0
    collective_s: float = 100.0
    eval_batches: int = 1

    @classmethod
    def from_config(cls, config) -> Bounds:
        t = config.train
        return cls(
            interval_s=t.heartbeat_interval_s,
            heartbeat_timeout_s=t.heartbeat_timeout_s,
            init_s=t.init_timeout_s,
            step_s=t.step_timeout_s,
            save_s=t.save_timeout_s,
            collective_s=t.collective_timeout_s,
            eval_batches=max(1, t.eval_iters),
        )

    def phase_collective_s(self, name: str) -> float | None:
        """The collective timeout inside phase ``name`` when it differs from the usual;
        above the phase's bound, so that the watchdog names a stuck rank first."""
        return self.save_s + self.heartbeat_timeout_s if name == "save" else None

    def phase(self, name: str, first_step: bool = False) -> float:
        if name == "startup" or (name == "step" and first_step):
            return self.init_s
        if name == "save":
            return self.save_s
        if name == "eval":
            return self.step_s * self.eval_batches
        if name == "shutdown":
            return self.collective_s
        return self.step_s  # data, step


@dataclass(frozen=True)
class _Phase:
    name: str
    step: int
    started: float  # time.monotonic()
    bound_s: float


@dataclass
class _Peer:
    seq: int = -1
    changed: float = field(default_factory=time.monotonic)
    quiet_beats: int = 0  # this rank's beats since the peer's last change
    state: dict[str, Any] = field(default_factory=dict)


class _StoreCalls:
    """One helper thread that makes the store calls; callers wait with a deadline (a call
    to a stopped store's process never returns, and a blocked client must not be used
    by a second call meanwhile)."""

    def __init__(self, addr: str, port: int, timeout_s: float) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._addr, self._port, self._timeout_s = addr, port, timeout_s
        self.busy_since: float | None = None
        self._pending: tuple[threading.Event | None, dict | None] = (None, None)
        self._lock = threading.Lock()  # the watchdog thread and the main thread both call
        self._thread = threading.Thread(target=self._serve, name="cqk-watchdog-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import torch.distributed as dist

        client = None
        while True:
            job = self._jobs.get()
            if job is None:  # close(): the client's socket goes with this thread
                del client
                return
            fn, done, box = job
            try:
                if client is None:
                    client = dist.TCPStore(
                        self._addr,
                        self._port,
                        None,
                        False,
                        timedelta(seconds=self._timeout_s),
                        wait_for_workers=False,
                    )
                box["value"] = fn(client)
            except Exception as error:  # noqa: BLE001 - reported to the caller
                box["error"] = error
            done.set()

    def call(self, fn, deadline_s: float) -> tuple[str, Any]:
        """("ok", value) | ("error", exception) | ("pending", None) if still blocked."""
        with self._lock:
            return self._call(fn, deadline_s)

    def _call(self, fn, deadline_s: float) -> tuple[str, Any]:
        if self.busy_since is not None:  # an earlier call never came back
            return "pending", None
        done, box = threading.Event(), {}
        self.busy_since = time.monotonic()
        self._jobs.put((fn, done, box))
        if not done.wait(deadline_s):
            self._pending = (done, box)
            return "pending", None
        self.busy_since = None
        return ("error", box["error"]) if "error" in box else ("ok", box["value"])

    def close(self, wait_s: float) -> None:
        """End the helper thread and its client (a process that trains several runs must
        not keep one of each per run); a call still blocked on a stopped store keeps it
        until that call returns (a daemon thread: it never holds the process)."""
        self._jobs.put(None)
        self._thread.join(timeout=wait_s)

    def collect(self) -> tuple[str, Any] | None:
        """The late answer of a call that was pending, if it came."""
        with self._lock:
            return self._collect()

    def _collect(self) -> tuple[str, Any] | None:
        done, box = self._pending
        if done is None or not done.is_set():
            return None
        self.busy_since, self._pending = None, (None, None)
        return ("error", box["error"]) if "error" in box else ("ok", box["value"])


def _where(thread_id: int) -> tuple[str, bool]:
    """The innermost Python frame of a thread, and whether it waits in a collective."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "?", False
    code = frame.f_code
    text = f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
    return text, any(part in code.co_filename for part in _COLLECTIVE_CODE)


def _process_state(pid: int) -> str | None:
    """On this host: what the kernel says of ``pid`` (None: not on this host, or alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "no longer running"
    state = stat.rsplit(")", 1)[-1].split()[0]
    return {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "Z": "exited"}.get(state)


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
        # Keys of their own for each run trained in this process (tests train several),
        # and for each of torchrun's restarts (its agent's store may outlive a worker group).
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"{_KEY}{restart}/{generation}/"
        self.run_dir = run_dir
        self.store_where = f"{store_addr}:{store_port}"
        self.store_host = store_host
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._main = threading.main_thread().ident
        self._phase = _Phase("startup", 0, time.monotonic(), bounds.phase("startup"))
        self._steps_begun = 0
        self._seq = 0
        self._peers = {r: _Peer() for r in range(world_size) if r != rank}
        self._stop = threading.Event()
        self._wake = threading.Event()  # beat now (a long phase began, or stop)
        self._verdict_ready = threading.Event()
        self._crash: str | None = None
        self._symptom: str | None = None
        self._store_failed: tuple[float, str] | None = None
        # Silence counts only while this rank itself keeps beating: on an oversubscribed
        # machine every Python thread can stall for seconds at once (the GIL's holder
        # descheduled), and a stall here must not look like a peer's.
        self._beats_needed = max(2, math.ceil(bounds.heartbeat_timeout_s / bounds.interval_s))
        self._pending_beats = 0
        self._store = (
            _StoreCalls(store_addr, store_port, bounds.heartbeat_timeout_s)
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
        """The main thread begins phase ``name`` (of step ``step``); it lasts until the next
        ``enter``. The first time a second step begins, start-up is over on every rank:
        after a barrier, every group's collectives get ``collective_timeout_s``."""
        if name == "step":
            self._steps_begun += 1
            if self._steps_begun == 2:
                self._lower_collective_timeout()
        first = name == "step" and self._steps_begun == 1
        self._phase = _Phase(name, step, time.monotonic(), self.bounds.phase(name, first))
        if name in _ANNOUNCED:
            self._wake.set()
        faults.on_phase(name, step, self.rank)

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None):
        """Phase ``name`` for the body, then back to the enclosing phase (its clock
        restarted). A save's collectives (barriers behind rank 0's manifest hashing) may
        take as long as the save: their timeout is raised for it."""
        outer = self._phase
        collective_timeout_s = self.bounds.phase_collective_s(name)
        self.enter(name, outer.step if step is None else step)
        if collective_timeout_s is not None:
            from cqk_megatron.distributed import set_collective_timeout

            set_collective_timeout(collective_timeout_s)
        try:
            yield
        finally:
            if collective_timeout_s is not None:
                from cqk_megatron.distributed import set_collective_timeout

                set_collective_timeout(
                    self.bounds.collective_s if self._steps_begun >= 2 else self.bounds.init_s
                )
            self._phase = _Phase(outer.name, outer.step, time.monotonic(), outer.bound_s)

    def _lower_collective_timeout(self) -> None:
        from cqk_megatron.distributed import set_collective_timeout
        from cqk_megatron.training import collectives

        # torchtitan's order: agree that start-up is over, then lower; else a fast rank's
        # short timeout could expire on a peer still finishing its first step.
        collectives.barrier()
        set_collective_timeout(self.bounds.collective_s)

    def close(self) -> None:
        """This rank is done (finished or stopping to requeue): its silence from now on
        is not a fault, and it judges nobody. The store's host waits (bounded) until the
        others are done too: its process ending takes the store with it."""
        if not self._crash:  # a crash stays published where it happened
            self._phase = _Phase("done", self._phase.step, time.monotonic(), float("inf"))
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.bounds.heartbeat_timeout_s + 1)
        if self._store is None:
            return
        try:
            self._publish_last()
            if self.rank == 0 and self.store_host == "rank 0" and not self._crash:
                self._wait_for_others()
        finally:
            self._store.close(wait_s=1.0)

    def _wait_for_others(self) -> None:
        """Rank 0 hosts the store: until every peer is done (bounded by a heartbeat
        timeout), so that none loses the store before its last word."""
        keys = [self._key(r) for r in self._peers]

        def others_done(client) -> bool:
            present = [k for k in keys if client.check([k])]
            states = [json.loads(raw) for raw in client.multi_get(present)] if present else []
            return len(present) == len(keys) and all(
                s.get("phase") == "done" or s.get("crashed") or s.get("verdict") for s in states
            )

        deadline = time.monotonic() + self.bounds.heartbeat_timeout_s
        while time.monotonic() < deadline:
            status, done = self._store.call(others_done, 1.0)
            if status != "ok" or done:
                return
            time.sleep(min(0.05, self.bounds.interval_s))

    def _publish_last(self) -> None:
        """This rank's final state (done, or crashed), waiting out a store call still
        pending from the thread (bounded): peers must not take its silence for a fault."""
        deadline = time.monotonic() + self.bounds.heartbeat_timeout_s
        while time.monotonic() < deadline:
            self._store.collect()
            status, _ = self._store.call(
                lambda c: c.set(self._key(self.rank), self._state_json()), 1.0
            )
            if status != "pending":
                return
            time.sleep(0.1)

    def on_error(self, error: BaseException) -> None:
        """The main thread got ``error``. A communication error waits (bounded) for the
        watchdog's verdict, which ends the process naming the lost peer; anything else is
        published as this rank's crash and recorded. Returns to let the caller raise."""
        if _is_communication_error(error) and self._store is not None:
            self._symptom = _first_line(error, 120) or None
            # The peer's silence is noticed within heartbeat_timeout_s (+ a beat or two).
            self._verdict_ready.wait(self.bounds.heartbeat_timeout_s + 3 * self.bounds.interval_s)
            return
        self._stop.set()  # this rank raises now: it judges nobody (peers stop on its crash)
        self._crash = f"{type(error).__name__}: {_first_line(error, 200)}"
        self._record(
            {
                "event": "crashed",
                "rank": self.rank,
                "host": self.host,
                "pid": self.pid,
                "step": self._phase.step,
                "phase": self._phase.name,
                "error": self._crash,
            }
        )
        if self._store is not None:  # peers stop now instead of after the heartbeat timeout
            self._publish_last()

    def on_refusal(self, error: BaseException) -> None:
        """Every rank refused together (``collectives.from_rank0``, a save's agreed outcome):
        nobody is lost. Refused before training, the run's folder stays as it was (no
        record); refused once steps have run (a full disk at a save), rank 0 records why
        in ``faults.jsonl``: it is what ended the job."""
        step = self._phase.step
        self.enter("shutdown", step)
        if self._steps_begun and self.rank == 0:
            self._record(
                {
                    "event": "refused",
                    "rank": self.rank,
                    "host": self.host,
                    "pid": self.pid,
                    "step": step,
                    "reason": f"{type(error).__name__}: {_first_line(error, 2000)}",
                }
            )

    # -- the thread --------------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def _state_json(self, verdict: dict | None = None) -> str:
        phase = self._phase
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
        }
        if self._crash:
            state["crashed"] = self._crash
        if verdict:
            state["verdict"] = verdict
        return json.dumps(state)

    def _run(self) -> None:
        keys = [self._key(r) for r in range(self.world_size)]
        seen: set[int] = set()  # ranks whose key exists (multi_get waits for missing keys)

        def exchange(client, mine: str) -> dict[int, bytes]:
            client.set(keys[self.rank], mine)
            if len(seen) < self.world_size:
                seen.update(r for r in range(self.world_size) if client.check([keys[r]]))
            ranks = sorted(seen)
            return dict(zip(ranks, client.multi_get([keys[r] for r in ranks]), strict=True))

        while not self._stop.is_set():
            beat = time.monotonic()
            self._seq += 1
            verdict = None
            if self._store is None:
                verdict = self._judge_phases({self.rank: json.loads(self._state_json())})
            else:
                mine = self._state_json()
                outcome = self._store.collect() or self._store.call(
                    lambda client, mine=mine: exchange(client, mine),
                    self.bounds.interval_s,  # a slow answer is collected at the next beat
                )
                verdict = self._judge(outcome)
            if verdict is not None and not self._stop.is_set():
                self._fire(verdict)
                return
            self._wake.wait(max(0.0, self.bounds.interval_s - (time.monotonic() - beat)))
            self._wake.clear()

    def _judge(self, outcome: tuple[str, Any]) -> dict | None:
        now = time.monotonic()
        status, value = outcome
        if status != "ok":
            if status == "error" and not self._store_failed:
                self._store_failed = (now, _first_line(value, 120))
            busy = self._store.busy_since
            self._pending_beats += 1
            if status == "error" or (
                busy is not None
                and now - busy > self.bounds.heartbeat_timeout_s
                and self._pending_beats >= self._beats_needed
            ):
                return self._store_lost(now, status == "error", busy)
            return None
        self._pending_beats = 0
        states = {}
        for r, raw in value.items():
            try:
                states[r] = json.loads(raw)
            except (ValueError, TypeError):
                continue
        for r, state in states.items():
            if r == self.rank:
                continue
            if state.get("verdict"):  # another rank decided first: the same verdict
                return {**state["verdict"], "adopted_from": r}
            if state.get("crashed"):
                return self._verdict(
                    [r], state, f"crashed ({state['crashed']})", 0.0, kind="crashed"
                )
        for r, peer in self._peers.items():
            state = states.get(r)  # None: never heard of; silent since the watchdog began
            if state is not None and state["seq"] != peer.seq:
                peer.seq, peer.changed, peer.state, peer.quiet_beats = state["seq"], now, state, 0
            else:
                peer.quiet_beats += 1
            if peer.state.get("phase") in ("shutdown", "done"):
                continue  # past its last collective: its silence stalls nobody
            silent = now - peer.changed
            if silent > self.bounds.heartbeat_timeout_s and peer.quiet_beats >= self._beats_needed:
                return self._verdict(
                    [r],
                    peer.state,
                    f"sent no heartbeat for {silent:.1f} s "
                    f"(train.heartbeat_timeout_s={self.bounds.heartbeat_timeout_s:g}): "
                    f"{self._liveness(peer.state)}",
                    silent,
                    kind="silent",
                )
        for r, peer in self._peers.items():  # a peer's phase age as of now, not its last beat
            if r in states and states[r].get("seq") == peer.seq:
                states[r] = {**states[r], "age_s": states[r]["age_s"] + (now - peer.changed)}
        states[self.rank] = json.loads(self._state_json())
        return self._judge_phases(states)

    def _liveness(self, state: dict) -> str:
        known = _process_state(state["pid"]) if state.get("host") == self.host else None
        return known or "killed, stopped, hung or unreachable"

    def _judge_phases(self, states: dict[int, dict]) -> dict | None:
        over = {
            r: s
            for r, s in states.items()
            if s.get("bound_s") is not None and s["age_s"] > s["bound_s"] and s["phase"] != "done"
        }
        if not over:
            return None
        culprits = [r for r, s in over.items() if not s.get("waiting")]
        if culprits:
            why = "overran"
        else:
            # Only ranks that wait in a collective overran: the one they wait for is
            # likely just behind (its clock started later, or its last beat is older).
            # Give it a heartbeat timeout to overrun too; then name the waiters furthest
            # behind (a collective that never completes on any rank).
            if (
                max(s["age_s"] - s["bound_s"] for s in over.values())
                < self.bounds.heartbeat_timeout_s
            ):
                return None
            low = min(s["step"] for s in over.values())
            culprits = [r for r, s in over.items() if s["step"] == low]
            why = "overran (waiting in a collective)"
        first = over[culprits[0]]
        return self._verdict(
            sorted(culprits),
            first,
            f"{why} phase '{first['phase']}': {first['age_s']:.1f} s, bound {first['bound_s']:g} s "
            f"(main thread at {first.get('where', '?')})",
            first["age_s"] - first["bound_s"],
            kind="stuck",
        )

    def _store_lost(self, now: float, closed: bool, busy: float | None) -> dict | None:
        last = {}
        if self.store_host == "rank 0" and 0 in self._peers:
            last = self._peers[0].state
        if self._phase.name in ("shutdown", "done") or last.get("phase") in ("shutdown", "done"):
            # Training is over here or on the store's host: its process may end first.
            self._stop.set()
            return None
        what = (
            f"closed the connection ({self._store_failed[1]})"
            if closed and self._store_failed
            else f"stopped answering for {now - (busy or now):.1f} s"
        )
        reason = f"hosts the job's store at {self.store_where}, which {what}: " + (
            self._liveness(last) if last else "gone or stuck"
        )
        if self.store_host != "rank 0":
            reason = f"({self.store_host}) " + reason
            return self._verdict([], {}, reason, 0.0, kind="store")
        return self._verdict([0], last, reason, 0.0, kind="store")

    def _verdict(self, ranks: list[int], state: dict, reason: str, late_s: float, kind: str):
        return {
            "kind": kind,
            "ranks": ranks,
            "host": state.get("host"),
            "pid": state.get("pid"),
            "step": state.get("step"),
            "phase": state.get("phase"),
            "reason": reason,
            "late_s": round(late_s, 2),
        }

    def _fire(self, verdict: dict) -> None:
        """Print the one line, record it, tell the peers, and end this process."""
        who = ", ".join(map(str, verdict["ranks"])) or "?"
        known = []
        if verdict.get("pid") and len(verdict["ranks"]) == 1:
            known.append(f"pid {verdict['pid']}")
        if verdict.get("step") is not None:
            known.append(f"last heard at step {verdict['step']} in phase {verdict['phase']}")
        subject = (
            f"rank{'s' if len(verdict['ranks']) != 1 else ''} {who}"
            + (f" on {verdict['host']}" if verdict.get("host") else "")
            + (f" ({', '.join(known)})" if known else "")
        )
        symptom = f" Seen here first as: {self._symptom}." if self._symptom else ""
        line = (
            f"watchdog: {subject} {verdict['reason']}.{symptom} "
            f"Rank {self.rank} on {self.host} exits {EXIT_WATCHDOG} so that the job is "
            "relaunched from its last complete checkpoint."
        )
        print(line, file=sys.stderr, flush=True)
        self._record(
            {"event": "lost", "by_rank": self.rank, "by_host": self.host, **verdict, "line": line}
        )
        self._verdict_ready.set()
        if self._store is not None and "adopted_from" not in verdict:
            # Let the others read it (and name the same rank) before a store host goes.
            self._store.call(lambda c: c.set(self._key(self.rank), self._state_json(verdict)), 1.0)
            time.sleep(min(2 * self.bounds.interval_s, 5.0))
        sys.stdout.flush()
        _end_helper_processes()
        os._exit(EXIT_WATCHDOG)

    def _record(self, record: dict) -> None:
        if self.run_dir is None:
            return
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with (self.run_dir / FAULTS).open("a") as handle:  # one short write
                handle.write(json.dumps({**record, "time": time.time()}) + "\n")
        except OSError:
            pass  # the verdict is on stderr anyway


def _end_helper_processes() -> None:
    """os._exit skips multiprocessing's cleanup: end this process's children (Megatron's
    checkpoint-writer manager) so that they do not outlive it."""
    import multiprocessing

    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()


def _first_line(error: BaseException, limit: int) -> str:
    """The message's first line, without the C++ source location gloo puts first."""
    text = (str(error).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:limit]


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
    from cqk_megatron.distributed import _uses_agent_store

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
    if run_dir is not None:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with (run_dir / FAULTS).open("a") as handle:
                record = {"event": "rendezvous", "by_rank": rank, "line": line, "time": time.time()}
                handle.write(json.dumps(record) + "\n")
        except OSError:
            pass

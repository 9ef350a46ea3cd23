"""The heartbeat store: every rank publishes its state to the job's TCPStore and reads its
peers', through a client connection of its own (``StoreCalls``) with a short timeout.

A peer whose heartbeat counter stops changing for ``train.resilience.heartbeat_timeout_s`` (killed,
SIGSTOPped, its node gone from the network: no TCP reset needed) is lost; so is the
store's host (rank 0, or torchrun's agent) when the store stops answering or closes. Ages
are each rank's own clock: no clock is compared across nodes. All-to-all reads cost each
rank one ``multi_get`` of N small keys per interval: fine for dozens to hundreds of ranks;
thousands would want a tree.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from cqk_megatron.training.resilience.phases import OVER, Bounds
from cqk_megatron.training.resilience.verdict import first_line, verdict

_KEY = "cqk/watchdog/"


@dataclass
class Peer:
    seq: int = -1
    changed: float = field(default_factory=time.monotonic)
    quiet_beats: int = 0  # this rank's beats since the peer's last change
    state: dict[str, Any] = field(default_factory=dict)


class StoreCalls:
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


def process_state(pid: int) -> str | None:
    """On this host: what the kernel says of ``pid`` (None: not on this host, or alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "no longer running"
    state = stat.rsplit(")", 1)[-1].split()[0]
    return {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "Z": "exited"}.get(state)


class Heartbeats:
    """This rank's side of the heartbeat store (``world_size > 1``): publish its state,
    read every rank's, and say which peer went silent, crashed or decided first."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store_addr: str,
        store_port: int,
        bounds: Bounds,
        store_host: str,
        generation: int,
        host: str,
    ) -> None:
        self.rank, self.world_size, self.bounds, self.host = rank, world_size, bounds, host
        # Keys of their own for each run trained in this process (tests train several),
        # and for each of torchrun's restarts (its agent's store may outlive a worker group).
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"{_KEY}{restart}/{generation}/"
        self._keys = [self.key(r) for r in range(world_size)]
        self._seen: set[int] = set()  # ranks whose key exists (multi_get waits for missing keys)
        self.store_where = f"{store_addr}:{store_port}"
        self.store_host = store_host
        self.peers = {r: Peer() for r in range(world_size) if r != rank}
        self._store_failed: tuple[float, str] | None = None
        # Silence counts only while this rank itself keeps beating: on an oversubscribed
        # machine every Python thread can stall for seconds at once (the GIL's holder
        # descheduled), and a stall here must not look like a peer's.
        self._beats_needed = max(2, math.ceil(bounds.heartbeat_timeout_s / bounds.interval_s))
        self._pending_beats = 0
        self.calls = StoreCalls(store_addr, store_port, bounds.heartbeat_timeout_s)

    def key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    def exchange(self, mine: str) -> tuple[str, Any]:
        """Publish ``mine`` and read every rank's state (a ``StoreCalls`` outcome); a slow
        answer is collected at the next beat."""
        return self.calls.collect() or self.calls.call(
            lambda client: self._exchange(client, mine), self.bounds.interval_s
        )

    def _exchange(self, client, mine: str) -> dict[int, bytes]:
        client.set(self._keys[self.rank], mine)
        if len(self._seen) < self.world_size:
            self._seen.update(r for r in range(self.world_size) if client.check([self._keys[r]]))
        ranks = sorted(self._seen)
        return dict(zip(ranks, client.multi_get([self._keys[r] for r in ranks]), strict=True))

    def unanswered(self, status: str, error: Any, now: float) -> tuple[bool, float | None] | None:
        """The store did not answer this beat (``status`` error or pending): (closed,
        busy since) once that makes it lost, else None (it may answer at the next beat)."""
        if status == "error" and not self._store_failed:
            self._store_failed = (now, first_line(error, 120))
        busy = self.calls.busy_since
        self._pending_beats += 1
        if status == "error" or (
            busy is not None
            and now - busy > self.bounds.heartbeat_timeout_s
            and self._pending_beats >= self._beats_needed
        ):
            return status == "error", busy
        return None

    def store_host_state(self) -> dict:
        """The last state the store's host published, when it is a rank (rank 0)."""
        if self.store_host == "rank 0" and 0 in self.peers:
            return self.peers[0].state
        return {}

    def store_lost(self, now: float, closed: bool, busy: float | None) -> dict:
        """The verdict on the store's host (rank 0, or torchrun's agent)."""
        last = self.store_host_state()
        what = (
            f"closed the connection ({self._store_failed[1]})"
            if closed and self._store_failed
            else f"stopped answering for {now - (busy or now):.1f} s"
        )
        reason = f"hosts the job's store at {self.store_where}, which {what}: " + (
            self.liveness(last) if last else "gone or stuck"
        )
        if self.store_host != "rank 0":
            reason = f"({self.store_host}) " + reason
            return verdict([], {}, reason, 0.0, kind="store")
        return verdict([0], last, reason, 0.0, kind="store")

    def read(self, answer: dict[int, bytes], now: float) -> tuple[dict | None, dict[int, dict]]:
        """The store answered: a verdict that a peer published (adopted), a peer's crash, or
        a silent peer; else None, and the peers' states with their phase ages as of now."""
        self._pending_beats = 0
        states = {}
        for r, raw in answer.items():
            try:
                states[r] = json.loads(raw)
            except (ValueError, TypeError):
                continue
        for r, state in states.items():
            if r == self.rank:
                continue
            if state.get("verdict"):  # another rank decided first: the same verdict
                return {**state["verdict"], "adopted_from": r}, states
            if state.get("crashed"):
                reason = f"crashed ({state['crashed']})"
                return verdict([r], state, reason, 0.0, kind="crashed"), states
        silent = self._silent_peer(states, now)
        if silent is not None:
            return silent, states
        for r, peer in self.peers.items():  # a peer's phase age as of now, not its last beat
            if r in states and states[r].get("seq") == peer.seq:
                states[r] = {**states[r], "age_s": states[r]["age_s"] + (now - peer.changed)}
        return None, states

    def _silent_peer(self, states: dict[int, dict], now: float) -> dict | None:
        for r, peer in self.peers.items():
            state = states.get(r)  # None: never heard of; silent since the watchdog began
            if state is not None and state["seq"] != peer.seq:
                peer.seq, peer.changed, peer.state, peer.quiet_beats = state["seq"], now, state, 0
            else:
                peer.quiet_beats += 1
            if peer.state.get("phase") in OVER:
                continue  # past its last collective: its silence stalls nobody
            silent = now - peer.changed
            if silent > self.bounds.heartbeat_timeout_s and peer.quiet_beats >= self._beats_needed:
                return verdict(
                    [r],
                    peer.state,
                    f"sent no heartbeat for {silent:.1f} s "
                    f"(train.resilience.heartbeat_timeout_s={self.bounds.heartbeat_timeout_s:g}): "
                    f"{self.liveness(peer.state)}",
                    silent,
                    kind="silent",
                )
        return None

    def liveness(self, state: dict) -> str:
        known = process_state(state["pid"]) if state.get("host") == self.host else None
        return known or "killed, stopped, hung or unreachable"

    def publish(self, state_json, wait_s: float) -> None:
        """Publish ``state_json()`` (this rank's final state: done, or crashed), waiting out
        a call still pending from the thread (bounded by ``wait_s``): peers must not take
        its silence for a fault."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self.calls.collect()
            status, _ = self.calls.call(lambda c: c.set(self.key(self.rank), state_json()), 1.0)
            if status != "pending":
                return
            time.sleep(0.1)

    def wait_for_others(self) -> None:
        """Rank 0 hosts the store: until every peer is done (bounded by a heartbeat
        timeout), so that none loses the store before its last word."""
        keys = [self.key(r) for r in self.peers]

        def others_done(client) -> bool:
            present = [k for k in keys if client.check([k])]
            states = [json.loads(raw) for raw in client.multi_get(present)] if present else []
            return len(present) == len(keys) and all(
                s.get("phase") == "done" or s.get("crashed") or s.get("verdict") for s in states
            )

        deadline = time.monotonic() + self.bounds.heartbeat_timeout_s
        while time.monotonic() < deadline:
            status, done = self.calls.call(others_done, 1.0)
            if status != "ok" or done:
                return
            time.sleep(min(0.05, self.bounds.interval_s))

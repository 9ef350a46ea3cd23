"""Fault drills: make one rank fail on purpose, at a chosen phase and step.

The watchdog and the launcher's relaunch are tested (and can be rehearsed on a cluster)
by injecting a real fault into a real job::

    CQK_FAULT="rank=1,phase=step,step=30,action=kill" cqk submit ...

Fields (comma-separated ``key=value``):

- ``action``: ``crash`` (raise ``InjectedFault`` in the main thread), ``exit`` (exit
  code 3 at once, no cleanup), ``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself: alive
  but silent), ``hang`` (the main thread blocks forever while the process stays alive: a
  deadlock);
- ``phase``: ``rendezvous``, ``startup``, ``data``, ``step``, ``eval``, ``save`` or
  ``shutdown`` (the watchdog's phases), and ``step``: the step being trained or saved
  (default: any); ``rank`` (default 0);
- ``delay_s``: for ``kill`` and ``stop``, act this long after the phase began, from a
  timer thread, so that the fault lands inside the phase;
- ``when``: for ``kill`` and ``stop``, act as soon as a file matching this glob exists
  (e.g. a checkpoint's first shard in ``iter_0000050.tmp/model/``: mid-write), polled
  every 5 ms from a thread, at most 60 s;
- ``once``: a file path; the fault fires only if the file does not exist, and creates it
  (so a relaunched job is not hit again). Without it, every attempt is hit the same way.

Several faults are separated by ``;`` (each with its own ``once`` file, they hit one
attempt after another). Nothing happens unless ``CQK_FAULT`` is set.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cqk_megatron.errors import EXIT_INJECTED

ACTIONS = ("crash", "exit", "kill", "stop", "hang")
PHASES = ("rendezvous", "startup", "data", "step", "eval", "save", "shutdown")


class InjectedFault(RuntimeError):
    """The ``crash`` drill."""


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    step: int | None = None
    rank: int = 0
    delay_s: float = 0.0
    when: str | None = None
    once: str | None = None

    def matches(self, phase: str, step: int, rank: int) -> bool:
        return (
            phase == self.phase and rank == self.rank and (self.step is None or step == self.step)
        )


def parse(text: str) -> Fault:
    """``CQK_FAULT``'s value; a clear error names the bad field."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"CQK_FAULT: {item!r} is not key=value")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"action", "phase", "step", "rank", "delay_s", "when", "once"}
    if unknown:
        raise ValueError(f"CQK_FAULT: unknown keys {sorted(unknown)}")
    if fields.get("action") not in ACTIONS:
        raise ValueError(f"CQK_FAULT: action must be one of {list(ACTIONS)}")
    if fields.get("phase") not in PHASES:
        raise ValueError(f"CQK_FAULT: phase must be one of {list(PHASES)}")
    return Fault(
        action=fields["action"],
        phase=fields["phase"],
        step=int(fields["step"]) if "step" in fields else None,
        rank=int(fields.get("rank", 0)),
        delay_s=float(fields.get("delay_s", 0)),
        when=fields.get("when"),
        once=fields.get("once"),
    )


_FAULTS: list[Fault] | None = None


def planned() -> list[Fault]:
    global _FAULTS
    if _FAULTS is None:
        text = os.environ.get("CQK_FAULT", "")
        _FAULTS = [parse(part) for part in text.split(";") if part.strip()]
    return _FAULTS


def on_phase(phase: str, step: int, rank: int) -> None:
    """Called as ``phase`` begins (by the watchdog, and before rendezvous)."""
    for fault in planned():
        if fault.matches(phase, step, rank):
            _fire(fault, phase, step, rank)


def _fire(fault: Fault, phase: str, step: int, rank: int) -> None:
    if fault.once is not None:
        marker = Path(fault.once)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            with marker.open("x") as handle:  # atomic: only the first attempt fires
                handle.write(f"{phase} step {step} rank {rank} pid {os.getpid()}\n")
        except FileExistsError:
            return
    print(
        f"CQK_FAULT: rank {rank} (pid {os.getpid()}) injects '{fault.action}' in phase "
        f"{phase} at step {step}",
        flush=True,
    )
    if fault.action in ("kill", "stop") and fault.when:
        threading.Thread(target=_act_when, args=(fault.action, fault.when), daemon=True).start()
        return
    if fault.action in ("kill", "stop") and fault.delay_s > 0:
        threading.Timer(fault.delay_s, _act, args=(fault.action,)).start()
        return
    _act(fault.action)


def _act_when(action: str, pattern: str) -> None:
    deadline = time.monotonic() + 60
    while not glob.glob(pattern):
        if time.monotonic() > deadline:
            print(f"CQK_FAULT: gave up: no {pattern} within 60 s", flush=True)
            return
        time.sleep(0.005)
    print(f"CQK_FAULT: {pattern} exists", flush=True)
    _act(action)


def _act(action: str) -> None:
    # The moment of the fault, for measuring how long its detection takes.
    print(f"CQK_FAULT: {action} at t={time.time():.3f}", flush=True)
    if action == "crash":
        raise InjectedFault("CQK_FAULT: injected crash")
    if action == "exit":
        os._exit(EXIT_INJECTED)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "hang":
        while True:  # a deadlocked main thread: the watchdog thread keeps running
            time.sleep(3600)

"""Phase time limits: the main thread marks what it is doing (start-up, data loading, a
step, evaluation, a save, shutdown), each phase has a bound (``Bounds``), and a rank whose
main thread overruns it is stuck (``judge_phases``): deadlocked, or in a collective that
one peer never joined."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from cqk_megatron.training.resilience import faults
from cqk_megatron.training.resilience.progress import stopped_ranks
from cqk_megatron.training.resilience.verdict import verdict

# Phases that are long and rare: a beat at once tells the peers (steps beat on the clock).
ANNOUNCED = ("eval", "save", "shutdown")
# Phases past a rank's last collective: its silence stalls nobody.
OVER = ("shutdown", "done")


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
            interval_s=t.resilience.heartbeat_interval_s,
            heartbeat_timeout_s=t.resilience.heartbeat_timeout_s,
            init_s=t.resilience.init_timeout_s,
            step_s=t.resilience.step_timeout_s,
            save_s=t.resilience.save_timeout_s,
            collective_s=t.resilience.collective_timeout_s,
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
class Phase:
    name: str
    step: int
    started: float  # time.monotonic()
    bound_s: float


class PhaseClock:
    """The main thread's current phase (read by the heartbeat thread: one attribute,
    replaced whole), and the collective timeouts that go with the phases."""

    def __init__(self, bounds: Bounds, rank: int, announce: Callable[[], None]) -> None:
        self.bounds, self.rank = bounds, rank
        self._announce = announce  # a long phase began: beat now
        self.current = Phase("startup", 0, time.monotonic(), bounds.phase("startup"))
        self.steps_begun = 0

    def enter(self, name: str, step: int) -> None:
        """The main thread begins phase ``name`` (of step ``step``); it lasts until the next
        ``enter``. The first time a second step begins, start-up is over on every rank:
        after a barrier, every group's collectives get ``collective_timeout_s``."""
        if name == "step":
            self.steps_begun += 1
            if self.steps_begun == 2:
                self._lower_collective_timeout()
        first = name == "step" and self.steps_begun == 1
        self.current = Phase(name, step, time.monotonic(), self.bounds.phase(name, first))
        if name in ANNOUNCED:
            self._announce()
        faults.on_phase(name, step, self.rank)

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None):
        """Phase ``name`` for the body, then back to the enclosing phase (its clock
        restarted). A save's collectives (barriers behind rank 0's manifest hashing) may
        take as long as the save: their timeout is raised for it."""
        outer = self.current
        collective_timeout_s = self.bounds.phase_collective_s(name)
        self.enter(name, outer.step if step is None else step)
        if collective_timeout_s is not None:
            from cqk_megatron.parallel.process_groups import set_collective_timeout

            set_collective_timeout(collective_timeout_s)
        try:
            yield
        finally:
            if collective_timeout_s is not None:
                from cqk_megatron.parallel.process_groups import set_collective_timeout

                set_collective_timeout(
                    self.bounds.collective_s if self.steps_begun >= 2 else self.bounds.init_s
                )
            self.current = Phase(outer.name, outer.step, time.monotonic(), outer.bound_s)

    def done(self) -> None:
        """No bound from now on: this rank is done."""
        self.current = Phase("done", self.current.step, time.monotonic(), float("inf"))

    def _lower_collective_timeout(self) -> None:
        from cqk_megatron.parallel.process_groups import set_collective_timeout
        from cqk_megatron.training import collectives

        # torchtitan's order: agree that start-up is over, then lower; else a fast rank's
        # short timeout could expire on a peer still finishing its first step.
        collectives.barrier()
        set_collective_timeout(self.bounds.collective_s)


def judge_phases(states: dict[int, dict], heartbeat_timeout_s: float) -> dict | None:
    """The verdict on the ranks (published states, ages as of now) whose phase overran its
    bound, or None. First from how far each rank got (``progress.stopped_ranks``): a rank
    that has issued fewer collectives than its peers stopped, and they wait for it,
    wherever their main threads block. Where every rank issued the same, those whose main
    thread is not waiting in ``torch.distributed`` are the cause; if every one waits, the
    furthest behind are named."""
    over = {
        r: s
        for r, s in states.items()
        if s.get("bound_s") is not None and s["age_s"] > s["bound_s"] and s["phase"] != "done"
    }
    if not over:
        return None
    stopped, why_stopped = stopped_ranks(states)
    if stopped:
        return _stopped_verdict(stopped, why_stopped, over)
    culprits = [r for r, s in over.items() if not s.get("waiting")]
    if culprits:
        why = "overran"
    else:
        # Only ranks that wait in a collective overran: the one they wait for is
        # likely just behind (its clock started later, or its last beat is older).
        # Give it a heartbeat timeout to overrun too; then name the waiters furthest
        # behind (a collective that never completes on any rank).
        if max(s["age_s"] - s["bound_s"] for s in over.values()) < heartbeat_timeout_s:
            return None
        low = min(s["step"] for s in over.values())
        culprits = [r for r, s in over.items() if s["step"] == low]
        why = "overran (waiting in a collective)"
    first = over[culprits[0]]
    return verdict(
        sorted(culprits),
        first,
        f"{why} phase '{first['phase']}': {first['age_s']:.1f} s, bound {first['bound_s']:g} s "
        f"(main thread at {first.get('where', '?')})",
        first["age_s"] - first["bound_s"],
        kind="stuck",
    )


def _stopped_verdict(stopped: list[int], why: str, over: dict[int, dict]) -> dict | None:
    """The verdict on the ranks that stopped, once their own phase has overrun its bound
    (before that they are busy within it, a save say, and the others wait as they should)."""
    culprits = [r for r in stopped if r in over]
    if not culprits:
        return None
    first = over[culprits[0]]
    return verdict(
        culprits,
        first,
        f"overran phase '{first['phase']}': {first['age_s']:.1f} s, bound "
        f"{first['bound_s']:g} s; {why} (main thread at {first.get('where', '?')})",
        first["age_s"] - first["bound_s"],
        kind="stuck",
    )

"""The watchdog's verdict: which rank(s) it names, and why, in one dict that is printed
(``verdict_line``), appended to ``RUN/faults.jsonl`` (``append_fault``) and published to
the peers (who adopt it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from cqk_megatron.errors import EXIT_WATCHDOG
from cqk_megatron.run.folder import FAULTS


def verdict(ranks: list[int], state: dict, reason: str, late_s: float, kind: str) -> dict:
    """``kind``: ``silent`` (no heartbeat), ``crashed`` (a peer's own error), ``stuck`` (a
    phase overran its bound) or ``store`` (the job's store is gone); ``state`` is the named
    rank's last published state (host, PID, step, phase), ``late_s`` how far past its
    bound it was."""
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


def verdict_line(verdict: dict, rank: int, host: str, symptom: str | None) -> str:
    """The one line every surviving rank prints: who is lost, why, and that this rank
    (``rank`` on ``host``) exits to be relaunched; ``symptom``: what this rank saw first."""
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
    seen = f" Seen here first as: {symptom}." if symptom else ""
    return (
        f"watchdog: {subject} {verdict['reason']}.{seen} "
        f"Rank {rank} on {host} exits {EXIT_WATCHDOG} so that the job is "
        "relaunched from its last complete checkpoint."
    )


def append_fault(run_dir: Path | None, record: dict) -> None:
    """One line in ``RUN/faults.jsonl`` (one short write), timed; nothing without a run
    folder, and nothing if it cannot be written (the line is on stderr anyway)."""
    if run_dir is None:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with (run_dir / FAULTS).open("a") as handle:
            handle.write(json.dumps({**record, "time": time.time()}) + "\n")
    except OSError:
        pass


def first_line(error: BaseException, limit: int) -> str:
    """The message's first line, without the C++ source location gloo puts first."""
    text = (str(error).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:limit]

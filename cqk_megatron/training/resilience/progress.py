"""How far each rank got: the collectives it has issued, per process group.

Where a rank's main thread blocks says little about who stopped: under NCCL a collective
returns once it is queued, and a healthy rank then waits on its peer in ``.item()``, a
device synchronize or a ``work.wait()`` in Megatron's or DeepSpeed's code, never inside
``torch.distributed``. What does tell is each rank's last completed step in the job's
common sequence: every member of a group issues that group's collectives in the same order,
and c10d numbers them (``ProcessGroup._get_sequence_number_for_group``, the counter of
NCCL's desync report). A member that has issued fewer than its peers on some group
stopped before the collective they wait in (or inside it, before issuing it); the
others wait for it.
"""

from __future__ import annotations

import torch.distributed as dist


def issued_collectives() -> dict[str, int]:
    """This rank's count of collectives issued on each of its process groups, keyed by
    the group's name (the same on every member: c10d names groups in creation order,
    which every rank follows). Safe to call from another thread: counters are read, not
    changed; a group being created or destroyed meanwhile is skipped."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    from torch.distributed.distributed_c10d import _world

    issued = {}
    try:
        groups = list(_world.pg_names.items())
    except RuntimeError:  # the main thread changed the dict while it was copied
        return {}
    for group, name in groups:
        try:
            issued[name] = int(group._get_sequence_number_for_group())
        except (RuntimeError, AttributeError, TypeError):  # a process group without the counter
            continue
    return issued


def stopped_ranks(states: dict[int, dict]) -> tuple[list[int], str]:
    """The ranks behind their peers on some group and ahead of none (the rank that
    stopped, not those waiting for it, which may themselves be behind on another group),
    and why; ``[]`` when every group's members have issued the same collectives."""
    behind: dict[int, str] = {}
    ahead: set[int] = set()
    for group, counts in _counts_by_group(states).items():
        most = max(counts.values())
        late = {rank: count for rank, count in counts.items() if count < most}
        if not late:
            continue
        ahead.update(rank for rank, count in counts.items() if count == most)
        for rank, count in late.items():
            behind.setdefault(
                rank,
                f"it issued {count} collectives on process group {group!r} where its peers "
                f"issued {most}, so it stopped before the one they wait in",
            )
    stopped = sorted(rank for rank in behind if rank not in ahead)
    return stopped, behind[stopped[0]] if stopped else ""


def _counts_by_group(states: dict[int, dict]) -> dict[str, dict[int, int]]:
    """Each group's members (those that published it) and their counts."""
    by_group: dict[str, dict[int, int]] = {}
    for rank, state in states.items():
        for group, count in (state.get("issued") or {}).items():
            by_group.setdefault(group, {})[rank] = count
    return by_group

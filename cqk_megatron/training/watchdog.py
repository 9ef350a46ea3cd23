"""The old import path of ``cqk_megatron.training.resilience.watchdog``, kept for one
release: new code imports ``cqk_megatron.training.resilience.watchdog``."""

from cqk_megatron.training.resilience.watchdog import (  # noqa: F401 - re-exported
    Bounds,
    Watchdog,
    current,
    enter,
    phase,
    record_rendezvous_failure,
    watching,
)

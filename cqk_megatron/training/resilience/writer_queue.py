"""The queue that carries Megatron's checkpoint-write results to the rank, held by a
helper process that stores them as pickled bytes.

Megatron's filesystem writer puts each save's results (``WriteResult``s, torch
objects) in a ``multiprocessing`` manager's queue. A plain manager queue unpickles every
item in the helper, and so imports torch there at the first save: about 3 CPU-s per
rank per run (measured), with the save waiting on it. Here the items cross already
pickled, both ways; the helper holds bytes and never imports more than this module
(standard library only, on purpose: the spawned helper imports the module of its manager
class).
"""

from __future__ import annotations

import pickle
import queue
from multiprocessing.managers import BaseProxy, SyncManager


class PickledQueueProxy(BaseProxy):
    """A ``queue.Queue`` in the helper, its items pickled here and unpickled here."""

    _exposed_ = ("put", "get", "get_nowait", "empty", "qsize")

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        self._callmethod("put", (pickle.dumps(item), block, timeout))

    def get(self, block: bool = True, timeout: float | None = None):
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self):
        return pickle.loads(self._callmethod("get_nowait"))

    def empty(self) -> bool:
        return self._callmethod("empty")

    def qsize(self) -> int:
        return self._callmethod("qsize")


class WriterResultsManager(SyncManager):
    """``SyncManager`` with ``PickledQueue()``: what Megatron's
    ``filesystem_async._get_write_results_queue`` makes, minus the helper's torch."""


WriterResultsManager.register("PickledQueue", queue.Queue, PickledQueueProxy)

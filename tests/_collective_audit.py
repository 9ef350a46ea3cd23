"""Record every ``torch.distributed`` collective that this package's code calls (tests only).

``install`` wraps each communicating function of ``torch.distributed`` (the list is
``collectives.COMMUNICATING``). A call whose immediate caller is a module of
``cqk_megatron`` is counted under (caller file, function, devices of its tensors);
Megatron's and DeepSpeed's own collectives (their callers are theirs) pass uncounted.
Code that looks the function up at call time (``dist.all_reduce(...)``, as this package
does) goes through the wrapper.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

import cqk_megatron
from cqk_megatron.training.collectives import COMMUNICATING

PACKAGE = Path(cqk_megatron.__file__).resolve().parent
REPO = PACKAGE.parent


def _devices(values) -> set[str]:
    found = set()
    for value in values:
        if isinstance(value, torch.Tensor):
            found.add(str(value.device))
        elif isinstance(value, (list, tuple)):
            found |= _devices(value)
    return found


def install(counts: Counter) -> None:
    """Count into ``counts`` every package call of a communicating collective."""
    for name in sorted(COMMUNICATING):
        original = getattr(dist, name, None)
        if original is None or hasattr(original, "_audited"):
            continue

        def audited(*args, _name=name, _original=original, **kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename).resolve()
            if caller.is_relative_to(PACKAGE):
                devices = ",".join(sorted(_devices([*args, *kwargs.values()]))) or "-"
                counts[(caller.relative_to(REPO).as_posix(), _name, devices)] += 1
            return _original(*args, **kwargs)

        audited._audited = True
        setattr(dist, name, audited)


# -- the data-parallel traffic of the engines (tests/test_comm_audit.py) --------------------
# Unlike ``install``, this recorder sees every caller: DeepSpeed's and Megatron's own
# collectives are what it is for.

# Each function's tensor argument whose size is the call's payload: the whole buffer a
# reduction reduces, the whole buffer a gather fills (output).
_PAYLOAD = {  # (keyword, position)
    "all_reduce": ("tensor", 0),
    "reduce": ("tensor", 0),
    "reduce_scatter_tensor": ("input", 1),
    "_reduce_scatter_base": ("input", 1),
    "all_gather_into_tensor": ("output_tensor", 0),
    "_all_gather_base": ("output_tensor", 0),
    "all_gather": ("tensor_list", 0),
    "reduce_scatter": ("input_list", 1),
    "broadcast": ("tensor", 0),
}
_KIND = {
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
}
# DeepSpeed runs its backward epilogue (the last bucket's reduction) from an autograd
# callback queued for when every gradient of the backward is computed
# (``runtime/base_optimizer.py``: ``queue_post_backward_callback``): autograd is still
# running then, yet nothing is left for the reduction to overlap.
_AFTER_THE_GRADIENTS = frozenset({"run_grad_acc_post_hooks", "_run_post_backward"})
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _elements_and_dtype(payload) -> tuple[int, str]:
    tensors = payload if isinstance(payload, (list, tuple)) else [payload]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not tensors:
        return 0, "-"
    dtype = _DTYPES.get(tensors[0].dtype, str(tensors[0].dtype).removeprefix("torch."))
    return sum(t.numel() for t in tensors), dtype


def _backward_running() -> int | None:
    """The running backward's id, None outside a backward and inside DeepSpeed's epilogue."""
    task = torch._C._current_graph_task_id()
    if task == -1:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _AFTER_THE_GRADIENTS:
            return None
        frame = frame.f_back
    return task


def _library_caller() -> str:
    """``file:function`` of the first frame outside torch.distributed and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        inside = ("torch/distributed", "deepspeed/comm/", "_collective_audit.py")
        if not any(part in path for part in inside):
            parts = Path(path).parts
            start = next(
                (i for i, p in enumerate(parts) if p in ("deepspeed", "megatron", "cqk_megatron")),
                len(parts) - 1,
            )
            return f"{'/'.join(parts[start:])}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class TrafficRecorder:
    """Every collective any code issues, one dict per call: ``step`` (the training step
    it belongs to, None outside one), ``kind``, ``group`` (its global ranks), ``elements``
    (the payload: the whole buffer reduced, or the whole buffer gathered), ``dtype``,
    ``in_backward`` and ``caller``. Nested calls (a collective made of others) count once.

    ``in_backward``: issued while autograd runs a backward that computes at least one more
    parameter gradient afterwards (``count_gradients`` must have hooked the model's
    parameters; their hooks run after the engines', so the gradient whose hook issues a
    call counts as computed before it): what the call can overlap with.
    One recorder a process: ``install`` it once, then ``clear`` it between runs."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.step: int | None = None
        self._depth = 0
        self._gradients: dict[int, int] = {}  # backward id -> parameter gradients so far
        self._hooked: set[int] = set()

    def count_gradients(self, parameters) -> None:
        """Count each parameter gradient autograd computes, per backward."""
        for param in parameters:
            if param.requires_grad and id(param) not in self._hooked:
                self._hooked.add(id(param))
                param.register_post_accumulate_grad_hook(self._gradient_computed)

    def _gradient_computed(self, _param) -> None:
        task = torch._C._current_graph_task_id()
        self._gradients[task] = self._gradients.get(task, 0) + 1

    def finished(self) -> list[dict]:
        """The calls, each ``in_backward`` decided now that every backward has ended."""
        for call in self.calls:
            task = call.pop("backward", None)
            before = call.pop("gradients_before", 0)
            if "in_backward" not in call:
                call["in_backward"] = task is not None and before < self._gradients.get(task, 0)
        return self.calls

    def clear(self) -> None:
        self.calls.clear()
        self.step = None
        self._gradients.clear()
        self._hooked.clear()

    def install(self) -> None:
        for name in _PAYLOAD:
            original = getattr(dist, name, None)
            if original is not None and not hasattr(original, "_recorded"):
                setattr(dist, name, self._wrap(name, original))
        # Megatron binds its reduce-scatter and all-gather at import (``param_and_grad_buffer``)
        from megatron.core.distributed import param_and_grad_buffer as buffers

        for attribute in ("dist_reduce_scatter_func", "dist_all_gather_func"):
            original = getattr(buffers, attribute)
            if not hasattr(original, "_recorded"):
                setattr(buffers, attribute, self._wrap(original.__name__, original))

    def _wrap(self, name: str, original):
        def recorded(*args, **kwargs):
            if self._depth == 0:
                self._record(name, args, kwargs)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        recorded._recorded = True
        return recorded

    def _record(self, name: str, args, kwargs) -> None:
        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        keyword, position = _PAYLOAD[name]
        payload = kwargs[keyword] if keyword in kwargs else args[position]
        elements, dtype = _elements_and_dtype(payload)
        task = _backward_running()
        self.calls.append(
            {
                "step": self.step,
                "kind": _KIND.get(name, name),
                "group": dist.get_process_group_ranks(group or dist.group.WORLD),
                "elements": elements,
                "dtype": dtype,
                "backward": task,
                "gradients_before": self._gradients.get(task, 0),
                "caller": _library_caller(),
            }
        )

"""Ranks for tests/test_engine_memory.py: the real training loop on DeepSpeed ZeRO-2 or
Megatron's distributed optimizer, their buffers measured where they are largest (tests
only).

PyTorch has no allocator statistics on CPU, so each component is measured as the bytes of
the distinct storages that the engine holds for it at its peak. DeepSpeed: the gradient
buckets and the fp32 copy at each all-reduce (the copy is the tensor reduced), the fp32
gradient partition when the step starts, the master weights and Adam moments after it.
Megatron: its DDP's parameter and gradient buffers and the optimizer's fp32 shards and
moments after a step.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from _training import set_rank_env, train_runs


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@contextlib.contextmanager
def _measuring(measured: dict):
    """The loop's engine with the gradient bucket of ``perf.traffic`` (the rule the engine
    shares with the step-time model) and every buffer of its ZeRO optimizer measured."""
    import torch.distributed as dist

    from cqk_megatron.perf.traffic import reduce_bucket_elements
    from cqk_megatron.training import loop
    from cqk_megatron.training.engines import deepspeed as deepspeed_engine

    original_engine, original_config = loop.make_engine, deepspeed_engine.deepspeed_config
    original_all_reduce = dist.all_reduce

    def make_engine(model, config):
        parameters = sum(p.numel() for p in model.parameters())
        dp = dist.get_world_size()
        bucket = reduce_bucket_elements(parameters, dp)
        largest = max(p.numel() for p in model.parameters())
        measured.update(count=parameters, dp=dp, bucket=bucket, largest=largest)

        def with_bucket(*args, **kwargs):
            ds = original_config(*args, **kwargs)
            ds["zero_optimization"]["reduce_bucket_size"] = bucket
            return ds

        deepspeed_engine.deepspeed_config = with_bucket
        try:
            engine = original_engine(model, config)
        finally:
            deepspeed_engine.deepspeed_config = original_config
        _watch(engine.optimizer, model, measured)
        return engine

    def all_reduce(tensor, *args, **kwargs):
        optimizer = measured.get("_optimizer")
        if optimizer is not None and tensor.numel() > 64:
            buckets = [b for bucket in optimizer.ipg_buckets.values() for b in bucket.buffer]
            _peak(measured, "reduce_buckets", _storage_bytes(buckets))
            if tensor.dtype.is_floating_point and tensor.element_size() == 4:
                _peak(measured, "reduction_copy", tensor.numel() * 4)
        return original_all_reduce(tensor, *args, **kwargs)

    loop.make_engine, dist.all_reduce = make_engine, all_reduce
    try:
        yield
    finally:
        loop.make_engine, dist.all_reduce = original_engine, original_all_reduce


def _peak(measured: dict, key: str, value: int) -> None:
    measured[key] = max(measured.get(key, 0), value)


def _watch(optimizer, model, measured: dict) -> None:
    """Measure the fp32 gradient partition as the step starts, the optimizer's states and
    the parameters after it."""
    measured["_optimizer"] = optimizer
    step = optimizer.step

    def measured_step(*args, **kwargs):
        grads = [g for group in optimizer.averaged_gradients.values() for g in group]
        _peak(measured, "gradients", _storage_bytes(grads))
        result = step(*args, **kwargs)
        masters = list(optimizer.single_partition_of_fp32_groups)
        moments = [
            value
            for state in optimizer.optimizer.state.values()
            for value in state.values()
            if hasattr(value, "untyped_storage") and value.numel() > 1
        ]
        _peak(measured, "optimizer", _storage_bytes(masters + moments))
        _peak(measured, "parameters", _storage_bytes(list(model.parameters())))
        return result

    optimizer.step = measured_step


def measure_zero2_buffers(rank, world_size, port, root, overrides) -> None:
    """One short run; each rank writes what it measured to ``root/measured_<rank>.json``."""
    set_rank_env(rank, world_size, port)
    measured: dict = {}
    with _measuring(measured):
        train_runs(rank, world_size, port, root, [("zero2", overrides)])
    measured.pop("_optimizer", None)
    Path(root, f"measured_{rank}.json").write_text(json.dumps(measured))


def _megatron_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def _measuring_megatron(measured: dict):
    """The loop's Megatron engine, measured after its first step."""
    from cqk_megatron.training import loop

    original = loop.make_engine

    def make_engine(model, config):
        engine = original(model, config)
        measured["count"] = sum(p.numel() for p in model.parameters())
        step = engine.train_step

        def measured_step(micro_batches):
            result = step(micro_batches)
            buffers = [b for chunk in engine.chunks for b in chunk.buffers]
            _peak(measured, "parameters", _storage_bytes([b.param_data for b in buffers]))
            _peak(measured, "gradients", _storage_bytes([b.grad_data for b in buffers]))
            states = []
            for opt in _megatron_optimizers(engine.optimizer):
                for groups in (opt.shard_fp32_from_float16_groups, opt.shard_fp32_groups):
                    states += [t for group in groups for t in group]
                states += [
                    v
                    for state in opt.optimizer.state.values()
                    for v in state.values()
                    if hasattr(v, "untyped_storage") and v.numel() > 1
                ]
            _peak(measured, "optimizer", _storage_bytes(states))
            return result

        engine.train_step = measured_step
        return engine

    loop.make_engine = make_engine
    try:
        yield
    finally:
        loop.make_engine = original


def measure_distopt_buffers(rank, world_size, port, root, overrides) -> None:
    """One short run on the distributed optimizer; ``root/distopt_<rank>.json``."""
    set_rank_env(rank, world_size, port)
    measured: dict = {}
    with _measuring_megatron(measured):
        train_runs(rank, world_size, port, root, [("distopt", overrides)])
    Path(root, f"distopt_{rank}.json").write_text(json.dumps(measured))


def _gathered_bytes(model) -> int:
    """Bytes of the whole (gathered) copies that ZeRO-3 holds now of the parameters it
    partitions: a released parameter's data is an empty tensor."""
    return _storage_bytes([p.data for p in model.parameters() if not p.ds_persist])


def _persistent_bytes(model) -> int:
    """The whole copies of the parameters under ``stage3_param_persistence_threshold``,
    which ZeRO-3 never releases (their partitions are in the flat bf16 partition)."""
    return _storage_bytes([p.data for p in model.parameters() if p.ds_persist])


@contextlib.contextmanager
def _measuring_zero3(measured: dict):
    """The loop's DeepSpeed engine as it configures ZeRO-3, and every buffer of its stage-3
    optimizer and parameter coordinator measured where it is largest: the gathered
    parameters after each module's fetch (and prefetch), the bucket and any fp32 copy
    at each reduction, the states after the step."""
    import torch.distributed as dist
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.partitioned_param_coordinator import (
        PartitionedParameterCoordinator,
    )

    from cqk_megatron.training import loop

    original_engine = loop.make_engine
    original_fetch = PartitionedParameterCoordinator.fetch_sub_module
    original_all_reduce = dist.all_reduce
    original_scatter = coalesced_collectives._torch_reduce_scatter_fn
    state: dict = {}

    def make_engine(model, config):
        engine = original_engine(model, config)
        optimizer = engine.optimizer
        state.update(optimizer=optimizer, model=model)
        measured.update(
            count=sum(p.ds_numel for p in model.parameters()),
            dp=dist.get_world_size(),
            bucket=optimizer.reduce_bucket_size,
            largest=max(p.ds_numel for p in model.parameters()),
            persistent_count=sum(p.ds_numel for p in model.parameters() if p.ds_persist),
        )
        _watch_zero3(optimizer, model, measured)
        return engine

    def fetch_sub_module(self, current_submodule, *args, **kwargs):
        result = original_fetch(self, current_submodule, *args, **kwargs)
        # in training; an evaluation's forward keeps for a backward that never comes what
        # the trace reuses there, but holds no gradients or activations for it either
        if "model" in state and current_submodule.training:
            _peak(measured, "gathered_parameters", _gathered_bytes(state["model"]))
        return result

    def reduced(tensor) -> None:
        optimizer = state.get("optimizer")
        if optimizer is None or tensor.numel() <= 64:
            return
        buckets = [bucket.buffer for bucket in optimizer.ipg_buckets.values()]
        _peak(measured, "reduce_buckets", _storage_bytes(buckets))
        in_bucket = {b.untyped_storage().data_ptr() for b in buckets if b is not None}
        if tensor.untyped_storage().data_ptr() not in in_bucket and tensor.element_size() == 4:
            _peak(measured, "reduction_copy", tensor.numel() * 4)

    def all_reduce(tensor, *args, **kwargs):
        reduced(tensor)
        return original_all_reduce(tensor, *args, **kwargs)

    def reduce_scatter(input_tensor, *args, **kwargs):
        reduced(input_tensor)
        return original_scatter(input_tensor, *args, **kwargs)

    loop.make_engine, dist.all_reduce = make_engine, all_reduce
    PartitionedParameterCoordinator.fetch_sub_module = fetch_sub_module
    coalesced_collectives._torch_reduce_scatter_fn = reduce_scatter
    try:
        yield
    finally:
        loop.make_engine, dist.all_reduce = original_engine, original_all_reduce
        PartitionedParameterCoordinator.fetch_sub_module = original_fetch
        coalesced_collectives._torch_reduce_scatter_fn = original_scatter


def _watch_zero3(optimizer, model, measured: dict) -> None:
    """The fp32 gradient partitions as the step starts; the bf16 partitions, the whole
    persistent parameters, the fp32 master partitions and Adam moments after it."""
    step = optimizer.step

    def measured_step(*args, **kwargs):
        _peak(measured, "gradients", _storage_bytes([optimizer.grad_partitions_flat_buffer]))
        result = step(*args, **kwargs)
        moments = [
            value
            for state in optimizer.optimizer.state.values()
            for value in state.values()
            if hasattr(value, "untyped_storage") and value.numel() > 1
        ]
        masters = list(optimizer.fp32_partitioned_groups_flat)
        _peak(measured, "optimizer", _storage_bytes(masters + moments))
        _peak(measured, "parameters", _storage_bytes(optimizer.fp16_partitioned_groups_flat))
        _peak(measured, "persistent_parameters", _persistent_bytes(model))
        return result

    optimizer.step = measured_step


def measure_zero3_buffers(rank, world_size, port, root, overrides) -> None:
    """One short ZeRO-3 run; each rank writes what it measured to ``root/zero3_<rank>.json``."""
    set_rank_env(rank, world_size, port)
    measured: dict = {}
    with _measuring_zero3(measured):
        train_runs(rank, world_size, port, root, [("zero3", overrides)])
    Path(root, f"zero3_{rank}.json").write_text(json.dumps(measured))

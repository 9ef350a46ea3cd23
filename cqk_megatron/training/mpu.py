"""Megatron's process groups under the names DeepSpeed asks an ``mpu`` for.

DeepSpeed counts replicated parameters once per group of ranks whose
``get_model_parallel_rank()`` is 0 and sums gradient norms over
``get_model_parallel_group()``. So: the rank is the tensor-parallel rank (each pipeline
stage's replicated parameters, its norms, are its own and must be counted), and the
group is Megatron's model-parallel group (tensor x pipeline), over which per-stage norms
add up. Data parallel is Megatron's data-parallel group.
"""

from __future__ import annotations

from megatron.core import parallel_state as ps


class MegatronMpu:
    def get_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    def get_model_parallel_group(self):
        return ps.get_model_parallel_group()

    def get_tensor_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return ps.get_tensor_model_parallel_group()

    def get_pipeline_model_parallel_rank(self) -> int:
        return ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_group(self):
        return ps.get_pipeline_model_parallel_group()

    def get_data_parallel_rank(self) -> int:
        return ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return ps.get_data_parallel_group()

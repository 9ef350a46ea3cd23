"""The seam between conversion and the training engine's checkpoint format.

Conversion works on full (TP=1, PP=1) state dicts with the names that
``build_model(config).named_parameters()`` gives under TP=1 and PP=1. These two
functions move such a state dict out of and into a run checkpoint folder
(``iter_XXXXXXX/`` with ``model/`` in Megatron's ``torch_dist`` format, ``config.yaml``
and ``manifest.json``) through the engine's own ``cqk_megatron.training.checkpoint``:
``torch_dist`` reshards on load, so one CPU process reads a checkpoint saved under any
TP/PP layout by loading it into a TP=1, PP=1 model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from cqk_megatron.config import RunConfig
from cqk_megatron.convert.errors import ConversionError


def single_process_config(config: RunConfig) -> RunConfig:
    """``config`` with the model whole on one process (TP=1, PP=1)."""
    single = copy.deepcopy(config)
    p = single.parallel
    p.tensor_parallel, p.pipeline_parallel = 1, 1
    p.virtual_pipeline, p.sequence_parallel, p.world_size = None, False, None
    return single


def _whole_model(config: RunConfig):
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_single_process

    single = single_process_config(config)
    init_single_process(single)
    return build_model(single)


def _engine_checkpoint():
    try:
        from cqk_megatron.training import checkpoint
    except ImportError as error:
        raise ConversionError(
            f"the training engine's checkpoint module is unavailable ({error}); "
            "convert a full state dict with export_state_dict instead"
        ) from error
    return checkpoint


def read_full_state_dict(
    checkpoint_dir: Path, config: RunConfig, config_source: str | None = None
) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint in ``checkpoint_dir``, whole and on CPU; a
    checkpoint whose tensors do not fit ``config`` (read from ``config_source``) is
    refused naming the differing fields, not with Megatron's shape errors."""
    checkpoint = _engine_checkpoint()
    model = _whole_model(config)
    source = config_source or "the config given"
    fix = (
        f"{source} is not the config this checkpoint was saved with; export it with that one "
        "(checkpoints written by cqk train carry it as config.yaml in their folder)"
    )
    try:
        checkpoint.load_model_weights(Path(checkpoint_dir), model, config, fix)
    except checkpoint.CheckpointError as error:
        raise ConversionError(str(error)) from error
    return {name: param.detach().to("cpu").clone() for name, param in model.named_parameters()}


def write_full_state_dict(
    state: dict[str, torch.Tensor], config: RunConfig, checkpoint_dir: Path
) -> None:
    """A weights-only checkpoint in ``checkpoint_dir`` that training starts from
    (``train.init_from``), under any layout."""
    from cqk_megatron.parallel.sharding import load_full_state

    checkpoint = _engine_checkpoint()
    model = _whole_model(config)
    load_full_state(model, state, 0, 0, 1, config.model.swiglu)
    checkpoint.save_weights(Path(checkpoint_dir), model, config)

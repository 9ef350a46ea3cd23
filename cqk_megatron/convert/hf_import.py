"""Import a Hugging Face folder back into a full Megatron state dict and ``RunConfig``.

Reads folders written by ``hf_export`` (``LlamaForCausalLM`` or ``CQKForCausalLM``,
with the run's config in ``cqk_run_config.yaml``), native Llama folders of a shape
cqk-megatron can build (RMSNorm, SwiGLU, default RoPE, no biases) and native GPT-2
folders with the exact GELU, whose config is derived from ``config.json``.
``import_checkpoint`` then writes the state as a run checkpoint for continued pretraining.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cqk_megatron.config import ConfigError, RunConfig, load_config, validate
from cqk_megatron.convert.checkpoint_io import write_full_state_dict
from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.gpt2_names import gpt2_to_megatron
from cqk_megatron.convert.hf_config import (
    CQK,
    GPT2,
    LLAMA,
    check_config_agrees,
    run_config_from_cqk,
    run_config_from_gpt2,
    run_config_from_llama,
)
from cqk_megatron.convert.hf_export import RUN_CONFIG_FILE
from cqk_megatron.convert.names import ModelShape, check_megatron_state, hf_to_megatron
from cqk_megatron.convert.output_dir import check_target
from cqk_megatron.convert.safetensors_io import has_weights, load_weights
from cqk_megatron.convert.tokenizer import SENTENCEPIECE_FILE
from cqk_megatron.run.checkpoint_files import weights_only_checkpoint

IMPORTABLE_MODEL_TYPES = (LLAMA, GPT2, CQK)


def read_hf_config(folder: Path) -> dict:
    """``config.json`` of a Hugging Face model folder, refusing anything else."""
    if not folder.is_dir():
        raise ConversionError(f"'{folder}' is not a folder; pass a Hugging Face model folder")
    path = folder / "config.json"
    if not path.is_file() or not has_weights(folder):
        raise ConversionError(
            f"'{folder}' is not a Hugging Face model folder: it needs config.json and "
            "model.safetensors (or model.safetensors.index.json)"
        )
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path}: not valid JSON ({error})") from error
    if hf.get("model_type") not in IMPORTABLE_MODEL_TYPES:
        raise ConversionError(
            f"{path}: model_type={hf.get('model_type')!r} cannot be imported; cqk-megatron "
            f"builds {list(IMPORTABLE_MODEL_TYPES)} models"
        )
    return hf


def run_config_for(folder: Path, hf: dict) -> RunConfig:
    saved = folder / RUN_CONFIG_FILE
    if saved.is_file():
        try:
            config = load_config(saved)
        except ConfigError as error:
            raise ConversionError(f"{saved}: {error}") from error
        check_config_agrees(config, hf, str(folder))
    elif hf["model_type"] == CQK:
        config = run_config_from_cqk(hf, str(folder / "config.json"))
        config.name = folder.name
    elif hf["model_type"] == GPT2:
        config = run_config_from_gpt2(hf, str(folder / "config.json"))
        config.name = folder.name
    else:
        config = run_config_from_llama(hf, str(folder / "config.json"))
        config.name = folder.name
    recorded = config.data.tokenizer
    if (recorded is None or not Path(recorded).exists()) and (
        folder / SENTENCEPIECE_FILE
    ).is_file():
        config.data.tokenizer = str((folder / SENTENCEPIECE_FILE).resolve())
    try:
        return validate(config)
    except ConfigError as error:
        raise ConversionError(f"{folder}: the imported config is not buildable: {error}") from error


def import_hf_folder(folder: str | Path) -> tuple[dict[str, torch.Tensor], RunConfig]:
    """The full (TP=1, PP=1) Megatron state dict and ``RunConfig`` of a Hugging Face folder."""
    folder = Path(folder)
    hf = read_hf_config(folder)
    config = run_config_for(folder, hf)
    tensors = load_weights(folder)
    gpt2 = hf["model_type"] == GPT2
    if config.model.tie_embeddings:
        # some writers store the tied head as well; Megatron holds the embedding only
        head = tensors.pop("lm_head.weight", None)
        embedding = tensors.get("transformer.wte.weight" if gpt2 else "model.embed_tokens.weight")
        if head is not None and embedding is not None and not torch.equal(head, embedding):
            raise ConversionError(
                f"{folder}: tie_word_embeddings is set but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )
    to_megatron = gpt2_to_megatron if gpt2 else hf_to_megatron
    state = to_megatron(tensors, ModelShape.from_run_config(config))
    check_megatron_state(state, config, f"'{folder}'")
    return state, config


def import_checkpoint(
    hf_dir: str | Path, checkpoint_dir: str | Path, overwrite: bool = False
) -> Path:
    """Write a Hugging Face folder as a run checkpoint that training resumes from."""
    checkpoint_dir = Path(checkpoint_dir)
    # only what an import writes may be replaced: never a run's checkpoint or the input
    check_target(
        checkpoint_dir,
        overwrite,
        inputs=[Path(hf_dir)],
        replaceable=weights_only_checkpoint,
        command="cqk convert import",
    )
    state, config = import_hf_folder(hf_dir)
    write_full_state_dict(state, config, checkpoint_dir)
    return checkpoint_dir

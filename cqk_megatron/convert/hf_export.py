"""Export a full Megatron state dict (or a run's checkpoint) to a Hugging Face folder.

``export_state_dict`` is the whole conversion from a full (TP=1, PP=1) state dict with
Megatron's parameter names and the run's ``RunConfig``. ``export_checkpoint`` finds a
checkpoint and its ``config.yaml``, refuses folders that are not (complete)
checkpoints, gathers the full state dict with ``read_full_state_dict`` and hands it on.

The folder holds ``config.json``, ``generation_config.json``, the weights as
safetensors (sharded above ``max_shard_size``), the tokenizer, ``README.md`` and
``cqk_run_config.yaml`` (the full ``RunConfig``, which the importer reads back); a
non-Llama variant adds ``configuration_cqk.py``, ``modeling_cqk.py``, a verbatim copy
of ``cqk_megatron/variants/plain_math.py`` and ``cqk_variant.py``, the variant's classes
(``remote_source``). Standard attention exports to a native class where one is exact:
``LlamaForCausalLM`` (Llama family) or ``GPT2LMHeadModel`` (GPT-2 family).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from cqk_megatron.config import ConfigError, RunConfig, load_config, save_config, validate
from cqk_megatron.convert.checkpoint_io import read_full_state_dict
from cqk_megatron.convert.errors import ConversionError
from cqk_megatron.convert.gpt2_names import megatron_to_gpt2
from cqk_megatron.convert.hf_config import GPT2, check_exportable, hf_config_dict, native_model_type
from cqk_megatron.convert.hf_remote import REMOTE_CODE_DIR, REMOTE_CODE_FILES
from cqk_megatron.convert.model_card import model_card
from cqk_megatron.convert.names import (
    ModelShape,
    canonical_megatron_names,
    check_megatron_state,
    megatron_to_hf,
)
from cqk_megatron.convert.options import EXPORT_DTYPE_NAMES
from cqk_megatron.convert.output_dir import check_target, staged_folder
from cqk_megatron.convert.remote_source import EXPORTED_MATH_FILE, VARIANT_FILE, variant_source
from cqk_megatron.convert.safetensors_io import DEFAULT_MAX_SHARD, parse_size, save_weights
from cqk_megatron.convert.tokenizer import check_tokenizer, save_tokenizer, special_token_ids
from cqk_megatron.run.checkpoint_files import (
    LATEST,
    MANIFEST,
    WEIGHT_PARTS,
    CheckpointError,
    iterations,
    latest_name,
    verify,
)
from cqk_megatron.run.folder import CHECKPOINTS, CONFIG
from cqk_megatron.variants import plain_math

RUN_CONFIG_FILE = "cqk_run_config.yaml"
EXPORT_DTYPES = {name: getattr(torch, name) for name in EXPORT_DTYPE_NAMES}


def export_state_dict(
    state: dict[str, torch.Tensor],
    config: RunConfig,
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    with_tokenizer: bool = True,
    tokens_trained: int | None = None,
    validation_perplexity: float | None = None,
    iteration: int | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
    inputs: Sequence[Path] = (),
    license: str | None = None,
    datasets: Sequence[str] | None = None,
    base_model: str | None = None,
) -> Path:
    """Write the Hugging Face folder of a full Megatron state dict; returns ``out_dir``.

    ``license``, ``datasets`` and ``base_model`` go to the model card's metadata (and the
    exported run config's ``card`` section) in place of the run config's ``card.*``.

    ``tokenizer`` defaults to the run's ``data.tokenizer``; with ``with_tokenizer`` (the
    default) a missing one is an error. ``dtype`` (float32, bfloat16, float16) casts the
    weights; None keeps the checkpoint's. ``overwrite`` replaces an existing ``out_dir``,
    unless it is, holds or lies in a run folder, a checkpoint or one of ``inputs`` (the
    folders the state dict was read from).
    """
    out_dir = Path(out_dir)
    check_target(out_dir, overwrite, inputs=inputs)
    config = with_card(config, license=license, datasets=datasets, base_model=base_model)
    parse_size(max_shard_size)  # refuse a bad size before any work
    check_exportable(config)
    try:
        validate(config)
    except ConfigError as error:
        raise ConversionError(f"the run's config cannot describe a model: {error}") from error
    tokenizer_path = _resolve_tokenizer(config, tokenizer, with_tokenizer)
    if tokenizer_path is not None:
        check_tokenizer(tokenizer_path, config.model.vocab_size)
    special_ids = special_token_ids(tokenizer_path) if tokenizer_path is not None else {}

    state = canonical_megatron_names(state)
    check_megatron_state(state, config, "the state dict")
    target_dtype = _export_dtype(state, dtype)
    state = {name: tensor.detach().to("cpu", target_dtype) for name, tensor in state.items()}
    shape = ModelShape.from_run_config(config)
    native = native_model_type(config)
    hf_tensors = (megatron_to_gpt2 if native == GPT2 else megatron_to_hf)(state, shape)
    num_parameters = sum(t.numel() for t in state.values())

    with staged_folder(out_dir, overwrite, inputs) as staging:
        _write_json(staging / "config.json", hf_config_dict(config, target_dtype, special_ids))
        _write_json(staging / "generation_config.json", _generation_config(special_ids))
        save_weights(hf_tensors, staging, max_shard_size)
        if native is None:
            _copy_remote_code(staging, config)
        if tokenizer_path is not None:
            save_tokenizer(tokenizer_path, staging)
        save_config(config, staging / RUN_CONFIG_FILE)
        card = model_card(
            config,
            num_parameters,
            tokens_trained=tokens_trained,
            validation_perplexity=validation_perplexity,
            iteration=iteration,
            has_tokenizer=tokenizer_path is not None,
        )
        (staging / "README.md").write_text(card)
    return out_dir


def with_card(config: RunConfig, **given) -> RunConfig:
    """``config`` with the model card fields that are given (not None) replaced."""
    values = {key: value for key, value in given.items() if value is not None}
    if "datasets" in values:
        values["datasets"] = list(values["datasets"])
    return dataclasses.replace(config, card=dataclasses.replace(config.card, **values))


def _resolve_tokenizer(
    config: RunConfig, tokenizer: str | Path | None, with_tokenizer: bool
) -> Path | None:
    if not with_tokenizer:
        return None
    if tokenizer is not None:
        return Path(tokenizer)
    if config.data.tokenizer is None:
        raise ConversionError(
            "no tokenizer: the run's data.tokenizer is unset and none was given; pass the "
            "SentencePiece .model it trained with (--tokenizer PATH, tokenizer=...), or "
            "--no-tokenizer (with_tokenizer=False) to export the weights alone"
        )
    path = Path(config.data.tokenizer)
    if not path.exists():
        raise ConversionError(
            f"the run's tokenizer data.tokenizer='{path}' does not exist here; pass its "
            "current location with --tokenizer PATH (tokenizer=...)"
        )
    return path


def _export_dtype(state: dict[str, torch.Tensor], dtype: str | None) -> torch.dtype:
    if dtype is not None:
        if dtype not in EXPORT_DTYPES:
            raise ConversionError(f"dtype {dtype!r} is not one of {list(EXPORT_DTYPES)}")
        return EXPORT_DTYPES[dtype]
    found = {t.dtype for t in state.values()}
    if len(found) == 1 and (only := found.pop()) in EXPORT_DTYPES.values():
        return only
    return torch.float32  # mixed or fp64 (numerical checks): the safe common type


def _generation_config(special_ids: dict[str, int | None]) -> dict:
    import transformers

    config = {f"{k}_token_id": v for k, v in special_ids.items() if k != "unk" and v is not None}
    config["transformers_version"] = transformers.__version__
    return config


def _copy_remote_code(folder: Path, config: RunConfig) -> None:
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, folder / name)
    # verbatim: the exported model and the Megatron layers share this one file
    shutil.copyfile(Path(plain_math.__file__), folder / EXPORTED_MATH_FILE)
    (folder / VARIANT_FILE).write_text(variant_source(config))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# --- from a run's checkpoint --------------------------------------------------------------


def find_checkpoint_config(checkpoint_dir: Path) -> Path:
    """``config.yaml`` in the checkpoint folder, or beside it (``checkpoints/``, run dir)."""
    for folder in (checkpoint_dir, checkpoint_dir.parent, checkpoint_dir.parent.parent):
        if (folder / CONFIG).is_file():
            return folder / CONFIG
    raise ConversionError(
        f"'{checkpoint_dir}': no {CONFIG} in it or its run folder; a checkpoint is "
        "exported with the resolved config its run saved"
    )


def resolve_checkpoint_dir(path: Path) -> Path:
    """A complete checkpoint folder: ``iter_XXXXXXX/`` itself, or, in a ``checkpoints/``
    folder or a run folder, the newest one whose weights verify (a note on stderr names it
    when newer ones do not); refuses anything else with the reason."""
    if not path.is_dir():
        raise ConversionError(f"checkpoint '{path}' is not a folder")
    if (path / MANIFEST).is_file() and not path.name.endswith(".tmp"):
        return path
    for checkpoints in (path, path / CHECKPOINTS):
        if latest_name(checkpoints) is not None or iterations(checkpoints):
            return newest_verifying(checkpoints)
    names = sorted(p.name for p in path.iterdir())
    if path.name.endswith(".tmp") or "model" in names or any(n.endswith(".distcp") for n in names):
        raise ConversionError(
            f"checkpoint '{path}' is half-written: it has no {MANIFEST}, which is written "
            "last; export an earlier, complete iteration"
        )
    raise ConversionError(f"'{path}' is not a run checkpoint: no {MANIFEST} or {LATEST}")


def newest_verifying(checkpoints: Path) -> Path:
    """The newest ``iter_*`` folder in ``checkpoints`` whose weights verify (the optimizer's
    files do not matter to an export), as a resume would choose it."""
    refused = []
    for folder in reversed(iterations(checkpoints)):
        try:
            verify(folder, parts=WEIGHT_PARTS)
        except CheckpointError as error:
            refused.append(f"{folder.name}: {error}")
            continue
        if refused:
            print(
                f"note: exporting {folder.name}, the newest checkpoint in {checkpoints} whose "
                f"weights verify; newer ones do not: {'; '.join(refused)}",
                file=sys.stderr,
            )
        return folder
    name = latest_name(checkpoints)
    if not refused and name is not None:
        raise ConversionError(
            f"'{checkpoints / LATEST}' names '{name}', which does not exist; "
            "pass an iteration folder instead"
        )
    raise ConversionError(
        f"none of the {len(refused)} checkpoint(s) in {checkpoints} has weights that verify, "
        "so nothing was exported: " + "; ".join(refused)
    )


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, **options) -> Path:
    """Export a run's checkpoint (``run_dir/checkpoints/iter_XXXXXXX``, or the run's or
    its ``checkpoints/`` folder for the newest one whose weights verify), saved under any
    TP/PP layout.

    ``options`` are those of ``export_state_dict``; the iteration is taken from the
    folder name when not given.
    """
    given = Path(checkpoint_dir)
    check_target(Path(out_dir), options.get("overwrite", False), inputs=[given])
    checkpoint_dir = resolve_checkpoint_dir(given)
    config_path = find_checkpoint_config(checkpoint_dir)
    try:
        config = load_config(config_path)
    except ConfigError as error:
        raise ConversionError(f"{config_path}: {error}") from error
    if options.get("iteration") is None and checkpoint_dir.name.startswith("iter_"):
        suffix = checkpoint_dir.name[len("iter_") :]
        options["iteration"] = int(suffix) if suffix.isdigit() else None
    options["inputs"] = [given, checkpoint_dir, config_path.parent]
    state = read_full_state_dict(checkpoint_dir, config, str(config_path))
    return export_state_dict(state, config, out_dir, **options)
